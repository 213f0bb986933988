"""smoke: import, server-args and tree-builder checks with the host's Python (see ../smoke.py)."""

from __future__ import annotations

from ..smoke import op_smoke


def run(args: dict) -> dict:
    return op_smoke(args)

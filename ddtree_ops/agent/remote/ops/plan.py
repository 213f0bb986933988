"""plan: dry run of a push from an inline manifest; changes nothing (see ../install.py)."""

from __future__ import annotations

from ..install import op_plan


def run(args: dict) -> dict:
    return op_plan(args)

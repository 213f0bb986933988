"""history: state.json and the audit log tail (see ../state.py)."""

from __future__ import annotations

from ..state import op_history


def run(args: dict) -> dict:
    return op_history(args)

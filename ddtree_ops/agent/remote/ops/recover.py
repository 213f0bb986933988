"""recover: finish an interrupted install or rollback (see ../journal.py)."""

from __future__ import annotations

from ..journal import op_recover


def run(args: dict) -> dict:
    return op_recover(args)

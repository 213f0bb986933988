"""rollback: restore a previous release or pristine from backups (see ../rollback.py)."""

from __future__ import annotations

from ..rollback import op_rollback


def run(args: dict) -> dict:
    return op_rollback(args)

"""lock_status: who holds the host lock, and whether it is stale (see ../lock.py)."""

from __future__ import annotations

from ..lock import op_lock_status


def run(args: dict) -> dict:
    return op_lock_status(args)

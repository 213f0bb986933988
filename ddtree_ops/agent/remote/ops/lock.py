"""lock: take the host lock; answers the lock_id later calls pass (see ../lock.py)."""

from __future__ import annotations

from ..lock import op_lock


def run(args: dict) -> dict:
    return op_lock(args)

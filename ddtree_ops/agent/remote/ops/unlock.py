"""unlock: release the host lock by lock_id, or break it with force (see ../lock.py)."""

from __future__ import annotations

from ..lock import op_unlock


def run(args: dict) -> dict:
    return op_unlock(args)

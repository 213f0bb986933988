"""Layout of the on-host state directory, and tolerant readers for what facts reports.

    <state_dir>/state.json          {"current": release id | null, "previous": ..., "mode": ..., ...}
    <state_dir>/lock/owner.json     who holds the lock: {"who", "command", "pid", "start", "ttl_s", ...}
    <state_dir>/journal.json        present only while an install or rollback is in flight
    <state_dir>/releases/<id>/      bundle, manifest, backups

The ops that write these (lock, install, rollback, state) own their semantics and the file
names; this module builds the paths facts reads from those same names.
"""

from __future__ import annotations

import json
import os

from .lock import LOCK_DIR, OWNER
from .state import STATE
from .statefs import MAX_STATE_FILE


def state_file(state_dir: str) -> str:
    return os.path.join(state_dir, STATE)


def lock_dir(state_dir: str) -> str:
    return os.path.join(state_dir, LOCK_DIR)


def lock_owner_file(state_dir: str) -> str:
    return os.path.join(lock_dir(state_dir), OWNER)


def read_json_file(path: str):
    """(value, problem): value is None when the file is absent; problem names a corrupt file."""
    try:
        # Never through a link (it could point anywhere), never blocking on a planted fifo.
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
            return json.loads(f.read(MAX_STATE_FILE).decode("utf-8")), None
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        return None, f"{path}: unreadable ({exc})"

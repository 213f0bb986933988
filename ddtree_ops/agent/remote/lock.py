"""The host lock: one mutating ddtree-ops run per host at a time (stdlib only).

The lock is the directory `<state_dir>/lock/` (mkdir is atomic) with `owner.json` inside.
It outlives the agent process on purpose: the control side takes it once and then makes
several agent calls (stage, install, record) under its `lock_id`, and releases it in a
`finally`. Because a crashed control side cannot release it, a lock is *stale* when
  - its heartbeat is older than its TTL (every call made under the lock refreshes it), or
  - its owner ran on this very host and that pid is gone (local callers, tests).
Deciding "stale" and breaking it happens under a short flock on `.lock.guard` so two
waiters can never both break the same lock and then both take it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from .atomic import AgentError, is_enospc, read_json, write_json_atomic

LOCK_DIR = "lock"
OWNER = "owner.json"
DEFAULT_TTL_S = 900.0
# A lock dir without owner.json is one being created right now; only after this long
# do we believe its creator died between mkdir and writing owner.json.
UNOWNED_GRACE_S = 30.0
POLL_S = 0.2


def _lock_path(state_dir: Path) -> Path:
    return state_dir / LOCK_DIR


@contextlib.contextmanager
def _guard(state_dir: Path) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / ".lock.guard", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder(state_dir: str | os.PathLike[str]) -> dict | None:
    """The current owner record (with `stale` and `stale_reason`), or None when unlocked."""
    state_dir = Path(state_dir)
    lock = _lock_path(state_dir)
    if not lock.is_dir():
        return None
    owner = read_json(lock / OWNER)
    if not isinstance(owner, dict):
        age = time.time() - lock.stat().st_mtime
        stale = age > UNOWNED_GRACE_S
        return {"who": "?", "command": "?", "host": "?", "pid": None, "lock_id": None,
                "stale": stale, "stale_reason": "lock dir without owner.json" if stale else ""}
    now = time.time()
    beat = float(owner.get("heartbeat", owner.get("start_epoch", 0)))
    ttl = float(owner.get("ttl_s", DEFAULT_TTL_S))
    reason = ""
    if now > beat + ttl:
        reason = f"TTL of {ttl:.0f}s expired {now - beat - ttl:.0f}s ago"
    elif owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int) \
            and not _pid_alive(owner["pid"]):
        reason = f"owner pid {owner['pid']} on this host is gone"
    return {**owner, "stale": bool(reason), "stale_reason": reason}


def describe(owner: dict) -> str:
    return (f"{owner.get('who', '?')} ({owner.get('command', '?')}) from {owner.get('host', '?')} "
            f"pid {owner.get('pid', '?')} since {owner.get('start', '?')}")


def _break(state_dir: Path) -> None:
    lock = _lock_path(state_dir)
    # Rename first so a half-removed lock is never mistaken for a live one.
    grave = state_dir / f".lock.broken.{secrets.token_hex(4)}"
    os.rename(lock, grave)
    shutil.rmtree(grave, ignore_errors=True)


def _try_take(state_dir: Path, owner: dict) -> bool:
    lock = _lock_path(state_dir)
    with _guard(state_dir):
        current = holder(state_dir)
        if current is not None:
            if not current["stale"]:
                return False
            _break(state_dir)
        try:
            os.mkdir(lock, 0o700)
        except FileExistsError:
            return False
        try:
            write_json_atomic(lock / OWNER, owner)
        except OSError as exc:
            shutil.rmtree(lock, ignore_errors=True)
            if is_enospc(exc):
                raise AgentError("no_space", f"state dir {state_dir} is full: cannot write the lock owner file",
                                 "free space on the state-dir filesystem; nothing was changed") from exc
            raise
    return True


def acquire(state_dir: str | os.PathLike[str], *, who: str, command: str, host: str | None = None,
            pid: int | None = None, ttl_s: float = DEFAULT_TTL_S, wait_s: float = 0.0) -> dict:
    """Take the lock, waiting up to wait_s; returns the owner record (its lock_id is the key)."""
    state_dir = Path(state_dir)
    now = time.time()
    owner = {
        "who": who, "command": command,
        # pid None: a remote caller's pid means nothing here, so only the TTL can expire it.
        "host": host or socket.gethostname(), "pid": pid,
        "start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), "start_epoch": now,
        "heartbeat": now, "ttl_s": float(ttl_s), "lock_id": secrets.token_hex(8),
    }
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        try:
            if _try_take(state_dir, owner):
                return owner
        except OSError as exc:
            if is_enospc(exc):
                raise AgentError("no_space", f"state dir {state_dir} is full", "free space there") from exc
            raise
        if time.monotonic() >= deadline:
            current = holder(state_dir) or {}
            raise AgentError(
                "locked", f"host is locked by {describe(current)}",
                "wait for it to finish (--lock-wait SECONDS), or if it is dead: ddtree-ops unlock -i INVENTORY HOST",
                holder={k: current.get(k) for k in ("who", "command", "host", "pid", "start", "ttl_s")},
            )
        time.sleep(POLL_S)


def check(state_dir: str | os.PathLike[str], lock_id: str) -> None:
    """Raise unless the lock is held under lock_id; refresh its heartbeat (best effort)."""
    state_dir = Path(state_dir)
    current = holder(state_dir)
    if current is None or current.get("lock_id") != lock_id:
        who = describe(current) if current else "nobody"
        raise AgentError("lock_lost", f"this run does not hold the host lock (held by {who})",
                         "someone broke the lock; re-run the command")
    owner = {k: v for k, v in current.items() if k not in ("stale", "stale_reason")}
    owner["heartbeat"] = time.time()
    # A full disk must not fail the operation here: the heartbeat only extends the TTL.
    with contextlib.suppress(OSError):
        write_json_atomic(_lock_path(state_dir) / OWNER, owner)


def release(state_dir: str | os.PathLike[str], lock_id: str | None, *, force: bool = False) -> dict:
    """Remove the lock if lock_id owns it (or force). Returns {"released": bool, "holder": ...}."""
    state_dir = Path(state_dir)
    with _guard(state_dir):
        current = holder(state_dir)
        if current is None:
            return {"released": False, "holder": None}
        if not force and current.get("lock_id") != lock_id:
            return {"released": False, "holder": current}
        try:
            _break(state_dir)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
        return {"released": True, "holder": current}


@contextlib.contextmanager
def held(state_dir: str | os.PathLike[str], lock_id: str | None, *, who: str, command: str,
         wait_s: float = 0.0) -> Iterator[str]:
    """Run a block under the lock: reuse the caller's lock_id, or take and release our own."""
    if lock_id:
        check(state_dir, lock_id)
        yield lock_id
        return
    owner = acquire(state_dir, who=who, command=command, wait_s=wait_s, pid=os.getpid())
    try:
        yield owner["lock_id"]
    finally:
        release(state_dir, owner["lock_id"])


def op_lock(request: dict) -> dict:
    owner = acquire(request["state_dir"], who=str(request.get("who", "?")),
                    command=str(request.get("command", "?")), host=request.get("host"),
                    pid=request.get("pid"), ttl_s=float(request.get("ttl_s", DEFAULT_TTL_S)),
                    wait_s=float(request.get("wait_s", 0.0)))
    return {"lock": owner, "lock_id": owner["lock_id"]}


def op_unlock(request: dict) -> dict:
    return release(request["state_dir"], request.get("lock_id"), force=bool(request.get("force")))


def op_lock_status(request: dict) -> dict:
    return {"holder": holder(request["state_dir"])}

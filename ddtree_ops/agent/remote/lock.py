"""The host lock: one mutating ddtree-ops run per host at a time (stdlib only).

The lock is the directory `<state_dir>/lock/` (mkdir is atomic) with `owner.json` inside.
It outlives the agent process on purpose: the control side takes it once and then makes
several agent calls (stage, install, record) under its `lock_id`, and releases it in a
`finally`. While it holds the lock the control side sends a heartbeat every fraction of the TTL
(and every call made under the lock refreshes it too), so the TTL only has to cover a missed beat
or two, never the longest wait of a run. Because a crashed control side cannot release it, a lock
is *stale* when
  - its heartbeat is older than its TTL and no agent op of its run is still executing on this host
    (an op registers itself in `ops` while it runs: a control side that gave up waiting must not
    let a second run in while the first run's op carries on), or
  - it was taken by an agent process itself (an install or rollback called without a lock_id)
    and that very process is gone: same boot id, same pid *and* same process start time, read
    from /proc. The control side's host name and pid are recorded for people only and never
    checked: a control machine may share the target's host name (a host deploying to itself,
    containers), and its pid means nothing on the target, so checking it would let a second run
    take a live lock. Each lock is identified by its random lock_id and the caller's run_id.
Deciding "stale" and breaking it happens under a short flock on `.lock.guard` so two
waiters can never both break the same lock and then both take it. A damaged owner.json is
never stale by itself (it may belong to a live run): `unlock` shows it and clears it.
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
from collections.abc import Callable, Iterator
from pathlib import Path

from . import statefs
from .atomic import AgentError, fsync_dir, is_enospc, write_json_atomic

LOCK_DIR = "lock"
OWNER = "owner.json"
# Short on purpose: a live run renews it by heartbeat, so it only bounds how long a dead run's
# lock keeps others out.
DEFAULT_TTL_S = 120.0
# A lock dir without owner.json is one being created right now; only after this long
# do we believe its creator died between mkdir and writing owner.json.
UNOWNED_GRACE_S = 30.0
POLL_S = 0.2


def _lock_path(state_dir: Path) -> Path:
    return state_dir / LOCK_DIR


@contextlib.contextmanager
def _guard(state_dir: Path) -> Iterator[None]:
    fd = os.open(state_dir / ".lock.guard", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _boot_id() -> str | None:
    text = _read("/proc/sys/kernel/random/boot_id")
    return text.strip() if text else None


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None when gone."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = text.rsplit(")", 1)[-1].split()
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def this_process() -> dict:
    """What makes this agent process unique on this host for as long as it lives."""
    return {"boot_id": _boot_id(), "pid": os.getpid(), "start_ticks": _start_ticks(os.getpid())}


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def control_process() -> dict:
    """The control-side run as its own machine knows it (the pid namespace too: containers on one
    kernel share a boot id but not their pids)."""
    return {**this_process(), "pid_ns": _pid_namespace()}


def died_here(proc: dict) -> bool:
    """True only when `proc` (a `control_process()` record) ran in this boot and pid namespace and is
    gone; False when it is alive or when this machine cannot tell (another machine, no /proc)."""
    if proc.get("boot_id") is None or proc.get("start_ticks") is None or proc.get("pid_ns") is None:
        return False
    if proc["boot_id"] != _boot_id() or proc["pid_ns"] != _pid_namespace():
        return False
    return _start_ticks(proc["pid"]) != proc["start_ticks"]


def _process_gone(proc: dict) -> bool:
    if proc.get("boot_id") is None or proc.get("start_ticks") is None:
        return False  # no /proc where it was taken: only the TTL can tell
    return proc["boot_id"] != _boot_id() or _start_ticks(proc["pid"]) != proc["start_ticks"]


_NUMBER = (int, float)
# owner.json field -> accepted types; a record that does not match is damaged, never guessed at.
OWNER_FIELDS: dict[str, tuple[type, ...]] = {
    "who": (str,), "command": (str,), "lock_id": (str,), "run_id": (str,), "start": (str,),
    "start_epoch": _NUMBER, "heartbeat": _NUMBER, "ttl_s": _NUMBER,
    "host": (str, type(None)), "pid": (int, type(None)), "agent_process": (dict, type(None)),
}


def _process_problem(proc: object) -> bool:
    return proc is not None and not (
        isinstance(proc, dict) and isinstance(proc.get("pid"), int) and not isinstance(proc.get("pid"), bool)
        and isinstance(proc.get("boot_id"), (str, type(None))) and isinstance(proc.get("start_ticks"), (int, type(None))))


def _owner_problem(owner: object) -> str | None:
    if not isinstance(owner, dict):
        return f"is a JSON {type(owner).__name__}, not an object"
    for key, types in OWNER_FIELDS.items():
        if key not in owner:
            return f"lacks `{key}`"
        if not isinstance(owner[key], types) or isinstance(owner[key], bool):
            return f"`{key}` is a {type(owner[key]).__name__}"
    # control_process (optional: locks taken before it existed lack it) is the control-side run.
    for key in ("agent_process", "control_process"):
        if _process_problem(owner.get(key)):
            return f"`{key}` is not {{boot_id, pid, start_ticks}}"
    ops = owner.get("ops", [])
    if not isinstance(ops, list) or any(_process_problem(op) or op is None or not isinstance(op.get("op"), str)
                                        for op in ops):
        return "`ops` is not a list of {op, boot_id, pid, start_ticks}"
    return None


def live_ops(owner: dict) -> list[dict]:
    """The agent ops of the holder's run still executing on this host."""
    return [op for op in owner.get("ops") or [] if not _process_gone(op)]


def _unknown_holder(problem: str, stale: bool = False) -> dict:
    return {"who": "?", "command": "?", "host": None, "pid": None, "lock_id": None, "run_id": None,
            "damaged": problem, "stale": stale, "stale_reason": problem if stale else ""}


def holder(state_dir: str | os.PathLike[str]) -> dict | None:
    """The current owner record (with `stale` and `stale_reason`, and `damaged` when the lock's files
    are not what the agent writes), or None when unlocked."""
    state_dir = Path(state_dir)
    lock = _lock_path(state_dir)
    try:
        st = os.lstat(lock)
    except FileNotFoundError:
        return None
    if not os.path.isdir(lock) or os.path.islink(lock):
        return _unknown_holder(f"{lock} is not a directory the agent made (a link or a file)")
    path = lock / OWNER
    try:
        owner = statefs.read_json(path, "the lock owner file", statefs.REPAIR_UNLOCK)
    except FileNotFoundError:
        stale = time.time() - st.st_mtime > UNOWNED_GRACE_S
        return {**_unknown_holder(""), "damaged": None, "stale": stale,
                "stale_reason": "lock dir without owner.json" if stale else ""}
    except AgentError as exc:
        return _unknown_holder(exc.message)
    problem = _owner_problem(owner)
    if problem:
        return _unknown_holder(f"{path}: the lock owner file {problem}")
    assert isinstance(owner, dict)
    now = time.time()
    beat, ttl = float(owner["heartbeat"]), float(owner["ttl_s"])
    reason = ""
    if now > beat + ttl and not live_ops(owner):
        reason = f"no heartbeat for {now - beat:.0f}s (TTL {ttl:.0f}s)"
    elif owner["agent_process"] is not None and _process_gone(owner["agent_process"]):
        reason = f"the agent process {owner['agent_process']['pid']} that took it on this host is gone"
    return {**owner, "damaged": None, "stale": bool(reason), "stale_reason": reason}


def describe(owner: dict) -> str:
    if owner.get("damaged"):
        return f"an unknown holder ({owner['damaged']})"
    return (f"{owner.get('who', '?')} ({owner.get('command', '?')}) from {owner.get('host', '?')} "
            f"run {owner.get('run_id', '?')} since {owner.get('start', '?')}")


def _break(state_dir: Path) -> None:
    lock = _lock_path(state_dir)
    if os.path.islink(lock) or not os.path.isdir(lock):
        os.unlink(lock)  # the entry itself, never what a link points at
        fsync_dir(state_dir)
        return
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
            pid: int | None = None, run_id: str | None = None, ttl_s: float = DEFAULT_TTL_S, wait_s: float = 0.0,
            agent_process: dict | None = None, control_process: dict | None = None) -> dict:
    """Take the lock, waiting up to wait_s; returns the owner record (its lock_id is the key).

    host / pid: the caller's, shown to people only. agent_process: set when this agent process
    itself is the holder, so the lock dies with it. control_process: the control-side run's own
    {boot_id, pid, start_ticks}, recorded so that a later run on that same machine can tell that the
    holder died (only there does that pid mean anything); the agent never judges it."""
    state_dir = Path(state_dir)
    now = time.time()
    owner = {
        "who": who, "command": command, "host": host, "pid": pid, "run_id": run_id or secrets.token_hex(8),
        "start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), "start_epoch": now,
        "heartbeat": now, "ttl_s": float(ttl_s), "lock_id": secrets.token_hex(8), "agent_process": agent_process,
    }
    if control_process is not None:
        owner["control_process"] = control_process
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
            hint = ("wait for it to finish (--lock-wait SECONDS), or if it is dead: ddtree-ops unlock -i INVENTORY HOST"
                    if not current.get("damaged") else f"repair: {statefs.REPAIR_UNLOCK}")
            raise AgentError(
                "locked", f"host is locked by {describe(current)}", hint,
                holder={k: current.get(k) for k in ("who", "command", "host", "run_id", "start", "ttl_s", "damaged",
                                                    "control_process")},
            )
        time.sleep(POLL_S)


def _rewrite_owner(state_dir: Path, lock_id: str, change: Callable[[dict], None]) -> dict:
    """Under the guard: raise unless lock_id holds the lock; refresh its heartbeat and apply change."""
    with _guard(state_dir):
        current = holder(state_dir)
        if current is None or current.get("lock_id") != lock_id:
            who = describe(current) if current else "nobody"
            raise AgentError("lock_lost", f"this run does not hold the host lock (held by {who})",
                             "someone broke the lock; re-run the command")
        owner = {k: v for k, v in current.items() if k not in ("stale", "stale_reason", "damaged")}
        owner["heartbeat"] = time.time()
        change(owner)
        # A full disk must not fail the operation here: the heartbeat only extends the TTL.
        with contextlib.suppress(OSError):
            write_json_atomic(_lock_path(state_dir) / OWNER, owner)
        return owner


def check(state_dir: str | os.PathLike[str], lock_id: str) -> dict:
    """Raise unless the lock is held under lock_id; refresh its heartbeat (best effort)."""
    return _rewrite_owner(Path(state_dir), lock_id, lambda owner: None)


def _register(state_dir: Path, lock_id: str, op: str) -> dict:
    me = {**this_process(), "op": op}
    _rewrite_owner(state_dir, lock_id, lambda owner: owner.setdefault("ops", []).append(me))
    return me


def _unregister(state_dir: Path, lock_id: str, me: dict) -> None:
    def drop(owner: dict) -> None:
        # Also forget ops whose process is gone (a killed agent never unregisters itself).
        owner["ops"] = [op for op in owner.get("ops") or [] if op != me and not _process_gone(op)]

    # The lock may have been broken meanwhile (unlock of a dead run): nothing left to unregister.
    with contextlib.suppress(AgentError):
        _rewrite_owner(state_dir, lock_id, drop)


def release(state_dir: str | os.PathLike[str], lock_id: str | None, *, force: bool = False,
            run_id: str | None = None) -> dict:
    """Remove the lock if lock_id owns it, or if run_id is its run (a dead run's lock, broken by a
    later run of the same control machine), or force. Returns {"released": bool, "holder": ...}."""
    state_dir = Path(state_dir)
    with _guard(state_dir):
        current = holder(state_dir)
        if current is None:
            return {"released": False, "holder": None}
        mine = current.get("lock_id") == lock_id if lock_id else bool(run_id) and current.get("run_id") == run_id
        if not force and not mine:
            return {"released": False, "holder": current}
        busy = live_ops(current) if not current.get("damaged") else []
        if busy:
            # An op of the holder's run still changes this host: the lock stays until it ends (and
            # then expires with the TTL), so no second run starts beside it.
            return {"released": False, "holder": current, "busy": busy}
        try:
            _break(state_dir)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
        return {"released": True, "holder": current}


@contextlib.contextmanager
def held(state_dir: str | os.PathLike[str], lock_id: str | None, *, who: str, command: str,
         wait_s: float = 0.0) -> Iterator[str]:
    """Run a block under the lock: reuse the caller's lock_id (registering this op as running under
    it, so the lock cannot go stale or be released while it runs), or take and release our own."""
    if lock_id:
        me = _register(Path(state_dir), lock_id, command)
        try:
            yield lock_id
        finally:
            _unregister(Path(state_dir), lock_id, me)
        return
    owner = acquire(state_dir, who=who, command=command, wait_s=wait_s, host=socket.gethostname(), pid=os.getpid(),
                    agent_process=this_process())
    try:
        yield owner["lock_id"]
    finally:
        release(state_dir, owner["lock_id"])


def op_lock(request: dict) -> dict:
    host, pid, run_id = request.get("host"), request.get("pid"), request.get("run_id")
    control = request.get("control_process")
    if _process_problem(control):
        raise AgentError("bad_request", "control_process must be {boot_id, pid, start_ticks}", "a ddtree-ops bug")
    owner = acquire(statefs.state_dir(request), who=str(request.get("who", "?")), control_process=control,
                    command=str(request.get("command", "?")), host=host if isinstance(host, str) else None,
                    pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                    run_id=run_id if isinstance(run_id, str) else None,
                    ttl_s=float(request.get("ttl_s", DEFAULT_TTL_S)), wait_s=float(request.get("wait_s", 0.0)))
    return {"lock": owner, "lock_id": owner["lock_id"]}


def op_unlock(request: dict) -> dict:
    """Release by lock_id (or by run_id: a dead run's lock); with force (the `unlock` command) break a
    lock that is stale or damaged, or whose run the control side saw die (`dead_run_id`), and clear
    planted entries first. A lock whose heartbeat is fresh belongs to a live run and is never broken."""
    force = bool(request.get("force"))
    sd = statefs.state_dir(request, scan_tree=not force)
    run_id = request.get("run_id") if isinstance(request.get("run_id"), str) else None
    if force:
        current = holder(sd)
        dead = request.get("dead_run_id")
        if current is not None and not current["stale"] and not current.get("damaged") \
                and not (isinstance(dead, str) and current.get("run_id") == dead):
            age = time.time() - float(current["heartbeat"])
            busy = live_ops(current)
            raise AgentError(
                "lock_alive", f"the lock is held by a live run: {describe(current)}, last heartbeat {age:.0f}s ago"
                + (f", {len(busy)} agent op(s) of it running here" if busy else ""),
                f"wait for that run to finish (a dead run's lock goes stale {float(current['ttl_s']):.0f}s after its "
                f"last heartbeat), or stop it on {current.get('host')} (pid {current.get('pid')})",
                holder={k: current.get(k) for k in ("who", "command", "host", "pid", "run_id", "start")})
    removed = statefs.remove_planted(sd) if force else []
    return {**release(sd, request.get("lock_id"), force=force, run_id=run_id), "removed": removed}


def op_lock_status(request: dict) -> dict:
    """Who holds the lock, and every problem `unlock` would repair (read-only, never refuses on damage)."""
    from . import repair

    sd = statefs.state_dir(request, create=False, scan_tree=False)
    return {"holder": holder(sd) if sd.is_dir() else None, "problems": repair.diagnose(sd)}

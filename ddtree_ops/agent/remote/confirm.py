"""Commit-confirmed promote stages: the deadline and the watchdog that enforces it (stdlib only).

A stage is installed with a confirm deadline (Junos `commit confirmed`): unless the control side
confirms it in time (unit_commit), the host puts its previous unit back by itself. The control
side renews the deadline by heartbeat while its gates run, up to a hard limit fixed at install
(restart plus every gate's bound), so a control side that dies, hangs in a way its own deadlines
miss, or loses the network can never leave an unconfirmed unit serving.

The deadline lives in the unit journal (`confirm`), on CLOCK_BOOTTIME (wall-clock jumps cannot
move it; a reboot makes it expired). The watchdog is a transient systemd service started with
`systemd-run` before the journal and the new unit are written: PID 1 owns it, so neither the SSH session's end nor
the agent's death stops it, and it restarts if killed. It runs this same agent (`unit_watch`),
fed from a file written here: its sources and its request.

Who acts on a journal (the watchdog undoing it, a commit, a renewal, another run's recovery)
takes `.confirm.guard` (flock) first, so a commit and an expiry can never both happen.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from . import bootstrap
from .atomic import AgentError, remove_durably, write_bytes_atomic

GUARD = ".confirm.guard"
# The watchdog starts before its stage's journal is written; an install that dies in between wrote
# nothing, and the watchdog gives up waiting for the journal after this long.
JOURNAL_GRACE_S = 10.0
WATCH_DIR = "watch"
UNIT_PREFIX = "ddtree-ops-confirm-"
_UNIT_SAFE = re.compile(r"[^A-Za-z0-9:_.-]")


def now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


@contextlib.contextmanager
def guard(sd: Path) -> Iterator[None]:
    fd = os.open(sd / GUARD, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def arm(window_s: float, hard_s: float) -> dict:
    """The confirm record of a stage installed now: window_s until it expires unless renewed, and
    never renewed past hard_s from now."""
    if not 1 <= window_s <= hard_s:
        raise AgentError("bad_request", f"confirm window {window_s!r}s must be ≥ 1 and ≤ the hard limit {hard_s!r}s")
    t = now()
    return {"boot_id": _boot_id(), "window_s": window_s, "deadline": t + window_s, "hard": t + hard_s}


def problem(confirm: object) -> str | None:
    if not isinstance(confirm, dict) or not all(isinstance(confirm.get(k), int | float)
                                                for k in ("deadline", "hard", "window_s")):
        return "the journal's confirm record is missing or damaged"
    return None


def expired(confirm: object) -> str | None:
    """Why the stage's deadline has passed, or None while it holds."""
    if problem(confirm):
        return problem(confirm)
    assert isinstance(confirm, dict)
    if confirm.get("boot_id") != _boot_id():
        return "the host rebooted since the stage was installed"
    if now() >= confirm["deadline"]:
        return f"not confirmed within its deadline ({confirm['window_s']:.0f}s after the last renewal)"
    return None


def remaining_s(confirm: dict) -> float:
    return round(confirm["deadline"] - now(), 1)


def renewed(confirm: dict, extend_s: float, *, past_hard: bool = False) -> dict:
    """The record with its deadline moved to extend_s from now, capped at the hard limit (a pause
    may go past it, once, on the operator's word)."""
    deadline = now() + max(0.0, float(extend_s))
    if not past_hard:
        deadline = min(deadline, confirm["hard"])
    return {**confirm, "deadline": max(confirm["deadline"], deadline)}


# ---------------------------------------------------------------- the watchdog


def unit_name(unit_id: str) -> str:
    return UNIT_PREFIX + _UNIT_SAFE.sub("_", unit_id) + ".service"


def _input_path(sd: Path, unit_id: str) -> Path:
    return sd / WATCH_DIR / f"{_UNIT_SAFE.sub('_', unit_id)}.in"


def start_watchdog(sd: Path, unit_id: str, service: str) -> str:
    """Start the transient service that undoes the stage at its deadline; raises if systemd refuses."""
    watch = sd / WATCH_DIR
    watch.mkdir(mode=0o700, exist_ok=True)
    request = {"op": "unit_watch", "args": {"state_dir": str(sd), "unit_id": unit_id}}
    feed = _input_path(sd, unit_id)
    write_bytes_atomic(feed, bootstrap.payload_line(bootstrap.running_sources())
                       + json.dumps(request).encode() + b"\n", mode=0o600)
    name = unit_name(unit_id)
    argv = ["systemd-run", "--quiet", "--collect", f"--unit={name}",
            f"--description=ddtree-ops: put the previous {service} unit back unless stage {unit_id} is confirmed",
            f"--property=StandardInput=file:{feed}", "--property=StandardOutput=journal",
            "--property=Restart=on-failure", "--property=RestartSec=1",
            "--", sys.executable, "-I", "-c", bootstrap.LINE]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        remove_durably(feed)
        raise AgentError("watchdog_failed", f"cannot start the confirm watchdog: {exc}",
                         "promote needs systemd-run on the host; nothing was installed") from None
    if proc.returncode != 0:
        remove_durably(feed)
        raise AgentError("watchdog_failed", f"systemd-run refused the confirm watchdog: {proc.stderr.strip()[-500:]}",
                         "nothing was installed")
    return name


def finish_watchdog(sd: Path, unit_id: str) -> None:
    """The watchdog's own clean-up once its stage is settled (its input holds no secret, only code)."""
    remove_durably(_input_path(sd, unit_id))


def prune_inputs(sd: Path, keep: str | None) -> None:
    """Inputs of watchdogs whose stage is settled (a watchdog killed for good leaves its own)."""
    with contextlib.suppress(FileNotFoundError):
        for entry in (sd / WATCH_DIR).iterdir():
            if keep is None or entry.name != _input_path(sd, keep).name:
                remove_durably(entry)

"""The state directory as the agent reaches it: absolute, private, and never through a link (stdlib only).

Every op that touches the state dir gets it from `state_dir(request)`, which
  - requires an absolute, normalised path (a relative one would land under the agent's cwd);
  - refuses a state dir that is a symlink, not a directory, not owned by the agent's user, or
    writable by group or others (whoever can write there can plant links or swap backups);
  - walks the whole tree with lstat and refuses any symlink, fifo, socket or device in it and any
    directory others can write. The agent creates none of those, so one that is there was planted,
    and following it would redirect a write (or empty a directory) outside the state dir.
The tree is small (a few releases of a few files), so one walk per call costs milliseconds.
State files are read with O_NOFOLLOW on top, so a link planted after the walk is refused too.

A damaged or planted file is reported by `damaged()`: its path, what is wrong and the command
that repairs it. `unlock` is the repair for what it can clear (links, lock, a journal whose
change is not in effect); `rollback --to pristine` rebuilds from the pristine store.
"""

from __future__ import annotations

import json
import os
import posixpath
import stat
from pathlib import Path

from .atomic import AgentError

# The repair commands every refusal names (the CLI spells HOST; see README "Repairing a host").
REPAIR_UNLOCK = "ddtree-ops unlock HOST (shows what it found, then clears it)"
REPAIR_PRISTINE = ("ddtree-ops rollback --to pristine HOST (restores every file ddtree-ops touched from the "
                   "pristine store, checked against the wheel's hashes, and starts a new state.json), then push again")
# State files are small JSON; a bigger one is damage (or an attempt to make the agent read a disk image).
MAX_STATE_FILE = 16 * 1024 * 1024


def damaged(path: str | os.PathLike[str], problem: str, repair: str) -> AgentError:
    return AgentError("state_damaged", f"{path}: {problem}", f"repair: {repair}", path=str(path))


def state_dir(request: dict, *, create: bool = True, scan_tree: bool = True) -> Path:
    """The request's state dir, checked (and created 0700 when absent); with scan_tree every entry
    in it lstat-checked too (the repair ops look at the findings themselves instead)."""
    raw = request.get("state_dir")
    if not isinstance(raw, str) or not raw.startswith("/") or "\0" in raw or posixpath.normpath(raw) != raw.rstrip("/") \
            or raw == "/":
        raise AgentError("bad_request", f"state_dir must be a normalised absolute path, got {raw!r}",
                         "set state_dir in the inventory to an absolute path such as /var/lib/ddtree-ops")
    sd = Path(raw)
    try:
        st = os.lstat(sd)
    except FileNotFoundError:
        if not create:
            return sd
        os.makedirs(sd, mode=0o700, exist_ok=True)
        st = os.lstat(sd)
    _check_dir(sd, st)
    problems = scan(sd) if scan_tree else []
    if problems:
        path, problem, repair = problems[0]
        raise damaged(path, problem + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""), repair)
    return sd


def _check_dir(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise AgentError("state_dir", f"{path}: the state dir is a symbolic link; the agent never follows one",
                         "point state_dir in the inventory at the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise AgentError("state_dir", f"{path}: the state dir is not a directory", "set state_dir to a directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise AgentError("state_dir", f"{path}: the state dir is owned by uid {st.st_uid} with mode "
                         f"{st.st_mode & 0o7777:o}; it must belong to uid {os.geteuid()} and be writable by nobody else",
                         f"chown {os.geteuid()} {path} && chmod go-w {path}")


def scan(sd: Path) -> list[tuple[str, str, str]]:
    """(path, problem, repair) for every entry under sd the agent cannot have made."""
    found: list[tuple[str, str, str]] = []
    for top, dirs, files in os.walk(sd):
        for name in dirs + files:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                # Gone between listing and lstat: a concurrent op's temp file renamed into place
                # (state.json, owner.json) or a broken lock's grave removed. Nothing to refuse.
                continue
            if stat.S_ISLNK(st.st_mode):
                found.append((path, f"is a symbolic link (to {os.readlink(path)!r}) that ddtree-ops did not make; "
                                    "it is never followed", REPAIR_UNLOCK))
            elif stat.S_ISDIR(st.st_mode):
                if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                    found.append((path, f"directory owned by uid {st.st_uid} with mode {st.st_mode & 0o7777:o} "
                                        "(others could plant files in it)", f"chown {os.geteuid()} {path} && chmod go-w {path}"))
            elif not stat.S_ISREG(st.st_mode):
                found.append((path, "is not a regular file (fifo, socket or device)", REPAIR_UNLOCK))
        # os.walk does not descend into links to directories, so nothing outside sd is listed.
    return found


def remove_planted(sd: Path) -> list[dict]:
    """The repair for planted entries: unlink links and special files (never their targets)."""
    removed = []
    for path, problem, _ in scan(sd):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            os.unlink(path)
            removed.append({"path": path, "found": problem, "action": "removed the entry (its target untouched)"})
    return removed


def read_json(path: str | os.PathLike[str], what: str, repair: str) -> object:
    """A state file's JSON, never through a link; FileNotFoundError when absent, damaged() when unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise damaged(path, f"{what} cannot be opened ({exc.strerror}; a link is never followed)", repair) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise damaged(path, f"{what} is not a regular file", repair)
        if st.st_size > MAX_STATE_FILE:
            raise damaged(path, f"{what} is {st.st_size} bytes, more than any state file can be", repair)
        data = f.read(MAX_STATE_FILE + 1)
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError as exc:
        raise damaged(path, f"{what} is not valid JSON ({exc}; {len(data)} bytes)", repair) from None

"""state.json and audit.log in the host's state directory (stdlib only).

state.json (rewritten atomically, so a reader sees the old or the new file, never half):
    current   release id installed now, or null (pristine)
    previous  the release `rollback --to previous` returns to (the one below current), or null
    stack     release ids in install order; each entry's backup restores the one below it
    mode      DDTree mode of the service (written by promote; kept as is here)
    history   newest last: {time, operator, action, release, from}
Other keys (gate results written by later stages) are preserved untouched.

Every load validates the file against SCHEMA (one validator per key; a later stage adds its keys
there) and the stack's own consistency. A missing state.json is a fresh host only while the
state dir holds no release and no pristine store; otherwise it is damage, reported with the
repair, because reading it as "nothing installed" would make the next push back up patched
files as if they were the originals.

audit.log: one JSON object per line, appended with O_APPEND and fsync:
    {time, operator, command, release, result, ...detail}
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from . import statefs
from .atomic import write_json_atomic
from .layout import PRISTINE, RELEASES, is_release_id

STATE = "state.json"
AUDIT = "audit.log"
HISTORY_KEEP = 500


def _optional_release(v: object) -> str | None:
    return None if v is None or is_release_id(v) else "must be a release id or null"


def _release_list(v: object) -> str | None:
    if not isinstance(v, list) or not all(is_release_id(r) for r in v):
        return "must be a list of release ids"
    return "lists a release twice" if len(set(v)) != len(v) else None


def _optional_str(v: object) -> str | None:
    return None if v is None or isinstance(v, str) else "must be a string or null"


def _object(v: object) -> str | None:
    return None if isinstance(v, dict) else "must be an object"


def _list_of_objects(v: object) -> str | None:
    return None if isinstance(v, list) and all(isinstance(e, dict) for e in v) else "must be a list of objects"


# key -> validator (None when the value is fine, else what is wrong). Keys not listed are kept as is.
SCHEMA: dict[str, Callable[[object], str | None]] = {
    "current": _optional_release,
    "previous": _optional_release,
    "stack": _release_list,
    "mode": _optional_str,
    "history": _list_of_objects,
    "promotion": _object,  # promote's record (units.py): stages, passed modes, last gate result
}
REQUIRED = ("stack", "current", "previous")


def problem_of(raw: object) -> str | None:
    """What is wrong with a state.json value, or None when it is a valid state."""
    if not isinstance(raw, dict):
        return f"is a JSON {type(raw).__name__}, not an object"
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        return f"lacks {', '.join(missing)}"
    for key, check in SCHEMA.items():
        if key in raw and (problem := check(raw[key])):
            return f"`{key}` {problem} (it is a {type(raw[key]).__name__})"
    stack = raw["stack"]
    if raw["current"] != (stack[-1] if stack else None) or raw["previous"] != (stack[-2] if len(stack) > 1 else None):
        return "`current`/`previous` disagree with `stack`"
    return None


def _install_evidence(state_dir: Path) -> str | None:
    """Why a missing state.json cannot mean a fresh host, or None when it can."""
    try:
        kept = sorted(p.name for p in (state_dir / RELEASES).iterdir() if not p.name.startswith("."))
    except FileNotFoundError:
        kept = []
    if kept:
        return f"{state_dir / RELEASES} holds {len(kept)} release(s) ({', '.join(kept[:3])})"
    if (state_dir / PRISTINE).exists():
        return f"{state_dir / PRISTINE} holds pristine copies"
    return None


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def empty() -> dict:
    return {"current": None, "previous": None, "stack": [], "mode": None, "history": []}


def load(state_dir: str | os.PathLike[str]) -> dict:
    """The validated state; raises statefs.damaged() naming the file and the repair."""
    path = Path(state_dir) / STATE
    try:
        raw = statefs.read_json(path, "state.json", statefs.REPAIR_PRISTINE)
    except FileNotFoundError:
        evidence = _install_evidence(Path(state_dir))
        if evidence:
            raise statefs.damaged(path, f"is missing, but {evidence}: which release is installed is lost",
                                  statefs.REPAIR_PRISTINE) from None
        return empty()
    problem = problem_of(raw)
    if problem:
        raise statefs.damaged(path, f"state.json {problem}", statefs.REPAIR_PRISTINE)
    assert isinstance(raw, dict)
    return {**empty(), **raw}


def save(state_dir: str | os.PathLike[str], st: dict) -> None:
    st["history"] = st.get("history", [])[-HISTORY_KEEP:]
    write_json_atomic(Path(state_dir) / STATE, st)


def update(state_dir: str | os.PathLike[str], fn: Callable[[dict], None]) -> dict:
    """Load, let fn mutate, save; callers hold the host lock so there is no lost update."""
    st = load(state_dir)
    fn(st)
    save(state_dir, st)
    return st


def set_stack(st: dict, stack: list[str], *, operator: str, action: str, release: str | None) -> None:
    before = st.get("current")
    st["stack"] = list(stack)
    st["current"] = stack[-1] if stack else None
    st["previous"] = stack[-2] if len(stack) > 1 else None
    st.setdefault("history", []).append(
        {"time": now_iso(), "operator": operator, "action": action, "release": release, "from": before})


def audit(state_dir: str | os.PathLike[str], *, operator: str, command: str, release: str | None,
          result: str, **detail: object) -> None:
    line = {"time": now_iso(), "operator": operator, "command": command, "release": release,
            "result": result, **detail}
    data = (json.dumps(line, sort_keys=True) + "\n").encode()
    path = Path(state_dir) / AUDIT
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o640)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def audit_best_effort(state_dir: str | os.PathLike[str], **kw: object) -> str | None:
    """Append to the audit log; a full disk must not turn a finished change into a failure."""
    try:
        audit(state_dir, **kw)  # type: ignore[arg-type]
    except OSError as exc:
        return f"audit log not written: {exc}"
    return None


def read_audit(state_dir: str | os.PathLike[str], limit: int = 50) -> list[dict]:
    path = Path(state_dir) / AUDIT
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return []
    with os.fdopen(fd, "rb") as f:
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    out = []
    for line in lines[-limit:] if limit else lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            # A line torn by a crash mid-append is shown, not fatal.
            out.append({"unparsable": line[:200]})
    return out


def op_history(request: dict) -> dict:
    state_dir = statefs.state_dir(request)
    st = load(state_dir)
    limit = int(request.get("limit", 50))
    return {"state": {k: st.get(k) for k in ("current", "previous", "stack", "mode")},
            "history": st.get("history", [])[-limit:] if limit else st.get("history", []),
            "audit": read_audit(state_dir, limit)}

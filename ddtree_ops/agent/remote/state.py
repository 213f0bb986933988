"""state.json and audit.log in the host's state directory (stdlib only).

state.json (rewritten atomically, so a reader sees the old or the new file, never half):
    current   release id installed now, or null (pristine)
    previous  the release `rollback --to previous` returns to (the one below current), or null
    stack     release ids in install order; each entry's backup restores the one below it
    mode      DDTree mode of the service (written by promote; kept as is here)
    history   newest last: {time, operator, action, release, from}
Other keys (gate results written by later stages) are preserved untouched.

audit.log: one JSON object per line, appended with O_APPEND and fsync:
    {time, operator, command, release, result, ...detail}
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from .atomic import read_json, write_json_atomic

STATE = "state.json"
AUDIT = "audit.log"
HISTORY_KEEP = 500


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def empty() -> dict:
    return {"current": None, "previous": None, "stack": [], "mode": None, "history": []}


def load(state_dir: str | os.PathLike[str]) -> dict:
    st = read_json(Path(state_dir) / STATE)
    base = empty()
    if isinstance(st, dict):
        base.update(st)
    return base


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
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
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
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines[-limit:] if limit else lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            # A line torn by a crash mid-append is shown, not fatal.
            out.append({"unparsable": line[:200]})
    return out


def op_history(request: dict) -> dict:
    state_dir = request["state_dir"]
    st = load(state_dir)
    limit = int(request.get("limit", 50))
    return {"state": {k: st.get(k) for k in ("current", "previous", "stack", "mode")},
            "history": st.get("history", [])[-limit:] if limit else st.get("history", []),
            "audit": read_audit(state_dir, limit)}

"""The journal that makes a change to site-packages all-or-nothing (stdlib only).

Policy (one rule for install and rollback alike):
  * Everything a change needs — the new bytes (releases/<id>/payload/) and the old bytes
    (releases/<id>/backup/) — is written and fsynced *before* journal.json appears.
  * journal.json lists every file with its before and after sha256 and where each side's
    bytes live. It is written before the first file changes and removed after the last
    file changed and state.json recorded the result.
  * If the process dies (SIGKILL, power loss) with a journal present, the next mutating
    run **rolls it forward**: it finishes the interrupted change (each step is idempotent:
    a file already at its target hash is skipped) and records it. Roll-forward is chosen
    because the operator asked for that change; a `rollback` issued afterwards then undoes
    it like any finished push, so push and rollback both converge.
  * If the change fails *in-process* (disk full, a hash that does not verify), it is
    **undone** right there from the same journal, and the journal removed: the host is
    left exactly as before and the error says why.
Each file is replaced with temp-file + fsync + rename, so a file is always wholly its
before or wholly its after bytes, never torn.
A journal.json that does not validate (truncated, wrong shape, a source outside the state dir)
is refused naming the repair; `unlock` clears it only after checking that no file is mixed
(repair.py), and `rollback --to pristine` supersedes it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from . import state, statefs
from .atomic import (
    AgentError,
    copy_file_atomic,
    is_enospc,
    remove_durably,
    sha256_file,
    write_json_atomic,
)
from .layout import JOURNAL, is_release_id

# Test hook: SIGKILL ourselves after this many files changed (the crash tests' knife).
KILL_ENV = "DDTREE_OPS_TEST_KILL_AFTER_FILES"


def _target(site: Path, rel: str) -> Path:
    return site / rel


def _kill_point(request_hook: int | None) -> int | None:
    raw = os.environ.get(KILL_ENV)
    if raw not in (None, ""):
        return int(raw)
    return request_hook


def _clean_temps(site: Path, steps: list[dict]) -> None:
    """Remove temp files a SIGKILL left beside the targets (never anything else)."""
    for d in {(_target(site, s["rel"])).parent for s in steps}:
        with contextlib.suppress(OSError):
            for p in d.glob(".*.ddtree-tmp"):
                p.unlink()


def apply_steps(site: Path, steps: list[dict], side: str, kill_after: int | None = None) -> list[str]:
    """Bring each file to its `side` ("after" or "before") bytes; returns the rels changed."""
    changed: list[str] = []
    for step in steps:
        path = _target(site, step["rel"])
        want = step[side]
        if sha256_file(path) == want:
            continue
        if want is None:
            remove_durably(path)
        else:
            src = step[f"{side}_src"]
            copy_file_atomic(src, path, mode=step.get("mode"))
            got = sha256_file(path)
            if got != want:
                raise AgentError("verify_failed", f"{step['rel']}: sha256 {got} after writing, expected {want}",
                                 f"the source {src} in the state dir is damaged. "
                                 f"repair: {statefs.REPAIR_PRISTINE}", path=src)
        changed.append(step["rel"])
        if kill_after is not None and len(changed) >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    return changed


def _record(state_dir: Path, jr: dict) -> None:
    st = state.load(state_dir)
    if st.get("stack") == jr["stack_after"]:
        return
    state.set_stack(st, jr["stack_after"], operator=jr["operator"], action=jr["action"], release=jr["release"])
    state.save(state_dir, st)


def run(state_dir: Path, site: Path, jr: dict, kill_after: int | None = None) -> list[str]:
    """Journal, apply, record, un-journal. On any in-process failure undo and re-raise."""
    jr = {**jr, "site_packages": str(site)}
    try:
        write_json_atomic(state_dir / JOURNAL, jr)
    except OSError as exc:
        if is_enospc(exc):
            raise AgentError("no_space", f"state dir {state_dir} is full: cannot write the journal",
                             "free space on the state-dir filesystem; site-packages was not touched") from exc
        raise
    try:
        changed = apply_steps(site, jr["steps"], "after", _kill_point(kill_after))
        _record(state_dir, jr)
    except BaseException as exc:
        undo_error = _undo(state_dir, site, jr)
        if undo_error:
            raise AgentError(
                "undo_failed", f"{jr['action']} failed ({exc}) and undoing it failed too ({undo_error})",
                "the journal was kept: the next push or rollback completes the change", journal=True,
            ) from exc
        if is_enospc(exc):
            raise AgentError("no_space", f"no space left while changing files ({exc})",
                             "free space; every file was restored, nothing changed") from exc
        raise
    remove_durably(state_dir / JOURNAL)
    return changed


def _undo(state_dir: Path, site: Path, jr: dict) -> str | None:
    try:
        apply_steps(site, list(reversed(jr["steps"])), "before")
        _clean_temps(site, jr["steps"])
        remove_durably(state_dir / JOURNAL)
    except Exception as exc:  # noqa: BLE001 - reported, journal kept for the next run
        return str(exc)
    return None


def _hash_or_none(v: object) -> bool:
    return v is None or (isinstance(v, str) and len(v) == 64)


def _step_problem(step: object, state_dir: Path) -> str | None:
    if not isinstance(step, dict) or not isinstance(step.get("rel"), str) or step["rel"].startswith("/") \
            or ".." in step["rel"].split("/"):
        return "a step without a safe `rel`"
    for side in ("before", "after"):
        src = step.get(f"{side}_src")
        if not _hash_or_none(step.get(side)):
            return f"step {step['rel']}: `{side}` is not a sha256 or null"
        # Sources are our own copies: one outside the state dir would copy any file into site-packages.
        if (step[side] is None) != (src is None) or (src is not None and not (
                isinstance(src, str) and src.startswith(str(state_dir) + "/") and ".." not in src.split("/"))):
            return f"step {step['rel']}: `{side}_src` is not a file in the state dir"
    if not (step.get("mode") is None or isinstance(step.get("mode"), int)):
        return f"step {step['rel']}: `mode` is not an integer"
    return None


def problem_of(jr: object, state_dir: Path) -> str | None:
    if not isinstance(jr, dict):
        return f"is a JSON {type(jr).__name__}, not an object"
    for key in ("action", "release", "operator", "site_packages"):
        if not isinstance(jr.get(key), str):
            return f"`{key}` is not a string"
    if not jr["site_packages"].startswith("/"):
        return "`site_packages` is not an absolute path"
    for key in ("stack_before", "stack_after"):
        if not (isinstance(jr.get(key), list) and all(is_release_id(r) for r in jr[key])):
            return f"`{key}` is not a list of release ids"
    if not isinstance(jr.get("steps"), list):
        return "`steps` is not a list"
    return next((p for p in (_step_problem(s, state_dir) for s in jr["steps"]) if p), None)


def pending(state_dir: Path) -> dict | None:
    """The journal of an interrupted change, validated; None when there is none."""
    path = state_dir / JOURNAL
    what = "journal.json (an install or rollback was interrupted)"
    try:
        jr = statefs.read_json(path, what, statefs.REPAIR_UNLOCK)
    except FileNotFoundError:
        return None
    problem = problem_of(jr, state_dir)
    if problem:
        raise statefs.damaged(path, f"{what} {problem}", statefs.REPAIR_UNLOCK)
    assert isinstance(jr, dict)
    return jr


def recover(state_dir: Path) -> dict | None:
    """Roll an interrupted change forward. Returns what was done, or None when no journal."""
    jr = pending(state_dir)
    if jr is None:
        return None
    site = Path(jr["site_packages"])
    _clean_temps(site, jr["steps"])
    missing = [s["rel"] for s in jr["steps"]
               if s["after"] is not None and sha256_file(s["after_src"]) != s["after"]]
    if missing:
        # The new bytes are gone or damaged: forward is impossible, so go back instead.
        err = _undo(state_dir, site, jr)
        if err:
            raise AgentError("recover_failed", f"interrupted {jr['action']} of {jr['release']} can be neither "
                             f"completed (sources damaged: {missing}) nor undone ({err})",
                             "inspect journal.json in the state dir")
        direction = "undone"
        changed: list[str] = []
    else:
        changed = apply_steps(site, jr["steps"], "after")
        _record(state_dir, jr)
        remove_durably(state_dir / JOURNAL)
        direction = "completed"
    state.audit_best_effort(state_dir, operator=jr.get("operator", "?"), command=f"recover-{jr['action']}",
                            release=jr["release"], result=direction, files_changed=len(changed))
    return {"action": jr["action"], "release": jr["release"], "direction": direction, "files_changed": changed}


def op_recover(request: dict) -> dict:
    """Finish an interrupted change; with repair (the `unlock` command) clear a damaged journal
    too, once every file is shown to be where state.json says (repair.py)."""
    from . import lock, repair, stale

    sd = statefs.state_dir(request)
    with lock.held(sd, request.get("lock_id"), who=str(request.get("operator", "?")), command="recover"):
        if os.path.lexists(sd / JOURNAL):
            # SGLang changed under the release: its interrupted change would write another version's bytes.
            stale.refuse_if_stale(sd, stale.installed_version("sglang", request.get("sys_path")))
        if request.get("repair"):
            try:
                pending(sd)
            except AgentError as exc:
                if exc.code != "state_damaged":
                    raise
                return {"recovered": None, "journal_cleared": repair.clear_journal(sd, exc.message,
                                                                                  request.get("sys_path"))}
        return {"recovered": recover(sd)}

"""Agent op `rollback`: restore files from release backups, byte for byte (stdlib only).

The installed releases form a stack (state.json `stack`); each release's backup holds
exactly what its install replaced. So:
    --to previous   undo the top release            (pop 1)
    --to pristine   undo every release, top first   (pop all)
    --to RELEASE    pop down to RELEASE if it is in the stack; otherwise, if its bundle is
                    still kept under releases/, install it again (like a push).
Each pop is its own journaled change, so an interruption between pops leaves a
consistent stack that the next run simply continues from. Every restored file is
checked against the sha256 recorded in backup.json when the backup was taken.
"""

from __future__ import annotations

from pathlib import Path

from . import install, journal, lock, state
from .atomic import AgentError, copy_file_atomic, read_json, sha256_file
from .layout import BACKUP_RECORD, RELEASES, find_base, release_dir, safe_name, state_dir_of


def _record(sd: Path, rid: str) -> dict:
    rec = read_json(release_dir(sd, rid) / BACKUP_RECORD)
    if not isinstance(rec, dict) or not isinstance(rec.get("files"), dict):
        raise AgentError("backup_missing", f"release {rid} has no backup manifest in {release_dir(sd, rid)}",
                         "the state dir was damaged; restore files by reinstalling sglang")
    return rec


def _steps_for_pop(sd: Path, site: Path, rid: str, *, adopt: bool, check_drift: bool) -> tuple[list[dict], list[str]]:
    """Journal steps that undo release rid, after checking every backup byte for byte."""
    rdir = release_dir(sd, rid)
    rec = _record(sd, rid)
    steps, drifted = [], []
    for rel, f in sorted(rec["files"].items()):
        backup = rdir / "backup" / rel
        if f["before"] is not None and sha256_file(backup) != f["before"]:
            raise AgentError("backup_damaged", f"backup of {rel} in {rid} does not hash to {f['before']}",
                             "nothing was changed; the backup cannot be trusted")
        step = {"rel": rel, "before": f["after"], "before_src": str(rdir / "payload" / rel) if f["after"] else None,
                "after": f["before"], "after_src": str(backup) if f["before"] is not None else None,
                "mode": f.get("mode")}
        now = sha256_file(site / rel)
        if check_drift and now not in (f["after"], f["before"]):
            drifted.append(rel)
            if adopt and now is not None:
                # Keep the foreign bytes too, so even this rollback can be undone.
                keep = rdir / "drift" / rel
                copy_file_atomic(site / rel, keep)
                step.update(before=now, before_src=str(keep))
            elif adopt:
                step.update(before=None, before_src=None)
        steps.append(step)
    return steps, drifted


def rollback(sd: Path, to: str, *, operator: str, sys_path: list | None = None, adopt: bool = False,
             package: str = "sglang") -> dict:
    recovered = journal.recover(sd)
    st = state.load(sd)
    stack = list(st.get("stack") or [])
    if to == "previous":
        if not stack:
            return _noop(sd, operator, to, "nothing to roll back: no ddtree-ops release is installed here", recovered)
        keep = len(stack) - 1
    elif to == "pristine":
        if not stack:
            return _noop(sd, operator, to, "nothing to roll back: the host is already pristine", recovered)
        keep = 0
    else:
        rid = safe_name(to, "release id")
        if stack and stack[-1] == rid:
            return _noop(sd, operator, to, f"{rid} is already current; nothing to roll back", recovered)
        if rid in stack:
            keep = stack.index(rid) + 1
        else:
            kept = release_dir(sd, rid) / "bundle.tar.gz"
            if not kept.is_file():
                known = sorted(p.name for p in (sd / RELEASES).glob("*") if not p.name.startswith("."))
                raise AgentError("unknown_release", f"no release {rid} on this host",
                                 f"known here: {', '.join(known) or 'none'}")
            # Not below us: reinstall its kept bundle, which is checked like any push.
            result = install.install(sd, kept, operator=operator, sys_path=sys_path, adopt=adopt)
            return {**result, "to": rid, "popped": [], "recovered": recovered or result.get("recovered")}
    _, site = find_base(package, sys_path)
    pops = list(reversed(stack[keep:]))
    # Check every backup of every pop before the first file changes.
    planned = []
    for i, rid in enumerate(pops):
        steps, drifted = _steps_for_pop(sd, site, rid, adopt=adopt, check_drift=(i == 0))
        if drifted and not adopt:
            raise AgentError("foreign", f"changed since {rid} was installed: {', '.join(drifted)}",
                             "inspect them; rollback --adopt overwrites them (their bytes are kept in the state dir)")
        planned.append((rid, steps))
    changed: list[str] = []
    remaining = list(stack)
    for rid, steps in planned:
        jr = {"op": "rollback", "action": "rollback", "release": rid, "operator": operator,
              "started": state.now_iso(), "steps": steps, "stack_before": list(remaining),
              "stack_after": remaining[:-1]}
        try:
            changed += journal.run(sd, site, jr)
        except AgentError as exc:
            state.audit_best_effort(sd, operator=operator, command=f"rollback --to {to}", release=rid,
                                    result="failed", reason=exc.code)
            raise
        remaining = remaining[:-1]
    # Byte-for-byte proof: every file of every popped release is at its recorded before-hash
    # (the lowest pop's before wins for a file several pops touched).
    expected: dict[str, str | None] = {}
    for _, steps in planned:
        for s in steps:
            expected[s["rel"]] = s["after"]
    mismatched = [rel for rel, want in expected.items() if sha256_file(site / rel) != want]
    if mismatched:
        raise AgentError("verify_failed", f"after rollback these files do not match their backups: {mismatched}",
                         "inspect the host")
    now = remaining[-1] if remaining else None
    warn = state.audit_best_effort(sd, operator=operator, command=f"rollback --to {to}", release=now,
                                   result="rolled-back", popped=pops, files_changed=len(changed))
    return {"noop": False, "to": to, "current": now, "popped": pops, "changed": changed,
            "verified": sorted(expected), "message": f"rolled back {', '.join(pops)} → {now or 'pristine'}",
            "recovered": recovered, "warnings": [warn] if warn else []}


def _noop(sd: Path, operator: str, to: str, message: str, recovered: dict | None) -> dict:
    st = state.load(sd)
    state.audit_best_effort(sd, operator=operator, command=f"rollback --to {to}", release=st.get("current"),
                            result="noop")
    return {"noop": True, "to": to, "current": st.get("current"), "popped": [], "message": message,
            "recovered": recovered}


def op_rollback(request: dict) -> dict:
    sd = state_dir_of(request)
    operator = str(request.get("operator", "?"))
    with lock.held(sd, request.get("lock_id"), who=operator, command="rollback",
                   wait_s=float(request.get("lock_wait_s", 0))):
        return rollback(sd, str(request.get("to") or "previous"), operator=operator,
                        sys_path=request.get("sys_path"), adopt=bool(request.get("adopt")))

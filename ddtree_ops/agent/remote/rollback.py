"""Agent op `rollback`: restore files from release backups, byte for byte (stdlib only).

The installed releases form a stack (state.json `stack`); each release's backup holds
exactly what its install replaced. So:
    --to previous   undo the top release            (pop 1)
    --to RELEASE    pop down to RELEASE if it is in the stack; otherwise, if its bundle is
                    still kept under releases/, install it again (like a push).
Each pop is its own journaled change, so an interruption between pops leaves a
consistent stack that the next run simply continues from. Every restored file is
checked against the sha256 recorded in backup.json when the backup was taken.
    --to pristine   every file any kept release touches back to its original from the pristine
                    store, in one journaled change, each checked against the original sha256 the
                    manifests state (not against a backup). It needs neither state.json nor a
                    readable journal, so it is also the repair when either is damaged: the damaged
                    file is set aside and a new state.json (empty stack) is written.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from . import backup, install, journal, lock, pristine, repair, stale, state, statefs, units
from .atomic import AgentError, copy_file_atomic, sha256_file
from .bundle import read_bundle, release_id
from .layout import JOURNAL, RELEASES, REPLACED, find_base, release_dir, safe_name


def _steps_for_pop(sd: Path, site: Path, rid: str, *, adopt: bool, check_drift: bool) -> tuple[list[dict], list[str]]:
    """Journal steps that undo release rid, after checking every backup byte for byte."""
    rdir = release_dir(sd, rid)
    rec = backup.read(sd, rid)
    steps, drifted = [], []
    for rel, f in sorted(rec["files"].items()):
        kept = rdir / "backup" / rel
        if f["before"] is not None and sha256_file(kept) != f["before"]:
            raise AgentError("backup_damaged", f"{kept}: the backup of {rel} in {rid} does not hash to {f['before']}",
                             f"nothing was changed; the backup cannot be trusted. repair: {statefs.REPAIR_PRISTINE}",
                             path=str(kept))
        step = {"rel": rel, "before": f["after"], "before_src": str(rdir / "payload" / rel) if f["after"] else None,
                "after": f["before"], "after_src": str(kept) if f["before"] is not None else None,
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
    # Before anything, the journal's recovery included.
    stale.refuse_if_stale(sd, stale.installed_version(package, sys_path), package)
    if to == "pristine":
        return to_pristine(sd, operator=operator, sys_path=sys_path, adopt=adopt, package=package)
    recovered = journal.recover(sd)
    st = state.load(sd)
    stack = list(st.get("stack") or [])
    if to == "previous":
        if not stack:
            return _noop(sd, operator, to, "nothing to roll back: no ddtree-ops release is installed here", recovered)
        keep = len(stack) - 1
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
            # Not below us: reinstall its kept bundle, which is checked like any push, and must be
            # the release asked for (content-addressed ids: another bundle under that name is damage).
            if release_id(read_bundle(kept)) != rid:
                raise statefs.damaged(kept, f"holds another release than {rid}", statefs.REPAIR_PRISTINE)
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


def _damage(fn, *args: object) -> tuple[object, AgentError | None]:
    """fn's result, or the damaged-file refusal it raised (to_pristine works around those)."""
    try:
        return fn(*args), None
    except AgentError as exc:
        if exc.code != "state_damaged":
            raise
        return None, exc


def _pristine_steps(sd: Path, site: Path, index: dict, known: pristine.Known, *, adopt: bool,
                    package: str) -> tuple[list[dict], list[str]]:
    """Journal steps taking every indexed file to its original, and the files whose bytes are neither
    original nor ours (foreign: refused unless adopt). Undo needs the bytes each file has now: the
    caller copies them fresh to each step's before_src under replaced/<time>/ (a few small files),
    so no record has to be trusted for them."""
    replaced = sd / REPLACED / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    steps, foreign = [], []
    for rel, entry in sorted(index.items()):
        want = entry["sha256"]
        now = sha256_file(site / rel)
        if entry["adopted"] and now in known.wheel.get(rel, ()):
            continue  # an adopted file that is the wheel's own again is more than restored
        if entry.get("unknown"):
            raise AgentError("pristine_lost", f"the original of {rel} is unknown: no kept manifest lists it and the "
                             f"installed {package} has no RECORD", f"reinstall the wheel on the host (pip install "
                             f"--force-reinstall --no-deps {package}), then repeat; nothing was changed", path=rel)
        if now == want:
            continue
        if want is not None and not pristine.heal(sd, site, rel, want, known):
            raise pristine.lost(rel, want, package)
        if now not in known.ours.get(rel, set()):
            foreign.append(rel)
            if not adopt:
                continue
        steps.append({"rel": rel, "before": now, "before_src": str(replaced / rel) if now is not None else None,
                      "after": want, "after_src": str(pristine.copy_path(sd, rel)) if want is not None else None,
                      "mode": None})
    return steps, foreign


def to_pristine(sd: Path, *, operator: str, sys_path: list | None, adopt: bool, package: str) -> dict:
    st, state_err = _damage(state.load, sd)
    jr, journal_err = _damage(journal.pending, sd)
    recovered = None
    if jr is not None and state_err is None:
        recovered = journal.recover(sd)  # finish it first, so the stack we record from is the real one
        st = state.load(sd)
    version, site = find_base(package, sys_path)
    known = pristine.Known(sd)
    index = pristine.load_index(sd, known, pristine.host_record(site, package, version))
    steps, drifted = _pristine_steps(sd, site, index, known, adopt=adopt, package=package)
    if drifted and not adopt:
        raise AgentError("foreign", f"changed by someone else, neither original nor a release of ours: {', '.join(drifted)}",
                         "inspect them; rollback --to pristine --adopt overwrites them (their bytes are kept in the state dir)")
    for step in steps:
        if step["before_src"] is not None:
            copy_file_atomic(site / step["rel"], step["before_src"])
    stack = list(st["stack"]) if isinstance(st, dict) else []
    # What this run supersedes (a damaged state.json, a journal it could not finish) is set aside,
    # never deleted, so the change's own journal and state are the only ones the next run reads;
    # if the change fails they are put back.
    supersede = [name for name, err in ((JOURNAL, journal_err or (jr is not None and recovered is None)),
                                        (state.STATE, state_err)) if err]
    if not steps and not stack and not supersede:
        return _noop(sd, operator, "pristine", "nothing to roll back: the host is already pristine", recovered)
    kept = {name: repair.set_aside(sd / name) for name in supersede if (sd / name).exists()}
    jr_new = {"op": "rollback", "action": "rollback", "release": "pristine", "operator": operator,
              "started": state.now_iso(), "steps": steps, "stack_before": stack, "stack_after": []}
    try:
        if state_err is not None:
            # Releases start anew (every file goes back to pristine below); the promotion stack does not:
            # its units are not touched here, so it is rebuilt from their records on disk.
            promotion = units.rebuild_promotion(sd)
            state.save(sd, {**state.empty(), "promotion": promotion, "mode": promotion["mode"]})
        changed = journal.run(sd, site, jr_new)
    except BaseException as exc:
        for name, path in kept.items():
            os.replace(path, sd / name)
        state.audit_best_effort(sd, operator=operator, command="rollback --to pristine", release=None,
                                result="failed", reason=getattr(exc, "code", type(exc).__name__))
        raise
    # Byte-for-byte proof against the originals the manifests state (adopted ones: the bytes found).
    mismatched = [rel for rel, e in index.items() if sha256_file(site / rel) != e["sha256"]
                  and not (e["adopted"] and sha256_file(site / rel) in known.wheel.get(rel, ()))]
    if mismatched:
        raise AgentError("verify_failed", f"after rollback these files are not pristine: {mismatched}", "inspect the host")
    not_pristine = sorted(rel for rel, e in index.items() if e["adopted"])
    warnings = [f"{rel}: restored to the bytes found before push --adopt took it over (never pristine here)"
                for rel in not_pristine]
    warnings += [f"superseded {name}, kept as {path}" for name, path in kept.items()]
    warn = state.audit_best_effort(sd, operator=operator, command="rollback --to pristine", release=None,
                                   result="rolled-back", popped=list(reversed(stack)), files_changed=len(changed),
                                   set_aside=[p.name for p in kept.values()])
    return {"noop": False, "to": "pristine", "current": None, "popped": list(reversed(stack)), "changed": changed,
            "verified": sorted(index), "not_pristine": not_pristine, "set_aside": [str(p) for p in kept.values()],
            "message": f"rolled back {', '.join(reversed(stack)) or 'damaged state'} → pristine "
                       f"({len(index)} files verified against their original sha256)",
            "recovered": recovered, "warnings": warnings + ([warn] if warn else [])}


def _noop(sd: Path, operator: str, to: str, message: str, recovered: dict | None) -> dict:
    st = state.load(sd)
    state.audit_best_effort(sd, operator=operator, command=f"rollback --to {to}", release=st.get("current"),
                            result="noop")
    return {"noop": True, "to": to, "current": st.get("current"), "popped": [], "message": message,
            "recovered": recovered}


def op_rollback(request: dict) -> dict:
    sd = statefs.state_dir(request)
    operator = str(request.get("operator", "?"))
    with lock.held(sd, request.get("lock_id"), who=operator, command="rollback",
                   wait_s=float(request.get("lock_wait_s", 0))):
        return rollback(sd, str(request.get("to") or "previous"), operator=operator,
                        sys_path=request.get("sys_path"), adopt=bool(request.get("adopt")))

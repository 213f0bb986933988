"""Agent op `forget_stale`: the repair of a host whose SGLang was changed under its releases (stale.py).

Such a host's releases, backups and pristine copies describe another SGLang version, so none of them may
be restored. Once the operator has reinstalled SGLang's own files (pip install --force-reinstall), this:
  1. checks, before any change, that every file any kept release touched is what the installed wheel's
     RECORD says (upstream files) or, for a file the wheel does not list, absent or bytes of ours (a DDTree
     module the old release added: pip leaves those behind); anything else is refused, naming the files;
  2. removes those modules of ours in one journaled change that also empties the release stack (their
     bytes are kept under forgotten/<time>/site/, so even this can be undone by hand);
  3. sets pristine/ and releases/ aside under forgotten/<time>/ (renamed, never deleted).
A crash between the steps leaves a host that is still stale (its releases are kept) or already clean, and
running it again finishes it. Promote's unit records are not touched: `rollback --to pristine` restores the
unit afterwards, once the host is no longer stale.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from . import journal, lock, pristine, repair, stale, state, statefs, units
from .atomic import AgentError, copy_file_atomic, fsync_dir, sha256_file
from .layout import JOURNAL, PRISTINE, RELEASES, find_base

FORGOTTEN = "forgotten"


def forget_stale(sd: Path, *, operator: str, sys_path: list | None = None, package: str = "sglang") -> dict:
    version, site = find_base(package, sys_path)
    old = stale.stale_releases(sd, version)
    if not old:
        raise AgentError("not_stale", f"no release here was made for another {package} than the installed {version}; "
                         "nothing to forget", "use rollback --to previous|pristine|RELEASE")
    record = pristine.host_record(site, package, version)
    if not record:
        raise AgentError("no_record", f"the installed {package} {version} has no RECORD: its own files cannot be "
                         "checked", f"reinstall it (pip install --force-reinstall --no-deps {package}=={version}), "
                         "then repeat; nothing was changed")
    try:
        st, damaged = state.load(sd), None
    except AgentError as exc:  # a damaged state.json is superseded below, like rollback --to pristine does
        if exc.code != "state_damaged":
            raise
        st, damaged = state.empty(), exc
    known = pristine.Known(sd)
    not_wheel, foreign, ours = [], [], []
    for rel in sorted(known.touched):
        now = sha256_file(site / rel)
        if rel in record:
            if now != record[rel]:
                not_wheel.append(rel)
        elif now is not None:
            (ours if now in known.ours.get(rel, set()) else foreign).append((rel, now))
    if not_wheel:
        raise AgentError("not_reinstalled", f"{package} {version}'s own files are not the wheel's yet: "
                         f"{', '.join(not_wheel)}", f"reinstall them (pip install --force-reinstall --no-deps "
                         f"{package}=={version}), then repeat; nothing was changed")
    if foreign:
        raise AgentError("foreign", f"not in {package} {version}'s RECORD and not a file ddtree-ops installed: "
                         f"{', '.join(r for r, _ in foreign)}", "inspect them (someone else put them there); "
                         "nothing was changed")
    dest = sd / FORGOTTEN / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
    steps = []
    for rel, now in ours:
        keep = dest / "site" / rel
        copy_file_atomic(site / rel, keep)
        if sha256_file(keep) != now:
            raise AgentError("backup_failed", f"the copy of {rel} does not verify", "nothing was changed; repeat")
        steps.append({"rel": rel, "before": now, "before_src": str(keep), "after": None, "after_src": None,
                      "mode": None})
    # What this supersedes is set aside, never deleted: a journal of the old release (its steps would write
    # the old version's bytes; every file was just shown to be the wheel's or ours) and a damaged state.json.
    set_aside = [str(repair.set_aside(sd / name)) for name in (JOURNAL, state.STATE)
                 if (sd / name).exists() and (name == JOURNAL or damaged is not None)]
    if damaged is not None:
        promotion = units.rebuild_promotion(sd)
        state.save(sd, {**state.empty(), "promotion": promotion, "mode": promotion["mode"]})
        st = state.load(sd)
    stack = list(st.get("stack") or [])
    jr = {"op": "forget_stale", "action": "forget-stale", "release": "forget-stale", "operator": operator,
          "started": state.now_iso(), "steps": steps, "stack_before": stack, "stack_after": []}
    changed = journal.run(sd, site, jr) if steps or stack else []
    dest.mkdir(parents=True, exist_ok=True)
    moved = []
    for name in (PRISTINE, RELEASES):  # pristine first: releases kept = still stale, so a rerun finishes
        if (sd / name).exists():
            os.rename(sd / name, dest / name)
            moved.append(name)
    fsync_dir(sd)
    warn = state.audit_best_effort(sd, operator=operator, command="rollback --forget-stale", release=None,
                                   result="forgotten", releases=old, removed=changed, kept_as=str(dest))
    mode = st.get("mode")
    warnings = [warn] if warn else []
    if mode not in (None, "off"):
        warnings.append(f"the service's unit was promoted to {mode} and still names the DDTree flags: "
                        "`ddtree-ops rollback --to pristine` restores the unit, then push and promote again")
    return {"noop": False, "to": "forget-stale", "current": None, "forgotten": old, "removed": changed,
            "kept_as": str(dest), "set_aside": moved + set_aside,
            "message": f"forgot {', '.join(sorted(old))} (made for {package} "
                       f"{', '.join(sorted(set(old.values())))}; {package} here is {version}); removed "
                       f"{len(changed)} DDTree module(s) of theirs; kept in {dest}",
            "warnings": warnings}


def op_forget_stale(request: dict) -> dict:
    sd = statefs.state_dir(request)
    operator = str(request.get("operator", "?"))
    with lock.held(sd, request.get("lock_id"), who=operator, command="rollback --forget-stale",
                   wait_s=float(request.get("lock_wait_s", 0))):
        return forget_stale(sd, operator=operator, sys_path=request.get("sys_path"))

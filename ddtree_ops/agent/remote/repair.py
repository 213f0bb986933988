"""What `unlock` finds and clears in a damaged state dir (stdlib only).

`diagnose` lists every problem without changing anything (lock_status shows it before the
operator confirms). `unlock` then removes planted links (statefs.remove_planted), breaks the
lock, and completes an interrupted change, or, when its journal is damaged, clears the journal
with `clear_journal` only after proving that no file is mixed: every file any kept release
touches is exactly where state.json's stack says. Otherwise it refuses, naming the files, and
`rollback --to pristine` (which needs neither the journal nor state.json) is the repair.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from . import backup, journal, pristine, state, statefs
from .atomic import AgentError, fsync_dir, sha256_file
from .layout import JOURNAL, find_base


def diagnose(sd: Path) -> list[dict]:
    """[{path, problem, repair}] for everything in sd a mutating command would refuse on (but the lock)."""
    if not sd.is_dir():
        return []
    found = {path: {"path": path, "problem": problem, "repair": repair} for path, problem, repair in statefs.scan(sd)}

    def add(exc: AgentError) -> None:
        path = str(exc.extra.get("path", ""))
        found.setdefault(path, {"path": path, "problem": exc.message, "repair": exc.hint})

    # A damaged lock owner is the holder's `damaged` field (lock_status reports both side by side).
    for check in (journal.pending, state.load):
        try:
            check(sd)
        except AgentError as exc:
            add(exc)
    return list(found.values())


def expected_hashes(sd: Path, stack: list[str], index: dict[str, dict]) -> dict[str, str | None]:
    """rel -> the sha256 it has when the stack is fully installed (originals below every release)."""
    want = {rel: e["sha256"] for rel, e in index.items()}
    for rid in stack:
        for rel, f in backup.read(sd, rid)["files"].items():
            want[rel] = f["after"]
    return want


def set_aside(path: Path) -> Path:
    """Keep a damaged state file for inspection under a name nothing reads; never delete it."""
    kept = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}")
    os.rename(path, kept)
    fsync_dir(path.parent)
    return kept


def clear_journal(sd: Path, found: str, sys_path: list | None, package: str = "sglang") -> dict:
    st = state.load(sd)
    version, site = find_base(package, sys_path)
    index = pristine.load_index(sd, pristine.Known(sd), pristine.host_record(site, package, version))
    want = expected_hashes(sd, st["stack"], index)
    mixed = sorted(rel for rel, h in want.items() if sha256_file(site / rel) != h)
    if mixed:
        raise AgentError("files_mixed", f"{found}; and {len(mixed)} file(s) are not where state.json says, so the "
                         f"interrupted change is half done: {', '.join(mixed)}",
                         f"the journal is kept. repair: {statefs.REPAIR_PRISTINE}", path=str(sd / JOURNAL))
    kept = set_aside(sd / JOURNAL)
    state.audit_best_effort(sd, operator="?", command="unlock", release=st["current"], result="journal-cleared",
                            kept_as=kept.name)
    return {"found": found, "kept_as": str(kept), "checked": sorted(want)}

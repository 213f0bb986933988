"""Agent ops for the serving unit that promote manages (stdlib only).

Files (beside the release files, in the same state dir):
    units/<unit_id>/record.json     what a stage replaced: per file its sha256 before (null: absent)
                                    and after (the bytes the stage wrote), the backup's path, and
                                    `retired` once the stage's files are back (undone or popped)
    units/<unit_id>/files/unit      the replaced unit (or drop-in); the replaced env file is kept
                                    beside it (<env dir>/.ddtree-ops-backup/<unit_id>.env, 0600):
                                    secrets never enter the state dir. Both go with their stage
                                    (undone, popped, or everything at rollback --to pristine).
    units-journal.json              present only while a stage is in flight (installed, not yet
                                    confirmed), with its confirm deadline (confirm.py): if nobody
                                    confirms it in time, the watchdog puts the previous unit back
    watch/<unit_id>.in              the watchdog's input (its code and request) while it runs
    promotion/canary-<mode>.json    the canary prompts and greedy outputs a passed stage served
    evidence/<time>-<mode>-<result>.json   gate inputs and verdicts (0600; the control side sends no secrets)

state.json gets one key of its own, `promotion` (plus the existing `mode`):
    {"mode", "stack": [unit_id...], "stages": {unit_id: {mode, from_mode, time}},
     "last": {mode, result, time, gates, accept_length, evidence},
     "passed": {mode: {time, unit_id, accept_length, release, bundle_sha256}}}

The commit point of a stage is the state.json rename that puts its unit_id on the stack; the journal
goes after. So a journal whose unit_id is on the stack is a commit that was interrupted after that
rename, and recovery finishes it; any other journal is undone. Every change is backup first, then
journal, then files (temp + fsync + rename), then daemon-reload; undo is the same in reverse and
idempotent, so a re-run converges. Restarts are queued (`--no-block`) and waited for by unit_wait,
so no op outlasts the control side's wait for it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from . import backup, confirm, envfile, lock, redaction, state, statefs
from .atomic import (
    AgentError,
    copy_file_atomic,
    remove_durably,
    sha256_bytes,
    sha256_file,
    write_bytes_atomic,
    write_json_atomic,
)
from .layout import RELEASES, safe_name

UNITS = "units"
UNIT_JOURNAL = "units-journal.json"
PROMOTION_DIR = "promotion"
EVIDENCE_DIR = "evidence"
ENV_BACKUP_DIR = ".ddtree-ops-backup"
FOUND_DIR = "units-found"  # units changed by hand, kept when --adopt (or an undo) overwrote them
KILL_ENV = "DDTREE_OPS_TEST_KILL_UNIT_AT"
DDTREE_MODULE = "sglang/srt/speculative/ddtree_utils.py"
# The v2 bases' server-args glue (shipped by 0.5.17's and 0.5.23's payloads only): it says which modes those bases
# can serve yet.
V2_GLUE_MODULE = "sglang/srt/speculative/ddtree_v2_args.py"
SHOW_PROPERTIES = ("LoadState", "ActiveState", "SubState", "Result", "NRestarts", "FragmentPath", "DropInPaths",
                   "ExecMainStatus", "ExecMainCode", "UnitFileState", "InvocationID")
TOOL_TIMEOUT_S = 120
JOURNAL_TAIL = 8000
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.@\\-]{1,240}\.service")
_ACTIVE = ("active", "activating", "reloading")


# ---------------------------------------------------------------- small helpers


def _service(args: dict) -> str:
    name = args.get("service")
    if not isinstance(name, str) or not _UNIT_NAME.fullmatch(name) or name.startswith("-") or name.endswith("\\"):
        raise AgentError("bad_request", f"invalid service name {name!r}")
    return name


def _abs(args: dict, key: str) -> Path:
    value = args.get(key)
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value or ".." in value.split("/"):
        raise AgentError("bad_request", f"`{key}` must be an absolute path")
    return Path(value)


def _run(argv: list, timeout: float = TOOL_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as exc:
        raise AgentError("tool_missing", f"{argv[0]} not found on the host: {exc}", "promote needs systemd") from None
    except subprocess.TimeoutExpired:
        raise AgentError("tool_timeout", f"{' '.join(argv[:3])} did not finish within {timeout:.0f}s") from None


def systemctl(*args: str, timeout: float = TOOL_TIMEOUT_S) -> subprocess.CompletedProcess:
    return _run(["systemctl", "--no-pager", *args], timeout)


def show(service: str) -> dict:
    proc = systemctl("show", "--property=" + ",".join(SHOW_PROPERTIES), "--", service)
    props = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    props["NRestarts"] = int(props["NRestarts"]) if props.get("NRestarts", "").isdigit() else 0
    return props


def _daemon_reload() -> None:
    proc = systemctl("daemon-reload")
    if proc.returncode != 0:
        raise AgentError("daemon_reload_failed", f"systemctl daemon-reload: {proc.stderr.strip()[-500:]}")


def _secret_values(env_path: Path | None) -> list:
    """Values of the env file, read here on the host, so that excerpts we send back never carry them."""
    if env_path is None:
        return []
    try:
        return envfile.values(env_path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return []


def journal_excerpt(service: str, since: float | None, env_path: Path | None) -> str:
    argv = ["journalctl", "--no-pager", "-o", "short-iso", "-n", "200", "-u", service]
    if since:
        argv += ["--since", f"@{int(since)}"]
    try:
        proc = _run(argv, 30)
        text = (proc.stdout or proc.stderr)[-JOURNAL_TAIL:]
    except AgentError as exc:
        text = exc.message
    return redaction.redact_text(text, _secret_values(env_path))


def _kill_point(name: str, args: dict) -> None:
    if name in (os.environ.get(KILL_ENV), args.get("test_kill")):
        os.kill(os.getpid(), 9)


# ---------------------------------------------------------------- lint


def lint(service: str, kind: str, text: str) -> dict:
    """`systemd-analyze verify` (any output line fails: it exits 0 on unknown keys) and the
    `systemd-analyze security` exposure score of the rendered unit, in a scratch directory.
    A drop-in is verified merged over a copy of the unit it extends."""
    with tempfile.TemporaryDirectory(prefix="ddtree-unit-") as tmp:
        unit = Path(tmp) / service
        if kind == "drop-in":
            fragment = show(service).get("FragmentPath") or ""
            if not fragment or not os.path.isfile(fragment):
                raise AgentError("unit_missing", f"{service} has no unit file to put a drop-in over",
                                 "install the service first, or set `unit_kind: unit` in the inventory")
            shutil.copyfile(fragment, unit)
            (Path(tmp) / f"{service}.d").mkdir()
            (Path(tmp) / f"{service}.d" / "50-ddtree-ops.conf").write_text(text)
        else:
            unit.write_text(text)
        verify = _run(["systemd-analyze", "verify", "--man=no", "--", str(unit)])
        output = (verify.stdout + verify.stderr).strip()
        warnings = [line for line in output.splitlines() if line.strip()]
        security = _run(["systemd-analyze", "security", "--no-pager", "--offline=true", "--", str(unit)])
        exposure, level = None, None
        match = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", security.stdout)
        if match:
            exposure, level = float(match.group(1)), match.group(2)
    return {"ok": verify.returncode == 0 and not warnings, "returncode": verify.returncode,
            "warnings": [w.replace(tmp, "<rendered>") for w in warnings],
            "exposure": exposure, "exposure_level": level,
            "security_table": security.stdout.replace(tmp, "<rendered>")[-6000:]}


# ---------------------------------------------------------------- records


def read_json(path: Path) -> object:
    """A promote state file (journal, stage record, canary), never through a link; None when absent
    (no stage in flight, none recorded), statefs.damaged() naming the file and its repair when unreadable."""
    try:
        return statefs.read_json(path, f"the promote file {path.name}", statefs.REPAIR_UNLOCK)
    except FileNotFoundError:
        return None


def _unit_dir(sd: Path, unit_id: str) -> Path:
    return sd / UNITS / safe_name(unit_id, "unit id")


def env_backup_path(env_path: Path, unit_id: str) -> Path:
    """Where the replaced env file is kept: beside it, in its own 0700 directory, never in the state
    dir (the env file holds secrets, and nothing in the state dir may)."""
    return env_path.parent / ENV_BACKUP_DIR / f"{safe_name(unit_id, 'unit id')}.env"


def _record_problem(rec: object) -> str | None:
    if not isinstance(rec, dict) or not isinstance(rec.get("files"), list) or not isinstance(rec.get("service"), str):
        return "is not a stage record"
    for f in rec["files"]:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) or not f["path"].startswith("/"):
            return "lists a file without an absolute path"
        if not all(f.get(k) is None or isinstance(f.get(k), str) for k in ("before", "after", "backup")):
            return "has a file entry whose hashes are not strings"
    return None


def _record(sd: Path, unit_id: str) -> dict:
    path = _unit_dir(sd, unit_id) / "record.json"
    rec = read_json(path)
    problem = "is missing" if rec is None else _record_problem(rec)
    if problem:
        raise AgentError("unit_backup_missing", f"{path}: the record of stage {unit_id} {problem}, so what it "
                         "replaced cannot be put back",
                         "put the unit and env file back by hand as they should be, then clear the stage with "
                         "`ddtree-ops unlock HOST` after removing its journal entry, or re-run with --adopt to "
                         "keep the files as they are now and forget the stage", path=str(path))
    assert isinstance(rec, dict)
    return rec


def _records_on_disk(sd: Path) -> list:
    """Every stage record that is not retired, oldest first: the stack when state.json cannot say."""
    recs = []
    try:
        names = sorted(p.name for p in (sd / UNITS).iterdir() if not p.name.startswith("."))
    except FileNotFoundError:
        return []
    for name in names:
        rec = read_json(sd / UNITS / name / "record.json")
        if _record_problem(rec) is None and not rec.get("retired") and rec.get("unit_id") == name:
            recs.append(rec)
    return sorted(recs, key=lambda r: (str(r.get("time")), r["unit_id"]))


def _retire(sd: Path, rec: dict) -> None:
    """Mark a stage whose files are back: if a crash comes before its forget, nothing counts it again."""
    if not rec.get("retired"):
        rec["retired"] = state.now_iso()
        write_json_atomic(_unit_dir(sd, rec["unit_id"]) / "record.json", rec)


def _forget(sd: Path, rec: dict) -> None:
    """A retired stage's backups go: the unit copy, and the env copy that may hold a rotated secret."""
    for f in rec["files"]:
        if f.get("backup") and not Path(f["backup"]).is_relative_to(sd):
            remove_durably(f["backup"])
    shutil.rmtree(_unit_dir(sd, rec["unit_id"]), ignore_errors=True)


def rebuild_promotion(sd: Path) -> dict:
    """The promotion stack as the stage records on disk tell it, for a state.json written anew over
    a damaged one: a repair must never silently forget that a promoted unit is installed."""
    try:
        jr = read_json(sd / UNIT_JOURNAL)
    except AgentError:
        jr = None
    in_flight = jr.get("unit_id") if isinstance(jr, dict) else None
    recs = [r for r in _records_on_disk(sd) if r["unit_id"] != in_flight]
    return {"stack": [r["unit_id"] for r in recs], "mode": recs[-1].get("mode") if recs else None,
            "stages": {r["unit_id"]: {"mode": r.get("mode"), "from_mode": r.get("from_mode"), "time": r.get("time")}
                       for r in recs}, "passed": {}, "rebuilt": state.now_iso()}


def _stack(st: dict) -> list:
    return list((st.get("promotion") or {}).get("stack") or [])


def drifted(rec: dict) -> list:
    """Files of a stage changed since it wrote them (by hand: neither what it wrote nor, when it is
    being undone mid-way, what it replaced)."""
    out = []
    for f in rec["files"]:
        if "after" not in f:  # a record from before `after` was kept: nothing to compare with
            continue
        now = sha256_file(f["path"])
        if now not in (f["after"], f["before"]):
            out.append(f["path"])
    return out


def _refuse_drift(rec: dict, doing: str) -> None:
    changed = drifted(rec)
    if changed:
        raise AgentError("unit_drift", f"changed by hand since stage {rec['unit_id']} ({rec.get('mode')}) installed "
                         f"it: {', '.join(changed)}", f"inspect the change; {doing} --adopt replaces it (the file as "
                         "found is kept: the unit under the state dir's units/, an env file in its 0600 backup dir)",
                         paths=changed)


def _keep_drift(sd: Path, rec: dict, path: Path) -> str:
    """A hand-made change about to be overwritten: kept, the unit in the state dir, an env file (it may
    hold secrets) beside its backups, 0600."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if any(f["path"] == str(path) and f.get("kind") == "env" for f in rec["files"]):
        keep = path.parent / ENV_BACKUP_DIR / f"{rec['unit_id']}.found-{stamp}.env"
        keep.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    else:
        keep = sd / FOUND_DIR / f"{stamp}-{rec['unit_id']}" / path.name
        keep.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    copy_file_atomic(path, keep, mode=0o600)
    return str(keep)


def _put_back(sd: Path, rec: dict, *, adopt: bool, keep_found: bool) -> dict:
    """Every file of a record to its before bytes (absent: removed); idempotent, verified. Every
    backup is checked before the first file changes. keep_found: a file changed by hand since the
    stage wrote it is kept before it is overwritten. adopt: a file whose backup is gone stays as it is."""
    todo, kept_as_found = [], []
    for f in rec["files"]:
        path = Path(f["path"])
        if sha256_file(path) == f["before"]:
            continue
        if f["before"] is not None and (not f.get("backup") or sha256_file(f["backup"]) != f["before"]):
            if adopt:
                kept_as_found.append(str(path))
                continue
            what = "missing" if not f.get("backup") or not os.path.exists(f["backup"]) else "damaged"
            raise AgentError("unit_backup_missing", f"cannot put {path} back as it was before stage {rec['unit_id']}: "
                             f"its backup {f.get('backup')} is {what}",
                             f"restore {path} by hand to the bytes whose sha256 is {f['before']} and re-run, or re-run "
                             f"with --adopt to keep {path} as it is now", path=str(path))
        todo.append(f)
    restored, found = [], []
    for f in todo:
        path = Path(f["path"])
        if keep_found and path.exists() and "after" in f and sha256_file(path) != f["after"]:
            found.append(_keep_drift(sd, rec, path))
        if f["before"] is None:
            remove_durably(path)
        else:
            copy_file_atomic(f["backup"], path, mode=f.get("mode"))
            if sha256_file(path) != f["before"]:
                raise AgentError("verify_failed", f"{path} does not hash to its backup after restoring")
        restored.append(str(path))
    return {"restored": restored, "kept_as_found": kept_as_found, "found_kept": found}


def _adopt(sd: Path, rec: dict | None, paths: list) -> None:
    """Files kept as found (their backup was gone, --adopt): the stage below now counts them as what
    it wrote, so the next rollback does not take the operator's choice for a change by hand."""
    if rec is None or not paths:
        return
    for f in rec["files"]:
        if f["path"] in paths:
            f["after"] = sha256_file(f["path"])
    write_json_atomic(_unit_dir(sd, rec["unit_id"]) / "record.json", rec)


def _restart(service: str, run: bool) -> dict:
    """Queue a fresh start of the (restored or new) unit, or its stop when nothing should run. Queued,
    not waited for: the old process may take TimeoutStopSec to drain, and unit_wait watches for the
    new invocation instead, so no op outlasts the control side's wait for it."""
    since = time.time()
    before = show(service).get("InvocationID") or ""
    systemctl("reset-failed", "--", service)
    proc = systemctl("restart" if run else "stop", "--no-block", "--", service)
    return {"action": "restart" if run else "stop", "since": since, "invocation_before": before,
            "returncode": proc.returncode, "message": proc.stderr.strip()[-500:]}


def _committed(sd: Path, unit_id: str) -> bool:
    """Whether the stage's commit point (its unit_id on the stack) was passed. A state.json that cannot
    be read cannot say so: the stage counts as unconfirmed and is undone (fail closed)."""
    try:
        return unit_id in _stack(state.load(sd))
    except AgentError:
        return False


def _undo_locked(sd: Path, *, adopt: bool = False, reason: str) -> dict | None:
    """Settle the stage in flight (the caller holds confirm.guard): finish its commit if the commit point
    was passed, else put its previous unit back. None when no stage is in flight."""
    jr = read_json(sd / UNIT_JOURNAL)
    if not isinstance(jr, dict):
        return None
    if not isinstance(jr.get("unit_id"), str):
        raise statefs.damaged(sd / UNIT_JOURNAL, "names no stage", statefs.REPAIR_UNLOCK)
    return _undo_stage(sd, jr, adopt=adopt, reason=reason)


def _undo_stage(sd: Path, jr: dict, *, adopt: bool, reason: str) -> dict:
    unit_id = jr["unit_id"]
    if _committed(sd, unit_id):
        remove_durably(sd / UNIT_JOURNAL)
        confirm.prune_inputs(sd, None)
        return {"unit_id": unit_id, "mode": jr.get("mode"), "committed": True, "restored": [], "restart": None}
    rec = _record(sd, unit_id)
    run = bool(rec.get("active_before"))
    restart = None if run else _restart(rec["service"], False)  # stopped while its unit is still known
    put = _put_back(sd, rec, adopt=adopt, keep_found=True)
    if put["kept_as_found"]:
        stack = _stack(state.load(sd))
        _adopt(sd, _record(sd, stack[-1]) if stack else None, put["kept_as_found"])
    _daemon_reload()
    if run:
        restart = _restart(rec["service"], True)
    _retire(sd, rec)
    remove_durably(sd / UNIT_JOURNAL)
    _forget(sd, rec)
    confirm.prune_inputs(sd, None)
    state.audit_best_effort(sd, operator=str(jr.get("operator", "?")), command=f"promote --mode {jr.get('mode')}",
                            release=None, result="undone", unit_id=unit_id, reason=reason)
    return {"unit_id": unit_id, "mode": jr.get("mode"), "reason": reason, "restart": restart, **put}


def undo_journal(sd: Path, *, adopt: bool = False, reason: str = "interrupted") -> dict | None:
    with confirm.guard(sd):
        return _undo_locked(sd, adopt=adopt, reason=reason)


# ---------------------------------------------------------------- inspect


def _release_info(sd: Path, sys_path: list | None = None) -> dict:
    st = state.load(sd)
    current = st.get("current")
    ddtree = False
    bundle_sha = None
    if current:
        ddtree = DDTREE_MODULE in (backup.read(sd, current).get("files") or {})
        bundle_sha = sha256_file(sd / RELEASES / safe_name(current, "release id") / "bundle.tar.gz")
    return {"current": current, "ddtree_payload": ddtree, "bundle_sha256": bundle_sha,
            "stale": _stale_info(sd, sys_path)}


def _stale_info(sd: Path, sys_path: list | None) -> dict | None:
    """Releases made for another SGLang than the installed one (stale.py): promote refuses such a host.
    Nothing is said when SGLang cannot be found here (the promote's own start check fails then)."""
    from . import stale
    from .layout import find_base

    try:
        version = find_base("sglang", sys_path)[0]
    except AgentError:
        return None
    old = stale.stale_releases(sd, version)
    return stale.describe(version, old) if old else None


FULL_MODE_PROBE = r"""
import importlib.util, json, sys
path, config = sys.argv[1], json.loads(sys.argv[2])
spec = importlib.util.spec_from_file_location("ddtree_utils_probe", path)
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod  # dataclasses look their module up there
spec.loader.exec_module(mod)
print(json.dumps({"refusal": mod.full_mode_refusal(config)}))
"""


# The base glue's own refusal of full mode (0.5.23: its tree step ran on the CPU only; 0.5.17 serves it, on the hybrid
# architectures proven on that worker: ddtree_v2_hybrid.kind_refusal). It imports the glue as the server would (through
# sglang, whose import is the slow part), so it runs only where the glue is installed and only for a full-mode
# promote. argv[1]: the target's config.json.
BASE_MODE_PROBE = r"""
import importlib.util, json, sys
from sglang.srt.speculative import ddtree_v2_args as glue
from sglang.srt.speculative.ddtree_utils import hybrid_kind
config = json.loads(sys.argv[1])
try:
    glue.refuse_unavailable("full")
except glue.DDTreeV2NotAvailable as exc:
    refusal = str(exc)
else:
    refusal, kind = None, hybrid_kind(config)
    if kind and importlib.util.find_spec("sglang.srt.speculative.ddtree_v2_hybrid"):
        from sglang.srt.speculative import ddtree_v2_hybrid as hybrid
        refusal = hybrid.kind_refusal(kind)
print(json.dumps({"refusal": refusal}))
"""


# The base glue's refusal of shadow-linear (ddtree_v2_args.shadow_refusal: a base whose own DFLASH tracks no recurrent
# state on a hybrid with the radix cache; 0.5.17 under payloads 0.8.12-0.8.14), over the unit's model path and radix
# flag, before the unit changes. argv[1]: {model_path,
# disable_radix_cache}. A payload older than the refusal has none to give.
SHADOW_MODE_PROBE = r"""
import json, sys, types
from sglang.srt.speculative import ddtree_v2_args as glue
args = json.loads(sys.argv[1])
refuse = getattr(glue, "shadow_refusal", None)
server_args = types.SimpleNamespace(speculative_ddtree_mode="shadow-linear", **args)
print(json.dumps({"refusal": refuse(server_args) if refuse else None}))
"""


def shadow_mode_check(model_path: str | None, disable_radix_cache: bool) -> dict:
    """The installed v2 glue's verdict on serving shadow-linear for the target (v1 serves it everywhere)."""
    if not model_path or not model_path.startswith("/"):
        return {"checked": False, "reason": "model_path is not a local directory on the host"}
    from .layout import find_base

    _, site = find_base("sglang")
    if not (site / V2_GLUE_MODULE).is_file():
        return {"checked": True, "refusal": None}
    probe = json.dumps({"model_path": model_path, "disable_radix_cache": bool(disable_radix_cache)})
    return _probe_verdict("probe", SHADOW_MODE_PROBE, probe)


def _probe_verdict(name: str, code: str, *argv: str) -> dict:
    """Run a probe (`python -c code argv...`, 120 s at most) that prints {"refusal": ...} last: its verdict, or why
    there is none."""
    proc = _run([sys.executable, "-c", code, *argv], 120)
    try:
        return {"checked": True, "refusal": json.loads(proc.stdout.strip().splitlines()[-1]).get("refusal")}
    except (ValueError, IndexError, AttributeError):
        return {"checked": False, "reason": f"{name} failed: {proc.stderr.strip()[-400:]}"}


def full_mode_check(model_path: str | None) -> dict:
    """The installed payload's own verdict on the target (full_mode_refusal over its config.json):
    the same words the worker would refuse with, before anything changes."""
    if not model_path or not model_path.startswith("/"):
        return {"checked": False, "reason": "model_path is not a local directory on the host"}
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        return {"checked": False, "reason": f"cannot read {model_path}/config.json: {exc}"}
    from .layout import find_base

    _, site = find_base("sglang")
    module = site / DDTREE_MODULE
    if not module.is_file():
        return {"checked": False, "reason": f"{module} is not installed"}
    verdict = _probe_verdict("probe", FULL_MODE_PROBE, str(module), json.dumps(config))
    if verdict["checked"] and not verdict["refusal"] and (site / V2_GLUE_MODULE).is_file():
        # The target allows full, but this base's payload may not serve it yet: refused here, before the
        # unit changes, with the words the server would refuse with at start.
        verdict = _probe_verdict("base probe", BASE_MODE_PROBE, json.dumps(config))
    return {**verdict, "model_type": config.get("model_type")} if verdict["checked"] else verdict


def op_unit_inspect(args: dict) -> dict:
    sd = statefs.state_dir(args)
    service = _service(args)
    unit_path, env_path = _abs(args, "unit_path"), _abs(args, "env_path")
    kind = str(args.get("kind") or "unit")
    try:
        installed = unit_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        installed = None
    st = state.load(sd)
    promotion = st.get("promotion") or {}
    stack = _stack(st)
    jr = read_json(sd / UNIT_JOURNAL)
    if isinstance(jr, dict) and not confirm.problem(jr.get("confirm")):
        jr = {**jr, "confirm_remaining_s": confirm.remaining_s(jr["confirm"])}
    out = {
        "service": show(service),
        # A unit written by hand may carry a token: what leaves the host is redacted.
        "installed_text": None if installed is None else redaction.redact_text(installed, _secret_values(env_path)),
        # The env file holds secrets: only whether it exists and its hash ever leave the host.
        "env_sha256": sha256_file(env_path),
        "release": _release_info(sd, args.get("sys_path")),
        "mode": st.get("mode"),
        "promotion": {k: promotion.get(k) for k in ("mode", "stack", "last", "passed")},
        "journal": jr,
        # With a stage in flight the files are that stage's: it is settled first, and unit_apply checks
        # for drift again after that, under the lock.
        "drift": drifted(_record(sd, stack[-1])) if stack and jr is None else [],
    }
    text = args.get("lint_text")
    if isinstance(text, str):
        out["lint"] = lint(service, kind, text)
    mode = args.get("mode")
    if mode and (promotion.get("passed") or {}).get("shadow-linear"):
        out["shadow_linear_canary"] = read_json(sd / PROMOTION_DIR / "canary-shadow-linear.json")
    if args.get("model_path") and mode == "full":
        out["full_mode"] = full_mode_check(str(args["model_path"]))
    elif args.get("model_path") and mode == "shadow-linear":
        out["shadow_mode"] = shadow_mode_check(str(args["model_path"]), bool(args.get("disable_radix_cache")))
    return out


# ---------------------------------------------------------------- apply


def _backup(sd: Path, unit_id: str, files: list, service: str, mode: str, from_mode: str | None,
            active_before: bool) -> dict:
    """units/<id>/: the files the stage replaces (the env file's copy beside it, 0600) and the hashes
    of what it will write, written before anything changes."""
    final = _unit_dir(sd, unit_id)
    tmp = final.with_name(f".{unit_id}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "files").mkdir(parents=True)
    entries = []
    for kind, path, data in files:
        before = sha256_file(path)
        keep = final / "files" / "unit" if kind == "unit" else env_backup_path(path, unit_id)
        entry = {"kind": kind, "path": str(path), "before": before, "after": sha256_bytes(data), "backup": None,
                 "mode": None}
        if before is not None:
            entry["backup"] = str(keep)
            entry["mode"] = os.stat(path).st_mode & 0o7777
            staged = tmp / "files" / keep.name if keep.is_relative_to(final) else keep
            staged.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            copy_file_atomic(path, staged, mode=0o600)
            if sha256_file(staged) != before:
                raise AgentError("backup_failed", f"backup of {path} does not verify", "it changed while copying")
        entries.append(entry)
    record = {"unit_id": unit_id, "service": service, "mode": mode, "from_mode": from_mode,
              "active_before": active_before, "time": state.now_iso(), "files": entries}
    write_json_atomic(tmp / "record.json", record)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    return record


def _prune_orphans(sd: Path, env_path: Path, keep: list) -> None:
    """Under the lock, with no stage in flight: every stage record and kept env file that is not on the
    stack is what a crash left (a stage retired but not yet forgotten, an install killed before its
    journal): it goes, a kept env file first of all (it may hold a rotated secret)."""
    try:
        entries = [e for e in (sd / UNITS).iterdir() if not e.name.startswith(".")]
    except FileNotFoundError:
        entries = []
    for entry in entries:
        if entry.name not in keep:
            rec = read_json(entry / "record.json") if entry.is_dir() else None
            if isinstance(rec, dict) and not _record_problem(rec):
                _forget(sd, rec)
            shutil.rmtree(entry, ignore_errors=True)
    folder = env_path.parent / ENV_BACKUP_DIR
    if folder.is_dir() and not folder.is_symlink():
        for entry in folder.iterdir():
            if entry.is_file() and not entry.is_symlink() and entry.name.split(".", 1)[0] not in keep:
                remove_durably(entry)


def op_unit_apply(args: dict) -> dict:
    """Install a stage, commit-confirmed: backup, journal with its confirm deadline, the watchdog that
    enforces it, then unit + env file, daemon-reload and a queued restart."""
    sd = statefs.state_dir(args)
    service = _service(args)
    unit_path, env_path = _abs(args, "unit_path"), _abs(args, "env_path")
    kind, mode = str(args.get("kind") or "unit"), str(args.get("mode") or "")
    text, env_text = args.get("unit_text"), args.get("env_text")
    if not isinstance(text, str) or not isinstance(env_text, str) or not mode:
        raise AgentError("bad_request", "unit_text, env_text and mode are required")
    window, hard = float(args.get("confirm_window_s") or 0), float(args.get("confirm_hard_s") or 0)
    operator, adopt = str(args.get("operator", "?")), bool(args.get("adopt"))
    with lock.held(sd, args.get("lock_id"), who=operator, command=f"promote --mode {mode}"):
        recovered = undo_journal(sd, adopt=adopt, reason="left in flight by an earlier run")
        checked = lint(service, kind, text)
        if not checked["ok"]:
            state.audit_best_effort(sd, operator=operator, command=f"promote --mode {mode}", release=None,
                                    result="lint-failed")
            raise AgentError("unit_lint_failed", f"the rendered unit for {service} fails systemd-analyze verify: "
                             + " | ".join(checked["warnings"][:5]), "nothing was installed; fix the inventory value "
                             "or template it names", lint=checked)
        st = state.load(sd)
        stack = _stack(st)
        if stack and not adopt:
            _refuse_drift(_record(sd, stack[-1]), "promote")
        _prune_orphans(sd, env_path, stack)
        active_before = show(service).get("ActiveState") in _ACTIVE
        unit_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}-{mode}"
        rec = _backup(sd, unit_id, [("unit", unit_path, text.encode()), ("env", env_path, env_text.encode())],
                      service, mode, st.get("mode"), active_before)
        _kill_point("after_backup", args)
        # The watchdog first: no journal (and so no change) ever exists without one. It waits a
        # moment for the journal; an install that dies before writing it changed nothing.
        confirm.arm(window, hard)  # refuses a bad window before anything starts
        try:
            confirm.start_watchdog(sd, unit_id, service)
        except AgentError:
            _forget(sd, rec)
            raise
        _kill_point("after_watchdog", args)
        jr = {"unit_id": unit_id, "mode": mode, "operator": operator, "started": state.now_iso(),
              "confirm": confirm.arm(window, hard), "watchdog": confirm.unit_name(unit_id),
              "files": [{"path": str(unit_path)}, {"path": str(env_path)}]}
        with confirm.guard(sd):
            write_json_atomic(sd / UNIT_JOURNAL, jr)
        _kill_point("after_journal", args)
        env_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_bytes_atomic(env_path, env_text.encode(), mode=0o600)
        unit_path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_bytes_atomic(unit_path, text.encode(), mode=0o644)
        _kill_point("after_write", args)
        _daemon_reload()
        _kill_point("after_reload", args)
        restart = _restart(service, True)
        _kill_point("after_restart", args)
    return {"unit_id": unit_id, "restart": restart, "lint": checked, "recovered": recovered,
            "confirm": {"window_s": window, "hard_s": hard, "watchdog": jr["watchdog"]},
            "backup": [{k: f[k] for k in ("path", "before")} for f in rec["files"]]}


# ---------------------------------------------------------------- confirm: heartbeat and watchdog


def op_heartbeat(args: dict) -> dict:
    """The control side is alive: refresh its lock, and renew the confirm deadline of its stage in
    flight (up to the stage's hard limit; `pause` once past it, on the operator's word)."""
    sd = statefs.state_dir(args, scan_tree=False)
    lock.check(sd, str(args.get("lock_id") or ""))
    unit_id = args.get("unit_id")
    if not unit_id:
        return {"lock": "held"}
    with confirm.guard(sd):
        jr = read_json(sd / UNIT_JOURNAL)
        if not isinstance(jr, dict) or jr.get("unit_id") != unit_id:
            return {"lock": "held", "stage": "gone"}
        why = confirm.expired(jr.get("confirm"))
        if why:
            return {"lock": "held", "stage": "expired", "reason": why}
        jr["confirm"] = confirm.renewed(jr["confirm"], float(args.get("extend_s") or 0), past_hard=bool(args.get("pause")))
        write_json_atomic(sd / UNIT_JOURNAL, jr)
        return {"lock": "held", "stage": "pending", "remaining_s": confirm.remaining_s(jr["confirm"])}


def _stop_unconfirmed(sd: Path, jr: dict, failure: AgentError) -> dict:
    """The stage could not be undone (its backup is gone): stop it rather than leave an unconfirmed unit
    serving, and leave the journal for the next run to report with its repair."""
    rec = read_json(_unit_dir(sd, str(jr["unit_id"])) / "record.json")
    service = rec.get("service") if isinstance(rec, dict) else None
    stopped = _restart(service, False) if isinstance(service, str) and _UNIT_NAME.fullmatch(service) else None
    state.audit_best_effort(sd, operator="watchdog", command=f"promote --mode {jr.get('mode')}", release=None,
                            result="undo-failed-stopped", unit_id=jr["unit_id"], reason=failure.message)
    return {"outcome": "stopped", "error": failure.to_dict(), "stopped": stopped}


def op_unit_watch(args: dict) -> dict:
    """The confirm watchdog (a transient systemd service): wait until the stage is settled, or undo it
    at its deadline."""
    sd = statefs.state_dir(args, scan_tree=False)
    unit_id = safe_name(str(args.get("unit_id") or ""), "unit id")
    started = time.monotonic()
    while True:
        with confirm.guard(sd):
            outcome, pause = _watch_once(sd, unit_id, time.monotonic() - started)
        if outcome is not None:
            break
        time.sleep(pause)
    confirm.finish_watchdog(sd, unit_id)
    return {"unit_id": unit_id, **outcome}


def _watch_once(sd: Path, unit_id: str, waited_s: float) -> tuple[dict | None, float]:
    """One look (under confirm.guard): the outcome once the stage is settled, else how long to sleep."""
    try:
        jr = read_json(sd / UNIT_JOURNAL)
    except AgentError as exc:
        # Unreadable: it proves no deadline, so the stage is undone (the damaged file is kept).
        from . import repair

        repair.set_aside(sd / UNIT_JOURNAL)
        jr = {"unit_id": unit_id, "operator": "watchdog", "confirm": None, "damaged": exc.message}
    if jr is None and waited_s < confirm.JOURNAL_GRACE_S:
        return None, 0.2  # its install has not written the journal yet
    if not isinstance(jr, dict) or jr.get("unit_id") != unit_id:
        return {"outcome": "settled"}, 0.0
    why = confirm.expired(jr.get("confirm"))
    if why:
        try:
            return {"outcome": "undone", "undone": _undo_stage(sd, jr, adopt=False, reason=why)}, 0.0
        except AgentError as exc:
            return _stop_unconfirmed(sd, jr, exc), 0.0
    return None, max(0.2, min(1.0, confirm.remaining_s(jr["confirm"])))


# ---------------------------------------------------------------- ready


def _http_status(url: str, timeout: float) -> tuple:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - http to the local server
            return resp.status, None
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def op_unit_wait(args: dict) -> dict:
    """The ready probe on the host: /health_generate answers 200 within timeout_s while the unit stays
    up. With after_invocation, only a new invocation of the unit counts (a queued restart may not have
    stopped the old process yet). A unit that fails (failed — e.g. its crash loop hit the start limit —
    or stopped) fails at once, with the journal since the (re)start."""
    service = _service(args)
    url = str(args.get("url") or "")
    if not re.fullmatch(r"http://[A-Za-z0-9.:\[\]%-]+:[0-9]{1,5}/[A-Za-z0-9_/]*", url):
        raise AgentError("bad_request", f"bad url {url!r}")
    timeout_s = float(args.get("timeout_s") or 600)
    # With a queued restart: first the old process stops (up to its TimeoutStopSec), and only then
    # does the new invocation's start timeout begin.
    stop_s = float(args.get("stop_timeout_s") or 0)
    env_path = _abs(args, "env_path") if args.get("env_path") else None
    since = args.get("since")
    old = args.get("after_invocation")
    notes = []
    started = began = time.monotonic()
    props = show(service)
    if args.get("start_if_inactive") and props.get("ActiveState") not in _ACTIVE:
        if props.get("LoadState") != "loaded":
            raise AgentError("unit_missing", f"{service} is {props.get('LoadState')} on this host",
                             "install the service, or let promote install its own unit (`unit_kind: unit`)")
        notes.append(f"{service} was {props.get('ActiveState')}/{props.get('SubState')}: started it as it is")
        since = since or time.time()
        old = props.get("InvocationID") or ""
        systemctl("reset-failed", "--", service)
        systemctl("start", "--no-block", "--", service)
    polls, last_http, last_error = 0, None, None

    def answer(ready: bool, **extra: object) -> dict:
        out = {"ready": ready, "seconds": round(time.monotonic() - started, 2), "polls": polls, "unit": props,
               "notes": notes, "since": since, **extra}
        if not ready:
            out.update(last_http=last_http, last_error=last_error, journal=journal_excerpt(service, since, env_path))
        return out

    while True:
        polls += 1
        props = show(service)
        active = props.get("ActiveState")
        new = old is None or props.get("InvocationID") != old
        if not new:
            began = time.monotonic()
        # A crash with restarts left is systemd's to retry (activating/auto-restart); once the start
        # limit is hit the unit is `failed` (Result=start-limit-hit), and a unit that stopped is
        # `inactive`: both end the wait at once, once it is the new invocation that ended.
        if new and active in ("failed", "inactive"):
            return answer(False, failed=True, reason=f"unit {active}/{props.get('SubState')} (result "
                          f"{props.get('Result')}, exit {props.get('ExecMainCode')}/{props.get('ExecMainStatus')}, "
                          f"restarts {props['NRestarts']})")
        if new and active == "active":
            last_http, last_error = _http_status(url, 5.0)
            if last_http == 200:
                return answer(True, invocation=props.get("InvocationID"))
        if not new and time.monotonic() - started > stop_s + timeout_s:
            return answer(False, failed=False, reason=f"the restart did not begin within {stop_s + timeout_s:.0f}s "
                          f"(the old process still {active})")
        if new and time.monotonic() - began > timeout_s:
            return answer(False, failed=False, reason=f"not ready within {timeout_s:.0f}s: no 200 from "
                          f"/health_generate (last: {last_http or last_error or active})")
        time.sleep(0.5)


# ---------------------------------------------------------------- commit / restore


def _write_evidence(sd: Path, evidence: object, mode: str, result: str) -> str | None:
    if not isinstance(evidence, dict):
        return None
    name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}-{mode}-{result}.json"
    path = sd / EVIDENCE_DIR / name
    path.parent.mkdir(mode=0o700, exist_ok=True)
    write_bytes_atomic(path, (json.dumps(evidence, indent=2, sort_keys=True) + "\n").encode(), mode=0o600)
    return str(path)


def _set_last(st: dict, *, mode: str, result: str, record: dict, evidence_path: str | None) -> None:
    promo = st.setdefault("promotion", {})
    promo["last"] = {"mode": mode, "result": result, "time": state.now_iso(), "evidence": evidence_path,
                     **{k: record.get(k) for k in ("gates", "accept_length", "failed_gate", "reason")}}
    st.setdefault("history", []).append({"time": state.now_iso(), "operator": record.get("operator", "?"),
                                         "action": f"promote {mode}", "release": st.get("current"),
                                         "from": promo.get("mode"), "result": result})


def op_unit_commit(args: dict) -> dict:
    """The stage passed its gates: confirm it before its deadline (stack, mode, verdicts, canary, the
    release it passed on) and drop the journal. Past its deadline the stage is undone instead."""
    sd = statefs.state_dir(args)
    operator = str(args.get("operator", "?"))
    unit_id, mode = str(args.get("unit_id") or ""), str(args.get("mode") or "")
    record = args.get("record") if isinstance(args.get("record"), dict) else {}
    with lock.held(sd, args.get("lock_id"), who=operator, command=f"promote --mode {mode}"), confirm.guard(sd):
        jr = read_json(sd / UNIT_JOURNAL)
        if not isinstance(jr, dict) or jr.get("unit_id") != unit_id:
            raise AgentError("stage_gone", f"stage {unit_id} is no longer in flight here (journal: "
                             f"{jr.get('unit_id') if isinstance(jr, dict) else None}): its confirm deadline passed "
                             "and the host put its previous unit back, or another run undid it", "re-run promote")
        why = confirm.expired(jr.get("confirm"))
        if why:
            undone = _undo_locked(sd, reason=why)
            raise AgentError("confirm_expired", f"stage {unit_id} was {why}: undone, the previous unit is back",
                             "re-run promote (a slow start or gate needs a larger confirm_timeout_s)", undone=undone)
        evidence_path = _write_evidence(sd, args.get("evidence"), mode, "passed")
        canary = args.get("canary")
        if isinstance(canary, dict):
            write_json_atomic(sd / PROMOTION_DIR / f"canary-{safe_name(mode, 'mode')}.json", canary)
        _kill_point("after_evidence", args)
        release = _release_info(sd)

        def change(st: dict) -> None:
            _set_last(st, mode=mode, result="passed", record={**record, "operator": operator},
                      evidence_path=evidence_path)
            promo = st["promotion"]
            promo.setdefault("stack", []).append(unit_id)
            promo.setdefault("stages", {})[unit_id] = {"mode": mode, "from_mode": st.get("mode"), "time": state.now_iso()}
            promo.setdefault("passed", {})[mode] = {"time": state.now_iso(), "unit_id": unit_id,
                                                   "accept_length": record.get("accept_length"),
                                                   "release": release["current"],
                                                   "bundle_sha256": release["bundle_sha256"]}
            promo["mode"] = st["mode"] = mode

        state.update(sd, change)  # the commit point
        _kill_point("after_state", args)
        remove_durably(sd / UNIT_JOURNAL)
        confirm.prune_inputs(sd, None)  # the watchdog sees the stage settled and ends by itself
        state.audit_best_effort(sd, operator=operator, command=f"promote --mode {mode}", release=None,
                                result="passed", unit_id=unit_id)
    return {"unit_id": unit_id, "mode": mode, "evidence": evidence_path}


def _prune_env_backups(env_path: Path) -> list:
    """rollback --to pristine: every kept env file goes (a rotated token must not outlive it)."""
    gone = []
    folder = env_path.parent / ENV_BACKUP_DIR
    if folder.is_dir() and not folder.is_symlink():
        for entry in folder.iterdir():
            if entry.is_file() and not entry.is_symlink():
                remove_durably(entry)
                gone.append(str(entry))
        if not any(folder.iterdir()):
            os.rmdir(folder)
    return gone


def op_unit_restore(args: dict) -> dict:
    """journal: undo the stage in flight (a failed gate); previous: undo the last passed stage;
    pristine: every stage, back to the unit as it was before ddtree-ops touched it. pristine needs no
    state.json: a damaged one is left to the release rollback that follows (it sets it aside), and the
    stages come from their records on disk."""
    sd = statefs.state_dir(args)
    operator = str(args.get("operator", "?"))
    to = str(args.get("to") or "journal")
    if to not in ("journal", "previous", "pristine"):
        raise AgentError("bad_request", f"unknown restore target {to!r}")
    restart, adopt = args.get("restart", True), bool(args.get("adopt"))
    env_path = _abs(args, "env_path") if args.get("env_path") else None
    with lock.held(sd, args.get("lock_id"), who=operator, command=f"unit restore --to {to}"):
        if to == "journal":
            with confirm.guard(sd):
                jr = read_json(sd / UNIT_JOURNAL)
                if not isinstance(jr, dict):
                    # The mode says whether ddtree-ops manages the service (a release rollback then restarts it).
                    return {"noop": True, "message": "no stage in flight (its confirm deadline may have undone it "
                            "already)", "mode": state.load(sd).get("mode")}
                mode = str(jr.get("mode"))
                # What the stage's server said, before its unit goes (evidence for any failed gate).
                excerpt = journal_excerpt(_service(args), args.get("since"), env_path) if args.get("service") else None
                undone = _undo_locked(sd, adopt=adopt, reason=str(args.get("reason") or "a gate did not pass"))
            if undone and undone.get("committed"):  # its commit had landed: nothing to undo
                return {"noop": True, "committed": True, "to": to, "undone": undone, "mode": mode}
            evidence = args.get("evidence")
            if isinstance(evidence, dict):
                evidence = {**evidence, "journal": excerpt}
            evidence_path = _write_evidence(sd, evidence, mode, "rolled-back")
            record = args.get("evidence") if isinstance(args.get("evidence"), dict) else {}
            state.update(sd, lambda s: _set_last(s, mode=mode, result="rolled-back",
                                                 record={**(record.get("summary") or {}), "operator": operator},
                                                 evidence_path=evidence_path))
            restarted = (undone or {}).get("restart")
            return {"noop": False, "to": to, "undone": undone, "mode": state.load(sd).get("mode"),
                    "evidence": evidence_path, "since": restarted["since"] if restarted else None,
                    "restart": restarted, "journal": excerpt}
        recovered = undo_journal(sd, adopt=adopt, reason="left in flight by an earlier run")
        try:
            st: dict | None = state.load(sd)
        except AgentError:
            if to != "pristine":
                raise
            st = None  # the release rollback --to pristine that follows sets the damaged file aside
        if st is not None:
            stack = _stack(st)
            records = [_record(sd, uid) for uid in reversed(stack[-1:] if to == "previous" else stack)]
        else:
            records = list(reversed(_records_on_disk(sd)))
        pruned = _prune_env_backups(env_path) if to == "pristine" and env_path and not records else []
        if not records:
            return {"noop": True, "to": to, "message": "no promoted unit to restore", "recovered": recovered,
                    "mode": st.get("mode") if st else None, "env_backups_removed": pruned}
        if not adopt:
            _refuse_drift(records[0], "rollback")
        bottom = records[-1]
        mode_now = bottom.get("from_mode")
        # Undoing a stage returns to a unit that was serving; pristine may mean "nothing ran here",
        # and then the service stops before its unit goes (a removed unit cannot be stopped by name
        # cleanly once systemd forgot it).
        run = bool(bottom.get("active_before")) if to == "pristine" else True
        restarted = None if run else _restart(bottom["service"], False)
        put = {"restored": [], "kept_as_found": [], "found_kept": []}
        for i, rec in enumerate(records):  # newest first: the oldest backup's bytes are the last written
            for k, v in _put_back(sd, rec, adopt=adopt, keep_found=i == 0).items():
                put[k] += v
        _daemon_reload()
        if run and restart:
            restarted = _restart(bottom["service"], True)
        for rec in records:
            _retire(sd, rec)
        popped = [r["unit_id"] for r in records]
        remaining = [u for u in (_stack(st) if st is not None else []) if u not in popped]
        _adopt(sd, _record(sd, remaining[-1]) if remaining else None, put["kept_as_found"])

        def change(s: dict) -> None:
            promo = s.setdefault("promotion", {})
            promo["stack"] = [u for u in _stack(s) if u not in popped]
            promo["mode"] = s["mode"] = mode_now
            if to == "pristine":
                promo["passed"] = {}
            else:
                (promo.get("passed") or {}).pop(records[0].get("mode"), None)
            s.setdefault("history", []).append({"time": state.now_iso(), "operator": operator,
                                                "action": f"unit rollback --to {to}", "release": s.get("current"),
                                                "from": records[0].get("mode"), "result": mode_now or "pristine"})

        if st is not None:
            state.update(sd, change)
        for rec in records:
            _forget(sd, rec)
        if to == "pristine" and env_path is not None:
            pruned = _prune_env_backups(env_path)
        state.audit_best_effort(sd, operator=operator, command=f"rollback --to {to}", release=None,
                                result="unit-restored", units=popped, mode=mode_now)
    return {"noop": False, "to": to, "popped": popped, "mode": mode_now, "should_run": run, **put,
            "restart": restarted, "since": restarted["since"] if restarted else None, "recovered": recovered,
            "env_backups_removed": pruned, "state_damaged": st is None}


def op_unit_recover(args: dict) -> dict:
    """For unlock (and anyone else): settle a stage a dead run left in flight."""
    sd = statefs.state_dir(args)
    with lock.held(sd, args.get("lock_id"), who=str(args.get("operator", "?")), command="unit recover"):
        return {"recovered": undo_journal(sd, adopt=bool(args.get("adopt")), reason="left in flight by a dead run")}


def op_unit_service(args: dict) -> dict:
    """Restart (or stop) the service as its unit stands now: after a release rollback changed files."""
    service = _service(args)
    sd = statefs.state_dir(args)
    with lock.held(sd, args.get("lock_id"), who=str(args.get("operator", "?")), command="restart"):
        run = bool(args.get("run", True))
        if run and show(service).get("LoadState") != "loaded":
            return {"noop": True, "message": f"{service} has no unit here: nothing to restart", "since": None}
        return {"noop": False, **_restart(service, run)}

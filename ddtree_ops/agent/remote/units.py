"""Agent ops for the serving unit that promote manages (stdlib only).

Files (beside the release files, in the same state dir):
    units/<unit_id>/record.json     what a stage replaced: per file its sha256 before (null: absent)
    units/<unit_id>/files/unit      the replaced unit (or drop-in); the replaced env file is kept
                                    beside it (<env dir>/.ddtree-ops-backup/<unit_id>.env, 0600):
                                    secrets never enter the state dir
    units-journal.json              present only while a stage is in flight (installed, gates not
                                    yet passed): an interrupted promote is *undone* from it by the
                                    next promote, rollback or unlock (its gates never passed)
    promotion/canary-<mode>.json    the canary prompts and greedy outputs a passed stage served
    evidence/<time>-<mode>-<result>.json   gate inputs and verdicts (the control side sends no secrets)

state.json gets one key of its own, `promotion` (plus the existing `mode`):
    {"mode", "stack": [unit_id...], "stages": {unit_id: {mode, from_mode, time}},
     "last": {mode, result, time, gates, accept_length, evidence}, "passed": {mode: {...}}}

Every change is backup first, then journal, then files (temp + fsync + rename), then
daemon-reload; undo is the same in reverse and idempotent, so a re-run converges.
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

from . import backup, lock, state, statefs
from .atomic import (
    AgentError,
    copy_file_atomic,
    remove_durably,
    sha256_file,
    write_bytes_atomic,
    write_json_atomic,
)
from .layout import safe_name

UNITS = "units"
UNIT_JOURNAL = "units-journal.json"
PROMOTION_DIR = "promotion"
EVIDENCE_DIR = "evidence"
KILL_ENV = "DDTREE_OPS_TEST_KILL_UNIT_AT"
DDTREE_MODULE = "sglang/srt/speculative/ddtree_utils.py"
SHOW_PROPERTIES = ("LoadState", "ActiveState", "SubState", "Result", "NRestarts", "FragmentPath", "DropInPaths",
                   "ExecMainStatus", "ExecMainCode", "UnitFileState")
TOOL_TIMEOUT_S = 120
JOURNAL_TAIL = 8000
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.@\\-]{1,240}\.service")


# ---------------------------------------------------------------- small helpers


def _service(args: dict) -> str:
    name = args.get("service")
    if not isinstance(name, str) or not _UNIT_NAME.fullmatch(name) or name.startswith("-"):
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
        text = env_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    values = []
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            raw = line.split("=", 1)[1].strip()
            if len(raw) >= 2 and raw[0] == raw[-1] == '"':
                raw = re.sub(r'\\([\\"$`])', r"\1", raw[1:-1])
            if raw:
                values.append(raw)
    return values


def redact(text: str, secrets: list) -> str:
    for s in secrets:
        text = text.replace(s, "[secret]")
    return text


def journal_excerpt(service: str, since: float | None, env_path: Path | None) -> str:
    argv = ["journalctl", "--no-pager", "-o", "short-iso", "-n", "200", "-u", service]
    if since:
        argv += ["--since", f"@{int(since)}"]
    try:
        proc = _run(argv, 30)
        text = (proc.stdout or proc.stderr)[-JOURNAL_TAIL:]
    except AgentError as exc:
        text = exc.message
    return redact(text, _secret_values(env_path))


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


# ---------------------------------------------------------------- inspect


def read_json(path: Path) -> object:
    """A promote state file (journal, stage record, canary), never through a link; None when absent
    (no stage in flight, none recorded), statefs.damaged() naming the file and its repair when unreadable."""
    try:
        return statefs.read_json(path, f"the promote file {path.name}", statefs.REPAIR_UNLOCK)
    except FileNotFoundError:
        return None


def _release_info(sd: Path) -> dict:
    st = state.load(sd)
    current = st.get("current")
    ddtree = False
    if current:
        ddtree = DDTREE_MODULE in (backup.read(sd, current).get("files") or {})
    return {"current": current, "ddtree_payload": ddtree}


FULL_MODE_PROBE = r"""
import importlib.util, json, sys
path, config = sys.argv[1], json.loads(sys.argv[2])
spec = importlib.util.spec_from_file_location("ddtree_utils_probe", path)
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod  # dataclasses look their module up there
spec.loader.exec_module(mod)
print(json.dumps({"refusal": mod.full_mode_refusal(config)}))
"""


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
    proc = _run([sys.executable, "-c", FULL_MODE_PROBE, str(module), json.dumps(config)], 120)
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"checked": False, "reason": f"probe failed: {proc.stderr.strip()[-400:]}"}
    return {"checked": True, "refusal": answer.get("refusal"), "model_type": config.get("model_type")}


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
    out = {
        "service": show(service),
        "installed_text": installed,
        # The env file holds secrets: only whether it exists and its hash ever leave the host.
        "env_sha256": sha256_file(env_path),
        "release": _release_info(sd),
        "mode": st.get("mode"),
        "promotion": {k: promotion.get(k) for k in ("mode", "stack", "last", "passed")},
        "journal": read_json(sd / UNIT_JOURNAL),
    }
    text = args.get("lint_text")
    if isinstance(text, str):
        out["lint"] = lint(service, kind, text)
    mode = args.get("mode")
    if mode and (promotion.get("passed") or {}).get("shadow-linear"):
        out["shadow_linear_canary"] = read_json(sd / PROMOTION_DIR / "canary-shadow-linear.json")
    if args.get("model_path"):
        out["full_mode"] = full_mode_check(str(args["model_path"]))
    return out


# ---------------------------------------------------------------- apply / undo


def _unit_dir(sd: Path, unit_id: str) -> Path:
    return sd / UNITS / safe_name(unit_id, "unit id")


def env_backup_path(env_path: Path, unit_id: str) -> Path:
    """Where the replaced env file is kept: beside it, in its own 0700 directory, never in the state
    dir (the env file holds secrets, and nothing in the state dir may)."""
    return env_path.parent / ".ddtree-ops-backup" / f"{safe_name(unit_id, 'unit id')}.env"


def _backup(sd: Path, unit_id: str, unit_path: Path, env_path: Path, service: str, mode: str,
            from_mode: str | None, active_before: bool) -> dict:
    """units/<id>/: the unit file the stage replaces (and where the env file's copy went), written
    before anything changes."""
    final = _unit_dir(sd, unit_id)
    tmp = final.with_name(f".{unit_id}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "files").mkdir(parents=True)
    files = []
    for path, keep in ((unit_path, final / "files" / "unit"), (env_path, env_backup_path(env_path, unit_id))):
        before = sha256_file(path)
        entry = {"path": str(path), "before": before, "backup": None, "mode": None}
        if before is not None:
            entry["backup"] = str(keep)
            entry["mode"] = os.stat(path).st_mode & 0o7777
            staged = tmp / "files" / keep.name if keep.is_relative_to(final) else keep
            staged.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            copy_file_atomic(path, staged, mode=0o600)
            if sha256_file(staged) != before:
                raise AgentError("backup_failed", f"backup of {path} does not verify", "it changed while copying")
        files.append(entry)
    record = {"unit_id": unit_id, "service": service, "mode": mode, "from_mode": from_mode,
              "active_before": active_before, "time": state.now_iso(), "files": files}
    write_json_atomic(tmp / "record.json", record)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    return record


def _record(sd: Path, unit_id: str) -> dict:
    rec = read_json(_unit_dir(sd, unit_id) / "record.json")
    if not isinstance(rec, dict) or not isinstance(rec.get("files"), list):
        raise AgentError("unit_backup_missing", f"unit backup {unit_id} is missing or damaged in {sd / UNITS}",
                         "inspect the state dir; the unit cannot be restored from it")
    return rec


def _put_back(sd: Path, rec: dict) -> list:
    """Every file of a record to its before bytes (absent: removed); idempotent, verified."""
    restored = []
    for f in rec["files"]:
        path = Path(f["path"])
        if sha256_file(path) == f["before"]:
            continue
        if f["before"] is None:
            remove_durably(path)
        else:
            copy_file_atomic(f["backup"], path, mode=f.get("mode"))
            if sha256_file(path) != f["before"]:
                raise AgentError("verify_failed", f"{path} does not hash to its backup after restoring")
        restored.append(str(path))
    return restored


def _restart(service: str, run: bool) -> dict:
    """Start the (restored or new) unit afresh, or stop it when nothing should run."""
    since = time.time()
    systemctl("reset-failed", "--", service)
    if run:
        proc = systemctl("restart", "--", service, timeout=300)
    else:
        proc = systemctl("stop", "--", service, timeout=300)
    return {"action": "restart" if run else "stop", "since": since, "returncode": proc.returncode,
            "message": proc.stderr.strip()[-500:]}


def undo_journal(sd: Path) -> dict | None:
    """Undo a stage left in flight (installed, its gates never passed); None when none is."""
    jr = read_json(sd / UNIT_JOURNAL)
    if not isinstance(jr, dict):
        return None
    rec = _record(sd, jr["unit_id"])
    restored = _put_back(sd, rec)
    _daemon_reload()
    restart = _restart(rec["service"], bool(rec.get("active_before")))
    remove_durably(sd / UNIT_JOURNAL)
    state.audit_best_effort(sd, operator=str(jr.get("operator", "?")), command=f"promote --mode {jr.get('mode')}",
                            release=None, result="undone", unit_id=jr["unit_id"])
    return {"unit_id": jr["unit_id"], "mode": jr.get("mode"), "restored": restored, "restart": restart}


def op_unit_apply(args: dict) -> dict:
    sd = statefs.state_dir(args)
    service = _service(args)
    unit_path, env_path = _abs(args, "unit_path"), _abs(args, "env_path")
    kind, mode = str(args.get("kind") or "unit"), str(args.get("mode") or "")
    text, env_text = args.get("unit_text"), args.get("env_text")
    if not isinstance(text, str) or not isinstance(env_text, str) or not mode:
        raise AgentError("bad_request", "unit_text, env_text and mode are required")
    operator = str(args.get("operator", "?"))
    with lock.held(sd, args.get("lock_id"), who=operator, command=f"promote --mode {mode}"):
        recovered = undo_journal(sd)
        checked = lint(service, kind, text)
        if not checked["ok"]:
            state.audit_best_effort(sd, operator=operator, command=f"promote --mode {mode}", release=None,
                                    result="lint-failed")
            raise AgentError("unit_lint_failed", f"the rendered unit for {service} fails systemd-analyze verify: "
                             + " | ".join(checked["warnings"][:5]), "nothing was installed; fix the inventory value "
                             "or template it names", lint=checked)
        st = state.load(sd)
        before = show(service)
        active_before = before.get("ActiveState") in ("active", "activating", "reloading")
        unit_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}-{mode}"
        rec = _backup(sd, unit_id, unit_path, env_path, service, mode, st.get("mode"), active_before)
        jr = {"unit_id": unit_id, "mode": mode, "operator": operator, "started": state.now_iso(),
              "files": [{"path": str(unit_path), "after": None}, {"path": str(env_path), "after": None}]}
        write_json_atomic(sd / UNIT_JOURNAL, jr)
        _kill_point("after_journal", args)
        env_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_bytes_atomic(env_path, env_text.encode(), mode=0o600)
        unit_path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_bytes_atomic(unit_path, text.encode(), mode=0o644)
        _kill_point("after_write", args)
        _daemon_reload()
        restart = _restart(service, True)
    return {"unit_id": unit_id, "restart": restart, "lint": checked, "recovered": recovered,
            "backup": [{k: f[k] for k in ("path", "before")} for f in rec["files"]]}


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
    up. A unit that fails (failed — e.g. its crash loop hit the start limit — or stopped) fails at
    once, with the journal since the (re)start."""
    service = _service(args)
    url = str(args.get("url") or "")
    if not re.fullmatch(r"http://[A-Za-z0-9.:\[\]%-]+:[0-9]{1,5}/[A-Za-z0-9_/]*", url):
        raise AgentError("bad_request", f"bad url {url!r}")
    timeout_s = float(args.get("timeout_s") or 600)
    env_path = _abs(args, "env_path") if args.get("env_path") else None
    since = args.get("since")
    notes = []
    started = time.monotonic()
    props = show(service)
    if args.get("start_if_inactive") and props.get("ActiveState") not in ("active", "activating", "reloading"):
        if props.get("LoadState") != "loaded":
            raise AgentError("unit_missing", f"{service} is {props.get('LoadState')} on this host",
                             "install the service, or let promote install its own unit (`unit_kind: unit`)")
        notes.append(f"{service} was {props.get('ActiveState')}/{props.get('SubState')}: started it as it is")
        since = since or time.time()
        systemctl("reset-failed", "--", service)
        systemctl("start", "--", service, timeout=300)
    polls, last_http, last_error = 0, None, None
    while True:
        polls += 1
        props = show(service)
        active = props.get("ActiveState")
        # A crash with restarts left is systemd's to retry (activating/auto-restart); once the start
        # limit is hit the unit is `failed` (Result=start-limit-hit), and a unit that stopped is
        # `inactive`: both end the wait at once.
        if active in ("failed", "inactive"):
            reason = (f"unit {active}/{props.get('SubState')} (result {props.get('Result')}, "
                      f"exit {props.get('ExecMainCode')}/{props.get('ExecMainStatus')}, restarts {props['NRestarts']})")
            return {"ready": False, "failed": True, "reason": reason, "seconds": round(time.monotonic() - started, 2),
                    "polls": polls, "unit": props, "notes": notes, "last_http": last_http, "last_error": last_error,
                    "journal": journal_excerpt(service, since, env_path)}
        last_http, last_error = _http_status(url, 5.0)
        if last_http == 200:
            return {"ready": True, "seconds": round(time.monotonic() - started, 2), "polls": polls, "unit": props,
                    "notes": notes, "since": since}
        if time.monotonic() - started > timeout_s:
            return {"ready": False, "failed": False, "reason": f"no 200 from /health_generate within {timeout_s:.0f}s "
                    f"(last: {last_http or last_error})", "seconds": round(time.monotonic() - started, 2),
                    "polls": polls, "unit": props, "notes": notes, "last_http": last_http, "last_error": last_error,
                    "journal": journal_excerpt(service, since, env_path)}
        time.sleep(0.5)


# ---------------------------------------------------------------- commit / restore


def _write_evidence(sd: Path, evidence: object, mode: str, result: str) -> str | None:
    if not isinstance(evidence, dict):
        return None
    name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}-{mode}-{result}.json"
    path = sd / EVIDENCE_DIR / name
    write_json_atomic(path, evidence)
    os.chmod(path, 0o640)
    return str(path)


def _set_last(st: dict, *, mode: str, result: str, record: dict, evidence_path: str | None) -> None:
    promo = st.setdefault("promotion", {})
    promo["last"] = {"mode": mode, "result": result, "time": state.now_iso(), "evidence": evidence_path,
                     **{k: record.get(k) for k in ("gates", "accept_length", "failed_gate", "reason")}}
    st.setdefault("history", []).append({"time": state.now_iso(), "operator": record.get("operator", "?"),
                                         "action": f"promote {mode}", "release": st.get("current"),
                                         "from": promo.get("mode"), "result": result})


def op_unit_commit(args: dict) -> dict:
    """The stage passed its gates: record it (stack, mode, verdicts, canary) and drop the journal."""
    sd = statefs.state_dir(args)
    operator = str(args.get("operator", "?"))
    unit_id, mode = str(args.get("unit_id") or ""), str(args.get("mode") or "")
    record = args.get("record") if isinstance(args.get("record"), dict) else {}
    with lock.held(sd, args.get("lock_id"), who=operator, command=f"promote --mode {mode}"):
        jr = read_json(sd / UNIT_JOURNAL)
        if not isinstance(jr, dict) or jr.get("unit_id") != unit_id:
            raise AgentError("journal_mismatch", f"no stage {unit_id} in flight here (journal: "
                             f"{jr.get('unit_id') if isinstance(jr, dict) else None})", "re-run promote")
        evidence_path = _write_evidence(sd, args.get("evidence"), mode, "passed")
        canary = args.get("canary")
        if isinstance(canary, dict):
            write_json_atomic(sd / PROMOTION_DIR / f"canary-{safe_name(mode, 'mode')}.json", canary)

        def change(st: dict) -> None:
            _set_last(st, mode=mode, result="passed", record={**record, "operator": operator},
                      evidence_path=evidence_path)
            promo = st["promotion"]
            promo.setdefault("stack", []).append(unit_id)
            promo.setdefault("stages", {})[unit_id] = {"mode": mode, "from_mode": st.get("mode"), "time": state.now_iso()}
            promo.setdefault("passed", {})[mode] = {"time": state.now_iso(), "unit_id": unit_id,
                                                   "accept_length": record.get("accept_length"),
                                                   "release": st.get("current")}
            promo["mode"] = st["mode"] = mode

        state.update(sd, change)
        remove_durably(sd / UNIT_JOURNAL)
        state.audit_best_effort(sd, operator=operator, command=f"promote --mode {mode}", release=None,
                                result="passed", unit_id=unit_id)
    return {"unit_id": unit_id, "mode": mode, "evidence": evidence_path}


def op_unit_restore(args: dict) -> dict:
    """journal: undo the stage in flight (a failed gate); previous: undo the last passed stage;
    pristine: every stage, back to the unit as it was before ddtree-ops touched it."""
    sd = statefs.state_dir(args)
    operator = str(args.get("operator", "?"))
    to = str(args.get("to") or "journal")
    if to not in ("journal", "previous", "pristine"):
        raise AgentError("bad_request", f"unknown restore target {to!r}")
    restart = args.get("restart", True)
    with lock.held(sd, args.get("lock_id"), who=operator, command=f"unit restore --to {to}"):
        jr = read_json(sd / UNIT_JOURNAL)
        st = state.load(sd)
        stack = list((st.get("promotion") or {}).get("stack") or [])
        if to == "journal":
            if not isinstance(jr, dict):
                return {"noop": True, "message": "no stage in flight", "mode": st.get("mode")}
            mode = str(jr.get("mode"))
            # What the stage's server said, before its unit goes (evidence for any failed gate).
            env_path = _abs(args, "env_path") if args.get("env_path") else None
            excerpt = journal_excerpt(_service(args), args.get("since"), env_path) if args.get("service") else None
            undone = undo_journal(sd)
            evidence = args.get("evidence")
            if isinstance(evidence, dict):
                evidence = {**evidence, "journal": excerpt}
            evidence_path = _write_evidence(sd, evidence, mode, "rolled-back")
            record = args.get("evidence") if isinstance(args.get("evidence"), dict) else {}
            state.update(sd, lambda s: _set_last(s, mode=mode, result="rolled-back",
                                                 record={**(record.get("summary") or {}), "operator": operator},
                                                 evidence_path=evidence_path))
            return {"noop": False, "to": to, "undone": undone, "mode": st.get("mode"), "evidence": evidence_path,
                    "since": undone["restart"]["since"] if undone else None, "journal": excerpt}
        recovered = undo_journal(sd)
        if not stack:
            return {"noop": True, "to": to, "message": "no promoted unit to restore", "mode": st.get("mode"),
                    "recovered": recovered}
        pops = stack[-1:] if to == "previous" else list(reversed(stack))
        records = [_record(sd, uid) for uid in pops]
        bottom = records[-1]
        mode_now = bottom.get("from_mode")
        # Undoing a stage returns to a unit that was serving; pristine may mean "nothing ran here",
        # and then the service stops before its unit goes (a removed unit cannot be stopped by name
        # cleanly once systemd forgot it).
        run = bool(bottom.get("active_before")) if to == "pristine" else True
        restarted = None if run else _restart(bottom["service"], False)
        restored = []
        for rec in records:  # newest first: the oldest backup's bytes are the last written
            restored += _put_back(sd, rec)
        _daemon_reload()
        if run and restart:
            restarted = _restart(bottom["service"], True)

        def change(s: dict) -> None:
            promo = s.setdefault("promotion", {})
            promo["stack"] = stack[: len(stack) - len(pops)]
            promo["mode"] = s["mode"] = mode_now
            if to == "pristine":
                promo["passed"] = {}
            else:
                (promo.get("passed") or {}).pop(records[0].get("mode"), None)
            s.setdefault("history", []).append({"time": state.now_iso(), "operator": operator,
                                                "action": f"unit rollback --to {to}", "release": s.get("current"),
                                                "from": records[0].get("mode"), "result": mode_now or "pristine"})

        state.update(sd, change)
        state.audit_best_effort(sd, operator=operator, command=f"rollback --to {to}", release=None,
                                result="unit-restored", units=pops, mode=mode_now)
    return {"noop": False, "to": to, "popped": pops, "restored": restored, "mode": mode_now, "should_run": run,
            "restart": restarted, "since": restarted["since"] if restarted else None, "recovered": recovered}


def op_unit_recover(args: dict) -> dict:
    """For unlock (and anyone else): undo a stage a dead run left in flight."""
    sd = statefs.state_dir(args)
    with lock.held(sd, args.get("lock_id"), who=str(args.get("operator", "?")), command="unit recover"):
        return {"recovered": undo_journal(sd)}


def op_unit_service(args: dict) -> dict:
    """Restart (or stop) the service as its unit stands now: after a release rollback changed files."""
    service = _service(args)
    sd = statefs.state_dir(args)
    with lock.held(sd, args.get("lock_id"), who=str(args.get("operator", "?")), command="restart"):
        run = bool(args.get("run", True))
        if run and show(service).get("LoadState") != "loaded":
            return {"noop": True, "message": f"{service} has no unit here: nothing to restart", "since": None}
        return {"noop": False, **_restart(service, run)}


"""facts: what a host is and what it runs, read without changing anything.

args:
    state_dir     where releases/backups go (default /var/lib/ddtree-ops)
    service       systemd unit to describe (optional)
    package       import name of SGLang (default "sglang")
    files         site-packages-relative paths to sha256, e.g. "sglang/srt/server_args.py"
                  (the payload's touched files); a missing file hashes to null
    sys_path      directories to search before sys.path (tests point this at a fake package)
    os_release    os-release file (default /etc/os-release; tests override it)

Each section is null when its source is absent (no systemctl, no nvidia-smi, SGLang not
installed); a source that exists but fails adds a line to `warnings` instead of failing facts.
"""

from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import socket
import subprocess
import sys

from .. import atomic, confirm
from ..errors import AgentError
from ..requests import get_abs_path, get_str, get_str_list, relative_inside
from ..state import problem_of as state_problem
from ..state_dir import lock_dir, lock_owner_file, read_json_file, state_file

DEFAULT_STATE_DIR = "/var/lib/ddtree-ops"
SUBPROCESS_TIMEOUT_S = 15


def run(args: dict) -> dict:
    warnings: list = []
    state_dir = get_abs_path(args, "state_dir", DEFAULT_STATE_DIR)
    files = [relative_inside(p) for p in get_str_list(args, "files")]
    package = get_str(args, "package", "sglang")
    sglang = sglang_facts(package, files, get_str_list(args, "sys_path"), warnings)
    return {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "os": os_facts(get_abs_path(args, "os_release", "/etc/os-release"), warnings),
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "implementation": platform.python_implementation(),
        },
        "user": {"uid": os.geteuid(), "gid": os.getegid()},
        "sglang": sglang,
        "service": service_facts(get_str(args, "service"), warnings),
        "disk": disk_facts(state_dir),
        "gpus": gpu_facts(warnings),
        "lock": lock_facts(state_dir, warnings),
        "release": release_facts(state_dir, warnings, (sglang or {}).get("version"), package),
        "warnings": warnings,
    }


def os_facts(path: str, warnings: list) -> dict | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        warnings.append(f"os-release unreadable: {exc}")
        return None
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and re.fullmatch(r"[A-Z0-9_]+", key):
            values[key] = value.strip().strip("\"'")
    return {
        "id": values.get("ID"),
        "version_id": values.get("VERSION_ID"),
        "pretty_name": values.get("PRETTY_NAME"),
    }


def sglang_facts(package: str, files: list, sys_path: list, warnings: list) -> dict | None:
    # find_spec on a top-level name locates the package without importing it (importing SGLang
    # takes seconds and pulls in torch); the version comes from its distribution metadata.
    if sys_path:
        sys.path[:0] = sys_path
        importlib.invalidate_caches()
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError) as exc:
        warnings.append(f"{package}: cannot locate: {exc}")
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    package_dir = locations[0] if locations else os.path.dirname(spec.origin or "")
    # Payload paths are "as in site-packages" (sglang/srt/...): relative to the package's parent.
    site_dir = os.path.dirname(package_dir.rstrip("/"))
    version, metadata_dir = None, None
    # Only metadata installed next to the package we found counts: another install's dist-info
    # (a second venv on sys.path, a stale copy) would report a version this interpreter does not run.
    for dist in importlib.metadata.distributions(name=package):
        if os.path.realpath(str(dist.locate_file(""))) == os.path.realpath(site_dir):
            version = dist.version
            metadata_dir = str(getattr(dist, "_path", "")) or None
            break
    if version is None:
        version = _version_from_source(package_dir)
        if version is None:
            warnings.append(f"{package}: no distribution metadata and no version.py next to {package_dir}")
    return {
        "version": version,
        "path": package_dir,
        "site_dir": site_dir,
        "metadata": metadata_dir,
        "files": {rel: sha256_file(os.path.join(site_dir, rel)) for rel in files},
    }


def _version_from_source(package_dir: str) -> str | None:
    try:
        with open(os.path.join(package_dir, "version.py"), encoding="utf-8") as f:
            match = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def sha256_file(path: str) -> str | None:
    """Hex sha256 of a regular file; None when it does not exist (or is not a file)."""
    try:
        return atomic.sha256_file(path)
    except (IsADirectoryError, NotADirectoryError):
        return None
    except OSError as exc:
        raise AgentError("unreadable_file", f"cannot read {path}: {exc}", "check permissions (or set `sudo: true`)") from None


SERVICE_PROPERTIES = ("LoadState", "ActiveState", "SubState", "UnitFileState", "FragmentPath", "MainPID")


def _tool_output(argv: list[str], label: str, warnings: list) -> str | None:
    """stdout of a host tool, or None with a warning: a missing fact must not fail the facts op."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        warnings.append(f"{label}: {exc}")
        return None
    if proc.returncode != 0:
        warnings.append(f"{label}: exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:300]}")
        return None
    return proc.stdout


def service_facts(service: str | None, warnings: list) -> dict | None:
    systemctl = shutil.which("systemctl")
    if not service or systemctl is None:
        return None
    stdout = _tool_output([systemctl, "show", "--no-pager", "--property=" + ",".join(SERVICE_PROPERTIES), "--", service],
                          f"systemctl show {service}", warnings)
    if stdout is None:
        return None
    # Parse Key=Value lines: with --value, systemd prints values in its own order, not ours.
    props = dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)
    return {
        "name": service,
        "load_state": props.get("LoadState") or None,
        "active_state": props.get("ActiveState") or None,
        "sub_state": props.get("SubState") or None,
        "unit_file_state": props.get("UnitFileState") or None,
        "fragment_path": props.get("FragmentPath") or None,
        "main_pid": int(props["MainPID"]) if props.get("MainPID", "").isdigit() else None,
    }


def disk_facts(state_dir: str) -> dict:
    # Before the first push the state dir does not exist yet: measure the filesystem it will live on.
    path = state_dir
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return {
        "state_dir": state_dir,
        "measured_at": path,
        "free_bytes": st.f_bavail * st.f_frsize,
        "total_bytes": st.f_blocks * st.f_frsize,
    }


def gpu_facts(warnings: list) -> list | None:
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return None
    stdout = _tool_output([nvidia_smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                          "nvidia-smi", warnings)
    if stdout is None:
        return None
    gpus = []
    for row in csv.reader(stdout.splitlines(), skipinitialspace=True):
        if len(row) < 3:
            continue
        index, name, memory = (cell.strip() for cell in row[:3])
        gpus.append({
            "index": int(index) if index.isdigit() else index,
            "name": name,
            "memory_total_mib": int(memory) if memory.isdigit() else None,
        })
    return gpus


def lock_facts(state_dir: str, warnings: list) -> dict | None:
    """The lock owner record, or None when nobody holds the lock."""
    if not os.path.isdir(lock_dir(state_dir)):
        return None
    owner, problem = read_json_file(lock_owner_file(state_dir))
    if problem:
        warnings.append(problem)
    if not isinstance(owner, dict):
        # The lock directory is the lock; a missing owner file means a holder died mid-acquire.
        return {"who": None, "note": "lock directory present without a readable owner.json"}
    return owner


def release_facts(state_dir: str, warnings: list, version: str | None = None, package: str = "sglang") -> dict | None:
    state, problem = read_json_file(state_file(state_dir))
    if problem is None and state is not None and (bad := state_problem(state)):
        problem = f"{state_file(state_dir)}: state.json {bad} (`ddtree-ops unlock HOST` shows the repair)"
    if problem:
        warnings.append(problem)
    if not isinstance(state, dict):
        return None
    out = {"current": state.get("current"), "previous": state.get("previous"), "mode": state.get("mode")}
    promotion = state.get("promotion")
    if isinstance(promotion, dict):
        # promote's record (units.py): the last stage's verdicts and accept length, for `status`.
        last = promotion.get("last") if isinstance(promotion.get("last"), dict) else {}
        out["promotion"] = {"last_mode": last.get("mode"), "last_result": last.get("result"),
                            "gates": last.get("gates"), "accept_length": last.get("accept_length"),
                            "failed_gate": last.get("failed_gate"), "time": last.get("time")}
    out["in_flight"] = stage_in_flight(state_dir)
    out["stale"] = stale_facts(state_dir, version, package, warnings)
    return out


def stale_facts(state_dir: str, version: str | None, package: str, warnings: list) -> dict | None:
    """Kept releases made for another SGLang than the installed one (stale.py): push and rollback refuse
    such a host; `status` shows it with the repair, never as healthy."""
    from pathlib import Path

    from .. import stale

    if version is None:  # SGLang not installed: status says "absent"
        return None
    try:
        old = stale.stale_releases(Path(state_dir), version)
    except OSError as exc:
        warnings.append(f"{state_dir}: releases unreadable ({exc})")
        return None
    if not old:
        return None
    d = stale.describe(version, old, package)
    warnings.append(f"{d['message']}; repair: {d['hint']}")
    return {"installed_version": version, "release_bases": old, "message": d["message"], "repair": d["hint"]}


def stage_in_flight(state_dir: str) -> dict | None:
    """A promote stage installed and not yet confirmed: its mode and how long until the host puts the
    previous unit back by itself (unless the run gating it confirms it first)."""
    jr, _ = read_json_file(os.path.join(state_dir, "units-journal.json"))
    if not isinstance(jr, dict):
        return None
    record = jr.get("confirm")
    return {"mode": jr.get("mode"), "unit_id": jr.get("unit_id"),
            "restores_in_s": None if confirm.problem(record) else max(0.0, confirm.remaining_s(record))}

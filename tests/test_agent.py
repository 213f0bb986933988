"""The host agent, run locally exactly as on a host: `python -I -c BOOTSTRAP` fed by stdin."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_ops.agent.client import AgentCallError, parse_answer
from ddtree_ops.agent.shipping import BOOTSTRAP_LINE, BOOTSTRAP_SOURCE, agent_argv, agent_sources, agent_stdin
from ddtree_ops.ssh import RemoteResult

REMOTE_DIR = Path(__file__).resolve().parents[1] / "ddtree_ops" / "agent" / "remote"


def run_agent(op: str, args: dict, *, env: dict[str, str] | None = None, python: str = sys.executable) -> dict:
    proc = subprocess.run(agent_argv(python), input=agent_stdin(op, args), capture_output=True, timeout=60,
                          env=env if env is not None else {"PATH": os.environ["PATH"]})
    assert proc.returncode == 0, proc.stderr.decode()
    lines = proc.stdout.decode().splitlines()
    assert len(lines) == 1, f"stdout must hold exactly one JSON line, got {proc.stdout!r}"
    return json.loads(lines[0])


@pytest.fixture
def fake_site(tmp_path: Path) -> Path:
    """A site-packages with a fake sglang that explodes if imported (facts must not import it)."""
    site = tmp_path / "site"
    pkg = site / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"open({str(tmp_path / 'IMPORTED')!r}, 'w').close()\nraise SystemExit('imported!')\n")
    (pkg / "version.py").write_text('__version__ = "0.5.13.post1"\n')
    (pkg / "srt" / "server_args.py").write_text("# pristine\n")
    dist = site / "sglang-0.5.13.post1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.13.post1\n")
    return site


def fake_bin(tmp_path: Path, name: str, script: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    exe = bindir / name
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(0o755)
    return bindir


def test_facts_against_a_temporary_root(tmp_path: Path, fake_site: Path) -> None:
    state_dir = tmp_path / "state"
    (state_dir / "lock").mkdir(parents=True)
    (state_dir / "lock" / "owner.json").write_text(json.dumps({"who": "alice@laptop", "command": "push"}))
    (state_dir / "state.json").write_text(json.dumps({"current": "r2", "previous": "r1", "mode": "shadow-linear"}))
    os_release = tmp_path / "os-release"
    os_release.write_text('PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n')
    answer = run_agent("facts", {
        "state_dir": str(state_dir), "sys_path": [str(fake_site)], "os_release": str(os_release),
        "files": ["sglang/srt/server_args.py", "sglang/srt/speculative/ddtree_utils.py"], "service": "sglang.service",
    }, env={"PATH": "/nonexistent"})
    assert answer["ok"] is True and answer["op"] == "facts" and answer["protocol"] == 1, answer
    facts = answer["result"]
    assert facts["os"] == {"id": "debian", "version_id": "12", "pretty_name": "Debian GNU/Linux 12 (bookworm)"}
    assert facts["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    sglang = facts["sglang"]
    assert sglang["version"] == "0.5.13.post1" and sglang["path"] == str(fake_site / "sglang")
    assert sglang["files"] == {
        "sglang/srt/server_args.py": hashlib.sha256(b"# pristine\n").hexdigest(),
        "sglang/srt/speculative/ddtree_utils.py": None,
    }
    assert not (tmp_path / "IMPORTED").exists(), "facts imported sglang"
    assert facts["service"] is None and facts["gpus"] is None  # no systemctl / nvidia-smi on PATH
    assert facts["lock"]["who"] == "alice@laptop"
    assert facts["release"] == {"current": "r2", "previous": "r1", "mode": "shadow-linear", "in_flight": None,
                                "stale": None}
    assert facts["disk"]["measured_at"] == str(state_dir) and facts["disk"]["free_bytes"] > 0


def test_facts_without_sglang_state_or_os_release(tmp_path: Path) -> None:
    facts = run_agent("facts", {"state_dir": str(tmp_path / "a" / "b" / "c"), "package": "no_such_pkg_xyz",
                                "os_release": str(tmp_path / "none")})["result"]
    assert facts["sglang"] is None and facts["os"] is None and facts["lock"] is None and facts["release"] is None
    assert facts["disk"]["measured_at"] == str(tmp_path)  # nearest existing parent


def test_sglang_version_from_version_py_when_metadata_is_missing(tmp_path: Path, fake_site: Path) -> None:
    for dist in fake_site.glob("*.dist-info"):
        for f in dist.iterdir():
            f.unlink()
        dist.rmdir()
    facts = run_agent("facts", {"sys_path": [str(fake_site)], "state_dir": str(tmp_path)})["result"]
    assert facts["sglang"]["version"] == "0.5.13.post1" and facts["sglang"]["metadata"] is None


def test_facts_parses_systemctl_and_nvidia_smi(tmp_path: Path) -> None:
    args_file = tmp_path / "systemctl-args"
    fake_bin(tmp_path, "systemctl", f'printf "%s\\n" "$@" > {args_file}\n'
             "printf 'LoadState=loaded\\nActiveState=active\\nSubState=running\\nUnitFileState=enabled\\n"
             "FragmentPath=/etc/systemd/system/sglang.service\\nMainPID=4242\\n'\n")
    bindir = fake_bin(tmp_path, "nvidia-smi", "echo '0, NVIDIA H200, 143771'; echo '1, NVIDIA H200, 143771'\n")
    facts = run_agent("facts", {"state_dir": str(tmp_path), "service": "my;unit.service"},
                      env={"PATH": str(bindir)})["result"]
    assert facts["service"] == {
        "name": "my;unit.service", "load_state": "loaded", "active_state": "active", "sub_state": "running",
        "unit_file_state": "enabled", "fragment_path": "/etc/systemd/system/sglang.service", "main_pid": 4242,
    }
    # The unit name reached systemctl as one argv element, after `--`.
    assert args_file.read_text().splitlines()[-2:] == ["--", "my;unit.service"]
    assert facts["gpus"] == [
        {"index": 0, "name": "NVIDIA H200", "memory_total_mib": 143771},
        {"index": 1, "name": "NVIDIA H200", "memory_total_mib": 143771},
    ]


def test_failing_tools_become_warnings_not_failures(tmp_path: Path) -> None:
    fake_bin(tmp_path, "systemctl", "echo 'Failed to connect to bus' >&2; exit 1\n")
    bindir = fake_bin(tmp_path, "nvidia-smi", "echo 'NVIDIA-SMI has failed' ; exit 9\n")
    answer = run_agent("facts", {"state_dir": str(tmp_path), "service": "sglang.service"}, env={"PATH": str(bindir)})
    facts = answer["result"]
    assert answer["ok"] and facts["service"] is None and facts["gpus"] is None
    assert any("Failed to connect to bus" in w for w in facts["warnings"])
    assert any("NVIDIA-SMI has failed" in w for w in facts["warnings"])


def test_corrupt_state_files_are_warnings(tmp_path: Path) -> None:
    (tmp_path / "lock").mkdir()
    (tmp_path / "state.json").write_text("{not json")
    facts = run_agent("facts", {"state_dir": str(tmp_path)})["result"]
    assert facts["release"] is None and facts["lock"]["who"] is None
    assert any("state.json" in w for w in facts["warnings"])


@pytest.mark.parametrize("rel", ["../../etc/passwd", "/etc/passwd", "sglang/../../x"])
def test_files_outside_site_packages_are_refused(tmp_path: Path, rel: str) -> None:
    answer = run_agent("facts", {"state_dir": str(tmp_path), "files": [rel]})
    assert answer["ok"] is False and answer["error"]["code"] == "bad_request"


def test_unknown_op_and_bad_arguments(tmp_path: Path) -> None:
    answer = run_agent("no-such-op", {})
    assert answer == {**answer, "ok": False} and answer["error"]["code"] == "unknown_op"
    assert "facts" in answer["error"]["hint"]
    answer = run_agent("facts", {"state_dir": "relative/dir"})
    assert answer["error"]["code"] == "bad_request" and "absolute" in answer["error"]["message"]
    answer = run_agent("facts", {"files": "not-a-list"})
    assert answer["error"]["code"] == "bad_request"


def test_request_that_is_not_json(tmp_path: Path) -> None:
    from ddtree_ops.agent.shipping import agent_payload_line

    proc = subprocess.run(agent_argv(sys.executable), input=agent_payload_line() + b"{oops\n", capture_output=True, timeout=60)
    answer = json.loads(proc.stdout)
    assert answer["ok"] is False and answer["error"]["code"] == "bad_request"


def test_hostile_arguments_travel_as_data(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    hostile = f"/tmp/x'; touch {marker}; echo '$(touch {marker})`touch {marker}`\n"
    answer = run_agent("facts", {"state_dir": "/" + hostile.lstrip("/"), "service": hostile, "files": ["a" + hostile]},
                       env={"PATH": os.environ["PATH"]})
    assert answer["ok"] is True
    assert not marker.exists()


# --- what ships, and how ---------------------------------------------------------------------------


def test_bootstrap_is_constant_and_shell_inert() -> None:
    # The -c argument never depends on the inventory; only `python` (quoted by ssh.py) does.
    assert agent_argv("/a/python")[1:] == agent_argv("/b/p y'th;on")[1:] == ["-I", "-c", BOOTSTRAP_LINE]
    import re

    assert re.fullmatch(r'import base64;exec\(base64\.b64decode\("[A-Za-z0-9+/=]+"\)\)', BOOTSTRAP_LINE)
    assert "ddtree_agent.main" in BOOTSTRAP_SOURCE


def test_remote_package_is_stdlib_only_and_python310_syntax() -> None:
    stdlib = set(sys.stdlib_module_names)
    for name, (_, source) in agent_sources().items():
        tree = ast.parse(source, filename=name, feature_version=(3, 10))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            bad = [r for r in roots if r not in stdlib and r != "__future__"]
            assert not bad, f"{name} imports {bad}: the agent must be stdlib-only"


def test_shipped_sources_cover_the_remote_tree() -> None:
    on_disk = {p.relative_to(REMOTE_DIR).with_suffix("").as_posix() for p in REMOTE_DIR.rglob("*.py")}
    shipped = {n.removeprefix("ddtree_agent").lstrip(".").replace(".", "/") for n in agent_sources()}
    expected = {p.removesuffix("/__init__").removesuffix("__init__") for p in on_disk}
    assert shipped == expected


def test_every_registered_op_resolves_to_a_function() -> None:
    import importlib

    from ddtree_ops.agent.remote import ops

    for op, (module, function) in ops.REGISTRY.items():
        assert callable(getattr(importlib.import_module(".." + module, ops.__name__), function)), op


def test_agent_writes_nothing_outside_its_answer(tmp_path: Path) -> None:
    """The bootstrap leaves no files behind (sources live in memory)."""
    before = set(os.listdir("/tmp"))
    run_agent("facts", {"state_dir": str(tmp_path)})
    assert {n for n in set(os.listdir("/tmp")) - before if "agent" in n.lower()} == set()


# --- control side: answers without JSON -----------------------------------------------------------


def test_parse_answer_maps_exit_statuses() -> None:
    with pytest.raises(AgentCallError) as info:
        parse_answer("h", "/opt/py", RemoteResult(127, b"", b"sh: 1: /opt/py: not found\n", 0.0))
    assert info.value.code == "python_not_found" and "`python`" in (info.value.hint or "")
    with pytest.raises(AgentCallError) as info:
        parse_answer("h", "/opt/py", RemoteResult(126, b"", b"permission denied", 0.0))
    assert info.value.code == "python_not_executable"
    with pytest.raises(AgentCallError) as info:
        parse_answer("h", "/opt/py", RemoteResult(1, b"", b"sudo: a password is required\n", 0.0), sudo_user="deploy")
    assert info.value.code == "sudo_password_required" and "sudo_password_env" in info.value.hint
    with pytest.raises(AgentCallError) as info:
        parse_answer("h", "/opt/py", RemoteResult(1, b"garbage\n", b"Traceback...", 0.0))
    assert info.value.code == "agent_no_answer" and "Traceback" in info.value.detail["stderr"]
    ok = parse_answer("h", "/opt/py", RemoteResult(0, b'{"ok": true, "result": {}}\n', b"", 0.0))
    assert ok["ok"] is True


# What sudo (1.8 and 1.9) and the login shell say when the agent never starts, and what the operator is told.
@pytest.mark.parametrize(("exit_code", "stderr", "code", "hint"), [
    (127, "sh: 1: sudo: not found", "sudo_missing", "apt-get install sudo"),
    (127, "bash: line 1: sudo: command not found", "sudo_missing", "`sudo: false`"),
    (1, "sudo: a password is required", "sudo_password_required", "NOPASSWD: /opt/py"),
    (1, "sudo: a terminal is required to read the password; either use the -S option to read from standard input "
        "or configure an askpass helper", "sudo_password_required", "sudo_password_env"),
    (1, "Sorry, user deploy is not allowed to execute '/opt/py -I -c x' as root on h1.", "sudo_not_allowed",
     "deploy ALL=(root) NOPASSWD: /opt/py"),
    (1, "deploy is not in the sudoers file.  This incident will be reported.", "sudo_not_allowed", "visudo"),
    (1, "sudo: sorry, you must have a tty to run sudo", "sudo_needs_tty", "!requiretty"),
    (1, "sudo: /opt/py: command not found", "python_not_found", "`python`"),
    (1, "Sorry, try again.\nsudo: 1 incorrect password attempt", "sudo_password_wrong", "sudo_password_env"),
    (1, "sudo: account validation failure, is your account locked?", "sudo_failed", "sudo -v"),
])
def test_sudo_refusals_say_what_to_fix(exit_code: int, stderr: str, code: str, hint: str) -> None:
    with pytest.raises(AgentCallError) as info:
        parse_answer("h1", "/opt/py", RemoteResult(exit_code, b"", stderr.encode() + b"\n", 0.0), sudo_user="deploy")
    assert info.value.code == code and hint in info.value.hint, (info.value.message, info.value.hint)
    assert info.value.message.startswith("h1: ")


def test_without_sudo_a_missing_interpreter_is_not_blamed_on_sudo() -> None:
    with pytest.raises(AgentCallError) as info:
        parse_answer("h1", "/opt/py", RemoteResult(127, b"", b"sh: 1: /opt/py: not found\n", 0.0), sudo_user="deploy")
    assert info.value.code == "python_not_found"

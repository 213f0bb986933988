"""`ddtree-ops status` against the lab fleet: real sshd, real systemd, the host's own SGLang venv."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.lab


def cli(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("ddtree-ops")
    argv = [str(exe)] if exe.exists() else [sys.executable, "-c", "from ddtree_ops.cli import main; main()"]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")} | (env or {})
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout, env=environ)


def status_json(inventory: Path, *extra: str) -> tuple[int, dict[str, dict]]:
    result = cli("status", "-i", str(inventory), "--json", *extra)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, {row["host"]: row for row in json.loads(result.stdout)["results"]}


def inventory_copy(lab_fleet, tmp_path: Path, edit) -> Path:
    """The lab inventory, with absolute key paths, written to tmp_path after `edit(data)`."""
    data = lab_fleet.inventory_data()
    edit(data)
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_status_of_three_hosts(lab_fleet) -> None:
    code, rows = status_json(lab_fleet.inventory_path)
    assert code == 0 and sorted(rows) == sorted(lab_fleet.hosts)
    for name, row in rows.items():
        facts = row["data"]
        assert row["status"] == "ok" and row["address"] == lab_fleet.addresses[name]
        assert facts["os"]["id"] == "debian"
        assert facts["python"]["executable"].startswith("/opt/sglang/venv/bin/python")
        assert facts["sglang"]["version"] == "0.5.13.post1"
        assert facts["sglang"]["path"].endswith("/site-packages/sglang")
        assert facts["service"]["name"] == "sglang.service" and facts["service"]["load_state"]
        assert facts["disk"]["free_bytes"] > 0
        # The payload's touched files were hashed with the host's interpreter.
        assert facts["sglang"]["files"] and all(len(v) == 64 for v in facts["sglang"]["files"].values() if v)


def test_status_table_on_a_terminal_free_run(lab_fleet) -> None:
    result = cli("status", "-i", str(lab_fleet.inventory_path), "--limit", "lab-1")
    assert result.returncode == 0, result.stderr
    assert "lab-1" in result.stdout and "0.5.13.post1" in result.stdout and "lab-2" not in result.stdout


@pytest.fixture
def lab2_stopped(lab_exclusive) -> Iterator[str]:
    """lab-2 powered off; the lab is ours alone meanwhile, so other sessions' tests never see it down."""
    from ddtree_ops.lab.fleet import start_host, stop_host

    stop_host("lab-2")
    try:
        yield "lab-2"
    finally:
        start_host("lab-2")


def test_unreachable_host_reported_while_others_succeed(lab_fleet, lab2_stopped: str) -> None:
    started = time.monotonic()
    code, rows = status_json(lab_fleet.inventory_path)
    assert code == 1
    assert rows[lab2_stopped]["status"] == "unreachable"
    assert rows[lab2_stopped]["error"]["code"] == "unreachable" and rows[lab2_stopped]["error"]["hint"]
    assert {h: r["status"] for h, r in rows.items() if h != lab2_stopped} == {"lab-1": "ok", "lab-3": "ok"}
    assert time.monotonic() - started < 90


def _ssh_logins_between(lab_fleet, host: str, since: float, until: float) -> list[str]:
    result = lab_fleet.ssh(host, "journalctl", "-o", "cat", "--no-pager", "-t", "sshd", "-t", "sshd-session",
                           f"--since=@{int(since)}", f"--until=@{int(until) + 1}")
    assert result.returncode == 0, result.stderr
    return [ln for ln in result.stdout.splitlines() if "Accepted" in ln]


def test_unknown_host_key_refused_and_nothing_ran(lab_fleet, tmp_path: Path) -> None:
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    inventory = inventory_copy(lab_fleet, tmp_path, lambda d: d["all"]["vars"].update(known_hosts=str(empty)))
    time.sleep(1.1)  # journal windows are whole seconds: keep earlier tests' logins out of ours
    before = time.time()
    code, rows = status_json(inventory, "--limit", "lab-1")
    after = time.time()
    time.sleep(2)  # ... and the login that reads the journal out of it too
    assert code == 1
    assert rows["lab-1"]["status"] == "failed" and rows["lab-1"]["error"]["code"] == "host_key_unknown"
    assert "SHA256:" in rows["lab-1"]["error"]["message"]
    assert empty.read_text() == ""  # strict mode never learns a key
    assert _ssh_logins_between(lab_fleet, "lab-1", before, after) == []
    # Positive control: the same window check does see a login that was accepted.
    before = time.time()
    assert status_json(lab_fleet.inventory_path, "--limit", "lab-1")[0] == 0
    after = time.time()
    time.sleep(2)
    assert _ssh_logins_between(lab_fleet, "lab-1", before, after)


def test_accept_new_learns_the_key_and_says_so(lab_fleet, tmp_path: Path) -> None:
    learned = tmp_path / "learned_known_hosts"
    inventory = inventory_copy(
        lab_fleet, tmp_path, lambda d: d["all"]["vars"].update(known_hosts=str(learned), host_key_policy="accept-new"))
    result = cli("status", "-i", str(inventory), "--limit", "lab-1")
    assert result.returncode == 0, result.stderr
    assert "accepted new host key" in result.stderr and lab_fleet.addresses["lab-1"] in learned.read_text()


def test_sudo_path_works(lab_fleet, tmp_path: Path) -> None:
    inventory = inventory_copy(lab_fleet, tmp_path, lambda d: d["all"]["vars"].update(sudo=True))
    code, rows = status_json(inventory, "--limit", "lab-1")
    assert code == 0 and rows["lab-1"]["data"]["user"]["uid"] == 0


# --- hostile inventory values ---------------------------------------------------------------------


@pytest.fixture
def marker() -> Iterator[str]:
    path = f"/tmp/pwned-{secrets.token_hex(6)}"
    yield path
    Path(path).unlink(missing_ok=True)


def _payloads(marker: str) -> list[str]:
    return [f"'; touch {marker}; echo '", f'"; touch {marker}; echo "', f"$(touch {marker})", f"`touch {marker}`",
            f"; touch {marker}", f"\ntouch {marker}\n"]


def _assert_not_pwned(lab_fleet, marker: str) -> None:
    assert not Path(marker).exists(), "a command ran on the control side"
    for host in lab_fleet.hosts:
        check = lab_fleet.ssh(host, "test", "-e", marker)
        assert check.returncode == 1, f"a command ran on {host}"


def test_hostile_values_rejected_or_carried_without_execution(lab_fleet, tmp_path: Path, marker: str) -> None:
    from typer.testing import CliRunner

    from ddtree_ops.cli import app

    runner = CliRunner()
    outcomes = []
    for i, payload in enumerate(_payloads(marker)):
        for field in ("python", "state_dir", "service", "model_path", "extra_args", "host_name", "identity_file"):
            case = tmp_path / f"case{i}-{field}"
            case.mkdir()

            def edit(data: dict, field: str = field, payload: str = payload, case: Path = case) -> None:
                host = data["hosts"]["lab-1"]
                if field == "host_name":
                    data["hosts"] = {"lab" + payload: host}
                    data["groups"] = {}
                elif field == "identity_file":
                    weird_key = case / f"id{payload.replace('/', '_').replace(chr(10), '_')}"
                    shutil.copyfile(lab_fleet.identity_file, weird_key)
                    weird_key.chmod(0o600)
                    host["identity_file"] = str(weird_key)
                elif field == "extra_args":
                    host["extra_args"] = ["--flag", payload]
                elif field in ("python", "state_dir"):
                    host[field] = "/opt/x" + payload
                else:
                    host[field] = payload
                data["hosts"] = {k: v for k, v in data["hosts"].items() if k not in ("lab-2", "lab-3")}
                data["groups"] = {}

            inventory = inventory_copy(lab_fleet, case, edit)
            # In-process (the same CLI code path, without 42 interpreter start-ups).
            result = runner.invoke(app, ["status", "-i", str(inventory), "--json"])
            outcomes.append((field, payload, result.exit_code))
            # Either refused up front (2), or the host answered with a clean per-host result.
            assert result.exit_code in (0, 1, 2), result.stderr
            if result.exit_code != 2:
                rows = json.loads(result.stdout)["results"]
                assert len(rows) == 1
                if field == "python":
                    # The lab's sudo rule allows the operator the agent's own interpreter only: sudo refuses any
                    # other path before running it (as root, the same path is "not found").
                    assert rows[0]["error"]["code"] in ("python_not_found", "sudo_password_required"), (payload, rows[0])
    _assert_not_pwned(lab_fleet, marker)
    # Some values are legal and travelled as data (e.g. shell characters in the state_dir path).
    assert any(code == 0 for field, _, code in outcomes if field in ("state_dir", "identity_file", "model_path"))
    assert all(code == 2 for field, _, code in outcomes if field in ("service", "host_name"))

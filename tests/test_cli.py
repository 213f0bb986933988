"""The CLI as an operator (or a script) sees it: help, version, exit codes, --json purity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ddtree_ops import __version__

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "inventory" / "example.yaml"


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("ddtree-ops")
    argv = [str(exe)] if exe.exists() else [sys.executable, "-c", "from ddtree_ops.cli import main; main()"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})})


def test_help_lists_every_command_with_a_description() -> None:
    result = cli("--help")
    assert result.returncode == 0
    commands = result.stdout.split("Commands:")[1]
    listed = [ln.split(None, 1) for ln in commands.splitlines() if ln.startswith("  ") and not ln.startswith("    ")]
    assert {"status", "hosts", "lab"} <= {name for name, _ in listed}
    for name, description in listed:
        assert len(description) > 10, name
    assert "..." not in commands  # descriptions are whole sentences, never cut off


def test_version() -> None:
    result = cli("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"ddtree-ops {__version__}")


def test_help_does_not_import_heavy_libraries() -> None:
    code = ("import sys; sys.argv=['ddtree-ops','--help']\nfrom ddtree_ops.cli import main\ntry: main()\n"
            "except SystemExit: pass\nheavy=[m for m in ('fabric','paramiko','torch','httpx','pydantic','rich') if m in sys.modules]\n"
            "print('HEAVY', heavy, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in result.stderr


def test_missing_inventory_is_a_usage_error_with_hint() -> None:
    result = cli("status")
    assert result.returncode == 2 and result.stdout == ""
    assert "no inventory given" in result.stderr and "DDTREE_INVENTORY" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_inventory_with_json_gives_a_json_error() -> None:
    result = cli("status", "--json")
    assert result.returncode == 2
    assert json.loads(result.stdout)["error"]["code"] == "inventory_missing"


def test_invalid_inventory_names_file_line_field_and_hint(tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  gpu-1:\n    adress: 10.0.0.1\n")
    result = cli("status", "-i", str(inv))
    assert result.returncode == 2 and result.stdout == ""
    assert f"{inv}:3: hosts.gpu-1.adress: unknown field `adress`" in result.stderr
    assert "did you mean `address`?" in result.stderr and "Traceback" not in result.stderr
    as_json = cli("status", "-i", str(inv), "--json")
    assert as_json.returncode == 2
    issues = json.loads(as_json.stdout)["error"]["issues"]
    assert issues[0]["path"] == "hosts.gpu-1.adress" and issues[0]["line"] == 3


def test_debug_shows_the_traceback_but_keeps_the_exit_code(tmp_path: Path) -> None:
    result = cli("--debug", "status", "-i", str(tmp_path / "missing.yaml"))
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_limit_matching_nothing_exits_2() -> None:
    result = cli("hosts", "-i", str(EXAMPLE), "--limit", "gpu-9")
    assert result.returncode == 2 and "matches no host or group" in result.stderr and "did you mean" in result.stderr


def test_unknown_option_exits_2() -> None:
    assert cli("status", "--frobnicate").returncode == 2


def test_inventory_from_environment_and_hosts_json() -> None:
    result = cli("hosts", "--limit", "main", "--json", env={"DDTREE_INVENTORY": str(EXAMPLE)})
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["results"]
    assert [r["host"] for r in rows] == ["gpu-2", "gpu-3"] and rows[0]["data"]["ddtree_budget"] == 64


# --- status against in-process SSH servers ------------------------------------------------------


def test_status_json_is_pure_and_reports_each_host(two_host_inventory: Path) -> None:
    result = cli("status", "-i", str(two_host_inventory), "--json")
    assert result.returncode == 1, result.stderr
    doc = json.loads(result.stdout)  # the whole of stdout is one JSON document
    assert (doc["command"], doc["ok"], doc["exit_code"]) == ("status", False, 1)
    assert doc["summary"]["unreachable"] == ["down"]
    by_host = {r["host"]: r for r in doc["results"]}
    assert by_host["up"]["status"] == "ok" and by_host["up"]["data"]["python"]["executable"] == sys.executable
    assert by_host["down"]["status"] == "unreachable" and by_host["down"]["error"]["code"] == "unreachable"
    assert by_host["down"]["error"]["hint"]


def test_status_table_and_limit(two_host_inventory: Path) -> None:
    result = cli("status", "-i", str(two_host_inventory))
    assert result.returncode == 1
    assert "up" in result.stdout and "down" in result.stdout and "unreachable:" in result.stderr
    only_up = cli("status", "-i", str(two_host_inventory), "--limit", "up", "--json")
    assert only_up.returncode == 0 and [r["host"] for r in json.loads(only_up.stdout)["results"]] == ["up"]


def test_status_row_cells() -> None:
    from ddtree_ops.errors import ErrorInfo
    from ddtree_ops.fleet import HostResult
    from ddtree_ops.inventory import HostConfig
    from ddtree_ops.output import status_row

    host = HostConfig(name="h", address="10.0.0.1", port=2222)
    facts = {"os": {"id": "debian", "version_id": "12"}, "python": {"version": "3.11.2"},
             "sglang": {"version": "0.5.13.post1"}, "service": {"active_state": "active", "sub_state": "running"},
             "release": {"current": None}, "lock": {"who": "alice@laptop"},
             "gpus": [{"name": "NVIDIA H200"}, {"name": "NVIDIA H200"}], "disk": {"free_bytes": 3 * 1024**3}}
    row = status_row(host, HostResult("h", "ok", data=facts))
    assert row == {**row, "address": "10.0.0.1:2222", "reachable": "yes", "os": "debian 12", "service": "active/running",
                   "release": "pristine", "lock": "alice@laptop", "gpus": "2× NVIDIA H200", "free_disk": "3.0 GiB"}
    assert status_row(host, HostResult("h", "ok", data={**facts, "release": None, "lock": None}))["release"] == "none"
    refused = status_row(host, HostResult("h", "failed", error=ErrorInfo("host_key_unknown", "m")))
    assert refused["reachable"] == "refused (host_key_unknown)" and refused["sglang"] == "-"
    assert status_row(host, HostResult("h", "unreachable", error=ErrorInfo("unreachable", "m")))["reachable"] == "no"

"""One CLI behaviour everywhere, as an operator meets it in the first hour: one --json document shape for
every command and every ending, --debug after the command, shell completion, Ctrl-C, a host that accepts TCP
but sends no SSH banner, tables at 80 columns, history and unlock selecting hosts as --limit says."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from test_cli import EXAMPLE, cli

from tests.release_fixtures import run_agent

ENVELOPE = {"command", "ok", "exit_code", "error", "warnings", "results", "summary"}
HOST_RESULT = {"host", "status", "data", "error", "elapsed_s", "notices"}


class SilentServer:
    """Accepts TCP connections and never says a word: a hung sshd, or a port that is not sshd's."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = threading.Event()
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            self.accepted.set()

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def document(result: subprocess.CompletedProcess[str]) -> dict:
    doc = json.loads(result.stdout)  # the whole of stdout is the one document
    assert set(doc) >= ENVELOPE, doc
    assert doc["exit_code"] == result.returncode and doc["ok"] == (result.returncode == 0)
    assert all(set(r) >= HOST_RESULT for r in doc["results"])
    return doc


# --- one --json shape ------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["status"], ["hosts"], ["push", "--bundle", "x.tar.gz"], ["smoke"], ["rollback"], ["history"],
    ["unlock", "--yes"], ["promote", "--mode", "shadow-linear"],
])
def test_every_fleet_command_reports_a_usage_error_in_the_same_document(argv: list[str]) -> None:
    result = cli(*argv, "--json")
    doc = document(result)
    assert result.returncode == 2 and doc["command"].split()[0] == argv[0]
    assert doc["error"]["code"] == "inventory_missing" and doc["error"]["hint"]
    assert (doc["results"], doc["summary"]) == ([], None)


def test_a_click_usage_error_is_a_document_too() -> None:
    result = cli("status", "--frobnicate", "--json")
    doc = document(result)
    assert (result.returncode, doc["command"], doc["error"]["code"]) == (2, "status", "usage")
    assert "--frobnicate" in doc["error"]["message"] and "--frobnicate" in result.stderr


def test_status_hosts_and_build_share_the_shape_when_they_succeed(two_host_inventory: Path, tmp_path: Path) -> None:
    inventory = two_host_inventory
    status = document(cli("status", "-i", str(inventory), "--json"))
    assert status["summary"]["ok"] == 1 and status["summary"]["unreachable"] == ["down"]
    assert {r["host"]: r["port"] for r in status["results"]}["down"]  # where each host is, as in the table
    hosts = document(cli("hosts", "-i", str(EXAMPLE), "--json"))
    assert hosts["ok"] and [r["host"] for r in hosts["results"]][:2] == ["gpu-1", "gpu-2"]
    from tests.release_fixtures import make_bundle

    bundle = make_bundle(tmp_path / "dist").path
    verified = document(cli("build", "--verify", str(bundle), "--allow-unsigned", "--json"))
    assert verified["command"] == "build --verify" and verified["manifest"]["payload_version"] == "1.0.0"


def test_lab_status_shares_the_shape(tmp_path: Path) -> None:
    env = {"DDTREE_LAB_STATE_DIR": str(tmp_path / "state"), "DDTREE_LAB_CACHE_DIR": str(tmp_path / "cache")}
    result = cli("lab", "status", "--repo-root", str(tmp_path), "--json", env=env)
    doc = document(result)
    assert doc["command"] == "lab status" and doc["results"] == [] and doc["hosts"] == []


# --- --debug, completion ------------------------------------------------------------------------------------


def test_debug_is_accepted_after_the_command_too(tmp_path: Path) -> None:
    after = cli("status", "-i", str(tmp_path / "missing.yaml"), "--debug")
    assert after.returncode == 2 and "Traceback" in after.stderr and "file not found" in after.stderr
    assert cli("hosts", "-i", str(EXAMPLE), "--debug").returncode == 0
    assert "--debug" in cli("push", "--help").stdout


def completions(words: str, cword: int, env: dict[str, str] | None = None) -> list[str]:
    result = cli(env={"_DDTREE_OPS_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword),
                      **(env or {})})
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_shell_completion_of_commands_options_and_inventory_hosts() -> None:
    assert "--install-completion" in cli("--help").stdout
    assert completions("ddtree-ops pu", 1) == ["push"]
    assert completions("ddtree-ops push --allow-u", 2) == ["--allow-unsigned"]
    assert completions(f"ddtree-ops status -i {EXAMPLE} --limit gpu", 5) == ["gpu-1", "gpu-2", "gpu-3"]
    assert completions("ddtree-ops history can", 2, env={"DDTREE_INVENTORY": str(EXAMPLE)}) == ["canary"]
    assert completions("ddtree-ops status --limit canary,gpu-", 3, env={"DDTREE_INVENTORY": str(EXAMPLE)}) == [
        "canary,gpu-1", "canary,gpu-2", "canary,gpu-3"]


# --- Ctrl-C, and a host that never sends its banner ---------------------------------------------------------


def test_ctrl_c_acts_at_once_says_what_it_interrupted_and_exits_130(tmp_path: Path, silent: SilentServer) -> None:
    inventory = tmp_path / "inv.yaml"
    (tmp_path / "known_hosts").write_text("")
    inventory.write_text(yaml.safe_dump({"all": {"vars": {"known_hosts": "known_hosts", "connect_timeout": 300}},
                                         "hosts": {"hung": {"address": "127.0.0.1", "port": silent.port}}}))
    argv = [sys.executable, "-c", "from ddtree_ops.cli import main; main()", "status", "-i", str(inventory), "--json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    # SIGINT as a shell gives it, whatever this test process inherited (an ignored SIGINT is inherited across exec).
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert silent.accepted.wait(60), "the CLI never connected"
        proc.send_signal(signal.SIGINT)
        # Well inside the 300 s connect timeout it would otherwise wait out.
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    doc = json.loads(out)
    assert doc["exit_code"] == 130 and doc["error"]["code"] == "interrupted"
    assert doc["error"]["message"].startswith("interrupted (Ctrl-C) during status")
    assert doc["results"][0]["status"] == "interrupted"
    assert "interrupted while connecting; nothing was changed" in doc["results"][0]["error"]["message"]
    assert "interrupted (Ctrl-C) during status" in err and "Traceback" not in err


def test_a_host_that_accepts_tcp_but_sends_no_banner_is_reported_as_that(tmp_path: Path, silent: SilentServer) -> None:
    from ddtree_ops import ssh
    from ddtree_ops.inventory import HostConfig

    (tmp_path / "known_hosts").write_text("")
    host = HostConfig(name="hung", address="127.0.0.1", port=silent.port, known_hosts=str(tmp_path / "known_hosts"),
                      connect_timeout=1.0)
    # paramiko's start_client returns at its timeout without raising, and the banner wait races it: both
    # orders of that race must read as a banner timeout, never as an authentication failure.
    for _ in range(4):
        with pytest.raises(ssh.ConnectionFailure) as failed:
            ssh.HostSession(host, retries=0).open()
        assert failed.value.code == "banner_timeout" and failed.value.unreachable
        assert "accepted the TCP connection but sent no SSH banner" in failed.value.message
        assert "MaxStartups" in failed.value.hint


# --- tables at 80 columns -------------------------------------------------------------------------------------


def test_status_and_hosts_are_readable_at_80_columns(two_host_inventory: Path) -> None:
    inventory = two_host_inventory
    for argv in (["status", "-i", str(inventory)], ["hosts", "-i", str(EXAMPLE)]):
        result = cli(*argv, env={"COLUMNS": "80"})
        lines = result.stdout.splitlines()
        assert lines and all(len(line) <= 80 for line in lines), result.stdout
        assert "not shown at 80 columns:" in result.stderr
    status = cli("status", "-i", str(inventory), env={"COLUMNS": "80"}).stdout
    # Whole cells, not slivers: the essential columns' titles and every host name appear unbroken.
    for word in ("Host", "Reachable", "Service", "Release", "Mode", "Lock", " up ", " down ", "none"):
        assert word in status, (word, status)
    wide = cli("status", "-i", str(inventory), env={"COLUMNS": "250"})
    assert "Free disk" in wide.stdout and "not shown" not in wide.stderr


# --- history and unlock select hosts as --limit says --------------------------------------------------------


def test_history_and_unlock_honour_limit_with_a_host_argument(two_host_inventory: Path) -> None:
    inventory = two_host_inventory
    both = cli("history", "up", "-i", str(inventory), "--limit", "up,down", "--json")
    assert [r["host"] for r in document(both)["results"]] == ["up"]
    limit_only = cli("history", "-i", str(inventory), "--limit", "up", "--json")
    assert [r["host"] for r in document(limit_only)["results"]] == ["up"]
    disjoint = cli("history", "up", "-i", str(inventory), "--limit", "down", "--json")
    assert disjoint.returncode == 2 and "no host in common" in document(disjoint)["error"]["message"]


def test_unlock_yes_reports_unreachable_hosts_first_and_counts_them(two_host_inventory: Path, tmp_path: Path) -> None:
    inventory = two_host_inventory
    state_dir = tmp_path / "state"
    # A dead run's lock (no heartbeat for longer than its TTL): unlock never breaks a live run's.
    held = run_agent("lock", {"state_dir": str(state_dir), "who": "ghost@elsewhere", "command": "push",
                              "host": "elsewhere", "pid": 1, "ttl_s": 0.5})
    assert held["ok"], held
    time.sleep(1.0)
    result = cli("unlock", "-i", str(inventory), "--yes", "--json")
    doc = document(result)
    lines = result.stderr.splitlines()
    unreachable = next(i for i, line in enumerate(lines) if line.startswith("down: unreachable, its lock was not checked"))
    locked = next(i for i, line in enumerate(lines) if line.startswith("up: locked by ghost@elsewhere"))
    assert unreachable < locked  # what could not be checked comes first
    assert result.returncode == 1 and doc["summary"]["unreachable"] == ["down"]
    by_host = {r["host"]: r for r in doc["results"]}
    assert by_host["up"]["status"] == "ok" and by_host["down"]["status"] == "unreachable"
    again = document(cli("unlock", "-i", str(inventory), "--yes", "--json", "--limit", "up"))
    assert again["results"][0]["data"] == {"message": "not locked", "noop": True}

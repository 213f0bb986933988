"""ssh.py against an in-process SSH server: host-key policy, retries, TCP_NODELAY, jump, agent."""

from __future__ import annotations

import shlex
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
from ssh_server import LocalSSHServer, write_private_key

from ddtree_ops import ssh
from ddtree_ops.agent.client import AgentCallError, call_agent
from ddtree_ops.inventory import HostConfig
from ddtree_ops.ssh import ConnectionFailure, HostSession, nodelay_enabled, remote_command


@pytest.fixture(scope="module")
def client_key() -> paramiko.PKey:
    return paramiko.ECDSAKey.generate()


@pytest.fixture
def server(client_key: paramiko.PKey) -> Iterator[LocalSSHServer]:
    srv = LocalSSHServer(host_key=paramiko.ECDSAKey.generate(), authorized_key=client_key).start()
    yield srv
    srv.stop()


@pytest.fixture
def host_factory(tmp_path: Path, client_key: paramiko.PKey, server: LocalSSHServer):
    identity = write_private_key(client_key, tmp_path / "id_ecdsa")
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(server.known_hosts_line())

    def make(**overrides: object) -> HostConfig:
        fields = {"name": "t1", "address": "127.0.0.1", "port": server.port, "identity_file": str(identity),
                  "known_hosts": str(known_hosts), "python": sys.executable, "connect_timeout": 5.0}
        fields.update(overrides)
        return HostConfig.model_validate(fields)

    return make


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssh, "BACKOFF_S", 0.01)


def test_run_with_known_key_stdin_stdout_stderr_exit_code(host_factory, server: LocalSSHServer) -> None:
    with HostSession(host_factory()) as session:
        result = session.run(["sh", "-c", "cat; echo err >&2; exit 3"], stdin=b"hello")
        assert (result.exit_code, result.stdout, result.stderr) == (3, b"hello", b"err\n")
        assert nodelay_enabled(session.conn)
        assert session.run(["echo", "a b", "c'd"]).stdout == b"a b c'd\n"
    assert server.commands[-1] == shlex.join(["echo", "a b", "c'd"])


def test_command_that_exits_before_reading_its_stdin_still_reports_its_exit_status(host_factory) -> None:
    # A missing interpreter answers 127 at once, while the agent source is still being sent:
    # the channel closes under the sender, and that must read as exit 127, not as a crash.
    with HostSession(host_factory()) as session:
        result = session.run(["sh", "-c", "echo gone >&2; exit 127"], stdin=b"x" * 50_000_000)
        assert (result.exit_code, result.stderr) == (127, b"gone\n")


def test_nodelay_can_be_disabled_for_benchmarks(host_factory) -> None:
    with HostSession(host_factory(), nodelay=False) as session:
        assert not nodelay_enabled(session.conn)


def test_unknown_host_key_is_refused_and_nothing_runs(host_factory, server: LocalSSHServer, tmp_path: Path) -> None:
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    session = HostSession(host_factory(known_hosts=str(empty)))
    with pytest.raises(ConnectionFailure) as info:
        session.open()
    assert info.value.code == "host_key_unknown" and not info.value.unreachable
    assert server.host_key.fingerprint in info.value.message and "ssh-keyscan" in (info.value.hint or "")
    assert session.attempts == 1  # a host-key refusal is not retried
    assert server.commands == []
    assert empty.read_text() == ""


def test_missing_known_hosts_file_is_refused_before_connecting(host_factory, server: LocalSSHServer, tmp_path: Path) -> None:
    with pytest.raises(ConnectionFailure) as info:
        HostSession(host_factory(known_hosts=str(tmp_path / "nope"))).open()
    assert info.value.code == "known_hosts_missing" and server.connections == 0


def test_changed_host_key_is_refused_even_with_accept_new(host_factory, server: LocalSSHServer, tmp_path: Path) -> None:
    other = paramiko.ECDSAKey.generate()
    stale = tmp_path / "stale_known_hosts"
    stale.write_text(paramiko.hostkeys.HostKeyEntry([f"[127.0.0.1]:{server.port}"], other).to_line())
    for policy in ("strict", "accept-new"):
        with pytest.raises(ConnectionFailure) as info:
            HostSession(host_factory(known_hosts=str(stale), host_key_policy=policy)).open()
        assert info.value.code == "host_key_changed"
    assert server.commands == []


def test_accept_new_adds_the_key_and_says_so(host_factory, server: LocalSSHServer, tmp_path: Path) -> None:
    fresh = tmp_path / "sub" / "fresh_known_hosts"
    notices: list[str] = []
    with HostSession(host_factory(known_hosts=str(fresh), host_key_policy="accept-new"), notice=notices.append) as s:
        assert s.run(["true"]).exit_code == 0
    assert len(notices) == 1 and "accepted new host key" in notices[0] and str(fresh) in notices[0]
    assert f"[127.0.0.1]:{server.port}" in fresh.read_text()
    # From now on the key is known: a strict connection succeeds without any notice.
    with HostSession(host_factory(known_hosts=str(fresh))) as s:
        assert s.run(["true"]).exit_code == 0 and s.notices == []


def test_auth_failure_is_not_retried(host_factory, tmp_path: Path) -> None:
    wrong = write_private_key(paramiko.ECDSAKey.generate(), tmp_path / "wrong")
    session = HostSession(host_factory(identity_file=str(wrong)))
    with pytest.raises(ConnectionFailure) as info:
        session.open()
    assert info.value.code == "auth_failed" and session.attempts == 1


def test_refused_connection_is_retried_then_unreachable(host_factory) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    session = HostSession(host_factory(port=free_port), retries=2)
    with pytest.raises(ConnectionFailure) as info:
        session.open()
    assert info.value.unreachable and info.value.code == "unreachable"
    assert session.attempts == 3 and "after 3 attempt(s)" in info.value.message


def test_jump_host(host_factory, server: LocalSSHServer) -> None:
    target = host_factory(name="target", jump_host="jump")
    jump = host_factory(name="jump")
    with HostSession(target, jump_chain=[jump]) as session:
        assert session.run(["echo", "via jump"]).stdout == b"via jump\n"
        assert nodelay_enabled(session.conn.gateway)  # Nagle is off on the real socket, the jump's
    assert server.forwards == [("127.0.0.1", server.port)]


def test_sudo_prefix_quotes_every_argument() -> None:
    assert remote_command(["/opt/p y", "-c", "x; y"], sudo=True) == "sudo -n -- '/opt/p y' -c 'x; y'"
    assert remote_command(["/opt/p"], sudo=False) == "/opt/p"


def test_agent_round_trip_over_ssh(host_factory, tmp_path: Path) -> None:
    with HostSession(host_factory()) as session:
        facts = call_agent(session, "facts", {"state_dir": str(tmp_path), "service": "sglang.service"})
    assert facts["python"]["executable"] == sys.executable
    assert facts["disk"]["free_bytes"] > 0


def test_hostile_python_path_runs_nothing(host_factory, server: LocalSSHServer, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    python = f"/nonexistent/py'; touch {marker}; echo '$(touch {marker})`touch {marker}`"
    with HostSession(host_factory(python=python)) as session, pytest.raises(AgentCallError) as info:
        call_agent(session, "facts", {"state_dir": str(tmp_path)})
    assert info.value.code == "python_not_found"
    assert not marker.exists()
    assert shlex.split(server.commands[0])[0] == python  # arrived as one word


def test_timeouts_are_not_retried_past_one_connect_timeout(host_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def slow_timeout(self):
        calls.append(1)
        ssh.time.sleep(0.3)
        raise ssh._HopError(self.host, TimeoutError("timed out"))

    monkeypatch.setattr(HostSession, "_connect_once", slow_timeout)
    session = HostSession(host_factory(connect_timeout=0.25), retries=5)
    with pytest.raises(ConnectionFailure) as info:
        session.open()
    assert info.value.unreachable and len(calls) == 1


@pytest.mark.parametrize(("exc", "unreachable"), [
    (paramiko.SSHException("Timeout opening channel."), True),  # a jump host that cannot reach a powered-off target
    (paramiko.ChannelException(2, "Connect failed"), True),  # ... or that is refused at once
    (paramiko.SSHException("Error reading SSH protocol banner"), True),
    (paramiko.SSHException("Incompatible ssh peer (no acceptable kex algorithm)"), False),
])
def test_a_target_the_jump_host_cannot_reach_is_unreachable(exc: Exception, unreachable: bool) -> None:
    from ddtree_ops.inventory import HostConfig
    from ddtree_ops.ssh import _describe_failure

    failure = _describe_failure(HostConfig(name="gpu-1", address="10.0.0.5", jump_host="bastion"), exc, 3)
    assert (failure.code == "unreachable") is unreachable
    if unreachable:
        assert "through jump host bastion" in failure.hint

"""A non-root operator with sudo, control side: the agent under `sudo -n`, a password from the environment given
only when sudo asks (once), and every way sudo refuses reported with what to fix; the password is never sent
into the agent, put on a command line, or printed.

The SSH server is the in-process paramiko one; `sudo` on its commands' PATH is tests/sudo_stand_in.py (real sudo
cannot be set up on the test machine; the lab hosts have it). A missing sudo is the real login shell's answer."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
import yaml
from ssh_server import LocalSSHServer, write_private_key
from test_cli import cli

from ddtree_ops import sudo
from ddtree_ops.agent.client import AgentCallError, call_agent
from ddtree_ops.errors import UsageError
from ddtree_ops.inventory import HostConfig
from ddtree_ops.ssh import HostSession, SudoRefused

PASSWORD = "s3cret pass'word $(touch /tmp/no)"
STAND_IN = Path(__file__).with_name("sudo_stand_in.py")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LocalSSHServer]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sudo").write_text(f"#!/bin/sh\nexec {sys.executable} {STAND_IN} \"$@\"\n")
    (bin_dir / "sudo").chmod(0o755)
    client_key = paramiko.ECDSAKey.generate()
    srv = LocalSSHServer(host_key=paramiko.ECDSAKey.generate(), authorized_key=client_key)
    srv.env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STANDIN_SUDO_LOG": str(tmp_path / "sudo.log"),
               "STANDIN_SUDO_PASSWORD": PASSWORD, "STANDIN_SUDO_RULE": "nopasswd"}
    srv.start()
    write_private_key(client_key, tmp_path / "id_ecdsa")
    (tmp_path / "known_hosts").write_text(srv.known_hosts_line())
    srv.client_key = client_key
    yield srv
    srv.stop()


def host(tmp_path: Path, server: LocalSSHServer, **fields: object) -> HostConfig:
    return HostConfig.model_validate({
        "name": "h1", "address": "127.0.0.1", "port": server.port, "user": "deploy", "sudo": True,
        "identity_file": str(tmp_path / "id_ecdsa"), "known_hosts": str(tmp_path / "known_hosts"),
        "python": sys.executable, "state_dir": str(tmp_path / "state"), "connect_timeout": 5.0, **fields})


def facts(h: HostConfig) -> dict:
    with HostSession(h) as session:
        return call_agent(session, "facts", {"state_dir": h.state_dir, "service": "sglang.service", "files": []})


def password_reads(tmp_path: Path) -> int:
    log = tmp_path / "sudo.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def password_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TEST_SUDO_PASSWORD", PASSWORD)
    return "TEST_SUDO_PASSWORD"


def test_a_nopasswd_rule_runs_the_agent_under_sudo_n(tmp_path: Path, server: LocalSSHServer) -> None:
    assert facts(host(tmp_path, server))["python"]["executable"] == sys.executable
    assert server.commands[-1].startswith("sudo -n -- ") and password_reads(tmp_path) == 0


def test_a_password_from_the_environment_answers_sudo_once(tmp_path: Path, server: LocalSSHServer,
                                                           password_env: str) -> None:
    server.env["STANDIN_SUDO_RULE"] = "password"
    answer = facts(host(tmp_path, server, sudo_password_env=password_env))
    assert answer["python"]["executable"] == sys.executable  # the agent got its own input, after the password
    assert password_reads(tmp_path) == 1
    command = server.commands[-1]
    assert command.startswith("sudo -S -p '[ddtree-ops sudo password ") and command.endswith(" --ready")
    assert not any(PASSWORD in c for c in server.commands)  # never on a command line


def test_a_password_is_not_sent_when_sudo_does_not_ask(tmp_path: Path, server: LocalSSHServer, password_env: str) -> None:
    # A NOPASSWD rule (or cached credentials): sudo starts the agent at once; the password must not reach it.
    h = host(tmp_path, server, sudo_password_env=password_env)
    with HostSession(h) as session:
        from ddtree_ops.agent.shipping import READY, agent_argv, agent_stdin

        result = session.run(agent_argv(h.python, ready=True), stdin=agent_stdin("facts", {"state_dir": h.state_dir}),
                             ready=READY.encode())
    assert result.exit_code == 0 and json.loads(result.stdout)["ok"] is True
    assert PASSWORD.encode() not in result.stdout + result.stderr and password_reads(tmp_path) == 0


def test_a_wrong_password_is_tried_once_and_never_shown(tmp_path: Path, server: LocalSSHServer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    server.env["STANDIN_SUDO_RULE"] = "password"
    monkeypatch.setenv("TEST_SUDO_PASSWORD", "wrong-" + PASSWORD)
    with pytest.raises(SudoRefused) as refused:
        facts(host(tmp_path, server, sudo_password_env="TEST_SUDO_PASSWORD"))
    assert refused.value.code == "sudo_password_wrong" and "sudo_password_env" in refused.value.hint
    assert password_reads(tmp_path) == 1  # not three: a PAM lockout counts failures
    assert PASSWORD not in refused.value.message + refused.value.hint


@pytest.mark.parametrize(("rule", "code", "hint"), [
    ("password", "sudo_password_required", "sudo_password_env"),
    ("denied", "sudo_not_allowed", f"deploy ALL=(root) NOPASSWD: {sys.executable}"),
])
def test_sudo_refusals_are_reported_with_what_to_fix(tmp_path: Path, server: LocalSSHServer, rule: str, code: str,
                                                      hint: str) -> None:
    server.env["STANDIN_SUDO_RULE"] = rule
    with pytest.raises(AgentCallError) as refused:
        facts(host(tmp_path, server))
    assert refused.value.code == code and hint in refused.value.hint


def test_a_host_without_sudo_is_reported_as_that(tmp_path: Path, server: LocalSSHServer) -> None:
    server.env["PATH"] = str(tmp_path / "empty")  # the real login shell: `sudo: not found`, exit 127
    with pytest.raises(AgentCallError) as refused:
        facts(host(tmp_path, server))
    assert refused.value.code == "sudo_missing" and "apt-get install sudo" in refused.value.hint


def test_the_cli_refuses_before_any_host_when_a_needed_password_is_missing(tmp_path: Path,
                                                                           server: LocalSSHServer) -> None:
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(yaml.safe_dump({
        "all": {"vars": {"identity_file": "id_ecdsa", "known_hosts": "known_hosts", "user": "deploy", "sudo": True,
                         "sudo_password_env": "TEST_SUDO_PASSWORD_UNSET", "python": sys.executable}},
        "hosts": {"h1": {"address": "127.0.0.1", "port": server.port}}}))
    result = cli("status", "-i", str(inventory), "--json")  # stdin is no terminal: nobody to ask
    assert result.returncode == 2, result.stderr
    assert json.loads(result.stdout)["error"]["code"] == "sudo_password_missing"
    assert "$TEST_SUDO_PASSWORD_UNSET is not set and there is no terminal" in result.stderr
    assert server.connections == 0


def test_the_cli_reports_a_wrong_password_without_showing_it(tmp_path: Path, server: LocalSSHServer) -> None:
    server.env["STANDIN_SUDO_RULE"] = "password"
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(yaml.safe_dump({
        "all": {"vars": {"identity_file": "id_ecdsa", "known_hosts": "known_hosts", "user": "deploy", "sudo": True,
                         "sudo_password_env": "TEST_SUDO_PASSWORD", "python": sys.executable}},
        "hosts": {"h1": {"address": "127.0.0.1", "port": server.port}}}))
    result = cli("status", "-i", str(inventory), "--json", "--debug", env={"TEST_SUDO_PASSWORD": "not-" + PASSWORD})
    assert result.returncode == 1
    assert json.loads(result.stdout)["results"][0]["error"]["code"] == "sudo_password_wrong"
    assert PASSWORD not in result.stdout + result.stderr


def test_passwords_are_asked_once_per_variable_before_any_host(tmp_path: Path, server: LocalSSHServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_SUDO_PASSWORD", raising=False)
    monkeypatch.setattr(sudo, "_typed", {})
    hosts = [host(tmp_path, server, name=n, sudo_password_env="TEST_SUDO_PASSWORD") for n in ("h1", "h2")]
    asked: list[str] = []
    sudo.ask_passwords([*hosts, host(tmp_path, server, name="h3")], ask=lambda p: asked.append(p) or PASSWORD)
    assert asked == ["sudo password for h1, h2 ($TEST_SUDO_PASSWORD): "]
    assert sudo.password_for(hosts[1]) == PASSWORD and sudo.password_for(host(tmp_path, server)) is None
    server.env["STANDIN_SUDO_RULE"] = "password"
    assert facts(hosts[0])["python"]["executable"] == sys.executable
    sudo.ask_passwords(hosts, ask=lambda p: pytest.fail("asked twice"))
    with pytest.raises(UsageError, match="no sudo password given"):
        monkeypatch.setattr(sudo, "_typed", {})
        sudo.ask_passwords(hosts, ask=lambda p: "")


def test_sudo_password_env_without_sudo_is_an_inventory_error(tmp_path: Path) -> None:
    from ddtree_ops.inventory import InventoryError, load_inventory

    path = tmp_path / "inv.yaml"
    path.write_text("all:\n  vars: {sudo_password_env: SUDO_PW}\nhosts:\n  a: {address: x}\n")
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    assert err.value.issues[0].path == "all.vars.sudo_password_env" and "set `sudo: true`" in err.value.hint
    assert os.environ.get("SUDO_PW") is None


# --- the agent's side of a sudo upload: the login user's file in /tmp, imported into root's staging dir ----


def _upload(tmp_path: Path, bundle: Path, how: str) -> str:
    src = f"/tmp/.ddtree-upload-{os.urandom(6).hex()}"
    if how == "link":
        os.symlink(bundle, src)
    else:
        Path(src).write_bytes(bundle.read_bytes())
    return src


@pytest.mark.parametrize(("how", "env", "code"), [
    ("file", {}, None),
    ("link", {}, "bad_upload"),  # a link to some other file (say /etc/shadow) is never opened
    ("file", {"SUDO_UID": "4242"}, "bad_upload"),  # not the file of the user sudo came from
])
def test_the_agent_imports_only_the_login_users_own_upload(tmp_path: Path, how: str, env: dict, code: str | None) -> None:
    from tests.release_fixtures import make_bundle, run_agent, sha

    bundle = make_bundle(tmp_path / "dist").path
    state_dir = tmp_path / "state"
    begun = run_agent("stage_begin", {"state_dir": str(state_dir), "name": bundle.name, "size": bundle.stat().st_size})
    assert begun["ok"], begun
    src = _upload(tmp_path, bundle, how)
    try:
        answer = run_agent("stage_verify", {"state_dir": str(state_dir), "bundle": bundle.name, "import_from": src,
                                            "bundle_sha256": sha(bundle.read_bytes())}, env={**os.environ, **env})
    finally:
        Path(src).unlink(missing_ok=True)
    if code is None:
        assert answer["ok"] and (state_dir / "staging" / bundle.name).read_bytes() == bundle.read_bytes()
        assert not os.path.lexists(src)  # the agent removes the upload
    else:
        assert answer["error"]["code"] == code, answer
        assert not (state_dir / "staging" / bundle.name).exists()

"""The operator's path on the lab: an unprivileged login through the bastion, sudo for the host agent.

lab.yaml logs in as `ops` through lab-bastion with `sudo: true`, so every other lab test already
runs that way; these tests break sudo on one host in the ways real hosts do and check what the
operator is told, give sudo a password for real, and keep root logins working.
"""

from __future__ import annotations

import json
import secrets
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_status import cli, inventory_copy, status_json

from ddtree_ops.lab.host import sudo_rule

pytestmark = pytest.mark.lab

HOST = "lab-3"
RULE_FILE = "/etc/sudoers.d/ddtree-ops-lab"


def _set_sudo_rule(lab_fleet, rule: str | None) -> None:
    """As root on HOST: the operator's sudo rule replaced (checked by visudo first), or removed."""
    if rule is None:
        command = f"rm -f {RULE_FILE}"
    else:
        command = (f"printf '%s\\n' {shlex.quote(rule)} > {RULE_FILE}.new && chmod 440 {RULE_FILE}.new && "
                   f"visudo -cqf {RULE_FILE}.new && mv -f {RULE_FILE}.new {RULE_FILE}")
    result = lab_fleet.ssh(HOST, command)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def sudo_restored(lab_fleet) -> Iterator[None]:
    yield
    _set_sudo_rule(lab_fleet, sudo_rule())
    lab_fleet.ssh(HOST, "usermod -p '*' ops")


def _failure(inventory: Path) -> dict:
    code, rows = status_json(inventory, "--limit", HOST)
    assert code == 1 and rows[HOST]["status"] == "failed", rows
    return rows[HOST]["error"]


def test_sudo_that_asks_for_a_password_the_inventory_does_not_give_is_refused(lab_fleet, sudo_restored) -> None:
    _set_sudo_rule(lab_fleet, sudo_rule().replace("NOPASSWD: ", ""))
    error = _failure(lab_fleet.inventory_path)
    assert error["code"] == "sudo_password_required"
    assert "asks for ops's password" in error["message"] and "sudo_password_env" in error["hint"]
    assert "NOPASSWD" in error["hint"]  # or the rule that needs none


def test_sudo_that_does_not_allow_the_operator_is_refused_with_the_rule_to_add(lab_fleet, sudo_restored) -> None:
    _set_sudo_rule(lab_fleet, None)
    error = _failure(lab_fleet.inventory_path)
    assert error["code"] in ("sudo_not_allowed", "sudo_password_required"), error
    assert "/opt/sglang/venv/bin/python" in error["hint"] or "sudo_password_env" in error["hint"]


def test_sudo_with_a_password_from_the_environment_never_shows_it(lab_fleet, sudo_restored, tmp_path: Path) -> None:
    password = "lab-" + secrets.token_urlsafe(12)
    chpasswd = lab_fleet.ssh(HOST, f"echo {shlex.quote('ops:' + password)} | chpasswd")
    assert chpasswd.returncode == 0, chpasswd.stderr
    _set_sudo_rule(lab_fleet, sudo_rule().replace("NOPASSWD: ", ""))
    inventory = inventory_copy(lab_fleet, tmp_path, lambda d: d["all"]["vars"].update(
        sudo_password_env="LAB_TEST_SUDO_PASSWORD"))
    ok = cli("status", "-i", str(inventory), "--limit", HOST, "--json", env={"LAB_TEST_SUDO_PASSWORD": password})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads(ok.stdout)["results"][0]["data"]["user"]["uid"] == 0
    wrong = cli("status", "-i", str(inventory), "--limit", HOST, "--json", env={"LAB_TEST_SUDO_PASSWORD": password + "x"})
    assert wrong.returncode == 1
    assert json.loads(wrong.stdout)["results"][0]["error"]["code"] == "sudo_password_wrong"
    for result in (ok, wrong):
        assert password not in result.stdout + result.stderr
    journal = lab_fleet.ssh(HOST, "journalctl --no-pager -o cat -n 2000")
    assert journal.returncode == 0 and password not in journal.stdout


def test_root_logins_keep_working(lab_fleet, tmp_path: Path) -> None:
    # The jump stays the operator's (`ops@` in jump_host); the hosts are logged into as root, no sudo.
    inventory = inventory_copy(lab_fleet, tmp_path, lambda d: d["all"]["vars"].update(user="root", sudo=False))
    code, rows = status_json(inventory)
    assert code == 0 and {row["data"]["user"]["uid"] for row in rows.values()} == {0}

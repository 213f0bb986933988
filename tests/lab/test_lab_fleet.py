"""The lab fleet itself: real nspawn hosts with systemd, sshd and SGLang, on a private bridge."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ddtree_ops.lab import fleet
from ddtree_ops.lab.config import BRIDGE, LabPaths
from ddtree_ops.lab.image import SERVER_ARGS_SMOKE


def _nspawn_processes() -> list[int]:
    """Live (not zombie) systemd-nspawn processes booting lab hosts."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if (
            state != "Z"
            and cmdline
            and cmdline[0].endswith(b"systemd-nspawn")
            and b"--machine=lab-" in b" ".join(cmdline)
        ):
            pids.append(int(proc.name))
    return pids


def _net_namespaces_in_use() -> set[str]:
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                found.add(os.readlink(proc / "ns" / "net"))
    return found


def _host_net_namespaces() -> set[str]:
    """The network namespaces of the running lab hosts (their nspawn's child is the container's init)."""
    namespaces = set()
    for pid in _nspawn_processes():
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                namespaces.add(os.readlink(f"/proc/{child}/ns/net"))
    return namespaces


def _lab_mounts() -> list[str]:
    hosts_dir = str(LabPaths.from_env().hosts)
    leftovers = []
    for mountinfo in Path("/proc").glob("[0-9]*/mountinfo"):
        try:
            leftovers += [line for line in mountinfo.read_text().splitlines() if hosts_dir in line]
        except OSError:
            continue
    return leftovers


def _lab_interfaces() -> list[str]:
    return sorted(
        p.name for p in Path("/sys/class/net").iterdir() if p.name.startswith(("ddtlab", "vb-lab-"))
    )


@pytest.mark.lab
def test_three_hosts_and_the_bastion_answer_ssh_with_their_own_host_keys(lab_fleet):
    assert lab_fleet.hosts == ["lab-1", "lab-2", "lab-3"]
    assert lab_fleet.addresses == {"lab-bastion": "10.200.0.10", "lab-1": "10.200.0.11", "lab-2": "10.200.0.12",
                                   "lab-3": "10.200.0.13"}
    entries = [line.split() for line in lab_fleet.known_hosts.read_text().splitlines()]
    assert [e[0] for e in entries] == ["10.200.0.10", "10.200.0.11", "10.200.0.12", "10.200.0.13"]
    assert all(e[1] == "ssh-ed25519" for e in entries)
    assert len({e[2] for e in entries}) == 4, "hosts share a host key"
    machine_ids = set()
    for name in ["lab-bastion", *lab_fleet.hosts]:
        result = lab_fleet.ssh(name, "hostname; cat /etc/machine-id; systemctl is-system-running")
        assert result.returncode == 0, result.stderr
        hostname, machine_id, state = result.stdout.split()
        assert hostname == name
        assert state == "running"
        machine_ids.add(machine_id)
        # The key the host actually serves (as the bastion sees it) is the one the lab wrote to known_hosts.
        scanned = lab_fleet.ssh("lab-bastion", f"ssh-keyscan -t ed25519 {lab_fleet.addresses[name]}", timeout=30)
        served = scanned.stdout.split()
        assert served[1:3] in [e[1:3] for e in entries if e[0] == lab_fleet.addresses[name]]
    assert len(machine_ids) == 4


@pytest.mark.lab
def test_only_the_bastion_takes_ssh_from_this_machine(lab_fleet):
    from ddtree_ops.lab.host import ssh_port_open

    assert ssh_port_open(lab_fleet.addresses["lab-bastion"])
    for name in lab_fleet.hosts:
        with pytest.raises(OSError):  # refused here, by this machine's own routing rule: no packet leaves
            socket.create_connection((lab_fleet.addresses[name], 22), timeout=3).close()
        # … while the bastion reaches it, and so do ddtree-ops (lab.yaml's jump_host) and the lab itself
        probe = lab_fleet.ssh("lab-bastion", _connect_probe(lab_fleet.addresses[name], 22, python="python3"))
        assert probe.stdout.strip() == "ok", probe.stderr
    assert fleet.lab_status(lab_fleet.repo_root).all_up


@pytest.mark.lab
def test_the_operator_logs_in_unprivileged_and_sudo_runs_only_the_agents_python(lab_fleet):
    who = lab_fleet.ssh("lab-1", "id -un; id -u; sudo -n /opt/sglang/venv/bin/python -c 'import os; print(os.getuid())'",
                        user="ops")
    assert who.returncode == 0, who.stderr
    user, uid, agent_uid = who.stdout.split()
    assert (user, agent_uid) == ("ops", "0") and uid != "0"
    other = lab_fleet.ssh("lab-1", "sudo -n /bin/true", user="ops")
    assert other.returncode != 0 and "sudo" in other.stderr
    # the bastion: a login, no sudo rule at all
    assert lab_fleet.ssh("lab-bastion", "sudo -n -l", user="ops").returncode != 0


@pytest.mark.lab
def test_inventory_is_ready_to_use(lab_fleet):
    inventory = yaml.safe_load(lab_fleet.inventory_path.read_text())
    assert lab_fleet.inventory_path == lab_fleet.repo_root / "inventory" / "lab.yaml"
    assert inventory["all"]["vars"] == {
        "user": "ops",
        "sudo": True,
        "jump_host": "ops@10.200.0.10",
        "identity_file": "lab/id_ed25519",
        "known_hosts": "lab/known_hosts",
        "python": "/opt/sglang/venv/bin/python",
        "service": "sglang.service",
        "state_dir": "/var/lib/ddtree-ops",
        "serve_port": 30000,
        # The lab engine stands in for sglang.launch_server, with the models `lab up` wrote.
        "server_module": "ddtree_lab_engine",
        "model_path": "/opt/ddtree-lab/models/target",
        "draft_model_path": "/opt/ddtree-lab/models/draft",
        "extra_args": ["--device", "cpu"],
    }
    assert inventory["groups"] == {"canary": {"hosts": ["lab-1"]}, "main": {"hosts": ["lab-2", "lab-3"]}}
    assert inventory["hosts"]["lab-2"] == {"address": "10.200.0.12", "port": 22}
    assert inventory["signers"] == {"lab": "lab/signer_ed25519.pub"}  # what the rehearsal signs with
    assert (lab_fleet.inventory_path.parent / "lab" / "signer_ed25519").stat().st_mode & 0o077 == 0
    assert lab_fleet.identity_file.stat().st_mode & 0o077 == 0, "ssh refuses a key others can read"


@pytest.mark.lab
def test_only_the_lab_key_logs_in(lab_fleet, tmp_path):
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    argv = lab_fleet.ssh_argv("lab-1", "true")
    argv[argv.index("-i") + 1] = str(stranger)
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert refused.returncode == 255
    assert "Permission denied" in refused.stderr


@pytest.mark.lab
def test_unknown_host_key_is_refused(lab_fleet, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    argv = lab_fleet.ssh_argv("lab-1", "true")
    argv[argv.index(f"UserKnownHostsFile={lab_fleet.known_hosts}")] = f"UserKnownHostsFile={empty}"
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert refused.returncode == 255
    assert "Host key verification failed" in refused.stderr


@pytest.mark.lab
def test_lab_up_again_is_idempotent(lab_fleet):
    before = fleet.lab_status(lab_fleet.repo_root)
    known_hosts = lab_fleet.known_hosts.read_text()
    started = time.monotonic()
    after = fleet.lab_up(3, lab_fleet.repo_root)
    assert time.monotonic() - started < 30
    assert [(h.name, h.pid) for h in after.hosts] == [(h.name, h.pid) for h in before.hosts], (
        "hosts were restarted"
    )
    assert after.all_up
    assert lab_fleet.known_hosts.read_text() == known_hosts


@pytest.mark.lab
def test_host_venv_imports_sglang_and_parses_dflash_args(lab_fleet):
    result = lab_fleet.ssh(
        "lab-2", shlex.join(["/opt/sglang/venv/bin/python", "-c", SERVER_ARGS_SMOKE]), timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    assert parsed["version"] == "0.5.13.post1"
    assert "DFLASH" in parsed["algorithm"]
    assert parsed["draft"] is True
    assert parsed["draft_tokens"] == 16


def _connect_probe(address: str, port: int, python: str = "/opt/sglang/venv/bin/python") -> str:
    code = f"import socket; socket.create_connection(({address!r}, {port}), timeout=3); print('ok')"
    return shlex.join([python, "-c", code])


@pytest.mark.lab
def test_hosts_reach_each_other_but_nothing_beyond_the_bridge(lab_fleet):
    peer = lab_fleet.ssh("lab-1", _connect_probe("10.200.0.12", 22))
    assert peer.stdout.strip() == "ok", peer.stderr
    route = lab_fleet.ssh("lab-1", "ip route get 1.1.1.1")
    assert route.returncode != 0
    assert "unreachable" in route.stderr.lower()
    assert lab_fleet.ssh("lab-1", _connect_probe("1.1.1.1", 53)).returncode != 0
    # Even a host that routes via the bridge gets nowhere: this machine does not forward for it.
    assert Path(f"/proc/sys/net/ipv4/conf/{BRIDGE}/forwarding").read_text().strip() == "0"
    assert lab_fleet.ssh("lab-1", "ip route add default via 10.200.0.1").returncode == 0
    try:
        assert lab_fleet.ssh("lab-1", _connect_probe("1.1.1.1", 53)).returncode != 0
    finally:
        lab_fleet.ssh("lab-1", "ip route del default via 10.200.0.1")


@pytest.mark.lab
def test_one_host_stopped_and_started_again(lab_fleet):
    fleet.stop_host("lab-3")
    try:
        status = fleet.lab_status(lab_fleet.repo_root)
        assert not status.host("lab-3").running and not status.host("lab-3").ssh
        assert status.host("lab-1").ssh and status.host("lab-2").ssh
        assert lab_fleet.ssh("lab-3", "true", timeout=30).returncode == 255
    finally:
        fleet.start_host("lab-3")
    result = lab_fleet.ssh("lab-3", "hostname")
    assert result.returncode == 0 and result.stdout.strip() == "lab-3", result.stderr


@pytest.mark.lab
def test_status_cli_json(lab_fleet):
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ddtree_ops.lab.cli import lab_app; lab_app()",
            "status",
            "--json",
            "--repo-root",
            str(lab_fleet.repo_root),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["all_up"] is True
    assert [(h["name"], h["role"]) for h in status["hosts"]] == [("lab-bastion", "bastion")] + [
        (name, "gpu") for name in lab_fleet.hosts
    ]


@pytest.mark.lab
@pytest.mark.lab_destructive
def test_down_leaves_nothing_behind_and_up_works_twice(lab_exclusive):
    lab_fleet = lab_exclusive
    for _ in range(2):
        host_namespaces = _host_net_namespaces()
        assert len(host_namespaces) == 4  # and the bastion
        fleet.lab_down(lab_fleet.repo_root)
        assert _nspawn_processes() == []
        assert _lab_mounts() == []
        assert _lab_interfaces() == []
        assert subprocess.run(["ip", "-4", "rule", "show", "pref", "17411"], capture_output=True, text=True,
                              check=True).stdout == "", "the lab's routing rule outlived it"
        assert not host_namespaces & _net_namespaces_in_use(), "a host's network namespace outlived it"
        assert not lab_fleet.inventory_path.exists()
        fleet.lab_down(lab_fleet.repo_root)  # nothing up: still fine
        status = fleet.lab_up(3, lab_fleet.repo_root)
        assert status.all_up
        for name in lab_fleet.hosts:
            assert lab_fleet.ssh(name, "true").returncode == 0


def test_lab_cli_import_stays_light():
    probe = (
        "import sys, ddtree_ops.lab.cli; "
        "print([m for m in ('fabric', 'paramiko', 'torch', 'yaml') if m in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


# Plain unit tests of the lab's pure parts (no fleet needed).


def test_inventory_for_one_host_has_no_empty_main_group(tmp_path):
    from ddtree_ops.lab.host import LabHost
    from ddtree_ops.lab.inventory_file import render

    paths = LabPaths(cache=tmp_path / "cache", state=tmp_path / "state")
    rendered = render([LabHost("lab-1", paths)])
    assert (rendered["all"]["vars"]["user"], rendered["all"]["vars"]["jump_host"]) == ("ops", "ops@10.200.0.10")
    assert rendered["groups"] == {"canary": {"hosts": ["lab-1"]}}
    assert rendered["hosts"] == {"lab-1": {"address": "10.200.0.11", "port": 22}}
    # the lab's serving unit runs the lab engine on the lab's models, on production's port
    vars_ = rendered["all"]["vars"]
    assert (vars_["server_module"], vars_["serve_port"]) == ("ddtree_lab_engine", 30000)
    assert (vars_["model_path"], vars_["draft_model_path"]) == ("/opt/ddtree-lab/models/target",
                                                                "/opt/ddtree-lab/models/draft")


@pytest.mark.parametrize("name", ["lab-0", "lab-51", "lab-bastion2", "lab-x", "gpu-1", "lab-1; rm -rf /", "../lab-1"])
def test_foreign_host_names_are_refused(name):
    from ddtree_ops.lab.config import host_index

    with pytest.raises(ValueError):
        host_index(name)


def test_apt_packages_printable_without_dependencies():
    # The install script runs this with Debian's python3 before any venv exists.
    result = subprocess.run(
        ["/usr/bin/python3", "-m", "ddtree_ops.lab.image", "apt-packages"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    packages = result.stdout.split()
    assert {"systemd-container", "debootstrap", "iproute2", "openssh-client"} <= set(packages)


def test_a_host_in_the_middle_of_exec_still_counts_as_running(tmp_path):
    # The launcher execs unshare -> sh -> nspawn; while each execve runs, /proc/<pid>/cmdline
    # reads empty. A chain of thousands of execs, carrying the host's markers, must read as
    # "running" on every poll until it really exits.
    from ddtree_ops.lab.host import LabHost, running_pid

    host = LabHost("lab-1", LabPaths(cache=tmp_path / "cache", state=tmp_path / "state"))
    host.dir.mkdir(parents=True)
    chain = 'n=$1; shift; [ "$n" -gt 0 ] && exec sh -c "$CHAIN" chain $((n-1)) "$@"; sleep 1'
    proc = subprocess.Popen(
        ["sh", "-c", chain, "chain", "2000", f"--machine={host.name}", f"--directory={host.root}"],
        env={**os.environ, "CHAIN": chain},
    )
    host.pid_file.write_text(f"{proc.pid}\n")
    polls = misses = 0
    try:
        while proc.poll() is None:
            seen = running_pid(host)
            # A None is only right once the chain is done (exited, or sleeping out its last second).
            if seen is None and proc.poll() is None:
                misses += 1
            polls += 1
    finally:
        proc.kill()
        proc.wait()
    assert polls > 100 and misses == 0
    assert running_pid(host) is None  # exited (and reaped): no longer running


def test_a_host_on_another_sglang_gets_its_venvs_python_in_the_inventory(tmp_path):
    from ddtree_ops.lab.host import LabHost, sudo_rule
    from ddtree_ops.lab.inventory_file import render

    paths = LabPaths(cache=tmp_path / "cache", state=tmp_path / "state")
    old, new = LabHost("lab-1", paths), LabHost("lab-2", paths)
    new.dir.mkdir(parents=True)
    new.sglang_file.write_text("0.5.23\n")
    assert (old.sglang(), new.sglang()) == ("0.5.13.post1", "0.5.23")
    rendered = render([old, new])
    assert rendered["all"]["vars"]["python"] == "/opt/sglang/venv/bin/python"
    assert rendered["hosts"] == {"lab-1": {"address": "10.200.0.11", "port": 22},
                                 "lab-2": {"address": "10.200.0.12", "port": 22,
                                           "python": "/opt/sglang-0.5.23/venv/bin/python"}}
    assert sudo_rule(new.python) == "ops ALL=(root) NOPASSWD: /opt/sglang-0.5.23/venv/bin/python"


def test_sglang_choices_are_checked_before_anything_boots():
    from ddtree_ops.lab.cli import _parse_versions
    from ddtree_ops.lab.fleet import _host_versions
    from ddtree_ops.lab.steps import LabError

    assert _host_versions(2, {"lab-2": "0.5.23"}) == {"lab-1": "0.5.13.post1", "lab-2": "0.5.23"}
    with pytest.raises(LabError, match=r"lab-3, not one of this fleet's hosts \(lab-1 … lab-2\)"):
        _host_versions(2, {"lab-3": "0.5.23"})
    with pytest.raises(LabError, match=r"--sglang 0.5.17: the lab image carries SGLang 0.5.13.post1, 0.5.23 only"):
        _host_versions(2, {"lab-1": "0.5.17"})
    assert _parse_versions(["lab-2=0.5.23"]) == {"lab-2": "0.5.23"}
    for bad in (["lab-2"], ["=0.5.23"], ["lab-2=0.5.23", "lab-2=0.5.13.post1"]):
        with pytest.raises(LabError):
            _parse_versions(bad)


def test_the_image_recipe_carries_each_sglang_venv():
    from ddtree_ops.lab import image
    from ddtree_ops.lab.config import SGLANG_VENVS

    recipe = image.recipe()
    assert recipe["sglang"] == "sglang==0.5.13.post1" and recipe["venv_dir"] == SGLANG_VENVS["0.5.13.post1"]
    assert recipe["overlay_venvs"] == {"0.5.23": {"dir": "/opt/sglang-0.5.23/venv",
                                                  "requirements": ["sglang==0.5.23", "apache-tvm-ffi==0.1.11"]}}
    # every extra venv's own SGLang is the version it is named for
    assert all(f"sglang=={v}" in reqs for v, reqs in image.OVERLAY_VENVS.items())
    assert [n for n in ("sglang", "sglang-0.5.13.post1.dist-info", "sglang_router", "sgl_kernel", "sglang.pth")
            if image._is_sglang(n)] == ["sglang", "sglang-0.5.13.post1.dist-info"]

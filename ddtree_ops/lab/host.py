"""One lab host: its overlay, its host key, and the systemd-nspawn process that boots it.

Layout under `<state>/hosts/<name>/`:
    upper/, work/    the host's overlay over the read-only base image (only what changes is copied up)
    root/            the overlay's mount point; mounted only inside the host's own mount namespace,
                     so the mount vanishes with the process and nothing is ever left mounted here
    base             path of the base image this overlay belongs to
    sglang           the SGLang version the host runs (which of the image's venvs); absent: the default
    nspawn.pid       pid of systemd-nspawn (absent when stopped)
    console.log      the container's console output (boot messages), for diagnosing a failed boot
    machine-id       the host's own systemd machine id
    ssh_host_ed25519_key.pub   copy of the host's public key, the lab's trust root for known_hosts
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ddtree_ops.lab.config import (
    BASTION,
    BRIDGE,
    BRIDGE_ADDRESS,
    DEFAULT_SGLANG,
    OPERATOR,
    SSH_PORT,
    SUBNET,
    VENV_DIR,
    LabPaths,
    host_address,
    host_index,
    venv_dir,
)
from ddtree_ops.lab.steps import LabError, capture, log_tail, run_step

# Runs as the process that becomes nspawn: joins the host's own cgroups ($5, $6; empty when the
# hierarchy is absent), mounts the overlay inside the fresh mount namespace `unshare` made, then
# execs nspawn. Values arrive as positional parameters, never pasted into the script text.
_LAUNCH_SCRIPT = (
    'for cg in "$5" "$6"; do [ -z "$cg" ] || echo $$ > "$cg/cgroup.procs" || exit 1; done; '
    'mount -t overlay overlay -o "lowerdir=$1,upperdir=$2,workdir=$3" "$4" && shift 6 && exec "$@"'
)

BOOT_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0
_CMDLINE_RETRIES = 100


@dataclass(frozen=True)
class LabHost:
    name: str
    paths: LabPaths

    @property
    def index(self) -> int:
        return host_index(self.name)

    @property
    def address(self) -> str:
        return str(host_address(self.index))

    @property
    def is_bastion(self) -> bool:
        return self.name == BASTION

    @property
    def dir(self) -> Path:
        return self.paths.host_dir(self.name)

    @property
    def upper(self) -> Path:
        return self.dir / "upper"

    @property
    def work(self) -> Path:
        return self.dir / "work"

    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def pid_file(self) -> Path:
        return self.dir / "nspawn.pid"

    @property
    def console_log(self) -> Path:
        return self.dir / "console.log"

    @property
    def base_file(self) -> Path:
        return self.dir / "base"

    @property
    def sglang_file(self) -> Path:
        return self.dir / "sglang"

    def sglang(self) -> str:
        """The SGLang version this host runs (chosen at creation; a host made before there was a choice
        runs the default)."""
        try:
            return self.sglang_file.read_text().strip() or DEFAULT_SGLANG
        except FileNotFoundError:
            return DEFAULT_SGLANG

    @property
    def python(self) -> str:
        """The interpreter of the host's SGLang venv: what the inventory, sudo rule and engine use."""
        return f"{venv_dir(self.sglang())}/bin/python"

    @property
    def machine_id_file(self) -> Path:
        return self.dir / "machine-id"

    @property
    def host_key_pub(self) -> Path:
        return self.dir / "ssh_host_ed25519_key.pub"

    def known_hosts_line(self) -> str:
        key_type, key_b64 = self.host_key_pub.read_text().split()[:2]
        return f"{self.address} {key_type} {key_b64}"

    def exists(self) -> bool:
        return self.host_key_pub.is_file() and self.upper.is_dir()

    def base(self) -> Path | None:
        try:
            return Path(self.base_file.read_text().strip())
        except OSError:
            return None


def create(host: LabHost, base_rootfs: Path, log: Path, sglang: str = DEFAULT_SGLANG) -> None:
    """Make the host's overlay: its own ssh host key, static address and hostname files, and which of the
    image's SGLang venvs it runs."""
    venv_dir(sglang)  # raises ValueError for a version the image does not carry
    host.dir.mkdir(parents=True, exist_ok=True)
    for d in (host.upper, host.work, host.root):
        d.mkdir(exist_ok=True)
    ssh_dir = _mkdirs_like(base_rootfs, host.upper, "etc/ssh")
    key = ssh_dir / "ssh_host_ed25519_key"
    for old in (key, key.with_suffix(".pub")):
        old.unlink(missing_ok=True)
    run_step(
        f"{host.name}: generate its ssh host key",
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{host.name}", "-f", key],
        log,
    )
    host.host_key_pub.write_text(key.with_suffix(".pub").read_text())
    net_dir = _mkdirs_like(base_rootfs, host.upper, "etc/systemd/network")
    # Sorted before systemd's own 80-container-host0.network (DHCP), so this static one wins.
    # No Gateway: the host has no route beyond the bridge.
    (net_dir / "10-ddtree-lab.network").write_text(
        "[Match]\nName=host0\n\n[Network]\n"
        f"Address={host.address}/{SUBNET.prefixlen}\nLinkLocalAddressing=no\nIPv6AcceptRA=no\n"
    )
    (host.upper / "etc/hostname").write_text(f"{host.name}\n")
    (host.upper / "etc/hosts").write_text(
        f"127.0.0.1\tlocalhost\n{host.address}\t{host.name}\n{BRIDGE_ADDRESS}\tddtree-lab-control\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
    # Each host its own machine id (journal, D-Bus and systemd key things on it). Written into the
    # overlay rather than left to systemd: with the image's /etc/machine-id empty, systemd would copy
    # the one D-Bus's package left in /var/lib/dbus, the same on every host.
    machine_id = uuid.uuid4().hex
    host.machine_id_file.write_text(machine_id + "\n")
    (host.upper / "etc/machine-id").write_text(machine_id + "\n")
    dbus_dir = _mkdirs_like(base_rootfs, host.upper, "var/lib/dbus")
    (dbus_dir / "machine-id").unlink(missing_ok=True)
    (dbus_dir / "machine-id").symlink_to("/etc/machine-id")
    if host.is_bastion:
        # Every GPU host's session hops through here at once (24 at `push`): OpenSSH's default
        # MaxStartups (10:30:100) would drop unauthenticated connections beyond 10 at random.
        sshd_dir = _mkdirs_like(base_rootfs, host.upper, "etc/ssh/sshd_config.d")
        (sshd_dir / "ddtree-lab-bastion.conf").write_text("MaxStartups 200:30:400\nMaxSessions 64\n")
    host.sglang_file.write_text(f"{sglang}\n")
    host.base_file.write_text(f"{base_rootfs}\n")


def authorize(host: LabHost, base_rootfs: Path, client_pubkey: str) -> None:
    """Install the lab's client key as root's only authorized key (written while the host is stopped)."""
    ssh_dir = _mkdirs_like(base_rootfs, host.upper, "root/.ssh", mode=0o700)
    keys = ssh_dir / "authorized_keys"
    keys.write_text(client_pubkey.strip() + "\n")
    keys.chmod(0o600)


# Runs as root on a host (sh -c, values as positional parameters): the operator user with the lab's key,
# and on the GPU hosts a sudo rule for the host agent's interpreter only, checked by visudo before use.
_PROVISION_SCRIPT = r"""
set -eu
user=$1 key=$2 rule=$3
id -u "$user" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$user"
usermod -p '*' "$user"
home=$(getent passwd "$user" | cut -d: -f6)
install -d -m 700 -o "$user" -g "$user" "$home/.ssh"
printf '%s\n' "$key" > "$home/.ssh/authorized_keys.tmp"
chown "$user:" "$home/.ssh/authorized_keys.tmp" && chmod 600 "$home/.ssh/authorized_keys.tmp"
mv -f "$home/.ssh/authorized_keys.tmp" "$home/.ssh/authorized_keys"
if [ -n "$rule" ]; then
    printf '%s\n' "$rule" > /etc/sudoers.d/.ddtree-ops-lab.tmp
    chmod 440 /etc/sudoers.d/.ddtree-ops-lab.tmp
    visudo -cqf /etc/sudoers.d/.ddtree-ops-lab.tmp
    mv -f /etc/sudoers.d/.ddtree-ops-lab.tmp /etc/sudoers.d/ddtree-ops-lab
fi
"""


def sudo_rule(python: str = f"{VENV_DIR}/bin/python") -> str:
    """The operator's only sudo right on a GPU host: the host agent's interpreter, without a password."""
    return f"{OPERATOR} ALL=(root) NOPASSWD: {python}"


def provision_operator(host: LabHost, paths: LabPaths, client_pubkey: str, via: LabHost) -> None:
    """The unprivileged login user `ops` with the lab's key (and its sudo rule, but on the bastion)."""
    rule = "" if host.is_bastion else sudo_rule(host.python)
    remote = shlex.join(["sh", "-c", _PROVISION_SCRIPT, "lab-provision", OPERATOR, client_pubkey.strip(), rule])
    result = capture(ssh_argv(host, paths.client_key, paths.known_hosts, remote, via=via), timeout=60)
    if result.returncode != 0:
        raise LabError(f"{host.name}: creating the operator user {OPERATOR} failed "
                       f"(exit {result.returncode}): {result.stderr.strip()[-2000:]}")


def _mkdirs_like(lower_root: Path, upper_root: Path, rel: str, mode: int | None = None) -> Path:
    """Create rel under the overlay's upper dir with the owner and mode the base gives each level.

    A directory created in upper with default permissions would shadow the base's (e.g. /root is 0700).
    """
    current_upper, current_lower = upper_root, lower_root
    for part in Path(rel).parts:
        current_upper, current_lower = current_upper / part, current_lower / part
        if not current_upper.exists():
            current_upper.mkdir()
            if current_lower.is_dir():
                st = current_lower.stat()
                os.chown(current_upper, st.st_uid, st.st_gid)
                current_upper.chmod(st.st_mode & 0o7777)
            elif mode is not None:
                current_upper.chmod(mode)
    return current_upper


def nspawn_argv(host: LabHost) -> list[str]:
    return [
        "systemd-nspawn",
        "--boot",
        # This machine has no systemd as PID 1, so nspawn must neither register with machined
        # nor move itself into a new scope unit.
        "--register=no",
        "--keep-unit",
        f"--machine={host.name}",
        f"--uuid={host.machine_id_file.read_text().strip()}",
        f"--directory={host.root}",
        f"--network-bridge={BRIDGE}",
        "--link-journal=no",
        "--resolv-conf=off",
        "--timezone=off",
        "--console=read-only",
    ]


def start(host: LabHost, base_rootfs: Path) -> int:
    """Boot the host in the background; returns the nspawn pid (the caller waits for ssh)."""
    if (pid := running_pid(host)) is not None:
        return pid
    argv = [
        "unshare", "--mount", "--propagation", "private", "--",
        "sh", "-c", _LAUNCH_SCRIPT, "ddtree-lab-launch",
        str(base_rootfs), str(host.upper), str(host.work), str(host.root),
        *_own_cgroups(host),
        *nspawn_argv(host),
    ]  # fmt: skip
    # nspawn with --keep-unit puts the container in "<its own cgroup>/payload". Started from the
    # same cgroup, all hosts would share one payload cgroup and their systemds would trip over each
    # other's units (seen: 219/CGROUP at boot), so each host gets its own cgroup first. The unified
    # (v2) hierarchy inside the container also matches what production hosts run.
    env = {**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
    with host.console_log.open("w") as console:
        # A new session: the host outlives the `ddtree-ops lab up` that started it.
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            close_fds=True,
        )
    # unshare and sh exec into nspawn, so this pid is nspawn's.
    host.pid_file.write_text(f"{proc.pid}\n")
    return proc.pid


def _cgroup_mounts() -> tuple[Path | None, Path | None]:
    """Mount points of the unified (v2) hierarchy and of the v1 name=systemd one, where present."""
    unified = named = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if tail and tail[0] == "cgroup2" and unified is None:
            unified = Path(fields[4])
        elif tail and tail[0] == "cgroup" and "name=systemd" in tail[-1].split(",") and named is None:
            named = Path(fields[4])
    return unified, named


def cgroup_dirs(host: LabHost) -> list[Path]:
    return [mount / f"ddtree-lab-{host.name}" for mount in _cgroup_mounts() if mount is not None]


def _own_cgroups(host: LabHost) -> list[str]:
    unified, named = _cgroup_mounts()
    created = []
    for mount in (unified, named):
        if mount is None:
            created.append("")
            continue
        group = mount / f"ddtree-lab-{host.name}"
        group.mkdir(exist_ok=True)
        created.append(str(group))
    return created


def remove_cgroups(host: LabHost) -> None:
    """Remove the host's (now empty) cgroup trees; cgroupfs only allows rmdir, bottom-up."""
    for group in cgroup_dirs(host):
        if not group.is_dir():
            continue
        for dirpath, _dirnames, _files in sorted(os.walk(group), key=lambda entry: -len(entry[0])):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def running_pid(host: LabHost) -> int | None:
    """The nspawn pid of this host if it is alive, else None."""
    try:
        pid = int(host.pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _is_our_nspawn(pid, host) else None


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _proc_state(pid: int) -> str | None:
    """The one-letter state of pid ("Z" for a zombie), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _is_our_nspawn(pid: int, host: LabHost) -> bool:
    # The pid is reaped only by the process that started it; until nspawn has exec'ed, the
    # cmdline shows unshare/sh with the same machine argument, which counts as ours too.
    # In the middle of each execve the cmdline reads empty for a moment (seen on a loaded 2-core
    # CI machine as "exited while booting" with an empty console), so look again before
    # calling a live process someone else's.
    for _ in range(_CMDLINE_RETRIES):
        state = _proc_state(pid)
        if state is None or state == "Z":
            return False
        if cmdline := _cmdline(pid):
            return f"--machine={host.name}" in cmdline and f"--directory={host.root}" in cmdline
        time.sleep(0.005)
    return False


def stray_nspawn_pids(paths: LabPaths) -> list[int]:
    """nspawn processes booting from this lab's host dirs whose pid files are lost."""
    marker = f"--directory={paths.hosts}/"
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            cmd = _cmdline(int(proc.name))
            if cmd and Path(cmd[0]).name == "systemd-nspawn" and any(a.startswith(marker) for a in cmd):
                pids.append(int(proc.name))
    return pids


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def stop_pid(pid: int, timeout: float = STOP_TIMEOUT_S) -> None:
    """Orderly shutdown: SIGTERM makes nspawn send SIGRTMIN+3 (poweroff) to the container's systemd.

    If that does not finish in time, kill the container's init first (killing nspawn alone would leave
    the container's processes running in their pid namespace), then nspawn.
    """
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if _wait_gone(pid, timeout):
        return
    for child in _children(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    _wait_gone(pid, 10)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # The launcher session is not our child (it may come from an earlier `lab up`), so
        # "gone" means no process or a zombie awaiting a reaper that is not us.
        state = _proc_state(pid)
        if state is None:
            return True
        if state == "Z":
            _reap(pid)
            return True
        time.sleep(0.1)
    return False


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def stop(host: LabHost) -> None:
    if (pid := running_pid(host)) is not None:
        stop_pid(pid)
    host.pid_file.unlink(missing_ok=True)
    _kill_leftover_processes(host)
    remove_cgroups(host)


def _kill_leftover_processes(host: LabHost) -> None:
    # Whatever is still in the host's cgroup after nspawn is gone (only after a forced stop) dies
    # here, so no container process outlives `lab down`.
    for group in cgroup_dirs(host):
        kill = group / "cgroup.kill"
        if kill.is_file() and _cgroup_has_processes(group):
            with contextlib.suppress(OSError):
                kill.write_text("1")
            deadline = time.monotonic() + 5
            while _cgroup_has_processes(group) and time.monotonic() < deadline:
                time.sleep(0.1)


def _cgroup_has_processes(group: Path) -> bool:
    for procs in group.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            if procs.read_text().strip():
                return True
    return False


def remove_all_lab_cgroups() -> None:
    """Remove empty ddtree-lab-* cgroups of hosts whose directories are already gone."""
    for mount in _cgroup_mounts():
        if mount is None:
            continue
        for group in mount.glob("ddtree-lab-lab-*"):
            for dirpath, _dirnames, _files in sorted(os.walk(group), key=lambda entry: -len(entry[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)


def ssh_port_open(address: str, timeout: float = 1.0) -> bool:
    """True when something on address:22 greets with an SSH banner (seen from this machine)."""
    try:
        with socket.create_connection((address, SSH_PORT), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False


# Prints the addresses (argv) whose port 22 greets with an SSH banner, one per line.
_BANNER_PROBE = r"""
import socket, sys
for address in sys.argv[1:]:
    try:
        with socket.create_connection((address, 22), timeout=1.0) as sock:
            sock.settimeout(1.0)
            if sock.recv(64).startswith(b"SSH-"):
                print(address)
    except OSError:
        pass
"""


def _netns(host: LabHost) -> str | None:
    """The host's network namespace (its nspawn's child is the container's init), None when stopped."""
    pid = running_pid(host)
    init = _children(pid)[:1] if pid is not None else []
    return f"/proc/{init[0]}/ns/net" if init else None


def ssh_ports_open_behind(bastion: LabHost, addresses: list[str]) -> set[str]:
    """The addresses whose ssh port answers as seen from the bastion (this machine may not reach them):
    one probe run in the bastion's network namespace, for all of them at once."""
    netns = _netns(bastion)
    if netns is None or not addresses:
        return set()
    probe = ["nsenter", f"--net={netns}", "--", "python3", "-c", _BANNER_PROBE, *addresses]
    result = capture(probe, timeout=5 + 2 * len(addresses))
    return set(result.stdout.split()) if result.returncode == 0 else set()


def ssh_argv(
    host: LabHost, client_key: Path, known_hosts: Path, *remote: str, user: str = "root", via: LabHost | None = None
) -> list[str]:
    """Plain OpenSSH client with the lab's key and strict host-key checking; through `via` (the bastion,
    as root, with the same key and known_hosts) unless the host is the bastion itself."""
    common = [
        "-i", str(client_key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}", "-o", "ConnectTimeout=15",
    ]  # fmt: skip
    # ConnectTimeout bounds the banner exchange too: a lab host's sshd behind the bastion's ProxyCommand, on a
    # 2-core machine busy with the test suite, took more than 5 s to greet (a CI run's fixture failed on it)
    proxy: list[str] = []
    if via is not None and not host.is_bastion:
        # ProxyCommand, not ProxyJump: a jump's ssh reads only ssh_config, not these -o options.
        jump = ["ssh", *common, "-W", "%h:%p", "-p", str(SSH_PORT), f"root@{via.address}"]
        proxy = ["-o", "ProxyCommand=" + shlex.join(jump)]
    return ["ssh", *common, *proxy, "-p", str(SSH_PORT), f"{user}@{host.address}", "--", *remote]


def wait_for_ssh(
    host: LabHost, client_key: Path, known_hosts: Path, timeout: float = BOOT_TIMEOUT_S, via: LabHost | None = None
) -> None:
    """Return once `ssh root@host true` succeeds with strict host-key checking (through `via`, the bastion)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if running_pid(host) is None:
            raise LabError(
                f"{host.name} exited while booting; console log {host.console_log}:\n"
                f"{log_tail(host.console_log)}"
            )
        behind = via is not None and not host.is_bastion
        if (host.address in ssh_ports_open_behind(via, [host.address])) if behind else ssh_port_open(host.address):
            result = capture(ssh_argv(host, client_key, known_hosts, "true", via=via), timeout=40)
            if result.returncode == 0:
                return
            last = result.stderr.strip()
        time.sleep(0.2)
    raise LabError(
        f"{host.name} ({host.address}) did not answer ssh within {timeout:.0f} s"
        f"{'; last ssh error: ' + last if last else ''}; its network: {network_snapshot(host)}; "
        f"console log {host.console_log}:\n{log_tail(host.console_log)}"
    )


def network_snapshot(host: LabHost) -> str:
    """What a host that does not answer looks like from the network's side: its addresses, routes and
    listening sockets (inside its namespace) and the bridge's ports (here), for the error message."""
    netns = _netns(host)
    inside = [["ip", "-br", "addr"], ["ip", "route"], ["ss", "-ltn"]] if netns else []
    parts = [capture(["nsenter", f"--net={netns}", "--", *argv], timeout=5) for argv in inside]
    parts.append(capture(["ip", "-br", "link", "show", "master", BRIDGE], timeout=5))
    return " | ".join(" ".join((p.stdout + p.stderr).split()) for p in parts) or "(stopped)"

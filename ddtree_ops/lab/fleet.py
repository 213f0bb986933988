"""The lab fleet: bring N hosts up, report on them, take them all down.

A host is a systemd-nspawn container booted with systemd as PID 1 from the cached base image
(see `image`), with its own overlay, network namespace, address on the `ddtlab0` bridge and ssh
host key (see `host`). Besides the N GPU hosts there is always `lab-bastion`, the only host this
machine reaches by ssh (see `network`); the others are reached through it, as root for the lab's own
work and as the unprivileged operator `ops` (with sudo for the host agent) for ddtree-ops.
`lab_up` also writes a ready inventory for the rest of ddtree-ops.

Runtime state lives under /var/lib/ddtree-ops-lab (DDTREE_LAB_STATE_DIR), the base image under
/var/cache/ddtree-ops-lab (DDTREE_LAB_CACHE_DIR). The lab is one per machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddtree_ops.lab import engine_files, image, inventory_file, network
from ddtree_ops.lab import host as lab_host
from ddtree_ops.lab.config import (
    BASTION,
    DEFAULT_SGLANG,
    MAX_HOSTS,
    SGLANG_VENVS,
    LabPaths,
    host_index,
    host_name,
)
from ddtree_ops.lab.host import LabHost
from ddtree_ops.lab.steps import LabError, Progress, no_progress, on_each, run_step

DEFAULT_HOSTS = 3
REQUIRED_TOOLS = ("systemd-nspawn", "debootstrap", "ip", "unshare", "nsenter", "mount", "ssh", "ssh-keygen")


@dataclass(frozen=True)
class HostStatus:
    name: str
    address: str
    running: bool
    ssh: bool  # the ssh port answers with an SSH banner (the GPU hosts': seen from the bastion)
    pid: int | None = None
    role: str = "gpu"  # or "bastion"
    sglang: str | None = None  # the SGLang version the host runs (None: the bastion runs none)


@dataclass(frozen=True)
class LabStatus:
    hosts: list[HostStatus] = field(default_factory=list)
    bridge: bool = False
    base_image: str | None = None
    inventory_path: Path | None = None

    @property
    def all_up(self) -> bool:
        return bool(self.hosts) and all(h.running and h.ssh for h in self.hosts)

    @property
    def gpu_hosts(self) -> list[HostStatus]:
        return [h for h in self.hosts if h.role == "gpu"]

    def host(self, name: str) -> HostStatus:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def to_json(self) -> dict[str, object]:
        return {
            "hosts": [asdict(h) for h in self.hosts],
            "bridge": self.bridge,
            "base_image": self.base_image,
            "inventory": str(self.inventory_path) if self.inventory_path else None,
            "all_up": self.all_up,
        }


def lab_up(
    hosts: int = DEFAULT_HOSTS,
    repo_root: Path | None = None,
    progress: Progress = no_progress,
    paths: LabPaths | None = None,
    sglang: Mapping[str, str] | None = None,
) -> LabStatus:
    """Bring lab-bastion and lab-1 … lab-N up and write `inventory/lab.yaml`; returns once every host
    answers ssh (the GPU hosts through the bastion) and has its operator user.

    `sglang` maps GPU hosts to the SGLang version they run (one of the image's venvs, config.SGLANG_VENVS);
    every host it does not name runs the default (0.5.13.post1), so the fleet is always what the call says.

    Idempotent: running hosts stay as they are, missing ones are created and booted. Hosts numbered
    above N are stopped and removed, so the inventory and the fleet always agree. A host whose
    overlay belongs to an older base image, or that runs another SGLang than asked, is recreated (its
    changes are lost: its state and releases were made for the other venv).
    """
    if not 1 <= hosts <= MAX_HOSTS:
        raise LabError(f"--hosts must be between 1 and {MAX_HOSTS}, not {hosts}")
    versions = _host_versions(hosts, sglang or {})
    repo_root = Path(repo_root or Path.cwd())
    paths = paths or LabPaths.from_env()
    _check_prerequisites()
    with _lab_lock(paths):
        log = paths.logs / "lab.log"
        rootfs = image.ensure_base_image(paths, progress)
        _ensure_key(paths.client_key, "ddtree-ops-lab", "the lab's ssh client key", log)
        _ensure_key(paths.signing_key, "ddtree-ops-lab-signer", "the lab's bundle signing key", log)
        network.ensure_bridge(log)
        _raise_inotify_limits(hosts + 1, progress)
        bastion = LabHost(BASTION, paths)
        wanted = [LabHost(host_name(i), paths) for i in range(0, hosts + 1)]  # 0: the bastion
        for extra in _existing_hosts(paths):
            if extra.index > hosts:
                progress(f"removing {extra.name} (beyond --hosts {hosts})")
                _remove_host(extra)
        started: list[LabHost] = []
        for h in wanted:
            if h.exists() and h.base() != rootfs:
                progress(f"{h.name}: its overlay belongs to an older base image; recreating it")
                _remove_host(h)
            if h.exists() and not h.is_bastion and h.sglang() != versions[h.name]:
                progress(f"{h.name}: runs SGLang {h.sglang()}, asked for {versions[h.name]}; recreating it")
                _remove_host(h)
            if not h.exists():
                progress(f"{h.name}: creating its overlay and ssh host key")
                lab_host.create(h, rootfs, log, sglang=versions.get(h.name, DEFAULT_SGLANG))
            if lab_host.running_pid(h) is None:
                lab_host.authorize(h, rootfs, _client_pubkey(paths))
                lab_host.start(h, rootfs)
                started.append(h)
        _write_known_hosts(paths, wanted)
        if started:
            progress(f"booting {', '.join(h.name for h in started)}")
        for h in wanted:
            _wait_for_ssh_or_reboot(h, rootfs, paths, bastion, booted_now=h in started, progress=progress, log=log)
        progress(f"{hosts} host(s) and the bastion answer ssh")
        gpu_hosts = wanted[1:]
        on_each(wanted, lambda h: lab_host.provision_operator(h, paths, _client_pubkey(paths), via=bastion))
        engine_files.install(gpu_hosts, paths, progress, via=bastion)
        image.prune_old_images(paths, {rootfs.parent.resolve()})
        inventory = inventory_file.write(repo_root, paths, gpu_hosts)
    return lab_status(repo_root, paths, inventory)


def lab_down(
    repo_root: Path | None = None, progress: Progress = no_progress, paths: LabPaths | None = None
) -> None:
    """Stop every lab host and remove its overlay, the bridge and the lab inventory.

    Leaves no process, mount, interface or namespace behind; succeeds when nothing is up.
    The cached base image stays.
    """
    repo_root = Path(repo_root or Path.cwd())
    paths = paths or LabPaths.from_env()
    with _lab_lock(paths):
        for h in _existing_hosts(paths):
            progress(f"stopping {h.name}")
            lab_host.stop(h)
        for pid in lab_host.stray_nspawn_pids(paths):
            progress(f"stopping a lab nspawn process without pid file ({pid})")
            lab_host.stop_pid(pid)
        _wait_for_veths_gone()
        network.remove_bridge(paths.logs / "lab.log")
        shutil.rmtree(paths.hosts, ignore_errors=True)
        lab_host.remove_all_lab_cgroups()
        _remove_nspawn_leftovers()
        paths.known_hosts.unlink(missing_ok=True)
        inventory_file.remove(repo_root)
    progress("lab is down")


def lab_status(
    repo_root: Path | None = None, paths: LabPaths | None = None, inventory_path: Path | None = None
) -> LabStatus:
    """Per host: name, address, whether its nspawn runs and whether its ssh port answers."""
    repo_root = Path(repo_root or Path.cwd())
    paths = paths or LabPaths.from_env()
    statuses = []
    existing = _existing_hosts(paths)
    pids = {h.name: lab_host.running_pid(h) for h in existing}
    bastion = LabHost(BASTION, paths)
    behind = lab_host.ssh_ports_open_behind(
        bastion, [h.address for h in existing if not h.is_bastion and pids[h.name] is not None]
    )
    for h in existing:
        pid = pids[h.name]
        ssh = lab_host.ssh_port_open(h.address) if h.is_bastion else h.address in behind
        statuses.append(
            HostStatus(
                name=h.name,
                address=h.address,
                running=pid is not None,
                ssh=pid is not None and ssh,
                pid=pid,
                role="bastion" if h.is_bastion else "gpu",
                sglang=None if h.is_bastion else h.sglang(),
            )
        )
    base = paths.base_link.resolve() if paths.base_link.is_symlink() else None
    inventory = inventory_path or inventory_file.path(repo_root)
    return LabStatus(
        hosts=statuses,
        bridge=network.bridge_exists(),
        base_image=str(base) if base else None,
        inventory_path=inventory if inventory.exists() else None,
    )


def stop_host(name: str, paths: LabPaths | None = None) -> None:
    """Power one host off (its overlay stays), e.g. to make it unreachable in a test."""
    paths = paths or LabPaths.from_env()
    h = _known_host(name, paths)
    with _lab_lock(paths):
        lab_host.stop(h)


def start_host(name: str, paths: LabPaths | None = None) -> HostStatus:
    """Boot a host that `lab_up` created and `stop_host` stopped; returns once it answers ssh."""
    paths = paths or LabPaths.from_env()
    h = _known_host(name, paths)
    with _lab_lock(paths):
        rootfs = h.base()
        if rootfs is None or not rootfs.is_dir():
            raise LabError(f"{name}: its base image is gone; run `ddtree-ops lab up`")
        network.ensure_bridge(paths.logs / "lab.log")
        if lab_host.running_pid(h) is None:
            lab_host.authorize(h, rootfs, _client_pubkey(paths))
            lab_host.start(h, rootfs)
        lab_host.wait_for_ssh(h, paths.client_key, paths.known_hosts, via=LabHost(BASTION, paths))
        return HostStatus(name=h.name, address=h.address, running=True, ssh=True, pid=lab_host.running_pid(h),
                          role="bastion" if h.is_bastion else "gpu", sglang=None if h.is_bastion else h.sglang())


def _host_versions(hosts: int, asked: Mapping[str, str]) -> dict[str, str]:
    """The SGLang of each GPU host lab-1 … lab-N: the asked one, else the default; refuses a host outside the
    fleet and a version the image does not carry (before anything is booted or removed)."""
    gpu = [host_name(i) for i in range(1, hosts + 1)]
    stray = sorted(set(asked) - set(gpu))
    if stray:
        raise LabError(f"--sglang names {', '.join(stray)}, not one of this fleet's hosts ({gpu[0]} … {gpu[-1]})")
    unknown = sorted({v for v in asked.values() if v not in SGLANG_VENVS})
    if unknown:
        raise LabError(f"--sglang {', '.join(unknown)}: the lab image carries SGLang {', '.join(SGLANG_VENVS)} only")
    return {name: asked.get(name, DEFAULT_SGLANG) for name in gpu}


def _known_host(name: str, paths: LabPaths) -> LabHost:
    host_index(name)  # raises ValueError for names the lab does not own
    h = LabHost(name, paths)
    if not h.exists():
        raise LabError(f"{name} is not part of the lab; run `ddtree-ops lab up` first")
    return h


def _existing_hosts(paths: LabPaths) -> list[LabHost]:
    if not paths.hosts.is_dir():
        return []
    found = []
    for d in paths.hosts.iterdir():
        try:
            host_index(d.name)
        except ValueError:
            continue
        found.append(LabHost(d.name, paths))
    return sorted(found, key=lambda h: h.index)


def _remove_host(h: LabHost) -> None:
    lab_host.stop(h)
    shutil.rmtree(h.dir, ignore_errors=True)


def _check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (systemd-nspawn, bridges, overlay mounts); run as root")
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        raise LabError(
            f"missing tools: {', '.join(missing)}; apt-get install {' '.join(image.required_apt_packages())}"
        )


def _wait_for_ssh_or_reboot(
    h: LabHost, rootfs: Path, paths: LabPaths, bastion: LabHost, *, booted_now: bool, progress: Progress, log: Path
) -> None:
    """A host booted just now that does not answer ssh in time is powered off and booted once more
    (its first failure, with its network as it stood, goes to the lab log); a second failure is raised."""
    try:
        lab_host.wait_for_ssh(h, paths.client_key, paths.known_hosts, via=bastion)
        return
    except LabError as first:
        if not booted_now:
            raise
        with log.open("a") as f:
            f.write(f"### {time.strftime('%Y-%m-%d %H:%M:%S')} {h.name}: no ssh after boot; rebooting once\n{first}\n")
    progress(f"{h.name}: no ssh after boot; powering it off and booting it once more (details in {log})")
    lab_host.stop(h)
    lab_host.authorize(h, rootfs, _client_pubkey(paths))
    lab_host.start(h, rootfs)
    lab_host.wait_for_ssh(h, paths.client_key, paths.known_hosts, via=bastion)


def _raise_inotify_limits(hosts: int, progress: Progress) -> None:
    """Each booted host's systemd, journald and logind hold inotify instances of root's, against one
    per-user limit of the whole machine (Debian: 128): past about a dozen hosts, a booting host's
    services fail with "Too many open files". Raised, never lowered, with room to spare."""
    for name, floor, per_host in (("max_user_instances", 1024, 64), ("max_user_watches", 65536, 16384)):
        knob = Path("/proc/sys/fs/inotify") / name
        wanted = floor + per_host * hosts
        try:
            current = int(knob.read_text())
            if current < wanted:
                knob.write_text(str(wanted))
                progress(f"fs.inotify.{name}: {current} -> {wanted} (for {hosts} hosts)")
        except (OSError, ValueError) as exc:
            raise LabError(f"cannot raise {knob} to {wanted} for {hosts} hosts: {exc}") from exc


def _ensure_key(key: Path, comment: str, what: str, log: Path) -> None:
    if key.is_file() and key.with_suffix(".pub").is_file():
        return
    key.unlink(missing_ok=True)
    key.with_suffix(".pub").unlink(missing_ok=True)
    run_step(f"generate {what}", ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", key], log)


def _client_pubkey(paths: LabPaths) -> str:
    return paths.client_key.with_suffix(".pub").read_text()


def _write_known_hosts(paths: LabPaths, hosts: list[LabHost]) -> None:
    # The lab generated every host key itself, so it is the trust root: no trust-on-first-use.
    tmp = paths.known_hosts.with_suffix(".tmp")
    tmp.write_text("".join(h.known_hosts_line() + "\n" for h in hosts))
    os.replace(tmp, paths.known_hosts)


def _wait_for_veths_gone(timeout: float = 10.0) -> None:
    # The host side of a container's veth disappears when its network namespace dies, a moment
    # after nspawn exits.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not list(Path("/sys/class/net").glob("vb-lab-*")):
            return
        time.sleep(0.1)
    raise LabError("lab veth interfaces (vb-lab-*) are still present after the hosts stopped")


def _remove_nspawn_leftovers() -> None:
    # nspawn leaves an empty per-machine propagation directory in /run when it cannot remove it.
    propagate = Path("/run/systemd/nspawn/propagate")
    for d in propagate.glob("lab-*"):
        with contextlib.suppress(OSError):
            d.rmdir()


@contextlib.contextmanager
def _lab_lock(paths: LabPaths) -> Iterator[None]:
    """One lab operation at a time on this machine (two `lab up`s would race for the same hosts)."""
    paths.state.mkdir(parents=True, exist_ok=True)
    with paths.lock_file.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            deadline = time.monotonic() + 1800
            while True:
                time.sleep(0.5)
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise LabError(f"another lab operation holds {paths.lock_file}") from None
        yield

"""The lab fleet, brought up once per test session (3 hosts) for every test under tests/lab.

Set DDTREE_LAB_KEEP=1 to leave the fleet running after the session (faster reruns; the next
session finds the hosts up and `lab up` returns in about a second).

The lab is one per machine and several test sessions may use it at once, so each session holds a
shared lease on it (flock on <state>/sessions.lock). A test that takes the whole lab down
(`lab_exclusive`) waits for the other sessions first, and a session's teardown only takes the lab
down when no other session is using it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
LAB_HOSTS = 3
EXCLUSIVE_WAIT_S = 900.0


class LabLease:
    """This session's claim on the shared lab: shared while testing, exclusive to cycle the lab."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")

    def shared(self) -> None:
        fcntl.flock(self._file, fcntl.LOCK_SH)

    def try_exclusive(self, wait_s: float) -> bool:
        """Exclusive once no other session holds the lab; False after wait_s (the lease is then shared).

        While waiting this session holds nothing: it runs no test meanwhile, and two sessions that
        both hold a shared lease while waiting for an exclusive one would wait for each other forever.
        """
        fcntl.flock(self._file, fcntl.LOCK_UN)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    fcntl.flock(self._file, fcntl.LOCK_SH)
                    return False
                time.sleep(0.5)

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class LabFleet:
    inventory_path: Path
    hosts: list[str]  # the GPU hosts (lab-1 …), not the bastion
    repo_root: Path
    addresses: dict[str, str]  # the bastion's too

    @property
    def identity_file(self) -> Path:
        return self.inventory_path.parent / "lab" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.inventory_path.parent / "lab" / "known_hosts"

    def inventory_data(self) -> dict[str, Any]:
        """lab.yaml as data with its file paths made absolute, for a test to edit and write elsewhere."""
        data = yaml.safe_load(self.inventory_path.read_text())
        data["all"]["vars"].update(identity_file=str(self.identity_file), known_hosts=str(self.known_hosts))
        data["signers"] = {name: str(self.inventory_path.parent / key) for name, key in data["signers"].items()}
        return data

    def ssh_argv(self, host: str, *remote: str, user: str = "root") -> list[str]:
        """Plain OpenSSH with the lab's key and strict host-key checking against the lab's known_hosts,
        through the bastion (this machine may not reach a GPU host's ssh directly): the lab's own argv."""
        from ddtree_ops.lab.config import BASTION, LabPaths
        from ddtree_ops.lab.host import LabHost
        from ddtree_ops.lab.host import ssh_argv as lab_ssh_argv

        paths = LabPaths.from_env()
        return lab_ssh_argv(LabHost(host, paths), self.identity_file, self.known_hosts, *remote, user=user,
                            via=LabHost(BASTION, paths))

    def ssh(self, host: str, *remote: str, timeout: float = 120, user: str = "root") -> subprocess.CompletedProcess[str]:
        """Run a command like the plain ssh client does: the words are joined with spaces and the
        host's shell parses them, so quote with shlex.join for arguments that hold shell syntax.

        Waits for ssh itself, not for its pipes: through the bastion, a stopped host leaves the
        ProxyCommand's `ssh -W` waiting on the bastion's TCP connect (the kernel's SYN retries, tens of
        seconds when the host's ARP entry is still fresh) while holding the output open, after ssh has
        already given up with 255. Its process group goes when ssh has finished."""
        argv = self.ssh_argv(host, *remote, user=user)
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(argv, rc, out.read(), err.read())


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "lab_destructive: takes the whole lab down and up again; runs after every other test"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Tests that cycle the whole lab wipe every host's overlay; run them last so that other tests'
    # state (pushed releases, units) is not pulled from under them.
    items.sort(key=lambda item: item.get_closest_marker("lab_destructive") is not None)


@pytest.fixture(scope="session")
def lab_lease() -> Iterator[LabLease]:
    from ddtree_ops.lab.config import LabPaths

    lease = LabLease(LabPaths.from_env().state / "sessions.lock")
    lease.shared()
    yield lease
    lease.close()


@pytest.fixture(scope="session")
def lab_fleet(lab_lease: LabLease) -> Iterator[LabFleet]:
    if os.geteuid() != 0 or shutil.which("systemd-nspawn") is None:
        pytest.fail(
            "the lab fleet needs root and systemd-nspawn (apt-get install systemd-container debootstrap)"
        )
    from ddtree_ops.lab.fleet import lab_down, lab_up

    status = lab_up(LAB_HOSTS, REPO_ROOT)
    assert status.inventory_path is not None
    yield LabFleet(
        inventory_path=status.inventory_path,
        hosts=[h.name for h in status.gpu_hosts],
        repo_root=REPO_ROOT,
        addresses={h.name: h.address for h in status.hosts},
    )
    # Another session still testing on the lab keeps it up; the last one out takes it down.
    if not os.environ.get("DDTREE_LAB_KEEP") and lab_lease.try_exclusive(wait_s=0):
        lab_down(REPO_ROOT)


@pytest.fixture
def lab_exclusive(lab_fleet: LabFleet, lab_lease: LabLease) -> Iterator[LabFleet]:
    """The lab to this test alone (for tests that take it down): waits for other sessions to finish."""
    if not lab_lease.try_exclusive(EXCLUSIVE_WAIT_S):
        pytest.skip(f"other test sessions kept using the lab for {EXCLUSIVE_WAIT_S:.0f} s")
    try:
        yield lab_fleet
    finally:
        lab_lease.shared()

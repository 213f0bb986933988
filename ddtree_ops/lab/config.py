"""Where the lab keeps its files, and the fixed facts of its network.

The lab is one per machine (one bridge, one address range), whichever checkout drives it;
`repo_root` only decides where the ready inventory is written.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

BRIDGE = "ddtlab0"
SUBNET = ipaddress.IPv4Network("10.200.0.0/24")
BRIDGE_ADDRESS = ipaddress.IPv4Address("10.200.0.1")
FIRST_HOST_OCTET = 11
MAX_HOSTS = 50  # .11 … .60; far more than one small machine can boot
HOST_PREFIX = "lab-"
# The only host the control machine may reach by ssh (network.py); the others are reached through it.
# It is host 0: the address just below lab-1's.
BASTION = "lab-bastion"
# The unprivileged login user on every lab host; it runs the host agent as root through sudo.
OPERATOR = "ops"
SSH_PORT = 22
VENV_DIR = "/opt/sglang/venv"
# The SGLang every host runs unless the lab is told otherwise (`lab up --sglang lab-N=VERSION`), and the
# venv of each SGLang the base image carries: a mixed-version fleet rehearses push, smoke and promote
# picking each host's own bundle. VENV_DIR stays the default host's, so a default fleet is as it was.
DEFAULT_SGLANG = "0.5.13.post1"
SGLANG_VENVS: dict[str, str] = {
    DEFAULT_SGLANG: VENV_DIR,
    "0.5.23": "/opt/sglang-0.5.23/venv",
}
SERVICE = "sglang.service"
HOST_STATE_DIR = "/var/lib/ddtree-ops"
SERVE_PORT = 30000
# The lab engine stands in for sglang.launch_server (see ddtree_ops/lab/engine and engine_files).
SERVER_MODULE = "ddtree_lab_engine"
LAB_MODELS_DIR = "/opt/ddtree-lab/models"
TARGET_MODEL = f"{LAB_MODELS_DIR}/target"
HYBRID_TARGET_MODEL = f"{LAB_MODELS_DIR}/target-hybrid"
DRAFT_MODEL = f"{LAB_MODELS_DIR}/draft"

DEFAULT_CACHE_DIR = Path("/var/cache/ddtree-ops-lab")
DEFAULT_STATE_DIR = Path("/var/lib/ddtree-ops-lab")


def host_name(index: int) -> str:
    """Name of the index-th host, counting from 1 (0 is the bastion)."""
    return BASTION if index == 0 else f"{HOST_PREFIX}{index}"


def host_index(name: str) -> int:
    """Inverse of `host_name`; raises ValueError for names the lab does not own."""
    if name == BASTION:
        return 0
    if not name.startswith(HOST_PREFIX) or not name[len(HOST_PREFIX) :].isdigit():
        raise ValueError(f"{name!r} is not a lab host name (expected {HOST_PREFIX}1, {HOST_PREFIX}2, …)")
    index = int(name[len(HOST_PREFIX) :])
    if not 1 <= index <= MAX_HOSTS:
        raise ValueError(f"{name!r}: lab hosts are numbered 1…{MAX_HOSTS}")
    return index


def venv_dir(sglang: str) -> str:
    """The venv in the base image that holds this SGLang version (ValueError for one the image lacks)."""
    try:
        return SGLANG_VENVS[sglang]
    except KeyError:
        raise ValueError(f"the lab image has no SGLang {sglang} (it carries {', '.join(SGLANG_VENVS)})") from None


def host_address(index: int) -> ipaddress.IPv4Address:
    return SUBNET.network_address + (FIRST_HOST_OCTET - 1 + index)


@dataclass(frozen=True)
class LabPaths:
    """The two directories the lab owns on this machine.

    cache: the base image (rebuilt only when its recipe hash changes) and build logs.
    state: per-host overlays, pid files, console logs, the client key, the bundle signing key and known_hosts;
           `lab down` removes the hosts' part of it.
    """

    cache: Path
    state: Path

    @classmethod
    def from_env(cls) -> LabPaths:
        # Overridable so that a test or a second checkout can point the cache elsewhere.
        return cls(
            cache=Path(os.environ.get("DDTREE_LAB_CACHE_DIR", DEFAULT_CACHE_DIR)),
            state=Path(os.environ.get("DDTREE_LAB_STATE_DIR", DEFAULT_STATE_DIR)),
        )

    @property
    def logs(self) -> Path:
        return self.cache / "logs"

    @property
    def base_link(self) -> Path:
        """Symlink to the current base image directory (`base-<recipe hash>`)."""
        return self.cache / "base"

    @property
    def hosts(self) -> Path:
        return self.state / "hosts"

    def host_dir(self, name: str) -> Path:
        return self.hosts / name

    @property
    def client_key(self) -> Path:
        return self.state / "id_ed25519"

    @property
    def signing_key(self) -> Path:
        """The key the rehearsal signs bundles with; the lab inventory trusts its public half (`signers:`)."""
        return self.state / "signer_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.state / "known_hosts"

    @property
    def lock_file(self) -> Path:
        return self.state / "lock"

"""The lab's private bridge: hosts talk to this machine (10.200.0.1) and to each other, nothing else.

No NAT and no forwarding: the bridge's own IPv4 forwarding is switched off (so even a host that
adds a default route via 10.200.0.1 gets nowhere) and IPv6 is disabled on it.
"""

from __future__ import annotations

from pathlib import Path

from ddtree_ops.lab.config import BRIDGE, BRIDGE_ADDRESS, SUBNET
from ddtree_ops.lab.steps import LabError, capture, run_step


def bridge_exists() -> bool:
    return Path("/sys/class/net", BRIDGE).exists()


def ensure_bridge(log: Path) -> None:
    if not bridge_exists():
        run_step(f"create bridge {BRIDGE}", ["ip", "link", "add", BRIDGE, "type", "bridge"], log)
    _write_sysctl(f"/proc/sys/net/ipv4/conf/{BRIDGE}/forwarding", "0")
    _write_sysctl(f"/proc/sys/net/ipv6/conf/{BRIDGE}/disable_ipv6", "1")
    cidr = f"{BRIDGE_ADDRESS}/{SUBNET.prefixlen}"
    shown = capture(["ip", "-o", "-4", "addr", "show", "dev", BRIDGE])
    if cidr not in shown.stdout:
        run_step(f"address {cidr} on {BRIDGE}", ["ip", "addr", "add", cidr, "dev", BRIDGE], log)
    run_step(f"bring {BRIDGE} up", ["ip", "link", "set", BRIDGE, "up"], log)


def remove_bridge(log: Path) -> None:
    if bridge_exists():
        run_step(f"delete bridge {BRIDGE}", ["ip", "link", "delete", BRIDGE], log)


def _write_sysctl(path: str, value: str) -> None:
    try:
        Path(path).write_text(value)
    except OSError as exc:
        raise LabError(f"cannot set {path} = {value}: {exc}") from exc

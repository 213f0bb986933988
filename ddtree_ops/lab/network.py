"""The lab's private bridge: hosts talk to this machine (10.200.0.1) and to each other, nothing else.

No NAT and no forwarding: the bridge's own IPv4 forwarding is switched off (so even a host that
adds a default route via 10.200.0.1 gets nowhere) and IPv6 is disabled on it.

Like a real GPU fleet, only the bastion (lab-bastion) takes ssh from this machine: two policy-routing
rules refuse this machine's own connections to port 22 of every other lab address. The hosts talk to
each other over the bridge itself, which no routing rule of this machine sees, so the bastion reaches
them all. Other ports (the engines' HTTP, for tests) stay reachable.
"""

from __future__ import annotations

from pathlib import Path

from ddtree_ops.lab.config import BRIDGE, BRIDGE_ADDRESS, SSH_PORT, SUBNET, host_address
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
    _ensure_ssh_rules(log)


def remove_bridge(log: Path) -> None:
    for pref, _selector in _ssh_rules():
        while capture(["ip", "-4", "rule", "show", "pref", pref]).stdout.strip():
            run_step(f"remove lab routing rule {pref}", ["ip", "-4", "rule", "del", "pref", pref], log)
    if bridge_exists():
        run_step(f"delete bridge {BRIDGE}", ["ip", "link", "delete", BRIDGE], log)


# Rule preferences of our own, far from the kernel's (0, 32766, 32767) and from common tools' ranges.
_BASTION_RULE_PREF = "17410"
_REFUSE_RULE_PREF = "17411"


def _ssh_rules() -> list[tuple[str, list[str]]]:
    port = ["ipproto", "tcp", "dport", str(SSH_PORT)]
    return [
        (_BASTION_RULE_PREF, ["to", f"{host_address(0)}/32", *port, "lookup", "main"]),
        (_REFUSE_RULE_PREF, ["to", str(SUBNET), *port, "prohibit"]),
    ]


def _ensure_ssh_rules(log: Path) -> None:
    for pref, selector in _ssh_rules():
        if capture(["ip", "-4", "rule", "show", "pref", pref]).stdout.strip():
            continue
        run_step(f"lab routing rule {pref}: {' '.join(selector)}", ["ip", "-4", "rule", "add", "pref", pref, *selector], log)


def _write_sysctl(path: str, value: str) -> None:
    try:
        Path(path).write_text(value)
    except OSError as exc:
        raise LabError(f"cannot set {path} = {value}: {exc}") from exc

"""Host facts, control side: ask each host's agent what it is and what it runs (read-only).

`status` renders these; push's preflight compares them with a bundle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ddtree_ops.fleet import DEFAULT_CONCURRENCY, FleetProgress, HostContext, HostResult, run_on_hosts

if TYPE_CHECKING:
    from ddtree_ops.inventory import HostConfig, Inventory


def facts_args(host: HostConfig, files: Sequence[str] = ()) -> dict[str, Any]:
    """The facts request for a host: inventory values travel as JSON, never through a shell."""
    return {"state_dir": host.state_dir, "service": host.service, "files": list(files)}


def payload_files() -> list[str]:
    """Site-packages-relative paths the payloads touch (patched and new files of every base that has a
    payload), so facts can hash them; a payload that cannot be read is left out (`build` reports it)."""
    from ddtree_ops.bases import BASES
    from ddtree_ops.bundle import PAYLOAD_DIR, load_payload

    paths: set[str] = set()
    for base in BASES:
        if not base.has_payload(PAYLOAD_DIR):
            continue
        try:
            _, descriptor = load_payload(None, base.version)
        except Exception:  # the payload is optional for facts; a broken one is reported by `build`
            continue
        paths |= {t for patch in descriptor.patches for t in patch.targets}
        paths |= set(descriptor.new_files) | set(descriptor.shared)
    return sorted(paths)


def with_payload_base(results: list[HostResult]) -> list[HostResult]:
    """Each reachable host's facts gain `payload_base`: which base its installed SGLang is (bases.host_base)."""
    from ddtree_ops.bases import host_base

    for r in results:
        if r.ok and isinstance(r.data, dict):
            r.data["payload_base"] = host_base((r.data.get("sglang") or {}).get("version"))
    return results


def fetch_facts(ctx: HostContext, inventory: Inventory, files: Sequence[str] = (), *, retries: int | None = None) -> dict[str, Any]:
    from ddtree_ops.agent.client import call_agent
    from ddtree_ops.ssh import DEFAULT_RETRIES, HostSession

    ctx.step("connecting")
    session = HostSession(ctx.host, jump_chain=inventory.jump_chain(ctx.host), notice=ctx.notice,
                          retries=DEFAULT_RETRIES if retries is None else retries)
    with session:
        ctx.step("facts")
        return call_agent(session, "facts", facts_args(ctx.host, files))


def collect_facts(
    inventory: Inventory,
    hosts: Sequence[HostConfig],
    *,
    files: Sequence[str] | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: FleetProgress | None = None,
    retries: int | None = None,
) -> list[HostResult]:
    touched = payload_files() if files is None else list(files)
    return with_payload_base(run_on_hosts(hosts, lambda ctx: fetch_facts(ctx, inventory, touched, retries=retries),
                                          concurrency=concurrency, progress=progress))

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
    """Site-packages-relative paths the payload touches (patched and new files), so facts can hash
    them; empty when the payload descriptor is unavailable (facts then hashes nothing)."""
    try:
        from ddtree_ops.bundle import load_payload

        _, descriptor = load_payload()
        paths = {t for patch in descriptor.patches for t in patch.targets} | set(descriptor.new_files)
    except Exception:  # the payload is optional for facts; a broken one is reported by `build`
        return []
    return sorted(paths)


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
    return run_on_hosts(hosts, lambda ctx: fetch_facts(ctx, inventory, touched, retries=retries),
                        concurrency=concurrency, progress=progress)

"""`smoke`, control side: ask each host's agent to exercise the installed payload with the host's
own SGLang interpreter (imports, server-args flags, a CPU tree-builder self-test).

The agent runs each step in a subprocess with a timeout and answers per step pass/fail plus its
output; a host whose smoke failed is a failed HostResult whose message names the failing steps
and whose `detail` (on SmokeFailed) keeps the full per-step answer for --json.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ddtree_ops.errors import OpsError
from ddtree_ops.fleet import DEFAULT_CONCURRENCY, FleetProgress, HostContext, HostResult, run_on_hosts

if TYPE_CHECKING:
    from ddtree_ops.inventory import HostConfig, Inventory

DEFAULT_STEP_TIMEOUT_S = 240.0
STEPS = ("import", "server_args", "tree")


class SmokeFailed(OpsError):
    code = "smoke_failed"

    def __init__(self, message: str, *, hint: str | None = None, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message, hint=hint)
        self.detail = detail or {}


def _explain(host: str, answer: dict[str, Any]) -> SmokeFailed:
    parts = []
    for step in answer.get("steps", []):
        if step.get("passed"):
            continue
        detail = step.get("detail")
        bad: list[str] = []
        if isinstance(detail, list):
            bad = [f"{c.get('case') or c.get('check')}: {c.get('detail', c.get('got'))}" for c in detail if not c.get("ok")]
        elif isinstance(detail, dict):
            bad = [f"{mod}: {v.get('error')}" for mod, v in detail.items() if not v.get("ok")]
        elif detail:
            bad = [str(detail)]
        tail = (step.get("output") or "").strip().splitlines()[-3:]
        parts.append(f"step {step['name']} failed: " + ("; ".join(bad[:4]) or " | ".join(tail) or "no output"))
    return SmokeFailed(f"{host}: smoke " + " / ".join(parts),
                       hint="the per-step output is in --json (data of the failed host is in error detail)",
                       detail=answer)


def smoke_host(ctx: HostContext, inventory: Inventory, *, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
               steps: Sequence[str] = STEPS) -> dict[str, Any]:
    from ddtree_ops.release import _call, _session

    with _session(ctx, inventory) as session:
        ctx.step("smoke: " + ", ".join(steps))
        answer = _call(session, "smoke", {"state_dir": ctx.host.state_dir, "timeout_s": step_timeout_s,
                                          "steps": list(steps)},
                       timeout=step_timeout_s * len(steps) + 60)
    if not answer.get("passed"):
        raise _explain(ctx.host.name, answer)
    for warning in answer.get("warnings", []):
        ctx.notice(warning)
    return answer


def smoke(inventory: Inventory, hosts: Sequence[HostConfig], *, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
          steps: Sequence[str] = STEPS, concurrency: int = DEFAULT_CONCURRENCY,
          progress: FleetProgress | None = None) -> list[HostResult]:
    return run_on_hosts(hosts, lambda ctx: smoke_host(ctx, inventory, step_timeout_s=step_timeout_s, steps=steps),
                        concurrency=concurrency, progress=progress)

"""`--speculative-ddtree-budget auto` in `/metrics` (installed as `sglang/srt/speculative/ddtree_metrics.py` by the
ddtree-ops payload), beside SGLang's own `sglang:spec_accept_length`, through the same prometheus_client
(multiprocess mode: the scheduler process writes, the HTTP server process serves).

- `sglang:ddtree_step_budget` (histogram): the tree budget each verify step verified, 0 for the chain (linear
  DFLASH); buckets at auto's candidates.
- `sglang:ddtree_step_ms{width, batch}`: auto's step cost estimate per verify width and batch bucket (ms).
- `sglang:ddtree_accepted_by_budget{budget}`: accepted draft tokens per request each candidate would have had.

Only tensor-parallel rank 0 writes; a metric that cannot be made (no prometheus_client, a name already taken)
logs a warning and leaves /metrics without it: never a server that does not start.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


class AutoMetrics:
    def __init__(self, budgets: Sequence[int]) -> None:
        from prometheus_client import Gauge, Histogram

        self.budget = Histogram(
            "sglang:ddtree_step_budget",
            "DDTree auto: tree budget verified per step (0: the linear DFLASH chain).",
            buckets=[0, *sorted(int(b) for b in budgets), float("inf")],
        )
        self.step_ms = Gauge(
            "sglang:ddtree_step_ms",
            "DDTree auto: estimated step cost by verify width and batch bucket (ms).",
            labelnames=["width", "batch"],
            multiprocess_mode="mostrecent",
        )
        self.accepted = Gauge(
            "sglang:ddtree_accepted_by_budget",
            "DDTree auto: accepted draft tokens per request each candidate budget would have had.",
            labelnames=["budget"],
            multiprocess_mode="mostrecent",
        )

    @classmethod
    def maybe_create(cls, budgets: Sequence[int], *, enabled: bool, tp_rank: int) -> AutoMetrics | None:
        if not enabled or tp_rank != 0:
            return None
        try:
            return cls(budgets)
        except Exception as e:  # noqa: BLE001 - metrics are a view; the server serves without them
            logger.warning("DDTree auto: /metrics figures not registered (%s: %s)", type(e).__name__, e)
            return None

    def observe_step(self, budget: int) -> None:
        self.budget.observe(int(budget))

    def publish(self, report: dict[str, Any]) -> None:
        """Set the gauges from `AutoBudget.as_dict()`."""
        for width, row in (report.get("step_ms") or {}).items():
            for batch, ms in row.items():
                self.step_ms.labels(width=str(width), batch=str(batch)).set(float(ms))
        for budget, value in (report.get("accepted_by_budget") or {}).items():
            if value is not None:
                self.accepted.labels(budget="0" if budget == "chain" else str(budget)).set(float(value))

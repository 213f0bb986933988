"""DDTree's per-worker counters and their `/server_info` report (installed as
`sglang/srt/speculative/ddtree_stats.py` by the ddtree-ops payload; one copy, used by the v1 worker's
`DDTreeController` and by 0.5.17's v2 tree worker).

`/server_info` → `internal_states[i]["ddtree"]` is `internal_state(settings(...), stats, **extra)`: the
settings the promote settings gate checks (mode, budget, topk_cap, keep_chain) under the same names on every
base, then the counters. Nothing here reads the device per step: tree sizes and accepted depths given as
device tensors are summed on the device and read once, when the stats are read.

Imports torch and the standard library only (tested on the CPU without SGLang, like the algorithm modules).
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class DDTreeStats:
    """Debug metrics; read by logs and by `internal_state()`."""

    steps: int = 0
    tree_steps: int = 0
    fallback_steps: int = 0
    # Tree steps that ran a smaller budget than configured (KV pool, row, logits or mask limits),
    # those of them padded to the verify graphs' width, and linear steps by cause ("kv_pool",
    # "step_limits"; v2: "grammar").
    shrunk_steps: int = 0
    padded_steps: int = 0
    requests_sum: int = 0
    build_ms_n: int = 0
    # Per request and tree step: walked greedily or by sampling; steps whose logits had
    # processors, penalties or biases applied.
    greedy_requests: int = 0
    sampled_requests: int = 0
    logit_adjusted_steps: int = 0
    # Steps whose target verify replayed a CUDA graph (the rest ran eagerly).
    graph_steps: int = 0
    # Tree builds replayed from a captured build graph (ddtree_build_graphs; the rest ran eagerly).
    build_graph_steps: int = 0
    # --speculative-ddtree-budget auto: steps it gave the chain (linear DFLASH verify; not fallbacks).
    chain_steps: int = 0

    def __post_init__(self) -> None:
        # Accepted depths counted on the host (v1: its walk's lengths are host ints already) ...
        self.accepted_depth_hist: collections.Counter[int] = collections.Counter()
        # ... and on the device (`add_accepted_depths`): counts by depth, read with the stats.
        self.depth_counts: Any = None
        # Recent tree-build times (draft logits + build_ddtree, CUDA events). The first build of a
        # process includes Triton JIT compilation, so it is kept apart.
        self.build_ms_first: float | None = None
        self.build_ms_recent: collections.deque[float] = collections.deque(maxlen=256)
        self.fallback_reasons: collections.Counter[str] = collections.Counter()
        # Tree nodes summed on the device, read only when the stats are read (no sync per step).
        self.nodes_sum: Any = 0

    def add_nodes(self, num_nodes: Any) -> None:
        self.nodes_sum = num_nodes.sum() + self.nodes_sum

    def add_accepted_depths(self, depths: Any, max_depth: int) -> None:
        """Count a step's accepted depths (an integer tensor, one per request, on any device) on that device:
        no host read. Depths outside `0 .. max_depth` are clamped into it."""
        index = depths.to(torch.int64).clamp(0, int(max_depth))
        counts = self.depth_counts
        if counts is None or counts.numel() <= max_depth or counts.device != index.device:
            size = max(int(max_depth) + 1, 0 if counts is None else counts.numel())
            grown = torch.zeros(size, dtype=torch.int64, device=index.device)
            if counts is not None:
                grown[: counts.numel()] += counts.to(index.device)
            counts = self.depth_counts = grown
        counts.index_add_(0, index, torch.ones_like(index))

    def add_linear_step(self, result: Any, block_size: int) -> None:
        """One linear DFLASH decode step of a v2 worker, from its result: counted, its graph replay, and each
        request's accepted depth (`accept_lens - 1`, on the device)."""
        self.steps += 1
        self.graph_steps += bool(getattr(result, "can_run_cuda_graph", False))
        accept_lens = getattr(result, "accept_lens", None)
        if accept_lens is not None and accept_lens.numel():
            self.add_accepted_depths(accept_lens - 1, block_size - 1)

    def depth_hist(self) -> dict[int, int]:
        """Requests by accepted depth, host and device counts together (reads the device: the stats' read)."""
        hist = collections.Counter(self.accepted_depth_hist)
        if self.depth_counts is not None:
            for depth, count in enumerate(self.depth_counts.tolist()):
                if count:
                    hist[depth] += int(count)
        return dict(sorted(hist.items()))

    def as_dict(self) -> dict[str, Any]:
        hist = self.depth_hist()
        n_req = max(1, sum(hist.values()))
        return {
            "steps": self.steps,
            "tree_steps": self.tree_steps,
            "fallback_steps": self.fallback_steps,
            "shrunk_steps": self.shrunk_steps,
            "padded_steps": self.padded_steps,
            "fallback_reasons": dict(sorted(self.fallback_reasons.items())),
            "avg_tree_nodes": round(float(self.nodes_sum) / max(1, self.requests_sum), 3),
            "greedy_requests": self.greedy_requests,
            "sampled_requests": self.sampled_requests,
            "logit_adjusted_steps": self.logit_adjusted_steps,
            "graph_steps": self.graph_steps,
            "build_graph_steps": self.build_graph_steps,
            "chain_steps": self.chain_steps,
            "build_ms_median": round(statistics.median(self.build_ms_recent), 4) if self.build_ms_recent else 0.0,
            "build_ms_max": round(max(self.build_ms_recent, default=0.0), 4),
            "build_ms_first": None if self.build_ms_first is None else round(self.build_ms_first, 3),
            "build_samples": self.build_ms_n,
            "accepted_depth_hist": hist,
            "avg_accepted_depth": round(sum(k * v for k, v in hist.items()) / n_req, 4),
        }


def settings(*, mode: str, budget: int, budget_auto: bool, topk_cap: Any, keep_chain: bool) -> dict[str, Any]:
    """What the worker runs, under the names the promote settings gate reads (`ddtree_ops.gates`): `budget` is
    "auto" under auto, with its maximum as `budget_max`."""
    return {
        "mode": mode,
        "budget": "auto" if budget_auto else budget,
        "budget_max": budget if budget_auto else None,
        "topk_cap": topk_cap,
        "keep_chain": bool(keep_chain),
    }


def internal_state(settings: dict[str, Any], stats: DDTreeStats, **extra: Any) -> dict[str, Any]:
    """For the scheduler's get_internal_state (`/server_info` → internal_states[i]["ddtree"]): the settings,
    the worker's own extras, then the counters; string keys only (the HTTP layer serialises with orjson)."""
    counters = stats.as_dict()
    counters["accepted_depth_hist"] = {str(k): v for k, v in counters["accepted_depth_hist"].items()}
    return {**settings, **extra, **counters}

#!/usr/bin/env python3
"""What `--speculative-ddtree-budget auto` costs the scheduler between steps: `AutoBudget.refresh` (every 16
steps) and `choose` / `observe` (every step), on the real-size shell's ladder (candidates chain, 15, 31, 63,
127; the 27 graph batch buckets of `--cuda-graph-max-bs 64`), 2000 simulated steps at batch 1 / 4 / 16 / 64.

    .venv/bin/python bench/bench_auto_refresh.py [--steps N]

Prints the timings and a digest of every plan, exploration table and the final `/server_info` document, so
two versions of the module can be checked for making the same decisions (same digest) at different cost.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ddtree_oracle import load_payload_module  # noqa: E402

A = load_payload_module("ddtree_auto_budget")
BUCKETS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 40, 44, 48, 52, 56, 60, 64]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    a = ap.parse_args()
    cands = A.auto_candidates(127, 16)
    auto = A.AutoBudget(cands, BUCKETS, 64)
    auto.seed_start_costs({(w, bs): 0.005 + 0.0001 * w * bs / 16 for w in A.verify_widths(cands) for bs in BUCKETS})
    rng = random.Random(0)
    nb = len(auto.budgets)
    per_step, refresh, decisions = [], [], []
    for step in range(a.steps):
        bs = rng.choice([1, 4, 16, 64])
        t0 = time.perf_counter()
        c = auto.choose(bs, step)
        accepted = [min(i * 0.3, 2) * bs for i in range(1, nb + 1)] if c.budget else [0.0] * nb
        seconds = 0.004 + 0.0002 * c.width * bs / 16 * (1 + 0.1 * rng.random())
        auto.observe(A.StepObservation(budget=c.budget, width=c.width, batch_size=bs, seconds=seconds,
                                       accepted=accepted, chain=0.5 * bs, requests=bs, sampled_accepted=[0.0] * nb,
                                       sampled_chain=0.0, sampled_requests=0))
        per_step.append(time.perf_counter() - t0)
        if auto.due(step):
            t0 = time.perf_counter()
            auto.refresh()
            refresh.append(time.perf_counter() - t0)
            decisions.append((tuple(p.name for p in auto.plan), tuple(tuple(e) for e in auto.explore)))
    t0 = time.perf_counter()
    info = auto.as_dict()
    as_dict_ms = (time.perf_counter() - t0) * 1e3
    digest = hashlib.sha256(repr((decisions, json.dumps(info, sort_keys=True))).encode()).hexdigest()[:16]
    print(json.dumps({
        "steps": a.steps, "refreshes": len(refresh),
        "choose_observe_us_median": round(statistics.median(per_step) * 1e6, 1),
        "refresh_ms_median": round(statistics.median(refresh) * 1e3, 2), "refresh_ms_max": round(max(refresh) * 1e3, 2),
        "refresh_ms_per_step": round(sum(refresh) / a.steps * 1e3, 3), "as_dict_ms": round(as_dict_ms, 2),
        "decisions_digest": digest}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What `--speculative-ddtree-budget auto` loses to exploration on the 8.2 B shell's costs (simulated:
tests/ddtree_shell_sim.py), against an oracle that plays the best fixed candidate for each batch bucket on the
same steps: steady batch 1 / 4 / 16 / 64, live traffic whose batch size and ease move (also with every cell's
first three steps slow), and auto_bench.py's schedule on a fresh server (measured passes only), greedy alone and
greedy then T 0.8 (a sampled walk's cost grows with the tree's width).

    .venv/bin/python bench/bench_auto_explore.py [--seeds N] [--steps N] [--module PATH]

Per scenario, over the seeds: auto's tokens/s / the oracle's (median, min); at batch >= 8 (all batches for
steady 1 and 4), the share of steps that explored and the share of time they lost against the bucket's best.
`--module` loads another version of ddtree_auto_budget.py (e.g. `git show REV:ddtree_ops/payload/sglang/srt/
speculative/ddtree_auto_budget.py > /tmp/old.py`) for a before / after on the same traces.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import ddtree_shell_sim as sim  # noqa: E402
from ddtree_oracle import load_payload_module  # noqa: E402


def _load(path: str | None):
    if path is None:
        return load_payload_module("ddtree_auto_budget")
    # a name per file: bench_auto_schedule.py loads several versions side by side
    spec = importlib.util.spec_from_file_location(f"ddtree_auto_budget_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--module", default=None)
    a = ap.parse_args()
    ab = _load(a.module)
    n = a.steps
    scenarios = {f"steady bs {bs}": (lambda rng, bs=bs: (sim.steady(bs, n, rng, ease_walk=0.03), 0), 1, min(bs, 8))
                 for bs in (1, 4, 16, 64)}
    scenarios["moving"] = (lambda rng: (sim.moving(4 * n, rng), 0), 1, 8)
    scenarios["moving, slow first steps"] = (lambda rng: (sim.moving(4 * n, rng), 0), 3, 8)
    scenarios["benchmark schedule"] = (lambda rng: sim.benchmark(rng), 1, 8)
    scenarios["benchmark schedule, greedy and T 0.8"] = (lambda rng: sim.benchmark(rng, kinds=(False, True)), 1, 8)
    for name, (make, slow, lo) in scenarios.items():
        ratios, steps, lost, by_bs = [], [], [], {}
        for seed in range(a.seeds):
            rng = random.Random(seed)
            server = sim.ShellServer(ab, rng, slow_first=slow)
            auto = sim.new_auto(ab, server)
            trace, skip = make(rng)
            cells = sim.run(ab, auto, server, trace, skip=skip)
            ratios.append(sim.overall(cells))
            s, t = sim.explore_share(cells, lo)
            steps.append(s)
            lost.append(t)
            if name.startswith(("moving", "benchmark")):
                for sign, kind in ((1, ""), (-1, "T0.8 ")):  # sampled steps are counted under negative buckets
                    for group in ((1, 2), (3, 7), (8, 16), (18, 32), (40, 64)):
                        sel = {b: c for b, c in cells.items() if group[0] <= sign * b <= group[1]}
                        if sel:
                            by_bs.setdefault(f"{kind}{group[0]}-{group[1]}", []).append(sim.overall(sel))
        row = {"vs_oracle": round(statistics.median(ratios), 4), "vs_oracle_min": round(min(ratios), 4),
               f"explore_steps_bs>={lo}": round(statistics.median(steps), 4),
               f"explore_time_lost_bs>={lo}": round(statistics.median(lost), 4)}
        if by_bs:
            row["vs_oracle_by_bs"] = {k: round(statistics.median(v), 4) for k, v in by_bs.items()}
        print(name, json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What `--speculative-ddtree-budget auto` loses to exploration on the 8.2 B shell's costs (simulated:
tests/ddtree_shell_sim.py), against an oracle that plays the best fixed candidate for each batch size on the
same steps: steady batch 1 / 4 / 16 / 64, and live traffic whose batch size and ease move.

    .venv/bin/python bench/bench_auto_explore.py [--seeds N] [--steps N] [--module PATH]

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
    spec = importlib.util.spec_from_file_location("ddtree_auto_budget_other", path)
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
    out: dict[str, dict] = {}
    scenarios = [(f"steady bs {bs}", bs) for bs in (1, 4, 16, 64)] + [("moving", None)]
    for name, bs in scenarios:
        ratios, shares, lost, per_bucket = [], [], [], {}
        for seed in range(a.seeds):
            rng = random.Random(seed)
            server = sim.ShellServer(ab, rng)
            auto = sim.new_auto(ab, server)
            trace = sim.steady(bs, a.steps, rng, ease_walk=0.03) if bs else sim.moving(a.steps * 4, rng)
            cells = sim.run(ab, auto, server, trace)
            ratios.append(sim.overall(cells))
            s, t = sim.explore_share(cells, 8 if bs is None else 1)
            shares.append(s)
            lost.append(t)
            if bs is None:
                for lo, hi in ((1, 2), (3, 7), (8, 16), (18, 32), (40, 64)):
                    sel = {b: c for b, c in cells.items() if lo <= b <= hi}
                    if sel:
                        per_bucket.setdefault(f"{lo}-{hi}", []).append(
                            (sim.overall(sel), *sim.explore_share(sel)))
        row = {"vs_oracle_median": round(statistics.median(ratios), 3), "vs_oracle_min": round(min(ratios), 3),
               "explore_steps_share": round(statistics.median(shares), 4),
               "explore_time_lost": round(statistics.median(lost), 4)}
        if per_bucket:
            row["by_batch"] = {k: {"vs_oracle": round(statistics.median(r[0] for r in v), 3),
                                   "explore_steps": round(statistics.median(r[1] for r in v), 4),
                                   "explore_lost": round(statistics.median(r[2] for r in v), 4)}
                               for k, v in per_bucket.items()}
        out[name] = row
        print(name, json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Versions of `--speculative-ddtree-budget auto` side by side on auto_bench.py's schedule (measured passes only),
simulated on both targets: the launch-bound trained pair (tests/ddtree_pair_sim.py) and the 8.2 B shell
(tests/ddtree_shell_sim.py), greedy alone and greedy then T 0.8, against the best fixed candidate of each batch bucket.

    git show REV:ddtree_ops/payload/sglang/srt/speculative/ddtree_auto_budget.py > /tmp/before.py
    .venv/bin/python bench/bench_auto_schedule.py --seeds 200 --module /tmp/before.py --module current

Per version, model and mix, over the seeds: auto's tokens/s / the best fixed candidate's (mean, tenth percentile, worst
seed). The simulators' noise is theirs (+-6 %, slow spells; a GPU host's drift can be larger): figures for a before /
after on the same traces, not for a GPU.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import ddtree_pair_sim as pair  # noqa: E402
import ddtree_shell_sim as shell  # noqa: E402
from bench_auto_explore import _load  # noqa: E402  (bench/ is sys.path[0] when run as a script)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=50)
    ap.add_argument("--module", action="append", default=[],
                    help="a ddtree_auto_budget.py to load, or 'current' (the payload's); repeat to compare")
    a = ap.parse_args()
    for path in a.module or ["current"]:
        ab = _load(None if path == "current" else path)
        for model, server_class in (("pair", pair.PairServer), ("shell", shell.ShellServer)):
            for mix, kinds in (("greedy", (False,)), ("greedy + T 0.8", (False, True))):
                ratios = []
                for seed in range(a.seeds):
                    rng = random.Random(seed)
                    server = server_class(ab, rng)
                    auto = shell.new_auto(ab, server)
                    trace, measured = shell.benchmark(rng, kinds=kinds)
                    ratios.append(shell.overall(shell.run(ab, auto, server, trace, skip=measured)))
                ratios.sort()
                print(f"{path} | {model} | {mix} | mean {statistics.mean(ratios):.4f} | "
                      f"p10 {ratios[len(ratios) // 10]:.4f} | min {ratios[0]:.4f}", flush=True)


if __name__ == "__main__":
    main()

"""Release benchmarks on the lab fleet: push to 1 vs 3 hosts, no-op re-push, rollback.

    .venv/bin/python bench/bench_release.py [--runs 5]       # needs the lab (`ddtree-ops lab up`)

Times the library calls the CLI makes (release.push / release.rollback), wall clock, from a
pristine fleet each round; the bundle is the real payload built against the dev venv's pristine
sglang files. Medians are printed as Markdown for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ddtree_ops import release  # noqa: E402
from ddtree_ops.bundle import build_bundle  # noqa: E402
from ddtree_ops.inventory import load_inventory  # noqa: E402


def timed(fn) -> float:
    started = time.perf_counter()
    results = fn()
    elapsed = time.perf_counter() - started
    bad = [r.to_dict() for r in results if not r.ok]
    if bad:
        raise SystemExit(f"failed: {bad}")
    return elapsed


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} ms (min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--inventory", type=Path, default=REPO / "inventory" / "lab.yaml")
    args = ap.parse_args()
    inv = load_inventory(args.inventory)
    with tempfile.TemporaryDirectory() as tmp:
        site = importlib.metadata.distribution("sglang").locate_file("")
        built = build_bundle(None, tmp, site_dir=site)
        bundle = release.LocalBundle.load(built.bundle_path)
        figures: dict[str, list[float]] = {}
        all_hosts = inv.select(None)
        release.rollback(inv, all_hosts, to="pristine", adopt=True)
        for label, limit in (("1 host", "lab-1"), (f"{len(all_hosts)} hosts", None)):
            hosts = inv.select(limit)
            for _ in range(args.runs):
                figures.setdefault(f"push, {label}", []).append(timed(lambda h=hosts: release.push(inv, h, bundle)))
                figures.setdefault(f"no-op re-push, {label}", []).append(
                    timed(lambda h=hosts: release.push(inv, h, bundle)))
                figures.setdefault(f"rollback, {label}", []).append(timed(lambda h=hosts: release.rollback(inv, h)))
                figures.setdefault(f"dry run, {label}", []).append(
                    timed(lambda h=hosts: release.push(inv, h, bundle, dry_run=True)))
    print(f"bundle {built.bundle_path.name}: {bundle.size} bytes, {len(bundle.manifest['patched_files'])} patched + "
          f"{len(bundle.manifest['new_files'])} new files; {args.runs} runs each\n")
    print("| step | wall time, median |")
    print("|---|---|")
    for name, values in figures.items():
        print(f"| {name} | {fmt(values)} |")


if __name__ == "__main__":
    main()

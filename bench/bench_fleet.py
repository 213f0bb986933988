"""One host against many, as the operator sees it: the CLI through the bastion, with sudo, on the lab.

    .venv/bin/python bench/bench_fleet.py --hosts 24 [--runs 3] [--smoke]   # root; brings the lab to N hosts

Per round, from pristine hosts: `status`, `push` (a signed bundle), a no-op re-push and
`promote --mode shadow-linear --dry-run`, first with `--limit lab-1`, then across all N; `smoke`
once across all N with --smoke (each host imports SGLang three times: minutes on 2 cores). Wall
clock of the whole CLI command, medians printed as Markdown for bench/RESULTS.md, with the ratio N
hosts / 1 host. Every lab host runs on this machine's CPUs, so the hosts' own work (sshd, sudo, the
agent's Python) competes with the control side: the ratio is an upper bound for a fleet whose hosts
have CPUs of their own.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ddtree_ops.bundle import build_bundle  # noqa: E402
from ddtree_ops.lab.config import LabPaths  # noqa: E402
from ddtree_ops.lab.fleet import lab_up  # noqa: E402
from ddtree_ops.signing import sign_bundle  # noqa: E402


def cli(*args: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")} | {"PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", "from ddtree_ops.cli import main; main()", *args, "--json"],
                            capture_output=True, text=True, env=env, timeout=3600)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: exit {result.returncode}\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    rows = json.loads(result.stdout)["results"]
    if not all(row["status"] == "ok" for row in rows):
        raise SystemExit(f"{' '.join(args)}: {[row for row in rows if row['status'] != 'ok'][:2]}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=24)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    status = lab_up(args.hosts, REPO, print)
    inv = str(status.inventory_path)
    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        built = build_bundle(None, tmp, site_dir=importlib.metadata.distribution("sglang").locate_file(""))
        sign_bundle(built.bundle_path, LabPaths.from_env().signing_key)
        bundle = str(built.bundle_path)
        evidence = str(Path(tmp) / "evidence")
        cli("rollback", "-i", inv, "--to", "pristine", "--adopt")
        for _ in range(args.runs):
            for label, limit in (("1 host", ["--limit", "lab-1"]), (f"{args.hosts} hosts", [])):
                for step, argv in (("status", ["status"]), ("push", ["push", "--bundle", bundle]), ("no-op re-push", ["push", "--bundle", bundle]),
                                   ("promote --dry-run", ["promote", "--mode", "shadow-linear", "--dry-run",
                                                          "--evidence-dir", evidence])):
                    figures.setdefault(f"{step}|{label}", []).append(cli(*argv, "-i", inv, *limit))
                cli("rollback", "-i", inv, "--to", "pristine", "--adopt", *limit)
        if args.smoke:
            cli("push", "--bundle", bundle, "-i", inv)
            figures[f"smoke|{args.hosts} hosts"] = [cli("smoke", "-i", inv)]
            cli("rollback", "-i", inv, "--to", "pristine", "--adopt")
    print(f"\n{args.hosts} hosts + the bastion on {os.cpu_count()} CPUs; {args.runs} runs; the CLI as the operator "
          "(sudo) through the bastion\n")
    print(f"| step | 1 host | {args.hosts} hosts | ratio |")
    print("|---|---|---|---|")
    for step in dict.fromkeys(key.split("|")[0] for key in figures):
        one, many = figures.get(f"{step}|1 host"), figures[f"{step}|{args.hosts} hosts"]
        one_s = f"{statistics.median(one):.2f} s" if one else "–"
        ratio = f"{statistics.median(many) / statistics.median(one):.1f}×" if one else "–"
        print(f"| {step} | {one_s} | {statistics.median(many):.2f} s (min {min(many):.2f}) | {ratio} |")


if __name__ == "__main__":
    main()

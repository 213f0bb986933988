"""Foundations benchmarks: CLI start-up, status fan-out, and the per-step SSH round trip.

    .venv/bin/python bench/bench_status.py                       # needs the lab (`ddtree-ops lab up`)
    .venv/bin/python bench/bench_status.py --help-only           # just the --help timing

Figures are medians over repeated runs; the Markdown printed at the end goes into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI = Path(sys.executable).with_name("ddtree-ops")


def timed_runs(argv: list[str], runs: int, *, ok_codes: tuple[int, ...] = (0,)) -> list[float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, env=env)
        times.append(time.perf_counter() - started)
        if proc.returncode not in ok_codes:
            raise SystemExit(f"{argv} exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return times


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} ms (min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f}, n={len(values)})"


def bench_help(runs: int) -> dict[str, list[float]]:
    return {
        "python -c pass": timed_runs([sys.executable, "-c", "pass"], runs),
        "ddtree-ops --help": timed_runs([str(CLI), "--help"], runs),
        "ddtree-ops --version": timed_runs([str(CLI), "--version"], runs),
    }


def bench_status(inventory: Path, runs: int) -> dict[str, list[float]]:
    return {
        "status, 1 host": timed_runs([str(CLI), "status", "-i", str(inventory), "--limit", "lab-1", "--json"], runs),
        "status, 3 hosts": timed_runs([str(CLI), "status", "-i", str(inventory), "--json"], runs),
    }


def bench_round_trip(inventory: Path, runs: int) -> dict[str, list[float]]:
    """Per step on an already-open connection: one exec of `true`, and one agent `facts` call."""
    from ddtree_ops.agent.client import call_agent
    from ddtree_ops.facts import facts_args
    from ddtree_ops.inventory import load_inventory
    from ddtree_ops.ssh import HostSession

    host = load_inventory(inventory).hosts["lab-1"]
    out: dict[str, list[float]] = {}
    for nodelay in (True, False):
        label = "TCP_NODELAY" if nodelay else "Nagle (no TCP_NODELAY)"
        started = time.perf_counter()
        with HostSession(host, nodelay=nodelay) as session:
            out[f"connect + auth, {label}"] = [time.perf_counter() - started]
            session.run(["true"])  # warm-up
            execs, agent = [], []
            for _ in range(runs):
                t = time.perf_counter()
                session.run(["true"])
                execs.append(time.perf_counter() - t)
            for _ in range(max(3, runs // 3)):
                t = time.perf_counter()
                call_agent(session, "facts", facts_args(host))
                agent.append(time.perf_counter() - t)
        out[f"exec `true`, {label}"] = execs
        out[f"agent facts call, {label}"] = agent
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inventory", type=Path, default=REPO / "inventory" / "lab.yaml")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--help-only", action="store_true")
    args = parser.parse_args()

    results = bench_help(args.runs)
    if not args.help_only:
        if not args.inventory.exists():
            raise SystemExit(f"{args.inventory} missing: run `ddtree-ops lab up` first (or --help-only)")
        results |= bench_status(args.inventory, max(3, args.runs // 4))
        results |= bench_round_trip(args.inventory, args.runs)

    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}\n")
    print("| measurement | median |\n|---|---|")
    for name, values in results.items():
        print(f"| {name} | {ms(values)} |")
    if "status, 1 host" in results:
        ratio = statistics.median(results["status, 3 hosts"]) / statistics.median(results["status, 1 host"])
        print(f"\nfan-out ratio status(3 hosts) / status(1 host): {ratio:.2f}")
    for label in ("exec `true`", "agent facts call"):
        on, off = results.get(f"{label}, TCP_NODELAY"), results.get(f"{label}, Nagle (no TCP_NODELAY)")
        if on and off:
            print(f"{label}: Nagle / TCP_NODELAY = {statistics.median(off) / statistics.median(on):.1f}x")


if __name__ == "__main__":
    main()

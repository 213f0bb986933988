"""Commit-confirmed stages on the lab fleet: how long after the control side dies does a host serve
its previous unit again, by itself? And what does confirming cost a healthy stage?

    .venv/bin/python bench/bench_confirm.py [--runs 3] [--windows 10,30]   # needs the lab (`ddtree-ops lab up`)

Per run, on lab-1 (pushed, promoted to shadow-linear first): a promote to full with a changed unit,
its CLI SIGKILLed mid-gates (rollout.KILL_ENV=during_gates); the clock runs from the kill until the
host's unit file is the previous one again, no stage is in flight and /health_generate answers 200
(polled every 0.5 s over ssh). Then a plain promote of the same stage, timed, for the cost side: the
heartbeat calls it made and its wall time. Medians are printed as Markdown for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ddtree_ops import release, rollout  # noqa: E402
from ddtree_ops.bundle import build_bundle  # noqa: E402
from ddtree_ops.inventory import load_inventory  # noqa: E402
from ddtree_ops.lab.config import BASTION, LabPaths  # noqa: E402
from ddtree_ops.lab.host import LabHost, ssh_argv  # noqa: E402

HOST, UNIT, STATE = "lab-1", "/etc/systemd/system/sglang.service", "/var/lib/ddtree-ops"


def ssh(command: str) -> subprocess.CompletedProcess[str]:
    """As root on HOST, through the bastion, the way the lab itself gets there."""
    paths = LabPaths.from_env()
    argv = ssh_argv(LabHost(HOST, paths), paths.client_key, paths.known_hosts, command, via=LabHost(BASTION, paths))
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def serving(unit_sha: str) -> bool:
    probe = (f"sha256sum {UNIT} | cut -d' ' -f1; test -e {STATE}/units-journal.json && echo inflight; "
             + shlex.join(["/opt/sglang/venv/bin/python", "-c", "import urllib.request; print(urllib.request.urlopen("
                           "'http://127.0.0.1:30000/health_generate', timeout=10).status)"]))
    out = ssh(probe).stdout.split()
    return out[:1] == [unit_sha] and "inflight" not in out and out[-1:] == ["200"]


def cli(inv_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", "from ddtree_ops.cli import main; main()", *args],
                          capture_output=True, text=True, env=full_env, timeout=1800, cwd=REPO)


def inventory(base: Path, tmp: Path, window: int, change: str) -> Path:
    """The lab inventory with lab-1's confirm window and a unit that differs, beside the original (its
    key and signer paths are relative to it)."""
    data = yaml.safe_load(base.read_text())
    data["hosts"][HOST].update(confirm_timeout_s=window, service_environment={"BENCH_CHANGE": change})
    path = base.with_name(f".bench-confirm-{tmp.name}-{window}-{change}.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--windows", default="10,30")
    ap.add_argument("--inventory", type=Path, default=REPO / "inventory" / "lab.yaml")
    args = ap.parse_args()
    inv = load_inventory(args.inventory)
    hosts = inv.select(HOST)
    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        site = importlib.metadata.distribution("sglang").locate_file("")
        bundle = release.LocalBundle.load(build_bundle(None, tmp, site_dir=site).bundle_path)
        assert all(r.ok for r in release.push(inv, hosts, bundle))
        base = inventory(args.inventory, tmp, 60, "base")
        shadow = cli(base, "promote", "-i", str(base), "--mode", "shadow-linear", "--limit", HOST, "--evidence-dir",
                     str(tmp / "ev"))
        assert shadow.returncode == 0, shadow.stderr[-3000:]
        for window in (int(w) for w in args.windows.split(",")):
            for run in range(args.runs):
                unit = ssh(f"sha256sum {UNIT}").stdout.split()[0]
                changed = inventory(args.inventory, tmp, window, f"k{window}-{run}")
                killed = cli(changed, "promote", "-i", str(changed), "--mode", "full", "--limit", HOST,
                             "--evidence-dir", str(tmp / "ev"), env={rollout.KILL_ENV: "during_gates"})
                dead_at = time.monotonic()
                assert killed.returncode == -9, killed.stderr[-2000:]
                while not serving(unit):
                    assert time.monotonic() - dead_at < window + 300, "not restored"
                    time.sleep(0.5)
                figures.setdefault(f"killed mid-gates -> previous unit serving, window {window} s", []).append(
                    time.monotonic() - dead_at)
                started = time.monotonic()
                ok = cli(changed, "promote", "-i", str(changed), "--mode", "full", "--limit", HOST, "--json",
                         "--evidence-dir", str(tmp / "ev"))
                assert ok.returncode == 0, ok.stderr[-3000:]
                figures.setdefault("healthy full stage, wall", []).append(time.monotonic() - started)
                timing = json.loads(ok.stdout)["results"][0]["data"]["timing"]
                figures.setdefault("healthy full stage, tool time", []).append(timing["tool_s"])
                back = rollout.rollback(load_inventory(changed), load_inventory(changed).select(HOST))[0]
                assert back.ok, back.to_dict()
    for leftover in args.inventory.parent.glob(".bench-confirm-*.yaml"):
        leftover.unlink()
    print("| measure | median s | min | max | runs |\n|---|---|---|---|---|")
    for label, values in figures.items():
        print(f"| {label} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} | {len(values)} |")


if __name__ == "__main__":
    main()

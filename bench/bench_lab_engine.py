"""Lab engine benchmarks: decode tokens/s per mode on CPU, and the engine's start time on a lab host.

    .venv/bin/python bench/bench_lab_engine.py                 # tokens/s per mode (this machine's CPU)
    .venv/bin/python bench/bench_lab_engine.py --lab --runs 3  # + start time under systemd on lab-1
                                                               #   (needs `ddtree-ops lab up`; take the
                                                               #   lab lock if others share the lab)

Tokens/s: the engine's own decoder (`ddtree_ops/lab/engine/decoding.py`) in-process, one thread, the
lab models, the payload's ddtree_utils, greedy, ignore_eos; batch 1 and batch 4. Start time: from
`systemd-run` to the first /health 200, measured from this machine over the lab bridge.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ddtree_ops.lab.engine.decoding import Decoder, Request  # noqa: E402
from ddtree_ops.lab.engine.draft import DraftModel  # noqa: E402
from ddtree_ops.lab.engine.model import TinyLM  # noqa: E402
from ddtree_ops.lab.engine.model_files import EOS_ID, write_models  # noqa: E402
from ddtree_ops.lab.engine.sampling import Choice  # noqa: E402

MODES = [("plain", False, "off"), ("DFLASH", True, "off"), ("shadow-linear", True, "shadow-linear"),
         ("full", True, "full")]


def payload_ddtree_utils():
    path = REPO / "ddtree_ops/payload/sglang/srt/speculative/ddtree_utils.py"
    spec = importlib.util.spec_from_file_location("ddtree_utils_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def tokens_per_s(models: Path, batch: int, new_tokens: int) -> list[tuple[str, float, float | None]]:
    torch.set_num_threads(1)
    target, draft, du = TinyLM.load(models / "target"), DraftModel.load(models / "draft"), payload_ddtree_utils()
    rows = []
    for name, speculative, mode in MODES:
        dec = Decoder(target, capacity=2048, draft=draft if speculative else None, mode=mode,
                      ddtree=du if mode != "off" else None)
        reqs = [Request(rid=str(i), input_ids=[5 + i, 6, 7, 8], choice=Choice(greedy=True), max_new_tokens=new_tokens,
                        stop_token_ids=frozenset(), ignore_eos=True, eos_token_id=EOS_ID) for i in range(batch)]
        started = time.perf_counter()
        for r in reqs:
            dec.prefill(r)
        while not all(r.finished for r in reqs):
            dec.step(reqs)
        elapsed = time.perf_counter() - started
        rows.append((name, batch * new_tokens / elapsed, dec.spec.accept_length))
    return rows


def lab_start_times(runs: int) -> list[float]:
    import httpx
    import yaml

    from ddtree_ops.lab.config import BASTION, DRAFT_MODEL, TARGET_MODEL, VENV_DIR, LabPaths
    from ddtree_ops.lab.host import LabHost, ssh_argv

    inventory = REPO / "inventory/lab.yaml"
    address = yaml.safe_load(inventory.read_text())["hosts"]["lab-1"]["address"]
    paths = LabPaths.from_env()
    ssh = ssh_argv(LabHost("lab-1", paths), paths.client_key, paths.known_hosts, via=LabHost(BASTION, paths))
    import subprocess

    times = []
    for i in range(runs):
        unit, port = f"ddtree-lab-engine-bench-{uuid.uuid4().hex[:6]}", 31900 + i
        argv = ["systemd-run", f"--unit={unit}", "--property=Type=exec", f"{VENV_DIR}/bin/python", "-m",
                "ddtree_lab_engine", "--model-path", TARGET_MODEL, "--device", "cpu", "--host", "0.0.0.0", "--port",
                str(port), "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", DRAFT_MODEL]
        started = time.monotonic()
        subprocess.run([*ssh, shlex.join(argv)], check=True, capture_output=True)
        while True:
            try:
                if httpx.get(f"http://{address}:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - started > 120:
                raise SystemExit(f"{unit} not healthy within 120 s")
            time.sleep(0.1)
        times.append(time.monotonic() - started)
        subprocess.run([*ssh, f"systemctl stop {unit}"], check=False, capture_output=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", action="store_true", help="also measure the start time on lab-1")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
          f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}\n")
    with tempfile.TemporaryDirectory() as tmp:
        write_models(Path(tmp))
        print("| mode | batch | tokens/s | accept length |\n|---|---|---|---|")
        for batch in (1, 4):
            for name, tps, al in tokens_per_s(Path(tmp), batch, args.new_tokens):
                print(f"| {name} | {batch} | {tps:.0f} | {'—' if al is None else f'{al:.2f}'} |")
    if args.lab:
        times = lab_start_times(args.runs)
        print(f"\nstart time on lab-1 (systemd-run → /health 200): median {statistics.median(times):.1f} s "
              f"(min {min(times):.1f}, max {max(times):.1f}, n={len(times)})")


if __name__ == "__main__":
    main()

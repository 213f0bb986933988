#!/usr/bin/env python3
"""Time the sampled tree walk (`ddtree_sampling.tree_walk`) on the GPU, alone: a batch of sampled requests over
best-first trees of `--width` verify tokens on a `--vocab` vocabulary (random draft and target logits), as a full
step's walk phase runs it, sgl_kernel's walk included when the carried site has it.

    source bench/gpu/device_env.sh; mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/site312.tar.xz
    PYTHONPATH=/tmp/site python3 bench/gpu/walk_bench.py [--module DIR ...] [--batches 1,4,16,64]

`--module DIR` (repeatable) also times the `ddtree_sampling.py` in DIR (with its `ddtree_utils.py` beside it) after
the payload's, e.g. a previous payload's (`git show REV:ddtree_ops/payload/sglang/srt/speculative/ddtree_sampling.py`)
for a before / after on the same inputs. Per module, settings (temperature only; top_k 20 / top_p 0.95) and batch:
the median GPU ms of one walk over `--repeats` walks (CUDA events), and the host ms to issue it. One JSON line each.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

PAYLOAD = Path(__file__).resolve().parents[2] / "ddtree_ops/payload/sglang/srt/speculative"


def load(directory: Path, tag: str):
    """ddtree_utils then ddtree_sampling from `directory`, under names of their own (two versions side by side)."""
    mods = {}
    for stem in ("ddtree_utils", "ddtree_sampling"):
        spec = importlib.util.spec_from_file_location(f"{stem}_{tag}", directory / f"{stem}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        mods[stem] = mod
    return mods["ddtree_utils"], mods["ddtree_sampling"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module", action="append", default=None, help="a directory holding ddtree_sampling.py")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--width", type=int, default=16, help="verify tokens per request (budget + 1)")
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (host clock only)")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dirs = [PAYLOAD] + [Path(d) for d in (a.module or [])]
    for tag, directory in enumerate(dirs):
        du, ds = load(directory, str(tag))
        for name, top_k, top_p in (("temperature only", ds.TOP_K_ALL, 1.0), ("top_k 20, top_p 0.95", 20, 0.95)):
            for bs in (int(b) for b in a.batches.split(",")):
                g = torch.Generator(device=device).manual_seed(bs)
                draft = torch.randn(bs, a.depth, a.vocab, device=device, generator=g) * 3
                tree = du.build_ddtree(draft, a.width - 1)
                n = tree.parents.shape[1]
                logits = torch.randn(bs, n, a.vocab, device=device, generator=g) * 3
                candidates = tree.full_token_ids(torch.zeros(bs, dtype=torch.int64, device=device))
                kw = dict(sampled_rows=list(range(bs)), temperatures=torch.full((bs,), 0.8, device=device),
                          top_ks=torch.full((bs,), top_k, device=device, dtype=torch.int32),
                          top_ps=torch.full((bs,), top_p, device=device), min_ps=None)
                if "unfiltered" in inspect.signature(ds.tree_walk).parameters:  # the host's word, as a server gives it
                    kw["unfiltered"] = list(range(bs)) if top_k == ds.TOP_K_ALL else []
                gpu_ms, host_ms = [], []
                for i in range(a.repeats + 3):
                    sync()
                    t0 = time.perf_counter()
                    if device.type == "cuda":
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                    ds.tree_walk(tree, candidates, logits, generator=g, **kw)
                    t1 = time.perf_counter()
                    if device.type == "cuda":
                        end.record()
                    sync()
                    if i >= 3:  # the first walks compile and allocate
                        gpu_ms.append(start.elapsed_time(end) if device.type == "cuda" else (time.perf_counter() - t0) * 1e3)
                        host_ms.append((t1 - t0) * 1e3)
                print(json.dumps({"module": str(directory), "settings": name, "batch": bs, "width": n,
                                  "walk_gpu_ms": round(statistics.median(gpu_ms), 3),
                                  "walk_host_ms": round(statistics.median(host_ms), 3),
                                  "kernel": ds._kernel() is not None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

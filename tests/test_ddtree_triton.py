"""The Triton fast path equals the torch path: on a CUDA GPU when there is one, else in Triton's CPU
interpreter (a subprocess with TRITON_INTERPRET=1). Skipped where Triton is not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = r"""
import random, sys, torch
sys.path.insert(0, sys.argv[1])
from ddtree_oracle import load_ddtree_utils, tree_tensor_fields
du = load_ddtree_utils()
dk = du._kernels()
assert dk is not None, "kernels did not load"
device = sys.argv[2]
cases = int(sys.argv[3])
rng = random.Random(0)
keep_chains = 0
fields = tree_tensor_fields()
for case in range(cases):
    batch, depth = rng.choice([1, 3]), rng.choice([1, 3, 5])
    vocab, budget, cap = rng.choice([5, 70, 300, 2000]), rng.choice([1, 2, 7, 16, 40]), rng.choice([1, 2, 4, None])
    k = du._effective_cap(budget, vocab, cap)
    kind = rng.choice(["gauss", "ties", "inf", "inf_row"])
    if kind == "gauss":
        x = torch.randn(batch, depth, vocab) * 3
    elif kind == "ties":
        x = torch.randint(0, 3, (batch, depth, vocab)).float()
    elif kind == "inf_row":  # a whole position without a finite logit: it and every deeper one unreachable
        x = torch.randint(0, 3, (batch, depth, vocab)).float()
        x[rng.randrange(batch), rng.randrange(depth)] = float("-inf")
    else:
        x = torch.randn(batch, depth, vocab).masked_fill(torch.rand(batch, depth, vocab) < 0.9, float("-inf"))
        x[..., 0] = 0.3
    x = x.to(rng.choice([torch.float32, torch.bfloat16, torch.float16])).to(device)
    ctx = (batch, depth, vocab, budget, cap, kind)
    ref_v, ref_i = du.topk_logprobs(x, k)
    got_v, got_i = dk.topk_logprobs_triton(du, x, k)
    assert torch.equal(ref_i, got_i), ctx
    assert torch.equal(torch.isfinite(ref_v), torch.isfinite(got_v)), ctx
    assert not got_v.isnan().any() and torch.equal(ref_v == float("-inf"), got_v == float("-inf")), ctx
    fin = torch.isfinite(ref_v)
    assert torch.allclose(ref_v[fin], got_v[fin], atol=1e-5, rtol=1e-5), ctx
    ref = du.select_tree_from_topk(ref_v, ref_i, budget)
    got = dk.select_tree_triton(du, ref_v, ref_i, budget)
    bad = [f for f in fields if not torch.equal(getattr(ref, f), getattr(got, f))]
    assert not bad, (ctx, bad)
    # Keep-chain post-processes either selection of the same top-K with the same torch code.
    if budget >= depth:
        ref_kc, got_kc = du.keep_top1_chain(ref, ref_v, ref_i), du.keep_top1_chain(got, ref_v, ref_i)
        bad = [f for f in fields if not torch.equal(getattr(ref_kc, f), getattr(got_kc, f))]
        assert not bad, (ctx, "keep_chain", bad)
        keep_chains += 1
    if device == "cuda":  # build_ddtree's own route (Triton), on the Triton top-K (scores may differ
        # from the torch top-K's in the last bit)
        for keep in (False, True) if budget >= depth else (False,):
            fast = du.build_ddtree(x, budget, cap, keep_chain=keep)
            slow = du.select_tree_from_topk(got_v, got_i, budget)
            slow = du.keep_top1_chain(slow, got_v, got_i) if keep else slow
            bad = [f for f in fields if not torch.equal(getattr(slow, f), getattr(fast, f))]
            assert not bad, (ctx, "build_ddtree", keep, bad)
assert keep_chains >= cases // 4, keep_chains
print("ok", cases)
"""


def run_check(device: str, cases: int, interpret: bool) -> None:
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, str(HERE), device, str(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"ok {cases}" in proc.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_triton_path_equals_torch_path_on_gpu() -> None:
    run_check("cuda", 40, interpret=False)


@pytest.mark.slow
def test_triton_kernels_in_the_cpu_interpreter() -> None:
    run_check("cpu", 12, interpret=True)

#!/usr/bin/env python3
"""On the GPU, with the payload installed (PYTHONPATH=/tmp/site): two checks for issue 13.

Usage: sampling_kernels_check.py walk | renorm [TIMEOUT_S]
1. walk: the sampled tree walk: sgl_kernel's tree_speculative_sampling_target_only (zero draft probs) against
   the payload's plain-torch walk (`ddtree_sampling.sample_tree_walk`) on the same trees, target
   distributions and coins: accepted paths, lengths and bonus tokens must agree.
2. renorm: the stall's cause: sgl_kernel's top_k_renorm_prob / top_p_renorm_prob on rows whose top
   probabilities tie (a greedy row carries top_k 1 in a mixed batch), each in a subprocess with a
   timeout, beside the payload's sort-based `filtered_probs_top_k_first` on the same rows.
Prints one JSON line per check.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

RENORM_CHILD = r"""
import sys, time, torch
from sgl_kernel import top_k_renorm_prob, top_p_renorm_prob
kind, rows, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator(device="cuda").manual_seed(0)
# bf16 logits of a near-uniform (random-weight) model: many exact ties, the top one included
if sys.argv[4] == "one-column":
    # what the stuck batch ran: a greedy-only batch with a stale is_all_greedy, top_k 1 -> a one-column
    # top-k whose probabilities are all 1, then top_p_renorm_prob on it
    logits = torch.zeros(rows, 1, device="cuda")
elif sys.argv[4] == "ties":
    # bf16 logits of a near-uniform (random-weight) model: many exact ties, the top one included
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 0.05).to(torch.bfloat16).float()
    logits[:, 1] = logits.max(-1).values
else:  # control: spread float32 logits, no ties
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 3
probs = torch.softmax(logits, -1)
torch.cuda.synchronize(); t = time.time()
if kind == "top_k1":
    out = top_k_renorm_prob(probs, torch.ones(rows, dtype=torch.int32, device="cuda"))
else:
    out = top_p_renorm_prob(probs, torch.full((rows,), 0.95, device="cuda"))
torch.cuda.synchronize()
print(f"{time.time() - t:.4f}")
"""


def walk_check() -> dict:
    import torch
    from sglang.srt.speculative import ddtree_sampling as ds
    from sglang.srt.speculative.ddtree_utils import build_ddtree

    kernel = ds._kernel()
    if kernel is None:
        return {"check": "walk", "ok": False, "error": "sgl_kernel tree sampling not importable"}
    g = torch.Generator(device="cuda").manual_seed(1)
    mismatches, total = 0, 0
    for bs, budget, vocab, temp in [(64, 64, 4096, 1.0), (32, 256, 4096, 2.0),
                                                       (128, 15, 512, 0.5), (16, 64, 64, 3.0)]:
        draft = torch.randn(bs, 15, vocab, device="cuda", generator=g) * 3
        tree = build_ddtree(draft, budget)
        n = budget + 1
        # targets that often agree with the draft, so walks go deep
        logits = torch.randn(bs, n, vocab, device="cuda", generator=g)
        probs = torch.softmax(logits / temp, -1)
        cand = tree.full_token_ids(torch.randint(0, vocab, (bs,), device="cuda", generator=g))
        coins = torch.rand((bs, n), device="cuda", generator=g)
        final = torch.rand((bs,), device="cuda", generator=g)
        a = ds._kernel_walk(kernel, tree, cand, probs, coins, final)
        b = ds.sample_tree_walk(tree, cand, probs, coins, final)
        same = (a[0] == b[0]).all(1) & (a[1] == b[1]) & (a[2] == b[2])
        mismatches += int((~same).sum())
        total += bs
    return {"check": "walk", "ok": mismatches == 0, "rows": total, "mismatches": mismatches}


def renorm_check(timeout: float) -> list[dict]:
    """Controls first; a tied input that spins is left running only until the timeout (the caller
    runs this last: a spinning kernel starves every other process on the GPU)."""
    out = []
    for inputs in ("control", "one-column", "ties"):
        for kind in ("top_k1", "top_p"):
            rows, vocab = 64, 4096
            t = time.time()
            try:
                p = subprocess.run([sys.executable, "-c", RENORM_CHILD, kind, str(rows), str(vocab), inputs],
                                   capture_output=True, text=True, timeout=timeout)
                res = {"kernel_s": p.stdout.strip().splitlines()[-1] if p.returncode == 0 else None,
                       "rc": p.returncode, "err": p.stderr.strip().splitlines()[-1:] if p.returncode else []}
            except subprocess.TimeoutExpired:
                res = {"kernel_s": None, "timed_out_after_s": timeout}
            out.append({"check": "renorm", "inputs": inputs, "kind": kind, "rows": rows, "vocab": vocab, **res,
                        "wall_s": round(time.time() - t, 2)})
            print(json.dumps(out[-1]), flush=True)
    import torch
    from sglang.srt.speculative.ddtree_sampling import filtered_probs_top_k_first

    logits = (torch.randn(256, 4096, device="cuda") * 0.05).to(torch.bfloat16).float()
    logits[:, 1] = logits.max(-1).values
    torch.cuda.synchronize()
    t = time.time()
    p = filtered_probs_top_k_first(logits, torch.ones(256, dtype=torch.int64, device="cuda"), None)
    torch.cuda.synchronize()
    out.append({"check": "renorm", "inputs": "ties", "kind": "payload sort, top_k1", "rows": 256, "vocab": 4096,
                "s": round(time.time() - t, 4), "one_hot": bool(((p > 0).sum(-1) == 1).all())})
    print(json.dumps(out[-1]), flush=True)
    return out


def main() -> int:
    """walk | renorm [TIMEOUT_S]"""
    if sys.argv[1:2] == ["renorm"]:
        renorm_check(float(sys.argv[2]) if len(sys.argv) > 2 else 20.0)
        return 0
    try:
        r = walk_check()
    except Exception as e:  # noqa: BLE001 - reported, the proof call goes on
        r = {"check": "walk", "ok": False, "error": repr(e)[:500]}
    print(json.dumps(r), flush=True)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

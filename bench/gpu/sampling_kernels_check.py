#!/usr/bin/env python3
"""On the GPU, with the payload installed (PYTHONPATH=/tmp/site): the sampled walk's checks (issues 13, 23).

Usage: sampling_kernels_check.py walk | renorm [TIMEOUT_S]
1. walk: the sampled tree walk: sgl_kernel's tree_speculative_sampling_target_only (zero draft probs) against
   the payload's plain-torch walk (`ddtree_sampling.sample_tree_walk`) on the same trees, target
   distributions and coins: accepted paths, lengths and bonus tokens must agree. Then (issue 23):
   - leftover: nodes whose children hold their whole top-k distribution, with float32 sums below the
     largest coin; at that coin the raw kernel emits vocab - 1 (no mass), the payload the last child;
     and 200 000 walks with uniform coins through the real kernel follow the target (two-sample test
     against torch.multinomial on the same distribution);
   - identity: rows at the identity settings (temperature only) take `tree_walk`'s own path (a log-sum-exp per
     node, Triton's walk over the children's probabilities, one distribution for the bonus): with the same
     coins it must walk as sgl_kernel does over every node's distribution (mismatches counted: only float32
     rounding at a coin's edge may differ), and 200 000 walks of one tree must emit the root's distribution
     (two-sample test against torch.multinomial);
   - filters: `target_probs` against plain's own samplers on the GPU, per --sampling-backend rule:
     SGLang's top_k_top_p_min_p_sampling_from_probs_torch and flashinfer's joint top_k_top_p sampling,
     100 000 draws a row on rows with ties at the boundaries (every draw inside the support, and a
     chi-square fit), and the identity rows (T 1, top_p 1) unfiltered.
2. renorm: the stall's cause: sgl_kernel's top_k_renorm_prob / top_p_renorm_prob on rows whose top
   probabilities tie (a greedy row carries top_k 1 in a mixed batch), each in a subprocess with a
   timeout, beside the payload's sort-based `target_probs` on the same rows.
Prints one JSON line per check; exit 1 if one fails.
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
    from sglang.srt.speculative.ddtree_sampling import target_probs

    logits = (torch.randn(256, 4096, device="cuda") * 0.05).to(torch.bfloat16).float()
    logits[:, 1] = logits.max(-1).values
    torch.cuda.synchronize()
    t = time.time()
    ones = torch.ones(256, device="cuda")
    p = target_probs(logits, ones, torch.ones(256, dtype=torch.int64, device="cuda"), ones)
    torch.cuda.synchronize()
    out.append({"check": "renorm", "inputs": "ties", "kind": "payload sort, top_k1", "rows": 256, "vocab": 4096,
                "s": round(time.time() - t, 4), "one_hot": bool(((p > 0).sum(-1) == 1).all())})
    print(json.dumps(out[-1]), flush=True)
    return out


def _chi2(counts: list[int], probs: list[float]) -> dict:
    """Pearson goodness of fit, cells of expectation < 5 pooled; p from Wilson-Hilferty."""
    import math

    n = sum(counts)
    stat, df, po, pe = 0.0, -1, 0, 0.0
    for c, p in zip(counts, probs, strict=True):
        if p == 0:
            if c:
                return {"outside_support": c, "p": 0.0}
            continue
        if n * p < 5:
            po, pe = po + c, pe + n * p
            continue
        stat, df = stat + (c - n * p) ** 2 / (n * p), df + 1
    if pe > 0:
        stat, df = stat + (po - pe) ** 2 / pe, df + 1
    if df <= 0:
        return {"chi2": stat, "df": df, "p": 1.0}
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return {"chi2": round(stat, 2), "df": df, "p": 0.5 * math.erfc(z / math.sqrt(2))}


def leftover_check() -> dict:
    import torch
    from sglang.srt.speculative import ddtree_sampling as ds
    from sglang.srt.speculative.ddtree_utils import build_ddtree

    kernel = ds._kernel()
    g = torch.Generator(device="cuda").manual_seed(5)
    last_coin = 1.0 - 2.0**-24
    found, raw_bad, fixed_bad, law = 0, 0, 0, []
    for k in (2, 3, 5, 8):
        vocab = 64
        logits = torch.randn(4096, vocab, device="cuda", generator=g) * 2
        ks = torch.full((4096,), k, device="cuda")
        q = ds.target_probs(logits, torch.ones(4096, device="cuda"), ks, torch.ones(4096, device="cuda"))
        top = torch.topk(q, k, dim=-1).indices  # the support, most probable first: the root's children
        acc = torch.zeros(4096, device="cuda")
        for j in range(k):
            acc = acc + q.gather(1, top[:, j : j + 1]).view(-1)
        rows = torch.nonzero(acc < last_coin).view(-1)[:256]  # the float32 sum below the largest coin
        if rows.numel() == 0:
            continue
        bs = rows.numel()
        draft = torch.full((bs, 1, vocab), -30.0, device="cuda")
        draft[:, 0].scatter_(1, top[rows], torch.arange(k, 0, -1, device="cuda", dtype=torch.float32).expand(bs, k) * 3)
        tree = build_ddtree(draft, k)
        cand = tree.full_token_ids(torch.zeros(bs, dtype=torch.int64, device="cuda"))
        probs = q[rows].unsqueeze(1).expand(bs, k + 1, vocab).contiguous()
        coins = torch.full((bs, k + 1), last_coin, device="cuda")
        final = torch.rand((bs,), device="cuda", generator=g)
        # the raw kernel (as upstream's sampled DFLASH / a tree walk calls it)
        predicts = torch.empty(bs * (k + 1), dtype=torch.int32, device="cuda")
        index = torch.full((bs, 2), -1, dtype=torch.int32, device="cuda")
        num = torch.zeros(bs, dtype=torch.int32, device="cuda")
        kernel(predicts=predicts, accept_index=index, accept_token_num=num, candidates=cand,
               retrive_index=torch.arange(bs * (k + 1), device="cuda").view(bs, k + 1),
               retrive_next_token=tree.retrive_next_token, retrive_next_sibling=tree.retrive_next_sibling,
               uniform_samples=coins, uniform_samples_for_final_sampling=final, target_probs=probs,
               draft_probs=torch.zeros_like(probs), threshold_single=1.0, threshold_acc=1.0, deterministic=True)
        raw = predicts.view(bs, k + 1)[:, 0].long()
        stopped = num == 0
        found += int(stopped.sum())
        raw_bad += int(((probs[:, 0].gather(1, raw[:, None]).view(-1) == 0) & stopped).sum())
        nodes, lengths, bonus = ds._kernel_walk(kernel, tree, cand, probs, coins, final)
        first = torch.where(lengths > 0, cand.gather(1, nodes[:, 1:2].clamp(min=0)).view(-1), bonus)
        fixed_bad += int((probs[:, 0].gather(1, first[:, None]).view(-1) == 0).sum())
        if k == 3:  # the law through the real kernel, uniform coins, against multinomial draws
            reps = 200_000 // bs
            big = ds._tree_rows(tree, torch.arange(bs, device="cuda").repeat(reps))
            cand_r, probs_r = cand.repeat(reps, 1), probs.repeat(reps, 1, 1)
            nodes, lengths, bonus = ds._kernel_walk(kernel, big, cand_r, probs_r,
                                                    torch.rand((bs * reps, k + 1), device="cuda", generator=g),
                                                    torch.rand((bs * reps,), device="cuda", generator=g))
            first = torch.where(lengths > 0, cand_r.gather(1, nodes[:, 1:2].clamp(min=0)).view(-1), bonus)
            draws = torch.multinomial(probs_r[:, 0], 1, generator=g).view(-1)
            # pooled over the rows: per (row, token) counts as one contingency table
            key_a = (torch.arange(bs * reps, device="cuda") % bs) * vocab + first
            key_b = (torch.arange(bs * reps, device="cuda") % bs) * vocab + draws
            ca = torch.bincount(key_a, minlength=bs * vocab).tolist()
            cb = torch.bincount(key_b, minlength=bs * vocab).tolist()
            stat, df = 0.0, -1
            for a, b in zip(ca, cb, strict=True):
                if a + b >= 10:
                    e = (a + b) / 2
                    stat, df = stat + (a - e) ** 2 / e + (b - e) ** 2 / e, df + 1
            law.append({"two_sample_chi2": round(stat, 1), "df": df, "p": _chi2_sf(stat, df), "walks": bs * reps})
    ok = found > 0 and fixed_bad == 0 and all(t["p"] > 1e-4 for t in law) and bool(law)
    return {"check": "leftover", "ok": ok, "rows_at_the_largest_coin": found, "raw_kernel_outside_support": raw_bad,
            "payload_outside_support": fixed_bad, "law": law}


def _chi2_sf(stat: float, df: int) -> float:
    import math

    if df <= 0:
        return 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def identity_check() -> dict:
    import torch
    from sglang.srt.speculative import ddtree_sampling as ds
    from sglang.srt.speculative.ddtree_utils import build_ddtree

    kernel = ds._kernel()
    kernels = ds._fused_kernels(torch.empty(0, device="cuda"))
    if kernel is None or kernels is None:
        return {"check": "identity", "ok": False, "error": "sgl_kernel walk or the payload's Triton kernels missing"}
    g = torch.Generator(device="cuda").manual_seed(8)
    mismatches, total = 0, 0
    for bs, budget, vocab, temp in [(64, 15, 151936, 0.8), (16, 64, 151936, 1.0), (128, 15, 4096, 0.5),
                                    (8, 256, 32000, 1.3)]:
        draft = torch.randn(bs, 15, vocab, device="cuda", generator=g) * 4
        tree = build_ddtree(draft, budget)
        n = budget + 1
        logits = draft.new_zeros(bs, n, vocab)
        logits[:, :, :] = torch.randn(bs, n, vocab, device="cuda", generator=g) * 3
        cand = tree.full_token_ids(torch.randint(0, vocab, (bs,), device="cuda", generator=g))
        rows = list(range(bs))
        temps = torch.full((bs,), temp, device="cuda")
        kw = dict(sampled_rows=rows, temperatures=temps, top_ks=torch.full((bs,), ds.TOP_K_ALL, device="cuda"),
                  top_ps=torch.ones(bs, device="cuda"))
        seed = 100 + bs
        got = ds.tree_walk(tree, cand, logits, unfiltered=rows, generator=torch.Generator(device="cuda").manual_seed(seed), **kw)
        coin_gen = torch.Generator(device="cuda").manual_seed(seed)
        coins, final = torch.rand((bs, n), device="cuda", generator=coin_gen), torch.rand((bs,), device="cuda", generator=coin_gen)
        probs = torch.softmax(logits / temp, -1)
        want = ds._kernel_walk(kernel, tree, cand, probs, coins, final)
        same = (got[0] == want[0]).all(1) & (got[1] == want[1]) & (got[2] == want[2])
        mismatches += int((~same).sum())
        total += bs
    # the law: one tree of peaked draft logits walked 200 000 times; the first emitted token against
    # multinomial draws from the root's distribution
    vocab, budget, reps = 64, 12, 200_000
    tree1 = build_ddtree(torch.randn(1, 4, vocab, device="cuda", generator=g) * 3, budget)
    logits1 = torch.randn(1, budget + 1, vocab, device="cuda", generator=g) * 1.5
    big = ds._tree_rows(tree1, torch.zeros(reps, dtype=torch.int64, device="cuda"))
    cand1 = tree1.full_token_ids(torch.zeros(1, dtype=torch.int64, device="cuda")).expand(reps, -1)
    ones = torch.ones(reps, device="cuda")
    nodes, lengths, bonus = ds.tree_walk(big, cand1, logits1.expand(reps, -1, -1), sampled_rows=list(range(reps)),
                                         unfiltered=list(range(reps)), temperatures=ones * 0.8,
                                         top_ks=torch.full((reps,), ds.TOP_K_ALL, device="cuda"), top_ps=ones,
                                         generator=torch.Generator(device="cuda").manual_seed(9))
    first = torch.where(lengths > 0, cand1.gather(1, nodes[:, 1:2].clamp(min=0)).view(-1), bonus)
    draws = torch.multinomial(torch.softmax(logits1[0, 0] / 0.8, -1), reps, replacement=True, generator=g)
    ca, cb = torch.bincount(first, minlength=vocab).tolist(), torch.bincount(draws, minlength=vocab).tolist()
    stat, df = 0.0, -1
    for a, b in zip(ca, cb, strict=True):
        if a + b >= 10:
            e = (a + b) / 2
            stat, df = stat + (a - e) ** 2 / e + (b - e) ** 2 / e, df + 1
    law = {"two_sample_chi2": round(stat, 1), "df": df, "p": _chi2_sf(stat, df), "walks": reps}
    ok = mismatches <= max(1, total // 1000) and law["p"] > 1e-4
    return {"check": "identity", "ok": ok, "rows": total, "mismatches_vs_sgl_kernel": mismatches, "law": law}


def filters_check() -> dict:
    import torch
    from flashinfer.sampling import top_k_top_p_sampling_from_probs
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch
    from sglang.srt.speculative.ddtree_sampling import TOP_K_ALL, target_probs

    g = torch.Generator(device="cuda").manual_seed(6)
    vocab, draws = 48, 100_000
    # quantised logits: ties at the top-k and top-p boundaries
    logits = (torch.randint(-4, 5, (6, vocab), device="cuda", generator=g) * 0.5).float()
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0, 0.9], device="cuda")
    ks = torch.tensor([3, 5, TOP_K_ALL, 8, TOP_K_ALL, 2], device="cuda")
    ps = torch.tensor([1.0, 0.8, 0.6, 0.9, 1.0, 1.0], device="cuda")
    mins = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.0], device="cuda")
    out = {}
    for rule in ("pytorch", "flashinfer"):
        want = target_probs(logits, temps, ks, ps, mins, rule=rule)
        rows = []
        for r in range(logits.shape[0]):
            if rule == "flashinfer" and float(mins[r]) > 0:
                continue  # its min-p path runs sgl_kernel's renorm kernels (the stall): CPU-tested only
            probs = torch.softmax(logits[r : r + 1] / temps[r], -1).repeat(draws, 1)
            k, p = ks[r : r + 1].repeat(draws), ps[r : r + 1].repeat(draws)
            if rule == "pytorch":
                got = top_k_top_p_min_p_sampling_from_probs_torch(probs, k, p, mins[r : r + 1].repeat(draws),
                                                                  float(mins[r]) > 0, None, None)
            else:
                got = top_k_top_p_sampling_from_probs(probs, k.int(), p, filter_apply_order="joint")
            counts = torch.bincount(got.long(), minlength=vocab).tolist()
            rows.append({"row": r, **_chi2(counts, want[r].tolist()),
                         "support": int((want[r] > 0).sum())})
        out[rule] = rows
    ones = torch.ones(2, device="cuda")
    ident = target_probs(logits[:2], ones, torch.full((2,), TOP_K_ALL, device="cuda"), ones)
    identity_ok = bool(torch.equal(ident, torch.softmax(logits[:2], -1)))
    ok = identity_ok and all(t.get("p", 0) > 1e-4 for rows in out.values() for t in rows)
    return {"check": "filters", "ok": ok, "identity_unfiltered": identity_ok, **out}


def main() -> int:
    """walk | renorm [TIMEOUT_S]"""
    if sys.argv[1:2] == ["renorm"]:
        renorm_check(float(sys.argv[2]) if len(sys.argv) > 2 else 20.0)
        return 0
    ok = True
    for check in (walk_check, leftover_check, identity_check, filters_check):
        try:
            r = check()
        except Exception as e:  # noqa: BLE001 - reported, the proof call goes on
            r = {"check": check.__name__, "ok": False, "error": repr(e)[:500]}
        print(json.dumps(r), flush=True)
        ok &= bool(r["ok"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

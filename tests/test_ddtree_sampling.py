"""Sampled verification of a DDTree (payload `ddtree_sampling`): the target distributions it samples
from, and the walk's output distribution, against independent references.

The walk is checked by its law, not by hand-picked cases: for random trees and random per-node target
distributions, the emitted (first token, second token or end-of-step) pairs must follow the exact law
of plain sampling, computed analytically; the same chi-square test must reject the law of a walk that
forgets to remove rejected children from the bonus draw (the test has power).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from ddtree_oracle import load_ddtree_utils, load_payload_module

du = load_ddtree_utils()
ds = load_payload_module("ddtree_sampling")
TOP_K_ALL = 1 << 30


# ---------------------------------------------------------------------------------- target probs
def ref_probs(row: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """Plain SGLang sampler semantics written as loops (pytorch backend, joint order)."""
    m = max(x / temperature for x in row)
    e = [math.exp(x / temperature - m) for x in row]
    z = sum(e)
    p = [x / z for x in e]
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    kept = {}
    above = 0.0
    for rank, i in enumerate(order):
        if rank < top_k and above <= top_p:
            kept[i] = p[i]
        above += p[i]
    best = p[order[0]]
    kept = {i: v for i, v in kept.items() if v >= min_p * best or i == order[0]}
    total = sum(kept.values())
    return [kept.get(i, 0.0) / total for i in range(len(p))]


def test_target_probs_match_the_sampler_semantics() -> None:
    rng = random.Random(3)
    for trial in range(200):
        vocab = rng.choice([2, 5, 17, 64])
        rows = rng.randint(1, 6)
        # quantised logits: ties at the top and at the top-k / top-p boundaries
        logits = torch.tensor([[rng.randint(-6, 6) * 0.5 for _ in range(vocab)] for _ in range(rows)], dtype=torch.float64)
        temps = torch.tensor([rng.choice([0.3, 0.8, 1.0, 2.0]) for _ in range(rows)])
        ks = torch.tensor([rng.choice([1, 2, 3, vocab, TOP_K_ALL]) for _ in range(rows)])
        ps = torch.tensor([rng.choice([0.1, 0.5, 0.95, 1.0]) for _ in range(rows)])
        mins = torch.tensor([rng.choice([0.0, 0.0, 0.2]) for _ in range(rows)])
        got = ds.target_probs(logits, temps, ks, ps, mins)
        for r in range(rows):
            want = ref_probs(logits[r].tolist(), float(temps[r]), int(ks[r]), float(ps[r]), float(mins[r]))
            assert got[r].tolist() == pytest.approx(want, abs=1e-5), (trial, r)


def test_top_k_first_probs_one_hot_for_greedy_rows() -> None:
    """The upstream-DFLASH stall fix: a top_k 1 row is the argmax (lowest id on ties), exactly."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 2.0, 3.0]])
    got = ds.filtered_probs_top_k_first(logits, torch.tensor([1, 1, TOP_K_ALL]), torch.tensor([1.0, 1.0, 1.0]))
    assert got[0].tolist() == [0.0, 1.0, 0.0, 0.0] and got[1].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert got[2].tolist() == pytest.approx(torch.softmax(logits[2], 0).tolist())
    # top-k first, then top-p over the renormalised top-k (upstream's order)
    p = torch.softmax(torch.tensor([3.0, 2.0, 1.0, 0.0]), 0)
    got = ds.filtered_probs_top_k_first(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), torch.tensor([3]), torch.tensor([0.8]))
    top3 = p[:3] / p[:3].sum()
    keep = 2 if float(top3[0]) < 0.8 else 1
    want = torch.zeros(4)
    want[:keep] = p[:keep] / p[:keep].sum()
    assert got[0].tolist() == pytest.approx(want.tolist())


# ---------------------------------------------------------------------------------- the walk
def _random_case(seed: int, vocab: int = 6, depth: int = 3, budget: int = 7):
    g = torch.Generator().manual_seed(seed)
    tree = du.build_ddtree(torch.randn(1, depth, vocab, generator=g) * 1.5, budget)
    n = tree.parents.shape[1]
    probs = torch.softmax(torch.randn(1, n, vocab, generator=g) * 1.5, -1)
    candidates = tree.full_token_ids(torch.tensor([0]))
    return tree, probs, candidates


def _children(tree, node: int) -> dict[int, int]:
    nn = int(tree.num_nodes[0])
    return {int(tree.token_ids[0, c - 1]): c for c in range(1, nn) if int(tree.parents[0, c]) == node}


def exact_law(tree, probs, *, forget_rejected: bool = False) -> dict[tuple[int, int], float]:
    """P(first emitted token, second emitted token or -1 when the step ends after the first)."""
    q0 = probs[0, 0].double()
    kids = _children(tree, 0)
    law: dict[tuple[int, int], float] = {}
    if forget_rejected:  # a broken walk: the bonus is drawn from q0 without removing the children
        miss = 1.0 - sum(float(q0[t]) for t in kids)
        for t in range(q0.numel()):
            law[(t, -1)] = law.get((t, -1), 0.0) + miss * float(q0[t])
    for t in range(q0.numel()):
        if t in kids:
            q1 = probs[0, kids[t]].double()
            for s in range(q1.numel()):
                law[(t, s)] = float(q0[t]) * float(q1[s])
        elif not forget_rejected:
            law[(t, -1)] = float(q0[t])
    return law


def _repeat_tree(tree, bs: int):
    """A one-request tree repeated ``bs`` times (independent walks over the same tree)."""
    return type(tree)(**{
        f: (getattr(tree, f).expand(bs, *getattr(tree, f).shape[1:]).contiguous()
            if isinstance(getattr(tree, f), torch.Tensor) else getattr(tree, f))
        for f in tree.__dataclass_fields__
    })


def walk_samples(tree, probs, candidates, n: int, seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    bs = n
    big = _repeat_tree(tree, bs)
    nodes, lengths, bonus = ds.sample_tree_walk(
        big, candidates.expand(bs, -1), probs.expand(bs, -1, -1),
        torch.rand((bs, candidates.shape[1]), generator=g), torch.rand((bs,), generator=g),
    )
    out = []
    for i in range(bs):
        length = int(lengths[i])
        emitted = [int(candidates[0, int(nodes[i, j])]) for j in range(1, length + 1)] + [int(bonus[i])]
        out.append((emitted[0], emitted[1] if len(emitted) > 1 else -1))
    return out


def chi_square_rejects(samples: list[tuple[int, int]], law: dict[tuple[int, int], float]) -> bool:
    """Pearson chi-square at alpha 1e-4 (Wilson-Hilferty critical value), cells with expectation < 5
    pooled; a sample outside the law's support rejects outright."""
    n = len(samples)
    counts: dict[tuple[int, int], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    if any(law.get(k, 0.0) == 0.0 for k in counts):
        return True
    stat, df, pooled_o, pooled_e = 0.0, -1, 0, 0.0
    for k, p in law.items():
        e = n * p
        if e < 5:
            pooled_o, pooled_e = pooled_o + counts.get(k, 0), pooled_e + e
            continue
        stat += (counts.get(k, 0) - e) ** 2 / e
        df += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        df += 1
    z = 3.719  # one-sided normal quantile for alpha = 1e-4
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical


@pytest.mark.parametrize("seed", range(6))
def test_the_walk_samples_exactly_the_target(seed: int) -> None:
    tree, probs, candidates = _random_case(seed)
    samples = walk_samples(tree, probs, candidates, 30_000, seed + 100)
    assert not chi_square_rejects(samples, exact_law(tree, probs)), seed
    # power: the law of a walk that keeps rejected children in the bonus draw is rejected
    assert chi_square_rejects(samples, exact_law(tree, probs, forget_rejected=True)), seed


def test_the_walk_accepts_what_it_emits_and_stays_on_the_tree() -> None:
    for seed in range(20):
        tree, probs, candidates = _random_case(seed, vocab=5, depth=4, budget=12)
        g = torch.Generator().manual_seed(seed)
        bs = 64
        big = _repeat_tree(tree, bs)
        nodes, lengths, bonus = ds.sample_tree_walk(
            big, candidates.expand(bs, -1), probs.expand(bs, -1, -1),
            torch.rand((bs, candidates.shape[1]), generator=g), torch.rand((bs,), generator=g))
        for i in range(bs):
            path = nodes[i, : int(lengths[i]) + 1].tolist()
            assert path[0] == 0 and all(x == -1 for x in nodes[i, int(lengths[i]) + 1 :].tolist())
            for a, b in zip(path, path[1:], strict=False):
                assert int(tree.parents[0, b]) == a
            # the bonus is never a child of the last node (those were all rejected) and has mass there
            assert int(bonus[i]) not in _children(tree, path[-1])
            assert float(probs[0, path[-1], int(bonus[i])]) > 0


def test_greedy_rows_walk_the_argmax_and_mixed_batches_keep_them() -> None:
    """tree_walk: greedy rows equal follow_verified_tree on the argmax whatever the sampled rows do."""
    g = torch.Generator().manual_seed(7)
    bs, depth, vocab, budget = 6, 4, 9, 10
    tree = du.build_ddtree(torch.randn(bs, depth, vocab, generator=g), budget)
    n = budget + 1
    logits = torch.randn(bs, n, vocab, generator=g)
    candidates = tree.full_token_ids(torch.arange(bs))
    want = du.follow_verified_tree(tree, logits.argmax(-1))
    sampled = [1, 4]
    kw = dict(temperatures=torch.full((bs,), 0.8), top_ks=torch.full((bs,), TOP_K_ALL),
              top_ps=torch.full((bs,), 0.95), min_ps=None)
    alone = ds.tree_walk(tree, candidates, logits, sampled_rows=[], **kw)
    mixed = ds.tree_walk(tree, candidates, logits, sampled_rows=sampled,
                         generator=torch.Generator().manual_seed(1), **kw)
    for a, b in zip(want, alone, strict=True):
        assert torch.equal(a, b)
    greedy = [i for i in range(bs) if i not in sampled]
    for a, b in zip(want, mixed, strict=True):
        assert torch.equal(a[greedy], b[greedy])
    # a sampled row at a vanishing temperature is the argmax walk too
    cold = ds.tree_walk(tree, candidates, logits * 1000, sampled_rows=list(range(bs)),
                        generator=torch.Generator().manual_seed(2), **kw)
    for a, b in zip(du.follow_verified_tree(tree, logits.argmax(-1)), cold, strict=True):
        assert torch.equal(a, b)


def test_the_torch_walk_is_the_kernel_rule() -> None:
    """sample_tree_walk and the payload's kernel adapter (`_kernel_walk`, fed the Python-loop kernel
    reference) agree exactly: same trees, distributions and coins, so the CUDA path and the CPU path
    are one rule (on the GPU the real kernel matched too: bench/gpu/sampling_kernels_check.py)."""
    from ddtree_oracle import tree_sampling_reference

    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        bs, depth, vocab, budget = 5, 4, 7, [3, 9, 20][seed % 3]
        tree = du.build_ddtree(torch.randn(bs, depth, vocab, generator=g) * 2, budget)
        n = budget + 1
        probs = torch.softmax(torch.randn(bs, n, vocab, generator=g) * 2, -1)
        cand = tree.full_token_ids(torch.randint(0, vocab, (bs,), generator=g))
        coins, final = torch.rand((bs, n), generator=g), torch.rand((bs,), generator=g)
        want = ds._kernel_walk(tree_sampling_reference, tree, cand, probs, coins, final)
        got = ds.sample_tree_walk(tree, cand, probs, coins, final)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b), seed


def test_chunked_sampled_rows_walk_exactly_as_one_chunk() -> None:
    """Bounding the distributions' memory (max_elements) changes nothing but the peak: same coins,
    same paths, same bonus tokens."""
    g = torch.Generator().manual_seed(11)
    bs, depth, vocab, budget = 7, 4, 13, 9
    tree = du.build_ddtree(torch.randn(bs, depth, vocab, generator=g), budget)
    n = budget + 1
    logits = torch.randn(bs, n, vocab, generator=g) * 2
    candidates = tree.full_token_ids(torch.arange(bs))
    kw = dict(sampled_rows=[0, 2, 3, 5, 6], temperatures=torch.full((bs,), 0.9), top_ks=torch.full((bs,), 5),
              top_ps=torch.full((bs,), 0.9), min_ps=None)
    one = ds.tree_walk(tree, candidates, logits, generator=torch.Generator().manual_seed(5), **kw)
    for limit in (1, n * vocab, 2 * n * vocab + 1):
        chunked = ds.tree_walk(tree, candidates, logits, generator=torch.Generator().manual_seed(5),
                               max_elements=limit, **kw)
        for a, b in zip(one, chunked, strict=True):
            assert torch.equal(a, b), limit

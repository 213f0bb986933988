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
def _softmax(row: list[float], temperature: float) -> list[float]:
    m = max(x / temperature for x in row)
    e = [math.exp(x / temperature - m) for x in row]
    return [x / sum(e) for x in e]


def _identity(top_k: int, top_p: float, min_p: float) -> bool:
    return top_k >= TOP_K_ALL and top_p == 1.0 and min_p <= 0.0


def ref_pytorch(row: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """SGLang's torch sampler (top_k_top_p_min_p_sampling_from_probs_torch) written as loops: sorted
    order, drop rank >= k or mass before > top_p, then min-p against the best; none at identity."""
    p = _softmax(row, temperature)
    if _identity(top_k, top_p, min_p):
        return p
    # Among equal probabilities the order is the sort's (implementation-defined): take torch's, as the
    # sampler does; the rest is loops.
    probs = torch.softmax(torch.tensor([row], dtype=torch.float64).float() / temperature, -1)
    order = probs.sort(dim=-1, descending=True).indices[0].tolist()
    kept, above = {}, 0.0
    for rank, i in enumerate(order):
        if rank < top_k and above <= top_p:
            kept[i] = p[i]
        above += p[i]
    best = p[order[0]]
    kept = {i: v for i, v in kept.items() if v >= min_p * best}
    return [kept.get(i, 0.0) / sum(kept.values()) for i in range(len(p))]


def ref_flashinfer(row: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """flashinfer as SGLang calls it, as loops over tokens: joint (fewer than k tokens and less than
    top_p of the mass strictly more probable), or with min-p top-k, renormalise, top-p, renormalise,
    min-p; none at identity."""
    p = _softmax(row, temperature)
    if _identity(top_k, top_p, min_p):
        return p

    def strictly_above(q: list[float], i: int) -> tuple[int, float]:
        return sum(1 for x in q if x > q[i]), sum(x for x in q if x > q[i])

    if min_p <= 0:
        kept = [v if strictly_above(p, i)[0] < top_k and strictly_above(p, i)[1] < top_p else 0.0
                for i, v in enumerate(p)]
    else:
        kept = [v if strictly_above(p, i)[0] < top_k else 0.0 for i, v in enumerate(p)]
        q = [v / sum(kept) for v in kept]
        if top_p < 1.0:
            kept = [v if strictly_above(q, i)[1] < top_p else 0.0 for i, v in enumerate(kept)]
        best = max(kept)
        kept = [v if v >= min_p * best else 0.0 for v in kept]
    return [v / sum(kept) for v in kept]


@pytest.mark.parametrize("rule,ref", [("pytorch", ref_pytorch), ("flashinfer", ref_flashinfer)])
def test_target_probs_are_plain_samplings_rule(rule: str, ref) -> None:
    """Randomised against the loop references, with quantised logits so that ties sit at the top-k,
    top-p and min-p boundaries, and rows at the identity settings among them."""
    rng = random.Random(3)
    for trial in range(300):
        vocab = rng.choice([2, 5, 17, 64])
        rows = rng.randint(1, 6)
        logits = torch.tensor([[rng.randint(-6, 6) * 0.5 for _ in range(vocab)] for _ in range(rows)], dtype=torch.float64)
        temps = torch.tensor([rng.choice([0.3, 0.8, 1.0, 2.0]) for _ in range(rows)])
        ks = torch.tensor([rng.choice([1, 2, 3, vocab, TOP_K_ALL]) for _ in range(rows)])
        ps = torch.tensor([rng.choice([0.1, 0.5, 0.95, 1.0, 1.0]) for _ in range(rows)])
        mins = torch.tensor([rng.choice([0.0, 0.0, 0.2]) for _ in range(rows)])
        got = ds.target_probs(logits, temps, ks, ps, mins, rule=rule, max_elements=rng.choice([1, 64, 1 << 20]))
        for r in range(rows):
            want = ref(logits[r].tolist(), float(temps[r]), int(ks[r]), float(ps[r]), float(mins[r]))
            assert got[r].tolist() == pytest.approx(want, abs=1e-5), (rule, trial, r)


def test_only_filtered_rows_are_sorted(monkeypatch) -> None:
    """The sort is the cost (a 152k vocabulary, bs x width rows): rows at the identity settings skip it,
    and a chunk of them alone sorts nothing. Randomised row mixes; the result is the all-rows result."""
    rng = random.Random(11)
    sorted_rows: list[int] = []
    real_sort = ds._sorted_desc

    def spy(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sorted_rows.append(probs.shape[0])
        return real_sort(probs)

    monkeypatch.setattr(ds, "_sorted_desc", spy)
    for _ in range(60):
        rows, vocab = rng.randint(1, 9), rng.choice([5, 33])
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        temps = torch.tensor([rng.choice([0.5, 1.0]) for _ in range(rows)])
        identity = [rng.random() < 0.5 for _ in range(rows)]
        ks = torch.tensor([TOP_K_ALL if i else rng.choice([1, 3, TOP_K_ALL]) for i in identity])
        ps = torch.tensor([1.0 if i else rng.choice([0.5, 0.9]) for i in identity])
        step = rng.choice([1, 2, rows])
        sorted_rows.clear()
        got = ds.target_probs(logits, temps, ks, ps, None, max_elements=step * vocab)
        want_sorted = [sum(1 for i in identity[lo:lo + step] if not i) for lo in range(0, rows, step)]
        assert sorted_rows == [n for n in want_sorted if n], (identity, step)
        for r in range(rows):
            want = ref_pytorch(logits[r].tolist(), float(temps[r]), int(ks[r]), float(ps[r]), 0.0)
            assert got[r].tolist() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("rule", ["pytorch", "flashinfer"])
def test_identity_settings_filter_nothing_where_a_top_p_1_filter_would(rule: str) -> None:
    """T 1 / top_p 1 / top_k all / min_p 0 is plain's unfiltered softmax, bit for bit. On this row the
    float32 running sum passes 1.0 before the last token, so a top-p 1 filter drops it (the payload
    before issue 23 did; plain skips the filter)."""
    logits = torch.tensor([[0.40722140669822693, -1.9383013248443604, -38.398014068603516]])
    one = torch.ones(1)
    probs = torch.softmax(logits, dim=-1)
    filtered = ds.target_probs(logits, one, torch.tensor([2]), one, None, rule=rule)  # top-k 2: filtered
    assert float(filtered[0, 2]) == 0.0
    sorted_p = torch.sort(probs, dim=-1, descending=True).values
    assert bool(((torch.cumsum(sorted_p, -1) - sorted_p) > 1.0)[0, 2]), "the premise: the tail passes 1.0"
    got = ds.target_probs(logits, one, torch.tensor([TOP_K_ALL]), one, torch.zeros(1), rule=rule)
    assert torch.equal(got, probs) and float(got[0, 2]) > 0
    if rule == "pytorch":  # plain's torch filter at top_k all / top_p 1 would drop the last token
        keep = ds._keep_pytorch(sorted_p, torch.tensor([TOP_K_ALL]), one, torch.zeros(1))
        assert keep.tolist() == [[True, True, False]]


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


def _walk_case(seed: int, bs: int, depth: int = 4, vocab: int = 13, budget: int = 9):
    """A random tree of `budget` nodes per request, the target's logits at its nodes and its candidates."""
    g = torch.Generator().manual_seed(seed)
    tree = du.build_ddtree(torch.randn(bs, depth, vocab, generator=g), budget)
    logits = torch.randn(bs, budget + 1, vocab, generator=g) * 2
    return tree, logits, tree.full_token_ids(torch.arange(bs))


def test_chunked_sampled_rows_walk_exactly_as_one_chunk() -> None:
    """Bounding the distributions' memory (max_elements) changes nothing but the peak: same coins,
    same paths, same bonus tokens."""
    bs = 7
    tree, logits, candidates = _walk_case(11, bs)
    _, n, vocab = logits.shape
    kw = dict(sampled_rows=[0, 2, 3, 5, 6], temperatures=torch.full((bs,), 0.9), top_ks=torch.full((bs,), 5),
              top_ps=torch.full((bs,), 0.9), min_ps=None)
    one = ds.tree_walk(tree, candidates, logits, generator=torch.Generator().manual_seed(5), **kw)
    for limit in (1, n * vocab, 2 * n * vocab + 1):
        chunked = ds.tree_walk(tree, candidates, logits, generator=torch.Generator().manual_seed(5),
                               max_elements=limit, **kw)
        for a, b in zip(one, chunked, strict=True):
            assert torch.equal(a, b), limit


@pytest.mark.parametrize("identity", [True, False])
def test_a_walk_makes_no_distribution_for_identity_rows_and_checks_filters_once(monkeypatch, identity: bool) -> None:
    """At T > 0 the walk's time was its launches and host syncs (the H100 profile of payload 0.8.16: the walk
    phase's GPU time grew by as much as the verify's forward at batch 64). Rows at the identity settings
    (temperature only) make no distribution per node and sort nothing, however many chunks the memory bound
    would cut; with the host's word for which rows those are (`unfiltered`), not even the one device check.
    Filtered rows still make and sort theirs, a chunk at a time, with the row indices copied once."""
    bs = 9
    tree, logits, candidates = _walk_case(3, bs)
    _, n, vocab = logits.shape
    rows = [0, 1, 3, 4, 6, 7, 8]
    kw = dict(sampled_rows=rows, temperatures=torch.full((bs,), 0.8),
              top_ks=torch.full((bs,), TOP_K_ALL if identity else 5), top_ps=torch.full((bs,), 1.0), min_ps=None)
    one = ds.tree_walk(tree, candidates, logits, generator=torch.Generator().manual_seed(5), **kw)
    calls = {"nonzero": 0, "tensor": 0, "sorted": 0, "tolist": 0, "target_probs": 0}
    real = {"nonzero": torch.Tensor.nonzero, "tensor": torch.tensor, "sorted": ds._sorted_desc,
            "tolist": torch.Tensor.tolist, "target_probs": ds.target_probs}

    def counted(name):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)
        return wrapper

    for owner, name in ((torch.Tensor, "nonzero"), (torch, "tensor"), (ds, "_sorted_desc"), (torch.Tensor, "tolist"),
                        (ds, "target_probs")):
        monkeypatch.setattr(owner, name, counted(name.strip("_").replace("desc", "").strip("_") if name == "_sorted_desc"
                                                 else name))
    chunked = ds.tree_walk(tree, candidates, logits, generator=torch.Generator().manual_seed(5),
                           max_elements=2 * n * vocab, **kw)  # 4 chunks
    four = dict(calls)
    calls.update(dict.fromkeys(calls, 0))
    hinted = ds.tree_walk(tree, candidates, logits, generator=torch.Generator().manual_seed(5),
                          unfiltered=rows if identity else [], **kw)
    monkeypatch.undo()
    for a, b, c in zip(one, chunked, hinted, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    if identity:
        assert four == {"nonzero": 0, "tensor": 1, "sorted": 0, "tolist": 1, "target_probs": 0}, four
        assert calls == {"nonzero": 0, "tensor": 1, "sorted": 0, "tolist": 0, "target_probs": 0}, calls
    else:
        assert four == {"nonzero": 4, "tensor": 1, "sorted": 4, "tolist": 1, "target_probs": 4}, four
        assert calls == {"nonzero": 1, "tensor": 1, "sorted": 1, "tolist": 0, "target_probs": 1}, calls


def test_unfiltered_rows_are_the_sampled_requests_plain_samples_unfiltered() -> None:
    """The host's word for the identity path: top_k all, top_p exactly 1 and no min-p; any filter, or a value the
    host cannot read as exactly the identity, leaves the request on the filtered path (never wrong, only slower)."""
    from types import SimpleNamespace

    def req(top_k: int, top_p: float, min_p: float | None):
        return SimpleNamespace(sampling_params=SimpleNamespace(top_k=top_k, top_p=top_p, min_p=min_p))

    reqs = [req(TOP_K_ALL, 1.0, 0.0), req(20, 1.0, 0.0), req(TOP_K_ALL, 0.95, 0.0), req(TOP_K_ALL, 1.0, 0.05),
            req(TOP_K_ALL, 0.99999999, 0.0), req(TOP_K_ALL, 1.0, None), req(1, 1.0, 0.0)]
    assert ds.unfiltered_rows(reqs, [0, 1, 2, 3, 4, 5]) == [0, 5]
    assert ds.unfiltered_rows(reqs, [1, 2]) == []
    # the rows asked about only: a greedy request (top_k 1) is never a sampled row
    assert ds.unfiltered_rows(reqs, [5, 0]) == [5, 0]


def _walk_by_distributions(tree, candidates, logits, sampled, params, seed):
    """0.8.17's walk, the oracle of the identity rows' path: every sampled row's distribution at every node
    (target_probs), walked by sample_tree_walk with tree_walk's coins; greedy rows on the argmax."""
    bs, n, vocab = logits.shape
    accepted, lengths, bonus = du.follow_verified_tree(tree, logits.argmax(-1))
    g = torch.Generator().manual_seed(seed)
    coins, final = torch.rand((len(sampled), n), generator=g), torch.rand((len(sampled),), generator=g)
    idx = torch.tensor(sampled)
    temps, ks, ps, mps = (t[idx].repeat_interleave(n) for t in params)
    probs = ds.target_probs(logits[idx].reshape(-1, vocab), temps, ks, ps, mps).view(len(sampled), n, vocab)
    got = ds.sample_tree_walk(ds._tree_rows(tree, idx), candidates[idx], probs, coins, final)
    return tuple(t.index_copy(0, idx, s) for t, s in zip((accepted, lengths, bonus), got, strict=True))


def test_identity_rows_walk_as_the_distributions_would() -> None:
    """The identity rows' path (log-sum-exp per node, the children's probabilities, one distribution for the
    bonus) takes the same paths and bonus tokens as walking every node's distribution with the same coins, in
    batches that mix greedy, identity and filtered rows, at one chunk and at many."""
    rng = random.Random(4)
    checked = 0
    for case in range(60):
        bs, vocab, budget = rng.choice([1, 3, 8]), rng.choice([7, 50, 300]), rng.choice([3, 9, 30])
        tree, logits, _ = _walk_case(case, bs, depth=rng.choice([2, 4, 6]), vocab=vocab, budget=budget)
        candidates = tree.full_token_ids(torch.arange(bs) % vocab)
        n = logits.shape[1]
        kinds = [rng.choice(["greedy", "identity", "identity", "filtered"]) for _ in range(bs)]
        sampled = [i for i, kind in enumerate(kinds) if kind != "greedy"]
        if not sampled:
            continue
        temps = torch.tensor([rng.choice([0.3, 0.8, 1.0, 1.7]) for _ in range(bs)])
        ks = torch.tensor([TOP_K_ALL if kind != "filtered" else rng.choice([2, 5]) for kind in kinds])
        ps = torch.tensor([1.0 if kind != "filtered" else rng.choice([1.0, 0.9]) for kind in kinds])
        mps = torch.zeros(bs)
        want = _walk_by_distributions(tree, candidates, logits, sampled, (temps, ks, ps, mps), case)
        for limit in (1 << 24, n * vocab + 1):
            # SGLang's temperatures are [bs, 1]
            got = ds.tree_walk(tree, candidates, logits, sampled_rows=sampled,
                               temperatures=temps.view(-1, 1) if case % 2 else temps, top_ks=ks,
                               top_ps=ps, min_ps=mps, generator=torch.Generator().manual_seed(case),
                               max_elements=limit)
            for a, b in zip(want, got, strict=True):
                assert torch.equal(a, b), (case, limit, kinds)
        checked += 1
    assert checked > 40


@pytest.mark.parametrize("seed", range(4))
def test_identity_rows_sample_exactly_the_target(seed: int) -> None:
    """The identity rows' path by its law: 30 000 walks of one tree (tree_walk, temperature only) emit
    (first, second) token pairs by plain sampling's exact law at that temperature; a walk whose coins lean
    towards the drafted children (coin_scale 0.6) is rejected by the same test."""
    tree, probs, candidates = _random_case(seed)
    temperature = [0.5, 0.8, 1.0, 1.6][seed]
    logits = torch.log(probs) * temperature  # softmax(logits / T) is probs
    bs = 30_000
    big = _repeat_tree(tree, bs)
    kw = dict(sampled_rows=list(range(bs)), temperatures=torch.full((bs,), temperature),
              top_ks=torch.full((bs,), TOP_K_ALL), top_ps=torch.ones(bs), unfiltered=list(range(bs)))
    for scale, should_reject in ((1.0, False), (0.6, True)):
        nodes, lengths, bonus = ds.tree_walk(big, candidates.expand(bs, -1), logits.expand(bs, -1, -1),
                                             generator=torch.Generator().manual_seed(seed), coin_scale=scale, **kw)
        samples = []
        for i in range(bs):
            length = int(lengths[i])
            emitted = [int(candidates[0, int(nodes[i, j])]) for j in range(1, length + 1)] + [int(bonus[i])]
            samples.append((emitted[0], emitted[1] if len(emitted) > 1 else -1))
        assert chi_square_rejects(samples, exact_law(tree, probs)) == should_reject, (seed, scale)


# ---------------------------------------------------------------------------------- the leftover case
LEFTOVER_LOGITS = [3.076284170150757, 2.934630870819092, 3.190234422683716, -3.0557808876037598,
                   2.031259298324585, -0.40391242504119873, -2.572941541671753, 1.6462199687957764]
LAST_COIN = 1.0 - 2.0**-24  # the largest float32 below 1: torch.rand's largest coin


def _leftover_probs() -> torch.Tensor:
    """The top-3 target distribution of LEFTOVER_LOGITS in float32, built here (math.exp, then float32)
    rather than by the sampler's softmax, whose last ulp depends on the CPU's vector unit: on one machine
    its three probabilities summed to 1.0 in float32 and the premise below failed. The last child's
    probability is lowered by ulps until the children's float32 sum, in their order (2, 0, 1), is below
    LAST_COIN; a few ulps change no law the tests check."""
    support = [2, 0, 1]
    weights = [math.exp(LEFTOVER_LOGITS[t]) for t in support]
    q = torch.zeros(len(LEFTOVER_LOGITS))
    for t, w in zip(support, weights, strict=True):
        q[t] = w / sum(weights)
    while float(q[2] + q[0] + q[1]) >= LAST_COIN:
        q[1] = torch.nextafter(q[1], torch.zeros(()))
    return q


def _leftover_case(bs: int = 1):
    """A root whose three children are exactly the support of its top-k 3 distribution, and whose
    three probabilities sum to less than LAST_COIN in float32 in the children's order."""
    vocab = len(LEFTOVER_LOGITS)
    q = _leftover_probs()
    draft = torch.full((bs, 1, vocab), -9.0)
    draft[:, 0, [2, 0, 1]] = torch.tensor([3.0, 2.0, 1.0])  # the support, most probable first, as children
    tree = du.build_ddtree(draft, 3)
    cand = tree.full_token_ids(torch.full((bs,), 7))
    probs = torch.zeros(bs, 4, vocab)
    probs[:, :] = q  # every node: the same distribution (only the root's matters here)
    acc = torch.zeros((), dtype=torch.float32)
    for node in range(1, 4):
        acc = acc + q[int(cand[0, node])]
    assert float(acc) < LAST_COIN, "premise: the children's float32 sum is below the largest coin"
    assert sorted(int(t) for t in cand[0, 1:]) == sorted(int(t) for t in torch.nonzero(q).view(-1))
    return tree, cand, probs, q


def test_a_coin_above_the_childrens_rounded_mass_emits_the_last_child_not_vocab_minus_1() -> None:
    from ddtree_oracle import tree_sampling_reference

    tree, cand, probs, q = _leftover_case()
    coins, final = torch.full((1, 4), LAST_COIN), torch.tensor([0.5])
    # the kernel's own rule draws from an empty residual: vocab - 1, a token with no mass at all
    predicts = torch.empty(4, dtype=torch.int32)
    index, num = torch.full((1, tree.max_depth + 1), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    tree_sampling_reference(predicts=predicts, accept_index=index, accept_token_num=num, candidates=cand,
                            retrive_index=torch.arange(4).view(1, 4), retrive_next_token=tree.retrive_next_token,
                            retrive_next_sibling=tree.retrive_next_sibling, uniform_samples=coins,
                            uniform_samples_for_final_sampling=final, target_probs=probs,
                            draft_probs=torch.zeros_like(probs))
    assert int(num[0]) == 0 and int(predicts[0]) == len(LEFTOVER_LOGITS) - 1 and float(q[-1]) == 0.0
    last_child = int(cand[0, 3])
    nodes, lengths, bonus = ds._kernel_walk(tree_sampling_reference, tree, cand, probs, coins, final)
    assert int(lengths[0]) == 0 and int(bonus[0]) == last_child
    # the torch walk sums in float64 on CPU: it may reach the last child instead; the same token either way
    nodes, lengths, bonus = ds.sample_tree_walk(tree, cand, probs, coins, final)
    first = int(cand[0, int(nodes[0, 1])]) if int(lengths[0]) else int(bonus[0])
    assert first == last_child


def test_the_walk_samples_the_target_on_nodes_whose_children_cover_it() -> None:
    """The law where the leftover case lives: the root's children hold its whole distribution; the
    first emitted token must follow the target (chi-square), never a token outside its support. (The
    sliver above the children's float32 mass has probability ~1e-7: its coins belong to the last
    child's share, which the test above pins.)"""
    tree, cand, probs, q = _leftover_case(bs=40_000)
    g = torch.Generator().manual_seed(4)
    nodes, lengths, bonus = ds.sample_tree_walk(tree, cand, probs, torch.rand((40_000, 4), generator=g),
                                                torch.rand((40_000,), generator=g))
    first = torch.where(lengths > 0, cand.gather(1, nodes[:, 1:2].clamp(min=0)).view(-1), bonus)
    assert bool((q[first] > 0).all())
    law = {(int(t), -1): float(q[t]) for t in torch.nonzero(q).view(-1)}
    assert not chi_square_rejects([(int(t), -1) for t in first], law)
    skewed = {k: v * (1.1 if k[0] == int(cand[0, 3]) else 1.0) for k, v in law.items()}
    total = sum(skewed.values())
    assert chi_square_rejects([(int(t), -1) for t in first], {k: v / total for k, v in skewed.items()})

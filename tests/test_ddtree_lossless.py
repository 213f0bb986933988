"""DDTree end to end on a tiny float64 causal LM: lossless greedy and sampled decoding.

The target is ``TinyLM`` (RoPE, a few layers); the verify pass is one forward over the committed prefix
(causal) plus the tree's slots (ancestor mask, positions = prefix length + depth).
"""

from __future__ import annotations

import math

import pytest
import torch
from ddtree_oracle import (
    TinyLM,
    ddtree_decode,
    dflash_linear_rule,
    greedy_ar,
    load_ddtree_utils,
    make_drafter,
    sample_ar,
    tree_forward,
)

du = load_ddtree_utils()

DRAFTERS = ["random", "noisy_oracle", "always_wrong", "sparse", "exact"]


def prompt_for(seed: int, vocab: int, length: int = 5) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


@pytest.mark.parametrize("kind", DRAFTERS)
def test_greedy_ddtree_equals_greedy_ar(kind: str) -> None:
    checked = 0
    for seed in range(3):
        model = TinyLM(seed=seed)
        prompt = prompt_for(seed, model.vocab)
        expected = greedy_ar(model, prompt, 16)
        for depth, budget, cap in [
            (3, 1, None),
            (4, 4, 1),
            (4, 9, 1),
            (4, 8, 2),
            (5, 16, None),
            (3, 40, 4),
            (6, 24, None),
        ]:
            drafter = make_drafter(kind, seed, depth)
            got, accepts = ddtree_decode(model, prompt, 16, drafter, budget, cap)
            assert got == expected, (kind, seed, depth, budget, cap)
            assert all(0 <= a <= min(depth, budget) for a in accepts)
            if kind == "exact":  # the argmax chain is all right; cap 1 keeps exactly that chain
                assert accepts[0] == min(depth, budget) if cap == 1 else accepts[0] >= 1
            checked += 1
    assert checked == 21


def test_tree_logits_equal_causal_logits_of_prefix_plus_path() -> None:
    model = TinyLM(seed=5)
    seq = prompt_for(5, model.vocab, 7)
    for kind, budget, cap in [("random", 20, None), ("noisy_oracle", 31, 3), ("sparse", 16, None)]:
        draft = make_drafter(kind, 1, 4)(model, seq)
        tree = du.build_ddtree(draft[None].float(), budget, cap)
        tree_logits = tree_forward(model, [seq], tree)[0]
        for i in range(int(tree.num_nodes[0])):
            path, j = [], i
            while j > 0:
                path.append(int(tree.token_ids[0, j - 1]))
                j = int(tree.parents[0, j])
            causal = model.causal_logits(seq + path[::-1])[-1]
            torch.testing.assert_close(tree_logits[i], causal, rtol=1e-10, atol=1e-10)


def test_a_wrong_mask_is_caught() -> None:
    """Negative control: letting nodes see their siblings breaks both checks above."""
    model = TinyLM(seed=2)
    prompt = prompt_for(2, model.vocab)
    expected = greedy_ar(model, prompt, 16)
    drafter = make_drafter("noisy_oracle", 2, 4)
    got, _ = ddtree_decode(model, prompt, 16, drafter, 24, None, corrupt_mask=True)
    assert got != expected


def test_cap_one_is_linear_dflash() -> None:
    """Cap 1 and budget >= depth: the tree is DFlash's argmax chain and the walk is DFlash's rule."""
    steps = 0
    for seed in range(4):
        model = TinyLM(seed=10 + seed)
        prompt = prompt_for(seed, model.vocab)
        depth = 5
        drafter = make_drafter("noisy_oracle", seed, depth, noise=1.0)

        def on_step(seq, tree, logits, target, accept_len, bonus, draft_logits, depth=depth, model=model):
            nonlocal steps
            chain = draft_logits.argmax(-1)
            assert int(tree.num_nodes[0]) == depth + 1
            assert tree.token_ids[0, :depth].tolist() == chain.tolist()
            assert tree.parents[0].tolist() == list(range(-1, depth)) + [-1] * 3
            candidates = torch.cat([torch.tensor([seq[-1]]), chain])[None]
            # the chain's tree forward is a causal forward: target_predict at every block position
            causal = model.causal_logits(seq + chain.tolist())[len(seq) - 1 :].argmax(-1)[None]
            assert torch.equal(target[:, : depth + 1], causal)
            correct_len, dflash_bonus = dflash_linear_rule(candidates, causal)
            assert accept_len == int(correct_len[0]) and bonus == int(dflash_bonus[0])
            steps += 1

        got, _ = ddtree_decode(model, prompt, 20, drafter, depth + 3, 1, on_step=on_step)
        assert got == greedy_ar(model, prompt, 20)
    assert steps >= 8


def test_sampling_with_shared_stream_equals_ar_sampling() -> None:
    for seed in range(3):
        model = TinyLM(seed=20 + seed, logit_scale=1.5)
        prompt = prompt_for(seed, model.vocab)
        g = torch.Generator().manual_seed(seed)
        gumbel = -torch.log(-torch.log(torch.rand(64, model.vocab, generator=g, dtype=torch.float64)))
        for temperature in (0.7, 1.6):
            expected = sample_ar(model, prompt, 16, gumbel, temperature)
            for kind, budget, cap in [("noisy_oracle", 16, None), ("random", 8, 2), ("exact", 4, 1)]:
                drafter = make_drafter(kind, seed, 4)
                got, _ = ddtree_decode(
                    model, prompt, 16, drafter, budget, cap, temperature=temperature, gumbel=gumbel
                )
                assert got == expected, (seed, temperature, kind)


def chi2_critical(dof: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.719: p = 1e-4)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def first_two_tokens(model, prompt, temperature, trials, seed, draft_from_target=True):
    """Sample the first two generated tokens in ``trials`` independent DDTree runs (batched).

    Every node samples its own token (independent Gumbel noise per node), so the draws are fresh.
    ``draft_from_target=False`` is a broken sampler (the first token comes from the draft instead).
    """
    g = torch.Generator().manual_seed(seed)
    depth, budget = 3, 12
    base = make_drafter("noisy_oracle", seed, depth, noise=0.0)(model, prompt)
    drafts = base[None] + 1.5 * torch.randn(trials, depth, model.vocab, generator=g, dtype=torch.float64)
    tree = du.build_ddtree(drafts.float(), budget, None)
    logits = tree_forward(model, [prompt] * trials, tree)
    noise = -torch.log(-torch.log(torch.rand(logits.shape, generator=g, dtype=torch.float64)))
    target = (logits / temperature + noise).argmax(-1)
    if not draft_from_target:
        target[:, 0] = drafts[:, 0].argmax(-1)
    accepted, lens, bonus = du.follow_verified_tree(tree, target)
    pairs = []
    for t in range(trials):
        emitted = [int(tree.token_ids[t, i - 1]) for i in accepted[t, 1 : 1 + int(lens[t])].tolist()]
        emitted.append(int(bonus[t]))
        if len(emitted) < 2:  # the next step's root sample gives the second token
            logits2 = model.causal_logits(prompt + emitted)[-1]
            gumbel = -torch.log(-torch.log(torch.rand(model.vocab, generator=g, dtype=torch.float64)))
            emitted.append(int((logits2 / temperature + gumbel).argmax()))
        pairs.append((emitted[0], emitted[1]))
    return pairs


def exact_pair_distribution(model, prompt, temperature) -> dict[tuple[int, int], float]:
    p1 = torch.softmax(model.causal_logits(prompt)[-1] / temperature, -1)
    out = {}
    for a in range(model.vocab):
        p2 = torch.softmax(model.causal_logits(prompt + [a])[-1] / temperature, -1)
        for b in range(model.vocab):
            out[(a, b)] = float(p1[a] * p2[b])
    return out


def chi2_statistic(pairs, expected_p) -> tuple[float, int]:
    trials = len(pairs)
    counts: dict[tuple[int, int], int] = {}
    for p in pairs:
        counts[p] = counts.get(p, 0) + 1
    stat, cells, rest_o, rest_e = 0.0, 0, 0, 0.0
    for cell, p in expected_p.items():
        e = p * trials
        if e >= 5:
            stat += (counts.get(cell, 0) - e) ** 2 / e
            cells += 1
        else:  # pool the rare cells so the chi-square approximation holds
            rest_o += counts.get(cell, 0)
            rest_e += e
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        cells += 1
    return stat, cells - 1


def test_sampled_first_tokens_follow_the_target_distribution() -> None:
    model = TinyLM(vocab=6, dim=16, layers=2, heads=2, seed=3, logit_scale=1.5)
    prompt = [1, 4, 2]
    temperature = 1.0
    expected = exact_pair_distribution(model, prompt, temperature)
    pairs = first_two_tokens(model, prompt, temperature, trials=4000, seed=0)
    stat, dof = chi2_statistic(pairs, expected)
    assert stat < chi2_critical(dof), (stat, dof)
    # power check: a sampler that takes the first token from the draft is rejected
    biased = first_two_tokens(model, prompt, temperature, trials=4000, seed=0, draft_from_target=False)
    bad_stat, bad_dof = chi2_statistic(biased, expected)
    assert bad_stat > chi2_critical(bad_dof), (bad_stat, bad_dof)


def test_accept_length_grows_with_budget() -> None:
    depth = 6
    per_budget: dict[str, list[int]] = {}
    settings = {"cap1": (depth, 1), "b4": (4, None), "b16": (16, None), "b64": (64, None)}
    for seed in range(6):
        model = TinyLM(seed=30 + seed)
        prompt = prompt_for(seed, model.vocab, 6)
        drafter = make_drafter("noisy_oracle", seed, depth, noise=2.0)
        seq = list(prompt) + greedy_ar(model, prompt, 12)
        for cut in range(len(prompt), len(seq)):  # the same states for every budget
            state = seq[:cut]
            draft = drafter(model, state)
            lengths = []
            for name, (budget, cap) in settings.items():
                tree = du.build_ddtree(draft[None].float(), budget, cap)
                target = tree_forward(model, [state], tree).argmax(-1)
                length = int(du.follow_verified_tree(tree, target)[1][0])
                per_budget.setdefault(name, []).append(length)
                lengths.append(length)
            # budget 4 ⊂ 16 ⊂ 64 as node sets, so per state the accept length cannot shrink
            assert lengths[1] <= lengths[2] <= lengths[3]
    means = {k: sum(v) / len(v) for k, v in per_budget.items()}
    assert means["b4"] <= means["b16"] <= means["b64"]
    assert means["b64"] > means["cap1"] + 0.3, means


def test_keep_chain_is_lossless_and_never_accepts_less_than_linear_dflash() -> None:
    """Keep-chain trees on the tiny LM: greedy outputs equal AR, and at every step the walk accepts at
    least DFLASH's rule on the draft's argmax chain (the target's own greedy continuation decides).
    The standard tree of the same budget, on the same states, sometimes accepts less."""
    depth, steps, standard_worse = 6, 0, 0
    for seed in range(3):
        model = TinyLM(seed=50 + seed)
        prompt = prompt_for(seed, model.vocab)
        for budget, cap in [(depth, None), (depth + 2, 2), (12, 1)]:
            drafter = make_drafter("noisy_oracle", seed, depth, noise=1.0)

            def on_step(
                seq,
                tree,
                logits,
                target,
                accept_len,
                bonus,
                draft_logits,
                model=model,
                budget=budget,
                cap=cap,
            ):
                nonlocal steps, standard_worse
                chain = draft_logits.argmax(-1)
                candidates = torch.cat([torch.tensor([seq[-1]]), chain])[None]
                causal = model.causal_logits(seq + chain.tolist())[len(seq) - 1 :].argmax(-1)[None]
                linear = int(dflash_linear_rule(candidates, causal)[0][0])
                assert accept_len >= linear, (accept_len, linear)
                standard = du.build_ddtree(draft_logits[None].float(), budget, cap)
                target_std = tree_forward(model, [seq], standard).argmax(-1)
                standard_worse += int(du.follow_verified_tree(standard, target_std)[1][0]) < linear
                steps += 1

            got, _ = ddtree_decode(model, prompt, 16, drafter, budget, cap, on_step=on_step, keep_chain=True)
            assert got == greedy_ar(model, prompt, 16), (seed, budget, cap)
    assert steps >= 25 and standard_worse > 0, (steps, standard_worse)

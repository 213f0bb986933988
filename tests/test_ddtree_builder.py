"""DDTree builder: equality with the best-first heap oracle, structure, optimality, edge cases."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest
import torch
from ddtree_oracle import (
    f32,
    heap_oracle,
    heap_oracle_lazy,
    keep_chain_oracle,
    load_ddtree_utils,
    oracle_logprobs,
    ranked_candidates,
    tree_tensor_fields,
)

du = load_ddtree_utils()

BUDGETS = [0, 1, 2, 7, 16, 63, 255]
CAPS = [1, 2, 4, None]
DEPTHS = [1, 3, 15]
BATCHES = [1, 5]


def random_logits(rng: random.Random, batch: int, depth: int, vocab: int) -> torch.Tensor:
    """Random logits of one of several kinds; every row keeps at least one finite value."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    kind = rng.choice(["gauss", "repeated", "repeated_inf", "gauss_inf", "peaked", "flat"])
    if kind in ("gauss", "gauss_inf"):
        x = torch.randn(batch, depth, vocab, generator=g) * rng.choice([0.5, 2.0, 8.0])
    elif kind == "peaked":
        x = torch.randn(batch, depth, vocab, generator=g) * 30.0
    elif kind == "flat":
        x = torch.zeros(batch, depth, vocab)  # every path ties: tie order decides everything
    else:  # few distinct values: many exact ties among tokens and among path sums
        x = torch.randint(0, 3, (batch, depth, vocab), generator=g).float() * rng.choice([0.5, 1.0])
    if kind.endswith("_inf"):
        drop = torch.rand(batch, depth, vocab, generator=g) < rng.choice([0.3, 0.8, 0.97])
        x = x.masked_fill(drop, float("-inf"))
        keep = torch.randint(0, vocab, (batch, depth, 1), generator=g)
        x.scatter_(2, keep, torch.randn(batch, depth, 1, generator=g))
    if rng.random() < 0.3:
        x = x.to(rng.choice([torch.bfloat16, torch.float16, torch.float64]))
    return x


def assert_row_equals_oracle(tree, b: int, ref, ctx: str) -> int:
    """Request b of the built tree is the oracle's node list, then padding; returns its node count."""
    m = len(ref.parents)
    assert int(tree.num_nodes[b]) == m, ctx
    assert tree.token_ids[b, : m - 1].tolist() == ref.tokens, ctx
    assert tree.parents[b, :m].tolist() == ref.parents, ctx
    assert tree.depths[b, :m].tolist() == ref.depths, ctx
    assert tree.token_ranks[b, :m].tolist() == ref.ranks, ctx
    assert tree.scores[b, :m].tolist() == ref.scores, ctx
    # padding
    assert (tree.token_ids[b, m - 1 :] == du.PAD_TOKEN_ID).all(), ctx
    assert (tree.parents[b, m:] == -1).all() and (tree.depths[b, m:] == 0).all(), ctx
    return m


def assert_matches_oracle(logits: torch.Tensor, budget: int, cap: int | None) -> None:
    tree = du.build_ddtree(logits, budget, cap)
    n = budget + 1
    assert tree.token_ids.shape == (logits.shape[0], budget)
    assert tree.parents.shape == tree.depths.shape == tree.tree_mask.shape[:2] == (logits.shape[0], n)
    for b in range(logits.shape[0]):
        ctx = f"b={b} budget={budget} cap={cap} shape={tuple(logits.shape)}"
        assert_row_equals_oracle(tree, b, heap_oracle(logits[b], budget, cap), ctx)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("cap", CAPS)
def test_builder_equals_heap_oracle(budget: int, cap: int | None) -> None:
    rng = random.Random(1000 * budget + (cap or 0))
    cases = 0
    for depth, batch in itertools.product(DEPTHS, BATCHES):
        for _ in range(12 if budget < 255 else 6):
            big_vocab_ok = budget <= 63 or cap is not None
            vocab = rng.choice([2, 3, 5, 12, 40] + ([300] if big_vocab_ok else []))
            assert_matches_oracle(random_logits(rng, batch, depth, vocab), budget, cap)
            cases += 1
    assert cases >= 36


def test_lazy_heap_equals_full_heap() -> None:
    """The benchmark's baseline (lazy sibling/child heap) pops in the oracle's order."""
    rng = random.Random(5)
    for _ in range(200):
        budget, cap = rng.choice(BUDGETS), rng.choice(CAPS)
        logits = random_logits(rng, 1, rng.choice(DEPTHS), rng.choice([2, 5, 12, 40]))
        full = heap_oracle(logits[0], budget, cap)
        k = min(budget if cap is None else cap, budget, logits.shape[-1]) if budget else 1
        topv, topi = du.topk_logprobs(logits, k)
        lazy = heap_oracle_lazy(topv[0].tolist(), topi[0].tolist(), budget)
        assert (lazy.tokens, lazy.parents, lazy.scores, lazy.ranks) == (
            full.tokens,
            full.parents,
            full.scores,
            full.ranks,
        )


def check_structure(tree, logits: torch.Tensor, cap: int | None) -> None:
    batch, depth, vocab = logits.shape
    budget = tree.budget
    k = min(budget if cap is None else cap, budget, vocab) if budget else 0
    n = budget + 1
    topv, topi = du.topk_logprobs(logits, max(k, 1))
    for b in range(batch):
        m = int(tree.num_nodes[b])
        parents = tree.parents[b].tolist()
        depths = tree.depths[b].tolist()
        children: dict[int, list[int]] = {i: [] for i in range(n)}
        for i in range(1, m):
            p = parents[i]
            assert 0 <= p < i, "parents precede children (prefix-closed, topological order)"
            assert depths[i] == depths[p] + 1 <= depth
            rank = int(tree.token_ranks[b, i])
            assert 0 <= rank < k, "rank < cap"
            assert int(tree.token_ids[b, i - 1]) == int(topi[b, depths[i] - 1, rank])
            children[p].append(i)
        for i in range(n):
            sibling_tokens = [int(tree.token_ids[b, c - 1]) for c in children[i]]
            assert len(set(sibling_tokens)) == len(sibling_tokens), "siblings carry distinct tokens"
        # scores: monotone along paths, sorted best-first
        scores = tree.scores[b, :m].tolist()
        assert all(scores[i] <= scores[parents[i]] for i in range(1, m))
        assert all(scores[i] >= scores[i + 1] for i in range(1, m - 1))
        # mask = ancestor sets (self included); padding rows see only themselves
        for i in range(n):
            expect = set()
            if i < m:
                j = i
                while j >= 0:
                    expect.add(j)
                    j = parents[j]
            else:
                expect = {i}
            got = set(torch.nonzero(tree.tree_mask[b, i]).view(-1).tolist())
            assert got == expect, (b, i)
        # retrive_* round-trip to the children lists
        assert tree.retrive_index[b].tolist() == [b * n + i for i in range(n)]
        for i in range(n):
            walk = []
            c = int(tree.retrive_next_token[b, i])
            while c != -1 and len(walk) <= n:  # bounded: a corrupted list may cycle
                walk.append(c)
                c = int(tree.retrive_next_sibling[b, c])
            assert walk == children[i], (b, i, walk, children[i])
        linked = {c for cs in children.values() for c in cs}
        for i in range(m, n):
            assert i not in linked and int(tree.retrive_next_sibling[b, i]) == -1
        pos = tree.positions(torch.full((batch,), 7))
        assert pos[b].tolist() == [7 + d for d in depths]


def test_structural_properties() -> None:
    rng = random.Random(7)
    for _ in range(150):
        budget = rng.choice(BUDGETS[1:-1])
        cap = rng.choice(CAPS)
        logits = random_logits(rng, rng.choice(BATCHES), rng.choice(DEPTHS), rng.choice([2, 5, 12, 40]))
        check_structure(du.build_ddtree(logits, budget, cap), logits, cap)


def test_structure_checker_catches_a_broken_tree() -> None:
    logits = torch.randn(1, 3, 12)
    tree = du.build_ddtree(logits, 7, None)
    check_structure(tree, logits, None)
    tree.retrive_next_sibling[0, 1], tree.retrive_next_sibling[0, 2] = 2, 1  # a cycle among siblings
    with pytest.raises(AssertionError):
        check_structure(tree, logits, None)


# retrive_index is b * n + i: the one field that names its row
ROW_FIELDS = [name for name in tree_tensor_fields() if name != "retrive_index"]


def assert_rows_independent(logits: torch.Tensor, budget: int, cap: int, *, keep_chain: bool = False) -> None:
    """Each row of a batched build equals that row built alone."""
    whole = du.build_ddtree(logits, budget, cap, keep_chain=keep_chain)
    for b in range(logits.shape[0]):
        single = du.build_ddtree(logits[b : b + 1], budget, cap, keep_chain=keep_chain)
        for name in ROW_FIELDS:
            assert torch.equal(getattr(whole, name)[b], getattr(single, name)[0]), (name, b)


def test_batch_rows_are_independent() -> None:
    rng = random.Random(3)
    logits = random_logits(rng, 5, 15, 40)
    assert_rows_independent(logits, 63, 4)


def brute_force_nodes(logits_row: torch.Tensor, cap: int) -> list[tuple[tuple[int, ...], float]]:
    """Every reachable token path with rank < cap at each position, with its float32 score."""
    depth = logits_row.shape[0]
    lp, ranked = ranked_candidates(logits_row, cap, cap)
    nodes = []
    for d in range(1, depth + 1):
        for path in itertools.product(*ranked[:d]):
            s = 0.0
            for pos, tok in enumerate(path):
                s = f32(s + lp[pos][tok])
            if s > float("-inf"):
                nodes.append((path, s))
    return nodes


@pytest.mark.parametrize("vocab,depth", [(2, 1), (2, 3), (3, 2), (3, 3), (4, 2)])
def test_brute_force_optimality(vocab: int, depth: int) -> None:
    rng = random.Random(vocab * 10 + depth)
    for _ in range(25):
        logits = random_logits(rng, 1, depth, vocab)
        for cap in (1, 2, None):
            for budget in range(0, 12):
                tree = du.build_ddtree(logits, budget, cap)
                k = min(budget if cap is None else cap, budget, vocab) if budget else 1
                nodes = brute_force_nodes(logits[0], k)
                best = sorted((s for _, s in nodes), reverse=True)[:budget]
                m = int(tree.num_nodes[0])
                got = sorted(tree.scores[0, 1:m].tolist(), reverse=True)
                assert got == best, (budget, cap)
                # the selected paths are real paths with those scores
                by_path = dict(nodes)
                for i in range(1, m):
                    path, j = [], i
                    while j > 0:
                        path.append(int(tree.token_ids[0, j - 1]))
                        j = int(tree.parents[0, j])
                    assert by_path[tuple(reversed(path))] == float(tree.scores[0, i])


def test_best_prefix_closed_subset_maximises_expected_acceptance() -> None:
    """Over all prefix-closed subsets of a tiny tree, ours maximises the sum of path probabilities."""
    rng = random.Random(11)
    for _ in range(20):
        logits = random_logits(rng, 1, 2, 3)
        nodes = brute_force_nodes(logits[0], 3)
        paths = [p for p, _ in nodes]
        prob = {p: math.exp(s) for p, s in nodes}
        for budget in range(1, len(paths) + 1):
            best = max(
                sum(prob[p] for p in subset)
                for subset in itertools.combinations(paths, budget)
                if all(len(p) == 1 or p[:-1] in subset for p in subset)
            )
            tree = du.build_ddtree(logits, budget, None)
            m = int(tree.num_nodes[0])
            ours = sum(math.exp(s) for s in tree.scores[0, 1:m].tolist())
            assert ours == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_edge_cases() -> None:
    logits = torch.randn(2, 4, 10)
    t0 = du.build_ddtree(logits, 0)
    assert t0.token_ids.shape == (2, 0) and t0.num_nodes.tolist() == [1, 1]
    assert t0.tree_mask.shape == (2, 1, 1) and t0.tree_mask.all()
    assert t0.retrive_next_token.tolist() == [[-1], [-1]]
    # fewer reachable nodes than the budget: one finite token per position -> a chain of 4
    sparse = torch.full((1, 4, 10), float("-inf"))
    sparse[0, torch.arange(4), torch.tensor([3, 1, 4, 1])] = 0.5
    t = du.build_ddtree(sparse, 16)
    assert int(t.num_nodes[0]) == 5 and t.token_ids[0, :4].tolist() == [3, 1, 4, 1]
    assert t.parents[0, :5].tolist() == [-1, 0, 1, 2, 3]
    # tiny vocab: 2 tokens, depth 2 -> at most 6 nodes
    t = du.build_ddtree(torch.zeros(1, 2, 2), 255)
    assert int(t.num_nodes[0]) == 7
    # cap larger than vocab and budget is fine; cap 0 is refused
    du.build_ddtree(logits, 3, 1000)
    with pytest.raises(ValueError):
        du.build_ddtree(logits, 3, 0)
    with pytest.raises(ValueError):
        du.build_ddtree(logits[0], 3)
    # flat logits: ties resolved by (depth, parent order, token id): breadth-first in token order
    t = du.build_ddtree(torch.zeros(1, 2, 3), 5)
    assert t.token_ids[0].tolist() == [0, 1, 2, 0, 1] and t.parents[0].tolist() == [-1, 0, 0, 0, 1, 1]


def test_sort_keys_order_values_then_index() -> None:
    values = torch.tensor([0.0, -0.0, 1.5, float("-inf"), -3.0, 1.5, -1e-30])
    keys = du._sort_keys(values, torch.arange(values.numel()))
    order = torch.argsort(keys, descending=True).tolist()
    assert order == [2, 5, 0, 1, 6, 4, 3]
    v, i = du._decode_keys(keys)
    assert torch.equal(i, torch.arange(values.numel())) and v[2] == 1.5 and v[3] == float("-inf")


# -------------------------------- follow_verified_tree ---------------------------------------------


def handmade_tree():
    # position 1: tokens 5 (best) and 6; positions 2 and 3: only 7 and 8 are finite. Budget 8 holds
    # all 6 reachable nodes (5, 5-7, 5-7-8, 6, 6-7, 6-7-8) and 2 padding slots.
    logits = torch.full((1, 3, 10), float("-inf"))
    logits[0, 0, 5], logits[0, 0, 6] = 0.0, -1.0
    logits[0, 1, 7] = 0.0
    logits[0, 2, 8] = 0.0
    tree = du.build_ddtree(logits, 8)
    assert int(tree.num_nodes[0]) == 7
    assert tree.token_ids[0].tolist() == [5, 7, 8, 6, 7, 8, du.PAD_TOKEN_ID, du.PAD_TOKEN_ID]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 0, 4, 5, -1, -1]
    return tree


def test_follow_verified_tree_paths() -> None:
    tree = handmade_tree()
    pad = 9
    cases = [
        # target token at each slot: root, 5, 5-7, 5-7-8, 6, 6-7, 6-7-8, pad, pad
        ([5, 7, 8, 2, 0, 0, 0, pad, pad], [0, 1, 2, 3], 3, 2),  # full chain, bonus from node 3
        ([5, 7, 3, 0, 0, 0, 0, pad, pad], [0, 1, 2, -1], 2, 3),
        ([6, 1, 1, 1, 7, 8, 4, pad, pad], [0, 4, 5, 6], 3, 4),  # the sibling branch
        ([6, 7, 8, 2, 1, 0, 0, pad, pad], [0, 4, -1, -1], 1, 1),
        ([1, 7, 8, 2, 7, 8, 4, pad, pad], [0, -1, -1, -1], 0, 1),  # nothing matches
    ]
    for target, nodes, length, bonus in cases:
        acc, lens, bon = du.follow_verified_tree(tree, torch.tensor([target]))
        assert acc[0].tolist() == nodes and int(lens[0]) == length and int(bon[0]) == bonus, target


def test_follow_verified_tree_ignores_padding_and_batches() -> None:
    tree = handmade_tree()
    # padding slots carry token PAD_TOKEN_ID (0); a target of 0 at the root must not "accept" them
    both = du.DDTree(
        **{k: (torch.cat([v, v]) if isinstance(v, torch.Tensor) else v) for k, v in vars(tree).items()}
    )
    target = torch.tensor([[0] * 9, [5, 7, 8, 2, 0, 0, 0, 0, 0]])
    acc, lens, bon = du.follow_verified_tree(both, target)
    assert lens.tolist() == [0, 3] and bon.tolist() == [0, 2]


# -------------------------------- is_hybrid_model ----------------------------------------------------

HYBRID = [
    ({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}, "qwen3_next"),
    (
        {"model_type": "qwen3_5_moe", "text_config": {"layer_types": ["linear_attention", "full_attention"]}},
        "qwen3_5",
    ),
    (
        {
            "model_type": "some_vl",
            "text_config": {"model_type": "x", "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
        },
        "3 of 4",
    ),
    ({"model_type": "jamba", "attn_layer_period": 8}, "Jamba"),
    ({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M-M*-"}, "Nemotron-H"),
    ({"model_type": "falcon_h1"}, "Falcon-H1"),
    ({"model_type": "granitemoehybrid", "layer_types": ["mamba", "attention"]}, "Granite"),
    ({"model_type": "kimi_linear"}, "Kimi"),
    ({"model_type": "lfm2", "layer_types": ["conv", "full_attention"]}, "LFM2"),
    ({"architectures": ["MyCustomMambaForCausalLM"]}, "Mamba"),
    ({"model_type": "custom", "layer_types": ["full_attention", "mamba2"]}, "mamba2"),
    ({"model_type": "custom", "mamba_d_state": 128}, "mamba_d_state"),
    ({"model_type": "custom", "linear_num_value_heads": 32}, "linear_num_value_heads"),
]
NOT_HYBRID = [
    {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "sliding_window": 4096},
    {"model_type": "gpt_oss", "layer_types": ["sliding_attention", "full_attention"]},
    {"model_type": "gemma3", "text_config": {"layer_types": ["sliding_attention"] * 5 + ["full_attention"]}},
    {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128},
]


@pytest.mark.parametrize("config,evidence", HYBRID)
def test_is_hybrid_model_detects_hybrids(config: dict, evidence: str) -> None:
    hybrid, reason = du.is_hybrid_model(config)
    assert hybrid, reason
    assert evidence.lower() in reason.lower(), reason


@pytest.mark.parametrize("config", NOT_HYBRID)
def test_is_hybrid_model_passes_attention_models(config: dict) -> None:
    hybrid, reason = du.is_hybrid_model(config)
    assert not hybrid, reason
    assert "attention" in reason


def test_module_imports_only_torch() -> None:
    source = du.__file__
    text = Path(source).read_text()
    imports = {
        line.split()[1].split(".")[0] for line in text.splitlines() if line.startswith(("import ", "from "))
    }
    assert imports <= {"__future__", "os", "sys", "dataclasses", "typing", "torch"}, imports


def sgl_verify_tree_greedy(
    candidates, retrive_index, next_token, next_sibling, target_predict, num_spec_tokens
):
    """Python transcription of sgl_kernel's ``VerifyTreeGreedy`` (csrc/speculative/eagle_utils.cu),
    the walk SGLang runs over ``retrive_*``: ``target_predict`` is flat over the verify batch."""
    bs, n = candidates.shape
    predicts = [-1] * (bs * n)
    accept_index = [[-1] * num_spec_tokens for _ in range(bs)]
    accept_num = [0] * bs
    for bx in range(bs):
        last = int(retrive_index[bx, 0])
        accept_index[bx][0] = last
        num, cur = 0, 0
        for _ in range(1, num_spec_tokens):
            cur = int(next_token[bx, cur])
            while cur != -1:
                draft_index = int(retrive_index[bx, cur])
                if int(candidates[bx, cur]) == int(target_predict[last]):
                    predicts[last] = int(target_predict[last])
                    num += 1
                    accept_index[bx][num] = draft_index
                    last = draft_index
                    break
                cur = int(next_sibling[bx, cur])
            if cur == -1:
                break
        accept_num[bx] = num
        predicts[last] = int(target_predict[last])
    return predicts, accept_index, accept_num


def test_retrive_arrays_drive_sglangs_greedy_verify_walk() -> None:
    """SGLang's own tree walk over our retrive_* arrays accepts what follow_verified_tree accepts."""
    rng = random.Random(17)
    g = torch.Generator().manual_seed(17)
    for _ in range(120):
        batch, depth, vocab = rng.choice(BATCHES), rng.choice(DEPTHS), rng.choice([3, 12, 40])
        budget, cap = rng.choice(BUDGETS[1:]), rng.choice(CAPS)
        logits = random_logits(rng, batch, depth, vocab)
        tree = du.build_ddtree(logits, budget, cap)
        n = budget + 1
        roots = torch.randint(0, vocab, (batch,), generator=g)
        candidates = tree.full_token_ids(roots)
        # targets that often follow a branch: each node's target is one of its children's tokens or noise
        target = torch.randint(0, vocab, (batch, n), generator=g)
        for b in range(batch):
            for i in range(1, int(tree.num_nodes[b])):
                if rng.random() < 0.6:
                    target[b, int(tree.parents[b, i])] = int(tree.token_ids[b, i - 1])
        accepted, lengths, bonus = du.follow_verified_tree(tree, target)
        predicts, accept_index, accept_num = sgl_verify_tree_greedy(
            candidates,
            tree.retrive_index,
            tree.retrive_next_token,
            tree.retrive_next_sibling,
            target.reshape(-1),
            depth + 1,
        )
        assert accept_num == lengths.tolist()
        for b in range(batch):
            length = int(lengths[b])
            flat = tree.retrive_index[b].gather(0, accepted[b, : length + 1]).tolist()
            assert accept_index[b][: length + 1] == flat
            assert predicts[flat[-1]] == int(bonus[b])


def test_selection_is_prefix_closed_even_for_log_probs_above_zero() -> None:
    """Rounding can push a log-prob a hair above 0; a caller may pass raw values. Clamped at entry,
    a child never outscores its parent, so every selected node's parent is selected before it."""
    rng = random.Random(3)
    for _ in range(60):
        batch, depth, k = rng.choice([1, 3]), rng.choice([2, 4, 15]), rng.choice([2, 4, 8])
        topv = -torch.rand(batch, depth, k).sort(dim=-1, descending=True).values.mul(3.0).add(-0.01)
        topv[:, 1:, :] = topv[:, 1:, :].abs() * rng.choice([1e-7, 1.0, 5.0])  # deeper positions > 0
        topv = topv.sort(dim=-1, descending=True).values
        topi = torch.stack([torch.randperm(50)[:k] for _ in range(batch * depth)]).view(batch, depth, k)
        budget = rng.choice([1, 2, 5, 16])
        tree = du.select_tree_from_topk(topv, topi, budget)
        for b in range(batch):
            m = int(tree.num_nodes[b])
            for i in range(1, m):
                p = int(tree.parents[b, i])
                assert 0 <= p < i and int(tree.depths[b, i]) == int(tree.depths[b, p]) + 1, (b, i, p)
            scores = tree.scores[b, :m].tolist()
            assert all(scores[i] <= scores[int(tree.parents[b, i])] for i in range(1, m))


# -------------------------------- keep-chain ----------------------------------------------------------

KC_DEPTHS = [1, 2, 3, 5, 15]


def kc_logits(rng: random.Random, batch: int, depth: int, vocab: int) -> torch.Tensor:
    """random_logits, sometimes with whole positions of -inf logits (no reachable token there)."""
    x = random_logits(rng, batch, depth, vocab)
    if rng.random() < 0.15:
        x = x.float().clone()
        for _ in range(rng.choice([1, 2])):
            x[rng.randrange(batch), rng.randrange(depth)] = float("-inf")
    return x


def kc_budget(rng: random.Random, depth: int) -> int:
    return rng.choice([depth, depth, depth + 1, depth + 2, 2 * depth, depth + 7, 16, 40, 63])


def chain_of(logits_row: torch.Tensor) -> list[int]:
    """The top-1 chain written independently: per position the smallest id among the largest float32
    logits, cut before the first position with no finite logit."""
    chain = []
    for row in logits_row.float().tolist():
        best = max(row)
        if best == float("-inf"):
            break
        chain.append(min(v for v, x in enumerate(row) if x == best))
    return chain


def assert_keep_chain_matches_oracle(logits: torch.Tensor, budget: int, cap: int | None) -> None:
    tree = du.build_ddtree(logits, budget, cap, keep_chain=True)
    n = budget + 1
    assert tree.token_ids.shape == (logits.shape[0], budget) and tree.parents.shape == (logits.shape[0], n)
    for b in range(logits.shape[0]):
        ref = keep_chain_oracle(logits[b], budget, cap)
        ctx = f"b={b} budget={budget} cap={cap} shape={tuple(logits.shape)}"
        m = assert_row_equals_oracle(tree, b, ref, ctx)
        assert (tree.token_ranks[b, m:] == -1).all() and (tree.scores[b, m:] == float("-inf")).all(), ctx
        # the chain is in the tree: from the root, follow the child carrying the next chain token
        chain, node = chain_of(logits[b]), 0
        for d, token in enumerate(chain, 1):
            kids = [i for i in range(1, m) if ref.parents[i] == node and ref.tokens[i - 1] == token]
            assert len(kids) == 1 and ref.depths[kids[0]] == d and ref.ranks[kids[0]] == 0, (ctx, d)
            node = kids[0]
        # the budget is used up unless fewer nodes are reachable than the standard tree would hold
        standard = heap_oracle(logits[b], budget, cap)
        assert m == len(standard.parents) or m == n, ctx
        if set(standard.paths) >= {tuple(chain[:d]) for d in range(len(chain) + 1)}:
            assert ref.paths == standard.paths, ctx  # the chain was there already: the same tree


@pytest.mark.parametrize("cap", CAPS)
def test_keep_chain_equals_its_oracle(cap: int | None) -> None:
    rng = random.Random(4242 + (cap or 0))
    for _ in range(160):
        depth = rng.choice(KC_DEPTHS)
        budget = kc_budget(rng, depth)
        vocab = rng.choice([1, 2, 3, 5, 12, 40] + ([300] if budget <= 63 or cap else []))
        assert_keep_chain_matches_oracle(kc_logits(rng, rng.choice(BATCHES), depth, vocab), budget, cap)


def test_keep_chain_oracle_is_not_the_standard_tree() -> None:
    """The equality above is not vacuous: most small-budget random cases change the tree."""
    rng = random.Random(9)
    differ = 0
    for _ in range(100):
        depth = rng.choice([3, 5, 15])
        logits = torch.randn(1, depth, 40) * rng.choice([0.5, 2.0])
        budget = depth + rng.choice([0, 1, 3])
        if keep_chain_oracle(logits[0], budget).paths != heap_oracle(logits[0], budget).paths:
            differ += 1
    assert differ > 50, differ


def test_keep_chain_structure() -> None:
    """Prefix-closed, parents first, the builder's order (scores never rise along the node order), mask
    and retrive_* consistent: the same checks as the standard tree."""
    rng = random.Random(77)
    for _ in range(150):
        depth = rng.choice(KC_DEPTHS)
        budget, cap = kc_budget(rng, depth), rng.choice(CAPS)
        logits = kc_logits(rng, rng.choice(BATCHES), depth, rng.choice([2, 5, 12, 40]))
        check_structure(du.build_ddtree(logits, budget, cap, keep_chain=True), logits, cap)


def test_keep_chain_batch_rows_are_independent() -> None:
    rng = random.Random(31)
    for _ in range(10):
        logits = kc_logits(rng, 5, 15, 40)
        assert_rows_independent(logits, 20, 4, keep_chain=True)


def node_paths(tree, b: int) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, int(tree.num_nodes[b])):
        paths.append(paths[int(tree.parents[b, i])] + (int(tree.token_ids[b, i - 1]),))
    return paths


def test_keep_chain_never_accepts_less_than_linear_dflash() -> None:
    """For any target: the walk over a keep-chain tree accepts at least what linear DFLASH accepts on
    the same draft. A target is a function of the token path (memoised, shared by both trees): it
    follows the chain for a while, then often picks one of the draft's top tokens, else any token.
    The standard tree does not promise this (counted, so the check can fail)."""
    rng = random.Random(2024)
    standard_worse = kept_better = cases = 0
    for _ in range(400):
        depth = rng.choice([2, 3, 5, 15])
        budget, cap = kc_budget(rng, depth), rng.choice(CAPS)
        batch, vocab = rng.choice(BATCHES), rng.choice([3, 12, 40])
        logits = random_logits(rng, batch, depth, vocab)  # every position has a finite logit
        keep = du.build_ddtree(logits, budget, cap, keep_chain=True)
        std = du.build_ddtree(logits, budget, cap)
        for b in range(batch):
            chain = chain_of(logits[b])
            assert len(chain) == depth
            follow = rng.choice([0, 1, 2, depth // 2, depth - 1, depth])
            top = logits[b].float().topk(min(3, vocab), dim=-1).indices.tolist()
            memo: dict[tuple[int, ...], int] = {}

            def target(
                path: tuple[int, ...],
                chain=chain,
                follow=follow,
                top=top,
                memo=memo,
                depth=depth,
                vocab=vocab,
            ) -> int:
                if path not in memo:
                    d = len(path)
                    if d < follow and path == tuple(chain[:d]):
                        memo[path] = chain[d]
                    elif d < depth and rng.random() < 0.6:
                        memo[path] = rng.choice(top[d])
                    else:
                        memo[path] = rng.randrange(vocab)
                return memo[path]

            linear = 0  # DFLASH: accept while the target's token after chain[:d] is chain[d]
            while linear < depth and target(tuple(chain[:linear])) == chain[linear]:
                linear += 1
            for tree, name in ((keep, "keep"), (std, "standard")):
                targets = torch.zeros((batch, budget + 1), dtype=torch.int64)
                for i, path in enumerate(node_paths(tree, b)):
                    targets[b, i] = target(path)
                got = int(du.follow_verified_tree(tree, targets)[1][b])
                if name == "keep":
                    assert got >= linear, (got, linear, depth, budget, cap)
                    kept_better += got > linear
                    cases += 1
                else:
                    standard_worse += got < linear
    assert cases >= 400 and standard_worse > 0 and kept_better > 0, (cases, standard_worse, kept_better)


def test_keep_chain_edges() -> None:
    logits = torch.randn(2, 4, 10)
    for budget in (0, 1, 3):
        with pytest.raises(ValueError, match="budget >= depth"):
            du.build_ddtree(logits, budget, keep_chain=True)
    # budget == depth: exactly the chain, whatever the cap
    for cap in (1, 2, None):
        t = du.build_ddtree(logits, 4, cap, keep_chain=True)
        for b in range(2):
            assert t.token_ids[b].tolist() == chain_of(logits[b]) and t.parents[b].tolist() == [
                -1,
                0,
                1,
                2,
                3,
            ]
            assert t.token_ranks[b].tolist() == [-1, 0, 0, 0, 0]
    # depth 0 / vocab 0: root only, no error
    assert du.build_ddtree(torch.zeros(1, 0, 5), 0, keep_chain=True).num_nodes.tolist() == [1]
    assert du.build_ddtree(torch.zeros(1, 2, 0), 3, keep_chain=True).num_nodes.tolist() == [1]
    # a chain node the standard tree lacks: (0) .50, (1) .45 beat (0,0) .20 at budget 2
    two = torch.tensor([[[0.50, 0.45, 0.04, 0.01], [0.40, 0.30, 0.20, 0.10]]]).log()
    assert du.build_ddtree(two, 2).token_ids[0].tolist() == [0, 1]
    t = du.build_ddtree(two, 2, keep_chain=True)
    assert t.token_ids[0].tolist() == [0, 0] and t.parents[0].tolist() == [-1, 0, 1]
    lp = oracle_logprobs(two[0])
    assert (
        t.scores[0, 2].item() == f32(lp[0][0] + lp[1][0])
        and abs(t.scores[0, 2].item() - math.log(0.2)) < 1e-6
    )
    assert t.token_ranks[0].tolist() == [-1, 0, 0]
    t = du.build_ddtree(two, 3, keep_chain=True)  # (0), (1), then the appended chain node (0,0), last
    assert t.token_ids[0].tolist() == [0, 1, 0] and t.parents[0].tolist() == [-1, 0, 0, 1]


def test_keep_chain_with_a_position_of_only_minus_inf_logits() -> None:
    """A position without a finite logit has no token: its log-probs are -inf (not NaN), it and every
    deeper position are unreachable, the chain stops before it, and the budget left goes best-first."""
    logits = torch.randn(1, 4, 6)
    logits[0, 2] = float("-inf")
    topv, _ = du.topk_logprobs(logits, 3)
    assert (topv[0, 2] == float("-inf")).all() and not topv.isnan().any()
    chain = chain_of(logits[0])
    assert len(chain) == 2
    for budget in (4, 8, 50):  # 6 + 36 nodes are reachable, at depths 1 and 2
        for keep in (False, True):
            t = du.build_ddtree(logits, budget, keep_chain=keep)
            m = int(t.num_nodes[0])
            assert m == 1 + min(budget, 42) and t.depths[0, :m].max() <= 2, (budget, keep)
            assert t.scores[0, 1:m].isfinite().all()
            paths = node_paths(t, 0)
            assert not keep or {(chain[0],), tuple(chain)} <= set(paths), (budget, paths)
    whole = torch.full((2, 3, 5), float("-inf"))
    whole[1] = torch.randn(3, 5)
    t = du.build_ddtree(whole, 3, keep_chain=True)
    assert t.num_nodes.tolist() == [1, 4] and t.token_ids[1].tolist() == chain_of(whole[1])


def test_shrink_tree_is_the_smaller_budgets_tree() -> None:
    """The first b nodes of a budget-B tree are the budget-b tree (the best-first order does not depend
    on the budget): narrow, field for field the builder's own; padded, the same nodes at B's width with
    the builder's padding after them."""
    rng = random.Random(23)
    for _ in range(120):
        big = rng.choice([7, 16, 63, 255])
        small = rng.randrange(0, big)
        cap = rng.choice(CAPS)
        logits = random_logits(rng, rng.choice(BATCHES), rng.choice(DEPTHS), rng.choice([2, 5, 12, 40]))
        want = du.build_ddtree(logits, small, cap)
        full = du.build_ddtree(logits, big, cap)
        ctx = f"{big} -> {small}, cap {cap}, {tuple(logits.shape)} {logits.dtype}"
        narrow = du.shrink_tree(full, small, pad=False)
        assert narrow.budget == small, ctx
        for name in tree_tensor_fields():
            assert torch.equal(getattr(narrow, name), getattr(want, name)), (name, ctx)
        padded = du.shrink_tree(full, small, pad=True)
        assert padded.budget == big and padded.parents.shape == full.parents.shape, ctx
        check_structure(padded, logits, cap)  # padding rows: own mask row only, never linked
        w = small + 1
        assert torch.equal(padded.num_nodes, want.num_nodes), ctx
        assert torch.equal(padded.tree_mask[:, :w, :w], want.tree_mask), ctx
        for name in ("parents", "depths", "scores", "token_ranks", "retrive_next_token", "retrive_next_sibling"):
            assert torch.equal(getattr(padded, name)[:, :w], getattr(want, name)), (name, ctx)
        assert torch.equal(padded.token_ids[:, :small], want.token_ids), ctx
        assert (padded.token_ids[:, small:] == du.PAD_TOKEN_ID).all(), ctx
        # Padded to a smaller verify graph's width (auto): the same nodes, that width's padding.
        to = rng.randrange(small + 1, big + 2)
        mid = du.shrink_tree(full, small, pad=True, pad_to=to)
        assert mid.parents.shape[1] == to and mid.budget == to - 1, ctx
        check_structure(mid, logits, cap)
        for name in tree_tensor_fields():
            if name != "retrive_index":
                assert torch.equal(getattr(mid, name)[..., :to - 1 if name == "token_ids" else to]
                                   if name != "tree_mask" else mid.tree_mask,
                                   getattr(padded, name)[..., :to - 1 if name == "token_ids" else to]
                                   if name != "tree_mask" else padded.tree_mask[:, :to, :to]), (name, to, ctx)
    assert du.shrink_tree(full, big, pad=True) is full


def test_shrink_tree_keeps_keep_chain_trees_ancestor_closed() -> None:
    """A keep-chain tree appends its chain last; its prefix is still a tree (parents kept, masks the
    kept ancestors), the standard tree's prefix where the chain was appended."""
    rng = random.Random(29)
    for _ in range(80):
        depth = rng.choice(KC_DEPTHS)
        budget, cap = kc_budget(rng, depth), rng.choice(CAPS)
        logits = kc_logits(rng, rng.choice(BATCHES), depth, rng.choice([2, 5, 12, 40]))
        full = du.build_ddtree(logits, budget, cap, keep_chain=True)
        small = rng.randrange(0, budget)
        for pad in (False, True):
            tree = du.shrink_tree(full, small, pad=pad)
            n = tree.parents.shape[1]
            for b in range(tree.batch_size):
                m = int(tree.num_nodes[b])
                assert m == min(int(full.num_nodes[b]), small + 1)
                for i in range(1, m):
                    assert 0 <= int(tree.parents[b, i]) < i
                for i in range(n):
                    row = set(torch.nonzero(tree.tree_mask[b, i]).view(-1).tolist())
                    if i < m:
                        assert row == set(torch.nonzero(full.tree_mask[b, i]).view(-1).tolist())
                    else:
                        assert row == {i} and int(tree.parents[b, i]) == -1
                linked = set(tree.retrive_next_token[b].tolist()) | set(tree.retrive_next_sibling[b].tolist())
                assert all(c < m for c in linked - {-1})

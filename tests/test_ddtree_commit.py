"""ddtree_commit: the v2 worker's on-device commit of a verified tree, against a pure-Python oracle.

Random trees (budgets 0 .. 63, top-k caps, keep-chain, trees with fewer valid nodes than slots, padded
shrunk trees), random targets that follow the tree to varying depths, walked by `follow_verified_tree`;
a `req_to_token` pool with extra rows, random distinct slots, random prefixes and shuffled pool indices.
The oracle walks each tree over Python lists and says what the outputs, the permuted row, the draft-KV
write and the KV the committed positions then read must be. Plus: the module has no host round trip.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ddtree_oracle import load_ddtree_utils, load_payload_module

du = load_ddtree_utils()
dc = load_payload_module("ddtree_commit")

MODULE = Path(dc.__file__)
BUDGETS = [0, 1, 7, 15, 63]


@dataclass
class Case:
    tree: object
    target: torch.Tensor  # int64 [bs, n]
    pool: torch.Tensor  # [rows, width], int32 or int64
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    block: int


def _logits(rng: random.Random, g: torch.Generator, bs: int, depth: int, vocab: int) -> torch.Tensor:
    x = torch.randn((bs, depth, vocab), generator=g) * rng.choice([0.5, 3.0, 20.0])
    if rng.random() < 0.3:  # -inf tokens: some trees hold fewer than 1 + budget nodes
        drop = torch.rand((bs, depth, vocab), generator=g) < rng.choice([0.5, 0.9])
        x = x.masked_fill(drop, float("-inf"))
        x[:, :, 0] = 0.0
    if rng.random() < 0.1:  # a whole position unreachable: it and everything deeper
        x[:, rng.randrange(depth), :] = float("-inf")
    return x


def _children(parents: list[int], num_nodes: int) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for j in range(1, num_nodes):
        kids.setdefault(parents[j], []).append(j)
    return kids


def random_case(rng: random.Random, budget: int) -> Case:
    bs = rng.choice([1, 2, 3, 6])
    depth, vocab = rng.choice([1, 3, 7, 15]), rng.choice([5, 40])
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    keep_chain = budget >= depth and rng.random() < 0.3
    tree = du.build_ddtree(
        _logits(rng, g, bs, depth, vocab), budget, topk_cap=rng.choice([None, 1, 2, 4]), keep_chain=keep_chain
    )
    if budget > 1 and rng.random() < 0.2:  # a shrunk tree at the full width: padding slots in the segment
        tree = du.shrink_tree(tree, rng.randrange(budget), pad=True)
    n = tree.parents.shape[1]
    # Target: at each node, with a per-request probability, the token of one of its children.
    target = [[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)]
    for b in range(bs):
        follow = rng.choice([0.0, 0.5, 0.9, 1.0])
        tokens = tree.token_ids[b].tolist()
        for parent, kids in _children(tree.parents[b].tolist(), int(tree.num_nodes[b])).items():
            if rng.random() < follow:
                target[b][parent] = tokens[rng.choice(kids) - 1]
    # Pool: extra rows and columns, distinct random slots, shuffled rows, random prefixes.
    rows = bs + rng.randrange(4)
    prefixes = [rng.randrange(30) for _ in range(bs)]
    width = max(prefixes) + n + rng.randrange(5)
    slots = rng.sample(range(1, 1 << 20), rows * width)
    dtype = rng.choice([torch.int32, torch.int64])
    pool = torch.tensor(slots, dtype=dtype).view(rows, width)
    req_pool_indices = torch.tensor(rng.sample(range(rows), bs), dtype=rng.choice([torch.int32, torch.int64]))
    prefix_lens = torch.tensor(prefixes, dtype=rng.choice([torch.int32, torch.int64]))
    block = tree.max_depth + 1 + rng.choice([0, 0, 1, 3])
    return Case(tree, torch.tensor(target, dtype=torch.int64), pool, req_pool_indices, prefix_lens, block)


def oracle_walk(
    tokens: list[int], parents: list[int], num_nodes: int, target: list[int]
) -> tuple[list[int], int]:
    """(path nodes from the root, bonus token): move to the child whose token is the target's at the
    current node until none is."""
    kids = _children(parents, num_nodes)
    path = [0]
    while True:
        nxt = [c for c in kids.get(path[-1], []) if tokens[c - 1] == target[path[-1]]]
        assert len(nxt) <= 1  # siblings carry distinct tokens
        if not nxt:
            return path, target[path[-1]]
        path.append(nxt[0])


def oracle(case: Case) -> list[dict]:
    """Per request: path, out_tokens row, the permuted pool row, the KV plan's entries, as Python lists."""
    t = case.tree
    n = t.parents.shape[1]
    pool = case.pool.tolist()
    out = []
    for b in range(t.parents.shape[0]):
        path, bonus = oracle_walk(
            t.token_ids[b].tolist(), t.parents[b].tolist(), int(t.num_nodes[b]), case.target[b].tolist()
        )
        tokens = [t.token_ids[b].tolist()[j - 1] for j in path[1:]] + [bonus]
        row, prefix = int(case.req_pool_indices[b]), int(case.prefix_lens[b])
        segment = pool[row][prefix : prefix + n]  # slot at which node i was verified: segment[i]
        order = path + [j for j in range(n) if j not in path]
        out.append(
            {
                "path": path,
                "out_tokens": tokens + [0] * (case.block - len(tokens)),
                "commit_len": len(tokens),
                "row": row,
                "prefix": prefix,
                "segment": segment,
                "permuted": [segment[j] for j in order],
                "hidden_rows": [b * n + j for j in path],
                "positions": [prefix + k for k in range(len(path))],
            }
        )
    return out


def walk(case: Case):
    return du.follow_verified_tree(case.tree, case.target)


def check_case(case: Case) -> list[int]:
    t = case.tree
    bs, n = t.parents.shape
    ref = oracle(case)
    accepted, lengths, bonus = walk(case)
    before = case.pool.tolist()

    out_tokens, commit_lens = dc.step_outputs(t, accepted, lengths, bonus, case.block)
    assert out_tokens.dtype == torch.int64 and out_tokens.shape == (bs, case.block)
    assert out_tokens.tolist() == [r["out_tokens"] for r in ref]
    assert commit_lens.tolist() == [r["commit_len"] for r in ref]

    order = dc.commit_order(t, accepted, lengths)
    for b, r in enumerate(ref):
        assert sorted(order[b].tolist()) == list(range(n))  # a full permutation, padding included
        assert order[b].tolist()[: r["commit_len"]] == r["path"]

    committed = dc.permute_row_segments(case.pool, case.req_pool_indices, case.prefix_lens, order)
    assert committed.dtype == case.pool.dtype
    after = case.pool.tolist()
    expected = [list(row) for row in before]
    for r in ref:
        expected[r["row"]][r["prefix"] : r["prefix"] + n] = r["permuted"]
        assert sorted(r["permuted"]) == sorted(r["segment"])  # the request keeps every slot
    assert after == expected  # other rows and positions outside the segments untouched
    assert committed.tolist() == [r["permuted"] for r in ref]

    plan = dc.draft_kv_write_plan(t, accepted, lengths, case.prefix_lens, committed, case.block)
    for field in ("hidden_rows", "positions", "cache_loc", "valid"):
        assert getattr(plan, field).shape == (bs * case.block,), field
    valid = plan.valid.view(bs, case.block).tolist()
    hidden = plan.hidden_rows.view(bs, case.block).tolist()
    positions = plan.positions.view(bs, case.block).tolist()
    locs = plan.cache_loc.view(bs, case.block).tolist()
    # The target's verify KV: node i of request b written at its segment's slot i, from hidden row b*n + i.
    kv = {slot: b * n + i for b, r in enumerate(ref) for i, slot in enumerate(r["segment"])}
    for b, r in enumerate(ref):
        m = r["commit_len"]
        assert valid[b] == [True] * m + [False] * (case.block - m)
        assert hidden[b][:m] == r["hidden_rows"]
        assert positions[b][:m] == r["positions"]
        assert locs[b][:m] == after[r["row"]][r["prefix"] : r["prefix"] + m]
        # Composition: the committed positions now read the KV written where the path's nodes were verified.
        assert [kv[s] for s in after[r["row"]][r["prefix"] : r["prefix"] + m]] == r["hidden_rows"]
        # Padding repeats the root's entry: writing it unmasked rewrites the root with the same data.
        root = (hidden[b][0], positions[b][0], locs[b][0])
        assert all((hidden[b][k], positions[b][k], locs[b][k]) == root for k in range(m, case.block))
    return [r["commit_len"] - 1 for r in ref]


@pytest.mark.parametrize("budget", BUDGETS)
def test_commit_matches_oracle(budget: int) -> None:
    rng = random.Random(1000 + budget)
    torch.manual_seed(budget)
    seen: set[int] = set()
    depths: set[int] = set()
    for _ in range(60):
        case = random_case(rng, budget)
        seen.update(check_case(case))
        depths.add(case.tree.max_depth)
    # The targets reach both ends: nothing accepted, and (for real trees) paths several nodes deep.
    assert 0 in seen
    if budget >= 7:
        assert max(seen) >= 5, seen
    elif budget == 1:
        assert 1 in seen


def test_commit_tree_is_the_parts_in_order() -> None:
    rng = random.Random(7)
    for _ in range(20):
        case = random_case(rng, rng.choice(BUDGETS))
        pool = case.pool.clone()
        accepted, lengths, bonus = walk(case)
        got = dc.commit_tree(
            case.tree, accepted, lengths, bonus, pool, case.req_pool_indices, case.prefix_lens, case.block
        )
        out_tokens, commit_lens = dc.step_outputs(case.tree, accepted, lengths, bonus, case.block)
        order = dc.commit_order(case.tree, accepted, lengths)
        committed = dc.permute_row_segments(case.pool, case.req_pool_indices, case.prefix_lens, order)
        plan = dc.draft_kv_write_plan(case.tree, accepted, lengths, case.prefix_lens, committed, case.block)
        assert torch.equal(pool, case.pool)
        assert torch.equal(got.out_tokens, out_tokens) and torch.equal(got.commit_lens, commit_lens)
        assert torch.equal(got.committed_slots, committed)
        for field in ("hidden_rows", "positions", "cache_loc", "valid"):
            assert torch.equal(getattr(got.kv_plan, field), getattr(plan, field)), field


def test_walk_padding_is_not_read() -> None:
    """Only the path's entries of accepted_nodes are read: any padding value gives the same commit."""
    rng = random.Random(11)
    for _ in range(20):
        case = random_case(rng, rng.choice([7, 15, 63]))
        accepted, lengths, bonus = walk(case)
        n = case.tree.parents.shape[1]
        pad = torch.arange(accepted.shape[1])[None, :] > lengths[:, None]
        noisy = torch.where(pad, torch.randint(0, n, accepted.shape), accepted)
        assert torch.equal(
            dc.commit_order(case.tree, noisy, lengths), dc.commit_order(case.tree, accepted, lengths)
        )
        a = dc.step_outputs(case.tree, noisy, lengths, bonus, case.block)
        b = dc.step_outputs(case.tree, accepted, lengths, bonus, case.block)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        slots = torch.arange(len(lengths) * n).view(-1, n)
        p = dc.draft_kv_write_plan(case.tree, noisy, lengths, case.prefix_lens, slots, case.block)
        q = dc.draft_kv_write_plan(case.tree, accepted, lengths, case.prefix_lens, slots, case.block)
        assert torch.equal(p.hidden_rows, q.hidden_rows) and torch.equal(p.cache_loc, q.cache_loc)


def test_block_smaller_than_a_path_is_refused_before_the_pool_moves() -> None:
    case = random_case(random.Random(3), 15)
    accepted, lengths, bonus = walk(case)
    before = case.pool.clone()
    short = case.tree.max_depth  # one less than the longest path's tokens
    with pytest.raises(ValueError, match="more than the block"):
        dc.step_outputs(case.tree, accepted, lengths, bonus, short)
    with pytest.raises(ValueError, match="more than the block"):
        dc.commit_tree(
            case.tree, accepted, lengths, bonus, case.pool, case.req_pool_indices, case.prefix_lens, short
        )
    assert torch.equal(case.pool, before)
    n = case.tree.parents.shape[1]
    with pytest.raises(ValueError, match="more than the block"):
        dc.draft_kv_write_plan(
            case.tree,
            accepted,
            lengths,
            case.prefix_lens,
            torch.zeros((len(lengths), n), dtype=torch.int64),
            short,
        )


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def test_module_has_no_host_round_trip_and_no_loops() -> None:
    """No `.cpu()`, `.item()`, `.tolist()`, `.numpy()`, numpy, a "cpu" device string, `for` / `while` loops or
    comprehensions (which would be loops over the batch) in the module's code (docstrings aside)."""
    tree = ast.parse(MODULE.read_text())
    docstrings = _docstring_nodes(tree)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("cpu", "item", "tolist", "numpy"):
            bad.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in ("numpy", "np"):
            bad.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(name.split(".")[0] == "numpy" for name in names):
                bad.append(f"line {node.lineno}: imports numpy")
        elif isinstance(node, ast.For | ast.AsyncFor | ast.While | ast.comprehension):
            bad.append(f"line {node.lineno}: {type(node).__name__}")
        elif isinstance(node, ast.Constant) and id(node) not in docstrings and node.value == "cpu":
            bad.append(f"line {node.lineno}: 'cpu'")
    assert not bad, bad

"""ddtree_verify_step: the verify's custom mask, the greedy walk with its packed host row, and the
commit's kept / freed KV slots and hidden rows -- the torch path against per-request Python oracles
on random trees, and the Triton kernels (ddtree_verify_kernels) against the torch path, bit for bit:
on a CUDA GPU when there is one, else in Triton's CPU interpreter (a subprocess, TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddtree_oracle import load_ddtree_utils, load_payload_module

HERE = Path(__file__).resolve().parent
du = load_ddtree_utils()
vs = load_payload_module("ddtree_verify_step")


def random_case(rng: random.Random, bs: int | None = None, budgets: tuple[int, ...] = (1, 4, 12, 30, 64, 256)):
    """A built tree batch, root tokens, a target argmax that follows the tree some way down, prefix
    lengths and KV slots: what a verify step holds after the target forward."""
    bs = bs or rng.choice([1, 2, 5])
    depth, vocab, budget = rng.choice([1, 3, 6, 15]), rng.choice([6, 40]), rng.choice(budgets)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = torch.randn((bs, depth, vocab), generator=g) * rng.choice([0.5, 3.0])
    tree = du.build_ddtree(logits, budget, topk_cap=rng.choice([None, 2]))
    n = budget + 1
    candidates = torch.cat([torch.randint(0, vocab, (bs, 1), generator=g), tree.token_ids], 1)
    target = torch.randint(0, vocab, (bs, n), generator=g)
    for b in range(bs):  # at each node, most often the token of one of its children: deep paths
        kids: dict[int, list[int]] = {}
        for j, parent in enumerate(tree.parents[b, 1 : int(tree.num_nodes[b])].tolist(), start=1):
            kids.setdefault(parent, []).append(j)
        for i, children in kids.items():
            if rng.random() < 0.8:
                target[b, i] = candidates[b, rng.choice(children)]
    prefix = torch.tensor([rng.choice([0, 1, 7, 1500]) for _ in range(bs)])
    loc = torch.randperm(10_000, generator=g)[: bs * n] + 1
    return tree, candidates, target, prefix, loc


def walk_oracle(tree, target: torch.Tensor, b: int) -> list[int]:
    """Root first, then at each node the child whose token is the target's choice there."""
    parents, tokens, want = tree.parents[b].tolist(), tree.token_ids[b].tolist(), target[b].tolist()
    path, cur = [0], 0
    while True:
        kids = [j for j in range(1, int(tree.num_nodes[b])) if parents[j] == cur and tokens[j - 1] == want[cur]]
        assert len(kids) <= 1, "siblings must carry distinct tokens"
        if not kids:
            return path
        cur = kids[0]
        path.append(cur)


def test_custom_mask_is_prefix_ones_then_the_tree_rows_per_request() -> None:
    rng = random.Random(1)
    for _ in range(20):
        tree, _c, _t, prefix, _l = random_case(rng)
        n = tree.tree_mask.shape[1]
        got = vs.tree_custom_mask(tree.tree_mask, prefix, prefix.tolist())
        blocks = []
        for b in range(tree.batch_size):
            block = torch.ones((n, int(prefix[b]) + n), dtype=torch.bool)
            block[:, int(prefix[b]):] = tree.tree_mask[b]
            blocks.append(block.reshape(-1))
        assert torch.equal(got, torch.cat(blocks))


def test_greedy_walk_and_its_packed_row_follow_the_target() -> None:
    rng = random.Random(2)
    depths_seen = set()
    for _ in range(40):
        tree, cand, target, _p, _l = random_case(rng)
        accepted, packed = vs.greedy_walk(tree, cand, target, du.follow_verified_tree)
        depth = tree.max_depth
        assert accepted.shape == (tree.batch_size, depth + 1) and packed.shape == (tree.batch_size, depth + 2)
        for b in range(tree.batch_size):
            path = walk_oracle(tree, target, b)
            depths_seen.add(len(path) - 1)
            assert accepted[b].tolist() == path + [-1] * (depth + 1 - len(path))
            tokens = [int(cand[b, i]) for i in path[1:]]
            assert packed[b, : len(tokens)].tolist() == tokens
            assert int(packed[b, depth]) == len(path) - 1  # accepted draft tokens
            assert int(packed[b, depth + 1]) == int(target[b, path[-1]])  # bonus: the target at the last node
    assert len(depths_seen) >= 4, depths_seen  # the cases walk to several depths, not only the root


def test_commit_keeps_the_committed_path_in_order_and_frees_every_other_slot() -> None:
    rng = random.Random(3)
    for _ in range(40):
        tree, cand, target, _p, loc = random_case(rng)
        n = tree.parents.shape[1]
        accepted, packed = vs.greedy_walk(tree, cand, target, du.follow_verified_tree)
        # a finished request commits fewer nodes than its path holds, down to none
        commits = [rng.randint(0, int(packed[b, tree.max_depth]) + 1) for b in range(tree.batch_size)]
        kept, rows, freed = vs.commit_slots(accepted, loc, commits, n)
        want_kept, want_rows, want_freed = [], [], []
        for b, c in enumerate(commits):
            nodes = accepted[b, :c].tolist()
            want_kept += [int(loc[b * n + i]) for i in nodes]
            want_rows += [b * n + i for i in nodes]
            want_freed += [int(loc[b * n + i]) for i in range(n) if i not in nodes]
        assert kept.tolist() == want_kept and rows.tolist() == want_rows and freed.tolist() == want_freed
        assert sorted(kept.tolist() + freed.tolist()) == sorted(loc.tolist())  # nothing lost, nothing twice


KERNEL_CHECK = r"""
import random, sys, torch
sys.path.insert(0, sys.argv[1])
import test_ddtree_verify_step as t
vk = t.vs._kernels()
assert vk is not None, "ddtree_verify_kernels did not load"
device, cases = sys.argv[2], int(sys.argv[3])
rng = random.Random(7)
for case in range(cases):
    # the interpreter runs programs one by one: wide batches with small trees, wide trees in small batches
    bs = rng.choice([1, 3, 33])
    tree, cand, target, prefix, loc = t.random_case(rng, bs=bs, budgets=(1, 4, 12) if bs > 3 else (1, 12, 64, 256))
    if device != "cpu":
        tree = type(tree)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(tree).items()})
        cand, target, prefix, loc = (x.to(device) for x in (cand, target, prefix, loc))
    n = tree.parents.shape[1]
    want_mask = t.vs._tree_custom_mask_torch(tree.tree_mask.cpu(), prefix.cpu(), int(prefix.sum()))
    got_mask = vk.tree_custom_mask_triton(tree.tree_mask, prefix.tolist())
    assert got_mask.dtype == torch.bool and torch.equal(got_mask.cpu(), want_mask), case
    cpu_tree = type(tree)(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(tree).items()})
    want_acc, want_packed = t.vs._greedy_walk_torch(cpu_tree, cand.cpu(), target.cpu(), t.du.follow_verified_tree)
    got_acc, got_packed = vk.greedy_walk_triton(tree, cand, target)
    assert torch.equal(got_acc.cpu(), want_acc) and torch.equal(got_packed.cpu(), want_packed), case
    commits = [rng.randint(0, int(want_packed[b, tree.max_depth]) + 1) for b in range(tree.batch_size)]
    want = t.vs._commit_slots_torch(want_acc, loc.cpu(), commits, n)
    got = vk.commit_slots_triton(got_acc, loc, commits, n)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want)), case
# the v2 worker's verify input (tokens, positions, slots, and the mask placed by the device lengths and sized by a
# host bound) and whole commit (the pool's row segments permuted in place, the outputs, the draft-KV plan): one
# kernel each, the torch path's every tensor
dc = t.load_payload_module("ddtree_commit")
for case in range(cases):
    bs = rng.choice([1, 3, 33])
    tree, cand, target, prefix, _ = t.random_case(rng, bs=bs, budgets=(1, 4, 12) if bs > 3 else (1, 12, 64, 256))
    n, depth = tree.parents.shape[1], int(tree.max_depth)
    bound = int(prefix.sum()) + rng.choice([0, 9])
    accepted = t.du.follow_verified_tree(tree, target)[0].to(torch.int64)
    # a shorter commit than the walk's is a path too; past the accept length the walk's entries are garbage
    lengths = torch.tensor([rng.randint(0, int((accepted[b] >= 0).sum()) - 1) for b in range(bs)])
    accepted = torch.where(torch.arange(depth + 1)[None, :] <= lengths[:, None], accepted, rng.choice([-1, 0, 5]))
    bonus = torch.randint(0, 40, (bs,))
    rows = torch.randperm(bs + 2)[:bs]
    pool = torch.randperm((bs + 2) * (1500 + n + 4)).view(bs + 2, -1).to(rng.choice([torch.int32, torch.int64]))
    block = depth + 1 + rng.choice([0, 0, 3])
    want_pool = pool.clone()
    want_input = t.vs._verify_input_torch(tree, bonus, prefix, pool, rows, bound)
    n_ = tree.parents.shape[1]
    assert torch.equal(want_input[0].view(bs, n_)[:, 1:], tree.token_ids) and torch.equal(want_input[0][::n_], bonus)
    assert torch.equal(want_input[2], t.vs._tree_custom_mask_torch(tree.tree_mask, prefix, bound))
    assert torch.equal(want_input[3].view(bs, n_), torch.stack([pool[r, p : p + n_] for r, p in zip(rows, prefix)]).long())
    want = dc.commit_tree(tree, accepted, lengths, bonus, want_pool, rows, prefix, block)
    if device != "cpu":
        tree = type(tree)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(tree).items()})
    got_pool = pool.to(device)
    got_input = t.vs.verify_input(tree, bonus.to(device), prefix.to(device), got_pool, rows.to(device), bound)
    assert got_input[2].dtype == torch.bool, case
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got_input, want_input, strict=True)), case
    kernel = t.vs.commit_kernel(got_pool)
    assert kernel is vk.tree_commit_triton
    got = dc.commit_tree(tree, accepted.to(device), lengths.to(device), bonus.to(device), got_pool, rows.to(device),
                         prefix.to(device), block, kernel=kernel)
    assert torch.equal(got_pool.cpu(), want_pool) and got.committed_slots.dtype == pool.dtype, case
    for name in ("out_tokens", "commit_lens", "committed_slots"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (case, name)
    for name in ("hidden_rows", "positions", "cache_loc", "valid"):
        assert torch.equal(getattr(got.kv_plan, name).cpu(), getattr(want.kv_plan, name)), (case, name)
# auto's smaller trees: the shrink kernel makes the torch path's tree, own width and padded to wider verify graphs
for case in range(cases):
    bs = rng.choice([1, 3, 33])
    tree = t.random_case(rng, bs=bs, budgets=(12, 30) if bs > 3 else (12, 64, 256))[0]
    n = tree.parents.shape[1]
    budget = rng.randint(0, n - 2)
    kw = rng.choice([dict(pad=False), dict(pad=True), dict(pad=True, pad_to=rng.randint(budget + 1, n))])
    want = t.du.shrink_tree(tree, budget, **kw)
    if device != "cpu":
        tree = type(tree)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(tree).items()})
    kernel = t.vs.shrink_kernel(tree.parents)
    assert kernel is vk.shrink_tree_triton
    got = t.du.shrink_tree(tree, budget, kernel=kernel, **kw)
    for (name, a), b in zip(vars(got).items(), vars(want).values(), strict=True):
        assert (torch.equal(a.cpu(), b) and a.dtype == b.dtype) if isinstance(a, torch.Tensor) else a == b, (case, name)
# a shrink kernel wrong only at a padded width is caught at start, on auto's smaller trees
real_shrink = vk.shrink_tree_triton
vk.shrink_tree_triton = lambda tree, keep, w, pad: (lambda f: (f[0], f[1], f[2] + (w > keep), *f[3:]))(real_shrink(tree, keep, w, pad))
why = t.vs.self_test(torch.device(device), 12, 3, t.du.build_ddtree, t.du.follow_verified_tree, t.du.shrink_tree, smaller=(3,),
                     pad_widths=(8,))
assert why is not None and "shrunk tree differs" in why, why
vk.shrink_tree_triton = real_shrink
t.vs._KERNELS_OFF.clear()
# a v2 commit kernel wrong only past a short commit is caught at start, and so is a wrong verify input
real_v2 = vk.tree_commit_triton
vk.tree_commit_triton = lambda *a: (lambda o, *rest: (o + (o == 0).to(o.dtype), *rest))(*real_v2(*a))
why = t.vs.self_test(torch.device(device), 12, 3, t.du.build_ddtree, t.du.follow_verified_tree, commit=dc.commit_tree)
assert why is not None and "v2 commit differs" in why, why
vk.tree_commit_triton = real_v2
t.vs._KERNELS_OFF.clear()
real_input = vk.tree_verify_input_triton
vk.tree_verify_input_triton = lambda tree, bonus, p, pool, r, b: real_input(tree, bonus, p, pool, r, b + 1)
why = t.vs.self_test(torch.device(device), 12, 3, t.du.build_ddtree, t.du.follow_verified_tree, commit=dc.commit_tree)
assert why is not None and "v2 verify input differs" in why, why
vk.tree_verify_input_triton = real_input
t.vs._KERNELS_OFF.clear()
assert t.vs.self_test(torch.device(device), 12, 3, t.du.build_ddtree, t.du.follow_verified_tree, commit=dc.commit_tree) is None
# the sampled walk of identity rows: its descent and the log-sum-exp per node
ds = t.load_payload_module("ddtree_sampling")
for case in range(cases):
    bs = rng.choice([1, 3, 33])
    tree = t.random_case(rng, bs=bs, budgets=(1, 4, 12) if bs > 3 else (1, 12, 64, 256))[0]
    n = tree.parents.shape[1]
    g = torch.Generator().manual_seed(case)
    # children's probabilities large enough that walks go deep; some children hold their parent's whole mass
    q = torch.rand((bs, n), generator=g) * rng.choice([0.6, 1.0 / max(1, n - 1)])
    q[torch.rand((bs, n), generator=g) < 0.1] = 1.0
    coins = torch.rand((bs, n), generator=g)
    want = ds.walk_node_probs(tree, q, coins)
    if device != "cpu":
        tree = type(tree)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(tree).items()})
    got = vk.sampled_walk_triton(tree, q.to(device), coins.to(device))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want)), case
    x = torch.randn((5, rng.choice([7, 4096, 9000])), generator=g) * 5
    x[2, : x.shape[1] // 2] = float("-inf")
    rows, temps = torch.tensor([4, 2, 2, 0]), torch.tensor([0.5, 1.0, 2.0, 0.8])
    lse = vk.row_logsumexp_triton(x.to(device), rows.to(device), temps.to(device)).cpu()
    assert torch.allclose(lse, torch.logsumexp(x[rows] / temps[:, None], -1), rtol=1e-5, atol=1e-5), case
# auto's acceptance by budget: one kernel, the torch path's counts, greedy and sampled rows apart
for case in range(cases):
    bs = rng.choice([1, 3, 33])
    tree, _, target, _, _ = t.random_case(rng, bs=bs, budgets=(1, 4, 12) if bs > 3 else (1, 12, 64, 256))
    accepted = t.du.follow_verified_tree(tree, target)[0].to(torch.int64)
    budgets = torch.tensor(sorted(rng.sample([1, 2, 3, 7, 15, 31, 63, 127, 255], rng.randint(1, 6))))
    sampled = sorted(rng.sample(range(bs), rng.randint(0, bs)))
    want = t.du.acceptance_by_kind(tree, accepted, budgets, sampled)
    if device != "cpu":
        tree = type(tree)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(tree).items()})
    got = t.vs.step_acceptance(tree, accepted.to(device), budgets.to(device), sampled, None)
    assert torch.equal(got.cpu(), want), (case, got, want)
# a wrong acceptance kernel is caught at start
real_acc = vk.acceptance_by_budget_triton
vk.acceptance_by_budget_triton = lambda tree, a, b, k: real_acc(tree, a, b, None)
why = t.vs.self_test(torch.device(device), 12, 3, t.du.build_ddtree, t.du.follow_verified_tree, acceptance=t.du.acceptance_by_kind)
assert why is not None and "acceptance by budget differs" in why, why
vk.acceptance_by_budget_triton = real_acc
t.vs._KERNELS_OFF.clear()
# tree_walk takes the kernels for identity rows here, and walks as the torch path does
tree, _, _, _, _ = t.random_case(rng, bs=5, budgets=(30,))
bs, n = tree.parents.shape
vocab = 40
logits = torch.randn((bs, n, vocab), generator=torch.Generator().manual_seed(3)) * 2
cand = torch.cat([torch.zeros((bs, 1), dtype=torch.int64), tree.token_ids], 1)
kw = dict(sampled_rows=[0, 2, 3, 4], temperatures=torch.full((bs,), 0.8), top_ks=torch.full((bs,), 1 << 30),
          top_ps=torch.ones(bs), unfiltered=[0, 2, 3, 4])
def walk(): return ds.tree_walk(tree.__class__(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(tree).items()}),
                                cand.to(device), logits.to(device), generator=None if device != "cpu" else torch.Generator().manual_seed(1),
                                **{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
sibling_vs = ds._sibling("ddtree_verify_step")
assert ds._fused_kernels(logits.to(device)) is not None
if device == "cpu":
    fused = walk()
    sibling_vs._KERNELS_OFF.append("test: the torch path")
    plain = walk()
    sibling_vs._KERNELS_OFF.clear()
    assert all(torch.equal(a, b) for a, b in zip(fused, plain)), (fused, plain)
assert t.vs.self_test(torch.device(device), 12, 3, t.du.build_ddtree, t.du.follow_verified_tree,
                      t.du.shrink_tree, smaller=(7, 3, 1, 0), walk=ds.walk_node_probs,
                      acceptance=t.du.acceptance_by_kind) is None
# a wrong sampled walk kernel is caught at start
real_sampled = vk.sampled_walk_triton
vk.sampled_walk_triton = lambda tree, q, c: (lambda a, l, x: (a, l, torch.where(l > 1, x + 1, x)))(*real_sampled(tree, q, c))
why = t.vs.self_test(torch.device(device), 12, 3, t.du.build_ddtree, t.du.follow_verified_tree, walk=ds.walk_node_probs)
assert why is not None and "sampled walk differs" in why, why
vk.sampled_walk_triton = real_sampled
t.vs._KERNELS_OFF.clear()
assert t.vs.kernels_in_use(torch.device(device))
# the dispatch takes the kernels here (a GPU, or the interpreter)
tree, cand, target, prefix, loc = t.random_case(rng, bs=2)
tree = type(tree)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(tree).items()})
assert torch.equal(t.vs.greedy_walk(tree, cand.to(device), target.to(device), None)[1],
                   vk.greedy_walk_triton(tree, cand.to(device), target.to(device))[1])
# a wrong kernel is caught at start and turns the kernels off (the torch path serves)
real = vk.greedy_walk_triton
vk.greedy_walk_triton = lambda tree, c, tg: (lambda a, p: (a, p + 1))(*real(tree, c, tg))
why = t.vs.self_test(torch.device(device), 12, 3, t.du.build_ddtree, t.du.follow_verified_tree)
assert why is not None and "greedy walk differs" in why, why
vk.greedy_walk_triton = real
# a commit kernel wrong only for a shrunk tree's slots is caught by the smaller widths
real_commit = vk.commit_slots_triton
vk.commit_slots_triton = lambda a, loc, c, w: real_commit(a, loc, c, w) if w == 13 else real_commit(a, loc.flip(0), c, w)
t.vs._KERNELS_OFF.clear()
assert t.vs.self_test(torch.device(device), 12, 3, t.du.build_ddtree, t.du.follow_verified_tree) is None
why = t.vs.self_test(torch.device(device), 12, 3, t.du.build_ddtree, t.du.follow_verified_tree,
                     t.du.shrink_tree, smaller=(7,))
assert why is not None and "commit differs" in why and "8 of 8 slots" in why, why
assert not t.vs.kernels_in_use(torch.device(device))
print("ok", cases)
"""


def run_kernel_check(device: str, cases: int, interpret: bool) -> None:
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK, str(HERE), device, str(cases)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"ok {cases}" in proc.stdout


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_verify_kernels_equal_the_torch_path_on_gpu() -> None:
    run_kernel_check("cuda", 60, interpret=False)


@needs_triton
def test_verify_kernels_in_the_cpu_interpreter() -> None:
    run_kernel_check("cpu", 12, interpret=True)


@needs_triton
def test_verify_kernels_env_switch_keeps_the_torch_path() -> None:
    probe = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import test_ddtree_verify_step as t; "
             "print(t.vs.kernels_in_use(torch.device('cpu')))")
    for switch, want in (("0", "False"), ("1", "True")):
        env = {**os.environ, "TRITON_INTERPRET": "1", "SGLANG_DDTREE_VERIFY_KERNELS": switch}
        proc = subprocess.run([sys.executable, "-c", probe, str(HERE)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.stdout.strip().splitlines()[-1:] == [want], proc.stdout + proc.stderr[-2000:]

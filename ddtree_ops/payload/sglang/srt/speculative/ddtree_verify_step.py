"""The tensor work of a DDTree full-mode verify step (installed as
`sglang/srt/speculative/ddtree_verify_step.py` by the ddtree-ops payload): the verify's custom mask,
the greedy walk with the row the host copies, and which KV slots and hidden rows the accepted path
keeps. `ddtree_worker` holds the step's order and SGLang's state; this module holds the tensors.

Each function is plain torch (CPU, tests, the reference) and, on CUDA with Triton, one kernel of
`ddtree_verify_kernels` with the same result bit for bit (tests/test_ddtree_verify_step.py runs both
on random trees). `DDTREE_DISABLE_TRITON=1` keeps the torch path, as for the tree builder; `SGLANG_DDTREE_VERIFY_KERNELS=0`
keeps it for the verify step alone.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_KERNELS: list = []  # [module] once loaded, [None] once known to be unavailable
# SGLANG_DDTREE_VERIFY_KERNELS=0 keeps the torch path for the verify step only (the builder's Triton
# kernels stay on): the benchmark's unfused twin.
VERIFY_KERNELS = os.environ.get("SGLANG_DDTREE_VERIFY_KERNELS", "1") != "0"


def _kernels() -> Any:
    """`ddtree_verify_kernels` beside this file, or None (no Triton, or it failed to import)."""
    if not _KERNELS:
        try:
            if __package__:
                from . import ddtree_verify_kernels as module
            else:  # loaded by file path (tests): load the sibling the same way
                import importlib.util
                from pathlib import Path

                path = Path(__file__).with_name("ddtree_verify_kernels.py")
                spec = importlib.util.spec_from_file_location("ddtree_verify_kernels_" + __name__, path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
        except Exception:  # triton missing or broken: the torch path gives the same tensors
            module = None
        _KERNELS.append(module)
    return _KERNELS[0]


def _fused(t: torch.Tensor) -> Any:
    # Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors: how the tests
    # check them, and this dispatch, without a GPU.
    on_device = t.is_cuda or os.environ.get("TRITON_INTERPRET", "") == "1"
    if not on_device or _KERNELS_OFF or not VERIFY_KERNELS or os.environ.get("DDTREE_DISABLE_TRITON", "") not in ("", "0"):
        return None
    return _kernels()


_KERNELS_OFF: list[str] = []  # why the kernels were turned off (by `self_test`), if they were


def tree_custom_mask(tree_mask: torch.Tensor, prefix_lens: torch.Tensor, prefix_lens_cpu: list[int]) -> torch.Tensor:
    """The triton backend's TARGET_VERIFY mask, flat bool: per request a row-major [n, prefix + n]
    block (query = tree node, key = prefix then tree nodes), requests back to back. The prefix is
    visible to every node; the tree part is the builder's ancestor-or-self mask. `prefix_lens_cpu`
    is the host's copy of `prefix_lens` (it sizes the mask)."""
    kernels = _fused(tree_mask)
    if kernels is not None:
        return kernels.tree_custom_mask_triton(tree_mask, prefix_lens_cpu)
    return _tree_custom_mask_torch(tree_mask, prefix_lens, sum(prefix_lens_cpu))


def verify_input(
    tree: Any, bonus_tokens: torch.Tensor, prefix_lens: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, prefix_bound: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The v2 worker's verify input over each request's reserved row, with no host copy of the prefix lengths:
    (tokens int64 `[bs * n]`: the root (the bonus) then the tree's tokens; positions int64 `[bs * n]`: prefix +
    depth; the flat bool mask in `tree_custom_mask`'s layout, sized for a host `prefix_bound >= sum(prefix_lens)`,
    cells past the batch's own True and never read (the backend indexes by the device lengths); out_cache_loc int64
    `[bs * n]`: `req_to_token[row, prefix + i]`). On CUDA one kernel after the mask's fill."""
    kernels = _fused(tree.parents)
    if kernels is not None and req_to_token.stride(1) == 1:
        return kernels.tree_verify_input_triton(tree, bonus_tokens, prefix_lens, req_to_token, req_pool_indices,
                                                int(prefix_bound))
    return _verify_input_torch(tree, bonus_tokens, prefix_lens, req_to_token, req_pool_indices, int(prefix_bound))


def shrink_kernel(t: torch.Tensor) -> Any:
    """`ddtree_utils.shrink_tree`'s kernel for tensors like `t` (its `kernel`), or None: the torch path."""
    kernels = _fused(t)
    return None if kernels is None else kernels.shrink_tree_triton


def commit_kernel(t: torch.Tensor) -> Any:
    """The v2 commit's kernel for tensors like `t` (`ddtree_commit.commit_tree`'s `kernel`), or None: the torch path."""
    kernels = _fused(t)
    return None if kernels is None else kernels.tree_commit_triton


def _verify_input_torch(
    tree: Any, bonus_tokens: torch.Tensor, prefix_lens: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, prefix_bound: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    bs, n = tree.parents.shape
    device = tree.parents.device
    prefix = prefix_lens.to(device=device, dtype=torch.int64)
    rows = req_pool_indices.to(device=device, dtype=torch.int64)[:, None].expand(-1, n)
    cols = prefix[:, None] + torch.arange(n, device=device)
    return (tree.full_token_ids(bonus_tokens.to(device)).reshape(-1), tree.positions(prefix).reshape(-1),
            _tree_custom_mask_torch(tree.tree_mask, prefix, prefix_bound),
            req_to_token[rows, cols].to(torch.int64).reshape(-1))


def _tree_custom_mask_torch(tree_mask: torch.Tensor, prefix_lens: torch.Tensor, prefix_total: int) -> torch.Tensor:
    bs, n, _ = tree_mask.shape
    device = tree_mask.device
    prefix = prefix_lens.to(device=device, dtype=torch.int64)
    row_len = prefix + n  # [bs]
    block = n * row_len
    base = torch.cumsum(block, 0) - block  # exclusive prefix sum: start of each request's block
    out = torch.ones((prefix_total * n + bs * n * n,), dtype=torch.bool, device=device)
    r = torch.arange(n, device=device, dtype=torch.int64)
    idx = base[:, None, None] + r[None, :, None] * row_len[:, None, None] + prefix[:, None, None] + r[None, None, :]
    out[idx.reshape(-1)] = tree_mask.to(torch.bool).reshape(-1)
    return out


def pack_walk(candidates: torch.Tensor, accepted: torch.Tensor, lengths: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """int64 [bs, depth + 2], the one row per request the host copies after a walk: the accepted
    path's tokens at depth 1..depth (the root token where the path is shorter), the accept length,
    the bonus token."""
    path_tokens = candidates.to(torch.int64).gather(1, accepted.clamp(min=0))
    return torch.cat([path_tokens[:, 1:], lengths.to(torch.int64)[:, None], bonus.to(torch.int64)[:, None]], dim=1)


def greedy_walk(tree: Any, candidates: torch.Tensor, target_tokens: torch.Tensor, follow: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's tree walked along the target's argmax `target_tokens` [bs, n]; `candidates`
    [bs, n] is the root token then the tree's tokens. Returns (accepted nodes [bs, depth + 1], root
    first, -1 pad; the packed rows of `pack_walk`). `follow` is `ddtree_utils.follow_verified_tree`,
    the torch walk (passed in: this module does not import the builder's)."""
    kernels = _fused(candidates)
    if kernels is not None:
        return kernels.greedy_walk_triton(tree, candidates, target_tokens)
    return _greedy_walk_torch(tree, candidates, target_tokens, follow)


def _greedy_walk_torch(tree: Any, candidates: torch.Tensor, target_tokens: torch.Tensor, follow: Any) -> tuple[torch.Tensor, torch.Tensor]:
    accepted, lengths, bonus = follow(tree, target_tokens)
    accepted = accepted.to(torch.int64)
    return accepted, pack_walk(candidates, accepted, lengths, bonus)


def commit_slots(
    accepted: torch.Tensor, out_cache_loc: torch.Tensor, commit_lens_cpu: list[int], n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the first `commit_lens_cpu[i]` nodes of each accepted path keep.

    `accepted` [bs, depth + 1] path nodes (root first, -1 pad); `out_cache_loc` [bs * n] the verify's
    KV slots, request-major. Returns (kept slots in path order, requests back to back; the flat verify
    rows of those nodes, for their hidden states; every other slot, row-major, to free).
    """
    kernels = _fused(accepted)
    if kernels is not None:
        return kernels.commit_slots_triton(accepted, out_cache_loc, commit_lens_cpu, n)
    return _commit_slots_torch(accepted, out_cache_loc, commit_lens_cpu, n)


def _commit_slots_torch(
    accepted: torch.Tensor, out_cache_loc: torch.Tensor, commit_lens_cpu: list[int], n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bs = len(commit_lens_cpu)
    device = accepted.device
    commit_lens = torch.tensor(commit_lens_cpu, dtype=torch.int64, device=device)
    safe = accepted.clamp(min=0)
    in_commit = torch.arange(accepted.shape[1], device=device)[None, :] < commit_lens[:, None]
    # scatter_add, not scatter: padded path entries (-1, clamped to the root's 0) must not
    # overwrite the root's keep flag.
    keep_count = torch.zeros((bs, n), dtype=torch.int32, device=device)
    keep_count.scatter_add_(1, safe, in_commit.to(torch.int32))
    loc = out_cache_loc.view(bs, n)
    rows = (safe + torch.arange(bs, device=device)[:, None] * n)[in_commit]
    return loc.gather(1, safe)[in_commit], rows, loc[keep_count == 0]


def step_acceptance(tree: Any, accepted_nodes: torch.Tensor, budgets: torch.Tensor, sampled: list[int],
                    reference: Any) -> torch.Tensor:
    """auto's acceptance by budget of a step's walk, greedy and sampled rows apart: `reference` is
    `ddtree_utils.acceptance_by_kind` (passed in, as the walks' references are), the torch path of about fifteen
    small ops; on CUDA one kernel. No host sync either way."""
    kernels = _fused(accepted_nodes)
    if kernels is None:
        return reference(tree, accepted_nodes, budgets, sampled)
    kinds = None
    if sampled:
        host = torch.zeros(accepted_nodes.shape[0], dtype=torch.int64, pin_memory=accepted_nodes.is_cuda)
        host[list(sampled)] = 1
        kinds = host.to(accepted_nodes.device, non_blocking=True)
    return kernels.acceptance_by_budget_triton(tree, accepted_nodes, budgets, kinds)


def self_test(
    device: torch.device, budget: int, depth: int, build: Any, follow: Any, shrink: Any = None,
    smaller: tuple[int, ...] = (), pad_widths: tuple[int, ...] = (), walk: Any = None, acceptance: Any = None,
    commit: Any = None,
) -> str | None:
    """Run each kernel beside its torch function on random trees of this budget and depth on `device`,
    and on the first `b` nodes of them for every `b` in `smaller` (`shrink` is
    `ddtree_utils.shrink_tree`, its kernel checked on each), at their own width and padded to the full
    one (and to each of `pad_widths` that holds them: auto's smaller verify graphs), as shrunk and padded
    steps verify them:
    every width a step can take is compiled here, at start, not mid-serving. `walk` is
    `ddtree_sampling.walk_node_probs`, the sampled walk's reference (its kernel and the log-sum-exp's are
    checked where it is given); `acceptance` is `ddtree_utils.acceptance_by_kind` (auto's acceptance kernel is
    checked against it where it is given); `commit` is `ddtree_commit.commit_tree`, given by the v2 worker: its
    verify-input and commit kernels are checked against the torch path where it is given.
    None: they agree, or there are no kernels to test. Otherwise why not, and every later call takes
    the torch path: a server with a kernel this GPU or Triton gets wrong is slower, never wrong."""
    if _fused(torch.empty(0, device=device)) is None:
        return None
    kernels = _kernels()
    g = torch.Generator().manual_seed(0)
    try:
        for bs in (1, 3):
            full = build(torch.randn((bs, depth, 64), generator=g).to(device), budget)
            shapes = [(full, budget)] + [(_checked_shrink(kernels, shrink, full, b, pad=pad), b)
                                         for b in smaller for pad in (False, True)]
            shapes += [(_checked_shrink(kernels, shrink, full, b, pad=True, pad_to=w), b)
                       for b in (budget, *smaller) for w in pad_widths if b + 1 < w < budget + 1]
            for tree, b in shapes:
                where = f"batch {bs}, {b + 1} of {tree.parents.shape[1]} slots"
                accepted = _check_kernels_on(kernels, tree, b + 1, follow, g, where)
                if commit is not None:
                    _check_v2_kernels_on(kernels, tree, accepted, commit, g, where)
                if acceptance is not None:
                    _check_acceptance_on(kernels, tree, accepted, (*smaller, budget), acceptance, where)
            if walk is not None:  # a flat draft's tree is wide, a peaked one's deep: both
                for tree in (full, build(torch.randn((bs, depth, 64), generator=g).to(device) * 4, budget)):
                    _check_sampled_kernels_on(kernels, tree, walk, g, f"batch {bs}, depth {int(tree.max_depth)}")
    except Exception as e:  # noqa: BLE001 - any failure (compile, launch, mismatch) turns the kernels off
        _KERNELS_OFF.append(f"{type(e).__name__}: {e}")
        return _KERNELS_OFF[-1]
    return None


def _check_kernels_on(kernels: Any, tree: Any, kv_width: int, follow: Any, g: torch.Generator, where: str) -> torch.Tensor:
    """The mask, walk and commit kernels against the torch path on one tree; returns the torch walk's accepted nodes."""
    bs, n = tree.parents.shape
    device = tree.parents.device
    depth = int(tree.max_depth)
    cand = torch.cat([torch.randint(0, 64, (bs, 1), generator=g).to(device), tree.token_ids], 1)
    target = torch.randint(0, 64, (bs, n), generator=g).to(device)
    # most nodes' target is the token of a child: the walks go deep
    slot = torch.arange(n, device=device).expand(bs, n)
    target.scatter_(1, torch.where(tree.parents >= 0, tree.parents, slot), torch.where(tree.parents >= 0, cand, target))
    prefix_cpu = [5, 0, 1000][:bs]
    prefix = torch.tensor(prefix_cpu, device=device)
    loc = torch.randperm(bs * kv_width, generator=g).to(device) + 1
    pairs = {
        "custom mask": (kernels.tree_custom_mask_triton(tree.tree_mask, prefix_cpu),
                        _tree_custom_mask_torch(tree.tree_mask, prefix, sum(prefix_cpu))),
    }
    got_walk = kernels.greedy_walk_triton(tree, cand, target)
    want_walk = _greedy_walk_torch(tree, cand, target, follow)
    pairs["greedy walk"] = (torch.cat(got_walk, 1), torch.cat(want_walk, 1))
    commits = [int(x) + 1 for x in want_walk[1][:, depth].tolist()]
    pairs["commit"] = (torch.cat(kernels.commit_slots_triton(want_walk[0], loc, commits, kv_width)),
                       torch.cat(_commit_slots_torch(want_walk[0], loc, commits, kv_width)))
    for name, (got, want) in pairs.items():
        if not torch.equal(got, want):
            raise AssertionError(f"{name} differs from the torch path at {where}")
    return want_walk[0]


def _checked_shrink(kernels: Any, shrink: Any, full: Any, budget: int, **kw: Any) -> Any:
    """`shrink(full, budget, **kw)` (the torch path's tree, returned), after checking the shrink kernel makes the
    same tree."""
    want = shrink(full, budget, **kw)
    if want is full:  # nothing cut: the kernel is not called
        return want
    got = shrink(full, budget, kernel=kernels.shrink_tree_triton, **kw)
    if not all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(vars(got).values(), vars(want).values(), strict=True)):
        raise AssertionError(f"shrunk tree differs from the torch path at batch {full.batch_size}, budget {budget}, {kw}")
    return want


def _check_v2_kernels_on(kernels: Any, tree: Any, accepted: torch.Tensor, commit: Any, g: torch.Generator,
                         where: str) -> None:
    """The v2 worker's verify-input and commit kernels against the torch path, on `accepted` (a walk of `tree`)
    cut at random depths, over a pool whose rows are shuffled slots: the permuted pools must agree too."""
    bs, n = tree.parents.shape
    device = tree.parents.device
    depth = int(tree.max_depth)
    lengths = ((accepted >= 0).sum(1) - 1).cpu()
    lengths = torch.minimum(lengths, torch.randint(0, depth + 1, (bs,), generator=g)).to(device)
    prefix = torch.tensor([5, 0, 1000][:bs], device=device)
    rows = torch.randperm(4, generator=g)[:bs].to(device)
    pool = torch.randperm(4 * (1000 + n + 3), generator=g).view(4, -1).to(device=device, dtype=torch.int32)
    bonus = torch.randint(0, 64, (bs,), generator=g).to(device)
    bound = int(prefix.sum()) + 7
    got = kernels.tree_verify_input_triton(tree, bonus, prefix, pool, rows, bound)
    want = _verify_input_torch(tree, bonus, prefix, pool, rows, bound)
    if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
        raise AssertionError(f"v2 verify input differs from the torch path at {where}")
    block = depth + 1 + int(torch.randint(0, 3, (1,), generator=g))  # v2's own block is depth + 1
    want_pool, got_pool = pool.clone(), pool.clone()
    want = commit(tree, accepted, lengths, bonus, want_pool, rows, prefix, block)
    got = commit(tree, accepted, lengths, bonus, got_pool, rows, prefix, block, kernel=kernels.tree_commit_triton)
    pairs = [(got_pool, want_pool), (got.out_tokens, want.out_tokens), (got.commit_lens, want.commit_lens),
             (got.committed_slots, want.committed_slots)]
    pairs += [(getattr(got.kv_plan, f), getattr(want.kv_plan, f)) for f in ("hidden_rows", "positions", "cache_loc", "valid")]
    if not all(torch.equal(a, b) for a, b in pairs):
        raise AssertionError(f"v2 commit differs from the torch path at {where}")


def _check_acceptance_on(kernels: Any, tree: Any, accepted: torch.Tensor, budgets: tuple[int, ...], acceptance: Any,
                         where: str) -> None:
    """auto's acceptance kernel against the torch path on the walk `_check_kernels_on` made (all greedy, and every
    other request sampled)."""
    bs = tree.parents.shape[0]
    device = tree.parents.device
    ladder = torch.tensor(sorted({b for b in budgets if b > 0}), dtype=torch.int64, device=device)
    for sampled in ([], list(range(0, bs, 2))):
        kinds = torch.zeros(bs, dtype=torch.int64, device=device)
        kinds[sampled] = 1
        got = kernels.acceptance_by_budget_triton(tree, accepted, ladder, kinds if sampled else None)
        if not torch.equal(got, acceptance(tree, accepted, ladder, sampled)):
            raise AssertionError(f"acceptance by budget differs from the torch path at {where}")


def _check_sampled_kernels_on(kernels: Any, tree: Any, walk: Any, g: torch.Generator, where: str) -> None:
    bs, n = tree.parents.shape
    device = tree.parents.device
    # children's probabilities large enough that walks go deep, some holding a node's whole mass
    q = torch.rand((bs, n), generator=g) * 0.6
    q[torch.rand((bs, n), generator=g) < 0.1] = 1.0
    q, coins = q.to(device), torch.rand((bs, n), generator=g).to(device)
    got, want = kernels.sampled_walk_triton(tree, q, coins), walk(tree, q, coins)
    if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
        raise AssertionError(f"sampled walk differs from the torch path at {where}")
    x = (torch.randn((3, 5000), generator=g) * 4).to(device)
    x[1, :4100] = float("-inf")  # a first block banned whole
    rows, temps = torch.tensor([2, 0, 1], device=device), torch.tensor([0.7, 1.0, 1.3], device=device)
    want_lse = torch.logsumexp(x[rows] / temps[:, None], dim=-1)
    if not torch.allclose(kernels.row_logsumexp_triton(x, rows, temps), want_lse, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"row log-sum-exp differs from the torch path at {where}")


def kernels_in_use(device: torch.device) -> bool:
    return _fused(torch.empty(0, device=device)) is not None


def turn_kernels_off(reason: str) -> None:
    """Every later step takes the torch path (e.g. the kernels failed their check on another TP rank)."""
    _KERNELS_OFF.append(reason)

"""Triton kernels of a DDTree full-mode verify step (installed as
`sglang/srt/speculative/ddtree_verify_kernels.py` by the ddtree-ops payload; CUDA only, imported lazily
and guarded by `ddtree_verify_step`, whose torch functions are the reference each kernel must equal).

On a small target a verify step is host-bound: its time is the launches of a few dozen small torch ops
(bench/RESULTS.md, issue 13 call 4: the walk and commit took 1.6 ms at batch 1, the mask 0.5 ms). Each
kernel here replaces one such sequence by one launch:
  - `tree_custom_mask_triton`: the triton backend's flat TARGET_VERIFY mask (prefix ones, then the
    tree's ancestor rows), one program per (request, node, column block), no host sync;
  - `greedy_walk_triton`: the greedy walk down each tree along the target's argmax, writing the
    accepted nodes and the packed row the host copies (path tokens, accept length, bonus);
  - `commit_slots_triton`: from the accepted path and the host's commit lengths, the KV slots to keep
    (path order), the slots to free (row-major, as the torch reference frees them) and the verify
    rows whose hidden states feed the draft;
  - `shrink_tree_triton`: a tree's first nodes, padded to a verify width (auto's smaller picks), one launch
    where `ddtree_utils.shrink_tree` takes about seventeen;
  - `tree_verify_input_triton` and `tree_commit_triton`: the v2 worker's verify input (tokens, positions, slots
    and the mask, placed by the device's lengths and sized by a host bound) and its whole commit (the row segment
    permuted in place, the step's outputs, the draft-KV plan), each one launch where the torch paths take about
    fifteen and forty;
  - `row_logsumexp_triton` and `sampled_walk_triton`: a sampled walk of requests at the identity settings
    (`ddtree_sampling.tree_walk`) reads each verified node's row once for its log-sum-exp and walks the
    children's probabilities, instead of a float32 distribution per node and a chunked walk over them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MASK_COLUMNS = 1024  # mask columns per program


@triton.jit(do_not_specialize=["B"])
def _tree_mask_kernel(
    out_ptr,  # u8 flat: per request N rows of (prefix + N) columns, requests back to back
    tree_mask_ptr,  # u8 [B, N, N]
    plan_ptr,  # i64 [2, B]: prefix length, start of the request's block in out
    B,
    N: tl.constexpr,
    COLS: tl.constexpr,
):
    b = tl.program_id(0)
    i = tl.program_id(1)
    c = tl.program_id(2)
    prefix = tl.load(plan_ptr + b)
    row_len = prefix + N
    col = c * COLS + tl.arange(0, COLS)
    in_row = col < row_len
    tree_col = col - prefix
    tree_bit = tl.load(tree_mask_ptr + (b * N + i) * N + tree_col, mask=in_row & (tree_col >= 0), other=0)
    value = tl.where(tree_col < 0, 1, tree_bit).to(tl.uint8)
    tl.store(out_ptr + tl.load(plan_ptr + B + b) + i * row_len + col, value, mask=in_row)


def _mask_bits(tree_mask: torch.Tensor) -> torch.Tensor:
    """A tree's ancestor mask as the bytes the kernels read (Triton takes no bool pointers; a view costs nothing)."""
    return tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask.to(torch.uint8)


def tree_custom_mask_triton(tree_mask: torch.Tensor, prefix_lens_cpu: list[int]) -> torch.Tensor:
    """Same contract as `ddtree_verify_step.tree_custom_mask` (flat bool mask); the prefix lengths
    are the host's copy, which also places each request's block and sizes the column grid."""
    bs, n, _ = tree_mask.shape
    device = tree_mask.device
    starts, total = [], 0
    for prefix in prefix_lens_cpu:
        starts.append(total)
        total += n * (prefix + n)
    out = torch.empty((total,), dtype=torch.uint8, device=device)
    if total == 0:
        return out.view(torch.bool)
    plan = torch.tensor([list(prefix_lens_cpu), starts], dtype=torch.int64).to(device, non_blocking=True)
    bits = _mask_bits(tree_mask)
    grid = (bs, n, triton.cdiv(max(prefix_lens_cpu) + n, MASK_COLUMNS))
    _tree_mask_kernel[grid](out, bits.contiguous(), plan, bs, N=n, COLS=MASK_COLUMNS)
    return out.view(torch.bool)


@triton.jit(do_not_specialize=["B"])
def _tree_verify_input_kernel(
    mask_ptr,  # u8 flat, pre-filled with ones: per request N rows of (prefix + N) columns, requests back to back
    tokens_ptr,  # i64 [B * N] out: the root (bonus), then the tree's tokens
    positions_ptr,  # i64 [B * N] out: prefix + depth
    loc_ptr,  # i64 [B * N] out: req_to_token[row, prefix + i]
    tree_mask_ptr,  # u8 [B, N, N]
    token_ids_ptr,  # i64 [B, token_stride]: node i >= 1 has token i - 1
    depths_ptr,  # i64 [B, N]
    bonus_ptr,  # i64 [B]
    prefix_ptr,  # i64 [B]: the device's prefix lengths
    pool_ptr,  # req_to_token (int32 or int64), rows `row_stride` apart
    pool_rows_ptr,  # i64 [B]
    B,
    row_stride,
    token_stride,
    N: tl.constexpr,
    N_BLOCK: tl.constexpr,
    B_BLOCK: tl.constexpr,
):
    # One program per (request, node): the node's N tree columns of the mask (the prefix columns are the fill's
    # ones) and its token, position and slot. Each request's start in the mask is summed here from the device
    # lengths: no host copy of them, no plan launch.
    b = tl.program_id(0)
    i = tl.program_id(1)
    offs_b = tl.arange(0, B_BLOCK)
    before = tl.load(prefix_ptr + offs_b, mask=offs_b < b, other=0)
    start = tl.sum(tl.where(offs_b < b, N * (before + N), 0), axis=0)
    prefix = tl.load(prefix_ptr + b)
    col = tl.arange(0, N_BLOCK)
    bits = tl.load(tree_mask_ptr + (b * N + i) * N + col, mask=col < N, other=0)
    tl.store(mask_ptr + start + i * (prefix + N) + prefix + col, bits.to(tl.uint8), mask=col < N)
    token = tl.load(token_ids_ptr + b * token_stride + i - 1, mask=i > 0, other=0)
    tl.store(tokens_ptr + b * N + i, tl.where(i == 0, tl.load(bonus_ptr + b), token))
    tl.store(positions_ptr + b * N + i, prefix + tl.load(depths_ptr + b * N + i))
    slot = tl.load(pool_ptr + tl.load(pool_rows_ptr + b) * row_stride + prefix + i)
    tl.store(loc_ptr + b * N + i, slot.to(tl.int64))


def tree_verify_input_triton(
    tree, bonus_tokens: torch.Tensor, prefix_lens: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, prefix_bound: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `ddtree_verify_step.verify_input` (a row-major `req_to_token`): (tokens, positions, the
    flat bool mask sized for the host's `prefix_bound`, out_cache_loc), in one launch after the mask's fill."""
    bs, n, _ = tree.tree_mask.shape
    device = tree.tree_mask.device
    i64 = {"device": device, "dtype": torch.int64}
    mask = torch.ones((int(prefix_bound) * n + bs * n * n,), dtype=torch.uint8, device=device)
    tokens, positions, loc = (torch.empty((bs * n,), **i64) for _ in range(3))
    if bs and n:
        bits = _mask_bits(tree.tree_mask)
        token_ids = tree.token_ids.to(torch.int64).contiguous()
        _tree_verify_input_kernel[(bs, n)](
            mask, tokens, positions, loc, bits.contiguous(), token_ids, tree.depths.to(**i64).contiguous(),
            bonus_tokens.to(**i64).reshape(-1).contiguous(), prefix_lens.to(**i64).contiguous(), req_to_token,
            req_pool_indices.to(**i64).contiguous(), bs, req_to_token.stride(0), token_ids.shape[1],
            N=n, N_BLOCK=triton.next_power_of_2(n), B_BLOCK=triton.next_power_of_2(bs),
        )
    return tokens, positions, mask.view(torch.bool), loc


@triton.jit(do_not_specialize=["keep"])
def _shrink_kernel(
    tokens_ptr, parents_ptr, depths_ptr, scores_ptr, ranks_ptr, next_token_ptr, next_sibling_ptr, mask_ptr,
    num_nodes_ptr,  # the tree's fields: [B, N] (tokens [B, token_stride], mask [B, N, N] u8, num_nodes [B])
    o_tokens_ptr, o_parents_ptr, o_depths_ptr, o_scores_ptr, o_ranks_ptr, o_next_token_ptr, o_next_sibling_ptr,
    o_mask_ptr, o_num_nodes_ptr, o_retrive_ptr,  # out: the same at width W ([B, W - 1] tokens, [B, W, W] mask)
    keep,
    token_stride,
    pad_token,
    N: tl.constexpr,
    W: tl.constexpr,
    W_BLOCK: tl.constexpr,
):
    # One program per (request, slot) of the shrunk tree: slot i keeps its node while i < keep, else becomes
    # the builder's padding (`ddtree_utils.shrink_tree`, the reference).
    b = tl.program_id(0)
    i = tl.program_id(1)
    drop = i >= keep
    src = b * N + i
    dst = b * W + i
    token = tl.load(tokens_ptr + b * token_stride + i - 1, mask=i > 0, other=0)
    tl.store(o_tokens_ptr + b * (W - 1) + i - 1, tl.where(drop, pad_token, token), mask=i > 0)
    tl.store(o_parents_ptr + dst, tl.where(drop, -1, tl.load(parents_ptr + src)))
    tl.store(o_depths_ptr + dst, tl.where(drop, 0, tl.load(depths_ptr + src)))
    tl.store(o_scores_ptr + dst, tl.where(drop, float("-inf"), tl.load(scores_ptr + src)))
    tl.store(o_ranks_ptr + dst, tl.where(drop, -1, tl.load(ranks_ptr + src)))
    tl.store(o_retrive_ptr + dst, dst.to(tl.int64))
    # first children and next siblings have increasing indices: a link past the kept nodes is cut
    link = tl.load(next_token_ptr + src)
    tl.store(o_next_token_ptr + dst, tl.where(drop | (link >= keep), -1, link))
    link = tl.load(next_sibling_ptr + src)
    tl.store(o_next_sibling_ptr + dst, tl.where(drop | (link >= keep), -1, link))
    col = tl.arange(0, W_BLOCK)
    row = tl.load(mask_ptr + src * N + col, mask=col < W, other=0)
    tl.store(o_mask_ptr + dst * W + col, tl.where(drop, col == i, row != 0).to(tl.uint8), mask=col < W)
    if i == 0:
        tl.store(o_num_nodes_ptr + b, tl.minimum(tl.load(num_nodes_ptr + b), keep))


def shrink_tree_triton(tree, keep: int, width: int, pad_token: int) -> tuple[torch.Tensor, ...]:
    """`ddtree_utils.shrink_tree`'s tensors in one launch (its `kernel`): the first `keep` slots of `tree` at
    `width` slots per request. Returns (token_ids, parents, depths, num_nodes, tree_mask, scores, token_ranks,
    retrive_index, retrive_next_token, retrive_next_sibling)."""
    bs, n = tree.parents.shape
    device = tree.parents.device
    new = {"device": device, "dtype": torch.int64}
    tokens = torch.empty((bs, width - 1), **new)
    parents, depths, ranks, retrive, next_token, next_sibling = (torch.empty((bs, width), **new) for _ in range(6))
    scores = torch.empty((bs, width), dtype=tree.scores.dtype, device=device)
    mask = torch.empty((bs, width, width), dtype=torch.uint8, device=device)
    num_nodes = torch.empty((bs,), dtype=tree.num_nodes.dtype, device=device)
    if bs:
        source = tree.token_ids.contiguous()
        bits = _mask_bits(tree.tree_mask)
        _shrink_kernel[(bs, width)](
            source, tree.parents.contiguous(), tree.depths.contiguous(), tree.scores.contiguous(),
            tree.token_ranks.contiguous(), tree.retrive_next_token.contiguous(),
            tree.retrive_next_sibling.contiguous(), bits.contiguous(), tree.num_nodes.contiguous(),
            tokens, parents, depths, scores, ranks, next_token, next_sibling, mask, num_nodes, retrive,
            int(keep), source.shape[1], int(pad_token), N=n, W=width, W_BLOCK=triton.next_power_of_2(width),
        )
    return (tokens, parents, depths, num_nodes, mask.view(torch.bool), scores, ranks, retrive, next_token,
            next_sibling)


@triton.jit
def _greedy_walk_kernel(
    cand_ptr,  # i64 [B, N]: the root token, then the tree's tokens
    target_ptr,  # i64 [B, N]: the target's argmax at every node
    parents_ptr,  # i64 [B, N]
    num_nodes_ptr,  # i64 [B]
    accepted_ptr,  # i64 [B, D + 1] out: nodes by depth, -1 pad
    packed_ptr,  # i64 [B, D + 2] out: path tokens (depth 1..D, root token as pad), length, bonus
    N: tl.constexpr,
    D: tl.constexpr,
    N_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    offs = tl.arange(0, N_BLOCK)
    in_row = offs < N
    valid = in_row & (offs < tl.load(num_nodes_ptr + b))
    parent = tl.load(parents_ptr + b * N + offs, mask=in_row, other=-1)
    token = tl.load(cand_ptr + b * N + offs, mask=in_row, other=-1)
    root_token = tl.load(cand_ptr + b * N)
    cur = tl.program_id(0) * 0  # int32 scalar 0: the root
    length = cur
    tl.store(accepted_ptr + b * (D + 1), cur.to(tl.int64))
    for d in range(D):
        want = tl.load(target_ptr + b * N + cur)
        # Siblings carry distinct tokens: at most one child of `cur` matches. Once no child matched,
        # cur and its target stay the same, so nothing matches in later rounds either.
        hit = valid & (parent == cur) & (token == want)
        nxt = tl.max(tl.where(hit, offs, -1), axis=0)
        found = nxt >= 0
        cur = tl.where(found, nxt, cur)
        length += found.to(tl.int32)
        tl.store(accepted_ptr + b * (D + 1) + d + 1, tl.where(found, nxt, -1).to(tl.int64))
        path_token = tl.load(cand_ptr + b * N + tl.maximum(nxt, 0))
        tl.store(packed_ptr + b * (D + 2) + d, tl.where(found, path_token, root_token))
    tl.store(packed_ptr + b * (D + 2) + D, length.to(tl.int64))
    tl.store(packed_ptr + b * (D + 2) + D + 1, tl.load(target_ptr + b * N + cur))


def greedy_walk_triton(tree, candidates: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `ddtree_verify_step.greedy_walk`: (accepted [bs, D + 1], packed [bs, D + 2])."""
    bs, n = candidates.shape
    depth = int(tree.max_depth)
    device = candidates.device
    accepted = torch.empty((bs, depth + 1), dtype=torch.int64, device=device)
    packed = torch.empty((bs, depth + 2), dtype=torch.int64, device=device)
    if bs:
        _greedy_walk_kernel[(bs,)](
            candidates.to(torch.int64).contiguous(), target_tokens.to(torch.int64).contiguous(),
            tree.parents.contiguous(), tree.num_nodes.contiguous(), accepted, packed,
            N=n, D=depth, N_BLOCK=triton.next_power_of_2(n),
        )
    return accepted, packed


@triton.jit(do_not_specialize=["B"])
def _commit_kernel(
    accepted_ptr,  # i64 [B, D1]: path nodes by depth, -1 pad
    loc_ptr,  # i64 [B * N]: the verify's KV slots
    plan_ptr,  # i64 [3, B]: commit length, start in the kept list, start in the freed list
    kept_ptr,  # i64 [sum(commit)] out
    rows_ptr,  # i64 [sum(commit)] out: flat verify rows of the committed nodes
    freed_ptr,  # i64 [B * N - sum(commit)] out
    B,
    N: tl.constexpr,
    D1: tl.constexpr,
    D1_BLOCK: tl.constexpr,
    N_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    commit = tl.load(plan_ptr + b)
    keep_at = tl.load(plan_ptr + B + b)
    free_at = tl.load(plan_ptr + 2 * B + b)
    offs_d = tl.arange(0, D1_BLOCK)
    in_commit = offs_d < commit
    node = tl.load(accepted_ptr + b * D1 + offs_d, mask=offs_d < D1, other=-1)
    node = tl.where(in_commit, node, -1)
    row = b * N + tl.maximum(node, 0)
    tl.store(kept_ptr + keep_at + offs_d, tl.load(loc_ptr + row, mask=in_commit, other=0), mask=in_commit)
    tl.store(rows_ptr + keep_at + offs_d, row.to(tl.int64), mask=in_commit)
    offs_n = tl.arange(0, N_BLOCK)
    kept = tl.max((offs_n[:, None] == node[None, :]).to(tl.int32), axis=1) > 0
    free = (offs_n < N) & ~kept
    rank = tl.cumsum(free.to(tl.int32), axis=0) - free.to(tl.int32)
    slots = tl.load(loc_ptr + b * N + offs_n, mask=free, other=0)
    tl.store(freed_ptr + free_at + rank, slots, mask=free)


def commit_slots_triton(
    accepted: torch.Tensor, out_cache_loc: torch.Tensor, commit_lens_cpu: list[int], n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `ddtree_verify_step.commit_slots`: (kept slots, hidden rows, freed slots)."""
    bs, d1 = accepted.shape
    device = accepted.device
    keep_at, free_at, kept_total = [], [], 0
    for i, c in enumerate(commit_lens_cpu):
        keep_at.append(kept_total)
        free_at.append(i * n - kept_total)
        kept_total += c
    plan = torch.tensor([list(commit_lens_cpu), keep_at, free_at], dtype=torch.int64).to(device, non_blocking=True)
    freed_total = bs * n - kept_total
    # One element at least: a step that commits every node (budget = depth, all accepted) frees
    # nothing, and an empty tensor has no device pointer to hand a kernel.
    kept = torch.empty((max(1, kept_total),), dtype=torch.int64, device=device)
    rows = torch.empty((max(1, kept_total),), dtype=torch.int64, device=device)
    freed = torch.empty((max(1, freed_total),), dtype=torch.int64, device=device)
    if bs:
        _commit_kernel[(bs,)](
            accepted.contiguous(), out_cache_loc.to(torch.int64).contiguous(), plan, kept, rows, freed, bs,
            N=n, D1=d1, D1_BLOCK=triton.next_power_of_2(d1), N_BLOCK=triton.next_power_of_2(n),
        )
    return kept[:kept_total].to(out_cache_loc.dtype), rows[:kept_total], freed[:freed_total].to(out_cache_loc.dtype)


@triton.jit
def _tree_commit_kernel(
    accepted_ptr,  # i64 [B, W]: path nodes by depth, root first (entries past the accept length not read)
    lengths_ptr,  # i64 [B]: accepted draft tokens
    bonus_ptr,  # i64 [B]
    tokens_ptr,  # i64 [B, token_stride]: node i >= 1 has token i - 1
    retrive_ptr,  # i64 [B, retrive_stride]: node -> flat verify row
    pool_ptr,  # req_to_token (int32 or int64), rows `row_stride` apart: permuted in place
    pool_rows_ptr,  # i64 [B]: each request's req_to_token row
    prefix_ptr,  # i64 [B]
    out_tokens_ptr,  # i64 [B, BLOCK] out
    commit_lens_ptr,  # i64 [B] out
    committed_ptr,  # pool dtype [B, N] out: the permuted segments
    hidden_rows_ptr,  # i64 [B * BLOCK] out
    positions_ptr,  # i64 [B * BLOCK] out
    cache_loc_ptr,  # i64 [B * BLOCK] out
    valid_ptr,  # u8 [B * BLOCK] out
    row_stride,
    token_stride,
    retrive_stride,
    N: tl.constexpr,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
    N_BLOCK: tl.constexpr,
    W_BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    length = tl.load(lengths_ptr + b)
    prefix = tl.load(prefix_ptr + b)
    segment = pool_ptr + tl.load(pool_rows_ptr + b) * row_stride + prefix
    # Each node's destination in the segment: a path node goes to its depth, the others follow the path in
    # ascending node order (as `ddtree_commit.commit_order`).
    offs_w = tl.arange(0, W_BLOCK)
    in_path = (offs_w < W) & (offs_w <= length)
    path = tl.load(accepted_ptr + b * W + offs_w, mask=in_path, other=-1)
    offs_n = tl.arange(0, N_BLOCK)
    in_tree = offs_n < N
    hit = (offs_n[:, None] == path[None, :]) & in_path[None, :]
    depth = tl.max(tl.where(hit, offs_w[None, :], -1), axis=1)
    off_path = in_tree & (depth < 0)
    rank = tl.cumsum(off_path.to(tl.int32), axis=0) - off_path.to(tl.int32)
    dest = tl.where(depth >= 0, depth, length + 1 + rank)
    slots = tl.load(segment + offs_n, mask=in_tree, other=0)
    # The outputs by depth k (`ddtree_commit.step_outputs` / `draft_kv_write_plan`); entries past the commit
    # repeat the root's. Every read of the segment happens before the barrier below.
    k = tl.arange(0, K_BLOCK)
    in_block = k < BLOCK
    valid = in_block & (k <= length)
    node = tl.load(accepted_ptr + b * W + k, mask=valid & (k < W), other=0)
    tl.store(hidden_rows_ptr + b * BLOCK + k, tl.load(retrive_ptr + b * retrive_stride + node, mask=in_block, other=0),
             mask=in_block)
    tl.store(positions_ptr + b * BLOCK + k, prefix + tl.where(valid, k, 0), mask=in_block)
    tl.store(cache_loc_ptr + b * BLOCK + k, tl.load(segment + node, mask=in_block, other=0).to(tl.int64),
             mask=in_block)
    tl.store(valid_ptr + b * BLOCK + k, valid.to(tl.uint8), mask=in_block)
    before_bonus = k < length
    child = tl.load(accepted_ptr + b * W + k + 1, mask=before_bonus, other=1)
    token = tl.load(tokens_ptr + b * token_stride + child - 1, mask=before_bonus, other=0)
    token = tl.where(k == length, tl.load(bonus_ptr + b), token)
    tl.store(out_tokens_ptr + b * BLOCK + k, token, mask=in_block)
    tl.store(commit_lens_ptr + b, length + 1)
    # The permutation is in place: no thread may store a slot another has yet to read.
    tl.debug_barrier()
    tl.store(segment + dest, slots, mask=in_tree)
    tl.store(committed_ptr + b * N + dest, slots, mask=in_tree)


def tree_commit_triton(
    tree, accepted_nodes: torch.Tensor, accept_lengths: torch.Tensor, bonus_tokens: torch.Tensor,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, block: int,
) -> tuple[torch.Tensor, ...]:
    """`ddtree_commit.commit_tree` in one launch, for a row-major `req_to_token` (the caller checks the block
    first): (out_tokens, commit_lens, committed slots, and the draft-KV plan's hidden_rows, positions, cache_loc,
    valid), each as the torch commit returns it."""
    bs, n = tree.parents.shape
    width = accepted_nodes.shape[1]
    device = accepted_nodes.device
    i64 = {"device": device, "dtype": torch.int64}
    out_tokens = torch.empty((bs, block), **i64)
    commit_lens = torch.empty((bs,), **i64)
    committed = torch.empty((bs, n), dtype=req_to_token.dtype, device=device)
    hidden_rows, positions, cache_loc = (torch.empty((bs * block,), **i64) for _ in range(3))
    valid = torch.empty((bs * block,), dtype=torch.uint8, device=device)
    tokens = tree.token_ids.to(torch.int64).contiguous()
    retrive = tree.retrive_index.to(**i64).contiguous()
    if bs:
        _tree_commit_kernel[(bs,)](
            accepted_nodes.to(torch.int64).contiguous(), accept_lengths.to(**i64).contiguous(),
            bonus_tokens.to(**i64).contiguous(), tokens, retrive, req_to_token,
            req_pool_indices.to(**i64).contiguous(), prefix_lens.to(**i64).contiguous(), out_tokens, commit_lens,
            committed, hidden_rows, positions, cache_loc, valid, req_to_token.stride(0), tokens.shape[1],
            retrive.shape[1],
            N=n, W=width, BLOCK=block, N_BLOCK=triton.next_power_of_2(n),
            W_BLOCK=triton.next_power_of_2(width), K_BLOCK=triton.next_power_of_2(block),
        )
    return out_tokens, commit_lens, committed, hidden_rows, positions, cache_loc, valid.view(torch.bool)


@triton.jit
def _row_lse_kernel(
    x_ptr,  # [rows, V] logits, any float dtype, rows `stride` apart
    rows_ptr,  # i64 [R]: the rows to reduce
    temps_ptr,  # f32 [R]
    out_ptr,  # f32 [R] out: logsumexp(x[row] / temperature)
    V,
    stride,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    base = x_ptr + tl.load(rows_ptr + r) * stride
    temp = tl.load(temps_ptr + r)
    # A finite start: a block of -inf logits (a logit bias or grammar ban) then adds exp(-inf) = 0, never a NaN.
    m = tl.max(tl.full((BLOCK,), -1e30, tl.float32), axis=0)
    s = m * 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp
        new_m = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    tl.store(out_ptr + r, m + tl.log(s))


def row_logsumexp_triton(x: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Same contract as `ddtree_sampling._row_logsumexp`: float32 `logsumexp(x[rows] / temperatures)` per row."""
    out = torch.empty((rows.shape[0],), dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _row_lse_kernel[(rows.shape[0],)](
            x, rows.to(torch.int64).contiguous(), temperatures.to(torch.float32).contiguous(), out,
            x.shape[1], x.stride(0), BLOCK=4096,
        )
    return out


@triton.jit
def _sampled_walk_kernel(
    q_ptr,  # f32 [B, N]: node i's token's probability under its parent's distribution
    coins_ptr,  # f32 [B, N]: one coin per node, used at the node it belongs to
    parents_ptr,  # i64 [B, N]
    num_nodes_ptr,  # i64 [B]
    accepted_ptr,  # i64 [B, D + 1] out: nodes by depth, -1 pad
    lengths_ptr,  # i64 [B] out
    last_ptr,  # i64 [B] out: the node the walk stopped at
    N: tl.constexpr,
    D: tl.constexpr,
    N_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    offs = tl.arange(0, N_BLOCK)
    in_row = offs < N
    valid = in_row & (offs < tl.load(num_nodes_ptr + b))
    parent = tl.load(parents_ptr + b * N + offs, mask=in_row, other=-1)
    q = tl.load(q_ptr + b * N + offs, mask=in_row, other=0.0)
    cur = tl.program_id(0) * 0  # int32 scalar 0: the root
    length = cur
    tl.store(accepted_ptr + b * (D + 1), cur.to(tl.int64))
    for d in range(D):
        # Once no child was taken, cur stays and its coin is the one that took none: no later round moves.
        child = valid & (parent == cur)
        q_child = tl.where(child, q, 0.0)
        ok = child & ((tl.load(coins_ptr + b * N + cur) <= tl.cumsum(q_child, axis=0)) | (q_child >= 1.0))
        nxt = tl.min(tl.where(ok, offs, N_BLOCK), axis=0)
        found = nxt < N_BLOCK
        cur = tl.where(found, nxt, cur)
        length += found.to(tl.int32)
        tl.store(accepted_ptr + b * (D + 1) + d + 1, tl.where(found, nxt, -1).to(tl.int64))
    tl.store(lengths_ptr + b, length.to(tl.int64))
    tl.store(last_ptr + b, cur.to(tl.int64))


def sampled_walk_triton(tree, node_probs: torch.Tensor, coins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `ddtree_sampling.walk_node_probs`: (accepted [bs, D + 1], lengths [bs], last node [bs])."""
    bs, n = tree.parents.shape
    depth = int(tree.max_depth)
    device = node_probs.device
    accepted = torch.empty((bs, depth + 1), dtype=torch.int64, device=device)
    lengths = torch.empty((bs,), dtype=torch.int64, device=device)
    last = torch.empty((bs,), dtype=torch.int64, device=device)
    if bs:
        _sampled_walk_kernel[(bs,)](
            node_probs.to(torch.float32).contiguous(), coins.to(torch.float32).contiguous(),
            tree.parents.contiguous(), tree.num_nodes.contiguous(), accepted, lengths, last,
            N=n, D=depth, N_BLOCK=triton.next_power_of_2(n),
        )
    return accepted, lengths, last


@triton.jit(do_not_specialize=["B", "N", "D", "K"])
def _acceptance_kernel(
    accepted_ptr,  # i64 [B, D + 1]: the walk's nodes by depth, root first, -1 pad
    ranks_ptr,  # i64 [B, N]: each node's token's rank at its position (0: the draft's top-1)
    budgets_ptr,  # i64 [K]
    kinds_ptr,  # i64 [B]: 1 for a sampled request (read only with HAS_KINDS)
    out_ptr,  # f32 [2, K + 1] out: greedy row, sampled row; each the budgets' counts, then the chain's
    B,
    N,
    D,
    K,
    D_BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr,
    HAS_KINDS: tl.constexpr,
):
    # One program for the batch: a few dozen requests of a few path nodes each, summed in a fixed order.
    d = tl.arange(0, D_BLOCK)
    k = tl.arange(0, K_BLOCK)
    in_path = d < D
    budgets = tl.load(budgets_ptr + k, mask=k < K, other=-1)
    counts0 = tl.zeros((K_BLOCK,), dtype=tl.int32)
    counts1 = tl.zeros((K_BLOCK,), dtype=tl.int32)
    chain0 = tl.program_id(0) * 0
    chain1 = chain0
    for b in range(B):
        node = tl.load(accepted_ptr + b * (D + 1) + 1 + d, mask=in_path, other=-1)
        on_path = node > 0
        within = (node[:, None] <= budgets[None, :]) & on_path[:, None]
        counts = tl.sum(within.to(tl.int32), axis=0)
        rank = tl.load(ranks_ptr + b * N + tl.maximum(node, 0), mask=in_path, other=1)
        # the leading path nodes that are the draft's top-1: the first position that is not, or D
        chain = tl.min(tl.where(on_path & (rank == 0), D, d), axis=0)
        sampled = 0
        if HAS_KINDS:
            sampled = tl.load(kinds_ptr + b)
        counts0 += tl.where(sampled == 0, counts, 0)
        counts1 += tl.where(sampled != 0, counts, 0)
        chain0 += tl.where(sampled == 0, chain, 0)
        chain1 += tl.where(sampled != 0, chain, 0)
    tl.store(out_ptr + k, counts0.to(tl.float32), mask=k < K)
    tl.store(out_ptr + K, chain0.to(tl.float32))
    tl.store(out_ptr + (K + 1) + k, counts1.to(tl.float32), mask=k < K)
    tl.store(out_ptr + (K + 1) + K, chain1.to(tl.float32))


def acceptance_by_budget_triton(tree, accepted_nodes: torch.Tensor, budgets: torch.Tensor,
                                kinds: torch.Tensor | None) -> torch.Tensor:
    """Same contract as `ddtree_utils.acceptance_by_budget` with `kinds` int64 [bs] on the device (1: sampled;
    None: every request greedy): float32 [2, K + 1]."""
    bs, width = accepted_nodes.shape
    k = int(budgets.numel())
    device = accepted_nodes.device
    out = torch.empty((2, k + 1), dtype=torch.float32, device=device)
    ranks = tree.token_ranks.contiguous()
    _acceptance_kernel[(1,)](
        accepted_nodes.to(torch.int64).contiguous(), ranks, budgets.to(device=device, dtype=torch.int64).contiguous(),
        accepted_nodes if kinds is None else kinds.contiguous(), out, bs,
        N=ranks.shape[1], D=width - 1, K=k, D_BLOCK=triton.next_power_of_2(max(width - 1, 1)),
        K_BLOCK=triton.next_power_of_2(max(k, 1)), HAS_KINDS=kinds is not None,
    )
    return out

"""The v2 commit of a verified DDTree (installed as `sglang/srt/speculative/ddtree_commit.py` by the
ddtree-ops payload): what a `DFlashWorkerV2` step does after the tree walk, on the device, with no host
round trip (bench/gpu/V2_WORKER.md §1.3).

The v2 worker verifies node `i` of a request's tree (`n = 1 + budget` nodes, the root is node 0) at row
position `prefix + i` of its already reserved `req_to_token` row. Committing the accepted path then
moves no KV and frees nothing: it permutes that row segment so the path's slots come first, in path
order (root, then the accepted nodes by depth), and the other slots follow in ascending node order.
Every slot stays the request's; the tail past the committed length is overwritten by the next step,
as DFLASH's own v2 step leaves its rejected block tail. The outputs follow DFLASH's contract
(`out_tokens [bs, block]`, `commit_lens = accept_lengths + 1`), and the draft KV is written from the
path nodes' hidden-state rows at positions `prefix + depth` into the permuted slots.

Inputs are what `ddtree_utils.follow_verified_tree` (or `ddtree_sampling.tree_walk`) returns:
`accepted_nodes` int64 `[bs, max_depth + 1]` (root 0 first, then the path by depth, `-1` padding) and
`accept_lengths` int64 `[bs]` (accepted draft tokens, root and bonus excluded). Only
`accepted_nodes[:, : accept_lengths + 1]` is read, so a walk's padding value does not matter.

Everything is plain torch, batched, loop-free (tests/test_ddtree_commit.py checks the source): no
`.cpu()`, `.item()` or `.tolist()`, no Python loop over requests, no host sequence lengths. Shapes
(Python ints from tensor metadata) are the only host values read. Works the same on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "KVWritePlan",
    "TreeCommit",
    "commit_order",
    "commit_tree",
    "draft_kv_write_plan",
    "permute_row_segments",
    "step_outputs",
]


def _path_mask(accepted_nodes: torch.Tensor, accept_lengths: torch.Tensor) -> torch.Tensor:
    """bool `[bs, max_depth + 1]`: True for the path's entries (depth `0 .. accept_lengths`)."""
    depth = torch.arange(accepted_nodes.shape[1], device=accepted_nodes.device)
    return depth[None, :] <= accept_lengths.to(torch.int64)[:, None]


def _check_block(tree: Any, block: int) -> int:
    """The tree's depth, after checking its longest commit (`max_depth + 1` tokens) fits DFLASH's
    `block`-wide rows. Python ints only: a truncated path would lose tokens silently, so refuse instead."""
    max_depth = int(tree.max_depth)
    if max_depth + 1 > block:
        raise ValueError(
            f"a DDTree of depth {max_depth} commits up to {max_depth + 1} tokens, more than the block of {block}"
        )
    return max_depth


def commit_order(tree: Any, accepted_nodes: torch.Tensor, accept_lengths: torch.Tensor) -> torch.Tensor:
    """int64 `[bs, n]`, each row a permutation of `0 .. n-1`: entry `k` is the node (its segment position
    before the commit, where it was verified) whose slot goes to segment position `k`.

    The path's nodes come first, by depth (`order[:, 0] == 0`, the root), then every other node position
    in ascending order, padding included, so a tree with fewer than `n` valid nodes still gives a full
    permutation (the segment keeps all its slots). `tree` is a `ddtree_utils.DDTree` (only its width
    `n = tree.parents.shape[1]` is read).
    """
    n = tree.parents.shape[1]
    bs, width = accepted_nodes.shape
    device = accepted_nodes.device
    on_path_entry = _path_mask(accepted_nodes, accept_lengths)
    # Destination of every node: a path node goes to its depth; the others keep their relative order
    # after the path (commit_len + how many off-path nodes precede them). A cumsum, not a sort: exact,
    # no tie order to depend on. Padded path entries are sent to a dummy column n and dropped.
    nodes = torch.where(on_path_entry, accepted_nodes.to(torch.int64), n)
    depth = torch.arange(width, dtype=torch.int64, device=device).expand(bs, -1)
    path_dest = torch.full((bs, n + 1), -1, dtype=torch.int64, device=device)
    path_dest.scatter_(1, nodes, torch.where(on_path_entry, depth, -1))
    path_dest = path_dest[:, :n]
    off_path = path_dest < 0
    commit_lens = accept_lengths.to(torch.int64)[:, None] + 1
    dest = torch.where(off_path, commit_lens + off_path.cumsum(1) - 1, path_dest)
    order = torch.empty((bs, n), dtype=torch.int64, device=device)
    order.scatter_(1, dest, torch.arange(n, dtype=torch.int64, device=device).expand(bs, -1))
    return order


def _segment_index(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) int64 `[bs, n]` of each request's verify segment in `req_to_token`."""
    device = req_to_token.device
    rows = req_pool_indices.to(device=device, dtype=torch.int64)[:, None].expand(-1, n)
    cols = prefix_lens.to(device=device, dtype=torch.int64)[:, None] + torch.arange(n, device=device)
    return rows, cols


def permute_row_segments(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, order: torch.Tensor
) -> torch.Tensor:
    """Apply `order` in place: `req_to_token[r, prefix + k] <- old req_to_token[r, prefix + order[k]]` for
    `r = req_pool_indices[b]`, `prefix = prefix_lens[b]`, `k < n = order.shape[1]`.

    Gather then scatter (advanced indexing), so the pool's dtype (int32 or int64) is kept and nothing
    else in it is touched: other rows, and positions outside each segment. The rows must be distinct
    (one per request, as a batch's are) and every segment must lie inside the reserved row
    (`prefix + n <= row width`; the v2 reservation guarantees it, and checking would cost a sync).
    Returns the permuted segments `[bs, n]` (pool dtype): the committed slots first, in path order.
    """
    rows, cols = _segment_index(req_to_token, req_pool_indices, prefix_lens, order.shape[1])
    committed = req_to_token[rows, cols].gather(1, order.to(device=req_to_token.device, dtype=torch.int64))
    req_to_token[rows, cols] = committed
    return committed


def step_outputs(
    tree: Any,
    accepted_nodes: torch.Tensor,
    accept_lengths: torch.Tensor,
    bonus_tokens: torch.Tensor,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DFLASH v2's step outputs: (`out_tokens` int64 `[bs, block]`, `commit_lens` int64 `[bs]`).

    `out_tokens[b]` holds the accepted nodes' tokens by depth, then the bonus token, then zeros (the
    scheduler reads the first `commit_lens[b]` entries of each `block`-wide row);
    `commit_lens = accept_lengths + 1`. A path holds at most `max_depth + 1` tokens, so this needs
    `tree.max_depth + 1 <= block` (true for a tree drafted from a block: depth = block - 1); it is
    checked on the Python ints, and a larger tree raises `ValueError` rather than truncate a path.
    """
    max_depth = _check_block(tree, block)
    bs = accepted_nodes.shape[0]
    device = accepted_nodes.device
    lengths = accept_lengths.to(torch.int64)
    # Node tokens with the root at column 0 (its token is the previous bonus, not emitted again).
    node_tokens = torch.cat(
        [torch.zeros((bs, 1), dtype=torch.int64, device=device), tree.token_ids.to(torch.int64)], 1
    )
    path = accepted_nodes[:, 1:].to(torch.int64)  # depth 1 .. max_depth
    on_path = _path_mask(path, lengths - 1)
    tokens = torch.where(on_path, node_tokens.gather(1, torch.where(on_path, path, 0)), 0)
    out_tokens = torch.zeros((bs, block), dtype=torch.int64, device=device)
    out_tokens[:, :max_depth] = tokens
    out_tokens.scatter_(1, lengths[:, None], bonus_tokens.to(torch.int64)[:, None])
    return out_tokens, lengths + 1


@dataclass
class KVWritePlan:
    """Where the draft KV of the committed positions comes from and goes, laid out like `out_tokens`:
    entry `b * block + k` is request `b`'s committed token `k` (depth `k` on the path). All flat int64
    `[bs * block]`; `valid` bool says which entries are committed (`k < commit_lens[b]`).

      hidden_rows  the path node's row in the verify batch's `[bs * n]` hidden states (`b * n + node`,
                   `tree.retrive_index`'s convention).
      positions    `prefix_lens[b] + k`.
      cache_loc    the committed slot: the permuted segment's entry `k`, i.e. the slot at which that node
                   was verified.
      valid        `k < commit_lens[b]`.

    Entries past a request's commit repeat its root entry (row `b * n`, position `prefix`, the root's
    slot), so a caller that writes every entry without the mask writes the root's KV twice with the
    same data: harmless. Padded rather than packed by `commit_lens`, because packing needs the total on
    the host.
    """

    hidden_rows: torch.Tensor
    positions: torch.Tensor
    cache_loc: torch.Tensor
    valid: torch.Tensor


def draft_kv_write_plan(
    tree: Any,
    accepted_nodes: torch.Tensor,
    accept_lengths: torch.Tensor,
    prefix_lens: torch.Tensor,
    committed_slots: torch.Tensor,
    block: int,
) -> KVWritePlan:
    """The draft-KV write of one committed step (see `KVWritePlan`).

    `committed_slots` `[bs, n]`: the permuted segments `permute_row_segments` returns (or the row read
    back after the commit). `block >= tree.max_depth + 1`, the same width as `step_outputs`.
    """
    _check_block(tree, block)
    bs, n = tree.parents.shape
    device = accepted_nodes.device
    width = accepted_nodes.shape[1]
    lengths = accept_lengths.to(device=device, dtype=torch.int64)
    depth = torch.arange(block, dtype=torch.int64, device=device)[None, :].expand(bs, -1)
    valid = depth <= lengths[:, None]
    # Path nodes by depth, padded to `block`; entries past the path become the root (node 0, depth 0).
    nodes = torch.zeros((bs, block), dtype=torch.int64, device=device)
    nodes[:, :width] = accepted_nodes.to(torch.int64)
    nodes = torch.where(valid, nodes, 0)
    k = torch.where(valid, depth, 0)
    hidden_rows = tree.retrive_index.to(device=device, dtype=torch.int64).gather(1, nodes)
    positions = prefix_lens.to(device=device, dtype=torch.int64)[:, None] + k
    # k <= accept_length < n for a committed entry, and 0 otherwise: in range even when n < block.
    cache_loc = committed_slots.to(device=device, dtype=torch.int64).gather(1, k)
    return KVWritePlan(
        hidden_rows=hidden_rows.reshape(-1),
        positions=positions.reshape(-1),
        cache_loc=cache_loc.reshape(-1),
        valid=valid.reshape(-1),
    )


@dataclass
class TreeCommit:
    """One v2 step's commit: `out_tokens` / `commit_lens` for the scheduler, the permuted segments
    (`committed_slots`, pool dtype `[bs, n]`) and the draft-KV write plan."""

    out_tokens: torch.Tensor
    commit_lens: torch.Tensor
    committed_slots: torch.Tensor
    kv_plan: KVWritePlan


def commit_tree(
    tree: Any,
    accepted_nodes: torch.Tensor,
    accept_lengths: torch.Tensor,
    bonus_tokens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    block: int,
    kernel: Any = None,
) -> TreeCommit:
    """The whole commit in order: outputs (checks the block first, before the pool is touched), the
    permutation applied to `req_to_token` in place, then the draft-KV plan over the permuted slots.

    `kernel` (`ddtree_verify_step.commit_kernel`'s answer: on CUDA `tree_commit_triton`) does all of it in one
    launch for a row-major pool; the start-up self-test holds it to these torch functions."""
    if kernel is not None and req_to_token.stride(1) == 1:
        _check_block(tree, block)
        out_tokens, commit_lens, committed, rows, positions, cache_loc, valid = kernel(
            tree, accepted_nodes, accept_lengths, bonus_tokens, req_to_token, req_pool_indices, prefix_lens, block)
        plan = KVWritePlan(hidden_rows=rows, positions=positions, cache_loc=cache_loc, valid=valid)
        return TreeCommit(out_tokens=out_tokens, commit_lens=commit_lens, committed_slots=committed, kv_plan=plan)
    out_tokens, commit_lens = step_outputs(tree, accepted_nodes, accept_lengths, bonus_tokens, block)
    order = commit_order(tree, accepted_nodes, accept_lengths)
    committed = permute_row_segments(req_to_token, req_pool_indices, prefix_lens, order)
    plan = draft_kv_write_plan(tree, accepted_nodes, accept_lengths, prefix_lens, committed, block)
    return TreeCommit(out_tokens=out_tokens, commit_lens=commit_lens, committed_slots=committed, kv_plan=plan)

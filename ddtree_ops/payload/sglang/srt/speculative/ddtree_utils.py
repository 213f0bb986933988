"""DDTree: draft-tree construction and the verify walk for DFlash speculative decoding.

Installed on hosts as ``sglang/srt/speculative/ddtree_utils.py``. Imports only torch; Triton is used,
when importable and the logits live on a CUDA device, for the fused top-k pass and the one-launch tree
selection in ``ddtree_kernels.py``. The module imports and works fully on CPU without Triton.

Algorithm (exact, batched, no host-device sync)
-----------------------------------------------
DFlash gives, for each of ``depth`` future positions, logits over the vocabulary. Let
``lp[d, v] = logits[d, v] - logsumexp(logits[d])`` (float32). A node at depth ``d`` is a token path
``(t_1 .. t_d)`` where ``t_k`` is among the ``K`` best tokens of position ``k``
(``K = min(topk_cap or budget, budget, vocab)``) and its score is the float32 left-to-right sum
``((lp[1,t_1] + lp[2,t_2]) + ...)``. The tree keeps the ``budget`` best nodes. Because every ``lp`` is
``<= 0`` a prefix never scores below its extensions, so the selection is prefix-closed.

Route: at each depth keep the best ``budget`` prefixes of that length (extend the previous depth's beam
by the top-K tokens, keep the best ``budget``), then keep the best ``budget`` over all depths.
Log-probs are clamped to ``<= 0`` wherever they enter (rounding can push one a hair above), so the
prefix-closure holds by construction, not by arithmetic luck. Only
pairs (beam position ``i``, token rank ``j``) with ``(i+1)*(j+1) <= budget`` can make a depth's cut,
because every pair (i' <= i, j' <= j) ranks at least as high, so about ``budget * ln(budget)``
candidates are scored per depth instead of ``budget * K``.

Order (deterministic tie-breaking) -- the total order on nodes, best first:
  1. higher score first;
  2. on equal score, smaller depth first (so a parent always precedes its child);
  3. on equal score and depth, the node whose parent comes earlier in this order first, and under the
     same parent the lower token rank first. Token rank at a position orders tokens by float32 logit
     descending (equivalently log-prob descending), then token id ascending.
A best-first heap keyed ``(-score, depth, pop index of parent, token rank)`` pops in exactly this
order, which is how the tests' oracle reproduces it. Nodes scoring ``-inf`` (a token with ``-inf``
logit anywhere on the path) are unreachable and never selected, so a tree may hold fewer than
``1 + budget`` nodes; ``num_nodes`` says how many, and the rest is padding (see ``DDTree``).
Logits must be finite or ``-inf``; NaN or ``+inf`` give undefined trees. A position whose logits are all
``-inf`` has no token (log-probs ``-inf``): it and every deeper position are unreachable.

Node numbering: node 0 is the root (the previous bonus token, not in the budget), nodes
``1 .. num_nodes-1`` follow the order above, so parents precede children; padding comes last.

Keep-chain (``keep_chain=True``, ``--speculative-ddtree-keep-chain``)
-------------------------------------------------------------------
The chain is the draft's top-1 path: at every depth the rank-0 token (logit desc, token id asc) --
what linear DFLASH verifies. A keep-chain tree holds the whole chain (``depth`` nodes, so it needs
``budget >= depth``) and fills the rest of the budget best-first: the chain plus the best
``budget - depth`` non-chain nodes in the order above. Every node on the chain is in the tree, so the
verify walk accepts at least as many tokens as linear DFLASH on the same draft, for any target.
Prefix-closed: a non-chain node's parent is on the chain or a non-chain node ranked above it.
Derived from the standard tree, which holds a prefix of ``c`` chain nodes (scores do not increase
along a path, parents rank before children) and, ranked first among its non-chain nodes, the best
non-chain ones: keep the chain prefix and the first ``budget - depth`` non-chain nodes, then append
the ``depth - c`` missing chain nodes by depth (``keep_top1_chain``, plain torch, batched, no
host-device sync; the Triton path's tree is post-processed by the same code). The appended nodes
come last among the valid nodes; each ranks below every node of the standard tree, so the node
order is still the order above restricted to the kept nodes. Their ``scores`` are their cumulative
log-probs, their ``token_ranks`` 0. Unreachable chain nodes (a chain score of ``-inf``: only where a
whole logits row is ``-inf``, which makes that depth and every deeper one unreachable) are not added;
the budget left by them is filled best-first too (which is nothing deeper than that row).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DDTree",
    "DDTreeRefused",
    "PAD_TOKEN_ID",
    "build_ddtree",
    "follow_verified_tree",
    "full_mode_refusal",
    "hybrid_kind",
    "hybrid_refusal",
    "hybrid_support",
    "is_hybrid_model",
    "keep_top1_chain",
    "proven_hybrids",
    "uses_windowed_attention",
    "select_tree_from_topk",
    "shrink_tree",
    "topk_logprobs",
]

# Padding nodes carry a real token id so that the verify forward pass can embed them.
PAD_TOKEN_ID = 0

_LOW32 = 0xFFFFFFFF


@dataclass
class DDTree:
    """A batch of draft trees, every tensor on the draft logits' device.

    ``batch`` requests, ``budget`` non-root nodes at most, ``n = 1 + budget`` verify slots each.

    Fields:
      token_ids     int64 ``[batch, budget]``: node ``i >= 1`` has token ``token_ids[:, i-1]``; the
                    root's token is the previous bonus token, which the caller holds. Padding
                    slots hold ``PAD_TOKEN_ID``.
      parents       int64 ``[batch, n]``: parent node index; the root and padding have ``-1``.
      depths        int64 ``[batch, n]``: root 0, a node at draft position ``d`` (1-based) has ``d``;
                    padding 0.
      num_nodes     int64 ``[batch]``: valid nodes including the root (``1 .. n``); slots
                    ``i >= num_nodes`` are padding.
      tree_mask     bool ``[batch, n, n]``: ``tree_mask[b, i, j]`` is True when node ``i`` may attend
                    to node ``j`` (``j`` is ``i`` or one of its ancestors). A padding row attends
                    only to itself, so no row is empty. The committed prefix (KV cache) is not in
                    this mask: every valid node also attends to all of it.
      scores        float32 ``[batch, n]``: cumulative draft log-prob (root 0, padding ``-inf``).
      token_ranks   int64 ``[batch, n]``: rank of the node's token among its position's top-K
                    (0 = best); root and padding ``-1``.
      retrive_index int64 ``[batch, n]``: SGLang convention, node -> flat row in the verify batch,
                    ``b * n + i`` (the verify batch lays out each request's ``n`` slots contiguously).
      retrive_next_token   int64 ``[batch, n]``: first child (the smallest-index child), ``-1`` if none.
      retrive_next_sibling int64 ``[batch, n]``: next sibling in increasing node index, ``-1`` if
                    none. Padding is never linked. These are what SGLang's ``verify_tree_greedy`` /
                    ``tree_speculative_sampling_target_only`` walk (with ``candidates`` = root token
                    followed by ``token_ids``, and ``num_speculative_tokens = max_depth + 1``).
      budget, max_depth    python ints: the node budget and the draft depth (logits' dim 1).
    Positions: node ``i`` sits at ``prefix_len + depths[:, i]`` (see ``positions``).
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    num_nodes: torch.Tensor
    tree_mask: torch.Tensor
    scores: torch.Tensor
    token_ranks: torch.Tensor
    retrive_index: torch.Tensor
    retrive_next_token: torch.Tensor
    retrive_next_sibling: torch.Tensor
    budget: int
    max_depth: int

    @property
    def batch_size(self) -> int:
        return self.parents.shape[0]

    @property
    def valid(self) -> torch.Tensor:
        """bool ``[batch, n]``: True for real nodes (root included), False for padding."""
        n = self.parents.shape[1]
        return torch.arange(n, device=self.parents.device)[None, :] < self.num_nodes[:, None]

    def positions(self, prefix_lens: torch.Tensor) -> torch.Tensor:
        """int64 ``[batch, n]`` absolute positions: ``prefix_lens[:, None] + depths``.

        ``prefix_lens[b]`` is the number of tokens already in request ``b``'s KV cache, i.e. the root
        (the previous bonus token, not yet in the cache) sits at position ``prefix_lens[b]`` --
        SGLang's ``seq_lens`` in ``build_tree_kernel_efficient``. Padding gets the root's position.
        """
        return prefix_lens.to(torch.int64).view(-1, 1) + self.depths

    def full_token_ids(self, root_tokens: torch.Tensor) -> torch.Tensor:
        """int64 ``[batch, n]``: root token then ``token_ids`` (SGLang's per-request ``candidates``)."""
        return torch.cat([root_tokens.to(torch.int64).view(-1, 1), self.token_ids], dim=1)


# --------------------------------------------------------------------------------------------------
# Sort keys: one int64 per element whose descending order is (value desc, index asc). Unique keys make
# torch.topk deterministic, on CPU and CUDA alike, without a stable sort of the whole row.
# --------------------------------------------------------------------------------------------------


def _monotone_int32(x: torch.Tensor) -> torch.Tensor:
    """int32 whose signed order equals the float32 order of ``x`` (-0.0 folded onto +0.0)."""
    bits = (x.float() + 0.0).view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _float_from_monotone(key: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_monotone_int32`` (the transform is an involution)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).view(torch.float32)


def _sort_keys(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 keys: high half the value's monotone bits, low half ``2**32-1 - index``."""
    # Multiply rather than shift: left-shifting negative integers is not portable.
    return _monotone_int32(values).to(torch.int64) * (_LOW32 + 1) + (_LOW32 - index.to(torch.int64))


def _decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = _float_from_monotone(torch.div(keys, _LOW32 + 1, rounding_mode="floor").to(torch.int32))
    index = _LOW32 - (keys & _LOW32)
    return values, index


def _effective_cap(budget: int, vocab: int, topk_cap: int | None) -> int:
    cap = budget if topk_cap is None else int(topk_cap)
    if cap < 1:
        raise ValueError(f"topk_cap must be >= 1 or None, got {topk_cap}")
    return max(1, min(cap, budget, vocab))


def topk_logprobs(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` log-probs per position, ordered (float32 logit desc, token id asc).

    Returns ``(values float32 [batch, depth, k], token ids int64 [batch, depth, k])`` with
    ``values = logits - logsumexp(logits)`` in float32. Ranking by the logit rather than the log-prob
    is the same order (the shift is monotone) except that two logits which round to one log-prob stay
    distinct, which lets the Triton pass rank tokens before it knows the log-sum-exp.
    Plain torch; works on any device.
    """
    logits = draft_logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    vocab_index = torch.arange(logits.shape[-1], device=logits.device)
    keys = torch.topk(_sort_keys(logits, vocab_index), k, dim=-1, sorted=True).values
    top_logits, top_ids = _decode_keys(keys)
    # Clamped: float32 rounding of the log-sum-exp can put a near-certain token a hair above 0, and
    # prefix-closure of the selection rests on every log-prob being <= 0. A row of only -inf logits
    # has no token (-inf log-probs, not -inf - -inf = NaN).
    values = torch.where(lse > float("-inf"), top_logits - lse, float("-inf"))
    return values.clamp_(max=0.0), top_ids


def _pair_table(budget: int, cap: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(beam position i, token rank j) pairs with (i+1)(j+1) <= budget, ordered by i then j."""
    pair_i, pair_j = [], []
    for i in range(budget):
        for j in range(min(cap, budget // (i + 1))):
            pair_i.append(i)
            pair_j.append(j)
    return (
        torch.tensor(pair_i, dtype=torch.int64, device=device),
        torch.tensor(pair_j, dtype=torch.int64, device=device),
    )


_PAIR_CACHE: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _pairs(budget: int, cap: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Cached per device: building the table is a host loop and a copy, which must stay out of the
    # hot path (and out of CUDA graph capture after the first call).
    key = (budget, cap, str(device))
    if key not in _PAIR_CACHE:
        _PAIR_CACHE[key] = _pair_table(budget, cap, device)
    return _PAIR_CACHE[key]


def select_tree_from_topk(topv: torch.Tensor, topi: torch.Tensor, budget: int) -> DDTree:
    """Build the trees from per-position top-K log-probs (plain torch, any device).

    ``topv`` float32 ``[batch, depth, K]`` sorted as ``topk_logprobs`` returns (``-inf`` = no token),
    ``topi`` int64 token ids, ``1 <= K <= budget``. See the module docstring for the order.
    """
    batch, depth, cap = topv.shape
    device = topv.device
    n = budget + 1
    if budget == 0 or depth == 0:
        return _root_only_tree(batch, budget, depth, device)

    pair_i, pair_j = _pairs(budget, cap, device)
    pair_index = torch.arange(pair_i.numel(), device=device)
    cand_lp = topv[:, :, pair_j].clamp(max=0.0)  # [batch, depth, P]; <= 0 keeps it prefix-closed

    beam_score = torch.full((batch, budget), float("-inf"), device=device)
    beam_score[:, 0] = 0.0  # the root is the only prefix of length 0
    scores, parent_pos, ranks = [], [], []
    for d in range(depth):  # loop over draft positions (<= 15), never over nodes
        cand = beam_score[:, pair_i] + cand_lp[:, d]
        keys = torch.topk(_sort_keys(cand, pair_index), budget, dim=-1, sorted=True).values
        beam_score, chosen = _decode_keys(keys)
        scores.append(beam_score)
        parent_pos.append(pair_i[chosen])
        ranks.append(pair_j[chosen])
    all_scores = torch.stack(scores, 1).reshape(batch, depth * budget)  # (depth, pos) order
    all_parent_pos = torch.stack(parent_pos, 1).reshape(batch, depth * budget)
    all_ranks = torch.stack(ranks, 1).reshape(batch, depth * budget)
    flat_index = torch.arange(depth * budget, device=device)

    # Global cut: (score desc, depth asc, beam position asc) == (score desc, flat index asc).
    keys = torch.topk(_sort_keys(all_scores, flat_index), budget, dim=-1, sorted=True).values
    sel_score, sel_flat = _decode_keys(keys)
    valid = sel_score > float("-inf")
    num_nodes = 1 + valid.sum(-1)
    sel_depth = sel_flat // budget  # 0-based draft position

    node_index = torch.arange(1, n, device=device).expand(batch, -1)
    # node_of[flat] = node index of a selected (depth, pos), -1 elsewhere; one extra dump column.
    node_of = torch.full((batch, depth * budget + 1), -1, dtype=torch.int64, device=device)
    node_of.scatter_(1, torch.where(valid, sel_flat, depth * budget), node_index)
    sel_parent_pos = all_parent_pos.gather(1, sel_flat)
    parent_flat = ((sel_depth - 1) * budget + sel_parent_pos).clamp(min=0)
    parent_node = torch.where(sel_depth == 0, 0, node_of.gather(1, parent_flat))
    sel_rank = all_ranks.gather(1, sel_flat)
    sel_token = topi.reshape(batch, depth * cap).gather(1, sel_depth * cap + sel_rank)

    minus_one = torch.full((batch, 1), -1, dtype=torch.int64, device=device)
    token_ids = torch.where(valid, sel_token, PAD_TOKEN_ID)
    parents = torch.cat([minus_one, torch.where(valid, parent_node, -1)], 1)
    depths = torch.cat([torch.zeros_like(minus_one), torch.where(valid, sel_depth + 1, 0)], 1)
    scores_out = torch.cat(
        [torch.zeros((batch, 1), device=device), torch.where(valid, sel_score, float("-inf"))], 1
    )
    token_ranks = torch.cat([minus_one, torch.where(valid, sel_rank, -1)], 1)
    return _finish_tree(token_ids, parents, depths, num_nodes, scores_out, token_ranks, budget, depth)


def keep_top1_chain(tree: DDTree, topv: torch.Tensor, topi: torch.Tensor) -> DDTree:
    """The keep-chain tree from the standard tree of the same ``topv`` / ``topi`` (see the module
    docstring): the whole top-1 chain plus the best ``budget - depth`` non-chain nodes.

    ``tree``: ``select_tree_from_topk(topv, topi, budget)`` or the Triton selection of the same
    inputs, ``budget >= depth``. Plain torch on the tree's device, batched, no host-device sync.
    Kept nodes keep their order (and token, depth, score, rank); the missing chain nodes follow them
    by depth, then padding.
    """
    batch, n = tree.parents.shape
    budget, depth = tree.budget, tree.max_depth
    if depth == 0 or budget == 0:
        return tree
    if budget < depth:
        raise ValueError(f"keep_chain needs budget >= depth, got budget {budget} < depth {depth}")
    device = tree.parents.device
    i64 = torch.int64
    slots = torch.arange(n, device=device).expand(batch, -1)
    valid = tree.valid

    # The chain: rank-0 tokens, scores summed left to right in float32 as the selection sums them.
    chain_tokens = topi[:, :, 0].to(i64)  # [batch, depth]
    chain_lp = topv[:, :, 0].float().clamp(max=0.0)
    sums, acc = [], torch.zeros((batch,), dtype=torch.float32, device=device)
    for d in range(depth):
        acc = acc + chain_lp[:, d]
        sums.append(acc)
    chain_scores = torch.stack(sums, 1)
    chain_len = (chain_scores > float("-inf")).sum(-1)  # reachable chain nodes (NaN counts as not)

    # Chain nodes already in the tree: rank 0 under a chain parent (parents precede children).
    on_chain = slots == 0
    parent_slot = tree.parents.clamp(min=0)
    rank0 = valid & (tree.token_ranks == 0)
    for d in range(1, depth + 1):
        on_chain = on_chain | (rank0 & (tree.depths == d) & on_chain.gather(1, parent_slot))
    in_tree = on_chain.sum(-1) - 1  # c: the tree's chain prefix length, <= chain_len

    # Keep the chain prefix and the first budget - chain_len non-chain nodes.
    off_chain = valid & ~on_chain
    kept = on_chain | (off_chain & (off_chain.cumsum(-1) <= (budget - chain_len)[:, None]))
    new_of_old = torch.where(kept, kept.cumsum(-1) - 1, -1)  # old slot -> new slot
    n_kept = kept.sum(-1)
    num_nodes = n_kept + (chain_len - in_tree)
    # old_of_new[j]: the old slot moved to j (kept slots), -1 for appended chain nodes and padding.
    old_of_new = torch.full((batch, n + 1), -1, dtype=i64, device=device)
    old_of_new.scatter_(1, torch.where(kept, new_of_old, n), slots)
    old_of_new = old_of_new[:, :n]

    # New slot of the chain node at each depth 0..depth (-1 where unreachable).
    levels = torch.arange(depth + 1, device=device).expand(batch, -1)
    chain_old = torch.full((batch, depth + 2), -1, dtype=i64, device=device)
    chain_old.scatter_(1, torch.where(on_chain & valid, tree.depths, depth + 1), slots)
    chain_old = chain_old[:, : depth + 1]
    appended_slot = n_kept[:, None] + levels - in_tree[:, None] - 1
    chain_new = torch.where(
        levels <= in_tree[:, None],
        new_of_old.gather(1, chain_old.clamp(min=0)),
        torch.where(levels <= chain_len[:, None], appended_slot, -1),
    )

    is_kept = old_of_new >= 0
    is_appended = ~is_kept & (slots < num_nodes[:, None])
    src = old_of_new.clamp(min=0)
    # Appended slot j holds the chain node at depth in_tree + 1 + (j - n_kept).
    app_depth = (slots - n_kept[:, None] + in_tree[:, None] + 1).clamp(1, depth)
    old_parent = tree.parents.gather(1, src)
    kept_parent = torch.where(old_parent >= 0, new_of_old.gather(1, old_parent.clamp(min=0)), -1)
    root_pad = torch.full((batch, 1), PAD_TOKEN_ID, dtype=i64, device=device)
    node_tokens = torch.cat([root_pad, tree.token_ids], 1)

    def pick(old: torch.Tensor, appended: torch.Tensor, pad: float | int) -> torch.Tensor:
        return torch.where(is_kept, old, torch.where(is_appended, appended, pad))

    tokens = pick(node_tokens.gather(1, src), chain_tokens.gather(1, app_depth - 1), PAD_TOKEN_ID)
    parents = pick(kept_parent, chain_new.gather(1, app_depth - 1), -1)
    depths = pick(tree.depths.gather(1, src), app_depth, 0)
    scores = pick(tree.scores.gather(1, src), chain_scores.gather(1, app_depth - 1), float("-inf"))
    ranks = pick(tree.token_ranks.gather(1, src), torch.zeros_like(src), -1)
    return _finish_tree(tokens[:, 1:].contiguous(), parents, depths, num_nodes, scores, ranks, budget, depth)


def _root_only_tree(batch: int, budget: int, depth: int, device: torch.device) -> DDTree:
    n = budget + 1
    parents = torch.full((batch, n), -1, dtype=torch.int64, device=device)
    scores = torch.full((batch, n), float("-inf"), device=device)
    scores[:, 0] = 0.0
    return _finish_tree(
        torch.full((batch, budget), PAD_TOKEN_ID, dtype=torch.int64, device=device),
        parents,
        torch.zeros((batch, n), dtype=torch.int64, device=device),
        torch.ones(batch, dtype=torch.int64, device=device),
        scores,
        parents.clone(),
        budget,
        depth,
    )


def _finish_tree(
    token_ids: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    num_nodes: torch.Tensor,
    scores: torch.Tensor,
    token_ranks: torch.Tensor,
    budget: int,
    depth: int,
) -> DDTree:
    """Mask and SGLang's retrive_* arrays from the parent pointers (plain torch)."""
    batch, n = parents.shape
    device = parents.device
    slots = torch.arange(n, device=device).expand(batch, -1)
    valid = slots < num_nodes[:, None]
    # Ancestor chain walk, one step per depth level: the root and padding point to themselves.
    step_parent = torch.where(parents >= 0, parents, slots)
    tree_mask = torch.zeros((batch, n, n), dtype=torch.bool, device=device)
    cur = slots
    for _ in range(depth + 1):
        tree_mask.scatter_(2, cur.unsqueeze(-1), True)
        cur = step_parent.gather(1, cur)

    # First child = smallest child index; siblings in increasing index. Sorting (parent, index) groups
    # siblings; padding and the root sort to the end under parent n.
    is_child = valid & (parents >= 0)
    group = torch.where(is_child, parents, n)
    order = torch.argsort(group * (n + 1) + slots, dim=1)
    sorted_group = group.gather(1, order)
    next_same = torch.cat(
        [
            sorted_group[:, 1:] == sorted_group[:, :-1],
            torch.zeros((batch, 1), dtype=torch.bool, device=device),
        ],
        1,
    )
    next_node = torch.cat([order[:, 1:], torch.full((batch, 1), -1, device=device, dtype=torch.int64)], 1)
    sibling_sorted = torch.where(next_same & (sorted_group < n), next_node, -1)
    retrive_next_sibling = torch.full((batch, n), -1, dtype=torch.int64, device=device)
    retrive_next_sibling.scatter_(1, order, sibling_sorted)
    first_in_group = torch.cat(
        [
            torch.ones((batch, 1), dtype=torch.bool, device=device),
            sorted_group[:, 1:] != sorted_group[:, :-1],
        ],
        1,
    )
    is_first = first_in_group & (sorted_group < n)
    retrive_next_token = torch.full((batch, n + 1), -1, dtype=torch.int64, device=device)
    retrive_next_token.scatter_(1, torch.where(is_first, sorted_group, n), torch.where(is_first, order, -1))
    retrive_next_token = retrive_next_token[:, :n].contiguous()
    retrive_index = torch.arange(batch * n, device=device, dtype=torch.int64).view(batch, n)
    return DDTree(
        token_ids=token_ids,
        parents=parents,
        depths=depths,
        num_nodes=num_nodes,
        tree_mask=tree_mask,
        scores=scores,
        token_ranks=token_ranks,
        retrive_index=retrive_index,
        retrive_next_token=retrive_next_token,
        retrive_next_sibling=retrive_next_sibling,
        budget=budget,
        max_depth=depth,
    )


_KERNELS: list = []  # [module] once loaded, [None] once known to be unavailable


def _kernels():
    """The Triton kernels module beside this file, or None (no Triton, or disabled by env)."""
    if not _KERNELS:
        try:
            if __package__:
                from . import ddtree_kernels as module
            else:  # loaded by file path (tests, benchmarks): load the sibling the same way
                import importlib.util
                from pathlib import Path

                path = Path(__file__).with_name("ddtree_kernels.py")
                spec = importlib.util.spec_from_file_location("ddtree_kernels_" + __name__, path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
        except Exception:  # triton missing or broken (not only ImportError): the torch path is exact too
            module = None
        _KERNELS.append(module)
    return _KERNELS[0]


def _use_triton(draft_logits: torch.Tensor) -> bool:
    if not draft_logits.is_cuda or os.environ.get("DDTREE_DISABLE_TRITON", "") not in ("", "0"):
        return False
    return _kernels() is not None


def build_ddtree(
    draft_logits: torch.Tensor, budget: int, topk_cap: int | None = None, keep_chain: bool = False
) -> DDTree:
    """Select, per request, the ``budget`` draft-tree nodes with the highest cumulative log-prob.

    ``draft_logits``: ``[batch, depth, vocab]`` any float dtype (depth = block size - 1 positions
    after the bonus token). ``budget``: non-root nodes (``>= 0``; 0 gives a root-only tree).
    ``topk_cap``: at most this many candidate tokens per position (``None`` = ``min(budget, vocab)``).
    ``keep_chain``: the draft's top-1 chain is always in the tree and the rest of the budget is
    filled best-first (module docstring, "Keep-chain"); needs ``budget >= depth`` (``ValueError``).
    Returns a ``DDTree`` on the logits' device. Exactly the best-first heap's result, with the
    deterministic tie order of the module docstring. No host-device synchronisation.

    On CUDA with Triton the top-k pass and the selection run as fused kernels (``ddtree_kernels``);
    there the row log-sum-exp is computed by the kernel, so scores can differ from the torch path in
    the last float32 bit, which can only reorder nodes whose scores tie to within that rounding.
    Set ``DDTREE_DISABLE_TRITON=1`` to force the plain torch path.
    """
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [batch, depth, vocab], got {tuple(draft_logits.shape)}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    batch, depth, vocab = draft_logits.shape
    if keep_chain and budget < depth:
        raise ValueError(
            f"keep_chain needs budget >= depth (the whole top-1 chain), got budget {budget} < depth {depth}"
        )
    if budget == 0 or depth == 0 or vocab == 0:
        return _root_only_tree(batch, budget, depth, draft_logits.device)
    cap = _effective_cap(budget, vocab, topk_cap)
    if _use_triton(draft_logits):
        kernels, du = _kernels(), sys.modules[__name__]
        topv, topi = kernels.topk_logprobs_triton(du, draft_logits, cap)
        tree = kernels.select_tree_triton(du, topv, topi, budget)
    else:
        topv, topi = topk_logprobs(draft_logits, cap)
        tree = select_tree_from_topk(topv, topi, budget)
    return keep_top1_chain(tree, topv, topi) if keep_chain else tree


def shrink_tree(tree: DDTree, budget: int, *, pad: bool, pad_to: int | None = None, kernel: Any = None) -> DDTree:
    """The first ``budget`` non-root nodes of ``tree``; the rest become padding.

    Nodes are numbered in the best-first order, which does not depend on the budget, and parents
    precede children, so for a standard tree this is exactly the tree ``build_ddtree`` makes at the
    smaller budget (same cap; tests/test_ddtree_builder.py checks it). A keep-chain tree appends
    its missing chain nodes last, so its prefix is the standard tree's prefix and may not hold the
    whole chain. Any such prefix is ancestor-closed: a valid tree to verify.

    ``pad=False``: ``1 + budget`` slots per request, as ``build_ddtree(.., budget)`` returns.
    ``pad=True``: the original width (or ``pad_to``, between ``1 + budget`` and it: a smaller verify
    graph's), the slots past ``1 + budget`` in the builder's padding form (the verify CUDA graphs' width,
    for a step that cannot afford the whole tree). Plain torch, elementwise, no host-device
    synchronisation; ``kernel`` (``ddtree_verify_step.shrink_kernel``'s answer: on CUDA
    ``shrink_tree_triton``) makes the same tensors in one launch.
    """
    n = tree.parents.shape[1]
    keep = int(budget) + 1
    if keep >= n:
        return tree
    width = (n if pad_to is None else max(keep, min(n, int(pad_to)))) if pad else keep
    budget_out = tree.budget if width == n else width - 1
    if kernel is not None:
        fields = kernel(tree, keep, width, PAD_TOKEN_ID)
        return DDTree(*fields, budget=budget_out, max_depth=tree.max_depth)
    batch = tree.batch_size
    device = tree.parents.device
    slots = torch.arange(width, device=device)
    drop = (slots >= keep)[None, :]

    def cut(links: torch.Tensor) -> torch.Tensor:
        # First children and next siblings have increasing indices: a link past the kept nodes
        # means every later one is past them too.
        links = links[:, :width]
        return torch.where(drop | (links >= keep), -1, links)

    eye = torch.eye(width, dtype=torch.bool, device=device)
    return DDTree(
        token_ids=tree.token_ids[:, : width - 1].masked_fill(drop[:, 1:], PAD_TOKEN_ID),
        parents=tree.parents[:, :width].masked_fill(drop, -1),
        depths=tree.depths[:, :width].masked_fill(drop, 0),
        num_nodes=tree.num_nodes.clamp(max=keep),
        tree_mask=torch.where(drop[:, :, None], eye, tree.tree_mask[:, :width, :width]),
        scores=tree.scores[:, :width].masked_fill(drop, float("-inf")),
        token_ranks=tree.token_ranks[:, :width].masked_fill(drop, -1),
        retrive_index=torch.arange(batch * width, device=device, dtype=torch.int64).view(batch, width),
        retrive_next_token=cut(tree.retrive_next_token),
        retrive_next_sibling=cut(tree.retrive_next_sibling),
        budget=budget_out,
        max_depth=tree.max_depth,
    )


def follow_verified_tree(
    tree: DDTree, target_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree along the target's choices.

    ``target_tokens`` int ``[batch, n]``: the target's token at every node slot -- the argmax of the
    target logits at that node (T = 0) or a sample from them (T > 0); padding slots are ignored.
    Starting at the root, the walk moves to the child whose token equals the target's token at the
    current node, and stops where no child matches; that node's target token is the bonus token.

    Returns ``(accepted_nodes, accept_lengths, bonus_tokens)``:
      accepted_nodes int64 ``[batch, max_depth + 1]``: node indices on the accepted path by depth,
                     ``[:, 0]`` is the root (0), then the accepted draft nodes, padded with ``-1``.
                     Flat rows in the verify batch: ``tree.retrive_index.gather(1, nodes.clamp(0))``.
      accept_lengths int64 ``[batch]``: accepted *draft* tokens, excluding the root and the bonus
                     (0 .. max_depth). The step emits ``accept_lengths + 1`` tokens: the accepted
                     nodes' tokens, then the bonus. This is DFlash's ``correct_len`` (SGLang's
                     ``compute_dflash_correct_drafts_and_bonus``, ``req.spec_num_correct_drafts``);
                     SGLang's reported ``spec_accept_length`` is the mean of ``accept_lengths + 1``
                     (``spec_num_accept_tokens = num_correct_drafts + bs`` per verify step).
      bonus_tokens   int64 ``[batch]``: the target's token at the last accepted node.
    Lossless: the emitted tokens are the target's own choices at each step; siblings carry distinct
    tokens, so at most one child matches. No host-device synchronisation.
    """
    batch, n = tree.parents.shape
    target = target_tokens.to(torch.int64)
    device = target.device
    valid = tree.valid
    parent_target = target.gather(1, tree.parents.clamp(min=0))
    node_tokens = torch.cat([torch.full((batch, 1), -1, dtype=torch.int64, device=device), tree.token_ids], 1)
    matches = (node_tokens == parent_target) & valid
    matches[:, 0] = True
    # A node is on the accepted path iff every node on its root path (its mask row) matches.
    path_ok = ~(tree.tree_mask & ~matches[:, None, :]).any(-1) & valid
    accept_lengths = path_ok.sum(-1) - 1
    slots = torch.arange(n, device=device).expand(batch, -1)
    accepted = torch.full((batch, tree.max_depth + 2), -1, dtype=torch.int64, device=device)
    accepted.scatter_(
        1, torch.where(path_ok, tree.depths, tree.max_depth + 1), torch.where(path_ok, slots, -1)
    )
    accepted = accepted[:, : tree.max_depth + 1].contiguous()
    last = accepted.gather(1, accept_lengths.view(-1, 1))
    bonus_tokens = target.gather(1, last).view(-1)
    return accepted, accept_lengths, bonus_tokens


def acceptance_by_budget(tree: DDTree, accepted_nodes: torch.Tensor, budgets: torch.Tensor,
                         sampled: torch.Tensor | None = None) -> torch.Tensor:
    """What smaller trees would have accepted on this step (``ddtree_auto_budget``), summed over the batch's
    greedy requests (row 0) and its sampled ones (row 1).

    ``accepted_nodes`` as ``follow_verified_tree`` returns it; ``budgets`` int64 ``[k]``; ``sampled`` bool
    ``[batch]`` (None: every request greedy). Returns float32 ``[2, k + 1]``: for each budget ``b`` the
    accepted path's nodes among the first ``b`` (the budget-``b`` tree's accepted tokens: nodes are numbered
    best-first whatever the budget, and indices increase along a path), then the leading path nodes that are
    their position's top-1 draft token (the chain's; a lower bound where the path ends on the chain and this
    tree lacks the chain's next node). No host sync.
    """
    path = accepted_nodes[:, 1:]
    on_path = path > 0
    within = (path[:, :, None] <= budgets.to(path.device)[None, None, :]) & on_path[:, :, None]
    per_budget = within.sum(dim=1)
    ranks = tree.token_ranks.gather(1, path.clamp(min=0))
    chain = ((ranks == 0) & on_path).to(torch.int64).cumprod(dim=1).sum(dim=1, keepdim=True)
    per_request = torch.cat([per_budget, chain], dim=1).to(torch.float32)
    kind = (torch.zeros(path.shape[0], dtype=torch.int64, device=path.device) if sampled is None
            else sampled.to(device=path.device, dtype=torch.int64))
    out = torch.zeros((2, per_request.shape[1]), dtype=torch.float32, device=path.device)
    return out.index_add_(0, kind, per_request)


def acceptance_by_kind(tree: DDTree, accepted_nodes: torch.Tensor, budgets: torch.Tensor,
                       sampled: list[int]) -> torch.Tensor:
    """``acceptance_by_budget`` with the batch's sampled requests given by their indices (empty: all greedy); the
    mask is made on the host and copied from pinned memory in stream order (a pageable copy waits for the GPU)."""
    mask = None
    if sampled:
        mask = torch.zeros(accepted_nodes.shape[0], dtype=torch.bool, pin_memory=accepted_nodes.is_cuda)
        mask[list(sampled)] = True
        mask = mask.to(accepted_nodes.device, non_blocking=True)
    return acceptance_by_budget(tree, accepted_nodes, budgets, mask)


class HostCopy:
    """A small device tensor copied to the host in stream order, without a host sync: `queue` returns the host
    copy, readable once a later host read on the same stream has synchronised (v1's walk reads its packed
    result right after). Reading the device tensor itself at the step's end (`tolist`) waited for everything
    queued by then, the step's tail included: a second host stall a step that fixed budgets do not have. One
    pinned buffer, reused: the caller reads it before the next `queue`."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None

    def queue(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_cuda:
            return t
        if self._host is None or self._host.shape != t.shape or self._host.dtype != t.dtype:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host.copy_(t, non_blocking=True)
        return self._host


# --------------------------------------------------------------------------------------------------
# Hybrid (recurrent-state) model detection from a Hugging Face config.json
# --------------------------------------------------------------------------------------------------

_HYBRID_MODEL_TYPES = {
    "qwen3_next": "Qwen3-Next (Gated DeltaNet linear attention)",
    "qwen3_5": "Qwen3.5 hybrid (Gated DeltaNet linear attention)",
    "qwen3_5_moe": "Qwen3.5 MoE hybrid (Gated DeltaNet linear attention)",
    "qwen3_5_text": "Qwen3.5 hybrid (Gated DeltaNet linear attention)",
    "qwen3_5_moe_text": "Qwen3.5 MoE hybrid (Gated DeltaNet linear attention)",
    "qwen3_6": "Qwen3.6 hybrid (Gated DeltaNet linear attention)",
    "qwen3_6_moe": "Qwen3.6 MoE hybrid (Gated DeltaNet linear attention)",
    "jamba": "Jamba (Mamba layers)",
    "nemotron_h": "Nemotron-H (Mamba-2 layers)",
    "falcon_h1": "Falcon-H1 (Mamba-2 heads)",
    "granitemoehybrid": "Granite 4 hybrid (Mamba-2 layers)",
    "kimi_linear": "Kimi-Linear (KDA linear attention)",
    "lfm2": "LFM2 (short convolution layers)",
    "lfm2_moe": "LFM2 MoE (short convolution layers)",
    "lfm2_vl": "LFM2-VL (short convolution layers)",
    "mamba": "Mamba (state-space model)",
    "mamba2": "Mamba-2 (state-space model)",
    "falcon_mamba": "Falcon-Mamba (state-space model)",
    "zamba": "Zamba (Mamba layers)",
    "zamba2": "Zamba2 (Mamba-2 layers)",
    "bamba": "Bamba (Mamba-2 layers)",
    "plamo2": "PLaMo 2 (Mamba layers)",
    "minimax": "MiniMax (lightning linear attention)",
    "minimax_text_01": "MiniMax-Text-01 (lightning linear attention)",
    "minimax_m1": "MiniMax-M1 (lightning linear attention)",
    "recurrent_gemma": "RecurrentGemma (RG-LRU recurrent layers)",
    "rwkv": "RWKV (recurrent)",
    "rwkv7": "RWKV-7 (recurrent)",
    "hymba": "Hymba (Mamba heads)",
    "xlstm": "xLSTM (recurrent)",
}

_HYBRID_ARCH_MARKERS = (
    "Qwen3Next",
    "Qwen3_5",
    "Qwen3_6",
    "Jamba",
    "NemotronH",
    "FalconH1",
    "FalconMamba",
    "GraniteMoeHybrid",
    "KimiLinear",
    "Lfm2",
    "Mamba",
    "Zamba",
    "Bamba",
    "Plamo2",
    "MiniMaxText01",
    "MiniMaxM1",
    "RecurrentGemma",
    "Rwkv",
    "Hymba",
    "xLSTM",
)

# layer_types values that are plain (softmax) attention and keep no recurrent state.
_ATTENTION_LAYER_TYPES = {
    "full_attention",
    "sliding_attention",
    "attention",
    "chunked_attention",
    "global_attention",
    "local_attention",
    "swa",
    "full",
    "sliding_window",
    "hybrid_attention",  # attention with a sliding/full split, still softmax attention
}

# Top-level keys that only recurrent / linear-attention layers carry.
_HYBRID_KEY_PREFIXES = (
    "mamba_",
    "ssm_",
    "linear_attn",
    "linear_conv",
    "linear_num_",
    "linear_key_head",
    "linear_value_head",
    "hybrid_override_pattern",
    "full_attention_interval",
    "conv_l_cache",
    "attn_layer_period",
    "lru_width",
    "block_types",
)


def _sub_configs(config: dict) -> list[tuple[str, dict]]:
    found = [("", config)]
    for key in ("text_config", "language_config", "llm_config", "thinker_config"):
        sub = config.get(key)
        if isinstance(sub, dict):
            found.extend((f"{key}.{p}" if p else f"{key}.", c) for p, c in _sub_configs(sub))
    return found


def is_hybrid_model(config: dict) -> tuple[bool, str]:
    """Whether a Hugging Face ``config.json`` describes a hybrid / recurrent-state model.

    Such models (Mamba / Gated DeltaNet / linear-attention / convolution layers: Qwen3-Next,
    Qwen3.5 and 3.6 hybrids, Jamba, Nemotron-H, Falcon-H1, Granite 4 hybrids, Kimi-Linear, LFM2, ...)
    keep a recurrent state that cannot be shared across sibling branches of a DDTree verify pass, so
    full DDTree must be refused on them unless the operator allows it. Looks at ``model_type``,
    ``architectures``, ``layer_types`` and recurrent-only keys, in the top level and in nested
    ``text_config`` / ``language_config`` / ``llm_config`` / ``thinker_config``.

    Returns ``(is_hybrid, reason)``; the reason names the evidence, for an operator to read.
    """
    if not isinstance(config, dict):
        return False, f"config is not a mapping ({type(config).__name__}); cannot tell, assuming not hybrid"
    for where, cfg in _sub_configs(config):
        model_type = str(cfg.get("model_type", "")).lower()
        if model_type in _HYBRID_MODEL_TYPES:
            return (
                True,
                f"{where}model_type '{model_type}' is a hybrid family: {_HYBRID_MODEL_TYPES[model_type]}",
            )
        for arch in cfg.get("architectures") or []:
            for marker in _HYBRID_ARCH_MARKERS:
                if marker.lower() in str(arch).lower():
                    return True, f"{where}architectures names '{arch}', a hybrid family ({marker})"
        layer_types = cfg.get("layer_types")
        if isinstance(layer_types, list | tuple):
            recurrent = sorted({str(t) for t in layer_types} - _ATTENTION_LAYER_TYPES)
            if recurrent:
                count = sum(1 for t in layer_types if str(t) in recurrent)
                return True, (
                    f"{where}layer_types has {count} of {len(layer_types)} non-attention layers "
                    f"({', '.join(recurrent)})"
                )
        for key in cfg:
            lowered = str(key).lower()
            if lowered.startswith(_HYBRID_KEY_PREFIXES):
                return True, f"{where}config key '{key}' belongs to recurrent / linear-attention layers"
    model_type = config.get("model_type", "?")
    return (
        False,
        f"model_type '{model_type}': only attention layers found (no Mamba / linear-attention markers)",
    )


# --------------------------------------------------------------------------------------------------
# Attention variants the tree mask does not express
# --------------------------------------------------------------------------------------------------

# layer_types values whose keys are limited by distance: a verify kernel applies the window by a
# query's index in the verify block, not by its tree depth, so a tree node would lose prefix keys.
_WINDOWED_LAYER_TYPES = {"sliding_attention", "sliding_window", "swa", "local_attention", "chunked_attention"}


def uses_windowed_attention(config: dict) -> tuple[bool, str]:
    """Whether a Hugging Face ``config.json`` has sliding-window / chunked / local attention layers.

    The sibling of ``is_hybrid_model`` for the other thing a DDTree verify pass cannot do: such
    layers see only keys within a distance of the query, and SGLang's kernels measure that distance
    by the query's index in the verify block, while a tree node's true distance is its depth.
    ``use_sliding_window: false`` (Qwen2/Qwen3 ship a ``sliding_window`` value they do not use)
    counts as no window. Returns ``(windowed, reason)``.
    """
    if not isinstance(config, dict):
        return False, f"config is not a mapping ({type(config).__name__}); cannot tell"
    for where, cfg in _sub_configs(config):
        layer_types = cfg.get("layer_types")
        if isinstance(layer_types, list | tuple):
            windowed = sorted({str(t) for t in layer_types} & _WINDOWED_LAYER_TYPES)
            if windowed:
                count = sum(1 for t in layer_types if str(t) in windowed)
                return True, (
                    f"{where}layer_types has {count} of {len(layer_types)} windowed attention layers "
                    f"({', '.join(windowed)})"
                )
        for key in ("attention_chunk_size", "sliding_window_pattern", "window_size"):
            if cfg.get(key) not in (None, 0, False, -1, [], [-1, -1]):
                return True, f"{where}config key '{key}' = {cfg.get(key)!r} limits attention to a window"
        window = cfg.get("sliding_window")
        if window not in (None, 0, False, -1) and cfg.get("use_sliding_window", True) is not False:
            return True, f"{where}sliding_window = {window!r} with sliding-window attention enabled"
    return False, "no sliding-window, chunked or local attention found"


# Spelled here, not imported from ddtree_args, so that this module keeps importing only torch.
_FLAG_MODE = "--speculative-ddtree-mode"


class DDTreeRefused(RuntimeError):
    """DDTree full mode cannot run on this target / backend; the message says why and what to do."""


# Full DDTree on a hybrid target, by the recurrent layer type SGLang runs for it and the architecture
# around it (bench/gpu/HYBRID.md): the layer type's verify kernels must follow a tree's parents, the
# accepted node's state must be the one committed, and a GPU proof on that architecture must show plain
# decoding's tokens. `proven`: served. `unproven`: the wiring exists, served only where a proof itself
# asks (test switch SGLANG_DDTREE_TEST_UNPROVEN_HYBRID). Every other hybrid is refused, its layer type named.
GATED_DELTANET = "gated-deltanet"
# model_type -> architecture; the Qwen3.5 / 3.6 checkpoints carry theirs in text_config too
_GDN_ARCHITECTURES = {
    "qwen3_next": "qwen3-next",
    "qwen3_5": "qwen3.5", "qwen3_5_text": "qwen3.5",
    "qwen3_5_moe": "qwen3.5-moe", "qwen3_5_moe_text": "qwen3.5-moe",
    "qwen3_6": "qwen3.6", "qwen3_6_moe": "qwen3.6-moe",
}
# `architectures` class name (lower case) -> architecture, most specific first
_GDN_ARCH_MARKERS = (("qwen3next", "qwen3-next"), ("qwen3_5moe", "qwen3.5-moe"), ("qwen3_5", "qwen3.5"),
                     ("qwen3_6moe", "qwen3.6-moe"), ("qwen3_6", "qwen3.6"))
_GDN_UNPROVEN = (
    "SGLang's GDN tree kernels follow DDTree's parents and the accepted node's state is committed "
    "(bench/gpu/HYBRID.md); token identity with plain decoding is not yet shown on a GPU for this architecture"
)
HYBRID_TREE_SUPPORT: dict[tuple[str, str], tuple[str, str]] = {
    # H200, payloads 0.8.5 / 0.8.6 (bench/RESULTS.md): trained pairs token-identical to plain decoding at budgets
    # 15 / 64 / 256 on the production mix and the limits workload, with the radix cache too; samples and
    # liveness pass; the deepest node's state committed instead fails
    (GATED_DELTANET, "qwen3-next"): ("proven", "Qwen3-Next, GDN + attention + MoE"),
    (GATED_DELTANET, "qwen3.5"): ("proven", "dense Qwen3.5 (Qwen3_5ForConditionalGeneration), GDN + gated attention"),
    (GATED_DELTANET, "qwen3.5-moe"): ("proven", "Qwen3.5 MoE (Qwen3_5MoeForConditionalGeneration)"),
    (GATED_DELTANET, "qwen3.6"): ("unproven", _GDN_UNPROVEN),
    (GATED_DELTANET, "qwen3.6-moe"): ("unproven", _GDN_UNPROVEN),
}


def hybrid_kind(config: dict) -> tuple[str, str] | None:
    """(recurrent layer type, architecture) of a hybrid ``config.json`` where DDTree knows them, e.g.
    ("gated-deltanet", "qwen3.5"); None for any other hybrid, or a dense model."""
    if not isinstance(config, dict):
        return None
    for _where, cfg in _sub_configs(config):
        # the class SGLang builds names the architecture; model_type where no class is named
        archs = [str(a).lower() for a in cfg.get("architectures") or []]
        for marker, architecture in _GDN_ARCH_MARKERS:
            if any(marker in arch for arch in archs):
                return GATED_DELTANET, architecture
        architecture = _GDN_ARCHITECTURES.get(str(cfg.get("model_type", "")).lower())
        if architecture:
            return GATED_DELTANET, architecture
    return None


def hybrid_support(layer_type: str | None, architecture: str | None) -> tuple[str, str]:
    """`HYBRID_TREE_SUPPORT`'s (status, why) for a layer type on an architecture ("refused" when unknown)."""
    return HYBRID_TREE_SUPPORT.get((layer_type or "", architecture or ""), ("refused", "no tree-verify support"))


def proven_hybrids() -> list[str]:
    """'<layer type> on <architecture>' for every proven entry: what a refusal says does run."""
    return [f"{t} on {a}" for (t, a), (st, _) in HYBRID_TREE_SUPPORT.items() if st == "proven"]


def hybrid_refusal(config: dict, *, allow_unproven: bool = False) -> str | None:
    """Why full DDTree must not run on this hybrid target (None: it may, or the model is not hybrid)."""
    hybrid, reason = is_hybrid_model(config)
    if not hybrid:
        return None
    layer_type, architecture = hybrid_kind(config) or (None, None)
    status, why = hybrid_support(layer_type, architecture)
    if status == "proven" or (status == "unproven" and allow_unproven):
        return None
    proven = proven_hybrids()
    where = f"full mode runs on {', '.join(proven)} only" if proven else "no hybrid layer type is proven yet"
    if status == "unproven":
        return (
            f"DDTree full mode refused: the target model is hybrid ({reason}), layer type {layer_type} on "
            f"{architecture}: {why} ({where}). Use {_FLAG_MODE} shadow-linear."
        )
    return (
        f"DDTree full mode refused: the target model is hybrid ({reason}). Its recurrent "
        f"Mamba/linear-attention layers have no tree-verify support in DDTree ({where}). "
        f"Use {_FLAG_MODE} shadow-linear."
    )


def full_mode_refusal(config: dict, *, allow_unproven_hybrid: bool = False) -> str | None:
    """Why full DDTree must not run on the target described by ``config`` (its config.json), or None.

    One place for the offline refusals, so the worker, the smoke test and the lab engine refuse the
    same models with the same words; hybrids follow `HYBRID_TREE_SUPPORT`.
    """
    refusal = hybrid_refusal(config, allow_unproven=allow_unproven_hybrid)
    if refusal:
        return refusal
    windowed, reason = uses_windowed_attention(config)
    if windowed:
        return (
            f"DDTree full mode refused: the target model uses windowed attention ({reason}). The "
            "verify kernels apply the window by a node's index in the verify block, not by its tree "
            f"depth, so tree nodes would lose keys inside their window. Use {_FLAG_MODE} shadow-linear."
        )
    return None

"""What the tensor-parallel ranks of a DDTree server agree on (installed as
`sglang/srt/speculative/ddtree_ranks.py` by the ddtree-ops payload; imports only torch, and its sibling
`ddtree_verify_step` where a rank turns its verify kernels off).

Every rank of a TP group runs the same verify step, and its collectives (the draft logits' gather, the
target forward's all-reduces, graph or eager) must match. A step's shape is decided on each rank from
the batch, which the ranks share, and from limits sized at start from the free device memory, which they
do not: ranks with different free memory would pick different tree widths, or graphs on one and eager on
another, and hang. So every per-rank value a step depends on goes through `agree` once at start: the
minimum over the group (the most any rank can afford), or for a flag the AND; auto's timings are summed
over the group at each refresh, so its plan is the same on every rank. The tree itself is built from
`vocab_logits`, the draft logits gathered over the vocab shards: the same on every rank (the tree is the
verify input) and the same as one device's; `lm_head_refusal` says at start when a target's LM head cannot
give them (a quantized head would fail the first tree step, mid-serving).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def agree_min(values: list[int], group: Any) -> list[int]:
    """Element-wise minimum of `values` over the ranks of `group` (a CPU / gloo process group, as
    SGLang's `get_tp_group().cpu_group`); `group` None or of one rank: `values` unchanged."""
    if group is None or dist.get_world_size(group) == 1:
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def agree_all(flag: bool, group: Any) -> bool:
    """True only if `flag` is True on every rank of `group`."""
    return bool(agree_min([int(bool(flag))], group)[0])


def agree_verify_kernels(in_use: bool, group: Any) -> bool:
    """Whether the verify step's Triton kernels run on every rank of `group` (each rank passes whether its own
    passed their start-up check); where one rank's do not, the others turn theirs off: kernels and torch walk a
    sampled tree alike but for float32 rounding at a coin's edge, and ranks on different paths could commit
    different tokens for one request. A collective: every rank calls it."""
    every = agree_all(in_use, group)
    if in_use and not every:
        from sglang.srt.speculative.ddtree_verify_step import turn_kernels_off

        turn_kernels_off("off on another TP rank")
    return every


def agree_sum(values: list[float], group: Any) -> list[float]:
    """Element-wise sum of `values` over the ranks of `group` (auto's accumulators, `ddtree_auto_budget`);
    `group` None or of one rank: `values` unchanged."""
    if group is None or dist.get_world_size(group) == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return [float(v) for v in t.tolist()]


def refresh_over_ranks(auto: Any, group: Any) -> None:
    """`AutoBudget.refresh` with its accumulators summed over the ranks of `group` (None: one rank), so every
    rank re-plans from the same numbers and picks the same budget for the same step."""
    world = 1 if group is None else int(dist.get_world_size(group))
    auto.refresh(reduce=lambda v: agree_sum(v, group), world=world)


FLOAT_HEAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def lm_head_refusal(lm_head: Any) -> str | None:
    """Why `vocab_logits` cannot multiply by this target LM head (it reads `weight` as a float matrix, as
    upstream's own DFLASH draft sampler does when it folds the head), or None."""
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return (f"the target's LM head ({type(lm_head).__name__}) has no weight matrix to build the tree's draft "
                "logits with (a quantized or wrapped head)")
    if weight.dtype not in FLOAT_HEAD_DTYPES:
        return f"the target's LM head is stored as {weight.dtype} (a quantized head); the tree needs a float head"
    return None


def vocab_logits(hidden_states: torch.Tensor, lm_head: Any, vocab: int, tp_group: Any) -> torch.Tensor:
    """Full-vocabulary logits `[rows, vocab]` of `hidden_states` `[rows, hidden]` under a vocab-parallel LM head
    (SGLang's `ParallelLMHead`: `weight` this rank's shard, `shard_indices` its layout) whose TP group is
    `tp_group` (`get_tp_group()`: `world_size`, `all_gather`); a plain head (no `shard_indices`) is one rank's
    whole vocabulary. Every rank returns the same tensor. Added (LoRA) vocab entries are left out: the tree
    drafts base-vocab tokens only, which costs acceptance at most, never correctness."""
    weight = lm_head.weight
    shard = getattr(lm_head, "shard_indices", None)
    num_org = int(shard.num_org_elements) if shard is not None else int(weight.shape[0])
    hs = hidden_states if hidden_states.dtype == weight.dtype else hidden_states.to(weight.dtype)
    local = torch.matmul(hs, weight[:num_org].T)
    if tp_group is None or int(tp_group.world_size) == 1:
        return local[:, :vocab]
    # org_vocab_start_index(rank) = rank * num_org_elements_padded (vocab_parallel_embedding), so padding each
    # shard to the padded width and concatenating gives column == token id
    padded = int(shard.num_org_elements_padded)
    full_local = torch.full((local.shape[0], padded), float("-inf"), dtype=local.dtype, device=local.device)
    full_local[:, :num_org] = local
    return tp_group.all_gather(full_local.contiguous(), dim=-1)[:, :vocab]

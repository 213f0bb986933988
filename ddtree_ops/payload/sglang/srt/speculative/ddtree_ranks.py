"""What the tensor-parallel ranks of a DDTree server agree on (installed as
`sglang/srt/speculative/ddtree_ranks.py` by the ddtree-ops payload; imports only torch).

Every rank of a TP group runs the same verify step, and its collectives (the draft logits' gather, the
target forward's all-reduces, graph or eager) must match. A step's shape is decided on each rank from
the batch, which the ranks share, and from limits sized at start from the free device memory, which they
do not: ranks with different free memory would pick different tree widths, or graphs on one and eager on
another, and hang. So every per-rank value a step depends on goes through `agree` once at start: the
minimum over the group (the most any rank can afford), or for a flag the AND; auto's timings are summed
over the group at each refresh, so its plan is the same on every rank.
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


def agree_sum(values: list[float], group: Any) -> list[float]:
    """Element-wise sum of `values` over the ranks of `group` (auto's accumulators, `ddtree_auto_budget`);
    `group` None or of one rank: `values` unchanged."""
    if group is None or dist.get_world_size(group) == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return [float(v) for v in t.tolist()]

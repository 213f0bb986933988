"""Penalties exact on the v2 DFLASH worker's verify, tree or chain (SGLang 0.5.17 / 0.5.23; installed as
`sglang/srt/speculative/ddtree_v2_penalties.py` by the payload of each v2 base; one copy, shared).

Upstream's v2 verify drops frequency / presence / repetition / min_new_tokens: `apply_dflash_verify_logits_
adjustments` (17:speculative/dflash_utils.py:120, 23:…:201) reads an orchestrator the forward copy of the sampling
info does not have (17:sampling/sampling_batch_info.py:454-457) and penalties nobody accumulated (spec decoding
returns before `cumulate_penalty_output_tokens`, 17:managers/schedule_batch.py:2961-2965), so only the logit bias
survives. On the H200 (2026-12-05) 14 of 23 penalised requests left plain decoding on 0.5.17's DFLASH. The v1
payload fixed the same loss in 0.5.13.post1's linear verify (its `dflash_info.patch`); this is that fix for v2.

`exact_verify_adjustments` is what both v2 steps apply: upstream's adjustments on a copy of the sampling info with
every penalty source and the bias taken out (a custom logit processor, or a grammar mask on the dense path, still
applies as upstream applies it), then the penalties at every verify position as plain decoding applies them after
the request's output so far plus the position's path, in plain's penalizer order, then the bias
(`ddtree_penalties.penalise_and_bias`). The tree step calls it with its tree; upstream's linear step reaches it
through two hooks, registered for every DFLASH server on these bases by `ddtree_v2_args` (no switch):
- BEFORE `DFlashVerifyInput.prepare_for_verify(batch, …)`: the verify input and the batch it is about to run on
  (the one place upstream's step hands both over; after it `batch.spec_info` is the verify input itself);
- AROUND `dflash_utils.apply_dflash_verify_logits_adjustments`: when that pending verify is the call's (its batch's
  sampling info is the one passed, its width the one passed) and a request of it is penalised, the block as a
  chain (`chain_shape`; the verify's own tokens, the root first); otherwise upstream's function, untouched;
- 0.5.23 only, AROUND `DFlashWorkerV2._can_skip_verify_logits`: a penalised batch is not argmaxed over a
  vocab-sharded target's shards without its adjustments.

Exact only without the overlap scheduler: there `req.output_ids` holds every committed token when a step starts
(the root included), as the tree step relies on too. Under overlap the host lags the step in flight by up to a
block, and plain decoding itself counts one token late; the hook then leaves upstream's adjustments as they are.
A batch with no penalised request costs one pass over its requests' settings (`is_penalised`, about a
microsecond a request), nothing on the device.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.speculative import ddtree_args as _shared
from sglang.srt.speculative import ddtree_v2_args as _v2args
from sglang.srt.speculative.ddtree_penalties import (
    NOTHING_REQUIRED,
    chain_shape,
    is_penalised,
    order_of,
    penalise_and_bias,
)

# What upstream's verify adjustments must not apply again (0.5.17 reads `acc_linear_penalties`, the orchestrator,
# and, on its dense path, `apply_logits_bias`: the `acc_*_penalties` and the bias).
STRIPPED = {"penalizer_orchestrator": NOTHING_REQUIRED, "acc_linear_penalties": None,
            "acc_additive_penalties": None, "acc_scaling_penalties": None, "logit_bias": None}


def plain_penalizer_order() -> tuple[str, ...]:
    """The order plain decoding applies the penalizers in, in this process. `SamplingBatchInfo.from_schedule_batch`
    builds every orchestrator's dict from this set display of the same four classes (17:sampling_batch_info.py:
    188-197; merge and filter keep the dict); the same objects displayed in the same order iterate alike within a
    process. The forward copy a v2 step sees has no orchestrator to read it from."""
    from sglang.srt.sampling import penaltylib

    return order_of({
        penaltylib.BatchedFrequencyPenalizer,
        penaltylib.BatchedMinNewTokensPenalizer,
        penaltylib.BatchedPresencePenalizer,
        penaltylib.BatchedRepetitionPenalizer,
    })


def exact_verify_adjustments(logits: torch.Tensor, info: Any, reqs: Any, *, parents: torch.Tensor,
                             depths: torch.Tensor, tokens: torch.Tensor, max_depth: int, upstream: Any) -> bool:
    """The verify logits `[bs * n, vocab]` (in place) as plain decoding samples them at every position of the tree
    or chain `parents` / `depths` / `tokens` (`[bs, n]`, the root's token first); `upstream`: the unhooked
    `apply_dflash_verify_logits_adjustments`. Returns whether a penalty or a bias was applied."""
    bs, n = tokens.shape
    stripped = copy.copy(info)
    for name, value in STRIPPED.items():
        setattr(stripped, name, value)
    upstream(next_token_logits=logits, sampling_info=stripped, draft_token_num=n)
    return penalise_and_bias(logits.view(bs, n, -1), reqs, info.logit_bias, parents=parents, depths=depths,
                             tokens=tokens, max_depth=max_depth, order=plain_penalizer_order(),
                             req_eos=req_eos_stops())


def req_eos_stops() -> bool:
    """Whether plain's min_new_tokens holds back a request's own eos ids on this base."""
    return _v2args.base_version() in _v2args.REQ_EOS_STOP_BASES


# --- upstream's linear step ----------------------------------------------------------------------------------


@dataclass
class _PendingVerify:
    verify: Any  # the DFlashVerifyInput about to run
    batch: Any  # the ScheduleBatch it runs on


_pending: _PendingVerify | None = None


def _overlap_on() -> bool:
    args = _shared.running_server_args()
    return args is None or not getattr(args, "disable_overlap_schedule", False)


def before_prepare_for_verify(verify: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE `DFlashVerifyInput.prepare_for_verify`: remember the verify input and its batch."""
    global _pending
    _pending = _PendingVerify(verify, batch)


def _penalised(reqs: Any) -> bool:
    return any(is_penalised(r) for r in reqs)


def around_can_skip_verify_logits(original: Any, worker: Any, batch: Any, sampling_info: Any) -> bool:
    """AROUND 0.5.23's `DFlashWorkerV2._can_skip_verify_logits`: with a vocab-sharded target (TP > 1) a greedy
    batch whose forward copy has no orchestrator is argmaxed over the shards and never reaches the adjustments
    (23:speculative/dflash_worker_v2.py:629-647, :2885-2896); a penalised batch must reach them."""
    skip = original(worker, batch, sampling_info)
    return bool(skip) and (_overlap_on() or not _penalised(batch.reqs))


def around_adjustments(original: Any, *, next_token_logits: torch.Tensor, sampling_info: Any,
                       draft_token_num: int) -> None:
    """AROUND `apply_dflash_verify_logits_adjustments`: a linear DFLASH verify with a penalised request gets the
    penalties at every block position; anything else (no pending verify of this call, a tree step's stripped copy,
    nothing penalised, the overlap scheduler) gets upstream's function."""
    global _pending
    pending, _pending = _pending, None
    call = dict(next_token_logits=next_token_logits, sampling_info=sampling_info, draft_token_num=draft_token_num)
    if (pending is None or sampling_info is None or pending.batch.sampling_info is not sampling_info
            or int(pending.verify.draft_token_num) != int(draft_token_num)
            or not _penalised(pending.batch.reqs) or _overlap_on()):
        return original(**call)
    bs, n = len(pending.batch.reqs), int(draft_token_num)
    tokens = pending.verify.draft_token.view(bs, n).to(torch.int64)
    exact_verify_adjustments(next_token_logits, sampling_info, pending.batch.reqs, tokens=tokens,
                             max_depth=n - 1, upstream=original, **chain_shape(bs, n, tokens.device))
    return None

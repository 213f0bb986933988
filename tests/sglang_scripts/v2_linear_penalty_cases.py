"""Run inside an unpacked SGLang 0.5.17 or 0.5.23 tree (on PYTHONPATH, the payload's `ddtree_v2_args.py`,
`ddtree_args.py`, `ddtree_penalties.py` and `ddtree_v2_penalties.py` beside upstream's): upstream's linear DFLASH
verify with the payload's penalty hooks, against plain greedy decoding; prints one JSON object.

What runs for real: SGLang's `HookRegistry` applying the hooks `ddtree_v2_args` registers at import
(`load_plugins()`), `DFlashVerifyInput` and its `prepare_for_verify` entry, `apply_dflash_verify_logits_adjustments`
as `dflash_worker_v2` calls it (by its module name, which the registry rebinds), SGLang's penalizers,
`SamplingBatchInfo.copy_for_forward` (the copy a v2 step sees) and, for the oracle, plain decoding's
`cumulate_penalty_output_tokens` / `apply_logits_bias` (penalty_oracle.py).
Stand-ins, and why: the target (`penalty_oracle.penalty_target`, no model on a CPU); `prepare_for_verify` is
stopped right after its entry (it builds a ForwardBatch from a model runner) by a forward mode whose `is_idle()`
raises — both bases read it first; the running server's args (`ddtree_args.running_server_args`: whether the
overlap scheduler is off); the draft (plain's continuation, mostly, with rivals).
`linear_step` is upstream's decode step reduced to what happens around the adjustments, in upstream's order
(17:speculative/dflash_worker_v2.py:1659-1716, 23:…:2823-2915; `contract()` checks that order in the source),
and its greedy accept (the longest drafted prefix the target's argmax agrees with, then the target's token).

Usage: python v2_linear_penalty_cases.py
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import random
import re
from types import SimpleNamespace
from typing import Any
from unittest import mock

import penalty_oracle as po  # beside this script
import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.plugins import load_plugins
from sglang.srt.speculative import ddtree_args as shared
from sglang.srt.speculative import ddtree_penalties as dp
from sglang.srt.speculative import ddtree_v2_args as v2args  # registers the hooks at import
from sglang.srt.speculative import ddtree_v2_penalties as vp
from sglang.srt.speculative import dflash_utils, dflash_worker_v2
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.version import __version__

BLOCK = 4
SERVER = SimpleNamespace(disable_overlap_schedule=True)
shared.running_server_args = lambda: SERVER


class _Entered(Exception):
    """`prepare_for_verify` got past its entry (and its BEFORE hook)."""


class _StopAtEntry:
    def is_idle(self) -> bool:
        raise _Entered


def linear_step(batch: SimpleNamespace, draft: torch.Tensor, logits: torch.Tensor, passed: Any = None) -> None:
    """Upstream's step around the adjustments: the verify input of the block, `prepare_for_verify(batch, …)`,
    `sampling_info = batch.sampling_info` (or `passed`), the adjustments on the verify logits `[bs * block,
    vocab]`, in place."""
    verify = DFlashVerifyInput(draft_token=draft.reshape(-1), positions=torch.zeros(draft.numel(), dtype=torch.int64),
                               draft_token_num=BLOCK, custom_mask=None, capture_hidden_mode=CaptureHiddenMode.FULL)
    batch.forward_mode = _StopAtEntry()
    with contextlib.suppress(_Entered):
        verify.prepare_for_verify(batch, None)
    sampling_info = batch.sampling_info if passed is None else passed
    dflash_worker_v2.apply_dflash_verify_logits_adjustments(next_token_logits=logits, sampling_info=sampling_info,
                                                            draft_token_num=BLOCK)


def run(seed: int, steps: int = 24, neutral: bool = False) -> dict:
    """`steps` linear steps of a batch of 4 requests with random penalty settings, each step's commit appended to
    `req.output_ids` as the scheduler does without overlap; each step sees a real forward copy of a sampling info
    whose orchestrator, as under spec decoding, never counted a token. Compared with plain greedy decoding: the
    tokens, and the logits at every committed position bit for bit."""
    rng = random.Random(2000 + seed)
    bs = 4
    settings, bias = po.random_settings(rng, bs, neutral)
    prompt_lens = [rng.randint(3, 9) for _ in range(bs)]
    firsts = [rng.choice([0, 1, 2, 3, 4, 5, 6]) for _ in range(bs)]
    oracle = po.plain_greedy(settings, firsts, prompt_lens, bias, steps * BLOCK + 1)
    reqs = [po.request(s, f, p) for s, f, p in zip(settings, firsts, prompt_lens, strict=True)]
    _, spec_info = po.sampling_info(reqs, bias)
    bad: list[str] = []
    positions = 0
    for step in range(steps):
        draft = torch.zeros((bs, BLOCK), dtype=torch.int64)
        for b, r in enumerate(reqs):
            want, L = oracle["outputs"][b], len(r.output_ids)
            draft[b, 0] = r.output_ids[-1]
            for j in range(1, BLOCK):
                if L + j - 1 < len(want) and rng.random() < 0.8:
                    draft[b, j] = want[L + j - 1]
                else:  # the unpenalised choice after the previous drafted token: a rival penalties must beat
                    draft[b, j] = int(po.penalty_target(prompt_lens[b] + L + j - 2, int(draft[b, j - 1])).argmax())
        logits = torch.stack([po.penalty_target(prompt_lens[b] + len(r.output_ids) - 1 + j, int(draft[b, j]))
                              for b, r in enumerate(reqs) for j in range(BLOCK)])
        batch = SimpleNamespace(reqs=reqs, sampling_info=spec_info.copy_for_forward())
        linear_step(batch, draft, logits)
        predict = logits.view(bs, BLOCK, -1).argmax(-1)
        for b, r in enumerate(reqs):
            L, accept = len(r.output_ids), 0
            while accept < BLOCK - 1 and int(draft[b, accept + 1]) == int(predict[b, accept]):
                accept += 1
            for j in range(accept + 1):
                if not torch.equal(logits[b * BLOCK + j], oracle["logits_at"][b][L + j]):
                    bad.append(f"seed {seed} step {step} req {b} position {j}: logits differ")
                positions += 1
            r.output_ids.extend([*draft[b, 1 : accept + 1].tolist(), int(predict[b, accept])])
    match = all(r.output_ids == o[: len(r.output_ids)] for r, o in zip(reqs, oracle["outputs"], strict=True))
    return {"match": match, "bad": bad[:5], "bad_count": len(bad), "positions": positions,
            **{k: oracle[k] for k in ("changed", "banned", "model_eos_banned", "penalised_tokens")}}


def runs(n: int = 6) -> list[dict]:
    return [run(seed) for seed in range(n)]


def passthrough() -> dict:
    """Calls the hook leaves to upstream: a call whose sampling info is not the pending verify's batch's (the tree
    step's stripped copy), and a batch with nothing penalised. Both equal upstream's own answer exactly."""
    reqs = [po.request({"frequency": 0.6, "presence": 0.4, "repetition": 1.6, "min_new_tokens": 12, "stop_ids": set()},
                       3, 5) for _ in range(2)]
    bias = torch.zeros((2, po.VOCAB))
    bias[1, 2] = 1.5
    _, info = po.sampling_info(reqs, bias)
    upstream = dflash_utils.apply_dflash_verify_logits_adjustments.__wrapped__
    draft = torch.tensor([[3, 1, 4, 1], [3, 5, 9, 2]])
    raw = torch.randn((2 * BLOCK, po.VOCAB), generator=torch.Generator().manual_seed(3))
    out = {}
    batch = SimpleNamespace(reqs=reqs, sampling_info=info.copy_for_forward())
    other = copy.copy(batch.sampling_info)
    neutral = [po.request({"frequency": 0.0, "presence": 0.0, "repetition": 1.0, "min_new_tokens": 0,
                           "stop_ids": set()}, 3, 5) for _ in range(2)]
    for name, reqs_now, passed in (("other_sampling_info", reqs, other), ("neutral", neutral, None)):
        batch.reqs = reqs_now
        hooked, plain = raw.clone(), raw.clone()
        with mock.patch.object(dp, "apply_verify_penalties", wraps=dp.apply_verify_penalties) as counted:
            linear_step(batch, draft, hooked, passed)
        upstream(next_token_logits=plain, sampling_info=passed or batch.sampling_info, draft_token_num=BLOCK)
        out[name] = {"equal_upstream": torch.equal(hooked, plain), "penalty_calls": counted.call_count}
    return out


def skip_logits() -> dict | None:
    """0.5.23: whether a greedy batch's verify may skip its adjustments (argmax over a vocab-sharded target's
    shards), as upstream answers and as hooked: penalised, neutral, and penalised under the overlap scheduler."""
    can_skip = getattr(dflash_worker_v2.DFlashWorkerV2, "_can_skip_verify_logits", None)
    if can_skip is None:
        return None
    worker = SimpleNamespace(_selector_sample=None)
    settings = {"frequency": 0.6, "presence": 0.0, "repetition": 1.0, "min_new_tokens": 0, "stop_ids": set()}
    neutral = {**settings, "frequency": 0.0}
    out = {}
    for name, setting in (("penalised", settings), ("neutral", neutral)):
        reqs = [po.request(setting, 3, 5) for _ in range(2)]
        _, info = po.sampling_info(reqs, None)
        forward = info.copy_for_forward()  # no orchestrator: upstream sees nothing penalised
        batch = SimpleNamespace(reqs=reqs, has_grammar=False, return_logprob=False)
        out[name] = {"upstream": bool(inspect.unwrap(can_skip)(worker, batch, forward)),
                     "hooked": bool(can_skip(worker, batch, forward))}
        if name == "penalised":
            SERVER.disable_overlap_schedule = False
            out["penalised_overlap"] = bool(can_skip(worker, batch, forward))
            SERVER.disable_overlap_schedule = True
    return out


def contract() -> dict:
    """Upstream's step does what `linear_step` stands in for, in that order: in `forward_batch_generation`'s source
    the block's `DFlashVerifyInput(draft_token=…)`, `sampling_info = batch.sampling_info`, the verify input's
    `prepare_for_verify(batch, …)`, then `apply_dflash_verify_logits_adjustments(…, sampling_info=sampling_info,
    draft_token_num=int(self.block_size))`, each once."""
    src = re.sub(r"\s+", "", inspect.getsource(inspect.unwrap(dflash_worker_v2.DFlashWorkerV2.forward_batch_generation)))
    marks = ["verify_input=DFlashVerifyInput(draft_token=verify_input_ids,",
             "batch.out_cache_loc=verify_out_cache_locsampling_info=batch.sampling_info",
             "verify_forward_batch,_=verify_input.prepare_for_verify(batch,self.target_worker",
             "apply_dflash_verify_logits_adjustments(next_token_logits=logits_output.next_token_logits,"
             "sampling_info=sampling_info,draft_token_num=int(self.block_size),)"]
    at = [src.find(m) for m in marks]
    return {"found": [src.count(m) == 1 for m in marks], "in_order": all(a >= 0 for a in at) and at == sorted(at)}


def main() -> None:
    out: dict = {"version": __version__, "registered": v2args.register_linear_penalties()}
    out["unhooked"] = runs()  # upstream's adjustments: the power of the comparison
    load_plugins()
    out["rebound"] = (dflash_worker_v2.apply_dflash_verify_logits_adjustments
                      is dflash_utils.apply_dflash_verify_logits_adjustments
                      and hasattr(dflash_utils.apply_dflash_verify_logits_adjustments, "__wrapped__")
                      and hasattr(DFlashVerifyInput.prepare_for_verify, "__wrapped__"))
    out["hooked"] = runs()
    out["neutral"] = run(100, neutral=True)
    SERVER.disable_overlap_schedule = False
    out["overlap"] = runs(3)  # the hook leaves upstream's adjustments under the overlap scheduler
    SERVER.disable_overlap_schedule = True
    out["passthrough"] = passthrough()
    out["contract"] = contract()
    out["skip_logits"] = skip_logits()
    out["order"] = list(vp.plain_penalizer_order())
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Run inside an unpacked SGLang 0.5.17 or 0.5.23 tree (on PYTHONPATH, that base's payload files beside it): check
the v2 tree worker (the base's `ddtree_worker_v2.py` adapter over the shared `ddtree_v2_step.py`) against the real
upstream classes and print one JSON object. The same cases run on both bases; where upstream's shapes differ
(`V23`), the stand-ins follow the base (0.5.23: no `ps` in the constructor, `pp_proxy_tensors`, a real pass-through
`KVIndexTranslator` for the step's KV plans, `enable_num_token_non_padded` off (it reads a published parallel
config), the scheduler's internal-state controller stubbed).

What runs for real: the module's import against 0.5.17, `DFlashWorkerV2` / `DFlashVerifyInput` /
`GenerationBatchResult` / `ForwardBatch` / `ReqToTokenPool`-shaped tensors, SGLang's `HookRegistry` and
`SpeculativeAlgorithm.create_worker`, the payload's tree builder, walk and commit (torch paths); in the penalty case
SGLang's penalizers, `BatchedPenalizerOrchestrator`, `SamplingBatchInfo` (`copy_for_forward`, `apply_logits_bias`)
and `ScheduleBatch.cumulate_penalty_output_tokens`, both for the oracle (plain decoding) and for the sampling info
the step sees.
Stand-ins (CPU, no model): in the decode-step case, the draft runner (returns chosen hidden states), the target
verify (logits of a made-up deterministic "target": next token = f(position, token)), `prepare_for_verify`
(needs a model runner; records the verify input instead), upstream's triton `assign_extend_cache_locs_func` (the
same gather in torch) and `_append_target_hidden_to_draft_kv_by_loc` (records its arguments). The worker object is
made without `__init__` (it builds models) and given the attributes the step reads; in the stats run, by its own
`__init__` with upstream's stubbed, and upstream's `forward_batch_generation` stubbed for the batches it hands on.
The scheduler's `get_internal_state` is the real one (as `load_plugins` hooked it) on a stand-in scheduler object.
In the auto case the target's verify graph runner is `v2_runner_stand_in.StandInRunner` (a CUDA graph needs a GPU;
its width comes through the real `ModelRunner.decode_num_tokens_per_req` and the seams' hook), the ladder's replay
timer and the kernels' start-up check are recorded instead of run (CUDA events / a device the stand-in only names).

Usage: python v2_worker_cases.py   (env: SGLANG_DDTREE_TEST_V2_TREE / _ALLOW_TEST_SWITCHES as the case needs)
"""

from __future__ import annotations

import inspect
import json
import os
import random
import re
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import penalty_oracle as po  # beside this script
import sglang.srt.speculative.spec_utils as spec_utils
import torch
import v2_runner_stand_in as stand_in  # beside this script
from graph_stand_in import RerunGraph  # beside this script
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.plugins import load_plugins
from sglang.srt.speculative import ddtree_build_graphs as bg
from sglang.srt.speculative import ddtree_penalties as dp
from sglang.srt.speculative import ddtree_v2_args as v2args
from sglang.srt.speculative import ddtree_v2_penalties as vp
from sglang.srt.speculative import ddtree_v2_seams as seams
from sglang.srt.speculative import ddtree_v2_step as s
from sglang.srt.speculative import ddtree_verify_graphs as vg
from sglang.srt.speculative import ddtree_worker_v2 as w
from sglang.srt.speculative.ddtree_args import TEST_V2_TP
from sglang.srt.speculative.ddtree_stats import DDTreeStats
from sglang.srt.speculative.ddtree_utils import build_ddtree
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.version import __version__

V23 = __version__ == "0.5.23"


def contracts() -> dict:
    """What the subclass relies on, read off the real upstream classes."""
    from sglang.srt.managers.scheduler import GenerationBatchResult

    def params(fn):
        return list(inspect.signature(fn).parameters)

    result_fields = set(inspect.signature(GenerationBatchResult).parameters)
    return {
        "subclass": issubclass(w.DDTreeWorkerV2, DFlashWorkerV2),
        "init": params(DFlashWorkerV2.__init__) == params(w.DDTreeWorkerV2.__init__),
        "forward": params(DFlashWorkerV2.forward_batch_generation) == params(
            w.DDTreeWorkerV2.forward_batch_generation),
        "append_kv": {"target_hidden", "cache_loc", "positions", "cache_loc_2d", "commit_lens"}
        <= set(params(DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc)),
        "next_input": params(DFlashWorkerV2._make_next_draft_input_decode)[1:] == ["bonus_tokens", "new_seq_lens"]
        and params(DFlashWorkerV2._make_next_draft_input_prefill)[1:] == ["bonus_tokens", "seq_lens"],
        "result": {"logits_output", "next_token_ids", "accept_lens", "can_run_cuda_graph", "next_draft_input",
                   "speculative_num_draft_tokens", "new_seq_lens"} <= result_fields,
        "verify_input": {"draft_token", "positions", "draft_token_num", "custom_mask", "capture_hidden_mode",
                         *(("kv_loc_plan",) if V23 else ())}
        <= set(inspect.signature(DFlashVerifyInput).parameters),
        "result_v23": not V23 or {"routed_experts_output", "indexer_topk_output"} <= result_fields,
        "sampler_hook": hasattr(DFlashWorkerV2, "_maybe_build_draft_sampler"),
        # what `ddtree_internal_state` reads of the target's verify graphs (by name; no runner is built here)
        "graph_runner": _graph_runner_names(),
    }


def _graph_runner_names() -> bool:
    import sglang.srt.model_executor.model_runner as mr
    import sglang.srt.model_executor.runner.decode_cuda_graph_runner as dr

    runner, decode = Path(mr.__file__).read_text(), Path(dr.__file__).read_text()
    return ("self.decode_cuda_graph_runner = " in runner and "self.captured_req_width = " in decode
            and "self.max_bs = " in decode)


def triton_layout() -> dict:
    """The layout the step writes, as 0.5.17's triton backend and extend kernel read it (source lines)."""
    import sglang.kernels.ops.attention.extend_attention as ext
    import sglang.srt.layers.attention.triton_backend as tb

    backend = re.sub(r"\s+", " ", Path(tb.__file__).read_text())
    kernel = Path(ext.__file__).read_text()
    width = "num_tokens_per_req" if V23 else "num_draft_tokens"  # 0.5.23 renamed it (spec_info's own width)
    return {
        "indptr": backend.count(f"seq_mask_len = {width} * (seq_lens + {width})") == 1
        and f"forward_batch.seq_lens + {width}" in backend,
        # query row stride = prefix + extend; an extend key sits after the prefix
        "row": bool(re.search(r"\* \(cur_seq_len \+ window_kv_offset\)\s*\+ window_kv_offset\s*\+ cur_seq_len_prefix",
                              kernel)),
    }


def allowed(parents: list[int], i: int, j: int) -> bool:
    """Oracle: node i attends to node j iff j is i or one of its ancestors (parent pointers, -1 = none)."""
    while i >= 0:
        if i == j:
            return True
        i = parents[i]
    return False


def triton_cell(mask: torch.Tensor, prefix: list[int], n: int, b: int, q: int, k: int) -> bool:
    """Read a mask cell the way the triton backend indexes it: `mask_indptr = cumsum(n * (seq_lens + n))`, row
    stride `seq_len + n`, key k (the prefix first, then the extend tokens)."""
    start = sum(n * (p + n) for p in prefix[:b])
    return bool(mask[start + q * (prefix[b] + n) + k])


def verify_inputs(trials: int = 40) -> dict:
    """`tree_verify_input` on random trees against the oracles; a chain must give DFLASH's causal mask."""
    rng = random.Random(7)
    bad: list[str] = []
    chains_causal = 0
    for trial in range(trials):
        bs, depth, vocab = rng.randint(1, 4), rng.randint(1, 6), rng.randint(3, 12)
        chain = trial % 4 == 0
        budget = depth if chain else rng.randint(1, 12)
        gen = torch.Generator().manual_seed(trial)
        logits = torch.randn((bs, depth, vocab), generator=gen) * 3
        if chain:  # one candidate per depth: the tree is the draft's chain
            tree = build_ddtree(logits, budget, topk_cap=1)
        else:
            tree = build_ddtree(logits, budget, topk_cap=rng.choice([None, 2, 3]))
        n = tree.parents.shape[1]
        prefix = [rng.randint(0, 9) for _ in range(bs)]
        width = max(prefix) + n + 3
        pool = torch.randperm(bs * width + 5, generator=gen)[: 2 * bs * width].view(-1)[: (bs + 2) * width]
        req_to_token = torch.zeros((bs + 2, width), dtype=torch.int32)
        req_to_token.view(-1)[: pool.numel()] = pool.to(torch.int32)
        rows = torch.randperm(bs + 2, generator=gen)[:bs]
        bonus = torch.randint(0, vocab, (bs,), generator=gen)
        slack = rng.choice([0, 0, 5])  # a host bound above the true prefix total
        v = s.tree_verify_input(tree, bonus, torch.tensor(prefix), req_to_token, rows, sum(prefix) + slack)
        if v.custom_mask.numel() != n * (sum(prefix) + slack + bs * n):
            bad.append(f"{trial}: mask size")
        parents, depths = tree.parents.tolist(), tree.depths.tolist()
        for b in range(bs):
            for i in range(n):
                flat = b * n + i
                want_token = int(bonus[b]) if i == 0 else int(tree.token_ids[b, i - 1])
                if int(v.tokens[flat]) != want_token:
                    bad.append(f"{trial}: token {b},{i}")
                if int(v.positions[flat]) != prefix[b] + depths[b][i]:
                    bad.append(f"{trial}: position {b},{i}")
                if int(v.out_cache_loc[flat]) != int(req_to_token[int(rows[b]), prefix[b] + i]):
                    bad.append(f"{trial}: slot {b},{i}")
                for k in range(prefix[b] + n):
                    want = True if k < prefix[b] else allowed(parents[b], i, k - prefix[b])
                    if triton_cell(v.custom_mask, prefix, n, b, i, k) != want:
                        bad.append(f"{trial}: mask {b},{i},{k}")
        if chain and all(int(x) == n for x in tree.num_nodes):
            causal = all(
                triton_cell(v.custom_mask, prefix, n, b, i, k) == (k <= prefix[b] + i)
                for b in range(bs) for i in range(n) for k in range(prefix[b] + n)
            )
            chains_causal += causal
            if not causal:
                bad.append(f"{trial}: chain not causal")
    return {"bad": bad[:20], "chains_causal": chains_causal}


def sharded_draft_logits() -> bool:
    """draft_tree_logits over a vocab-parallel head on 2 emulated ranks (SGLang's shard layout: rank r holds
    tokens r * padded .. of an odd vocabulary, the last shard padded): every rank gets one device's logits."""
    vocab, tp, padded = 11, 2, 8
    g = torch.Generator().manual_seed(6)
    weight, hidden = torch.randn(vocab, 5, generator=g), torch.randn(2, 4, 5, generator=g)
    heads = []
    for rank in range(tp):
        start, end = min(rank * padded, vocab), min((rank + 1) * padded, vocab)
        local = torch.zeros(padded, 5)
        local[: end - start] = weight[start:end]
        heads.append(SimpleNamespace(weight=local, org_vocab_size=vocab,
                                     shard_indices=SimpleNamespace(num_org_elements=end - start,
                                                                   num_org_elements_padded=padded)))
    sent: dict[int, torch.Tensor] = {}

    def sending(rank: int) -> SimpleNamespace:  # pass 1: what each rank contributes to the gather
        return SimpleNamespace(world_size=tp, all_gather=lambda x, dim=-1: sent.setdefault(rank, x.clone()))

    gathered = SimpleNamespace(world_size=tp, all_gather=lambda x, dim=-1: torch.cat([sent[r] for r in range(tp)], dim))
    for rank in range(tp):
        s.draft_tree_logits(hidden, heads[rank], vocab, sending(rank))
    want = hidden[:, 1:, :] @ weight.T
    return all(torch.allclose(s.draft_tree_logits(hidden, heads[rank], vocab, gathered), want, atol=1e-5)
               for rank in range(tp))


def small_pieces() -> dict:
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 4, 5, generator=g)
    weight = torch.randn(9, 5, generator=g)
    logits = s.draft_tree_logits(hidden, SimpleNamespace(weight=weight[:7]), 7, None)
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(top_k=k)) for k in (1, 40, 1 << 30, 1)]
    bounds, total = s.host_prefix_bounds(torch.tensor([3, 5], dtype=torch.int32), None, 4)
    r_bounds, r_total = s.host_prefix_bounds(None, torch.tensor([20, 30], dtype=torch.int32), 4)
    return {
        # an absolute tolerance: a matmul of another shape may round a near-zero logit differently
        "draft_logits": bool(torch.allclose(logits, hidden[:, 1:, :] @ weight[:7].T, atol=1e-5))
        and list(logits.shape) == [2, 3, 7],
        "sharded_draft_logits": sharded_draft_logits(),
        "sampled_rows": s.sampled_rows(reqs),
        "bounds": [bounds.tolist(), total, r_bounds.tolist(), r_total],
        "no_bounds": s.host_prefix_bounds(None, None, 4) == (None, None),
    }


GOOD = dict(speculative_ddtree_mode="full", speculative_ddtree_budget=7, speculative_num_draft_tokens=4,
            speculative_ddtree_topk_cap=None, speculative_ddtree_keep_chain=False, disable_overlap_schedule=True,
            attention_backend="triton", decode_attention_backend=None, prefill_attention_backend=None, page_size=1,
            tp_size=1, pp_size=1, speculative_draft_window_size=None, sampling_backend="pytorch")


def refusals() -> dict:
    cases = {
        "good": {},
        "auto": {"speculative_ddtree_budget": "auto"},
        "overlap": {"disable_overlap_schedule": False},
        "flashinfer": {"attention_backend": "flashinfer"},
        "backend unset": {"attention_backend": None},
        "decode fa3": {"decode_attention_backend": "fa3"},
        "page": {"page_size": 16},
        "tp": {"tp_size": 2},
        "pp": {"pp_size": 2},
        "window": {"speculative_draft_window_size": 512},
    }
    out = {name: w.v2_refusal(SimpleNamespace(**{**GOOD, **change})) for name, change in cases.items()}
    os.environ[TEST_V2_TP] = "1"  # the TP proof's servers: --tp-size 2 served, --pp-size still refused
    try:
        out["tp under switch"] = w.v2_refusal(SimpleNamespace(**{**GOOD, **cases["tp"]}))
        out["pp under switch"] = w.v2_refusal(SimpleNamespace(**{**GOOD, **cases["pp"]}))
    finally:
        del os.environ[TEST_V2_TP]
    out["hybrid"] = w.v2_refusal(SimpleNamespace(**GOOD), hybrid=True)
    out["simulated"] = w.v2_refusal(SimpleNamespace(**GOOD), simulate_acc_len=3)
    # the worker refuses before upstream builds anything (its __init__ would need a GPU and models)
    target = SimpleNamespace(model_runner=SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace())))
    try:
        w.mambaish_config = lambda config: None  # the model config is a stand-in; hybrid is checked above
        w.DDTreeWorkerV2(*init_args(SimpleNamespace(**{**GOOD, "disable_overlap_schedule": False}), target))
        out["init"] = None
    except w.DDTreeV2Refused as e:
        out["init"] = str(e)
    out["seams_after_refusal"] = seams.active() is not None
    # the built target backend, asked before the graphs: the real class with upstream's switches set as a gfx95
    # GPU would set them (its __init__ needs a model runner); which switches upstream's __init__ sets at all
    def triton(**switches) -> TritonAttnBackend:
        backend = TritonAttnBackend.__new__(TritonAttnBackend)
        backend.__dict__.update(switches)
        return backend

    out["backend triton"] = s.verify_backend_refusal(triton(use_verify_splitkv=False))
    out["backend split-kv"] = s.verify_backend_refusal(triton(use_verify_splitkv=True))
    out["backend hybrid split-kv"] = s.verify_backend_refusal(
        SimpleNamespace(full_attn_backend=triton(use_verify_splitkv=True)))
    out["backend shared-kv"] = s.verify_backend_refusal(triton(use_verify_shared_kv=True))
    out["backend other"] = s.verify_backend_refusal(SimpleNamespace())
    # the target's LM head the tree drafts through: a float matrix; a quantized one refused at start, not at the
    # first tree step (a crash mid-serving)
    heads = {"bf16": torch.zeros(8, 4, dtype=torch.bfloat16), "fp32": torch.zeros(8, 4),
             "fp8": torch.zeros(8, 4).to(torch.float8_e4m3fn), "int8": torch.zeros(8, 4, dtype=torch.int8),
             "vector": torch.zeros(8)}
    for name, weight in heads.items():
        out[f"head {name}"] = s.head_refusal(SimpleNamespace(lm_head=SimpleNamespace(weight=weight)))
    out["head qweight only"] = s.head_refusal(SimpleNamespace(lm_head=SimpleNamespace(qweight=heads["int8"])))
    out["no head"] = s.head_refusal(SimpleNamespace())
    worker = object.__new__(w.DDTreeWorkerV2)
    fp8_target = SimpleNamespace(model=SimpleNamespace(lm_head=SimpleNamespace(weight=heads["fp8"])))
    worker.__dict__.update(model_runner=SimpleNamespace(attn_backend=triton(use_verify_splitkv=False)),
                           _target_worker=SimpleNamespace(model_runner=fp8_target))
    try:
        worker.init_cuda_graphs()  # refused before upstream captures anything
        out["start with fp8 head"] = None
    except w.DDTreeV2Refused as e:
        out["start with fp8 head"] = str(e)
    init_source = inspect.getsource(TritonAttnBackend.__init__)
    out["chain-only switches upstream sets"] = [n for n in s.CHAIN_ONLY_VERIFY if f"self.{n} =" in init_source]
    if V23:  # 0.5.23's own: DP attention; the draft checkpoint's heads and translating pools (known after __init__)
        out["dp attention"] = w.v2_refusal(SimpleNamespace(**{**GOOD, "attn_dp_size": 2}))
        heads = SimpleNamespace(selector=object(), lilicorr=None, _is_domino=True)
        out["draft heads"] = w.draft_head_refusal(heads)
        out["no draft heads"] = w.draft_head_refusal(SimpleNamespace(selector=None, lilicorr=None, _is_domino=False))
        runner = SimpleNamespace(kv_index_translator=SimpleNamespace(is_translating=False))
        unified = SimpleNamespace(kv_index_translator=SimpleNamespace(is_translating=True))
        out["pool"] = w.pool_refusal(SimpleNamespace(model_runner=unified, draft_model_runner=runner))
        out["no pool"] = w.pool_refusal(SimpleNamespace(model_runner=runner, draft_model_runner=runner))
    return out


def init_args(server_args, target_worker) -> tuple:
    """The worker's constructor arguments on this base (0.5.17 passes the `ps`, 0.5.23 does not)."""
    return (server_args, 0, 0, target_worker) if V23 else (server_args, 0, None, 0, target_worker)


def worker_selection() -> dict:
    """What `create_worker` returns once `load_plugins()` (as each scheduler process calls it) has applied the
    registered hooks; whether the scheduler's `get_internal_state` runs the payload's hook."""
    load_plugins()
    full = SimpleNamespace(speculative_ddtree_mode="full", enable_multi_layer_eagle=False)
    shadow = SimpleNamespace(speculative_ddtree_mode="shadow-linear")
    return {
        "registered": v2args._workers_registered,
        "state_hook": seams.hook_took(v2args.INTERNAL_STATE_TARGET, v2args._internal_state),
        "full": SpeculativeAlgorithm.DFLASH.create_worker(full).__name__,
        "shadow": SpeculativeAlgorithm.DFLASH.create_worker(shadow).__name__,
        "eagle_full": SpeculativeAlgorithm.EAGLE.create_worker(full).__name__,
    }


# --- one decode step on CPU stand-ins ---------------------------------------------------------------------------

BLOCK, BUDGET = 4, 7


def target_next(position: int, token: int) -> int:
    """The stand-in target's greedy choice after `token` at `position`."""
    return (3 * token + 5 * position + 1) % po.VOCAB


def plain_chain(bonus: int, prefix: int) -> list[int]:
    """Plain greedy decoding of the stand-in target: the block's tokens after `bonus` at `prefix`."""
    tokens, tok = [], bonus
    for d in range(BLOCK):
        tok = target_next(prefix + d, tok)
        tokens.append(tok)
    return tokens


class Sampling(SimpleNamespace):
    """A batch's `SamplingBatchInfo`, the fields upstream's verify adjustments and the walk read."""

    def __len__(self) -> int:
        return len(self.temperatures)


def sampling(bs: int) -> tuple[Sampling, list]:
    """Request 0 greedy with a logit bias that forces token 0, request 1 sampled (T = 1), the others greedy."""
    bias = torch.zeros((bs, po.VOCAB))
    bias[0, 0] = 100.0
    top_k = [1, 1 << 30] + [1] * (bs - 2)
    info = Sampling(temperatures=torch.ones((bs, 1)), top_ks=torch.tensor(top_k), top_ps=torch.ones(bs),
                    min_ps=torch.zeros(bs), need_min_p_sampling=False, has_custom_logit_processor=False,
                    penalizer_orchestrator=None, grammar_mask=None, logit_bias=bias, acc_linear_penalties=None)
    return info, [SimpleNamespace(sampling_params=SimpleNamespace(top_k=k, top_p=1.0, min_p=0.0), output_ids=[1, 2])
                  for k in top_k]


def one_hot_target(position: int, token: int) -> torch.Tensor:
    """The stand-in target's verify logits at a node: 5 at `target_next`, -5 elsewhere."""
    logits = torch.full((po.VOCAB,), -5.0)
    logits[target_next(position, token)] = 5.0
    return logits


def assign_cache_locs(req_pool_indices, req_to_token, start_offset, end_offset, batch_size, draft_token_num,
                      device):
    """Upstream's `assign_extend_cache_locs` in torch: each row's `draft_token_num` slots from `start_offset`."""
    cols = start_offset[:, None] + torch.arange(draft_token_num)
    return req_to_token[req_pool_indices[:, None], cols].to(torch.int64).reshape(-1)


def run_step(prefix: torch.Tensor, rows: torch.Tensor, req_to_token: torch.Tensor, bonus_in: torch.Tensor,
             draft_hidden: torch.Tensor, target_logits, info, reqs, *, worker: w.DDTreeWorkerV2 | None = None,
             graph: bool = False, dispatch: bool = False, budget: int | None = None) -> tuple:
    """One `_tree_step` on the stand-ins (module docstring), of a fresh worker made without `__init__` or of `worker`
    (its settings and stats kept): the draft returns `draft_hidden` `[bs, block, vocab]` (an identity LM head), the
    target's verify logits at a node are `target_logits(position, token)`, and it says `can_run_cuda_graph=graph`.
    `dispatch`: the decode batch goes through the worker's `forward_batch_generation` instead (auto may hand it to
    upstream's step, which the caller stubs); else `budget` is the tree step's (None: the configured one). Returns (the
    result, what the stand-ins recorded, what was published)."""
    bs = len(prefix)
    recorded: dict = {}

    def prepare_for_verify(self, batch, target_worker, **kw):
        recorded["verify"] = self
        recorded["host_seq_lens"] = batch.seq_lens_cpu.tolist()
        recorded["verify_out_cache_loc"] = batch.out_cache_loc.clone()
        # the graph runner upstream's `prepare_for_verify` asks `can_run_graph` and loads the batch into
        recorded["planned_on"] = target_worker.model_runner.decode_cuda_graph_runner.captured_req_width
        return SimpleNamespace(spec_info=self), False

    def target_forward(batch=None, forward_batch=None, is_verify=False, skip_attn_backend_init=False):
        v = forward_batch.spec_info
        recorded["replayed_on"] = runner.decode_cuda_graph_runner.captured_req_width  # the forward's runner
        logits = torch.stack([target_logits(int(v.positions[r]), int(v.draft_token[r]))
                              for r in range(bs * v.draft_token_num)])
        hidden = torch.arange(bs * v.draft_token_num, dtype=torch.float32)[:, None].repeat(1, 2)  # row id
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits, hidden_states=hidden),
                               can_run_cuda_graph=graph, routed_experts_output=None, indexer_topk_output=None)

    def draft_forward(forward_batch):
        recorded["draft_batch"] = forward_batch
        return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=draft_hidden.reshape(-1, po.VOCAB)))

    def append_kv(**kw):
        recorded["kv"] = kw

    DFlashVerifyInput.prepare_for_verify = prepare_for_verify
    s.assign_extend_cache_locs_func = assign_cache_locs  # the shared step prepares the draft block
    if worker is None:
        worker = object.__new__(w.DDTreeWorkerV2)
        worker.__dict__.update(tree_budget=BUDGET, tree_topk_cap=None, tree_keep_chain=False, sampling_rule="pytorch",
                               ddtree_stats=DDTreeStats())
    lm_head = SimpleNamespace(weight=torch.eye(po.VOCAB))
    model = SimpleNamespace(lm_head=lm_head, get_input_embeddings=lambda: (lambda ids: ids[..., None].float()))
    # 0.5.17's DecodeCudaGraphRunner's names; under auto's ladder the target model runner it captured on, whose
    # `decode_cuda_graph_runner` the step swaps for its verify
    ladder = getattr(worker, "_verify_ladder", None)
    if ladder is not None:
        runner = ladder.model_runner
    else:
        runner = getattr(getattr(worker, "_target_worker", None), "model_runner", None) if worker else None
        if getattr(runner, "decode_cuda_graph_runner", None) is None:
            runner = SimpleNamespace(decode_cuda_graph_runner=SimpleNamespace(
                captured_req_width=BUDGET + 1, max_bs=16, capture_bs=[1, 2, 4, 8, 16]))
    runner.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token, size=16)
    runner.model = model
    widest = runner.decode_cuda_graph_runner
    draft_runner = SimpleNamespace(forward=draft_forward)
    worker.__dict__.update(
        block_size=BLOCK, device=torch.device("cpu"), model_runner=runner, _mask_token_id=po.VOCAB - 1,
        _target_worker=SimpleNamespace(model_runner=runner, forward_batch_generation=target_forward),
        draft_model_runner=draft_runner,
        _draft_block_spec_info=None, _block_pos_offsets=torch.arange(BLOCK), _draft_block_ids_buf=None,
        _append_target_hidden_to_draft_kv_by_loc=append_kv,
    )
    if V23:  # 0.5.23's draft forward reads these; the KV plans go through a real (pass-through) translator
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

        def translator() -> KVIndexTranslator:  # a static pool's: ids index it as they are
            return KVIndexTranslator(req_to_token=req_to_token, token_to_kv_pool_allocator=None,
                                     token_to_kv_pool=None, page_size=1, device="cpu")

        runner.kv_index_translator, draft_runner.kv_index_translator = translator(), translator()
        # reads the published parallel config (MoE EP / DP gather padding, both out of the step's scope): none on CPU
        w.enable_num_token_non_padded = lambda: False
        worker.__dict__.update(_full_embed_gpu=None, draft_model=SimpleNamespace(), _noise_embed_scale=1.0,
                               draft_parallel_layout=SimpleNamespace(tp_group=None), _target_logits_processor=None)
    draft_input = seams.DDTreeDraftInputV2.from_dflash(
        w.DFlashWorkerV2._make_next_draft_input_decode(worker, bonus_tokens=bonus_in, new_seq_lens=prefix))
    batch = SimpleNamespace(
        seq_lens=prefix.clone(), seq_lens_cpu=prefix.clone().to(torch.int32), seq_lens_sum=int(prefix.sum()),
        req_pool_indices=rows, spec_info=draft_input, out_cache_loc=None, sampling_info=info, reqs=reqs,
        can_run_decode_cuda_graph=False, forward_mode=Mode(kind="decode"), is_extend_in_batch=False, has_grammar=False,
        return_logprob=False,
    )
    recorded["block_slots"] = assign_cache_locs(rows, req_to_token, prefix, prefix + BLOCK, bs, BLOCK, "cpu")
    published: list = []
    if dispatch:
        result = worker.forward_batch_generation(batch, published.append)
    else:
        result = worker._tree_step(batch, published.append, budget=budget)
    recorded["runner_restored"] = runner.decode_cuda_graph_runner is widest  # every other forward: SGLang's own set
    return result, recorded, published


def decode_step(seed: int, sampled: bool = False, *, worker: w.DDTreeWorkerV2 | None = None, graph: bool = False,
                dispatch: bool = False, budget: int | None = None) -> dict:
    gen = torch.Generator().manual_seed(seed)
    bs, width = 3, 40
    prefix = torch.tensor([5, 9, 2])
    rows = torch.tensor([2, 0, 3])
    req_to_token = torch.zeros((4, width), dtype=torch.int32)
    req_to_token.view(-1)[:] = torch.randperm(4 * width, generator=gen).to(torch.int32) + 1
    before = req_to_token.clone()
    bonus_in = torch.randint(0, po.VOCAB, (bs,), generator=gen)

    # the draft guesses the target's chain at most depths (one-hot hidden states through an identity LM head)
    chain = []
    for b in range(bs):
        tokens, tok = [], int(bonus_in[b])
        for d in range(BLOCK - 1):
            tok = target_next(int(prefix[b]) + d, tok)
            tokens.append(tok)
        chain.append(tokens)
    draft_hidden = torch.randn((bs, BLOCK, po.VOCAB), generator=gen)
    for b in range(bs):
        for d, tok in enumerate(chain[b]):
            if (b + d + seed) % 3:  # sometimes the draft's best guess is wrong
                draft_hidden[b, d + 1, tok] += 6.0

    if sampled:
        info, reqs = sampling(bs)
    else:
        info, reqs = None, [None] * bs
    result, recorded, published = run_step(prefix, rows, req_to_token, bonus_in, draft_hidden, one_hot_target,
                                           info, reqs, worker=worker, graph=graph, dispatch=dispatch, budget=budget)
    if "verify" not in recorded:  # upstream's linear step ran it (auto's chain): its tokens against plain's
        lens, out = result.accept_lens.tolist(), result.next_token_ids.view(bs, BLOCK).tolist()
        plain = [plain_chain(int(bonus_in[b]), int(prefix[b])) for b in range(bs)]
        return {"chain": True, "lens": lens, "greedy": all(out[b][: lens[b]] == plain[b][: lens[b]] for b in range(bs)),
                "untouched": torch.equal(req_to_token, before), "runner_restored": recorded["runner_restored"]}

    # oracles: (1) what the step emits is plain greedy decoding of the stand-in target from each bonus token;
    # (2) its length is how far the tree holds that chain (the tree read back from the tokens, positions and
    # mask the step sent: a node's parent is the node it sees one position up)
    verify = recorded["verify"]
    n = verify.draft_token_num
    tokens = verify.draft_token.view(bs, n).tolist()
    positions = verify.positions.view(bs, n).tolist()
    out = result.next_token_ids.view(bs, BLOCK).tolist()
    lens = result.accept_lens.tolist()
    kv = recorded["kv"]
    plain, walked, ok_slots, ok_kv = [], [], True, True
    for b in range(bs):
        p, r = int(prefix[b]), int(rows[b])
        chain_tokens, tok = [], int(bonus_in[b])
        for d in range(BLOCK):
            tok = target_next(p + d, tok)
            chain_tokens.append(tok)
        plain.append(chain_tokens)
        node, length = 0, 0
        while True:
            nxt = target_next(positions[b][node], tokens[b][node])
            kids = [j for j in range(1, n) if tokens[b][j] == nxt and _is_parent(verify, b, n, prefix, node, j)]
            length += 1
            if not kids:
                break
            node = kids[0]
        walked.append(length)
        # the segment is a permutation of the slots it held; the prefix and other rows are untouched
        ok_slots &= sorted(req_to_token[r, p : p + n].tolist()) == sorted(before[r, p : p + n].tolist())
        ok_slots &= bool(torch.equal(req_to_token[r, :p], before[r, :p]))
        for k in range(lens[b]):
            e = b * BLOCK + k
            slot = int(kv["cache_loc"][e])
            node_row = int(kv["target_hidden"][e, 0])  # the verify row of the node whose state goes there
            ok_kv &= slot == int(req_to_token[r, p + k]) and int(kv["positions"][e]) == p + k
            ok_kv &= int(before[r, p + node_row - b * n]) == slot
    others = [i for i in range(4) if i not in rows.tolist()]
    ok_slots &= all(torch.equal(req_to_token[i], before[i]) for i in others)
    return {
        "greedy": all(out[b][: lens[b]] == plain[b][: lens[b]] for b in range(bs) if not sampled),
        "biased": out[0][: lens[0]] == [0] * lens[0],
        "bonus_is_last": all(result.next_draft_input.bonus_tokens[b] == out[b][lens[b] - 1] for b in range(bs)),
        "lens": lens,
        "walked": walked,
        "new_seq_lens": result.new_seq_lens.tolist(),
        "published": published[0].tolist(),
        "prefix_plus": (prefix + result.accept_lens).tolist(),
        "stride": result.speculative_num_draft_tokens,
        "next_bonus": result.next_draft_input.bonus_tokens.tolist(),
        "next_class": type(result.next_draft_input).__name__,
        "slots_permuted_in_place": ok_slots,
        "kv_plan": ok_kv and kv["cache_loc_2d"].shape == (bs, BLOCK) and kv["commit_lens"].tolist() == lens,
        "host_seq_lens": recorded["host_seq_lens"],
        "verify_width": recorded["verify"].draft_token_num,
        "planned_on": recorded["planned_on"],
        "replayed_on": recorded["replayed_on"],
        "runner_restored": recorded["runner_restored"],
        "mask_cells": int(recorded["verify"].custom_mask.numel()),
        "kv_plans": kv_plans(recorded, n),
        # per request the tree's nodes, root included: a padding node sits at depth 0, the root's position
        "nodes": [1 + sum(pos > int(prefix[b]) for pos in positions[b][1:]) for b in range(bs)],
    }


def kv_plans(recorded: dict, n: int) -> bool | None:
    """0.5.23 only (None on 0.5.17): the verify's `KVLocPlan` is its own window (the tree's slots, read extent
    `1 + budget`), and the draft batch was bound to a plan of the block's slots (read extent block)."""
    if not V23:
        return None
    plan, draft = recorded["verify"].kv_loc_plan, recorded["draft_batch"]
    return (plan is not None and torch.equal(plan.write_virtual, recorded["verify_out_cache_loc"])
            and plan.read_extent == n and draft.kv_loc_plan.read_extent == BLOCK
            and torch.equal(draft.out_cache_loc, recorded["block_slots"]))


# --- penalties over many decode steps ----------------------------------------------------------------------------

def penalty_run(seed: int, steps: int = 24, neutral: bool = False) -> dict:
    """`steps` tree steps of a batch of 4 requests with random penalty settings, each step's output appended to
    `req.output_ids` as the scheduler does; the sampling info each step sees is a real forward copy
    (`copy_for_forward`, as `Scheduler._forward_isolation` makes it) of a sampling info whose orchestrator, as under
    spec decoding, never counted a token. Compared with `plain_greedy`: the tokens, and the logits the walk read at
    every committed node bit for bit."""
    rng = random.Random(1000 + seed)
    gen = torch.Generator().manual_seed(seed)
    bs = 4
    settings, bias = po.random_settings(rng, bs, neutral)
    prompt_lens = [rng.randint(3, 9) for _ in range(bs)]
    firsts = [rng.choice([0, 1, 2, 3, 4, 5, 6]) for _ in range(bs)]  # the prefill's token (never a stop token)
    oracle = po.plain_greedy(settings, firsts, prompt_lens, bias, steps * BLOCK + 1)
    reqs = [po.request(s, f, p) for s, f, p in zip(settings, firsts, prompt_lens, strict=True)]
    _, spec_info = po.sampling_info(reqs, bias)  # the spec batch's own: nothing is ever cumulated into it

    seen: dict = {}
    walk = s.tree_walk

    def recording_walk(tree, candidates, logits, **kw):
        seen["tree"], seen["candidates"], seen["logits"] = tree, candidates, logits.clone()
        return walk(tree, candidates, logits, **kw)

    s.tree_walk = recording_walk
    bad: list[str] = []
    exact_nodes = deep = 0
    try:
        for step in range(steps):
            prefix = torch.tensor([p + len(r.output_ids) - 1 for p, r in zip(prompt_lens, reqs, strict=True)])
            width = int(prefix.max()) + BUDGET + 2
            req_to_token = torch.randperm(bs * width, generator=gen).to(torch.int32).view(bs, width) + 1
            rows = torch.randperm(bs, generator=gen)
            bonus_in = torch.tensor([r.output_ids[-1] for r in reqs])
            # the draft: plain's continuation (mostly), plain's unpenalised choice as a rival, noise
            draft_hidden = torch.randn((bs, BLOCK, po.VOCAB), generator=gen)
            for b, r in enumerate(reqs):
                L, want = len(r.output_ids), oracle["outputs"][b]
                for d in range(BLOCK - 1):
                    if L + d < len(want) and rng.random() < 0.8:
                        draft_hidden[b, d + 1, want[L + d]] += 6.0
                    if L + d - 1 < len(want):
                        rival = int(po.penalty_target(prompt_lens[b] + L + d - 1, want[L + d - 1]).argmax())
                        draft_hidden[b, d + 1, rival] += 4.0
            result, _, _ = run_step(prefix, rows, req_to_token, bonus_in, draft_hidden, po.penalty_target,
                                    spec_info.copy_for_forward(), reqs)
            out = result.next_token_ids.view(bs, BLOCK).tolist()
            lens = result.accept_lens.tolist()
            tree, cand, logits = seen["tree"], seen["candidates"], seen["logits"]
            for b, r in enumerate(reqs):
                L = len(r.output_ids)
                node = 0
                for d in range(lens[b]):  # the committed path's nodes: their logits are plain's there
                    if not torch.equal(logits[b, node], oracle["logits_at"][b][L + d]):
                        bad.append(f"seed {seed} step {step} req {b} depth {d}: logits differ")
                    exact_nodes += 1
                    deep += d > 0 and dp.request_penalties(r).active
                    if d + 1 < lens[b]:
                        kids = [j for j in range(1, cand.shape[1]) if int(tree.parents[b, j]) == node
                                and int(cand[b, j]) == out[b][d]]
                        node = kids[0]
                r.output_ids.extend(out[b][: lens[b]])
    finally:
        s.tree_walk = walk
    match = all(r.output_ids == o[: len(r.output_ids)] for r, o in zip(reqs, oracle["outputs"], strict=True))
    return {"match": match, "bad": bad[:10], "bad_count": len(bad), "exact_nodes": exact_nodes, "deep_penalised": deep,
            "tokens": sum(len(r.output_ids) - 1 for r in reqs), "order": oracle["order"],
            **{k: oracle[k] for k in ("changed", "banned", "bias_changed", "penalised_tokens")}}


def penalties() -> dict:
    """The tree step's greedy outputs with random penalties equal plain greedy decoding (`plain_greedy`), over many
    steps; the order the step uses is plain's; a batch with nothing penalised never reaches the per-node code; and
    broken variants (upstream's adjustments only: the gap before issue 26; the paths ignored; min_new_tokens
    skipped; the bias applied twice; the penalizers in reverse order) are told apart by the same comparison."""
    from sglang.srt.sampling import sampling_batch_info

    source = Path(sampling_batch_info.__file__).read_text()
    display = "penalizers={" + ",".join(f"penaltylib.{c}" for c in po.PENALIZER_CLASSES) + ",}"
    calls = []
    apply = dp.apply_verify_penalties
    dp.apply_verify_penalties = lambda *a, **k: (calls.append(1), apply(*a, **k))[1]
    try:
        runs = [penalty_run(seed) for seed in range(6)]
        before = len(calls)
        neutral = penalty_run(100, neutral=True)
        neutral_calls = len(calls) - before
    finally:
        dp.apply_verify_penalties = apply
    order = vp.plain_penalizer_order()

    def upstream_only(logits, batch, tree, candidates, **kw):  # the step before issue 26
        s.apply_dflash_verify_logits_adjustments(next_token_logits=logits, sampling_info=batch.sampling_info,
                                                 draft_token_num=candidates.shape[1])
        return True

    paths = dp.path_tokens
    breaks = {
        "upstream_only": mock.patch.object(s, "adjust_tree_verify_logits", upstream_only),
        "paths_ignored": mock.patch.object(dp, "path_tokens", lambda *a: paths(*a).fill_(-1)),
        "min_new_skipped": mock.patch.object(vp, "plain_penalizer_order",
                                             lambda: tuple(x for x in order if x != "min_new_tokens")),
        "bias_twice": mock.patch.dict(vp.STRIPPED, {k: v for k, v in vp.STRIPPED.items() if k != "logit_bias"},
                                      clear=True),
        "order_reversed": mock.patch.object(vp, "plain_penalizer_order", lambda: order[::-1]),
        # the base's rule for `req.eos_token_ids` under min_new_tokens, flipped (0.5.23 bans them, 0.5.17 does not)
        "req_eos_flipped": mock.patch.object(vp, "req_eos_stops", lambda: not V23),
    }
    controls = {}
    for name, patch in breaks.items():
        with patch:
            broken = [penalty_run(seed) for seed in range(6)]
        controls[name] = {"runs_differing": sum(not r["match"] for r in broken),
                          "logits_differing": sum(r["bad_count"] for r in broken)}
    return {
        "runs": runs, "neutral": neutral, "neutral_calls": neutral_calls, "controls": controls,
        "order": list(order),
        "oracle_order": [dp.PENALIZERS[c] for c in runs[0]["order"]],
        "display_as_upstream": re.sub(r"\s+", "", source).count(display) == 1,
    }


# --- the stats a run of steps reports, through the scheduler's own get_internal_state -----------------------


def tree_worker(**change) -> w.DDTreeWorkerV2:
    """The tree worker made by its own `__init__` from server args (GOOD + `change`), upstream's `__init__` (models,
    pools, graphs) stubbed to what the tree worker reads after it; the seams it turns on are turned off again."""
    real = DFlashWorkerV2.__init__

    def upstream_init(self, server_args, *rest):  # 0.5.17: gpu_id, ps, nccl_port, target; 0.5.23: no ps
        self.block_size = int(server_args.speculative_num_draft_tokens)
        self._target_worker, self._draft_worker, self._additional_graph_memory_usage = rest[-1], None, {}
        self.selector, self.lilicorr, self._is_domino = None, None, False  # 0.5.23's draft heads: none loaded

    target = SimpleNamespace(model_runner=SimpleNamespace(model_config=None))
    DFlashWorkerV2.__init__ = upstream_init
    w.mambaish_config = lambda config: None  # the model config is a stand-in; hybrid targets are refused above
    try:
        return w.DDTreeWorkerV2(*init_args(SimpleNamespace(**{**GOOD, **change}), target))
    finally:
        DFlashWorkerV2.__init__ = real
        seams.deactivate()


class Mode(SimpleNamespace):
    def is_extend(self) -> bool:
        return self.kind == "extend"

    def is_idle(self) -> bool:
        return self.kind == "idle"


def upstream_steps(worker: w.DDTreeWorkerV2) -> list:
    """Batches `forward_batch_generation` hands to upstream's step (stubbed: a result with `accept_lens`): a prefill,
    an idle batch and a decode batch holding a grammar request; returns the decode's accept_lens."""
    real = DFlashWorkerV2.forward_batch_generation
    decode_lens = torch.tensor([1, 4, 2], dtype=torch.int32)

    def upstream(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        return SimpleNamespace(accept_lens=decode_lens if batch.forward_mode.kind == "decode" else
                               torch.tensor([1, 1, 1], dtype=torch.int32), can_run_cuda_graph=True)

    DFlashWorkerV2.forward_batch_generation = upstream
    try:
        for kind, grammar in (("extend", False), ("idle", False), ("decode", True)):
            batch = SimpleNamespace(forward_mode=Mode(kind=kind), is_extend_in_batch=kind == "extend",
                                    spec_info=object(), has_grammar=grammar)
            worker.forward_batch_generation(batch)
    finally:
        DFlashWorkerV2.forward_batch_generation = real
    return decode_lens.tolist()


def logprob_dispatch() -> dict:
    """A decode batch asking for logprobs, on a fresh tree worker: 0.5.17 refuses it as upstream does there; 0.5.23
    hands it to upstream's linear step (stubbed), which serves logprobs, and counts a `logprob` fallback; so it does
    a batch in which a request asks for sampling masks (0.5.23's `sampling_mask_batch_indices`)."""
    worker = tree_worker()
    real = DFlashWorkerV2.forward_batch_generation
    handed: list = []

    def upstream(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        handed.append(batch)
        return SimpleNamespace(accept_lens=torch.tensor([2, 1], dtype=torch.int32), can_run_cuda_graph=False)

    def tree_step(batch, on_publish):
        raise AssertionError("a logprob batch reached the tree step")

    DFlashWorkerV2.forward_batch_generation = upstream
    worker.__dict__["_tree_step"] = tree_step
    error = None
    try:
        batch = SimpleNamespace(forward_mode=Mode(kind="decode"), is_extend_in_batch=False, spec_info=object(),
                                has_grammar=False, return_logprob=True)
        worker.forward_batch_generation(batch)
        if V23:
            masks = SimpleNamespace(sampling_mask_batch_indices=torch.tensor([1]))
            worker.forward_batch_generation(SimpleNamespace(
                forward_mode=Mode(kind="decode"), is_extend_in_batch=False, spec_info=object(), has_grammar=False,
                return_logprob=False, sampling_info=masks))
    except ValueError as e:
        error = str(e)
    finally:
        DFlashWorkerV2.forward_batch_generation = real
    stats = worker.ddtree_stats
    return {"handed": len(handed), "error": error, "reasons": dict(stats.fallback_reasons),
            "fallback_steps": stats.fallback_steps, "tree_steps": stats.tree_steps}


def scheduler_state(draft_worker, *, spec: bool = True) -> dict:
    """The real `Scheduler.get_internal_state` (as hooked by `load_plugins`) on a stand-in scheduler, its answer
    through the scheduler's own msgpack IPC encoding, as the tokenizer manager receives it. On 0.5.23 the scheduler
    method delegates to its `SchedulerInternalStateController` (it reads the runtime context and the live pools):
    that controller is stubbed with an answer of upstream's type and keys; the hooked scheduler method is real."""
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.scheduler import Scheduler

    if V23:
        def controller_answer(recv_req):
            state = {"last_gen_throughput": 1.0, **({"avg_spec_accept_length": 2.5} if spec else {})}
            return io_struct.GetInternalStateReqOutput(internal_state=state)

        fake = SimpleNamespace(draft_worker=draft_worker,
                               internal_state=SimpleNamespace(get_internal_state=controller_answer))
        answer = Scheduler.get_internal_state(fake, io_struct.GetInternalStateReq())
        return io_struct.msgpack_decode(io_struct.msgpack_encode(answer)).internal_state
    from sglang.srt.server_args import prepare_server_args, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(prepare_server_args(["--model-path", "dummy"]))
    fake = SimpleNamespace(
        metrics_reporter=SimpleNamespace(last_gen_throughput=1.0, spec_total_num_forward_ct=2,
                                         spec_total_num_accept_tokens=5),
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(weight_load_mem_usage=0.0), graph_memory_usage={}),
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: SimpleNamespace(mem_usage=0.0)),
        startup_available_gpu_memory_gb=1.0, max_total_num_tokens=1, swa_tokens_per_layer=None, startup_time=0.0,
        max_running_requests=1, draft_worker=draft_worker,
        spec_algorithm=SimpleNamespace(is_none=lambda: not spec, is_dspark=lambda: False),
    )
    answer = Scheduler.get_internal_state(fake, io_struct.GetInternalStateReq())
    return io_struct.msgpack_decode(io_struct.msgpack_encode(answer)).internal_state


def stats_run() -> dict:
    """Six tree steps (greedy and sampled, some replaying a graph) and upstream's batches on one worker made by its
    `__init__` (top-k cap 4, keep-chain), then its report through the scheduler; and the scheduler's answer for
    upstream's DFLASH worker, for no speculative worker, and for a tree worker without keep-chain."""
    worker = tree_worker(speculative_ddtree_topk_cap=4, speculative_ddtree_keep_chain=True)
    stats = worker.ddtree_stats
    steps = [decode_step(seed, sampled=seed % 2 == 1, worker=worker, graph=seed % 3 == 0) for seed in range(6)]
    linear = upstream_steps(worker)
    on_device = {"nodes": isinstance(stats.nodes_sum, torch.Tensor), "depths": isinstance(stats.depth_counts, torch.Tensor),
                 "host_hist": dict(stats.accepted_depth_hist)}  # not yet read: no host count per step
    plain_dflash = object.__new__(DFlashWorkerV2)
    # upstream's worker hands unknown attributes to its target worker (`__getattr__`): a real one answers nothing
    plain_dflash.__dict__.update(_draft_worker=None, _additional_graph_memory_usage={},
                                 _target_worker=SimpleNamespace(model_runner=None))
    return {
        "lens": [step["lens"] for step in steps],
        "sampled": [seed % 2 == 1 for seed in range(6)],
        "graph": [seed % 3 == 0 for seed in range(6)],
        "linear_lens": linear,
        "on_device": on_device,
        "state": scheduler_state(worker),
        "dflash": scheduler_state(plain_dflash),
        "none": scheduler_state(None, spec=False),
        "no_keep_chain": scheduler_state(tree_worker()).get("ddtree", {}).get("keep_chain"),
    }


# --- SGLANG_DDTREE_PROFILE=1: v1's phases in the report --------------------------------------------------------


def profile_run() -> dict:
    """A tree worker made by its `__init__` with SGLANG_DDTREE_PROFILE=1: three greedy decode steps through
    `forward_batch_generation`, then upstream's batches (a prefill, an idle batch, a grammar decode: a linear step),
    and its report through the scheduler twice (the second after nothing ran); and one made without the switch."""
    os.environ["SGLANG_DDTREE_PROFILE"] = "1"
    try:
        worker = tree_worker()
    finally:
        del os.environ["SGLANG_DDTREE_PROFILE"]
    steps = [decode_step(seed, worker=worker, dispatch=True) for seed in range(3)]
    upstream_steps(worker)
    first = scheduler_state(worker)["ddtree"]["profile"]
    again = scheduler_state(worker)["ddtree"]["profile"]
    plain = tree_worker()
    decode_step(0, worker=plain, dispatch=True)
    return {"greedy": all(step["greedy"] for step in steps), "profile": first, "again": again,
            "cuda": worker.ddtree_profile.cuda, "off": plain.ddtree_profile is None,
            "off_report": scheduler_state(plain)["ddtree"]["profile"]}


# --- --speculative-ddtree-budget auto on the tree step -----------------------------------------------------------


AUTO_STEPS = 80


def auto_worker(budget_max: int) -> w.DDTreeWorkerV2:
    """A tree worker with `--speculative-ddtree-budget auto` of largest budget `budget_max` (its `__init__`)."""
    return tree_worker(speculative_ddtree_budget="auto", speculative_ddtree_budget_max=budget_max)


def graph_target() -> SimpleNamespace:
    """The target's model runner for the verify-graph cases: a GPU's by name (the ladder is for graphs on one), the
    real `ModelRunner.decode_num_tokens_per_req` (so the seams' width hook) and the real triton backend class."""
    head = SimpleNamespace(weight=torch.eye(po.VOCAB))
    target = SimpleNamespace(
        model=SimpleNamespace(lm_head=head), device="cuda", req_to_token_pool=SimpleNamespace(size=16),
        spec_algorithm=SpeculativeAlgorithm.DFLASH, is_draft_worker=False, model_config=SimpleNamespace(hf_config=None),
        server_args=SimpleNamespace(speculative_num_draft_tokens=BLOCK, speculative_eagle_topk=None),
        attn_backend=stand_in.triton_backend(block=BLOCK, max_context_len=64))
    target.decode_num_tokens_per_req = lambda **kw: ModelRunner.decode_num_tokens_per_req(target, **kw)  # the real one
    return target


def sglang_graphs(worker: w.DDTreeWorkerV2, target: SimpleNamespace,
                  fail_at: int | None = None) -> stand_in.StandInRunner:
    """SGLang's own verify graph runner on `target` (a `StandInRunner` captured with the seams on, as the worker's
    `__init__` left them: at its width `1 + budget`), installed where the verify reads it; the seams off again."""
    seams.activate(seams.SeamSettings(block_size=BLOCK, verify_width=worker.tree_budget + 1))
    stand_in.StandInRunner.block, stand_in.StandInRunner.capture_bs = BLOCK, (1, 2, 4, 8, 16)
    stand_in.StandInRunner.fail_at = fail_at
    get_spec = mock.patch.object(spec_utils, "get_spec", lambda: target.server_args, create=True)  # 0.5.23 reads it
    try:
        with get_spec:
            target.decode_cuda_graph_runner = stand_in.StandInRunner(target)
    finally:
        seams.deactivate()
    return target.decode_cuda_graph_runner


def start_graphs(worker: w.DDTreeWorkerV2, target: SimpleNamespace, fail_at: int | None = None) -> tuple:
    """SGLang's own set on `target` (`sglang_graphs`), then the worker's own `init_cuda_graphs` (upstream's capture
    stubbed; under auto the ladder, `fail_at`: that width's capture fails); returns SGLang's set, the log, and the
    kernels' start-up checks."""
    real_graphs = DFlashWorkerV2.init_cuda_graphs
    DFlashWorkerV2.init_cuda_graphs = lambda self, *a, **k: None
    # the target says "cuda" (the ladder is for graphs on a GPU), so the kernels' start-up check, which would put
    # tensors there, records what it was asked instead (on this CPU it finds no kernels to check either)
    self_tests: list = []

    def self_test(device, budget, depth, *args, smaller=(), pad_widths=(), walk=None, acceptance=None, commit=None):
        self_tests.append({"device": str(device), "budget": budget, "smaller": list(smaller),
                           "pad_widths": list(pad_widths), "acceptance": acceptance is not None,
                           "commit": getattr(commit, "__name__", None)})

    kernels = (mock.patch.object(s, "self_test", self_test), mock.patch.object(s, "kernels_in_use", lambda d: False))
    get_spec = mock.patch.object(spec_utils, "get_spec", lambda: target.server_args, create=True)

    def capture_builds(build, buckets, *, depth, hidden, dtype, device, pool):  # a CUDA graph's contract, on CPU
        return bg.DDTreeBuildGraphs(build, buckets, depth=depth, hidden=hidden, dtype=dtype, device="cpu",
                                    new_graph=RerunGraph)

    builds = (mock.patch.object(bg, "capture_build_graphs", capture_builds),
              mock.patch.object(torch.cuda, "graph_pool_handle", lambda: None))
    try:
        graphs = sglang_graphs(worker, target, fail_at)
        seams.activate(seams.SeamSettings(block_size=BLOCK, verify_width=worker.tree_budget + 1))
        with (get_spec, mock.patch.object(vg, "_replay_seconds", stand_in.replay_seconds), kernels[0], kernels[1],
              builds[0], builds[1]):
            logged = capture_log(lambda: worker.init_cuda_graphs())
    finally:
        DFlashWorkerV2.init_cuda_graphs = real_graphs
        stand_in.StandInRunner.fail_at = None
        seams.deactivate()
    return graphs, logged, self_tests


def auto_run(fail_at: int | None = None, steps: int = AUTO_STEPS) -> dict:
    """A tree worker with `--speculative-ddtree-budget auto` (max 7: candidates chain, 3, 7; verify widths 4 and 8),
    made by its `__init__` and started by its own `init_cuda_graphs` (upstream's capture stubbed): the target's verify
    graph runner is a stand-in of `DecodeCudaGraphRunner` (v2_runner_stand_in: its width from the real
    `ModelRunner.decode_num_tokens_per_req`, so through the seams' hook, active here as on a server) over the real
    triton backend class, so the worker captures its ladder (width 4 beside SGLang's 8) through the real
    `capture_verify_ladder` and seeds auto's costs from its (stand-in) replay timings; `fail_at`: that width's capture
    fails, and the worker must go on with SGLang's one set. Then `steps` greedy decode steps through
    `forward_batch_generation`: auto's tree picks run the tree step, its chain picks upstream's linear step, stubbed as
    linear DFLASH on the same stand-ins (the draft's argmax chain accepted while the target agrees); three steps more
    with auto's pick held at budget 3; three tree steps of budget 2 (not a candidate: a tree padded to the next
    captured width); then upstream's batches (a grammar decode: a fallback auto observes as a chain step) and the
    report through the scheduler."""
    worker = auto_worker(BUDGET)
    target = graph_target()
    backend = TritonAttnBackend.__new__(TritonAttnBackend)
    worker.__dict__.update(model_runner=SimpleNamespace(attn_backend=backend), device=torch.device("cpu"),
                           _target_worker=SimpleNamespace(model_runner=target))
    real_forward = DFlashWorkerV2.forward_batch_generation
    linear_calls: list[list[int]] = []
    chain_runner_widths: list[int] = []

    def linear_step(self, batch, on_publish=None, *rest):
        chain_runner_widths.append(target.decode_cuda_graph_runner.captured_req_width)
        draft = self._draft_hidden(batch, batch.spec_info)[:, 1:, :].argmax(-1)
        lens, out = [], []
        for b in range(len(batch.seq_lens)):
            plain = plain_chain(int(batch.spec_info.bonus_tokens[b]), int(batch.seq_lens[b]))
            n = next((d + 1 for d in range(BLOCK - 1) if int(draft[b, d]) != plain[d]), BLOCK)
            lens.append(n)
            out.append(plain[:n] + [0] * (BLOCK - n))
        linear_calls.append(lens)
        return SimpleNamespace(accept_lens=torch.tensor(lens, dtype=torch.int32), can_run_cuda_graph=False,
                               next_token_ids=torch.tensor(out).reshape(-1))

    sglang_graphs, logged, self_tests = start_graphs(worker, target, fail_at)
    DFlashWorkerV2.forward_batch_generation = linear_step
    try:
        started = worker.ddtree_auto is not None
        ladder = worker._verify_ladder
        ran = [decode_step(seed, worker=worker, dispatch=True) for seed in range(steps)]
        # auto's picks follow this machine's clock; the smaller candidate's step is made sure of here
        smaller = next(c for c in worker.ddtree_auto.candidates if 0 < c.budget < BUDGET)
        with mock.patch.object(worker.ddtree_auto, "choose", lambda *a, **k: smaller):
            held = [decode_step(steps + seed, worker=worker, dispatch=True) for seed in range(3)]
        padded = [decode_step(steps + 3 + seed, worker=worker, budget=2) for seed in range(3)]
        # each step's observation is made when the next forward (or a state read) settles it, not at its own end
        pending = {"pending": worker._pending_observation is not None,
                   "observed": sum(worker.ddtree_auto.verified.values())}
    finally:
        DFlashWorkerV2.forward_batch_generation = real_forward
    linear = upstream_steps(worker)
    return {
        "started": started,
        "ladder": None if ladder is None else {
            "widths": ladder.widths, "sglang_set_kept": ladder.runners[BUDGET + 1] is sglang_graphs,
            "captured": {str(w): r.captured_req_width for w, r in ladder.runners.items()}},
        "log": logged,
        "self_tests": self_tests,
        "steps": ran,
        "held": held,
        "padded": padded,
        "smaller": smaller.budget,
        "linear_calls": linear_calls,
        "chain_runner_widths": chain_runner_widths,
        "build_graphs": {"bs": None if worker._build_graphs is None else worker._build_graphs.sizes,
                         "steps": worker.ddtree_stats.build_graph_steps},
        "fallback_lens": linear,
        "before_state": pending,
        "state": scheduler_state(worker),
    }


# --- upstream's linear steps against block-wide verify graphs ---------------------------------------------------


def linear_runners(worker: w.DDTreeWorkerV2, target: SimpleNamespace, chain: Any = None) -> dict:
    """The target's verify graph runner as upstream's step (stubbed) sees it, and whether SGLang's is installed again
    after it, for each batch handed to it: a prefill, an idle batch, a grammar decode, a grammar decode whose step
    raises, on 0.5.23 a decode asking for logprobs (its fallback there); with `chain` (auto's chain candidate, held as
    auto's pick) a plain decode too."""
    real = DFlashWorkerV2.forward_batch_generation
    graphs = target.decode_cuda_graph_runner

    def upstream(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        now = target.decode_cuda_graph_runner
        batch.saw = "none" if now is None else "sglang" if now is graphs else "other"
        if batch.fail:
            raise RuntimeError("upstream's step failed (stand-in)")
        return SimpleNamespace(accept_lens=torch.tensor([2, 1], dtype=torch.int32), can_run_cuda_graph=False)

    cases = {"prefill": ("extend", False, False, False), "idle": ("idle", False, False, False),
             "grammar": ("decode", True, False, False), "grammar raising": ("decode", True, False, True)}
    if V23:
        cases["logprob"] = ("decode", False, True, False)
    if chain is not None:
        cases["chain"] = ("decode", False, False, False)
    out = {}
    DFlashWorkerV2.forward_batch_generation = upstream
    try:
        for name, (kind, grammar, logprob, fail) in cases.items():
            batch = SimpleNamespace(forward_mode=Mode(kind=kind), is_extend_in_batch=kind == "extend",
                                    spec_info=object(), has_grammar=grammar, return_logprob=logprob,
                                    sampling_info=None, seq_lens=torch.tensor([5, 6]), fail=fail, saw=None)
            raised = None
            with mock.patch.object(worker.ddtree_auto, "choose", lambda *a, **k: chain) if chain else nullcontext():
                try:
                    worker.forward_batch_generation(batch)
                except RuntimeError as e:
                    raised = str(e)
            out[name] = {"saw": batch.saw, "restored": target.decode_cuda_graph_runner is graphs, "raised": raised}
    finally:
        DFlashWorkerV2.forward_batch_generation = real
    return out


def eager_linear() -> dict:
    """Upstream's linear steps (the fallbacks, auto's chain) against SGLang's own verify graphs, captured by the seams
    at `1 + budget` with the tree's mask buffer: for a fixed budget of block - 1 (the default: graphs at the block's
    width, which would replay upstream's maskless linear verify over the last tree's mask) and of 7 (width 8: they
    refuse the block-wide linear verify on their own), and for auto of largest budget block - 1 (started by its own
    `init_cuda_graphs`: its ladder and SGLang's block-wide set); `linear_runners` for each, the width of SGLang's set,
    and the start log."""
    out = {}
    for name, budget in (("default", None), ("budget 7", BUDGET)):
        worker = tree_worker(speculative_ddtree_budget=budget)
        target = graph_target()
        graphs = sglang_graphs(worker, target)
        worker.__dict__.update(_target_worker=SimpleNamespace(model_runner=target))
        out[name] = {"width": graphs.captured_req_width, "budget": worker.tree_budget,
                     "steps": linear_runners(worker, target)}
    worker = auto_worker(BLOCK - 1)
    target = graph_target()
    worker.__dict__.update(model_runner=SimpleNamespace(attn_backend=TritonAttnBackend.__new__(TritonAttnBackend)),
                           device=torch.device("cpu"), _target_worker=SimpleNamespace(model_runner=target))
    graphs, logged, _ = start_graphs(worker, target)
    chain = next(c for c in worker.ddtree_auto.candidates if c.is_chain)
    out["auto"] = {"width": graphs.captured_req_width, "budget": worker.tree_budget,
                   "ladder": None if worker._verify_ladder is None else worker._verify_ladder.widths,
                   "steps": linear_runners(worker, target, chain), "log": logged,
                   "state": {k: v for k, v in worker.ddtree_internal_state().items()
                             if k in ("chain_steps", "fallback_steps", "fallback_reasons")}}
    return out


def capture_log(fn) -> list[str]:
    """The payload's log records (warnings and info) while `fn` runs."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname}: {record.getMessage()}")

    handler = Keep()
    logs = [(log, log.level) for log in map(logging.getLogger, (s.__name__, bg.__name__))]  # the step's, the builds'
    for log, _ in logs:
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        fn()
    finally:
        for log, level in logs:
            log.removeHandler(handler)
            log.setLevel(level)
    return records


def _is_parent(verify, b: int, n: int, prefix, parent: int, child: int) -> bool:
    """From the mask the step sent: `parent` is `child`'s parent iff child sees parent and nothing deeper."""
    p = [int(x) for x in prefix.tolist()]
    row = [triton_cell(verify.custom_mask, p, n, b, child, p[b] + j) for j in range(n)]
    pos = verify.positions.view(len(p), -1)[b].tolist()
    return row[parent] and pos[parent] == pos[child] - 1


if __name__ == "__main__":
    out = {"version": __version__, "switch": os.environ.get("SGLANG_DDTREE_TEST_V2_TREE") == "1"}
    out["selection"] = worker_selection()
    if out["switch"]:
        out["contracts"] = contracts()
        out["triton_layout"] = triton_layout()
        out["verify_inputs"] = verify_inputs()
        out["small"] = small_pieces()
        out["refusals"] = refusals()
        out["steps"] = [decode_step(seed) for seed in range(6)]
        out["sampled_steps"] = [decode_step(seed, sampled=True) for seed in range(4)]
        out["stats"] = stats_run()
        out["profile"] = profile_run()
        out["penalties"] = penalties()
        out["logprob"] = logprob_dispatch()
        out["auto"] = auto_run()
        out["auto_failed"] = auto_run(fail_at=BLOCK, steps=24)
        out["eager_linear"] = eager_linear()
    print(json.dumps(out))

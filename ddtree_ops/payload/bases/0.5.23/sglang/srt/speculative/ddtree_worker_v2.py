"""DDTree full mode on SGLang 0.5.23's v2 DFLASH worker (installed as `sglang/srt/speculative/ddtree_worker_v2.py`
by the 0.5.23 payload; 0.5.23's own glue, a thin adapter). FIRST VERSION, NEVER RUN ON A GPU (0.5.23 needs a newer
torch than the GPU carry has): served only under the proof switch `SGLANG_DDTREE_TEST_V2_TREE=1` (ddtree_v2_args),
whose hook on `SpeculativeAlgorithm.create_worker` picks this class; proven on the CPU only.

The tree step is the shared `ddtree_v2_step.DDTreeStepV2` (one copy with 0.5.17's); this module holds what is 0.5.23's
(`23:` = 0.5.23's `sglang/srt/speculative/dflash_worker_v2.py`):
- the constructor's signature (no `ps`: 0.5.23 reads the runtime context) and the refusals;
- the draft forward as 0.5.23's upstream runs it (23:2503-2688, its eager prepare-block path): the embedding through
  `_resolve_dflash_embedding_module` or the cached full embedding, the noise-embedding scale, a `KVLocPlan` for the
  block window bound to the draft batch, the non-windowed host bound, `draft_tp_context`;
- the verify's own `KVLocPlan`: upstream plans one window per step for draft, verify and draft-KV write alike (all
  the block); the tree verify writes `1 + budget` slots, so it gets a plan over its own `out_cache_loc` with
  `read_extent = 1 + budget`, and the draft-KV write ids come from a plan over the committed (permuted) slots,
  translated by upstream's `_draft_write_ids`;
- the deferred verify gather (`_target_logits_processor`, 23:2884-2898): finished before the walk reads the logits;
- 0.5.23's `GenerationBatchResult` (routed experts / indexer outputs passed on from the verify).

Logprobs: 0.5.23's upstream serves them (`compute_spec_logprobs(..., chain_stride=block)`, 23:2951-2957), unlike
0.5.17. The tree step does not compute them: that function reads the verify rows as a chain (row `b * block + k` =
the k-th committed token), which a tree's rows are not, and a tree-aware version is not written. Refusing them
would break requests upstream serves, so a decode batch asking for logprobs runs upstream's linear DFLASH step
instead (lossless, eager at width block, like a grammar batch) and is counted as a fallback (reason `logprob`).
So does a batch in which a request asks for sampling masks (reason `sampling_mask`: upstream rebuilds them from the
chain's verify rows, 23:2938-2949).

Out of scope, refused at start with the flag named (`v2_refusal`, then the draft checkpoint's heads after upstream's
`__init__` has loaded it): what 0.5.17 refuses (the overlap scheduler, attention backends other than triton, page
size != 1, TP / PP > 1, the draft window, simulated acceptance), hybrid targets (0.5.17's hybrid glue is not
ported), DP attention (`--attn-dp-size`), the candidate-selector / LiLiCorr / Domino draft heads (they
replace the draft's argmax; the tree needs the draft's hidden states), and KV pools that translate ids (unified
hybrid pools, a fused draft: not read through for the tree's permuted slots).

Auto (under its proof switch): the verify-graph ladder of the shared step (`DDTreeStepV2._capture_verify_ladder`), as
on 0.5.17: 0.5.23's `DecodeCudaGraphRunner` takes its width from the same hook and refuses other widths the same way
(23:model_executor/runner/decode_cuda_graph_runner.py:359, :845-870), its triton backend reads a verify's width from
the verify input (`_target_verify_num_tokens_per_req`, 23:layers/attention/triton_backend.py:586-641); each tree
step's verify `KVLocPlan` is over its own width (`_verify_input_extra`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
)
from sglang.srt.speculative import ddtree_args as _args
from sglang.srt.speculative.ddtree_v2_step import (
    DDTreeStepV2,
    DDTreeV2Refused,
    TreeVerify,
    host_prefix_bounds,
    settings_refusal,
)
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2, _resolve_dflash_embedding_module
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import SIMULATE_ACC_LEN, draft_tp_context

logger = logging.getLogger(__name__)

__all__ = ["DDTreeV2Refused", "DDTreeWorkerV2", "draft_head_refusal", "pool_refusal", "v2_refusal"]

FULL = f"{_args.FLAG_MODE} full on SGLang 0.5.23's v2 worker (first version, CPU-proven only)"


def v2_refusal(server_args: Any, *, hybrid: bool = False, simulate_acc_len: int = -1) -> str | None:
    """Why this first 0.5.23 tree step cannot serve `server_args` (the flag named), or None."""
    refusal = settings_refusal(server_args, FULL)
    if refusal:
        return refusal
    if int(getattr(server_args, "attn_dp_size", None) or 1) != 1 or getattr(server_args, "enable_dp_attention", False):
        return f"{FULL} needs --attn-dp-size 1 (DP attention is not supported)."
    if hybrid:  # 0.5.17's hybrid glue (ddtree_v2_hybrid) is not ported to 0.5.23
        return f"{FULL} needs a non-hybrid target (Mamba / GDN / linear-attention layers are not supported on 0.5.23)."
    if simulate_acc_len > 0:
        return f"{FULL} does not support SGLANG_SIMULATE_ACC_LEN (simulated acceptance)."
    return None


def draft_head_refusal(worker: Any) -> str | None:
    """What upstream's `__init__` loaded that the tree step cannot serve: draft heads that replace the draft's
    argmax (the tree is built from the draft's hidden states under the target's LM head)."""
    heads = [name for name, on in (("candidate selector", worker.selector is not None),
                                   ("LiLiCorr", worker.lilicorr is not None),
                                   ("Domino", bool(worker._is_domino))) if on]
    if heads:
        return f"{FULL} does not support the draft checkpoint's {' / '.join(heads)} head."
    return None


def pool_refusal(worker: Any) -> str | None:
    """KV pools that translate slot ids (unified hybrid pools, a fused draft): the tree's permuted slots through
    them are not read through. Asked once the pools exist (`init_attention_backends`: 0.5.23 builds the pools and
    their `kv_index_translator` after the draft worker's `__init__`, 23:managers/scheduler.py:1133-1136, 1100-1117)."""
    for name, runner in (("target", worker.model_runner), ("draft", worker.draft_model_runner)):
        if getattr(getattr(runner, "kv_index_translator", None), "is_translating", False):
            return f"{FULL} does not support a {name} KV pool that translates slot ids (unified or fused-draft pool)."
    return None


class DDTreeWorkerV2(DDTreeStepV2, DFlashWorkerV2):
    """DFLASH's v2 worker with DDTree's tree step on decode; prefill, idle and logprob batches are upstream's."""

    LOGPROB_FALLBACK = True  # upstream serves logprobs on 0.5.23 (module docstring)

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any):
        hybrid = mambaish_config(target_worker.model_runner.model_config) is not None
        refusal = v2_refusal(server_args, hybrid=hybrid, simulate_acc_len=int(SIMULATE_ACC_LEN))
        settings = self.ddtree_activate(server_args, refusal)
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        refusal = draft_head_refusal(self)
        if refusal:
            raise DDTreeV2Refused(refusal)
        self.ddtree_setup(server_args, settings)

    def init_attention_backends(self) -> None:
        super().init_attention_backends()
        refusal = pool_refusal(self)
        if refusal:
            raise DDTreeV2Refused(refusal)

    def forward_batch_generation(self, batch: Any, on_publish: Any = None, grammar_barrier: Any = None,
                                 pp_proxy_tensors: Any = None) -> GenerationBatchResult:
        return self.ddtree_forward(
            batch, on_publish, lambda: super(DDTreeWorkerV2, self).forward_batch_generation(
                batch, on_publish, grammar_barrier, pp_proxy_tensors))

    # ------------------------------------------------------------------ 0.5.23's shapes
    def _base_fallback_reason(self, batch: Any) -> str | None:
        # a request asking for sampling masks: upstream rebuilds them from the chain's verify rows
        # (SpeculativeSamplingMaskCapture.from_logits, 23:2938-2949), which the tree step does not
        info = batch.sampling_info
        if info is not None and getattr(info, "sampling_mask_batch_indices", None) is not None:
            return "sampling_mask"
        return None

    def _host_reserved_cpu(self, draft_input: Any) -> torch.Tensor | None:
        return draft_input.nxt_kv_lens_cpu  # 0.5.23's name for the reservation's host lengths

    def _plan(self, batch: Any, write_virtual: torch.Tensor, read_extent: int, reserved_cpu: Any) -> Any:
        """A `KVLocPlan` over `write_virtual` (virtual ids), as upstream plans its window (23:2588-2598: the
        committed host lengths, else the reservation's)."""
        seq_lens_cpu = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else reserved_cpu
        return self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, seq_lens_cpu=seq_lens_cpu,
            write_virtual=write_virtual, read_extent=read_extent,
        )

    def _draft_hidden(self, batch: Any, draft_input: Any) -> torch.Tensor:
        """Upstream's draft forward (23:2503-2688, its eager prepare-block path, the non-windowed host bound, no
        draft sampler); returns the draft's hidden states `[bs, block, hidden]`."""
        bs, block, prefix_lens = len(batch.seq_lens), int(self.block_size), batch.seq_lens
        block_ids, positions_2d, cache_loc = self._draft_block(batch, draft_input)
        if self._full_embed_gpu is not None:
            embeds = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
        else:
            target_model = self.target_worker.model_runner.model
            embeds = unwrap_lora_layer(_resolve_dflash_embedding_module(self.draft_model, target_model))(block_ids)
        if self._noise_embed_scale != 1.0:
            embeds = embeds * self._noise_embed_scale
        plan = self._plan(batch, cache_loc, block, draft_input.nxt_kv_lens_cpu)
        seq_lens_cpu, _ = host_prefix_bounds(batch.seq_lens_cpu, draft_input.nxt_kv_lens_cpu, block)
        if seq_lens_cpu is None:  # upstream's last resort: the allocated lengths (reservation included)
            seq_lens_cpu = torch.tensor([int(req.kv.kv_allocated_len) for req in batch.reqs], dtype=torch.int64)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens, out_cache_loc=cache_loc,
            seq_lens_sum=int(seq_lens_cpu.sum()), seq_lens_cpu=seq_lens_cpu.to(torch.int32),
            positions=positions_2d.reshape(-1), input_embeds=embeds.view(-1, embeds.shape[-1]),
            spec_algorithm=SpeculativeAlgorithm.DFLASH, spec_info=self._draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            num_token_non_padded=(torch.full((), bs * block, dtype=torch.int32, device=self.device)
                                  if enable_num_token_non_padded() else None),
            global_num_token_non_padded_cpu=bs * block,
            can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
        )
        plan.bind(forward_batch, self.draft_model_runner.kv_index_translator)
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            hidden = self.draft_model_runner.forward(forward_batch).logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DFLASH draft model returned no hidden states.")
        return hidden.view(bs, block, -1)

    def _verify_input_extra(self, batch: Any, verify: TreeVerify, n: int, bounds: torch.Tensor) -> dict[str, Any]:
        # the verify writes node i at `prefix + i` and reads up to `prefix + n`: its own window, not the draft's
        # (called before `prepare_for_verify`, so `batch.spec_info` is still the draft input)
        return {"kv_loc_plan": self._plan(batch, verify.out_cache_loc, n, self._host_reserved_cpu(batch.spec_info))}

    def _full_verify_logits(self, logits_output: Any) -> torch.Tensor:
        logits = logits_output.next_token_logits
        processor = self._target_logits_processor  # upstream defers the verify's vocab gather (23:2884-2898)
        if processor is not None and processor.is_deferred_shard(logits):
            logits = processor.finish_deferred_gather(logits)
        return logits

    def _draft_kv_cache_loc(self, batch: Any, cache_loc: torch.Tensor) -> torch.Tensor:
        # the committed slots are virtual ids (the row's own); the draft pool's ids come from upstream's translation
        # (writes only: no read table is built from this plan, so no host lengths are needed)
        return self._draft_write_ids(self._plan(batch, cache_loc, int(self.block_size), None))

    def _result_extra(self, target_out: Any) -> dict[str, Any]:
        return {"routed_experts_output": target_out.routed_experts_output,
                "indexer_topk_output": target_out.indexer_topk_output}

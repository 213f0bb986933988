"""DDTree full mode on SGLang 0.5.17's v2 DFLASH worker (installed as `sglang/srt/speculative/ddtree_worker_v2.py`
by the 0.5.17 payload; 0.5.17's own glue, a thin adapter). Proven on the H200 (bench/RESULTS.md) and served in full
mode: ddtree_v2_args' hook on `SpeculativeAlgorithm.create_worker` picks this class.

The tree step itself (draft -> tree -> verify -> penalties -> walk -> commit -> draft KV) is the shared
`ddtree_v2_step.DDTreeStepV2`, one copy for every v2 base; this module holds what is 0.5.17's: the constructor's
signature and refusals (hybrid targets through `ddtree_v2_hybrid`, 0.5.17's own glue), the draft forward as 0.5.17's
upstream runs it (its eager prepare-block path, `assign_extend_cache_locs_func`, the non-windowed host bound), the
reservation's host lengths (`reserved_seq_lens_cpu`) and 0.5.17's `GenerationBatchResult`.

Out of scope, refused at start with the flag named (`v2_refusal`): the overlap scheduler, attention backends other
than triton, page size != 1, TP / PP > 1, the draft window, hybrid targets other than the proven Gated DeltaNet ones
with the radix cache off (`ddtree_v2_hybrid`; auto budget on them, as v1 refuses it), simulated acceptance.
Per step: logprobs are refused as upstream refuses them on 0.5.17; a batch holding a grammar request runs upstream's
linear DFLASH step instead (eager at width block: SGLang's verify graphs are captured at `1 + budget`).

Auto captures a verify-graph set per smaller candidate width on 0.5.17's
`DecodeCudaGraphRunner`, the runner class SGLang made, made again while the seams' width hook answers that width
(`DDTreeStepV2._capture_verify_ladder`, shared with 0.5.23; 0.5.17's triton backend reads each verify's width from
its `DFlashVerifyInput`, 17:layers/attention/triton_backend.py:460-520, :1097-1118); each tree step installs the
runner of its width as `decode_cuda_graph_runner` for its verify, upstream's steps keep SGLang's own. Auto on a
hybrid target stays refused.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.speculative import ddtree_args as _args
from sglang.srt.speculative import ddtree_v2_hybrid as _hybrid
from sglang.srt.speculative.ddtree_v2_step import (
    DDTreeStepV2,
    DDTreeV2Refused,
    host_prefix_bounds,
    settings_refusal,
)
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import SIMULATE_ACC_LEN

logger = logging.getLogger(__name__)

__all__ = ["DDTreeV2Refused", "DDTreeWorkerV2", "v2_refusal"]


def v2_refusal(server_args: Any, *, hybrid: bool = False, simulate_acc_len: int = -1,
               hybrid_kind: tuple[str | None, str | None] = (None, None)) -> str | None:
    """Why this first v2 tree step cannot serve `server_args` (the flag named), or None."""
    full = f"{_args.FLAG_MODE} full on SGLang 0.5.17's v2 worker"
    refusal = settings_refusal(server_args, full)
    if refusal:
        return refusal
    if hybrid:  # proven GDN architectures, radix cache off (ddtree_v2_hybrid)
        refusal = _hybrid.refusal(server_args, hybrid_kind)
        if refusal:
            return refusal
    if simulate_acc_len > 0:
        return f"{full} does not support SGLANG_SIMULATE_ACC_LEN (simulated acceptance)."
    return None


class DDTreeWorkerV2(DDTreeStepV2, DFlashWorkerV2):
    """DFLASH's v2 worker with DDTree's tree step on decode; prefill and idle are upstream's."""

    def __init__(self, server_args: Any, gpu_id: int, ps: Any, nccl_port: int, target_worker: Any):
        model_config = target_worker.model_runner.model_config
        hybrid = mambaish_config(model_config) is not None
        refusal = v2_refusal(
            server_args, hybrid=hybrid, simulate_acc_len=int(SIMULATE_ACC_LEN),
            hybrid_kind=_hybrid.target_kind(model_config) if hybrid else (None, None),
        )
        settings = self.ddtree_activate(server_args, refusal)
        self._ddtree_hybrid = _hybrid.HybridStepV2(settings.verify_width) if hybrid else None  # its hooks on
        super().__init__(server_args, gpu_id, ps, nccl_port, target_worker)
        self.ddtree_setup(server_args, settings)

    def init_attention_backends(self) -> None:
        super().init_attention_backends()
        if self._ddtree_hybrid is not None:  # the target's backends and pools exist; its graphs come next
            self._ddtree_hybrid.start(self.model_runner, self.ps.tp_rank)

    def forward_batch_generation(self, batch: Any, on_publish: Any = None,
                                 grammar_barrier: Any = None) -> GenerationBatchResult:
        return self.ddtree_forward(
            batch, on_publish, lambda: super(DDTreeWorkerV2, self).forward_batch_generation(
                batch, on_publish, grammar_barrier))

    # ------------------------------------------------------------------ 0.5.17's shapes
    def _host_reserved_cpu(self, draft_input: Any) -> torch.Tensor | None:
        return draft_input.reserved_seq_lens_cpu

    def _draft_hidden(self, batch: Any, draft_input: Any) -> torch.Tensor:
        """Upstream's draft forward (17:dflash_worker_v2.py:1479-1628, its eager prepare-block path and the
        non-windowed host bound); returns the draft's hidden states `[bs, block, hidden]`."""
        bs, block, prefix_lens = len(batch.seq_lens), int(self.block_size), batch.seq_lens
        block_ids, positions_2d, cache_loc = self._draft_block(batch, draft_input)
        seq_lens_cpu, _ = host_prefix_bounds(batch.seq_lens_cpu, draft_input.reserved_seq_lens_cpu, block)
        if seq_lens_cpu is None:
            seq_lens_cpu = prefix_lens.to("cpu", dtype=torch.int64)  # upstream's last resort (a host sync)
        embeds = self.target_worker.model_runner.model.get_input_embeddings()(block_ids)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens, out_cache_loc=cache_loc,
            seq_lens_sum=int(seq_lens_cpu.sum()), seq_lens_cpu=seq_lens_cpu.to(torch.int32),
            positions=positions_2d.reshape(-1), input_embeds=embeds.view(-1, embeds.shape[-1]),
            spec_algorithm=SpeculativeAlgorithm.DFLASH, spec_info=self._draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )
        with torch.inference_mode():
            hidden = self.draft_model_runner.forward(forward_batch).logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DFLASH draft model returned no hidden states.")
        return hidden.view(bs, block, -1)

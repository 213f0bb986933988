"""DDTree full mode on SGLang 0.5.17's v2 DFLASH worker (installed as `sglang/srt/speculative/ddtree_worker_v2.py`
by the 0.5.17 payload; 0.5.17's own glue). FIRST VERSION, NEVER RUN ON A GPU: served only under the proof switch
`SGLANG_DDTREE_TEST_V2_TREE=1` (ddtree_v2_args), whose hook on `SpeculativeAlgorithm.create_worker` picks this class.

One decode step (`_tree_step`), everything on the device, no host read of device data (the sampled walk's
`target_probs` and penalised requests excepted, as on v1):
1. draft: upstream's block `[bonus, mask x (block - 1)]` through the draft runner (its eager prepare-block path),
   keeping the draft's hidden states (the folded draft sampler is off: `_maybe_build_draft_sampler` -> None);
2. tree: `build_ddtree` on the target LM head's logits of draft positions 1 .. block - 1 (v1's mapping: draft
   position d is tree depth d), fixed budget, the server's top-k cap and keep-chain;
3. verify input (`tree_verify_input`, pure): tokens `[bonus, tree tokens]`, positions `prefix + depth`, the tree's
   custom mask in the triton backend's verify layout, and node i's cache slot = the request's reserved row at
   `prefix + i` (the v2 contract; the seams reserve `committed + block + 1 + budget`);
4. target verify at width `1 + budget` exactly as upstream (graph when the runner can, the seams captured it with
   the mask), then the logit adjustments (`adjust_tree_verify_logits`): at every node the frequency / presence /
   repetition / min-new-tokens penalties exactly as plain decoding applies them after the request's output so far
   plus the node's path (`ddtree_penalties`, v1's code), in plain's penalizer order, then the logit bias;
5. walk (`ddtree_sampling.tree_walk`: argmax for greedy rows, the sampled walk for the others), commit
   (`ddtree_commit.commit_tree`: the row segment permuted so the path's slots come first; out_tokens / commit_lens
   in DFLASH's `[bs, block]` contract), `on_publish(prefix + commit_lens)`;
6. draft KV of the committed path from the target's hidden states (upstream's prefix-valid writer with the
   plan's `[bs, block]` slots), next draft input from the bonus tokens, as `DDTreeDraftInputV2` (the seams'
   reservation).

Out of scope, refused at start with the flag named (`v2_refusal`): auto budget, the overlap scheduler, attention
backends other than triton, page size != 1, TP / PP > 1, the draft window, hybrid targets (served only under their
own proof switch, `ddtree_v2_hybrid`), simulated acceptance.
Per step: logprobs are refused as upstream refuses them; a batch holding a grammar request runs upstream's linear
DFLASH step instead (eager at width block: the verify graphs are captured at `1 + budget`).

Penalties, from host data: each request's settings from `req.sampling_params` / `req.tokenizer` (stop ids as
`BatchedMinNewTokensPenalizer` collects them) and its output so far from `req.output_ids`. Without the overlap
scheduler that holds every committed token when the step starts, the root (the bonus) included: the scheduler extends
it with the accepted tokens before it builds the next batch (17:scheduler_components/batch_result_processor.py:859).
With `L = len(output_ids)`, a node at depth d predicts output token `L + d`: its counts are the output's plus its
path's, its min_new_tokens length `L + d`. The batch's own penalizer state is not used: the forward copy of the
sampling info has no orchestrator (17:sampling_batch_info.py:454-457) and spec decoding never cumulates output tokens
(17:schedule_batch.py:2960-2965, spec_utils.py:1037-1038), so its `acc_additive_penalties` are stale (min_new_tokens
at length 0, nothing counted). The penalizers' order is plain's in this process (`plain_penalizer_order`).
Upstream's `apply_dflash_verify_logits_adjustments` still runs, on a copy with every penalty source and the bias
removed, so nothing is applied twice. A batch with no penalised request reads nothing from the device for this; a
penalised one does (`ddtree_penalties`' gathers, as on v1).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.speculative import ddtree_args as _args
from sglang.srt.speculative import ddtree_stats as _stats
from sglang.srt.speculative import ddtree_v2_args as _v2args
from sglang.srt.speculative import ddtree_v2_hybrid as _hybrid
from sglang.srt.speculative import ddtree_v2_seams as _seams
from sglang.srt.speculative.ddtree_commit import commit_tree
from sglang.srt.speculative.ddtree_penalties import NOTHING_REQUIRED, order_of, penalise_and_bias
from sglang.srt.speculative.ddtree_sampling import sampled_rows, tree_walk
from sglang.srt.speculative.ddtree_utils import DDTree, build_ddtree
from sglang.srt.speculative.ddtree_verify_step import tree_custom_mask_bounded
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import SIMULATE_ACC_LEN

logger = logging.getLogger(__name__)


class DDTreeV2Refused(_args.DDTreeConfigError):
    """A setting the v2 tree step does not serve yet."""


def v2_refusal(server_args: Any, *, hybrid: bool = False, simulate_acc_len: int = -1,
               hybrid_kind: tuple[str | None, str | None] = (None, None)) -> str | None:
    """Why this first v2 tree step cannot serve `server_args` (the flag named), or None."""
    full = f"{_args.FLAG_MODE} full on SGLang 0.5.17's v2 worker (first version)"
    if _args.is_auto(getattr(server_args, "speculative_ddtree_budget", None)):
        return f"{full} takes a fixed {_args.FLAG_BUDGET}; {_args.FLAG_BUDGET} auto is not available on v2 yet."
    if not getattr(server_args, "disable_overlap_schedule", False):
        return f"{full} needs --disable-overlap-schedule: the overlap scheduler is not supported yet."
    for flag in ("attention_backend", "decode_attention_backend", "prefill_attention_backend"):
        backend = getattr(server_args, flag, None)
        if (backend is not None or flag == "attention_backend") and backend != "triton":
            return f"{full} needs --attention-backend triton, got --{flag.replace('_', '-')} {backend}."
    if int(getattr(server_args, "page_size", None) or 1) != 1:
        return f"{full} needs --page-size 1, got --page-size {server_args.page_size}."
    for flag in ("tp_size", "pp_size"):
        if int(getattr(server_args, flag, None) or 1) != 1:
            return f"{full} needs --{flag.replace('_', '-')} 1, got {getattr(server_args, flag)}."
    if getattr(server_args, "speculative_draft_window_size", None) is not None:
        return f"{full} does not support --speculative-draft-window-size (the compact draft cache) yet."
    if hybrid:  # only under its own proof switch, GDN, radix cache off (ddtree_v2_hybrid)
        refusal = _hybrid.refusal(server_args, hybrid_kind)
        if refusal:
            return refusal
    if simulate_acc_len > 0:
        return f"{full} does not support SGLANG_SIMULATE_ACC_LEN (simulated acceptance)."
    return None


@dataclass
class TreeVerify:
    """A tree step's target-verify input, request-major, `n = 1 + budget` entries per request."""

    tokens: torch.Tensor  # int64 [bs * n]: the root (previous bonus), then the tree's tokens
    positions: torch.Tensor  # int64 [bs * n]: prefix + depth
    custom_mask: torch.Tensor  # bool, triton's verify layout: per request n rows of (prefix + n)
    out_cache_loc: torch.Tensor  # int64 [bs * n]: req_to_token[row, prefix + i]


def tree_verify_input(
    tree: DDTree,
    bonus_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_bound: int,
) -> TreeVerify:
    """The verify input of `tree` over each request's reserved row (no host read; `prefix_bound`, a host int
    >= sum(prefix_lens), sizes the mask). The mask block of request b is `n x (prefix_b + n)`, row-major
    (query = node, key = the prefix then the nodes), requests back to back: what
    `TritonAttnBackend` indexes with `mask_indptr = cumsum(n * (seq_lens + n))` (17:triton_backend.py:517-519,
    :814-820); a chain tree gives the causal mask of DFLASH's own verify."""
    bs, n = tree.parents.shape
    device = tree.parents.device
    prefix = prefix_lens.to(device=device, dtype=torch.int64)
    rows = req_pool_indices.to(device=device, dtype=torch.int64)[:, None].expand(-1, n)
    cols = prefix[:, None] + torch.arange(n, device=device)
    return TreeVerify(
        tokens=tree.full_token_ids(bonus_tokens.to(device)).reshape(-1),
        positions=tree.positions(prefix).reshape(-1),
        custom_mask=tree_custom_mask_bounded(tree.tree_mask, prefix, prefix_bound),
        out_cache_loc=req_to_token[rows, cols].to(torch.int64).reshape(-1),
    )


def draft_tree_logits(draft_hidden: torch.Tensor, lm_head_weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[bs, block - 1, vocab]` logits of draft positions 1 .. block - 1 (position 0 is the bonus) under the
    target's LM head, TP 1 (v1's `DDTreeController.draft_logits` without the TP gather)."""
    tail = draft_hidden[:, 1:, :]
    weight = lm_head_weight[:vocab]
    return torch.matmul(tail.to(weight.dtype), weight.T)


def host_prefix_bounds(seq_lens_cpu: Any, reserved_cpu: Any, width: int) -> tuple[torch.Tensor | None, int | None]:
    """(per request a host upper bound of `prefix + width`, a host bound of the sum of the prefixes) from host
    data only, as upstream bounds its verify: the committed lengths when the scheduler kept them (exact), else the
    reservation (>= committed + block + width under the seams). (None, None) when the host has neither."""
    if seq_lens_cpu is not None:
        return seq_lens_cpu.to(torch.int64) + width, int(seq_lens_cpu.sum())
    if reserved_cpu is not None:
        bounds = reserved_cpu.to(torch.int64)
        return bounds, int(bounds.sum()) - width * len(bounds)
    return None, None


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


# What upstream's verify adjustments must not apply again (0.5.17 reads `acc_linear_penalties`, the orchestrator,
# and, on its dense path, `apply_logits_bias`: the `acc_*_penalties` and the bias).
_APPLIED = {"penalizer_orchestrator": NOTHING_REQUIRED, "acc_linear_penalties": None,
            "acc_additive_penalties": None, "acc_scaling_penalties": None, "logit_bias": None}


def adjust_tree_verify_logits(logits: torch.Tensor, batch: Any, tree: DDTree, candidates: torch.Tensor) -> bool:
    """The verify logits `[bs * n, vocab]` (in place) as plain decoding samples them at every node: upstream's
    adjustments with the penalties and the bias taken out (a custom logit processor, refused in full mode by
    ddtree_args), then the penalties per node and the logit bias (`ddtree_penalties.penalise_and_bias`);
    `candidates` `[bs, n]`: the root's token then the tree's. Returns whether a penalty or a bias was applied."""
    info = batch.sampling_info
    if info is None:
        return False
    bs, n = candidates.shape
    stripped = copy.copy(info)
    for name, value in _APPLIED.items():
        setattr(stripped, name, value)
    apply_dflash_verify_logits_adjustments(next_token_logits=logits, sampling_info=stripped, draft_token_num=n)
    return penalise_and_bias(logits.view(bs, n, -1), batch.reqs, info.logit_bias, parents=tree.parents,
                             depths=tree.depths, tokens=candidates, max_depth=tree.max_depth,
                             order=plain_penalizer_order())


class DDTreeWorkerV2(DFlashWorkerV2):
    """DFLASH's v2 worker with DDTree's tree step on decode; prefill and idle are upstream's."""

    _ddtree_hybrid: Any = None  # a hybrid target's recurrent layers (ddtree_v2_hybrid.HybridStepV2)

    def __init__(self, server_args: Any, gpu_id: int, ps: Any, nccl_port: int, target_worker: Any):
        model_config = target_worker.model_runner.model_config
        hybrid = mambaish_config(model_config) is not None
        refusal = v2_refusal(
            server_args, hybrid=hybrid, simulate_acc_len=int(SIMULATE_ACC_LEN),
            hybrid_kind=_hybrid.target_kind(model_config) if hybrid else (None, None),
        )
        if refusal:
            raise DDTreeV2Refused(refusal)
        settings = _seams.settings_for(server_args)
        if settings is None:
            raise DDTreeV2Refused(f"DDTreeWorkerV2 is for {_args.FLAG_MODE} full only.")
        # Before anything is built: the target's verify width, the mask in its triton verify graphs and the
        # reservation all follow the seams from here on (the scheduler builds pools and graphs after this).
        _seams.activate(settings)
        self._ddtree_hybrid = _hybrid.HybridStepV2(settings.verify_width) if hybrid else None  # its hooks on
        super().__init__(server_args, gpu_id, ps, nccl_port, target_worker)
        if int(self.block_size) != settings.block_size:
            raise DDTreeV2Refused(f"DFLASH block {self.block_size} differs from the seams' {settings.block_size}.")
        self.tree_budget = settings.verify_width - 1
        self.tree_topk_cap = server_args.speculative_ddtree_topk_cap
        self.tree_keep_chain = bool(server_args.speculative_ddtree_keep_chain)
        self.sampling_rule = _args.sampling_rule(server_args)
        self.ddtree_stats = _stats.DDTreeStats()  # `/server_info` ddtree (`ddtree_internal_state`)
        logger.info("DDTree v2 tree worker (UNPROVEN, test switch): block %d, budget %d, verify width %d",
                    self.block_size, self.tree_budget, settings.verify_width)
        if not _seams.hook_took(_v2args.INTERNAL_STATE_TARGET, _v2args._internal_state):
            logger.warning("DDTree v2: /server_info carries no `ddtree` stats: the hook on %s did not take "
                           "(the promote settings gate will say inconclusive)", _v2args.INTERNAL_STATE_TARGET)

    def init_attention_backends(self):
        super().init_attention_backends()
        if self._ddtree_hybrid is not None:  # the target's backends and pools exist; its graphs come next
            self._ddtree_hybrid.start(self.model_runner, self.ps.tp_rank)

    def init_cuda_graphs(self):
        attn = self.model_runner.attn_backend
        backend = type(getattr(attn, "full_attn_backend", attn)).__name__  # a hybrid's full-attention half
        if backend != "TritonAttnBackend":
            raise DDTreeV2Refused(f"{_args.FLAG_MODE} full on v2 needs the triton target backend, got {backend}.")
        super().init_cuda_graphs()

    def _maybe_build_draft_sampler(self):
        return None  # the tree needs the draft's hidden states, not the folded argmax

    def _make_next_draft_input_prefill(self, *, bonus_tokens, seq_lens):
        return _seams.DDTreeDraftInputV2.from_dflash(
            super()._make_next_draft_input_prefill(bonus_tokens=bonus_tokens, seq_lens=seq_lens))

    def _make_next_draft_input_decode(self, *, bonus_tokens, new_seq_lens):
        return _seams.DDTreeDraftInputV2.from_dflash(
            super()._make_next_draft_input_decode(bonus_tokens=bonus_tokens, new_seq_lens=new_seq_lens))

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None) -> GenerationBatchResult:
        decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle())
        if not decode or batch.spec_info is None or batch.has_grammar:
            result = super().forward_batch_generation(batch, on_publish, grammar_barrier)
            if decode:  # upstream's linear step: a fallback, as v1 counts its linear steps in full mode
                self._record_linear_step(result, "grammar" if batch.has_grammar else "no_draft_input")
            return result
        if getattr(batch, "return_logprob", False):
            raise ValueError("DFLASH speculative decoding does not support return_logprob yet.")
        self._validate_phase1_sampling_support(batch)
        return self._tree_step(batch, on_publish)

    # ------------------------------------------------------------------ the step
    def _draft_hidden(self, batch: Any, draft_input: Any) -> torch.Tensor:
        """Upstream's draft forward (17:dflash_worker_v2.py:1479-1628, its eager prepare-block path and the
        non-windowed host bound); returns the draft's hidden states `[bs, block, hidden]`."""
        bs, block = len(batch.seq_lens), int(self.block_size)
        self._ensure_draft_block_buffers(bs)
        prefix_lens = batch.seq_lens
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        block_ids = self._draft_block_ids_buf[:bs]
        block_ids.fill_(int(self._mask_token_id))
        block_ids[:, 0].copy_(draft_input.bonus_tokens)
        positions_2d = self._draft_block_positions_buf[:bs]
        torch.add(prefix_lens.unsqueeze(1), self._block_pos_offsets, out=positions_2d)
        cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=req_to_token, start_offset=prefix_lens,
            end_offset=prefix_lens + block, batch_size=bs, draft_token_num=block, device=self.device,
        )
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

    def _build_tree(self, draft_hidden: torch.Tensor) -> DDTree:
        lm_head = self.target_worker.model_runner.model.lm_head
        shard = getattr(lm_head, "shard_indices", None)
        vocab = int(shard.num_org_elements) if shard is not None else int(lm_head.weight.shape[0])
        logits = draft_tree_logits(draft_hidden, lm_head.weight, vocab)
        return build_ddtree(logits, self.tree_budget, self.tree_topk_cap, self.tree_keep_chain)

    def _tree_step(self, batch: Any, on_publish: Any) -> GenerationBatchResult:
        draft_input = batch.spec_info
        if batch.seq_lens.is_cuda:  # upstream's: seq_lens may come from another stream
            batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
        bs, block = len(batch.seq_lens), int(self.block_size)
        prefix_lens = batch.seq_lens
        req_to_token = self.model_runner.req_to_token_pool.req_to_token

        tree = self._build_tree(self._draft_hidden(batch, draft_input))
        n = tree.parents.shape[1]
        bounds, prefix_bound = host_prefix_bounds(batch.seq_lens_cpu, draft_input.reserved_seq_lens_cpu, n)
        if bounds is None:
            raise RuntimeError("DDTree v2 tree step needs the host's sequence lengths (overlap is refused).")
        verify = tree_verify_input(tree, draft_input.bonus_tokens, prefix_lens, req_to_token,
                                   batch.req_pool_indices, prefix_bound)

        verify_input = DFlashVerifyInput(
            draft_token=verify.tokens, positions=verify.positions, draft_token_num=n,
            custom_mask=verify.custom_mask, capture_hidden_mode=CaptureHiddenMode.FULL,
        )
        if self._ddtree_hybrid is not None:
            self._ddtree_hybrid.attach_tree(verify_input, tree)
        batch.out_cache_loc = verify.out_cache_loc
        seq_lens_cpu_backup, seq_lens_sum_backup = batch.seq_lens_cpu, batch.seq_lens_sum
        batch.seq_lens_cpu, batch.seq_lens_sum = bounds, int(bounds.sum())  # host bound = prefix + n
        verify_forward_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker)
        batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu_backup, seq_lens_sum_backup
        target_out = self.target_worker.forward_batch_generation(
            batch=None, forward_batch=verify_forward_batch, is_verify=True, skip_attn_backend_init=True,
        )
        logits_output = target_out.logits_output
        logits = logits_output.next_token_logits
        info = batch.sampling_info
        candidates = verify.tokens.view(bs, n)
        adjusted = adjust_tree_verify_logits(logits, batch, tree, candidates)

        sampled = sampled_rows(batch.reqs) if info is not None else []
        accepted, accept_lens, bonus = tree_walk(
            tree, candidates, logits.view(bs, n, -1), sampled_rows=sampled, rule=self.sampling_rule,
            temperatures=None if info is None else info.temperatures,
            top_ks=None if info is None else info.top_ks, top_ps=None if info is None else info.top_ps,
            min_ps=info.min_ps if info is not None and info.need_min_p_sampling else None,
        )
        commit = commit_tree(tree, accepted, accept_lens, bonus, req_to_token, batch.req_pool_indices,
                             prefix_lens, block)
        commit_lens = commit.commit_lens.to(torch.int32)
        if self._ddtree_hybrid is not None:  # the recurrent state of each request's last committed node
            self._ddtree_hybrid.commit(self, batch, tree, accepted, commit_lens)
        new_seq_lens = prefix_lens + commit_lens.to(prefix_lens.dtype)
        if on_publish is not None:
            on_publish(new_seq_lens)

        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTree v2 verify requires target hidden states, but got None.")
        plan = commit.kv_plan
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=hidden.index_select(0, plan.hidden_rows), cache_loc=plan.cache_loc,
            cache_loc_2d=plan.cache_loc.view(bs, block), positions=plan.positions, commit_lens=commit_lens,
        )
        logits_output.hidden_states = None
        self._record_tree_step(tree, commit_lens, sampled=len(sampled), adjusted=adjusted,
                               graph=target_out.can_run_cuda_graph)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=commit.out_tokens.reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=self._make_next_draft_input_decode(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=block,
            new_seq_lens=new_seq_lens,
        )

    # ------------------------------------------------------------------ stats (`/server_info` ddtree)
    def _record_tree_step(self, tree: DDTree, commit_lens: torch.Tensor, *, sampled: int, adjusted: bool,
                          graph: Any) -> None:
        """v1's counters for a tree step, host facts only: the tree's sizes and the accepted depths
        (`commit_lens - 1`) are summed on the device and read when the stats are (no sync per step)."""
        stats, bs = self.ddtree_stats, int(commit_lens.shape[0])
        stats.steps += 1
        stats.tree_steps += 1
        stats.requests_sum += bs
        stats.add_nodes(tree.num_nodes)
        stats.sampled_requests += sampled
        stats.greedy_requests += bs - sampled
        stats.logit_adjusted_steps += bool(adjusted)
        stats.graph_steps += bool(graph)
        stats.add_accepted_depths(commit_lens - 1, int(self.block_size) - 1)

    def _record_linear_step(self, result: Any, reason: str) -> None:
        """Upstream's linear DFLASH step on a decode batch (v1 counts its linear steps the same way)."""
        stats = self.ddtree_stats
        stats.steps += 1
        stats.fallback_steps += 1
        stats.fallback_reasons[reason] += 1
        stats.graph_steps += bool(getattr(result, "can_run_cuda_graph", False))
        accept_lens = getattr(result, "accept_lens", None)
        if accept_lens is not None and accept_lens.numel():
            stats.add_accepted_depths(accept_lens - 1, int(self.block_size) - 1)

    def ddtree_internal_state(self) -> dict[str, Any]:
        """`/server_info` → internal_states[0]["ddtree"] (`ddtree_v2_args`' hook on the scheduler's
        `get_internal_state`): v1's keys and settings names; what v2 does not have is None / empty."""
        runner = getattr(self.target_worker.model_runner, "decode_cuda_graph_runner", None)
        return _stats.internal_state(
            _stats.settings(mode="full", budget=self.tree_budget, budget_auto=False, topk_cap=self.tree_topk_cap,
                            keep_chain=self.tree_keep_chain),
            self.ddtree_stats,
            auto=None,
            verify_graph_width=getattr(runner, "captured_req_width", None),
            verify_graph_max_bs=getattr(runner, "max_bs", None),
            build_graph_bs=None,
            build_budgets=[self.tree_budget],
            verify_kernels=False,
            hybrid=None if self._ddtree_hybrid is None else self._ddtree_hybrid.as_dict(),
            profile=None,
        )

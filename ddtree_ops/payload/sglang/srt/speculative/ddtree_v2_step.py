"""DDTree's tree step on SGLang's v2 DFLASH worker, the part that does not depend on the base (installed as
`sglang/srt/speculative/ddtree_v2_step.py` by the payload of each v2 base with a tree step, 0.5.17 and 0.5.23; one
copy, shared). Proven on the H200 on 0.5.17 and served there; NEVER RUN ON A GPU on 0.5.23, served there only under
the proof switch `SGLANG_DDTREE_TEST_V2_TREE=1` (ddtree_v2_args.PROVEN_TREE_BASES).

Each base's `ddtree_worker_v2.py` is a thin adapter: `DDTreeWorkerV2(DDTreeStepV2, DFlashWorkerV2)` with that base's
`__init__` / `forward_batch_generation` signatures and the few calls whose shape upstream changed between 0.5.17
and 0.5.23 (the draft forward, the verify input's KV plan, the draft-KV write ids, the result's fields); the
algorithm below is written once.

One decode step (`DDTreeStepV2._tree_step`), everything on the device, no host read of device data (the sampled
walk's `target_probs` and penalised requests excepted, as on v1):
1. draft: upstream's block `[bonus, mask x (block - 1)]` through the draft runner (the base's `_draft_hidden`),
   keeping the draft's hidden states (the folded draft sampler is off: `_maybe_build_draft_sampler` -> None);
2. tree: `build_ddtree` on the target LM head's logits of draft positions 1 .. block - 1 (v1's mapping: draft
   position d is tree depth d), the configured budget (auto: its largest, shrunk to the pick below and padded to
   the verify width, `_verify_width`), the server's top-k cap and keep-chain; on one CUDA device with graphs the build
   is replayed from a graph of the batch's verify-graph size (`_capture_build_graphs`, v1's `ddtree_build_graphs`);
3. verify input (`tree_verify_input`, pure): tokens `[bonus, tree tokens]`, positions `prefix + depth`, the tree's
   custom mask in the triton backend's verify layout, and node i's cache slot = the request's reserved row at
   `prefix + i` (the v2 contract; the seams reserve `committed + block + 1 + budget`, auto's largest: the step's
   pick is not known when the scheduler reserves, and a narrower step uses a prefix of it);
4. target verify at the tree's width `n` exactly as upstream (graph when the runner can: the seams captured it
   with the mask; under auto the runner of that width installed for the verify, `_verify_runner`), then the logit
   adjustments (`adjust_tree_verify_logits`): at every node the frequency / presence /
   repetition / min-new-tokens penalties exactly as plain decoding applies them after the request's output so far
   plus the node's path (`ddtree_penalties`, v1's code), in plain's penalizer order, then the logit bias;
5. walk (`ddtree_sampling.tree_walk`: argmax for greedy rows, the sampled walk for the others), commit
   (`ddtree_commit.commit_tree`: the row segment permuted so the path's slots come first; out_tokens / commit_lens
   in DFLASH's `[bs, block]` contract), `on_publish(prefix + commit_lens)`;
6. draft KV of the committed path from the target's hidden states (upstream's prefix-valid writer with the
   plan's `[bs, block]` slots), next draft input from the bonus tokens, as `DDTreeDraftInputV2` (the seams'
   reservation).
With `SGLANG_DDTREE_PROFILE=1` the step marks v1's phases (`ddtree_profile`, `/server_info` `ddtree.profile`):
`step_start` as `ddtree_forward` takes a decode batch, `draft_done` after 1, `built` after 2, `mask_ready` after 3
(before upstream's `prepare_for_verify` plans the forward, as v1 marks it before its forward), `target_done` after
4's forward, `walked` after 5 and the path's hidden rows (before 6's draft-KV write), `step_done` after 6.

`--speculative-ddtree-budget auto` (`ddtree_auto_budget.AutoBudget`, v1's chooser, candidates and batch buckets;
served without a switch since 0.8.26: on an H100 on 0.5.17 its ladder captured, the pair's greedy outputs, the production
mix, the limits workload and the penalties matched plain's up to ties, its samples at T 1 plain's law, and its liveness
rounds passed, bench/RESULTS.md):
each decode step asks `choose(bs, step)` with `step` the stats' step counter (every TP rank counts the same steps).
The chain is upstream's linear DFLASH step itself (`ddtree_forward` hands the batch on, as for its fallbacks: eager,
SGLang's own verify graphs being captured at the largest tree's width). At start, after the target's graphs and
before the draft's, `_capture_verify_ladder` captures a verify-graph set per smaller candidate width (v1's
`ddtree_verify_graphs.capture_verify_ladder`, one copy, through the seams' capture width) and times their replays,
which seed auto's costs (`seed_start_costs`). A tree pick verifies the largest tree's first `budget` nodes padded to
the smallest captured width that holds them (`_verify_width`; eager steps: their own width), on that width's runner;
if the capture fails on any rank, every rank keeps SGLang's one set and pads every tree to it (a warning; slower,
never wrong). After the walk, `acceptance_by_kind` gives what each
candidate budget's tree would have accepted, greedy and sampled requests apart; the step's observation (its wall
time to a host read of that, which waits for the step's device work; a linear step's to its `accept_lens`) goes to
`auto.observe`, and every `refresh_every` steps `auto.refresh` re-plans from accumulators summed over the TP ranks.
v1's glue for this is the same functions (`chain_observation`, `tree_observation`, `refresh_over_ranks`).

Penalties, from host data: each request's settings from `req.sampling_params` / `req.tokenizer` (stop ids as
`BatchedMinNewTokensPenalizer` collects them) and its output so far from `req.output_ids`. Without the overlap
scheduler (refused) that holds every committed token when the step starts, the root (the bonus) included: the
scheduler extends it with the accepted tokens before it builds the next batch. With `L = len(output_ids)`, a node
at depth d predicts output token `L + d`: its counts are the output's plus its path's, its min_new_tokens length
`L + d`. The batch's own penalizer state is not used: the forward copy of the sampling info has no orchestrator
(`copy_for_forward`, both bases) and spec decoding never cumulates output tokens, so its `acc_additive_penalties`
are stale. The penalizers' order is plain's in this process, and 0.5.23's min_new_tokens also bans a request's
`eos_token_ids` (`ddtree_v2_penalties`, which upstream's linear verify uses too). Upstream's
`apply_dflash_verify_logits_adjustments` (the same function on 0.5.17 and 0.5.23) still runs, on a copy with every
penalty source and the bias removed, so nothing is applied twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.distributed import get_tp_group
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative import ddtree_args as _args
from sglang.srt.speculative import ddtree_stats as _stats
from sglang.srt.speculative import ddtree_v2_args as _v2args
from sglang.srt.speculative import ddtree_v2_penalties as _penalties
from sglang.srt.speculative import ddtree_v2_seams as _seams
from sglang.srt.speculative.ddtree_auto_budget import (
    AutoBudget,
    StepObservation,
    auto_candidates,
    chain_observation,
    tree_observation,
    verify_widths,
)
from sglang.srt.speculative.ddtree_build_graphs import DDTreeBuildGraphs, capture_build_sets
from sglang.srt.speculative.ddtree_commit import commit_tree
from sglang.srt.speculative.ddtree_metrics import AutoMetrics
from sglang.srt.speculative.ddtree_profile import StepClock, StepProfile, maybe_profile
from sglang.srt.speculative.ddtree_ranks import (
    agree_all,
    agree_verify_kernels,
    lm_head_refusal,
    refresh_over_ranks,
    vocab_logits,
)
from sglang.srt.speculative.ddtree_sampling import sampled_rows, tree_walk, unfiltered_rows, walk_node_probs
from sglang.srt.speculative.ddtree_utils import (
    DDTree,
    HostCopy,
    acceptance_by_kind,
    build_ddtree,
    follow_verified_tree,
    shrink_tree,
)
from sglang.srt.speculative.ddtree_v2_shadow import is_decode
from sglang.srt.speculative.ddtree_verify_graphs import V2_RUNNER, VerifyGraphLadder, capture_verify_ladder
from sglang.srt.speculative.ddtree_verify_step import (
    commit_kernel,
    kernels_in_use,
    self_test,
    shrink_kernel,
    step_acceptance,
    verify_input,
)
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments

logger = logging.getLogger(__name__)

__all__ = [
    "DDTreeStepV2", "DDTreeV2Refused", "TreeVerify", "adjust_tree_verify_logits", "draft_tree_logits",
    "head_refusal", "host_prefix_bounds", "ladder_refusal", "sampled_rows", "settings_refusal", "tree_verify_input",
    "verify_backend_refusal",
]


class DDTreeV2Refused(_args.DDTreeConfigError):
    """A setting the v2 tree step does not serve yet."""


def settings_refusal(server_args: Any, full: str) -> str | None:
    """The refusals every base's tree step shares (the flag named), or None; `full` opens the message
    (`--speculative-ddtree-mode full on SGLang <base>'s v2 worker (first version)`)."""
    if not getattr(server_args, "disable_overlap_schedule", False):
        return f"{full} needs --disable-overlap-schedule: the overlap scheduler is not supported yet."
    for flag in ("attention_backend", "decode_attention_backend", "prefill_attention_backend"):
        backend = getattr(server_args, flag, None)
        if (backend is not None or flag == "attention_backend") and backend != "triton":
            return f"{full} needs --attention-backend triton, got --{flag.replace('_', '-')} {backend}."
    if int(getattr(server_args, "page_size", None) or 1) != 1:
        return f"{full} needs --page-size 1, got --page-size {server_args.page_size}."
    tp, pp = (int(getattr(server_args, flag, None) or 1) for flag in ("tp_size", "pp_size"))
    if tp != 1 and not _args.test_switch(_args.TEST_V2_TP):  # the TP proof's own servers run under the switch
        return f"{full} needs --tp-size 1, got {server_args.tp_size}."
    if pp != 1:
        return f"{full} needs --pp-size 1, got {server_args.pp_size}."
    if getattr(server_args, "speculative_draft_window_size", None) is not None:
        return f"{full} does not support --speculative-draft-window-size (the compact draft cache) yet."
    return None


# TritonAttnBackend's switches that send a target verify to a chain-only kernel: split-KV verify and its grouped-head
# form (gfx95 with SGLANG_ENABLE_SPLITKV_VERIFY, on by default, whenever topk is 1, as DFLASH's is). Their
# `can_handle` does not look at the custom mask (17:layers/attention/triton_backend.py:174-180,
# 23:kernels/ops/attention/verify_mla.py), so a tree would be verified as a chain: wrong tokens, no error.
CHAIN_ONLY_VERIFY = ("use_verify_splitkv", "use_verify_shared_kv")


def verify_backend_refusal(attn_backend: Any) -> str | None:
    """Why the target's built attention backend cannot verify a tree (the triton backend's extend kernel reads the
    tree mask; nothing else is read through), or None."""
    full = getattr(attn_backend, "full_attn_backend", attn_backend)  # a hybrid's full-attention half
    name = type(full).__name__
    if name != "TritonAttnBackend":
        return f"{_args.FLAG_MODE} full on v2 needs the triton target backend, got {name}."
    chain_only = [switch for switch in CHAIN_ONLY_VERIFY if getattr(full, switch, False)]
    if chain_only:
        return (f"{_args.FLAG_MODE} full on v2: the triton backend sends target verifies to its chain-only kernel "
                f"({', '.join(chain_only)}: gfx95 with SGLANG_ENABLE_SPLITKV_VERIFY), which would read the tree as "
                "a chain; start with SGLANG_ENABLE_SPLITKV_VERIFY=0.")
    return None


def head_refusal(target_model: Any) -> str | None:
    """Why the tree step cannot draft through this target's LM head (`ddtree_ranks.lm_head_refusal`), or None."""
    reason = lm_head_refusal(getattr(target_model, "lm_head", None))
    return reason and f"{_args.FLAG_MODE} full on v2: {reason}. Serve this target with {_args.FLAG_MODE} off."


def ladder_refusal(model_runner: Any, runner: Any) -> str | None:
    """Why auto's verify-graph ladder is not captured on this target (then every tree pads to SGLang's one set), or
    None. Each is a per-runner state a second runner would rebuild under the first one's graphs: LoRA's batch info
    (re-made at the new width by the runner's `__init__`), PDMux's per-stream backend states (their
    `init_cuda_graph_state` is not held off), and the ragged verify mode (graphs keyed by tokens, not by batch
    size; DFLASH's compact ragged verify, 17/23: `ragged_verify_compact_graphs_enabled`)."""
    if getattr(runner, "ragged_verify_mode", False):
        return "the ragged verify graphs (SGLANG_RAGGED_VERIFY_MODE)"
    if getattr(runner, "enable_pdmux", False):
        return "--enable-pdmux"
    server_args = getattr(model_runner, "server_args", None)
    if getattr(model_runner, "lora_manager", None) is not None or getattr(server_args, "enable_lora", False):
        return "LoRA"
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
    :814-820); a chain tree gives the causal mask of DFLASH's own verify. `ddtree_verify_step.verify_input`:
    one kernel on CUDA."""
    tokens, positions, mask, loc = verify_input(tree, bonus_tokens, prefix_lens, req_to_token, req_pool_indices,
                                                prefix_bound)
    return TreeVerify(tokens=tokens, positions=positions, custom_mask=mask, out_cache_loc=loc)


def draft_tree_logits(draft_hidden: torch.Tensor, lm_head: Any, vocab: int, tp_group: Any) -> torch.Tensor:
    """`[bs, block - 1, vocab]` logits of draft positions 1 .. block - 1 (position 0 is the bonus) under the
    target's LM head, gathered over its vocab shards (v1's `DDTreeController.draft_logits`: the same function)."""
    return tail_tree_logits(draft_hidden[:, 1:, :], lm_head, vocab, tp_group)


def tail_tree_logits(tail: torch.Tensor, lm_head: Any, vocab: int, tp_group: Any) -> torch.Tensor:
    """`draft_tree_logits` of the draft hidden states after the bonus, `tail` `[bs, block - 1, hidden]`."""
    bs, depth = int(tail.shape[0]), int(tail.shape[1])
    return vocab_logits(tail.reshape(bs * depth, -1), lm_head, vocab, tp_group).view(bs, depth, -1)


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


def adjust_tree_verify_logits(logits: torch.Tensor, batch: Any, tree: DDTree, candidates: torch.Tensor) -> bool:
    """The verify logits `[bs * n, vocab]` (in place) as plain decoding samples them at every node
    (`ddtree_v2_penalties.exact_verify_adjustments`, the linear verify's code, with the tree): upstream's
    adjustments with the penalties and the bias taken out (a custom logit processor, refused in full mode by
    ddtree_args), then the penalties per node and the logit bias; `candidates` `[bs, n]`: the root's token then
    the tree's. Returns whether a penalty or a bias was applied."""
    info = batch.sampling_info
    if info is None:
        return False
    return _penalties.exact_verify_adjustments(
        logits, info, batch.reqs, parents=tree.parents, depths=tree.depths, tokens=candidates,
        max_depth=tree.max_depth, upstream=apply_dflash_verify_logits_adjustments)


@dataclass
class StepOutputs:
    """What a tree step hands back, before the base wraps it in its `GenerationBatchResult`."""

    logits_output: Any
    next_token_ids: torch.Tensor  # [bs * block]: the path's tokens, the bonus, zeros
    accept_lens: torch.Tensor  # int32 [bs]: commit lengths
    can_run_cuda_graph: Any
    next_draft_input: Any
    speculative_num_draft_tokens: int  # the block: the scheduler's stride over next_token_ids
    new_seq_lens: torch.Tensor


class DDTreeStepV2:
    """The tree step, mixed in before the base's `DFlashWorkerV2` (`class DDTreeWorkerV2(DDTreeStepV2,
    DFlashWorkerV2)`). The adapter supplies `_draft_hidden` (over `_draft_block`), `_host_reserved_cpu`, and where
    its base needs them `_verify_input_extra`, `_full_verify_logits`, `_draft_kv_cache_loc`, `_result_extra`."""

    _ddtree_hybrid: Any = None  # a hybrid target's recurrent layers (0.5.17's ddtree_v2_hybrid.HybridStepV2)
    ddtree_auto: AutoBudget | None = None  # --speculative-ddtree-budget auto, made by `ddtree_start_auto`
    tree_budget_auto = False  # set by `ddtree_setup` (workers the tests assemble without it read this)
    # auto's verify graphs by width (`_capture_verify_ladder`); None: SGLang's one set (or none), as a fixed budget
    _verify_ladder: VerifyGraphLadder | None = None
    _step_width = 0  # the last tree step's verify tokens per request (auto prices the step at it)
    # the largest tree's build replayed from CUDA graphs at the target's verify batch sizes (`_capture_build_graphs`);
    # None: every build eager
    _build_graphs: DDTreeBuildGraphs | None = None
    # SGLANG_DDTREE_PROFILE=1 (`ddtree_profile`, made by `ddtree_setup`): v1's phase marks at the same points of a step
    ddtree_profile: StepProfile | None = None
    # a decode batch that asks for logprobs: False refuses it (0.5.17, as upstream refuses them there); True hands it
    # to upstream's linear step, which serves them (0.5.23; the adapter says why)
    LOGPROB_FALLBACK = False

    # ------------------------------------------------------------------ start
    @staticmethod
    def ddtree_activate(server_args: Any, refusal: str | None) -> _seams.SeamSettings:
        """Refuse (naming the flag) or turn the seams on; call before upstream's `__init__`: the target's verify
        width, the mask in its triton verify graphs and the reservation all follow the seams from here on (the
        scheduler builds pools and graphs after the worker's `__init__`)."""
        if refusal:
            raise DDTreeV2Refused(refusal)
        settings = _seams.settings_for(server_args)
        if settings is None:
            raise DDTreeV2Refused(f"DDTreeWorkerV2 is for {_args.FLAG_MODE} full only.")
        _seams.activate(settings)
        return settings

    def ddtree_setup(self, server_args: Any, settings: _seams.SeamSettings) -> None:
        """After upstream's `__init__`: the tree's settings, the stats, the start log."""
        if int(self.block_size) != settings.block_size:
            raise DDTreeV2Refused(f"DFLASH block {self.block_size} differs from the seams' {settings.block_size}.")
        self.tree_budget = settings.verify_width - 1  # auto: its largest candidate
        self.tree_budget_auto = _args.is_auto(getattr(server_args, "speculative_ddtree_budget", None))
        self._auto_budgets: torch.Tensor | None = None
        self._auto_metrics: AutoMetrics | None = None
        self._auto_enable_metrics = bool(getattr(server_args, "enable_metrics", False))
        self._step_acceptance: torch.Tensor | None = None  # auto: the tree step's walk by budget (device)
        # auto: the last step's observation, made when its host copies are read (`_settle_auto`), and its step index
        self._pending_observation: tuple[int, Callable[[float], StepObservation]] | None = None
        self._refresh_due = False
        self.tree_topk_cap = server_args.speculative_ddtree_topk_cap
        self.tree_keep_chain = bool(server_args.speculative_ddtree_keep_chain)
        self.sampling_rule = _args.sampling_rule(server_args)
        self.tree_tp_size = int(getattr(server_args, "tp_size", None) or 1)
        self.ddtree_stats = _stats.DDTreeStats()  # `/server_info` ddtree (`ddtree_internal_state`)
        self.ddtree_profile = maybe_profile(getattr(self, "device", None))  # upstream's __init__ set the device
        unproven = _v2args.base_version() not in _v2args.PROVEN_TREE_BASES
        logger.info("DDTree v2 tree worker%s: block %d, budget %s, verify width %d",
                    " (UNPROVEN on a GPU, test switch)" if unproven else "", self.block_size,
                    f"auto (max {self.tree_budget})" if self.tree_budget_auto else self.tree_budget,
                    settings.verify_width)
        if not _seams.hook_took(_v2args.INTERNAL_STATE_TARGET, _v2args._internal_state):
            logger.warning("DDTree v2: /server_info carries no `ddtree` stats: the hook on %s did not take "
                           "(the promote settings gate will say inconclusive)", _v2args.INTERNAL_STATE_TARGET)

    def init_cuda_graphs(self, *args: Any, **kwargs: Any) -> None:
        # the target is built by now (its backend, its LM head); the graphs come next
        refusal = verify_backend_refusal(self.model_runner.attn_backend) or head_refusal(
            self.target_worker.model_runner.model)
        if refusal:
            raise DDTreeV2Refused(refusal)
        # The kernels this step takes (ddtree_verify_kernels: the verify input, the commit, the sampled walk through
        # ddtree_sampling) are checked against the torch path here, as v1 checks its own at start: one this GPU or
        # Triton gets wrong leaves the torch path. Under auto also on auto's smaller trees, at their own width and
        # padded to every candidate width (as v1 does): every shape a step can take is compiled here, not mid-serving.
        device = torch.device(self.target_worker.model_runner.device)
        smaller = tuple(b for b in self._auto_tree_budgets() if b < self.tree_budget)
        error = self_test(device, self.tree_budget, self.block_size - 1, build_ddtree, follow_verified_tree,
                          shrink_tree, smaller=smaller, pad_widths=tuple(self._auto_widths()) if smaller else (),
                          walk=walk_node_probs, acceptance=acceptance_by_kind if self.tree_budget_auto else None,
                          commit=commit_tree)
        if error:
            logger.warning("DDTree v2: verify kernels off (%s); the verify input, commit and sampled walk run on torch ops",
                           error)
        agree_verify_kernels(kernels_in_use(device), get_tp_group().cpu_group if self.tree_tp_size > 1 else None)
        if self.tree_budget_auto:
            # The scheduler captured the target's graphs just before this (17/23: managers/scheduler.py, the target
            # worker's init_cuda_graphs, then the draft worker's): the ladder's replays are timed while the shared
            # input buffers still hold what that capture left, before the draft's capture writes them.
            self._verify_ladder = self._capture_verify_ladder()
        super().init_cuda_graphs(*args, **kwargs)
        self._build_graphs = self._capture_build_graphs()
        if self.tree_budget_auto:
            self.ddtree_start_auto()
        if self._linear_runs_eager() is not None and self._tp_rank() == 0:
            logger.info("DDTree v2: the target's verify graphs are at the block's width %d: upstream's linear steps "
                        "(fallbacks%s) run eagerly (they carry no mask; the graphs read the tree's mask buffer)",
                        self.block_size, ", auto's chain" if self.tree_budget_auto else "")

    def _capture_build_graphs(self) -> DDTreeBuildGraphs | None:
        """The largest tree's build captured at the target's verify graph batch sizes, as v1 captures its builds
        (`capture_build_sets`: one device, CUDA, graphs on; else None, every build eager): at batch 1 the eager
        build's launches cost v2 twice v1's `draft_done -> built` (0.50 against 0.25 ms, RESULTS.md)."""
        runner = self.target_worker.model_runner
        lm_head = runner.model.lm_head  # a weight matrix: `head_refusal` passed at the start of init_cuda_graphs
        graph_runner = getattr(runner, V2_RUNNER.attr, None)
        graphs = capture_build_sets(
            {self.tree_budget: self._tree_builder(lm_head)}, list(getattr(graph_runner, "capture_bs", None) or []),
            lm_head, depth=int(self.block_size) - 1, dtype=lm_head.weight.dtype, device=runner.device,
            tp_size=self.tree_tp_size)
        return None if graphs is None else graphs[self.tree_budget]

    def _auto_tree_budgets(self) -> list[int]:
        """auto's tree budgets (none without auto)."""
        if not self.tree_budget_auto:
            return []
        return [c.budget for c in auto_candidates(self.tree_budget, self.block_size) if c.budget > 0]

    def _auto_widths(self) -> list[int]:
        """The verify widths auto's candidates verify at, ascending (the chain's is the block's)."""
        return verify_widths(auto_candidates(self.tree_budget, self.block_size))

    def _capture_verify_ladder(self) -> VerifyGraphLadder | None:
        """auto's verify graphs, one set per candidate width below the seams' (`ddtree_verify_graphs`), their replays
        timed; None without graphs. A capture that fails (or is refused, `ladder_refusal`) on any TP rank leaves
        every rank with the one set SGLang captured, smaller trees padded to it: slower, never a server that does not
        start, and every rank replays the same graphs."""
        runner = self.target_worker.model_runner
        existing = getattr(runner, V2_RUNNER.attr, None)
        widths = self._auto_widths()
        ladder, error = None, None
        if existing is not None and V2_RUNNER.is_graph_runner(existing):
            error = ladder_refusal(runner, existing)
            if error is None:
                try:
                    ladder = capture_verify_ladder(
                        runner, widths, set_capture_width=_seams.set_capture_width, set_backend_width=None,
                        reserved_memory=lambda: (torch.cuda.memory_reserved(runner.device)
                                                 if torch.cuda.is_available() else None),
                        names=V2_RUNNER)
                except Exception as e:  # noqa: BLE001 - any capture failure keeps the widest set alone
                    error = f"{type(e).__name__}: {e}"
        group = get_tp_group().cpu_group if self.tree_tp_size > 1 else None
        if not agree_all(error is None, group):
            if self._tp_rank() == 0:
                logger.warning("DDTree v2 auto: verify graphs at widths %s not captured (%s); smaller trees are "
                               "padded to width %d", widths, error or "failed on another TP rank", self.tree_budget + 1)
            return None  # capture_verify_ladder left SGLang's own runner installed
        if ladder is not None and self._tp_rank() == 0:
            logger.info("DDTree v2 auto: verify graphs at widths %s captured in %.1f s, %.2f GiB; replay ms by "
                        "(width, bs): %s", ladder.widths, ladder.seconds, ladder.captured_bytes / 2**30,
                        {f"{w}x{bs}": round(t * 1e3, 3) for (w, bs), t in sorted(ladder.replay_seconds.items())})
        return ladder

    def ddtree_start_auto(self) -> None:
        """auto's chooser, v1's candidates and batch buckets: the target's verify graphs' batch sizes (the scheduler
        captured them just before the draft's) and the request pool's size; its costs seeded from the ladder's replay
        timings (`_capture_verify_ladder`), as v1 seeds them. Without a ladder every tree candidate verifies at the
        seams' one width, smaller trees padded to it, priced by its own steps' times."""
        runner = self.target_worker.model_runner
        graphs = getattr(runner, V2_RUNNER.attr, None)
        self.ddtree_auto = AutoBudget(
            auto_candidates(self.tree_budget, self.block_size),
            capture_bs=list(getattr(graphs, "capture_bs", None) or [1]),
            max_running=int(runner.req_to_token_pool.size),
        )
        ladder = self._verify_ladder
        if ladder is not None:
            self.ddtree_auto.seed_start_costs(ladder.replay_seconds)
        self._auto_budgets = torch.tensor(self.ddtree_auto.budgets, dtype=torch.int64, device=self.device)
        self._auto_clock = StepClock(self.device)
        self._acceptance_copy, self._accept_lens_copy = HostCopy(), HostCopy()
        self._auto_metrics = AutoMetrics.maybe_create(
            self.ddtree_auto.budgets, enabled=self._auto_enable_metrics, tp_rank=self._tp_rank())
        if ladder is not None:
            verifies = f"each tree verifies on the graphs of the smallest of widths {ladder.widths} that holds it"
        else:
            verifies = f"every tree verifies at width {self.tree_budget + 1} (smaller trees padded: no verify-graph ladder)"
        logger.info("DDTree v2 auto: candidates %s; %s; the chain is upstream's linear step",
                    [c.name for c in self.ddtree_auto.candidates], verifies)

    def _tp_rank(self) -> int:
        return int(get_tp_group().rank_in_group) if self.tree_tp_size > 1 else 0

    def _maybe_build_draft_sampler(self) -> None:
        return None  # the tree needs the draft's hidden states, not the folded argmax

    def _make_next_draft_input_prefill(self, *, bonus_tokens: torch.Tensor, seq_lens: torch.Tensor) -> Any:
        return _seams.DDTreeDraftInputV2.from_dflash(
            super()._make_next_draft_input_prefill(bonus_tokens=bonus_tokens, seq_lens=seq_lens))

    def _make_next_draft_input_decode(self, *, bonus_tokens: torch.Tensor, new_seq_lens: torch.Tensor) -> Any:
        return _seams.DDTreeDraftInputV2.from_dflash(
            super()._make_next_draft_input_decode(bonus_tokens=bonus_tokens, new_seq_lens=new_seq_lens))

    # ------------------------------------------------------------------ dispatch
    def ddtree_forward(self, batch: Any, on_publish: Any, upstream: Any) -> Any:
        """A decode batch through the tree step; prefill, idle and the batches the tree step does not serve through
        `upstream()` (the base's own `forward_batch_generation`)."""
        decode = is_decode(batch)
        reason = None
        if decode:
            if batch.spec_info is None:
                reason = "no_draft_input"
            elif batch.has_grammar:
                reason = "grammar"
            elif self.LOGPROB_FALLBACK and getattr(batch, "return_logprob", False):
                reason = "logprob"
            else:
                reason = self._base_fallback_reason(batch)
        auto, step = self.ddtree_auto, self.ddtree_stats.steps
        if auto is not None:
            self._settle_auto(refresh=True)
        if decode:
            self._mark("step_start")
            if auto is not None:
                self._auto_clock.start()
        if not decode or reason is not None:
            # a decode's linear step runs eagerly where the verify graphs are block-wide (their mask: the last tree's)
            result = self._upstream_linear(upstream) if decode else upstream()
            if decode:  # upstream's linear step: a fallback, as v1 counts its linear steps in full mode
                self._step_done()
                self._record_linear_step(result, reason)
                if auto is not None:  # a chain step all the same (v1 observes its fallbacks too)
                    self._defer_chain_observation(self._sampled_rows(batch), result, step)
            return result
        if getattr(batch, "return_logprob", False):
            raise ValueError("DFLASH speculative decoding does not support return_logprob yet.")
        self._validate_phase1_sampling_support(batch)
        if auto is None:
            result = self._tree_step(batch, on_publish)
            self._step_done()
            return result
        sampled = self._sampled_rows(batch)
        pick = auto.choose(len(batch.seq_lens), step, sampled=len(sampled))
        if pick.is_chain:  # the chain candidate is upstream's linear DFLASH step itself
            result = self._upstream_linear(upstream)
            self._step_done()
            self._record_chain_step(result)
            self._defer_chain_observation(sampled, result, step)
            return result
        result = self._tree_step(batch, on_publish, budget=pick.budget, sampled=sampled)
        self._step_done()
        acceptance = self._acceptance_copy.queue(self._step_acceptance)
        self._step_acceptance = None
        self._auto_clock.stop()
        # the width it verified at: a tree padded past its own width is priced in that width's candidate's cell, as
        # v1 prices its padded steps (`AutoBudget._candidate_of`)
        budget, width, bs, n_sampled = pick.budget, self._step_width, len(batch.seq_lens), len(sampled)
        self._pending_observation = (step, lambda seconds: tree_observation(
            acceptance.tolist(), budget=budget, width=width, batch_size=bs, sampled=n_sampled, seconds=seconds))
        return result

    def _mark(self, name: str) -> None:
        """A named point of the step for SGLANG_DDTREE_PROFILE (`ddtree_profile`; v1's names)."""
        if self.ddtree_profile is not None:
            self.ddtree_profile.mark(name)

    def _step_done(self) -> None:
        """The decode step's end (`step_done`, v1's: upstream's end of the step), which closes its profiled step."""
        if self.ddtree_profile is not None:
            self.ddtree_profile.mark("step_done")
            self.ddtree_profile.end_step()

    def _linear_runs_eager(self) -> Any:
        """The target's installed verify graph runner when it was captured at the block's own width (a fixed budget
        of block - 1, the default; auto with a largest budget of block - 1), else None."""
        runner = getattr(self.target_worker.model_runner, V2_RUNNER.attr, None)
        if runner is None or not V2_RUNNER.is_graph_runner(runner) or V2_RUNNER.width(runner) != int(self.block_size):
            return None
        return runner

    def _upstream_linear(self, upstream: Any) -> Any:
        """Upstream's linear DFLASH step on a decode batch (a fallback, auto's chain), eager where the target's verify
        graphs are at the block's width. Those graphs were captured with the custom-mask buffer (the seams' mask
        policy: a tree is not causal), and upstream's linear verify carries no mask (`custom_mask = None`, "standard
        causal masking", 17/23: dflash_worker_v2.py): the triton backend's replay then leaves the buffer as it is,
        and the captured kernels would read the last tree's mask. A runner of another width refuses the linear
        verify anyway (`can_run_graph`: the width must be its captured one), so that step is eager already. The
        runner is hidden (None: what `prepare_for_verify` and the model runner's forward ask) for the call only."""
        runner = self._linear_runs_eager()
        if runner is None:
            return upstream()
        model_runner = self.target_worker.model_runner
        setattr(model_runner, V2_RUNNER.attr, None)
        try:
            return upstream()
        finally:
            setattr(model_runner, V2_RUNNER.attr, runner)

    # ------------------------------------------------------------------ base hooks (defaults: 0.5.17's shapes)
    def _base_fallback_reason(self, batch: Any) -> str | None:
        """Why upstream's linear step must serve this decode batch on this base (a per-request feature only it
        serves), or None."""
        return None

    def _draft_hidden(self, batch: Any, draft_input: Any) -> torch.Tensor:
        """The draft's hidden states `[bs, block, hidden]` from upstream's draft forward (base-specific)."""
        raise NotImplementedError

    def _host_reserved_cpu(self, draft_input: Any) -> torch.Tensor | None:
        """The reservation's host lengths the draft input carries (base-specific name)."""
        raise NotImplementedError

    def _verify_input_extra(self, batch: Any, verify: TreeVerify, n: int, bounds: torch.Tensor) -> dict[str, Any]:
        """Extra `DFlashVerifyInput` fields the base's verify needs (0.5.23: its KV plan)."""
        return {}

    def _full_verify_logits(self, logits_output: Any) -> torch.Tensor:
        """The verify's full-vocabulary logits `[bs * n, vocab]` (0.5.23 may defer a TP gather)."""
        return logits_output.next_token_logits

    def _draft_kv_cache_loc(self, batch: Any, cache_loc: torch.Tensor) -> torch.Tensor:
        """The committed slots (virtual ids, `[bs * block]`) as the draft pool indexes them (0.5.23 translates)."""
        return cache_loc

    def _result_extra(self, target_out: Any) -> dict[str, Any]:
        """Extra `GenerationBatchResult` fields the base's scheduler reads (0.5.23: the verify's routed experts and
        indexer outputs)."""
        return {}

    # ------------------------------------------------------------------ shared by the bases' draft forwards
    def _draft_block(self, batch: Any, draft_input: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Upstream's draft block (its eager prepare-block path, the same on both bases): the ids `[bs, block]`
        (the bonus, then the mask token), the positions `prefix + j` `[bs, block]`, and the block's slots in each
        request's reserved row `[bs * block]`."""
        bs, block = len(batch.seq_lens), int(self.block_size)
        self._ensure_draft_block_buffers(bs)
        prefix_lens = batch.seq_lens
        block_ids = self._draft_block_ids_buf[:bs]
        block_ids.fill_(int(self._mask_token_id))
        block_ids[:, 0].copy_(draft_input.bonus_tokens)
        positions = self._draft_block_positions_buf[:bs]
        torch.add(prefix_lens.unsqueeze(1), self._block_pos_offsets, out=positions)
        cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            start_offset=prefix_lens, end_offset=prefix_lens + block, batch_size=bs, draft_token_num=block,
            device=self.device,
        )
        return block_ids, positions, cache_loc

    def _tree_result(self, target_out: Any, outputs: StepOutputs) -> Any:
        return GenerationBatchResult(
            logits_output=outputs.logits_output, next_token_ids=outputs.next_token_ids,
            accept_lens=outputs.accept_lens, can_run_cuda_graph=outputs.can_run_cuda_graph,
            next_draft_input=outputs.next_draft_input,
            speculative_num_draft_tokens=outputs.speculative_num_draft_tokens, new_seq_lens=outputs.new_seq_lens,
            **self._result_extra(target_out),
        )

    # ------------------------------------------------------------------ the step
    def _build_tree(self, draft_hidden: torch.Tensor, budget: int, width: int | None = None) -> DDTree:
        """The configured (auto: the largest) budget's tree; a smaller `budget` keeps its first nodes, padded to
        `width` verify tokens per request (`shrink_tree`; default: the largest tree's, the one verify width the seams
        sized): nodes are best-first whatever the budget, so that prefix is the tree auto's acceptance-by-budget
        measured for it."""
        tail = draft_hidden[:, 1:, :]
        tree = None if self._build_graphs is None else self._build_graphs.run(tail)
        if tree is None:  # no graphs, or more requests than their largest batch
            tree = self._tree_builder(self.target_worker.model_runner.model.lm_head)(tail)
        else:
            self.ddtree_stats.build_graph_steps += 1
        if budget >= self.tree_budget:
            return tree
        return shrink_tree(tree, budget, pad=True, pad_to=width, kernel=shrink_kernel(tree.parents))

    def _tree_builder(self, lm_head: Any) -> Any:
        """The build of the configured (auto: the largest) budget's tree from the draft hidden states after the
        bonus `[bs, block - 1, hidden]`: what a build graph captures, and the eager build where none replays."""
        # SGLang's ParallelLMHead is sharded over the TP group (one shard at TP 1); a plain head is the vocabulary
        sharded = hasattr(lm_head, "shard_indices")
        vocab = int(lm_head.org_vocab_size) if sharded else int(lm_head.weight.shape[0])
        group = get_tp_group() if sharded else None
        return lambda tail: build_ddtree(tail_tree_logits(tail, lm_head, vocab, group), self.tree_budget,
                                         self.tree_topk_cap, self.tree_keep_chain)

    def _verify_width(self, budget: int, batch_size: int) -> int:
        """Tokens per request a tree of `budget` nodes verifies at this step: the largest tree's own width; else
        under auto's ladder the smallest captured width that holds it (graphs of every candidate width: its own),
        without a ladder SGLang's one set's width (padded: the one graph set, as before the ladder), and its own
        width where no graph takes the batch (graphs off, or more requests than the graphs hold: eager at any width,
        the triton backend's verify metadata is built from the step's own verify input)."""
        own, widest = int(budget) + 1, self.tree_budget + 1
        if own >= widest:
            return widest
        runner = getattr(self.target_worker.model_runner, V2_RUNNER.attr, None)
        if runner is None or not V2_RUNNER.is_graph_runner(runner) or batch_size > int(runner.max_bs):
            return own
        ladder = self._verify_ladder
        return ladder.width_for(own) if ladder is not None else V2_RUNNER.width(runner)

    def _verify_runner(self, width: int | None) -> None:
        """Install the ladder's runner of `width` where the target's verify reads it (`prepare_for_verify` asks it
        `can_run_graph` and loads the batch; the forward replays it); None: SGLang's own (the widest) again, for
        every other forward. Upstream's linear steps (auto's chain, the fallbacks) keep SGLang's own: their verify
        carries no custom mask, and a block-width set of the ladder was captured reading the mask buffer (the
        seams' mask policy), which would still hold the last tree's mask; where SGLang's own set is at the block's
        width (largest budget block - 1), `_upstream_linear` hides it from them."""
        ladder = self._verify_ladder
        if ladder is not None:
            ladder.use(ladder.widest if width is None else width)

    def _tree_step(self, batch: Any, on_publish: Any, budget: int | None = None,
                   sampled: list[int] | None = None) -> Any:
        draft_input = batch.spec_info
        if batch.seq_lens.is_cuda:  # upstream's: seq_lens may come from another stream
            batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
        bs, block = len(batch.seq_lens), int(self.block_size)
        prefix_lens = batch.seq_lens
        req_to_token = self.model_runner.req_to_token_pool.req_to_token

        budget = self.tree_budget if budget is None else int(budget)
        draft_hidden = self._draft_hidden(batch, draft_input)
        self._mark("draft_done")
        tree = self._build_tree(draft_hidden, budget, self._verify_width(budget, bs))
        self._mark("built")
        n = self._step_width = int(tree.parents.shape[1])
        bounds, prefix_bound = host_prefix_bounds(batch.seq_lens_cpu, self._host_reserved_cpu(draft_input), n)
        if bounds is None:
            raise RuntimeError("DDTree v2 tree step needs the host's sequence lengths (overlap is refused).")
        verify = tree_verify_input(tree, draft_input.bonus_tokens, prefix_lens, req_to_token,
                                   batch.req_pool_indices, prefix_bound)

        verify_input = DFlashVerifyInput(
            draft_token=verify.tokens, positions=verify.positions, draft_token_num=n,
            custom_mask=verify.custom_mask, capture_hidden_mode=CaptureHiddenMode.FULL,
            **self._verify_input_extra(batch, verify, n, bounds),
        )
        if self._ddtree_hybrid is not None:
            self._ddtree_hybrid.attach_tree(verify_input, tree)
        batch.out_cache_loc = verify.out_cache_loc
        self._mark("mask_ready")  # v1's point: tokens, positions, slots and mask made; upstream's planning is next
        seq_lens_cpu_backup, seq_lens_sum_backup = batch.seq_lens_cpu, batch.seq_lens_sum
        batch.seq_lens_cpu, batch.seq_lens_sum = bounds, int(bounds.sum())  # host bound = prefix + n
        self._verify_runner(n)  # the graphs of this width, for the plan below and the forward
        try:
            verify_forward_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker)
            batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu_backup, seq_lens_sum_backup
            target_out = self.target_worker.forward_batch_generation(
                batch=None, forward_batch=verify_forward_batch, is_verify=True, skip_attn_backend_init=True,
            )
        finally:
            self._verify_runner(None)
        self._mark("target_done")
        logits_output = target_out.logits_output
        logits = self._full_verify_logits(logits_output)
        logits_output.next_token_logits = logits
        info = batch.sampling_info
        candidates = verify.tokens.view(bs, n)
        adjusted = adjust_tree_verify_logits(logits, batch, tree, candidates)

        if sampled is None:  # auto's step already knows them (it chose for the batch's mix)
            sampled = self._sampled_rows(batch)
        accepted, accept_lens, bonus = tree_walk(
            tree, candidates, logits.view(bs, n, -1), sampled_rows=sampled, rule=self.sampling_rule,
            unfiltered=unfiltered_rows(batch.reqs, sampled),
            temperatures=None if info is None else info.temperatures,
            top_ks=None if info is None else info.top_ks, top_ps=None if info is None else info.top_ps,
            min_ps=info.min_ps if info is not None and info.need_min_p_sampling else None,
        )
        if self.ddtree_auto is not None:  # what each candidate budget's tree would have accepted (read by the caller)
            self._step_acceptance = step_acceptance(tree, accepted, self._auto_budgets, sampled, acceptance_by_kind)
        commit = commit_tree(tree, accepted, accept_lens, bonus, req_to_token, batch.req_pool_indices,
                             prefix_lens, block, kernel=commit_kernel(accepted))
        commit_lens = commit.commit_lens.to(torch.int32)
        if self._ddtree_hybrid is not None:  # the recurrent state of each request's last committed node
            self._ddtree_hybrid.commit(self, batch, tree, accepted, commit_lens, prefix_lens)
        new_seq_lens = prefix_lens + commit_lens.to(prefix_lens.dtype)
        if on_publish is not None:
            on_publish(new_seq_lens)

        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTree v2 verify requires target hidden states, but got None.")
        plan = commit.kv_plan
        cache_loc = self._draft_kv_cache_loc(batch, plan.cache_loc)
        target_hidden = hidden.index_select(0, plan.hidden_rows)
        self._mark("walked")  # v1's point: walked, committed, the path's hidden rows gathered; the draft KV is next
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=target_hidden, cache_loc=cache_loc,
            cache_loc_2d=cache_loc.view(bs, block), positions=plan.positions, commit_lens=commit_lens,
        )
        logits_output.hidden_states = None
        self._record_tree_step(tree, commit_lens, sampled=len(sampled), adjusted=adjusted,
                               graph=target_out.can_run_cuda_graph)
        return self._tree_result(target_out, StepOutputs(
            logits_output=logits_output,
            next_token_ids=commit.out_tokens.reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=self._make_next_draft_input_decode(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=block,
            new_seq_lens=new_seq_lens,
        ))

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

    def _record_chain_step(self, result: Any) -> None:
        """auto's chain pick, upstream's linear step: counted as v1 counts it, a chain step, not a fallback."""
        self.ddtree_stats.add_linear_step(result, int(self.block_size))
        self.ddtree_stats.chain_steps += 1

    def _record_linear_step(self, result: Any, reason: str) -> None:
        """Upstream's linear DFLASH step on a decode batch (v1 counts its linear steps the same way)."""
        stats = self.ddtree_stats
        stats.add_linear_step(result, int(self.block_size))
        stats.fallback_steps += 1
        stats.fallback_reasons[reason] += 1

    # ------------------------------------------------------------------ auto
    @staticmethod
    def _sampled_rows(batch: Any) -> list[int]:
        return sampled_rows(batch.reqs) if getattr(batch, "sampling_info", None) is not None else []

    def _defer_chain_observation(self, sampled: list[int], result: Any, step: int) -> None:
        """A linear step's observation, from each request's accepted drafts in upstream's `accept_lens` (`sampled`:
        the batch's sampled rows), made when the next step settles it (`_settle_auto`)."""
        lens = self._accept_lens_copy.queue(result.accept_lens)
        self._auto_clock.stop()
        rows, width, budgets = set(sampled), int(self.block_size), len(self.ddtree_auto.budgets)
        self._pending_observation = (step, lambda seconds: chain_observation(
            [max(0, int(n) - 1) for n in lens.tolist()], rows, width=width, seconds=seconds, budgets=budgets))

    def _settle_auto(self, *, refresh: bool) -> None:
        """The last step's observation into auto, and with `refresh` the refresh due after it, summed over the TP
        ranks (the forward path, which every rank takes in the same order; `/server_info` only observes). Made a
        step late so that no step waits for its own device work: by now the scheduler has read that step's result
        (a host sync fixed budgets pay as well), so its host copies are there and its clock has stopped. Reading
        them at the step's end stalled the host until the step's tail was done, which the tree step without auto
        does not."""
        auto, pending, self._pending_observation = self.ddtree_auto, self._pending_observation, None
        if pending is not None:
            step, observation = pending
            obs = observation(self._auto_clock.seconds())
            auto.observe(obs)
            if self._auto_metrics is not None:
                self._auto_metrics.observe_step(obs.budget)
            self._refresh_due = self._refresh_due or auto.due(step)
        if refresh and self._refresh_due:
            self._refresh_due = False
            refresh_over_ranks(auto, get_tp_group().cpu_group if self.tree_tp_size > 1 else None)
            if self._auto_metrics is not None:
                self._auto_metrics.publish(auto.as_dict())

    def ddtree_internal_state(self) -> dict[str, Any]:
        """`/server_info` → internal_states[0]["ddtree"] (`ddtree_v2_args`' hook on the scheduler's
        `get_internal_state`): v1's keys and settings names; what v2 does not have is None / empty."""
        runner = getattr(self.target_worker.model_runner, "decode_cuda_graph_runner", None)
        if self.ddtree_auto is not None:
            self._settle_auto(refresh=False)
        return _stats.internal_state(
            _stats.settings(mode="full", budget=self.tree_budget, budget_auto=self.tree_budget_auto,
                            topk_cap=self.tree_topk_cap, keep_chain=self.tree_keep_chain),
            self.ddtree_stats,
            # auto: candidates, plan per batch bucket, steps by budget, acceptance by budget, step costs
            auto=None if self.ddtree_auto is None else self.ddtree_auto.as_dict(),
            verify_graph_width=getattr(runner, "captured_req_width", None),
            verify_graph_max_bs=getattr(runner, "max_bs", None),
            build_graph_bs=None if self._build_graphs is None else self._build_graphs.sizes,
            # every step builds the largest tree (auto's smaller picks are its prefix)
            build_budgets=[self.tree_budget],
            verify_kernels=False,
            hybrid=None if self._ddtree_hybrid is None else self._ddtree_hybrid.as_dict(),
            # SGLANG_DDTREE_PROFILE=1: per-phase medians since the last read (ddtree_profile)
            profile=None if self.ddtree_profile is None else self.ddtree_profile.read_and_reset(),
        )

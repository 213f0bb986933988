"""DDTree inside SGLang's DFlash worker (installed as `sglang/srt/speculative/ddtree_worker.py`
by the ddtree-ops payload; upstream `dflash_worker.py` only carries three short hooks).

Modes (flag `--speculative-ddtree-mode`):
- `shadow-linear`: after DFlash drafts its block, build the DDTree from the same draft logits (one step
  in `SGLANG_DDTREE_SHADOW_EVERY`, default 4) and
  record its size and build time; verification stays the linear DFlash path, untouched, so outputs
  and accept lengths equal plain DFlash.
- `full`: build the tree, verify all `1 + budget` tree tokens in one TARGET_VERIFY pass with an
  ancestor-only custom mask (positions = prefix length + depth), walk the tree -- the target's
  argmax for greedy requests, a sample of the target at every node for sampled ones
  (`ddtree_sampling`) -- and commit the accepted path's KV slots and hidden states. The target's
  verify CUDA graphs are captured at `1 + budget` tokens per request (`ddtree_args`
  `target_verify_width`). A step that cannot afford the whole tree (KV pool, rows) verifies the
  first nodes of it (`shrink_tree`), padded to that width, on the same graphs: the padding's KV
  goes to SGLang's dummy slot 0 and no node attends to it. Eager steps: batches above the graphs'
  largest, steps whose logits or mask exceed the start-up sizing (a smaller tree at its own width,
  `step_budget`), and a linear DFLASH step when not even the root fits.

Why full mode is lossless here: every tree node's KV entry is computed at position
`prefix + depth` attending to the committed prefix, its ancestors and itself, which is exactly
what a linear pass over `prefix + path` computes; the walk accepts a child only when its token
is the target's own choice at the parent (argmax, or the sample drawn there), and the first
miss yields the target's own token. The accepted path's slots are re-pointed (req_to_token) in
path order, the rest are freed. Penalties and logit biases are applied to every node's logits as
plain decoding applies them after the output so far plus that node's path (`ddtree_penalties`), and a
sampled node draws from plain's own distribution for the request (`ddtree_sampling.target_probs`).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.mem_cache.common import alloc_token_slots, evict_from_tree_cache
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative import ddtree_stats
from sglang.srt.speculative.ddtree_args import (
    DDTREE_FULL_ATTENTION_BACKENDS,
    FLAG_MODE,
    TEST_UNPROVEN_HYBRID,
    configured_budget,
    is_auto,
    sampling_rule,
    set_capture_width,
    test_switch,
)
from sglang.srt.speculative.ddtree_auto_budget import (
    AutoBudget,
    auto_candidates,
    chain_observation,
    tree_observation,
    verify_widths,
)
from sglang.srt.speculative.ddtree_hybrid import HybridTree, hf_config_dict, runtime_refusal
from sglang.srt.speculative.ddtree_metrics import AutoMetrics
from sglang.srt.speculative.ddtree_penalties import NOTHING_REQUIRED, order_of, penalise_and_bias
from sglang.srt.speculative.ddtree_profile import maybe_profile
from sglang.srt.speculative.ddtree_ranks import (
    agree_all,
    agree_min,
    agree_verify_kernels,
    lm_head_refusal,
    refresh_over_ranks,
    vocab_logits,
)
from sglang.srt.speculative.ddtree_sampling import (
    sampled_rows,
    target_probs,
    tree_walk,
    unfiltered_rows,
    walk_bytes,
    walk_node_probs,
)
from sglang.srt.speculative.ddtree_stats import DDTreeStats
from sglang.srt.speculative.ddtree_step_budget import (
    StepLimits,
    VerifySizing,
    budget_ladder,
    padded_step_budget,
    size_verify_steps,
    step_budget,
)
from sglang.srt.speculative.ddtree_utils import (
    DDTreeRefused,
    HostCopy,
    acceptance_by_kind,
    build_ddtree,
    follow_verified_tree,
    full_mode_refusal,
    shrink_tree,
)
from sglang.srt.speculative.ddtree_verify_graphs import capture_verify_ladder
from sglang.srt.speculative.ddtree_verify_step import (
    commit_slots,
    greedy_walk,
    kernels_in_use,
    pack_walk,
    self_test,
    shrink_kernel,
    step_acceptance,
    tree_custom_mask,
)
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.spec_utils import assign_req_to_token_pool_func

logger = logging.getLogger(__name__)

# Log the debug metrics every this many DDTree steps (tp rank 0 only); the first step is logged too.
LOG_EVERY = max(1, int(os.environ.get("SGLANG_DDTREE_LOG_EVERY", "64") or 64))
# Shadow-linear builds and measures the tree on one step in this many (the first included): enough to
# report tree sizes and build times, at a quarter of the per-step cost on top of linear DFLASH.
SHADOW_EVERY = max(1, int(os.environ.get("SGLANG_DDTREE_SHADOW_EVERY", "4") or 4))
# Test-only switches, refused at start unless SGLANG_DDTREE_ALLOW_TEST_SWITCHES=1 (ddtree_args).
# Fault (bench/gpu/graphs_proof.py): halve the sampled walk's coins, which biases sampled requests
# towards drafted tokens; the distribution test must reject it.
TEST_BIASED_WALK = test_switch("SGLANG_DDTREE_TEST_BIASED_WALK")
# bench/gpu/run_device.sh token CYCLE: step k may use at most the k-th budget of the ladder, 0 (the
# root alone) included where the step is padded, as if the KV pool were short on every step; the
# shrunk and padded paths then run under a real workload, which must stay token-identical.
TEST_CYCLE_BUDGETS = test_switch("SGLANG_DDTREE_TEST_CYCLE_BUDGETS")
# Triton is the one backend whose target-verify metadata we can re-size per step: it reads the
# verify width from `num_draft_tokens` on every eager forward.
_TRITON_BACKEND_CLASS = "TritonAttnBackend"


def target_is_hybrid(model_runner: Any) -> tuple[bool, str]:
    """Hybrid detection from SGLang's runtime model config (authoritative); config.json's own
    evidence is in `full_mode_refusal`'s message."""
    runtime = []
    for attr in ("mambaish_config", "hybrid_gdn_config"):
        try:
            if getattr(model_runner, attr, None) is not None:
                runtime.append(attr)
        except Exception as e:  # a property that cannot evaluate is no proof of a plain model
            runtime.append(f"{attr} (unreadable: {type(e).__name__})")
    if runtime:
        return True, f"SGLang runtime model config has {', '.join(runtime)}"
    return False, "no hybrid markers"


def full_mode_refusal_at_start(model_runner: Any) -> str | None:
    """The offline refusals of `ddtree_utils.full_mode_refusal` plus what only the running server
    knows: the hybrid layers SGLang built (`ddtree_hybrid.runtime_refusal`) and the sliding window it
    actually applies."""
    hybrid, reason = target_is_hybrid(model_runner)
    if hybrid:
        refusal = runtime_refusal(model_runner, reason)
        if refusal:
            return refusal
    window = getattr(model_runner, "sliding_window_size", None)
    if window not in (None, 0, -1):
        return (
            f"DDTree full mode refused: SGLang runs this target with a sliding window of {window} "
            "tokens, which its verify kernels apply by a node's index in the verify block, not by "
            f"its tree depth. Use {FLAG_MODE} shadow-linear."
        )
    return full_mode_refusal(hf_config_dict(model_runner), allow_unproven_hybrid=test_switch(TEST_UNPROVEN_HYBRID))


def penalizer_order(info: Any) -> tuple[str, ...]:
    """The order plain applies the batch's penalizers in (their dict in the batch's orchestrator)."""
    return order_of(getattr(getattr(info, "penalizer_orchestrator", None), "penalizers", None) or {})


def adjust_verify_logits(
    logits: torch.Tensor, batch: Any, *, parents: torch.Tensor, depths: torch.Tensor, tokens: torch.Tensor,
    max_depth: int,
) -> tuple[Any, bool]:
    """Penalties (exact per verify position: `ddtree_penalties`) and logit biases on the verify logits
    `[bs, n, vocab]` of a tree or of DFLASH's linear block (parents / depths / tokens describe it).

    Returns the batch's sampling info with both marked applied (a copy whose penalizer requires nothing
    and whose bias is None: upstream DFLASH's own penalty block after the hook then applies nothing)
    and whether anything was applied. Custom logit processors: refused in full mode (ddtree_args);
    DFLASH's linear verify applies them as upstream does, before this."""
    info = batch.sampling_info
    if info is None:
        return None, False
    adjusted = penalise_and_bias(logits, batch.reqs, info.logit_bias, parents=parents, depths=depths,
                                 tokens=tokens, max_depth=max_depth, order=penalizer_order(info))
    applied = copy.copy(info)
    applied.penalizer_orchestrator, applied.logit_bias = NOTHING_REQUIRED, None
    return applied, adjusted


def verify_target_probs(logits: torch.Tensor, info: Any, n: int) -> torch.Tensor:
    """Upstream DFLASH's sampled verify distribution, made plain's (`ddtree_sampling.target_probs` with the
    server's rule): `logits` `[bs * n, vocab]`, the batch's sampling parameters repeated per position."""
    repeat = lambda t: torch.repeat_interleave(t, n, dim=0)  # noqa: E731
    min_ps = getattr(info, "min_ps", None)
    use_min_p = min_ps is not None and getattr(info, "need_min_p_sampling", False)
    return target_probs(logits, repeat(info.temperatures), repeat(info.top_ks), repeat(info.top_ps),
                        repeat(min_ps) if use_min_p else None, rule=sampling_rule())


def free_device_memory(device: Any) -> int | None:
    """Bytes free on a CUDA device (None elsewhere: nothing is sized)."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info(torch.device(device))[0])


def tp_cpu_group(worker: Any) -> Any:
    """The TP group's CPU (gloo) group, or None with one rank."""
    if int(getattr(worker.server_args, "tp_size", 1) or 1) == 1:
        return None
    from sglang.srt.distributed import get_tp_group

    return get_tp_group().cpu_group


@dataclass(frozen=True)
class StepShape:
    """One full-mode step: `budget` tree nodes per request (0: the root alone) verified as `width`
    tokens per request, `1 + budget` or, padded, the verify graphs' `1 + configured budget`;
    width 0: upstream's linear verify."""

    budget: int
    width: int


LINEAR_STEP = StepShape(budget=0, width=0)


class DDTreeController:
    """Per-worker DDTree state; created by a hook at the end of `DFlashWorker.__init__`."""

    @classmethod
    def maybe_create(cls, worker: Any) -> DDTreeController | None:
        mode = getattr(worker.server_args, "speculative_ddtree_mode", "off") or "off"
        if mode == "off":
            return None
        return cls(worker, mode)

    def __init__(self, worker: Any, mode: str) -> None:
        sa = worker.server_args
        self.worker = worker
        self.mode = mode
        self.block_size = int(worker.block_size)
        self.depth = self.block_size - 1
        # The largest tree a step verifies: the fixed budget, or auto's maximum.
        self.budget = configured_budget(sa, self.block_size)
        self.budget_auto = is_auto(getattr(sa, "speculative_ddtree_budget", None))
        self.auto: AutoBudget | None = None
        self._verify_ladder: Any = None
        self._auto_budgets: torch.Tensor | None = None
        # This step's: auto's pick, its shape, its sampled rows, the acceptance by budget of its walk
        # (device), its start.
        self._pick: Any = None
        self._step_sampled: set[int] = set()
        self._shape: StepShape = LINEAR_STEP
        self._step_acceptance: torch.Tensor | None = None
        self._acceptance_copy = HostCopy()  # read after the walk's host read: no second sync a step
        self._step_started: float | None = None
        self._auto_metrics: AutoMetrics | None = None
        self.topk_cap = sa.speculative_ddtree_topk_cap
        self.keep_chain = bool(getattr(sa, "speculative_ddtree_keep_chain", False))
        self.tp_rank = worker.tp_rank
        self.stats = DDTreeStats()
        self.profile = maybe_profile(worker.model_runner.device)  # SGLANG_DDTREE_PROFILE=1
        # (start, end) CUDA event pairs of builds not yet read; read at the next log line, so the
        # serving path never waits on the GPU for a metric.
        self._pending_build_events: list[tuple[Any, Any]] = []
        # A hybrid target's HybridLinearAttnBackend wraps the triton backend that takes the tree mask.
        self._attn_backend = getattr(worker.model_runner.attn_backend, "full_attn_backend", worker.model_runner.attn_backend)
        self.hybrid: HybridTree | None = None
        self._backend_verify_width = getattr(self._attn_backend, "num_draft_tokens", None)
        graph_runner = getattr(worker.model_runner, "graph_runner", None)
        self.verify_graph_width = getattr(graph_runner, "num_tokens_per_bs", None)
        self.verify_graph_max_bs = getattr(graph_runner, "max_bs", None)

        # both modes build trees through the target's LM head: a head it cannot read is refused here, at start,
        # not by the first tree step's matmul mid-serving
        head_refusal = lm_head_refusal(getattr(getattr(worker.model_runner, "model", None), "lm_head", None))
        if head_refusal:
            raise DDTreeRefused(f"DDTree {mode} mode refused: {head_refusal}. Serve this target with "
                                "--speculative-ddtree-mode off.")
        if mode == "full":
            refusal = full_mode_refusal_at_start(worker.model_runner)
            if refusal:
                raise DDTreeRefused(refusal)
            backend_name = type(self._attn_backend).__name__
            if backend_name != _TRITON_BACKEND_CLASS or self._backend_verify_width is None:
                raise DDTreeRefused(
                    f"DDTree full mode refused: target-verify attention backend {backend_name} "
                    "cannot take a DDTree custom mask with a variable verify width; supported: "
                    f"{', '.join(DDTREE_FULL_ATTENTION_BACKENDS)} (--attention-backend triton)."
                )
            if int(worker.page_size) != 1:
                raise DDTreeRefused(
                    f"DDTree full mode refused: needs --page-size 1, got {worker.page_size}."
                )
            if target_is_hybrid(worker.model_runner)[0]:
                self.hybrid = HybridTree(worker.model_runner, self.budget)
                self.hybrid.log_start(self.tp_rank)
            self._check_verify_width()
            if self.budget_auto:
                # Before the verify sizing: the graphs' memory is then not counted as free for steps.
                self._verify_ladder = self._capture_verify_ladder(worker)
            self.max_verify_tokens, self.max_mask_bytes = self._size_verify_memory(worker)
        # The budgets a step builds at: auto's candidates (a pick builds its own tree, the larger trees'
        # prefix, and pays only its own selection), else the configured budget.
        self.build_budgets = (
            [c.budget for c in auto_candidates(self.budget, self.block_size) if c.budget > 0]
            if mode == "full" and self.budget_auto else [self.budget]
        )
        self._warm_up_build(worker)
        self._build_graphs = self._capture_build_graphs(worker, graph_runner)
        self.verify_kernels = mode == "full" and agree_verify_kernels(self._check_verify_kernels(worker),
                                                                       tp_cpu_group(worker))
        if mode == "full" and self.budget_auto:
            self.auto = AutoBudget(
                auto_candidates(self.budget, self.block_size),
                capture_bs=list(getattr(graph_runner, "capture_bs", None) or [1]),
                max_running=int(worker.model_runner.req_to_token_pool.size),
            )
            if self._verify_ladder is not None:
                self.auto.seed_start_costs(self._verify_ladder.replay_seconds)
            self._auto_budgets = torch.tensor(self.auto.budgets, dtype=torch.int64, device=worker.model_runner.device)
            self._auto_metrics = AutoMetrics.maybe_create(
                self.auto.budgets, enabled=bool(getattr(sa, "enable_metrics", False)), tp_rank=self.tp_rank
            )

        if TEST_BIASED_WALK and self.tp_rank == 0:
            logger.warning("DDTree: SGLANG_DDTREE_TEST_BIASED_WALK=1, sampled requests are WRONG (test fault)")
        if self.tp_rank == 0:
            logger.info(
                "DDTree enabled: mode=%s budget=%s topk_cap=%s depth=%d block_size=%d",
                mode,
                f"auto (max {self.budget})" if self.budget_auto else self.budget,
                self.topk_cap,
                self.depth,
                self.block_size,
            )

    def _check_verify_width(self) -> None:
        """The patched triton backend and CUDA-graph runner size the target verify at 1 + budget
        (no graph runner: graphs off, nothing to check there)."""
        want = self.budget + 1
        widths = {"attention backend": self._backend_verify_width}
        if self.verify_graph_width is not None:
            widths["verify CUDA graphs"] = self.verify_graph_width
        wrong = {name: w for name, w in widths.items() if w != want}
        if wrong:
            raise DDTreeRefused(
                "DDTree full mode refused: the target verify is sized at "
                + ", ".join(f"{w} tokens per request ({name})" for name, w in wrong.items())
                + f", not 1 + budget = {want}: the payload's triton_backend / spec_info patches are "
                "not installed. Re-push the payload (ddtree-ops push) or use shadow-linear."
            )

    def _capture_verify_ladder(self, worker: Any) -> Any:
        """auto's verify graphs, one set per candidate width (`ddtree_verify_graphs`), their replays timed;
        None without graphs. A capture that fails on any TP rank leaves every rank with the one set SGLang
        captured (smaller trees padded to it): slower, never a server that does not start, and every rank
        replays the same graphs."""
        runner = worker.model_runner
        widths = verify_widths(auto_candidates(self.budget, self.block_size))
        ladder, error = None, None
        try:
            ladder = capture_verify_ladder(
                runner, widths, set_capture_width=set_capture_width, set_backend_width=self.set_verify_width,
                reserved_memory=lambda: torch.cuda.memory_reserved(runner.device),
            )
        except Exception as e:  # noqa: BLE001 - any capture failure keeps the widest set alone
            error = f"{type(e).__name__}: {e}"
        if not agree_all(error is None, tp_cpu_group(worker)):
            if self.tp_rank == 0:
                logger.warning("DDTree auto: verify graphs at widths %s not captured (%s); smaller trees are "
                               "padded to width %d", widths, error or "failed on another TP rank", self.budget + 1)
            return None  # capture_verify_ladder left SGLang's own runner installed
        if ladder is not None and self.tp_rank == 0:
            logger.info("DDTree auto: verify graphs at widths %s captured in %.1f s, %.2f GiB; replay ms by "
                        "(width, bs): %s", ladder.widths, ladder.seconds, ladder.captured_bytes / 2**30,
                        {f"{w}x{bs}": round(t * 1e3, 3) for (w, bs), t in sorted(ladder.replay_seconds.items())})
        return ladder

    def _warm_up_build(self, worker: Any) -> None:
        """Compile the tree builder's Triton kernels at start for every budget a step builds at (the first
        build in a process JIT-compiles for tens of seconds; a serving step should not)."""
        device = worker.model_runner.device
        if not str(device).startswith("cuda"):
            return
        vocab = int(worker.model_runner.model_config.vocab_size)
        t0 = time.perf_counter()
        for bs in (1, 2):
            # The draft logits' dtype is the target LM head's (model dtype): kernels specialise on it.
            logits = torch.randn((bs, self.depth, vocab), device=device).to(worker.model_runner.model_config.dtype)
            for budget in self.build_budgets:
                build_ddtree(logits, budget, topk_cap=self.topk_cap, keep_chain=self.keep_chain)
        torch.cuda.synchronize(device)
        if self.tp_rank == 0:
            logger.info("DDTree builder warmed up in %.1f s", time.perf_counter() - t0)

    def _check_verify_kernels(self, worker: Any) -> bool:
        """Compile the verify step's Triton kernels (`ddtree_verify_kernels`) at start and check them
        against the torch path on random trees of the configured budget and of every smaller one a step
        may take (own width and padded); a kernel that fails either leaves the torch path for every
        step (a warning, never a server that does not start)."""
        device = worker.model_runner.device
        pad_widths = tuple(self._verify_ladder.widths) if self._verify_ladder is not None else ()
        error = self_test(torch.device(device), self.budget, self.depth, build_ddtree, follow_verified_tree,
                          shrink_tree, smaller=(*budget_ladder(self.budget)[1:], 0), pad_widths=pad_widths,
                          walk=walk_node_probs, acceptance=acceptance_by_kind if self.budget_auto else None)
        if error and self.tp_rank == 0:
            logger.warning("DDTree: verify kernels off (%s); the verify step runs on torch ops", error)
        return kernels_in_use(torch.device(device))

    def _capture_build_graphs(self, worker: Any, graph_runner: Any) -> dict[int, Any] | None:
        """Builds captured at the verify graphs' batch sizes, one set per budget a step builds at
        (`ddtree_build_graphs.capture_build_sets`, the v2 tree step's too)."""
        from sglang.srt.speculative.ddtree_build_graphs import capture_build_sets

        runner = worker.model_runner
        lm_head = getattr(getattr(runner, "model", None), "lm_head", None)
        return capture_build_sets(
            {budget: self.budget_build(lm_head, budget) for budget in self.build_budgets},
            list(getattr(graph_runner, "capture_bs", None) or []), lm_head, depth=self.depth,
            dtype=getattr(runner.model_config, "dtype", None), device=runner.device,
            tp_size=int(getattr(worker.server_args, "tp_size", 1) or 1),
        )

    def budget_build(self, lm_head: Any, budget: int) -> Any:
        """The build a graph captures: draft hidden states after the bonus [bs, depth, hidden] -> the
        budget's tree (what `build_tree` runs eagerly where no graph is captured)."""
        return lambda tail: self._build_eagerly(tail, lm_head, budget)

    def _build_eagerly(self, tail: torch.Tensor, lm_head: Any, budget: int) -> Any:
        """Draft hidden states after the bonus [bs, depth, hidden] -> the budget's tree."""
        bs = int(tail.shape[0])
        logits = self.draft_logits(tail.reshape(-1, tail.shape[-1]), lm_head).view(bs, self.depth, -1)
        return build_ddtree(logits, budget, topk_cap=self.topk_cap, keep_chain=self.keep_chain)

    def _size_verify_memory(self, worker: Any) -> tuple[int, int]:
        """Verify tokens and mask bytes a step may use, sized once at start and reserved.

        Runs after the target and draft runners allocated their KV pools and graphs, so the free
        device memory is what verify steps have. The free memory is the minimum over the TP ranks
        (`ddtree_ranks`): every rank then sizes alike, so every step's shape is the same on all of
        them. The worst step (every running request with a full tree, and one sampled walk) is
        allocated once here: a server that cannot afford it fails at start, naming the flag to
        lower, instead of running out of memory mid-step, and the caching allocator keeps the block
        for the steps. Steps beyond the sizing shrink their tree (`step_budget`).
        """
        runner = worker.model_runner
        cfg = runner.model_config
        max_running = int(runner.req_to_token_pool.size)
        n = self.budget + 1
        row_width = int(runner.req_to_token_pool.max_context_len)
        override = os.environ.get("SGLANG_DDTREE_MAX_VERIFY_TOKENS")
        free = free_device_memory(runner.device)
        if free is None:  # CPU: nothing to size against
            tokens = max_running * n if not override else min(max_running * n, int(override))
            return tokens, n * max_running * (row_width + n)
        (free,) = agree_min([free], tp_cpu_group(worker))
        sizing = size_verify_steps(
            free, max_running=max_running, width=n, block_size=self.block_size, row_width=row_width,
            vocab=cfg.vocab_size, hidden=cfg.hidden_size, walk_bytes=walk_bytes(n, cfg.vocab_size),
            override_tokens=int(override) if override else None,
        )
        if not isinstance(sizing, VerifySizing):
            raise DDTreeRefused(f"DDTree full mode refused: {sizing}")
        if str(runner.device).startswith("cuda"):
            reserve = torch.empty((sizing.reserve_bytes,), dtype=torch.uint8, device=runner.device)
            del reserve  # freed into the caching allocator: reserved for verify steps
        if self.tp_rank == 0:
            logger.info(
                "DDTree full: verify steps sized at %d tokens (worst step %d), %.1f MiB of mask and %.2f GiB "
                "for a sampled walk; %.2f GiB reserved (free memory agreed over the TP ranks: %.2f GiB)",
                sizing.max_verify_tokens, max_running * n, sizing.max_mask_bytes / 2**20,
                sizing.walk_bytes / 2**30, sizing.reserve_bytes / 2**30, free / 2**30,
            )
        return sizing.max_verify_tokens, sizing.max_mask_bytes

    # ------------------------------------------------------------------ draft logits + tree
    def draft_logits(self, hidden_states: torch.Tensor, lm_head: Any) -> torch.Tensor:
        """Full-vocabulary draft logits `[n, vocab]` from the target's vocab-parallel LM head, gathered over
        the TP ranks so every rank builds the same tree (`ddtree_ranks.vocab_logits`)."""
        from sglang.srt.distributed import get_tp_group

        vocab = int(self.worker.model_runner.model_config.vocab_size)
        return vocab_logits(hidden_states, lm_head, vocab, get_tp_group())

    def build_tree(self, draft_hidden: torch.Tensor, lm_head: Any, budget: int | None = None) -> Any:
        """The tree of `budget` (one of `build_budgets`; default the configured one). draft_hidden:
        [bs, block_size, hidden]; positions 1.. predict the block's tokens. A step that affords less keeps
        its first nodes (`shrink_tree`): no Triton kernel compiled for another budget mid-serving."""
        budget = self.budget if budget is None else int(budget)
        tail = draft_hidden[:, 1:, :]
        use_events = tail.is_cuda and len(self._pending_build_events) < 4 * LOG_EVERY
        if use_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        tree = None
        graphs = None if self._build_graphs is None else self._build_graphs.get(budget)
        if graphs is not None:
            tree = graphs.run(tail)
            self.stats.build_graph_steps += tree is not None
        if tree is None:
            tree = self._build_eagerly(tail, lm_head, budget)
        if use_events:
            end.record()
            # Read lazily at the next log line: no host sync in the serving path.
            self._pending_build_events.append((start, end))
        elif not tail.is_cuda:
            self._record_build_ms((time.perf_counter() - t0) * 1e3)
        self.mark_phase("built")
        return tree

    def mark_phase(self, name: str) -> None:
        """A named point of the step for SGLANG_DDTREE_PROFILE (ddtree_profile); the step's start is also
        auto's clock."""
        if name == "step_start":
            self._step_started = time.perf_counter()
        if self.profile is not None:
            self.profile.mark(name)

    def _record_build_ms(self, ms: float) -> None:
        if self.stats.build_ms_first is None:
            self.stats.build_ms_first = ms
        else:
            self.stats.build_ms_recent.append(ms)
        self.stats.build_ms_n += 1

    # ------------------------------------------------------------------ shadow-linear
    def shadow_observe(self, draft_hidden: torch.Tensor, lm_head: Any) -> None:
        """Build and measure the tree; never touches the verify input."""
        tree = self.build_tree(draft_hidden, lm_head)
        self.stats.add_nodes(tree.num_nodes)
        self.stats.requests_sum += int(draft_hidden.shape[0])

    # ------------------------------------------------------------------ hooks
    def on_draft(
        self,
        batch: ScheduleBatch,
        *,
        bonus_tokens: torch.Tensor,
        target_prefix_lens: torch.Tensor,
        draft_hidden: torch.Tensor,
        lm_head: Any,
    ) -> bool:
        """Hook after the DFlash draft forward. True: the tree verify input is installed and
        the caller must return; False: continue with upstream's linear path."""
        self.mark_phase("draft_done")
        self.set_verify_width(self.block_size)
        shape = self.step_shape_for(batch)
        self._shape = shape
        if self._verify_ladder is not None:
            self._verify_ladder.use(shape.width or self.block_size)
        if shape.width:
            self.prepare_tree_verify(
                batch,
                shape=shape,
                bonus_tokens=bonus_tokens,
                target_prefix_lens=target_prefix_lens,
                draft_hidden=draft_hidden,
                lm_head=lm_head,
            )
            return True
        if self.mode == "shadow-linear" and self.stats.steps % SHADOW_EVERY == 0:
            self.shadow_observe(draft_hidden, lm_head)
        return False

    def on_verified(
        self, verify_input: Any, num_correct_drafts_per_req: list[int], *, graph: bool = False
    ) -> None:
        """Hook at the end of a DFlash decode step (both verify kinds); `graph`: the target verify
        replayed a CUDA graph."""
        if graph:
            self.stats.graph_steps += 1
        self.mark_phase("step_done")
        if self.profile is not None:
            self.profile.end_step()
        self.on_step_done(
            num_correct_drafts_per_req, linear=not isinstance(verify_input, DDTreeVerifyInput)
        )

    # ------------------------------------------------------------------ full mode
    def step_shape_for(self, batch: ScheduleBatch) -> StepShape:
        """This step's tree budget and verify width; width 0: upstream's linear verify (counted by
        reason, or auto's chain). The budget is the configured one, or auto's pick for this batch. Where
        verify graphs of the pick's width take the batch, a step that cannot afford the whole tree is
        padded to that width (`padded_step_budget`); elsewhere it shrinks to its own (`step_budget`)."""
        if self.mode != "full":
            return LINEAR_STEP
        bs = batch.batch_size()
        top, graph_width = self.budget, self.budget + 1
        self._pick = None
        if self.auto is not None:
            self._step_sampled = set(sampled_rows(batch.reqs))
            self._pick = self.auto.choose(bs, self.stats.steps, sampled=len(self._step_sampled))
            if self._pick.is_chain:
                self.stats.chain_steps += 1
                return LINEAR_STEP
            top, graph_width = self._pick.budget, self._pick.width
        facts = dict(
            batch_size=bs,
            max_seq_len=int(batch.seq_lens_cpu.max().item()),
            prefix_total=int(batch.seq_lens_cpu.sum().item()),
            limits=StepLimits(
                row_width=int(batch.req_to_token_pool.req_to_token.shape[1]),
                max_verify_tokens=self.max_verify_tokens,
                max_mask_bytes=self.max_mask_bytes,
            ),
        )
        has_graphs = (graph_width in self._verify_ladder.runners if self._verify_ladder is not None
                      else self.verify_graph_width == graph_width)
        on_graphs = has_graphs and bs <= (self.verify_graph_max_bs or 0)
        padded = padded_step_budget(top, width=graph_width, **facts) if on_graphs else None
        if padded is not None:
            ladder, budget = [*budget_ladder(top), 0], padded
        else:
            ladder, budget = budget_ladder(top), step_budget(top, **facts)
            if budget == 0:
                self.stats.fallback_reasons["step_limits"] += 1
                return LINEAR_STEP
        if TEST_CYCLE_BUDGETS:
            budget = min(budget, ladder[self.stats.steps % len(ladder)])
        while not self._tree_fits_in_kv(batch, budget):
            smaller = [b for b in ladder if b < budget]
            if not smaller:
                self.stats.fallback_reasons["kv_pool"] += 1
                return LINEAR_STEP
            budget = smaller[0]
        if budget < top:
            self.stats.shrunk_steps += 1
            self.stats.padded_steps += padded is not None
        return StepShape(budget=budget, width=graph_width if padded is not None else budget + 1)

    def _tree_fits_in_kv(self, batch: ScheduleBatch, budget: int) -> bool:
        # The scheduler reserves max_speculative_num_draft_tokens (raised to 1 + budget by
        # ddtree_args) per request for the next step; this is the last line should the pool still
        # be short (another allocation in between): verify linearly instead of failing the alloc.
        needed = batch.batch_size() * (budget + 1)
        allocator = batch.token_to_kv_pool_allocator
        if allocator.available_size() >= needed:
            return True
        evict_from_tree_cache(batch.tree_cache, needed)
        return allocator.available_size() >= needed

    def prepare_tree_verify(
        self,
        batch: ScheduleBatch,
        *,
        shape: StepShape,
        bonus_tokens: torch.Tensor,
        target_prefix_lens: torch.Tensor,
        draft_hidden: torch.Tensor,
        lm_head: Any,
    ) -> None:
        """Replace DFlash's linear verify input by the tree's (called instead of the argmax)."""
        bs = batch.batch_size()
        built = self.budget if self._pick is None else self._pick.budget
        tree = self.build_tree(draft_hidden, lm_head, built)
        n = shape.width
        if shape.budget < built:
            tree = shrink_tree(tree, shape.budget, pad=n > shape.budget + 1, pad_to=n,
                               kernel=shrink_kernel(tree.parents))
        tokens = torch.empty((bs, n), dtype=torch.long, device=bonus_tokens.device)
        tokens[:, 0] = bonus_tokens.to(torch.long)
        # Padding slots (num_nodes < n) carry PAD_TOKEN_ID, depth 0 and a mask row of their own;
        # they are verified like any node and never accepted.
        tokens[:, 1:] = tree.token_ids.to(torch.long)
        positions = tree.positions(target_prefix_lens)
        verify_input = DDTreeVerifyInput(
            draft_token=tokens.reshape(-1),
            positions=positions.reshape(-1),
            draft_token_num=n,
            kv_width=shape.budget + 1,
            tree=tree,
            controller=self,
        )
        if self.hybrid is not None:  # the recurrent layers' tree path takes DDTree's own arrays
            verify_input.retrieve_next_token = tree.retrive_next_token
            verify_input.retrieve_next_sibling = tree.retrive_next_sibling
        verify_input.prepare_for_verify(batch, self.worker.page_size)
        self.stats.tree_steps += 1
        self.stats.add_nodes(tree.num_nodes)
        self.stats.requests_sum += bs
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.spec_info = verify_input
        batch.return_hidden_states = False

    def set_verify_width(self, width: int) -> None:
        """The triton backend reads the verify width from `num_draft_tokens` when it builds a step's
        metadata (eager or graph replay); every full-mode step sets its own before the forward."""
        if self.mode == "full" and self._backend_verify_width is not None:
            self._attn_backend.num_draft_tokens = int(width)

    def mamba_commit_steps(
        self, verify_input: Any, chain_steps: torch.Tensor, track_steps: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Called by DFLASH's recurrent-state commit (payload patch): its chain indices, as this step's nodes."""
        if self.hybrid is None:
            return chain_steps, track_steps
        return self.hybrid.commit_steps(verify_input, chain_steps, track_steps)

    # ------------------------------------------------------------------ metrics
    def on_step_done(self, num_correct_drafts_per_req: list[int], *, linear: bool) -> None:
        if self.auto is not None:
            self._observe_step(num_correct_drafts_per_req, self._step_sampled, linear=linear)
        self.stats.steps += 1
        if linear:
            if self.mode == "full" and not (self._pick is not None and self._pick.is_chain):
                self.stats.fallback_steps += 1
            for k in num_correct_drafts_per_req:
                self.stats.accepted_depth_hist[int(k)] += 1
        if (self.stats.steps % LOG_EVERY == 0 or self.stats.steps == 1) and self.tp_rank == 0:
            if self._pending_build_events:
                self._pending_build_events[-1][1].synchronize()
                for start, end in self._pending_build_events:
                    self._record_build_ms(float(start.elapsed_time(end)))
                self._pending_build_events = []
            logger.info("DDTree stats (%s): %s", self.mode, self.stats.as_dict())

    def stash_acceptance(self, tree: Any, accepted_nodes: torch.Tensor, sampled: list[int]) -> None:
        """auto: what each candidate budget's tree would have accepted on this step, greedy and sampled
        requests apart (a host copy queued in stream order: read once the walk's host read has synchronised)."""
        if self.auto is not None:
            self._step_acceptance = self._acceptance_copy.queue(
                step_acceptance(tree, accepted_nodes, self._auto_budgets, sampled, acceptance_by_kind))

    def _observe_step(self, num_correct: list[int], sampled: set[int], *, linear: bool) -> None:
        auto = self.auto
        step = self.stats.steps
        seconds = 0.0 if self._step_started is None else time.perf_counter() - self._step_started
        if linear or self._step_acceptance is None:
            obs = chain_observation(num_correct, sampled, width=self.block_size, seconds=seconds,
                                    budgets=len(auto.budgets))
        else:
            obs = tree_observation(self._step_acceptance.tolist(), budget=self._shape.budget, width=self._shape.width,
                                   batch_size=len(num_correct), sampled=len(sampled), seconds=seconds)
        self._step_acceptance = None
        auto.observe(obs)
        if self._auto_metrics is not None:
            self._auto_metrics.observe_step(obs.budget)
        if auto.due(step):
            refresh_over_ranks(auto, tp_cpu_group(self.worker))
            if self._auto_metrics is not None:
                self._auto_metrics.publish(auto.as_dict())

    def internal_state(self) -> dict[str, Any]:
        """For the scheduler's get_internal_state (`/server_info` → internal_states[i]["ddtree"]; `ddtree_stats`)."""
        return ddtree_stats.internal_state(
            ddtree_stats.settings(mode=self.mode, budget=self.budget, budget_auto=self.budget_auto,
                                  topk_cap=self.topk_cap, keep_chain=self.keep_chain),
            self.stats,
            # auto: candidates, plan per batch bucket, steps by budget, acceptance by budget, step costs
            auto=None if self.auto is None else self.auto.as_dict(),
            verify_graph_width=self.verify_graph_width,
            verify_graph_max_bs=self.verify_graph_max_bs,
            build_graph_bs=None if not self._build_graphs else next(iter(self._build_graphs.values())).sizes,
            build_budgets=self.build_budgets,
            verify_kernels=self.verify_kernels,  # the fused mask / walk / commit (ddtree_verify_step)
            hybrid=None if self.hybrid is None else self.hybrid.as_dict(),
            # SGLANG_DDTREE_PROFILE=1: per-phase medians since the last read (ddtree_profile)
            profile=None if self.profile is None else self.profile.read_and_reset(),
        )


@dataclass
class DDTreeVerifyInput(DFlashVerifyInput):
    """TARGET_VERIFY input for a DDTree: `draft_token_num = 1 + budget` tokens per request (the
    verify graphs' width when padded), node order as built (parents before children), custom
    mask = prefix + tree ancestors."""

    tree: Any = None
    controller: Any = None
    # Slots per request that hold the tree's KV (1 + its budget); the rest of `draft_token_num`
    # (a step padded to the verify graphs' width) write theirs to SGLang's dummy slot 0.
    kv_width: int = 0
    tree_cache_loc: Any = None  # those slots, request-major (set by prepare_for_verify)
    # Hybrid targets: the tree for SGLang's linear-attention tree path, and the walk's accepted nodes for
    # the recurrent-state commit (DDTreeController.mamba_commit_steps).
    retrieve_next_token: Any = None
    retrieve_next_sibling: Any = None
    accepted_nodes: Any = None

    @property
    def tree_width(self) -> int:
        """KV slots per request the tree's nodes hold (`kv_width`, or every verify token's)."""
        return int(self.kv_width or self.draft_token_num)

    def prepare_for_verify(self, batch: ScheduleBatch, page_size: int, *, build_custom_mask: bool = True):
        if batch.forward_mode.is_idle():
            return
        if page_size != 1:
            raise DDTreeRefused(f"DDTree full mode needs page_size 1, got {page_size}.")
        n = int(self.draft_token_num)
        w = self.tree_width
        bs = batch.batch_size()
        row_width = int(batch.req_to_token_pool.req_to_token.shape[1])
        longest = int(batch.seq_lens_cpu.max().item())
        if longest + w > row_width:
            # step_budget never lets this happen; the slot writer has no bound check of its own,
            # so an overflow here would land in the next request's row.
            raise RuntimeError(
                f"DDTree verify of {w} tokens after {longest} does not fit a req_to_token row of {row_width}."
            )
        batch.input_ids = self.draft_token
        self.tree_cache_loc = alloc_token_slots(batch.tree_cache, bs * w)
        assign_req_to_token_pool_func(
            batch.req_pool_indices,
            batch.req_to_token_pool.req_to_token,
            batch.seq_lens,
            batch.seq_lens + w,
            self.tree_cache_loc,
            bs,
        )
        if w < n:
            # Slot 0 is never allocated: SGLang writes padded tokens' KV there, and no node attends
            # to the padding (its mask rows and columns are its own).
            loc = torch.zeros((bs, n), dtype=self.tree_cache_loc.dtype, device=self.tree_cache_loc.device)
            loc[:, :w] = self.tree_cache_loc.view(bs, w)
            batch.out_cache_loc = loc.view(-1)
        else:
            batch.out_cache_loc = self.tree_cache_loc
        self.custom_mask = tree_custom_mask(self.tree.tree_mask, batch.seq_lens, batch.seq_lens_cpu.tolist())
        self.controller.set_verify_width(n)
        self.controller.mark_phase("mask_ready")

    def verify(
        self,
        *,
        batch: ScheduleBatch,
        logits_output: LogitsProcessorOutput,
        page_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """Same contract as DFlashVerifyInput.verify, greedy and sampled requests alike."""
        if batch.forward_mode.is_idle():
            empty = torch.empty((0,), dtype=torch.int64, device=batch.device)
            return empty, empty.to(torch.int32), empty, []

        self.controller.mark_phase("target_done")
        bs = batch.batch_size()
        n = int(self.draft_token_num)
        logits = logits_output.next_token_logits
        device = logits.device
        tokens = self.draft_token.view(bs, n)
        info = batch.sampling_info
        stats = self.controller.stats
        candidates = tokens.to(torch.int64)
        _, adjusted = adjust_verify_logits(logits.view(bs, n, -1), batch, parents=self.tree.parents,
                                           depths=self.tree.depths, tokens=candidates, max_depth=int(self.tree.max_depth))
        stats.logit_adjusted_steps += adjusted
        sampled = sampled_rows(batch.reqs) if info is not None else []
        stats.sampled_requests += len(sampled)
        stats.greedy_requests += bs - len(sampled)
        if sampled:
            accepted_nodes, accept_lens, bonus = tree_walk(
                self.tree,
                candidates,
                logits.view(bs, n, -1),
                sampled_rows=sampled,
                unfiltered=unfiltered_rows(batch.reqs, sampled),
                rule=sampling_rule(),
                temperatures=info.temperatures,
                top_ks=info.top_ks,
                top_ps=info.top_ps,
                min_ps=info.min_ps if info.need_min_p_sampling else None,
                coin_scale=0.5 if TEST_BIASED_WALK else 1.0,
            )
            accepted_nodes = accepted_nodes.to(torch.int64)
            packed = pack_walk(candidates, accepted_nodes, accept_lens, bonus)
        else:  # greedy rows only: one fused walk on CUDA (ddtree_verify_step)
            accepted_nodes, packed = greedy_walk(
                self.tree, candidates, torch.argmax(logits, dim=-1).view(bs, n), follow_verified_tree
            )
        self.controller.stash_acceptance(self.tree, accepted_nodes, sampled)
        if self.controller.hybrid is not None:
            self.accepted_nodes = accepted_nodes
        # [bs, depth + 1], root first, -1 pad; one D2H copy for everything the per-request loop needs
        max_path = int(accepted_nodes.shape[1])
        rows = packed.cpu().tolist()

        commit_lens_cpu: list[int] = []
        new_bonus_tokens_list: list[int] = []
        num_correct: list[int] = []
        for i, req in enumerate(batch.reqs):
            acc_len = rows[i][max_path - 1]
            proposed = rows[i][:acc_len] + [rows[i][max_path]]
            appended = 0
            for token_id in proposed:
                req.output_ids.append(int(token_id))
                appended += 1
                req.update_finish_state()
                if req.finished():
                    break
                if req.grammar is not None:
                    req.grammar.accept_token(int(token_id))
            if req.output_ids:
                new_bonus = int(req.output_ids[-1])
            elif req.origin_input_ids:
                new_bonus = int(req.origin_input_ids[-1])
            else:
                raise RuntimeError("DDTree verify cannot determine the current token.")
            commit_lens_cpu.append(appended)
            new_bonus_tokens_list.append(new_bonus)
            num_correct.append(max(0, appended - 1))
            req.spec_verify_ct += 1
            req.spec_num_correct_drafts += num_correct[-1]

        commit_lens = torch.tensor(commit_lens_cpu, dtype=torch.int32, device=device)
        new_bonus_tokens = torch.tensor(new_bonus_tokens_list, dtype=torch.int64, device=device)

        # KV: keep the slots of the committed path nodes, in path order; free the tree's others (a
        # padded step's padding holds the dummy slot, never freed).
        w = self.tree_width
        kept_slots, path_rows, freed_slots = commit_slots(accepted_nodes, self.tree_cache_loc, commit_lens_cpu, w)
        if w < n:  # rows are b * w + node in the tree's slots; the hidden states are b * n + node
            path_rows = path_rows + (path_rows // w) * (n - w)
        batch.token_to_kv_pool_allocator.free(freed_slots)
        batch.out_cache_loc = kept_slots

        for req, commit_len in zip(batch.reqs, commit_lens_cpu, strict=True):
            req.kv_committed_len += commit_len
            req.kv_allocated_len = req.kv_committed_len

        end_offset = batch.seq_lens + commit_lens.to(batch.seq_lens.dtype)
        assign_req_to_token_pool_func(
            batch.req_pool_indices,
            batch.req_to_token_pool.req_to_token,
            batch.seq_lens,
            end_offset,
            batch.out_cache_loc,
            bs,
        )
        batch.seq_lens.add_(commit_lens.to(batch.seq_lens.dtype))
        batch.seq_lens_cpu.add_(torch.tensor(commit_lens_cpu, dtype=batch.seq_lens_cpu.dtype))
        batch.seq_lens_sum += sum(commit_lens_cpu)

        # Draft context features: the committed path's hidden states, in path order.
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTree verify requires target hidden states, but got None.")
        next_target_hidden = hidden.index_select(0, path_rows)
        logits_output.hidden_states = None

        for k in num_correct:
            self.controller.stats.accepted_depth_hist[int(k)] += 1
        self.controller.mark_phase("walked")
        return new_bonus_tokens, commit_lens, next_target_hidden, num_correct

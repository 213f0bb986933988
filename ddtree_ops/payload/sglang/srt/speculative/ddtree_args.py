"""DDTree server flags: CLI definitions and validation (installed as
`sglang/srt/speculative/ddtree_args.py` by the ddtree-ops payload).

Upstream files only carry hooks into this module, so the flag semantics live in one place:
- `add_ddtree_cli_args(parser)` is called from `ServerArgs.add_cli_args`;
- `handle_ddtree_server_args(server_args)` is called from `ServerArgs.__post_init__`, right after
  `handle_speculative_decoding`, so the DFLASH block size is already resolved.

Every refusal is a `ValueError` whose message names the flag and the allowed values, because an
operator reads it in a failed unit's journal, not in a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

DDTREE_MODES = ("off", "shadow-linear", "full")
# Non-root tree nodes. 512 keeps the verify batch (1 + budget tokens per request) and its
# custom mask (prefix x tree, per request) in a size the target-verify path is built for.
DDTREE_BUDGET_MIN = 1
DDTREE_BUDGET_MAX = 512
DDTREE_TOPK_CAP_MIN = 1
# Full mode changes the target-verify width per step; these backends take a custom tree mask
# and a verify width other than --speculative-num-draft-tokens in our wiring.
DDTREE_FULL_ATTENTION_BACKENDS = ("triton",)

FLAG_MODE = "--speculative-ddtree-mode"
FLAG_BUDGET = "--speculative-ddtree-budget"
FLAG_BUDGET_MAX = "--speculative-ddtree-budget-max"
BUDGET_AUTO = "auto"
# auto's largest budget when --speculative-ddtree-budget-max is not given: widths 16, 32, 64, 128.
DEFAULT_AUTO_MAX_BUDGET = 127
FLAG_TOPK_CAP = "--speculative-ddtree-topk-cap"
FLAG_KEEP_CHAIN = "--speculative-ddtree-keep-chain"
FLAG_ALLOW_HYBRID = "--speculative-ddtree-allow-hybrid-unsafe"
# The ServerArgs field of each DDTree flag (every base's patch declares these six).
FIELDS = tuple(flag[2:].replace("-", "_") for flag in (FLAG_MODE, FLAG_BUDGET, FLAG_BUDGET_MAX, FLAG_TOPK_CAP,
                                                         FLAG_KEEP_CHAIN, FLAG_ALLOW_HYBRID))

# Switches that make a server deliberately wrong or slow, for the proofs' power checks; a server
# refuses to start with one unless ALLOW_TEST_SWITCHES=1 says it is a test.
# TEST_UNPROVEN_HYBRID serves full mode on a hybrid layer type whose proof has not passed yet
# (ddtree_utils.HYBRID_TREE_SUPPORT): the proof's own servers, nothing else.
TEST_UNPROVEN_HYBRID = "SGLANG_DDTREE_TEST_UNPROVEN_HYBRID"
# TEST_V2_TREE serves full mode on a v2 base whose tree step has not passed its GPU proof (0.5.23: the GPU carry's
# torch cannot run it, so it is proven on the CPU only; ddtree_v2_args.PROVEN_TREE_BASES need no switch): the
# proof's own servers, nothing else (ddtree_v2_args.refuse_unavailable).
TEST_V2_TREE = "SGLANG_DDTREE_TEST_V2_TREE"
# TEST_V2_TP serves the v2 tree step with --tp-size > 1 (its draft logits are gathered over the vocab shards as v1's;
# no GPU proof across ranks yet): the proof's own TP servers, nothing else (ddtree_v2_step.settings_refusal).
TEST_V2_TP = "SGLANG_DDTREE_TEST_V2_TP"
TEST_SWITCHES = ("SGLANG_DDTREE_TEST_BIASED_WALK", "SGLANG_DDTREE_TEST_CYCLE_BUDGETS", TEST_UNPROVEN_HYBRID,
                 TEST_V2_TREE, TEST_V2_TP)
# A deliberately wrong recurrent-state commit on hybrid targets (the hybrid proof's power check):
# "deepest" commits each tree's deepest node, "chain" DFLASH's `commit_len - 1`, "skip" nothing.
TEST_MAMBA_COMMIT = "SGLANG_DDTREE_TEST_MAMBA_COMMIT"
MAMBA_COMMIT_FAULTS = ("deepest", "chain", "skip")
ALLOW_TEST_SWITCHES = "SGLANG_DDTREE_ALLOW_TEST_SWITCHES"


def test_switch(name: str, environ: Any = None) -> bool:
    """A test switch is on when its variable is "1"."""
    return (os.environ if environ is None else environ).get(name, "") == "1"


class DDTreeConfigError(ValueError):
    """A DDTree flag combination that the server refuses to start with."""


def mamba_commit_fault(environ: Any = None) -> str:
    """The TEST_MAMBA_COMMIT fault asked for ("" when none); an unknown value is refused."""
    value = (os.environ if environ is None else environ).get(TEST_MAMBA_COMMIT, "").strip().lower()
    if value and value not in MAMBA_COMMIT_FAULTS:
        raise DDTreeConfigError(f"{TEST_MAMBA_COMMIT} must be one of {', '.join(MAMBA_COMMIT_FAULTS)}, got {value!r}.")
    return value


def add_ddtree_cli_args(parser: argparse.ArgumentParser) -> None:
    # No argparse `choices`/ranges here: the same checks must hold for ServerArgs built in
    # Python (Engine kwargs), so they live in handle_ddtree_server_args with one message style.
    parser.add_argument(
        FLAG_MODE,
        type=str,
        default="off",
        help="DFLASH only. DDTree tree speculation: 'off' (plain DFLASH), 'shadow-linear' (build and "
        "measure the draft tree, verify the linear DFLASH path: outputs equal plain DFLASH), or "
        "'full' (verify the whole tree in one target pass; greedy requests; triton attention).",
    )
    parser.add_argument(
        FLAG_BUDGET,
        type=str,
        default=None,
        help=f"DFLASH + DDTree. Non-root tree nodes per request and step "
        f"({DDTREE_BUDGET_MIN}..{DDTREE_BUDGET_MAX}), or '{BUDGET_AUTO}': each step takes the budget (or the "
        f"linear DFLASH chain) with the most expected tokens per second for its batch, from acceptance and "
        f"step costs measured on this server (maximum: {FLAG_BUDGET_MAX}); default: block size - 1.",
    )
    parser.add_argument(
        FLAG_BUDGET_MAX,
        type=int,
        default=None,
        help=f"DFLASH + DDTree with {FLAG_BUDGET} {BUDGET_AUTO}: the largest budget a step may take "
        f"({DDTREE_BUDGET_MIN}..{DDTREE_BUDGET_MAX}); default {DEFAULT_AUTO_MAX_BUDGET}.",
    )
    parser.add_argument(
        FLAG_TOPK_CAP,
        type=int,
        default=None,
        help="DFLASH + DDTree. Candidate tokens per tree depth (1..budget); default: the budget.",
    )
    parser.add_argument(
        FLAG_KEEP_CHAIN,
        action="store_true",
        default=False,
        help="DFLASH + DDTree. Always keep the draft's top-1 chain (what linear DFLASH verifies) in the "
        "tree and fill the rest of the budget best-first, so a tree never accepts fewer tokens than "
        "linear DFLASH on the same draft. Needs a budget of at least block size - 1.",
    )
    parser.add_argument(
        FLAG_ALLOW_HYBRID,
        action="store_true",
        default=False,
        help="Refused when given: there is no unsafe override. Full mode on a hybrid (Mamba/GDN/linear-"
        "attention) target runs where its layer type and architecture are proven (ddtree_utils."
        "HYBRID_TREE_SUPPORT: Gated DeltaNet on Qwen3-Next and Qwen3.5); other hybrid targets run "
        "shadow-linear.",
    )


def _ddtree_flags_given(server_args: Any) -> list[str]:
    given = []
    if (getattr(server_args, "speculative_ddtree_mode", "off") or "off") != "off":
        given.append(FLAG_MODE)
    if getattr(server_args, "speculative_ddtree_budget", None) is not None:
        given.append(FLAG_BUDGET)
    if getattr(server_args, "speculative_ddtree_budget_max", None) is not None:
        given.append(FLAG_BUDGET_MAX)
    if getattr(server_args, "speculative_ddtree_topk_cap", None) is not None:
        given.append(FLAG_TOPK_CAP)
    if getattr(server_args, "speculative_ddtree_keep_chain", False):
        given.append(FLAG_KEEP_CHAIN)
    if getattr(server_args, "speculative_ddtree_allow_hybrid_unsafe", False):
        given.append(FLAG_ALLOW_HYBRID)
    return given


def _as_int(value: Any, flag: str) -> int:
    # ServerArgs built in Python may carry strings or floats; bool is an int subclass but a mistake.
    if isinstance(value, bool):
        raise DDTreeConfigError(f"{flag} must be an integer, got {value!r}.")
    try:
        as_int = int(value)
    except (TypeError, ValueError):
        raise DDTreeConfigError(f"{flag} must be an integer, got {value!r}.") from None
    if as_int != value and str(as_int) != str(value).strip():
        raise DDTreeConfigError(f"{flag} must be an integer, got {value!r}.")
    return as_int


def handle_ddtree_server_args(server_args: Any) -> None:
    """Validate and normalise the DDTree fields of a ServerArgs in place."""
    mode = getattr(server_args, "speculative_ddtree_mode", "off")
    mode = "off" if mode is None else str(mode).strip().lower()
    if mode not in DDTREE_MODES:
        raise DDTreeConfigError(
            f"{FLAG_MODE} must be one of {', '.join(DDTREE_MODES)}; got {mode!r}."
        )
    server_args.speculative_ddtree_mode = mode

    given = _ddtree_flags_given(server_args)
    if not given:
        return
    algo = (getattr(server_args, "speculative_algorithm", None) or "").upper()
    if algo != "DFLASH":
        raise DDTreeConfigError(
            f"{', '.join(given)} {'requires' if len(given) == 1 else 'require'} --speculative-algorithm DFLASH "
            f"(got --speculative-algorithm {getattr(server_args, 'speculative_algorithm', None)})."
        )
    if mode == "off":
        raise DDTreeConfigError(
            f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect with {FLAG_MODE} off; "
            f"set {FLAG_MODE} to shadow-linear or full, or drop them."
        )

    block_size = getattr(server_args, "speculative_num_draft_tokens", None)
    if block_size is None or int(block_size) < 2:
        raise DDTreeConfigError(
            f"{FLAG_MODE} {mode} needs a DFLASH block size of at least 2 "
            f"(--speculative-num-draft-tokens), got {block_size!r}."
        )
    block_size = int(block_size)

    budget = server_args.speculative_ddtree_budget
    budget_max = getattr(server_args, "speculative_ddtree_budget_max", None)
    if is_auto(budget):
        budget_max = DEFAULT_AUTO_MAX_BUDGET if budget_max is None else _as_int(budget_max, FLAG_BUDGET_MAX)
        if not DDTREE_BUDGET_MIN <= budget_max <= DDTREE_BUDGET_MAX:
            raise DDTreeConfigError(
                f"{FLAG_BUDGET_MAX} must be in {DDTREE_BUDGET_MIN}..{DDTREE_BUDGET_MAX} "
                f"(non-root tree nodes), got {budget_max}."
            )
        server_args.speculative_ddtree_budget = BUDGET_AUTO
        server_args.speculative_ddtree_budget_max = budget_max
        budget, budget_flag = budget_max, FLAG_BUDGET_MAX
    else:
        budget_flag = FLAG_BUDGET
        if budget_max is not None:
            raise DDTreeConfigError(
                f"{FLAG_BUDGET_MAX} is the largest budget of {FLAG_BUDGET} {BUDGET_AUTO}; with a fixed "
                f"{FLAG_BUDGET} drop it (or set {FLAG_BUDGET} {BUDGET_AUTO})."
            )
        if budget is None:
            budget = block_size - 1
        try:
            budget = _as_int(budget, FLAG_BUDGET)
        except DDTreeConfigError:
            raise DDTreeConfigError(
                f"{FLAG_BUDGET} must be in {DDTREE_BUDGET_MIN}..{DDTREE_BUDGET_MAX} (non-root tree nodes) or "
                f"{BUDGET_AUTO}, got {budget!r}."
            ) from None
        if not DDTREE_BUDGET_MIN <= budget <= DDTREE_BUDGET_MAX:
            raise DDTreeConfigError(
                f"{FLAG_BUDGET} must be in {DDTREE_BUDGET_MIN}..{DDTREE_BUDGET_MAX} "
                f"(non-root tree nodes) or {BUDGET_AUTO}, got {budget}."
            )
        server_args.speculative_ddtree_budget = budget

    cap = server_args.speculative_ddtree_topk_cap
    if cap is not None:
        cap = _as_int(cap, FLAG_TOPK_CAP)
        if not DDTREE_TOPK_CAP_MIN <= cap <= budget:
            raise DDTreeConfigError(
                f"{FLAG_TOPK_CAP} must be in {DDTREE_TOPK_CAP_MIN}..{budget} "
                f"(1..{budget_flag}), got {cap}."
            )
        server_args.speculative_ddtree_topk_cap = cap

    keep_chain = getattr(server_args, "speculative_ddtree_keep_chain", False)
    if not isinstance(keep_chain, bool):
        raise DDTreeConfigError(f"{FLAG_KEEP_CHAIN} must be a boolean (true or false), got {keep_chain!r}.")
    if keep_chain and budget < block_size - 1:
        raise DDTreeConfigError(
            f"{FLAG_KEEP_CHAIN} needs {budget_flag} >= the draft depth {block_size - 1} (block size "
            f"{block_size} - 1: the whole top-1 chain is in the tree), got {budget_flag} {budget}. "
            f"Raise {budget_flag} or drop {FLAG_KEEP_CHAIN}."
        )

    on = [f"{name}=1" for name in TEST_SWITCHES if test_switch(name)]
    fault = mamba_commit_fault()
    if fault:
        on.append(f"{TEST_MAMBA_COMMIT}={fault}")
    if on and not test_switch(ALLOW_TEST_SWITCHES):
        raise DDTreeConfigError(
            f"{', '.join(on)} {'is a test switch' if len(on) == 1 else 'are test switches'} (deliberately "
            f"wrong or slow verification), refused on a server; a test that means it sets {ALLOW_TEST_SWITCHES}=1."
        )

    if server_args.speculative_ddtree_allow_hybrid_unsafe:
        # No unsafe escape: full mode runs on a hybrid where its layer type is wired and proven
        # (ddtree_utils.HYBRID_TREE_SUPPORT), and nowhere else.
        raise DDTreeConfigError(
            f"{FLAG_ALLOW_HYBRID} is refused: full mode on a hybrid (Mamba/GDN/linear-attention) target runs "
            "only where DDTree commits the accepted node's recurrent state and a proof has shown it; there is "
            f"no unsafe override. Drop the flag; use {FLAG_MODE} shadow-linear on other hybrid targets."
        )

    if mode == "full":
        _check_full_mode(server_args)


def _check_full_mode(server_args: Any) -> None:
    # Only explicit settings can be checked here; the worker re-checks the backend that was
    # actually built (DDTreeController), since "auto" is resolved later.
    names = {
        "--attention-backend": getattr(server_args, "attention_backend", None),
        "--prefill-attention-backend": getattr(server_args, "prefill_attention_backend", None),
        "--decode-attention-backend": getattr(server_args, "decode_attention_backend", None),
    }
    for flag, backend in names.items():
        if backend is not None and backend not in DDTREE_FULL_ATTENTION_BACKENDS:
            raise DDTreeConfigError(
                f"{FLAG_MODE} full needs a target attention backend that takes a custom tree mask "
                f"with a variable verify width; supported: {', '.join(DDTREE_FULL_ATTENTION_BACKENDS)}; "
                f"got {flag} {backend}. Use --attention-backend triton or {FLAG_MODE} shadow-linear."
            )
    page_size = getattr(server_args, "page_size", None)
    if page_size is not None and int(page_size) != 1:
        raise DDTreeConfigError(
            f"{FLAG_MODE} full needs --page-size 1 (accepted tree nodes are committed slot by "
            f"slot), got --page-size {page_size}."
        )
    if getattr(server_args, "enable_dp_attention", False):
        raise DDTreeConfigError(f"{FLAG_MODE} full does not support --enable-dp-attention.")
    if getattr(server_args, "enable_deterministic_inference", False):
        # Its batch-invariant kernels cover decode and prefill; a tree verify's width and custom
        # mask change with the draft, and nothing makes that step batch-invariant.
        raise DDTreeConfigError(
            f"{FLAG_MODE} full cannot honour --enable-deterministic-inference (also implied by "
            f"--rl-on-policy-target): a tree verify step is not batch-invariant. Use {FLAG_MODE} "
            "shadow-linear or drop the flag."
        )
    from sglang.srt.speculative.ddtree_sampling import SAMPLING_RULES

    backend = getattr(server_args, "sampling_backend", None)
    if backend is not None and backend not in SAMPLING_RULES:
        raise DDTreeConfigError(
            f"{FLAG_MODE} full samples tree nodes with plain SGLang's filter rules of --sampling-backend "
            f"pytorch or flashinfer; got --sampling-backend {backend}."
        )
    if getattr(server_args, "enable_custom_logit_processor", False):
        # A processor reads the request's own state (its output so far), not a tree node's path, so
        # no tree node's logits could be made what plain decoding computes there.
        raise DDTreeConfigError(
            f"{FLAG_MODE} full cannot apply custom logit processors per tree node "
            f"(--enable-custom-logit-processor): use {FLAG_MODE} shadow-linear or drop the flag."
        )
    config = _local_model_config(server_args)
    if config is not None:
        from sglang.srt.speculative.ddtree_utils import full_mode_refusal, is_hybrid_model

        refusal = full_mode_refusal(config, allow_unproven_hybrid=test_switch(TEST_UNPROVEN_HYBRID))
        if refusal:
            raise DDTreeConfigError(refusal)
        if is_hybrid_model(config)[0]:
            check_hybrid_full_mode(server_args)
    # A tree verify writes 1 + budget KV slots per request, more than the block size the
    # req_to_token rows (context length + 4 + this value) and the scheduler's per-step
    # reservation are sized by; without this a request near the context limit writes its tree
    # into the next request's row. Only the row width and the reservation read this value.
    verify_width = 1 + configured_budget(server_args)
    current = getattr(server_args, "max_speculative_num_draft_tokens", None) or 0
    if verify_width > current:
        server_args.max_speculative_num_draft_tokens = verify_width


# Linear-attention backends whose tree path DDTree drives (SGLang's `topk > 1` branch): their kernels take
# the parents from DDTree's first-child / next-sibling arrays and keep one state per node.
HYBRID_TREE_BACKENDS = ("GDNAttnBackend",)


def hybrid_tree_verify(model_runner: Any, backend: Any) -> bool:
    """Whether this linear-attention backend verifies trees: a DDTree full-mode target (not the draft) on a
    backend in HYBRID_TREE_BACKENDS. Asked by `MambaAttnBackendBase.__init__` (payload patch), before the
    target's CUDA graphs are captured with or without the tree kernels; DDTreeController refuses a start
    where the answer and its own checks disagree."""
    server_args = model_runner.server_args
    return (
        getattr(server_args, "speculative_ddtree_mode", "off") == "full"
        and not getattr(model_runner, "is_draft_worker", False)
        and type(backend).__name__ in HYBRID_TREE_BACKENDS
    )


class _MambaPlanArgs:
    """ServerArgs as SGLang's hybrid memory plan reads them in full mode: `speculative_num_draft_tokens` is
    the width the intermediate states are allocated at (1 + budget); every write goes to the real args."""

    def __init__(self, args: Any, width: int) -> None:
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "speculative_num_draft_tokens", width)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._args, name, value)


def mamba_plan_args(server_args: Any) -> Any:
    """For `handle_max_mamba_cache` (payload patch): upstream plans the per-node recurrent states for
    `speculative_num_draft_tokens` (the DFLASH block) but allocates `max_speculative_num_draft_tokens`; in
    full mode that is the tree, so the plan counts the tree (a large budget then lowers the request count
    instead of failing the allocation)."""
    block = getattr(server_args, "speculative_num_draft_tokens", None)
    width = int(getattr(server_args, "max_speculative_num_draft_tokens", None) or 0)
    if getattr(server_args, "speculative_ddtree_mode", "off") != "full" or block is None or width <= int(block):
        return server_args
    return _MambaPlanArgs(server_args, width)


def _local_model_config(server_args: Any) -> dict | None:
    """The target's config.json when --model-path is a local directory (a hub id is checked by the
    worker, from SGLang's runtime config); read here so a refused hybrid never allocates its pools."""
    import json

    path = getattr(server_args, "model_path", None)
    if not path or not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def check_hybrid_full_mode(server_args: Any) -> None:
    """What full mode on a hybrid target is wired and proven for (bench/gpu/HYBRID.md §3.4): SGLang's
    Triton GDN kernels, one GPU, a fixed budget, and the radix cache only with `extra_buffer` tracking
    (the step's tracked state is the accepted path's node, `ddtree_hybrid.path_steps`). Called at
    argument parsing and again by the worker on the runtime config."""
    for flag, attr in (("--linear-attn-backend", "linear_attn_backend"),
                       ("--linear-attn-decode-backend", "linear_attn_decode_backend"),
                       ("--linear-attn-prefill-backend", "linear_attn_prefill_backend")):
        value = getattr(server_args, attr, None)
        if value not in (None, "triton"):
            raise DDTreeConfigError(
                f"{FLAG_MODE} full on a hybrid target needs SGLang's Triton linear-attention kernels (their tree "
                f"path is the one DDTree's commit follows); got {flag} {value}. Use {flag} triton or {FLAG_MODE} "
                "shadow-linear."
            )
    # 0.5.14+ keeps the value as `mamba_radix_cache_strategy`: --mamba-scheduler-strategy is a deprecated alias
    # there (0.5.17) or gone (0.5.23), so the advice names the flag this base parses
    if hasattr(server_args, "mamba_radix_cache_strategy"):
        strategy, flag = server_args.mamba_radix_cache_strategy, "--mamba-radix-cache-strategy"
    else:
        strategy, flag = getattr(server_args, "mamba_scheduler_strategy", None), "--mamba-scheduler-strategy"
    if not getattr(server_args, "disable_radix_cache", False) and strategy != "extra_buffer":
        # SGLang refuses the others with speculative decoding today; a later release that lets one through
        # would cache recurrent states DDTree's commit does not track.
        raise DDTreeConfigError(
            f"{FLAG_MODE} full on a hybrid target with the radix cache tracks recurrent states only with "
            f"{flag} extra_buffer (got {strategy}): add it, or --disable-radix-cache."
        )
    if int(getattr(server_args, "tp_size", 1) or 1) != 1:
        raise DDTreeConfigError(
            f"{FLAG_MODE} full on a hybrid target runs on one GPU only (--tp-size 1) until a tensor-parallel "
            f"proof; use {FLAG_MODE} shadow-linear with --tp-size {server_args.tp_size}."
        )
    if is_auto(getattr(server_args, "speculative_ddtree_budget", None)):
        raise DDTreeConfigError(
            f"{FLAG_BUDGET} {BUDGET_AUTO} is not available on hybrid targets yet (its verify graphs of several "
            f"widths share the recurrent-state buffers); give a fixed {FLAG_BUDGET}."
        )


def is_auto(budget: Any) -> bool:
    """Whether a --speculative-ddtree-budget value is 'auto' (any case, surrounding spaces)."""
    return isinstance(budget, str) and budget.strip().lower() == BUDGET_AUTO


def configured_budget(server_args: Any, block_size: int | None = None) -> int:
    """The largest tree a step may verify: auto's maximum, the fixed budget, or the block's depth."""
    if is_auto(getattr(server_args, "speculative_ddtree_budget", None)):
        return int(getattr(server_args, "speculative_ddtree_budget_max", None) or DEFAULT_AUTO_MAX_BUDGET)
    budget = getattr(server_args, "speculative_ddtree_budget", None)
    if budget is None:
        if block_size is None:
            block_size = int(server_args.speculative_num_draft_tokens)
        return int(block_size) - 1
    return int(budget)


# Set while the DDTree worker captures the verify graphs of auto's smaller widths: the CUDA-graph runner
# asks `target_verify_width` for its width (spec_info patch), and gets this one instead of the largest.
_capture_width: int | None = None


def set_capture_width(width: int | None) -> None:
    global _capture_width
    _capture_width = None if width is None else int(width)


def target_verify_width(server_args: Any, block_size: int) -> int:
    """Tokens per request of the *target's* verify forward: ``1 + budget`` in full mode (every tree
    step verifies its whole node set; auto's maximum), else the DFLASH block. The target's verify CUDA
    graphs are captured at this width and the triton backend sizes its verify metadata by it (payload
    patches of spec_info.py and triton_backend.py); the draft worker always runs its block. While auto's
    smaller verify graphs are captured, their width (`set_capture_width`)."""
    if getattr(server_args, "speculative_ddtree_mode", "off") == "full":
        if _capture_width is not None:
            return _capture_width
        if getattr(server_args, "speculative_ddtree_budget", None) is not None:
            return 1 + configured_budget(server_args, block_size)
    return int(block_size)


def running_server_args() -> Any:
    """The running server's ServerArgs, or None when no server set them (tests, tools).

    0.5.13.post1: `server_args.get_global_server_args()`, a ValueError when unset. 0.5.23 retired that
    accessor (it raises RuntimeError, set or not) for `runtime_context.get_server_args()` (ValueError
    when unset)."""
    from sglang.srt.server_args import get_global_server_args

    try:
        return get_global_server_args()
    except ValueError:
        return None
    except RuntimeError:  # retired (0.5.23): the runtime context holds the operator's ServerArgs
        pass
    try:
        from sglang.srt.runtime_context import get_server_args
    except ImportError:
        return None
    try:
        return get_server_args()
    except (ValueError, RuntimeError):
        return None


def sampling_rule(server_args: Any = None) -> str:
    """The filter rule of plain sampling a verify must reproduce: the server's --sampling-backend
    (``ddtree_sampling.SAMPLING_RULES``); pytorch's for a backend without one of its own here (full
    mode refuses those at start)."""
    from sglang.srt.speculative.ddtree_sampling import SAMPLING_RULES

    if server_args is None:
        server_args = running_server_args()
        if server_args is None:  # no server (tests, tools): the torch sampler's rule
            return "pytorch"
    backend = getattr(server_args, "sampling_backend", None)
    return backend if backend in SAMPLING_RULES else "pytorch"


def check_verify_graph_buffers(backend: Any, max_bs: int, max_num_tokens: int) -> None:
    """Called by the triton backend before it allocates its CUDA-graph buffers (payload patch): in full
    mode they hold `max_bs * (1 + budget)` tokens, so the attention scratch and the KV indices over the
    context grow with the budget, outside SGLang's memory estimate. A start whose buffers do not fit in
    the free device memory is refused here, naming the flags that shrink them."""
    server_args = running_server_args()
    if server_args is None:  # no server (tests, tools): no graph buffers of a server to check
        return
    if getattr(server_args, "speculative_ddtree_mode", "off") != "full" or not str(backend.device).startswith("cuda"):
        return
    import torch
    from sglang.srt.speculative.ddtree_step_budget import verify_graph_buffer_bytes

    width = max_num_tokens // max(1, max_bs)
    need = verify_graph_buffer_bytes(
        max_bs, width, row_width=int(backend.req_to_token.shape[1]), context_len=int(backend.max_context_len),
        heads=int(backend.num_head), kv_splits=int(backend.max_kv_splits), v_head_dim=int(backend.v_head_dim),
    )
    free, _total = torch.cuda.mem_get_info(backend.device)
    if need > free:
        raise DDTreeConfigError(
            f"{FLAG_MODE} full refused: the target's verify CUDA graphs need {need / 2**30:.2f} GiB of static "
            f"buffers ({max_bs} requests x {width} tokens over a {backend.max_context_len}-token context), "
            f"{free / 2**30:.2f} GiB is free. Lower --cuda-graph-max-bs, {FLAG_BUDGET} or --context-length "
            "(or --mem-fraction-static)."
        )

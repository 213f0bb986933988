"""DDTree's tree step on hybrid (Gated DeltaNet) targets for SGLang 0.5.17's v2 DFLASH worker (installed as
`sglang/srt/speculative/ddtree_v2_hybrid.py` by the 0.5.17 payload; 0.5.17's own glue). Proven on dense Qwen3.5 and
Qwen3.5 MoE (H200) and Qwen3-Next (H100): trained pairs, production mix and limits on CUDA graphs, the deepest-node
fault caught; with the radix cache (`extra_buffer`, round 2 resuming cached states) on dense Qwen3.5 (H100):
bench/RESULTS.md, "Hybrid targets on the 0.5.17 v2 tree step" and "Payload 0.8.15 on a GPU". Served as v1's support
table says (`refusal`). bench/gpu/V2_WORKER.md §8 is the reading this follows (17: = 0.5.17's wheel).

What a tree verify on a GDN target needs on 0.5.17 beyond the dense tree step, each turned on only while a hybrid
DDTree worker runs in this process (`activate`, called by the worker's `__init__`, which the scheduler runs before
the target's pools, attention backends and CUDA graphs: 17:managers/scheduler.py:974-981):
1. tree mode: the linear-attention backend takes the tree path iff `self.topk > 1`
   (17:layers/attention/hybrid_linear_attn_backend.py:43, read at :195, :275, :525, :696); DFLASH forces topk 1. AFTER hook
   on `MambaAttnBackendBase.__init__`: a GDN target's backend (never the draft's) gets `topk = 2`, before any capture.
2. dense per-node conv windows: 0.5.17 stores the intermediate conv windows of a linear chain "deduplicated"
   (consecutive steps share K - 2 columns, an overlapping `as_strided` view) whenever
   `conv_window_dedup_enabled` says so, i.e. topk <= 1 (17:mem_cache/memory_pool.py:117-132, :724-770); a tree
   node's window is its ancestors', not its index neighbours', so the shared columns would be overwritten by
   siblings. AROUND hook: False (the dense `[.., W, dim, K - 1]` layout EAGLE's trees use).
3. the memory plan at `1 + budget`: `KVCacheConfigurator._handle_max_mamba_cache` plans the intermediate states
   for `get_spec().speculative_num_draft_tokens` (the DFLASH block) while the pool allocates
   `max_speculative_num_draft_tokens` (= 1 + budget, set by ddtree_args) (17:mem_cache/kv_cache_configurator.py:
   1816-1982 vs :794). AROUND hook: the plan runs with the spec bag's block read as `1 + budget` (the bag's own
   scoped override), so a large budget lowers the request count instead of failing the allocation.
4. a linear DFLASH step (a batch with a grammar request; upstream's step) in tree mode: its `DFlashVerifyInput` has
   no tree arrays. Eager, `_forward_metadata` reads them by attribute (AttributeError); replaying a graph of the
   same width (budget = block - 1), the captured tree arrays keep the previous step's tree. AROUND hooks on both:
   None arrays eager (the chain kernels, as upstream DFLASH), a chain written into the graph's arrays on replay.
   Upstream's own chain commit (`commit_len - 1`) is then right.

Per tree step (`HybridStepV2`): the tree's first-child / next-sibling arrays on the verify input (no conversion:
the kernels derive the parents from them, bench/gpu/HYBRID.md §0.3), and after the walk the commit of each
request's last committed node on its accepted path (`ddtree_hybrid.HybridTree.commit_steps`, the rule of
`ddtree_hybrid_state.commit_step`, on the device: no host read) through upstream's
`update_mamba_state_after_mtp_verify`, with the radix cache's recurrent-state tracking when the batch tracks
(`--mamba-scheduler-strategy extra_buffer`): the step crossing a multiple of the track interval keeps the state of the
node at that position on its accepted path (`track_offsets`, 0.5.23's rule on the post-verify lengths, mapped through
the path as v1's `ddtree_hybrid_state.track_step`). CPU-proven only: with the radix cache on, the step is served
under the unproven-hybrid test switch alone (`refusal`) until its GPU run.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.runtime_context import get_exec
from sglang.srt.speculative import ddtree_args as _args
from sglang.srt.speculative.ddtree_hybrid import HybridTree, hf_config_dict
from sglang.srt.speculative.ddtree_utils import DDTreeRefused, hybrid_kind, hybrid_support, proven_hybrids
from sglang.srt.speculative.ddtree_v2_seams import HookSwitch

logger = logging.getLogger(__name__)

GATED_DELTANET = "gated-deltanet"

TREE_MODE_TARGET = "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase.__init__"
DENSE_WINDOWS_TARGET = "sglang.srt.mem_cache.memory_pool.conv_window_dedup_enabled"
PLAN_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._handle_max_mamba_cache"
EAGER_TARGET = "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase._forward_metadata"
REPLAY_TARGET = "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase._replay_metadata"


class DDTreeV2HybridRefused(DDTreeRefused):
    """A hybrid target (or a setting) the v2 tree step does not serve."""


# ------------------------------------------------------------------------------------------------ refusal
def target_kind(model_config: Any) -> tuple[str | None, str | None]:
    """(recurrent layer type, architecture) of the target SGLang loaded: the layer type from SGLang's own runtime
    config (`hybrid_gdn_config`: Qwen3-Next, Qwen3.5 / 3.5-MoE, ...), the architecture from its checkpoint config
    (`ddtree_utils.hybrid_kind`, the support table's names)."""
    from sglang.srt.configs.hybrid_arch import hybrid_gdn_config

    layer = GATED_DELTANET if hybrid_gdn_config(model_config) is not None else None
    kind = hybrid_kind(hf_config_dict(SimpleNamespace(model_config=model_config)))
    return layer, None if kind is None else kind[1]


# (flag, field, allowed values): settings the hybrid tree step was read against; anything else is refused by name
_REQUIRED = (
    ("--linear-attn-verify-backend", "linear_attn_verify_backend", (None, "triton")),
    ("--enable-linear-replayssm", "enable_linear_replayssm", (None, False)),
    ("--enable-linear-replayssm-spec", "enable_linear_replayssm_spec", (None, False)),
    ("--enable-unified-memory", "enable_unified_memory", (None, False)),
    ("--enable-page-major-kv-layout", "enable_page_major_kv_layout", (None, False)),
)


_FULL = f"{_args.FLAG_MODE} full on SGLang 0.5.17's v2 worker"


def kind_refusal(kind: tuple[str | None, str | None], environ: Any = None) -> str | None:
    """Why this worker must not serve a hybrid of this (layer type, architecture), whatever the settings, or None
    (also promote's pre-check, units.BASE_MODE_PROBE, so it refuses with the server's words)."""
    layer, architecture = kind
    if layer != GATED_DELTANET:
        return (f"{_FULL} drives Gated DeltaNet layers only (SGLang's hybrid_gdn_config: Qwen3-Next, Qwen3.5); this "
                f"target's recurrent layers are another kind (Mamba-2, KDA, Lightning, ...). Use {_args.FLAG_MODE} "
                "shadow-linear.")
    status, why = hybrid_support(layer, architecture)
    if status != "proven" and not (status == "unproven" and _args.test_switch(_args.TEST_UNPROVEN_HYBRID, environ)):
        return (f"{_FULL} refused on {layer} / {architecture or 'an unknown architecture'}: {why} (this worker's "
                f"proofs cover {', '.join(proven_hybrids())}). Use {_args.FLAG_MODE} shadow-linear.")
    return None


def refusal(server_args: Any, kind: tuple[str | None, str | None] = (None, None), environ: Any = None) -> str | None:
    """Why the v2 tree step must not serve this hybrid target (the flag or switch named), or None."""
    refused = kind_refusal(kind, environ)
    if refused:
        return refused
    for flag, field, allowed in _REQUIRED:
        value = getattr(server_args, field, None)
        if value not in allowed:
            return f"{_FULL} on a hybrid target does not support {flag} (got {value!r}): drop it."
    try:
        _args.check_hybrid_full_mode(server_args)
    except _args.DDTreeConfigError as e:
        return str(e)
    return None


# ------------------------------------------------------------------------------------------------ hooks
@dataclasses.dataclass(frozen=True)
class HybridSettings:
    verify_width: int  # 1 + budget: the per-node states each request keeps, the tree graphs' width


def active() -> HybridSettings | None:
    return _switch.settings


def activate(settings: HybridSettings) -> None:
    """Install the hooks (once per process) and turn them on."""
    _switch.activate(settings)


def deactivate() -> None:
    _switch.deactivate()


def _tree_mode(result: Any, backend: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `MambaAttnBackendBase.__init__`: a GDN target's backend verifies trees (`topk > 1`)."""
    if (_switch.settings is not None and not getattr(backend, "is_draft_worker", False)
            and type(backend).__name__ in _args.HYBRID_TREE_BACKENDS):
        backend.topk = max(int(backend.topk or 0), 2)


def _dense_windows(original: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND `conv_window_dedup_enabled`: a tree needs one conv window per node."""
    return False if _switch.settings is not None else original(*args, **kwargs)


def _plan_at_tree_width(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `KVCacheConfigurator._handle_max_mamba_cache`: plan the per-node states at the width allocated."""
    settings = _switch.settings
    if settings is None or getattr(configurator, "is_draft_worker", False):
        return original(configurator, *args, **kwargs)
    from sglang.srt.mem_cache import kv_cache_configurator as kvc

    spec = kvc.get_spec()  # the module's binding: the bag the plan itself reads
    block = spec.speculative_num_draft_tokens
    if block is None or settings.verify_width <= int(block):
        return original(configurator, *args, **kwargs)
    with spec.override(speculative_num_draft_tokens=settings.verify_width):
        return original(configurator, *args, **kwargs)


def _eager_chain(original: Any, backend: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `_forward_metadata`: a verify input without tree arrays (upstream's linear step) verifies a chain."""
    spec = forward_batch.spec_info
    if (_switch.settings is not None and int(backend.topk or 0) > 1 and spec is not None
            and forward_batch.forward_mode.is_target_verify() and not hasattr(spec, "retrieve_next_token")):
        spec.retrieve_next_token = None
        spec.retrieve_next_sibling = None
    return original(backend, forward_batch, *args, **kwargs)


_REPLAY_SIGNATURE: inspect.Signature | None = None


def _replay_chain(original: Any, backend: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `_replay_metadata`: replaying a tree graph for a verify without tree arrays (upstream's linear step
    when the block equals 1 + budget), the captured arrays get a chain instead of the previous step's tree."""
    global _REPLAY_SIGNATURE
    metadata = original(backend, *args, **kwargs)
    if _switch.settings is None or int(backend.topk or 0) <= 1:
        return metadata
    if _REPLAY_SIGNATURE is None:
        _REPLAY_SIGNATURE = inspect.signature(original)
    call = _REPLAY_SIGNATURE.bind(backend, *args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    spec = a["spec_info"]
    if (a["in_capture"] or spec is None or not a["forward_mode"].is_target_verify()
            or getattr(spec, "retrieve_next_token", None) is not None):
        return metadata
    bs = int(a["bs"])
    next_token = backend.retrieve_next_token_list[bs - 1]
    chain = torch.arange(1, next_token.shape[1] + 1, device=next_token.device, dtype=next_token.dtype)
    chain[-1] = -1
    next_token.copy_(chain.expand(bs, -1))
    backend.retrieve_next_sibling_list[bs - 1].fill_(-1)
    return metadata


def _hooks() -> list[tuple[str, Any, Any]]:
    from sglang.srt.plugins.hook_registry import HookType

    return [
        (TREE_MODE_TARGET, _tree_mode, HookType.AFTER),
        (DENSE_WINDOWS_TARGET, _dense_windows, HookType.AROUND),
        (PLAN_TARGET, _plan_at_tree_width, HookType.AROUND),
        (EAGER_TARGET, _eager_chain, HookType.AROUND),
        (REPLAY_TARGET, _replay_chain, HookType.AROUND),
    ]


_switch = HookSwitch(_hooks, "hybrid hooks")


def install() -> None:
    """Install the hybrid hooks (once per process); a hook that did not take refuses the start."""
    _switch.install()


# ------------------------------------------------------------------------------------------------ per step
def track_offsets(prefix_lens: torch.Tensor, commit_lens: torch.Tensor, interval: int) -> torch.Tensor:
    """Per request, the offset along this step's committed path whose state the radix cache keeps, -1 for none: a step
    that crosses a multiple `T` of `interval` keeps the state after `T` tokens, path offset `T - prefix - 1`, when that
    offset was committed (0.5.23's rule on the post-verify lengths, 23:speculative/dflash_worker_v2.py:2106-2117;
    0.5.17's own compares the pre-verify length with itself and tracks nothing)."""
    before = prefix_lens.to(torch.int64)
    lens = commit_lens.to(torch.int64)
    after = before + lens
    offset = (after // interval * interval - before - 1).clamp(min=0)
    keep = (before // interval != after // interval) & (offset < lens)
    return torch.where(keep, offset, torch.full_like(offset, -1))


@dataclasses.dataclass
class _Walk:
    """What `HybridTree.commit_steps` reads of a verified step."""

    accepted_nodes: torch.Tensor  # [bs, depth + 1], root first, -1 past the path
    tree: Any


class HybridStepV2:
    """A hybrid target's recurrent layers in the v2 tree step: the hooks on from `__init__`, checked once the
    target's backends exist (`start`), then per step the tree arrays and the state commit."""

    def __init__(self, verify_width: int) -> None:
        self.settings = HybridSettings(verify_width=int(verify_width))
        self.state: HybridTree | None = None
        activate(self.settings)

    def start(self, model_runner: Any, tp_rank: int = 0) -> None:
        """After the target's pools and attention backends are built (before its graphs): the hooks took there."""
        linear = getattr(model_runner.attn_backend, "linear_attn_backend", None)
        name = type(linear).__name__
        if name not in _args.HYBRID_TREE_BACKENDS or int(getattr(linear, "topk", 0) or 0) < 2:
            raise DDTreeV2HybridRefused(
                f"DDTree full (v2, hybrid) refused: the target's linear-attention backend {name} does not verify "
                "trees (the tree-mode hook did not reach it).")
        cache = model_runner.req_to_token_pool.mamba_pool.mamba_cache
        windows = getattr(cache, "intermediate_conv_window", None) or []
        if not windows or not all(w.is_contiguous() for w in windows):
            raise DDTreeV2HybridRefused(
                "DDTree full (v2, hybrid) refused: the mamba pool keeps its per-node conv windows deduplicated "
                "(a linear chain's layout), which a tree overwrites (the dense-window hook did not reach it).")
        self.state = HybridTree(model_runner, self.settings.verify_width - 1)  # width >= 1 + budget, memory
        self.state.log_start(tp_rank)

    @staticmethod
    def attach_tree(verify_input: Any, tree: Any) -> None:
        """The tree for the linear layers' tree path: DDTree's own arrays, `[bs, 1 + budget]`."""
        verify_input.retrieve_next_token = tree.retrive_next_token
        verify_input.retrieve_next_sibling = tree.retrive_next_sibling

    def commit_steps(self, tree: Any, accepted_nodes: torch.Tensor, commit_lens: torch.Tensor,
                     track: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per request, the verify-block index of the node whose state is committed, the last committed node on the
        accepted path `accepted_nodes[b, commit_lens[b] - 1]` (DFLASH's chain offset mapped through the path), and of
        the node whose state is tracked (`track`: offsets along the path, `track_offsets`; -1 stays none). The test
        fault `SGLANG_DDTREE_TEST_MAMBA_COMMIT` swaps them."""
        if self.state is None:
            raise RuntimeError("HybridStepV2.start was not called")
        return self.state.commit_steps(_Walk(accepted_nodes, tree), commit_lens.to(torch.int64) - 1, track)

    def commit(self, worker: Any, batch: Any, tree: Any, accepted_nodes: torch.Tensor, commit_lens: torch.Tensor,
               prefix_lens: torch.Tensor) -> None:
        """Commit the accepted path's states into the pool (upstream's fused scatter; the pool slots come from the
        verify's own metadata), and where the batch tracks states for the radix cache, the state at each crossed
        multiple of the track interval into the request's track slot."""
        track_slots = getattr(batch, "mamba_track_indices", None)
        offsets = None if track_slots is None else track_offsets(
            prefix_lens, commit_lens, int(get_exec().mamba.mamba_track_interval))
        steps, track = self.commit_steps(tree, accepted_nodes, commit_lens, offsets)
        runner = worker.target_worker.model_runner
        runner.attn_backend.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=steps, mamba_track_indices=None if track is None else track_slots,
            mamba_steps_to_track=track, model=runner.model,
            req_pool_indices=batch.req_pool_indices[: steps.shape[0]],
        )

    def as_dict(self) -> dict[str, Any]:
        return {} if self.state is None else self.state.as_dict()

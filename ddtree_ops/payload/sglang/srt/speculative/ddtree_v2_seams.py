"""The three seams a DDTree tree step needs in SGLang's v2 DFLASH worker (0.5.17, 0.5.23), through SGLang's own
plugin hooks (installed as `sglang/srt/speculative/ddtree_v2_seams.py` by the payload of each v2 base; shared).

A tree step verifies `1 + budget` tokens per request where DFLASH verifies its block, with a tree mask where
DFLASH's verify is causal. Upstream sizes everything for the block; the seams change exactly that, and only
while a DDTree full-mode worker runs in this process:
1. verify width: `SpeculativeAlgorithm.get_num_tokens_per_req_for_target_verify` answers `1 + budget` for
   the target (auto: the largest width; while auto's narrower verify graphs are captured, their width,
   `set_capture_width`). It is a method, so every reader (`resolve_num_tokens_per_req`,
   `ModelRunner.decode_num_tokens_per_req`, the CUDA-graph runner's capture width and `can_run`, 0.5.23's triton
   default) reaches the hook through the class; nothing imports it by name. The draft runner keeps its block.
2. verify mask in graphs: `dflash_utils.resolve_dflash_verify_mask_policy` says "build the custom mask", or
   the triton verify graphs are captured without one and a tree replay would attend causally (wrong tokens).
   The graph runner imports it inside the call, so the module attribute is the one it reads. And the triton
   backend's `VerifyMask` buffer, sized at `init_cuda_graph_state` for `n = speculative_num_draft_tokens`
   (the block; `n * (seq_len + n)` cells per request), is re-made for `n = 1 + budget` after that method.
3. reservation: `DDTreeDraftInputV2.prepare_for_decode` first reserves `committed + block + (1 + budget)` per
   request (the step in flight may accept up to a block before the host's committed length catches up, and
   the next step writes `1 + budget` nodes), then runs upstream's method, which then finds its own
   `committed + 2 * block` already held and only does its bookkeeping.

Nothing changes until `activate(settings)`: 0.5.17's `DDTreeWorkerV2` calls it in `__init__`, which the scheduler runs
before the pools, the attention backends and the CUDA graphs are built (17:managers/scheduler.py:924, 974-981),
so every width read comes after it. Parsing and shadow-linear never import this module.
"""

from __future__ import annotations

import dataclasses
import pkgutil
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.speculative import ddtree_args as _shared
from sglang.srt.speculative import dflash_info_v2 as _info

WIDTH_TARGET = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.get_num_tokens_per_req_for_target_verify"
MASK_POLICY_TARGET = "sglang.srt.speculative.dflash_utils.resolve_dflash_verify_mask_policy"
MASK_BUFFER_TARGET = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.init_cuda_graph_state"


class SeamsNotInstalled(RuntimeError):
    """A hook did not take (SGLang's registry only logs a target it cannot resolve)."""


@dataclasses.dataclass(frozen=True)
class SeamSettings:
    """What the seams need of a full-mode DDTree worker."""

    block_size: int  # DFLASH's block (speculative_num_draft_tokens): what the draft runs and may accept
    verify_width: int  # 1 + budget (auto: its largest): what the target verifies per request

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.verify_width < 2:
            raise ValueError(f"DDTree seams need block >= 1 and width >= 2, got {self}")

    @property
    def reserve(self) -> int:
        """Tokens past the committed length a request must hold before a step: the step in flight may
        accept up to a block (the host's committed length lags it under overlap), the next writes the tree."""
        return self.block_size + self.verify_width


def settings_for(server_args: Any) -> SeamSettings | None:
    """The seams' settings for validated server args; None unless `--speculative-ddtree-mode full`."""
    if getattr(server_args, "speculative_ddtree_mode", "off") != "full":
        return None
    block = int(server_args.speculative_num_draft_tokens)
    return SeamSettings(block_size=block, verify_width=1 + _shared.configured_budget(server_args, block))


class HookSwitch:
    """Hooks installed once per process (`install_hooks`) and inert until `activate(settings)`: each hook reads
    `settings`, and None makes it answer upstream's answer (the hooks stay installed)."""

    def __init__(self, hooks: Callable[[], list[tuple[str, Callable[..., Any], Any]]], what: str) -> None:
        self._hooks, self._what = hooks, what
        self._installed = False
        self.settings: Any = None

    def install(self) -> None:
        if not self._installed:
            install_hooks(self._hooks(), self._what)
            self._installed = True

    def activate(self, settings: Any) -> None:
        self.install()
        self.settings = settings

    def deactivate(self) -> None:
        self.settings = None


def active() -> SeamSettings | None:
    return _switch.settings


def activate(settings: SeamSettings) -> None:
    """Install the hooks (once per process) and turn the seams on with `settings`."""
    _switch.activate(settings)


def deactivate() -> None:
    """Seams off: every hook answers upstream's answer again (they stay installed)."""
    _switch.deactivate()


# --- 1. verify width --------------------------------------------------------------------------------------


# Set while the tree step captures auto's narrower verify graphs (`ddtree_verify_graphs.capture_verify_ladder`):
# the target's width then answers this width, so the graph runner made meanwhile captures at it. The seams own the
# target's width on v2 (v1's is `ddtree_args.target_verify_width`, which no v2 reader asks).
_capture_width: int | None = None


def set_capture_width(width: int | None) -> None:
    """The target's verify width while auto's narrower graph sets are captured (None: the seams' own again)."""
    global _capture_width
    _capture_width = None if width is None else int(width)


def _target_verify_width(original: Callable[..., int], algo: Any, num_draft_tokens: int,
                         is_draft_worker: bool) -> int:
    width = original(algo, num_draft_tokens, is_draft_worker)
    settings = _switch.settings
    if settings is None or is_draft_worker or not algo.is_dflash():
        return width  # the draft runner runs (and captures) its block
    return settings.verify_width if _capture_width is None else _capture_width


# --- 2. verify mask in graphs ------------------------------------------------------------------------------


def _mask_policy(original: Callable[[Any], tuple[str, bool]], attn_backend: Any) -> tuple[str, bool]:
    name, build_custom_mask = original(attn_backend)
    if _switch.settings is None:
        return name, build_custom_mask
    return name, True  # a tree is not causal on any backend; the caller still leaves the draft runner's off


def _widen_verify_mask(result: Any, backend: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `TritonAttnBackend.init_cuda_graph_state`: re-make the target's `VerifyMask` for the tree width.

    The mask of a verify is `n * (seq_len + n)` cells per request (`_update_target_verify_buffers`'
    `mask_indptr`), with `n` the step's `draft_token_num`; upstream allocates `max_bs * n * (max_context_len
    + n)` for `n` = the block, which a `1 + budget` tree overruns. The struct is frozen and nothing holds
    the old one yet (graphs are captured after this method), so it is swapped whole, as verify_mask.py asks.
    `backend.num_draft_tokens` stays the block: DFLASH's verify input always carries its own
    `draft_token_num`, so that attribute is only the fallback width (and draft-extend's, not used here)."""
    settings = _switch.settings
    mask = getattr(backend, "_verify_mask", None)
    if settings is None or mask is None or backend.is_draft_runner:
        return None
    if settings.verify_width <= int(backend.num_draft_tokens):
        return None
    from sglang.srt.layers.attention.verify_mask import maybe_create_verify_mask

    backend._verify_mask = None  # let the block-sized buffer go before the wider one is allocated
    backend._verify_mask = maybe_create_verify_mask(
        is_draft_runner=False, skip_prefill=backend.skip_prefill, max_bs=mask.max_bs,
        max_context_len=backend.max_context_len, num_draft_tokens=settings.verify_width,
        device=mask.buffer.device, is_read=mask.is_read, dtype=mask.buffer.dtype,
    )
    return None


# --- 3. reservation -----------------------------------------------------------------------------------------


def _committed_len(req: Any) -> int:
    kv = req.kv
    return int(kv.kv_committed_len if hasattr(kv, "kv_committed_len") else req.kv_committed_len)  # 0.5.23 : 0.5.17


def reserve_lens(batch: Any, reserve: int) -> tuple[list[int], list[int], int]:
    """Per request (held, to hold) and the tokens to allocate so each holds `committed + reserve`; rounded
    to pages as the base does it (0.5.23's `page_aligned_decode_alloc_lens`; 0.5.17 does not round)."""
    page_size = int(batch.token_to_kv_pool_allocator.page_size)
    aligned = getattr(_info, "page_aligned_decode_alloc_lens", None)
    if aligned is not None:
        return aligned(batch.reqs, reserve=reserve, page_size=page_size)
    cur = [int(r.kv.kv_allocated_len) for r in batch.reqs]
    nxt = [max(c, _committed_len(r) + reserve) for c, r in zip(cur, batch.reqs, strict=True)]
    return cur, nxt, sum(n - c for c, n in zip(cur, nxt, strict=True))


class DDTreeDraftInputV2(_info.DFlashDraftInputV2):
    """DFLASH's v2 draft input with the tree step's reservation; all else is upstream's.

    The worker returns it where DFLASH returns its own (`from_dflash`); the scheduler's `prepare_for_decode`
    reaches it through `batch.spec_info` (17:speculative/spec_utils.py:1038)."""

    @classmethod
    def from_dflash(cls, draft_input: _info.DFlashDraftInputV2) -> DDTreeDraftInputV2:
        fields = {f.name: getattr(draft_input, f.name) for f in dataclasses.fields(draft_input) if f.init}
        return cls(**fields)

    def prepare_for_decode(self, batch: Any) -> None:
        settings = _switch.settings
        if settings is not None and batch.batch_size() > 0:
            self._reserve_tree(batch, settings.reserve)
        super().prepare_for_decode(batch)

    @staticmethod
    def _reserve_tree(batch: Any, reserve: int) -> None:
        """Hold `committed + reserve` per request with upstream's own allocator call, on the current stream
        (upstream's optional plan stream waits for this one before its own call). Upstream's method then
        sees these lengths as already allocated and records them as the reservation."""
        cur, nxt, needed = reserve_lens(batch, reserve)
        if needed <= 0:
            return
        cur_cpu = torch.tensor(cur, dtype=torch.int32)
        nxt_cpu = torch.tensor(nxt, dtype=torch.int32)
        _info.alloc_for_spec_decode(
            batch.tree_cache, batch.req_to_token_pool, reqs=batch.reqs, req_pool_indices=batch.req_pool_indices,
            cur_kv_lens=cur_cpu.to(batch.device), cur_kv_lens_cpu=cur_cpu,
            nxt_kv_lens=nxt_cpu.to(batch.device), nxt_kv_lens_cpu=nxt_cpu,
            num_needed_tokens=needed, batch=batch,
        )


# --- registration ---------------------------------------------------------------------------------------------

def _hooks() -> list[tuple[str, Callable[..., Any], Any]]:
    from sglang.srt.plugins.hook_registry import HookType

    return [
        (WIDTH_TARGET, _target_verify_width, HookType.AROUND),
        (MASK_POLICY_TARGET, _mask_policy, HookType.AROUND),
        (MASK_BUFFER_TARGET, _widen_verify_mask, HookType.AFTER),
    ]


def hook_took(target: str, hook: Callable[..., Any]) -> bool:
    """Whether `target` now runs `hook`: the registry's wrappers keep the hook in their closure and the
    wrapped function in `__wrapped__`."""
    fn: Any = pkgutil.resolve_name(target)
    while fn is not None:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False


def install_hooks(hooks: list[tuple[str, Callable[..., Any], Any]], what: str) -> None:
    """Register `hooks` (target, hook, kind) with SGLang's `HookRegistry`, apply them, and refuse the start
    (`SeamsNotInstalled`, naming `what`) if one did not take.

    `apply_hooks` may run after the targets' modules are imported: it sets the new attribute on the class
    or module and rewrites stale `from X import name` bindings in loaded modules; it skips targets already
    patched, so plugins' earlier hooks are left as they are. A target it cannot resolve is only logged
    there, so each hook is checked here."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, kind)
    HookRegistry.apply_hooks()
    missing = [target for target, hook, _ in hooks if not hook_took(target, hook)]
    if missing:
        raise SeamsNotInstalled(f"DDTree v2 {what} did not take on {', '.join(missing)}: "
                                "this SGLang's names differ from what the payload was written against")


_switch = HookSwitch(_hooks, "seams")


def install() -> None:
    """Install the three seams' hooks (once per process)."""
    _switch.install()

"""DDTree server flags on the SGLang bases with the v2 DFLASH worker (0.5.17, 0.5.23): glue only (installed as
`sglang/srt/speculative/ddtree_v2_args.py` by the ddtree-ops payload of each v2 base; one copy, shared).

The flags' meaning, help and checks live in the shared `ddtree_args.py`, as on every base. What differs
is how each base takes them:
- fields: each base's one patch declares the six `speculative_ddtree_*` fields where that base keeps its
  server arguments (0.5.17: the `ServerArgs` dataclass in `server_args.py`; 0.5.23: the `Spec` namespace in
  `arg_groups/fields/spec.py`); `arg(field)` gives each its CLI metadata, read from the shared
  `add_ddtree_cli_args`, so the flags' help is written once;
- validation on 0.5.17: `ServerArgs.__post_init__` resolves by plain assignment until it materializes the
  record, so the patch calls `refuse_unavailable` before the dummy-model return and `check_post_init` right
  after `handle_speculative_decoding` (DFLASH's block size is resolved by then);
- validation on 0.5.23: `ServerArgs` is a sealed msgspec record resolved by `resolve_once`; a step writes
  through `declare_resolution`, never by assignment. `register()` (called by the patch) wraps two resolution
  steps through SGLang's own plugin route (`resolution_hooks.register_resolution_hook`):
  `handle_hardware_runtime_validation` (before the dummy-model return) refuses full mode, and
  `handle_speculative_decoding` (after DFLASH's block size is resolved) runs the shared
  `handle_ddtree_server_args` on a view that reads the values in effect and declares its normalised values.

Full mode (the shared `ddtree_v2_step.py` behind each base's own adapter `ddtree_worker_v2.py`) is served on the
bases whose tree step passed its GPU proof (`PROVEN_TREE_BASES`: 0.5.17, on the H200: bench/RESULTS.md). 0.5.23's
(which our GPU carry cannot run) is proven on the CPU only, so there it is served only under the proof switch
`SGLANG_DDTREE_TEST_V2_TREE=1` (with `SGLANG_DDTREE_ALLOW_TEST_SWITCHES=1`, like every test switch). Shadow-linear
and off are accepted on every v2 base.

Worker selection (0.5.17 and 0.5.23, every server): importing this module registers, without applying, an AROUND
hook on `SpeculativeAlgorithm.create_worker` with SGLang's `HookRegistry`; `load_plugins()` applies it in every
process (17:managers/scheduler.py:4895, 23:managers/scheduler.py:6323 in each scheduler, which is spawned and never
re-runs `__post_init__`, so a hook installed by `check_post_init` in the parent would not reach it). This module is
imported by the base's patched server-args file, which every process imports before it calls `load_plugins()`.
The hook returns, for DFLASH, `DDTreeShadowWorkerV2` in shadow-linear (upstream's steps, counted:
ddtree_v2_shadow) and `DDTreeWorkerV2` in full mode where it is served; anything else keeps upstream's worker.
With it, an AFTER hook on `Scheduler.get_internal_state` adds either worker's report as `ddtree` (what v1's
scheduler patch adds; `/server_info` → `internal_states[0].ddtree`, read by promote's gates); any other draft
worker, or none, adds nothing.

Row headroom (0.5.17 and 0.5.23, every DFLASH server, no switch): an AROUND hook on the `req_to_token` row's headroom, registered
the same way, so that a row holds a decode step's whole reservation (the section below says why).
Penalties (0.5.17 and 0.5.23, every DFLASH server, no switch): two hooks, registered the same way, make upstream's
linear verify apply them as plain decoding does (`ddtree_v2_penalties`).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from sglang.srt.speculative import ddtree_args as _shared

FIELDS = _shared.FIELDS
SOURCE = "ddtree_v2_args"


@functools.lru_cache(maxsize=1)
def _cli_actions() -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    _shared.add_ddtree_cli_args(parser)
    return {a.dest: a for a in parser._actions if a.dest in FIELDS}


def arg(field: str) -> Any:
    """The `Arg` of a DDTree field (0.5.17's `ServerArgs`, 0.5.23's `Spec`), from the shared CLI definition."""
    from sglang.srt.arg_groups.arg_utils import Arg

    action = _cli_actions()[field]
    if action.nargs == 0:  # store_true: arg_utils makes a bool field one by itself
        return Arg(help=action.help)
    return Arg(help=action.help, type_parser=action.type)


class DDTreeV2NotAvailable(_shared.DDTreeConfigError):
    """A DDTree mode this base cannot serve yet."""


def base_version() -> str:
    """The running SGLang's version (the base this glue was installed for)."""
    from sglang.version import __version__

    return __version__


# The bases whose v2 worker has a tree step (their payload ships `ddtree_worker_v2.py`).
TREE_STEP_BASES = ("0.5.17", "0.5.23")
# Of those, the ones whose tree step passed its GPU proof (the production mix, the limits, penalties, samples,
# liveness, retraction and hybrids on CUDA graphs, H200): full mode is served there without a switch.
PROVEN_TREE_BASES = ("0.5.17",)
# The bases whose DFLASH worker the payload picks by mode (ddtree_v2_shadow; the tree step where `tree_step_on`).
WORKER_BASES = ("0.5.17", "0.5.23")
# The bases whose `req_to_token` rows are too short for the v2 DFLASH reservation at page size 1 (below).
ROW_HEADROOM_BASES = ("0.5.17", "0.5.23")
ROW_HEADROOM_TARGET = "sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len"
# The bases whose own v2 DFLASH tracks no recurrent state for the radix cache on a hybrid target even with this
# payload's hooks, so a request resuming from a cached state would resume from a stale one: shadow-linear (upstream's
# steps, counted) is refused there unless --disable-radix-cache. None now: 0.5.17's two gaps (a wrong first token on
# the H100 and H200) are closed by `register_mamba_track` (payload 0.8.14; the radix-cache run passed on an H100 with
# 0.8.15, bench/RESULTS.md). A host still on payload 0.8.12-0.8.14 refuses by its own glue, which promote asks.
UNTRACKED_HYBRID_RADIX_BASES: tuple[str, ...] = ()
# The bases whose linear DFLASH verify drops the penalties (ddtree_v2_penalties).
LINEAR_PENALTY_BASES = ("0.5.17", "0.5.23")
# The bases whose min_new_tokens penalizer also holds back a request's own (the model's) eos ids
# (23:sampling/penaltylib/min_new_tokens.py:39; 0.5.17's, like 0.5.13.post1's, only the tokenizer's and the stop ids).
REQ_EOS_STOP_BASES = ("0.5.23",)
PREPARE_VERIFY_TARGET = "sglang.srt.speculative.dflash_info.DFlashVerifyInput.prepare_for_verify"
ADJUSTMENTS_TARGET = "sglang.srt.speculative.dflash_utils.apply_dflash_verify_logits_adjustments"
# The bases whose greedy verify may skip the adjustments on a vocab-sharded target (ddtree_v2_penalties).
SKIP_LOGITS_BASES = ("0.5.23",)
SKIP_LOGITS_TARGET = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._can_skip_verify_logits"
CREATE_WORKER_TARGET = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker"
INTERNAL_STATE_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"


def tree_step_on(environ: Any = None) -> bool:
    """Whether this process may serve full mode: a proven base, or a base with a tree step and the proof switch."""
    version = base_version()
    return version in PROVEN_TREE_BASES or (
        _shared.test_switch(_shared.TEST_V2_TREE, environ) and version in TREE_STEP_BASES)


def refuse_unavailable(mode: Any) -> None:
    if str(mode or "off").strip().lower() == "full":
        if base_version() in PROVEN_TREE_BASES:
            return
        if tree_step_on():
            if not _shared.test_switch(_shared.ALLOW_TEST_SWITCHES):
                # checked here too: 0.5.17 calls this before its dummy-model return, which skips check_post_init
                raise _shared.DDTreeConfigError(
                    f"{_shared.TEST_V2_TREE}=1 is a test switch (full mode on the v2 worker, not yet proven on a "
                    f"GPU), refused on a server; a test that means it sets {_shared.ALLOW_TEST_SWITCHES}=1."
                )
            return
        version = base_version()
        why = ("has not run on a GPU (our GPU carry's torch cannot run this SGLang; served only to its proof)"
               if version in TREE_STEP_BASES
               else "is not written, so nothing here could verify a tree")
        raise DDTreeV2NotAvailable(
            f"{_shared.FLAG_MODE} full is not available yet on SGLang {version}: the v2 DFLASH worker's tree "
            f"verify step {why} (ddtree-ops issue 26). Use {_shared.FLAG_MODE} shadow-linear or off."
        )


def shadow_refusal(server_args: Any, config: dict | None = None) -> str | None:
    """Why shadow-linear, which serves upstream's own DFLASH steps, must not serve this target here, or None. The
    target's `config` (default: a local --model-path's config.json, read at argument parsing; the shadow worker
    passes the one SGLang loaded, so a hub id is checked at start)."""
    if str(getattr(server_args, "speculative_ddtree_mode", None) or "off").strip().lower() != "shadow-linear":
        return None
    version = base_version()
    if version not in UNTRACKED_HYBRID_RADIX_BASES or getattr(server_args, "disable_radix_cache", False):
        return None
    if config is None:
        config = _shared._local_model_config(server_args)
    if not config:
        return None
    from sglang.srt.speculative.ddtree_utils import is_hybrid_model

    hybrid, reason = is_hybrid_model(config)
    if not hybrid:
        return None
    return (
        f"{_shared.FLAG_MODE} shadow-linear serves SGLang {version}'s own DFLASH steps, and on a hybrid target "
        f"({reason}) with the radix cache those track no recurrent state: a request resuming from a cached prefix "
        "resumes from a stale state and its tokens are wrong (seen on 0.5.17 before payload 0.8.14, ddtree-ops "
        "bench/RESULTS.md). Add --disable-radix-cache."
    )


def _check(server_args: Any) -> None:
    """The checks both bases run once DFLASH's block size is resolved."""
    _shared.handle_ddtree_server_args(server_args)
    refusal = shadow_refusal(server_args)
    if refusal:
        raise _shared.DDTreeConfigError(refusal)


def check_post_init(server_args: Any) -> None:
    """0.5.17: check the DDTree fields inside `ServerArgs.__post_init__`, where resolution still assigns."""
    refuse_unavailable(server_args.speculative_ddtree_mode)
    _check(server_args)


class _InEffect:
    """What the shared checks read and write: reads give the value in effect (the last declaration, else
    the raw input); writes are collected for `declare_resolution`."""

    def __init__(self, server_args: Any) -> None:
        object.__setattr__(self, "_server_args", server_args)
        object.__setattr__(self, "_writes", {})

    def __getattr__(self, name: str) -> Any:
        writes = object.__getattribute__(self, "_writes")
        if name in writes:
            return writes[name]
        from sglang.srt.arg_groups.overrides import resolution_result

        return resolution_result(object.__getattribute__(self, "_server_args"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__getattribute__(self, "_writes")[name] = value


def validate(server_args: Any) -> dict[str, Any]:
    """0.5.23: check the DDTree fields of a ServerArgs being resolved and declare their normalised values;
    returns what was declared. Raises `DDTreeConfigError` (a ValueError) naming the flag."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolution_result

    view = _InEffect(server_args)
    refuse_unavailable(view.speculative_ddtree_mode)
    _check(view)
    writes = dict(object.__getattribute__(view, "_writes"))
    # Not a field on 0.5.23: it is derived from the algorithm (23:arg_groups/overrides.py:1928-1960), so the shared
    # check's full-mode raise to `1 + budget` cannot be declared. The tree step's verify width reaches the target
    # through the seams (ddtree_v2_seams, activated by the worker); the `req_to_token` row width, which 0.5.17
    # widens through this value, is sized on 0.5.23 by the row-headroom hook below, from the `spec` bag's mode.
    writes.pop("max_speculative_num_draft_tokens", None)
    changed = {k: v for k, v in writes.items() if resolution_result(server_args, k) != v}
    if changed:
        declare_resolution(server_args, SOURCE, **changed)
    return changed


def _early(server_args: Any, previous: Any) -> None:
    previous(server_args)
    from sglang.srt.arg_groups.overrides import resolution_result

    refuse_unavailable(resolution_result(server_args, "speculative_ddtree_mode"))


def _after_speculative(server_args: Any, previous: Any) -> None:
    previous(server_args)
    validate(server_args)


_registered = False


def register() -> None:
    """0.5.23: wrap the two resolution steps (once per process)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook("handle_hardware_runtime_validation")(_early)
    register_resolution_hook("handle_speculative_decoding")(_after_speculative)
    _registered = True


# --- worker selection (shadow-linear on every v2 base; full where it is served) ---------------------------------


def _create_worker(original: Any, algo: Any, server_args: Any) -> Any:
    """AROUND `SpeculativeAlgorithm.create_worker`: DFLASH in shadow-linear gets the counting shadow worker
    (ddtree_v2_shadow), in full mode (where `tree_step_on`) the tree worker; anything else upstream's."""
    worker = original(algo, server_args)
    mode = getattr(server_args, "speculative_ddtree_mode", "off")
    if algo.is_dflash() and mode == "shadow-linear":
        from sglang.srt.speculative.ddtree_v2_shadow import DDTreeShadowWorkerV2

        return DDTreeShadowWorkerV2
    if algo.is_dflash() and mode == "full" and tree_step_on():
        from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2

        return DDTreeWorkerV2
    return worker


def _internal_state(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `Scheduler.get_internal_state`: the tree worker's `ddtree_internal_state()` as `ddtree` in the
    answer's `internal_state` (builtins already: string keys, numbers, None); inert for any other draft worker.
    Looked up on the worker's class: upstream's v2 DFLASH worker hands unknown instance attributes to its target
    worker (`DFlashWorkerV2.__getattr__`)."""
    worker = getattr(scheduler, "draft_worker", None)
    report = getattr(type(worker), "ddtree_internal_state", None)
    state = getattr(result, "internal_state", None)
    if callable(report) and isinstance(state, dict):
        state["ddtree"] = report(worker)
    return None  # the same answer, now with `ddtree`


# --- req_to_token row headroom (0.5.17 and 0.5.23, every DFLASH server) -----------------------------------------
# Each decode step of the v2 worker holds `committed + 2 * block` slots per request in its `req_to_token` row
# (17:speculative/dflash_info_v2.py:154, 23:speculative/dflash_info_v2.py:147; the tree worker `committed + block
# + 1 + budget`, ddtree_v2_seams), but at page size 1 the row is `context + 4 + max_speculative_num_draft_tokens`
# long (17:mem_cache/allocation_sizing.py:46-62, 23:mem_cache/allocation_sizing.py:96-116). Near the context
# limit the reservation runs past the row's end: the triton kernel that writes it (`assign_req_to_token_pool`,
# 17:mem_cache/allocation.py:597) bounds nothing, so the slots land in the next request's row, and the release
# slices the row and never frees them. The idle pool check then kills the server (`pool memory leak detected!`,
# H200 2026-12-05: 2 slots for each request that finished 8 short of the limit, on upstream's DFLASH and the tree
# worker alike), and a neighbour's first positions point at slots nobody wrote. Upstream sizes the row for the
# reservation only when pages are larger (0.5.23: and for UNO).


def decode_reservation(spec: Any) -> int:
    """Slots past the committed length one v2 decode step holds per request: upstream's `2 * block`, or the
    tree worker's seam reservation (`block + 1 + budget`, auto's largest) where that is more. `spec`: server
    args (0.5.17) or the published `spec` bag (0.5.23), which carries the same field names."""
    block = int(spec.speculative_num_draft_tokens or 0)
    need = 2 * block
    if getattr(spec, "speculative_ddtree_mode", "off") == "full":
        # only a full server imports the seams (they import the worker's modules)
        from sglang.srt.speculative import ddtree_v2_seams as _seams

        need = max(need, _seams.settings_for(spec).reserve)
    return need


def _row_headroom(original: Any, *args: Any, **kwargs: Any) -> int:
    """AROUND `get_req_to_token_extra_context_len`: a DFLASH server's rows hold its whole reservation (plus
    upstream's 4, and a page's rounding). 0.5.17 passes the server args; 0.5.23 takes nothing and reads the
    published bags, so this reads the same bags through the same module upstream's body does."""
    extra = original(*args, **kwargs)
    if args or kwargs:
        spec = args[0] if args else kwargs["server_args"]
        page = int(getattr(spec, "page_size", 1) or 1)
    else:
        from sglang.srt.mem_cache import allocation_sizing as _sizing

        spec, page = _sizing.get_spec(), _sizing.get_alloc_page_size()
    if str(getattr(spec, "speculative_algorithm", None) or "").upper() != "DFLASH":
        return extra
    return max(extra, 4 + decode_reservation(spec) + page - 1)


_row_headroom_registered = False


def register_row_headroom() -> bool:
    """Register (not apply) the row-headroom hook once per process on the bases that need it; whether it is.
    Every process imports this module (the patched `server_args.py` does) before `load_plugins()`, which the
    scheduler runs before it builds its pools (17:managers/scheduler.py:4895)."""
    global _row_headroom_registered
    if not _row_headroom_registered and base_version() in ROW_HEADROOM_BASES:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(ROW_HEADROOM_TARGET, _row_headroom, HookType.AROUND)
        _row_headroom_registered = True
    return _row_headroom_registered


# --- penalties in upstream's linear verify (0.5.17 and 0.5.23, every DFLASH server) ---------------------------
# Upstream's v2 verify drops every penalty but the logit bias; ddtree_v2_penalties says why and how the hooks
# below make them plain's. The hooks import it only when a verify runs (it imports torch).


def _before_prepare_for_verify(*args: Any, **kwargs: Any) -> None:
    from sglang.srt.speculative import ddtree_v2_penalties as _penalties

    return _penalties.before_prepare_for_verify(*args, **kwargs)


def _around_adjustments(original: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.speculative import ddtree_v2_penalties as _penalties

    return _penalties.around_adjustments(original, *args, **kwargs)


def _around_can_skip_verify_logits(original: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.speculative import ddtree_v2_penalties as _penalties

    return _penalties.around_can_skip_verify_logits(original, *args, **kwargs)


_linear_penalties_registered = False


def register_linear_penalties() -> bool:
    """Register (not apply) the linear verify's penalty hooks once per process on the v2 bases; whether they are."""
    global _linear_penalties_registered
    if not _linear_penalties_registered and base_version() in LINEAR_PENALTY_BASES:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(PREPARE_VERIFY_TARGET, _before_prepare_for_verify, HookType.BEFORE)
        HookRegistry.register(ADJUSTMENTS_TARGET, _around_adjustments, HookType.AROUND)
        if base_version() in SKIP_LOGITS_BASES:
            HookRegistry.register(SKIP_LOGITS_TARGET, _around_can_skip_verify_logits, HookType.AROUND)
        _linear_penalties_registered = True
    return _linear_penalties_registered


# --- the radix cache's recurrent-state tracking in upstream's linear verify (0.5.17, every DFLASH server) ------
# 0.5.17's DFLASH never tracks a recurrent state for the radix cache, while the scheduler records one at every
# crossed multiple of the track interval (`mamba_last_track_seqlen`, 17:managers/scheduler_components/
# batch_result_processor.py:1183-1193), so a request resuming from that cached prefix resumes from a stale state
# (a wrong first token on the H100 and H200, bench/RESULTS.md). Two gaps, both closed in 0.5.23:
# - the verify batch carries no track slots: spec batches skip the decode-time refresh and filter / merge null
#   them, and 0.5.17's `DFlashVerifyInput.prepare_for_verify` does not rebuild them as EAGLE's, NGRAM's and
#   0.5.23's DFLASH's do (`spec_utils.prepare_mamba_track_for_verify`, 23:speculative/dflash_info.py:99-104);
#   a BEFORE hook calls upstream's own function there;
# - the commit compares the pre-verify lengths with `batch.seq_lens`, which the step has not advanced
#   (17:speculative/dflash_worker_v2.py:1269-1278, called at :1840 with `seq_lens_pre_verify =
#   batch.seq_lens.clone()`); 0.5.23 compares with the post-verify lengths (23:…:2106-2117): an AROUND hook hands
#   0.5.17's commit the batch with those, so its own code picks the step 0.5.23's would.
TRACK_MEND_BASES = ("0.5.17",)
MAMBA_TRACK_TARGET = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._update_target_mamba_state_after_verify"


def _before_verify_track_slots(verify: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE `DFlashVerifyInput.prepare_for_verify` (0.5.17): on a server that tracks states for the radix cache
    (`extra_buffer`), the batch's track slots from its requests, as 0.5.23 rebuilds them before a verify (an idle batch
    has none)."""
    tracks = getattr(_shared.running_server_args(), "enable_mamba_extra_buffer", None)
    if tracks is not None and tracks() and not batch.forward_mode.is_idle():
        from sglang.srt.speculative.spec_utils import prepare_mamba_track_for_verify

        prepare_mamba_track_for_verify(batch)


class _PostVerifyBatch:
    """A batch as the state commit should read it: `seq_lens` after this verify, every other field the batch's."""

    def __init__(self, batch: Any, seq_lens: Any) -> None:
        self._batch, self.seq_lens = batch, seq_lens

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)


def _around_mamba_track(original: Any, worker: Any, *, batch: Any, seq_lens_pre_verify: Any, commit_lens: Any) -> Any:
    post = seq_lens_pre_verify + commit_lens.to(seq_lens_pre_verify.dtype)
    return original(worker, batch=_PostVerifyBatch(batch, post), seq_lens_pre_verify=seq_lens_pre_verify,
                    commit_lens=commit_lens)


_mamba_track_registered = False


def register_mamba_track() -> bool:
    """Register (not apply) the tracking hooks once per process on the bases that need them; whether they are."""
    global _mamba_track_registered
    if not _mamba_track_registered and base_version() in TRACK_MEND_BASES:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(PREPARE_VERIFY_TARGET, _before_verify_track_slots, HookType.BEFORE)
        HookRegistry.register(MAMBA_TRACK_TARGET, _around_mamba_track, HookType.AROUND)
        _mamba_track_registered = True
    return _mamba_track_registered


_workers_registered = False


def register_workers() -> bool:
    """Register (not apply) the worker hook and the internal-state hook, once per process on the v2 bases;
    whether they are registered. `load_plugins()` applies them (and every other registered hook) in each process."""
    global _workers_registered
    if not _workers_registered and base_version() in WORKER_BASES:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(CREATE_WORKER_TARGET, _create_worker, HookType.AROUND)
        HookRegistry.register(INTERNAL_STATE_TARGET, _internal_state, HookType.AFTER)
        _workers_registered = True
    return _workers_registered


register_row_headroom()
register_linear_penalties()
register_mamba_track()
register_workers()

"""Run inside an unpacked sglang tree of a v2 base (0.5.17 or 0.5.23, on PYTHONPATH, with the payload's
`ddtree_v2_seams.py` and `ddtree_args.py` beside it): drive the real upstream functions the DDTree seams hook,
before, while and after the seams are active, and print one JSON object of what they answered.

CPU stand-ins, and only where the real thing needs a GPU or a running server:
- `get_spec()` (the runtime context's speculative settings, set by a server) where the driven code reads it;
- the triton kernel `assign_req_to_token_pool` (writes the new slots into `req_to_token` rows `[cur, nxt)`)
  by the same write in torch; the allocator (`TokenToKVPoolAllocator`), the pool (`ReqToTokenPool`),
  `alloc_for_spec_decode` and `DFlashDraftInputV2.prepare_for_decode` are SGLang's own;
- the model runner, batch, requests and prefix cache are namespaces holding what those functions read;
- `TritonAttnBackend` is the real class, made without `__init__` (it needs a model runner), with the
  attributes its real `init_cuda_graph_state` reads;
- auto's verify-graph ladder (`ddtree_verify_graphs.capture_verify_ladder`, the v2 runner names): the graph runner
  is a stand-in of `DecodeCudaGraphRunner.__init__` as far as the width goes (its width from the real
  `ModelRunner.decode_num_tokens_per_req`, hence the seams' hook; the real backend's `init_cuda_graph_state`; graphs
  under the real class's `_make_graph_key` / `_capture_graph_size` keys): capturing a CUDA graph needs a GPU. The
  stand-in model runner says `device="cuda"` only so the ladder does not skip it as graphs-off; nothing is put on a
  device. Replays are not timed (`_replay_seconds`, CUDA events, answers a fixed number).

Usage: python v2_seams_cases.py
"""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import sglang.srt.mem_cache.allocation as allocation
import sglang.srt.speculative.dflash_info_v2 as info
import sglang.srt.speculative.spec_utils as spec_utils
import torch
from sglang.srt.layers.attention import verify_mask
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.speculative import ddtree_v2_seams as seams
from sglang.srt.speculative import ddtree_verify_graphs as vg
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.version import __version__
from v2_runner_stand_in import StandInRunner, replay_seconds  # beside this script
from v2_runner_stand_in import triton_backend as stand_in_backend

BLOCK = 16
SPEC = SimpleNamespace(speculative_num_draft_tokens=BLOCK, speculative_eagle_topk=None)
for module in (info, spec_utils):
    if hasattr(module, "get_spec"):
        module.get_spec = lambda: SPEC


def _assign_cpu(req_pool_indices, req_to_token, start, end, out_cache_loc, batch_size) -> None:
    """The triton kernel's write: request i's new slots, in order after requests < i's, at [start, end)."""
    offset = 0
    for i in range(batch_size):
        s, e = int(start[i]), int(end[i])
        req_to_token[int(req_pool_indices[i]), s:e] = out_cache_loc[offset : offset + e - s].to(req_to_token.dtype)
        offset += e - s


allocation.assign_req_to_token_pool_func = _assign_cpu


RESOLVE_PARAMS = inspect.signature(spec_utils.resolve_num_tokens_per_req).parameters


def widths() -> dict:
    dflash, eagle = SpeculativeAlgorithm.DFLASH, SpeculativeAlgorithm.EAGLE
    server_args = SimpleNamespace(speculative_num_draft_tokens=BLOCK, speculative_eagle_topk=None)

    def runner(is_draft: bool) -> int:  # the real ModelRunner method on a stand-in runner
        mr = SimpleNamespace(spec_algorithm=dflash, server_args=server_args, is_draft_worker=is_draft,
                             model_config=SimpleNamespace(hf_config=None))
        return ModelRunner.decode_num_tokens_per_req(mr, num_draft_tokens=BLOCK)

    def resolve(is_draft: bool) -> int:
        kwargs = {"server_args": server_args} if "server_args" in RESOLVE_PARAMS else {}  # 0.5.17 ; 0.5.23 get_spec()
        return spec_utils.resolve_num_tokens_per_req(phase="target_verify", spec_algorithm=dflash,
                                                     is_draft_worker=is_draft, **kwargs)

    return {
        "method_target": dflash.get_num_tokens_per_req_for_target_verify(BLOCK, False),
        "method_draft": dflash.get_num_tokens_per_req_for_target_verify(BLOCK, True),
        "eagle_target": eagle.get_num_tokens_per_req_for_target_verify(4, False),
        "resolve_target": resolve(False),
        "resolve_draft": resolve(True),
        "runner_target": runner(False),
        "runner_draft": runner(True),
    }


def mask_policy() -> list:
    # imported inside the call, as the CUDA-graph runner does (17:decode_cuda_graph_runner.py:1309-1317)
    from sglang.srt.speculative.dflash_utils import resolve_dflash_verify_mask_policy

    return list(resolve_dflash_verify_mask_policy(TritonAttnBackend.__new__(TritonAttnBackend)))


MAX_BS, CONTEXT = 4, 96


def triton_backend(is_draft_runner: bool = False) -> TritonAttnBackend:
    """The real triton backend class on the CPU, with what its `init_cuda_graph_state` reads."""
    return stand_in_backend(block=BLOCK, max_context_len=CONTEXT, is_draft_runner=is_draft_runner)


def mask_buffer(is_draft_runner: bool = False) -> int | None:
    """Cells of the verify mask the real `init_cuda_graph_state` leaves on a CPU triton backend."""
    b = triton_backend(is_draft_runner)
    active = seams.active()
    width = active.verify_width if active else BLOCK
    b.init_cuda_graph_state(MAX_BS, MAX_BS * width)
    mask = b._verify_mask
    if mask is None:
        return None
    assert mask.max_bs == MAX_BS and mask.buffer.dtype == torch.uint8, mask
    return int(mask.buffer.numel())


def mask_numel(n: int) -> int:
    return verify_mask.tree_mask_numel(verify_mask.default_tree_mask_mode(), MAX_BS, n, CONTEXT)


# --- reservation -------------------------------------------------------------------------------------------

V23 = hasattr(ReqKvInfo, "kv_committed_len") or "kv_committed_len" in getattr(ReqKvInfo, "__slots__", ())
# (committed, allocated) per request: just after prefill; holding upstream's 2 x block; holding more than a tree
REQS = [(10, 10), (40, 72), (5, 200)]


def _batch(cls) -> tuple[SimpleNamespace, object, SimpleNamespace]:
    pool = ReqToTokenPool(size=4, max_context_len=256, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(size=2048, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False)
    reqs = []
    for committed, allocated in REQS:
        if V23:
            kv = ReqKvInfo(kv_committed_len=committed, kv_allocated_len=allocated)
        else:
            kv = ReqKvInfo(kv_allocated_len=allocated, swa_evicted_seqlen=0)
        req = SimpleNamespace(kv=kv, kv_committed_len=committed, req_pool_idx=None, decode_batch_idx=0,
                              sampling_params=SimpleNamespace(top_k=1), inflight_middle_chunks=0)
        reqs.append(req)
    for req, row in zip(reqs, pool.alloc(reqs), strict=True):  # 0.5.23 keeps the row on req.kv
        req.req_pool_idx = row
    for req in reqs:  # rows as prefill / earlier steps left them: slots already held, marked by a sentinel
        pool.req_to_token[req.req_pool_idx, : req.kv.kv_allocated_len] = -7
    # a cache that shares no prefix: nothing to evict (0.5.17 asks is_chunk_cache, 0.5.23 supports_prefix_sharing)
    tree_cache = SimpleNamespace(token_to_kv_pool_allocator=allocator, is_chunk_cache=lambda: True,
                                 supports_prefix_sharing=lambda: False,
                                 supports_swa=lambda: False)
    batch = SimpleNamespace(
        device="cpu", reqs=reqs, batch_size=lambda: len(reqs), token_to_kv_pool_allocator=allocator,
        tree_cache=tree_cache, req_to_token_pool=pool, hisparse_coordinator=None, maybe_evict_swa=lambda: None,
        req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64),
        seq_lens_cpu=None, seq_lens_sum=None,
    )
    spec = info.DFlashDraftInputV2.create_idle_input(torch.device("cpu"))
    if cls is not info.DFlashDraftInputV2:
        spec = cls.from_dflash(spec)
    return batch, allocator, spec


def reserve(cls, steps: int = 1) -> dict:
    batch, allocator, spec = _batch(cls)
    free0 = allocator.available_size()
    for _ in range(steps):
        spec.prepare_for_decode(batch)
    pool = batch.req_to_token_pool.req_to_token
    rows, new_slots = [], []
    for (_, allocated), req in zip(REQS, batch.reqs, strict=True):
        row = pool[req.req_pool_idx]
        held = int(req.kv.kv_allocated_len)
        rows.append(bool((row[:allocated] == -7).all()) and bool((row[held:] == 0).all()))
        new_slots += row[allocated:held].tolist()
    recorded = spec.nxt_kv_lens_cpu if hasattr(spec, "nxt_kv_lens_cpu") else spec.reserved_seq_lens_cpu
    recorded_sum = spec.nxt_kv_lens_sum if hasattr(spec, "nxt_kv_lens_sum") else spec.reserved_seq_lens_sum
    return {
        "class": type(spec).__name__,
        "allocated": [int(r.kv.kv_allocated_len) for r in batch.reqs],
        "taken": free0 - allocator.available_size(),
        "new_slots_distinct_fresh": len(set(new_slots)) == len(new_slots) and min(new_slots, default=1) >= 1,
        "new_slots": len(new_slots),
        "old_rows_kept": rows,
        "recorded": [int(x) for x in recorded],
        "recorded_sum": int(recorded_sum),
        "seq_lens_cpu": [int(x) for x in batch.seq_lens_cpu],
    }


def paged_lens() -> list:
    """What the seam asks for at page size 4 (arithmetic only: the paged allocator's kernels need a GPU)."""
    batch, _, _ = _batch(info.DFlashDraftInputV2)
    batch.token_to_kv_pool_allocator = SimpleNamespace(page_size=4)
    return [list(x) if isinstance(x, list) else x for x in seams.reserve_lens(batch, 80)]


# --- auto's verify-graph ladder through the seams' width ---------------------------------------------------------


def ladder_case(widths: list[int], fail_at: int | None = None) -> dict:
    """The target's graph set at the seams' width, then `capture_verify_ladder` for `widths`, as the v2 tree step
    calls it; what each runner captured at, what the backend's buffers are after, what the width hook answers."""
    backend = triton_backend()
    mr = SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.DFLASH, is_draft_worker=False, device="cuda",
                         server_args=SimpleNamespace(speculative_num_draft_tokens=BLOCK, speculative_eagle_topk=None),
                         model_config=SimpleNamespace(hf_config=None), attn_backend=backend)
    mr.decode_num_tokens_per_req = lambda **kw: ModelRunner.decode_num_tokens_per_req(mr, **kw)  # the real method
    existing = mr.decode_cuda_graph_runner = StandInRunner(mr)
    mask, logits, kv_indices = backend._verify_mask, backend.cuda_graph_attn_logits, backend.cuda_graph_kv_indices
    real_replay, StandInRunner.fail_at = vg._replay_seconds, fail_at
    vg._replay_seconds = replay_seconds
    out: dict = {"existing_width": existing.captured_req_width}
    try:
        ladder = vg.capture_verify_ladder(mr, widths, set_capture_width=seams.set_capture_width,
                                          set_backend_width=None, reserved_memory=lambda: None, names=vg.V2_RUNNER)
        out["widths"] = ladder.widths
        out["captured"] = {str(w): r.captured_req_width for w, r in ladder.runners.items()}
        out["timed"] = sorted(f"{w}x{bs}" for w, bs in ladder.replay_seconds)
        out["width_for"] = {str(n): ladder.width_for(n) for n in range(1, existing.captured_req_width + 1)}
        ladder.use(ladder.widths[0])
        out["installed"] = mr.decode_cuda_graph_runner.captured_req_width
        ladder.use(ladder.widest)
    except RuntimeError as e:
        out["error"] = str(e)
    finally:
        vg._replay_seconds, StandInRunner.fail_at = real_replay, None
    out["after"] = {
        "runner_restored": mr.decode_cuda_graph_runner is existing,
        "buffers_kept": backend._verify_mask is mask and backend.cuda_graph_attn_logits is logits
        and backend.cuda_graph_kv_indices is kv_indices,
        "mask": int(backend._verify_mask.buffer.numel()),
        "init_is_the_class_method": "init_cuda_graph_state" not in vars(backend),
        "target_width": mr.decode_num_tokens_per_req(num_draft_tokens=BLOCK),
    }
    return out


def main() -> None:
    out: dict = {"version": __version__, "block": BLOCK}
    out["settings_fixed"] = vars(seams.settings_for(SimpleNamespace(
        speculative_ddtree_mode="full", speculative_num_draft_tokens=BLOCK, speculative_ddtree_budget=63)))
    out["settings_auto"] = vars(seams.settings_for(SimpleNamespace(
        speculative_ddtree_mode="full", speculative_num_draft_tokens=BLOCK, speculative_ddtree_budget="auto",
        speculative_ddtree_budget_max=95)))
    out["settings_shadow"] = seams.settings_for(SimpleNamespace(
        speculative_ddtree_mode="shadow-linear", speculative_num_draft_tokens=BLOCK, speculative_ddtree_budget=63))

    # upstream, no hook installed
    out["pristine"] = {"widths": widths(), "policy": mask_policy(), "mask": mask_buffer(),
                       "reserve": reserve(info.DFlashDraftInputV2)}
    seams.install()
    out["installed_inactive"] = {"widths": widths(), "policy": mask_policy(), "mask": mask_buffer(),
                                 "reserve": reserve(seams.DDTreeDraftInputV2)}
    seams.activate(seams.SeamSettings(block_size=BLOCK, verify_width=64))
    out["active"] = {"widths": widths(), "policy": mask_policy(), "mask": mask_buffer(),
                     "mask_draft_runner": mask_buffer(is_draft_runner=True),
                     "reserve": reserve(seams.DDTreeDraftInputV2),
                     "reserve_twice": reserve(seams.DDTreeDraftInputV2, 2),
                     "reserve_plain_class": reserve(info.DFlashDraftInputV2)}
    out["ladder"] = ladder_case([BLOCK, 32, 64])
    out["ladder_failed"] = ladder_case([BLOCK, 32, 64], fail_at=BLOCK)
    out["ladder_width_after"] = widths()
    seams.activate(seams.SeamSettings(block_size=BLOCK, verify_width=8))
    out["active_narrow"] = {"widths": widths(), "mask": mask_buffer(), "reserve": reserve(seams.DDTreeDraftInputV2)}
    seams.deactivate()
    out["deactivated"] = {"widths": widths(), "policy": mask_policy(), "mask": mask_buffer(),
                          "reserve": reserve(seams.DDTreeDraftInputV2)}
    out["paged_lens"] = paged_lens()
    out["mask_numel"] = {"block": mask_numel(BLOCK), "tree": mask_numel(64), "narrow": mask_numel(8)}
    seams.install()  # once per process: a second call registers nothing more
    from sglang.srt.plugins.hook_registry import HookRegistry

    out["registered"] = {t: len(HookRegistry._hooks[t]) for t in
                         (seams.WIDTH_TARGET, seams.MASK_POLICY_TARGET, seams.MASK_BUFFER_TARGET)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Run inside an unpacked SGLang 0.5.17 or 0.5.23 tree (on PYTHONPATH, with the payload's `ddtree_v2_args.py`,
`ddtree_args.py` and `ddtree_v2_seams.py` beside it): the `req_to_token` row headroom before and after SGLang's
own `load_plugins()` applies the hook `ddtree_v2_args` registers at import, and what SGLang's real
`DFlashDraftInputV2.prepare_for_decode` / `alloc_for_spec_decode` do near the context limit with each; prints
one JSON object.

Stand-ins (v2_seams_cases.py's, and why): `get_spec()` (0.5.23: the published bags
`allocation_sizing` reads — spec, schedule, parallel — hold each case's settings), and the triton kernel `assign_req_to_token_pool` —
here written as the kernel addresses memory (`row * row_len + position` in the pool's flat storage, no bound on
the position: 17:mem_cache/allocation.py:597-626), so a reservation past a row's end lands where it lands on
the GPU. The release is SGLang's `_release_overallocated_kv_indices` slice of the row.

Usage: python v2_row_headroom_cases.py
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

import sglang.srt.mem_cache.allocation as allocation  # noqa: E402
import sglang.srt.mem_cache.allocation_sizing as sizing  # noqa: E402
import sglang.srt.mem_cache.kv_cache_configurator as configurator  # noqa: E402
import sglang.srt.speculative.dflash_info_v2 as info  # noqa: E402
import torch  # noqa: E402
import v2_seams_cases as cases  # noqa: E402  (get_spec for the driven modules)
from sglang.srt.managers.schedule_batch import ReqKvInfo  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.speculative import ddtree_v2_args as v2args  # noqa: E402  (registers the hook at import)
from sglang.srt.speculative import ddtree_v2_seams as seams  # noqa: E402
from sglang.version import __version__  # noqa: E402

BLOCK = cases.BLOCK
CONTEXT = 96
NEIGHBOUR = 1000  # the slots of the next row's prompt


def _assign_as_the_kernel(req_pool_indices, req_to_token, start, end, out_cache_loc, batch_size) -> None:
    flat, row_len, offset = req_to_token.view(-1), req_to_token.shape[1], 0
    for i in range(batch_size):
        s, e = int(start[i]), int(end[i])
        base = int(req_pool_indices[i]) * row_len
        flat[base + s : base + e] = out_cache_loc[offset : offset + e - s].to(req_to_token.dtype)
        offset += e - s


allocation.assign_req_to_token_pool_func = _assign_as_the_kernel


def args(**kw) -> SimpleNamespace:
    base = dict(speculative_algorithm="DFLASH", speculative_num_draft_tokens=BLOCK,
                max_speculative_num_draft_tokens=BLOCK, speculative_num_steps=None, speculative_eagle_topk=None,
                page_size=1, speculative_ddtree_mode="off", speculative_ddtree_budget=None,
                speculative_ddtree_budget_max=None)
    return SimpleNamespace(**{**base, **kw})


# 0.5.17 passes the server args to the row headroom; 0.5.23 reads the runtime context's published bags
TAKES_ARGS = bool(inspect.signature(sizing.get_req_to_token_extra_context_len).parameters)


def headroom(a: SimpleNamespace) -> int:
    if TAKES_ARGS:
        return sizing.get_req_to_token_extra_context_len(a)
    sizing.get_spec = lambda: a
    sizing.get_schedule = lambda: SimpleNamespace(page_size=a.page_size)
    sizing.get_parallel = lambda: SimpleNamespace(attn_dcp_size=1)
    sizing.max_speculative_num_draft_tokens = lambda: a.max_speculative_num_draft_tokens
    return sizing.get_req_to_token_extra_context_len()


CASES = {
    "dflash": args(),
    "tree64": args(speculative_ddtree_mode="full", speculative_ddtree_budget=64, max_speculative_num_draft_tokens=65),
    "tree_auto": args(speculative_ddtree_mode="full", speculative_ddtree_budget="auto",
                      speculative_ddtree_budget_max=127, max_speculative_num_draft_tokens=128),
    "shadow": args(speculative_ddtree_mode="shadow-linear", speculative_ddtree_budget=64),
    "paged4": args(page_size=4),
    "eagle": args(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1),
    "none": args(speculative_algorithm=None, max_speculative_num_draft_tokens=None),
}


def extras() -> dict:
    return {name: headroom(a) for name, a in CASES.items()}


def _kv(committed: int) -> ReqKvInfo:
    if cases.V23:
        return ReqKvInfo(kv_committed_len=committed, kv_allocated_len=committed)
    return ReqKvInfo(kv_allocated_len=committed, swa_evicted_seqlen=0)


def near_limit(extra: int, cls, committed: int) -> dict:
    """One request at `committed` (unfinished: at most CONTEXT - 2) in row 0 of a pool `CONTEXT + extra` wide,
    a neighbour's prompt in row 1; one step's `prepare_for_decode`; what the release would free and what the
    neighbour's row still says."""
    pool = ReqToTokenPool(size=3, max_context_len=CONTEXT + extra, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(size=4096, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False)
    req = SimpleNamespace(kv=_kv(committed), kv_committed_len=committed,
                          req_pool_idx=None, decode_batch_idx=0, sampling_params=SimpleNamespace(top_k=1),
                          inflight_middle_chunks=0)
    neighbour = SimpleNamespace(kv=_kv(20), req_pool_idx=None)
    req.req_pool_idx, neighbour.req_pool_idx = pool.alloc([req, neighbour])
    pool.req_to_token[req.req_pool_idx, :committed] = -7
    pool.req_to_token[neighbour.req_pool_idx, :20] = torch.arange(NEIGHBOUR, NEIGHBOUR + 20, dtype=torch.int32)
    tree_cache = SimpleNamespace(token_to_kv_pool_allocator=allocator, is_chunk_cache=lambda: True,
                                 supports_prefix_sharing=lambda: False, supports_swa=lambda: False)
    batch = SimpleNamespace(device="cpu", reqs=[req], batch_size=lambda: 1, token_to_kv_pool_allocator=allocator,
                            tree_cache=tree_cache, req_to_token_pool=pool, hisparse_coordinator=None,
                            maybe_evict_swa=lambda: None, seq_lens_cpu=None, seq_lens_sum=None,
                            req_pool_indices=torch.tensor([req.req_pool_idx], dtype=torch.int64))
    spec = info.DFlashDraftInputV2.create_idle_input(torch.device("cpu"))
    if cls is not info.DFlashDraftInputV2:
        spec = cls.from_dflash(spec)
    free0 = allocator.available_size()
    spec.prepare_for_decode(batch)
    taken = free0 - allocator.available_size()
    # what `_release_overallocated_kv_indices` slices (17:mem_cache/common.py:196, 23:mem_cache/common.py:447): the row from the committed
    # length to the allocated length, clipped by the row's end
    freed = pool.req_to_token[req.req_pool_idx][committed : int(req.kv.kv_allocated_len)].numel()
    row = pool.req_to_token[neighbour.req_pool_idx, :20].tolist()
    return {"row_len": int(pool.req_to_token.shape[1]), "allocated": int(req.kv.kv_allocated_len), "taken": taken,
            "lost": taken - freed, "neighbour_intact": row == list(range(NEIGHBOUR, NEIGHBOUR + 20))}


def spills(extra: dict) -> dict:
    """`extra`: the headroom per case, read before the step (activating the seams applies every registered hook)."""
    out = {}
    for committed in (CONTEXT - 40, CONTEXT - 10, CONTEXT - 2):
        out[f"dflash@{committed}"] = near_limit(extra["dflash"], info.DFlashDraftInputV2, committed)
        seams.activate(seams.settings_for(CASES["tree64"]))
        out[f"tree64@{committed}"] = near_limit(extra["tree64"], seams.DDTreeDraftInputV2, committed)
        seams.deactivate()
    return out


def main() -> None:
    out: dict = {"version": __version__, "registered": v2args.register_row_headroom()}
    out["upstream"] = extras()
    out["configurator_upstream"] = configurator.get_req_to_token_extra_context_len is \
        sizing.get_req_to_token_extra_context_len
    out["upstream_spills"] = spills(out["upstream"])
    load_plugins()  # SGLang's own: applies every registered hook, and rebinds names imported from the module
    out["hooked"] = extras()
    out["configurator_rebound"] = configurator.get_req_to_token_extra_context_len is \
        sizing.get_req_to_token_extra_context_len
    out["hooked_spills"] = spills(out["hooked"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Run inside a patched sglang tree (PYTHONPATH): the payload's hybrid patches in SGLang's own code, on the CPU.

- `MambaAttnBackendBase` (hybrid_linear_attn_backend.patch): which backends take the tree path; a DDTree step's
  first-child / next-sibling arrays reach the eager metadata and the graph buffers; a linear DFLASH step runs
  the chain (eager: no arrays; a graph of the same width: a chain written into its arrays); a verify does not run
  the prefill's deferred state clears again.
- `handle_max_mamba_cache` (model_runner_kv_cache_mixin.patch): SGLang's own plan counts the per-node states at
  the tree's width in full mode, at the block elsewhere.
- `ScheduleBatch.prepare_for_decode` (managers_schedule_batch.patch): a DFLASH (spec v1) step names every
  request's radix-tracking slot again after the running batch changed (filter / merge dropped them), with
  `--mamba-scheduler-strategy extra_buffer` only.
- `fused_sigmoid_gating_delta_rule_update` (layers_attention_fla_fused_sigmoid_gating_recurrent.patch): a tree
  verify's parent table is sized by the request's width, so the kernel's `NP2_T` (a compile-time constant) is
  the same at every batch size; a chain verify keeps upstream's size.
Prints one JSON object: {"failures": [...]}.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from sglang.srt.layers.attention.hybrid_linear_attn_backend import Mamba2AttnBackend, MambaAttnBackendBase
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner_kv_cache_mixin import ModelRunnerKVCacheMixin
from sglang.srt.server_args import set_global_server_args_for_scheduler
from sglang.srt.speculative.ddtree_args import hybrid_tree_verify
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

W, MAX_BS = 9, 4


class Pool:
    def get_mamba_indices(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        return req_pool_indices.to(torch.int32) + 10


def backend() -> MambaAttnBackendBase:
    b = object.__new__(GDNAttnBackend)
    b.device, b.topk, b.pad_slot_id = torch.device("cpu"), 2, -1
    b.req_to_token_pool = Pool()
    b.state_indices_list, b.query_start_loc_list = [], []
    b.retrieve_next_token_list, b.retrieve_next_sibling_list, b.retrieve_parent_token_list = [], [], []
    MambaAttnBackendBase.init_cuda_graph_state(b, MAX_BS, MAX_BS * W)
    return b


def tree_arrays(bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    # root 0 -> 1, 2 (siblings); 1 -> 3; the rest unlinked padding
    nxt = torch.full((bs, W), -1, dtype=torch.int64)
    sib = torch.full((bs, W), -1, dtype=torch.int64)
    nxt[:, 0], sib[:, 1], nxt[:, 1] = 1, 2, 3
    return nxt, sib


def linear_input(bs: int) -> DFlashVerifyInput:
    return DFlashVerifyInput(draft_token=torch.zeros(bs * W, dtype=torch.int64),
                             positions=torch.zeros(bs * W, dtype=torch.int64), draft_token_num=W)


def backend_checks() -> list[str]:
    out: list[str] = []
    chain = list(range(1, W)) + [-1]
    bs = 3
    reqs = torch.arange(1, bs + 1)
    nxt, sib = tree_arrays(bs)
    b = backend()
    tree = SimpleNamespace(retrieve_next_token=nxt, retrieve_next_sibling=sib, draft_token_num=W)
    md = b._replay_metadata(bs, reqs.clone(), ForwardMode.TARGET_VERIFY, tree, None)
    if md.retrieve_next_token[:bs].tolist() != nxt.tolist() or md.retrieve_next_sibling[:bs].tolist() != sib.tolist():
        out.append("graph replay: the tree's arrays did not reach the buffers")
    md = b._replay_metadata(bs, reqs.clone(), ForwardMode.TARGET_VERIFY, linear_input(bs), None)
    if md.retrieve_next_token.tolist() != [chain] * bs or md.retrieve_next_sibling.unique().tolist() != [-1]:
        out.append(f"graph replay of a linear step: {md.retrieve_next_token.tolist()} is not a chain")

    # A real request of length 1 (its first verify after a one-token prompt) beside graph padding: only the
    # padding rows take the pad slot; SGLang alone counted the real one as padding too.
    for lens, real in (([5, 1, 7, 1], 3), ([5, 7, 1, 1], 3), ([1, 1, 1, 1], 4), ([1, 4, 1, 1], 2)):
        nxt_real, sib_real = tree_arrays(real)
        real_tree = SimpleNamespace(retrieve_next_token=nxt_real, retrieve_next_sibling=sib_real, draft_token_num=W,
                                    draft_token=torch.zeros(real * W, dtype=torch.int64))  # as DDTree's input
        for spec in (linear_input(real), real_tree):
            md = b._replay_metadata(MAX_BS, torch.arange(1, MAX_BS + 1), ForwardMode.TARGET_VERIFY, spec,
                                    torch.tensor(lens, dtype=torch.int32))
            want = [r + 10 for r in range(1, real + 1)] + [-1] * (MAX_BS - real)
            if md.mamba_cache_indices.tolist() != want:
                out.append(f"graph replay, lengths {lens}, {real} real ({type(spec).__name__}): slots "
                           f"{md.mamba_cache_indices.tolist()}, want {want}")
    decode = b._replay_metadata(MAX_BS, torch.arange(1, MAX_BS + 1), ForwardMode.DECODE, None,
                                torch.tensor([3, 9, 1, 1], dtype=torch.int32))
    if decode.mamba_cache_indices.tolist() != [11, 12, -1, -1]:
        out.append(f"graph replay of a decode: slots {decode.mamba_cache_indices.tolist()}")

    def eager(spec):
        batch = SimpleNamespace(batch_size=bs, forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=reqs,
                                input_ids=torch.zeros(bs * W, dtype=torch.int64), spec_info=spec,
                                mamba_track_mask=None)
        return b._forward_metadata(batch)

    md = eager(linear_input(bs))
    if md.retrieve_next_token is not None or md.retrieve_parent_token is not None:
        out.append("eager linear step: tree arrays where the chain kernels should run")
    md = eager(tree)
    if md.retrieve_next_token is not nxt or md.retrieve_parent_token is None:
        out.append("eager tree step: the tree's arrays are not the metadata's")
    if md.query_start_loc.tolist() != [0, W, 2 * W, 3 * W]:
        out.append(f"eager tree step: query_start_loc {md.query_start_loc.tolist()}")

    def runner(mode: str, draft: bool = False) -> SimpleNamespace:
        return SimpleNamespace(server_args=SimpleNamespace(speculative_ddtree_mode=mode), is_draft_worker=draft)

    gdn, mamba2 = object.__new__(GDNAttnBackend), object.__new__(Mamba2AttnBackend)
    for name, (r, be, want) in {
        "GDN full target": (runner("full"), gdn, True),
        "GDN draft": (runner("full", draft=True), gdn, False),
        "GDN shadow": (runner("shadow-linear"), gdn, False),
        "GDN off": (runner("off"), gdn, False),
        "Mamba-2 full target": (runner("full"), mamba2, False),
    }.items():
        if hybrid_tree_verify(r, be) is not want:
            out.append(f"tree path for {name}: want {want}")
    return out


def deferred_clear_checks() -> list[str]:
    """A prefill batch adopted as the running batch keeps its clear indices until a request leaves it: the
    prefill zeroes its new requests' states, a verify of the running batch must not zero them again."""
    out: list[str] = []
    for mode, want in ((ForwardMode.EXTEND, [[5, 6]]), (ForwardMode.TARGET_VERIFY, []), (ForwardMode.DECODE, [])):
        cleared: list[list[int]] = []
        b = object.__new__(GDNAttnBackend)
        b.is_draft_worker = False
        b.req_to_token_pool = SimpleNamespace(mamba_pool=SimpleNamespace(
            clear_slots=lambda idx, seen=cleared: seen.append(idx.tolist()), copy_from=lambda *a: None))
        batch = SimpleNamespace(forward_mode=mode, mamba_clear_indices=torch.tensor([5, 6]),
                                mamba_cow_src_indices=None, mamba_cow_dst_indices=None)
        b._execute_deferred_mamba_cow_and_clear(batch)
        if cleared != want:
            out.append(f"deferred clear on {mode.name}: cleared {cleared}, want {want}")
    return out


def track_index_checks() -> list[str]:
    """After filter_batch / merge_batch (track indices None, a prefill's mask left over), a DFLASH step's
    prepare_for_decode must name each remaining request's track slot in batch order, and drop the mask."""
    import sglang.srt.managers.schedule_batch as schedule_batch

    class Unpinned:  # SGLang pins the index upload; a CPU-only torch has no pinned memory
        def __getattr__(self, name: str) -> object:
            return getattr(torch, name)

        @staticmethod
        def tensor(*args: object, pin_memory: bool = False, **kwargs: object) -> torch.Tensor:
            return torch.tensor(*args, **kwargs)

    schedule_batch.torch = Unpinned()
    out: list[str] = []
    # req pool index r -> its ping-pong track slots (one slot without the overlap scheduler, as DFLASH runs)
    mapping = torch.tensor([[100 + r] for r in range(8)], dtype=torch.int64)
    for strategy, want in (("extra_buffer", [105, 102, 107]), ("no_buffer", None)):
        set_global_server_args_for_scheduler(SimpleNamespace(
            enable_mamba_extra_buffer=lambda s=strategy: s == "extra_buffer"))
        batch = object.__new__(ScheduleBatch)
        batch.reqs = [SimpleNamespace(mamba_next_track_idx=0) for _ in range(3)]
        batch.req_pool_indices = torch.tensor([5, 2, 7])
        batch.req_to_token_pool = SimpleNamespace(req_index_to_mamba_ping_pong_track_buffer_mapping=mapping)
        batch.spec_algorithm = SpeculativeAlgorithm.from_string("DFLASH")
        batch.spec_info, batch.input_embeds, batch.attn_cp_metadata = None, None, None
        batch.mamba_track_indices, batch.mamba_track_mask = None, torch.tensor([True, False, True])
        batch.prepare_for_decode()
        got = None if batch.mamba_track_indices is None else batch.mamba_track_indices.tolist()
        if got != want:
            out.append(f"{strategy}: DFLASH step tracks into {got}, want {want}")
        if strategy == "extra_buffer" and batch.mamba_track_mask is not None:
            out.append("extra_buffer: a prefill's track mask reached a DFLASH verify")
    schedule_batch.torch = torch
    return out


def plan_checks() -> list[str]:
    """SGLang's joint solve for the mamba pool, on the patched method."""
    out: list[str] = []
    per_req = 1 << 20

    def plan(mode: str, width: int) -> tuple[int, float]:
        args = SimpleNamespace(
            speculative_num_draft_tokens=16, max_speculative_num_draft_tokens=width, speculative_ddtree_mode=mode,
            max_running_requests=64, max_mamba_cache_size=None, disable_radix_cache=False,
            mamba_full_memory_ratio=0.9, enable_dp_attention=False, dp_size=1,
        )
        fake = SimpleNamespace(
            mambaish_config=SimpleNamespace(mamba2_cache_params=SimpleNamespace(mamba_cache_per_req=per_req)),
            server_args=args, spec_algorithm=SimpleNamespace(is_none=lambda: False), dp_size=1,
            _calculate_mamba_ratio=lambda: 1,
        )
        rest = ModelRunnerKVCacheMixin.handle_max_mamba_cache(fake, 100.0)
        return args.max_mamba_cache_size, rest

    budget = 100.0 * 0.9 / 1.9 * (1 << 30)
    for mode, width, d in (("off", 16, 16), ("shadow-linear", 65, 16), ("full", 65, 65), ("full", 257, 257)):
        size, rest = plan(mode, width)
        want = int(budget // (per_req * (1 + d)))
        if size != want:
            out.append(f"plan {mode} width {width}: {size} requests' states, want {want} (intermediate at {d} tokens)")
        if not 0 < rest < 100.0:
            out.append(f"plan {mode} width {width}: rest {rest}")
    return out


def recurrence_shape_checks() -> list[str]:
    """The compile-time constant each GDN verify launches its recurrence with, on the patched wrapper (the
    Triton kernel itself is replaced by a recorder: the CPU cannot launch it outside the interpreter)."""
    import sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent as rec

    seen: list[int] = []

    class Recorder:
        def __getitem__(self, grid: object):
            return lambda **kw: seen.append(kw["NP2_T"])

    real, rec.fused_sigmoid_gating_delta_rule_update_kernel = rec.fused_sigmoid_gating_delta_rule_update_kernel, Recorder()
    try:
        out: list[str] = []
        for width, tree in ((65, True), (16, False)):
            for bs in (1, 3, 9, 33):
                n, hv, k = bs * width, 2, 16
                q = torch.zeros(1, n, 1, k)
                kwargs = dict(A_log=torch.zeros(hv), a=torch.zeros(n, hv), dt_bias=torch.zeros(hv), softplus_beta=1.0,
                              softplus_threshold=20.0, q=q, k=q.clone(), v=torch.zeros(1, n, hv, k), b=torch.zeros(n, hv),
                              initial_state_source=torch.zeros(bs, hv, k, k), initial_state_indices=torch.arange(bs),
                              cu_seqlens=torch.arange(bs + 1) * width, disable_state_update=True,
                              intermediate_states_buffer=torch.zeros(bs, width, hv, k, k),
                              intermediate_state_indices=torch.arange(bs),
                              retrieve_parent_token=torch.zeros(bs, width, dtype=torch.int32) if tree else None)
                rec.fused_sigmoid_gating_delta_rule_update(**kwargs)
                want = 128 if tree else 1 << (n - 1).bit_length()
                if seen[-1] != want:
                    out.append(f"recurrence {'tree' if tree else 'chain'} width {width} batch {bs}: NP2_T {seen[-1]}, want {want}")
        return out
    finally:
        rec.fused_sigmoid_gating_delta_rule_update_kernel = real


if __name__ == "__main__":
    print(json.dumps({"failures": backend_checks() + deferred_clear_checks() + track_index_checks() + plan_checks() + recurrence_shape_checks()}))

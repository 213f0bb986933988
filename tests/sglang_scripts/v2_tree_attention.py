"""Run inside an unpacked SGLang 0.5.17 or 0.5.23 tree (on PYTHONPATH, that base's payload files beside it) under
Triton's CPU interpreter (TRITON_INTERPRET=1): the tree verify's attention, as the v2 tree step feeds it, through the
base's real triton backend and its real extend-attention kernel, eager and from the CUDA-graph buffers; print one
JSON object.

What it settles on the CPU that reading alone had decided (bench/gpu/V2_WORKER.md §0.1, point 3): the step's
`tree_verify_input` mask (bool, `n x (prefix + n)` per request, sized by a host bound above the true prefix total)
is read by `TritonAttnBackend.init_forward_metadata` + `extend_attention_fwd` as the tree; and after the seams
have widened the `VerifyMask` buffer, a graph replay (upstream's `_update_target_verify_buffers` copying the bool
mask into the uint8 buffer, `mask_indptr` over the graph's padded batch) reads the same. The oracle is written
here from the definition: node i of request b attends to the request's prefix and to the nodes on its own
root-to-node path, softmax over those keys with the layer's scaling, grouped-query heads.

Controls (each must differ from the oracle on branching trees): the same tokens verified causally (DFLASH's chain
rule: no custom mask), and the mask in a wrong layout (rows of `n` keys, the prefix left out).

Stand-ins, only where the real thing needs a model runner: the backend is the real class made without `__init__`
and given the attributes its verify paths read (either base's: an attribute one base does not read is inert there);
the layer is a namespace with RadixAttention's fields; the KV pool holds K / V per slot in two tensors
(`get_key_buffer` / `get_value_buffer`). 0.5.23 reads the prefix's slots through the step's `KVLocPlan` and the
runner's `KVIndexTranslator`: both real (a static pool's pass-through translator), the plan made by the base
adapter's own `_verify_input_extra` and bound to the batch as `ForwardBatch.init_new` binds it.

Usage: TRITON_INTERPRET=1 python v2_tree_attention.py
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import torch
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative import ddtree_v2_seams as seams
from sglang.srt.speculative import ddtree_v2_step as w  # the shared tree step
from sglang.srt.speculative import ddtree_worker_v2 as adapter
from sglang.srt.speculative import dflash_utils
from sglang.srt.speculative.ddtree_utils import build_ddtree
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.version import __version__

if __version__ == "0.5.23":
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

HEADS, KV_HEADS, DIM = 4, 2, 16
CONTEXT = 64  # the model's context length: sizes the graph mask buffer, as max_context_len does upstream
CHAIN_FROM = 8  # trials from this seed on verify a chain
BLOCK = 4  # DFLASH's block: what upstream sizes the verify mask for before the seams widen it


class Pool:
    """K / V per slot, as `MHATokenToKVPool.get_key_buffer / get_value_buffer` return them for one layer."""

    def __init__(self, slots: int, gen: torch.Generator) -> None:
        self.k = torch.randn((slots, KV_HEADS, DIM), generator=gen)
        self.v = torch.randn((slots, KV_HEADS, DIM), generator=gen)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v


def translator(req_to_token: torch.Tensor) -> KVIndexTranslator | None:
    """0.5.23's runner's translator for a static pool (ids index the pool as they are); 0.5.17 has none."""
    if __version__ != "0.5.23":
        return None
    return KVIndexTranslator(req_to_token=req_to_token, token_to_kv_pool_allocator=None, token_to_kv_pool=None,
                             page_size=1, device="cpu")


def make_backend(req_to_token: torch.Tensor, pool: Pool, max_bs: int,
                 trans: KVIndexTranslator | None) -> TritonAttnBackend:
    b = TritonAttnBackend.__new__(TritonAttnBackend)
    b.extend_attention_fwd = extend_attention_fwd
    b.device = torch.device("cpu")
    b.req_to_token = req_to_token
    b.req_to_token_pool = SimpleNamespace(size=max_bs, req_to_token=req_to_token)
    b.token_to_kv_pool = pool
    b.num_draft_tokens = BLOCK
    b.max_context_len = CONTEXT
    b.sliding_window_size = None
    b.use_sliding_window_kv_pool = False
    b._translate_kv_loc = None
    b.dcp_size = 1
    b.enable_deterministic = False
    b.use_verify_splitkv = False
    b.use_mla = False
    b.page_size = 1
    b.num_head, b.v_head_dim, b.swa_v_head_dim, b.max_kv_splits = HEADS, DIM, None, 4
    b.is_draft_runner = False
    b.skip_prefill = False
    b.allow_bidirectional_attention_in_extend = False
    b.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32)
    b.window_kv_indptr = None
    b.qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int64)
    b.mask_indptr = torch.zeros(max_bs + 1, dtype=torch.int64)
    b.forward_metadata = None
    b._verify_mask = None
    # 0.5.23's: the fallback verify width its __init__ reads through the runner (hooked by the seams), the KV ids'
    # translator, and the paths a verify must not take (DLLM, ROCm's split-KV verify, FP8 chunked prefill)
    b.target_verify_num_tokens_per_req = SpeculativeAlgorithm.DFLASH.get_num_tokens_per_req_for_target_verify(
        BLOCK, False)
    b.kv_index_translator = trans
    b.dllm_attention = None
    b.use_verify_shared_kv = b.use_dense_fp8_chunked_prefill = False
    b._dense_one_shot_kv_indptr = None
    b.lean_total_programs, b.lean_block_m = 1, 16
    return b


LAYER = SimpleNamespace(
    layer_id=0, tp_q_head_num=HEADS, qk_head_dim=DIM, v_head_dim=DIM, k_scale=None, v_scale=None,
    logit_capping_method="tanh", logit_cap=0.0, is_cross_attention=False, attn_type=AttentionType.DECODER,
    sliding_window_size=None, scaling=DIM**-0.5, xai_temperature_len=-1,
)


def oracle(q, k_ext, v_ext, pool, req_to_token, rows, prefix, parents, n) -> torch.Tensor:
    """Per request and node: softmax attention over the prefix's slots and the node's root-to-node path."""
    out = torch.zeros_like(q)
    group = HEADS // KV_HEADS
    for b, p in enumerate(prefix):
        slots = req_to_token[int(rows[b]), :p].long()
        for i in range(n):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = parents[b][j]
            ext = torch.tensor(sorted(path)) + b * n
            keys = torch.cat([pool.k[slots], k_ext[ext]])
            vals = torch.cat([pool.v[slots], v_ext[ext]])
            for h in range(HEADS):
                scores = keys[:, h // group] @ q[b * n + i, h] * LAYER.scaling
                out[b * n + i, h] = torch.softmax(scores, 0) @ vals[:, h // group]
    return out


def verify_batch(bs: int, prefix: list[int], rows: torch.Tensor, seq_lens_sum: int, spec_info,
                 out_cache_loc, trans: KVIndexTranslator | None = None) -> SimpleNamespace:
    fb = SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, req_pool_indices=rows, seq_lens=torch.tensor(prefix, dtype=torch.int64),
        seq_lens_sum=seq_lens_sum, seq_lens_cpu=torch.tensor(prefix), spec_info=spec_info,
        out_cache_loc=out_cache_loc, encoder_lens=None, mha_one_shot=False, attn_attend_prefix_cache=None,
        extend_seq_lens_cpu=None, kv_loc_plan=None, kv_loc_cols=None,
    )
    plan = getattr(spec_info, "kv_loc_plan", None)
    if plan is not None:  # as ForwardBatch.init_new binds it (a graph replay's view carries the live batch's plan)
        plan.bind(fb, trans)
        fb.out_cache_loc = out_cache_loc  # a replay writes through the runner's padded slots
    return fb


def verify_extra(tree_verify: w.TreeVerify, rows: torch.Tensor, prefix: list[int], n: int,
                 trans: KVIndexTranslator | None) -> dict:
    """The fields the base's adapter adds to the verify input (`_verify_input_extra`; 0.5.23: the verify's own
    `KVLocPlan`), from a worker made without `__init__` holding only the runner's translator."""
    worker = adapter.DDTreeWorkerV2.__new__(adapter.DDTreeWorkerV2)
    worker.__dict__["_target_worker"] = SimpleNamespace(model_runner=SimpleNamespace(kv_index_translator=trans))
    prefix_t = torch.tensor(prefix, dtype=torch.int64)
    batch = SimpleNamespace(req_pool_indices=rows, seq_lens=prefix_t, seq_lens_cpu=prefix_t,
                            spec_info=SimpleNamespace(nxt_kv_lens_cpu=None))
    return worker._verify_input_extra(batch, tree_verify, n, prefix_t + n)


def run_attention(backend, fb, q, k_ext, v_ext) -> torch.Tensor:
    out = backend.forward_extend(q.view(q.shape[0], -1), k_ext, v_ext, LAYER, fb, save_kv_cache=False)
    return out.view(q.shape)


def wrong_layout(tree_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The tree's `n x n` node masks back to back, prefix columns left out (EAGLE's QLEN_ONLY shape), padded to
    the right mask's size."""
    flat = tree_mask.reshape(-1).to(torch.bool)
    out = torch.zeros_like(like)
    out[: flat.numel()] = flat
    return out


def trial(seed: int) -> dict:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bs = rng.randint(1, 3)
    graph_bs = bs + rng.randint(0, 2)  # the replay pads the batch to the captured size
    depth, vocab = rng.randint(2, 5), rng.randint(4, 9)
    chain = seed >= CHAIN_FROM  # one candidate per depth: DFLASH's own chain, whose mask is the causal one
    logits = torch.randn((bs, depth, vocab), generator=gen) * 2
    if chain:
        tree = build_ddtree(logits, depth, topk_cap=1)
    else:
        tree = build_ddtree(logits, rng.randint(3, 11), topk_cap=rng.choice([None, 2]))
    n = tree.parents.shape[1]
    prefix = [rng.randint(1, 20) for _ in range(bs)]
    width = CONTEXT + n
    slots = (graph_bs + 2) * width
    req_to_token = torch.randperm(slots, generator=gen).view(graph_bs + 2, width).to(torch.int32)
    rows = torch.randperm(graph_bs + 1, generator=gen)[:bs] + 1  # row 0 is where padded rows read
    pool = Pool(slots, gen)
    bonus = torch.randint(0, vocab, (bs,), generator=gen)
    bound = sum(prefix) + rng.choice([0, 0, 7])  # the host's bound may exceed the true total
    v = w.tree_verify_input(tree, bonus, torch.tensor(prefix), req_to_token, rows, bound)
    trans = translator(req_to_token)  # the target runner's, shared by its backend and its batches
    extra = verify_extra(v, rows, prefix, n, trans)

    q = torch.randn((bs * n, HEADS, DIM), generator=gen)
    k_ext = torch.randn((bs * n, KV_HEADS, DIM), generator=gen)
    v_ext = torch.randn((bs * n, KV_HEADS, DIM), generator=gen)
    want = oracle(q, k_ext, v_ext, pool, req_to_token, rows, prefix, tree.parents.tolist(), n)
    branching = any(len(set(ps)) < len(ps) for ps in (row[1:] for row in tree.parents.tolist()))

    def spec(mask) -> DFlashVerifyInput:
        return DFlashVerifyInput(draft_token=v.tokens, positions=v.positions, draft_token_num=n, custom_mask=mask,
                                 capture_hidden_mode=CaptureHiddenMode.FULL, **extra)

    def eager(mask) -> float:
        backend = make_backend(req_to_token, pool, graph_bs + 2, trans)
        fb = verify_batch(bs, prefix, rows, sum(prefix), spec(mask), v.out_cache_loc, trans)
        backend.init_forward_metadata(fb)
        return float((run_attention(backend, fb, q, k_ext, v_ext) - want).abs().max())

    def graph(seamed: bool) -> tuple[float | str, bool]:
        """Upstream's graph buffers for the block (widened by the seams when they are on), captured with the
        runner's dummy mask where its mask policy asks for one (`draft_token_num` = the captured width), then
        replayed with the step's mask over the padded batch."""
        if seamed:
            seams.activate(seams.SeamSettings(block_size=BLOCK, verify_width=n))
        try:
            backend = make_backend(req_to_token, pool, graph_bs + 2, trans)
            backend.init_cuda_graph_state(graph_bs, graph_bs * n)
            widened = backend._verify_mask.buffer.numel() == graph_bs * n * (CONTEXT + n)
            uint8 = backend._verify_mask.buffer.dtype == torch.uint8
            _, build_mask = dflash_utils.resolve_dflash_verify_mask_policy(backend)  # as the runner asks
            pad_rows = torch.cat([rows, torch.zeros(graph_bs - bs, dtype=rows.dtype)])
            pad_prefix = prefix + [backend.get_cuda_graph_seq_len_fill_value()] * (graph_bs - bs)
            dummy = torch.ones((graph_bs + graph_bs * n) * n, dtype=torch.bool) if build_mask else None
            capture_spec = DFlashVerifyInput(draft_token=None, positions=None, draft_token_num=n, custom_mask=dummy,
                                             capture_hidden_mode=CaptureHiddenMode.FULL)
            backend.init_forward_metadata_out_graph(
                verify_batch(graph_bs, pad_prefix, pad_rows, sum(pad_prefix), capture_spec, None), in_capture=True)
            backend._verify_mask.buffer.fill_(1)  # what capture left behind must not leak into a replay
            pad_loc = torch.cat([v.out_cache_loc, torch.zeros((graph_bs - bs) * n, dtype=torch.int64)])
            fb = verify_batch(graph_bs, pad_prefix, pad_rows, sum(pad_prefix), spec(v.custom_mask), pad_loc, trans)
            backend.init_forward_metadata_out_graph(fb, in_capture=False)
            pad = lambda t: torch.cat([t, torch.randn((graph_bs - bs) * n, *t.shape[1:], generator=gen)])  # noqa: E731
            out = run_attention(backend, fb, pad(q), pad(k_ext), pad(v_ext))[: bs * n]
            return float((out - want).abs().max()), widened and uint8
        except Exception as e:  # the unseamed control may not even fit the tree's mask in the block's buffer
            return f"{type(e).__name__}: {e}"[:200], False
        finally:
            seams.deactivate()

    graph_err, graph_buffer_ok = graph(seamed=True)
    unseamed_err, _ = graph(seamed=False)
    return {
        "seed": seed, "chain": chain, "bs": bs, "graph_bs": graph_bs, "n": n, "branching": branching,
        "graph_buffer": graph_buffer_ok,
        "kv_plan": extra.get("kv_loc_plan") is not None,  # 0.5.23's pass-through reads would not miss it
        "eager": eager(v.custom_mask),
        "graph": graph_err,
        "graph_without_seams": unseamed_err,
        "causal": eager(None),
        "wrong_layout": eager(wrong_layout(tree.tree_mask, v.custom_mask)),
    }


if __name__ == "__main__":
    print(json.dumps({"version": __version__, "trials": [trial(seed) for seed in range(CHAIN_FROM + 2)]}))

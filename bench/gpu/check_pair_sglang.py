#!/usr/bin/env python3
"""Check train_pair.py's torch DFlash drafter (and its target features) against SGLang's own code, on CPU.

    python bench/gpu/check_pair_sglang.py PAIR_DIR [--out check.json] [--contexts 3]

PAIR_DIR holds target/ and draft/ (train_pair.py or make_tiny_models.py), or next/ or dense/ {target, draft}
(train_pair.py --hybrid / --dense-hybrid, make_tiny_hybrid.py): a hybrid target, whose SGLang capture is not run here
(its layers need SGLang's GDN backend and Triton kernels; the capture itself is the same residual stream
as Qwen3's, see train_pair.py's docstring), so only the draft and the HF features are checked. Needs sglang 0.5.13.post1
importable (the dev venv, or /tmp/site on the GPU machine: run it there with CUDA_VISIBLE_DEVICES=
so SGLang picks its CPU/native code paths). Everything runs in float32 on CPU.

What is SGLang's and what is ours:
  * draft: SGLang's `DFlashDraftModel(config)` built from draft/config.json, weights loaded with its
    own `load_weights` (q/k/v -> qkv_proj, gate/up -> gate_up_proj), its RMSNorm / RotaryEmbedding /
    SiluAndMul / Parallel linears (forward_native), its `project_target_hidden`, and the context K/V
    exactly as `DFlashWorker._append_target_hidden_sequential` makes them (`kv_proj_only`,
    `apply_k_norm`, `apply_k_rope` at the context positions), then `DFlashDraftModel.forward` on
    the block embeddings at positions L..L+15. Only the attention kernel is ours: RadixAttention
    (ENCODER_ONLY, i.e. non-causal, in TARGET_VERIFY mode over the draft KV cache) is replaced by a
    module that attends, non-causally, from the block queries to [context K/V; block K/V] in one
    scaled_dot_product_attention (GQA by repeat_interleave of the KV heads).
  * target features: SGLang's Qwen3ForCausalLM built from target/config.json with its own
    `load_weights` and `set_dflash_layers_to_capture(target_layer_ids)`; `model.model(...)` returns
    the aux hidden states SGLang captures (again with a causal SDPA in place of RadixAttention), and
    they are compared with train_pair.FeatureTap's features from the HF model. If SGLang's target
    cannot run this way the check reports the reason and goes on with the draft.
Sensitivity: deliberately wrong variants of our drafter (context positions shifted by 16, context
ignored, block positions from 0, hidden_norm skipped) and features one layer early must differ from
SGLang by more than the tolerance, else the check fails too.
Both are compared with train_pair.DFlashDraft fed the same inputs: max |diff| of the hidden states
and of the logits (through the target's lm_head), and equality of the per-position argmax tokens
(the draft tokens the server would propose). Prints one JSON line, exit 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sglang_cpu_init(model_path: str) -> None:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # native (torch) paths of SGLang's layers
    # a CUDA build of torch ships libnccl: point PyNccl at no library, as on a CPU-only torch
    os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl-cpu-check.so")
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.distributed.parallel_state import set_custom_all_reduce
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_custom_all_reduce(False)
    # no radix cache: 0.5.17 defaults a hybrid target's cache to extra_buffer tracking, which asserts a GPU
    args = ServerArgs(model_path=model_path, device="cpu", disable_radix_cache=True)
    set_global_server_args_for_scheduler(args)
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=1)
    try:  # the target's LayerCommunicator asks for it (no DP attention: sizes 1)
        import torch
        from sglang.srt.layers.dp_attention import initialize_dp_attention

        initialize_dp_attention(args, SimpleNamespace(hidden_size=0, dtype=torch.float32))
    except Exception as e:  # then the target capture check reports why it did not run
        print(f"initialize_dp_attention: {type(e).__name__}: {e}", file=sys.stderr)


class BlockAttention:
    """Stands in for RadixAttention in the draft: block queries over [context K/V; block K/V]."""

    def __init__(self, radix, n_heads, n_kv, head_dim):
        import torch

        self.radix, self.nh, self.nkv, self.d = radix, n_heads, n_kv, head_dim
        self.ctx_k = self.ctx_v = None
        self._torch = torch

    def __call__(self, q, k, v, forward_batch=None, **_):
        torch = self._torch
        F = torch.nn.functional
        n = q.shape[0]
        q = q.view(n, self.nh, self.d).transpose(0, 1)
        kk = torch.cat([self.ctx_k, k.view(n, self.nkv, self.d)], 0).transpose(0, 1)
        vv = torch.cat([self.ctx_v, v.view(n, self.nkv, self.d)], 0).transpose(0, 1)
        g = self.nh // self.nkv
        kk, vv = kk.repeat_interleave(g, 0), vv.repeat_interleave(g, 0)
        o = F.scaled_dot_product_attention(q[None], kk[None], vv[None], is_causal=False, scale=self.radix.scaling)
        return o[0].transpose(0, 1).reshape(n, self.nh * self.d)


class CausalAttention:
    """Stands in for RadixAttention in the target: causal attention over one whole sequence."""

    def __init__(self, radix):
        import torch

        self.radix = radix
        self._torch = torch

    def __call__(self, q, k, v, forward_batch=None, **_):
        torch = self._torch
        r = self.radix
        n = q.shape[0]
        q = q.view(n, r.tp_q_head_num, r.head_dim).transpose(0, 1)
        k = k.view(n, r.tp_k_head_num, r.head_dim).transpose(0, 1)
        v = v.view(n, r.tp_v_head_num, r.head_dim).transpose(0, 1)
        g = r.tp_q_head_num // r.tp_k_head_num
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        o = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                             scale=r.scaling)
        return o[0].transpose(0, 1).reshape(n, -1)


def _swap_attn(parent, new):
    # nn.Module.__setattr__ refuses a non-Module over a registered child: go through _modules
    parent._modules.pop("attn", None)
    object.__setattr__(parent, "attn", new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("pair_dir")
    ap.add_argument("--out", default=None)
    ap.add_argument("--contexts", type=int, default=3, help="random contexts checked")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4, help="max |logit diff| allowed (float32)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    pair = Path(a.pair_dir)
    for layout in ("next", "dense"):  # train_pair.py --hybrid / --dense-hybrid, make_tiny_hybrid.py
        if not (pair / "target").is_dir() and (pair / layout / "target").is_dir():
            pair = pair / layout
    tdir, ddir = pair / "target", pair / "draft"

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    tp = importlib.import_module("train_pair")  # bench/gpu, on sys.path above
    torch.set_grad_enabled(False)
    sglang_cpu_init(str(tdir))
    from sglang.srt.models.dflash import DFlashDraftModel

    dcfg_json = json.loads((ddir / "config.json").read_text())
    ids = dcfg_json["dflash_config"]["target_layer_ids"]
    mask_id = int(dcfg_json["dflash_config"]["mask_token_id"])
    block = int(dcfg_json["dflash_config"].get("block_size", dcfg_json.get("block_size", 16)))

    model_type = json.loads((tdir / "config.json").read_text()).get("model_type")
    hybrid, dense_hybrid = model_type == "qwen3_next", model_type == "qwen3_5"
    hf = tp.target_class(hybrid, dense_hybrid).from_pretrained(
        str(tdir), dtype=torch.float32, **tp.target_kwargs(hybrid)).eval()
    tap = tp.FeatureTap(hf, ids)
    ours = tp.load_draft(ddir).float().eval()

    sg = DFlashDraftModel(AutoConfig.from_pretrained(str(ddir)))
    sg.load_weights(load_file(str(ddir / "model.safetensors")).items())
    sg = sg.float().eval()
    stubs = []
    for layer in sg.layers:
        at = layer.self_attn
        st = BlockAttention(at.attn, at.num_heads, at.num_kv_heads, at.head_dim)
        _swap_attn(at, st)
        stubs.append(st)

    # SGLang's target, for the captured features (best effort)
    sg_target, sg_target_error = None, None
    try:
        if hybrid or dense_hybrid:
            raise NotImplementedError(f"{model_type} target: SGLang's GDN layers need its linear-attention backend "
                                      "(Triton) and a real forward batch")
        from sglang.srt.models.qwen3 import Qwen3ForCausalLM as SgQwen3

        tcfg = AutoConfig.from_pretrained(str(tdir))
        sg_target = SgQwen3(tcfg)
        sg_target.load_weights(load_file(str(tdir / "model.safetensors")).items())
        sg_target = sg_target.float().eval()
        sg_target.set_dflash_layers_to_capture(ids)
        for layer in sg_target.model.layers:
            _swap_attn(layer.self_attn, CausalAttention(layer.self_attn.attn))
    except Exception as e:  # reported, not fatal
        sg_target, sg_target_error = None, f"{type(e).__name__}: {e}"

    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(a.seed)
    emb, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    cases, ok = [], True
    for _ in range(a.contexts):
        L = int(torch.randint(4, 200, (1,), generator=g))
        ctx = torch.randint(4, vocab, (1, L), generator=g)
        feats, cont = tp.greedy_block(hf, tap, ctx, block)
        # our features vs HF's own output_hidden_states (hidden_states[k + 1] = output of layer k)
        hs = hf(input_ids=ctx, output_hidden_states=True).hidden_states
        hf_feats = torch.cat([hs[i + 1] for i in sorted(ids)], -1)
        case = {"context_len": L, "feat_vs_hf_hidden_states": float((feats - hf_feats).abs().max())}
        if sg_target is not None:
            try:
                pos = torch.arange(L)
                fb = SimpleNamespace(forward_mode=None)
                _, aux = sg_target.model(ctx[0], pos, fb)
                sg_feats = torch.cat(aux, -1)
                case["feat_vs_sglang_capture"] = float((feats[0] - sg_feats).abs().max())
            except Exception as e:
                sg_target, sg_target_error = None, f"{type(e).__name__}: {e}"
        blk = torch.full((1, block), mask_id)
        blk[0, 0] = cont[0, 0]
        bemb = emb(blk)
        bpos = L + torch.arange(block)
        h_ours = ours(feats, torch.arange(L), bemb, bpos)[0]
        # SGLang: the worker's KV materialization, then the draft forward over the block
        ctx_hidden = sg.project_target_hidden(feats[0])
        cpos = torch.arange(L)
        for layer, st in zip(sg.layers, stubs, strict=True):
            at = layer.self_attn
            k, v = at.kv_proj_only(ctx_hidden)
            k = at.apply_k_norm(k)
            k = at.apply_k_rope(cpos, k)
            st.ctx_k = k.view(-1, at.num_kv_heads, at.head_dim)
            st.ctx_v = v.view(-1, at.num_kv_heads, at.head_dim)
        h_sg = sg(blk[0], bpos, None, input_embeds=bemb[0]).hidden_states
        lo_ours, lo_sg = head(h_ours[1:]), head(h_sg[1:])
        tok_ours, tok_sg = lo_ours.argmax(-1), lo_sg.argmax(-1)
        case.update({
            "hidden_max_abs_diff": float((h_ours - h_sg).abs().max()),
            "logits_max_abs_diff": float((lo_ours - lo_sg).abs().max()),
            "draft_tokens_equal": bool(torch.equal(tok_ours, tok_sg)),
            "draft_tokens": tok_sg.tolist(),
        })
        # sensitivity: deliberately wrong variants of our drafter must NOT match SGLang
        def logit_diff(h, ref=lo_sg):
            return float((head(h[1:]) - ref).abs().max())

        mut = {
            "context_positions_shifted_by_16": logit_diff(ours(feats, torch.arange(L) + 16, bemb, bpos)[0]),
            "context_ignored": logit_diff(ours(feats, torch.arange(L), bemb, bpos,
                                               ctx_valid=torch.zeros(1, L, dtype=torch.bool))[0]),
            "block_positions_from_0": logit_diff(ours(feats, torch.arange(L), bemb, torch.arange(block))[0]),
        }
        ours.project_target_hidden = lambda f: ours.fc(f)  # hidden_norm left out
        mut["hidden_norm_skipped"] = logit_diff(ours(feats, torch.arange(L), bemb, bpos)[0])
        del ours.project_target_hidden
        if sg_target is not None:
            shifted = [i - 1 for i in sorted(ids)]
            mut["features_one_layer_early"] = float((torch.cat([hs[i + 1] for i in shifted], -1)[0]
                                                     - sg_feats).abs().max())
        case["mutations_max_abs_diff"] = mut
        case["mutations_detected"] = all(v > a.tol for v in mut.values())
        bad = (not case["mutations_detected"] or case["logits_max_abs_diff"] > a.tol or not case["draft_tokens_equal"]
               or case["feat_vs_hf_hidden_states"] > 1e-5 or case.get("feat_vs_sglang_capture", 0.0) > 1e-4)
        ok &= not bad
        cases.append(case)
    res = {"ok": ok, "pair_dir": str(pair), "cases": cases, "tol": a.tol,
           "sglang_target_capture": "checked" if sg_target is not None else f"not checked: {sg_target_error}",
           "attention": "ours (SDPA) in place of RadixAttention, in both models", "wall_s": time.perf_counter() - t0}
    line = json.dumps(res)
    print(line, flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Tiny hybrid targets for the DDTree hybrid-guard check, plus the usual DFlash draft.

Usage: [PEAKED=1] python make_tiny_hybrid.py OUT_DIR   (PEAKED as in make_tiny_models.py: drafts get accepted)
Writes OUT_DIR/next/target  a tiny random Qwen3-Next (Gated DeltaNet + attention + MoE) that
                            SGLang loads as Qwen3NextForCausalLM (runtime hybrid_gdn_config);
       OUT_DIR/marker/target the tiny Qwen3 target of make_tiny_models.py with one recurrent-only
                            config key added: SGLang serves it as plain Qwen3, only the offline
                            config check (ddtree_utils.is_hybrid_model) calls it hybrid. A fallback
                            in case this SGLang build cannot load Qwen3-Next.
       OUT_DIR/dense/target  a tiny random dense Qwen3.5 hybrid (Gated DeltaNet + gated attention, dense MLP,
                            no MoE) that SGLang loads as Qwen3_5ForConditionalGeneration (its only dense
                            Qwen3.5 entry class: a vision-language wrapper, so a 1-block vision tower and
                            image / video processor configs come with it; runtime hybrid_gdn_config);
       OUT_DIR/moe35/target  dense/target made a Qwen3.5 MoE (Gated DeltaNet + gated attention + MoE) that SGLang
                            loads as Qwen3_5MoeForConditionalGeneration (moe_from_dense: every routed expert a copy of
                            the dense MLP, so it computes dense/'s function and accepts dense/'s drafts);
       OUT_DIR/*/draft       the DFlash draft (hidden 256, target layers [1, 2]).

       python make_tiny_hybrid.py --moe-from-dense SRC_PAIR_DIR OUT_DIR
                            SRC_PAIR_DIR/dense/{target,draft} (e.g. train_pair.py --dense-hybrid's trained pair) ->
                            OUT_DIR/moe35/{target,draft} (+ heldout_prompts.json when SRC_PAIR_DIR has one).
"""
import argparse
import hashlib
import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_models as tm  # noqa: E402

FULL_ATTENTION_INTERVAL = 4  # layers 0-2 Gated DeltaNet, layer 3 gated attention (SGLang: (l + 1) % 4 == 0)


def next_config(eos: int):
    """The tiny Qwen3-Next config (also train_pair.py --hybrid's target): the dense target's shape
    (make_tiny_models: hidden 256, 4 layers, vocab 4096, untied head) with GDN layers 0-2 and MoE in
    every layer (SGLang 0.5.13.post1 builds every Qwen3-Next layer as MoE, see __main__)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=tm.VOCAB, hidden_size=tm.HIDDEN, intermediate_size=tm.INTER,
        num_hidden_layers=tm.TARGET_LAYERS, num_attention_heads=tm.HEADS,
        num_key_value_heads=tm.KV_HEADS, head_dim=tm.HEAD_DIM, max_position_embeddings=tm.MAX_POS,
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False,
    )


def fix_saved_config(out_dir: str) -> None:
    """SGLang 0.5.13.post1's Qwen3-Next reads `full_attention_interval`, which transformers 5.x
    no longer writes (it derives layer_types); without it the server fails before any DDTree code
    runs (seen on the H200: AttributeError in the scheduler)."""
    p = os.path.join(out_dir, "config.json")
    with open(p) as f:
        saved = json.load(f)
    saved["full_attention_interval"] = FULL_ATTENTION_INTERVAL
    with open(p, "w") as f:
        json.dump(saved, f, indent=2)


def make_next(out_dir):
    from transformers import Qwen3NextForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    n_vocab, eos = tm.build_tokenizer(out_dir)
    cfg = next_config(eos)
    torch.manual_seed(tm.SEED)
    model = Qwen3NextForCausalLM(cfg)
    with torch.no_grad():  # make_tiny_models' recipe: clear greedy margins; PEAKED=1 biases towards its peak token
        model.lm_head.weight.normal_(0.0, 0.5)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        if tm.PEAKED:
            model.model.embed_tokens.weight[:, 0] = 8.0
            model.lm_head.weight[tm.PEAK_TOKEN, 0] = 3.0
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    fix_saved_config(out_dir)
    print(f"qwen3-next target: {out_dir} params={sum(p.numel() for p in model.parameters())}")


# ---- the dense Qwen3.5 hybrid (no MoE)
# The special tokens a Qwen3.5 processor looks up by name (transformers' Qwen3VLProcessor, SGLang's
# QwenVLImageProcessor): in the tokenizer, so their ids lie inside the tiny vocabulary and config.json's
# image / video / vision_start / vision_end ids name real tokens. Text-only requests never contain them.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen3.5's rotary: partial (0.25 of head_dim 64: 16 dims, 8 frequencies), multimodal RoPE sections
# interleaved as in Qwen3.5 / 3.6 (there [11, 11, 10] of 32 frequencies; here 8 = 3 + 3 + 2). Text-only
# positions are equal in all three sections, so this is plain RoPE on text; SGLang serves it as an mrope
# model (model_runner.model_is_mrope, ForwardBatch.mrope_positions), the path a real Qwen3.5 / 3.6 takes.
DENSE_ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25,
              "mrope_section": [3, 3, 2], "mrope_interleaved": True}
# A small vision tower: one block, a 4 x 4 position grid; it only has to exist (SGLang's
# Qwen3VLForConditionalGeneration builds it unconditionally). head_dim 64: the vision attention picks its GPU
# backend at start, and 64 is a width every backend takes. out_hidden_size = the text hidden.
DENSE_VISION = {"depth": 1, "hidden_size": 128, "intermediate_size": 256, "num_heads": 2, "in_channels": 3,
                "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": tm.HIDDEN,
                "num_position_embeddings": 16}


def dense_text_config(eos: int):
    """The dense Qwen3.5 hybrid's text config (transformers' Qwen3_5TextConfig; also train_pair.py
    --dense-hybrid's Qwen3_5ForCausalLM): next_config's shape (hidden 256, 4 layers, vocab 4096, GDN layers
    0-2 with the same head dims, gated attention layer 3, untied head) with make_tiny_models' dense SwiGLU
    MLP (intermediate 512) in every layer instead of MoE."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=tm.VOCAB, hidden_size=tm.HIDDEN, intermediate_size=tm.INTER,
        num_hidden_layers=tm.TARGET_LAYERS, num_attention_heads=tm.HEADS,
        num_key_value_heads=tm.KV_HEADS, head_dim=tm.HEAD_DIM, max_position_embeddings=tm.MAX_POS,
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6, hidden_act="silu",
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_parameters=dict(DENSE_ROPE),
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False,
    )


def dense_config(eos: int, vision_ids: dict):
    """The checkpoint's Qwen3_5Config: dense_text_config + DENSE_VISION; vision_ids maps VISION_TOKENS to ids."""
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        text_config=dense_text_config(eos).to_dict(), vision_config=dict(DENSE_VISION),
        image_token_id=vision_ids["<|image_pad|>"], video_token_id=vision_ids["<|video_pad|>"],
        vision_start_token_id=vision_ids["<|vision_start|>"], vision_end_token_id=vision_ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def vision_token_ids(tok_dir: str) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    assert all(i is not None and i < tm.VOCAB for i in ids.values()), ids
    return ids


def fix_saved_dense_config(out_dir: str) -> None:
    """What SGLang 0.5.13.post1 reads and transformers 5.x does not write (configs/qwen3_5.py builds the text
    config on its Qwen3NextConfig, the vision config on Qwen3VLVisionConfig):
      * text_config.full_attention_interval: Qwen3NextConfig.layers_block_type derives the layer kinds from it
        alone (layer_types is ignored), as for Qwen3-Next (fix_saved_config);
      * vision_config.deepstack_visual_indexes = []: Qwen3VLVisionConfig's default is [8, 16, 24], which would
        make SGLang build three deepstack mergers (weights not in the checkpoint) and add deepstack inputs;
        Qwen3.5 checkpoints have none;
      * text_config.mamba_ssm_dtype "float32" and attn_output_gate true: SGLang's defaults already, written as
        Qwen3.5 / 3.6 checkpoints write them."""
    p = os.path.join(out_dir, "config.json")
    with open(p) as f:
        saved = json.load(f)
    saved["text_config"]["full_attention_interval"] = FULL_ATTENTION_INTERVAL
    saved["text_config"]["mamba_ssm_dtype"] = "float32"
    saved["text_config"]["attn_output_gate"] = True
    saved["vision_config"]["deepstack_visual_indexes"] = []
    with open(p, "w") as f:
        json.dump(saved, f, indent=2)


def write_processor_configs(out_dir: str) -> None:
    """preprocessor_config.json + video_preprocessor_config.json. SGLang enables multimodal for this
    architecture (ModelConfig: enable_multimodal defaults on) and its tokenizer manager then loads the
    processor (AutoProcessor -> transformers' Qwen3VLProcessor) from the model directory before serving any
    request; the tokenizer files are the ones already there. Patch / merge sizes are the vision config's."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLVideoProcessor

    kw = {"patch_size": DENSE_VISION["patch_size"], "merge_size": DENSE_VISION["spatial_merge_size"],
          "temporal_patch_size": DENSE_VISION["temporal_patch_size"],
          "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    Qwen2VLImageProcessor(**kw).save_pretrained(out_dir)
    Qwen3VLVideoProcessor(**kw).save_pretrained(out_dir)


def save_dense_target(text_model, out_dir: str, seed: int = tm.SEED) -> None:
    """Save a trained / random Qwen3_5ForCausalLM (the text model) as the Qwen3_5ForConditionalGeneration
    checkpoint SGLang loads: its weights under model.language_model.* + lm_head.weight, a seeded random
    vision tower under model.visual.*, bf16; config fixed (fix_saved_dense_config) and processor configs
    written. out_dir must already hold the tokenizer (with VISION_TOKENS)."""
    from transformers import Qwen3_5ForConditionalGeneration

    cfg = dense_config(text_model.config.eos_token_id, vision_token_ids(out_dir))
    torch.manual_seed(seed + 11)
    vl = Qwen3_5ForConditionalGeneration(cfg)
    with torch.no_grad():
        vl.model.language_model.load_state_dict(text_model.model.state_dict(), strict=True)
        vl.lm_head.weight.copy_(text_model.lm_head.weight)
    vl = vl.to(torch.bfloat16)
    vl.save_pretrained(out_dir, safe_serialization=True)
    fix_saved_dense_config(out_dir)
    write_processor_configs(out_dir)


def make_dense(out_dir):
    from transformers import Qwen3_5ForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    n_vocab, eos = tm.build_tokenizer(out_dir, extra_specials=VISION_TOKENS)
    cfg = dense_text_config(eos)
    torch.manual_seed(tm.SEED)
    model = Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():  # as make_next: make_tiny_models' recipe, PEAKED=1 biases towards its peak token
        model.lm_head.weight.normal_(0.0, 0.5)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        if tm.PEAKED:
            model.model.embed_tokens.weight[:, 0] = 8.0
            model.lm_head.weight[tm.PEAK_TOKEN, 0] = 3.0
    save_dense_target(model.to(torch.bfloat16), out_dir)
    print(f"qwen3.5 dense hybrid target: {out_dir} params={sum(p.numel() for p in model.parameters())} (text)")


def make_marker(out_dir):
    tm.make_target(out_dir)
    p = os.path.join(out_dir, "config.json")
    with open(p) as f:
        cfg = json.load(f)
    cfg["mamba_d_state"] = 16  # recurrent-only key: the offline hybrid check's evidence
    with open(p, "w") as f:
        json.dump(cfg, f, indent=2)
    print(f"marker target: {out_dir}")


# ---- the Qwen3.5 MoE hybrid made from a dense Qwen3.5 (moe35/)
# Every routed expert is the dense layer's MLP, bit for bit, and the router renormalises its top-k weights (they
# sum to 1): whatever the router picks, the MoE block computes sum_k w_k * MLP(x) = MLP(x) up to rounding. So the
# MoE target is the dense target's function (its layers' hidden states, the drafter's input, included) and a
# draft trained against the dense target is accepted by it, while SGLang runs its real MoE path (router, top-k,
# fused experts, shared expert) on every layer.
MOE_EXPERTS = 4
MOE_TOP_K = 2
MOE_SHARED_INTER = 128  # the shared expert's width (next_config's); it contributes exactly zero (moe_weights)
MOE_SEED = tm.SEED + 35


def moe_config(dense: dict, num_experts: int = MOE_EXPERTS, top_k: int = MOE_TOP_K):
    """The MoE checkpoint's Qwen3_5MoeConfig from the dense checkpoint's config.json (a dict): the same text
    shape, layer kinds, rope, token ids and vision tower, under Qwen3.5-MoE's names (model_type qwen3_5_moe,
    text qwen3_5_moe_text: the text model_type is what makes SGLang build MoE blocks), with num_experts routed
    experts of the dense MLP's width (moe_intermediate_size = the dense intermediate_size) and a shared expert.
    The dense intermediate_size is dropped: Qwen3.5-MoE's text config has no such field (SGLang's MoE code reads
    moe_intermediate_size and shared_expert_intermediate_size)."""
    from transformers import Qwen3_5MoeConfig

    text = {k: v for k, v in dense["text_config"].items() if k not in ("model_type", "intermediate_size")}
    text.update(num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=dense["text_config"]["intermediate_size"],
                shared_expert_intermediate_size=MOE_SHARED_INTER)
    vision = {k: v for k, v in dense["vision_config"].items() if k != "model_type"}
    ids = {k: dense[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    cfg.dtype = dense.get("dtype", "bfloat16")
    return cfg


def fix_saved_moe_config(out_dir: str) -> None:
    """fix_saved_dense_config (SGLang's full_attention_interval, deepstack_visual_indexes = [], ...), plus the
    MoE keys transformers 5.8.1's Qwen3_5MoeTextConfig does not write (its router always renormalises):
      * norm_topk_prob true: SGLang's TopK(renormalize=config.norm_topk_prob); its Qwen3NextConfig default is
        already true, written so that no default decides; without renormalised weights the MoE block would
        return (w_1 + w_2) * MLP(x), not the dense MLP;
      * decoder_sparse_step 1, mlp_only_layers []: every layer MoE, as SGLang's Qwen3.5 builds qwen3_5_moe_text
        regardless of them (written for readers that follow Qwen3-Next's convention)."""
    fix_saved_dense_config(out_dir)
    p = os.path.join(out_dir, "config.json")
    with open(p) as f:
        saved = json.load(f)
    saved["text_config"].update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    with open(p, "w") as f:
        json.dump(saved, f, indent=2)


def moe_weights(dense_sd: dict, num_layers: int, num_experts: int = MOE_EXPERTS, seed: int = MOE_SEED) -> dict:
    """The MoE checkpoint's tensors from the dense checkpoint's (same dtype; everything else unchanged): per layer
    mlp.{gate,up,down}_proj.weight become
      * mlp.experts.gate_up_proj [E, 2I, H] (each expert: gate | up) and mlp.experts.down_proj [E, H, I], every
        expert the dense MLP. These are the fused names Qwen3.5-MoE's published checkpoints use and SGLang's
        Qwen3_5MoeForConditionalGeneration.load_weights reads (its fused path: gate_up_proj chunked into w1 / w3,
        one expert per row); transformers 5.8.1 loads them as they are (its Qwen3_5MoeExperts parameters) --
        its save_pretrained would instead write per-expert experts.{e}.{gate,up,down}_proj.weight, which both
        also load;
      * mlp.gate.weight [E, H]: the router, seeded random N(0, 1/H) -- on RMS-normed inputs logits of spread ~1,
        so different tokens pick different experts (which picks nothing: the experts are equal);
      * mlp.shared_expert.{gate,up}_proj.weight seeded random, mlp.shared_expert.down_proj.weight ZERO, and
        mlp.shared_expert_gate.weight seeded random: the shared expert's output is down_proj(...) = 0 exactly,
        whatever sigmoid(shared_expert_gate(x)) scales it by (SGLang and transformers both build the shared
        expert whenever shared_expert_intermediate_size > 0, and load_weights must find its tensors)."""
    g = torch.Generator().manual_seed(seed)
    sd = dict(dense_sd)
    for i in range(num_layers):
        p = f"model.language_model.layers.{i}.mlp."
        gate, up, down = (sd.pop(f"{p}{x}_proj.weight") for x in ("gate", "up", "down"))
        dtype, hidden = gate.dtype, gate.shape[1]
        sd[p + "experts.gate_up_proj"] = torch.cat([gate, up], 0).unsqueeze(0).repeat(num_experts, 1, 1)
        sd[p + "experts.down_proj"] = down.unsqueeze(0).repeat(num_experts, 1, 1)
        sd[p + "gate.weight"] = (torch.randn(num_experts, hidden, generator=g) / hidden ** 0.5).to(dtype)
        sd[p + "shared_expert.gate_proj.weight"] = (0.02 * torch.randn(MOE_SHARED_INTER, hidden, generator=g)).to(dtype)
        sd[p + "shared_expert.up_proj.weight"] = (0.02 * torch.randn(MOE_SHARED_INTER, hidden, generator=g)).to(dtype)
        sd[p + "shared_expert.down_proj.weight"] = torch.zeros(hidden, MOE_SHARED_INTER, dtype=dtype)
        sd[p + "shared_expert_gate.weight"] = (0.02 * torch.randn(1, hidden, generator=g)).to(dtype)
    assert not any(".mlp.gate_proj." in k or ".mlp.up_proj." in k or ".mlp.down_proj." in k for k in sd)
    return {k: v.contiguous() for k, v in sd.items()}


def moe_target_from_dense(dense_dir: str, out_dir: str, num_experts: int = MOE_EXPERTS, top_k: int = MOE_TOP_K,
                          seed: int = MOE_SEED) -> None:
    """One dense Qwen3.5 checkpoint (save_dense_target's: a single model.safetensors) -> the MoE checkpoint in
    out_dir: config (moe_config + fix_saved_moe_config), weights (moe_weights), and every other file (tokenizer,
    generation / processor configs) copied unchanged."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(dense_dir, "config.json")) as f:
        dense = json.load(f)
    assert dense["architectures"] == ["Qwen3_5ForConditionalGeneration"], dense["architectures"]
    sd = load_file(os.path.join(dense_dir, "model.safetensors"))
    os.makedirs(out_dir, exist_ok=True)
    for name in sorted(os.listdir(dense_dir)):
        if name not in ("config.json", "model.safetensors") and os.path.isfile(os.path.join(dense_dir, name)):
            shutil.copy2(os.path.join(dense_dir, name), os.path.join(out_dir, name))
    moe_config(dense, num_experts, top_k).save_pretrained(out_dir)
    fix_saved_moe_config(out_dir)
    sd = moe_weights(sd, dense["text_config"]["num_hidden_layers"], num_experts, seed)
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def moe_from_dense(src_pair: str, out_pair: str, num_experts: int = MOE_EXPERTS, top_k: int = MOE_TOP_K,
                   seed: int = MOE_SEED) -> str:
    """SRC_PAIR/dense/{target,draft} -> OUT_PAIR/moe35/{target,draft}: the target through moe_target_from_dense,
    the DFlash draft copied unchanged (it reads the target's layers 1 and 2, which compute what they did), and
    SRC_PAIR/heldout_prompts.json (train_pair.py's) copied beside when there is one. moe35/made_from.json says
    what it was made from. Returns OUT_PAIR/moe35."""
    src = os.path.join(src_pair, "dense")
    out = os.path.join(out_pair, "moe35")
    moe_target_from_dense(os.path.join(src, "target"), os.path.join(out, "target"), num_experts, top_k, seed)
    shutil.copytree(os.path.join(src, "draft"), os.path.join(out, "draft"), dirs_exist_ok=True)
    held = os.path.join(src_pair, "heldout_prompts.json")
    if os.path.isfile(held) and not os.path.exists(os.path.join(out_pair, "heldout_prompts.json")):
        shutil.copy2(held, os.path.join(out_pair, "heldout_prompts.json"))
    with open(os.path.join(src, "target", "model.safetensors"), "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(out, "made_from.json"), "w") as f:
        json.dump({"source": os.path.abspath(src), "source_target_sha256": sha, "num_experts": num_experts,
                   "top_k": top_k, "router_seed": seed, "routed_experts": "each a copy of the dense MLP",
                   "shared_expert": "down_proj zero: contributes 0"}, f, indent=2)
    print(f"qwen3.5 moe hybrid target: {out}/target from {src}/target ({num_experts} experts, top-{top_k})")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="/tmp/tiny_h", help="OUT_DIR of the random models")
    ap.add_argument("--moe-from-dense", nargs=2, metavar=("SRC_PAIR_DIR", "OUT_DIR"),
                    help="make only OUT_DIR/moe35/{target,draft} from SRC_PAIR_DIR/dense/{target,draft}")
    ap.add_argument("--experts", type=int, default=MOE_EXPERTS)
    ap.add_argument("--top-k", type=int, default=MOE_TOP_K)
    ap.add_argument("--seed", type=int, default=MOE_SEED, help="the routers' seed")
    a = ap.parse_args(argv)
    if a.moe_from_dense:
        moe_from_dense(*a.moe_from_dense, num_experts=a.experts, top_k=a.top_k, seed=a.seed)
        return 0
    out = a.out
    tm.make_draft(os.path.join(out, "next", "draft"))
    try:
        make_next(os.path.join(out, "next", "target"))
    except Exception as e:  # the marker target still exercises the guard
        print(f"qwen3-next target failed: {type(e).__name__}: {e}")
    # No dense (MoE-free) Qwen3-Next: SGLang 0.5.13.post1 builds every Qwen3-Next layer as MoE (is_layer_sparse
    # = True; `mlp_only_layers` weights fail to load, seen on the H200); its dense GDN family is Qwen3.5, served
    # only through the vision-language wrapper: dense/. moe35/ is Qwen3.5's MoE made from it.
    try:
        make_dense(os.path.join(out, "dense", "target"))
        shutil.copytree(os.path.join(out, "next", "draft"), os.path.join(out, "dense", "draft"), dirs_exist_ok=True)
        moe_from_dense(out, out, num_experts=a.experts, top_k=a.top_k, seed=a.seed)
    except Exception as e:  # next/ and marker/ stand without them
        print(f"qwen3.5 dense / moe target failed: {type(e).__name__}: {e}")
    make_marker(os.path.join(out, "marker", "target"))
    shutil.copytree(os.path.join(out, "next", "draft"), os.path.join(out, "marker", "draft"), dirs_exist_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Tiny hybrid targets for the DDTree hybrid-guard check, plus the usual DFlash draft.

Usage: [PEAKED=1] python make_tiny_hybrid.py OUT_DIR   (PEAKED as in make_tiny_models.py: drafts get accepted)
Writes OUT_DIR/next/target  a tiny random Qwen3-Next (Gated DeltaNet + attention + MoE) that
                            SGLang loads as Qwen3NextForCausalLM (runtime hybrid_gdn_config);
       OUT_DIR/marker/target the tiny Qwen3 target of make_tiny_models.py with one recurrent-only
                            config key added: SGLang serves it as plain Qwen3, only the offline
                            config check (ddtree_utils.is_hybrid_model) calls it hybrid. A fallback
                            in case this SGLang build cannot load Qwen3-Next.
       OUT_DIR/*/draft       the DFlash draft (hidden 256, target layers [1, 2]).
"""
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


def make_marker(out_dir):
    tm.make_target(out_dir)
    p = os.path.join(out_dir, "config.json")
    with open(p) as f:
        cfg = json.load(f)
    cfg["mamba_d_state"] = 16  # recurrent-only key: the offline hybrid check's evidence
    with open(p, "w") as f:
        json.dump(cfg, f, indent=2)
    print(f"marker target: {out_dir}")


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny_h"
    tm.make_draft(os.path.join(out, "next", "draft"))
    try:
        make_next(os.path.join(out, "next", "target"))
    except Exception as e:  # the marker target still exercises the guard
        print(f"qwen3-next target failed: {type(e).__name__}: {e}")
    # No dense (MoE-free) Qwen3-Next: SGLang 0.5.13.post1 builds every Qwen3-Next layer as MoE (is_layer_sparse
    # = True; `mlp_only_layers` weights fail to load, seen on the H200); its dense GDN family is Qwen3.5, served
    # only through the vision-language wrapper.
    make_marker(os.path.join(out, "marker", "target"))
    shutil.copytree(os.path.join(out, "next", "draft"), os.path.join(out, "marker", "draft"), dirs_exist_ok=True)

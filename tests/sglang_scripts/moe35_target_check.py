"""A Qwen3.5 MoE hybrid target made from a dense Qwen3.5 (bench/gpu/make_tiny_hybrid.py moe35/, --moe-from-dense)
read by SGLang 0.5.13.post1 and by transformers, on CPU, against the dense checkpoint it was made from.

Usage: python moe35_target_check.py MOE_TARGET_DIR[=DENSE_TARGET_DIR] ...   prints one JSON object per directory.
Without =DENSE_TARGET_DIR the dense source is MOE_TARGET_DIR/../../dense/target (make_tiny_hybrid's default run
writes both side by side); without one there, only SGLang's reading of the MoE target is reported.

transformers (first, before sglang is imported; float32, so that bf16 rounding is not what is compared):
  * Qwen3_5MoeForConditionalGeneration.from_pretrained reports no missing / unexpected / mismatched tensor;
  * every routed expert equals the dense MLP bit for bit (experts.gate_up_proj[e] = gate | up, down_proj[e]);
  * each layer's MoE block, fed the dense model's own MLP inputs on the prompts (forward pre-hooks), against the
    dense MLP: max |diff| (float32 rounding: sum_k w_k * MLP(x) with sum_k w_k = 1 up to one ulp); the shared
    expert's output (must be exactly 0); the router's top-k sets across those tokens (must vary);
  * whole model: every layer's hidden state and the logits against the dense model's (max |diff|), and the greedy
    continuations (12 tokens) of the prompts (train_pair's held-out prompts beside the pair when there are any,
    else fixed token ids).
SGLang (as tests/sglang_scripts/dense_target_check.py; what is SGLang's and what stands in is said there):
  * config: `ModelConfig(path)`, the architecture through `ModelRegistry.resolve_model_cls`, the runner's
    `hybrid_gdn_config` / `mambaish_config`, the MoE fields of the text config it hands the model;
  * model: `Qwen3_5MoeForConditionalGeneration(hf_config)` built for real on CPU: its MoE blocks (router, TopK,
    FusedMoE, shared expert) as built;
  * weights: every parameter NaN, then the model's own `load_weights` on the checkpoint's names and tensors, then
    each module's quant_method.process_weights_after_loading (as SGLang's loader does); every parameter finite
    afterwards, no loader warning, packed tensors equal to the checkpoint's pieces (experts.w13_weight[e] = the
    fused gate_up_proj[e], w2_weight = down_proj, shared_expert.gate_up_proj = gate | up, qkv, GDN in_proj_*);
  * SGLang's own MoE block forward on CPU (SGLANG_USE_CPU_ENGINE: its torch-native MoE path, not the GPU's Triton
    kernel) on seeded N(0, 1) inputs against the dense MLP computed from the dense checkpoint's tensors;
  * processor: as dense_target_check (get_processor, the tokenizer's ids, get_mm_processor).
The whole model's forward is not run in SGLang: its GDN layers need the linear-attention backend and Triton.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dense_target_check as dtc  # noqa: E402  (its import puts bench/gpu on sys.path too)

LM = dtc.LM
PROMPTS = [[11, 12, 13], [100, 7, 7, 42, 5, 9], [2000, 1]]  # make_tiny_hybrid's tests' token ids


def prompts_for(moe_dir: Path) -> list[list[int]]:
    """train_pair.py's held-out prompts (first 3, 40 tokens each) when the pair has them, else PROMPTS."""
    held = moe_dir.parent.parent / "heldout_prompts.json"
    if held.is_file():
        got = [p["input_ids"][:40] for p in json.loads(held.read_text())["prompts"]][:3]
        if got:
            return got
    return PROMPTS


def _greedy(model, ids, n=12):
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def transformers_view(moe_dir: str, dense_dir: str, prompts: list[list[int]] | None = None) -> dict:
    """The MoE target against its dense source in transformers, float32 (see the module docstring)."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    prompts = prompts or prompts_for(Path(moe_dir))
    out: dict = {"prompts": prompts}
    moe, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(moe_dir, dtype=torch.float32,
                                                                   output_loading_info=True)
    dense = Qwen3_5ForConditionalGeneration.from_pretrained(dense_dir, dtype=torch.float32).eval()
    moe = moe.eval()
    out["class"] = type(moe).__name__
    out["loading_info"] = {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs"}
    out["loading_errors"] = [str(e) for e in info.get("error_msgs", [])]
    mlayers, dlayers = moe.model.language_model.layers, dense.model.language_model.layers
    out["moe_block_class"] = sorted({type(layer.mlp).__name__ for layer in mlayers})

    experts_equal = []
    for m, d in zip(mlayers, dlayers, strict=True):
        gu = torch.cat([d.mlp.gate_proj.weight, d.mlp.up_proj.weight], 0)
        experts_equal.append(all(torch.equal(m.mlp.experts.gate_up_proj[e], gu)
                                  and torch.equal(m.mlp.experts.down_proj[e], d.mlp.down_proj.weight)
                                  for e in range(m.mlp.experts.num_experts)))
    out["experts_equal_dense_mlp"] = experts_equal
    # every tensor that is not MoE is the dense one (embeddings, GDN, attention, norms, lm_head, vision tower)
    dsd = dense.state_dict()
    others = {k: v for k, v in moe.state_dict().items() if ".mlp." not in k or k.startswith("model.visual.")}
    out["non_moe_tensors"] = len(others)
    out["non_moe_tensors_differing"] = sorted(k for k, v in others.items() if k not in dsd or not torch.equal(v, dsd[k]))

    # each block on the dense model's own MLP inputs
    captured: dict[int, list] = {i: [] for i in range(len(dlayers))}
    hooks = [layer.mlp.register_forward_pre_hook(lambda _m, args, i=i: captured[i].append(args[0].reshape(-1, args[0].shape[-1])))
             for i, layer in enumerate(dlayers)]
    hs_diff, hs_scale, logit_diff = [], [], []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            do = dense(input_ids=x, output_hidden_states=True)
            mo = moe(input_ids=x, output_hidden_states=True)
            hs_diff.append([float((a - b).abs().max()) for a, b in zip(do.hidden_states, mo.hidden_states, strict=True)])
            hs_scale.append([float(a.abs().max()) for a in do.hidden_states])
            logit_diff.append(float((do.logits - mo.logits).abs().max()))
    for h in hooks:
        h.remove()
    out["hidden_state_max_abs_diff"] = [max(r[i] for r in hs_diff) for i in range(len(hs_diff[0]))]
    out["hidden_state_max_abs"] = [max(r[i] for r in hs_scale) for i in range(len(hs_scale[0]))]
    out["logits_max_abs_diff"] = max(logit_diff)
    blocks = []
    with torch.no_grad():
        for i, (m, d) in enumerate(zip(mlayers, dlayers, strict=True)):
            x = torch.cat(captured[i], 0)
            ref = d.mlp(x)
            got = m.mlp(x[None])[0]
            _, weights, idx = m.mlp.gate(x)
            sets = sorted({tuple(sorted(r)) for r in idx.tolist()})
            blocks.append({"tokens": x.shape[0], "max_abs_diff": float((got - ref).abs().max()),
                           "ref_max_abs": float(ref.abs().max()),
                           "shared_expert_max_abs": float(m.mlp.shared_expert(x).abs().max()),
                           "topk_weight_sum_max_dev": float((weights.sum(-1) - 1).abs().max()),
                           "topk_sets": [list(s) for s in sets],
                           "expert_tokens": torch.bincount(idx.flatten(), minlength=m.mlp.experts.num_experts).tolist()})
    out["blocks"] = blocks
    out["greedy_moe"] = [_greedy(moe, p) for p in prompts]
    out["greedy_dense"] = [_greedy(dense, p) for p in prompts]
    out["greedy_equal"] = out["greedy_moe"] == out["greedy_dense"]
    return out


def sglang_view(d: str, dense_dir: str | None) -> dict:
    import torch
    from safetensors.torch import load_file

    out, mc, cls = dtc.config_view(d)
    tc = mc.hf_text_config
    out["moe_config"] = {k: getattr(tc, k, None) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                          "shared_expert_intermediate_size", "norm_topk_prob")}
    model = dtc.build(cls, mc)
    out["mlp_classes"] = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith(".mlp")})
    out["moe_blocks"] = [{"experts": type(layer.mlp.experts).__name__, "num_experts": layer.mlp.experts.num_experts,
                          "top_k": layer.mlp.topk.topk_config.top_k,
                          "renormalize": layer.mlp.topk.topk_config.renormalize,
                          "shared_expert": type(layer.mlp.shared_expert).__name__,
                          "fused_shared_experts": layer.mlp.num_fused_shared_experts}
                         for layer in model.model.layers]
    out["deepstack_mergers"] = len(getattr(model.visual, "deepstack_merger_list", []) or [])
    loaded, sd, pd = dtc.load_view(model, d, after_loading=True)
    out.update(loaded)
    out["checkpoint_expert_names"] = sorted({k.split(".mlp.", 1)[1] for k in sd if ".mlp." in k and "visual" not in k})
    pairs = dtc.packed_pairs(sd)
    for i in range(len(model.model.layers)):
        p = f"{LM}layers.{i}.mlp."
        pairs[f"model.layers.{i}.mlp.experts.w13_weight"] = sd[p + "experts.gate_up_proj"].float()
        pairs[f"model.layers.{i}.mlp.experts.w2_weight"] = sd[p + "experts.down_proj"].float()
        pairs[f"model.layers.{i}.mlp.gate.weight"] = sd[p + "gate.weight"].float()
        pairs[f"model.layers.{i}.mlp.shared_expert.gate_up_proj.weight"] = dtc.cat(
            sd, p + "shared_expert.gate_proj.weight", p + "shared_expert.up_proj.weight")
        pairs[f"model.layers.{i}.mlp.shared_expert.down_proj.weight"] = sd[p + "shared_expert.down_proj.weight"].float()
    out["packed_equal"] = {k: bool(torch.equal(pd[k].data, v)) for k, v in pairs.items()}

    if dense_dir:  # SGLang's MoE block (router, TopK, FusedMoE's CPU path, shared expert) against the dense MLP
        F = torch.nn.functional
        dsd = load_file(str(Path(dense_dir) / "model.safetensors"))
        x = torch.randn(64, tc.hidden_size, generator=torch.Generator().manual_seed(0))
        blocks = []
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                g, u, dn = (dsd[f"{LM}layers.{i}.mlp.{k}_proj.weight"].float() for k in ("gate", "up", "down"))
                ref = F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), dn)
                got = layer.mlp(x.clone())
                logits, _ = layer.mlp.gate(x)
                sets = {tuple(sorted(r)) for r in logits.topk(tc.num_experts_per_tok, -1).indices.tolist()}
                blocks.append({"max_abs_diff": float((got - ref).abs().max()), "ref_max_abs": float(ref.abs().max()),
                               "shared_expert_max_abs": float(layer.mlp._forward_shared_experts(x).abs().max()),
                               "topk_sets": len(sets)})
        out["moe_block_vs_dense"] = blocks
    out.update(dtc.processor_view(d, mc))
    return out


def parse(arg: str) -> tuple[str, str | None]:
    moe, _, dense = arg.partition("=")
    if not dense:
        guess = Path(moe).resolve().parent.parent / "dense" / "target"
        dense = str(guess) if (guess / "config.json").is_file() else ""
    return moe, dense or None


def main() -> int:
    import check_pair_sglang as cps

    pairs = [parse(a) for a in sys.argv[1:]]
    views = [{"dir": m, "dense": d, "transformers": transformers_view(m, d) if d else None} for m, d in pairs]
    cps.sglang_cpu_init(pairs[0][0])
    for (m, d), v in zip(pairs, views, strict=True):
        v["sglang"] = sglang_view(m, d)
        print(json.dumps(v), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

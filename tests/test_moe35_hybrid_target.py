"""The Qwen3.5 MoE hybrid target made from a dense Qwen3.5 (bench/gpu/make_tiny_hybrid.py: moe35/ of its default
run, from its random dense/; --moe-from-dense on train_pair.py --dense-hybrid's trained pair, --tiny here) on CPU:
  * the checkpoint: Qwen3_5MoeForConditionalGeneration, the dense config with Qwen3.5-MoE's names and MoE keys,
    the fused expert tensors of Qwen3.5-MoE's published checkpoints, every routed expert the dense MLP, the shared
    expert's down projection zero, a seeded random router per layer, every other tensor and file the dense one's;
    the draft and held-out prompts copied unchanged; made twice, the same bytes;
  * transformers (float32, tests/sglang_scripts/moe35_target_check.py's transformers_view) loads it with no
    tensor missing or unexpected and computes the dense target's function: each MoE block on the dense model's
    own MLP inputs equals the dense MLP to float32 rounding (relative 1e-5: the block returns
    sum_k w_k * MLP(x) with sum_k w_k = 1 up to an ulp, and the experts' matmuls run on token subsets; ~1e-7
    seen), the shared expert returns exactly 0, every layer's hidden state (what the drafter reads) and the
    logits agree to rounding, and greedy continuations are equal token for token -- while the router sends
    tokens to different expert pairs;
  * SGLang 0.5.13.post1 (the same script, one sglang import) reads it as a GDN hybrid with MoE
    (Qwen3_5MoeTextConfig, num_experts / top-k / widths / norm_topk_prob as written), builds
    Qwen3_5MoeForConditionalGeneration with a Qwen2MoeSparseMoeBlock (FusedMoE, renormalised TopK, shared
    expert) in every layer, fills every parameter through its own load_weights (the fused expert names included),
    and its MoE block on CPU equals the dense MLP to float32 rounding;
  * the payload's offline check classes it gated-deltanet on qwen3.5-moe, which the H200 proof lifted (served).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ddtree_oracle import load_ddtree_utils
from tiny_hybrid_makers import GPU, tiny_hybrid_makers

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "sglang_scripts" / "moe35_target_check.py"
ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "TOKENIZERS_PARALLELISM": "false"}
MOE_KEYS = {"num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 128,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
REL = 1e-5  # float32 rounding, relative to the compared values' scale (see the module docstring)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """make_tiny_hybrid's default run (next/, dense/, moe35/, marker/; in this process), and moe35/ made a second
    time from its dense/ (moe_from_dense) for the determinism check."""
    mth, tm = tiny_hybrid_makers()
    root = tmp_path_factory.mktemp("moe35")
    old, tm.PEAKED = tm.PEAKED, False  # the random set, whatever PEAKED says in the environment
    try:
        assert mth.main([str(root / "h")]) == 0
    finally:
        tm.PEAKED = old
    mth.moe_from_dense(str(root / "h"), str(root / "again"))
    return {"pair": root / "h", "random": root / "h" / "moe35" / "target", "dense": root / "h" / "dense" / "target",
            "again": root / "again" / "moe35" / "target"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """train_pair.py --dense-hybrid --tiny's pair (as tests/test_dense_hybrid_target.py), then the CLI
    `make_tiny_hybrid.py --moe-from-dense PAIR OUT`."""
    tiny_hybrid_makers()
    root = tmp_path_factory.mktemp("pm")
    pd, pm = root / "pd", root / "pm"
    r = subprocess.run([sys.executable, str(GPU / "train_pair.py"), str(pd), "--dense-hybrid", "--tiny",
                        "--device", "cpu", "--target-steps", "6", "--draft-steps", "3", "--traj-rows", "4",
                        "--prompts", "3"], capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = subprocess.run([sys.executable, str(GPU / "make_tiny_hybrid.py"), "--moe-from-dense", str(pd), str(pm)],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {"src": pd, "pair": pm, "target": pm / "moe35" / "target", "dense": pd / "dense" / "target"}


@pytest.fixture(scope="module")
def view(made, trained) -> dict:
    """moe35_target_check.py's JSON for the random and the trained MoE target, each against its dense source."""
    pytest.importorskip("sglang")
    args = [f"{made['random']}={made['dense']}", f"{trained['target']}={trained['dense']}"]
    r = subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=300, env=ENV,
                       cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return {"random": rows[0], "trained": rows[1]}


def _targets(made, trained):
    return {"random": (made["random"], made["dense"]), "trained": (trained["target"], trained["dense"])}


@pytest.mark.parametrize("which", ["random", "trained"])
def test_config_is_the_dense_one_under_qwen35_moe_names(made, trained, which):
    moe_dir, dense_dir = _targets(made, trained)[which]
    cfg = json.loads((moe_dir / "config.json").read_text())
    dense = json.loads((dense_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and cfg["model_type"] == "qwen3_5_moe"
    t, dt = cfg["text_config"], dense["text_config"]
    assert t["model_type"] == "qwen3_5_moe_text"  # what makes SGLang build MoE blocks
    assert {k: t[k] for k in MOE_KEYS} == MOE_KEYS
    assert t["moe_intermediate_size"] == dt["intermediate_size"] and "intermediate_size" not in t
    # everything else is the dense text config (transformers' additions: the router's loss keys)
    moe_only = set(MOE_KEYS) | {"moe_intermediate_size", "output_router_logits", "router_aux_loss_coef"}
    assert {k: v for k, v in t.items() if k not in moe_only and k != "model_type"} == \
        {k: v for k, v in dt.items() if k not in ("model_type", "intermediate_size")}
    assert t["full_attention_interval"] == 4 and t["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    v, dv = cfg["vision_config"], dense["vision_config"]
    assert v["model_type"] == "qwen3_5_moe_vision" and v["deepstack_visual_indexes"] == []
    assert {k: x for k, x in v.items() if k != "model_type"} == {k: x for k, x in dv.items() if k != "model_type"}
    for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
              "tie_word_embeddings", "dtype"):
        assert cfg[k] == dense[k], k
    # every other file of the target is the dense one's, byte for byte
    names = {p.name for p in dense_dir.iterdir()} - {"config.json", "model.safetensors"}
    assert names >= {"tokenizer.json", "preprocessor_config.json", "video_preprocessor_config.json"}
    assert {p.name for p in moe_dir.iterdir()} == names | {"config.json", "model.safetensors"}
    for n in names:
        assert (moe_dir / n).read_bytes() == (dense_dir / n).read_bytes(), n


@pytest.mark.parametrize("which", ["random", "trained"])
def test_checkpoint_has_the_fused_experts_of_qwen35_moe(made, trained, which):
    import torch
    from safetensors.torch import load_file

    moe_dir, dense_dir = _targets(made, trained)[which]
    sd, dsd = load_file(str(moe_dir / "model.safetensors")), load_file(str(dense_dir / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    routers = []
    for i in range(4):
        p = f"model.language_model.layers.{i}.mlp."
        assert not any(k.startswith(p + x) for k in sd for x in ("gate_proj", "up_proj", "down_proj"))
        g, u, d = (dsd[f"{p}{x}_proj.weight"] for x in ("gate", "up", "down"))
        assert sd[p + "experts.gate_up_proj"].shape == (4, 1024, 256) and sd[p + "experts.down_proj"].shape == (4, 256, 512)
        for e in range(4):  # every routed expert is the dense MLP, bit for bit
            assert torch.equal(sd[p + "experts.gate_up_proj"][e], torch.cat([g, u], 0))
            assert torch.equal(sd[p + "experts.down_proj"][e], d)
        assert not sd[p + "shared_expert.down_proj.weight"].any()  # the shared expert returns exactly 0
        assert sd[p + "shared_expert.gate_proj.weight"].shape == (128, 256)
        assert sd[p + "gate.weight"].shape == (4, 256) and sd[p + "gate.weight"].float().std() > 0.03
        routers.append(sd[p + "gate.weight"])
    assert not any(torch.equal(routers[0], r) for r in routers[1:])  # a router of its own per layer
    assert len(sd) == len(dsd) - 4 * 3 + 4 * 7
    for k, v in dsd.items():  # embeddings, GDN, attention, norms, lm_head, vision tower unchanged
        if ".mlp." not in k or k.startswith("model.visual."):
            assert torch.equal(sd[k], v), k


def test_made_twice_the_same_bytes(made):
    for f in ("model.safetensors", "config.json"):
        assert _sha(made["random"] / f) == _sha(made["again"] / f), f


def test_default_run_and_cli_lay_out_the_pair(made, trained):
    """make_tiny_hybrid's default run writes moe35/ beside dense/ (what run_device.sh's LIMITS_SET=hm serves);
    --moe-from-dense writes OUT/moe35/{target,draft} + OUT/heldout_prompts.json from a trained pair."""
    for pair, src in ((made["pair"], made["pair"]), (trained["pair"], trained["src"])):
        for d in ("target", "draft"):
            assert (pair / "moe35" / d / "config.json").is_file()
        for f in ("config.json", "model.safetensors"):  # the drafter, unchanged
            assert (pair / "moe35" / "draft" / f).read_bytes() == (src / "dense" / "draft" / f).read_bytes()
        made_from = json.loads((pair / "moe35" / "made_from.json").read_text())
        assert made_from["source"] == str((src / "dense").resolve())
        assert made_from["source_target_sha256"] == _sha(src / "dense" / "target" / "model.safetensors")
    assert (made["pair"] / "dense" / "target" / "config.json").is_file()
    assert (made["pair"] / "next" / "target").is_dir() and (made["pair"] / "marker" / "target").is_dir()
    held = trained["pair"] / "heldout_prompts.json"
    assert held.read_bytes() == (trained["src"] / "heldout_prompts.json").read_bytes()


@pytest.mark.parametrize("which", ["random", "trained"])
def test_transformers_computes_the_dense_function(view, which):
    t = view[which]["transformers"]
    assert t["class"] == "Qwen3_5MoeForConditionalGeneration" and t["moe_block_class"] == ["Qwen3_5MoeSparseMoeBlock"]
    assert t["loading_info"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    assert t["loading_errors"] == []
    assert t["experts_equal_dense_mlp"] == [True] * 4
    assert t["non_moe_tensors"] == 65 and t["non_moe_tensors_differing"] == []
    for b in t["blocks"]:
        assert b["max_abs_diff"] <= REL * b["ref_max_abs"], b
        assert b["shared_expert_max_abs"] == 0.0
        assert b["topk_weight_sum_max_dev"] <= 2.5e-7  # renormalised: the top-k weights sum to 1 (float32)
    for diff, scale in zip(t["hidden_state_max_abs_diff"], t["hidden_state_max_abs"], strict=True):
        assert diff <= REL * scale  # the drafter's inputs (layers 1, 2) included
    assert t["hidden_state_max_abs_diff"][0] == 0.0  # the embeddings
    assert t["logits_max_abs_diff"] <= 1e-4
    assert t["greedy_equal"] is True and t["greedy_moe"] == t["greedy_dense"]
    assert all(len(g) == 12 for g in t["greedy_moe"])
    if which == "trained":  # train_pair's held-out prompts (the pair's heldout_prompts.json), not the fixed ids
        assert len(t["prompts"]) == 3 and all(len(p) > 6 for p in t["prompts"])


@pytest.mark.parametrize("which", ["random", "trained"])
def test_the_router_really_routes(view, which):
    """Different tokens go to different expert pairs, in every layer, and every expert is chosen somewhere. On the
    random target no expert is in every token's pair either; the --tiny pair (6 training steps) leaves its layer 3
    MLP input dominated by one direction (mean vector norm ~15 of ~16), so there one expert is in every pair (the
    H200-trained .gpu/pair_hd's MoE routes evenly: all 6 pairs in every layer, each expert 15-33 % of the picks)."""
    t = view[which]["transformers"]
    used = [0] * 4
    for b in t["blocks"]:
        assert len(b["topk_sets"]) >= 3, b  # of the 6 possible pairs
        if which == "random":
            assert max(b["expert_tokens"]) < b["tokens"], b  # no expert took every token
        used = [a + c for a, c in zip(used, b["expert_tokens"], strict=True)]
    assert min(used) > 0, used
    for b in view[which]["sglang"]["moe_block_vs_dense"]:
        assert b["topk_sets"] >= 3, b


@pytest.mark.parametrize("which", ["random", "trained"])
def test_sglang_reads_a_gdn_hybrid_with_moe(view, which):
    v = view[which]["sglang"]
    assert v["arch"] == "Qwen3_5MoeForConditionalGeneration"
    assert v["model_class"] == "sglang.srt.models.qwen3_5.Qwen3_5MoeForConditionalGeneration"
    assert v["hf_config_class"] == "Qwen3_5MoeConfig" and v["text_config_class"] == "Qwen3_5MoeTextConfig"
    assert v["hybrid_gdn_config"] == "Qwen3_5MoeTextConfig" and v["mambaish_config"] == "Qwen3_5MoeTextConfig"
    assert v["text_model_type"] == "qwen3_5_moe_text"
    assert v["layers_block_type"] == ["linear_attention"] * 3 + ["attention"] and v["mamba_layers"] == [0, 1, 2]
    assert v["mamba_dtype"]["temporal"] == "torch.float32"
    assert v["moe_config"] == {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 512,
                               "shared_expert_intermediate_size": 128, "norm_topk_prob": True}
    # every decoder layer's MLP is SGLang's MoE block (no dense Qwen2MoeMLP as a layer MLP)
    assert v["mlp_classes"] == ["Qwen2MoeSparseMoeBlock", "Qwen3_VisionMLP"]
    assert v["moe_blocks"] == [{"experts": "FusedMoE", "num_experts": 4, "top_k": 2, "renormalize": True,
                                "shared_expert": "Qwen2MoeMLP", "fused_shared_experts": 0}] * 4
    assert v["deepstack_mergers"] == 0
    assert v["is_multimodal"] is True and v["is_mrope"] is True


@pytest.mark.parametrize("which", ["random", "trained"])
def test_sglang_load_weights_fills_every_parameter(view, which):
    v = view[which]["sglang"]
    assert v["checkpoint_expert_names"] == ["experts.down_proj", "experts.gate_up_proj", "gate.weight",
                                            "shared_expert.down_proj.weight", "shared_expert.gate_proj.weight",
                                            "shared_expert.up_proj.weight", "shared_expert_gate.weight"]
    assert v["checkpoint_tensors"] == 93  # the dense checkpoint's 77, less 3 MLP tensors, plus 7 MoE ones, per layer
    assert v["loader_warnings"] == []
    assert v["params_with_nan"] == []  # every parameter written (all were NaN before load_weights)
    # as for the dense target: only GDN's A_log / dt_bias (one Parameter under two names) go unnamed
    assert all(n.endswith((".linear_attn.attn.A_log", ".linear_attn.attn.dt_bias"))
               for n in v["params_not_loaded_by_name"]), v["params_not_loaded_by_name"]
    assert v["packed_equal"] and all(v["packed_equal"].values()), v["packed_equal"]
    assert sum(".mlp.experts.w13_weight" in k for k in v["packed_equal"]) == 4


@pytest.mark.parametrize("which", ["random", "trained"])
def test_sglang_moe_block_computes_the_dense_mlp(view, which):
    for b in view[which]["sglang"]["moe_block_vs_dense"]:
        assert b["max_abs_diff"] <= REL * b["ref_max_abs"], b
        assert b["shared_expert_max_abs"] == 0.0


@pytest.mark.parametrize("which", ["random", "trained"])
def test_sglang_loads_the_processor(view, which):
    v = view[which]["sglang"]
    assert v["processor_class"] == "Qwen3VLProcessor" and v["mm_processor_class"] == "QwenVLImageProcessor"
    assert v["tokenizer_ids_equal"] is True


def test_payload_classes_it_gated_deltanet_on_qwen35_moe(made, trained):
    du = load_ddtree_utils()
    for d in (made["random"], trained["target"]):
        cfg = json.loads((d / "config.json").read_text())
        hybrid, why = du.is_hybrid_model(cfg)
        assert hybrid, why
        assert du.hybrid_kind(cfg) == ("gated-deltanet", "qwen3.5-moe")
        assert du.full_mode_refusal(cfg) is None  # proven on the H200 (bench/RESULTS.md)

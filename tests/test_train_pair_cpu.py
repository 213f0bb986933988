"""bench/gpu/train_pair.py on CPU (issue 14 item 1): a --tiny run (a few steps on a few stdlib files)
writes a target and a DFlash draft in make_tiny_models' layout, the losses fall, the report holds the
evaluation, and the pair is deterministic given the seed; check_pair_sglang.py finds our torch drafter
equal to SGLang's DFlashDraftModel (and its target features to SGLang's capture) and a wrong drafter
different.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

GPU = Path(__file__).resolve().parents[1] / "bench" / "gpu"
ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _mod(name):
    if str(GPU) not in sys.path:
        sys.path.insert(0, str(GPU))
    return __import__(name)


def _run_tiny(out: Path, *extra: str) -> subprocess.CompletedProcess:
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    r = subprocess.run([sys.executable, str(GPU / "train_pair.py"), str(out), "--tiny", "--device", "cpu",
                        "--report", str(out / "train_report.json"), *extra],
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pair")
    _run_tiny(out)
    return out


def _safetensors_layout(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118


def test_target_layout_is_make_tiny_models(pair, tmp_path):
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    mtm = _mod("make_tiny_models")
    cfg = json.loads((pair / "target" / "config.json").read_text())
    # what make_tiny_models.make_target saves for the same config (its init does not change the layout)
    ref = Qwen3ForCausalLM(mtm.target_config(cfg["eos_token_id"])).to(torch.bfloat16)
    ref.save_pretrained(str(tmp_path / "ref"), safe_serialization=True)
    assert cfg == json.loads((tmp_path / "ref" / "config.json").read_text())
    assert cfg["hidden_size"] == mtm.HIDDEN and cfg["vocab_size"] == mtm.VOCAB and not cfg["tie_word_embeddings"]
    got = _safetensors_layout(pair / "target" / "model.safetensors")
    assert got == _safetensors_layout(tmp_path / "ref" / "model.safetensors")
    assert all(dt == "BF16" for _, dt in got.values())
    tok = AutoTokenizer.from_pretrained(str(pair / "target"))
    assert tok.eos_token == "<|endoftext|>" and tok.convert_tokens_to_ids("<|endoftext|>") == cfg["eos_token_id"]
    dcfg = json.loads((pair / "draft" / "config.json").read_text())
    assert tok.convert_tokens_to_ids("<|MASK|>") == dcfg["dflash_config"]["mask_token_id"] < mtm.VOCAB


# config.json of the tiny target as transformers 5.8.1 (SGLang 0.5.13.post1's) and 5.12.1 (SGLang 0.5.17's) both
# write it, bar "transformers_version": SGLang reads this file itself (Qwen3: rope_parameters["rope_theta"] before
# a top-level rope_theta, tie_word_embeddings, head_dim), so the same pair serves on either version
SAVED_TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "dtype": "bfloat16",
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 256, "initializer_range": 0.02, "intermediate_size": 512,
    "layer_types": ["full_attention"] * 4, "max_position_embeddings": 4096, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "sliding_window": None, "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
    "vocab_size": 4096,
}


def test_target_config_and_weights_are_version_independent(pair):
    """What SGLang loads (config.json, model.safetensors' names / shapes / dtypes) is the same whichever
    transformers (5.8.1, 5.12.1) trained and saved the pair; the reload check compared weights and buffers."""
    cfg = json.loads((pair / "target" / "config.json").read_text())
    eos = cfg["eos_token_id"]
    got = {k: v for k, v in cfg.items() if k != "transformers_version"}
    assert got == {**SAVED_TARGET_CONFIG, "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}
    layout = _safetensors_layout(pair / "target" / "model.safetensors")
    assert layout["lm_head.weight"] == ((4096, 256), "BF16") == layout["model.embed_tokens.weight"]
    assert not any("rotary" in k or "inv_freq" in k for k in layout)
    assert len(layout) == 3 + 4 * 11
    rc = json.loads((pair / "train_report.json").read_text())["target"]["reload_check"]
    assert rc["greedy_equal"] is True and rc["state_differences"] == []


def test_cast_weights_keeps_the_rotary_inv_freq_fp32(tmp_path):
    """The reload check's cause (the GPU run with transformers 5.12.1 failed it): nn.Module.to(bf16) also casts
    the rotary inv_freq buffers (not saved), from_pretrained(dtype=bf16) computes them in fp32, so the model in
    memory computed other logits than the checkpoint it saved. cast_weights casts the parameters only: the
    reload gives back the same weights, buffers and logits; .to() does not."""
    import torch
    from transformers import Qwen3ForCausalLM

    mtm, tp = _mod("make_tiny_models"), _mod("train_pair")
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(mtm.target_config(0))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    naive = Qwen3ForCausalLM(mtm.target_config(0))
    naive.load_state_dict(m.state_dict())
    naive = naive.to(torch.bfloat16).eval()
    m = tp.cast_weights(m, torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert {n: b.dtype for n, b in m.named_buffers()} == {
        "model.rotary_emb.inv_freq": torch.float32, "model.rotary_emb.original_inv_freq": torch.float32}
    m.save_pretrained(str(tmp_path / "t"), safe_serialization=True)
    r = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "t"), dtype=torch.bfloat16).eval()
    assert tp.state_differences(m, r) == []
    assert tp.state_differences(naive, r) == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    x = torch.randint(4, 4096, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lm, lr, ln = m(x).logits, r(x).logits, naive(x).logits
    assert torch.equal(lm, lr)
    assert not torch.equal(ln, lr)


def test_draft_layout_is_make_tiny_models(pair):
    mtm, tp = _mod("make_tiny_models"), _mod("train_pair")
    dcfg = json.loads((pair / "draft" / "config.json").read_text())
    mask = dcfg["dflash_config"]["mask_token_id"]
    # same keys and values as make_tiny_models, bar the mask id and the layer count
    assert dcfg == mtm.draft_config(mask, num_layers=tp.DRAFT_LAYERS)
    assert dcfg["architectures"] == ["DFlashDraftModel"] and dcfg["dflash_config"]["block_size"] == 16
    assert dcfg["dflash_config"]["target_layer_ids"] == [1, 2]
    want = {n: (tuple(s), "BF16") for n, s, _ in mtm.draft_weight_specs(tp.DRAFT_LAYERS)}
    assert _safetensors_layout(pair / "draft" / "model.safetensors") == want


def test_losses_fall_and_report_has_the_fields(pair):
    r = json.loads((pair / "train_report.json").read_text())
    for key in ("seed", "device", "versions", "corpus", "target", "draft", "eval", "wall_s", "reproduce",
                "hyperparameters", "deterministic"):
        assert key in r, key
    assert r["seed"] == 0 and r["device"] == "cpu" and r["tiny"] is True
    t, d = r["target"], r["draft"]
    assert t["steps"] == 25 and d["steps"] == 15 and t["wall_s"] > 0 and d["wall_s"] > 0
    assert t["loss"]["last"] < t["loss"]["first"] - 0.5, t["loss"]  # from ~ln(4096) = 8.3
    assert d["loss"]["last"] < d["loss"]["first"], d["loss"]
    assert t["checkpoint_bytes"]["model.safetensors"] > 1_000_000 and d["checkpoint_bytes"]["model.safetensors"] > 0
    c = r["corpus"]
    assert c["files_train"] > 0 and c["files_heldout"] > 0 and c["tokens_heldout"] > 0
    e = r["eval"]
    for part in ("target_heldout", "target_train"):
        assert 0.0 <= e[part]["top1"] <= 1.0 and e[part]["loss"] > 0 and e[part]["tokens"] > 0
    dh = e["draft_heldout"]
    assert dh["blocks"] == 8
    for k in (1, 4, 8):
        assert len(dh[f"per_position_top{k}"]) == 15
    for a, b, c8 in zip(dh["per_position_top1"], dh["per_position_top4"], dh["per_position_top8"], strict=True):
        assert 0.0 <= a <= b <= c8 <= 1.0
    assert 1.0 <= dh["mean_accept_length"] <= 16.0
    assert sum(dh["accept_length_hist"]) == dh["blocks"] and dh["accept_length_hist"][0] == 0
    mean_from_hist = sum(i * n for i, n in enumerate(dh["accept_length_hist"])) / dh["blocks"]
    assert abs(mean_from_hist - dh["mean_accept_length"]) < 1e-9
    # a chain accepts position k only if it accepted 1..k-1: P(accept >= k + 1) <= top-1 at k
    n_ge = [sum(dh["accept_length_hist"][j:]) / dh["blocks"] for j in range(2, 17)]
    assert all(x <= p + 1e-9 for x, p in zip(n_ge, dh["per_position_top1"], strict=True))


def test_heldout_prompts_come_from_heldout_files(pair):
    from tokenizers import Tokenizer

    tp = _mod("train_pair")
    p = json.loads((pair / "heldout_prompts.json").read_text())
    tok = Tokenizer.from_file(str(pair / "target" / "tokenizer.json"))
    assert len(p["prompts"]) == 8
    for q in p["prompts"]:
        assert tp.is_heldout(q["file"], 5.0), q["file"]
        assert 64 <= q["n_tokens"] <= 256 and q["n_tokens"] == len(q["input_ids"])
        assert tok.encode(q["text"], add_special_tokens=False).ids == q["input_ids"]


def test_greedy_block_and_features_match_hf(pair):
    """The distillation labels (our KV-cache greedy loop) equal HF generate's greedy output, and the
    context features are the outputs of target layers 1 and 2 (HF hidden_states[2], [3])."""
    import torch
    from transformers import Qwen3ForCausalLM

    tp = _mod("train_pair")
    m = Qwen3ForCausalLM.from_pretrained(str(pair / "target"), dtype=torch.float32).eval()
    _assert_greedy_block_is_hf(tp, m, rows=3)


def test_greedy_trajectories_are_greedy_continuations_of_every_prefix(pair):
    """The drafter's training rows: for every anchor a >= p, trajectory[a:a + 16] is what greedy_block
    (the target's own greedy decode) continues trajectory[:a] with, so each row's labels are the
    server's greedy verify targets. A text window (a < p) is not, which shows the check can fail."""
    import torch
    from transformers import Qwen3ForCausalLM

    tp = _mod("train_pair")
    m = Qwen3ForCausalLM.from_pretrained(str(pair / "target"), dtype=torch.float32).eval()
    tap = tp.FeatureTap(m, [1, 2])
    stream = torch.randint(4, 4096, (500,), generator=torch.Generator().manual_seed(2))
    traj, ps = tp.greedy_trajectories(m, tap, stream, 3, 48, (8, 12), torch.Generator().manual_seed(3),
                                      "cpu", 2)
    assert traj.shape == (3, 48) and set(ps.tolist()) <= {8, 12}
    for r in range(3):
        p = int(ps[r])
        for a in (p, p + 7, 48 - 16):
            _, cont = tp.greedy_block(m, tap, traj[r:r + 1, :a])
            assert torch.equal(cont[0], traj[r, a:a + 16]), (r, a)
    # random text is not the target's greedy continuation of its prefix
    _, cont = tp.greedy_block(m, tap, traj[:, :4])
    assert not torch.equal(cont[:, :4], traj[:, 4:8])
    tap.remove()


def test_same_seed_same_pair(pair, tmp_path):
    def digest(d: Path) -> dict:
        return {f"{sub}/{n}": hashlib.sha256((d / sub / n).read_bytes()).hexdigest()
                for sub in ("target", "draft") for n in ("model.safetensors", "config.json")}

    _run_tiny(tmp_path)
    assert digest(tmp_path) == digest(pair)
    assert (tmp_path / "heldout_prompts.json").read_text() == (pair / "heldout_prompts.json").read_text()


def test_draft_equals_sglang_dflash_draft_model(pair, tmp_path):
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed in this venv")
    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, str(GPU / "check_pair_sglang.py"), str(pair), "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env={**ENV, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["sglang_target_capture"] == "checked"
    for c in res["cases"]:
        assert c["logits_max_abs_diff"] <= 1e-4 and c["draft_tokens_equal"] and c["mutations_detected"]
        assert c["feat_vs_sglang_capture"] <= 1e-4


# ---- --hybrid (issue 25): a Qwen3-Next target (GDN + gated attention + MoE) through the same script


@pytest.fixture(scope="module")
def pair_h(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pair_h")
    _run_tiny(out, "--hybrid")
    return out


def test_hybrid_layout_is_make_tiny_hybrid(pair_h, tmp_path):
    """next/target is what make_tiny_hybrid saves for the same config (config.json with SGLang's
    full_attention_interval, the same tensors), next/draft the usual DFlash draft."""
    import torch
    from transformers import Qwen3NextForCausalLM

    mth, tp = _mod("make_tiny_hybrid"), _mod("train_pair")
    tdir = pair_h / "next" / "target"
    cfg = json.loads((tdir / "config.json").read_text())
    ref = Qwen3NextForCausalLM(mth.next_config(cfg["eos_token_id"])).to(torch.bfloat16)
    ref.save_pretrained(str(tmp_path / "ref"), safe_serialization=True)
    mth.fix_saved_config(str(tmp_path / "ref"))
    assert cfg == json.loads((tmp_path / "ref" / "config.json").read_text())
    assert cfg["full_attention_interval"] == 4 and cfg["layer_types"][3] == "full_attention"
    got = _safetensors_layout(tdir / "model.safetensors")
    assert got == _safetensors_layout(tmp_path / "ref" / "model.safetensors")
    assert all(dt == "BF16" for _, dt in got.values())
    dcfg = json.loads((pair_h / "next" / "draft" / "config.json").read_text())
    assert dcfg == _mod("make_tiny_models").draft_config(dcfg["dflash_config"]["mask_token_id"],
                                                         num_layers=tp.DRAFT_LAYERS)
    assert not (pair_h / "target").exists() and (pair_h / "heldout_prompts.json").is_file()


def test_hybrid_report_reload_and_eval(pair_h):
    r = json.loads((pair_h / "train_report.json").read_text())
    assert r["hybrid"] is True and r["target"]["class"] == "Qwen3NextForCausalLM"
    assert r["target"]["reload_check"]["greedy_equal"] is True
    assert r["target"]["reload_check"]["state_differences"] == []
    t, d = r["target"], r["draft"]
    assert t["steps"] == 25 and d["steps"] == 15
    assert t["loss"]["last"] < t["loss"]["first"] - 0.5, t["loss"]
    assert d["loss"]["last"] < d["loss"]["first"], d["loss"]
    dh = r["eval"]["draft_heldout"]
    assert dh["blocks"] == 8 and 1.0 <= dh["mean_accept_length"] <= 16.0
    assert "--hybrid" in r["reproduce"]


def test_hybrid_greedy_block_and_features_match_hf(pair_h):
    """On Qwen3-Next too: our KV/state-cache greedy loop equals HF generate, and the features are the
    outputs of layers 1 and 2 (HF hidden_states[2], [3]; SGLang captures the same residual stream)."""
    import torch

    tp = _mod("train_pair")
    m = tp.target_class(True).from_pretrained(str(pair_h / "next" / "target"), dtype=torch.float32,
                                              **tp.target_kwargs(True)).eval()
    _assert_greedy_block_is_hf(tp, m, rows=2)


def _assert_greedy_block_is_hf(tp, m, rows: int) -> None:
    """train_pair's greedy continuation and drafter features equal HF's own generate and hidden states (the
    outputs of layers 1 and 2: hidden_states[2], [3])."""
    import torch

    tap = tp.FeatureTap(m, [1, 2])
    ctx = torch.randint(4, 4096, (rows, 20), generator=torch.Generator().manual_seed(1))
    feats, cont = tp.greedy_block(m, tap, ctx)
    with torch.no_grad():
        gen = m.generate(ctx, max_new_tokens=16, do_sample=False, min_new_tokens=16,
                         attention_mask=torch.ones_like(ctx), pad_token_id=0)
        hs = m(input_ids=ctx, output_hidden_states=True).hidden_states
    assert torch.equal(cont, gen[:, 20:])
    assert torch.equal(feats, torch.cat([hs[2], hs[3]], -1))
    tap.remove()

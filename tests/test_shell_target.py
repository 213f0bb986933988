"""bench/gpu/make_shell.py on CPU (issue 24 item 4): a real-size "shell" of a small pair keeps its outputs.

A small random pair in make_tiny_models' layout (target: Qwen3, hidden 256, 4 layers, 4 heads x 64, 2 KV heads,
MLP 512, vocab 4096; drafter: 2 layers, target_layer_ids [1, 2]) with sharp random weights (non-trivial norm,
q_norm / k_norm weights, attention that depends on position), and a REDUCED shell built by the same code
(6 layers with the small ones spread over them, hidden 1024, 8 heads x 128 in groups of 4 over 2 KV heads,
MLP 768, vocab 5120, float32): (a) greedy continuations with transformers' Qwen3ForCausalLM are
token-identical, the logits over the real vocabulary agree to 1e-4 relative and padded tokens sit far below;
(b) the drafter (train_pair.DFlashDraft, and SGLang's own DFlashDraftModel / Qwen3 classes when sglang is
installed) proposes the same tokens from the shell's captured features; (c) shells broken on purpose (norms
not compensated, RoPE dims mapped contiguously, softmax scale not compensated, drafter feature ids not mapped)
differ, so the comparisons have power. Also: a bf16 shell written in several shards loads and agrees, sizes
that cannot embed the small model are refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

GPU = Path(__file__).resolve().parents[1] / "bench" / "gpu"
if str(GPU) not in sys.path:
    sys.path.insert(0, str(GPU))
import make_shell as ms  # noqa: E402

# hidden / 4 and head_dim / 2 as in the real shell (256 -> 4096, 64 -> 128), GQA groups of 4 over 2 KV heads
SIZE = ms.ShellSize(layers=6, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=768, vocab=5120)
N_PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 24, 32
MASK_ID = 3


def _sharpen(model: torch.nn.Module, seed: int) -> None:
    """Weights that make every mapping matter: matrices N(0, 1/fan_in) (embedding 1, lm_head 0.5: peaked
    logits, as make_tiny_models), hidden norms U(0.5, 1.5), q_norm / k_norm U(1, 3) (sharp, position-dependent
    attention, so a wrong RoPE or softmax scale shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "q_norm" in name or "k_norm" in name:
                p.copy_(1 + 2 * torch.rand(p.shape, generator=g))
            else:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))


def make_small_pair(root: Path) -> Path:
    """A random pair in make_tiny_models' layout (bf16 on disk, as the trained pair), with a tokenizer."""
    from safetensors.torch import save_file
    from transformers import Qwen3ForCausalLM

    mtm, tp = __import__("make_tiny_models"), __import__("train_pair")
    tdir, ddir = root / "target", root / "draft"
    tdir.mkdir(parents=True)
    ddir.mkdir(parents=True)
    _, eos = mtm.build_tokenizer(str(tdir), files=mtm.tokenizer_files()[:3])
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(mtm.target_config(eos))
    _sharpen(target, 1)
    target.to(torch.bfloat16).save_pretrained(str(tdir), safe_serialization=True)
    dcfg = mtm.draft_config(MASK_ID, num_layers=2)
    draft = tp.init_draft(dcfg, 2)
    _sharpen(draft, 3)
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()}
    order = [n for n, _, _ in mtm.draft_weight_specs(2, 2)]
    save_file({k: sd[k] for k in order}, str(ddir / "model.safetensors"), metadata={"format": "pt"})
    (ddir / "config.json").write_text(json.dumps(dcfg, indent=2))
    return root


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("shell")
    pair = make_small_pair(root / "pair")
    res = ms.build(pair, root / "shell", SIZE, dtype="float32", placement="spread", device="cpu",
                   log=lambda _s: None)
    return {"pair": pair, "shell": root / "shell", "build": res}


@pytest.fixture(scope="module")
def models(built) -> dict:
    pair, shell = built["pair"], built["shell"]
    g = torch.Generator().manual_seed(5)
    return {
        "small_t": ms.load_target(pair / "target", "cpu"), "shell_t": ms.load_target(shell / "target", "cpu"),
        "small_d": ms.load_draft(pair / "draft", "cpu"), "shell_d": ms.load_draft(shell / "draft", "cpu"),
        "params": json.loads((shell / ms.SHELL_JSON).read_text()),
        # one batch of equal-length prompts: one greedy loop per model
        "prompts": list(torch.randint(4, 4096, (N_PROMPTS, PROMPT_LEN), generator=g)),
    }


def test_layout_configs_and_files(built):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    shell = built["shell"]
    cfg = AutoConfig.from_pretrained(str(shell / "target"))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (1024, 6, 8, 2, 128, 768, 5120)
    assert cfg.rms_norm_eps == 1e-6 and not cfg.tie_word_embeddings and len(cfg.layer_types) == 6
    dcfg = json.loads((shell / "draft" / "config.json").read_text())
    assert dcfg["architectures"] == ["DFlashDraftModel"] and dcfg["hidden_size"] == 1024
    assert dcfg["num_hidden_layers"] == 2 and dcfg["num_target_layers"] == 6 and dcfg["vocab_size"] == 5120
    p = json.loads((shell / ms.SHELL_JSON).read_text())
    # spread: small layers 0..3 -> 0, 2, 3, 5; the drafter reads the outputs of small layers 1, 2 -> 2, 3
    assert p["layer_map"] == [0, 2, 3, 5] and dcfg["dflash_config"]["target_layer_ids"] == [2, 3]
    assert p["alpha"] == 4.0 and p["sigma"] == 0.5 and p["k_scale"] == 2.0 and p["eps_effective_k_norm"] == 5e-7
    assert p["q_map"] == [0, 1, 4, 5] and p["kv_map"] == [0, 1]
    # the real shell: small KV heads 0, 1 -> shell KV heads 0, 4 (groups of 4 q heads), q heads 0, 1, 16, 17
    real = ms.Shell(json.loads((built["pair"] / "target" / "config.json").read_text()), ms.ShellSize())
    assert real.kv_map == [0, 4] and real.q_map == [0, 1, 16, 17] and (real.alpha, real.sigma) == (8.0, 0.25)
    assert real.dim_map[:3] == [0, 2, 4] and real.dim_map[32:35] == [64, 66, 68] and real.q_rows()[65] == 130
    assert AutoTokenizer.from_pretrained(str(shell / "target")).eos_token == "<|endoftext|>"
    b = built["build"]
    assert "tokenizer.json" in b["copied"] and b["target"]["files"] == ["model.safetensors"]
    with safe_open(str(shell / "target" / "model.safetensors"), "pt") as f:
        assert f.get_slice("lm_head.weight").get_shape() == [5120, 1024]
        assert f.get_slice("model.layers.5.mlp.down_proj.weight").get_dtype() == "F32"
    # random almost everywhere: zeros only where a product would reach a kept output
    assert b["target"]["gemm_zero_fraction"] < 0.15, b["target"]["gemm_zero_fraction_by_weight"]


def test_greedy_tokens_and_logits_equal(models):
    """(a) greedy continuations token-identical, real-vocabulary logits within 1e-4 relative, padded far below."""
    r = ms.compare_targets(models["small_t"], models["shell_t"], models["prompts"], NEW_TOKENS, "cpu")
    assert r["tokens_equal"], r["cases"]
    assert r["logits_max_rel_diff"] < 1e-4, r
    assert r["pad_margin_min"] > 100 and r["pad_prob_t0.8_max"] < 1e-20, r
    # the continuations are not degenerate (the comparison would be weak if every model said one token)
    toks = ms.greedy(models["small_t"], torch.stack(models["prompts"]), NEW_TOKENS)
    assert len(set(toks.flatten().tolist())) > 8


def test_k_norm_eps_is_the_only_residual(models):
    """The construction is exact in real arithmetic but for k_norm's eps (eps/2 instead of eps: config.json has
    one eps): the shell's logits with that eps set exactly move by less than 1e-5 relative."""
    r = ms.k_norm_eps_effect(models["shell_t"], models["params"], models["prompts"], "cpu")
    assert r["eps_effective"] == 5e-7 and r["eps_that_would_be_exact"] == 2e-6
    assert r["logits_max_rel_diff"] < 1e-5, r


def test_draft_tokens_equal(models):
    """(b) the drafter: features (shell / alpha on the real dims, the constant, zeros elsewhere), hidden states,
    logits and per-position argmax tokens over the whole shell vocabulary."""
    m = models
    r = ms.compare_drafts(m["small_t"], m["shell_t"], m["small_d"], m["shell_d"], m["params"], m["prompts"], "cpu")
    assert r["blocks"] == N_PROMPTS and r["draft_tokens_equal"], r
    assert r["features_max_rel_diff"] < 1e-5 and r["features_const_max_abs_diff"] < 1e-6, r
    assert r["features_zero_dims_max_abs"] == 0.0 and r["hidden_zero_dims_max_abs"] == 0.0, r
    assert r["logits_max_rel_diff"] < 1e-4 and r["pad_margin_min"] > 100, r


def _mutant_target(built, models, mutation: str):
    from transformers import AutoConfig, Qwen3ForCausalLM

    small_cfg = json.loads((built["pair"] / "target" / "config.json").read_text())
    dcfg = json.loads((built["pair"] / "draft" / "config.json").read_text())
    sh = ms.Shell(small_cfg, SIZE, draft=dcfg, placement="spread", mutations=(mutation,))
    with ms.no_init():
        model = Qwen3ForCausalLM(AutoConfig.from_pretrained(str(built["shell"] / "target")))
    small_sd = ms.read_weights(built["pair"] / "target")
    sd = ms.state_dict(ms.target_tensors(sh, small_sd, ms.Rand(0, torch.device("cpu"))))
    model.load_state_dict(sd, strict=True)
    return sh, model.eval()


@pytest.mark.parametrize("mutation", ["norm_uncompensated", "rope_contiguous", "softmax_uncompensated"])
def test_broken_target_differs(built, models, mutation):
    """(c) the same code with one compensation left out must NOT match (the comparison has power)."""
    _, bad = _mutant_target(built, models, mutation)
    small = models["small_t"]
    diff = ms.logits_diff(small, bad, models["prompts"][:2], "cpu")
    with torch.no_grad():
        scale = float(small(input_ids=models["prompts"][0][None]).logits.abs().max())
    assert diff / scale > 1e-2, (mutation, diff, scale)


@pytest.mark.parametrize("mutation", ["ids_unmapped", "norm_uncompensated"])
def test_broken_draft_differs(built, models, mutation):
    tp = __import__("train_pair")
    small_cfg = json.loads((built["pair"] / "target" / "config.json").read_text())
    dcfg = json.loads((built["pair"] / "draft" / "config.json").read_text())
    sh = ms.Shell(small_cfg, SIZE, draft=dcfg, placement="spread", mutations=(mutation,))
    bad = tp.DFlashDraft(ms.draft_config(sh, "float32"))
    bad.load_state_dict(ms.state_dict(ms.draft_tensors(sh, ms.read_weights(built["pair"] / "draft"),
                                                       ms.Rand(0, torch.device("cpu")))), strict=True)
    m = models
    r = ms.compare_drafts(m["small_t"], m["shell_t"], m["small_d"], bad.eval(), m["params"], m["prompts"], "cpu")
    assert r["logits_max_rel_diff"] > 1e-2 and not r["draft_tokens_equal"], (mutation, r)


def test_bf16_shards_first_placement(built, models, tmp_path):
    """The default dtype and placement, written in several shards (+ the index): the bf16 copies of the small
    bf16 weights are exact (alpha, sigma, s_k are powers of 2), so float32 logits still agree to 1e-4."""
    out = tmp_path / "bf16"
    res = ms.build(built["pair"], out, SIZE, dtype="bfloat16", placement="first", device="cpu",
                   max_shard_gb=0.03, log=lambda _s: None)
    assert len(res["target"]["files"]) > 2 and (out / "target" / "model.safetensors.index.json").exists()
    index = json.loads((out / "target" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == res["target"]["bytes"] == res["target"]["params"] * 2
    assert json.loads((out / "draft" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 2]
    shell, small, prompts = ms.load_target(out / "target", "cpu"), models["small_t"], models["prompts"]
    with torch.no_grad():  # teacher-forced: the greedy loop is test_greedy_tokens_and_logits_equal's
        lo_s, lo_h = small(input_ids=torch.stack(prompts)).logits, shell(input_ids=torch.stack(prompts)).logits
    assert float((lo_h[..., :4096] - lo_s).abs().max() / lo_s.abs().max()) < 1e-4
    assert torch.equal(lo_h.argmax(-1), lo_s.argmax(-1))
    d = ms.compare_drafts(models["small_t"], shell, models["small_d"], ms.load_draft(out / "draft", "cpu"),
                          json.loads((out / ms.SHELL_JSON).read_text()), models["prompts"][:2], "cpu")
    assert d["draft_tokens_equal"] and d["logits_max_rel_diff"] < 1e-4, d


def test_sizes_that_cannot_embed_are_refused(built):
    small = json.loads((built["pair"] / "target" / "config.json").read_text())
    for bad, why in ((ms.ShellSize(hidden=256), "constant dim"), (ms.ShellSize(head_dim=96), "multiple"),
                     (ms.ShellSize(heads=8, kv_heads=8), "groups smaller"), (ms.ShellSize(vocab=1000), "--vocab")):
        with pytest.raises(ValueError, match=why):
            ms.Shell(small, bad)


def test_sglang_classes_agree(built, tmp_path):
    """(b) with SGLang's own Qwen3ForCausalLM (aux hidden capture) and DFlashDraftModel (context K/V as the
    worker makes them), on CPU, through make_shell.py --check-only --sglang (its own process: SGLang's
    distributed state is process-wide)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed in this venv")
    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, str(GPU / "make_shell.py"), str(built["pair"]), str(built["shell"]),
                        "--check-only", "--sglang", "--device", "cpu", "--prompts", "2", "--new-tokens", "8",
                        "--report", str(out)],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    c = json.loads(out.read_text())["check"]
    assert c["ok"] and c["target"]["tokens_equal"] and c["draft"]["draft_tokens_equal"]
    s = c["sglang"]
    assert s["model_config"]["target"]["architectures"] == ["Qwen3ForCausalLM"]
    assert s["model_config"]["draft"]["architectures"] == ["DFlashDraftModel"]
    assert s["model_config"]["target"]["vocab"] == s["model_config"]["draft"]["vocab"] == 5120
    assert s["blocks"] == 2 and s["target_argmax_equal"] and s["draft_tokens_equal"], s
    assert s["target_logits_max_abs_diff"] < 1e-3 and s["draft_logits_max_abs_diff"] < 1e-3, s
    assert s["draft_pad_margin_min"] > 100, s

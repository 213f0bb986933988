#!/usr/bin/env python3
"""Train a small Qwen3 (or, --hybrid, Qwen3-Next; --dense-hybrid, a dense Qwen3.5) target and a DFlash drafter
against it, reproducibly (issue 14 item 1; --hybrid and --dense-hybrid: issue 25).

    python bench/gpu/train_pair.py OUT_DIR [--seconds N] [--tiny] [--hybrid | --dense-hybrid] [--device cuda|cpu] \
        [--report OUT_DIR/train_report.json]

Writes, in the layout bench/gpu/make_tiny_models.py writes (so SGLang 0.5.13.post1 serves them with
the same flags as today's random pair):
  OUT_DIR/target   Qwen3ForCausalLM (make_tiny_models.target_config: hidden 256, 4 layers, vocab 4096,
                   untied lm_head), bf16 safetensors + config + tokenizer (make_tiny_models.build_tokenizer,
                   trained on the training split only, plus one special token <|MASK|>)
  OUT_DIR/draft    DFlashDraftModel config + bf16 safetensors (make_tiny_models.draft_config /
                   draft_weight_specs: target_layer_ids [1, 2], block 16, mask_token_id = <|MASK|>)
  OUT_DIR/heldout_prompts.json   prompts cut from held-out files (never trained on), for benchmarks
  --report (default OUT_DIR/train_report.json)   seeds, steps, wall times, losses, evaluation

--hybrid (issue 25: a hybrid target whose drafts are really accepted, so a server commits deep tree nodes):
the target is transformers' Qwen3NextForCausalLM with make_tiny_hybrid.next_config (the same hidden 256 /
4 layers / vocab 4096; layers 0-2 Gated DeltaNet, layer 3 gated attention, MoE of 4 experts top-2 + a
shared expert in every layer, as SGLang 0.5.13.post1 requires), config.json completed with
`full_attention_interval` (make_tiny_hybrid.fix_saved_config), and the pair goes to OUT_DIR/next/target +
OUT_DIR/next/draft, make_tiny_hybrid's layout (run_device.sh MIX_SET=h serves HYB_MODELS/next). Everything
else is this script's one path. What differs: the MoE router's load-balancing loss (HF's, coefficient
router_aux_loss_coef = 0.001) is added to the target's loss; transformers' "eager" experts (target_kwargs);
on CPU subnormals are flushed (the GDN decays underflow, see main). The drafter's features need nothing
new: SGLang's Qwen3-Next captures, for DFLASH layer id k, the residual stream entering layer k+1
(`prepare_attn_and_capture_last_layer_outputs`: after the fused add of the input norm, the `residual`, not
the normed hidden), i.e. the output of layer k, as Qwen3's model loop does (`hidden_states + residual`).
The GDN kernels are transformers' torch fallbacks (no fla / causal-conv1d on the GPU machine): a Python loop
over the 64 rows of a chunk per GDN layer, ~14k ops per training step vs ~1.3k for the dense target, so
the GPU steps are launch-bound and fewer in the same time.
CPU check (~30 s on 2 idle cores, tests/test_train_pair_cpu.py runs it):
    python bench/gpu/train_pair.py /tmp/ph --hybrid --tiny --device cpu

--dense-hybrid (issue 25, a hybrid WITHOUT MoE): the target trains as transformers' Qwen3_5ForCausalLM with
make_tiny_hybrid.dense_text_config (next_config's shape and GDN layers, a dense SwiGLU MLP of 512 in every
layer, Qwen3.5's partial interleaved mRoPE) and is saved as the Qwen3_5ForConditionalGeneration checkpoint
SGLang 0.5.13.post1 loads (its only dense Qwen3.5 entry class): the text weights under
model.language_model.*, lm_head.weight, a seeded random one-block vision tower, config.json completed and the
image / video processor configs written (make_tiny_hybrid.save_dense_target); the tokenizer also holds
make_tiny_hybrid.VISION_TOKENS (after <|MASK|>). The pair goes to OUT_DIR/dense/target + OUT_DIR/dense/draft.
No router loss (no MoE); subnormals flushed on CPU as for --hybrid. The reload check reads the saved VL
checkpoint back through Qwen3_5ForCausalLM (transformers maps model.language_model.* onto it, the vision
tower ignored); tests/test_dense_hybrid_target.py loads it as Qwen3_5ForConditionalGeneration as well.
    python bench/gpu/train_pair.py /tmp/pd --dense-hybrid --tiny --device cpu

Corpus: the .py files of the running Python's standard library (site-packages / dist-packages left
out) plus every .py under each --extra-corpus DIR, read as UTF-8 (undecodable or > 1 MB files
skipped). Each file goes to the held-out split when sha256(label) % 1000 < 10 * --heldout-pct, its
label being "stdlib/<relative path>" or "extraN/<relative path>": a deterministic split, the same on
every machine for the same files.

Target: transformers' own Qwen3ForCausalLM (the class that saves the checkpoint), AdamW, bf16 autocast
on CUDA (fp32 on CPU), seeded, random windows of the training token stream. The saved checkpoint is
reloaded and must continue two held-out windows greedily exactly like the model in memory (both bf16
weights, the rotary inv_freq fp32 in both: `cast_weights`), with the same weights and buffers
(report["target"]["reload_check"]).
Drafter: a torch re-implementation of SGLang's srt/models/dflash.py + speculative/dflash_worker.py
(`DFlashDraft` below; bench/gpu/check_pair_sglang.py compares it with SGLang's own DFlashDraftModel):
  * context features: the target's residual stream after layers `target_layer_ids` (SGLang captures
    "before layer k+1", i.e. hidden + residual, not normed), concatenated in layer order, for every
    committed token 0..L-1; projected once, ctx = hidden_norm(fc(features)), and used as the K/V input
    of EVERY draft layer (k_proj/v_proj only, no input_layernorm; k_norm; RoPE at the context
    positions 0..L-1);
  * the block: [bonus token, 15 x mask token] embedded with the TARGET's embedding, positions
    L..L+15; each layer is Qwen3 pre-norm (input_layernorm -> attention -> residual ->
    post_attention_layernorm -> SwiGLU MLP -> residual); block queries attend, non-causally, to all
    context keys and all 16 block keys; final norm; the TARGET's lm_head on block positions 1..15
    gives the predictions of the tokens at positions L+1..L+15.
  * labels (distillation): the target's own greedy continuation, which is exactly what the server's
    greedy verify compares the draft with. The (bf16) target decodes greedy trajectories once (a
    corpus window of p tokens, p in d_prompt_lens, continued greedily to d_seq tokens, KV cache);
    each training row is (trajectory, anchor a >= p): context trajectory[:a] (a key mask on the
    context features of the whole row), bonus trajectory[a], labels trajectory[a+1..a+15]. Loss:
    cross-entropy at positions 1..15, weighted exp(-(k-1)/7) (DFlash's loss decay for block 16).

Evaluation (report["eval"]), with the checkpoints as saved (bf16; computed in bf16 on CUDA, in fp32
on CPU): target held-out (and train) next-token top-1 and loss; drafter per-position (1..15) top-1 /
top-4 / top-8 accuracy on held-out contexts against the target's greedy continuation, and the mean
accept length a linear DFLASH chain gets there (1 + the number of leading positions whose draft top-1
equals the target's greedy token: the server's greedy accept length per step, bonus included).

Deterministic given --seed and the step counts (the report records them: --target-steps /
--draft-steps reproduce a time-budgeted run's schedule). With --seconds the step counts come from
the measured speed of the first steps (so they differ between machines / runs), the learning-rate
schedule is then a function of the step alone. On CUDA, bf16 GEMM and attention kernels (and their
backward passes) are not guaranteed bitwise reproducible; torch.use_deterministic_algorithms is set
with warn_only=True, so what remains nondeterministic is reported as warnings, not refused.

TRAIN_SECONDS (env) is the default of --seconds (240 on CUDA: target 50 %, drafter 50 %, its greedy
trajectories included, capped at half the drafter's share: fewer than --traj-rows when the decode is slow).
--tiny: a few steps on a few files at a small batch, for CPU tests (< 1 min).
Needs torch, transformers, tokenizers, safetensors (no network).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_tiny_hybrid as mth  # noqa: E402
import make_tiny_models as mtm  # noqa: E402

MASK_TOKEN = "<|MASK|>"
DRAFT_LAYERS = 2  # make_tiny_models' random draft has 1; chosen for capacity, not measured against 1
BLOCK = mtm.BLOCK_SIZE
LOSS_DECAY_GAMMA = 7.0
TOPKS = (1, 4, 8)
MAX_FILE_BYTES = 1_000_000


# --------------------------------------------------------------------------------------------- corpus


def corpus_files(extra_dirs: list[str], limit: int | None = None) -> list[tuple[str, str]]:
    """[(label, path)], sorted by label: the stdlib's .py files, then each extra dir's."""
    roots = [("stdlib", os.path.dirname(os.__file__))] + [(f"extra{i}", d) for i, d in enumerate(extra_dirs)]
    out = []
    for tag, root in roots:
        for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
            rel = os.path.relpath(p, root)
            parts = rel.split(os.sep)
            if tag == "stdlib" and parts[0] in ("site-packages", "dist-packages"):
                continue
            if any(x == "__pycache__" for x in parts) or not os.path.isfile(p):
                continue
            out.append((f"{tag}/{'/'.join(parts)}", p))
    out.sort()
    if limit is not None:  # --tiny: the top-level stdlib modules only, first `limit`
        out = [x for x in out if x[0].count("/") == 1][:limit]
    return out


def is_heldout(label: str, heldout_pct: float) -> bool:
    return int(hashlib.sha256(label.encode()).hexdigest(), 16) % 1000 < int(round(10 * heldout_pct))


def read_texts(files: list[tuple[str, str]]) -> list[tuple[str, str]]:
    texts = []
    for label, path in files:
        try:
            if os.path.getsize(path) > MAX_FILE_BYTES:
                continue
            with open(path, encoding="utf-8") as f:
                t = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        if t.strip():
            texts.append((label, t))
    return texts


def corpus_digest(texts: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for label, t in texts:
        h.update(label.encode() + b"\0" + hashlib.sha256(t.encode()).digest())
    return h.hexdigest()[:16]


def encode_all(tok, texts: list[tuple[str, str]], eos: int) -> tuple[torch.Tensor, list[list[int]]]:
    """(one stream: every file's tokens followed by eos, per-file token lists)."""
    encs = tok.encode_batch([t for _, t in texts], add_special_tokens=False)
    per_file = [e.ids for e in encs]
    flat = []
    for ids in per_file:
        flat.extend(ids)
        flat.append(eos)
    return torch.tensor(flat, dtype=torch.long), per_file


def heldout_prompts(tok, texts: list[tuple[str, str]], n: int, gen: torch.Generator,
                    lo: int = 64, hi: int = 256) -> list[dict]:
    """n prompts of lo..hi tokens, whole lines cut from held-out files (one per file while files last)."""
    prompts = []
    order = torch.randperm(len(texts), generator=gen).tolist()
    i = 0
    while len(prompts) < n and order and i < 4 * n + len(order):
        label, text = texts[order[i % len(order)]]
        i += 1
        lines = text.splitlines(keepends=True)
        if len(lines) < 4:
            continue
        want = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        start = int(torch.randint(0, max(1, len(lines) - 4), (1,), generator=gen))
        chunk, n_tok = "", 0
        for j in range(start, len(lines)):
            nxt = chunk + lines[j]
            n_nxt = len(tok.encode(nxt, add_special_tokens=False).ids)
            if n_nxt > hi:
                break
            chunk, n_tok = nxt, n_nxt
            if n_tok >= want:
                break
        if n_tok < lo:
            continue
        ids = tok.encode(chunk, add_special_tokens=False).ids
        prompts.append({"file": label, "line": start + 1, "n_tokens": len(ids), "text": chunk, "input_ids": ids})
    return prompts


# ---------------------------------------------------------------------------------------------- draft


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class _Attn(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, d = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.d = cfg["num_attention_heads"], cfg["num_key_value_heads"], d
        self.q_proj = nn.Linear(h, self.nh * d, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nh * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(d, cfg["rms_norm_eps"])


class _MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = _Attn(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = _MLP(cfg)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style RoPE (HF Qwen3 / SGLang is_neox_style=True). x [B, S, H, D], pos [B, S] or [S]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    f = pos.to(torch.float32)[..., None] * inv  # [(B,) S, D/2]
    if f.dim() == 2:
        f = f[None]
    cos, sin = f.cos()[:, :, None, :], f.sin()[:, :, None, :]
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def rope_theta(cfg: dict) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    return float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))


class DFlashDraft(nn.Module):
    """SGLang's DFlashDraftModel + the worker's drafting step, in plain torch. Parameter names are
    the checkpoint's (make_tiny_models.draft_weight_specs)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        h = cfg["hidden_size"]
        k = len(cfg["dflash_config"]["target_layer_ids"])
        self.layers = nn.ModuleList([_Layer(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.fc = nn.Linear(k * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.theta = rope_theta(cfg)

    def project_target_hidden(self, feats):
        return self.hidden_norm(self.fc(feats))

    def forward(self, ctx_feats, ctx_pos, block_emb, block_pos, ctx_valid=None):
        """ctx_feats [B, L, K*H] (target features of the committed tokens), ctx_pos [L] or [B, L],
        block_emb [B, S, H] (target embeddings of [bonus, mask...]), block_pos [S] or [B, S];
        ctx_valid [B, L] bool (optional key mask). Returns the normed hidden states [B, S, H]."""
        ctx = self.project_target_hidden(ctx_feats)
        b, s, _ = block_emb.shape
        nl = ctx.shape[1]
        h = block_emb
        mask = None
        if ctx_valid is not None:
            ones = torch.ones(b, s, dtype=torch.bool, device=h.device)
            mask = torch.cat([ctx_valid, ones], 1)[:, None, None, :]
        for layer in self.layers:
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_norm(a.q_proj(x).view(b, s, a.nh, a.d))
            kb = a.k_norm(a.k_proj(x).view(b, s, a.nkv, a.d))
            vb = a.v_proj(x).view(b, s, a.nkv, a.d)
            kc = a.k_norm(a.k_proj(ctx).view(b, nl, a.nkv, a.d))
            vc = a.v_proj(ctx).view(b, nl, a.nkv, a.d)
            q, kb, kc = rope(q, block_pos, self.theta), rope(kb, block_pos, self.theta), rope(kc, ctx_pos, self.theta)
            k = torch.cat([kc, kb], 1).transpose(1, 2)
            v = torch.cat([vc, vb], 1).transpose(1, 2)
            g = a.nh // a.nkv
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, is_causal=False,
                                               scale=a.d ** -0.5)
            h = h + a.o_proj(o.transpose(1, 2).reshape(b, s, a.nh * a.d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


def init_draft(cfg: dict, seed: int) -> DFlashDraft:
    """make_tiny_models' init: N(0, 0.02) matrices, ones for norms (seeded)."""
    m = DFlashDraft(cfg)
    g = torch.Generator().manual_seed(seed)
    specs = mtm.draft_weight_specs(cfg["num_hidden_layers"], len(cfg["dflash_config"]["target_layer_ids"]))
    params = dict(m.named_parameters())
    assert sorted(params) == sorted(n for n, _, _ in specs), "draft parameter names differ from the checkpoint's"
    with torch.no_grad():
        for name, shape, init in specs:
            p = params[name]
            assert tuple(p.shape) == tuple(shape), (name, p.shape, shape)
            p.copy_(torch.randn(*shape, generator=g) * 0.02 if init == "randn" else torch.ones(*shape))
    return m


def load_draft(draft_dir: str | Path) -> DFlashDraft:
    from safetensors.torch import load_file

    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    m = DFlashDraft(cfg)
    sd = load_file(str(Path(draft_dir) / "model.safetensors"))
    m.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return m


# --------------------------------------------------------------------------------------------- target


class FeatureTap:
    """Captures the output of target layers `layer_ids` (the residual stream after them, = SGLang's
    aux hidden state captured before layer id+1), concatenated in layer order."""

    def __init__(self, model, layer_ids):
        self.ids = sorted(layer_ids)
        self.on = False
        self.out: dict[int, torch.Tensor] = {}
        self.handles = [model.model.layers[i].register_forward_hook(self._hook(i)) for i in self.ids]

    def _hook(self, i):
        def f(_mod, _inp, out):
            if self.on:
                self.out[i] = out[0] if isinstance(out, tuple) else out
        return f

    def features(self) -> torch.Tensor:
        return torch.cat([self.out[i] for i in self.ids], -1)

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def greedy_block(target, tap: FeatureTap, ctx_ids: torch.Tensor, n: int = BLOCK):
    """Context features [B, L, K*H] of ctx_ids and the target's greedy continuation [B, n] (g0 = bonus)."""
    tap.on = True
    out = target(input_ids=ctx_ids, use_cache=True, logits_to_keep=1)
    tap.on = False
    feats = tap.features()
    tok = out.logits[:, -1].float().argmax(-1)
    cont = [tok]
    past = out.past_key_values
    for _ in range(n - 1):
        out = target(input_ids=tok[:, None], past_key_values=past, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        tok = out.logits[:, -1].float().argmax(-1)
        cont.append(tok)
    return feats, torch.stack(cont, 1)


@torch.no_grad()
def greedy_trajectories(target, tap: FeatureTap, stream: torch.Tensor, rows: int, length: int,
                        prompt_lens: tuple[int, ...], gen: torch.Generator, device, batch: int,
                        max_seconds: float | None = None):
    """(tokens [rows, length] on device, prompt length [rows]): each row a random corpus window of p
    tokens (p from prompt_lens, one per batch) followed by the target's greedy continuation.
    max_seconds: stop after the batch that passes it (fewer rows; the first batch always runs)."""
    out, ps = [], []
    t0 = time.perf_counter()
    for i in range(0, rows, batch):
        if out and max_seconds is not None:
            sync(device)
            if time.perf_counter() - t0 > max_seconds:
                break
        n = min(batch, rows - i)
        p = prompt_lens[int(torch.randint(0, len(prompt_lens), (1,), generator=gen))]
        starts = torch.randint(0, len(stream) - p, (n,), generator=gen)
        ctx = stream[starts[:, None] + torch.arange(p)].to(device)
        _, cont = greedy_block(target, tap, ctx, n=length - p)
        out.append(torch.cat([ctx, cont], 1))
        ps += [p] * n
    return torch.cat(out), torch.tensor(ps)


def target_class(hybrid: bool, dense_hybrid: bool = False):
    """transformers' class that trains, saves and reloads the target: Qwen3ForCausalLM, or with --hybrid
    Qwen3NextForCausalLM (Gated DeltaNet layers 0-2 + gated attention layer 3, MoE MLPs), or with
    --dense-hybrid Qwen3_5ForCausalLM (the same layers, dense MLPs; saved through the VL class)."""
    if dense_hybrid:
        from transformers import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM
    if hybrid:
        from transformers import Qwen3NextForCausalLM

        return Qwen3NextForCausalLM
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM


def target_kwargs(hybrid: bool) -> dict:
    """Model-loading options. The hybrid's MoE runs transformers' "eager" experts (a loop over the 4
    experts): its default, "grouped_mm", hands fp32 master weights to torch's grouped GEMM on CUDA
    under bf16 autocast, a dtype combination not tried on the GPU machine's torch 2.11. Nothing of it
    is saved: config.json and the weights are the same either way."""
    return {"experts_implementation": "eager"} if hybrid else {}


def cast_weights(model, dtype):
    """model.to(dtype) for the parameters only: floating buffers keep their dtype. nn.Module.to also casts
    the rotary embedding's inv_freq / original_inv_freq (non-persistent buffers, not in the checkpoint) to
    bf16, which moves every rope angle by up to ~0.4 % and changes the logits by ~0.3 (some greedy tokens
    of a trained target); from_pretrained(dtype=bf16) recomputes them in fp32 (transformers 5.8.1 and
    5.12.1 alike), as SGLang does. So the model in memory would differ from the saved checkpoint as loaded,
    and the reload check would fail or pass by luck (it failed on the GPU with 5.12.1, passed with 5.8.1)."""
    keep = {n: b for n, b in model.named_buffers() if b.is_floating_point()}
    model.to(dtype)
    for n, b in model.named_buffers():
        if n in keep and b.dtype != keep[n].dtype:
            mod, _, leaf = n.rpartition(".")
            model.get_submodule(mod)._buffers[leaf] = keep[n].to(b.device)
    return model


def state_differences(a, b) -> list[str]:
    """Names of the parameters and buffers of `a` that `b` lacks or holds with another dtype, shape or value
    (the reload check: save_pretrained + from_pretrained must give back the model in memory)."""
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    sa.update(a.named_buffers())
    sb.update(b.named_buffers())
    diff = sorted(set(sa) ^ set(sb))
    for n in sorted(set(sa) & set(sb)):
        x, y = sa[n], sb[n]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y.to(x.device)):
            diff.append(n)
    return diff


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def param_groups(model, wd: float, no_decay_names=("embed_tokens",)):
    decay, no = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no if p.dim() < 2 or any(x in n for x in no_decay_names) else decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no, "weight_decay": 0.0}]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_loop(name, step_fn, opt, *, steps, seconds, warmup, peak_lr, device, log_every, probe=20):
    """Runs step_fn(step) -> loss tensor; fixed `steps`, or sized from `seconds` after `probe` steps."""
    total = steps if steps else None
    losses, t0, t_probe = [], time.perf_counter(), None
    step = 0
    while total is None or step < total:
        lr = lr_at(step, total if total else 10**9, warmup, peak_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = step_fn(step)
        losses.append(float(loss))
        step += 1
        if total is None:
            if step == 5:
                sync(device)
                t_probe = time.perf_counter()
            elif step == probe:
                sync(device)
                per = (time.perf_counter() - t_probe) / (probe - 5)
                total = max(probe, int((seconds - (time.perf_counter() - t0)) / per) + probe)
                print(f"[{name}] {per * 1e3:.1f} ms/step -> {total} steps in ~{seconds:.0f} s", flush=True)
        if step % log_every == 0 or step == total:
            print(f"[{name}] step {step}/{total or '?'} loss {losses[-1]:.4f} lr {lr:.2e} "
                  f"t {time.perf_counter() - t0:.1f}s", flush=True)
    sync(device)
    return losses, step, time.perf_counter() - t0


def summarize_losses(losses, n=None):
    n = n or max(1, min(50, len(losses) // 10))
    curve_every = max(1, len(losses) // 50)
    return {
        "first": sum(losses[:n]) / n, "last": sum(losses[-n:]) / n, "window": n,
        "curve_every": curve_every, "curve": [round(x, 4) for x in losses[::curve_every]],
    }


def dir_bytes(d) -> dict:
    return {p.name: p.stat().st_size for p in sorted(Path(d).iterdir()) if p.is_file()}


# ------------------------------------------------------------------------------------------------ eval


@torch.no_grad()
def eval_target(model, stream, n, seq, gen, device, batch):
    starts = torch.randint(0, len(stream) - seq - 1, (n,), generator=gen)
    correct, loss_sum, count = 0, 0.0, 0
    for i in range(0, n, batch):
        idx = starts[i:i + batch, None] + torch.arange(seq + 1)
        w = stream[idx].to(device)
        logits = model(input_ids=w[:, :-1]).logits.float()
        y = w[:, 1:]
        loss_sum += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
        count += y.numel()
    return {"top1": correct / count, "loss": loss_sum / count, "tokens": count, "windows": n, "seq_len": seq}


@torch.no_grad()
def eval_draft(target, tap, draft, stream, ctx_lens, n_per, gen, device, batch, mask_id, dtype):
    """Per-position top-k accuracy of the draft against the target's greedy continuation, plus the
    ground-truth text's top-1 and the linear chain's accept length, over held-out contexts."""
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    hits = {k: torch.zeros(BLOCK - 1) for k in TOPKS}
    text_hits = torch.zeros(BLOCK - 1)
    accept, by_len = [], {}
    for L in ctx_lens:
        acc_l = []
        starts = torch.randint(0, len(stream) - L - BLOCK, (n_per,), generator=gen)
        for i in range(0, n_per, batch):
            idx = starts[i:i + batch, None] + torch.arange(L + BLOCK)
            w = stream[idx].to(device)
            feats, cont = greedy_block(target, tap, w[:, :L])
            blk = torch.full_like(cont, mask_id)
            blk[:, 0] = cont[:, 0]
            hid = draft(feats.to(dtype), torch.arange(L, device=device), emb(blk).to(dtype),
                        L + torch.arange(BLOCK, device=device))
            logits = head(hid[:, 1:].to(head.weight.dtype)).float()  # [b, 15, V]
            top = logits.topk(max(TOPKS), -1).indices
            want = cont[:, 1:]
            for k in TOPKS:
                hits[k] += (top[..., :k] == want[..., None]).any(-1).float().sum(0).cpu()
            text_hits += (top[..., 0] == w[:, L + 1:L + BLOCK]).float().sum(0).cpu()
            match = (top[..., 0] == want).long()
            acc = 1 + match.cumprod(1).sum(1)
            acc_l += acc.tolist()
        by_len[str(L)] = {"mean_accept_length": sum(acc_l) / len(acc_l), "blocks": len(acc_l)}
        accept += acc_l
    n = len(accept)
    hist = [0] * (BLOCK + 1)
    for a in accept:
        hist[a] += 1
    return {
        "labels": "target greedy continuation (bonus = the target's greedy token after the context)",
        "blocks": n, "context_lengths": list(ctx_lens),
        **{f"per_position_top{k}": [round(float(x) / n, 4) for x in hits[k]] for k in TOPKS},
        "per_position_top1_vs_text": [round(float(x) / n, 4) for x in text_hits],
        "mean_accept_length": sum(accept) / n,
        "accept_length_hist": hist,
        "by_context_length": by_len,
    }


# ------------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seconds", type=float, default=None,
                    help="training time budget, target + drafter (default $TRAIN_SECONDS or 240; --tiny: steps)")
    ap.add_argument("--tiny", action="store_true", help="a few steps on a few files (CPU tests)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    ap.add_argument("--report", default=None, help="report JSON (default OUT_DIR/train_report.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-steps", type=int, default=None, help="fixed step count (overrides --seconds)")
    ap.add_argument("--draft-steps", type=int, default=None, help="fixed step count (overrides --seconds)")
    ap.add_argument("--target-share", type=float, default=0.5, help="share of --seconds for the target")
    ap.add_argument("--draft-layers", type=int, default=DRAFT_LAYERS)
    ap.add_argument("--extra-corpus", action="append", default=[], help="another dir of .py files")
    ap.add_argument("--heldout-pct", type=float, default=5.0)
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts to write (64; tiny 8)")
    ap.add_argument("--traj-rows", type=int, default=None,
                    help="greedy trajectories for the drafter (default 4096, tiny 4; time-capped with --seconds)")
    ap.add_argument("--hybrid", action="store_true",
                    help="Qwen3-Next target (make_tiny_hybrid.next_config), pair in OUT_DIR/next/{target,draft}")
    ap.add_argument("--dense-hybrid", action="store_true",
                    help="dense Qwen3.5 hybrid target (make_tiny_hybrid.dense_text_config, saved as "
                         "Qwen3_5ForConditionalGeneration), pair in OUT_DIR/dense/{target,draft}")
    a = ap.parse_args(argv)
    if a.hybrid and a.dense_hybrid:
        ap.error("--hybrid and --dense-hybrid exclude each other")

    t_start = time.perf_counter()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if (a.hybrid or a.dense_hybrid) and not cuda:
        # The Gated DeltaNet decays (exp of cumulative log-gates, transformers' torch fallback) underflow
        # into subnormal floats as the gates train, and x86 arithmetic on subnormals is ~10-100x slower:
        # the tiny CPU run's target steps went from 0.2 s to 3 s. Flushing them to zero changes values
        # below 1e-38 only; CUDA (the real run) is unaffected either way.
        torch.set_flush_denormal(True)
    tiny = a.tiny
    seconds = a.seconds if a.seconds is not None else float(os.environ.get("TRAIN_SECONDS", "240"))
    hp = {  # hyper-parameters; --tiny shrinks the batch and fixes small step counts
        "t_batch": 4 if tiny else 128, "t_seq": 32 if tiny else 512, "t_lr": 3e-3, "t_warmup": 3 if tiny else 200,
        "d_batch": 4 if tiny else 512, "d_anchors": 2 if tiny else 8, "d_seq": 40 if tiny else 512,
        "d_prompt_lens": (8, 16) if tiny else (16, 32, 64, 128, 256), "d_traj_rows": 4 if tiny else 4096,
        "d_traj_batch": 4 if tiny else 512, "d_lr": 3e-3, "d_warmup": 3 if tiny else 100,
        "wd": 0.1, "clip": 1.0, "betas": (0.9, 0.95),
    }
    t_steps = a.target_steps or (25 if tiny else None)
    d_steps = a.draft_steps or (15 if tiny else None)
    out = Path(a.out_dir)
    # --hybrid: make_tiny_hybrid's layout, so run_device.sh's HYB_MODELS=OUT_DIR serves OUT_DIR/next
    pair_dir = out / "next" if a.hybrid else (out / "dense" if a.dense_hybrid else out)
    tdir, ddir = pair_dir / "target", pair_dir / "draft"
    tdir.mkdir(parents=True, exist_ok=True)
    ddir.mkdir(parents=True, exist_ok=True)
    report_path = Path(a.report) if a.report else out / "train_report.json"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    # ---- corpus, split, tokenizer
    t0 = time.perf_counter()
    files = corpus_files(a.extra_corpus, limit=40 if tiny else None)
    texts = read_texts(files)
    train = [x for x in texts if not is_heldout(x[0], a.heldout_pct)]
    held = [x for x in texts if is_heldout(x[0], a.heldout_pct)]
    if tiny and not held:  # a handful of files may all hash to train: hold out the last one
        held, train = train[-1:], train[:-1]
    label_to_path = dict(files)
    tok_files = [label_to_path[lb] for lb, _ in train if lb.startswith("stdlib/") and lb.count("/") == 1][:200]
    n_vocab, eos = mtm.build_tokenizer(str(tdir), files=tok_files,
                                       extra_specials=[MASK_TOKEN] + (mth.VISION_TOKENS if a.dense_hybrid else []))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    mask_id = tok.token_to_id(MASK_TOKEN)
    assert mask_id is not None and mask_id < mtm.VOCAB
    train_stream, _ = encode_all(tok, train, eos)
    held_stream, _ = encode_all(tok, held, eos)
    prompts = heldout_prompts(tok, held, a.prompts or (8 if tiny else 64), torch.Generator().manual_seed(a.seed + 7))
    (out / "heldout_prompts.json").write_text(json.dumps({
        "about": "prompts cut (whole lines, 64..256 tokens) from held-out files that neither the target, the "
                 "drafter nor the tokenizer were trained on; input_ids = the target tokenizer's encoding of text",
        "tokenizer": "target (beside this file)", "seed": a.seed, "prompts": prompts}, indent=1))
    corpus = {
        "roots": {"stdlib": os.path.dirname(os.__file__), **{f"extra{i}": d for i, d in enumerate(a.extra_corpus)}},
        "files_train": len(train), "files_heldout": len(held), "tokens_train": len(train_stream),
        "tokens_heldout": len(held_stream), "digest": corpus_digest(texts), "heldout_pct": a.heldout_pct,
        "tokenizer_files": len(tok_files), "tokenizer_vocab": n_vocab, "eos_token_id": eos,
        "mask_token": MASK_TOKEN, "mask_token_id": mask_id, "prompts": len(prompts), "wall_s": time.perf_counter() - t0,
    }
    print(f"corpus: {json.dumps({k: v for k, v in corpus.items() if k != 'roots'})}", flush=True)
    train_stream_d = train_stream.to(device)

    # ---- target
    target_cls = target_class(a.hybrid, a.dense_hybrid)
    cfg = mth.next_config(eos) if a.hybrid else (mth.dense_text_config(eos) if a.dense_hybrid else mtm.target_config(eos))
    torch.manual_seed(a.seed)
    target = (target_cls._from_config(cfg, **target_kwargs(a.hybrid)) if a.hybrid else target_cls(cfg)).to(device)
    target.train()
    opt = torch.optim.AdamW(param_groups(target, hp["wd"]), lr=hp["t_lr"], betas=hp["betas"],
                            **({"fused": True} if cuda else {}))
    tb, ts = hp["t_batch"], hp["t_seq"]
    t_gen = torch.Generator().manual_seed(a.seed + 1)

    def target_step(_step):
        starts = torch.randint(0, len(train_stream) - ts - 1, (tb,), generator=t_gen)
        w = train_stream_d[(starts[:, None] + torch.arange(ts + 1)).to(device)]
        with amp:
            # no cache: a training forward needs none (a hybrid one would also keep conv / SSM states);
            # the MoE router's load-balancing loss (HF's, off by default) keeps the 4 experts in use
            o = target(input_ids=w[:, :-1], use_cache=False, **({"output_router_logits": True} if a.hybrid else {}))
        logits = o.logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        if a.hybrid:
            loss = loss + cfg.router_aux_loss_coef * o.aux_loss.float()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), hp["clip"])
        opt.step()
        return loss.detach()

    t_losses, t_done, t_wall = train_loop(
        "target", target_step, opt, steps=t_steps, seconds=seconds * a.target_share, warmup=hp["t_warmup"],
        peak_lr=hp["t_lr"], device=device, log_every=10 if tiny else 500)
    target = cast_weights(target, torch.bfloat16).eval()  # not target.to(): inv_freq stays fp32
    # Reload check: the saved checkpoint must continue held-out text exactly like the model in memory
    # (both bf16, same device), e.g. no weight dropped or renamed by save_pretrained's conversions
    # (Qwen3-Next's fused MoE experts are split per expert on disk).
    rc_ctx = held_stream[:2 * 24].view(2, 24).to(device)
    rc_tap = FeatureTap(target, [0])
    rc_before = greedy_block(target, rc_tap, rc_ctx)[1]
    rc_tap.remove()
    if a.dense_hybrid:  # the Qwen3_5ForConditionalGeneration checkpoint (+ vision tower, processor configs)
        mth.save_dense_target(target, str(tdir), seed=a.seed)
    else:
        target.save_pretrained(str(tdir), safe_serialization=True)
    if a.hybrid:
        mth.fix_saved_config(str(tdir))  # full_attention_interval, which SGLang's Qwen3-Next config reads
    # the saved checkpoint, as SGLang / HF load it
    trained = target
    target = target_cls.from_pretrained(str(tdir), dtype=torch.bfloat16, **target_kwargs(a.hybrid)).to(device).eval()
    state_diff = state_differences(trained, target)
    del trained
    for p in target.parameters():
        p.requires_grad_(False)
    rc_tap = FeatureTap(target, [0])
    rc_after = greedy_block(target, rc_tap, rc_ctx)[1]
    rc_tap.remove()
    reload_check = {"rows": int(rc_ctx.shape[0]), "context": int(rc_ctx.shape[1]), "new_tokens": BLOCK,
                    "greedy_equal": bool(torch.equal(rc_before, rc_after)), "state_differences": state_diff[:20]}
    print(f"reload check: {json.dumps(reload_check)}", flush=True)
    assert not state_diff, f"the reloaded target's weights / buffers differ from the trained model's: {state_diff[:20]}"
    assert reload_check["greedy_equal"], "the reloaded target's greedy tokens differ from the trained model's"
    if not cuda:
        target = target.float()  # bf16 weights, fp32 arithmetic on CPU
    dtype = torch.bfloat16 if cuda else torch.float32

    # ---- drafter
    dcfg = mtm.draft_config(mask_id, num_layers=a.draft_layers)
    draft = init_draft(dcfg, a.seed + 2).to(device)
    tap = FeatureTap(target, dcfg["dflash_config"]["target_layer_ids"])
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    dopt = torch.optim.AdamW(param_groups(draft, hp["wd"]), lr=hp["d_lr"], betas=hp["betas"],
                             **({"fused": True} if cuda else {}))
    db = hp["d_batch"]
    d_gen = torch.Generator().manual_seed(a.seed + 3)
    wpos = torch.exp(-torch.arange(BLOCK - 1, dtype=torch.float32) / LOSS_DECAY_GAMMA).to(device)
    wpos = wpos / wpos.sum()
    bpos = torch.arange(BLOCK, device=device)

    # Distillation data: greedy trajectories. A trajectory is a corpus window of p tokens followed by
    # the target's greedy continuation to d_seq tokens; for every anchor a >= p, trajectory[a:a + 16] IS
    # the target's greedy continuation of trajectory[:a] (bonus first), so one decode loop yields
    # d_seq - p - 15 training blocks per row instead of one (a decode per step cost 1.1 s a step).
    tr_len, tr_rows = hp["d_seq"], a.traj_rows or hp["d_traj_rows"]
    tr_gen = torch.Generator().manual_seed(a.seed + 4)
    t_tr = time.perf_counter()
    # A time-budgeted run spends at most half the drafter's share on trajectories (the dense target's
    # 4096 took 48 of 120 s on the H200; the hybrid's torch-fallback decode is slower, and without a cap
    # it could leave the drafter no steps). Fixed --draft-steps / --traj-rows runs are not capped.
    tr_cap = None if (d_steps or a.traj_rows) else 0.5 * seconds * (1 - a.target_share)
    traj, traj_p = greedy_trajectories(target, tap, train_stream, tr_rows, tr_len, hp["d_prompt_lens"], tr_gen,
                                       device, hp["d_traj_batch"], max_seconds=tr_cap)
    sync(device)
    tr_rows = int(traj.shape[0])
    traj_wall = time.perf_counter() - t_tr
    print(f"[draft] {tr_rows} greedy trajectories of {tr_len} tokens in {traj_wall:.1f} s", flush=True)
    ds, apr = hp["d_batch"] // hp["d_anchors"], hp["d_anchors"]
    ctx_pos = torch.arange(tr_len, device=device)

    def draft_step(_step):
        si = torch.randint(0, tr_rows, (ds,), generator=d_gen)
        p = traj_p[si]  # [ds]
        u = torch.rand(ds, apr, generator=d_gen)
        anchors = (p[:, None] + (u * (tr_len - BLOCK + 1 - p[:, None])).long()).reshape(-1).to(device)
        rows = traj[si.to(device)]
        with torch.no_grad():
            tap.on = True
            target(input_ids=rows, logits_to_keep=1, use_cache=False)
            tap.on = False
            feats = tap.features().repeat_interleave(apr, 0)  # [ds * apr, tr_len, K*H]
            rows = rows.repeat_interleave(apr, 0)
            idx = anchors[:, None] + bpos  # the block's positions: bonus at the anchor
            cont = rows.gather(1, idx)
            blk = torch.full_like(cont, mask_id)
            blk[:, 0] = cont[:, 0]
            bemb = emb(blk)
            ctx_valid = ctx_pos[None] < anchors[:, None]  # the committed tokens before the bonus
        with amp:
            hid = draft(feats, ctx_pos, bemb, idx, ctx_valid=ctx_valid)
            logits = head(hid[:, 1:])
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), cont[:, 1:].reshape(-1),
                             reduction="none").view(ds * apr, BLOCK - 1)
        loss = (ce.mean(0) * wpos).sum()
        dopt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), hp["clip"])
        dopt.step()
        return loss.detach()

    draft.train()
    d_losses, d_done, d_wall = train_loop(
        "draft", draft_step, dopt, steps=d_steps, seconds=seconds * (1 - a.target_share) - traj_wall, warmup=hp["d_warmup"],
        peak_lr=hp["d_lr"], device=device, log_every=10 if tiny else 200)
    from safetensors.torch import save_file

    sd = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in draft.state_dict().items()}
    order = [n for n, _, _ in mtm.draft_weight_specs(a.draft_layers, len(dcfg["dflash_config"]["target_layer_ids"]))]
    save_file({k: sd[k] for k in order}, str(ddir / "model.safetensors"), metadata={"format": "pt"})
    (ddir / "config.json").write_text(json.dumps(dcfg, indent=2))

    # ---- evaluation, on the checkpoints as saved
    t0 = time.perf_counter()
    draft = load_draft(ddir).to(device=device, dtype=dtype).eval()
    def e_gen(k):  # one generator per evaluation: adding one never moves another's samples
        return torch.Generator().manual_seed(a.seed + 100 + k)

    ev_n, ev_seq, ev_b = (4, 32, 4) if tiny else (512, 512, 64)
    ev_target_held = eval_target(target, held_stream, ev_n, ev_seq, e_gen(0), device, ev_b)
    ev_target_train = eval_target(target, train_stream, ev_n, ev_seq, e_gen(1), device, ev_b)
    ev_by_root = {}  # held-out files of each corpus root apart (site-packages code repeats itself more)
    for root in corpus["roots"]:
        part = [x for x in held if x[0].split("/", 1)[0] == root]
        stream_r = encode_all(tok, part, eos)[0] if part else torch.zeros(0, dtype=torch.long)
        if len(stream_r) > 4 * ev_seq:
            ev_by_root[root] = eval_target(target, stream_r, ev_n, ev_seq, e_gen(3), device, ev_b)
    ctx_lens = (8, 24) if tiny else (32, 128, 256, 480)
    ev_draft = eval_draft(target, tap, draft, held_stream, ctx_lens, 4 if tiny else 512, e_gen(2), device,
                          4 if tiny else 256, mask_id, dtype)
    ev_wall = time.perf_counter() - t0
    tap.remove()

    report = {
        "script": "bench/gpu/train_pair.py", "argv": sys.argv[1:] if argv is None else list(argv),
        "seed": a.seed, "tiny": tiny, "hybrid": a.hybrid, **({"dense_hybrid": True} if a.dense_hybrid else {}),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "deterministic": "given --seed and the step counts; CUDA bf16 kernels may differ in the last bits "
                         "between runs (use_deterministic_algorithms(warn_only=True))",
        "seconds_budget": None if (t_steps and d_steps) else seconds,
        "hyperparameters": {**hp, "betas": list(hp["betas"]), "loss_decay_gamma": LOSS_DECAY_GAMMA,
                            "draft_labels": "target greedy trajectories"},
        "corpus": corpus,
        "target": {
            "dir": str(tdir), "steps": t_done, "wall_s": t_wall, "tokens_seen": t_done * tb * ts,
            "params": sum(p.numel() for p in target.parameters()), "loss": summarize_losses(t_losses),
            "checkpoint_bytes": dir_bytes(tdir), "reload_check": reload_check,
            "class": target_cls.__name__,
            "config": {k: cfg.to_dict().get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                         "intermediate_size", "tie_word_embeddings", "layer_types",
                                                         "num_experts", "num_experts_per_tok")
                       if k in cfg.to_dict()},
        },
        "draft": {
            "dir": str(ddir), "steps": d_done, "wall_s": d_wall, "blocks_seen": d_done * db,
            "trajectories": {"rows": tr_rows, "tokens": tr_len, "prompt_lens": list(hp["d_prompt_lens"]),
                             "wall_s": traj_wall},
            "params": sum(p.numel() for p in draft.parameters()), "loss": summarize_losses(d_losses),
            "checkpoint_bytes": dir_bytes(ddir), "num_hidden_layers": a.draft_layers,
            "target_layer_ids": dcfg["dflash_config"]["target_layer_ids"], "block_size": BLOCK,
            "mask_token_id": mask_id,
        },
        "eval": {"target_heldout": ev_target_held, "target_train": ev_target_train,
                 "target_heldout_by_root": ev_by_root, "draft_heldout": ev_draft,
                 "dtype": str(dtype), "wall_s": ev_wall},
        "reproduce": f"python bench/gpu/train_pair.py OUT --seed {a.seed} --target-steps {t_done} "
                     f"--draft-steps {d_done} --traj-rows {tr_rows}" + (" --tiny" if tiny else "")
                     + (" --hybrid" if a.hybrid else "") + (" --dense-hybrid" if a.dense_hybrid else "")
                     + f" --draft-layers {a.draft_layers}"
                     + "".join(f" --extra-corpus {d}" for d in a.extra_corpus),
        "wall_s": time.perf_counter() - t_start,
    }
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=1))
    e = report["eval"]
    print(f"target held-out top1 {e['target_heldout']['top1']:.4f} loss {e['target_heldout']['loss']:.4f} | "
          f"draft top1@1 {ev_draft['per_position_top1'][0]:.4f} accept {ev_draft['mean_accept_length']:.3f} | "
          f"wall {report['wall_s']:.1f}s -> {report_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A real-size "shell" of a small DDTree pair (issue 24 item 4): the GEMMs of a Qwen3-8B-sized target and
drafter, the outputs of the small trained pair.

    python bench/gpu/make_shell.py PAIR OUT [--layers 36 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128
        --intermediate 12288 --vocab 151936] [--dtype bfloat16] [--placement first|spread] [--device cuda]
        [--check [--check-only] [--sglang]]

PAIR holds `target/` (HF Qwen3ForCausalLM, untied lm_head) and `draft/` (a DFlash drafter in the layout
SGLang's srt/models/dflash.py loads: make_tiny_models.py, train_pair.py). OUT gets `target/` and `draft/` of the
shell sizes (config.json that transformers and SGLang load, sharded safetensors written tensor by tensor:
peak RAM is one tensor, not the model), the target's tokenizer / generation files, heldout_prompts.json when
PAIR has it, and `shell.json` (the construction's parameters, read back by --check).

Construction (small sizes H, d, ...; shell sizes H', d', ...; every claim below is exact in real arithmetic):

* Residual stream: shell dims [0, H) carry alpha * (the small model's residual), dim H'-1 a constant c, every
  other dim exactly 0 in every layer (the embedding is 0 there; every row of o_proj / down_proj that writes
  there multiplies inputs that are exactly 0, or is 0). alpha is a power of 2 (exact in bf16).
* RMSNorm over H' dims: mean' = (alpha^2 H ms + c^2) / H' + eps. With c^2 = eps (alpha^2 H - H') that is
  (alpha^2 H / H') (ms + eps): the small model's norm, eps included, with ONE rms_norm_eps (the small's) in
  config.json. The normed vector is then sqrt(H'/H) times the small's, so every hidden norm weight is the
  small's times sqrt(H/H') (1/4 for 256 -> 4096; a power of 2 when H'/H is a power of 4, else not
  bf16-exact and the script says so); the norm weight at the constant dim is 0 (the final norm's is 1: see
  the vocabulary) and 1 at the zero dims (any value: it multiplies 0). So every norm input to q/k/v/gate/up is
  the small's normed vector on [0, H) and exactly 0 elsewhere: their columns >= H are random (they multiply
  0), and o_proj / down_proj rows [0, H) are alpha times the small's.
* Heads: small KV head g -> shell KV head g * (kv'/kv); its q heads keep their rank in the group (GQA groups
  4 vs 2: two q heads of each used shell group are not the small's). Head dims, r = d'/d: neox RoPE pairs
  dim i with i + d/2 at theta^(-2i/d), so small dim i < d/2 goes to r*i and i + d/2 to r*i + d'/2 (same pair,
  same frequency, same rope_theta). k (and v) of a real KV head are 0 on the other dims (rows 0 on the
  columns [0, H)); q instead carries copies of its real dims there, which makes mean(q^2) over d' equal the
  small's over d, so q_norm's output equals the small's (eps exact), while k's mean over d' is 1/r of the
  small's: k_norm's output is sqrt(r) times the small's and q.k / sqrt(d') = q.k / sqrt(d): the softmax
  scale is compensated with unchanged (bf16-exact) q_norm / k_norm weights. k_proj rows are scaled by s_k
  (a power of 2) so k_norm's eps becomes r eps / s_k^2 (eps / 2 for 64 -> 128; the one residual: see
  shell.json's eps_effective_k_norm and --check's measurement). v of every KV head that is not the small's
  and v of the extra dims are 0 (rows 0 on [0, H), random elsewhere), so an o_proj column is 0 only where
  a q head of a used KV group meets a real dim; all other o_proj columns are random.
* MLP: units [0, I) are the small's; up_proj rows of the others are 0 on [0, H) (their activation
  silu(gate) * 0 = 0), so gate_proj is random there and down_proj's columns of those units are random.
* Layers: the small layers go to shell layers `layer_map` (--placement first: 0..L-1; spread: evenly from 0
  to L'-1); every other layer adds exactly 0 (v_proj and up_proj rows 0 on [0, H): attention and MLP output
  0 whatever the random q/k/gate/o/down do). The drafter's target_layer_ids are mapped through layer_map
  (SGLang captures the OUTPUT of those layers; a layer after a real one until the next real one outputs the
  same residual).
* Vocabulary V -> V': padded token p has the embedding and lm_head row of its twin p mod V on [0, H), and
  lm_head[p, H'-1] = -G where the final norm has weight 1 at the constant dim: its logit is its twin's minus
  G c / (alpha sqrt(H/H') rms), rms the small model's final residual rms (a real token's lm_head weight at
  that dim is 0, so real logits are unchanged). A padded token can never beat its twin (ties go to the
  lower, real index), and G is set by --pad-gap (the gap at rms 1): the padded probability at T 0.8 is
  ~ (V'/V) exp(-gap / rms / 0.8). --check measures the margin to the best real logit on the prompts.
* Drafter: its layers embedded the same way (hidden, heads, MLP), fc [H', K H'] reads the features' [0, H)
  dims with the small fc (input alpha f, output alpha y) and copies feature 0's constant into dim H'-1, so
  hidden_norm sees the residual's structure; hidden_norm / norm / layer norms as above; it reads the
  shell target's embedding and lm_head, so its padded logits carry the same gap.
Random values (N(0, 0.02), seeded per tensor name) fill every weight whose product is provably discarded;
zeros are only where a product would reach a kept output (2 % of the 8B target's GEMM weights, 4 % of the
drafter's; build() reports the fraction per weight). Padded tokens are never inputs (the tokenizer and the
mask token are the small vocabulary's), so their embedding rows only keep the tensor's shape and values sane.
Shell(mutations=...) builds deliberately broken shells (tests/test_shell_target.py: the checks have power).

--check (after building, or on an existing OUT with --check-only) compares, on --device in --check-dtype
(float32 by default): greedy continuations of PAIR/heldout_prompts.json (or seeded random prompts) with
transformers' Qwen3ForCausalLM, teacher-forced logits over the real vocabulary, the padded margin, the
captured features, and the drafter (train_pair.DFlashDraft, the torch twin of SGLang's DFlashDraftModel that
check_pair_sglang.py checks) per-position tokens, logits and padded margin; --sglang adds SGLang's own
Qwen3 and DFlashDraftModel classes on CPU (float32). One JSON line; exit 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

RAND_STD = 0.02
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
MUTATIONS = ("norm_uncompensated", "rope_contiguous", "softmax_uncompensated", "ids_unmapped")
WEIGHT_FILES = (".safetensors", ".bin", ".pt")
SHELL_JSON = "shell.json"

TensorSpec = tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]


@dataclass(frozen=True)
class ShellSize:
    layers: int = 36
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288
    vocab: int = 151936


def _pow2_at_least(x: float) -> float:
    return 2.0 ** math.ceil(math.log2(x))


class Shell:
    """The index maps and scales of one small -> shell embedding (the module docstring says why)."""

    def __init__(self, small: dict, size: ShellSize, *, draft: dict | None = None, placement: str = "first",
                 pad_gap: float = 1e5, mutations: tuple[str, ...] = ()) -> None:
        bad = set(mutations) - set(MUTATIONS)
        if bad:
            raise ValueError(f"unknown mutations {sorted(bad)}")
        self.mut = frozenset(mutations)
        self.small, self.size, self.placement = small, size, placement
        H, L, V = small["hidden_size"], small["num_hidden_layers"], small["vocab_size"]
        nh, nkv, d, inter = (small["num_attention_heads"], small["num_key_value_heads"], small["head_dim"],
                             small["intermediate_size"])
        self.H, self.L, self.V, self.nh, self.nkv, self.d, self.inter = H, L, V, nh, nkv, d, inter
        Hs, ds = size.hidden, size.head_dim
        problems = []
        if small.get("tie_word_embeddings"):
            problems.append("the small target ties its lm_head to the embedding (the shell's rows differ)")
        if small.get("hidden_act", "silu") != "silu":
            problems.append("hidden_act must be silu")
        if Hs < H + 1:
            problems.append(f"--hidden {Hs} < small hidden {H} + 1 (one constant dim)")
        if ds % d or ds < d:
            problems.append(f"--head-dim {ds} is not a multiple of the small head_dim {d}")
        if size.kv_heads < nkv or size.kv_heads % nkv:
            problems.append(f"--kv-heads {size.kv_heads} is not a multiple of the small {nkv}")
        if size.heads % size.kv_heads or size.heads // size.kv_heads < nh // nkv:
            problems.append(f"--heads {size.heads} / --kv-heads {size.kv_heads}: groups smaller than the small's "
                            f"{nh // nkv}")
        if size.intermediate < inter:
            problems.append(f"--intermediate {size.intermediate} < small {inter}")
        if size.vocab < V:
            problems.append(f"--vocab {size.vocab} < small {V}")
        if size.layers < L:
            problems.append(f"--layers {size.layers} < small {L}")
        eps = float(small["rms_norm_eps"])
        if eps <= 0:
            problems.append("rms_norm_eps must be > 0 (the constant dim's norm contribution hides in it)")
        if problems:
            raise ValueError("; ".join(problems))
        self.eps = eps
        self.r = ds // d
        # alpha: a power of 2 with alpha^2 >= 2 H'/H, so that c^2 = eps (alpha^2 H - H') >= H' eps > 0
        self.alpha = _pow2_at_least(math.sqrt(2.0 * Hs / H))
        self.c = math.sqrt(max(0.0, eps * (self.alpha**2 * H - Hs)))
        self.sigma = 1.0 if "norm_uncompensated" in self.mut else math.sqrt(H / Hs)
        self.bf16_exact_sigma = math.log2(Hs / H) % 2 == 0
        # s_k: a power of 2 near sqrt(r): k_norm's effective eps is r eps / s_k^2 (exact when r is a power of 4)
        self.s_k = 2.0 ** math.ceil(math.log2(self.r) / 2) if self.r > 1 else 1.0
        self.eps_k = self.r * eps / self.s_k**2
        # the padded rows' gain: gap = G c / (alpha sigma rms) -> G = pad_gap alpha sigma / c at rms 1
        self.pad_gap = pad_gap
        self.G = pad_gap * self.alpha * math.sqrt(H / Hs) / self.c if self.c > 0 else 0.0
        self.const_dim = Hs - 1
        # layers
        if placement == "first" or L == 1:
            self.layer_map = list(range(L))
        elif placement == "spread":
            self.layer_map = [round(i * (size.layers - 1) / (L - 1)) for i in range(L)]
        else:
            raise ValueError(f"--placement {placement!r}: first | spread")
        # heads: small KV head g -> shell KV head g * stride, its q heads keep their rank in the group
        grp, self.grp_s = nh // nkv, size.heads // size.kv_heads
        stride = size.kv_heads // nkv
        self.kv_map = [g * stride for g in range(nkv)]
        self.q_map = [self.kv_map[h // grp] * self.grp_s + h % grp for h in range(nh)]
        # head dims: neox pairs (i, i + d/2) -> (r i, r i + d'/2); the q copies fill r i + 1 .. r i + r - 1
        half, half_s = d // 2, ds // 2
        if "rope_contiguous" in self.mut:
            dim_map = list(range(d))
            dups = [[d * t + i for t in range(1, self.r)] for i in range(d)]
        else:
            dim_map = [self.r * i if i < half else self.r * (i - half) + half_s for i in range(d)]
            dups = [[dim_map[i] + t for t in range(1, self.r)] for i in range(d)]
        assert sorted(dim_map + [x for row in dups for x in row]) == list(range(ds))
        self.dim_map, self.dups = dim_map, dups
        # the draft
        self.draft = draft
        if draft is not None:
            ids = list(draft["dflash_config"]["target_layer_ids"])
            if max(ids) > L - 2:
                raise ValueError(f"draft target_layer_ids {ids}: SGLang captures layer outputs up to L - 2 = {L - 2}")
            self.draft_ids = ids if "ids_unmapped" in self.mut else [self.layer_map[i] for i in ids]
            # one embedding (c, alpha) and one head map for both models: these must agree
            for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps"):
                if draft.get(k) != small.get(k):
                    raise ValueError(f"draft {k} {draft.get(k)} != target's {small.get(k)}")
            if draft["intermediate_size"] > size.intermediate:
                raise ValueError(f"--intermediate {size.intermediate} < the draft's {draft['intermediate_size']}")

    # ------------------------------------------------------------------ index tensors (device-independent)

    def q_rows(self) -> torch.Tensor:
        """Shell q_proj row of each small q_proj row (h d + i)."""
        ds = self.size.head_dim
        return torch.tensor([self.q_map[h] * ds + self.dim_map[i] for h in range(self.nh) for i in range(self.d)])

    def q_dup_rows(self) -> list[torch.Tensor]:
        ds = self.size.head_dim
        return [torch.tensor([self.q_map[h] * ds + self.dups[i][t] for h in range(self.nh) for i in range(self.d)])
                for t in range(self.r - 1)]

    def kv_rows(self) -> torch.Tensor:
        ds = self.size.head_dim
        return torch.tensor([self.kv_map[g] * ds + self.dim_map[i] for g in range(self.nkv) for i in range(self.d)])

    def kv_pad_rows(self) -> torch.Tensor:
        """The extra dims of the small KV heads' shell heads (k must be 0 there)."""
        ds = self.size.head_dim
        return torch.tensor([self.kv_map[g] * ds + self.dups[i][t] for g in range(self.nkv) for i in range(self.d)
                             for t in range(self.r - 1)], dtype=torch.long)

    def o_live_cols(self) -> torch.Tensor:
        """o_proj input columns that can be non-zero: every q head of a used KV group, at the real dims."""
        ds = self.size.head_dim
        return torch.tensor([(g * self.grp_s + t) * ds + self.dim_map[i]
                             for g in self.kv_map for t in range(self.grp_s) for i in range(self.d)])

    def head_norm(self, w: torch.Tensor) -> torch.Tensor:
        """q_norm / k_norm [d] -> [d']: the real dims and their copies carry the small weight."""
        out = torch.ones(self.size.head_dim, device=w.device)
        out[torch.tensor(self.dim_map, device=w.device)] = w
        for t in range(self.r - 1):
            out[torch.tensor([self.dups[i][t] for i in range(self.d)], device=w.device)] = w
        return out

    def hidden_norm(self, w: torch.Tensor | None, const: float, device) -> torch.Tensor:
        """A hidden-size RMSNorm weight: sigma * w on [0, H), `const` at the constant dim, 1 elsewhere."""
        out = torch.ones(self.size.hidden, device=device)
        out[: self.H] = self.sigma * (w if w is not None else 1.0)
        out[self.const_dim] = const
        return out

    def params(self) -> dict:
        """What --check (and a reader) needs to interpret the shell: written to OUT/shell.json."""
        return {
            "small": {k: self.small[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                 "num_key_value_heads", "head_dim", "intermediate_size",
                                                 "vocab_size", "rms_norm_eps")},
            "size": asdict(self.size), "placement": self.placement, "layer_map": self.layer_map,
            "alpha": self.alpha, "const": self.c, "const_dim": self.const_dim, "sigma": self.sigma,
            "sigma_bf16_exact": self.bf16_exact_sigma, "k_scale": self.s_k, "eps": self.eps,
            "eps_effective_k_norm": self.eps_k, "pad_gap_at_rms_1": self.pad_gap, "pad_gain": self.G,
            "kv_map": self.kv_map, "q_map": self.q_map, "dim_map": self.dim_map,
            "draft_target_layer_ids": getattr(self, "draft_ids", None), "mutations": sorted(self.mut),
        }


class Rand:
    """N(0, RAND_STD) float32 tensors on `device`, seeded per tensor name (so one tensor's values never depend
    on which others were made, or in what order)."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed, self.device = seed, device

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        seed = (self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62
        g = torch.Generator(device=self.device).manual_seed(seed)
        return torch.randn(shape, generator=g, device=self.device).mul_(RAND_STD)


# ------------------------------------------------------------------------------------------------ tensors


def layer_tensors(sh: Shell, prefix: str, w: Callable[[str], torch.Tensor] | None, rnd: Rand,
                  inter: int) -> list[TensorSpec]:
    """One shell decoder layer (target or draft, same names under `prefix`); w(suffix) gives the small layer's
    float32 weights on the device, or None for a layer that must add exactly 0 to the residual; `inter` is the
    small model's MLP width (target and drafter may differ)."""
    z, H, a, dev = sh.size, sh.H, sh.alpha, rnd.device
    qn, kvn = z.heads * z.head_dim, z.kv_heads * z.head_dim
    specs: list[TensorSpec] = []

    def add(suffix: str, shape: tuple[int, ...], fn: Callable[[], torch.Tensor]) -> None:
        specs.append((prefix + suffix, shape, fn))

    def q_proj() -> torch.Tensor:
        t = rnd(prefix + "self_attn.q_proj.weight", (qn, z.hidden))
        if w is not None:
            wq = w("self_attn.q_proj.weight")
            t[sh.q_rows().to(dev), :H] = wq
            for rows in sh.q_dup_rows():  # the copies that keep mean(q^2) (see the docstring)
                t[rows.to(dev), :H] = 0.0 if "softmax_uncompensated" in sh.mut else wq
        return t

    def k_proj() -> torch.Tensor:
        t = rnd(prefix + "self_attn.k_proj.weight", (kvn, z.hidden))
        if w is not None:
            t[sh.kv_pad_rows().to(dev), :H] = 0.0  # k is 0 on the extra dims of the small's KV heads
            t[sh.kv_rows().to(dev), :H] = sh.s_k * w("self_attn.k_proj.weight")
        return t

    def v_proj() -> torch.Tensor:
        t = rnd(prefix + "self_attn.v_proj.weight", (kvn, z.hidden))
        t[:, :H] = 0.0  # v = 0 for every KV head and dim that is not the small's (a dead layer: all of them)
        if w is not None:
            t[sh.kv_rows().to(dev), :H] = w("self_attn.v_proj.weight")
        return t

    def o_proj() -> torch.Tensor:
        t = rnd(prefix + "self_attn.o_proj.weight", (z.hidden, qn))
        if w is not None:
            t[:, sh.o_live_cols().to(dev)] = 0.0
            t[:H, sh.q_rows().to(dev)] = a * w("self_attn.o_proj.weight")
        return t

    def gate() -> torch.Tensor:
        t = rnd(prefix + "mlp.gate_proj.weight", (z.intermediate, z.hidden))
        if w is not None:
            t[:inter, :H] = w("mlp.gate_proj.weight")
        return t

    def up() -> torch.Tensor:
        t = rnd(prefix + "mlp.up_proj.weight", (z.intermediate, z.hidden))
        t[:, :H] = 0.0  # silu(gate) * 0 = 0 for every unit that is not the small's
        if w is not None:
            t[:inter, :H] = w("mlp.up_proj.weight")
        return t

    def down() -> torch.Tensor:
        t = rnd(prefix + "mlp.down_proj.weight", (z.hidden, z.intermediate))
        if w is not None:
            t[:, :inter] = 0.0
            t[:H, :inter] = a * w("mlp.down_proj.weight")
        return t

    def norm(suffix: str) -> Callable[[], torch.Tensor]:
        return lambda: sh.hidden_norm(w(suffix) if w is not None else None, 0.0, dev)

    def head_norm(suffix: str) -> Callable[[], torch.Tensor]:
        return lambda: sh.head_norm(w(suffix)) if w is not None else torch.ones(z.head_dim, device=dev)

    add("input_layernorm.weight", (z.hidden,), norm("input_layernorm.weight"))
    add("self_attn.q_proj.weight", (qn, z.hidden), q_proj)
    add("self_attn.k_proj.weight", (kvn, z.hidden), k_proj)
    add("self_attn.v_proj.weight", (kvn, z.hidden), v_proj)
    add("self_attn.o_proj.weight", (z.hidden, qn), o_proj)
    add("self_attn.q_norm.weight", (z.head_dim,), head_norm("self_attn.q_norm.weight"))
    add("self_attn.k_norm.weight", (z.head_dim,), head_norm("self_attn.k_norm.weight"))
    add("post_attention_layernorm.weight", (z.hidden,), norm("post_attention_layernorm.weight"))
    add("mlp.gate_proj.weight", (z.intermediate, z.hidden), gate)
    add("mlp.up_proj.weight", (z.intermediate, z.hidden), up)
    add("mlp.down_proj.weight", (z.hidden, z.intermediate), down)
    return specs


def small_getter(sd: dict[str, torch.Tensor], prefix: str, device) -> Callable[[str], torch.Tensor]:
    return lambda suffix: sd[prefix + suffix].to(device=device, dtype=torch.float32)


def target_tensors(sh: Shell, sd: dict[str, torch.Tensor], rnd: Rand) -> list[TensorSpec]:
    """The shell target's tensors in file order (HF Qwen3ForCausalLM names), each made when called."""
    z, H, V, dev = sh.size, sh.H, sh.V, rnd.device
    twin = torch.arange(z.vocab) % V  # padded token p reads its twin p mod V's rows

    def embed() -> torch.Tensor:
        t = torch.zeros(z.vocab, z.hidden, device=dev)  # a lookup, not a GEMM: the zero dims cost nothing
        t[:, :H] = sh.alpha * sd["model.embed_tokens.weight"].to(dev, torch.float32)[twin.to(dev)]
        t[:, sh.const_dim] = sh.c
        return t

    def lm_head() -> torch.Tensor:
        t = rnd("lm_head.weight", (z.vocab, z.hidden))
        t[:, :H] = sd["lm_head.weight"].to(dev, torch.float32)[twin.to(dev)]
        t[:V, sh.const_dim] = 0.0
        t[V:, sh.const_dim] = -sh.G
        return t

    specs: list[TensorSpec] = [("model.embed_tokens.weight", (z.vocab, z.hidden), embed)]
    real = {m: i for i, m in enumerate(sh.layer_map)}
    for m in range(z.layers):
        w = small_getter(sd, f"model.layers.{real[m]}.", dev) if m in real else None
        specs += layer_tensors(sh, f"model.layers.{m}.", w, rnd, sh.inter)
    fin = sd["model.norm.weight"]
    specs.append(("model.norm.weight", (z.hidden,), lambda: sh.hidden_norm(fin.to(dev, torch.float32), 1.0, dev)))
    specs.append(("lm_head.weight", (z.vocab, z.hidden), lm_head))
    return specs


def draft_tensors(sh: Shell, sd: dict[str, torch.Tensor], rnd: Rand) -> list[TensorSpec]:
    """The shell drafter's tensors (names as make_tiny_models.draft_weight_specs)."""
    assert sh.draft is not None
    z, H, dev = sh.size, sh.H, rnd.device
    n_layers, k = sh.draft["num_hidden_layers"], len(sh.draft["dflash_config"]["target_layer_ids"])
    specs: list[TensorSpec] = []
    for i in range(n_layers):
        specs += layer_tensors(sh, f"layers.{i}.", small_getter(sd, f"layers.{i}.", dev), rnd,
                               sh.draft["intermediate_size"])

    def fc() -> torch.Tensor:
        t = rnd("fc.weight", (z.hidden, k * z.hidden))
        small = sd["fc.weight"].to(dev, torch.float32)
        for f in range(k):
            base = f * z.hidden
            t[:, base: base + H] = 0.0
            t[:, base + sh.const_dim] = 0.0
            t[:H, base: base + H] = small[:, f * H: (f + 1) * H]  # input alpha f -> output alpha y
        t[sh.const_dim, sh.const_dim] = 1.0  # feature 0's constant c -> the projection's constant dim
        return t

    specs.append(("fc.weight", (z.hidden, k * z.hidden), fc))
    specs.append(("hidden_norm.weight", (z.hidden,),
                  lambda: sh.hidden_norm(sd["hidden_norm.weight"].to(dev, torch.float32), 0.0, dev)))
    specs.append(("norm.weight", (z.hidden,),
                  lambda: sh.hidden_norm(sd["norm.weight"].to(dev, torch.float32), 1.0, dev)))
    return specs


# ------------------------------------------------------------------------------------------------ configs


def target_config(sh: Shell, dtype: str) -> dict:
    cfg = dict(sh.small)
    z = sh.size
    cfg.update({"hidden_size": z.hidden, "num_hidden_layers": z.layers, "num_attention_heads": z.heads,
                "num_key_value_heads": z.kv_heads, "head_dim": z.head_dim, "intermediate_size": z.intermediate,
                "vocab_size": z.vocab, "dtype": dtype})
    if "layer_types" in cfg:
        cfg["layer_types"] = ["full_attention"] * z.layers
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = z.layers
    cfg.pop("torch_dtype", None)
    return cfg


def draft_config(sh: Shell, dtype: str) -> dict:
    assert sh.draft is not None
    cfg = json.loads(json.dumps(sh.draft))
    z = sh.size
    cfg.update({"hidden_size": z.hidden, "num_attention_heads": z.heads, "num_key_value_heads": z.kv_heads,
                "head_dim": z.head_dim, "intermediate_size": z.intermediate, "vocab_size": z.vocab,
                "num_target_layers": z.layers, "torch_dtype": dtype})
    cfg["dflash_config"]["target_layer_ids"] = list(sh.draft_ids)
    if "target_layer_ids" in cfg:  # a top-level copy, if the small config has one
        cfg["target_layer_ids"] = list(sh.draft_ids)
    return cfg


# ------------------------------------------------------------------------------------------------ files


def read_weights(model_dir: Path, device="cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f), device=str(device)))
    return sd


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) shard by shard: what SGLang's load_weights takes, one shard in memory at a time."""
    from safetensors.torch import load_file

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        yield from load_file(str(f)).items()


def write_safetensors(out_dir: Path, specs: list[TensorSpec], dtype: torch.dtype, max_shard_bytes: int,
                      log: Callable[[str], None] = print) -> dict:
    """Streams `specs` into HF-style shards (model.safetensors, or model-0000i-of-0000N.safetensors + the
    index): the header of each shard is written from the shapes, then each tensor is made, cast, written and
    dropped, so the peak memory is one tensor (and its cast), whatever the model's size."""
    esize = torch.empty(0, dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]] = [[]]
    size = 0
    for spec in specs:
        n = math.prod(spec[1]) * esize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    zeros: dict[str, list[int]] = {}  # GEMM weight kind -> [zeros, elements]: how much of each GEMM is zero
    for fname, shard in zip(names, shards, strict=True):
        t0 = time.perf_counter()
        header: dict = {"__metadata__": {"format": "pt"}}
        off = 0
        for name, shape, _ in shard:
            n = math.prod(shape) * esize
            header[name] = {"dtype": ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(out_dir / fname, "wb") as f:
            f.write(len(hb).to_bytes(8, "little"))
            f.write(hb)
            for name, shape, make in shard:
                t = make()
                if tuple(t.shape) != tuple(shape):
                    raise AssertionError(f"{name}: made {tuple(t.shape)}, declared {shape}")
                t = t.to(dtype).contiguous()
                if t.dim() == 2 and "embed_tokens" not in name:  # the embedding is a lookup, not a GEMM
                    z = zeros.setdefault(name.split(".")[-2], [0, 0])
                    z[0] += t.numel() - int(torch.count_nonzero(t))
                    z[1] += t.numel()
                t = t.cpu()
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                del t
        total += off
        log(f"  {fname}: {len(shard)} tensors, {off / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")
    if len(shards) > 1:
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    zf = {k: round(z / n, 4) for k, (z, n) in sorted(zeros.items())}
    all_z = sum(z for z, _ in zeros.values()) / max(1, sum(n for _, n in zeros.values()))
    return {"files": names, "bytes": total, "params": sum(math.prod(s) for _, s, _ in specs),
            "gemm_zero_fraction": round(all_z, 4), "gemm_zero_fraction_by_weight": zf}


def state_dict(specs: list[TensorSpec], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The specs materialised in memory (tests and small shells)."""
    return {name: make().to(dtype) for name, _, make in specs}


# ------------------------------------------------------------------------------------------------ build


def build(pair: Path, out: Path, size: ShellSize, *, dtype: str = "bfloat16", placement: str = "first",
          device: str = "cpu", seed: int = 0, pad_gap: float = 1e5, max_shard_gb: float = 4.0,
          mutations: tuple[str, ...] = (), log: Callable[[str], None] = print) -> dict:
    t0 = time.perf_counter()
    dev = torch.device(device)
    tdir, ddir = pair / "target", pair / "draft"
    small = json.loads((tdir / "config.json").read_text())
    dcfg = json.loads((ddir / "config.json").read_text()) if (ddir / "config.json").exists() else None
    sh = Shell(small, size, draft=dcfg, placement=placement, pad_gap=pad_gap, mutations=mutations)
    tdt = DTYPES[dtype]
    rnd = Rand(seed, dev)
    t_specs = target_tensors(sh, read_weights(tdir), rnd)
    d_specs = draft_tensors(sh, read_weights(ddir), rnd) if dcfg is not None else []
    esize = torch.empty(0, dtype=tdt).element_size()
    need = sum(math.prod(s) for _, s, _ in t_specs + d_specs) * esize
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if need > free:
        raise OSError(f"{out}: the shell needs {need / 2**30:.1f} GiB, the disk has {free / 2**30:.1f} GiB free")
    if not sh.bf16_exact_sigma and tdt != torch.float32:
        log(f"note: sqrt(H/H') = {sh.sigma:.6f} is not a power of 2: the norm weights round in {dtype}")
    res: dict = {"out": str(out), "dtype": dtype, "device": str(dev), "shell": sh.params()}
    for sub, specs, cfg in (("target", t_specs, target_config(sh, dtype)),
                            ("draft", d_specs, draft_config(sh, dtype) if dcfg else None)):
        if cfg is None:
            continue
        d = out / sub
        d.mkdir(parents=True, exist_ok=True)
        for old in d.iterdir():  # a previous shell's shards would be loaded with these
            if old.is_file() and (old.suffix in WEIGHT_FILES or old.name.endswith(".index.json")):
                old.unlink()
        ts = time.perf_counter()
        log(f"{sub}: {sum(math.prod(s) for _, s, _ in specs) / 1e9:.3f} B params -> {d}")
        info = write_safetensors(d, specs, tdt, int(max_shard_gb * 2**30), log)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        info["wall_s"] = round(time.perf_counter() - ts, 2)
        res[sub] = info
    # the tokenizer and generation files (everything in PAIR/target that is not weights or config)
    copied = []
    for f in sorted(tdir.iterdir()):
        weights_or_config = f.suffix in WEIGHT_FILES or f.name == "config.json" or f.name.endswith(".index.json")
        if f.is_file() and not weights_or_config:
            shutil.copy2(f, out / "target" / f.name)
            copied.append(f.name)
    res["copied"] = copied
    if (pair / "heldout_prompts.json").exists():
        shutil.copy2(pair / "heldout_prompts.json", out / "heldout_prompts.json")
    (out / SHELL_JSON).write_text(json.dumps(sh.params(), indent=1))
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    return res


# ------------------------------------------------------------------------------------------------ check


def no_init() -> AbstractContextManager:
    """transformers' no_init_weights where it exists: every parameter is copied in afterwards, and the random
    init costs seconds on CPU even for a small shell (another transformers: init, then overwrite)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return nullcontext()
    return no_init_weights()


def load_target(path: Path, device, dtype: torch.dtype = torch.float32):
    """transformers' Qwen3ForCausalLM from a (sharded) checkpoint, built on `device` (no accelerate needed:
    each shard is copied in, so host RAM holds one shard, not the model)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen3ForCausalLM

    cfg = AutoConfig.from_pretrained(str(path))
    with torch.device(device), no_init():
        m = Qwen3ForCausalLM(cfg)
    m = m.to(dtype).eval()
    params = dict(m.named_parameters())
    seen = set()
    with torch.no_grad():
        for f in sorted(Path(path).glob("*.safetensors")):
            for k, v in load_file(str(f), device=str(device)).items():
                params[k].copy_(v)
                seen.add(k)
    missing = set(params) - seen
    if missing:
        raise KeyError(f"{path}: no weights for {sorted(missing)[:5]}")
    return m


def load_draft(path: Path, device, dtype: torch.dtype = torch.float32):
    tp = __import__("train_pair")
    cfg = json.loads((Path(path) / "config.json").read_text())
    m = tp.DFlashDraft(cfg)
    m.load_state_dict({k: v.float() for k, v in read_weights(path).items()}, strict=True)
    return m.to(device=device, dtype=dtype).eval()


def check_prompts(pair: Path, n: int, seed: int, vocab: int, max_len: int = 256) -> list[torch.Tensor]:
    """PAIR/heldout_prompts.json's first n prompts (capped at max_len tokens), else seeded random ones."""
    p = pair / "heldout_prompts.json"
    if p.exists():
        return [torch.tensor(q["input_ids"][:max_len]) for q in json.loads(p.read_text())["prompts"][:n]]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (int(torch.randint(8, 64, (1,), generator=g)),), generator=g) for _ in range(n)]


@torch.no_grad()
def greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation [B, n] of ids [B, L] (argmax over the model's whole vocabulary), with a KV cache."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    toks = []
    for i in range(n):
        tok = out.logits[:, -1].float().argmax(-1)
        toks.append(tok)
        if i + 1 < n:
            out = model(input_ids=tok[:, None], past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
    return torch.stack(toks, 1)


def _pad_stats(lo: torch.Tensor, v: int, temp: float = 0.8) -> dict:
    """Margin best real - best padded logit (min over positions) and the padded probability at `temp`."""
    if lo.shape[-1] <= v:
        return {}
    margin = lo[..., :v].max(-1).values - lo[..., v:].max(-1).values
    p_pad = torch.softmax(lo / temp, -1)[..., v:].sum(-1)
    return {"pad_margin_min": float(margin.min()), "pad_prob_t0.8_max": float(p_pad.max())}


def tie_step(logit: float, dtype: torch.dtype, rel: float) -> float:
    """The gap below which two logits count as tied: one step of `dtype` at the logit's magnitude (bf16: 0.125
    at 16..32, DESIGN.md's rule), or rel * |logit| if larger (float32: the comparison's own tolerance)."""
    mag = 2.0 ** math.floor(math.log2(max(abs(logit), 1e-30)))
    return max(mag * torch.finfo(dtype).eps, rel * abs(logit))


@torch.no_grad()
def logits_diff(small, shell, prompts: list[torch.Tensor], device) -> float:
    """max |shell - small| of the teacher-forced logits over the real vocabulary, on the prompts."""
    v = small.config.vocab_size
    return max(float((shell(input_ids=p[None].to(device)).logits[0, :, :v].float()
                      - small(input_ids=p[None].to(device)).logits[0].float()).abs().max()) for p in prompts)


@torch.no_grad()
def k_norm_eps_effect(shell, params: dict, prompts: list[torch.Tensor], device) -> dict:
    """max |logits as built - logits with k_norm's eps set to the value that is exact| over the real vocabulary:
    the same model, the same summation order, so what is left is the eps residual alone (set in memory, then
    put back)."""
    exact = params["eps"] * params["k_scale"] ** 2 / (params["size"]["head_dim"] / params["small"]["head_dim"])
    v = params["small"]["vocab_size"]
    layers = shell.model.layers
    ids = [p[None].to(device) for p in prompts]
    built = [shell(input_ids=x).logits[..., :v].float() for x in ids]
    try:
        for layer in layers:
            layer.self_attn.k_norm.variance_epsilon = exact
        diff = max(float((shell(input_ids=x).logits[..., :v].float() - b).abs().max())
                   for x, b in zip(ids, built, strict=True))
    finally:
        for layer in layers:
            layer.self_attn.k_norm.variance_epsilon = params["eps"]
    scale = max(float(b.abs().max()) for b in built)
    return {"eps_effective": params["eps_effective_k_norm"], "eps_that_would_be_exact": exact,
            "logits_max_abs_diff": diff, "logits_max_rel_diff": diff / scale}


@torch.no_grad()
def compare_targets(small, shell, prompts: list[torch.Tensor], new_tokens: int, device,
                    tie_rel: float = 1e-4) -> dict:
    """Greedy continuations (token identity; prompts of one length run as one batch), teacher-forced logits
    over the real vocabulary on prompt + the small model's continuation, the padded margin. A divergence
    where the small model's top two logits are within tie_step() is a numeric tie (DESIGN.md's rule)."""
    v = small.config.vocab_size
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(int(p.numel()), []).append(i)
    cases: list[dict] = [{} for _ in prompts]
    for n, idx in by_len.items():
        ids = torch.stack([prompts[i] for i in idx]).to(device)
        a, b = greedy(small, ids, new_tokens), greedy(shell, ids, new_tokens)
        seq = torch.cat([ids, a], 1)
        lo_s, lo_h = small(input_ids=seq).logits.float(), shell(input_ids=seq).logits.float()
        for row, i in enumerate(idx):
            ls, lh = lo_s[row], lo_h[row]
            diff = float((lh[:, :v] - ls).abs().max())
            case = {"prompt_len": n, "tokens_equal": bool(torch.equal(a[row], b[row])), "logits_max_abs_diff": diff,
                    "logits_max_rel_diff": diff / float(ls.abs().max()), **_pad_stats(lh, v)}
            if not case["tokens_equal"]:
                k = int((a[row] != b[row]).nonzero()[0])
                top2 = ls[n - 1 + k].topk(2).values
                gap = float(top2[0] - top2[1])
                case.update({"first_divergence": k, "small_top2_gap_there": gap,
                             "numeric_tie": gap <= tie_step(float(top2[0]), small.dtype, tie_rel)})
            cases[i] = case
    margins = [c["pad_margin_min"] for c in cases if "pad_margin_min" in c]
    return {"prompts": len(prompts), "new_tokens": new_tokens, "tokens_equal": all(c["tokens_equal"] for c in cases),
            "divergences_not_ties": sum(1 for c in cases if not c["tokens_equal"] and not c["numeric_tie"]),
            "logits_max_abs_diff": max(c["logits_max_abs_diff"] for c in cases),
            "logits_max_rel_diff": max(c["logits_max_rel_diff"] for c in cases),
            "pad_margin_min": min(margins) if margins else None,
            "pad_prob_t0.8_max": max((c["pad_prob_t0.8_max"] for c in cases if "pad_prob_t0.8_max" in c), default=None),
            "cases": cases}


@torch.no_grad()
def compare_drafts(small_t, shell_t, small_d, shell_d, params: dict, prompts: list[torch.Tensor], device,
                   tie_rel: float = 1e-4) -> dict:
    """The drafter's block (bonus + masks at positions L..L+15) on each prompt: captured features (shell's
    [0, H) / alpha vs small's, constant dim, zero dims), normed hidden states, logits over the real
    vocabulary, per-position argmax tokens over the whole vocabulary, padded margin."""
    tp = __import__("train_pair")
    v, H, Hs = small_t.config.vocab_size, params["small"]["hidden_size"], params["size"]["hidden"]
    alpha, c, j = params["alpha"], params["const"], params["const_dim"]
    ids_s = small_d.cfg["dflash_config"]["target_layer_ids"]
    ids_h = shell_d.cfg["dflash_config"]["target_layer_ids"]
    mask = int(small_d.cfg["dflash_config"]["mask_token_id"])
    block = int(small_d.cfg["dflash_config"].get("block_size", 16))
    tap_s, tap_h = tp.FeatureTap(small_t, ids_s), tp.FeatureTap(shell_t, ids_h)
    res = {"features_max_abs_diff": 0.0, "features_max_rel_diff": 0.0, "features_const_max_abs_diff": 0.0,
           "features_zero_dims_max_abs": 0.0,
           "hidden_max_abs_diff": 0.0, "hidden_zero_dims_max_abs": 0.0, "logits_max_abs_diff": 0.0,
           "logits_max_rel_diff": 0.0, "draft_tokens_equal": True, "pad_margin_min": None,
           "pad_prob_t0.8_max": None, "draft_mismatches_not_ties": 0, "blocks": 0}
    try:
        for p in prompts:
            ids = p[None].to(device)
            L = ids.shape[1]
            tap_s.on = tap_h.on = True
            bonus = small_t(input_ids=ids, logits_to_keep=1).logits[:, -1].float().argmax(-1)
            shell_t(input_ids=ids, logits_to_keep=1)
            tap_s.on = tap_h.on = False
            fs, fh = tap_s.features(), tap_h.features()
            k = len(ids_s)
            fh4 = fh.view(1, L, k, Hs)
            fs4 = fs.view(1, L, k, H)
            zero = torch.ones(Hs, dtype=torch.bool, device=fh.device)
            zero[:H] = False
            zero[j] = False
            f_abs = float((fh4[..., :H] / alpha - fs4).abs().max())
            res["features_max_abs_diff"] = max(res["features_max_abs_diff"], f_abs)
            res["features_max_rel_diff"] = max(res["features_max_rel_diff"], f_abs / float(fs4.abs().max()))
            res["features_const_max_abs_diff"] = max(res["features_const_max_abs_diff"],
                                                     float((fh4[..., j] - c).abs().max()))
            res["features_zero_dims_max_abs"] = max(res["features_zero_dims_max_abs"],
                                                    float(fh4[..., zero].abs().max()))
            blk = torch.full((1, block), mask, device=ids.device)
            blk[0, 0] = bonus[0]
            pos = torch.arange(L, device=ids.device)
            bpos = L + torch.arange(block, device=ids.device)
            hs = small_d(fs, pos, small_t.get_input_embeddings()(blk), bpos)[0]
            hh = shell_d(fh, pos, shell_t.get_input_embeddings()(blk), bpos)[0]
            lo_s = small_t.get_output_embeddings()(hs[1:]).float()
            lo_h = shell_t.get_output_embeddings()(hh[1:]).float()
            d_abs = float((lo_h[:, :v] - lo_s).abs().max())
            res["hidden_max_abs_diff"] = max(res["hidden_max_abs_diff"], float((hh[:, :H] - hs).abs().max()))
            res["hidden_zero_dims_max_abs"] = max(res["hidden_zero_dims_max_abs"], float(hh[:, zero].abs().max()))
            res["logits_max_abs_diff"] = max(res["logits_max_abs_diff"], d_abs)
            res["logits_max_rel_diff"] = max(res["logits_max_rel_diff"], d_abs / float(lo_s.abs().max()))
            ts_, th_ = lo_s.argmax(-1), lo_h.argmax(-1)
            res["draft_tokens_equal"] &= bool(torch.equal(ts_, th_))
            for q in (ts_ != th_).nonzero().flatten().tolist():  # a differing position: tie or fault
                top = float(lo_s[q, ts_[q]])
                if th_[q] >= v or top - float(lo_s[q, th_[q]]) > tie_step(top, small_t.dtype, tie_rel):
                    res["draft_mismatches_not_ties"] += 1
            st = _pad_stats(lo_h, v)
            if st:
                res["pad_margin_min"] = min(st["pad_margin_min"], res["pad_margin_min"] or math.inf)
                res["pad_prob_t0.8_max"] = max(st["pad_prob_t0.8_max"], res["pad_prob_t0.8_max"] or 0.0)
            res["blocks"] += 1
    finally:
        tap_s.remove()
        tap_h.remove()
    return res


def check_sglang(pair: Path, shell_dir: Path, prompts: list[torch.Tensor]) -> dict:
    """SGLang's own Qwen3ForCausalLM (features captured as the server does) and DFlashDraftModel (context K/V
    as DFlashWorker materialises it) for the small pair and the shell, on CPU in float32 (only RadixAttention
    is replaced, by check_pair_sglang's SDPA stand-ins): target logits over the real vocabulary and draft
    tokens, small vs shell. Initialises SGLang's process-wide state: run it in its own process."""
    cps = __import__("check_pair_sglang")
    from transformers import AutoConfig

    cps.sglang_cpu_init(str(shell_dir / "target"))
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM as SgQwen3

    def models(root: Path):
        dcfg = AutoConfig.from_pretrained(str(root / "draft"))
        ids = json.loads((root / "draft" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
        t = SgQwen3(AutoConfig.from_pretrained(str(root / "target")))
        t.load_weights(iter_weights(root / "target"))
        t = t.float().eval()
        t.set_dflash_layers_to_capture(ids)
        for layer in t.model.layers:
            cps._swap_attn(layer.self_attn, cps.CausalAttention(layer.self_attn.attn))
        d = DFlashDraftModel(dcfg)
        d.load_weights(iter_weights(root / "draft"))
        d = d.float().eval()
        stubs = []
        for layer in d.layers:
            at = layer.self_attn
            st = cps.BlockAttention(at.attn, at.num_heads, at.num_kv_heads, at.head_dim)
            cps._swap_attn(at, st)
            stubs.append(st)
        return t, d, stubs

    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig

    torch.set_grad_enabled(False)
    # the configs as the server parses them (ModelConfig: what launch_server builds from --model-path and
    # --speculative-draft-model-path)
    mc = {sub: ModelConfig(str(shell_dir / sub), is_draft_model=sub == "draft") for sub in ("target", "draft")}
    model_config = {sub: {"architectures": m.hf_config.architectures, "layers": m.num_hidden_layers,
                          "hidden": m.hidden_size, "vocab": m.vocab_size, "head_dim": m.head_dim,
                          "kv_heads": m.get_num_kv_heads(1), "dtype": str(m.dtype)} for sub, m in mc.items()}
    (ts, ds, ss), (th, dh, sh_) = models(pair), models(shell_dir)
    dj = json.loads((pair / "draft" / "config.json").read_text())["dflash_config"]
    mask, block = int(dj["mask_token_id"]), int(dj.get("block_size", 16))
    v = ts.config.vocab_size
    res = {"model_config": model_config, "target_logits_max_abs_diff": 0.0, "target_argmax_equal": True,
           "draft_logits_max_abs_diff": 0.0,
           "draft_tokens_equal": True, "draft_pad_margin_min": None, "blocks": 0}

    def target_pass(t, d, stubs, ids: torch.Tensor) -> torch.Tensor:
        """The target's logits over the prompt; leaves the drafter's context K/V (from the captured
        features, as DFlashWorker._append_target_hidden_sequential makes them) in its attention stubs."""
        pos = torch.arange(ids.numel())
        hidden, aux = t.model(ids, pos, SimpleNamespace(forward_mode=None))
        ctx = d.project_target_hidden(torch.cat(aux, -1))
        for layer, st in zip(d.layers, stubs, strict=True):
            at = layer.self_attn
            k, val = at.kv_proj_only(ctx)
            k = at.apply_k_rope(pos, at.apply_k_norm(k))
            st.ctx_k, st.ctx_v = k.view(-1, at.num_kv_heads, at.head_dim), val.view(-1, at.num_kv_heads, at.head_dim)
        return hidden @ t.lm_head.weight.T

    def draft_pass(t, d, blk: torch.Tensor, bpos: torch.Tensor) -> torch.Tensor:
        h = d(blk, bpos, None, input_embeds=t.model.embed_tokens(blk)).hidden_states
        return h[1:] @ t.lm_head.weight.T

    for p in prompts:
        lo_s, lo_h = target_pass(ts, ds, ss, p), target_pass(th, dh, sh_, p)
        res["target_logits_max_abs_diff"] = max(res["target_logits_max_abs_diff"],
                                                float((lo_h[:, :v] - lo_s).abs().max()))
        res["target_argmax_equal"] &= bool(torch.equal(lo_s.argmax(-1), lo_h.argmax(-1)))
        blk = torch.full((block,), mask)
        blk[0] = lo_s[-1].argmax()
        bpos = p.numel() + torch.arange(block)
        ls, lh = draft_pass(ts, ds, blk, bpos), draft_pass(th, dh, blk, bpos)
        res["draft_logits_max_abs_diff"] = max(res["draft_logits_max_abs_diff"], float((lh[:, :v] - ls).abs().max()))
        res["draft_tokens_equal"] &= bool(torch.equal(ls.argmax(-1), lh.argmax(-1)))
        st = _pad_stats(lh, v)
        if st:
            res["draft_pad_margin_min"] = min(st["pad_margin_min"], res["draft_pad_margin_min"] or math.inf)
        res["blocks"] += 1
    return res


def check(pair: Path, shell_dir: Path, *, device: str = "cpu", dtype: str = "float32", n_prompts: int = 8,
          new_tokens: int = 32, seed: int = 0, tol: float = 1e-4, sglang: bool = False) -> dict:
    t0 = time.perf_counter()
    dev, dt = torch.device(device), DTYPES[dtype]
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (TF32 would round to 10 bits)
    torch.backends.cudnn.allow_tf32 = False
    params = json.loads((shell_dir / SHELL_JSON).read_text())
    small_t, shell_t = load_target(pair / "target", dev, dt), load_target(shell_dir / "target", dev, dt)
    t_load = time.perf_counter() - t0
    prompts = check_prompts(pair, n_prompts, seed, small_t.config.vocab_size)
    res: dict = {"pair": str(pair), "shell": str(shell_dir), "device": str(dev), "dtype": dtype, "tol": tol,
                 "load_s": round(t_load, 1)}
    res["target"] = compare_targets(small_t, shell_t, prompts, new_tokens, dev, tol)
    # the one residual of the construction: k_norm's eps is r eps / s_k^2, not eps (config.json has one eps for
    # all norms). Its effect alone: the shell's teacher-forced logits as built vs with k_norm's eps set exactly
    res["k_norm_eps_effect"] = k_norm_eps_effect(shell_t, params, prompts, dev)
    if (pair / "draft").exists():
        small_d, shell_d = load_draft(pair / "draft", dev, dt), load_draft(shell_dir / "draft", dev, dt)
        res["draft"] = compare_drafts(small_t, shell_t, small_d, shell_d, params, prompts, dev, tol)
    del small_t, shell_t
    if sglang:
        res["sglang"] = check_sglang(pair, shell_dir, prompts[:3])
    t, d = res["target"], res.get("draft")
    rel_tol = tol if dt == torch.float32 else 2.0 ** -6
    # float32: token-identical; bf16: every divergence a numeric tie (kernels differ with the GEMM shapes)
    exact = dt == torch.float32
    res["ok"] = bool((t["tokens_equal"] if exact else t["divergences_not_ties"] == 0)
                     and t["logits_max_rel_diff"] <= rel_tol
                     and (t["pad_margin_min"] is None or t["pad_margin_min"] > 0)
                     and (d is None or ((d["draft_tokens_equal"] if exact else d["draft_mismatches_not_ties"] == 0)
                                        and d["logits_max_rel_diff"] <= rel_tol
                                        and (d["pad_margin_min"] is None or d["pad_margin_min"] > 0)))
                     and (not sglang or (res["sglang"]["target_argmax_equal"]
                                         and res["sglang"]["draft_tokens_equal"])))
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pair", type=Path, help="the small pair: PAIR/target, PAIR/draft")
    ap.add_argument("out", type=Path, help="the shell: OUT/target, OUT/draft, OUT/shell.json")
    d = ShellSize()
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--kv-heads", type=int, default=d.kv_heads)
    ap.add_argument("--head-dim", type=int, default=d.head_dim)
    ap.add_argument("--intermediate", type=int, default=d.intermediate)
    ap.add_argument("--vocab", type=int, default=d.vocab)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    ap.add_argument("--placement", choices=["first", "spread"], default="first",
                    help="where the small layers go (the drafter's target_layer_ids follow)")
    ap.add_argument("--device", default=None, help="where tensors are made (default cuda if available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pad-gap", type=float, default=1e5,
                    help="padded token's logit below its twin's at final-residual rms 1 (scales as 1/rms)")
    ap.add_argument("--max-shard-gb", type=float, default=4.0)
    ap.add_argument("--check", action="store_true", help="compare small and shell after building")
    ap.add_argument("--check-only", action="store_true", help="compare an existing OUT, do not build")
    ap.add_argument("--check-dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--sglang", action="store_true", help="--check also with SGLang's model classes (CPU, float32)")
    ap.add_argument("--report", type=Path, default=None, help="write the JSON result here too")
    a = ap.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    res: dict = {}
    if not a.check_only:
        size = ShellSize(a.layers, a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate, a.vocab)
        b = build(a.pair, a.out, size, dtype=a.dtype, placement=a.placement, device=device, seed=a.seed,
                  pad_gap=a.pad_gap, max_shard_gb=a.max_shard_gb, log=lambda s: print(s, flush=True))
        print(f"built in {b['wall_s']:.1f} s: target {b['target']['params'] / 1e9:.3f} B params "
              f"{b['target']['bytes'] / 2**30:.2f} GiB in {len(b['target']['files'])} file(s)"
              + (f", draft {b['draft']['params'] / 1e9:.3f} B params {b['draft']['bytes'] / 2**30:.2f} GiB"
                 if "draft" in b else ""), flush=True)
        res["build"] = b
    ok = True
    if a.check or a.check_only:
        res["check"] = check(a.pair, a.out, device=device, dtype=a.check_dtype, n_prompts=a.prompts,
                             new_tokens=a.new_tokens, seed=a.seed, sglang=a.sglang)
        ok = res["check"]["ok"]
    line = json.dumps(res)
    print(line, flush=True)
    if a.report:
        a.report.write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The target: a tiny Llama-shaped causal LM on CPU (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Weights are read from the model directory's safetensors with Hugging Face Llama names. Everything is
computed in float64: a tree verify, a linear verify and a one-token decode reduce over different
lengths, and in float32 that reorders sums enough to flip an argmax between near-tied logits; in
float64 the lab's greedy outputs are identical across modes, as a lossless server's must be.

One request per forward (batch 1): each request has its own KV cache, so prefix lengths never need
padding, and a request's numbers never depend on what else is being served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPE = torch.float64


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_positions: int
    rope_theta: float
    rms_norm_eps: float
    bos_token_id: int
    eos_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=int(config["num_attention_heads"]),
            num_kv_heads=int(config.get("num_key_value_heads", config["num_attention_heads"])),
            max_positions=int(config["max_position_embeddings"]),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            bos_token_id=int(config["bos_token_id"]),
            eos_token_id=int(config["eos_token_id"]),
        )


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


class KVCache:
    """Keys and values of one request's committed tokens, preallocated to the context length."""

    def __init__(self, shape: ModelShape, capacity: int) -> None:
        size = (shape.num_layers, capacity, shape.num_kv_heads, shape.head_dim)
        self.k = torch.zeros(size, dtype=DTYPE)
        self.v = torch.zeros(size, dtype=DTYPE)
        self.length = 0

    def commit(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Append the new tokens' keys/values ([layers, n, kvh, d]); `rows` picks and orders them."""
        if rows is not None:
            k, v = k[:, rows], v[:, rows]
        n = k.shape[1]
        self.k[:, self.length : self.length + n] = k
        self.v[:, self.length : self.length + n] = v
        self.length += n

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [n, vocab] float64
    k: torch.Tensor  # [layers, n, kv_heads, head_dim]: the new tokens' keys, not yet committed
    v: torch.Tensor


class TinyLM:
    def __init__(self, shape: ModelShape, weights: dict[str, torch.Tensor]) -> None:
        self.shape = shape
        self.w = {name: t.to(DTYPE) for name, t in weights.items()}
        inv = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=DTYPE) / shape.head_dim))
        self.inv_freq = inv

    @classmethod
    def load(cls, model_dir: str | Path) -> TinyLM:
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        return cls(ModelShape.from_config(read_config(model_dir)), load_file(model_dir / "model.safetensors"))

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.shape, capacity)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.shape.rms_norm_eps) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [n, heads, d]; rotate-half convention, as Hugging Face Llama
        freqs = positions.to(DTYPE)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None = None
    ) -> ForwardOut:
        """Logits for `tokens` ([n]) at `positions` ([n]) after the cache's committed prefix.

        `mask` bool [n, n]: which new tokens each new token sees (None = causal); every new token
        sees the whole committed prefix. The cache is not changed: the caller commits what it keeps.
        """
        s = self.shape
        n = int(tokens.shape[0])
        prefix = cache.length
        if prefix + n > cache.k.shape[1]:
            raise ValueError(f"{prefix + n} tokens do not fit the KV cache of {cache.k.shape[1]}")
        if mask is None:
            mask = torch.ones((n, n), dtype=torch.bool).tril()
        full_mask = torch.cat([torch.ones((n, prefix), dtype=torch.bool), mask], 1)
        bias = torch.zeros(full_mask.shape, dtype=DTYPE).masked_fill(~full_mask, float("-inf"))
        group = s.num_heads // s.num_kv_heads
        x = self.w["model.embed_tokens.weight"][tokens]
        new_k, new_v = [], []
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            h = self._rms(x, self.w[p + "input_layernorm.weight"])
            q = (h @ self.w[p + "self_attn.q_proj.weight"].T).view(n, s.num_heads, s.head_dim)
            k = (h @ self.w[p + "self_attn.k_proj.weight"].T).view(n, s.num_kv_heads, s.head_dim)
            v = (h @ self.w[p + "self_attn.v_proj.weight"].T).view(n, s.num_kv_heads, s.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            new_k.append(k)
            new_v.append(v)
            keys = torch.cat([cache.k[i, :prefix], k], 0).repeat_interleave(group, dim=1)
            values = torch.cat([cache.v[i, :prefix], v], 0).repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) / s.head_dim**0.5 + bias
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, s.hidden_size)
            x = x + attn @ self.w[p + "self_attn.o_proj.weight"].T
            h = self._rms(x, self.w[p + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(h @ self.w[p + "mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ self.w[p + "mlp.up_proj.weight"].T)) @ self.w[p + "mlp.down_proj.weight"].T
        logits = self._rms(x, self.w["model.norm.weight"]) @ self.w["lm_head.weight"].T
        return ForwardOut(logits=logits, k=torch.stack(new_k), v=torch.stack(new_v))

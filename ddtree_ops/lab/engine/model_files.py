"""The lab's model directories: a dense target, the same target marked hybrid, and a draft.

Each is what SGLang expects of a local model: config.json, model.safetensors and a tokenizer
(tokenizer.json + tokenizer_config.json, byte-level: 3 special tokens then the 256 bytes). Weights
are seeded, so every host and every run gets the same bytes. `python -m ddtree_lab_engine.model_files
DIR` writes them (the lab writes them once on the control machine and copies them to each host).

The draft holds no network: it is a noisy oracle of the target (see `draft.py`), its quality set in
config.json under `ddtree_lab_draft`; its safetensors carries the one tensor it uses (a per-token
bias that makes its ranking of the target's runner-up tokens its own).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")
BOS_ID, EOS_ID = 1, 2
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
SEED = 20261201

TARGET_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
# What makes the payload (ddtree_utils.is_hybrid_model) and promote see a hybrid target. The engine
# still runs both layers as attention: the lab needs the marking, not a recurrent layer.
HYBRID_CONFIG: dict = {**TARGET_CONFIG, "layer_types": ["linear_attention", "full_attention"]}
DRAFT_BLOCK_SIZE = 16
DRAFT_CONFIG: dict = {
    **TARGET_CONFIG,
    "architectures": ["DFlashDraftModel"],
    "num_hidden_layers": 1,
    "block_size": DRAFT_BLOCK_SIZE,
    "dflash_config": {"block_size": DRAFT_BLOCK_SIZE, "target_layer_ids": [0, 1], "mask_token_id": 0},
    # quality: probability that the draft ranks the target's next token first at a position;
    # otherwise its first choice is another of the target's top_k tokens and the target's falls to
    # rank 1..top_k-1, where a DDTree still finds it (so full > shadow-linear = DFLASH > 1).
    "ddtree_lab_draft": {"quality": 0.75, "top_k": 4, "seed": 7},
}

MODELS = {"target": TARGET_CONFIG, "target-hybrid": HYBRID_CONFIG, "draft": DRAFT_CONFIG}


def target_weights(config: dict, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Seeded Llama weights, scaled so that logits spread over a few units (clear argmaxes)."""
    g = torch.Generator().manual_seed(seed)
    h, m = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = h // heads

    def normal(*size: int, std: float) -> torch.Tensor:
        return (torch.randn(*size, generator=g, dtype=torch.float64) * std).float()

    w = {"model.embed_tokens.weight": normal(config["vocab_size"], h, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = normal(heads * d, h, std=h**-0.5)
        w[p + "self_attn.k_proj.weight"] = normal(kv * d, h, std=h**-0.5)
        w[p + "self_attn.v_proj.weight"] = normal(kv * d, h, std=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = normal(h, heads * d, std=(heads * d) ** -0.5)
        w[p + "mlp.gate_proj.weight"] = normal(m, h, std=h**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(m, h, std=h**-0.5)
        w[p + "mlp.down_proj.weight"] = normal(h, m, std=m**-0.5)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = normal(config["vocab_size"], h, std=3.0 * h**-0.5)
    return w


def draft_weights(config: dict, seed: int = SEED + 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"lm_head.bias": (torch.randn(config["vocab_size"], generator=g, dtype=torch.float64) * 0.1).float()}


def tokenizer_json() -> dict:
    """A byte-level BPE without merges: every byte is one token (Hugging Face `tokenizers` format)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: bytes_of(ch))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return json.loads(tok.to_str())


def bytes_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode, inverted)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    others = [b for b in range(256) if b not in printable]
    code = ord(ch)
    return code if code in printable else others[code - 256]


TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": SPECIAL_TOKENS[BOS_ID],
    "eos_token": SPECIAL_TOKENS[EOS_ID],
    "pad_token": SPECIAL_TOKENS[0],
    "add_bos_token": False,
    "model_max_length": TARGET_CONFIG["max_position_embeddings"],
}


def write_models(dest: Path) -> None:
    """Write target/, target-hybrid/ and draft/ under dest (deterministic bytes)."""
    from safetensors.torch import save_file

    target = target_weights(TARGET_CONFIG)
    tokenizer = json.dumps(tokenizer_json(), indent=1, sort_keys=True) + "\n"
    for name, config in MODELS.items():
        d = dest / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
        weights = draft_weights(config) if name == "draft" else target
        save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "tokenizer.json").write_text(tokenizer)
        (d / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m ddtree_lab_engine.model_files DEST_DIR", file=sys.stderr)
        sys.exit(2)
    write_models(Path(sys.argv[1]))

"""SGLang 0.5.13.post1's own reading of a dense Qwen3.5 hybrid target (bench/gpu/make_tiny_hybrid.py dense/,
train_pair.py --dense-hybrid), on CPU, in one process (importing sglang costs ~8 s).

Usage: python dense_target_check.py TARGET_DIR [TARGET_DIR ...]   prints one JSON object per directory.

What is SGLang's and what stands in:
  * config: `ModelConfig(path)` (the scheduler's entry point), then `adjust_config_with_unaligned_cpu_tp`,
    what `ModelRunner` runs on a CPU device before it builds the model; the architecture through
    `ModelRegistry.resolve_model_cls`; `ModelRunner.hybrid_gdn_config` / `mambaish_config` (the properties
    that pick the hybrid linear-attention backend) on a ModelRunner whose __init__ is skipped (only
    `model_config` and `is_draft_worker` set; the properties read nothing else for this config);
    `mamba2_cache_params` (what the mamba pool is sized from);
  * model: `Qwen3_5ForConditionalGeneration(hf_config)` built for real after a single-process gloo group
    (bench/gpu/check_pair_sglang.sglang_cpu_init, as SGLang's CPU engine sets it up). One stand-in: while it
    is built, `torch.get_device_module()` without a device answers torch.cpu (this CUDA build of torch with
    no driver otherwise answers torch.cuda, and RMSNormGated asks it for its device);
  * weights: every parameter is filled with NaN, then the model's own `load_weights` reads the checkpoint
    (the loader's input: names and tensors as in model.safetensors); afterwards every parameter must be
    finite (written by some checkpoint tensor), the loader must have warned about no name
    ("Parameter ... not found in params_dict"), and a few packed tensors are compared with the checkpoint's
    pieces (qkv_proj = q | k | v, in_proj_qkvz = qkv | z, in_proj_ba = b | a, gate_up_proj = gate | up);
  * processor: `get_processor` with the arguments tokenizer_manager._get_processor_wrapper passes, its tokenizer's ids for a
    text equal to tokenizer.json's own, and SGLang's QwenVLImageProcessor built on it (get_mm_processor).
The forward pass is not run: SGLang's GDN layers need its linear-attention backend and Triton kernels.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

GPU = Path(__file__).resolve().parents[2] / "bench" / "gpu"
sys.path.insert(0, str(GPU))

TEXT = "def f(x):\n    return x + 1  # <|vision_start|> is a special token, not text\n"


LM = "model.language_model."


def config_view(d: str) -> tuple[dict, object, type]:
    """SGLang's reading of the checkpoint's config: (fields, its ModelConfig, the model class it resolves)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.models.registry import ModelRegistry

    out: dict = {}
    mc = ModelConfig(d)
    mc = adjust_config_with_unaligned_cpu_tp(mc, LoadConfig(), 1)
    cls, arch = ModelRegistry.resolve_model_cls(mc.hf_config.architectures)
    out["arch"], out["model_class"] = arch, f"{cls.__module__}.{cls.__name__}"
    out["hf_config_class"] = type(mc.hf_config).__name__
    tc = mc.hf_text_config
    out["text_config_class"] = type(tc).__name__
    out["text_model_type"] = tc.model_type
    out["layers_block_type"] = list(tc.layers_block_type)
    out["is_multimodal"] = bool(mc.is_multimodal)
    out["is_mrope"] = "mrope_section" in (getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", {}) or {})
    runner = ModelRunner.__new__(ModelRunner)
    runner.model_config, runner.is_draft_worker = mc, False
    gdn = runner.hybrid_gdn_config
    out["hybrid_gdn_config"] = type(gdn).__name__ if gdn is not None else None
    mambaish = runner.mambaish_config
    out["mambaish_config"] = type(mambaish).__name__ if mambaish is not None else None
    params = gdn.mamba2_cache_params
    out["mamba_layers"] = list(params.layers)
    out["mamba_dtype"] = {"conv": str(params.dtype.conv), "temporal": str(params.dtype.temporal)}
    return out, mc, cls


def build(cls: type, mc) -> object:
    """The model built for real on CPU (the one stand-in: torch.get_device_module() without a device is torch.cpu)."""
    import torch

    orig = torch.get_device_module
    torch.get_device_module = lambda device=None: torch.cpu if device is None else orig(device)
    try:
        return cls(mc.hf_config)
    finally:
        torch.get_device_module = orig


def load_view(model, d: str, *, after_loading: bool = False) -> tuple[dict, dict, dict]:
    """Every parameter NaN, then the model's own load_weights on the checkpoint (and, with after_loading, each
    module's quant_method.process_weights_after_loading, as SGLang's loader runs it): (fields, the checkpoint's
    tensors, the model's parameters)."""
    import torch
    from safetensors.torch import load_file

    sd = load_file(str(Path(d) / "model.safetensors"))
    pd = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for p in pd.values():
            p.data = p.data.float()
            p.fill_(float("nan"))
    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "not found" in record.getMessage():
                warnings.append(record.getMessage())

    h = Catch()
    logging.getLogger("sglang.srt.models.qwen3_5").addHandler(h)
    loaded = model.load_weights((k, v.float()) for k, v in sd.items())
    logging.getLogger("sglang.srt.models.qwen3_5").removeHandler(h)
    if after_loading:
        for m in model.modules():
            qm = getattr(m, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(m)
    out = {"checkpoint_tensors": len(sd), "params": len(pd), "loader_warnings": warnings,
           "params_not_loaded_by_name": sorted(set(pd) - set(loaded)),
           "params_with_nan": sorted(n for n, p in pd.items() if not torch.isfinite(p).all())}
    return out, sd, pd


def cat(sd: dict, *keys: str):
    import torch

    return torch.cat([sd[k].float() for k in keys], 0)


def packed_pairs(sd: dict) -> dict:
    """SGLang's packed parameters every Qwen3.5 layout shares, against the checkpoint's pieces."""
    return {
        "model.embed_tokens.weight": sd[LM + "embed_tokens.weight"].float(),
        "lm_head.weight": sd["lm_head.weight"].float(),
        "model.layers.3.qkv_proj.weight": cat(sd, *(f"{LM}layers.3.self_attn.{x}_proj.weight" for x in "qkv")),
        "model.layers.0.linear_attn.in_proj_qkvz.weight": cat(sd, f"{LM}layers.0.linear_attn.in_proj_qkv.weight",
                                                              f"{LM}layers.0.linear_attn.in_proj_z.weight"),
        "model.layers.0.linear_attn.in_proj_ba.weight": cat(sd, f"{LM}layers.0.linear_attn.in_proj_b.weight",
                                                            f"{LM}layers.0.linear_attn.in_proj_a.weight"),
        "visual.blocks.0.attn.qkv_proj.weight": sd["model.visual.blocks.0.attn.qkv.weight"].float(),
    }


def processor_view(d: str, mc) -> dict:
    """The processor a multimodal architecture needs, as SGLang's tokenizer manager builds it."""
    from sglang.srt.managers.multimodal_processor import get_mm_processor, import_processors
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.hf_transformers_utils import get_processor, get_tokenizer_from_processor
    from tokenizers import Tokenizer

    out: dict = {}
    args = ServerArgs(model_path=d, device="cpu")
    # tokenizer_manager._get_processor_wrapper's call, spelled out (importing tokenizer_manager needs uvloop)
    proc = get_processor(args.tokenizer_path, tokenizer_mode=args.tokenizer_mode,
                         trust_remote_code=args.trust_remote_code, revision=args.revision,
                         use_fast=not args.disable_fast_image_processor, tokenizer_backend=args.tokenizer_backend)
    out["processor_class"] = type(proc).__name__
    tok = get_tokenizer_from_processor(proc)
    want = Tokenizer.from_file(str(Path(d) / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    out["tokenizer_ids_equal"] = tok.encode(TEXT, add_special_tokens=False) == want
    out["processor_image_token_id"] = getattr(proc, "image_token_id", None)
    import_processors("sglang.srt.multimodal.processors")
    mm = get_mm_processor(mc.hf_config, args, proc, "default", model_config=mc)
    out["mm_processor_class"] = type(mm).__name__
    mm.cpu_executor.shutdown(wait=False)
    mm.io_executor.shutdown(wait=False)
    return out


def check(d: str) -> dict:
    import torch

    out, mc, cls = config_view(d)
    out["dir"] = d
    model = build(cls, mc)
    names = [n for n, _ in model.named_modules()]
    out["expert_modules"] = [n for n in names if "expert" in n.lower() or n.rsplit(".", 1)[-1] == "gate"]
    out["mlp_classes"] = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith(".mlp")})
    out["deepstack_mergers"] = len(getattr(model.visual, "deepstack_merger_list", []) or [])
    loaded, sd, pd = load_view(model, d)
    out.update(loaded)
    pairs = packed_pairs(sd)
    pairs["model.layers.1.mlp.gate_up_proj.weight"] = cat(sd, f"{LM}layers.1.mlp.gate_proj.weight",
                                                          f"{LM}layers.1.mlp.up_proj.weight")
    out["packed_equal"] = {k: bool(torch.equal(pd[k].data, v)) for k, v in pairs.items()}
    out.update(processor_view(d, mc))
    return out


def main() -> int:
    import check_pair_sglang as cps

    dirs = sys.argv[1:]
    cps.sglang_cpu_init(dirs[0])
    for d in dirs:
        print(json.dumps(check(d)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

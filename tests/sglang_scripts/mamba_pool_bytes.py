"""Run with an interpreter that has sglang 0.5.13.post1: SGLang's own `Qwen3NextConfig.mamba2_cache_params`
and `MambaPool.__init__` (the code that sizes and allocates the speculative intermediate states), on CPU.
`torch.zeros` inside memory_pool is swapped for meta tensors, so nothing is really allocated (the
intermediate buffers are hard-wired to device "cuda", memory_pool.py:331, 346). Reads one JSON object
from argv[1] (config fields, cases of [spec_state_size, width]) and prints one JSON line: per case the
shapes and bytes as SGLang's `get_tensor_size_bytes` reports them, plus `mamba_cache_per_req`.
"""

from __future__ import annotations

import json
import sys
import warnings

warnings.filterwarnings("ignore")

import sglang.srt.layers.dp_attention as dp_attention  # noqa: E402
import torch  # noqa: E402

# mamba2_cache_params asks the attention TP group its size; no process group exists here.
TP_SIZE = int(json.loads(sys.argv[1]).get("tp_size", 1))
dp_attention.get_attention_tp_size = lambda: TP_SIZE

from sglang.srt.configs.qwen3_next import Qwen3NextConfig  # noqa: E402
from sglang.srt.mem_cache import memory_pool  # noqa: E402


def _meta_zeros(*args, size=None, dtype=None, device=None, **kwargs):
    return torch.empty(size if size is not None else args, dtype=dtype, device="meta")


def main() -> None:
    request = json.loads(sys.argv[1])
    cfg = Qwen3NextConfig(**request["config"])
    params = cfg.mamba2_cache_params
    memory_pool.torch.zeros = _meta_zeros
    cases = []
    for spec_state_size, width in request["cases"]:
        pool = memory_pool.MambaPool(
            size=4,
            spec_state_size=spec_state_size,
            cache_params=params,
            mamba_layer_ids=params.layers,
            device="cpu",
            speculative_num_draft_tokens=width,
        )
        cache = pool.mamba_cache
        cases.append(
            {
                "spec_state_size": spec_state_size,
                "width": width,
                "ssm_shape": list(cache.intermediate_ssm.shape),
                "conv_shapes": [list(t.shape) for t in cache.intermediate_conv_window],
                "ssm_bytes": int(memory_pool.get_tensor_size_bytes(cache.intermediate_ssm)),
                "conv_bytes": int(memory_pool.get_tensor_size_bytes(cache.intermediate_conv_window)),
            }
        )
    print(
        json.dumps(
            {
                "layers": len(params.layers),
                "conv_shape": [list(s) for s in params.shape.conv],
                "temporal_shape": list(params.shape.temporal),
                "conv_dtype": str(params.dtype.conv),
                "ssm_dtype": str(params.dtype.temporal),
                "mamba_cache_per_req": int(params.mamba_cache_per_req),
                "cases": cases,
            }
        )
    )


if __name__ == "__main__":
    main()

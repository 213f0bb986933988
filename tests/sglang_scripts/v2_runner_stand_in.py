"""A stand-in of a v2 base's `DecodeCudaGraphRunner` (0.5.17 / 0.5.23) for CPU cases of auto's verify-graph ladder
(imported by v2_seams_cases.py and v2_worker_cases.py, which run by path from this folder): capturing a CUDA graph
needs a GPU, so this is the runner's `__init__` as far as the ladder depends on it, with the real class's pieces
where they run on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner


class StandInGraph:
    def __init__(self, width: int, bs: int) -> None:
        self.width, self.bs = width, bs

    def replay(self) -> None:
        pass


def replay_seconds(graph: StandInGraph, repeats: int) -> float:
    """For `ddtree_verify_graphs._replay_seconds` (CUDA events): a replay's seconds by its graph's shape."""
    return graph.width * graph.bs * 1e-6


class StandInRunner:
    """`DecodeCudaGraphRunner.__init__` as far as the width goes (17/23: `captured_req_width` from
    `model_runner.decode_num_tokens_per_req(num_draft_tokens=...)`, then `attn_backend.init_cuda_graph_state(max_bs,
    max_bs * width)`, then one graph per captured batch size under the runner's own keys: the real class's
    `_make_graph_key` / `_capture_graph_size`). `fail_at`: the width whose capture raises, as a failed capture does."""

    _make_graph_key = DecodeCudaGraphRunner._make_graph_key
    _capture_graph_size = DecodeCudaGraphRunner._capture_graph_size
    ragged_verify_mode = False
    enable_pdmux = False
    block = 16
    capture_bs = (1, 2, 4)
    fail_at: int | None = None

    def __init__(self, model_runner) -> None:
        self.model_runner, self.attn_backend = model_runner, model_runner.attn_backend
        self.captured_req_width = model_runner.decode_num_tokens_per_req(num_draft_tokens=self.block)
        if self.captured_req_width == type(self).fail_at:
            raise RuntimeError("Capture cuda graph failed (stand-in)")
        self.capture_bs = list(type(self).capture_bs)
        self.max_bs = max(self.capture_bs)
        self.attn_backend.init_cuda_graph_state(self.max_bs, self.max_bs * self.captured_req_width)
        self.backend = SimpleNamespace(_graphs={
            self._make_graph_key(self._capture_graph_size(bs=bs, num_tokens=bs * self.captured_req_width)):
                StandInGraph(self.captured_req_width, bs) for bs in self.capture_bs})


def triton_backend(*, block: int, max_context_len: int, is_draft_runner: bool = False) -> TritonAttnBackend:
    """The real triton backend class on the CPU, made without `__init__` (it needs a model runner), with what its
    real `init_cuda_graph_state` reads."""
    b = TritonAttnBackend.__new__(TritonAttnBackend)
    attrs = dict(num_head=2, max_kv_splits=2, v_head_dim=8, swa_v_head_dim=None, device="cpu",
                 max_context_len=max_context_len, is_draft_runner=is_draft_runner, skip_prefill=False,
                 num_draft_tokens=block, sliding_window_size=None, use_sliding_window_kv_pool=False,
                 _translate_kv_loc=None, kv_index_translator=None, page_size=1,
                 lean_total_programs=2, lean_block_m=2)  # 0.5.23 also sizes its lean-attention scratch
    for k, v in attrs.items():
        setattr(b, k, v)
    return b

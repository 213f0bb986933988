"""The target's verify CUDA graphs at several widths, for `--speculative-ddtree-budget auto` (installed as
`sglang/srt/speculative/ddtree_verify_graphs.py` by the ddtree-ops payload; imports only torch).

SGLang captures one set of target-verify graphs, at `1 + budget` tokens per request (the spec_info and
triton_backend patches). A fixed budget pads a smaller tree to that width: on a real-size target the
padding costs as much as real nodes. Auto steps at several widths, so each of its candidates' widths gets
a graph set of its own: another `CudaGraphRunner` of the target's model runner, captured while
`ddtree_args.target_verify_width` answers that width. The attention backend's graph buffers stay the ones
the widest set allocated (its `init_cuda_graph_state` is held off): the graphs captured before point into
them, and they hold every narrower step. Each step then installs the runner of its width as the model
runner's `graph_runner`; a width without one runs eagerly (`can_run` refuses any other width).

Each set's replays are timed right after its capture, while the backend's buffers still hold that set's
capture inputs: the seconds per `(width, batch size)` that auto starts from (`ddtree_auto_budget`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

REPLAYS_TIMED = 5


def time_verify_graphs(runner: Any, repeats: int = REPLAYS_TIMED) -> dict[tuple[int, int], float]:
    """Seconds of one replay of each of `runner`'s graphs, by (width, batch size). A replay recomputes what
    its capture computed: the capture's dummy requests (context of the fill length, KV to the dummy slot)."""
    width = int(runner.num_tokens_per_bs)
    out: dict[tuple[int, int], float] = {}
    for bs in sorted(runner.capture_bs):
        graph = runner.graphs.get(bs)
        if graph is None or not hasattr(graph, "replay"):
            continue
        graph.replay()  # first replays upload and warm caches
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        out[(width, int(bs))] = start.elapsed_time(end) / 1e3 / repeats
    return out


class VerifyGraphLadder:
    """Verify graph runners by width; `use(width)` installs one as the model runner's."""

    def __init__(self, model_runner: Any, runners: dict[int, Any], replay_seconds: dict[tuple[int, int], float],
                 captured_bytes: int, seconds: float) -> None:
        self.model_runner = model_runner
        self.runners = runners
        self.replay_seconds = replay_seconds
        self.captured_bytes = captured_bytes
        self.seconds = seconds
        self._widest = runners[max(runners)]

    @property
    def widths(self) -> list[int]:
        return sorted(self.runners)

    def use(self, width: int) -> None:
        # Any runner refuses a verify of another width (the cuda_graph_runner patch): the widest is as
        # good as none for a width without graphs.
        self.model_runner.graph_runner = self.runners.get(int(width), self._widest)


def capture_verify_ladder(
    model_runner: Any,
    widths: Sequence[int],
    *,
    set_capture_width: Callable[[int | None], None],
    set_backend_width: Callable[[int], None],
    reserved_memory: Callable[[], int | None],
) -> VerifyGraphLadder | None:
    """Capture a graph set for each of `widths` narrower than the existing one; None without graphs.

    `set_capture_width` is `ddtree_args.set_capture_width`; `set_backend_width` sets the attention
    backend's verify width (the capture's metadata is built at it). A failed capture raises: the caller
    keeps the one set SGLang captured (padding, as a fixed budget does). `reserved_memory` is this process's
    (the caching allocator's, graph pools included): the device's free memory also moves with the other
    servers of the GPU (the small pair's ladder read as 24.88 GiB while its neighbours loaded)."""
    existing = getattr(model_runner, "graph_runner", None)
    if existing is None or not hasattr(existing, "graphs") or not str(model_runner.device).startswith("cuda"):
        return None
    full = int(existing.num_tokens_per_bs)
    started = time.perf_counter()
    replay = time_verify_graphs(existing)  # before another capture changes the backend's buffers
    runners = {full: existing}
    backend = existing.attn_backend
    before = reserved_memory()
    init_state = backend.init_cuda_graph_state
    backend.init_cuda_graph_state = lambda *_args, **_kwargs: None
    try:
        for width in sorted({int(w) for w in widths if int(w) < full}, reverse=True):
            set_capture_width(width)
            set_backend_width(width)
            runner = type(existing)(model_runner)
            runners[width] = runner
            replay.update(time_verify_graphs(runner))
    finally:
        backend.init_cuda_graph_state = init_state
        set_capture_width(None)
        set_backend_width(full)
        model_runner.graph_runner = existing
    after = reserved_memory()
    used = 0 if before is None or after is None else max(0, after - before)
    return VerifyGraphLadder(model_runner, runners, replay, used, time.perf_counter() - started)

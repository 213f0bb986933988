"""The target's verify CUDA graphs at several widths, for `--speculative-ddtree-budget auto` (installed as
`sglang/srt/speculative/ddtree_verify_graphs.py` by the ddtree-ops payload; imports only torch; one copy for the
v1 worker, SGLang 0.5.13.post1, and the v2 tree step, 0.5.17 / 0.5.23).

SGLang captures one set of target-verify graphs, at `1 + budget` tokens per request (v1: the spec_info and
triton_backend patches; v2: the seams' width hook). A fixed budget pads a smaller tree to that width: on a
real-size target the padding costs as much as real nodes. Auto steps at several widths, so each of its
candidates' widths gets a graph set of its own: another graph runner of the target's model runner (the class
SGLang made, made again), captured while the width hook answers that width (`set_capture_width`: v1's
`ddtree_args.set_capture_width`, v2's `ddtree_v2_seams.set_capture_width`). The attention backend's graph
buffers stay the ones the widest set allocated (its `init_cuda_graph_state` is held off): the graphs captured
before point into them, and they hold every narrower step (the triton backend's verify mask is sized for the
widest too). Each step then installs the runner of its width where the model runner keeps its verify runner
(`RunnerNames.attr`); a width without one runs eagerly or padded (`can_run` refuses any other width on both
workers: v1's cuda_graph_runner patch, v2's upstream `spec_info.num_tokens_per_req` check).

Each set's replays are timed right after its capture, while the backend's buffers still hold that set's
capture inputs: the seconds per `(width, batch size)` that auto starts from (`ddtree_auto_budget`).

What differs between the workers is only where the runner lives and what it calls things (`RunnerNames`):
v1's `CudaGraphRunner` is `model_runner.graph_runner` with `num_tokens_per_bs` and a `graphs` dict by batch
size; v2's `DecodeCudaGraphRunner` is `model_runner.decode_cuda_graph_runner` with `captured_req_width`, its
graphs kept by its capture backend under `ShapeKey`s (`_v2_graphs`); v2's triton backend reads each capture's
width from the capture's own verify input, so v2 sets no backend width.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

REPLAYS_TIMED = 5


def _v2_graphs(runner: Any) -> dict[int, Any]:
    """A v2 `DecodeCudaGraphRunner`'s captured graphs by batch size: its full-graph capture backend keeps them in
    `_graphs` under the runner's own keys (`_make_graph_key` of `_capture_graph_size`, 17/23:
    model_executor/runner/decode_cuda_graph_runner.py); a capture backend keeping them otherwise (breakable,
    piecewise) gives none, and that set's replays are not timed (auto learns its cost from its steps)."""
    graphs = getattr(getattr(runner, "backend", None), "_graphs", None)
    if not isinstance(graphs, dict):
        return {}
    width = int(runner.captured_req_width)
    out = {}
    for bs in runner.capture_bs:
        graph = graphs.get(runner._make_graph_key(runner._capture_graph_size(bs=int(bs), num_tokens=int(bs) * width)))
        if graph is not None:
            out[int(bs)] = graph
    return out


@dataclass(frozen=True)
class RunnerNames:
    """Where a worker's model runner keeps the target's verify graph runner, and what that runner calls its width
    and its graphs."""

    attr: str  # the model runner's attribute the verify forward reads its graph runner from
    width_attr: str  # the runner's tokens per request
    graphs: Callable[[Any], dict[int, Any]]  # batch size -> captured graph (with `replay()`)

    def width(self, runner: Any) -> int:
        return int(getattr(runner, self.width_attr))

    def is_graph_runner(self, runner: Any) -> bool:
        """A runner of captured graphs (not None, not an eager runner standing in for one)."""
        if self.attr == "graph_runner":  # v1: SGLang's CudaGraphRunner, or None with graphs off
            return hasattr(runner, "graphs")
        return hasattr(runner, self.width_attr) and hasattr(runner, "capture_bs")


V1_RUNNER = RunnerNames("graph_runner", "num_tokens_per_bs", lambda runner: runner.graphs)
V2_RUNNER = RunnerNames("decode_cuda_graph_runner", "captured_req_width", _v2_graphs)


def padded_width(need: int, widths: Sequence[int]) -> int | None:
    """The smallest of `widths` that holds `need` verify tokens per request (a tree of `need - 1` nodes padded to
    it), None when none does."""
    ordered = sorted({int(w) for w in widths})
    i = bisect.bisect_left(ordered, int(need))
    return ordered[i] if i < len(ordered) else None


def _replay_seconds(graph: Any, repeats: int) -> float:
    """Seconds of one replay of `graph`, timed on the device (CUDA events)."""
    graph.replay()  # first replays upload and warm caches
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def time_verify_graphs(runner: Any, repeats: int = REPLAYS_TIMED, *,
                       names: RunnerNames = V1_RUNNER) -> dict[tuple[int, int], float]:
    """Seconds of one replay of each of `runner`'s graphs, by (width, batch size). A replay recomputes what
    its capture computed: the capture's dummy requests (context of the fill length, KV to the dummy slot)."""
    width = names.width(runner)
    graphs = names.graphs(runner)
    out: dict[tuple[int, int], float] = {}
    for bs in sorted(runner.capture_bs):
        graph = graphs.get(bs)
        if graph is None or not hasattr(graph, "replay"):
            continue
        out[(width, int(bs))] = _replay_seconds(graph, repeats)
    return out


class VerifyGraphLadder:
    """Verify graph runners by width; `use(width)` installs one as the model runner's."""

    def __init__(self, model_runner: Any, runners: dict[int, Any], replay_seconds: dict[tuple[int, int], float],
                 captured_bytes: int, seconds: float, names: RunnerNames = V1_RUNNER) -> None:
        self.model_runner = model_runner
        self.runners = runners
        self.replay_seconds = replay_seconds
        self.captured_bytes = captured_bytes
        self.seconds = seconds
        self.names = names
        self._widest = runners[max(runners)]

    @property
    def widths(self) -> list[int]:
        return sorted(self.runners)

    @property
    def widest(self) -> int:
        return max(self.runners)

    def width_for(self, need: int) -> int:
        """The captured width a tree of `need` verify tokens per request pads to (`padded_width`; the widest holds
        every tree auto builds)."""
        return padded_width(need, self.runners) or self.widest

    def use(self, width: int) -> None:
        # Any runner refuses a verify of another width (v1's cuda_graph_runner patch, v2's upstream check): the
        # widest is as good as none for a width without graphs.
        setattr(self.model_runner, self.names.attr, self.runners.get(int(width), self._widest))


def capture_verify_ladder(
    model_runner: Any,
    widths: Sequence[int],
    *,
    set_capture_width: Callable[[int | None], None],
    set_backend_width: Callable[[int], None] | None,
    reserved_memory: Callable[[], int | None],
    names: RunnerNames = V1_RUNNER,
) -> VerifyGraphLadder | None:
    """Capture a graph set for each of `widths` narrower than the existing one; None without graphs.

    `set_capture_width` makes the width hook answer a width (None: the configured one again);
    `set_backend_width` sets the attention backend's verify width where the backend reads it from itself (v1:
    the capture's metadata is built at it; v2: None, its triton backend reads the capture's verify input). A
    failed capture raises: the caller keeps the one set SGLang captured (padding, as a fixed budget does).
    `reserved_memory` is this process's (the caching allocator's, graph pools included): the device's free
    memory also moves with the other servers of the GPU (the small pair's ladder read as 24.88 GiB while its
    neighbours loaded)."""
    existing = getattr(model_runner, names.attr, None)
    if (existing is None or not names.is_graph_runner(existing)
            or not str(model_runner.device).startswith("cuda")):
        return None
    full = names.width(existing)
    started = time.perf_counter()
    replay = time_verify_graphs(existing, names=names)  # before another capture changes the backend's buffers
    runners = {full: existing}
    backend = existing.attn_backend
    before = reserved_memory()
    own_init = "init_cuda_graph_state" in vars(backend)
    init_state = backend.init_cuda_graph_state
    backend.init_cuda_graph_state = lambda *_args, **_kwargs: None
    try:
        for width in sorted({int(w) for w in widths if int(w) < full}, reverse=True):
            set_capture_width(width)
            if set_backend_width is not None:
                set_backend_width(width)
            runner = type(existing)(model_runner)
            if names.width(runner) != width:  # the width hook did not reach the runner: its graphs are not this width
                raise RuntimeError(f"verify graphs for width {width} were captured at width {names.width(runner)}")
            runners[width] = runner
            replay.update(time_verify_graphs(runner, names=names))
    finally:
        if own_init:
            backend.init_cuda_graph_state = init_state
        else:  # the class's method again, with whatever hooks it carries (v2: the seams' mask widening)
            del backend.init_cuda_graph_state
        set_capture_width(None)
        if set_backend_width is not None:
            set_backend_width(full)
        setattr(model_runner, names.attr, existing)
    after = reserved_memory()
    used = 0 if before is None or after is None else max(0, after - before)
    return VerifyGraphLadder(model_runner, runners, replay, used, time.perf_counter() - started, names)

"""Where a DDTree step's time goes (installed as `sglang/srt/speculative/ddtree_profile.py` by the
ddtree-ops payload; one copy, used by the v1 worker's `DDTreeController` and by the v2 tree step,
`ddtree_v2_step.DDTreeStepV2`). On with `SGLANG_DDTREE_PROFILE=1` (`maybe_profile`, read when the worker is
made); off, the worker holds no profile.

Both workers mark the same named points of each decode step (v2: a linear step that upstream's worker runs, a
fallback or auto's chain, is marked `step_start` and `step_done` only, as v1's linear steps mark no tree phase):
- `step_start`: the DFlash worker's decode step began (the scheduler handed it the batch);
- `draft_done`: the DFlash draft forward returned;
- `built`: the tree is built;
- `mask_ready`: the verify input is ready (tokens, positions, KV slots, custom mask);
- `target_done`: the target verify forward returned;
- `walked`: the tree walk and the KV / hidden-state commit are done;
- `step_done`: upstream's end of the step.

Each mark records a CUDA event on the current stream and a host clock reading. The time between
two consecutive marks is reported per transition (e.g. `built->mask_ready`); the last mark of a
step and the first of the next give `step_done->step_start`, the scheduler between steps, and
`step_start->draft_done` is the draft's set-up and forward.
- GPU milliseconds: between the events, i.e. when the GPU got there. At batch 1 the GPU mostly
  waits for launches, so these are the step's wall time split by phase.
- CPU milliseconds: host time between the marks.

Events are read only by `read_and_reset` (the `/server_info` path): a profiled server syncs there,
never in a step.

`StepClock` is not the profile: v2 auto times every step with it, profiled or not (two events a step, read when
the next step starts).
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

import torch

MAX_PENDING_STEPS = 4096
PROFILE_ENV = "SGLANG_DDTREE_PROFILE"


def median(values: Any) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def maybe_profile(device: Any) -> StepProfile | None:
    """A worker's profile where `SGLANG_DDTREE_PROFILE=1` (read here, when the worker is made, not at import, so one
    process can hold profiled and plain workers), with CUDA events on a CUDA `device`; else None."""
    if os.environ.get(PROFILE_ENV, "") != "1":
        return None
    return StepProfile(cuda=str(device).startswith("cuda"))


class StepProfile:
    """Named marks per step; medians per transition since the last read."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._marks: list[tuple[str, Any, float]] = []
        self._steps: collections.deque[list[tuple[str, Any, float]]] = collections.deque(maxlen=MAX_PENDING_STEPS)

    def mark(self, name: str) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._marks.append((name, event, time.perf_counter()))

    def end_step(self) -> None:
        if self._marks:
            self._steps.append(self._marks)
            self._marks = []

    def read_and_reset(self) -> dict[str, dict[str, Any]]:
        """{"a->b": {"n", "gpu_ms", "cpu_ms"}} (medians) over the steps closed since the last read."""
        steps = list(self._steps)
        self._steps.clear()
        if not steps:
            return {}
        if self.cuda:
            last_event = steps[-1][-1][1]
            last_event.synchronize()
        gpu: dict[str, list[float]] = collections.defaultdict(list)
        cpu: dict[str, list[float]] = collections.defaultdict(list)
        previous_last = None
        for marks in steps:
            chain = ([previous_last] if previous_last is not None else []) + marks
            for (a, ea, ta), (b, eb, tb) in zip(chain, chain[1:], strict=False):
                key = f"{a}->{b}"
                cpu[key].append((tb - ta) * 1e3)
                if ea is not None and eb is not None:
                    gpu[key].append(float(ea.elapsed_time(eb)))
            previous_last = marks[-1]
        return {
            key: {
                "n": len(cpu[key]),
                "gpu_ms": round(median(gpu[key]), 4) if gpu.get(key) else None,
                "cpu_ms": round(median(cpu[key]), 4),
            }
            for key in cpu
        }


class StepClock:
    """A step's wall time without a host sync: CUDA events around its device work, read once a later host read
    has waited for them (v2's scheduler reads every step's result before the next step starts). Without CUDA, the
    host clock at `stop` (nothing is queued to wait for). One pair of events, reused: `seconds` before the next
    `start`."""

    def __init__(self, device: Any) -> None:
        cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        self._host = (0.0, 0.0)

    def start(self) -> None:
        if self._events is not None:
            self._events[0].record()
        else:
            self._host = (time.perf_counter(), 0.0)

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._host = (self._host[0], time.perf_counter())

    def seconds(self) -> float:
        """From `start` to the end of the device work queued by `stop` (waits for it if it is still running)."""
        if self._events is None:
            return self._host[1] - self._host[0]
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1000.0

"""The scheduler: one thread that owns the model and steps every running request together.

HTTP threads `submit` requests and wait on them; each loop admits what is waiting (prefill), then
runs one decode step over all running requests, so concurrent requests interleave step by step and
a speculative step drafts and builds trees for the whole batch at once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from .decoding import Decoder, Request
from .faults import Faults

logger = logging.getLogger("ddtree_lab_engine")


@dataclass
class Job:
    """One or more requests answered together (a batched /generate is one job)."""

    requests: list[Request]
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    counts: bool = True  # health checks do not count for CRASH_AFTER_REQUESTS


class Scheduler:
    def __init__(self, decoder: Decoder, faults: Faults, max_running: int) -> None:
        self.decoder = decoder
        self.faults = faults
        self.max_running = max_running
        self._lock = threading.Condition()
        self._waiting: deque[tuple[Job, Request]] = deque()
        self._running: list[tuple[Job, Request]] = []
        self._answered = 0
        self.last_step_time = time.monotonic()
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            self._waiting.extend((job, r) for r in job.requests)
            self._lock.notify_all()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._waiting and not self._running:
                        self._lock.wait()
                    admitted = []
                    while self._waiting and len(self._running) + len(admitted) < self.max_running:
                        admitted.append(self._waiting.popleft())
                for pair in admitted:
                    self._prefill(*pair)
                with self._lock:
                    self._running.extend(p for p in admitted if not p[1].finished)
                    running = list(self._running)
                if self.faults.hang_on_mixed and _mixed(r for _, r in running):
                    self._stall(running)
                while self.faults.pause_while and os.path.exists(self.faults.pause_while):
                    time.sleep(0.05)
                self.decoder.step([r for _, r in running])
                self.last_step_time = time.monotonic()
                self._retire()
        except Exception:  # a bug here must not leave requests waiting forever on a live server
            logger.exception("scheduler failed; exiting")
            os._exit(1)

    def _prefill(self, job: Job, req: Request) -> None:
        self.prompt_tokens += len(req.input_ids)
        self.decoder.prefill(req)
        if req.finished:
            self._finish_if_done(job)

    def _retire(self) -> None:
        with self._lock:
            still = []
            for job, req in self._running:
                if req.finished:
                    self._finish_if_done(job)
                else:
                    still.append((job, req))
            self._running = still

    def _finish_if_done(self, job: Job) -> None:
        if job.done.is_set() or not all(r.finished for r in job.requests):
            return
        self.generated_tokens += sum(len(r.output_ids) for r in job.requests)
        job.done.set()
        with self._lock:
            self._lock.notify_all()
        if job.counts:
            self._answered += 1
            limit = self.faults.crash_after_requests
            if limit is not None and self._answered >= limit:
                # Give the HTTP thread a moment to send this answer, then die like a crashed server.
                threading.Timer(0.2, _crash, args=(limit,)).start()

    def _stall(self, running: list[tuple[Job, Request]]) -> None:
        logger.error(
            "fault %s: greedy and sampled requests in one batch (%d running); the scheduler stalls",
            "DDTREE_LAB_FAULT_HANG_ON_MIXED",
            len(running),
        )
        while True:
            time.sleep(3600)


def _mixed(reqs) -> bool:  # type: ignore[no-untyped-def]
    kinds = {r.choice.greedy for r in reqs}
    return len(kinds) > 1


def _crash(limit: int) -> None:
    print(
        f"ddtree_lab_engine: fault DDTREE_LAB_FAULT_CRASH_AFTER_REQUESTS={limit}: crashing after {limit} requests",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)

"""Fan-out over hosts: bounded concurrency, one result per host, whatever happens on the others.

A task is `fn(ctx: HostContext) -> data`. Returning means ok; raising an OpsError means failed
(or unreachable, when the error says so); any other exception is a bug, reported as failed with
its traceback kept for --debug. A failing host never stops or hides the others.

Ctrl-C (KeyboardInterrupt in the main thread; SIGTERM too, see cli_common) stops the fan-out at once
without leaving a host half-changed: hosts not started are not started; hosts that are only
connecting or reading (not inside `ctx.change()`) are abandoned on the spot, since nothing of theirs
needs undoing (a connect that would run into its timeout is not waited for); hosts inside a change
(holding their host lock) finish their current step, stop at their next `ctx.checkpoint()` and
release their lock. A second Ctrl-C stops waiting for them and says which hosts to `unlock`. Then
FleetInterrupted carries one result per host, status "interrupted" for those that did not finish.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ddtree_ops.errors import ErrorInfo, OpsError

if TYPE_CHECKING:
    from ddtree_ops.inventory import HostConfig

Status = Literal["ok", "failed", "unreachable", "interrupted"]
DEFAULT_CONCURRENCY = 16


@dataclass
class HostResult:
    host: str
    status: Status
    data: Any = None
    error: ErrorInfo | None = None
    elapsed_s: float = 0.0
    notices: list[str] = field(default_factory=list)
    traceback: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "status": self.status,
            "data": self.data,
            "error": self.error.to_dict() if self.error else None,
            "elapsed_s": round(self.elapsed_s, 3),
            "notices": list(self.notices),
        }


class FleetProgress(Protocol):
    """What a progress display gets told; all calls may come from worker threads."""

    def host_started(self, host: str) -> None: ...
    def host_step(self, host: str, step: str) -> None: ...
    def host_finished(self, result: HostResult) -> None: ...


class HostInterrupted(OpsError):
    """A host's task stopped because the run was interrupted, at a point where nothing is half-done."""

    code = "interrupted"


class FleetInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a fan-out; `results` has one entry per host, in order (see the module doc)."""

    def __init__(self, results: list[HostResult]) -> None:
        super().__init__("interrupted")
        self.results = results


class _Run:
    """What the hosts of one fan-out share: whether it was interrupted, and a lock that makes
    "enter a change" and "interrupt" exclusive (a host is either inside a change or never enters one)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False
        self.waiting_for: list[str] = []  # after an interrupt: the hosts inside a change it waits for


@dataclass
class HostContext:
    """Handed to a task: the host, plus ways to report a step or a notice for the operator, and to
    mark the part of the task that changes the host (`change`) and the safe points to stop (`checkpoint`)."""

    host: HostConfig
    progress: FleetProgress | None = None
    notices: list[str] = field(default_factory=list)
    current_step: str = "starting"
    changing: int = 0
    changed: bool = False  # a change section has ended (for what an interrupt reports)
    _run: _Run = field(default_factory=_Run, repr=False)

    def step(self, text: str) -> None:
        self.current_step = text
        if self._run.cancelled and not self.changing:
            # An abandoned host (the operator already has its result): stop before doing more.
            raise HostInterrupted(f"{self.host.name}: interrupted while {text}; nothing was changed")
        if self.progress is not None:
            self.progress.host_step(self.host.name, text)

    def notice(self, text: str) -> None:
        self.notices.append(text)

    @contextlib.contextmanager
    def change(self) -> Iterator[None]:
        """The part of a task that changes the host (from taking its lock to releasing it): an
        interrupt waits for it; once interrupted, no host enters one."""
        with self._run.lock:
            if self._run.cancelled:
                raise HostInterrupted(f"{self.host.name}: interrupted before any change")
            self.changing += 1
        try:
            yield
        finally:
            with self._run.lock:
                self.changing -= 1
                self.changed = True

    def checkpoint(self) -> None:
        """A point inside a change where stopping leaves the host consistent: raises once interrupted."""
        if self._run.cancelled:
            raise HostInterrupted(f"{self.host.name}: interrupted after {self.current_step}; stopped before the "
                                  "next step, nothing is half-done")


def run_on_hosts(
    hosts: Sequence[HostConfig],
    fn: Callable[[HostContext], Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: FleetProgress | None = None,
    on_result: Callable[[HostResult], None] | None = None,
) -> list[HostResult]:
    """Run fn once per host, at most `concurrency` at a time; results come back in `hosts` order.

    `on_result` is called (from worker threads, serialized) as each host finishes, so callers can
    stream results or keep a failure budget; batches are successive calls with host slices.
    Raises FleetInterrupted on Ctrl-C (module doc).
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if not hosts:
        return []
    run = _Run()
    contexts = [HostContext(h, progress, _run=run) for h in hosts]
    results: list[HostResult | None] = [None] * len(hosts)
    started: list[bool] = [False] * len(hosts)
    state = threading.Condition()
    pending = iter(range(len(hosts)))

    def one(i: int) -> HostResult:
        ctx = contexts[i]
        if progress is not None:
            progress.host_started(ctx.host.name)
        began = time.monotonic()
        try:
            result = HostResult(ctx.host.name, "ok", data=fn(ctx))
        except HostInterrupted as exc:
            result = HostResult(ctx.host.name, "interrupted", error=exc.info())
        except OpsError as exc:
            status: Status = "unreachable" if getattr(exc, "unreachable", False) else "failed"
            result = HostResult(ctx.host.name, status, error=exc.info())
        except Exception as exc:  # a bug in a task must not take the other hosts down with it
            result = HostResult(
                ctx.host.name, "failed",
                error=ErrorInfo("internal", f"{ctx.host.name}: {type(exc).__name__}: {exc}",
                                "this is a ddtree-ops bug; rerun with --debug for the traceback"),
                traceback=traceback.format_exc(),
            )
        result.elapsed_s = time.monotonic() - began
        result.notices = ctx.notices
        return result

    def worker() -> None:
        while True:
            with state:
                i = None if run.cancelled else next(pending, None)
                if i is None:
                    return
                started[i] = True
            result = one(i)
            with state:
                if results[i] is not None:  # abandoned by an interrupt: the operator has its result already
                    return
                if progress is not None:
                    progress.host_finished(result)
                if on_result is not None:
                    on_result(result)
                results[i] = result
                state.notify_all()

    try:
        # Daemon threads, not a ThreadPoolExecutor: the executor joins its threads at exit, so a host stuck
        # in a connect would hold an interrupted run until its connect_timeout.
        for n in range(min(concurrency, len(hosts))):
            threading.Thread(target=worker, name=f"ddtree-host-{n}", daemon=True).start()
        with state:
            while not all(r is not None for r in results):
                state.wait(0.5)
    except KeyboardInterrupt:
        _interrupt(run, state, contexts, results, started)
        raise FleetInterrupted([r for r in results if r is not None]) from None
    return [r for r in results if r is not None]


def _interrupt(run: _Run, state: threading.Condition, contexts: list[HostContext],
               results: list[HostResult | None], started: list[bool]) -> None:
    """First Ctrl-C: abandon what changes nothing, wait for hosts inside a change; a second one stops waiting."""
    with state, run.lock:
        run.cancelled = True
        waiting = [i for i, c in enumerate(contexts) if c.changing and results[i] is None]
        for i, ctx in enumerate(contexts):
            if results[i] is None and i not in waiting:
                message = (f"{ctx.host.name}: not started (interrupted before its turn)" if not started[i] else
                           f"{ctx.host.name}: interrupted after its change ended, while {ctx.current_step}" if ctx.changed
                           else f"{ctx.host.name}: interrupted while {ctx.current_step}; nothing was changed")
                results[i] = HostResult(ctx.host.name, "interrupted", error=ErrorInfo("interrupted", message))
    try:  # inside the try from the start: a second Ctrl-C may come at any moment from here on
        if waiting:
            names = ", ".join(f"{contexts[i].host.name} ({contexts[i].current_step})" for i in waiting)
            sys.stderr.write(f"interrupted: waiting for {names} to finish the step in flight and release the host "
                             "lock; Ctrl-C again to stop waiting (the lock then stays until `ddtree-ops unlock` or "
                             "its TTL)\n")
            sys.stderr.flush()
        run.waiting_for = [contexts[i].host.name for i in waiting]
        with state:
            while any(results[i] is None for i in waiting):
                state.wait(0.5)
    except KeyboardInterrupt:
        with state:
            for i in waiting:
                if results[i] is None:
                    ctx = contexts[i]
                    results[i] = HostResult(ctx.host.name, "interrupted", error=ErrorInfo(
                        "interrupted", f"{ctx.host.name}: abandoned while {ctx.current_step}, inside a change",
                        f"run `ddtree-ops unlock {ctx.host.name}`: it completes or undoes the change and frees the lock"))


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a command stopped by Ctrl-C


def exit_code(results: Sequence[HostResult]) -> int:
    """0 when every host succeeded, 130 when the run was interrupted, else 1 when any failed or was unreachable."""
    if any(r.status == "interrupted" for r in results):
        return EXIT_INTERRUPTED
    return 0 if all(r.ok for r in results) else 1

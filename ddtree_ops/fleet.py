"""Fan-out over hosts: bounded concurrency, one result per host, whatever happens on the others.

A task is `fn(ctx: HostContext) -> data`. Returning means ok; raising an OpsError means failed
(or unreachable, when the error says so); any other exception is a bug, reported as failed with
its traceback kept for --debug. A failing host never stops or hides the others.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ddtree_ops.errors import ErrorInfo, OpsError

if TYPE_CHECKING:
    from ddtree_ops.inventory import HostConfig

Status = Literal["ok", "failed", "unreachable"]
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


@dataclass
class HostContext:
    """Handed to a task: the host, plus ways to report a step or a notice for the operator."""

    host: HostConfig
    progress: FleetProgress | None = None
    notices: list[str] = field(default_factory=list)

    def step(self, text: str) -> None:
        if self.progress is not None:
            self.progress.host_step(self.host.name, text)

    def notice(self, text: str) -> None:
        self.notices.append(text)


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
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    callback_lock = threading.Lock()

    def one(host: HostConfig) -> HostResult:
        ctx = HostContext(host, progress)
        if progress is not None:
            progress.host_started(host.name)
        started = time.monotonic()
        try:
            result = HostResult(host.name, "ok", data=fn(ctx))
        except OpsError as exc:
            status: Status = "unreachable" if getattr(exc, "unreachable", False) else "failed"
            result = HostResult(host.name, status, error=exc.info())
        except Exception as exc:  # a bug in a task must not take the other hosts down with it
            result = HostResult(
                host.name, "failed",
                error=ErrorInfo("internal", f"{host.name}: {type(exc).__name__}: {exc}",
                                "this is a ddtree-ops bug; rerun with --debug for the traceback"),
                traceback=traceback.format_exc(),
            )
        result.elapsed_s = time.monotonic() - started
        result.notices = ctx.notices
        with callback_lock:
            if progress is not None:
                progress.host_finished(result)
            if on_result is not None:
                on_result(result)
        return result

    if not hosts:
        return []
    executor = ThreadPoolExecutor(max_workers=min(concurrency, len(hosts)), thread_name_prefix="ddtree-host")
    try:
        futures = [executor.submit(one, h) for h in hosts]
        return [f.result() for f in futures]
    finally:
        # On Ctrl-C, hosts not started yet are not started at all.
        executor.shutdown(wait=True, cancel_futures=True)


def exit_code(results: Sequence[HostResult]) -> int:
    """0 when every host succeeded, 1 when any failed or was unreachable."""
    return 0 if all(r.ok for r in results) else 1

"""fleet.run_on_hosts: every host yields a result, failures stay contained, concurrency is bounded."""

from __future__ import annotations

import threading
import time

import pytest

from ddtree_ops.errors import OpsError
from ddtree_ops.fleet import HostContext, HostResult, exit_code, run_on_hosts
from ddtree_ops.inventory import HostConfig
from ddtree_ops.ssh import ConnectionFailure


def hosts(n: int) -> list[HostConfig]:
    return [HostConfig(name=f"h{i}", address=f"10.0.0.{i}") for i in range(n)]


def test_each_outcome_is_reported_and_one_failure_does_not_stop_others() -> None:
    def task(ctx: HostContext) -> dict:
        ctx.notice(f"hello from {ctx.host.name}")
        match ctx.host.name:
            case "h1":
                raise OpsError("h1 broke", hint="fix h1", code="broken")
            case "h2":
                raise ConnectionFailure("h2 down", code="unreachable", unreachable=True)
            case "h3":
                raise KeyError("bug")
        return {"name": ctx.host.name}

    results = run_on_hosts(hosts(5), task, concurrency=2)
    assert [r.host for r in results] == ["h0", "h1", "h2", "h3", "h4"]
    assert [r.status for r in results] == ["ok", "failed", "unreachable", "failed", "ok"]
    assert results[0].data == {"name": "h0"} and results[0].error is None
    assert results[1].error.to_dict() == {"code": "broken", "message": "h1 broke", "hint": "fix h1"}
    assert results[3].error.code == "internal" and "KeyError" in results[3].traceback
    assert all(r.notices == [f"hello from {r.host}"] for r in results)
    assert exit_code(results) == 1 and exit_code([results[0], results[4]]) == 0


def test_concurrency_is_bounded_and_used() -> None:
    running, peak, lock = 0, 0, threading.Lock()

    def task(ctx: HostContext) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)
        with lock:
            running -= 1

    started = time.monotonic()
    run_on_hosts(hosts(12), task, concurrency=4)
    assert peak == 4
    assert time.monotonic() - started < 12 * 0.05  # really parallel


def test_callbacks_see_every_host() -> None:
    events: list[tuple[str, str]] = []

    class Recorder:
        def host_started(self, host: str) -> None:
            events.append(("start", host))

        def host_step(self, host: str, step: str) -> None:
            events.append((step, host))

        def host_finished(self, result: HostResult) -> None:
            events.append(("done", result.host))

    finished: list[str] = []
    run_on_hosts(hosts(3), lambda ctx: ctx.step("working"), concurrency=3, progress=Recorder(),
                 on_result=lambda r: finished.append(r.host))
    assert sorted(finished) == ["h0", "h1", "h2"]
    for h in ("h0", "h1", "h2"):
        assert [e for e, host in events if host == h] == ["start", "working", "done"]


def test_result_json_shape() -> None:
    (result,) = run_on_hosts(hosts(1), lambda ctx: {"x": 1})
    assert set(result.to_dict()) == {"host", "status", "data", "error", "elapsed_s", "notices"}


def test_empty_and_invalid() -> None:
    assert run_on_hosts([], lambda ctx: None) == []
    with pytest.raises(ValueError):
        run_on_hosts(hosts(1), lambda ctx: None, concurrency=0)

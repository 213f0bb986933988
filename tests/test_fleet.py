"""fleet.run_on_hosts: every host yields a result, failures stay contained, concurrency is bounded."""

from __future__ import annotations

import _thread
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from ddtree_ops.errors import OpsError
from ddtree_ops.fleet import (
    FleetInterrupted,
    HostContext,
    HostInterrupted,
    HostResult,
    exit_code,
    run_on_hosts,
)
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


# --- Ctrl-C ---------------------------------------------------------------------------------------------
# The interrupt is delivered with _thread.interrupt_main() once the hosts are where the test wants them, and
# the test threads wait on events and on the run's own state, never on sleeps: deterministic on a slow machine.


@pytest.fixture(autouse=True)
def _sigint_raises_keyboard_interrupt() -> Iterator[None]:
    # _thread.interrupt_main() calls whatever handles SIGINT: these tests need Python's own, whatever an
    # earlier test or library left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _wait_until(condition) -> None:
    while not condition():
        time.sleep(0.005)


def test_ctrl_c_abandons_what_changes_nothing_and_waits_for_a_host_inside_a_change() -> None:
    connecting, changing, stuck, release = (threading.Event() for _ in range(4))
    contexts: dict[str, HostContext] = {}
    finished_step: list[str] = []

    def task(ctx: HostContext) -> None:
        contexts[ctx.host.name] = ctx
        if ctx.host.name == "h0":  # a connect that would take its whole timeout
            ctx.step("connecting")
            connecting.set()
            stuck.wait()
            ctx.step("facts")
        else:
            with ctx.change():
                ctx.step("installing")
                changing.set()
                release.wait()
                finished_step.append(ctx.host.name)  # the step in flight finishes...
                ctx.checkpoint()  # ... and the host stops before the next one
                ctx.step("recording")

    def interrupter() -> None:
        connecting.wait()
        changing.wait()
        _thread.interrupt_main()
        _wait_until(lambda: contexts["h1"]._run.cancelled)
        release.set()

    threading.Thread(target=interrupter, daemon=True).start()
    with pytest.raises(FleetInterrupted) as stopped:
        run_on_hosts(hosts(3), task, concurrency=2)
    try:
        results = stopped.value.results
        assert [(r.host, r.status) for r in results] == [("h0", "interrupted"), ("h1", "interrupted"), ("h2", "interrupted")]
        assert results[0].error.message == "h0: interrupted while connecting; nothing was changed"
        assert "stopped before the next step" in results[1].error.message and finished_step == ["h1"]
        assert results[2].error.message == "h2: not started (interrupted before its turn)"
        assert not stuck.is_set()  # h0 was not waited for
        assert exit_code(results) == 130
    finally:
        stuck.set()


def test_a_second_ctrl_c_stops_waiting_and_names_the_host_to_unlock() -> None:
    changing, never = threading.Event(), threading.Event()
    contexts: dict[str, HostContext] = {}

    def task(ctx: HostContext) -> None:
        contexts[ctx.host.name] = ctx
        with ctx.change():
            ctx.step("installing")
            changing.set()
            never.wait()

    def interrupter() -> None:
        changing.wait()
        _thread.interrupt_main()
        _wait_until(lambda: contexts["h0"]._run.waiting_for == ["h0"])
        _thread.interrupt_main()

    threading.Thread(target=interrupter, daemon=True).start()
    with pytest.raises(FleetInterrupted) as stopped:
        run_on_hosts(hosts(1), task)
    never.set()
    (result,) = stopped.value.results
    assert result.status == "interrupted" and "abandoned while installing, inside a change" in result.error.message
    assert result.error.hint.startswith("run `ddtree-ops unlock h0`")


def test_no_host_enters_a_change_once_interrupted() -> None:
    reading, entered = threading.Event(), threading.Event()
    contexts: dict[str, HostContext] = {}
    outcome: list[str] = []

    def task(ctx: HostContext) -> None:
        contexts[ctx.host.name] = ctx
        ctx.step("preflight")
        reading.set()
        _wait_until(lambda: ctx._run.cancelled)
        try:
            with ctx.change():
                entered.set()
        except HostInterrupted as exc:
            outcome.append(exc.message)

    def interrupter() -> None:
        reading.wait()
        _thread.interrupt_main()

    threading.Thread(target=interrupter, daemon=True).start()
    with pytest.raises(FleetInterrupted):
        run_on_hosts(hosts(1), task)
    _wait_until(lambda: outcome)
    assert outcome == ["h0: interrupted before any change"] and not entered.is_set()

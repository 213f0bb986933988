"""ddtree_args reads the running server's ServerArgs on every base: 0.5.13.post1's
`get_global_server_args()` raises ValueError when unset; 0.5.23 retired it (RuntimeError, set or not) for
`runtime_context.get_server_args()` (ValueError when unset). Fake `sglang` modules stand in for both."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from ddtree_oracle import load_payload_module


def _raise(exc: Exception):
    def f() -> Any:
        raise exc
    return f


def _fake_sglang(monkeypatch: pytest.MonkeyPatch, global_args, runtime_args=None) -> None:
    """sglang.srt.server_args.get_global_server_args = global_args; with runtime_args, a runtime_context too."""
    mods = {name: types.ModuleType(name) for name in
            ("sglang", "sglang.srt", "sglang.srt.server_args", "sglang.srt.speculative",
             "sglang.srt.speculative.ddtree_sampling")}
    mods["sglang.srt.server_args"].get_global_server_args = global_args
    mods["sglang.srt.speculative.ddtree_sampling"].SAMPLING_RULES = ("pytorch", "flashinfer")
    if runtime_args is not None:
        rc = types.ModuleType("sglang.srt.runtime_context")
        rc.get_server_args = runtime_args
        mods["sglang.srt.runtime_context"] = rc
    else:
        monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", None)  # import fails
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


RETIRED = RuntimeError("get_global_server_args() is retired. Read the value ...")
UNSET = ValueError("Global server args is not set yet!")


class _Backend:
    device = "cuda:0"

    def __getattr__(self, name: str) -> Any:  # any sizing read means the check went on
        raise AssertionError(f"read {name}: the check ran without a server")


@pytest.mark.parametrize("case", ["0.5.13 unset", "0.5.23 unset", "0.5.23 retired, no runtime_context"])
def test_no_server_args_is_no_server(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    if case == "0.5.13 unset":
        _fake_sglang(monkeypatch, _raise(UNSET))
    elif case == "0.5.23 unset":
        _fake_sglang(monkeypatch, _raise(RETIRED), _raise(UNSET))
    else:
        _fake_sglang(monkeypatch, _raise(RETIRED))
    args = load_payload_module("ddtree_args")
    assert args.running_server_args() is None
    assert args.sampling_rule() == "pytorch"
    assert args.check_verify_graph_buffers(_Backend(), 8, 8 * 16) is None


@pytest.mark.parametrize("base", ["0.5.13.post1", "0.5.23"])
def test_the_running_servers_args_are_read_on_each_base(monkeypatch: pytest.MonkeyPatch, base: str) -> None:
    server = types.SimpleNamespace(sampling_backend="flashinfer", speculative_ddtree_mode="shadow-linear")
    if base == "0.5.13.post1":
        _fake_sglang(monkeypatch, lambda: server)
    else:
        _fake_sglang(monkeypatch, _raise(RETIRED), lambda: server)
    args = load_payload_module("ddtree_args")
    assert args.running_server_args() is server
    assert args.sampling_rule() == "flashinfer"
    assert args.check_verify_graph_buffers(_Backend(), 8, 8 * 16) is None  # not full mode: nothing to check


def test_other_errors_still_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_sglang(monkeypatch, _raise(KeyError("boom")))
    with pytest.raises(KeyError):
        load_payload_module("ddtree_args").sampling_rule()


@pytest.mark.parametrize("field", ["mamba_scheduler_strategy", "mamba_radix_cache_strategy"])
@pytest.mark.parametrize(("radix_off", "strategy", "refused"), [
    (True, "no_buffer", False), (False, "extra_buffer", False),
    (False, "no_buffer", True), (False, "extra_buffer_lazy", True), (False, None, True)])
def test_full_mode_on_a_hybrid_keeps_the_radix_cache_only_with_tracked_states(
        monkeypatch: pytest.MonkeyPatch, radix_off: bool, strategy: str | None, refused: bool, field: str) -> None:
    """Issue 25: the radix cache caches a recurrent state per tracked length; DDTree's commit tracks the accepted
    node only through `extra_buffer` (SGLang refuses the other strategies with DFLASH today; a later release that
    lets one through must still be refused here, by name). The flag's value is `mamba_scheduler_strategy` on
    0.5.13.post1, `mamba_radix_cache_strategy` from 0.5.14 on (the flag an alias there)."""
    _fake_sglang(monkeypatch, _raise(UNSET))
    args = load_payload_module("ddtree_args")
    server = types.SimpleNamespace(disable_radix_cache=radix_off, tp_size=1, speculative_ddtree_budget=64,
                                   **{field: strategy})
    if not refused:
        args.check_hybrid_full_mode(server)
        return
    with pytest.raises(args.DDTreeConfigError) as err:
        args.check_hybrid_full_mode(server)
    flag = "--mamba-scheduler-strategy" if field == "mamba_scheduler_strategy" else "--mamba-radix-cache-strategy"
    assert f"{flag} extra_buffer" in str(err.value) and "--disable-radix-cache" in str(err.value)
    assert f"got {strategy}" in str(err.value)

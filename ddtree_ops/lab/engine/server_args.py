"""The server arguments as the engine reads them, from either SGLang generation.

≤ 0.5.13 (v1): `prepare_server_args` returns a resolved `ServerArgs` dataclass; attributes are the values in
effect, `/server_info` is its `dataclasses.asdict`.

0.5.14 on (v2, e.g. 0.5.23): `ServerArgs` is a sealed msgspec record and `prepare_server_args` returns the raw
input; `launch_server` then calls `resolve_once()`, whose steps declare the values in effect (read back with
`resolution_result`). The engine cannot call `resolve_once()` itself: its DFLASH step refuses a CPU device
("DFLASH speculative decoding is not supported by SRTPlatform on device 'cpu'"), as there is no CPU DFLASH
worker. So it runs, through SGLang's own `run_hook`, the two resolution steps the payload's glue
(`ddtree_v2_args.register`) wraps, each a stand-in for the real step: `handle_hardware_runtime_validation`
(where the glue refuses full mode) and `handle_speculative_decoding` (which declares DFLASH's block size, as
the real step does on a GPU; the glue then checks and normalises the DDTree flags). The same route as the
host agent's v2 smoke (agent/remote/smoke.py); on a pristine 0.5.23 no hook is registered and both are no-ops.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def resolve(record: Any) -> Any:
    """What the engine reads its settings from: the record itself (v1) or a view of the resolved values (v2)."""
    if not hasattr(record, "resolve_once"):
        return record
    from sglang.srt.arg_groups.overrides import declare_resolution, resolution_result
    from sglang.srt.arg_groups.resolution_hooks import run_hook

    def handle_hardware_runtime_validation(server_args: Any) -> None:
        """Stand-in: the real step checks the accelerator, which a lab host does not have."""

    def handle_speculative_decoding(server_args: Any) -> None:
        """Stand-in: what the real step declares for DFLASH (its block size), without its CPU refusal."""
        if str(resolution_result(server_args, "speculative_algorithm") or "").upper() == "DFLASH":
            block = resolution_result(server_args, "speculative_num_draft_tokens") or 16
            declare_resolution(server_args, "ddtree_lab_engine: DFLASH block size",
                               speculative_num_draft_tokens=int(block))

    # run_hook finds the registered wrappers by the step's name, as resolve_once's pipeline does.
    run_hook(handle_hardware_runtime_validation, record)
    run_hook(handle_speculative_decoding, record)
    return ResolvedArgs(record)


class ResolvedArgs:
    """Attribute reads of a v2 record give the value in effect (the last declaration, else the input)."""

    def __init__(self, record: Any) -> None:
        object.__setattr__(self, "_record", record)
        object.__setattr__(self, "_fields", frozenset(type(record).__struct_fields__))

    def __getattr__(self, name: str) -> Any:
        record = object.__getattribute__(self, "_record")
        if name in object.__getattribute__(self, "_fields"):
            from sglang.srt.arg_groups.overrides import resolution_result

            return resolution_result(record, name)
        return getattr(record, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the resolved server arguments are read-only ({name})")


def as_dict(server_args: Any) -> dict[str, Any]:
    """Every field and its value in effect, as `/server_info` reports them."""
    if isinstance(server_args, ResolvedArgs):
        from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

        record = object.__getattribute__(server_args, "_record")
        return {name: msgspec_to_builtins(getattr(server_args, name)) for name in type(record).__struct_fields__}
    return dataclasses.asdict(server_args)


def state_dict(server_args: Any) -> dict[str, Any]:
    """The scheduler's view for `internal_states` (v1: the instance's attributes, its model config aside)."""
    if isinstance(server_args, ResolvedArgs):
        return as_dict(server_args)
    return {k: v for k, v in vars(server_args).items() if k != "model_config"}


def kv_events(server_args: Any) -> Any:
    """The KV-event publisher description `/server_info` carries (None when publishing is off)."""
    if isinstance(server_args, ResolvedArgs):
        if not server_args.kv_events_config:
            return None
        from sglang.srt.runtime_context import describe_kv_events_publisher

        return describe_kv_events_publisher(object.__getattribute__(server_args, "_record"))
    return server_args.describe_kv_events_publisher()

"""Run inside a patched sglang tree of a v2 base (0.5.17 or 0.5.23, on PYTHONPATH): parse each argv case with
SGLang's own `prepare_server_args`, then validate it the way that base resolves (one JSON object per case).

Both bases' DFLASH step refuses a CPU device, so the DDTree check is reached with a stand-in for upstream's
`handle_speculative_decoding` that resolves the block size as DFLASH's step does on a GPU:
- 0.5.23 validates in `ServerArgs.resolve_once` (a pipeline of named steps): the payload wraps that step through
  `resolution_hooks`, so the stand-in (same name) runs through SGLang's own `run_hook`;
- 0.5.17 resolves by assignment in `ServerArgs.__post_init__`, which `prepare_server_args` runs: the stand-in
  replaces the step it calls, and the payload's check (patched in right after that call) runs for real.
A case with "resolve": true runs the base's real resolution instead (dummy model, --device cpu): 0.5.23's
`resolve_once`, whose pipeline reaches the payload's early step (the full-mode refusal; it needs `tvm_ffi`), or
0.5.17's `__post_init__` untouched, whose dummy-model return comes after the payload's early refusal.

A case's "env" (optional) is set in os.environ while it is parsed (the DDTree test switches are read then).
A case with "headroom": true also reports the `req_to_token` row headroom the pool builder would use for it
(`kv_cache_configurator.get_req_to_token_extra_context_len`, after SGLang's own `load_plugins()`): on 0.5.23
from the runtime context's bags, published from the parsed record as a scheduler publishes its args.

Usage: python server_args_cases_v2.py CASES.json   (a list of {"name", "argv", "resolve"?, "env"?})
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

from sglang.srt.speculative.ddtree_v2_args import FIELDS as DDTREE_FIELDS

FIELDS = ("speculative_algorithm", "speculative_num_draft_tokens", *DDTREE_FIELDS)

try:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolution_result
    from sglang.srt.arg_groups.resolution_hooks import run_hook
except ImportError:  # 0.5.17
    import sglang.srt.arg_groups.speculative_hook as _hook

    _real_step = _hook.handle_speculative_decoding

    def handle_speculative_decoding(server_args) -> None:
        """Stand-in for 0.5.17's step of that name (DFLASH's block size resolved by assignment)."""
        algorithm = (server_args.speculative_algorithm or "").upper() or None
        server_args.speculative_algorithm = algorithm
        if algorithm == "DFLASH":
            server_args.speculative_num_draft_tokens = int(server_args.speculative_num_draft_tokens or 16)

    def field(args: Any, name: str) -> Any:
        return getattr(args, name, None)

    def parse(case: dict) -> tuple[Any, None]:
        """(resolved args, None): 0.5.17 keeps no raw input beside the resolved fields."""
        from sglang.srt.server_args import prepare_server_args

        _hook.handle_speculative_decoding = _real_step if case.get("resolve") else handle_speculative_decoding
        return prepare_server_args(case["argv"]), None
else:

    def handle_speculative_decoding(server_args) -> None:
        """Stand-in for 0.5.23's step of that name (same name: run_hook finds the payload's wrapper by it)."""
        if (resolution_result(server_args, "speculative_algorithm") or "").upper() == "DFLASH":
            block = resolution_result(server_args, "speculative_num_draft_tokens") or 16
            declare_resolution(server_args, "stand-in _handle_dflash", speculative_num_draft_tokens=int(block))

    field = resolution_result

    def parse(case: dict) -> tuple[Any, dict]:
        """(the record being resolved, its raw input as typed)."""
        from sglang.srt.server_args import prepare_server_args

        args = prepare_server_args(case["argv"])
        raw = {f: getattr(args, f, None) for f in FIELDS}
        if case.get("resolve"):
            args.resolve_once()
        else:
            run_hook(handle_speculative_decoding, args)
        return args, raw


@contextlib.contextmanager
def environ(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def headroom(args: Any) -> int:
    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.plugins import load_plugins

    load_plugins()  # idempotent: applies the hooks the payload registered at import
    extra_len = kv_cache_configurator.get_req_to_token_extra_context_len
    if inspect.signature(extra_len).parameters:  # 0.5.17: the server args are the argument
        return extra_len(args)
    from sglang.srt import runtime_context

    runtime_context._CONTEXT.set_server_args(args)
    return extra_len()


def run(case: dict) -> dict:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), environ(case.get("env", {})):
            args, raw = parse(case)
    except SystemExit as e:  # argparse: type errors print to stderr and exit 2
        return {"name": case["name"], "ok": False, "error": err.getvalue().strip().splitlines()[-1:], "exit": e.code}
    except Exception as e:
        return {"name": case["name"], "ok": False, "error": f"{type(e).__name__}: {e}"}
    out = {"name": case["name"], "ok": True, "raw": raw, **{f: field(args, f) for f in FIELDS}}
    if case.get("headroom"):
        out["headroom"] = headroom(args)
    return out


if __name__ == "__main__":
    for case in json.loads(Path(sys.argv[1]).read_text()):
        print(json.dumps(run(case)), flush=True)

"""Run inside a patched sglang 0.5.23 tree (PYTHONPATH): parse each argv case with SGLang's own
`prepare_server_args`, then validate it the way 0.5.23 resolves (and print one JSON object per case).

0.5.23 validates in `ServerArgs.resolve_once` (a pipeline of named steps). Its DFLASH step refuses a CPU
device and a dummy model returns before it, so the DDTree check (wrapped around that step by the payload,
through `resolution_hooks`) is run here through SGLang's own `run_hook` with a stand-in step named
`handle_speculative_decoding` that declares the block size as DFLASH's step does on a GPU. A case with
"resolve": true instead runs the real `resolve_once` (dummy model, --device cpu), whose pipeline reaches the
payload's early step (the full-mode refusal); it needs `tvm_ffi` (apache-tvm-ffi), imported by the pipeline.

Usage: python server_args_cases_v2.py CASES.json   (a list of {"name", "argv", "resolve"?})
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from sglang.srt.arg_groups.overrides import declare_resolution, resolution_result
from sglang.srt.arg_groups.resolution_hooks import run_hook
from sglang.srt.server_args import prepare_server_args
from sglang.srt.speculative.ddtree_v2_args import FIELDS as DDTREE_FIELDS

FIELDS = ("speculative_algorithm", "speculative_num_draft_tokens", *DDTREE_FIELDS)


def handle_speculative_decoding(server_args) -> None:
    """Stand-in for 0.5.23's step of that name (same name: run_hook finds the payload's wrapper by it)."""
    if (resolution_result(server_args, "speculative_algorithm") or "").upper() == "DFLASH":
        block = resolution_result(server_args, "speculative_num_draft_tokens") or 16
        declare_resolution(server_args, "stand-in _handle_dflash", speculative_num_draft_tokens=int(block))


def run(case: dict) -> dict:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = prepare_server_args(case["argv"])
            raw = {f: getattr(args, f, None) for f in FIELDS}
            if case.get("resolve"):
                args.resolve_once()
            else:
                run_hook(handle_speculative_decoding, args)
    except SystemExit as e:  # argparse: type errors print to stderr and exit 2
        return {"name": case["name"], "ok": False, "error": err.getvalue().strip().splitlines()[-1:], "exit": e.code}
    except Exception as e:
        return {"name": case["name"], "ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"name": case["name"], "ok": True, "raw": raw, **{f: resolution_result(args, f) for f in FIELDS}}


if __name__ == "__main__":
    for case in json.loads(Path(sys.argv[1]).read_text()):
        print(json.dumps(run(case)), flush=True)

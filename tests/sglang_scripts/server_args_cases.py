"""Run inside a patched sglang tree (PYTHONPATH): parse each argv case with SGLang's own
`prepare_server_args` and print one JSON object per case (accepted + the DDTree fields, or the error).

Usage: python server_args_cases.py CASES.json   (a list of {"name", "argv"} or {"name", "kwargs"}, each
with an optional "env": variables set for that case alone)
All cases run in one process because importing sglang costs ~8 s.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from unittest import mock

from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.srt.speculative.ddtree_args import FIELDS as DDTREE_FIELDS

FIELDS = ("speculative_algorithm", "speculative_num_draft_tokens", *DDTREE_FIELDS, "max_speculative_num_draft_tokens",
          "disable_cuda_graph")


def run(case: dict) -> dict:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), mock.patch.dict(os.environ, case.get("env", {})):
            args = ServerArgs(**case["kwargs"]) if "kwargs" in case else prepare_server_args(case["argv"])
    except SystemExit as e:  # argparse: type errors print to stderr and exit 2
        return {"name": case["name"], "ok": False, "error": err.getvalue().strip().splitlines()[-1:], "exit": e.code}
    except Exception as e:
        return {"name": case["name"], "ok": False, "error": f"{type(e).__name__}: {e}"}
    fields = {f: getattr(args, f, None) for f in FIELDS}
    if args.speculative_algorithm:
        # The req_to_token row headroom SGLang itself derives (context length + this per row).
        from sglang.srt.mem_cache.common import get_req_to_token_extra_context_len

        fields["req_to_token_extra"] = get_req_to_token_extra_context_len(args)
        # The verify widths the CUDA-graph runners capture (the patched spec_info hook reads the
        # global server args, as it does inside a model runner).
        from sglang.srt.server_args import set_global_server_args_for_scheduler
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        set_global_server_args_for_scheduler(args)
        algo = SpeculativeAlgorithm.from_string(args.speculative_algorithm)
        block = args.speculative_num_draft_tokens
        fields["target_verify_width"] = algo.get_num_tokens_per_bs_for_target_verify(block, False)
        fields["draft_verify_width"] = algo.get_num_tokens_per_bs_for_target_verify(block, True)
    return {"name": case["name"], "ok": True, **fields}


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    for case in cases:
        print("CASE " + json.dumps(run(case)), flush=True)


if __name__ == "__main__":
    main()

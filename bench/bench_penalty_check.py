"""What the v2 linear verify's penalty hook costs a DFLASH step that has nothing to penalise: the per-step check
over the batch's requests (`ddtree_penalties.is_penalised`, what `ddtree_v2_penalties` runs on every step), against
building each request's full settings (`request_penalties(...).active`, the first version), at batch sizes 1-256.
CPU only, the payload module loaded standalone as on a host.

Usage: .venv/bin/python bench/bench_penalty_check.py [--repeat 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ddtree_oracle import load_payload_module  # noqa: E402

dp = load_payload_module("ddtree_penalties")


def batch(bs: int) -> list:
    tokenizer = SimpleNamespace(eos_token_id=2, additional_stop_token_ids={3})
    sp = SimpleNamespace(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0,
                         stop_token_ids=None)
    return [SimpleNamespace(sampling_params=sp, tokenizer=tokenizer, output_ids=list(range(200)), eos_token_ids={5})
            for _ in range(bs)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    rows = []
    for bs in (1, 8, 64, 256):
        reqs = batch(bs)
        full = timeit.timeit(lambda r=reqs: any(dp.request_penalties(x).active for x in r), number=args.repeat)
        check = timeit.timeit(lambda r=reqs: any(dp.is_penalised(x) for x in r), number=args.repeat)
        rows.append({"batch": bs, "request_penalties_us": round(full / args.repeat * 1e6, 1),
                     "is_penalised_us": round(check / args.repeat * 1e6, 1)})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

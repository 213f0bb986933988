"""Which server is right where servers disagree: greedy of the model in Hugging Face transformers (fp32, CPU)
for the named requests of a production-mix workload, beside each server's tokens from the same call.

    python bench/gpu/hf_reference_check.py MODEL_DIR CALL_DIR --ids mix8 mix23 [--servers h_plain h_dflash]

CALL_DIR holds run_device.sh's `workload_<set>.json` and `<server>.json` files (the call's logs.tgz,
unpacked). Prints one JSON line per request: the prompt length, HF's tokens, each server's, and the first
position where each server leaves HF's tokens (null: none within the compared length).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("call_dir", type=Path)
    ap.add_argument("--ids", nargs="+", required=True)
    ap.add_argument("--servers", nargs="+", default=["h_plain", "h_dflash", "h_full15", "h_full64"])
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    workload = json.loads(next(args.call_dir.glob("workload_*.json")).read_text())
    requests = {r["id"]: r for r in workload["round1"] + workload["round2"]}
    served = {s: json.loads((args.call_dir / f"{s}.json").read_text()) for s in args.servers}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    for rid in args.ids:
        prompt = requests[rid]["prompt"]
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, do_sample=False)
        hf = out[0, len(prompt):].tolist()
        row: dict = {"id": rid, "prompt_len": len(prompt), "hf": hf, "servers": {}}
        for name, doc in served.items():
            got = (doc["round1"].get(rid) or doc["round2"].get(rid))["output_ids"][: args.tokens]
            first = next((i for i, (a, b) in enumerate(zip(hf, got, strict=False)) if a != b), None)
            row["servers"][name] = {"tokens": got, "first_diff": first}
        print(json.dumps(row))


if __name__ == "__main__":
    main()

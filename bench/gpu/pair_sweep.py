#!/usr/bin/env python3
"""Issue 14's client: the trained pair's sweep (plain / DFLASH / DDTree full budgets x cap x keep-chain).

  run --port P --tag T --out OUT/T.json --prompts heldout_prompts.json [--reference] [--wait S] [--pid PID]
      For each workload (greedy; T 0.8) and batch (bs1: 8 held-out prompts one after another; bs32:
      32 other held-out prompts sent together), 128 new tokens each (ignore_eos): one warm-up pass
      (first batches of a size compile kernels and fill the radix cache alike on every server), then
      the timed pass: wall time, tokens, verify steps (sum of spec_verify_ct; plain: tokens), mean
      accept length = tokens / verify steps, ms per step (bs1: wall / steps; bs32: wall / the longest
      request's steps), tokens/s, the DDTree stats' delta, and the greedy outputs.
      --reference (plain): afterwards the greedy prompts again with plain's top-5 logprobs, untimed,
      so `compare` can class divergences by plain's margin (production_mix.classify).
  compare OUT_DIR --plain TAG --dflash TAG --tags TAG... [--json F] [--title S]
      The table (markdown) of every server, greedy outputs checked token by token against plain's
      (each first divergence classed tie / upstream / fault by production_mix.classify; DFLASH is the
      'upstream' reference), the goals (best budget: accept >= 1.2x DFLASH, tok/s >= 1.15x at bs1 and
      >= 1.0x at bs32), and --json in plot_sweep.py's schema. Exit 1 on a fault or a missing server.
  merge SWEEP.json... --out F [--title S]
      the sweep.json of several calls (a sweep that one call's deadline cut, finished by a second with
      ONLY=...) into one, with each config's tokens/s over its own call's DFLASH (plot_sweep --relative).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import sys
import time

import requests
from graphs_proof import ddtree_state  # same folder: the scripts run by path
from production_mix import TOP_K, _write, classify, server_run_parser, wait_healthy

WORKLOADS = {"greedy": {"temperature": 0.0}, "t0.8": {"temperature": 0.8}}
BATCHES = {"bs1": (1, slice(0, 8)), "bs32": (32, slice(8, 40))}
MAX_NEW = 128
GOALS = {"accept": 1.2, "bs1": 1.15, "bs32": 1.0}  # issue 14: x DFLASH at the best budget (tok/s by batch)


def generate(base: str, prompt: list[int], sp: dict, *, logprobs: bool = False, max_new: int = MAX_NEW) -> dict:
    body: dict = {"input_ids": prompt, "sampling_params": {**sp, "max_new_tokens": max_new, "ignore_eos": True}}
    if logprobs:
        body.update(return_logprob=True, top_logprobs_num=TOP_K, logprob_start_len=len(prompt) - 1)
    r = requests.post(base + "/generate", json=body, timeout=300)
    r.raise_for_status()
    j = r.json()
    meta = j.get("meta_info", {})
    out = {"output_ids": j.get("output_ids"), "tokens": meta.get("completion_tokens"),
           "verify_ct": meta.get("spec_verify_ct")}
    if logprobs:
        out["topk"] = [[[lp, tid] for lp, tid, *_ in pos[:TOP_K]] for pos in meta.get("output_top_logprobs") or []]
    return out


def one_batch(base: str, prompts: list[list[int]], sp: dict, bs: int, *, logprobs: bool = False) -> list[dict]:
    if bs == 1:
        return [generate(base, p, sp, logprobs=logprobs) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(bs) as ex:
        return list(ex.map(lambda p: generate(base, p, sp, logprobs=logprobs), prompts))


def measure(base: str, prompts: list[list[int]], sp: dict, bs: int) -> dict:
    one_batch(base, prompts, sp, bs)  # warm-up
    before = ddtree_state(base)
    t0 = time.perf_counter()
    res = one_batch(base, prompts, sp, bs)
    wall = time.perf_counter() - t0
    after = ddtree_state(base)
    tokens = sum(r["tokens"] for r in res)
    verify = [r["verify_ct"] for r in res]
    spec = all(verify)
    steps = sum(verify) if spec else tokens
    steps_on_clock = steps if bs == 1 else (max(verify) if spec else max(r["tokens"] for r in res))
    return {
        "wall_s": round(wall, 4), "tokens": tokens, "verify_steps": steps,
        "accept": round(tokens / steps, 4), "ms_per_step": round(1e3 * wall / steps_on_clock, 4),
        "tok_s": round(tokens / wall, 1),
        "ddtree_delta": {k: after.get(k, 0) - before.get(k, 0) for k in
                         ("steps", "tree_steps", "graph_steps", "build_graph_steps", "fallback_steps", "shrunk_steps",
                          "sampled_requests")
                         if isinstance(after.get(k), int)},
        "outputs": [r["output_ids"] for r in res] if sp["temperature"] == 0 else None,
    }


def cmd_run(a: argparse.Namespace) -> int:
    base = f"http://127.0.0.1:{a.port}"
    with open(a.prompts) as f:
        prompts = [p["input_ids"] for p in json.load(f)["prompts"]]
    res: dict = {"tag": a.tag, "ready_s": wait_healthy(base, a.wait, a.pid), "results": {}}
    if res["ready_s"] is None:
        _write(a.out, res)
        print(f"[sweep] {a.tag}: never healthy", flush=True)
        return 2
    for wl, sp in WORKLOADS.items():
        for bname, (bs, sl) in BATCHES.items():
            r = measure(base, prompts[sl], sp, bs)
            res["results"].setdefault(wl, {})[bname] = r
            print(f"[sweep] {a.tag} {wl} {bname}: accept {r['accept']} ms/step {r['ms_per_step']} "
                  f"tok/s {r['tok_s']} ddtree {r['ddtree_delta']}", flush=True)
    if a.reference:
        res["reference"] = {bname: one_batch(base, prompts[sl], WORKLOADS["greedy"], bs, logprobs=True)
                            for bname, (bs, sl) in BATCHES.items()}
    res["ddtree"] = ddtree_state(base)
    _write(a.out, res)
    return 0


# ------------------------------------------------------------------ compare
def describe(tag: str) -> dict:
    """plain | dflash | full_b64[_cap4][_kc] -> mode, budget, cap, keep_chain."""
    m = re.fullmatch(r"full_b(\d+)(?:_cap(\d+))?(_kc)?", tag)
    if m:
        return {"mode": "full", "budget": int(m[1]), "cap": int(m[2]) if m[2] else None, "keep_chain": bool(m[3])}
    return {"mode": tag, "budget": None, "cap": None, "keep_chain": False}


def identity(plain: dict, cand: dict, upstream: dict | None) -> dict:
    """Greedy outputs vs plain's reference pass, per batch: counts of same / tie / upstream / fault."""
    row = {"same": 0, "tie": 0, "upstream": 0, "fault": 0, "details": []}
    for bname in BATCHES:
        ref = plain["reference"][bname]
        got = cand["results"]["greedy"][bname]["outputs"]
        ups = upstream["results"]["greedy"][bname]["outputs"] if upstream else [None] * len(ref)
        for i, (p, c, u) in enumerate(zip(ref, got, ups, strict=True)):
            kind, detail = classify(p, {"output_ids": c}, {"output_ids": u} if u else None)
            row[kind] += 1
            if kind != "same":
                row["details"].append({"batch": bname, "prompt": i, "kind": kind, **detail})
    return row


def cmd_compare(a: argparse.Namespace) -> int:
    def load(tag: str) -> dict | None:
        p = os.path.join(a.out_dir, f"{tag}.json")
        if not os.path.exists(p):
            return None
        with open(p) as f:
            d = json.load(f)
        return d if d.get("results") else None

    plain, dflash = load(a.plain), load(a.dflash)
    ok = plain is not None and "reference" in plain
    configs = []
    print("| server | greedy bs1 accept | ms/step | tok/s | greedy bs32 accept | ms/step | tok/s | "
          "T0.8 bs1 accept | tok/s | T0.8 bs32 accept | tok/s | vs plain (T 0) |")
    print("|---|" + "---|" * 12)
    for tag in [a.plain, a.dflash, *a.tags]:
        d = load(tag)
        cfg = {"name": tag, **describe(tag), "results": None}
        if d is None:
            ok = False
            print(f"| {tag} | no results |" + " |" * 11)
            configs.append(cfg)
            continue
        cfg["results"] = {wl: {b: {k: r.get(k) for k in ("accept", "ms_per_step", "tok_s", "ddtree_delta")}
                               for b, r in per.items()} for wl, per in d["results"].items()}
        if plain is not None and "reference" in plain:
            cfg["identity"] = identity(plain, d, dflash if tag != a.dflash else None)
            ok &= tag == a.dflash or cfg["identity"]["fault"] == 0
        r = d["results"]
        ident = cfg.get("identity") or {}
        cells = [f"{r['greedy']['bs1']['accept']}", f"{r['greedy']['bs1']['ms_per_step']}",
                 f"{r['greedy']['bs1']['tok_s']}", f"{r['greedy']['bs32']['accept']}",
                 f"{r['greedy']['bs32']['ms_per_step']}", f"{r['greedy']['bs32']['tok_s']}",
                 f"{r['t0.8']['bs1']['accept']}", f"{r['t0.8']['bs1']['tok_s']}",
                 f"{r['t0.8']['bs32']['accept']}", f"{r['t0.8']['bs32']['tok_s']}",
                 f"same {ident.get('same')} tie {ident.get('tie')} upstream {ident.get('upstream')} "
                 f"fault {ident.get('fault')}"]
        print(f"| {tag} | " + " | ".join(cells) + " |")
        configs.append(cfg)
    goals = best_budget(configs)
    print(json.dumps({"goals": goals}, indent=1))
    if a.json:
        _write(a.json, {"title": a.title, "configs": configs, "goals": goals})
    for c in configs:
        for det in (c.get("identity") or {}).get("details", [])[:4]:
            print(f"  {c['name']}: {det}")
    return 0 if ok else 1


def best_budget(configs: list[dict]) -> dict:
    """Per workload and batch: the DDTree config with the most tokens/s, its ratios to DFLASH."""
    by = {c["name"]: c for c in configs if c.get("results")}
    df = by.get("dflash")
    out: dict = {}
    if df is None:
        return out
    for wl in WORKLOADS:
        for b in BATCHES:
            base = df["results"][wl][b]
            full = [c for c in by.values() if c["mode"] == "full"]
            if not full:
                continue
            best = max(full, key=lambda c: c["results"][wl][b]["tok_s"])
            most = max(full, key=lambda c: c["results"][wl][b]["accept"])
            r = best["results"][wl][b]
            out[f"{wl}/{b}"] = {
                "fastest": best["name"], "tok_s_x_dflash": round(r["tok_s"] / base["tok_s"], 3),
                "its_accept_x_dflash": round(r["accept"] / base["accept"], 3),
                "most_accepting": most["name"],
                "accept_x_dflash": round(most["results"][wl][b]["accept"] / base["accept"], 3),
            }
            if wl == "greedy":  # the goals are stated for greedy; T 0.8 is reported beside them
                g = out[f"{wl}/{b}"]
                g["goals_met"] = {"accept": g["accept_x_dflash"] >= GOALS["accept"],
                                  "tok_s": g["tok_s_x_dflash"] >= GOALS[b]}
    return out


def cmd_merge(a: argparse.Namespace) -> int:
    """Several calls' sweep.json (each with its own plain and DFLASH) into one: every config keeps its
    figures, gains "run" (the input's index) and, per workload and batch, tok_s_x_dflash, its tokens/s
    over the same call's DFLASH (the machine's speed drifts between calls; ratios within a call hold).
    A config measured in several calls is taken from the first; plain and DFLASH from the first."""
    seen: dict[str, dict] = {}
    for run, path in enumerate(a.inputs):
        with open(path) as f:
            d = json.load(f)
        df = next((c for c in d["configs"] if c["name"] == "dflash" and c.get("results")), None)
        for c in d["configs"]:
            if c["name"] in seen or not c.get("results"):
                continue
            c = {**c, "run": run}
            for wl, per in c["results"].items():
                for b, r in per.items():
                    base = df["results"][wl][b]["tok_s"] if df else None
                    r["tok_s_x_dflash"] = round(r["tok_s"] / base, 3) if base and r.get("tok_s") else None
            seen[c["name"]] = c
    _write(a.out, {"title": a.title, "inputs": a.inputs, "configs": list(seen.values())})
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = server_run_parser(sub)
    r.add_argument("--prompts", required=True)
    r.add_argument("--reference", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("out_dir")
    c.add_argument("--plain", required=True)
    c.add_argument("--dflash", required=True)
    c.add_argument("--tags", nargs="*", default=[], help="the DDTree servers (full_b64, full_b64_cap4_kc, ...)")
    c.add_argument("--json")
    c.add_argument("--title", default="")
    m = sub.add_parser("merge")
    m.add_argument("inputs", nargs="+")
    m.add_argument("--out", required=True)
    m.add_argument("--title", default="")
    a = ap.parse_args()
    return {"run": cmd_run, "compare": cmd_compare, "merge": cmd_merge}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())

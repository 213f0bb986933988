#!/usr/bin/env python3
"""Issue 13's client: sampled requests on the tree, liveness of mixed batches, and speed with CUDA graphs.

  run --port P --tag T --out F.json [--liveness] [--samples N] [--perf] [--wait S] [--pid PID]
      liveness: 8 sampled (T 0.8, top_p 0.95) + 8 greedy requests sent together, 20 rounds in a row,
                each round must finish within --bound seconds (upstream 0.5.13.post1 DFLASH was seen
                to make no progress for 16-117 s on this mix).
      samples:  N requests per prompt of max_new_tokens 3 at T 0.8 / top_p 0.95 (--temperature, --top-p):
                the first 3 tokens.
      perf:     batch 1, 8, 32 of greedy requests (64-token prompts, 128 new tokens, ignore_eos), sent
                together, one warm-up round then PERF_ROUNDS measured rounds per size; per round wall
                time, verify steps (the longest request's spec_verify_ct; plain: tokens) and ms per
                step; the medians over rounds with their range, mean accept length, DDTree stats.
                Each --perf run on the same --out adds a pass (perf_passes); "perf" is their median.
  compare OUT_DIR --plain TAG --cand TAG [TAG...] [--biased TAG]
      two-sample tests of the first-3-token samples (chi-square homogeneity over the 3-token tuples, rare
      ones pooled, and total variation with its permutation null); every --cand must pass at
      alpha = 1e-3 / prompts; --biased (a server whose walk is deliberately biased) must fail, which
      shows the test has power. Also prints the liveness and perf tables; --ratio-to TAG: every perf
      server's ms per step over TAG's, pass by pass, and the median. Exit 1 on a failed verdict.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import random
import statistics
import sys
import time

import requests
from production_mix import _write, server_run_parser, wait_healthy  # same folder: the scripts run by path

SAMPLED = {"temperature": 0.8, "top_p": 0.95}
PROMPTS = [  # fixed token-id prompts (ids < 4000 exist in the tiny models' vocab)
    [(i * 37) % 3900 + 10 for i in range(24)],
    [7, 42, 42, 42, 1000, 2000, 3000, 5, 6, 7, 8, 9],
    list(range(100, 140)),
]


def post(base: str, body: dict, timeout: float) -> dict | list:
    r = requests.post(base + "/generate", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def ddtree_state(base: str) -> dict:
    try:
        info = requests.get(base + "/server_info", timeout=10).json()
        return ((info.get("internal_states") or [{}])[0]).get("ddtree") or {}
    except (requests.RequestException, ValueError):
        return {}


def liveness(base: str, rounds: int, bound: float) -> dict:
    rng = random.Random(13)
    out = []
    for k in range(rounds):
        reqs = []
        for i in range(16):
            prompt = [rng.randrange(10, 3900) for _ in range(rng.randint(8, 200))]
            sp = dict(SAMPLED) if i % 2 == 0 else {"temperature": 0.0}
            reqs.append({"input_ids": prompt, "sampling_params": {**sp, "max_new_tokens": 64, "ignore_eos": True}})
        t0 = time.time()
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            futs = [ex.submit(post, base, body, bound) for body in reqs]
            errors = []
            for f in futs:
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001 - a timeout is the stall this looks for
                    errors.append(type(e).__name__)
        dt = time.time() - t0
        out.append({"round": k, "s": round(dt, 3), "errors": errors})
        print(f"[live] round {k}: {dt:.2f}s errors={errors}", flush=True)
        if errors:
            break  # stalled: the server may stay stuck for minutes; the verdict is in
    ok = len(out) == rounds and all(not r["errors"] and r["s"] <= bound for r in out)
    return {"rounds": out, "bound_s": bound, "ok": ok, "max_s": max(r["s"] for r in out)}


def samples(base: str, n: int, params: dict | None = None) -> dict:
    res = {}
    for p, prompt in enumerate(PROMPTS):
        got: list[list[int]] = []
        chunk = 250
        bodies = [{"input_ids": [prompt] * min(chunk, n - s),
                   "sampling_params": {**(params or SAMPLED), "max_new_tokens": 3, "ignore_eos": True}}
                  for s in range(0, n, chunk)]
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            for out in ex.map(lambda b: post(base, b, 600), bodies):
                got += [o["output_ids"][:3] for o in out]
        res[str(p)] = got
    return res


# Measured rounds per batch size after one warm-up round: a bs-1 round is ~13 verify steps, too few
# for one round's ms/step to mean anything on a shared host, so small batches repeat more.
PERF_ROUNDS = {1: 8, 8: 4, 32: 3}


def perf(base: str, rounds: dict[int, int] | None = None) -> dict:
    rng = random.Random(21)
    prompts = [[rng.randrange(10, 3900) for _ in range(64)] for _ in range(32)]
    sp = {"temperature": 0.0, "max_new_tokens": 128, "ignore_eos": True}
    out = {}

    def one_round(bs: int) -> tuple[float, list[dict]]:
        t0 = time.time()
        with concurrent.futures.ThreadPoolExecutor(bs) as ex:
            res = list(ex.map(lambda pr: post(base, {"input_ids": pr, "sampling_params": sp}, 300), prompts[:bs]))
        return time.time() - t0, [r["meta_info"] for r in res]

    for bs, n_rounds in (rounds or PERF_ROUNDS).items():
        one_round(bs)  # warm at this batch size first: a first batch of a new size JIT-compiles kernels
        before = ddtree_state(base)  # also resets a profiled server's phase medians
        measured = []
        for _ in range(n_rounds):
            wall, metas = one_round(bs)
            verify = [m.get("spec_verify_ct") for m in metas]
            steps = max(verify) if all(verify) else max(m["completion_tokens"] for m in metas)
            measured.append({"wall_s": round(wall, 4), "steps": steps, "ms_per_step": round(1e3 * wall / steps, 3),
                             "tokens": sum(m["completion_tokens"] for m in metas),
                             "verify_ct": sum(verify) if all(verify) else None})
        after = ddtree_state(base)
        tokens = sum(r["tokens"] for r in measured)
        walls = sum(r["wall_s"] for r in measured)
        verify_total = None if any(r["verify_ct"] is None for r in measured) else sum(r["verify_ct"] for r in measured)
        out[str(bs)] = {
            # medians over the rounds: one slow round (a GC, a neighbour's burst) does not move them
            "wall_s": statistics.median(r["wall_s"] for r in measured),
            "steps": statistics.median(r["steps"] for r in measured),
            "ms_per_step": statistics.median(r["ms_per_step"] for r in measured),
            "ms_per_step_range": [min(r["ms_per_step"] for r in measured), max(r["ms_per_step"] for r in measured)],
            "accept_len": round(tokens / verify_total, 3) if verify_total else 1.0,
            "tok_per_s": round(tokens / walls, 1),
            "rounds": measured,
            "profile": after.get("profile"),  # SGLANG_DDTREE_PROFILE=1 servers: these rounds' phases
            "ddtree_delta": {k: after.get(k, 0) - before.get(k, 0)
                             for k in ("steps", "tree_steps", "graph_steps", "build_graph_steps", "fallback_steps", "sampled_requests")
                             if isinstance(after.get(k), int)},
        }
        print(f"[perf] bs {bs}: {json.dumps({k: v for k, v in out[str(bs)].items() if k != 'rounds'})}", flush=True)
    return out


def cmd_run(a: argparse.Namespace) -> int:
    base = f"http://127.0.0.1:{a.port}"
    res: dict = {}
    if os.path.exists(a.out):  # several runs per server (perf, then samples / liveness) share one file
        with open(a.out) as f:
            res = json.load(f)
    res.update(tag=a.tag, ready_s=wait_healthy(base, a.wait, a.pid))
    if res["ready_s"] is None:
        _write(a.out, res)
        print(f"[proof] {a.tag}: never healthy", flush=True)
        return 2
    if a.samples:
        t = time.time()
        res["samples"] = samples(base, a.samples, {"temperature": a.temperature, "top_p": a.top_p})
        res["samples_params"] = {"temperature": a.temperature, "top_p": a.top_p}
        res["samples_s"] = round(time.time() - t, 1)
    if a.liveness:
        res["liveness"] = liveness(base, 20, a.bound)
    perf_line = ""
    if a.perf:
        # Each --perf run is one pass; phase B interleaves the servers' passes (PERF_PASSES) so that
        # compare --ratio-to can pair each pass with the reference's pass of the same minutes.
        res["perf_passes"] = [*res.get("perf_passes", []), perf(base)]
        res["perf"] = merge_passes(res["perf_passes"])
        last = res["perf_passes"][-1]
        perf_line = f"perf pass {len(res['perf_passes'])} ms/step " + " ".join(
            f"bs{bs} {r['ms_per_step']}" for bs, r in last.items()) + "; "
    res["ddtree"] = ddtree_state(base)
    _write(a.out, res)
    print(f"[proof] {a.tag}: done; {perf_line}ddtree={json.dumps(res['ddtree'])[:600]}", flush=True)
    return 0


def merge_passes(passes: list[dict]) -> dict:
    """Per batch size, the median over passes of each pass's median ms per step (range: the passes'
    medians); the other figures from the pass nearest that median. One pass stays as measured (range:
    its rounds)."""
    if len(passes) == 1:
        return passes[0]
    merged = {}
    for bs in passes[0]:
        rows = [p[bs] for p in passes if bs in p]
        ms = statistics.median(r["ms_per_step"] for r in rows)
        nearest = min(rows, key=lambda r: abs(r["ms_per_step"] - ms))
        merged[bs] = {**nearest, "ms_per_step": ms, "passes": len(rows),
                      "ms_per_step_range": [min(r["ms_per_step"] for r in rows), max(r["ms_per_step"] for r in rows)]}
    return merged


def paired_ratios(cand: list[dict], ref: list[dict]) -> dict:
    """Per batch size, cand's ms per step over ref's in the same pass (passes run interleaved, so a
    pair shares the machine's state of those minutes): the ratios and their median."""
    out = {}
    for bs in ref[0] if ref else {}:
        # zip stops at the shorter list: a pass cut at the deadline has no partner
        ratios = [round(c[bs]["ms_per_step"] / r[bs]["ms_per_step"], 3)
                  for c, r in zip(cand, ref, strict=False) if bs in c and bs in r]
        if ratios:
            out[bs] = {"median": round(statistics.median(ratios), 3), "ratios": ratios}
    return out


# ------------------------------------------------------------------ two-sample tests
def _chi2_sf(stat: float, df: int) -> float:
    """Upper tail of chi-square (Wilson-Hilferty): plenty for a verdict at 1e-3."""
    if df <= 0:
        return 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def two_sample(a: list[tuple], b: list[tuple], perms: int = 300, seed: int = 0) -> dict:
    cats: dict[tuple, list[int]] = {}
    for x in a:
        cats.setdefault(x, [0, 0])[0] += 1
    for x in b:
        cats.setdefault(x, [0, 0])[1] += 1
    na, nb = len(a), len(b)
    rows, other = [], [0, 0]
    for ca, cb in cats.values():
        if ca + cb < 10:
            other[0] += ca
            other[1] += cb
        else:
            rows.append([ca, cb])
    if sum(other):
        rows.append(other)
    stat = 0.0
    for ca, cb in rows:
        tot = ca + cb
        for obs, n in ((ca, na), (cb, nb)):
            e = tot * n / (na + nb)
            stat += (obs - e) ** 2 / e
    df = len(rows) - 1
    # Total variation over the 3-token tuples, and its null spread by permuting the pooled samples.
    def tv(x: list[tuple], y: list[tuple]) -> float:
        cx: dict[tuple, float] = {}
        for t in x:
            cx[t] = cx.get(t, 0.0) + 1 / len(x)
        for t in y:
            cx[t] = cx.get(t, 0.0) - 1 / len(y)
        return 0.5 * sum(abs(v) for v in cx.values())

    observed = tv(a, b)
    rng = random.Random(seed)
    pooled = a + b
    null = []
    for _ in range(perms):
        rng.shuffle(pooled)
        null.append(tv(pooled[:na], pooled[na:]))
    return {"n": [na, nb], "categories": len(rows), "chi2": round(stat, 2), "df": df,
            "chi2_p": _chi2_sf(stat, df), "tv": round(observed, 4),
            "tv_null_p99": round(sorted(null)[int(0.99 * perms) - 1], 4),
            "tv_p": (1 + sum(v >= observed for v in null)) / (1 + perms)}


def cmd_compare(a: argparse.Namespace) -> int:
    def load(tag: str) -> dict:
        with open(os.path.join(a.out_dir, f"{tag}_proof.json")) as f:
            return json.load(f)

    ok = True
    summary: dict = {"samples": {}, "liveness": {}, "perf": {}}
    try:
        plain = load(a.plain)
    except FileNotFoundError:
        plain = {}
    alpha = 1e-3 / len(PROMPTS)
    judged = [(t, "cand") for t in a.cand] + ([(a.biased, "biased")] if a.biased else [])
    for tag, role in judged:
        try:
            cand = load(tag)
        except FileNotFoundError:
            print(f"{tag}: no results")
            ok = False
            continue
        if "samples" not in cand or "samples" not in plain:
            print(f"{tag}: no samples ({'plain ' + a.plain if 'samples' not in plain else 'the server'} never answered)")
            ok = False
            continue
        tests = {p: two_sample([tuple(x) for x in plain["samples"][p]], [tuple(x) for x in cand["samples"][p]])
                 for p in plain["samples"]}
        rejected = [p for p, t in tests.items() if min(t["chi2_p"], t["tv_p"]) < alpha]
        verdict = ("pass" if not rejected else "FAIL") if role == "cand" else ("rejected (power shown)" if rejected else "NOT rejected")
        if (role == "cand" and rejected) or (role == "biased" and not rejected):
            ok = False
        summary["samples"][tag] = {"verdict": verdict, "tests": tests}
        print(f"samples {tag} vs {a.plain}: {verdict}")
        for p, t in tests.items():
            print(f"  prompt {p}: n={t['n']} cats={t['categories']} chi2={t['chi2']} df={t['df']} p={t['chi2_p']:.3g} "
                  f"tv={t['tv']} (null p99 {t['tv_null_p99']}, p={t['tv_p']:.3g})")
    def part(tag: str, key: str) -> dict | None:
        try:
            return load(tag).get(key)
        except FileNotFoundError:
            return None

    for tag in a.liveness:
        live = part(tag, "liveness")
        if live is None:
            print(f"liveness {tag}: no results")
            ok = False
            continue
        summary["liveness"][tag] = live
        expected_stall = tag in a.expect_stall
        good = live["ok"] != expected_stall
        ok &= good
        print(f"liveness {tag}: {'ok' if live['ok'] else 'STALLED'} ({len(live['rounds'])} rounds, max {live['max_s']} s, "
              f"bound {live['bound_s']} s){' (expected: upstream before the fix)' if expected_stall else ''}")
    perf_passes: dict[str, list[dict]] = {}
    for tag in a.perf:
        try:
            proof = load(tag)
        except FileNotFoundError:
            continue
        if proof.get("perf"):
            summary["perf"][tag] = proof["perf"]
            perf_passes[tag] = proof.get("perf_passes") or []
    if summary["perf"]:
        print("perf (medians over rounds): tag | bs | wall s | steps | ms/step (range) | accept | tok/s | ddtree steps (graph)")
        for tag, pr in summary["perf"].items():
            for bs, r in pr.items():
                d = r.get("ddtree_delta") or {}
                lo, hi = r.get("ms_per_step_range", [r["ms_per_step"]] * 2)
                print(f"  {tag} | {bs} | {r['wall_s']} | {r['steps']} | {r['ms_per_step']} ({lo}-{hi}) | {r['accept_len']} | "
                      f"{r['tok_per_s']} | {d.get('steps', '-')} ({d.get('graph_steps', '-')})")
    if a.ratio_to and summary["perf"]:
        ref = perf_passes.get(a.ratio_to, [])
        summary["perf_ratios"] = {}
        print(f"ms per step over {a.ratio_to}'s in the same pass (median over passes; per pass):")
        for tag, passes in perf_passes.items():
            if tag == a.ratio_to or not passes or not ref:
                continue
            summary["perf_ratios"][tag] = paired_ratios(passes, ref)
            for bs, r in summary["perf_ratios"][tag].items():
                print(f"  {tag} | bs {bs} | {r['median']}x | {r['ratios']}")
    for tag, pr in summary["perf"].items():  # profiled servers: per-phase medians (ddtree_profile)
        for bs, r in pr.items():
            if r.get("profile"):
                phases = ", ".join(f"{k} {v['gpu_ms']}" for k, v in r["profile"].items())
                print(f"  profile {tag} bs {bs} (GPU ms): {phases}")
    with open(os.path.join(a.out_dir, "graphs_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = server_run_parser(sub)
    r.add_argument("--liveness", action="store_true")
    r.add_argument("--bound", type=float, default=15.0)
    r.add_argument("--samples", type=int, default=0)
    r.add_argument("--temperature", type=float, default=SAMPLED["temperature"], help="of the samples")
    r.add_argument("--top-p", type=float, default=SAMPLED["top_p"], help="of the samples")
    r.add_argument("--perf", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("out_dir")
    c.add_argument("--plain", required=True)
    c.add_argument("--cand", nargs="*", default=[])
    c.add_argument("--biased")
    c.add_argument("--liveness", nargs="*", default=[])
    c.add_argument("--expect-stall", nargs="*", default=[])
    c.add_argument("--perf", nargs="*", default=[])
    c.add_argument("--ratio-to", help="a --perf tag: every other's ms per step over its, paired by pass")
    a = ap.parse_args()
    return cmd_run(a) if a.cmd == "run" else cmd_compare(a)


if __name__ == "__main__":
    sys.exit(main())

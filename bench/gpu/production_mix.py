#!/usr/bin/env python3
"""Production-mix workload for the DDTree losslessness proof (issue 12), one server at a time.

    production_mix.py run --port P --tag T --out OUT/T.json --workload OUT/workload_SET.json [--make] ...
    production_mix.py compare OUT_DIR PLAIN_TAG TAG [TAG ...]   → report; exit 1 on any fault

`run --make` (the plain server of a flag set) builds the workload from a seed and from the plain
server's own greedy outputs, and writes it; every other server of the set replays the same file.
Round 1, all in flight together (threads, start offsets in ms): the near-limit case that corrupted
tokens (a prompt ending at 980 of 1024 generating to 1019, then 20/600 and 40/400 sent 50 ms after),
more prompts ending near the context length, prompt lengths 1..1000 over shared prefixes (three
prefix families), max_new_tokens 1..600, stop tokens that plain hits mid-path (picked from a probe
of plain's outputs), and streaming requests aborted after a few chunks. Round 2: prompts that
extend round-1 prompts by plain's round-1 outputs (the radix cache holds them), sent together.
Then the server must be idle with zero KV tokens in use (`/v1/loads`, else `/get_load`).

Other workloads (`run --kind`, issue 23), judged by the same `compare`:
- `limits`: a full CUDA-graph batch (`--graph-bs`) of requests that all sit near `--context-length`
  at once (prompts ending 124-126 tokens short, generating to 8 short), a quarter sampled, two
  streamed and aborted; then a second full batch ending 6 short. The batch whose verify mask
  overflowed upstream's graph buffer and crashed the scheduler of every speculative server.
- `penalties`: greedy requests with repetition, frequency and presence penalties (alone and mixed),
  min_new_tokens against a stop token plain meets early, and a logit bias, all in flight together;
  plus a `return_logprob` probe (`logprob_probe` in the result: plain's answer, or the refusal).
Sampled requests (`"sampled"`) and aborted ones are not compared; `--greedy-only` sends the sampled
ones greedily (upstream DFLASH stalls on mixed batches, which would hide the crash it is shown for).

The plain server also returns its top-2 logprobs; `compare` classes each request's first
divergence from plain by plain's logprob margin there (top-1 minus the candidate token's, from plain's
top-5; the top-2 gap is reported too): ≤ TIE_GAP (one bf16 step at logit magnitude 16–32) is a
numeric tie (ties can be three-way: a token outside plain's top-5 is never a tie); a
divergence that upstream DFLASH of the same flags shares exactly (same position, same token) is
classed 'upstream' (bf16 verify-vs-decode rounding, not the payload's); anything else is a fault.
DFLASH itself (`--upstream`) is reported as the reference, not judged. Aborted requests are not
compared; a request refused alike (same HTTP error) by plain and the candidate counts as same.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

import requests

TIE_GAP = 0.125 + 1e-6
TOP_K = 5  # ties can be three-way or more: the candidate's token must be among plain's top-k
SEED = 12
VOCAB_LO, VOCAB_HI = 10, 4000  # token ids the tiny models' tokenizer knows


def wait_healthy(base: str, wait_s: float, pid: int | None) -> float | None:
    t0 = time.time()
    while time.time() - t0 < wait_s:
        try:
            if requests.get(base + "/health", timeout=5).status_code == 200:
                return time.time() - t0
        except requests.RequestException:
            pass
        if pid is not None:
            try:
                os.kill(pid, 0)
            except OSError:
                return None
        time.sleep(1)
    return None


SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def generate(base: str, req: dict, *, logprobs: bool) -> dict:
    sp = {"temperature": 0.0, "max_new_tokens": req["max_new"], "ignore_eos": True}
    if req.get("sampled"):
        sp.update(SAMPLED)
    sp.update(req.get("params") or {})
    if req.get("stop"):
        sp["stop_token_ids"] = req["stop"]
    body: dict = {"input_ids": req["prompt"], "sampling_params": sp}
    if logprobs:
        body.update(return_logprob=True, top_logprobs_num=TOP_K, logprob_start_len=len(req["prompt"]) - 1)
    t = time.time()
    r = requests.post(base + "/generate", json=body, timeout=600)
    r.raise_for_status()
    j = r.json()
    meta = j.get("meta_info", {})
    out = {"output_ids": j.get("output_ids"), "s": time.time() - t,
           "finish": (meta.get("finish_reason") or {}).get("type"),
           "accept": meta.get("spec_accept_length"), "verify_ct": meta.get("spec_verify_ct"),
           "cached": meta.get("cached_tokens")}
    if logprobs:
        out["topk"] = [[[lp, tid] for lp, tid, *_ in pos[:TOP_K]] for pos in meta.get("output_top_logprobs") or []]
    return out


def stream_and_abort(base: str, req: dict) -> dict:
    sp = {"temperature": 0.0, "max_new_tokens": req["max_new"], "ignore_eos": True}
    with requests.post(base + "/generate", json={"input_ids": req["prompt"], "sampling_params": sp, "stream": True},
                       stream=True, timeout=600) as r:
        chunks = 0
        for line in r.iter_lines():
            if line.startswith(b"data:"):
                chunks += 1
                if chunks >= req["abort_after"]:
                    break  # closing the connection aborts the request server-side
    return {"aborted_after_chunks": chunks}


def run_concurrently(base: str, reqs: list[dict], *, logprobs: bool) -> dict[str, dict]:
    results: dict[str, dict] = {}
    t0 = time.time()

    def one(req: dict) -> None:
        time.sleep(max(0.0, req.get("at_ms", 0) / 1000 - (time.time() - t0)))
        try:
            results[req["id"]] = (stream_and_abort(base, req) if req.get("abort_after")
                                  else generate(base, req, logprobs=logprobs))
        except requests.HTTPError as e:  # the server's own refusal: comparable across servers
            results[req["id"]] = {"error": f"HTTP {e.response.status_code}: {e.response.text[:300]}"}
        except Exception as e:  # noqa: BLE001 - recorded per request, judged by compare
            results[req["id"]] = {"error": repr(e)[:500]}

    threads = [threading.Thread(target=one, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def make_round1(ctx: int, rng: random.Random, stops: dict[str, int]) -> list[dict]:
    tok = lambda n: [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]  # noqa: E731
    top = ctx - 5  # last position a request may reach (the seen case generated to 1019 of 1024)
    reqs = [  # the case seen corrupting tokens on the H200 (issue 12), verbatim
        {"id": "near980", "prompt": tok(980), "max_new": top - 980, "at_ms": 0},
        {"id": "after20", "prompt": tok(20), "max_new": 600, "at_ms": 50},
        {"id": "after40", "prompt": tok(40), "max_new": 400, "at_ms": 50},
    ]
    # SGLang refuses an input of ctx - 6 tokens or more (room for the first output and the reserve).
    for n in (960, 1000, 1010, ctx - 7):
        reqs.append({"id": f"near{n}", "prompt": tok(n), "max_new": top - n, "at_ms": rng.randrange(0, 300)})
    reqs.append({"id": "len1", "prompt": tok(1), "max_new": 300, "at_ms": 10})
    families = {name: tok(size) for name, size in (("A", 256), ("B", 512), ("C", 64))}
    for i in range(24):
        fam = rng.choice(list(families))
        total = min(1000, max(1, int(2 ** rng.uniform(0, 10))))
        prompt = (families[fam] + tok(max(0, total - len(families[fam]))))[:total] if rng.random() < 0.7 else tok(total)
        max_new = min(rng.choice([1, 2, 5, 17, 64, 150, 300, 600]), top - len(prompt))
        reqs.append({"id": f"mix{i}", "prompt": prompt, "max_new": max(1, max_new), "at_ms": rng.randrange(0, 500)})
    for sid, token in stops.items():
        reqs.append({"id": sid, "prompt": _stop_prompt(sid), "max_new": 200, "stop": [token],
                     "at_ms": rng.randrange(0, 500)})
    for i in range(4):
        reqs.append({"id": f"abort{i}", "prompt": tok(rng.randrange(5, 300)), "max_new": 500, "abort_after": 2 + 3 * i,
                     "at_ms": rng.randrange(0, 400)})
    return reqs


def _stop_prompt(sid: str) -> list[int]:
    r = random.Random(f"stop-{sid}")
    return [r.randrange(VOCAB_LO, VOCAB_HI) for _ in range(r.randrange(8, 200))]


def make_workload(base: str, ctx: int) -> dict:
    rng = random.Random(SEED)
    # Stop tokens that plain meets mid-path: its own greedy token at a chosen position.
    probe_ids = [f"stop{i}" for i in range(6)]
    probes = run_concurrently(base, [{"id": s, "prompt": _stop_prompt(s), "max_new": 40} for s in probe_ids],
                              logprobs=False)
    stops = {s: probes[s]["output_ids"][3 + 5 * i] for i, s in enumerate(probe_ids) if "output_ids" in probes[s]}
    return {"ctx": ctx, "round1": make_round1(ctx, rng, stops)}


def make_limits_workload(ctx: int, graph_bs: int) -> dict:
    """Two full graph batches near the context limit (module docstring)."""
    rng = random.Random(SEED + 1)
    tok = lambda n: [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]  # noqa: E731
    round1 = []
    for i in range(graph_bs):
        n = ctx - 124 - i % 3
        req = {"id": f"lim{i}", "prompt": tok(n), "max_new": ctx - 8 - n, "at_ms": 0}
        if i % 4 == 3:
            req["sampled"] = True
        if i in (5, 17):
            req["abort_after"] = 30
        round1.append(req)
    round2 = [{"id": f"lim2_{i}", "prompt": tok(ctx - 40 - i % 2), "max_new": 34 + i % 2, "at_ms": 0}
              for i in range(graph_bs)]
    return {"ctx": ctx, "kind": "limits", "round1": round1, "round2": round2}


def make_penalties_workload() -> dict:
    """Greedy requests with penalties, on the peaked model (its favourite token 7 repeats, so penalties
    decide where it stops being chosen, which drafted paths must reproduce)."""
    rng = random.Random(SEED + 2)
    tok = lambda n: [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]  # noqa: E731
    settings = (
        [("rep", {"repetition_penalty": 1.3})] * 4 + [("rep_low", {"repetition_penalty": 0.8})] * 2
        + [("freq", {"frequency_penalty": 0.8})] * 4 + [("pres", {"presence_penalty": 0.6})] * 4
        + [("freq_pres", {"frequency_penalty": 0.5, "presence_penalty": 0.5})] * 2
        + [("rep_freq", {"repetition_penalty": 1.2, "frequency_penalty": 0.4})] * 2
        + [("bias", {"logit_bias": {"7": -2.0}})] * 2
    )
    round1 = [{"id": f"{name}{i}", "prompt": tok(rng.randrange(8, 200)), "max_new": rng.choice([64, 96, 128]),
               "params": params, "at_ms": rng.randrange(0, 200)} for i, (name, params) in enumerate(settings)]
    # min_new_tokens against the stop token 7, which the peaked model emits almost at once
    round1 += [{"id": f"min_new{i}", "prompt": tok(rng.randrange(8, 100)), "max_new": 100, "stop": [7],
                "params": {"min_new_tokens": 20 + 9 * i}, "at_ms": 0} for i in range(3)]
    return {"ctx": None, "kind": "penalties", "round1": round1, "round2": []}


def logprob_probe(base: str) -> dict:
    """One request with return_logprob and top_logprobs_num: plain answers, DFLASH refuses per request."""
    body = {"input_ids": list(range(100, 140)), "return_logprob": True, "top_logprobs_num": 3,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}
    try:
        r = requests.post(base + "/generate", json=body, timeout=60)
    except requests.RequestException as e:
        return {"error": repr(e)[:300]}
    out: dict = {"status": r.status_code}
    if r.status_code == 200:
        meta = r.json().get("meta_info", {})
        out["output_token_logprobs"] = [lp[:2] for lp in meta.get("output_token_logprobs") or []]
    else:
        out["body"] = r.text[:400]
    return out


def make_round2(round1: list[dict], plain_out: dict[str, dict], ctx: int, limit: int = 14) -> list[dict]:
    out = []
    for req in round1:
        got = plain_out.get(req["id"], {})
        ids = got.get("output_ids")
        if not ids or req.get("abort_after"):
            continue
        prompt = req["prompt"] + ids
        room = ctx - 5 - len(prompt)
        if room < 1:
            continue
        out.append({"id": f"r2_{req['id']}", "prompt": prompt, "max_new": min(64, room), "at_ms": 0})
        if len(out) >= limit:
            break
    return out


def idle_kv_tokens(base: str) -> int | None:
    time.sleep(3)  # let the scheduler finish freeing after the last response
    for path in ("/v1/loads", "/get_load"):
        try:
            r = requests.get(base + path, timeout=10)
            if r.status_code != 200:
                continue
            j = r.json()
            rows = j if isinstance(j, list) else j.get("loads") or j.get("data") or [j]
            return sum(int(x.get("num_used_tokens", 0)) for x in rows if isinstance(x, dict))
        except (requests.RequestException, ValueError):
            continue
    return None


def _write(path: str, obj: object) -> None:
    """Whole or not at all: a client killed at its deadline (`timeout`) leaves the last complete file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def cmd_run(a: argparse.Namespace) -> int:
    base = f"http://127.0.0.1:{a.port}"
    res: dict = {"tag": a.tag}
    ready = wait_healthy(base, a.wait, a.pid)
    res["ready_s"] = ready
    if ready is None:
        _write(a.out, res)
        print(f"[mix] {a.tag}: never healthy", flush=True)
        return 2
    if not a.make:
        workload = _read(a.workload)
    elif a.kind == "limits":
        workload = make_limits_workload(a.context_length, a.graph_bs)
    elif a.kind == "penalties":
        workload = make_penalties_workload()
    else:
        workload = make_workload(base, a.context_length)
    if a.make:
        _write(a.workload, workload)
    if a.greedy_only:
        workload = {**workload, "round1": [{**r, "sampled": False} for r in workload["round1"]]}
    t = time.time()
    res["round1"] = run_concurrently(base, workload["round1"], logprobs=a.make)
    res["round1_s"] = time.time() - t
    if a.make and a.kind == "mix":
        workload["round2"] = make_round2(workload["round1"], res["round1"], workload["ctx"], a.round2)
        _write(a.workload, workload)
    t = time.time()
    res["round2"] = run_concurrently(base, workload["round2"], logprobs=a.make)
    res["round2_s"] = time.time() - t
    res["sampled"] = [r["id"] for r in workload["round1"] if r.get("sampled")]
    if a.kind == "penalties":
        res["logprob_probe"] = logprob_probe(base)
    res["idle_kv_tokens"] = idle_kv_tokens(base)
    try:
        info = requests.get(base + "/server_info", timeout=10).json()
        res["internal_state"] = (info.get("internal_states") or [{}])[0]
    except (requests.RequestException, ValueError) as e:
        res["internal_state"] = {"error": repr(e)}
    try:
        res["alive"] = requests.get(base + "/health", timeout=10).status_code == 200
    except requests.RequestException:
        res["alive"] = False
    _write(a.out, res)
    errors = [k for rnd in ("round1", "round2") for k, v in res[rnd].items() if "error" in v]
    cached = {rnd: sum(v.get("cached") or 0 for v in res[rnd].values()) for rnd in ("round1", "round2")}
    print(f"[mix] {a.tag}: round1 {res['round1_s']:.1f}s round2 {res['round2_s']:.1f}s errors={errors} "
          f"idle_kv={res['idle_kv_tokens']} alive={res['alive']} cached_tokens={cached}", flush=True)
    return 0


def first_divergence(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def classify(plain: dict, cand: dict, upstream: dict | None = None) -> tuple[str, dict]:
    """'same' | 'tie' | 'upstream' | 'fault' for one request, with the first differing position and
    plain's margins there. 'upstream': upstream DFLASH (same flags, DDTree off) leaves plain at the
    same position with the same token, so the divergence is not the payload's."""
    if "error" in cand or "error" in plain:
        if cand.get("error") == plain.get("error"):
            return "same", {}  # refused alike (e.g. an input over the server's limit)
        return "fault", {"error": cand.get("error") or plain.get("error")}
    a, b = plain["output_ids"], cand["output_ids"]
    pos = first_divergence(a, b)
    if pos is None:
        return "same", {}
    detail = {"pos": pos, "plain_len": len(a), "cand_len": len(b)}
    if pos >= min(len(a), len(b)):
        return "fault", {**detail, "why": "one output is a strict prefix of the other (finish differs)"}
    topk = plain.get("topk") or plain.get("top2") or []  # "top2": results recorded before top-5
    if pos < len(topk) and len(topk[pos]) >= 2:
        top = {int(tid): float(lp) for lp, tid in topk[pos]}
        best = float(topk[pos][0][0])
        # plain's top-2 margin there; and the candidate token's own margin when it is in the top-k.
        gap = best - float(topk[pos][1][0])
        cand_gap = best - top[b[pos]] if b[pos] in top else None
        detail.update(gap=round(gap, 4), cand_gap=None if cand_gap is None else round(cand_gap, 4),
                      plain_tok=a[pos], cand_tok=b[pos], plain_topk=topk[pos])
        if cand_gap is not None and cand_gap <= TIE_GAP:
            return "tie", detail
        if upstream and "output_ids" in upstream:
            u = upstream["output_ids"]
            if first_divergence(a, u) == pos and pos < len(u) and u[pos] == b[pos]:
                return "upstream", detail
        return "fault", detail
    return "fault", {**detail, "why": "no top-k logprobs at that position"}


def judged(plain: dict, cand: dict, upstream: dict | None):
    """(request id, plain's result, class, detail) for every greedy request plain finished: sampled requests
    are the sample tests' and aborted ones have no full output to compare."""
    skip = set(plain.get("sampled") or [])
    for rnd in ("round1", "round2"):
        for rid, p in plain[rnd].items():
            if "aborted_after_chunks" in p or rid in skip:
                continue
            shared = upstream[rnd].get(rid) if upstream else None
            yield (rid, p, *classify(p, cand[rnd].get(rid, {"error": "missing"}), shared))


def cmd_compare(a: argparse.Namespace) -> int:
    def load(tag: str) -> dict | None:
        p = os.path.join(a.out_dir, f"{tag}{a.suffix}.json")
        return _read(p) if os.path.exists(p) else None

    plain = load(a.plain)
    upstream = load(a.upstream) if a.upstream else None
    summary: dict = {"plain": a.plain, "upstream": a.upstream, "tie_gap": TIE_GAP, "variants": {}}
    bad = False
    if not plain or "round1" not in plain:
        print(f"{a.plain}: no plain results")
        return 1
    for tag in a.tags:
        cand = load(tag)
        row: dict = {"same": 0, "tie": 0, "upstream": 0, "fault": 0, "faults": [], "ties": [], "upstreams": []}
        if not cand or "round1" not in cand:
            row["missing"] = True
            bad = True
            summary["variants"][tag] = row
            # a client `timeout` killed at the call's deadline writes nothing, as does one whose server never came up
            print(f"{tag}: NO RESULTS (no {tag}{a.suffix}.json: its client was cut at the deadline or its server never "
                  f"became healthy; client_{tag}.log and run.log's rc say which)")
            continue
        if tag in a.expect_dead:  # upstream before the fix: the workload must have killed it
            dead = cand.get("alive") is False or cand.get("ready_s") is None
            row["verdict"] = "crashed (expected: upstream)" if dead else "SURVIVED (expected to crash)"
            bad |= not dead
            summary["variants"][tag] = row
            print(f"{tag:>16}: {row['verdict']} alive={cand.get('alive')} "
                  f"errors={sum('error' in v for r in ('round1', 'round2') for v in cand.get(r, {}).values())}")
            continue
        for rid, _, kind, detail in judged(plain, cand, upstream if tag != a.upstream else None):
            row[kind] += 1
            if kind != "same":
                row[kind + "s"].append({"id": rid, **detail})
        aborts = [v for v in cand["round1"].values() if "aborted_after_chunks" in v]
        if "logprob_probe" in cand:
            row["logprob_probe"] = cand["logprob_probe"]
        st = cand.get("internal_state", {})
        dd = st.get("ddtree") or {}
        row.update(idle_kv_tokens=cand.get("idle_kv_tokens"), alive=cand.get("alive"), aborted=len(aborts),
                   round1_s=round(cand["round1_s"], 2), round2_s=round(cand["round2_s"], 2),
                   avg_spec_accept_length=st.get("avg_spec_accept_length"),
                   ddtree={k: dd.get(k) for k in ("mode", "steps", "tree_steps", "fallback_steps", "shrunk_steps", "padded_steps",
                                                   "graph_steps", "fallback_reasons", "avg_tree_nodes", "budget")}
                   if dd else None)
        ok = row["fault"] == 0 and row.get("idle_kv_tokens") == 0 and row.get("alive")
        if tag in a.expect_fault:  # the code before a fix: the workload must catch it (power shown)
            ok = row["fault"] > 0 and row.get("alive")
        if tag in a.expect_padded and not dd.get("padded_steps"):  # a pass that never ran the path proves nothing
            row["not_exercised"] = "no step was padded to the verify graphs' width"
            ok = False
        if tag == a.upstream:  # upstream's own divergences are reported, not the payload's to pass
            row["verdict"] = "reference" + ("" if ok else " (diverges from plain beyond a tie)")
        else:
            bad |= not ok
            if tag in a.expect_fault:
                row["verdict"] = "faults (expected: before the fix)" if ok else "NO FAULT (expected some)"
            else:
                row["verdict"] = "pass" if ok else "FAIL"
        summary["variants"][tag] = row
        print(f"{tag:>16}: {row['verdict']}{' (' + row['not_exercised'] + ')' if 'not_exercised' in row else ''} "
              f"same={row['same']} tie={row['tie']} upstream={row['upstream']} "
              f"fault={row['fault']} "
              f"idle_kv={row['idle_kv_tokens']} alive={row['alive']} r1={row['round1_s']}s r2={row['round2_s']}s "
              f"accept={row['avg_spec_accept_length']} ddtree={row['ddtree']}")
        for f in row["faults"][:6]:
            print(f"{'':>18}fault {f}")
        for kind in ("upstreams", "ties"):
            for f in row[kind][:3]:
                print(f"{'':>18}{kind[:-1]} {f}")
    with open(os.path.join(a.out_dir, f"mix_summary{a.suffix}_{a.plain}_{a.tags[-1]}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 1 if bad else 0


def server_run_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `run` subcommand with the options every bench client takes: which server, where to write."""
    r = sub.add_parser("run")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--tag", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--wait", type=float, default=300, help="seconds to wait for /health")
    r.add_argument("--pid", type=int, help="the server's pid: stop waiting when it dies")
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = server_run_parser(sub)
    r.add_argument("--workload", required=True)
    r.add_argument("--make", action="store_true", help="plain server: build the workload and return top-5 logprobs")
    r.add_argument("--kind", choices=("mix", "limits", "penalties"), default="mix")
    r.add_argument("--round2", type=int, default=14,
                   help="mix with --make: at most this many round-2 requests (each resumes a round-1 request from the cache)")
    r.add_argument("--context-length", type=int, default=1024)
    r.add_argument("--graph-bs", type=int, default=32, help="limits: requests per batch (--cuda-graph-max-bs)")
    r.add_argument("--greedy-only", action="store_true", help="send the workload's sampled requests greedily")
    c = sub.add_parser("compare")
    c.add_argument("out_dir")
    c.add_argument("plain")
    c.add_argument("--upstream", help="the set's DFLASH tag: divergences it shares are classed 'upstream'")
    c.add_argument("--expect-padded", nargs="*", default=[],
                   help="tags that fail unless some step was padded to the verify graphs' width (TEST_CYCLE_BUDGETS)")
    c.add_argument("--suffix", default="", help="result files are TAG{suffix}.json (a workload kind's)")
    c.add_argument("--expect-dead", nargs="*", default=[], help="tags the workload must crash (upstream)")
    c.add_argument("--expect-fault", nargs="*", default=[], help="tags the workload must catch faulting")
    c.add_argument("tags", nargs="+")
    a = ap.parse_args()
    return cmd_run(a) if a.cmd == "run" else cmd_compare(a)


if __name__ == "__main__":
    sys.exit(main())

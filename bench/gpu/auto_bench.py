#!/usr/bin/env python3
"""Issue 24's client: tokens/s of plain, DFLASH, fixed DDTree budgets and `--speculative-ddtree-budget auto` at
batch 1 .. 64, in paired passes, and auto's greedy outputs against plain's.

  run --servers TAG=PORT[:PID] ... --prompts heldout_prompts.json --out F [--reference TAG] [--batches 1,2,..]
      [--temps 0,0.8] [--passes N] [--max-new N] [--min-tokens N] [--min-seconds S] [--warmup N] [--wait S]
      Every server is measured at every (temperature, batch): `batch` held-out prompts sent together, `max-new`
      tokens each (ignore_eos), then the next `batch` prompts, until `min-tokens` are generated and `min-seconds`
      have passed (`measure`: small batches need several rounds for their accept length to settle, fast ones for a
      round's prefill and HTTP to stop weighing), after `warmup` batches of that
      size (first uses: graphs, kernels; auto has a graph per candidate). A pass measures each (temperature, batch)
      on every server, one round of each in turn, in an order rotated per pass, so a server's figure and DFLASH's
      come from the same seconds (paired). --reference (plain): first, greedy outputs with plain's top-5 logprobs for the
      largest batch's prompts, so `compare` can class every divergence by plain's margin. Greedy outputs of
      the first pass are kept for that; /server_info's DDTree state (auto's plan, steps by budget, costs) last,
      and for auto's servers each measurement's own steps by candidate (`picks`).
  compare F [F ...] --dflash TAG --auto TAG [--plain TAG] [--fixed TAG ...] [--cost-realistic] [--title S]
      The table (tokens/s and x DFLASH, median over the passes' paired ratios, and the passes' spread), the
      goals (auto >= DFLASH within the twin spread at every batch, >= every fixed budget - 5 % (paired in the
      same wave where one served both, `against_fixed`), >= 1.3x
      DFLASH at batch 1 on a cost-realistic target) and the identity counts (same / tie / fault by plain's
      top-2 margin, production_mix.classify), and auto's steps by candidate at each batch size. Exit 1 on a fault
      or a missed goal.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time

import requests
from graphs_proof import ddtree_state  # same folder: the scripts run by path
from pair_sweep import generate
from production_mix import TOP_K, _write, classify, wait_healthy

AUTO_MARGIN = 0.05  # auto within 5 % of the best fixed budget
BS1_GOAL = 1.3  # auto over DFLASH at batch 1, cost-realistic target


def batch(base: str, prompts: list[list[int]], temperature: float, max_new: int, *, logprobs: bool = False) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: generate(base, p, {"temperature": temperature}, logprobs=logprobs,
                                              max_new=max_new), prompts))


def measure(bases: dict[str, str], prompts: list[list[int]], bs: int, temperature: float, max_new: int,
            min_tokens: int = 0, min_seconds: float = 0.0) -> dict[str, dict]:
    """Each server's figure at one (temperature, batch): rounds of `bs` prompts sent together, the next round the
    next `bs` of `prompts` (cycling), one round of each server in turn (the order of `bases`), until each has
    generated `min_tokens`: at batch 1 one round is one request of `max_new` tokens, whose accept length (a mean
    over a few dozen steps) varies from prompt to prompt and, sampled, from draw to draw (on the H200 one server's
    T 0.8 batch-1 ratio was 1.42x and 2.33x DFLASH in its two passes), far more than the 5 % the goals judge. And
    until its rounds have lasted `min_seconds`: on the launch-bound pair a round of 16 took 0.1 s, and one
    server's two passes at batch 16 differed by 30 % (H100, 2026-12-07), its prompts' prefill and the HTTP round
    trips a large part of so short a wall. Interleaved because a host's speed drifts within seconds: on an H100
    measured server after server, a second each, the same server's step moved by +-30 % from pass to pass and
    the ranking of DFLASH, full 128 and auto changed with it (RESULTS.md, "Payload 0.8.28 on a GPU"); round by
    round, the servers share the drift. A server's wall is its own rounds' (the others idle meanwhile)."""
    rounds: dict[str, list[list[dict]]] = {tag: [] for tag in bases}
    walls = dict.fromkeys(bases, 0.0)

    def done(tag: str) -> bool:
        return bool(rounds[tag]) and walls[tag] >= min_seconds and sum(
            r["tokens"] for rnd in rounds[tag] for r in rnd) >= min_tokens

    while not all(done(tag) for tag in bases):
        for tag, base in bases.items():
            if done(tag):
                continue
            start = len(rounds[tag]) * bs
            t0 = time.perf_counter()
            rounds[tag].append(batch(base, [prompts[(start + j) % len(prompts)] for j in range(bs)], temperature,
                                     max_new))
            walls[tag] += time.perf_counter() - t0
    return {tag: _summary(rounds[tag], walls[tag], temperature) for tag in bases}


def _summary(rounds: list[list[dict]], wall: float, temperature: float) -> dict:
    res = [r for rnd in rounds for r in rnd]
    tokens = sum(r["tokens"] for r in res)
    verify = [r["verify_ct"] or r["tokens"] for r in res]
    steps = sum(max(r["verify_ct"] or r["tokens"] for r in rnd) for rnd in rounds)
    return {"wall_s": round(wall, 4), "tokens": tokens, "rounds": len(rounds), "tok_s": round(tokens / wall, 2),
            "accept": round(tokens / max(1, sum(verify)), 4), "ms_per_step": round(1e3 * wall / max(1, steps), 4),
            # in prompt order: output i continues prompts[i % len(prompts)]
            "outputs": [r["output_ids"] for r in res] if temperature == 0 else None}


def cmd_run(a: argparse.Namespace) -> int:
    servers: dict[str, tuple[str, int | None]] = {}
    for spec in a.servers:
        tag, _, rest = spec.partition("=")
        port, _, pid = rest.partition(":")
        servers[tag] = (f"http://127.0.0.1:{port}", int(pid) if pid else None)
    with open(a.prompts) as f:
        prompts = [p["input_ids"] for p in json.load(f)["prompts"]]
    batches = [int(x) for x in a.batches.split(",")]
    temps = [float(x) for x in a.temps.split(",")]
    res: dict = {"batches": batches, "temps": temps, "passes": a.passes, "max_new": a.max_new, "servers": {},
                 "complete": False}
    alive = {}
    for tag, (base, pid) in servers.items():
        ready = wait_healthy(base, a.wait, pid)
        res["servers"][tag] = {"ready_s": ready, "results": {}}
        if ready is None:
            print(f"[auto] {tag}: never healthy", flush=True)
        else:
            alive[tag] = base
    need = max(batches)
    chosen = [prompts[i % len(prompts)] for i in range(need)]
    if a.reference and a.reference in alive:
        res["reference"] = batch(alive[a.reference], chosen, 0.0, a.max_new, logprobs=True)
        print(f"[auto] reference: {len(res['reference'])} greedy outputs with plain's top-{TOP_K}", flush=True)
    for temp in temps:  # warm-up: the first batch of a size compiles and fills the radix cache alike everywhere
        for bs in batches:
            for base in alive.values():
                for _ in range(a.warmup):
                    batch(base, chosen[:bs], temp, a.max_new)
    print("[auto] warm-up done", flush=True)
    tags = list(alive)
    profiled = set(a.profiled or ()) & set(alive)
    # auto's own servers: which candidates each measurement's steps took (its /server_info counts, before and after)
    auto_tags = {tag for tag, base in alive.items() if ddtree_state(base).get("auto")}
    for p in range(a.passes):
        order = tags[p % len(tags):] + tags[:p % len(tags)]
        for temp in temps:
            for bs in batches:
                watched = [tag for tag in order if tag in profiled | auto_tags]
                # profiled: drops the phases of the steps before this measurement
                before = {tag: ddtree_state(alive[tag]) for tag in watched}
                measured = measure({tag: alive[tag] for tag in order}, chosen, bs, temp, a.max_new, a.min_tokens,
                                   a.min_seconds)
                for tag in order:
                    r = measured[tag]
                    if p > 0:
                        r["outputs"] = None
                    after = ddtree_state(alive[tag]) if tag in watched else {}
                    if tag in profiled:  # SGLANG_DDTREE_PROFILE=1: this measurement's per-phase medians
                        r["profile"] = after.get("profile")
                    if tag in auto_tags:
                        r["chosen"] = picks(before[tag], after)
                    res["servers"][tag]["results"].setdefault(f"t{temp:g}", {}).setdefault(str(bs), []).append(r)
                    print(f"[auto] pass {p} T {temp:g} bs {bs} {tag}: {r['tok_s']} tok/s accept {r['accept']} "
                          f"{r['ms_per_step']} ms/step" + (f" picks {r['chosen']}" if "chosen" in r else ""), flush=True)
                _write(a.out, res)  # a wave cut at its deadline keeps what it measured
    for tag, base in alive.items():
        try:
            res["servers"][tag]["ddtree"] = ddtree_state(base)
        except requests.RequestException as e:
            res["servers"][tag]["ddtree"] = {"error": str(e)}
    res["complete"] = True
    _write(a.out, res)
    return 0


def picks(before: dict, after: dict) -> dict[str, int]:
    """Auto's steps by candidate between two /server_info reads (`auto.chosen`), the candidates it took."""
    was, now = ((state.get("auto") or {}).get("chosen") or {} for state in (before, after))
    return {name: n - was.get(name, 0) for name, n in now.items() if n > was.get(name, 0)}


# ------------------------------------------------------------------ compare
def summed_picks(runs: list[dict]) -> dict[str, int]:
    """Auto's steps by candidate over a cell's measurements (`run` records them as `chosen`)."""
    total: dict[str, int] = {}
    for r in runs:
        for name, n in (r.get("chosen") or {}).items():
            total[name] = total.get(name, 0) + n
    return total


def paired(mine_res: dict, tag: str, ref: str, key: str, bs: str) -> list[float]:
    """`tag`'s tokens/s over DFLASH's, pass by pass, within the file (the call's wave) that measured `tag`."""
    mine = mine_res["servers"][tag]["results"].get(key, {}).get(bs, [])
    theirs = mine_res["servers"].get(ref, {}).get("results", {}).get(key, {}).get(bs, [])
    return [m["tok_s"] / t["tok_s"] for m, t in zip(mine, theirs, strict=False) if t["tok_s"] > 0]


def identity(reference: list[dict] | None, res: dict, tag: str) -> dict:
    """Greedy outputs of the first pass vs plain's reference (the same prompts in every wave)."""
    row = {"same": 0, "tie": 0, "fault": 0, "details": []}
    if not reference:
        return row
    for bs, runs in res["servers"][tag]["results"].get("t0", {}).items():
        for i, out in enumerate(runs[0].get("outputs") or []):
            kind, detail = classify(reference[i % len(reference)], {"output_ids": out})
            kind = "fault" if kind == "upstream" else kind
            row[kind] += 1
            if kind != "same":
                row["details"].append({"bs": bs, "prompt": i, "kind": kind, **detail})
    return row


def against_fixed(waves: list[dict], a: argparse.Namespace, key: str, bs: str, auto_x: float,
                  med: dict[str, dict[str, float]]) -> dict[str, tuple[float, str]]:
    """Auto's tokens/s over each fixed budget's: paired pass by pass in a wave that served both (the same
    minutes: DFLASH of another wave drifted by up to 14 % on the H200 between calls, more than the 5 % judged),
    else through each one's DFLASH of its own wave."""
    out: dict[str, tuple[float, str]] = {}
    for tag in a.fixed:
        direct = [r for res in waves if a.auto in res["servers"] and tag in res["servers"]
                  for r in [paired(res, a.auto, tag, key, bs)] if r]
        if direct:
            out[tag] = (statistics.median(direct[0]), "same wave")
        elif bs in med.get(tag, {}):
            out[tag] = (auto_x / med[tag][bs], f"x {a.dflash} of each wave")
    return out


def cmd_compare(a: argparse.Namespace) -> int:
    """One set's waves (files): each server's ratios against the DFLASH of its own wave."""
    waves = []
    for path in a.files:
        with open(path) as f:
            waves.append(json.load(f))
    home: dict[str, dict] = {}
    for res in waves:
        for tag, srv in res["servers"].items():
            if srv.get("results") and (tag not in home or tag != a.dflash):
                home.setdefault(tag, res)
    reference = next((res["reference"] for res in waves if res.get("reference")), None)
    tags = [t for t in [a.plain, a.dflash, *a.fixed, a.auto] if t and t in home]
    batches = waves[0]["batches"] if waves else []
    rc = 0
    # a file without "complete" predates the flag and was written whole
    cut = [path for path, res in zip(a.files, waves, strict=True) if res.get("complete") is False]
    lines = [f"# {a.title}", "", f"files: {', '.join(a.files)}"
             + (f" (cut before the end, some cells short of their passes: {', '.join(cut)})" if cut else ""), ""]
    for key in [f"t{t:g}" for t in (waves[0]["temps"] if waves else [])]:
        lines += [f"## {key}: tokens/s (x {a.dflash} of the same wave: median of the paired passes [min, max]; accept)",
                  "", "| server | " + " | ".join(f"bs {b}" for b in batches) + " |", "|---|" + "---|" * len(batches)]
        med: dict[str, dict[str, float]] = {}
        spread: dict[str, dict[str, float]] = {}
        for tag in tags:
            cells = []
            for bs in map(str, batches):
                runs = home[tag]["servers"][tag]["results"].get(key, {}).get(bs, [])
                if not runs:
                    cells.append("—")
                    continue
                tok = statistics.median(r["tok_s"] for r in runs)
                acc = statistics.median(r["accept"] for r in runs)
                rr = paired(home[tag], tag, a.dflash, key, bs) if tag != a.dflash else []
                if rr:
                    med.setdefault(tag, {})[bs] = statistics.median(rr)
                    spread.setdefault(tag, {})[bs] = max(rr) - min(rr)
                    cells.append(f"{tok:.0f} ({med[tag][bs]:.2f}x [{min(rr):.2f}, {max(rr):.2f}], {acc:.2f})")
                else:
                    cells.append(f"{tok:.0f} ({acc:.2f})")
            lines.append(f"| {tag} | " + " | ".join(cells) + " |")
        lines.append("")
        for bs in map(str, batches):
            got = med.get(a.auto, {}).get(bs)
            if got is None and a.dflash not in home and a.auto in home:
                # A diagnostic wave without DFLASH: nothing to judge the goals by; auto against each fixed
                # budget of its wave instead.
                beside = [f"x {t} {statistics.median(rr):.2f} [{min(rr):.2f}, {max(rr):.2f}]" for t in a.fixed
                          if t in home and (rr := paired(home[a.auto], a.auto, t, key, bs))]
                lines.append(f"- {key} bs {bs}: no {a.dflash} measured, goals not judged; auto "
                             + ("; ".join(beside) or "alone"))
                continue
            if got is None:
                lines.append(f"- {key} bs {bs}: auto not measured: **missed**")
                rc = 1
                continue
            goals = [("auto >= DFLASH (within the passes' spread)", got >= 1.0 - spread[a.auto][bs])]
            vs_fixed = against_fixed(waves, a, key, bs, got, med)
            if vs_fixed:
                worst = min(vs_fixed, key=lambda t: vs_fixed[t][0])
                ratio, how = vs_fixed[worst]
                goals.append((f"auto >= best fixed - 5 % (closest: {worst}, auto at {ratio:.2f}x of it, {how})",
                              ratio >= 1 - AUTO_MARGIN))
            if a.cost_realistic and bs == "1":
                goals.append((f"auto >= {BS1_GOAL}x DFLASH at batch 1", got >= BS1_GOAL))
            for name, ok in goals:
                lines.append(f"- {key} bs {bs}: {name}: {got:.3f}x: {'met' if ok else '**missed**'}")
                rc |= 0 if ok else 1
        by_batch = [f"bs {bs} " + " ".join(f"{c} {n}" for c, n in sorted(steps.items(), key=lambda kv: -kv[1]))
                    for bs in map(str, batches) if a.auto in home
                    and (steps := summed_picks(home[a.auto]["servers"][a.auto]["results"].get(key, {}).get(bs, [])))]
        if by_batch:  # files from before `run` recorded them have none
            lines.append(f"- {key} auto's steps by candidate, over the passes: " + "; ".join(by_batch))
        lines.append("")
    for tag in tags:
        if tag in (a.plain, a.dflash):
            continue
        row = identity(reference, home[tag], tag)
        lines.append(f"- greedy vs {a.plain}: {tag}: same {row['same']}, tie {row['tie']}, fault {row['fault']}"
                     + (f"; first: {row['details'][:2]}" if row["details"] else ""))
        if row["fault"] and tag == a.auto:
            rc = 1
    auto = ((home.get(a.auto, {}).get("servers", {}).get(a.auto, {}).get("ddtree")) or {}).get("auto") or {}
    lines += ["", f"auto's plan: {auto.get('plan')}", f"steps by budget: {auto.get('verified')}",
              f"acceptance by budget: {auto.get('accepted_by_budget')}", f"step ms: {auto.get('step_ms')}",
              f"replay ms: {auto.get('replay_ms')}", ""]
    lines += profile_table(home, [t for t in (*a.fixed, a.auto) if t in home], batches)
    print("\n".join(lines))
    return rc


PHASES = ("step_start->draft_done", "draft_done->built", "built->mask_ready", "mask_ready->target_done",
          "target_done->walked", "walked->step_done", "step_done->step_start")


def profile_table(home: dict, tags: list[str], batches: list[int]) -> list[str]:
    """Profiled servers (`run --profiled`): greedy, first pass, GPU ms per phase (CPU ms where the GPU has no
    event), by batch size: where one server's step costs more than another's at the same tree."""
    lines: list[str] = []
    for bs in map(str, batches):
        rows = []
        for tag in tags:
            runs = home[tag]["servers"][tag]["results"].get("t0", {}).get(bs, [])
            prof = (runs[0].get("profile") if runs else None) or {}
            if prof:
                cells = [prof.get(k, {}).get("gpu_ms") or prof.get(k, {}).get("cpu_ms") for k in PHASES]
                rows.append(f"| {tag} | " + " | ".join("—" if c is None else f"{c:.2f}" for c in cells)
                            + f" | {runs[0]['ms_per_step']:.2f} |")
        if rows:
            lines += [f"## profile, T 0, bs {bs} (ms per phase, medians; last column: client ms per step)", "",
                      "| server | " + " | ".join(PHASES) + " | client |", "|---|" + "---|" * (len(PHASES) + 1), *rows, ""]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--servers", nargs="+", required=True)
    r.add_argument("--prompts", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--reference")
    r.add_argument("--batches", default="1,2,4,8,16,32,64")
    r.add_argument("--temps", default="0,0.8")
    r.add_argument("--passes", type=int, default=3)
    r.add_argument("--max-new", type=int, default=64)
    r.add_argument("--warmup", type=int, default=1, help="warm-up batches per (temperature, batch size)")
    r.add_argument("--wait", type=float, default=300)
    r.add_argument("--min-tokens", type=int, default=0,
                   help="repeat a batch size over the next prompts until this many tokens are generated")
    r.add_argument("--min-seconds", type=float, default=0.0,
                   help="and until this many seconds have passed (a fast batch's rounds are mostly prefill and HTTP)")
    r.add_argument("--profiled", nargs="*", default=[],
                   help="servers started with SGLANG_DDTREE_PROFILE=1: each measurement keeps its per-phase step times")
    c = sub.add_parser("compare")
    c.add_argument("files", nargs="+")
    c.add_argument("--dflash", required=True)
    c.add_argument("--auto", required=True)
    c.add_argument("--plain")
    c.add_argument("--fixed", nargs="*", default=[])
    c.add_argument("--cost-realistic", action="store_true")
    c.add_argument("--title", default="DDTree auto budget")
    a = ap.parse_args()
    return cmd_run(a) if a.cmd == "run" else cmd_compare(a)


if __name__ == "__main__":
    sys.exit(main())

"""Read state_audit's per-step records (sitecustomize.py) and say where a request's recurrent state went wrong.

    python3 analyze.py OUT_DIR --workload OUT_DIR/workload_h.json --plain h_plain_audit --cand h_dflash_audit ...

Per server, from its own records alone:
  - moved:    a slot whose fingerprint changed between two steps (nothing should touch the pool there);
  - clobber:  a slot that changed in a step none of whose rows owns it;
  - shared:   two rows of one step on the same slot;
  - lost:     a verify row whose slot did not change (its commit wrote nothing);
  - stale clear: a decode / verify batch still carrying clear indices (an eager verify ran them before 0.8.4);
  - committed KV changed, verify input / slot integrity issues (as sitecustomize.py recorded them).
Against plain (same request): the first length, while their tokens agree, where the candidate's conv / SSM
fingerprint leaves plain's by more than --tol (relative), with the step that produced it; for the --focus
requests, each position's top-2 logits and first sublayer off plain's, and the committed K/V sums by position.
Exit 0 always: this is a diagnosis, not a gate."""

from __future__ import annotations

import argparse
import glob
import json
import os


def load(out_dir: str, tag: str) -> list[dict]:
    recs: list[dict] = []
    for path in sorted(glob.glob(os.path.join(out_dir, f"audit_{tag}.jsonl.*"))):
        with open(path) as f:
            recs += [json.loads(line) for line in f if line.strip()]
    return [r for r in recs if "ct" in r]


def ids_by_hash(workload: str) -> dict[int, str]:
    with open(workload) as f:
        w = json.load(f)
    return {hash(tuple(r["prompt"])) & 0xFFFFFFFF: r["id"] for rnd in ("round1", "round2") for r in w[rnd]}


def state_tokens(rec: dict, i: int) -> int:
    """Tokens the row's state holds after the step."""
    if rec["mode"] in ("EXTEND", "MIXED"):
        return rec["seq"][i]
    if rec.get("correct") is not None:  # a speculative verify: the length before it plus what it committed
        return rec["seq"][i] + rec["correct"][i] + 1
    return rec["seq"][i]  # plain decode: the length already counts the step's token


def self_checks(recs: list[dict], names: dict[int, str]) -> list[str]:
    events: list[str] = []
    last_post = None
    for rec in recs:
        who = [names.get(h, f"?{h:08x}") for h in rec["phash"]]
        pre, post, slots = rec["pre"], rec["post"], rec["slots"]
        if last_post is not None:
            for s, (a, b) in enumerate(zip(last_post, pre, strict=True)):
                if a != b:
                    events.append(f"ct {rec['ct']}: slot {s} moved between steps {a[:2]} -> {b[:2]}")
        last_post = post
        if len(set(slots)) != len(slots):
            events.append(f"ct {rec['ct']} {rec['mode']}: shared slots {list(zip(who, slots, strict=True))}")
        owned = set(slots)
        for s, (a, b) in enumerate(zip(pre, post, strict=True)):
            if a != b and s not in owned:
                events.append(f"ct {rec['ct']} {rec['mode']} graph={rec['graph']}: slot {s} changed, owned by no row "
                              f"(rows {list(zip(who, slots, strict=True))})")
        if rec.get("correct") is not None:
            for i, s in enumerate(slots):
                if pre[s] == post[s]:
                    events.append(f"ct {rec['ct']} verify graph={rec['graph']}: {who[i]} slot {s} unchanged "
                                  f"(seq {rec['seq'][i]}, correct {rec['correct'][i]}, batch {len(slots)})")
        for ev in rec.get("prefill_issues") or []:
            events.append(f"ct {rec['ct']} {rec['mode']}: verify input (prefill against the running batch) {ev}")
        for ev in rec.get("verify_issues") or []:
            rows = [who[r] for r in ev.get("rows", []) if r < len(who)]
            events.append(f"ct {rec['ct']} graph={rec['graph']}: verify input {ev} rows {rows} (batch {list(zip(who, rec['seq'], strict=True))})")
        for ev in rec.get("slot_issues") or []:
            at = [(who[r], pos) for r, pos in ev.get("at", [])]
            events.append(f"ct {rec['ct']} {rec['mode']} graph={rec['graph']}: slots after the step: {ev['what']} {at or ev}")
        for ev in rec.get("kv") or []:
            events.append(f"ct {rec['ct']} {rec['mode']} graph={rec['graph']}: {names.get(rec['phash'][ev['row']], ev['rid'])} "
                          f"committed KV changed: positions moved {ev['moved']} changed {ev['changed']} (slots "
                          f"{ev['slots']}, of {ev['n']}; batch {len(rec['slots'])}, seq {rec['seq'][ev['row']]})")
        if rec["mode"] not in ("EXTEND", "MIXED") and rec.get("clear"):
            events.append(f"ct {rec['ct']} {rec['mode']} graph={rec['graph']}: stale clear indices {rec['clear']} "
                          f"on rows {list(zip(who, slots, strict=True))}")
    return events


def states(recs: list[dict], names: dict[int, str]) -> dict[str, dict[int, tuple[list[float], dict]]]:
    out: dict[str, dict[int, tuple[list[float], dict]]] = {}
    for rec in recs:
        for i, h in enumerate(rec["phash"]):
            n = state_tokens(rec, i)
            step = {"ct": rec["ct"], "mode": rec["mode"], "graph": rec["graph"], "batch": len(rec["slots"]),
                    "row": i, "slot": rec["slots"][i], "seq": rec["seq"][i],
                    "correct": rec["correct"][i] if rec.get("correct") is not None else None}
            out.setdefault(names.get(h, f"?{h:08x}"), {})[n] = (rec["post"][rec["slots"][i]], step)
    return out


def kv_contents(recs: list[dict], names: dict[int, str]) -> dict[str, dict[int, list[float]]]:
    """Each request's committed positions: their attention layers' K and V sums, as first committed."""
    out: dict[str, dict[int, list[float]]] = {}
    for rec in recs:
        for i, h in enumerate(rec["phash"]):
            new = (rec.get("kv_new") or {}).get(rec["rids"][i])
            if new:
                start, sums = new
                out.setdefault(names.get(h, f"?{h:08x}"), {}).update({start + j: v for j, v in enumerate(sums)})
    return out


def layer_rows(recs: list[dict], names: dict[int, str]) -> dict[tuple[str, int], dict]:
    """(request, position) -> the target's sublayer fingerprints and top-2 logits for the token at that
    position (every decode row; a verify row's first token)."""
    out: dict[tuple[str, int], dict] = {}
    for rec in recs:
        owner = {p: names.get(h, f"?{h:08x}") for p, h in zip(rec.get("rpi") or [], rec["phash"], strict=False)}
        for row in rec.get("layer_rows") or []:
            for j, (p, pos) in enumerate(zip(row.get("rpi", []), row.get("pos", []), strict=False)):
                if p in owner:
                    out[(owner[p], pos)] = {"top2": row["top2"][j],
                                            "layers": {k: v[j] for k, v in row.get("layers", {}).items()}}
    return out


def layer_report(plain: dict, cand: dict, focus: list[str], tol: float) -> None:
    """Where the focus requests' tokens first differ from plain's, sublayer by sublayer."""
    for rid in focus:
        keys = sorted(k for k in cand if k[0] == rid and k in plain)
        for key in keys[:12]:
            a, b = cand[key], plain[key]
            diffs = [(name, rel1(a["layers"][name], b["layers"][name])) for name in b["layers"] if name in a["layers"]]
            first = next((f"{n} {d:.2g}" for n, d in diffs if d > tol), "-")
            print(f"     {rid} pos {key[1]}: top2 {a['top2']} vs plain {b['top2']}; first sublayer off: {first}"
                  f" (of {len(diffs)}: " + " ".join(f"{n}:{d:.1g}" for n, d in diffs) + ")")


def rel1(a: list[float], b: list[float]) -> float:
    return max(abs(a[0] - b[0]), abs(a[1] - b[1])) / max(b[1], 1e-9)


def rel(a: list[float], b: list[float]) -> float:
    """Relative distance of two fingerprints: SSM and conv sums against their magnitudes."""
    return max(abs(a[0] - b[0]) / max(b[1], 1e-9), abs(a[1] - b[1]) / max(b[1], 1e-9),
               abs(a[2] - b[2]) / max(b[3], 1e-9), abs(a[3] - b[3]) / max(b[3], 1e-9))


def outputs(out_dir: str, tag: str) -> dict[str, list[int]]:
    """A server's output tokens per request (production_mix.py's <tag>.json), empty when absent."""
    path = os.path.join(out_dir, f"{tag}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        res = json.load(f)
    return {rid: r["output_ids"] for rnd in ("round1", "round2") for rid, r in (res.get(rnd) or {}).items()
            if r.get("output_ids")}


def same_tokens_until(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--plain", required=True)
    ap.add_argument("--cand", nargs="+", default=[])
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--focus", nargs="*", default=["mix20", "len1"], help="requests printed step by step")
    a = ap.parse_args()
    names = ids_by_hash(a.workload)
    plain_recs = load(a.out_dir, a.plain)
    plain = states(plain_recs, names)
    plain_out = outputs(a.out_dir, a.plain)
    with open(a.workload) as f:
        workload = json.load(f)
    prompt_len = {r["id"]: len(r["prompt"]) for rnd in ("round1", "round2") for r in workload[rnd]}
    for tag in [a.plain, *a.cand]:
        recs = load(a.out_dir, tag)
        print(f"== {tag}: {len(recs)} steps, {sum(r['graph'] for r in recs)} on graphs")
        if not recs:
            continue
        events = self_checks(recs, names)
        print(f"   self-check events: {len(events)}")
        loud = [e for e in events if any(k in e for k in ("committed KV", "verify input", "slots after"))]
        for e in [e for e in events if e not in loud][:12] + loud[:30]:
            print("   ", e)
        if tag == a.plain:
            continue
        cand, cand_out = states(recs, names), outputs(a.out_dir, tag)
        bad = []
        for rid, by_n in sorted(cand.items()):
            ref = plain.get(rid, {})
            # states are comparable while both hold the same tokens: the prompt and the outputs up to the first
            # difference (a tie taken the other way makes every later state differ, rightly)
            limit = prompt_len.get(rid, 0) + same_tokens_until(plain_out.get(rid, []), cand_out.get(rid, []))
            common = sorted(n for n in set(by_n) & set(ref) if not (plain_out and cand_out) or n <= limit)
            first = next((n for n in common if rel(by_n[n][0], ref[n][0]) > a.tol), None)
            worst = max((rel(by_n[n][0], ref[n][0]) for n in common), default=0.0)
            if first is not None:
                bad.append(rid)
                print(f"   {rid}: state leaves plain's at {first} tokens (rel {rel(by_n[first][0], ref[first][0]):.3g}; "
                      f"{len(common)} lengths compared, worst {worst:.3g}); step {by_n[first][1]}")
            if rid in a.focus:
                for n in common[:12]:
                    print(f"     {rid} n={n} rel={rel(by_n[n][0], ref[n][0]):.3g} cand={by_n[n][1]}")
        print(f"   requests whose state left plain's: {len(bad)} {bad[:20]}")
        layer_report(layer_rows(plain_recs, names), layer_rows(recs, names), a.focus, a.tol)
        plain_kv, cand_kv = kv_contents(plain_recs, names), kv_contents(recs, names)
        for rid in a.focus:
            ref, got = plain_kv.get(rid, {}), cand_kv.get(rid, {})
            diffs = [(p, max(abs(x - y) / max(abs(y), 1e-3) for x, y in zip(got[p], ref[p], strict=True)))
                     for p in sorted(set(ref) & set(got))[:16]]
            print(f"   {rid}: committed K/V sums against plain's, by position: "
                  + " ".join(f"{p}:{d:.2g}" for p, d in diffs))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Compare the DDTree proof run's variants (run_device.sh) and summarise them.

Usage: python compare_ddtree.py OUT_DIR   → prints a report, writes OUT_DIR/summary.json and summary.md
Checks: every DFLASH / DDTree variant is token-identical to plain decoding of the same model set
(single request, batch of 3, text prompt); shadow-linear's accept lengths and verify counts equal
DFLASH's; full mode on the hybrid targets was refused by the DDTree worker's guard (its message in
the server log) while shadow-linear on a hybrid serves.
With a TP2=1 run (tensor parallelism 2, issue 6): every `*_tp2` variant is token-identical to the
one-GPU plain decoding of its model set (and, reported apart, to `p_plain_tp2` for the p set), `p_shadow_tp2`'s
accept lengths equal `p_dflash_tp2`'s, and tp_tree_check.py's JSON verdict (tp_tree_check.log) is ok;
accept lengths and per-step times are shown beside the one-GPU twins.
"""
import json
import os
import re
import sys

d = sys.argv[1]
REFUSAL = "DDTree full mode refused"


def load(tag):
    p = os.path.join(d, f"{tag}.json")
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)


def log(tag):
    p = os.path.join(d, f"server_{tag}.log")
    if not os.path.exists(p):
        return ""
    with open(p, errors="replace") as f:
        return f.read()


def seqs(j):
    if not j or "batch" not in j:
        return None
    reps = [x["output_ids"] for x in j.get("single_repeat", [])]
    return [j["single"]["output_ids"]] + [x["output_ids"] for x in j["batch"]] + [j["text"]["output_ids"]] + reps


def spec(j):
    if not j or "batch" not in j:
        return None
    metas = [j["single"]["meta_info"]] + [x["meta_info"] for x in j["batch"]]
    return [(m.get("spec_accept_length"), m.get("spec_verify_ct")) for m in metas]


def _best(j):
    runs = j.get("single_repeat") or [{"s": j["single_s"], "meta_info": j["single"]["meta_info"]}]
    return min(runs, key=lambda x: x["s"])


def step_ms(j):
    """Warm per-step time: the fastest repeat of the single request / its decode steps
    (verify passes for DFLASH / DDTree, tokens for plain decoding)."""
    if not j or "single" not in j:
        return None
    best = _best(j)
    m = best["meta_info"]
    steps = m.get("spec_verify_ct") or m.get("completion_tokens") or 64
    return 1e3 * best["s"] / max(1, steps)


def token_ms(j):
    if not j or "single" not in j:
        return None
    best = _best(j)
    return 1e3 * best["s"] / max(1, best["meta_info"].get("completion_tokens") or 64)


def ddtree_stats(tag):
    lines = re.findall(r"DDTree stats \([^)]*\): (\{.*\})", log(tag))
    return lines[-1] if lines else None


def _server_info_ddtree(j):
    st = (j or {}).get("server_info_internal_states")
    if isinstance(st, list) and st and isinstance(st[0], dict):
        return st[0].get("ddtree")
    return None


summary = {"sets": {}, "hybrid": {}, "ok": True}
rows = []
for s in ("p", "r"):
    plain = load(f"{s}_plain")
    P = seqs(plain)
    dfl = load(f"{s}_dflash")
    res = {}
    for v in ("plain", "dflash", "shadow", "full15", "full64", "full256"):
        tag = f"{s}_{v}"
        j = load(tag)
        X = seqs(j)
        ident = None if (P is None or X is None) else (X == P)
        sp = spec(j)
        r = {
            "served": X is not None,
            "identical_to_plain": ident,
            "single_accept_len": sp[0][0] if sp else None,
            "batch_accept_len": [a for a, _ in sp[1:]] if sp else None,
            "verify_ct": [c for _, c in sp] if sp else None,
            "single_s": j.get("single_s") if j else None,
            "step_ms": step_ms(j),
            "token_ms": token_ms(j),
            "ddtree_stats": ddtree_stats(tag),
            "server_info_ddtree": _server_info_ddtree(j),
            "error": (j or {}).get("error"),
        }
        if v != "plain" and ident is not True:
            summary["ok"] = False
        if v == "shadow":
            r["accept_equal_to_dflash"] = (sp is not None and sp == spec(dfl))
            if not r["accept_equal_to_dflash"]:
                summary["ok"] = False
        res[v] = r
        rows.append((tag, r))
    summary["sets"][s] = res
for tag in ("h_next_full", "h_marker_full", "h_marker_shadow"):
    text = log(tag)
    m = re.search(REFUSAL + r"[^\n]*", text)
    j = load(tag)
    summary["hybrid"][tag] = {
        "refused_by_ddtree_guard": bool(m),
        "message": m.group(0)[:400] if m else None,
        "served": seqs(j) is not None,
        "other_error": None if m else (re.findall(r"\n(\w+Error: [^\n]*)", text)[-1:] or [None])[0],
    }
    if tag.endswith("_full") and tag.startswith("h_marker") and not m:
        summary["ok"] = False

# Issue 25: upstream DFLASH on the real hybrid targets (GDN + attention), reported when they were served.
for h in ("h_next",):
    if not any(os.path.exists(os.path.join(d, f"server_{h}_{v}.log")) for v in ("plain", "dflash")):
        continue
    P, j = seqs(load(f"{h}_plain")), load(f"{h}_dflash")
    X, sp = seqs(j), spec(j)
    text = log(f"{h}_dflash") + log(f"{h}_plain")
    summary["hybrid"][f"{h}_dflash"] = {
        "plain_served": P is not None, "dflash_served": X is not None,
        "identical_to_plain": None if (P is None or X is None) else X == P,
        "single_accept_len": sp[0][0] if sp else None,
        "other_error": (re.findall(r"\n(\w+Error: [^\n]*)", text)[-1:] or [None])[0],
    }
    print(f"{h}_dflash: {json.dumps(summary['hybrid'][f'{h}_dflash'])[:400]}")


TP2 = [("p_plain_tp2", "p_plain"), ("p_dflash_tp2", "p_dflash"), ("p_full64_tp2", "p_full64"),
       ("p_shadow_tp2", "p_shadow"), ("r_plain_tp2", "r_plain"), ("r_dflash_tp2", "r_dflash"),
       ("r_full64_tp2", "r_full64")]


def tp_check_verdict():
    p = os.path.join(d, "tp_tree_check.log")
    if not os.path.exists(p):
        return None
    with open(p, errors="replace") as f:
        lines = [ln for ln in f.read().splitlines() if ln.startswith("{")]
    try:
        return json.loads(lines[-1]) if lines else {"ok": False, "error": "no JSON line in tp_tree_check.log"}
    except json.JSONDecodeError as e:
        return {"ok": False, "error": f"bad JSON line: {e}"}


tp_check = tp_check_verdict()
tp_run = tp_check is not None or any(
    os.path.exists(os.path.join(d, name)) for t, _ in TP2 for name in (f"server_{t}.log", f"{t}.json")
)
tp_rows = []
if tp_run:
    summary["tp2"] = {"tp_tree_check": tp_check, "variants": {}}
    if not (tp_check or {}).get("ok"):
        summary["ok"] = False
    for tag, twin in TP2:
        plain_tp2 = seqs(load(f"{tag[0]}_plain_tp2"))
        j, jt = load(tag), load(twin)
        X = seqs(j)
        plain_1gpu = seqs(load(f"{tag[0]}_plain"))
        sp, spt = spec(j), spec(jt)
        r = {
            "twin": twin,
            "served": X is not None,
            "identical_to_1gpu_plain": None if (plain_1gpu is None or X is None) else (plain_1gpu == X),
            "identical_to_tp2_plain": None if (plain_tp2 is None or X is None) else (plain_tp2 == X),
            "single_accept_len": sp[0][0] if sp else None,
            "twin_single_accept_len": spt[0][0] if spt else None,
            "batch_accept_len": [a for a, _ in sp[1:]] if sp else None,
            "twin_batch_accept_len": [a for a, _ in spt[1:]] if spt else None,
            "accept_equal_to_twin": None if (sp is None or spt is None) else (sp == spt),
            "step_ms": step_ms(j),
            "twin_step_ms": step_ms(jt),
            "token_ms": token_ms(j),
            "twin_token_ms": token_ms(jt),
            "ddtree_stats": ddtree_stats(tag),
            "server_info_ddtree": _server_info_ddtree(j),
            "error": (j or {}).get("error"),
        }
        # Required: token identity with plain decoding at the same TP size. Identity with one-GPU
        # plain is reported too, but a bf16 near-tie can flip an argmax between TP sizes by
        # reduction order alone (the random model has such ties), so it is not the criterion.
        if r["identical_to_tp2_plain"] is not True:
            summary["ok"] = False
        if tag == "p_shadow_tp2":
            r["accept_equal_to_dflash_tp2"] = sp is not None and sp == spec(load("p_dflash_tp2"))
            if not r["accept_equal_to_dflash_tp2"]:
                summary["ok"] = False
        summary["tp2"]["variants"][tag] = r
        tp_rows.append((tag, r))

print(f"{'variant':<12} {'served':>6} {'same':>5} {'acc(single)':>11} {'acc(batch)':>22} {'verify_ct':>18} {'ms/step':>8} {'ms/tok':>7}")
for tag, r in rows:
    bal = ",".join(f"{a:.2f}" for a in r["batch_accept_len"]) if r["batch_accept_len"] and None not in r["batch_accept_len"] else "-"
    sal = f"{r['single_accept_len']:.2f}" if r["single_accept_len"] is not None else "-"
    ms = f"{r['step_ms']:.2f}" if r["step_ms"] is not None else "-"
    mt = f"{r['token_ms']:.3f}" if r["token_ms"] is not None else "-"
    print(f"{tag:<12} {str(r['served']):>6} {str(r['identical_to_plain']):>5} {sal:>11} {bal:>22} {str(r['verify_ct']):>18} {ms:>8} {mt:>7}")
    if r.get("accept_equal_to_dflash") is not None:
        print(f"{'':<12} shadow accept lengths == dflash: {r['accept_equal_to_dflash']}")
    if r["server_info_ddtree"]:
        print(f"{'':<12} /server_info ddtree: {json.dumps(r['server_info_ddtree'])[:400]}")
    elif r["ddtree_stats"]:
        print(f"{'':<12} log: {r['ddtree_stats'][:300]}")
    if r["error"]:
        print(f"{'':<12} error: {r['error'][:300]}")
for tag, h in summary["hybrid"].items():
    print(f"{tag:<16} refused_by_guard={h['refused_by_ddtree_guard']} served={h['served']} "
          f"{h['message'] or h['other_error'] or ''}")
if tp_run:
    def _f(x, fmt):
        return format(x, fmt) if x is not None else "-"

    def _bl(xs):
        return ",".join(f"{a:.2f}" for a in xs) if xs and None not in xs else "-"

    tc = tp_check or {}
    print(f"tensor parallel 2: tp_tree_check ok={tc.get('ok')} cases={tc.get('cases')} "
          f"trees/rank={tc.get('trees_per_rank')} backend={tc.get('backend')} "
          f"failures={tc.get('failures') or tc.get('error') or []}"[:600])
    print(f"{'variant':<13} {'twin':<9} {'=plain1':>7} {'=plainTP2':>9} {'acc1 tp2|1gpu':>14} "
          f"{'acc(batch) tp2 | 1gpu':>36} {'ms/step tp2|1gpu':>17} {'ms/tok tp2|1gpu':>16}")
    for tag, r in tp_rows:
        acc = f"{_f(r['single_accept_len'], '.2f')}|{_f(r['twin_single_accept_len'], '.2f')}"
        bacc = f"{_bl(r['batch_accept_len'])} | {_bl(r['twin_batch_accept_len'])}"
        ms = f"{_f(r['step_ms'], '.2f')}|{_f(r['twin_step_ms'], '.2f')}"
        mt = f"{_f(r['token_ms'], '.3f')}|{_f(r['twin_token_ms'], '.3f')}"
        print(f"{tag:<13} {r['twin']:<9} {str(r['identical_to_1gpu_plain']):>7} "
              f"{str(r['identical_to_tp2_plain']):>9} {acc:>14} {bacc:>36} {ms:>17} {mt:>16}")
        if r.get("accept_equal_to_dflash_tp2") is not None:
            print(f"{'':<13} shadow tp2 accept lengths == dflash tp2: {r['accept_equal_to_dflash_tp2']}")
        if r["server_info_ddtree"]:
            print(f"{'':<13} /server_info ddtree: {json.dumps(r['server_info_ddtree'])[:300]}")
        elif r["ddtree_stats"]:
            print(f"{'':<13} log: {r['ddtree_stats'][:300]}")
        if r["error"]:
            print(f"{'':<13} error: {r['error'][:300]}")
print("ALL CHECKS OK" if summary["ok"] else "SOME CHECKS FAILED")
with open(os.path.join(d, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)

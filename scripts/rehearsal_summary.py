"""Summarise a rehearsal directory (scripts/rehearse.sh): steps.tsv plus each step's --json document.

    python3 scripts/rehearsal_summary.py DIR            the whole summary
    python3 scripts/rehearsal_summary.py --step DIR N   one line (or a few) for step N, as it ends

Stdlib only (it runs before and after the venv exists). Waiting for services = the time promote
spent waiting on the serving unit (ready waits and HTTP to the server); per batch the slowest host
counts, since a batch's hosts run at once. Tool time = the rest of the step's wall time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GATES = ("ready", "settings", "canary", "liveness", "acceptance")


def load(out: Path, name: str) -> dict | list | None:
    try:
        return json.loads((out / f"{name}.json").read_text() or "null")
    except (OSError, ValueError):
        return None


def steps(out: Path) -> list[tuple[str, int, float]]:
    rows = []
    for line in (out / "steps.tsv").read_text().splitlines():
        name, rc, wall = line.split("\t")
        rows.append((name, int(rc), float(wall)))
    return rows


def promote_wait(doc: dict) -> float:
    """Per batch, the slowest host's waiting time; summed over batches."""
    by_host = {r["host"]: r for r in doc.get("results", [])}
    total = 0.0
    for batch in doc.get("batches", []):
        waits = [((by_host.get(h) or {}).get("data") or {}).get("timing", {}).get("waiting_for_service_s", 0.0)
                 for h in batch if h in by_host]
        total += max(waits, default=0.0)
    return total


def describe(name: str, doc: object, wall: float) -> list[str]:
    if isinstance(doc, dict) and "summary" in doc:
        s = doc["summary"]
        line = f"{s['ok']}/{s['hosts']} hosts ok"
        if s.get("failed"):
            line += f", failed: {', '.join(s['failed'])}"
        out = [line]
        if name.startswith("promote"):
            wait = promote_wait(doc)
            out[0] += f"; tool {wall - wait:.1f}s, waiting for services {wait:.1f}s"
            for r in doc["results"]:
                d = r.get("data") or {}
                gates = {g["gate"]: g for g in d.get("gates") or ((r.get("error") or {}).get("detail") or {}).get("gates", [])}
                cells = "  ".join(f"{g} {gates[g]['verdict']} {gates[g]['seconds']:.1f}s" for g in GATES if g in gates)
                accept = d.get("accept_length")
                out.append(f"    {r['host']:<8} {d.get('mode', r['status']):<14} {cells}"
                           + (f"  accept {accept:.2f}" if accept is not None else "")
                           + (f"  exposure {d['exposure']}" if d.get("exposure") is not None else ""))
        if name.startswith("rollback"):
            for r in doc["results"]:
                d = r.get("data") or {}
                out.append(f"    {r['host']:<8} {d.get('message') or r['status']}")
        if name.startswith("status"):
            out += status_lines(doc["results"])
        if name == "push":
            out += bundle_lines(doc)
        return out
    return ["ok"]


def bundle_lines(doc: dict) -> list[str]:
    """Who signed the pushed bundles: `bundles` (one per SGLang base) when push had several, else `bundle`."""
    bundles = doc.get("bundles") or ([doc["bundle"]] if isinstance(doc.get("bundle"), dict) else [])
    out = []
    for b in bundles:
        sig = b.get("signature")
        if not sig:
            continue
        base = f" for SGLang {b['base_version']}" if len(bundles) > 1 and b.get("base_version") else ""
        out.append(f"    bundle{base} signed by {sig.get('signer') or 'an untrusted key'} ({sig.get('key')})"
                   if sig.get("signed") else f"    bundle{base} UNSIGNED (--allow-unsigned)")
    return out


def status_lines(results: list[dict]) -> list[str]:
    out = []
    for r in results:
        rel = (r.get("data") or {}).get("release") or {}
        promo = rel.get("promotion") or {}
        svc = (r.get("data") or {}).get("service") or {}
        out.append(f"    {r['host']:<8} service {svc.get('active_state')}/{svc.get('sub_state')}, release "
                   f"{rel.get('current') or 'pristine'}, mode {rel.get('mode') or '-'}, last promote "
                   f"{promo.get('last_mode') or '-'} {promo.get('last_result') or ''}")
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--step"]:
        out, name = Path(argv[1]), argv[2]
        row = next((r for r in reversed(steps(out)) if r[0] == name), None)
        if row:
            lines = describe(name, load(out, name), row[2]) if row[1] == 0 else [f"exit {row[1]}"]
            print(f"[{name}: {row[2]:.1f}s] " + "\n".join(lines))
        return 0
    out = Path(argv[0])
    rows = steps(out)
    total = sum(w for _, _, w in rows)
    wait = sum(promote_wait(doc) for n, _, _ in rows if n.startswith("promote") and isinstance(doc := load(out, n), dict))
    print(f"\nRehearsal summary ({out})")
    print(f"{'step':<24} {'result':<8} {'wall':>8}")
    for name, rc, wall in rows:
        print(f"{name:<24} {'ok' if rc == 0 else f'exit {rc}':<8} {wall:>7.1f}s")
        if rc == 0 and (name.startswith(("promote", "rollback", "status-after")) or name == "push"):
            for line in describe(name, load(out, name), wall):
                print("  " + line)
    print(f"{'total':<24} {'':<8} {total:>7.1f}s  (tool {total - wait:.1f}s, waiting for services {wait:.1f}s)")
    return 0 if all(rc == 0 for _, rc, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

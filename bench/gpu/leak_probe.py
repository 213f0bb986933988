"""Which request leaks KV slots on a server (issue 26: every 0.5.17 speculative server, upstream DFLASH included,
died of the idle pool check `pool memory leak detected!` after the production mix; plain did not).

  leak_probe.py --port P --tag T --out F.json [--context-length N] [--pid PID]

Sends one kind of request at a time, waits for the server to go idle (SGLang runs its pool check there; with
`SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE` on, the default, a leak kills the scheduler), then asks /health.
The first probe after which the server is gone names the kind that leaks; with the check off, the server log's
warning lines tell the same. Each probe is sent twice: a leak that needs the radix cache to hold the prefix shows
on the second.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import requests
from production_mix import _write, stream_and_abort, wait_healthy


def probes(ctx: int, rng: random.Random) -> list[dict]:
    def tok(n: int) -> list[int]:
        return [rng.randrange(10, 4000) for _ in range(n)]

    return [
        {"id": "short", "prompt": tok(20), "max_new": 32},
        {"id": "len1", "prompt": tok(20), "max_new": 1},
        {"id": "stream_done", "prompt": tok(40), "max_new": 48, "stream": True},
        {"id": "stop_str", "prompt": tok(30), "max_new": 200, "stop": ["a", "e", " "]},
        {"id": "sampled", "prompt": tok(30), "max_new": 64, "temperature": 0.8},
        {"id": "near_limit", "prompt": tok(ctx - 40), "max_new": 32},
        {"id": "to_limit", "prompt": tok(ctx - 20), "max_new": 64},  # the server clips at the context length
        {"id": "abort_early", "prompt": tok(40), "max_new": 500, "abort_after": 2},
        {"id": "abort_late", "prompt": tok(40), "max_new": 500, "abort_after": 30},
    ]


def dead(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
        return False
    except OSError:
        return True


def alive(base: str, pid: int | None) -> bool:
    if dead(pid):
        return False
    try:
        return requests.get(base + "/health", timeout=10).status_code == 200
    except requests.RequestException:
        return False


def send(base: str, req: dict) -> dict:
    if req.get("abort_after"):
        return stream_and_abort(base, req)
    sp = {"max_new_tokens": req["max_new"], "temperature": req.get("temperature", 0.0)}
    if req.get("stop"):
        sp["stop"] = req["stop"]
    body = {"input_ids": req["prompt"], "sampling_params": sp}
    if req.get("stream"):
        with requests.post(base + "/generate", json={**body, "stream": True}, stream=True, timeout=300) as r:
            chunks = sum(1 for line in r.iter_lines() if line)
        return {"stream_chunks": chunks}
    r = requests.post(base + "/generate", json=body, timeout=300)
    out = r.json() if r.ok else {"status": r.status_code}
    return {"tokens": len(out.get("output_ids", []) or []), "finish": (out.get("meta_info") or {}).get("finish_reason")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--context-length", type=int, default=1024)
    ap.add_argument("--pid", type=int)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--wait", type=float, default=120.0)
    a = ap.parse_args()
    base = f"http://127.0.0.1:{a.port}"
    if wait_healthy(base, a.wait, a.pid) is None:
        _write(a.out, {"tag": a.tag, "ready": False})
        print(f"[leak] {a.tag}: never healthy")
        return 2
    steps, culprit = [], None
    for req in probes(a.context_length, random.Random(7)):
        for attempt in (1, 2):
            try:
                res = send(base, req)
            except requests.RequestException as e:
                res = {"error": repr(e)[:200]}
            time.sleep(a.idle_s)  # idle: the scheduler's pool check runs
            ok = alive(base, a.pid)
            steps.append({"probe": req["id"], "attempt": attempt, "result": res, "alive": ok})
            if not ok:
                culprit = f"{req['id']}#{attempt}"
                break
        if culprit:
            break
    _write(a.out, {"tag": a.tag, "ready": True, "culprit": culprit, "steps": steps})
    print(f"[leak] {a.tag}: {'died after ' + culprit if culprit else 'alive after every probe'} ({len(steps)} probes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

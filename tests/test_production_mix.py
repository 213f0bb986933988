"""bench/gpu/production_mix.py without a GPU: the `limits` and `penalties` workloads (issue 23) run end to
end against a local stand-in of SGLang's HTTP API, then `compare` judges them: a server that answers like
plain passes, one that changes a token where plain's margin is wide fails, sampled and aborted requests
are left out, a server the workload killed is what `--expect-dead` wants, and one that survived it fails
that verdict.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from http_stand_in import JSONHandler, serve

GPU = Path(__file__).resolve().parents[1] / "bench" / "gpu"


def _model(prompt: list[int], n: int) -> list[int]:
    """The stand-in's greedy 'model': deterministic in the prompt."""
    out, h = [], sum(prompt) % 997
    for i in range(n):
        h = (h * 31 + i + 7) % 4000
        out.append(h)
    return out


def _stand_in(fault: str | None):
    """fault: None (plain), 'token' (one token changed where plain's margin is 2.0), 'refuse_logprob'
    (DFLASH's per-request refusal), 'dead' (the first request kills it: every request fails, and
    /health too from then on)."""
    crashed = []

    class Handler(JSONHandler):
        def do_GET(self):
            if crashed:
                self.send_error(503)
                return
            if self.path == "/v1/loads":
                self.send_json({"loads": [{"num_used_tokens": 0}]})
            else:
                self.send_json({"internal_states": [{}]})

        def do_POST(self):
            body = self.read_json()
            if fault == "dead":
                crashed.append(True)
                self.send_error(500)
                return
            if body.get("return_logprob") and fault == "refuse_logprob":
                self.send_error(400, "DFLASH speculative decoding does not support return_logprob yet.")
                return
            sp = body["sampling_params"]
            ids = _model(body["input_ids"], sp["max_new_tokens"])
            if fault == "token" and len(ids) > 3 and sp.get("temperature", 0) == 0:
                ids[3] = (ids[3] + 1) % 4000
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for t in ids:
                        self.wfile.write(f"data: {json.dumps({'output_ids': [t]})}\n\n".encode())
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                return
            meta = {"finish_reason": {"type": "length"}}
            if body.get("return_logprob"):
                # plain's top-5: its own token first, 2.0 above the next
                meta["output_top_logprobs"] = [[[-0.1, t, None], [-2.1, (t + 1) % 4000, None]] for t in ids]
                meta["output_token_logprobs"] = [[-0.1, t, None] for t in ids]
            self.send_json({"output_ids": ids, "meta_info": meta})

    return serve(Handler)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GPU / "production_mix.py"), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("kind", ["limits", "penalties"])
def test_workloads_run_and_compare_judges_them(tmp_path: Path, kind: str) -> None:
    pytest.importorskip("requests")
    servers = {tag: _stand_in(fault) for tag, fault in
               (("plain", None), ("same", "refuse_logprob"), ("wrong", "token"), ("dead", "dead"), ("alive", None))}
    wl = tmp_path / "workload.json"
    try:
        for tag in servers:  # plain first: it makes the workload
            extra = ["--make"] if tag == "plain" else []
            proc = _run(["run", "--port", str(servers[tag].server_address[1]), "--tag", tag, "--out",
                         str(tmp_path / f"{tag}_{kind}.json"), "--workload", str(wl), "--kind", kind,
                         "--context-length", "1024", "--graph-bs", "8", "--wait", "5", *extra])
            assert proc.returncode == 0, proc.stderr[-2000:]
    finally:
        for srv in servers.values():
            srv.shutdown()
    workload = json.loads(wl.read_text())
    if kind == "limits":
        assert len(workload["round1"]) == len(workload["round2"]) == 8
        assert all(len(r["prompt"]) + r["max_new"] == 1024 - 8 for r in workload["round1"])
        assert sum(bool(r.get("sampled")) for r in workload["round1"]) == 2
        assert sum("abort_after" in r for r in workload["round1"]) == 1  # lim5 (lim17 needs 18 requests)
    else:
        assert {r["params"].get("min_new_tokens") for r in workload["round1"] if r["id"].startswith("min_new")} == {
            20, 29, 38}
    proc = _run(["compare", str(tmp_path), "plain", "--suffix", f"_{kind}", "--expect-dead", "dead", "alive", "--",
                 "same", "wrong", "dead", "alive"])
    out = proc.stdout
    assert proc.returncode == 1, out  # 'wrong' faults and 'alive' survived what it was expected not to
    lines = {ln.strip().split(":")[0]: ln for ln in out.splitlines()
             if ln.strip().split(":")[0] in ("same", "wrong", "dead", "alive")}
    assert "pass" in lines["same"] and "fault=0" in lines["same"]
    assert "FAIL" in lines["wrong"] and "fault=0" not in lines["wrong"]
    assert "crashed (expected: upstream)" in lines["dead"]
    assert "SURVIVED" in lines["alive"]
    summary = json.loads(next(tmp_path.glob(f"mix_summary_{kind}_plain_*.json")).read_text())
    same = summary["variants"]["same"]
    compared = same["same"] + same["tie"] + same["fault"]
    sampled = sum(bool(r.get("sampled")) for r in workload["round1"])
    aborted = sum("abort_after" in r for r in workload["round1"])
    assert compared == len(workload["round1"]) + len(workload["round2"]) - sampled - aborted
    if kind == "penalties":
        assert summary["variants"]["same"]["logprob_probe"]["status"] == 400
        plain = json.loads((tmp_path / "plain_penalties.json").read_text())
        assert plain["logprob_probe"]["status"] == 200 and plain["logprob_probe"]["output_token_logprobs"]

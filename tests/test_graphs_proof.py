"""bench/gpu/graphs_proof.py (issue 13's client), without a GPU: `perf` against a local HTTP stand-in of
SGLang's /generate and /server_info (medians over rounds, accept length from the server's verify
counts), and `compare`'s verdicts on recorded samples (a matching server passes, a shifted one is
rejected, a server that recorded nothing fails instead of being skipped).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from http_stand_in import JSONHandler, serve

GPU = Path(__file__).resolve().parents[1] / "bench" / "gpu"


def _stand_in(accept: int):
    """/generate: `max_new_tokens` tokens in ceil(n / accept) verify steps; /server_info: DDTree step
    counters that grow with the verify steps served."""
    state = {"steps": 0}
    lock = threading.Lock()

    class Handler(JSONHandler):
        def do_GET(self):
            with lock:
                ddtree = {"steps": state["steps"], "tree_steps": state["steps"], "profile": None}
            self.send_json({} if self.path == "/health" else {"internal_states": [{"ddtree": ddtree}]})

        def do_POST(self):
            n = self.read_json()["sampling_params"]["max_new_tokens"]
            verify = -(-n // accept)
            with lock:
                state["steps"] += verify
            self.send_json({"output_ids": list(range(n)), "meta_info": {"completion_tokens": n, "spec_verify_ct": verify}})

    return serve(Handler), state


def _load_proof():
    pytest.importorskip("requests")
    sys.path.insert(0, str(GPU))
    try:
        import graphs_proof
    finally:
        sys.path.remove(str(GPU))
    return graphs_proof


def test_perf_reports_medians_over_rounds_and_the_servers_accept_length() -> None:
    gp = _load_proof()
    srv, state = _stand_in(accept=5)
    try:
        out = gp.perf(f"http://127.0.0.1:{srv.server_address[1]}", rounds={1: 3, 8: 2})
    finally:
        srv.shutdown()
    assert set(out) == {"1", "8"}
    one, eight = out["1"], out["8"]
    assert len(one["rounds"]) == 3 and len(eight["rounds"]) == 2
    # 128 tokens at 5 per verify step: 26 steps per request, accept 128 / 26
    assert one["steps"] == 26 and one["accept_len"] == round(128 / 26, 3)
    assert eight["rounds"][0]["tokens"] == 8 * 128 and eight["rounds"][0]["verify_ct"] == 8 * 26
    for r in out.values():
        per_round = sorted(x["ms_per_step"] for x in r["rounds"])
        assert r["ms_per_step_range"] == [per_round[0], per_round[-1]]
        assert per_round[0] <= r["ms_per_step"] <= per_round[-1]
    # the step delta counts the measured rounds only, not the warm-up round before them
    assert one["ddtree_delta"]["steps"] == 3 * 26 and eight["ddtree_delta"]["steps"] == 2 * 8 * 26
    assert state["steps"] == (4 * 26) + (3 * 8 * 26)


def _samples(rng: random.Random, n: int, shift: float) -> dict:
    """3-token samples per prompt from a fixed law; `shift` moves mass towards token 0."""
    weights = [4, 3, 2, 1]
    weights[0] += shift
    return {str(p): [[rng.choices(range(4), weights)[0] + 10 * p for _ in range(3)] for _ in range(n)]
            for p in range(3)}


def _compare(out_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GPU / "graphs_proof.py"), "compare", str(out_dir), *args],
                          capture_output=True, text=True, timeout=300)


def test_compare_passes_a_matching_server_rejects_a_biased_one_and_fails_on_missing_data(tmp_path: Path) -> None:
    pytest.importorskip("requests")
    rng = random.Random(3)
    write = lambda tag, body: (tmp_path / f"{tag}_proof.json").write_text(json.dumps({"tag": tag, **body}))  # noqa: E731
    write("plain", {"samples": _samples(rng, 1000, 0)})
    write("full", {"samples": _samples(rng, 1000, 0), "liveness": {"rounds": [{"s": 0.4}], "ok": True, "max_s": 0.4,
                                                                    "bound_s": 15.0}})
    write("bias", {"samples": _samples(rng, 1000, 3)})
    write("dead", {"ready_s": None})  # a server that never became healthy records no samples

    good = _compare(tmp_path, "--plain", "plain", "--cand", "full", "--biased", "bias", "--liveness", "full")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "samples full vs plain: pass" in good.stdout
    assert "samples bias vs plain: rejected (power shown)" in good.stdout

    # the shifted law as a candidate fails; a matching law as "biased" shows no power and fails too
    assert _compare(tmp_path, "--plain", "plain", "--cand", "bias").returncode == 1
    no_power = _compare(tmp_path, "--plain", "plain", "--cand", "full", "--biased", "full")
    assert no_power.returncode == 1 and "NOT rejected" in no_power.stdout

    missing = _compare(tmp_path, "--plain", "plain", "--cand", "full", "dead")
    assert missing.returncode == 1 and "dead: no samples" in missing.stdout
    assert _compare(tmp_path, "--plain", "plain", "--cand", "full", "absent").returncode == 1
    no_live = _compare(tmp_path, "--plain", "plain", "--cand", "full", "--liveness", "bias")
    assert no_live.returncode == 1 and "liveness bias: no results" in no_live.stdout


def _pass(ms: dict[str, float]) -> dict:
    return {bs: {"wall_s": m / 100, "steps": 13, "ms_per_step": m, "ms_per_step_range": [m, m], "accept_len": 9.0,
                 "tok_per_s": 1000.0, "ddtree_delta": {}} for bs, m in ms.items()}


def test_perf_runs_on_one_file_add_passes_and_their_median(tmp_path: Path) -> None:
    _load_proof()
    srv, _ = _stand_in(accept=4)
    out = tmp_path / "x_proof.json"
    try:
        for _ in range(3):
            run = subprocess.run([sys.executable, str(GPU / "graphs_proof.py"), "run", "--port", str(srv.server_address[1]),
                                  "--tag", "x", "--out", str(out), "--perf", "--wait", "10"],
                                 capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stdout + run.stderr
    finally:
        srv.shutdown()
    assert "perf pass 3 ms/step bs1" in run.stdout
    data = json.loads(out.read_text())
    passes = data["perf_passes"]
    assert len(passes) == 3
    for bs in ("1", "8", "32"):
        per_pass = sorted(p[bs]["ms_per_step"] for p in passes)
        assert data["perf"][bs]["ms_per_step"] == per_pass[1] and data["perf"][bs]["passes"] == 3
        assert data["perf"][bs]["ms_per_step_range"] == [per_pass[0], per_pass[-1]]


def test_ratios_pair_each_pass_with_the_references_pass(tmp_path: Path) -> None:
    gp = _load_proof()
    # The machine slows between passes (4 -> 8 ms): paired ratios stay 1.1; the candidate's extra pass
    # (no reference pass beside it) and a batch size the reference lacks are left out.
    ref = [_pass({"1": 4.0, "8": 5.0}), _pass({"1": 8.0, "8": 5.0})]
    cand = [_pass({"1": 4.4, "8": 4.5, "32": 7.0}), _pass({"1": 8.8, "8": 6.0, "32": 7.0}), _pass({"1": 1.0, "8": 1.0})]
    assert gp.paired_ratios(cand, ref) == {"1": {"median": 1.1, "ratios": [1.1, 1.1]},
                                           "8": {"median": 1.05, "ratios": [0.9, 1.2]}}
    assert gp.merge_passes(ref)["1"]["ms_per_step"] == 6.0 and gp.merge_passes(ref)["1"]["passes"] == 2
    for tag, passes in (("dflash", ref), ("shadow", cand)):
        (tmp_path / f"{tag}_proof.json").write_text(json.dumps({"perf": gp.merge_passes(passes), "perf_passes": passes}))
    res = _compare(tmp_path, "--plain", "plain", "--perf", "dflash", "shadow", "--ratio-to", "dflash")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "shadow | bs 1 | 1.1x | [1.1, 1.1]" in res.stdout
    summary = json.loads((tmp_path / "graphs_summary.json").read_text())
    assert set(summary["perf_ratios"]) == {"shadow"} and summary["perf_ratios"]["shadow"]["8"]["median"] == 1.05

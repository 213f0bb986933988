"""bench/gpu/pair_sweep.py (issue 14's sweep client), against a local HTTP stand-in of SGLang's
/generate: `run` measures what the server reports, `compare` classes a divergence from plain as a tie
only within plain's top-k margin and fails a real fault, and `merge` rates each config against its own
call's DFLASH. The GPU servers themselves run only on the H200 (bench/gpu/sweep_phases.sh).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from http_stand_in import JSONHandler, serve

GPU = Path(__file__).resolve().parents[1] / "bench" / "gpu"


def _server(flip_at: int | None, margin: float, verify_every: int | None):
    """A /generate that continues any prompt deterministically; `flip_at` changes that output position
    (+1) for prompts of even length; plain's top-2 logprobs there are `margin` apart."""

    class Handler(JSONHandler):
        def do_GET(self):
            self.send_json({} if self.path == "/health" else {"internal_states": [{"ddtree": {"steps": 0}}]})

        def do_POST(self):
            req = self.read_json()
            prompt, n = req["input_ids"], req["sampling_params"]["max_new_tokens"]
            out = [(sum(prompt) + 7 * i) % 97 + 10 for i in range(n)]
            if flip_at is not None and len(prompt) % 2 == 0:
                out[flip_at] += 1
            meta = {"completion_tokens": n, "spec_verify_ct": -(-n // verify_every) if verify_every else None}
            if req.get("return_logprob"):
                meta["output_top_logprobs"] = [[[-0.5, t, None], [-0.5 - margin, t + 1, None]] for t in out]
            self.send_json({"output_ids": out, "meta_info": meta})

    return serve(Handler)


def _sweep(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("requests")
    return subprocess.run([sys.executable, str(GPU / "pair_sweep.py"), *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "heldout_prompts.json"
    p.write_text(json.dumps({"prompts": [{"input_ids": list(range(5, 5 + 60 + i))} for i in range(40)]}))
    return p


def _run(out_dir: Path, prompts: Path, tag: str, srv, *extra: str) -> dict:
    r = _sweep("run", "--port", str(srv.server_address[1]), "--tag", tag, "--out", str(out_dir / f"{tag}.json"),
               "--prompts", str(prompts), "--wait", "10", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out_dir / f"{tag}.json").read_text())


@pytest.mark.parametrize(("margin", "want_ok"), [(0.0625, True), (2.0, False)])
def test_compare_classes_divergences_by_plain_margin(tmp_path, prompts, margin, want_ok):
    servers = {"plain": _server(None, margin, None), "dflash": _server(None, margin, 2),
               "full_b64_cap4_kc": _server(3, margin, 4)}
    try:
        got = {t: _run(tmp_path, prompts, t, s, *(["--reference"] if t == "plain" else []))
               for t, s in servers.items()}
    finally:
        for s in servers.values():
            s.shutdown()
    g = got["full_b64_cap4_kc"]["results"]["greedy"]
    assert g["bs1"]["accept"] == 4.0 and g["bs32"]["accept"] == 4.0  # tokens / verify steps
    assert got["plain"]["results"]["greedy"]["bs1"]["accept"] == 1.0
    assert len(g["bs1"]["outputs"]) == 8 and len(g["bs32"]["outputs"]) == 32
    assert got["full_b64_cap4_kc"]["results"]["t0.8"]["bs1"]["outputs"] is None  # sampled: not compared
    r = _sweep("compare", str(tmp_path), "--plain", "plain", "--dflash", "dflash", "--tags", "full_b64_cap4_kc",
               "--json", str(tmp_path / "sweep.json"))
    assert (r.returncode == 0) is want_ok, r.stdout + r.stderr
    cfg = {c["name"]: c for c in json.loads((tmp_path / "sweep.json").read_text())["configs"]}
    ident = cfg["full_b64_cap4_kc"]["identity"]
    # even-length prompts: 4 of the 8 bs1 prompts, 16 of the 32 bs32 ones diverge at position 3
    assert ident["same"] == 20 and ident[("tie" if want_ok else "fault")] == 20, ident
    assert all(d["pos"] == 3 for d in ident["details"])
    assert cfg["full_b64_cap4_kc"] | {"results": None, "identity": None} == {
        "name": "full_b64_cap4_kc", "mode": "full", "budget": 64, "cap": 4, "keep_chain": True,
        "results": None, "identity": None}
    assert cfg["dflash"]["identity"]["same"] == 40
    goals = json.loads((tmp_path / "sweep.json").read_text())["goals"]
    # accept 4 vs DFLASH's 2 meets the accept goal; tok/s depends on this machine's HTTP timing
    assert goals["greedy/bs1"]["accept_x_dflash"] == 2.0 and goals["greedy/bs1"]["goals_met"]["accept"] is True
    assert "goals_met" not in goals["t0.8/bs1"]


def test_merge_rates_each_config_against_its_own_call(tmp_path):
    def call(df_tok_s: float, configs: dict[str, float]) -> dict:
        res = lambda t: {wl: {b: {"accept": 2.0, "ms_per_step": 1.0, "tok_s": t} for b in ("bs1", "bs32")}  # noqa: E731
                         for wl in ("greedy", "t0.8")}
        return {"configs": [{"name": "dflash", "results": res(df_tok_s)}]
                + [{"name": n, "results": res(t)} for n, t in configs.items()] + [{"name": "full_b15", "results": None}]}

    (tmp_path / "a.json").write_text(json.dumps(call(100.0, {"full_b64": 150.0})))
    (tmp_path / "b.json").write_text(json.dumps(call(50.0, {"full_b64": 10.0, "full_b15": 60.0})))
    r = _sweep("merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    m = {c["name"]: c for c in json.loads((tmp_path / "m.json").read_text())["configs"]}
    assert set(m) == {"dflash", "full_b64", "full_b15"}
    assert m["full_b64"]["run"] == 0 and m["full_b64"]["results"]["greedy"]["bs1"]["tok_s_x_dflash"] == 1.5
    assert m["full_b15"]["run"] == 1 and m["full_b15"]["results"]["t0.8"]["bs32"]["tok_s_x_dflash"] == 1.2


# --- bench/gpu/auto_bench.py (issue 24): the same stand-in, several servers in one paired run ---------------


def _auto_bench(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("requests")
    return subprocess.run([sys.executable, str(GPU / "auto_bench.py"), *args], capture_output=True, text=True,
                          timeout=300)


def test_auto_bench_runs_every_server_paired_and_classes_identity(tmp_path, prompts):
    servers = {"s_plain": _server(None, 0.0625, None), "s_dflash": _server(None, 0.0625, 2),
               "s_auto": _server(3, 0.0625, 4)}
    try:
        specs = [f"{t}={s.server_address[1]}" for t, s in servers.items()]
        r = _auto_bench("run", "--servers", *specs, "--reference", "s_plain", "--prompts", str(prompts), "--out",
                        str(tmp_path / "w1.json"), "--batches", "1,4", "--temps", "0,0.8", "--passes", "2",
                        "--max-new", "8", "--wait", "10")
    finally:
        for s in servers.values():
            s.shutdown()
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "w1.json").read_text())
    runs = res["servers"]["s_auto"]["results"]["t0"]["4"]
    assert len(runs) == 2 and runs[0]["accept"] == 4.0 and runs[0]["outputs"] and runs[1]["outputs"] is None
    assert len(res["reference"]) == 4 and res["servers"]["s_auto"]["results"]["t0.8"]["1"][0]["outputs"] is None
    c = _auto_bench("compare", str(tmp_path / "w1.json"), "--plain", "s_plain", "--dflash", "s_dflash",
                    "--auto", "s_auto")
    # prompts of even length diverge at position 3 within plain's one-bf16-step margin: ties, not faults
    assert "s_auto: same 2, tie 3, fault 0" in c.stdout, c.stdout  # bs 1: prompt 0; bs 4: prompts 0 and 2


def test_auto_bench_goals_pair_each_server_with_its_own_waves_dflash(tmp_path):
    def wave(servers: dict[str, list[float]]) -> dict:
        cell = lambda tok: [{"tok_s": t, "accept": 2.0, "ms_per_step": 1.0, "outputs": None} for t in tok]  # noqa: E731
        return {"batches": [1, 8], "temps": [0], "servers": {
            tag: {"results": {"t0": {"1": cell(tok), "8": cell([x * 2 for x in tok])}}} for tag, tok in servers.items()}}

    # wave 1: DFLASH 100, auto 140 (1.4x); wave 2 (other minutes, a slower machine): DFLASH 50, full 16 at 75 (1.5x)
    (tmp_path / "w1.json").write_text(json.dumps(wave({"s_dflash": [100, 100], "s_auto": [140, 140]})))
    (tmp_path / "w2.json").write_text(json.dumps(wave({"s_dflash": [50, 50], "s_full16": [75, 75]})))
    c = _auto_bench("compare", str(tmp_path / "w1.json"), str(tmp_path / "w2.json"), "--dflash", "s_dflash",
                    "--auto", "s_auto", "--fixed", "s_full16", "--cost-realistic")
    assert c.returncode == 1, c.stdout + c.stderr  # 1.4x < 1.5x - 5 %
    assert "t0 bs 1: auto >= DFLASH (within the passes' spread): 1.400x: met" in c.stdout
    assert ("t0 bs 1: auto >= best fixed - 5 % (closest: s_full16, auto at 0.93x of it, x s_dflash of each wave): "
            "1.400x: **missed**") in c.stdout
    assert "t0 bs 1: auto >= 1.3x DFLASH at batch 1: 1.400x: met" in c.stdout
    (tmp_path / "w2.json").write_text(json.dumps(wave({"s_dflash": [50, 50], "s_full16": [70, 70]})))
    ok = _auto_bench("compare", str(tmp_path / "w1.json"), str(tmp_path / "w2.json"), "--dflash", "s_dflash",
                     "--auto", "s_auto", "--fixed", "s_full16")
    assert ok.returncode == 0, ok.stdout


def test_auto_bench_judges_auto_against_a_fixed_budget_of_its_own_wave_directly(tmp_path):
    """DFLASH drifted between the H200's waves by more than the 5 % judged: where a wave served auto and a fixed
    budget together, their own paired ratio decides, not each one's ratio to a different DFLASH."""
    cell = lambda tok: [{"tok_s": t, "accept": 2.0, "ms_per_step": 1.0, "outputs": None} for t in tok]  # noqa: E731

    def wave(servers: dict[str, list[float]]) -> dict:
        return {"batches": [1], "temps": [0], "servers": {t: {"results": {"t0": {"1": cell(v)}}} for t, v in servers.items()}}

    # wave 2's DFLASH ran slow: through it full 32 looks 1.8x against auto's 1.4x; in its wave auto is at 0.97x
    (tmp_path / "w1.json").write_text(json.dumps(wave({"s_dflash": [100, 100], "s_auto": [140, 140]})))
    (tmp_path / "w2.json").write_text(json.dumps(wave({"s_dflash": [40, 40], "s_auto": [70, 70], "s_full32": [72, 72]})))
    args = ["--dflash", "s_dflash", "--auto", "s_auto", "--fixed", "s_full32"]
    c = _auto_bench("compare", str(tmp_path / "w1.json"), str(tmp_path / "w2.json"), *args)
    assert c.returncode == 0, c.stdout + c.stderr
    assert "(closest: s_full32, auto at 0.97x of it, same wave): 1.400x: met" in c.stdout, c.stdout
    (tmp_path / "w2.json").write_text(json.dumps(wave({"s_dflash": [40, 40], "s_full32": [72, 72]})))
    c = _auto_bench("compare", str(tmp_path / "w1.json"), str(tmp_path / "w2.json"), *args)
    assert c.returncode == 1 and "auto at 0.78x of it, x s_dflash of each wave): 1.400x: **missed**" in c.stdout


def test_auto_bench_judges_no_goal_without_dflash_and_pairs_auto_with_its_waves_fixed(tmp_path):
    """A diagnostic wave of auto and a fixed budget alone (the H100's card holds two shells) has no DFLASH to
    judge the goals by: it says so, and gives auto against the fixed budget of its wave, instead of "missed"."""
    cell = lambda tok: [{"tok_s": t, "accept": 2.0, "ms_per_step": 1.0, "outputs": None} for t in tok]  # noqa: E731
    wave = {"batches": [1], "temps": [0], "servers": {"s_auto": {"results": {"t0": {"1": cell([90, 110])}}},
                                                     "s_full16": {"results": {"t0": {"1": cell([100, 100])}}}}}
    (tmp_path / "w.json").write_text(json.dumps(wave))
    c = _auto_bench("compare", str(tmp_path / "w.json"), "--dflash", "s_dflash", "--auto", "s_auto",
                    "--fixed", "s_full16")
    assert c.returncode == 0, c.stdout + c.stderr
    assert "t0 bs 1: no s_dflash measured, goals not judged; auto x s_full16 1.00 [0.90, 1.10]" in c.stdout, c.stdout
    assert "missed" not in c.stdout


def test_auto_bench_repeats_small_batches_over_the_next_prompts_until_min_tokens(tmp_path, prompts):
    # batch 1 alone is one request: its accept length moves tokens/s by more than the 5 % the goals judge
    servers = {"s_plain": _server(None, 0.0625, None), "s_auto": _server(3, 0.0625, 4)}
    try:
        specs = [f"{t}={s.server_address[1]}" for t, s in servers.items()]
        r = _auto_bench("run", "--servers", *specs, "--reference", "s_plain", "--prompts", str(prompts), "--out",
                        str(tmp_path / "w.json"), "--batches", "1,4", "--temps", "0", "--passes", "1",
                        "--max-new", "8", "--min-tokens", "20", "--wait", "10")
    finally:
        for s in servers.values():
            s.shutdown()
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "w.json").read_text())
    one, four = (res["servers"]["s_auto"]["results"]["t0"][bs][0] for bs in ("1", "4"))
    assert (one["rounds"], one["tokens"], len(one["outputs"])) == (3, 24, 3)  # prompts 0, 1, 2
    assert (four["rounds"], four["tokens"]) == (1, 32)  # already past 20 tokens
    assert one["ms_per_step"] == pytest.approx(1e3 * one["wall_s"] / 6, rel=0.02)  # 2 verify steps a round, 3 rounds
    c = _auto_bench("compare", str(tmp_path / "w.json"), "--plain", "s_plain", "--dflash", "s_plain",
                    "--auto", "s_auto")
    # prompt i has length 60 + i: the even ones (0, 2 of batch 1's rounds; 0, 2 of batch 4) diverge as ties
    assert "s_auto: same 3, tie 4, fault 0" in c.stdout, c.stdout


def test_auto_bench_repeats_a_fast_batch_until_min_seconds(tmp_path, prompts):
    # a round of 16 on the launch-bound pair lasts 0.1 s, mostly prefill and HTTP: a measurement lasts at least this
    servers = {"s_auto": _server(None, 0.0625, 4)}
    try:
        specs = [f"{t}={s.server_address[1]}" for t, s in servers.items()]
        r = _auto_bench("run", "--servers", *specs, "--prompts", str(prompts), "--out", str(tmp_path / "w.json"),
                        "--batches", "4", "--temps", "0", "--passes", "1", "--max-new", "8", "--min-seconds", "0.25",
                        "--wait", "10")
    finally:
        for s in servers.values():
            s.shutdown()
    assert r.returncode == 0, r.stdout + r.stderr
    four = json.loads((tmp_path / "w.json").read_text())["servers"]["s_auto"]["results"]["t0"]["4"][0]
    assert four["wall_s"] >= 0.25  # one round of this stand-in alone takes milliseconds
    assert four["tokens"] == four["rounds"] * 4 * 8 and len(four["outputs"]) == four["rounds"] * 4


def test_auto_bench_interleaves_the_servers_rounds(tmp_path, prompts):
    """A host's speed drifts within seconds (an H100's steps moved +-30 % between passes): the servers of one
    measurement take their rounds in turn, so each server's figure spans the same seconds as its twins'."""
    arrivals: list[str] = []
    lock = threading.Lock()

    def logging_server(tag: str):
        class Handler(JSONHandler):
            def do_GET(self):
                self.send_json({} if self.path == "/health" else {"internal_states": [{"ddtree": {"steps": 0}}]})

            def do_POST(self):
                n = self.read_json()["sampling_params"]["max_new_tokens"]
                with lock:
                    arrivals.append(tag)
                self.send_json({"output_ids": [10] * n, "meta_info": {"completion_tokens": n, "spec_verify_ct": 2}})

        return serve(Handler)

    servers = {t: logging_server(t) for t in ("s_dflash", "s_full128", "s_auto")}
    try:
        specs = [f"{t}={s.server_address[1]}" for t, s in servers.items()]
        r = _auto_bench("run", "--servers", *specs, "--prompts", str(prompts), "--out", str(tmp_path / "w.json"),
                        "--batches", "1", "--temps", "0", "--passes", "2", "--max-new", "8", "--min-tokens", "24",
                        "--warmup", "0", "--wait", "10")
    finally:
        for s in servers.values():
            s.shutdown()
    assert r.returncode == 0, r.stdout + r.stderr
    # three rounds of one 8-token request each; pass 1 rotates the order by one server
    assert arrivals == ["s_dflash", "s_full128", "s_auto"] * 3 + ["s_full128", "s_auto", "s_dflash"] * 3, arrivals
    res = json.loads((tmp_path / "w.json").read_text())["servers"]
    for tag in servers:
        for m in res[tag]["results"]["t0"]["1"]:
            assert m["rounds"] == 3 and m["tokens"] == 24 and m["accept"] == 4.0  # 8 tokens in 2 verify steps


def test_auto_bench_records_which_candidates_auto_took_in_each_measurement(tmp_path, prompts):
    """Auto's /server_info counts its steps by candidate: each measurement keeps the difference, so a figure says
    which budgets made it (the H200's batch-1 losses could not be read without them)."""
    taken: dict[str, int] = {}
    lock = threading.Lock()

    class AutoHandler(JSONHandler):
        def do_GET(self):
            with lock:
                state = {"steps": 0, "auto": {"chosen": dict(taken)}}
            self.send_json({} if self.path == "/health" else {"internal_states": [{"ddtree": state}]})

        def do_POST(self):
            req = self.read_json()
            n = req["sampling_params"]["max_new_tokens"]
            with lock:  # greedy requests take budget 63 twice a request, sampled ones 127 once and the chain once
                for name in (("63", "63") if req["sampling_params"]["temperature"] == 0 else ("127", "chain")):
                    taken[name] = taken.get(name, 0) + 1
            self.send_json({"output_ids": [10] * n, "meta_info": {"completion_tokens": n, "spec_verify_ct": 2}})

    servers = {"s_dflash": _server(None, 0.0625, 2), "s_auto": serve(AutoHandler)}
    try:
        specs = [f"{t}={s.server_address[1]}" for t, s in servers.items()]
        r = _auto_bench("run", "--servers", *specs, "--prompts", str(prompts), "--out", str(tmp_path / "w.json"),
                        "--batches", "1,4", "--temps", "0,0.8", "--passes", "2", "--max-new", "8", "--wait", "10")
    finally:
        for s in servers.values():
            s.shutdown()
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "w.json").read_text())["servers"]
    assert res["s_auto"]["results"]["t0"]["4"][1]["chosen"] == {"63": 8}  # 4 requests; warm-up not counted
    assert res["s_auto"]["results"]["t0.8"]["1"][0]["chosen"] == {"127": 1, "chain": 1}
    assert "chosen" not in res["s_dflash"]["results"]["t0"]["1"][0]  # no auto state: nothing recorded
    c = _auto_bench("compare", str(tmp_path / "w.json"), "--dflash", "s_dflash", "--auto", "s_auto")
    assert "- t0 auto's steps by candidate, over the passes: bs 1 63 4; bs 4 63 16" in c.stdout, c.stdout
    assert "- t0.8 auto's steps by candidate, over the passes: bs 1 127 2 chain 2; bs 4 127 8 chain 8" in c.stdout


def test_auto_bench_killed_at_its_deadline_leaves_what_it_measured(tmp_path, prompts):
    """auto_phases.sh cuts a wave's client at the deadline (`timeout`): the H200's last wave lost 70 measurements
    that way. Each measurement now rewrites the file whole, marked incomplete until the end."""
    posts, release = [], threading.Event()

    class StallingHandler(JSONHandler):
        def do_GET(self):
            self.send_json({} if self.path == "/health" else {"internal_states": [{"ddtree": {"steps": 0}}]})

        def do_POST(self):
            n = self.read_json()["sampling_params"]["max_new_tokens"]
            posts.append(n)
            if len(posts) >= 3:  # warm-up, pass 0, then pass 1 never returns: the deadline comes
                release.wait(60)
            self.send_json({"output_ids": [10] * n, "meta_info": {"completion_tokens": n, "spec_verify_ct": 2}})

    servers = {"s_dflash": _server(None, 0.0625, 2), "s_auto": serve(StallingHandler)}
    out = tmp_path / "w.json"
    specs = [f"{t}={s.server_address[1]}" for t, s in servers.items()]
    proc = subprocess.Popen([sys.executable, str(GPU / "auto_bench.py"), "run", "--servers", *specs, "--prompts",
                             str(prompts), "--out", str(out), "--batches", "1", "--temps", "0", "--passes", "2",
                             "--max-new", "8", "--wait", "10"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(posts) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert len(posts) == 3, proc.stderr.read() if proc.poll() is not None else posts
        proc.terminate()  # what `timeout` sends
        proc.wait(30)
    finally:
        release.set()
        for s in servers.values():
            s.shutdown()
    res = json.loads(out.read_text())
    assert res["complete"] is False and not (tmp_path / "w.json.tmp").exists()
    assert [len(res["servers"][t]["results"]["t0"]["1"]) for t in ("s_dflash", "s_auto")] == [1, 1]
    c = _auto_bench("compare", str(out), "--dflash", "s_dflash", "--auto", "s_auto")
    assert f"(cut before the end, some cells short of their passes: {out})" in c.stdout, c.stdout
    assert "t0 bs 1: auto >= DFLASH (within the passes' spread)" in c.stdout  # judged on the pass it has

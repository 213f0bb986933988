"""The lab engine over HTTP on CPU: a real sglang 0.5.13.post1 tree with the payload installed, the
engine started by its real `launch.main` with real ARGS (forked from a helper that imported sglang
once), probed over HTTP.

Contract: every route, key and metric name the engine serves is held against the wheel's own
definitions (routes in http_server.py, /model_info's dict, ServerArgs fields, the scheduler's
`get_internal_state` and `get_init_info` run on a stand-in, the payload worker's `internal_state`,
the FINISH_* classes, GenerateReqInput for every body sent). Then each fault switch, seen over HTTP,
and the SIGTERM drain.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from ddtree_ops import bundle as B
from ddtree_ops.lab.engine import faults as F
from ddtree_ops.lab.engine.model_files import write_models
from tests.lab_engine_helpers import first_difference
from tests.payload_helpers import copy_sglang_tree, venv_site

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
HOST_SCRIPT = REPO / "tests/sglang_scripts/lab_engine_host.py"


def free_port() -> int:
    # Below 55536: SGLang derives a gRPC port (port + 10000) and refuses one above 65535.
    while True:
        port = random.randrange(20000, 29000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class LabHostStandIn:
    """The helper process (tests/sglang_scripts/lab_engine_host.py) and what it reported."""

    def __init__(self, site: Path, models: Path, logs: Path) -> None:
        env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}", "PYTHONDONTWRITEBYTECODE": "1"}
        self.models, self.logs = models, logs
        self._lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, str(HOST_SCRIPT), str(models)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=(logs / "host.log").open("w"), text=True,
                                     env=env)
        line = self.proc.stdout.readline()
        assert line, (logs / "host.log").read_text()[-3000:]
        self.contract = json.loads(line)["contract"]

    def call(self, **req) -> dict:
        with self._lock:  # one request/answer pair at a time on the pipe (tests call from threads)
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())

    def engine(self, *extra: str, env: dict[str, str] | None = None, mode: str | None = "full",
               model: str = "target", speculative: bool = True) -> Engine:
        port = free_port()
        argv = ["--model-path", str(self.models / model), "--device", "cpu", "--host", "127.0.0.1",
                "--port", str(port), "--enable-metrics", "--context-length", "1024"]
        if speculative:
            argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(self.models / "draft"),
                     "--speculative-num-draft-tokens", "16", "--attention-backend", "triton", "--page-size", "1"]
        if mode:
            argv += ["--speculative-ddtree-mode", mode]
        log = self.logs / f"engine-{port}.log"
        log.touch()  # the child opens it after the fork; a test may read it first
        pid = self.call(op="spawn", argv=[*argv, *extra], env=env or {}, log=str(log))["pid"]
        return Engine(self, pid, port, log)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@dataclass
class Engine:
    host: LabHostStandIn
    pid: int
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 30) -> httpx.Response:
        return httpx.get(self.url + path, timeout=timeout)

    def generate(self, body: dict, timeout: float = 60) -> httpx.Response:
        assert self.host.call(op="validate", body=body) == {"ok": True}, body  # a body the wheel accepts
        return httpx.post(self.url + "/generate", json=body, timeout=timeout)

    def wait_ready(self, timeout: float = 60) -> list[int]:
        """Poll /health until 200; returns the status codes seen (connection refused = 0)."""
        seen = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                code = self.get("/health", timeout=2).status_code
            except httpx.TransportError:
                code = 0
            if not seen or seen[-1] != code:
                seen.append(code)
            if code == 200:
                return seen
            assert self.exit_code(0) is None, f"engine exited: {self.log.read_text()[-3000:]}"
            time.sleep(0.1)
        raise AssertionError(f"not ready within {timeout} s (saw {seen}): {self.log.read_text()[-3000:]}")

    def exit_code(self, timeout: float) -> int | None:
        return self.host.call(op="wait", pid=self.pid, timeout=timeout)["code"]

    def stop(self) -> int | None:
        if self.exit_code(0) is None:
            os.kill(self.pid, signal.SIGKILL)
        return self.exit_code(10)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    root = tmp_path_factory.mktemp("labengine")
    built = B.build_bundle(None, root / "dist", site_dir=venv_site())
    site = copy_sglang_tree(root / "site")
    B.install_bundle(built.bundle_path, site)
    write_models(root / "models")
    (root / "logs").mkdir()
    stand_in = LabHostStandIn(site, root / "models", root / "logs")
    yield stand_in
    stand_in.close()


@pytest.fixture(scope="module")
def full_engine(host):
    engine = host.engine(env={F.START_DELAY_S: "1.5"})
    seen = engine.wait_ready()
    yield engine, seen
    engine.stop()


GREEDY = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}


def test_contract_routes_server_info_and_model_info(host, full_engine):
    engine, seen = full_engine
    c = host.contract
    assert seen[-1] == 200 and 503 in seen  # DDTREE_LAB_START_DELAY_S: bound and answering 503 while loading
    served = ["/health", "/health_generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info",
              "/generate"]
    assert set(served) <= set(c["routes"])
    for path in ("/health", "/health_generate"):
        assert engine.get(path).status_code == 200
    info = engine.get("/model_info").json()
    assert sorted(info) == sorted(set(c["model_info_keys"]))
    assert info["model_type"] == "llama" and info["is_generation"] is True
    assert engine.get("/get_model_info").json() == info
    server = engine.get("/server_info").json()
    want = set(c["server_args_fields"]) | set(c["init_info_keys"]) | set(c["server_info_extra_keys"])
    assert set(server) == want
    assert (server["speculative_algorithm"], server["speculative_ddtree_mode"]) == ("DFLASH", "full")
    assert (server["speculative_ddtree_budget"], server["speculative_num_draft_tokens"]) == (15, 16)
    assert server["version"] == c["version"] == "0.5.13.post1"
    engine.generate({"input_ids": [5, 6, 7], "sampling_params": GREEDY}).raise_for_status()
    state = engine.get("/get_server_info").json()["internal_states"][0]
    # the real scheduler's get_internal_state (payload patched in) on a stand-in, same keys
    assert sorted(state) == c["internal_state_keys"]
    assert sorted(state["ddtree"]) == c["ddtree_keys"]
    assert state["ddtree"]["tree_steps"] > 0 and state["avg_spec_accept_length"] > 1


def test_contract_generate_shapes(host, full_engine):
    engine, _ = full_engine
    c = host.contract
    single = engine.generate({"text": "Hello lab", "sampling_params": GREEDY}).json()
    assert set(single) == {"text", "output_ids", "meta_info"} and isinstance(single["text"], str)
    meta = single["meta_info"]
    assert set(meta) <= set(c["tokenizer_manager_literals"]), set(meta) - set(c["tokenizer_manager_literals"])
    assert meta["finish_reason"] == {**c["finish_length"], "length": 40}
    assert meta["completion_tokens"] == len(single["output_ids"]) == 40 and meta["prompt_tokens"] == 9
    assert meta["spec_accept_length"] == pytest.approx(40 / meta["spec_verify_ct"])
    batch = engine.generate({"input_ids": [[5, 6], [7, 8, 9]],
                             "sampling_params": [GREEDY, {**GREEDY, "max_new_tokens": 3}]}).json()
    assert isinstance(batch, list) and [len(b["output_ids"]) for b in batch] == [40, 3]
    # stop_token_ids: the first greedy token of a prompt, asked to stop there
    first = batch[1]["output_ids"][0]
    stopped = engine.generate({"input_ids": [7, 8, 9], "sampling_params": {"temperature": 0, "stop_token_ids": [first]}})
    assert stopped.json()["meta_info"]["finish_reason"] == {**c["finish_token"], "matched": first}
    assert set(GREEDY) | {"stop_token_ids", "top_p", "sampling_seed"} <= set(c["sampling_params"])
    assert {"text", "input_ids", "sampling_params", "rid", "stream"} <= set(c["generate_fields"])
    # SGLang's own refusals come back as its 400 shape
    bad = httpx.post(engine.url + "/generate", json={"text": "x", "sampling_params": {"top_p": 0}}, timeout=30)
    assert bad.status_code == 400 and "top_p must be in (0, 1]" in bad.json()["error"]["message"]
    too_long = httpx.post(engine.url + "/generate", json={"input_ids": [5] * 1024}, timeout=30)
    assert too_long.status_code == 400 and "longer than the model's context length (1024" in too_long.text


def test_contract_metrics(host, full_engine):
    engine, _ = full_engine
    text = engine.get("/metrics").text
    names = {line.split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert {"sglang:spec_accept_length", "sglang:spec_accept_rate"} <= names <= set(host.contract["metric_names"]) | {
        "sglang:prompt_tokens_total", "sglang:generation_tokens_total"}
    line = next(ln for ln in text.splitlines() if ln.startswith("sglang:spec_accept_length{"))
    assert 'engine_type="unified"' in line and float(line.rsplit(" ", 1)[1]) > 1


def test_concurrent_mixed_requests_are_served_correctly(full_engine):
    engine, _ = full_engine
    bodies = [{"input_ids": [3 + i, 4 + i], "sampling_params": {**GREEDY, "max_new_tokens": 20 + i}} for i in range(6)]
    bodies += [{"input_ids": [9, 9, i], "sampling_params": {"temperature": 0.8, "max_new_tokens": 20,
                                                             "sampling_seed": i, "ignore_eos": True}} for i in range(3)]
    alone = [engine.generate(b).json()["output_ids"] for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: engine.generate(b).json()["output_ids"], bodies))
    assert together == alone


def test_auto_budget_over_http(host, full_engine):
    """--speculative-ddtree-budget auto through the real ServerArgs of the patched tree: the engine steps through
    the payload's AutoBudget, serves the fixed-budget engine's greedy tokens, and reports what it chose."""
    fixed, _ = full_engine
    engine = host.engine("--speculative-ddtree-budget", "auto", "--speculative-ddtree-budget-max", "31")
    engine.wait_ready()
    try:
        bodies = [{"input_ids": [5 + i, 6, 7], "sampling_params": {**GREEDY, "max_new_tokens": 160}} for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(lambda b: engine.generate(b).json()["output_ids"], bodies))
        assert got == [fixed.generate(b).json()["output_ids"] for b in bodies]
        server = engine.get("/server_info").json()
        assert (server["speculative_ddtree_budget"], server["speculative_ddtree_budget_max"]) == ("auto", 31)
        state = server["internal_states"][0]["ddtree"]
        assert sorted(state) == host.contract["ddtree_keys"]
        assert (state["budget"], state["budget_max"]) == ("auto", 31)
        auto = state["auto"]
        assert auto["candidates"] == ["chain", "15", "31"] and sum(auto["verified"].values()) == state["steps"]
        assert auto["refreshes"] >= 1, state  # a plan is recomputed every 16 steps
        assert auto["accepted_by_budget"]["31"] is not None and set(auto["plan"]) >= {"1", "2", "4"}
    finally:
        engine.stop()


def test_fail_at_start(host):
    engine = host.engine(env={F.FAIL_AT_START: "1"})
    assert engine.exit_code(60) == 1
    assert "DDTREE_LAB_FAULT_FAIL_AT_START" in engine.log.read_text()
    with pytest.raises(httpx.TransportError):
        engine.get("/health", timeout=2)


def test_never_healthy(host):
    engine = host.engine(env={F.NEVER_HEALTHY: "1"})
    try:
        deadline = time.monotonic() + 30
        while "ready in" not in engine.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "ready in" in engine.log.read_text()  # loaded, and still:
        assert engine.get("/health").status_code == 503 and engine.get("/health_generate").status_code == 503
        assert httpx.post(engine.url + "/generate", json={"input_ids": [1]}, timeout=10).status_code == 503
    finally:
        engine.stop()


def test_crash_after_requests(host):
    engine = host.engine(env={F.CRASH_AFTER_REQUESTS: "2"}, mode=None, speculative=False)
    engine.wait_ready()
    for _ in range(2):
        assert engine.generate({"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    assert engine.exit_code(10) == 1
    assert "crashing after 2 requests" in engine.log.read_text()
    with pytest.raises(httpx.TransportError):
        engine.get("/health", timeout=2)


def test_wrong_tokens_after_n_in_full_mode_only(host, full_engine):
    good, _ = full_engine
    body = {"input_ids": [11, 12, 13], "sampling_params": {**GREEDY, "max_new_tokens": 60}}
    want = good.generate(body).json()["output_ids"]
    for mode, differs in (("full", True), ("shadow-linear", False)):
        engine = host.engine(env={F.WRONG_TOKENS_AFTER: "25"}, mode=mode)
        try:
            engine.wait_ready()
            got = engine.generate(body).json()["output_ids"]
        finally:
            engine.stop()
        first = first_difference(got, want)
        assert (first is not None) == differs, mode
        assert first is None or 25 <= first < 25 + 16


def test_low_acceptance(host):
    engine = host.engine(env={F.LOW_ACCEPTANCE: "1"})
    try:
        engine.wait_ready()
        meta = engine.generate({"input_ids": [5, 6], "sampling_params": GREEDY}).json()["meta_info"]
        assert meta["spec_accept_length"] == pytest.approx(40 / 39)  # 1 token per verify, +1 from prefill
        assert engine.get("/server_info").json()["internal_states"][0]["avg_spec_accept_length"] == 1.0
    finally:
        engine.stop()


def test_hang_on_mixed_then_sigterm_gives_up_at_the_drain_bound(host):
    engine = host.engine(env={F.HANG_ON_MIXED: "1", F.DRAIN_TIMEOUT_S: "2", "SGLANG_HEALTH_CHECK_TIMEOUT": "2"})
    try:
        engine.wait_ready()
        # greedy alone and sampled alone are fine
        for temperature in (0.0, 0.7):
            body = {"input_ids": [5], "sampling_params": {"max_new_tokens": 5, "temperature": temperature}}
            assert engine.generate(body).status_code == 200
        mixed = {"input_ids": [[5], [6]], "sampling_params": [{"temperature": 0}, {"temperature": 0.7}]}
        with pytest.raises(httpx.ReadTimeout):
            engine.generate(mixed, timeout=5)
        assert engine.get("/health").status_code == 200  # like SGLang: /health does not generate
        assert engine.get("/health_generate").status_code == 503
        assert "greedy and sampled requests in one batch" in engine.log.read_text()
        started = time.monotonic()
        os.kill(engine.pid, signal.SIGTERM)
        assert engine.exit_code(10) == 1 and time.monotonic() - started < 5
    finally:
        engine.stop()


def test_sigterm_drains_in_flight_requests(host):
    engine = host.engine(env={F.DRAIN_TIMEOUT_S: "30"}, mode="shadow-linear")
    engine.wait_ready()
    body = {"input_ids": [[5, 6], [7]], "sampling_params": {**GREEDY, "max_new_tokens": 400}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(engine.generate, body)
        time.sleep(0.5)
        os.kill(engine.pid, signal.SIGTERM)
        time.sleep(0.2)
        assert engine.get("/health").status_code == 503
        assert httpx.post(engine.url + "/generate", json={"input_ids": [1]}, timeout=10).status_code == 503
        answer = pending.result(timeout=60)
    assert answer.status_code == 200 and [len(a["output_ids"]) for a in answer.json()] == [400, 400]
    assert engine.exit_code(10) == 0
    assert "drained; exiting" in engine.log.read_text()

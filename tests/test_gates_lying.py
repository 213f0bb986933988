"""Gates against a server that lies: wrong shapes, empty outputs, replies dripped byte by byte or
never sent. The real ServerClient and the real gates, over real HTTP; the server is a stand-in
because the point is what a real SGLang server never does on purpose.

Property: whatever the server answers, a gate returns a verdict (never raises), within its
wall-clock bound, and passes only when an independent reading of the answers says it should.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree_ops import gates
from tests.http_stand_in import JSONHandler, serve

PROMPTS = [gates.CanaryPrompt(f"p{i}", "one" if i < 2 else "two", 24, text=f"prompt {i}") for i in range(3)]
BASELINE = {p.name: list(range(i * 100, i * 100 + 24)) for i, p in enumerate(PROMPTS)}
EXPECT = {"speculative_algorithm": "DFLASH", "speculative_ddtree_mode": "full", "speculative_ddtree_budget": 15}


class Lies:
    """What the stand-in answers: generate(body) -> a JSON value, or "drip" / "silent"; info likewise."""

    def __init__(self, generate: Any = None, info: Any = None) -> None:
        self.generate = generate
        self.info = info


class _Liar:
    """One HTTP server for the whole module (a server per example would cost its shutdown poll each);
    `lies` is swapped per example, `stop` ends the replies held open."""

    lies = Lies()
    stop = threading.Event()


@pytest.fixture(scope="module")
def liar_url() -> Iterator[str]:
    class Handler(JSONHandler):
        def _hold(self, drip: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100000")
            self.end_headers()
            while not _Liar.stop.wait(0.05):
                if drip:
                    try:
                        self.wfile.write(b" ")
                        self.wfile.flush()
                    except OSError:
                        return

        def do_GET(self) -> None:
            info = _Liar.lies.info
            if info in ("drip", "silent"):
                self._hold(info == "drip")
            elif self.path == "/server_info":
                self.send_json(info)
            else:
                self.send_error(404)

        def do_POST(self) -> None:
            body = self.read_json()
            generate = _Liar.lies.generate
            if generate in ("drip", "silent"):
                self._hold(generate == "drip")
                return
            self.send_json(generate(body))

    srv = serve(Handler)
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    _Liar.stop.set()
    srv.shutdown()


@contextmanager
def lying_server(url: str, lies: Lies) -> Iterator[gates.ServerClient]:
    _Liar.lies = lies
    client = gates.ServerClient(url, timeout_s=10)
    try:
        yield client
    finally:
        client.close()


def truthful(body: dict) -> dict:
    name = next(p.name for p in PROMPTS if p.text == body["text"])
    return {"text": "", "output_ids": BASELINE[name], "meta_info": {"spec_accept_length": 2.0, "spec_verify_ct": 12}}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["output_ids", "meta_info", "text", "spec_accept_length", "internal_states", "ddtree", "tree_steps"]),
        inner, max_size=4),
    max_leaves=12)


def well_formed_identical(answer: Any, want: list[int]) -> bool:
    """The oracle: an answer the canary may count, read independently of gates.generate_answer."""
    if isinstance(answer, list):
        if len(answer) != 1:
            return False
        answer = answer[0]
    return (isinstance(answer, dict) and type(answer.get("output_ids")) is list
            and all(type(t) is int for t in answer["output_ids"]) and answer["output_ids"] == want
            and isinstance(answer.get("meta_info", {}), dict))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lie=json_values, liar=st.sampled_from([p.name for p in PROMPTS]), wrap=st.booleans())
def test_canary_never_raises_and_passes_only_on_identical_well_formed_answers(liar_url: str, lie: Any, liar: str,
                                                                             wrap: bool) -> None:
    def answer(body: dict) -> Any:
        real = truthful(body)
        if next(p.name for p in PROMPTS if p.text == body["text"]) != liar:
            return real
        if isinstance(lie, dict) and wrap:
            return {**real, **lie}  # a plausible answer with some fields replaced
        return lie

    with lying_server(liar_url, Lies(answer)) as client:
        verdict, run = gates.canary_gate(client, PROMPTS, BASELINE, deadline=gates.Deadline(20))
    merged = {**truthful({"text": next(p.text for p in PROMPTS if p.name == liar)}), **lie} \
        if isinstance(lie, dict) and wrap else lie
    assert isinstance(verdict, gates.GateVerdict) and verdict.gate == "canary"
    assert (verdict.verdict == "pass") == well_formed_identical(merged, BASELINE[liar]), (verdict.reason, merged)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(info=json_values)
def test_settings_and_acceptance_never_raise_on_any_server_info(liar_url: str, info: Any) -> None:
    with lying_server(liar_url, Lies(info=info)) as client:
        settings_verdict = gates.settings_gate(client, EXPECT, deadline=gates.Deadline(10))
        run = gates.CanaryRun({"a": [1, 2]}, {"a": {"spec_accept_length": 3.0, "spec_verify_ct": 2}}, {}, 0.1)
        acceptance = gates.acceptance_gate(client, run, 2.0, 0.05, deadline=gates.Deadline(10))
    reports_all = isinstance(info, dict) and all(k in info and info[k] == v and type(info[k]) is type(v)
                                                 for k, v in EXPECT.items())
    assert settings_verdict.verdict in ("pass", "fail", "inconclusive")
    if settings_verdict.verdict == "pass":
        assert reports_all
    states = info.get("internal_states") if isinstance(info, dict) else None
    stats = states[0].get("ddtree") if isinstance(states, list) and states and isinstance(states[0], dict) else None
    tree_steps = stats.get("tree_steps") if isinstance(stats, dict) else None
    if isinstance(stats, dict) and stats.get("budget") == "auto":  # judged by auto's curve (test_rollout)
        assert acceptance.verdict in ("pass", "fail", "inconclusive")
    else:
        assert (acceptance.verdict == "pass") == (type(tree_steps) is int and tree_steps > 0), acceptance.reason


def test_a_canary_that_compares_nothing_is_inconclusive_and_missing_outputs_fail(liar_url: str) -> None:
    empty = {p.name: [] for p in PROMPTS}
    with lying_server(liar_url, Lies(lambda body: {"output_ids": [], "meta_info": {}})) as client:
        verdict, _ = gates.canary_gate(client, PROMPTS, empty)
    assert verdict.verdict == "inconclusive" and "0 tokens compared" in verdict.reason
    with lying_server(liar_url, Lies(lambda body: {"text": "no ids here", "meta_info": []})) as client:
        verdict, _ = gates.canary_gate(client, PROMPTS, BASELINE)
    assert verdict.verdict == "fail" and "output_ids" in verdict.reason


def test_meta_info_of_the_wrong_shape_fails_the_request_not_the_gate(liar_url: str) -> None:
    for meta in ([], [1, 2], "x", 3):
        with lying_server(liar_url, Lies(lambda body, meta=meta: {**truthful(body), "meta_info": meta})) as client:
            verdict, _ = gates.canary_gate(client, PROMPTS, BASELINE)
        assert verdict.verdict == "fail" and "meta_info" in verdict.reason, verdict.reason


def test_drip_fed_and_silent_servers_fail_within_the_bound(liar_url: str) -> None:
    """httpx times out per read, so a server that sends a byte now and then would hold a gate for
    ever; every request and gate is bounded by wall clock."""
    for behaviour in ("drip", "silent"):
        with lying_server(liar_url, Lies(behaviour, behaviour)) as client:
            started = time.monotonic()
            verdict, _ = gates.canary_gate(client, PROMPTS, BASELINE, timeout_s=30, deadline=gates.Deadline(1.5))
            canary_s = time.monotonic() - started
            started = time.monotonic()
            settings_verdict = gates.settings_gate(client, EXPECT, deadline=gates.Deadline(1.5))
            settings_s = time.monotonic() - started
            started = time.monotonic()
            live = gates.liveness_gate(client, bound_s=1.5, requests=2)
            live_s = time.monotonic() - started
        assert verdict.verdict == "fail" and canary_s < 1.5 + 3, (behaviour, canary_s, verdict.reason)
        assert settings_verdict.verdict == "inconclusive" and settings_s < 1.5 + 3, (behaviour, settings_s)
        assert live.verdict == "fail" and live_s < 1.5 + 3, (behaviour, live_s)


def test_a_gate_that_raises_is_a_failed_verdict(monkeypatch) -> None:
    def boom(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("unexpected")

    monkeypatch.setattr(gates, "run_canary", boom)
    verdict, run = gates.canary_gate(gates.ServerClient("http://127.0.0.1:9"), PROMPTS, BASELINE)
    assert verdict.verdict == "fail" and "RuntimeError: unexpected" in verdict.reason and run is None
    assert "exception" in verdict.evidence and json.dumps(verdict.to_dict())

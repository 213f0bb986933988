"""Fleet order and refusals of promote that need no host: batches, the failure budget, canary first."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ddtree_ops import gates, rollout
from ddtree_ops.cli import app
from ddtree_ops.errors import UsageError
from ddtree_ops.inventory import load_inventory
from tests.http_stand_in import JSONHandler, serve


def _inv(tmp_path: Path, n: int, canary: bool = True, **vars_: object):
    hosts = {f"h{i}": {"address": f"10.0.0.{i}"} for i in range(1, n + 1)}
    doc: dict = {"all": {"vars": {"model_path": "/m", "draft_model_path": "/d", **vars_}}, "hosts": hosts}
    if canary:
        doc["groups"] = {"canary": {"hosts": ["h1"]}}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_inventory(path)


def names(batches) -> list[list[str]]:
    return [[h.name for h in b] for b in batches]


def test_serial_semantics(tmp_path: Path) -> None:
    inv = _inv(tmp_path, 10, canary=False)
    hosts = inv.select(None)
    assert names(rollout.plan_batches(hosts, "1,25%,100%")) == [["h1"], ["h2", "h3"], [f"h{i}" for i in range(4, 11)]]
    # The last size repeats.
    assert [len(b) for b in rollout.plan_batches(hosts, "3")] == [3, 3, 3, 1]
    assert [len(b) for b in rollout.plan_batches(hosts, "10%")] == [1] * 10


def test_canary_group_goes_first_alone(tmp_path: Path) -> None:
    hosts = _inv(tmp_path, 5).select(None)
    assert names(rollout.plan_batches(hosts, "2")) == [["h1"], ["h2", "h3"], ["h4", "h5"]]


@pytest.mark.parametrize("spec", ["0", "abc", "1,,2", "101%", "-1"])
def test_bad_batch(spec: str) -> None:
    with pytest.raises(UsageError):
        rollout.parse_batches(spec)


def test_fail_budget() -> None:
    assert not rollout.FailBudget.parse("0").exceeded(0, 10)
    assert rollout.FailBudget.parse("0").exceeded(1, 10)
    assert not rollout.FailBudget.parse("2").exceeded(2, 10) and rollout.FailBudget.parse("2").exceeded(3, 10)
    assert rollout.FailBudget.parse("20%").allowed(10) == 2 and rollout.FailBudget.parse("25%").allowed(3) == 0
    with pytest.raises(UsageError):
        rollout.FailBudget.parse("1.5")


def test_hybrid_unsafe_refused_up_front(tmp_path: Path) -> None:
    inv = _inv(tmp_path, 2, allow_hybrid_unsafe=True)
    with pytest.raises(UsageError, match="no unsafe override"):
        rollout.promote(inv, inv.select(None), rollout.PromoteOptions(mode="full"))
    out = CliRunner().invoke(app, ["promote", "--mode", "full", "--allow-hybrid-unsafe", "-i", str(inv.path)])
    assert out.exit_code == 2 and "no unsafe override" in out.output


def test_promote_usage_errors(tmp_path: Path) -> None:
    inv = _inv(tmp_path, 1)
    for argv in (["--mode", "bushy"], ["--mode", "full", "--batch", "0"], ["--mode", "off"]):
        out = CliRunner().invoke(app, ["promote", *argv, "-i", str(inv.path)])
        assert out.exit_code == 2, out.output


def test_canary_comparison() -> None:
    assert gates.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert gates.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert gates.first_difference([1, 2, 3], [1, 2]) == 2
    run = gates.CanaryRun({"a": [1, 2], "b": [1, 5, 6]}, {"a": {"spec_accept_length": 2.0, "spec_verify_ct": 1},
                                                        "b": {"spec_accept_length": 3.0, "spec_verify_ct": 3}}, {}, 0.1)
    rows, failed = gates.compare_canary({"a": [1, 2], "b": [1, 2, 3]}, run)
    assert [r["identical"] for r in rows] == [True, False] and rows[1]["first_difference"] == 1 and not failed
    assert run.accept_length() == 2.75  # weighted by verify steps


def test_near_context_prompt_fits() -> None:
    prompt, _ = gates.near_context_prompt(100, [5, 6, 7])
    assert prompt is not None and len(prompt.input_ids) + prompt.max_new_tokens <= 100
    assert gates.near_context_prompt(None, [1])[0] is None


def test_prompt_file(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "hello", "max_new_tokens": 5}\n\n{"input_ids": [1, 2]}\n')
    got = gates.load_prompt_file(path)
    assert [(p.text, p.input_ids, p.max_new_tokens) for p in got] == [("hello", None, 5), (None, [1, 2], 64)]
    path.write_text('{"nope": 1}\n')
    with pytest.raises(UsageError, match="p.jsonl:1"):
        gates.load_prompt_file(path)


@contextlib.contextmanager
def _info_server(info: dict):
    """A real HTTP server whose /server_info answers `info`, and the real client to it."""

    class Handler(JSONHandler):
        def do_GET(self) -> None:
            if self.path == "/server_info":
                self.send_json(info)
            else:
                self.send_error(404)

    srv = serve(Handler)
    client = gates.ServerClient(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=10)
    try:
        yield client
    finally:
        client.close()
        srv.shutdown()


def test_keep_chain_settings_expected_and_gated(tmp_path: Path) -> None:
    host = _inv(tmp_path, 1, ddtree_budget=20, ddtree_keep_chain=True).hosts["h1"]
    expect = rollout.expected_settings(host, "full")
    assert expect["speculative_ddtree_keep_chain"] is True and expect["speculative_ddtree_budget"] == 20
    plain = _inv(tmp_path, 1).hosts["h1"]
    assert "speculative_ddtree_keep_chain" not in rollout.expected_settings(plain, "full")

    def info(server_flag, worker_flag):
        stats = {"mode": "full", "budget": 20, "topk_cap": None, "keep_chain": worker_flag}
        return {"speculative_algorithm": "DFLASH", "speculative_ddtree_mode": "full",
                "speculative_ddtree_budget": 20, "speculative_ddtree_keep_chain": server_flag,
                "internal_states": [{"ddtree": stats}]}

    with _info_server(info(True, True)) as client:
        assert gates.settings_gate(client, expect).verdict == "pass"
    with _info_server(info(False, False)) as client:
        refused = gates.settings_gate(client, expect)
    assert refused.verdict == "fail" and "speculative_ddtree_keep_chain=False (want True)" in refused.reason
    with _info_server(info(True, None)) as client:
        worker = gates.settings_gate(client, expect)
    assert worker.verdict == "fail" and "keep_chain=None" in worker.reason


def test_auto_budget_settings_expected_and_acceptance_judged_by_its_curve(tmp_path: Path) -> None:
    host = _inv(tmp_path, 1, ddtree_budget="auto", ddtree_budget_max=63).hosts["h1"]
    expect = rollout.expected_settings(host, "full")
    assert (expect["speculative_ddtree_budget"], expect["speculative_ddtree_budget_max"]) == ("auto", 63)
    default = rollout.expected_settings(_inv(tmp_path, 1, ddtree_budget="auto").hosts["h1"], "full")
    assert default["speculative_ddtree_budget_max"] == 127

    def info(curve, tree_steps=10):
        stats = {"mode": "full", "budget": "auto", "budget_max": 63, "tree_steps": tree_steps,
                 "auto": {"accepted_by_budget": curve, "verified": {"63": 10}}}
        return {"internal_states": [{"ddtree": stats}]}

    run = gates.CanaryRun({"a": [1, 2]}, {"a": {"spec_accept_length": 2.0, "spec_verify_ct": 2}}, {}, 0.1)
    cases = [({"chain": 0.9, "15": 1.1, "63": 1.5}, "pass", "budget 63 accepts 2.500"),
             ({"chain": 0.9, "15": 0.9, "63": 0.95}, "fail", "auto's largest tree (budget 63) accepts 1.950"),
             ({}, "inconclusive", "auto reports no acceptance by budget")]
    for curve, verdict, reason in cases:
        with _info_server(info(curve)) as client:
            got = gates.acceptance_gate(client, run, 1.9, 0.05)
        assert (got.verdict, reason in got.reason) == (verdict, True), got.reason
    # The canary accepting less than shadow-linear beyond the margin fails even with a good curve.
    low = gates.CanaryRun({"a": [1, 2]}, {"a": {"spec_accept_length": 1.5, "spec_verify_ct": 2}}, {}, 0.1)
    with _info_server(info({"chain": 0.9, "63": 1.5})) as client:
        got = gates.acceptance_gate(client, low, 1.9, 0.05)
    assert got.verdict == "fail" and "auto chose candidates that accept less" in got.reason


def test_unwritable_evidence_dir_is_a_usage_error_before_any_host(tmp_path: Path) -> None:
    """A stage must never confirm and then be reported failed for want of a place for its evidence:
    the evidence dir is checked before any host is contacted (these hosts do not exist)."""
    inv = _inv(tmp_path, 2)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = CliRunner().invoke(app, ["promote", "--mode", "shadow-linear", "-i", str(inv.path), "--evidence-dir",
                                   str(blocker / "evidence")])
    assert out.exit_code == 2 and "cannot write evidence" in out.output and "--evidence-dir" in out.output


def test_empty_limit_is_a_usage_error_for_every_fleet_command(tmp_path: Path) -> None:
    inv = _inv(tmp_path, 2)
    for argv in (["promote", "--mode", "full"], ["rollback"], ["status"], ["hosts"]):
        for limit in ("", ","):
            out = CliRunner().invoke(app, [*argv, "-i", str(inv.path), "--limit", limit])
            assert out.exit_code == 2 and "names no host or group" in out.output, (argv, limit, out.output)


def test_ctrl_c_in_a_later_batch_reports_every_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import _thread
    import signal
    import threading

    from ddtree_ops.fleet import FleetInterrupted

    inv = _inv(tmp_path, 4)
    started, done = threading.Event(), threading.Event()

    def promote_host(ctx, inventory, opts):
        if ctx.host.name == "h1":
            return {"mode": opts.mode}
        ctx.step("baseline canary")
        started.set()
        done.wait()  # reading until interrupted: abandoned, it changes nothing

    monkeypatch.setattr(rollout, "promote_host", promote_host)
    # _thread.interrupt_main() calls whatever handles SIGINT and does nothing where SIGINT is ignored (as a
    # process started in the background of a non-interactive shell inherits it): Python's own, for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=lambda: (started.wait(), _thread.interrupt_main()), daemon=True).start()
        with pytest.raises(FleetInterrupted) as stopped:
            rollout.promote(inv, inv.select(None), rollout.PromoteOptions(mode="shadow-linear"), batch="1")
    finally:
        signal.signal(signal.SIGINT, previous)
        done.set()
    got = [(r.host, r.status) for r in stopped.value.results]
    assert got == [("h1", "ok"), ("h2", "interrupted"), ("h3", "interrupted"), ("h4", "interrupted")]
    assert "not reached" in stopped.value.results[3].error.message


def test_the_payloads_own_refusal_of_a_mode_stops_the_host_before_any_change(tmp_path: Path) -> None:
    """unit_inspect's verdicts (agent units.full_mode_check / shadow_mode_check) become refusals before the unit
    changes; a verdict that could not be reached is a note, the server's own refusal at start the backstop."""
    host = _inv(tmp_path, 1).select(None)[0]
    info = {"release": {"ddtree_payload": True, "current": "r1", "bundle_sha256": "b"}, "promotion": {},
            "drift": [], "lint": {"ok": True},
            "shadow_mode": {"checked": True, "refusal": "add --disable-radix-cache"},
            "full_mode": {"checked": False, "reason": "model_path is not a local directory on the host"}}
    notes: list[str] = []
    got = rollout._refusals(host, rollout.PromoteOptions(mode="shadow-linear"), info, notes)
    assert [r["code"] for r in got] == ["shadow_linear_refused"] and "extra_args" in got[0]["hint"], got
    assert notes == []
    got = rollout._refusals(host, rollout.PromoteOptions(mode="full", force=True), info, notes)
    assert got == [] and notes and "full not checked" in notes[0], (got, notes)
    info["shadow_mode"] = {"checked": True, "refusal": None}
    assert rollout._refusals(host, rollout.PromoteOptions(mode="shadow-linear"), info, []) == []

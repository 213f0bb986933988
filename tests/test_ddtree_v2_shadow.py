"""shadow-linear on SGLang 0.5.17 and 0.5.23 (`ddtree_v2_shadow`): upstream's v2 worker has no `ddtree` report, so
promote's settings gate could only answer "inconclusive" on a real v2 server and every promote stopped at its first
stage (the lab's stand-in engine reports stats on every base and hid it). The payload now gives DFLASH in
shadow-linear a worker that is upstream's, steps unchanged, counted as v1's shadow-linear and reported under v1's
names; promote's settings gate passes it. Driven through SGLang's own hook registry, `create_worker` and the
scheduler's `get_internal_state` on the CPU (tests/sglang_scripts/v2_shadow_cases.py says which stand-ins it uses).
Skipped when a wheel, xgrammar or tvm_ffi cannot be had (see test_payload_v2.py)."""

from __future__ import annotations

import collections
import shutil
from pathlib import Path

import pytest

from ddtree_ops import bundle as B
from ddtree_ops import gates, rollout
from tests.test_payload_v2 import site_report, wheel_site

SCRIPT = Path(__file__).parent / "sglang_scripts" / "v2_shadow_cases.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["0.5.17", "0.5.23"])
def observed(request, tmp_path_factory) -> dict:
    site = wheel_site(request.param, tmp_path_factory)
    for rel, src in B.payload_sources(base=request.param).items():
        if rel.endswith(".py") and "/speculative/" in rel:
            shutil.copyfile(src, site / rel)
    return site_report(site, SCRIPT, version=request.param, timeout=300)


def test_shadow_linear_gets_the_counting_worker_and_nothing_else_changes(observed: dict) -> None:
    assert observed["registered"]
    sel = observed["selection"]
    assert (sel["shadow"], sel["subclass"], sel["off"]) == ("DDTreeShadowWorkerV2", True, "DFlashWorkerV2")
    assert sel["eagle_shadow"].startswith("EAGLE")  # another algorithm keeps its own worker
    # every batch's result is upstream's, as upstream returned it
    assert observed["passed_through"] == [[1, 1], [1, 1], *observed["lens"]]


def test_decode_steps_are_counted_as_v1s_shadow_linear(observed: dict) -> None:
    """Decode batches only (the verify leaves the batch in verify mode: the mode is read first), each request's
    accepted depth from the results (summed on the device, nothing on the host per step), graph replays."""
    state = observed["state"]["ddtree"]
    depths = collections.Counter(n - 1 for step in observed["lens"] for n in step)
    assert (state["steps"], state["tree_steps"], state["fallback_steps"], state["graph_steps"]) == (3, 0, 0, 1)
    assert state["accepted_depth_hist"] == {str(k): v for k, v in sorted(depths.items())}
    assert (state["avg_tree_nodes"], state["build_samples"], state["build_budgets"]) == (0.0, 0, [])  # no trees
    assert {k: state[k] for k in ("mode", "budget", "budget_max", "topk_cap", "keep_chain")} == {
        "mode": "shadow-linear", "budget": 31, "budget_max": None, "topk_cap": 4, "keep_chain": True}
    assert observed["on_device"]
    auto = observed["auto"]
    assert (auto["budget"], auto["budget_max"], auto["keep_chain"]) == ("auto", 63, False)
    assert not observed["dflash_state_has_ddtree"]  # upstream's worker (mode off) reports nothing


def test_the_shadow_report_has_the_v1_keys(observed: dict) -> None:
    from ddtree_ops.lab.engine.decoding import TreeStats

    assert sorted(observed["state"]["ddtree"]) == sorted(TreeStats("shadow-linear", 7, None).internal_state())


def test_promotes_settings_gate_passes_the_shadow_stage(observed: dict, tmp_path: Path) -> None:
    """The gate that stopped every v2 promote at shadow-linear: pass with the worker's report, inconclusive
    without it (upstream's worker), fail when the unit asked for keep-chain and the worker does not run it."""
    from tests.test_rollout import _info_server, _inv

    host = _inv(tmp_path, 1, draft_block_size=8, ddtree_budget=31, ddtree_topk_cap=4,
                ddtree_keep_chain=True).hosts["h1"]
    expect = rollout.expected_settings(host, "shadow-linear")
    server = {"speculative_algorithm": "DFLASH", "speculative_ddtree_mode": "shadow-linear",
              "speculative_ddtree_budget": 31, "speculative_ddtree_topk_cap": 4, "speculative_ddtree_keep_chain": True}

    def verdict(state: dict) -> gates.GateVerdict:
        with _info_server({**server, "internal_states": [state]}) as client:
            return gates.settings_gate(client, expect)

    state = observed["state"]
    assert verdict(state).verdict == "pass"
    assert verdict({k: v for k, v in state.items() if k != "ddtree"}).verdict == "inconclusive"
    failed = verdict({**state, "ddtree": {**state["ddtree"], "keep_chain": False}})
    assert failed.verdict == "fail" and "keep_chain=False" in failed.reason


def test_a_hub_model_is_checked_against_the_config_sglang_loaded(observed: dict) -> None:
    """Argument parsing reads a local --model-path only; the shadow worker checks the config SGLang loaded (a hub
    id). As shipped every base tracks the hybrid's states for the radix cache (0.5.17 through the payload's hooks):
    served. On a base marked untracked it refuses a hybrid with the radix cache, in the words of the argument check."""
    assert observed["loaded"] == {"hybrid, radix on": None, "hybrid, radix off": None, "dense": None}, observed
    loaded = observed["loaded untracked"]
    refused = loaded.pop("hybrid, radix on")
    assert loaded == {"hybrid, radix off": None, "dense": None}, loaded
    assert refused and refused.startswith("DDTreeConfigError") and "--disable-radix-cache" in refused, refused

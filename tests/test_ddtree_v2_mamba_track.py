"""The radix cache's recurrent-state tracking in upstream's linear DFLASH verify on SGLang 0.5.17 and 0.5.23
(`ddtree_v2_args.register_mamba_track`, every DFLASH server on 0.5.17): 0.5.17's verify is built without the
requests' track slots (its `prepare_for_verify` does not rebuild them, as 0.5.23's does) and its commit compares the
pre-verify lengths with lengths the step has not advanced, so it snapshots no state while the scheduler records one
(a wrong token after a cached prefix on the H100 and H200); with the hooks its own code gets the slots and snapshots
the step 0.5.23's does. Driven
through each base's real commit and SGLang's hook registry on the CPU against a brute-force oracle
(tests/sglang_scripts/v2_mamba_track_cases.py says which stand-ins it uses and why).
Skipped when a wheel, xgrammar or tvm_ffi cannot be had (see test_payload_v2.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_payload_v2 import site_report, wheel_site

SCRIPT = Path(__file__).parent / "sglang_scripts" / "v2_mamba_track_cases.py"
PAYLOAD_FILES = ("ddtree_v2_args.py", "ddtree_args.py", "ddtree_v2_penalties.py", "ddtree_penalties.py")  # the verify hooks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["0.5.17", "0.5.23"])
def observed(request, tmp_path_factory) -> dict:
    site = wheel_site(request.param, tmp_path_factory, PAYLOAD_FILES)
    return site_report(site, SCRIPT, version=request.param, timeout=600)


def test_every_base_snapshots_the_step_the_scheduler_records(observed: dict) -> None:
    """400 random batches (lengths, commits of 1-16 tokens, intervals 16-128): after `load_plugins()` each base's
    commit asks for exactly the oracle's steps, crossings included."""
    after = observed["after"]
    assert after["agree"] == after["cases"], after["wrong"]
    assert after["crossings"] >= 100, after


def test_every_base_builds_its_verify_with_the_requests_track_slots(observed: dict) -> None:
    """After `load_plugins()` a verify batch whose slots a filter / merge nulled is built with each request's own
    ping-pong slot, and without the stale extend-time mask (which would snapshot inside the verify forward)."""
    after = observed["slots_after"]
    assert after["slots"] == after["want"] and after["mask"] is None, after
    before = observed["slots_before"]
    if observed["version"] == "0.5.17":  # upstream's own gap: nothing to track into, a stale mask
        assert before["slots"] is None and before["mask"] == [True] * 4, before
    else:
        assert before == after, before


def test_the_hook_is_what_mends_0_5_17(observed: dict) -> None:
    """Unhooked, 0.5.17 snapshots nothing at a crossing (upstream's own defect: the oracle has power against it)
    and only 0.5.17 registers the hook; 0.5.23 is right on its own."""
    before = observed["before"]
    if observed["version"] == "0.5.17":
        assert observed["registered"] and observed["hooked"]
        assert before["crossings"] >= 100 and before["agree"] < before["cases"] / 2, before
        assert all(all(s == -1 for s in w["got"]) for w in before["wrong"]), before["wrong"]
    else:
        assert not observed["registered"] and not observed["hooked"]
        assert before["agree"] == before["cases"], before["wrong"]

"""Penalties in upstream's linear DFLASH verify on SGLang 0.5.17 and 0.5.23 (`ddtree_v2_penalties`, hooked by
`ddtree_v2_args` for every DFLASH server): upstream's v2 verify drops frequency / presence / repetition /
min_new_tokens (on the H200, 14 of 23 penalised requests left plain decoding on 0.5.17's DFLASH); with the hooks
every block position is penalised as plain decoding penalises it. Driven through SGLang's own hook registry,
verify input, adjustments and penalizers on the CPU against plain greedy decoding
(tests/sglang_scripts/v2_linear_penalty_cases.py says which stand-ins it uses and why).
Skipped when a wheel, xgrammar or tvm_ffi cannot be had (see test_payload_v2.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_payload_v2 import site_report, wheel_site

SCRIPT = Path(__file__).parent / "sglang_scripts" / "v2_linear_penalty_cases.py"
PAYLOAD_FILES = ("ddtree_v2_args.py", "ddtree_args.py", "ddtree_penalties.py", "ddtree_v2_penalties.py")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["0.5.17", "0.5.23"])
def observed(request, tmp_path_factory) -> dict:
    site = wheel_site(request.param, tmp_path_factory, PAYLOAD_FILES)
    out = site_report(site, SCRIPT, version=request.param, timeout=600)
    assert out["registered"]
    return out


def test_upstream_order_is_what_the_hooks_expect(observed: dict) -> None:
    """The step builds the block's verify input, prepares it on the batch, then adjusts the logits with that
    batch's sampling info, each once; after `load_plugins()` both names the step calls are the hooked ones."""
    assert observed["contract"] == {"found": [True] * 4, "in_order": True}
    assert observed["rebound"]


def test_hooked_linear_steps_are_plain_greedy_decoding(observed: dict) -> None:
    """6 runs x 24 steps x 4 requests with random penalties and biases: tokens equal plain greedy decoding, and
    the logits at every committed position equal plain's bit for bit; the penalties changed plain's choice often
    enough for that to mean something."""
    for r in observed["hooked"]:
        assert r["match"] and r["bad_count"] == 0, r
    assert sum(r["positions"] for r in observed["hooked"]) > 6 * 24 * 4
    assert sum(r["changed"] for r in observed["hooked"]) >= 30
    assert sum(r["banned"] for r in observed["hooked"]) >= 3  # min_new_tokens held a stop token back
    # 0.5.23's min_new_tokens also holds back the model's eos ids (a request's `eos_token_ids`), 0.5.17's not
    model_eos = sum(r["model_eos_banned"] for r in observed["hooked"])
    assert model_eos >= 1 if observed["version"] == "0.5.23" else model_eos == 0


def test_upstream_and_the_overlap_scheduler_keep_upstreams_answer(observed: dict) -> None:
    """The power: without the hooks (upstream's adjustments) most runs leave plain decoding; under the overlap
    scheduler the hook leaves upstream's adjustments (the host lags the step), so they leave it too."""
    assert sum(not r["match"] for r in observed["unhooked"]) >= 5
    assert sum(not r["match"] for r in observed["overlap"]) >= 2


def test_calls_that_are_not_a_penalised_linear_verify_get_upstreams_function(observed: dict) -> None:
    """A call whose sampling info is not the prepared batch's (the tree step's stripped copy) and a batch with
    nothing penalised: upstream's answer exactly, and the per-position code never runs; a neutral run still
    equals plain decoding (the bias alone is upstream's to apply)."""
    for name, got in observed["passthrough"].items():
        assert got == {"equal_upstream": True, "penalty_calls": 0}, name
    assert observed["neutral"]["match"] and observed["neutral"]["bad_count"] == 0


def test_a_penalised_greedy_batch_is_not_argmaxed_past_its_adjustments(observed: dict) -> None:
    """0.5.23 argmaxes a greedy batch over a vocab-sharded target's shards (TP > 1) without the adjustments when
    its forward copy shows nothing penalised, which it always does: hooked, a penalised batch takes the adjustments
    (not under overlap, where the hook leaves upstream's); 0.5.17 has no such shortcut."""
    got = observed["skip_logits"]
    if observed["version"] == "0.5.17":
        assert got is None
        return
    assert got == {"penalised": {"upstream": True, "hooked": False}, "neutral": {"upstream": True, "hooked": True},
                   "penalised_overlap": True}

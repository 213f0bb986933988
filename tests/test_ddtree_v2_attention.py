"""The v2 tree step's verify attention through the real triton backend and extend-attention kernel of every base with
a tree step (SGLang 0.5.17 and 0.5.23: `base`), in Triton's CPU interpreter (tests/sglang_scripts/v2_tree_attention.py
says what is real and what stands in): random trees, eager and replayed from the graph buffers the seams widened,
against an oracle written from the definition (each node attends to its prefix and its own root-to-node path). The
controls show the check can fail: the same verify without the mask (DFLASH's causal rule), the mask in a wrong layout,
and graphs captured without the seams (upstream leaves the triton verify graphs maskless on both bases) all differ on
branching trees. Skipped where the wheel, xgrammar / tvm_ffi or Triton cannot be had."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_ddtree_worker_v2 import base, base_site  # noqa: F401 (each base's unpacked tree with its payload)
from tests.test_payload_v2 import site_report

SCRIPT = Path(__file__).parent / "sglang_scripts" / "v2_tree_attention.py"
EXACT = 1e-5  # float32 on the CPU: the kernel's online softmax against the oracle's, a few ulps apart
WRONG = 1e-2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trials(base_site: Path, base: str) -> list[dict]:  # noqa: F811
    pytest.importorskip("triton")
    return site_report(base_site, SCRIPT, {"TRITON_INTERPRET": "1"}, version=base)["trials"]


def test_the_tree_mask_is_read_as_the_tree_eager_and_from_graph_buffers(
        trials: list[dict], base: str) -> None:  # noqa: F811
    for t in trials:
        assert t["eager"] < EXACT and isinstance(t["graph"], float) and t["graph"] < EXACT, t
        assert t["graph_buffer"], t  # the seams' VerifyMask: 1 + budget wide, uint8 as upstream reads it
        assert t["kv_plan"] == (base == "0.5.23"), t  # 0.5.23: the adapter's own KVLocPlan rode the verify
    assert {t["graph_bs"] > t["bs"] for t in trials} == {True, False}  # padded replays and exact ones


def test_the_controls_differ_on_branching_trees(trials: list[dict]) -> None:
    trees = [t for t in trials if not t["chain"]]
    assert len(trees) == 8 and all(t["branching"] for t in trees)
    for t in trees:
        assert t["causal"] > WRONG and t["wrong_layout"] > WRONG, t
        # Without the seams the runner captures triton's verify graphs maskless: the replay attends causally.
        control = t["graph_without_seams"]
        assert isinstance(control, str) or control > WRONG, t


def test_a_chain_is_dflash_s_causal_verify(trials: list[dict]) -> None:
    chains = [t for t in trials if t["chain"]]
    assert len(chains) == 2
    for t in chains:
        assert t["causal"] < EXACT and t["graph_without_seams"] < EXACT and t["wrong_layout"] > WRONG, t

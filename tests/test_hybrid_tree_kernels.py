"""Issue 25, G1 on the CPU: SGLang's own Gated DeltaNet verify kernels (the short convolution and the gated
delta-rule recurrence, Triton source from the installed wheel) run under Triton's interpreter on random
DDTrees: every valid node's output and cached conv window / SSM state equal its root-to-node path's, bit for
bit, with DDTree's own first-child / next-sibling arrays, while DFLASH's chain verify of the same tokens
differs (the check sees a wrong parent); the accepted node's state, committed, continues the path in a plain
decode step, DFLASH's index and the deepest node do not. The GPU runs the same script compiled
(bench/gpu/hybrid_kernels_check.py --device cuda)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench/gpu/hybrid_kernels_check.py"


def test_gdn_verify_kernels_follow_ddtree_parents_bit_for_bit() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--batch", "2"], capture_output=True, text=True,
                          env=env, timeout=900)
    out = proc.stdout[proc.stdout.index("{"):]
    report = json.loads(out)
    assert [c["case"] for c in report["cases"]] == ["budget 15", "budget 64", "keep-chain 31", "64 shrunk to 20, padded"]
    for case in report["cases"]:
        exact = case["tree_vs_path"]
        assert exact["nodes"] > case["batch"] and all(exact[k] == 0 for k in ("conv", "window", "o", "state", "parent")), case
        assert case["branching"], case  # the trees branch: a wrong parent would show
        assert case["dflash_chain_vs_path"]["o"] > 0, case
        commit = case["commit"]
        assert commit["accepted_conv"] and commit["accepted_o"], commit
        for wrong in ("dflash_index", "deepest_node"):
            assert commit[wrong]["requests_with_another_node"] > 0 and commit[wrong]["continued_anyway"] == 0, commit
    assert report["ok"] and proc.returncode == 0, proc.stderr[-2000:]

"""Tensor-parallel DDTree tree selection on CPU (issue 6): bench/gpu/tp_tree_check.py with two gloo
ranks in SGLang's real distributed state and real `ParallelLMHead` shards; the payload's
`DDTreeController.draft_logits` gathers the vocab shards and every rank must build the tree a single
device builds from the unsharded logits (vocab 151936, an odd 4099, and 4099 + added entries).

The payload modules come from the repo (`ddtree_ops/payload`, appended to the package path of the
dev venv's pristine sglang): `ddtree_worker` is a new module, not a patch, so this is the code the
bundle installs. The H200 run does the same with NCCL and the installed bundle (run_device.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.payload_helpers import venv_site

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "tp_tree_check.py"


def test_tp2_sharded_draft_logits_build_the_single_device_tree():
    venv_site()  # skips unless sglang 0.5.13.post1 is installed
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--nproc", "2", "--device", "cpu", "--seeds", "1", "--timeout", "150"],
        capture_output=True, text=True, env=env, timeout=200,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON summary (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads(lines[-1])
    assert summary["ok"], json.dumps(summary, indent=1)[:4000]
    assert proc.returncode == 0
    assert summary["backend"] == "gloo" and summary["nproc"] == 2
    # 3 layouts x 2 kinds x 2 dtypes x 1 seed x 2 batch sizes, 3 budgets each
    assert summary["cases"] == 24 and summary["trees_per_rank"] == 72
    # rank 1's shard of the odd vocab is padded: 4099 -> 2 x 2080, 2019 real rows on rank 1
    odd = [lay for lay in summary["layouts"]["1"] if lay["vocab"] == 4099 and lay["added"] == 0][0]
    assert (odd["org_start"], odd["num_org"], odd["num_org_padded"]) == (2080, 2019, 2080)
    assert all(n > 0 for n in summary["local_only_tree_differs"])

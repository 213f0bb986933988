"""The payload's captured tree builds (`ddtree_build_graphs`) and step profile (`ddtree_profile`), on CPU with a stand-in capture that has
a CUDA graph's contract: outputs are static tensors that each replay recomputes in place from the
static input. The bucket logic checked here is what the CUDA path runs too: which captured batch
size a step replays, the copy into its static input, padding rows left stale, and the slice of the
outputs. The capture itself only runs on a GPU (bench/gpu, GRAPHS=1). Oracle: the eager
`build_ddtree` of the same rows.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ddtree_oracle import load_ddtree_utils, load_payload_module

sys.path.insert(0, str(Path(__file__).parent / "sglang_scripts"))
from graph_stand_in import RerunGraph  # noqa: E402

du = load_ddtree_utils()
bg = load_payload_module("ddtree_build_graphs")
DEPTH, HIDDEN, VOCAB = 5, 8, 37


def _exact(*shape: int) -> torch.Tensor:
    """Small integers as floats: the LM-head matmul is exact in float32 for any batch blocking, so
    a bucket's padded matmul and the eager one of the real rows give bit-equal logits (as on the
    GPU, where cuBLAS may pick another kernel per batch size, they need not otherwise)."""
    return torch.randint(-3, 4, shape).float()


def _build_fn(weight: torch.Tensor, budget: int, cap: int | None, keep_chain: bool):
    def build(tail: torch.Tensor):
        logits = (tail.reshape(-1, HIDDEN) @ weight.T).view(tail.shape[0], DEPTH, -1)
        return du.build_ddtree(logits, budget, topk_cap=cap, keep_chain=keep_chain)

    return build


def _assert_same_tree(got, want, where: str) -> None:
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert a.shape == b.shape and torch.equal(a, b), f"{where}: {f.name} differs"
        else:
            assert a == b, f"{where}: {f.name} {a} != {b}"


@pytest.mark.parametrize("seed", range(6))
def test_replayed_builds_equal_the_eager_build_of_the_same_rows(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    budget = rng.choice([5, 9, 16, 30])
    cap = rng.choice([None, 2, 4])
    keep_chain = rng.random() < 0.5 and budget >= DEPTH
    weight = _exact(VOCAB, HIDDEN)
    build = _build_fn(weight, budget, cap, keep_chain)
    buckets = sorted(rng.sample([1, 2, 3, 4, 8, 12, 16], 3))
    graphs = bg.DDTreeBuildGraphs(build, buckets, depth=DEPTH, hidden=HIDDEN, dtype=torch.float32,
                                  device="cpu", new_graph=RerunGraph)
    assert graphs.sizes == buckets and graphs.max_bs == buckets[-1]
    # Steps of changing batch sizes: a bucket's padding rows hold an earlier, larger step's rows.
    for step in range(12):
        bs = rng.randint(1, graphs.max_bs)
        tail = _exact(bs, DEPTH, HIDDEN)
        got = graphs.run(tail)
        where = f"seed {seed} step {step} bs {bs} budget {budget} cap {cap} keep_chain {keep_chain}"
        assert got is not None and got.batch_size == bs, where
        _assert_same_tree(got, build(tail), where)


def test_batches_above_the_largest_bucket_build_eagerly_and_shapes_are_checked():
    weight = torch.randn(VOCAB, HIDDEN)
    graphs = bg.DDTreeBuildGraphs(_build_fn(weight, 9, None, False), [4, 2], depth=DEPTH, hidden=HIDDEN,
                                  dtype=torch.float32, device="cpu", new_graph=RerunGraph)
    assert graphs.run(torch.randn(5, DEPTH, HIDDEN)) is None
    with pytest.raises(ValueError, match=r"captured for \[bs, 5, 8\]"):
        graphs.run(torch.randn(2, DEPTH + 1, HIDDEN))
    with pytest.raises(ValueError, match="at least one"):
        bg.DDTreeBuildGraphs(_build_fn(weight, 9, None, False), [0], depth=DEPTH, hidden=HIDDEN,
                             dtype=torch.float32, device="cpu", new_graph=RerunGraph)


def test_the_tree_is_the_graph_outputs_so_the_next_replay_overwrites_it():
    """The contract the worker relies on (a step's tree is used within that step): the returned tree
    is a view of the bucket's static outputs, not a copy."""
    weight = torch.randn(VOCAB, HIDDEN) * 3
    graphs = bg.DDTreeBuildGraphs(_build_fn(weight, 9, None, False), [4], depth=DEPTH, hidden=HIDDEN,
                                  dtype=torch.float32, device="cpu", new_graph=RerunGraph)
    first_in = torch.randn(3, DEPTH, HIDDEN)
    first = graphs.run(first_in)
    kept = first.token_ids.clone()
    second = graphs.run(torch.randn(3, DEPTH, HIDDEN))
    assert first.token_ids.data_ptr() == second.token_ids.data_ptr()
    assert not torch.equal(kept, first.token_ids)


def test_capture_build_sets_captures_where_both_workers_may_and_falls_back_to_eager(monkeypatch, caplog):
    """The one capture both workers call: a set per budget, largest first in one pool, only on one CUDA device with
    verify graphs and the switch on; a capture that raises leaves every build eager (None) with a warning."""
    head = SimpleNamespace(weight=_exact(VOCAB, HIDDEN))
    builds = {budget: _build_fn(head.weight, budget, None, False) for budget in (3, 9)}
    captured: list = []

    def capture(build, buckets, *, depth, hidden, dtype, device, pool):  # a CUDA graph's contract, on CPU
        captured.append((hidden, pool))
        return bg.DDTreeBuildGraphs(build, buckets, depth=depth, hidden=hidden, dtype=dtype, device="cpu",
                                    new_graph=RerunGraph)

    monkeypatch.setattr(bg, "capture_build_graphs", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    kw = {"depth": DEPTH, "dtype": torch.float32, "device": "cuda:0", "tp_size": 1}
    sets = bg.capture_build_sets(builds, [4, 1], head, **kw)
    assert sorted(sets) == [3, 9] and sets[9].sizes == [1, 4] and captured == [(HIDDEN, "pool")] * 2
    tail = _exact(3, DEPTH, HIDDEN)
    _assert_same_tree(sets[3].run(tail), builds[3](tail), "budget 3")
    for args, change in (((builds, [], head), {}), ((builds, [4], None), {}), ((builds, [4], head), {"device": "cpu"}),
                         ((builds, [4], head), {"tp_size": 2})):
        assert bg.capture_build_sets(*args, **{**kw, **change}) is None
    monkeypatch.setattr(bg, "BUILD_GRAPHS", False)
    assert bg.capture_build_sets(builds, [4], head, **kw) is None
    monkeypatch.setattr(bg, "BUILD_GRAPHS", True)

    def fails(*a, **k):
        raise RuntimeError("capture failed (stand-in)")

    monkeypatch.setattr(bg, "capture_build_graphs", fails)
    with caplog.at_level("WARNING"):
        assert bg.capture_build_sets(builds, [4], head, **kw) is None
    assert "builds run eagerly" in caplog.text and "capture failed (stand-in)" in caplog.text


def test_slice_tree_keeps_the_first_rows_and_the_ints():
    logits = torch.randn(4, DEPTH, VOCAB)
    tree = du.build_ddtree(logits, 7)
    part = bg.slice_tree(tree, 2)
    assert part.batch_size == 2 and part.budget == 7 and part.max_depth == DEPTH
    _assert_same_tree(part, du.build_ddtree(logits[:2], 7), "slice")
    assert bg.slice_tree(tree, 4) is tree


prof = load_payload_module("ddtree_profile")


def test_step_profile_reports_each_transition_and_resets_on_read():
    p = prof.StepProfile(cuda=False)
    for _ in range(3):
        p.mark("draft_done")
        time.sleep(0.004)
        p.mark("built")
        time.sleep(0.012)
        p.mark("step_done")
        p.end_step()
    got = p.read_and_reset()
    assert set(got) == {"draft_done->built", "built->step_done", "step_done->draft_done"}
    assert got["draft_done->built"]["n"] == 3 and got["step_done->draft_done"]["n"] == 2
    assert 4.0 <= got["draft_done->built"]["cpu_ms"] < got["built->step_done"]["cpu_ms"]
    assert got["built->step_done"]["gpu_ms"] is None  # no CUDA: host clock only
    assert p.read_and_reset() == {}
    assert prof.median([3.0, 1.0, 2.0, 10.0]) == 2.5 and prof.median([]) == 0.0


def test_maybe_profile_follows_the_switch_read_when_the_worker_is_made(monkeypatch):
    """Both workers make their profile with `maybe_profile` (v1's controller, the v2 tree step's setup)."""
    monkeypatch.delenv(prof.PROFILE_ENV, raising=False)
    assert prof.maybe_profile("cuda:0") is None
    monkeypatch.setenv(prof.PROFILE_ENV, "0")
    assert prof.maybe_profile("cuda:0") is None
    monkeypatch.setenv(prof.PROFILE_ENV, "1")
    on_gpu, on_cpu = prof.maybe_profile("cuda:0"), prof.maybe_profile("cpu")
    assert isinstance(on_gpu, prof.StepProfile) and on_gpu.cuda
    assert isinstance(on_cpu, prof.StepProfile) and not on_cpu.cuda and prof.maybe_profile(None).cuda is False

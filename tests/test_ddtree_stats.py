"""ddtree_stats: the DDTree workers' counters (v1's DDTreeController and 0.5.17's v2 tree worker) and their
`/server_info` `ddtree` report, loaded by path as a host would see it (torch and the standard library only)."""

from __future__ import annotations

import ast
import collections
import json
import random

import torch
from ddtree_oracle import _MODULE_PATH, load_payload_module

S = load_payload_module("ddtree_stats")
MODULE = _MODULE_PATH.with_name("ddtree_stats.py")


def test_imports_only_torch_and_the_standard_library() -> None:
    roots = set()
    for node in ast.walk(ast.parse(MODULE.read_text())):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots <= {"__future__", "collections", "statistics", "dataclasses", "typing", "torch"}, roots


def test_device_and_host_depth_counts_add_up_to_the_accepted_depths() -> None:
    rng = random.Random(3)
    stats = S.DDTreeStats()
    want: collections.Counter[int] = collections.Counter()
    for step in range(40):
        depths = [rng.randint(0, 7) for _ in range(rng.randint(1, 5))]
        if step % 3:  # the v2 step: a device tensor, counted on its device
            t = torch.tensor(depths, dtype=torch.int64 if step % 2 else torch.int32)
            before = t.clone()
            stats.add_accepted_depths(t, 7)
            assert torch.equal(t, before)  # the caller's tensor is left as it was
        else:  # v1: host ints
            for k in depths:
                stats.accepted_depth_hist[k] += 1
        want.update(depths)
    assert stats.depth_hist() == dict(sorted(want.items()))
    assert stats.depth_hist() == stats.depth_hist()  # reading does not consume
    d = stats.as_dict()
    assert d["accepted_depth_hist"] == dict(sorted(want.items()))
    assert d["avg_accepted_depth"] == round(sum(k * v for k, v in want.items()) / sum(want.values()), 4)


def test_depths_are_clamped_and_a_larger_depth_keeps_the_earlier_counts() -> None:
    stats = S.DDTreeStats()
    depths = torch.tensor([-1, 0, 3, 9])  # int64, as `commit_lens - 1` may be
    stats.add_accepted_depths(depths, 3)  # -1 -> 0, 9 -> 3
    assert stats.depth_hist() == {0: 2, 3: 2}
    assert depths.tolist() == [-1, 0, 3, 9]  # clamped in a copy, not in the caller's tensor
    stats.add_accepted_depths(torch.tensor([5, 1]), 6)
    assert stats.depth_hist() == {0: 2, 1: 1, 3: 2, 5: 1}
    stats.add_accepted_depths(torch.tensor([2]), 2)  # a smaller bound later keeps the grown counts
    assert stats.depth_hist() == {0: 2, 1: 1, 2: 1, 3: 2, 5: 1}


def test_nothing_is_counted_until_read_and_an_empty_report_is_zeros() -> None:
    empty = S.DDTreeStats().as_dict()
    assert empty["accepted_depth_hist"] == {} and empty["avg_accepted_depth"] == 0.0
    assert empty["avg_tree_nodes"] == 0.0 and empty["build_ms_median"] == 0.0 and empty["build_ms_first"] is None
    stats = S.DDTreeStats()
    for n in ([8, 5], [8, 8, 2]):
        stats.add_nodes(torch.tensor(n))
        stats.requests_sum += len(n)
    assert isinstance(stats.nodes_sum, torch.Tensor)  # summed on the device, not read per step
    assert stats.as_dict()["avg_tree_nodes"] == round(31 / 5, 3)


def test_build_times_median_and_first_build_apart() -> None:
    stats = S.DDTreeStats()
    stats.build_ms_first = 900.0
    stats.build_ms_recent.extend([3.0, 1.0, 2.0, 10.0])
    d = stats.as_dict()
    assert (d["build_ms_first"], d["build_ms_median"], d["build_ms_max"]) == (900.0, 2.5, 10.0)


def test_internal_state_settings_extras_and_counters_with_string_keys() -> None:
    stats = S.DDTreeStats(steps=3, tree_steps=2, fallback_steps=1)
    stats.fallback_reasons["grammar"] += 1
    stats.add_accepted_depths(torch.tensor([0, 2, 2]), 3)
    fixed = S.internal_state(S.settings(mode="full", budget=15, budget_auto=False, topk_cap=None, keep_chain=True),
                             stats, auto=None, build_budgets=[15])
    assert list(fixed)[:7] == ["mode", "budget", "budget_max", "topk_cap", "keep_chain", "auto", "build_budgets"]
    assert (fixed["budget"], fixed["budget_max"], fixed["keep_chain"]) == (15, None, True)
    assert fixed["accepted_depth_hist"] == {"0": 1, "2": 2} and fixed["fallback_reasons"] == {"grammar": 1}
    assert json.loads(json.dumps(fixed)) == fixed  # builtins only
    auto = S.settings(mode="full", budget=63, budget_auto=True, topk_cap=4, keep_chain=0)
    assert auto == {"mode": "full", "budget": "auto", "budget_max": 63, "topk_cap": 4, "keep_chain": False}

"""The DDTree seams of the v2 DFLASH worker (`ddtree_v2_seams.py`: verify width, verify mask in graphs,
reservation) against the real code of SGLang 0.5.17 and 0.5.23: the payload module beside the unpacked wheel,
hooked through that SGLang's own `HookRegistry`, and the upstream functions driven in a child before, while
and after the seams are active (tests/sglang_scripts/v2_seams_cases.py says which stand-ins it uses and why).
CPU; skipped when a wheel, or xgrammar / tvm_ffi for 0.5.17, cannot be had (see test_payload_v2.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_payload_v2 import V2_BASES, extra_path, wheel_site

SCRIPT = Path(__file__).parent / "sglang_scripts" / "v2_seams_cases.py"
# the seams module, what it imports from the payload, and the ladder capture the tree step runs through it
PAYLOAD_FILES = ("ddtree_v2_seams.py", "ddtree_args.py", "ddtree_verify_graphs.py")

# beyond this venv, what the driven modules import (0.5.23's parse needs neither, its runtime needs tvm_ffi)
RUNTIME_NEEDS = {"0.5.17": ("xgrammar", "tvm_ffi"), "0.5.23": ("tvm_ffi",)}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=sorted(V2_BASES))
def observed(request, tmp_path_factory) -> dict:
    base = V2_BASES[request.param]
    extra = extra_path(*RUNTIME_NEEDS[base.version])
    site = wheel_site(base.version, tmp_path_factory, PAYLOAD_FILES, needs=RUNTIME_NEEDS[base.version])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG", "DDTREE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *extra])
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=site)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == base.version
    return out


UPSTREAM_WIDTHS = {"method_target": 16, "method_draft": 16, "eagle_target": 4, "resolve_target": 16,
                   "resolve_draft": 16, "runner_target": 16, "runner_draft": 16}


def test_settings_follow_the_flags(observed: dict) -> None:
    assert observed["settings_fixed"] == {"block_size": 16, "verify_width": 64}  # budget 63
    assert observed["settings_auto"] == {"block_size": 16, "verify_width": 96}  # auto: its largest tree
    assert observed["settings_shadow"] is None  # only full mode turns the seams on


def test_inactive_seams_answer_upstreams_answers(observed: dict) -> None:
    """Installed but not activated (and activated then deactivated): everything is upstream's, which the
    same code gave before any hook was installed."""
    pristine = observed["pristine"]
    assert pristine["widths"] == UPSTREAM_WIDTHS
    assert pristine["policy"] == ["TritonAttnBackend", False]  # upstream captures triton verify maskless
    assert pristine["mask"] == observed["mask_numel"]["block"]
    assert pristine["reserve"]["allocated"] == [42, 72, 200]  # max(held, committed + 2 x block)
    for phase in ("installed_inactive", "deactivated"):
        got = observed[phase]
        for key in ("widths", "policy", "mask"):
            assert got[key] == pristine[key], (phase, key)
        assert {**got["reserve"], "class": None} == {**pristine["reserve"], "class": None}
    assert observed["registered"] == dict.fromkeys(observed["registered"], 1)  # install() is once per process


def test_verify_width_is_the_tree_for_the_target_only(observed: dict) -> None:
    """Every reader the CUDA-graph capture width comes from (the method, `resolve_num_tokens_per_req`,
    `ModelRunner.decode_num_tokens_per_req`) gives 1 + budget for the target; the draft keeps its block, and
    another algorithm is untouched."""
    w = observed["active"]["widths"]
    assert w == {**UPSTREAM_WIDTHS, "method_target": 64, "resolve_target": 64, "runner_target": 64}
    narrow = observed["active_narrow"]["widths"]  # a budget under the block narrows the verify as well
    assert narrow == {**UPSTREAM_WIDTHS, "method_target": 8, "resolve_target": 8, "runner_target": 8}


def test_verify_graphs_get_a_tree_sized_mask(observed: dict) -> None:
    active, numel = observed["active"], observed["mask_numel"]
    assert active["policy"] == ["TritonAttnBackend", True]
    assert active["mask"] == numel["tree"] > numel["block"]  # max_bs x 64 x (context + 64) cells
    assert active["mask_draft_runner"] is None  # the draft runner has none, as upstream
    assert observed["active_narrow"]["mask"] == numel["block"]  # never below upstream's


def test_reservation_holds_the_step_in_flight_and_the_tree(observed: dict) -> None:
    """The real `prepare_for_decode` and `alloc_for_spec_decode` with SGLang's CPU allocator and pool: each
    request ends holding max(held, committed + block + 1 + budget), in fresh distinct slots written after
    what it held, and upstream records that as the reservation."""
    got = observed["active"]["reserve"]
    assert got["class"] == "DDTreeDraftInputV2"
    assert got["allocated"] == [10 + 80, 40 + 80, 200] == got["recorded"]
    assert got["recorded_sum"] == sum(got["allocated"])
    assert got["taken"] == got["new_slots"] == 80 + 48 and got["new_slots_distinct_fresh"]
    assert got["old_rows_kept"] == [True, True, True]
    assert got["seq_lens_cpu"] == [10, 40, 5]  # upstream's committed seed, unchanged
    assert observed["active"]["reserve_twice"] == got  # a second step at the same lengths takes nothing
    assert observed["active"]["reserve_plain_class"]["allocated"] == [42, 72, 200]  # only the subclass reserves
    # a tree smaller than the block: upstream's 2 x block is already more
    assert observed["active_narrow"]["reserve"]["allocated"] == [42, 72, 200]


def test_paged_reservation_rounds_as_the_base_does(observed: dict) -> None:
    cur, nxt, needed = observed["paged_lens"]
    assert cur == [10, 72, 200]
    if observed["version"] == "0.5.17":  # 0.5.17 reserves unrounded lengths; its paged allocator rounds
        assert nxt == [90, 120, 200] and needed == 128
    else:  # 0.5.23: page_aligned_decode_alloc_lens, whole pages of 4
        assert nxt == [92, 120, 200] and needed == 130


def test_auto_ladder_captures_each_width_through_the_seams(observed: dict) -> None:
    """Auto's verify-graph ladder as the v2 tree step captures it (`capture_verify_ladder` with the v2 runner names
    and the seams' `set_capture_width`): each narrower runner takes its width from the real
    `ModelRunner.decode_num_tokens_per_req`, so through the seams' hook; the triton backend's graph buffers and its
    tree-sized verify mask are the widest set's, not re-made per capture; afterwards the hook answers the seams'
    width again and the backend's `init_cuda_graph_state` is the class's (hooked) method again."""
    got = observed["ladder"]
    assert got["existing_width"] == 64 and got["widths"] == [16, 32, 64]
    assert got["captured"] == {"16": 16, "32": 32, "64": 64}
    assert got["timed"] == sorted(f"{w}x{bs}" for w in (16, 32, 64) for bs in (1, 2, 4))
    assert got["width_for"] == {str(n): 16 if n <= 16 else 32 if n <= 32 else 64 for n in range(1, 65)}
    assert got["installed"] == 16
    assert got["after"] == {"runner_restored": True, "buffers_kept": True, "mask": observed["mask_numel"]["tree"],
                            "init_is_the_class_method": True, "target_width": 64}
    assert observed["ladder_width_after"] == observed["active"]["widths"]  # nothing of the capture width stays


def test_a_failed_ladder_capture_leaves_the_seams_one_set(observed: dict) -> None:
    got = observed["ladder_failed"]
    assert "failed (stand-in)" in got["error"] and "widths" not in got
    assert got["after"] == {"runner_restored": True, "buffers_kept": True, "mask": observed["mask_numel"]["tree"],
                            "init_is_the_class_method": True, "target_width": 64}

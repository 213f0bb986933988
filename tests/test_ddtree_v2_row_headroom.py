"""The `req_to_token` row headroom on SGLang 0.5.17 and 0.5.23 (`ddtree_v2_args`' hook on
`allocation_sizing.get_req_to_token_extra_context_len`): at page size 1 upstream makes each row
`context + 4 + max_speculative_num_draft_tokens` long while its v2 DFLASH worker reserves `committed + 2 x block`
(the tree worker `committed + block + 1 + budget`). Near the context limit the reservation's slots land in the
next request's row and the release never frees them: on the H200 every 0.5.17 speculative server died of the idle
pool check, 2 slots for each request that finished 8 short of the limit. Here SGLang's own `prepare_for_decode`
and `alloc_for_spec_decode` reproduce those 2 slots on the CPU with upstream's rows, and lose none with the
rows the hook makes once SGLang's `load_plugins()` applies it (tests/sglang_scripts/v2_row_headroom_cases.py).
0.5.23 has the same arithmetic behind a different signature (no argument: it reads the published bags); the
same hook serves both. CPU; skipped when a wheel, xgrammar or tvm_ffi cannot be had (see test_payload_v2.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_payload_v2 import site_report, wheel_site

SCRIPT = Path(__file__).parent / "sglang_scripts" / "v2_row_headroom_cases.py"
PAYLOAD_FILES = ("ddtree_v2_args.py", "ddtree_args.py", "ddtree_v2_seams.py", "ddtree_verify_graphs.py")  # v2_seams_cases imports the ladder
CONTEXT = 96  # the script's context length

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["0.5.17", "0.5.23"])
def observed(request, tmp_path_factory) -> dict:
    site = wheel_site(request.param, tmp_path_factory, PAYLOAD_FILES)
    out = site_report(site, SCRIPT, version=request.param, timeout=300)
    assert out["version"] == request.param and out["registered"]
    return out


def test_hook_sizes_each_dflash_row_for_its_reservation(observed: dict) -> None:
    """Upstream's rows at page size 1: 4 + the largest verify width. With the hook a DFLASH server's rows hold
    4 + its reservation (2 x block; a tree's block + 1 + budget, auto's largest; plus a page's rounding); other
    algorithms keep upstream's answer."""
    assert observed["upstream"] == {"dflash": 20, "tree64": 69, "tree_auto": 132, "shadow": 20, "paged4": 35,
                                    "eagle": 20, "none": 4}
    assert observed["hooked"] == {"dflash": 4 + 32, "tree64": 4 + 16 + 65, "tree_auto": 4 + 16 + 128,
                                  "shadow": 4 + 32, "paged4": 4 + 32 + 3, "eagle": 20, "none": 4}
    # the pool builder imports the function by name: SGLang's registry rebinds that name too
    assert observed["configurator_upstream"] and observed["configurator_rebound"]


@pytest.mark.parametrize("algo", ["dflash", "tree64"])
def test_upstream_rows_lose_slots_near_the_limit_and_hooked_rows_lose_none(observed: dict, algo: str) -> None:
    """One decode step's reservation for a request at `committed` (CONTEXT - 10: the last step of a request that
    finishes 8 short of the limit, as the H200's limits workload did): upstream's row is too short, 2 slots land
    in the neighbour's row (overwriting its prompt's slots) and the release's slice of the row never frees them —
    the 2 per request the H200 counted. Far from the limit nothing is lost; with the hook nothing is lost anywhere."""
    up, hooked = observed["upstream_spills"], observed["hooked_spills"]
    far, near, last = (f"{algo}@{CONTEXT - d}" for d in (40, 10, 2))
    assert up[far]["lost"] == 0 and up[far]["neighbour_intact"]
    assert up[near]["lost"] == 2 and not up[near]["neighbour_intact"]
    assert up[last]["lost"] == 10 and not up[last]["neighbour_intact"]
    taken = 32 if algo == "dflash" else 16 + 65
    for key in (far, near, last):
        got = hooked[key]
        assert got["taken"] == taken and got["lost"] == 0 and got["neighbour_intact"], (key, got)
        assert got["allocated"] <= got["row_len"]

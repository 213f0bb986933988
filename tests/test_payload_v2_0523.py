"""The payload for SGLang 0.5.23 (the v2 DFLASH worker), server-args half: built against the real
`sglang==0.5.23` wheel's RECORD, installed into an unpacked copy of the wheel, and the DDTree flags
parsed and validated by 0.5.23's own parser and resolution hooks (CPU; skipped when the wheel cannot be had).

Needs nothing beyond this venv to import 0.5.23's `server_args` and parse. Running its real
`resolve_once` needs `tvm_ffi` (apache-tvm-ffi==0.1.11, which the venv lacks): that one case runs when
$DDTREE_TEST_SGLANG23_EXTRA names a directory holding it (e.g. `pip install --no-deps --target DIR
apache-tvm-ffi==0.1.11`), and is skipped otherwise.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ddtree_ops import bundle as B

VERSION = "0.5.23"
SPEC = "sglang/srt/arg_groups/fields/spec.py"
FIXED_TIME = "2026-01-01T00:00:00Z"
SCRIPT = Path(__file__).parent / "sglang_scripts" / "server_args_cases_v2.py"
DFLASH = ["--model-path", "dummy", "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "dummy"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel() -> Path:
    try:
        return B.download_wheel("sglang", VERSION)
    except B.BundleError as e:
        pytest.skip(f"no sglang {VERSION} wheel available: {e}")


@pytest.fixture(scope="module")
def built(wheel: Path, tmp_path_factory) -> B.BuildResult:
    return B.build_bundle(None, tmp_path_factory.mktemp("dist"), wheel=wheel, base=VERSION, build_time=FIXED_TIME)


@pytest.fixture(scope="module")
def unpacked(wheel: Path, tmp_path_factory) -> Path:
    """The wheel's files unpacked as pip lays them out (pristine; copies are hard-linked from it, and both
    installers replace a file by renaming a new one over it, so this tree is never written)."""
    site = tmp_path_factory.mktemp("pristine23")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


def _copy(unpacked: Path, dest: Path) -> Path:
    subprocess.run(["cp", "-al", str(unpacked), str(dest)], check=True)
    return dest


@pytest.fixture(scope="module")
def site(unpacked: Path, built: B.BuildResult, tmp_path_factory) -> Path:
    """A copy of the unpacked wheel with the bundle installed over it."""
    site = _copy(unpacked, tmp_path_factory.mktemp("site23") / "site-packages")
    B.install_bundle(built.bundle_path, site)
    return site


def test_builds_against_the_real_record(built: B.BuildResult, wheel: Path) -> None:
    m = built.manifest
    assert (m.base_package, m.base_version) == ("sglang", VERSION)
    assert built.bundle_path.name == f"ddtree-payload-{m.payload_version}-sglang{VERSION}.tar.gz"
    with zipfile.ZipFile(wheel) as z:
        record = B.parse_record(z.read(f"sglang-{VERSION}.dist-info/RECORD").decode())
    assert [f.path for f in m.patched_files] == [SPEC]
    assert m.patched_files[0].pristine_sha256 == record[SPEC]
    _, files = B.read_bundle(built.bundle_path)
    shared_root = B.PAYLOAD_DIR
    for f in m.new_files:
        assert f.path not in record
        own = shared_root / "bases" / VERSION / f.path
        src = own if own.is_file() else shared_root / f.path
        assert files[f.path] == src.read_bytes(), f.path
    names = {Path(f.path).name for f in m.new_files}
    assert {"ddtree_args.py", "ddtree_utils.py", "ddtree_v2_args.py"} <= names
    assert "ddtree_worker.py" not in names  # v1 glue: imports what 0.5.23 moved
    # every base's payload carries the algorithm's one version
    assert m.payload_version == json.loads((B.PAYLOAD_DIR / "payload.json").read_text())["version"]


def test_the_field_patch_is_small_and_additive() -> None:
    text = (B.PAYLOAD_DIR / "bases" / VERSION / "patches" / "arg_groups_fields_spec.patch").read_text()
    fps = B.parse_unified_diff(text, "arg_groups_fields_spec.patch")
    added = [body for fp in fps for h in fp.hunks for tag, body in h.lines if tag == "+"]
    assert not [1 for fp in fps for h in fp.hunks for tag, _ in h.lines if tag == "-"]
    assert len(added) <= 12
    assert sum("speculative_ddtree_" in line for line in added) == 6


def test_installed_tree_is_the_wheel_but_the_patched_file(site: Path, built: B.BuildResult) -> None:
    assert B.check_tree_against_record(site, "sglang", VERSION, ignore=[SPEC]) == []
    assert hashlib.sha256((site / SPEC).read_bytes()).hexdigest() == built.manifest.patched_files[0].sha256


def test_agent_pushes_and_rolls_back_the_bundle_on_the_0523_tree(unpacked: Path, built: B.BuildResult,
                                                                  tmp_path: Path) -> None:
    """The host agent, as push drives it: plan (0.5.23 found, nothing refused), install, no-op re-plan,
    rollback to pristine: the tree is the wheel's again, byte for byte."""
    from tests.release_fixtures import run_agent

    site = _copy(unpacked, tmp_path / "site-packages")
    base = {"state_dir": str(tmp_path / "state"), "sys_path": [str(site)], "operator": "tester"}
    manifest = json.loads(B.verify_bundle(built.bundle_path).model_dump_json())
    plan = run_agent("plan", {**base, "manifest": manifest})
    assert plan["ok"], plan
    assert plan["result"]["base_version"] == VERSION and not plan["result"]["refusals"]
    staged = run_agent("stage_begin", {**base, "name": built.bundle_path.name, "size": built.bundle_path.stat().st_size})
    assert staged["ok"], staged
    Path(staged["result"]["path"]).write_bytes(built.bundle_path.read_bytes())
    done = run_agent("install", {**base, "bundle": built.bundle_path.name, "bundle_sha256": built.bundle_sha256})
    assert done["ok"], done
    for f in [*built.manifest.patched_files, *built.manifest.new_files]:
        assert hashlib.sha256((site / f.path).read_bytes()).hexdigest() == f.sha256, f.path
    assert run_agent("plan", {**base, "manifest": manifest})["result"]["noop"]
    back = run_agent("rollback", {**base, "to": "pristine"})
    assert back["ok"], back
    assert B.check_tree_against_record(site, "sglang", VERSION) == []
    assert not [f.path for f in built.manifest.new_files if (site / f.path).exists()]


def _cases(site: Path, tmp_path: Path, cases: list[dict], extra: str | None = None) -> dict[str, dict]:
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG", "DDTREE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([extra] if extra else []))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            out[doc["name"]] = doc
    assert set(out) == {c["name"] for c in cases}, proc.stderr[-3000:]
    return out


def test_0523_parses_and_validates_the_ddtree_flags(site: Path, tmp_path: Path) -> None:
    cases = [
        {"name": "plain", "argv": DFLASH},
        {"name": "shadow", "argv": [*DFLASH, "--speculative-ddtree-mode", "shadow-linear",
                                    "--speculative-ddtree-budget", "31", "--speculative-ddtree-topk-cap", "4"]},
        {"name": "auto", "argv": [*DFLASH, "--speculative-num-draft-tokens", "8", "--speculative-ddtree-mode",
                                  "shadow-linear", "--speculative-ddtree-budget", "auto",
                                  "--speculative-ddtree-budget-max", "63", "--speculative-ddtree-keep-chain"]},
        {"name": "auto default max", "argv": [*DFLASH, "--speculative-ddtree-mode", "shadow-linear",
                                              "--speculative-ddtree-budget", "AUTO"]},
        {"name": "default budget", "argv": [*DFLASH, "--speculative-num-draft-tokens", "8",
                                            "--speculative-ddtree-mode", "shadow-linear"]},
        {"name": "full refused", "argv": [*DFLASH, "--speculative-ddtree-mode", "full",
                                          "--speculative-ddtree-budget", "15"]},
        {"name": "no dflash", "argv": ["--model-path", "dummy", "--speculative-ddtree-mode", "shadow-linear"]},
        {"name": "budget too big", "argv": [*DFLASH, "--speculative-ddtree-mode", "shadow-linear",
                                            "--speculative-ddtree-budget", "513"]},
        {"name": "budget max without auto", "argv": [*DFLASH, "--speculative-ddtree-mode", "shadow-linear",
                                                     "--speculative-ddtree-budget", "15",
                                                     "--speculative-ddtree-budget-max", "63"]},
        {"name": "bad mode", "argv": [*DFLASH, "--speculative-ddtree-mode", "wide"]},
        {"name": "mode off with budget", "argv": [*DFLASH, "--speculative-ddtree-budget", "15"]},
        {"name": "hybrid flag", "argv": [*DFLASH, "--speculative-ddtree-mode", "shadow-linear",
                                         "--speculative-ddtree-allow-hybrid-unsafe"]},
        {"name": "cap over budget", "argv": [*DFLASH, "--speculative-ddtree-mode", "shadow-linear",
                                             "--speculative-ddtree-budget", "7", "--speculative-ddtree-topk-cap", "8"]},
        {"name": "budget max not int", "argv": [*DFLASH, "--speculative-ddtree-budget-max", "lots"]},
    ]
    r = _cases(site, tmp_path, cases)
    assert r["plain"]["ok"] and r["plain"]["speculative_ddtree_mode"] == "off"
    assert r["plain"]["speculative_ddtree_budget"] is None
    shadow = r["shadow"]
    assert shadow["ok"] and shadow["raw"]["speculative_ddtree_budget"] == "31"  # the raw input is kept as typed
    assert (shadow["speculative_ddtree_mode"], shadow["speculative_ddtree_budget"],
            shadow["speculative_ddtree_topk_cap"]) == ("shadow-linear", 31, 4)
    auto = r["auto"]
    assert auto["ok"], auto
    assert (auto["speculative_ddtree_budget"], auto["speculative_ddtree_budget_max"],
            auto["speculative_ddtree_keep_chain"]) == ("auto", 63, True)
    assert r["auto default max"]["speculative_ddtree_budget"] == "auto"
    assert r["auto default max"]["speculative_ddtree_budget_max"] == 127
    assert r["default budget"]["speculative_ddtree_budget"] == 7  # block 8 - 1
    full = r["full refused"]
    assert not full["ok"] and "full is not available yet on SGLang 0.5.23" in full["error"]
    assert "shadow-linear" in full["error"]
    for name, words in {"no dflash": ["requires --speculative-algorithm DFLASH"],
                        "budget too big": ["--speculative-ddtree-budget must be in 1..512", "513"],
                        "budget max without auto": ["--speculative-ddtree-budget-max", "auto"],
                        "bad mode": ["--speculative-ddtree-mode must be one of off, shadow-linear, full", "wide"],
                        "mode off with budget": ["no effect with --speculative-ddtree-mode off"],
                        "hybrid flag": ["--speculative-ddtree-allow-hybrid-unsafe", "shadow-linear"],
                        "cap over budget": ["--speculative-ddtree-topk-cap must be in 1..7"]}.items():
        assert not r[name]["ok"], (name, r[name])
        assert all(w in r[name]["error"] for w in words), (name, r[name]["error"])
        assert r[name]["error"].startswith(("DDTreeConfigError", "DDTreeV2NotAvailable")), r[name]["error"]
    assert not r["budget max not int"]["ok"] and r["budget max not int"]["exit"] == 2  # argparse: int


def test_0523_resolve_once_refuses_full_mode(site: Path, tmp_path: Path) -> None:
    """The real resolution pipeline (dummy model, CPU) reaches the payload's early step."""
    extra = os.environ.get("DDTREE_TEST_SGLANG23_EXTRA")
    if importlib.util.find_spec("tvm_ffi") is None and not extra:
        pytest.skip("0.5.23's resolve_once imports tvm_ffi (apache-tvm-ffi==0.1.11), which this venv lacks; "
                    "set DDTREE_TEST_SGLANG23_EXTRA to a directory holding it")
    cpu = [*DFLASH, "--device", "cpu"]
    r = _cases(site, tmp_path, [
        {"name": "full", "argv": [*cpu, "--speculative-ddtree-mode", "full"], "resolve": True},
        {"name": "shadow", "argv": [*cpu, "--speculative-ddtree-mode", "shadow-linear"], "resolve": True},
    ], extra)
    assert not r["full"]["ok"] and "full is not available yet on SGLang 0.5.23" in r["full"]["error"]
    assert r["shadow"]["ok"] and r["shadow"]["speculative_ddtree_mode"] == "shadow-linear", r["shadow"]


def test_agent_smoke_runs_the_v2_checks_on_the_0523_tree(site: Path, built: B.BuildResult, tmp_path: Path) -> None:
    """`smoke` on a 0.5.23 host: every installed DDTree module imports, the flags are parsed by 0.5.23's own
    parser and validated through its resolution hook (shadow-linear accepted, full refused with the payload's
    "not available yet", bad values refused naming their flag), and the CPU self-test of the tree builder."""
    from tests.release_fixtures import run_agent

    modules = sorted(f.path[:-3].replace("/", ".") for f in [*built.manifest.patched_files, *built.manifest.new_files]
                     if f.path.endswith(".py"))
    answer = run_agent("smoke", {"state_dir": str(tmp_path / "state"), "sys_path": [str(site)], "modules": modules,
                                 "timeout_s": 500}, timeout=1600)
    assert answer["ok"], answer
    r = answer["result"]
    steps = {s["name"]: s for s in r["steps"]}
    assert r["passed"], {n: (s["detail"], s["output"][-1500:]) for n, s in steps.items() if not s["passed"]}
    assert (r["sglang_version"], r["worker"]) == (VERSION, "v2")
    imported = steps["import"]["detail"]
    assert set(imported) >= {*modules, "sglang.srt.speculative.ddtree_v2_args"}
    missing = {m: v["missing_dependency"] for m, v in imported.items() if not v.get("ok") or v.get("missing_dependency")}
    print("missing dependencies (not the payload):", missing)
    assert not [m for m in missing if missing[m] is None], missing
    cases = {c["case"]: c for c in steps["server_args"]["detail"]}
    assert cases["shadow-linear, defaults"]["ok"] and cases["shadow-linear, budget auto, maximum 63"]["ok"]
    full = cases["full (not available yet on this base)"]
    assert full["ok"] and "full is not available yet on SGLang 0.5.23" in full["detail"], full
    assert all(c["ok"] for c in cases.values()), cases
    assert all(c["ok"] for c in steps["tree"]["detail"])


def test_ddtree_args_reads_the_servers_args_through_0523s_runtime_context(site: Path, tmp_path: Path) -> None:
    """0.5.23 retired get_global_server_args (RuntimeError, set or not): the shared ddtree_args reads the
    runtime context instead, None before a server set it."""
    code = r"""
import json
from sglang.srt.speculative import ddtree_args as a
out = {"unset": a.running_server_args() is None, "rule_unset": a.sampling_rule()}
from sglang.srt.server_args import prepare_server_args
from sglang.srt import runtime_context
sa = prepare_server_args(["--model-path", "dummy", "--sampling-backend", "flashinfer"])
runtime_context._CONTEXT.set_server_args(sa)
out["set"] = a.running_server_args() is sa
out["rule_set"] = a.sampling_rule()
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG", "DDTREE"))}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"unset": True, "rule_unset": "pytorch", "set": True, "rule_set": "flashinfer"}, out

"""The payloads for the v2 DFLASH worker's bases, SGLang 0.5.17 and 0.5.23 (server-args half): each built against
the real wheel's RECORD, installed into an unpacked copy of the wheel, and the DDTree flags parsed and validated by
that SGLang's own parser and resolution (CPU; skipped when the wheel cannot be had).

What each base needs beyond this venv: 0.5.17's `server_args` imports `xgrammar` (0.2.1, which imports
`tvm_ffi`) at module import, so everything that parses there needs both; 0.5.23 parses without them and only its
real `resolve_once` imports `tvm_ffi`. They come from $DDTREE_TEST_SGLANG_V2_EXTRA, a directory holding
apache-tvm-ffi==0.1.11 and xgrammar==0.2.1 (`pip install --no-deps --target DIR ...`; scripts/install.sh makes
.venv/sglang-v2-extra); a case that needs them is skipped without it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddtree_ops import bundle as B

FIXED_TIME = "2026-01-01T00:00:00Z"
SCRIPT = Path(__file__).parent / "sglang_scripts" / "server_args_cases_v2.py"
DFLASH_FLAGS = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "dummy"]
# full mode on a v2 base: served where its tree step passed the GPU proof (ddtree_v2_args.PROVEN_TREE_BASES), under
# its proof switch where the step exists but ran on the CPU only (TREE_STEP_BASES)
TREE_STEP_BASES = ("0.5.17", "0.5.23")
PROVEN_TREE_BASES = ("0.5.17",)
PROOF_SWITCH = {"SGLANG_DDTREE_TEST_V2_TREE": "1", "SGLANG_DDTREE_ALLOW_TEST_SWITCHES": "1"}

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class V2Base:
    version: str
    patched: str  # the file its field patch changes
    patch: str  # the field patch, under bases/<version>/patches/
    needs: tuple[str, ...]  # modules beyond this venv that importing its server_args needs
    kernels: tuple[str, ...] = ()  # files its other patches change (0.5.17: the GDN tree kernels, as on v1)

    @property
    def all_patched(self) -> list[str]:
        return sorted([self.patched, *self.kernels])


V2_BASES = {
    "0.5.17": V2Base("0.5.17", "sglang/srt/server_args.py", "server_args.patch", ("xgrammar", "tvm_ffi"),
                     ("sglang/kernels/ops/attention/fla/fused_sigmoid_gating_recurrent.py",
                      "sglang/kernels/ops/mamba/causal_conv1d_triton.py")),
    "0.5.23": V2Base("0.5.23", "sglang/srt/arg_groups/fields/spec.py", "arg_groups_fields_spec.patch", ()),
}


def extra_path(*modules: str) -> list[str]:
    """The directories that make `modules` importable in a child (none needed when this venv has them); skips
    the test when they cannot be had."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return []
    extra = os.environ.get("DDTREE_TEST_SGLANG_V2_EXTRA")
    if extra and all((Path(extra) / m).is_dir() for m in missing):
        return [extra]
    pytest.skip(f"needs {', '.join(missing)} (apache-tvm-ffi==0.1.11, xgrammar==0.2.1), which this venv lacks; "
                "set DDTREE_TEST_SGLANG_V2_EXTRA to a directory holding them")


def wheel_site(version: str, tmp_path_factory, payload_modules: tuple[str, ...] = (),
               needs: tuple[str, ...] = ("xgrammar", "tvm_ffi")) -> Path:
    """SGLang `version`'s wheel unpacked (its `sglang/` tree), with these payload modules of `sglang/srt/speculative/`
    copied beside upstream's; skips the test when the wheel or the modules it `needs` cannot be had."""
    extra_path(*needs)
    try:
        wheel = B.download_wheel("sglang", version)
    except B.BundleError as e:
        pytest.skip(f"no sglang {version} wheel available: {e}")
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site, members=[n for n in z.namelist() if n.startswith("sglang/")])
    for name in payload_modules:
        shutil.copyfile(B.PAYLOAD_DIR / "sglang/srt/speculative" / name, site / "sglang/srt/speculative" / name)
    return site


def run_in_site(site: Path, args: list[str], env_add: dict[str, str] | None = None,
                timeout: int = 600) -> subprocess.CompletedProcess:
    """`python args` in an unpacked SGLang tree: the tree and xgrammar / tvm_ffi on PYTHONPATH, none of this
    process's PYTHON* / SGLANG* / DDTREE* / TRITON* variables, `env_add` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG", "DDTREE", "TRITON"))}
    env.update(env_add or {})
    env["PYTHONPATH"] = os.pathsep.join([str(site), *extra_path("xgrammar", "tvm_ffi")])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=site)


def site_report(site: Path, script: Path, env_add: dict[str, str] | None = None, *, version: str,
                timeout: int = 600) -> dict:
    """The JSON object a case script prints last, run by `run_in_site`; it must succeed on SGLang `version`."""
    proc = run_in_site(site, [str(script)], env_add, timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == version
    return out


@pytest.fixture(scope="module", params=sorted(V2_BASES))
def base(request) -> V2Base:
    return V2_BASES[request.param]


@pytest.fixture(scope="module")
def wheel(base: V2Base) -> Path:
    try:
        return B.download_wheel("sglang", base.version)
    except B.BundleError as e:
        pytest.skip(f"no sglang {base.version} wheel available: {e}")


@pytest.fixture(scope="module")
def built(base: V2Base, wheel: Path, tmp_path_factory) -> B.BuildResult:
    return B.build_bundle(None, tmp_path_factory.mktemp("dist"), wheel=wheel, base=base.version,
                          build_time=FIXED_TIME)


@pytest.fixture(scope="module")
def unpacked(wheel: Path, tmp_path_factory) -> Path:
    """The wheel's files unpacked as pip lays them out (pristine; copies are hard-linked from it, and both
    installers replace a file by renaming a new one over it, so this tree is never written)."""
    site = tmp_path_factory.mktemp("pristine")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


def _copy(unpacked: Path, dest: Path) -> Path:
    subprocess.run(["cp", "-al", str(unpacked), str(dest)], check=True)
    return dest


@pytest.fixture(scope="module")
def site(unpacked: Path, built: B.BuildResult, tmp_path_factory) -> Path:
    """A copy of the unpacked wheel with the bundle installed over it."""
    site = _copy(unpacked, tmp_path_factory.mktemp("site") / "site-packages")
    B.install_bundle(built.bundle_path, site)
    return site


def test_builds_against_the_real_record(base: V2Base, built: B.BuildResult, wheel: Path) -> None:
    m = built.manifest
    assert (m.base_package, m.base_version) == ("sglang", base.version)
    assert built.bundle_path.name == f"ddtree-payload-{m.payload_version}-sglang{base.version}.tar.gz"
    with zipfile.ZipFile(wheel) as z:
        record = B.parse_record(z.read(f"sglang-{base.version}.dist-info/RECORD").decode())
    assert [f.path for f in m.patched_files] == base.all_patched
    assert all(f.pristine_sha256 == record[f.path] for f in m.patched_files)
    _, files = B.read_bundle(built.bundle_path)
    shared_root = B.PAYLOAD_DIR
    for f in m.new_files:
        assert f.path not in record
        own = shared_root / "bases" / base.version / f.path
        src = own if own.is_file() else shared_root / f.path
        assert files[f.path] == src.read_bytes(), f.path
    names = {Path(f.path).name for f in m.new_files}
    assert {"ddtree_args.py", "ddtree_utils.py", "ddtree_v2_args.py"} <= names
    assert "ddtree_worker.py" not in names  # v1 glue: imports what the v2 bases moved
    # every base's payload carries the algorithm's one version
    assert m.payload_version == json.loads((B.PAYLOAD_DIR / "payload.json").read_text())["version"]


def _v2_fields() -> tuple[str, ...]:
    """The DDTree fields, from the shared ddtree_args (loaded from its file: it imports nothing of sglang)."""
    path = B.PAYLOAD_DIR / "sglang/srt/speculative/ddtree_args.py"
    spec = importlib.util.spec_from_file_location("ddtree_args_fields", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FIELDS


def test_the_field_patch_is_small_and_additive(base: V2Base) -> None:
    text = (B.PAYLOAD_DIR / "bases" / base.version / "patches" / base.patch).read_text()
    fps = B.parse_unified_diff(text, base.patch)
    added = [body for fp in fps for h in fp.hunks for tag, body in h.lines if tag == "+"]
    assert not [1 for fp in fps for h in fp.hunks for tag, _ in h.lines if tag == "-"]
    assert len(added) <= 12
    fields = [line.split(":")[0].strip() for line in added if line.lstrip().startswith("speculative_ddtree_")]
    assert sorted(fields) == sorted(_v2_fields()), fields


def test_installed_tree_is_the_wheel_but_the_patched_file(base: V2Base, site: Path, built: B.BuildResult) -> None:
    assert B.check_tree_against_record(site, "sglang", base.version, ignore=base.all_patched) == []
    for f in built.manifest.patched_files:
        assert hashlib.sha256((site / f.path).read_bytes()).hexdigest() == f.sha256, f.path


def test_agent_pushes_and_rolls_back_the_bundle_on_the_wheels_tree(base: V2Base, unpacked: Path,
                                                                    built: B.BuildResult, tmp_path: Path) -> None:
    """The host agent, as push drives it: plan (the base found, nothing refused), install, no-op re-plan,
    rollback to pristine: the tree is the wheel's again, byte for byte."""
    from tests.release_fixtures import run_agent

    site = _copy(unpacked, tmp_path / "site-packages")
    req = {"state_dir": str(tmp_path / "state"), "sys_path": [str(site)], "operator": "tester"}
    manifest = json.loads(B.verify_bundle(built.bundle_path).model_dump_json())
    plan = run_agent("plan", {**req, "manifest": manifest})
    assert plan["ok"], plan
    assert plan["result"]["base_version"] == base.version and not plan["result"]["refusals"]
    staged = run_agent("stage_begin", {**req, "name": built.bundle_path.name, "size": built.bundle_path.stat().st_size})
    assert staged["ok"], staged
    Path(staged["result"]["path"]).write_bytes(built.bundle_path.read_bytes())
    done = run_agent("install", {**req, "bundle": built.bundle_path.name, "bundle_sha256": built.bundle_sha256})
    assert done["ok"], done
    for f in [*built.manifest.patched_files, *built.manifest.new_files]:
        assert hashlib.sha256((site / f.path).read_bytes()).hexdigest() == f.sha256, f.path
    assert run_agent("plan", {**req, "manifest": manifest})["result"]["noop"]
    back = run_agent("rollback", {**req, "to": "pristine"})
    assert back["ok"], back
    assert B.check_tree_against_record(site, "sglang", base.version) == []
    assert not [f.path for f in built.manifest.new_files if (site / f.path).exists()]


def _cases(site: Path, tmp_path: Path, cases: list[dict], extra: list[str]) -> dict[str, dict]:
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG", "DDTREE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *extra])
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


def model_args(base: V2Base, tmp_path: Path) -> list[str]:
    """The model a parse case names. 0.5.23's stand-in step runs whatever the model; 0.5.17's __post_init__ returns
    before the speculative step for a dummy model, so it parses a tiny config on the CPU (as smoke does)."""
    if base.version == "0.5.23":
        return ["--model-path", "dummy"]
    from ddtree_ops.agent.remote.smoke import TINY_CONFIG

    model = tmp_path / "tiny-qwen3"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    return ["--model-path", str(model), "--device", "cpu"]


def test_parses_and_validates_the_ddtree_flags(base: V2Base, site: Path, tmp_path: Path) -> None:
    model = model_args(base, tmp_path)
    dflash = [*model, *DFLASH_FLAGS]
    cases = [
        {"name": "plain", "argv": dflash},
        {"name": "shadow", "argv": [*dflash, "--speculative-ddtree-mode", "shadow-linear",
                                    "--speculative-ddtree-budget", "31", "--speculative-ddtree-topk-cap", "4"]},
        {"name": "auto", "argv": [*dflash, "--speculative-num-draft-tokens", "8", "--speculative-ddtree-mode",
                                  "shadow-linear", "--speculative-ddtree-budget", "auto",
                                  "--speculative-ddtree-budget-max", "63", "--speculative-ddtree-keep-chain"]},
        {"name": "auto default max", "argv": [*dflash, "--speculative-ddtree-mode", "shadow-linear",
                                              "--speculative-ddtree-budget", "AUTO"]},
        {"name": "default budget", "argv": [*dflash, "--speculative-num-draft-tokens", "8",
                                            "--speculative-ddtree-mode", "shadow-linear"]},
        {"name": "full", "argv": [*dflash, "--speculative-ddtree-mode", "full", "--speculative-ddtree-budget", "15",
                                  "--attention-backend", "triton", "--disable-overlap-schedule"]},
        {"name": "full proof switch", "argv": [*dflash, "--speculative-ddtree-mode", "full",
                                               "--speculative-ddtree-budget", "15", "--attention-backend", "triton",
                                               "--disable-overlap-schedule"], "env": PROOF_SWITCH},
        {"name": "full switch without allow", "argv": [*dflash, "--speculative-ddtree-mode", "full"],
         "env": {"SGLANG_DDTREE_TEST_V2_TREE": "1"}},
        {"name": "no dflash", "argv": [*model, "--speculative-ddtree-mode", "shadow-linear"]},
        {"name": "budget too big", "argv": [*dflash, "--speculative-ddtree-mode", "shadow-linear",
                                            "--speculative-ddtree-budget", "513"]},
        {"name": "budget max without auto", "argv": [*dflash, "--speculative-ddtree-mode", "shadow-linear",
                                                     "--speculative-ddtree-budget", "15",
                                                     "--speculative-ddtree-budget-max", "63"]},
        {"name": "bad mode", "argv": [*dflash, "--speculative-ddtree-mode", "wide"]},
        {"name": "mode off with budget", "argv": [*dflash, "--speculative-ddtree-budget", "15"]},
        {"name": "hybrid flag", "argv": [*dflash, "--speculative-ddtree-mode", "shadow-linear",
                                         "--speculative-ddtree-allow-hybrid-unsafe"]},
        {"name": "cap over budget", "argv": [*dflash, "--speculative-ddtree-mode", "shadow-linear",
                                             "--speculative-ddtree-budget", "7", "--speculative-ddtree-topk-cap", "8"]},
        {"name": "budget max not int", "argv": [*dflash, "--speculative-ddtree-budget-max", "lots"]},
    ]
    r = _cases(site, tmp_path, cases, extra_path(*base.needs))
    assert r["plain"]["ok"] and r["plain"]["speculative_ddtree_mode"] == "off"
    assert r["plain"]["speculative_ddtree_budget"] is None
    shadow = r["shadow"]
    assert shadow["ok"], shadow
    if base.version == "0.5.23":
        assert shadow["raw"]["speculative_ddtree_budget"] == "31"  # the raw input is kept as typed
    assert (shadow["speculative_ddtree_mode"], shadow["speculative_ddtree_budget"],
            shadow["speculative_ddtree_topk_cap"]) == ("shadow-linear", 31, 4)
    auto = r["auto"]
    assert auto["ok"], auto
    assert (auto["speculative_ddtree_budget"], auto["speculative_ddtree_budget_max"],
            auto["speculative_ddtree_keep_chain"]) == ("auto", 63, True)
    assert r["auto default max"]["speculative_ddtree_budget"] == "auto"
    assert r["auto default max"]["speculative_ddtree_budget_max"] == 127
    assert r["default budget"]["speculative_ddtree_budget"] == 7  # block 8 - 1
    full = r["full"]
    if base.version in PROVEN_TREE_BASES:  # served without any switch
        assert full["ok"] and (full["speculative_ddtree_mode"], full["speculative_ddtree_budget"]) == ("full", 15), full
    else:
        assert not full["ok"] and f"full is not available yet on SGLang {base.version}" in full["error"]
        assert "shadow-linear" in full["error"]
    proof, no_allow = r["full proof switch"], r["full switch without allow"]
    if base.version in TREE_STEP_BASES:  # the v2 tree step exists there: the proof's servers take full mode
        assert proof["ok"], proof
        assert (proof["speculative_ddtree_mode"], proof["speculative_ddtree_budget"]) == ("full", 15)
        # a test switch without the allow switch is refused on every base, proven or not
        assert not no_allow["ok"] and "SGLANG_DDTREE_ALLOW_TEST_SWITCHES=1" in no_allow["error"], no_allow
        assert "SGLANG_DDTREE_TEST_V2_TREE=1 is a test switch" in no_allow["error"]
    else:  # no tree step: refused whatever the switches
        for got in (proof, no_allow):
            assert not got["ok"] and f"full is not available yet on SGLang {base.version}" in got["error"], got
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


def test_dflash_rows_hold_the_v2_reservation(base: V2Base, site: Path, tmp_path: Path) -> None:
    """The installed payload's row-headroom hook (tests/test_ddtree_v2_row_headroom.py says why) on each base's
    real path: args parsed by SGLang's parser, on 0.5.23 published into the runtime context's bags, the pool
    builder's own name after `load_plugins()`. Upstream would say 4 + block for every DFLASH server."""
    model = [*model_args(base, tmp_path), "--page-size", "1"]  # resolve_once (not run here) would default it
    dflash = [*model, *DFLASH_FLAGS]
    r = _cases(site, tmp_path, [
        {"name": "off", "argv": dflash, "headroom": True},
        {"name": "shadow", "argv": [*dflash, "--speculative-num-draft-tokens", "8", "--speculative-ddtree-mode",
                                    "shadow-linear", "--speculative-ddtree-budget", "31"], "headroom": True},
        {"name": "no speculation", "argv": model, "headroom": True},
    ], extra_path(*base.needs, "tvm_ffi"))
    assert {name: got.get("headroom", got) for name, got in r.items()} == \
        {"off": 4 + 2 * 16, "shadow": 4 + 2 * 8, "no speculation": 4}


SHADOW_REFUSAL_CASES = r"""
import json, sys
from types import SimpleNamespace
from sglang.srt.speculative import ddtree_v2_args as glue
hybrid, dense, untracked = sys.argv[1], sys.argv[2], sys.argv[3] == "untracked"
if untracked:  # the refusal a base whose own DFLASH tracks no recurrent state would get (none ships so now)
    glue.UNTRACKED_HYBRID_RADIX_BASES = (glue.base_version(),)
cases = {
    "hybrid, radix on": dict(model_path=hybrid, disable_radix_cache=False),
    "hybrid, radix off": dict(model_path=hybrid, disable_radix_cache=True),
    "hybrid, mode off": dict(model_path=hybrid, disable_radix_cache=False, speculative_ddtree_mode="off"),
    "dense, radix on": dict(model_path=dense, disable_radix_cache=False),
    "hub id": dict(model_path="Qwen/Qwen3.5-35B-A3B", disable_radix_cache=False),
}
out = {}
for name, args in cases.items():
    sa = SimpleNamespace(**{"speculative_ddtree_mode": "shadow-linear", **args})
    try:
        glue._check(SimpleNamespace(**{**vars(sa), "speculative_algorithm": "DFLASH", "speculative_ddtree_budget": None,
                                       "speculative_ddtree_budget_max": None, "speculative_ddtree_topk_cap": None,
                                       "speculative_ddtree_keep_chain": False,
                                       "speculative_ddtree_allow_hybrid_unsafe": False,
                                       "speculative_num_draft_tokens": 16}))
        out[name] = None
    except ValueError as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def test_shadow_linear_is_refused_only_where_upstreams_hybrid_radix_tracking_is_broken(
        base: V2Base, site: Path, tmp_path: Path) -> None:
    """shadow-linear serves upstream's own DFLASH steps. On a base whose DFLASH tracks no recurrent state for the
    radix cache even with the payload's hooks (ddtree_v2_args.UNTRACKED_HYBRID_RADIX_BASES), a hybrid target with the
    radix cache is refused unless --disable-radix-cache, through the checks both bases' resolution runs. None is so
    now: 0.5.17's gaps are closed by the payload's hooks (0.8.14; the radix-cache run passed on a GPU), so every base
    serves it as shipped; the refusal is checked with the base marked untracked."""
    from ddtree_ops.agent.remote.smoke import TINY_CONFIG

    hybrid, dense = tmp_path / "qwen35", tmp_path / "qwen3"
    for path, config in ((hybrid, {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]}),
                         (dense, TINY_CONFIG)):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    got = {}
    for marking in ("shipped", "untracked"):
        proc = run_in_site(site, ["-c", SHADOW_REFUSAL_CASES, str(hybrid), str(dense), marking])
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[marking] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["shipped"] == dict.fromkeys(got["shipped"]), got["shipped"]
    refused = got["untracked"].pop("hybrid, radix on")
    assert got["untracked"] == dict.fromkeys(got["untracked"]), got["untracked"]  # the others are served
    assert refused and refused.startswith("DDTreeConfigError") and "--disable-radix-cache" in refused, refused
    assert "shadow-linear" in refused and "Qwen3.5" in refused


SHADOW_CHECK_CASES = r"""
import json, sys
sys.path.insert(0, sys.argv[1])  # the agent's module, as the host runs it (stdlib only), beside this base's tree
from ddtree_ops.agent.remote.units import shadow_mode_check
hybrid, dense = sys.argv[2:4]
print(json.dumps({f"{name}, radix {'off' if off else 'on'}": shadow_mode_check(path, off)
                  for name, path in (("hybrid", hybrid), ("dense", dense)) for off in (False, True)}))
"""


def test_promotes_shadow_linear_check_gives_the_servers_verdict(base: V2Base, site: Path, tmp_path: Path) -> None:
    """promote's pre-check before a shadow-linear unit (units.shadow_mode_check, run by unit_inspect on the host) asks
    the installed glue: this payload serves shadow-linear on every base, hybrid or dense, radix cache or not (an
    older payload's glue that refuses is turned into a refusal by rollout, tests/test_rollout.py)."""
    from ddtree_ops.agent.remote.smoke import TINY_CONFIG

    hybrid, dense = tmp_path / "qwen35", tmp_path / "qwen3"
    for path, config in ((hybrid, {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]}),
                         (dense, TINY_CONFIG)):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    repo = Path(__file__).resolve().parents[1]
    proc = run_in_site(site, ["-c", SHADOW_CHECK_CASES, str(repo), str(hybrid), str(dense)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got) == 4 and got == dict.fromkeys(got, {"checked": True, "refusal": None}), got


RADIX_STRATEGY_CASES = r"""
import argparse, contextlib, io, json, re
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.ddtree_args import check_hybrid_full_mode

def parsed(flags):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return parser.parse_args(["--model-path", "m", *flags])
    except SystemExit:
        return None

def refusal(args):
    try:
        check_hybrid_full_mode(args)
    except Exception as exc:
        return str(exc)

out = {}
for flags in ([], ["--mamba-scheduler-strategy", "no_buffer"], ["--mamba-radix-cache-strategy", "no_buffer"],
              ["--mamba-scheduler-strategy", "extra_buffer"], ["--mamba-radix-cache-strategy", "extra_buffer"]):
    args = parsed(flags)
    said = None if args is None else refusal(args)
    advised = re.search(r"(--mamba-[a-z-]+) extra_buffer", said or "")
    # the advice taken: the flag the refusal names, parsed by this base and checked again
    retry = advised and parsed([advised.group(1), "extra_buffer"])
    out[" ".join(flags)] = {"parses": args is not None, "refusal": said,
                            "advice": retry and {"parses": True, "refusal": refusal(retry)}
                            if advised else None}
print(json.dumps(out))
"""


def test_the_radix_strategy_flag_reaches_the_hybrid_full_mode_check(base: V2Base, site: Path) -> None:
    """The radix-cache tracking strategy as each base's own parser stores it (0.5.17: --mamba-scheduler-strategy a
    deprecated alias of --mamba-radix-cache-strategy; 0.5.23: the old flag gone) reaches check_hybrid_full_mode:
    `extra_buffer` by either spelling the base parses is served, anything else refused, and the refusal names a flag
    this base parses which, given `extra_buffer`, is served. (On the H200 the check read the old field only and
    refused 0.5.17's `extra_buffer` as None.)"""
    proc = run_in_site(site, ["-c", RADIX_STRATEGY_CASES])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    old_flag = base.version == "0.5.17"
    assert {k: v["parses"] for k, v in got.items()} == {
        "": True, "--mamba-radix-cache-strategy no_buffer": True, "--mamba-radix-cache-strategy extra_buffer": True,
        "--mamba-scheduler-strategy no_buffer": old_flag, "--mamba-scheduler-strategy extra_buffer": old_flag}
    for flags, case in got.items():
        if not case["parses"]:
            continue
        if flags.endswith("extra_buffer"):
            assert case["refusal"] is None, (flags, case)
        else:
            assert case["refusal"] and case["advice"] == {"parses": True, "refusal": None}, (flags, case)
            assert "--mamba-radix-cache-strategy extra_buffer" in case["refusal"], case


def test_promotes_full_mode_probe_gives_the_bases_own_verdict(base: V2Base, site: Path) -> None:
    """promote's pre-check before a full-mode unit (units.BASE_MODE_PROBE, run where the glue is installed): 0.5.23
    refuses full mode whatever the target; 0.5.17 serves dense targets and the GDN hybrids proven on its worker, and
    refuses an unproven architecture (Qwen3.6) with the words its worker would use."""
    from ddtree_ops.agent.remote.smoke import TINY_CONFIG
    from ddtree_ops.agent.remote.units import BASE_MODE_PROBE

    configs = {"dense": TINY_CONFIG,
               "qwen3.5": {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]},
               "qwen3.5-moe": {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"]},
               "qwen3-next": {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]},
               "qwen3.6-moe": {"model_type": "qwen3_6_moe", "architectures": ["Qwen3_6MoeForConditionalGeneration"]}}
    got = {}
    for name, config in configs.items():
        proc = run_in_site(site, ["-c", BASE_MODE_PROBE, json.dumps(config)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[name] = json.loads(proc.stdout.strip().splitlines()[-1])["refusal"]
    if base.version in PROVEN_TREE_BASES:
        unproven = got.pop("qwen3.6-moe")
        assert got == dict.fromkeys(["dense", "qwen3.5", "qwen3.5-moe", "qwen3-next"]), got
        # the worker's own words (ddtree_v2_hybrid.kind_refusal)
        assert unproven and "qwen3.6-moe" in unproven and "shadow-linear" in unproven, unproven
    else:
        assert all(v and f"full is not available yet on SGLang {base.version}" in v for v in got.values()), got


def test_the_real_resolution_checks_full_mode(base: V2Base, site: Path, tmp_path: Path) -> None:
    """The base's real resolution (dummy model, CPU: 0.5.23's resolve_once, 0.5.17's __post_init__) reaches the
    payload's early step before its dummy-model return: full mode refused where it is not served."""
    cpu = ["--model-path", "dummy", *DFLASH_FLAGS, "--device", "cpu"]
    r = _cases(site, tmp_path, [
        {"name": "full", "argv": [*cpu, "--speculative-ddtree-mode", "full"], "resolve": True},
        {"name": "full switch without allow", "argv": [*cpu, "--speculative-ddtree-mode", "full"], "resolve": True,
         "env": {"SGLANG_DDTREE_TEST_V2_TREE": "1"}},
        {"name": "shadow", "argv": [*cpu, "--speculative-ddtree-mode", "shadow-linear"], "resolve": True},
    ], extra_path(*base.needs, "tvm_ffi"))
    assert r["shadow"]["ok"] and r["shadow"]["speculative_ddtree_mode"] == "shadow-linear", r["shadow"]
    no_allow = r["full switch without allow"]
    if base.version in PROVEN_TREE_BASES:  # served: the switch changes nothing (check_post_init refuses it, above)
        assert r["full"]["ok"] and no_allow["ok"], r
        return
    assert not r["full"]["ok"] and f"full is not available yet on SGLang {base.version}" in r["full"]["error"]
    # the dummy-model return comes before check_post_init: the early refusal checks the allow switch itself
    want = "SGLANG_DDTREE_ALLOW_TEST_SWITCHES=1" if base.version in TREE_STEP_BASES else "full is not available yet"
    assert not no_allow["ok"] and want in no_allow["error"], no_allow


def test_agent_smoke_runs_the_v2_checks(base: V2Base, site: Path, built: B.BuildResult, tmp_path: Path) -> None:
    """`smoke` on a host of the base: every installed DDTree module imports, the flags are parsed by that SGLang's
    own parser and validated where it resolves (shadow-linear accepted, full accepted where it is served and refused
    elsewhere with the payload's "not available yet", bad values refused naming their flag), and the CPU self-test
    of the tree builder."""
    from tests.release_fixtures import run_agent

    modules = sorted(f.path[:-3].replace("/", ".") for f in [*built.manifest.patched_files, *built.manifest.new_files]
                     if f.path.endswith(".py"))
    sys_path = [str(site), *extra_path(*base.needs)]
    answer = run_agent("smoke", {"state_dir": str(tmp_path / "state"), "sys_path": sys_path, "modules": modules,
                                 "timeout_s": 500}, timeout=1600)
    assert answer["ok"], answer
    r = answer["result"]
    steps = {s["name"]: s for s in r["steps"]}
    assert r["passed"], {n: (s["detail"], s["output"][-1500:]) for n, s in steps.items() if not s["passed"]}
    assert (r["sglang_version"], r["worker"]) == (base.version, "v2")
    imported = steps["import"]["detail"]
    assert set(imported) >= {*modules, "sglang.srt.speculative.ddtree_v2_args"}
    missing = {m: v["missing_dependency"] for m, v in imported.items() if not v.get("ok") or v.get("missing_dependency")}
    print("missing dependencies (not the payload):", missing)
    assert not [m for m in missing if missing[m] is None], missing
    cases = {c["case"]: c for c in steps["server_args"]["detail"]}
    assert cases["shadow-linear, defaults"]["ok"] and cases["shadow-linear, budget auto, maximum 63"]["ok"]
    if base.version in PROVEN_TREE_BASES:
        assert cases["full (served on this base)"]["ok"], cases
    else:
        full = cases["full (not available yet on this base)"]
        assert full["ok"] and f"full is not available yet on SGLang {base.version}" in full["detail"], full
    assert all(c["ok"] for c in cases.values()), cases
    assert all(c["ok"] for c in steps["tree"]["detail"])


# How a server publishes its ServerArgs on each base (the scheduler's role).
PUBLISH = {
    "0.5.17": "from sglang.srt.server_args import set_global_server_args_for_scheduler as publish",
    "0.5.23": "from sglang.srt import runtime_context\npublish = runtime_context._CONTEXT.set_server_args",
}


def test_ddtree_args_reads_the_running_servers_args(base: V2Base, site: Path, tmp_path: Path) -> None:
    """The shared ddtree_args reads the running server's args on each base, None before a server set them:
    0.5.17 through its legacy accessor (a shim over the runtime context), 0.5.23 through the runtime context
    (it retired get_global_server_args: RuntimeError, set or not)."""
    code = r"""
import json
from sglang.srt.speculative import ddtree_args as a
out = {"unset": a.running_server_args() is None, "rule_unset": a.sampling_rule()}
from sglang.srt.server_args import prepare_server_args
""" + PUBLISH[base.version] + r"""
sa = prepare_server_args(["--model-path", "dummy", "--sampling-backend", "flashinfer"])
publish(sa)
out["set"] = a.running_server_args() is sa
out["rule_set"] = a.sampling_rule()
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG", "DDTREE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *extra_path(*base.needs)])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"unset": True, "rule_unset": "pytorch", "set": True, "rule_set": "flashinfer"}, out

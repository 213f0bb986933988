"""The real payload on a real sglang 0.5.13.post1 tree, locally: install → smoke → rollback.

The tree is a hard-linked copy of the dev venv's sglang (cheap, and install replaces files by
rename, so the venv's own files are never written). Skipped when sglang is not installed.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.release_fixtures import run_agent, sha

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_tree(tmp_path_factory):
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed in this venv")
    if dist.version != "0.5.13.post1":
        pytest.skip(f"needs sglang 0.5.13.post1, found {dist.version}")
    venv_site = Path(dist.locate_file(""))
    # Same filesystem as the venv so `cp -al` can hard-link (tmp may be another fs).
    root = Path(tmp_path_factory.mktemp("real"))
    site = root / "site"
    site.mkdir()
    if subprocess.run(["cp", "-al", str(venv_site / "sglang"), str(site)], capture_output=True).returncode != 0:
        shutil.copytree(venv_site / "sglang", site / "sglang")
    shutil.copytree(venv_site / f"sglang-{dist.version}.dist-info", site / f"sglang-{dist.version}.dist-info")
    from ddtree_ops.bundle import build_bundle

    built = build_bundle(None, root / "dist", site_dir=venv_site)
    return site, built, root / "state"


def test_real_payload_install_smoke_rollback(real_tree):
    site, built, state_dir = real_tree
    from ddtree_ops.bundle import read_bundle

    manifest, files = read_bundle(built.bundle_path)
    rels = sorted(files)
    before = {rel: sha((site / rel).read_bytes()) if (site / rel).exists() else None for rel in rels}
    base = {"state_dir": str(state_dir), "sys_path": [str(site)], "operator": "test"}
    staged = run_agent("stage_begin", {**base, "name": built.bundle_path.name, "size": built.bundle_path.stat().st_size})
    shutil.copyfile(built.bundle_path, staged["result"]["path"])
    ans = run_agent("install", {**base, "bundle": built.bundle_path.name, "bundle_sha256": built.bundle_sha256})
    assert ans["ok"], ans
    assert {rel: sha((site / rel).read_bytes()) for rel in rels} == {rel: sha(files[rel]) for rel in rels}

    smoke = run_agent("smoke", base, timeout=900)
    assert smoke["ok"], smoke
    res = smoke["result"]
    assert res["passed"], [(s["name"], s["detail"], s["output"][-1500:]) for s in res["steps"] if not s["passed"]]
    cases = {c["case"]: c for c in next(s for s in res["steps"] if s["name"] == "server_args")["detail"]}
    assert len(cases) == 14 and all(c["ok"] for c in cases.values())
    assert cases["full, budget auto, maximum 63"]["ok"] and cases["budget maximum without auto"]["ok"]
    assert cases["keep-chain with budget below the depth"]["ok"] and cases["shadow-linear, keep-chain"]["ok"]

    back = run_agent("rollback", {**base, "to": "pristine"})
    assert back["ok"], back
    after = {rel: sha((site / rel).read_bytes()) if (site / rel).exists() else None for rel in rels}
    assert after == before
    # The pristine tree fails the smoke: the DDTree modules are gone again.
    gone = run_agent("smoke", {**base, "steps": ["tree"]}, timeout=300)["result"]
    assert not gone["passed"] and gone["failed_steps"] == ["tree"]

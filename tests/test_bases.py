"""Bundles per SGLang base (issue 26): the registry of bases, the per-base payload layout (shared modules
once), `build --base` / `--all-bases`, and push choosing each host's bundle by its installed SGLang.

The push tests run the real control side, SSH (the in-process server, SFTP included) and the real agent;
each "host" is a venv of its own whose site-packages is a fake SGLang tree of one version.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
import yaml
from ssh_server import LocalSSHServer, write_private_key
from test_cli import cli

from ddtree_ops import bases, release
from ddtree_ops import bundle as B
from ddtree_ops.errors import UsageError
from ddtree_ops.inventory import load_inventory
from tests.release_fixtures import PRISTINE, make_bundle, make_site, sha, site_hashes

FIXED_TIME = "2026-01-01T00:00:00Z"


# ------------------------------------------------------------------------------------- registry
def test_registry_knows_the_three_bases_and_the_default_is_the_v1_payload() -> None:
    assert bases.known_versions() == ["0.5.13.post1", "0.5.17", "0.5.23"]
    assert bases.DEFAULT_BASE == "0.5.13.post1"
    v1 = bases.get_base("0.5.13.post1")
    assert v1.worker == "v1" and v1.descriptor_path(B.PAYLOAD_DIR) == B.PAYLOAD_DIR / "payload.json"
    assert v1.has_payload(B.PAYLOAD_DIR)
    assert {bases.get_base(v).worker for v in ("0.5.17", "0.5.23")} == {"v2"}
    assert all(bases.get_base(v).has_payload(B.PAYLOAD_DIR) for v in bases.known_versions())


def _payload_without(tmp_path: Path, version: str) -> Path:
    """A copy of the shipped payload with one base's descriptor gone (an older or hand-made `--payload` tree)."""
    root = tmp_path / "payload-without"
    shutil.copytree(B.PAYLOAD_DIR, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / bases.get_base(version).descriptor).unlink()
    return root


def test_unknown_base_names_the_known_ones() -> None:
    with pytest.raises(bases.UnknownBaseError) as err:
        bases.get_base("0.5.14")
    assert isinstance(err.value, UsageError) and "0.5.14" in err.value.message
    assert all(v in err.value.hint for v in bases.known_versions())
    assert bases.find_base("0.5.14") is None and bases.find_base(None) is None


def test_base_without_payload_says_why_and_which_have_one(tmp_path: Path) -> None:
    root = _payload_without(tmp_path, "0.5.17")
    with pytest.raises(bases.NoPayloadError) as err:
        bases.base_with_payload("0.5.17", root)
    assert "0.5.17" in err.value.message and "bases/0.5.17/payload.json is missing" in err.value.message
    assert "0.5.13.post1" in err.value.hint and "0.5.23" in err.value.hint
    with pytest.raises(bases.NoPayloadError):
        B.load_payload(root, "0.5.17")


def test_host_base_labels(tmp_path: Path) -> None:
    assert bases.host_base("0.5.13.post1")["label"] == "0.5.13.post1 v1"
    assert bases.host_base("0.5.17") == {"version": "0.5.17", "known": True, "worker": "v2", "payload": True,
                                         "label": "0.5.17 v2"}
    assert bases.host_base("0.5.17", _payload_without(tmp_path, "0.5.17"))["label"] == "0.5.17 v2 (no payload)"
    assert bases.host_base("0.5.14")["label"] == "0.5.14 (unknown base)" and not bases.host_base("0.5.14")["known"]
    assert bases.host_base(None)["label"] == "absent"


def test_status_row_shows_the_sglang_base() -> None:
    from ddtree_ops.facts import with_payload_base
    from ddtree_ops.fleet import HostResult
    from ddtree_ops.inventory import HostConfig
    from ddtree_ops.output import status_row

    results = with_payload_base([HostResult("a", "ok", data={"sglang": {"version": "0.5.17"}}),
                                 HostResult("b", "ok", data={"sglang": None})])
    assert results[0].data["payload_base"]["worker"] == "v2"
    rows = [status_row(HostConfig(name=r.host, address="10.0.0.1"), r) for r in results]
    assert [r["sglang"] for r in rows] == ["0.5.17 v2", "absent"]


def test_every_algorithm_module_exists_once() -> None:
    """Shared modules live in the payload root only: no base directory carries a second copy. A base's own glue
    may share its installed name with another base's glue (each v2 base's `ddtree_worker_v2.py` adapter, which
    `ddtree_v2_args` imports by that name), never with a shared module."""
    files = [p for p in B.PAYLOAD_DIR.rglob("ddtree_*.py") if "__pycache__" not in p.parts]
    root = B.PAYLOAD_DIR / "bases"
    shared = [p.name for p in files if root not in p.parents]
    assert len(shared) == len(set(shared)), sorted(shared)
    for base_dir in root.iterdir():
        glue = [p.name for p in files if base_dir in p.parents]
        assert len(glue) == len(set(glue)) and not set(glue) & set(shared), (base_dir.name, sorted(glue))
    version = B.load_payload()[1].version
    for b in bases.BASES:
        if b.has_payload(B.PAYLOAD_DIR):
            assert B.load_payload(None, b.version)[1].version == version, b.version  # one algorithm version
            for rel, src in B.payload_sources(None, b.version).items():
                if Path(rel).name in ("ddtree_utils.py", "ddtree_args.py"):
                    assert src == B.PAYLOAD_DIR / rel, (b.version, rel, src)


# ------------------------------------------------------------------------------------- layout
def _fake_wheel(out: Path, version: str, files: dict[str, bytes]) -> Path:
    """A wheel with a RECORD, as pip download gives: enough for WheelSource."""
    info = f"sglang-{version}.dist-info"
    rows = [f"{rel},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).decode().rstrip('=')},{len(d)}"
            for rel, d in files.items()]
    path = out / f"sglang-{version}-py3-none-any.whl"
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for rel, data in files.items():
            z.writestr(rel, data)
        z.writestr(f"{info}/RECORD", "\n".join([*rows, f"{info}/RECORD,,"]) + "\n")
    return path


SPEC_PY = b"".join(f"line {i}\n".encode() for i in range(1, 11))
SPEC_PATCH = """--- a/sglang/srt/arg_groups/fields/spec.py
+++ b/sglang/srt/arg_groups/fields/spec.py
@@ -3,6 +3,7 @@
 line 3
 line 4
 line 5
+ddtree field
 line 6
 line 7
 line 8
"""


def _payload_with_a_v2_base(tmp_path: Path, version: str = "0.5.17") -> Path:
    """A copy of the shipped payload plus a v2 base descriptor: one patch, one glue file, two shared modules."""
    root = tmp_path / "payload"
    shutil.copytree(B.PAYLOAD_DIR, root, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(root / "bases" / version, ignore_errors=True)
    d = root / "bases" / version
    (d / "patches").mkdir(parents=True)
    (d / "patches" / "spec.patch").write_text(SPEC_PATCH)
    glue = d / "sglang/srt/speculative/ddtree_glue_v2.py"
    glue.parent.mkdir(parents=True)
    glue.write_text("# v2 glue\n")
    (d / "payload.json").write_text(json.dumps({
        "version": "0.8.0", "base_package": "sglang", "base_version": version,
        "patches": [{"file": "patches/spec.patch", "targets": ["sglang/srt/arg_groups/fields/spec.py"]}],
        "new_files": ["sglang/srt/speculative/ddtree_glue_v2.py"],
        "shared": ["sglang/srt/speculative/ddtree_utils.py", "sglang/srt/speculative/ddtree_args.py"]}))
    return root


def test_v2_base_builds_shared_modules_from_the_one_copy(tmp_path: Path) -> None:
    root = _payload_with_a_v2_base(tmp_path)
    wheel = _fake_wheel(tmp_path / "w", "0.5.17", {"sglang/srt/arg_groups/fields/spec.py": SPEC_PY})
    built = B.build_bundle(root, tmp_path / "dist", wheel=wheel, base="0.5.17", build_time=FIXED_TIME)
    m = built.manifest
    assert m.base_version == "0.5.17" and built.bundle_path.name == "ddtree-payload-0.8.0-sglang0.5.17.tar.gz"
    assert [f.path for f in m.patched_files] == ["sglang/srt/arg_groups/fields/spec.py"]
    assert m.patched_files[0].pristine_sha256 == sha(SPEC_PY)
    _, files = B.read_bundle(built.bundle_path)
    assert b"ddtree field\nline 6\n" in files["sglang/srt/arg_groups/fields/spec.py"]
    for rel in ("sglang/srt/speculative/ddtree_utils.py", "sglang/srt/speculative/ddtree_args.py"):
        assert files[rel] == (root / rel).read_bytes()  # the shared tree's bytes
    assert files["sglang/srt/speculative/ddtree_glue_v2.py"] == b"# v2 glue\n"
    assert "sglang/srt/speculative/ddtree_worker.py" not in files  # v1 glue stays with v1


def test_default_base_bundle_is_the_same_with_and_without_base(tmp_path: Path) -> None:
    from tests.payload_helpers import real_wheel

    wheel = real_wheel()
    plain = B.build_bundle(None, tmp_path / "a", wheel=wheel, build_time=FIXED_TIME)
    named = B.build_bundle(None, tmp_path / "b", wheel=wheel, build_time=FIXED_TIME, base="0.5.13.post1")
    assert plain.bundle_path.read_bytes() == named.bundle_path.read_bytes()
    assert plain.bundle_path.name == named.bundle_path.name


@pytest.mark.parametrize("case", ["copy of a shared file", "wrong base_version", "shared file missing"])
def test_v2_descriptor_refusals(tmp_path: Path, case: str) -> None:
    root = _payload_with_a_v2_base(tmp_path)
    d = root / "bases/0.5.17"
    desc = json.loads((d / "payload.json").read_text())
    if case == "copy of a shared file":
        shutil.copy(root / "sglang/srt/speculative/ddtree_utils.py", d / "sglang/srt/speculative/ddtree_utils.py")
        desc["new_files"].append("sglang/srt/speculative/ddtree_utils.py")
        expect = "listed both"
    elif case == "wrong base_version":
        desc["base_version"] = "0.5.23"
        expect = "not 0.5.17"
    else:
        desc["shared"].append("sglang/srt/speculative/ddtree_nothing.py")
        expect = "ddtree_nothing.py"
    (d / "payload.json").write_text(json.dumps(desc))
    with pytest.raises(B.BundleError) as err:
        B.load_payload(root, "0.5.17")
    assert expect in err.value.message


def test_v2_copy_of_a_shared_module_under_the_base_is_refused(tmp_path: Path) -> None:
    root = _payload_with_a_v2_base(tmp_path)
    d = root / "bases/0.5.17"
    shutil.copy(root / "sglang/srt/speculative/ddtree_utils.py", d / "sglang/srt/speculative/ddtree_utils.py")
    with pytest.raises(B.BundleError) as err:
        B.load_payload(root, "0.5.17")
    assert "also has a copy" in err.value.message


# ------------------------------------------------------------------------------------- build CLI
def test_build_base_unknown_and_without_payload_are_usage_errors(tmp_path: Path) -> None:
    unknown = cli("build", "--base", "0.5.14", "--out", str(tmp_path / "o"), "--json")
    assert unknown.returncode == 2, unknown.stderr
    err = json.loads(unknown.stdout)["error"]
    assert err["code"] == "unknown_base" and "0.5.14" in err["message"]
    assert "0.5.13.post1" in err["hint"] and "0.5.17" in err["hint"] and "0.5.23" in err["hint"]
    pending = cli("build", "--base", "0.5.17", "--payload", str(_payload_without(tmp_path, "0.5.17")), "--out",
                  str(tmp_path / "o"))
    assert pending.returncode == 2 and "no payload for SGLang 0.5.17 yet" in pending.stderr
    assert not (tmp_path / "o").exists()
    both = cli("build", "--all-bases", "--base", "0.5.17", "--out", str(tmp_path / "o"))
    assert both.returncode == 2 and "--base" in both.stderr
    verify = cli("build", "--verify", str(tmp_path / "x.tar.gz"), "--base", "0.5.23")
    assert verify.returncode == 2


def test_build_base_from_a_v2_payload(tmp_path: Path) -> None:
    root = _payload_with_a_v2_base(tmp_path)
    wheel = _fake_wheel(tmp_path / "w", "0.5.17", {"sglang/srt/arg_groups/fields/spec.py": SPEC_PY})
    out = cli("build", "--base", "0.5.17", "--payload", str(root), "--wheel", str(wheel), "--out",
              str(tmp_path / "dist"), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["manifest"]["base_version"] == "0.5.17" and doc["bundle"].endswith("-sglang0.5.17.tar.gz")


def test_build_all_bases_says_which_have_no_payload(tmp_path: Path) -> None:
    from tests.payload_helpers import real_wheel

    real_wheel()  # skip here when the default base's wheel cannot be had
    root = _payload_without(tmp_path, "0.5.17")
    out = cli("build", "--all-bases", "--payload", str(root), "--out", str(tmp_path / "dist"), "--json")
    doc = json.loads(out.stdout)
    rows = {r["base"]: r for r in doc["bases"]}
    assert list(rows) == bases.known_versions()
    assert rows["0.5.13.post1"]["built"] and Path(rows["0.5.13.post1"]["bundle"]).is_file()
    assert not rows["0.5.17"]["built"] and rows["0.5.17"]["reason"].startswith("no payload yet:")
    for v, r in rows.items():
        has = bases.get_base(v).has_payload(root)
        assert r["built"] or not has or "error" in r, r
        assert r["built"] or r["reason"]
    assert out.returncode == (1 if any("error" in r for r in rows.values()) else 0), out.stderr
    text = cli("build", "--all-bases", "--payload", str(root), "--out", str(tmp_path / "dist2"))
    assert "0.5.17 (v2 worker): not built: no payload yet" in " ".join(text.stdout.split())


# ------------------------------------------------------------------------------------- bundle sets
def _local(path: Path) -> release.LocalBundle:
    return release.LocalBundle.load(path)


def test_bundle_set_refuses_two_bundles_for_one_base(tmp_path: Path) -> None:
    a = make_bundle(tmp_path / "a", "1.0.0", tag="a")
    b = make_bundle(tmp_path / "b", "1.0.1", tag="b")
    with pytest.raises(UsageError) as err:
        release.BundleSet.of([_local(a.path), _local(b.path)])
    assert err.value.code == "bundle_base_twice" and "0.5.13.post1" in err.value.message


def test_bundle_set_picks_by_base_and_refuses_with_the_bases(tmp_path: Path) -> None:
    v1 = make_bundle(tmp_path / "d", "1.0.0", tag="v1")
    v2 = make_bundle(tmp_path / "d", "1.0.0", tag="v23", base_version="0.5.23")
    s = release.BundleSet.of([_local(v2.path), _local(v1.path)])
    assert s.bases == ["0.5.13.post1", "0.5.23"]
    assert s.for_base("0.5.23").path == v2.path and s.for_base("0.5.13.post1").path == v1.path
    assert s.for_base("0.5.17") is None
    pending = s.refusal("gpu-7", "0.5.17")
    assert pending["code"] == "wrong_version" and "gpu-7" in pending["message"] and "0.5.17" in pending["message"]
    assert "0.5.13.post1, 0.5.23" in pending["message"] and "build --base 0.5.17" in pending["hint"]
    only_v1 = release.BundleSet.of([_local(v1.path)])
    assert "build --base 0.5.23" in only_v1.refusal("gpu-9", "0.5.23")["hint"]
    unknown = s.refusal("gpu-8", "0.5.14")
    assert "not a base ddtree-ops knows" in unknown["hint"] and "0.5.23" in unknown["hint"]


def test_load_bundles_takes_the_newest_of_each_base_from_a_directory(tmp_path: Path) -> None:
    d = tmp_path / "dist"
    old = make_bundle(d, "1.0.0", tag="old")
    new = make_bundle(d, "1.1.0", tag="new")
    v2 = make_bundle(d, "1.1.0", tag="v23", base_version="0.5.23")
    os.utime(old.path, (1, 1))
    got = release.load_bundles([d])
    assert sorted(b.path for b in got.bundles) == sorted([new.path, v2.path])
    # a file and a directory together; the default is dist/
    single = release.load_bundles([old.path])
    assert [b.path for b in single.bundles] == [old.path]
    with pytest.raises(UsageError) as err:
        release.load_bundles([], dist=tmp_path / "empty")
    assert err.value.code == "bundle_missing"


# ------------------------------------------------------------------------------------- push: a mixed fleet
def _host_python(root: Path, version: str) -> tuple[Path, Path]:
    """A venv whose site-packages is a fake SGLang `version` tree: (its python, its site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True)
    site = next((root / "lib").glob("python3*/site-packages"))
    fake = make_site(root / "fake", version)
    for item in fake.iterdir():
        shutil.move(str(item), site / item.name)
    return root / "bin" / "python", site


@pytest.fixture
def mixed_fleet(tmp_path: Path) -> Iterator[tuple[Path, dict[str, Path]]]:
    """Three hosts over one SSH server: `old` on 0.5.13.post1, `new` on 0.5.23, `odd` on 0.5.14."""
    client_key = paramiko.ECDSAKey.generate()
    server = LocalSSHServer(host_key=paramiko.ECDSAKey.generate(), authorized_key=client_key).start()
    write_private_key(client_key, tmp_path / "id_ecdsa")
    (tmp_path / "known_hosts").write_text(server.known_hosts_line())
    sites, hosts = {}, {}
    for name, version in (("old", "0.5.13.post1"), ("new", "0.5.23"), ("odd", "0.5.14")):
        python, sites[name] = _host_python(tmp_path / f"venv-{name}", version)
        hosts[name] = {"address": "127.0.0.1", "port": server.port, "python": str(python),
                       "state_dir": str(tmp_path / f"state-{name}")}
    inventory = {"all": {"vars": {"identity_file": "id_ecdsa", "known_hosts": "known_hosts", "connect_timeout": 5}},
                 "hosts": hosts}
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(inventory))
    yield tmp_path / "inv.yaml", sites
    server.stop()


def test_push_gives_each_host_the_bundle_of_its_base(mixed_fleet, tmp_path: Path) -> None:
    inv_path, sites = mixed_fleet
    inv = load_inventory(inv_path)
    v1 = make_bundle(tmp_path / "dist", "1.0.0", tag="v1")
    v2 = make_bundle(tmp_path / "dist", "1.0.0", tag="v23", base_version="0.5.23")
    bundles = release.load_bundles([tmp_path / "dist"])
    hosts = inv.select(None)

    dry = {r.host: r for r in release.push(inv, hosts, bundles, dry_run=True)}
    assert dry["old"].ok and dry["old"].data["bundle"]["path"] == str(v1.path)
    assert dry["new"].ok and dry["new"].data["bundle"]["path"] == str(v2.path)
    assert dry["new"].data["bundle"]["host_version"] == "0.5.23" and not dry["new"].data["refusals"]
    assert dry["odd"].ok and dry["odd"].data["bundle"] is None
    assert dry["odd"].data["refusals"][0]["code"] == "wrong_version"
    assert site_hashes(sites["new"], v2.paths) == {rel: sha(PRISTINE.get(rel)) if rel in PRISTINE else None
                                                    for rel in v2.paths}  # a dry run changes nothing

    done = {r.host: r for r in release.push(inv, hosts, bundles)}
    assert done["old"].ok and done["new"].ok, {h: r.to_dict() for h, r in done.items()}
    assert site_hashes(sites["old"], v1.paths) == {rel: sha(v1.patched[rel]) for rel in v1.paths}
    assert site_hashes(sites["new"], v2.paths) == {rel: sha(v2.patched[rel]) for rel in v2.paths}
    assert done["new"].data["bundle"]["base_version"] == "0.5.23"
    odd = done["odd"]
    assert odd.status == "failed" and odd.error.code == "wrong_version"
    assert "odd" in odd.error.message and "0.5.14" in odd.error.message
    assert "0.5.13.post1, 0.5.23" in odd.error.message and "0.5.13.post1" in odd.error.hint
    assert site_hashes(sites["odd"], v1.paths) == {rel: sha(PRISTINE.get(rel)) if rel in PRISTINE else None
                                                    for rel in v1.paths}


def test_push_cli_single_bundle_refuses_the_other_base_and_shows_the_choice(mixed_fleet, tmp_path: Path) -> None:
    inv_path, sites = mixed_fleet
    v2 = make_bundle(tmp_path / "dist", "1.0.0", tag="v23", base_version="0.5.23")
    v1 = make_bundle(tmp_path / "dist", "1.0.0", tag="v1")
    single = cli("push", "-i", str(inv_path), "--bundle", str(v2.path), "--allow-unsigned", "--json")
    assert single.returncode == 1, single.stderr
    doc = json.loads(single.stdout)
    res = {r["host"]: r for r in doc["results"]}
    assert res["new"]["status"] == "ok" and res["new"]["data"]["bundle"]["base_version"] == "0.5.23"
    assert res["old"]["status"] == "failed" and res["old"]["error"]["code"] == "wrong_version"
    assert "0.5.13.post1" in res["old"]["error"]["message"] and "0.5.23" in res["old"]["error"]["message"]
    assert doc["bundle"]["path"] == str(v2.path)  # the single-bundle document keeps its key

    dry = cli("push", "-i", str(inv_path), "--bundle", str(v1.path), "--bundle", str(v2.path), "--dry-run",
              "--allow-unsigned", "--json")
    assert dry.returncode == 0, dry.stderr
    doc = json.loads(dry.stdout)
    assert sorted(b["base_version"] for b in doc["bundles"]) == ["0.5.13.post1", "0.5.23"]
    choice = {r["host"]: (r["data"]["bundle"] or {}).get("path") for r in doc["results"]}
    assert choice == {"old": str(v1.path), "new": str(v2.path), "odd": None}
    text = cli("push", "-i", str(inv_path), "-b", str(v1.path), "-b", str(v2.path), "--dry-run", "--allow-unsigned",
               env={"COLUMNS": "200"})
    flat = " ".join(text.stdout.split())
    assert f"SGLang 0.5.23 → {v2.path.name}" in flat and "SGLang 0.5.14: no bundle" in flat
    assert "odd: SGLang here is 0.5.14; no bundle given for it" in flat


def test_status_json_and_table_show_each_hosts_base(mixed_fleet) -> None:
    inv_path, _ = mixed_fleet
    doc = json.loads(cli("status", "-i", str(inv_path), "--json").stdout)
    labels = {r["host"]: r["data"]["payload_base"]["label"] for r in doc["results"]}
    assert labels == {"old": "0.5.13.post1 v1", "new": "0.5.23 v2", "odd": "0.5.14 (unknown base)"}
    table = cli("status", "-i", str(inv_path), env={"COLUMNS": "250"}).stdout
    assert "SGLang base" in table and "0.5.23 v2" in table and "0.5.14 (unknown base)" in table


def test_smoke_picks_the_checks_of_the_installed_sglangs_worker() -> None:
    from ddtree_ops.agent.remote.smoke import worker_of

    assert worker_of("0.5.13.post1") == "v1" and worker_of("0.5.9") == "v1" and worker_of(None) == "v1"
    assert worker_of("0.5.14") == "v2" and worker_of("0.5.17") == "v2" and worker_of("0.5.23") == "v2"
    assert worker_of("0.6.0rc1") == "v2" and worker_of("0.5.23+cu128") == "v2"

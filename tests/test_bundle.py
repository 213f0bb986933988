"""Payload bundles: build from the real sglang wheel, reproducibility, verify refusals, the strict
unified-diff applier, installing into a tree. No sglang import (fast)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest

from ddtree_ops import bundle as B
from tests.payload_helpers import BASE_VERSION, real_wheel

FIXED_TIME = "2026-01-01T00:00:00Z"


@pytest.fixture(scope="module")
def wheel() -> Path:
    return real_wheel()


@pytest.fixture(scope="module")
def built(wheel, tmp_path_factory) -> B.BuildResult:
    return B.build_bundle(None, tmp_path_factory.mktemp("dist"), wheel=wheel, build_time=FIXED_TIME)


def _record(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as z:
        return B.parse_record(z.read(f"sglang-{BASE_VERSION}.dist-info/RECORD").decode())


def _payload_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "payload"
    shutil.copytree(B.PAYLOAD_DIR, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _rewrite_tar(src: Path, dst: Path, edit) -> None:
    """Copy a bundle member by member, letting `edit(name, data)` change or drop (None) members."""
    out = io.BytesIO()
    with tarfile.open(src, "r:gz") as tin, tarfile.open(fileobj=out, mode="w:gz") as tout:
        for m in tin.getmembers():
            data = tin.extractfile(m).read()
            data = edit(m.name, data)
            if data is None:
                continue
            info = tarfile.TarInfo(m.name)
            info.size = len(data)
            tout.addfile(info, io.BytesIO(data))
    dst.write_bytes(out.getvalue())


# ------------------------------------------------------------------------------------- build
def test_build_from_real_wheel(built, wheel):
    m = built.manifest
    assert (m.payload_name, m.base_package, m.base_version) == ("ddtree-payload", "sglang", BASE_VERSION)
    assert built.bundle_path.name == f"ddtree-payload-{m.payload_version}.tar.gz"
    record = _record(wheel)
    desc = json.loads((B.PAYLOAD_DIR / "payload.json").read_text())
    assert sorted(f.path for f in m.patched_files) == sorted(t for p in desc["patches"] for t in p["targets"])
    assert sorted(f.path for f in m.new_files) == sorted(desc["new_files"])
    for f in m.patched_files:
        assert f.pristine_sha256 == record[f.path], f.path  # checked against the wheel's own RECORD
        assert f.sha256 != f.pristine_sha256
    for f in m.new_files:
        assert f.path not in record
        assert f.sha256 == hashlib.sha256((B.PAYLOAD_DIR / f.path).read_bytes()).hexdigest()
    assert B.verify_bundle(built.bundle_path) == m
    # manifest.json + files/<path> and nothing else
    with tarfile.open(built.bundle_path) as t:
        names = sorted(t.getnames())
    assert names == sorted(["manifest.json"] + [f"files/{p}" for p in m.all_paths()])


def test_patched_files_carry_the_hooks(built):
    _, files = B.read_bundle(built.bundle_path)
    assert b"handle_ddtree_server_args(self)" in files["sglang/srt/server_args.py"]
    assert b"add_ddtree_cli_args(parser)" in files["sglang/srt/server_args.py"]
    worker = files["sglang/srt/speculative/dflash_worker.py"]
    # init, step_start mark (2), on_draft (2), on_verified (2), the hybrid state commit (2)
    assert worker.count(b"self._ddtree") == 9
    assert b'ret["ddtree"] = ddtree.internal_state()' in files["sglang/srt/managers/scheduler.py"]


# The one patch that moves upstream lines instead of only adding to them, and its bound (added, removed): a
# tree's token loop in the conv kernel runs at run time under its own branch (unrolled, a 257-token tree never
# finished compiling); the chain keeps upstream's unrolled loop, and the two share the output store, repeated.
RESTRUCTURING_PATCHES = {"layers_attention_mamba_causal_conv1d_triton.patch": (45, 26)}


def test_patches_are_small_unified_diffs():
    for patch in sorted((B.PAYLOAD_DIR / "patches").glob("*.patch")):
        text = patch.read_text()
        fps = B.parse_unified_diff(text, patch.name)
        added = sum(1 for fp in fps for h in fp.hunks for tag, _ in h.lines if tag == "+")
        removed = sum(1 for fp in fps for h in fp.hunks for tag, _ in h.lines if tag == "-")
        max_added, max_removed = RESTRUCTURING_PATCHES.get(patch.name, (20, 0))
        assert removed <= max_removed and added <= max_added, (patch.name, added, removed)
        for fp in fps:
            for h in fp.hunks:  # the usual 3 lines of context
                assert [t for t, _ in h.lines[:3]] == [" "] * 3 and [t for t, _ in h.lines[-3:]] == [" "] * 3


def test_reproducible_bytes_and_manifest(wheel, built, tmp_path):
    again = B.build_bundle(None, tmp_path / "a", wheel=wheel, build_time=FIXED_TIME)
    assert again.bundle_path.read_bytes() == built.bundle_path.read_bytes()
    later = B.build_bundle(None, tmp_path / "b", wheel=wheel)
    assert later.manifest.build_time != FIXED_TIME
    assert later.manifest.digest_view() == built.manifest.digest_view()


def test_source_date_epoch_fixes_build_time(wheel, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")
    m = B.build_bundle(None, tmp_path, wheel=wheel).manifest
    assert m.build_time == FIXED_TIME


def test_installed_tree_source_equals_wheel(built, wheel, tmp_path):
    site = tmp_path / "site"
    info = f"sglang-{BASE_VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist() if n.startswith(info + "/") or n in
                   {f.path for f in built.manifest.patched_files}]
        z.extractall(site, members)
    m = B.build_bundle(None, tmp_path / "dist", site_dir=site, build_time=FIXED_TIME).manifest
    assert m.digest_view() == built.manifest.digest_view()


def test_exactly_one_pristine_source(wheel, tmp_path):
    with pytest.raises(B.BundleError, match="exactly one"):
        B.build_bundle(None, tmp_path, wheel=wheel, download=True)
    with pytest.raises(B.BundleError, match="exactly one"):
        B.build_bundle(None, tmp_path)


# ------------------------------------------------------------------------------------- refusals
def test_pristine_file_with_wrong_hash_refused(built, wheel, tmp_path):
    site = tmp_path / "site"
    info = f"sglang-{BASE_VERSION}.dist-info"
    target = "sglang/srt/server_args.py"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site, [n for n in z.namelist() if n.startswith(info + "/")] +
                     [f.path for f in built.manifest.patched_files])
    (site / target).write_bytes((site / target).read_bytes() + b"# local edit\n")
    with pytest.raises(B.PristineError) as e:
        B.build_bundle(None, tmp_path / "dist", site_dir=site)
    assert target in str(e.value) and "RECORD" in str(e.value)


def test_wheel_with_tampered_member_refused(built, wheel, tmp_path):
    bad = tmp_path / wheel.name
    target = "sglang/srt/speculative/dflash_worker.py"
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(bad, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == target:
                data = data.replace(b"class DFlashWorker", b"class DFlashWorkr", 1)
            zout.writestr(item, data)
    with pytest.raises(B.PristineError, match="dflash_worker.py.*RECORD"):
        B.build_bundle(None, tmp_path / "dist", wheel=bad)


def test_tampered_bundle_refused(built, tmp_path):
    bad = tmp_path / built.bundle_path.name

    def edit(name, data):
        return data + b"\n# evil\n" if name == "files/sglang/srt/speculative/ddtree_worker.py" else data

    _rewrite_tar(built.bundle_path, bad, edit)
    with pytest.raises(B.BundleError) as e:
        B.verify_bundle(bad)
    assert e.value.code == "bundle_tampered" and "ddtree_worker.py" in str(e.value)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda n, d: None if n.endswith("ddtree_args.py") else d, "missing"),
        (lambda n, d: None if n == "manifest.json" else d, "no manifest.json"),
        (lambda n, d: d.replace(b'"format": 1', b'"format": 9') if n == "manifest.json" else d, "format 9"),
    ],
)
def test_incomplete_bundle_refused(built, tmp_path, edit, match):
    bad = tmp_path / built.bundle_path.name
    _rewrite_tar(built.bundle_path, bad, edit)
    with pytest.raises(B.BundleError, match=match):
        B.verify_bundle(bad)


def test_extra_link_and_unsafe_members_refused(built, tmp_path):
    for kind in ("extra", "symlink", "dotdot"):
        bad = tmp_path / f"{kind}.tar.gz"
        out = io.BytesIO()
        with tarfile.open(built.bundle_path, "r:gz") as tin, tarfile.open(fileobj=out, mode="w:gz") as tout:
            for m in tin.getmembers():
                tout.addfile(m, tin.extractfile(m))
            if kind == "symlink":
                info = tarfile.TarInfo("files/sglang/evil.py")
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tout.addfile(info)
            else:
                name = "files/sglang/extra.py" if kind == "extra" else "files/../../evil.py"
                info = tarfile.TarInfo(name)
                info.size = 1
                tout.addfile(info, io.BytesIO(b"x"))
        bad.write_bytes(out.getvalue())
        with pytest.raises(B.BundleError, match={"extra": "not in the manifest", "symlink": "not a regular file",
                                                   "dotdot": "unsafe"}[kind]):
            B.verify_bundle(bad)


def test_not_a_bundle_refused(tmp_path):
    p = tmp_path / "x.tar.gz"
    p.write_bytes(b"not gzip")
    with pytest.raises(B.BundleError, match="not a readable"):
        B.verify_bundle(p)
    with pytest.raises(B.BundleError, match="not found"):
        B.verify_bundle(tmp_path / "missing.tar.gz")


def test_patch_mismatch_names_patch_hunk_and_target(wheel, tmp_path):
    payload = _payload_copy(tmp_path)
    patch = payload / "patches" / "speculative_dflash_worker.patch"
    text = patch.read_text()
    # Corrupt one context line of the second hunk.
    lines = text.splitlines(keepends=True)
    hunk_starts = [i for i, ln in enumerate(lines) if ln.startswith("@@")]
    i = hunk_starts[1] + 1
    lines[i] = " " + lines[i][1:].rstrip("\n") + "  # not upstream\n"
    patch.write_text("".join(lines))
    with pytest.raises(B.PatchError) as e:
        B.build_bundle(payload, tmp_path / "dist", wheel=wheel)
    msg = str(e.value)
    assert "speculative_dflash_worker.patch" in msg and "hunk #2" in msg
    assert "sglang/srt/speculative/dflash_worker.py" in msg and "does not apply" in msg


def test_unlisted_payload_file_refused(wheel, tmp_path):
    payload = _payload_copy(tmp_path)
    (payload / "sglang/srt/speculative/ddtree_extra.py").write_text("x = 1\n")
    with pytest.raises(B.BundleError, match="not listed.*ddtree_extra.py"):
        B.build_bundle(payload, tmp_path / "dist", wheel=wheel)


def test_new_file_colliding_with_upstream_refused(wheel, tmp_path):
    payload = _payload_copy(tmp_path)
    desc = json.loads((payload / "payload.json").read_text())
    desc["new_files"].append("sglang/srt/speculative/eagle_utils.py")
    (payload / "payload.json").write_text(json.dumps(desc))
    (payload / "sglang/srt/speculative/eagle_utils.py").write_text("x = 1\n")
    with pytest.raises(B.BundleError, match="collides"):
        B.build_bundle(payload, tmp_path / "dist", wheel=wheel)


# ------------------------------------------------------------------------------------- diff applier
def _diff(body: str) -> list[B.FilePatch]:
    return B.parse_unified_diff("--- a/x.py\n+++ b/x.py\n" + body, "t.patch")


def test_applier_insert_replace_and_eof():
    src = b"a\nb\nc\nd\n"
    out = B.apply_file_patch(src, _diff("@@ -1,2 +1,3 @@\n+z\n a\n b\n@@ -3,2 +4,2 @@\n c\n-d\n+e\n")[0])
    assert out == b"z\na\nb\nc\ne\n"
    # pure insertion after line 4 (old_len 0) and a file without a trailing newline
    assert B.apply_file_patch(src, _diff("@@ -4,0 +5,1 @@\n+tail\n")[0]) == b"a\nb\nc\nd\ntail\n"
    nonl = _diff("@@ -1,2 +1,2 @@\n a\n-b\n\\ No newline at end of file\n+B\n\\ No newline at end of file\n")[0]
    assert B.apply_file_patch(b"a\nb", nonl) == b"a\nB"


def test_applier_is_strict():
    fp = _diff("@@ -2,2 +2,3 @@\n b\n+x\n c\n")[0]
    assert B.apply_file_patch(b"a\nb\nc\n", fp) == b"a\nb\nx\nc\n"
    with pytest.raises(B.PatchError, match=r"hunk #1 .* line 2 is 'B'"):
        B.apply_file_patch(b"a\nB\nc\n", fp)  # no fuzz
    with pytest.raises(B.PatchError, match="line 2"):
        B.apply_file_patch(b"z\na\nb\nc\n", fp)  # no offset search: context must sit at its line
    with pytest.raises(B.PatchError, match="file has 1 lines"):
        B.apply_file_patch(b"a\n", fp)


@pytest.mark.parametrize(
    "text, match",
    [
        ("hello\n", "not a unified diff"),
        ("--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,3 @@\n a\n", "truncated"),
        ("--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n?a\n", "not context/removal/addition"),
        ("--- a/x.py\n+++ b/y.py\n@@ -1 +1 @@\n-a\n+b\n", "renames"),
        ("--- /dev/null\n+++ b/x.py\n@@ -0,0 +1 @@\n+a\n", "new_files"),
        ("--- a/../x.py\n+++ b/../x.py\n@@ -1 +1 @@\n-a\n+b\n", "unsafe"),
        ("--- a/x.py\n+++ b/x.py\n", "no hunks"),
    ],
)
def test_malformed_patches_refused(text, match):
    with pytest.raises(B.PatchError, match=match):
        B.parse_unified_diff(text, "t.patch")


def test_record_digest_decoding():
    data = b"hello"
    b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert B.parse_record(f"x.py,sha256={b64},5\ny.dist-info/RECORD,,\n") == {"x.py": hashlib.sha256(data).hexdigest()}


# ------------------------------------------------------------------------------------- install
def test_install_bundle_into_tree(built, wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site, [f.path for f in built.manifest.patched_files])
    m = B.install_bundle(built.bundle_path, site)
    for f in m.patched_files + m.new_files:
        assert hashlib.sha256((site / f.path).read_bytes()).hexdigest() == f.sha256
    B.install_bundle(built.bundle_path, site)  # idempotent
    target = site / m.patched_files[0].path
    target.write_bytes(b"# someone else's edit\n")
    with pytest.raises(B.PristineError, match="neither pristine"):
        B.install_bundle(built.bundle_path, site)

"""Bundle reading on the control side is streamed and capped, and payload paths stay inside the base
package (issue 11). The agent's side of the same rules is in test_state_damage.py."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from ddtree_ops import bundle as B
from tests.release_fixtures import make_bundle

REL = "sglang/srt/speculative/ddtree_big.py"
CAP = 64 * 1024 * 1024  # bundle.MAX_MEMBER, the agent's too


def zero_bundle(tmp_path: Path, size: int) -> Path:
    """A bundle with one new file of `size` zero bytes, its manifest consistent (so only a cap stops it)."""
    data = bytes(size)
    manifest = {"format": 1, "payload_name": "ddtree-payload", "payload_version": "9", "base_package": "sglang",
                "base_version": "0.5.13.post1", "build_time": "2026-01-01T00:00:00Z", "patched_files": [],
                "new_files": [{"path": REL, "sha256": hashlib.sha256(data).hexdigest(), "size": size}]}
    path = tmp_path / f"zeros-{size}.tar.gz"
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for name, blob in (("manifest.json", json.dumps(manifest).encode()), ("files/" + REL, data)):
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return path


VERIFY_RSS = """
import json, resource, sys
from ddtree_ops.bundle import BundleError, verify_bundle
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    verify_bundle(sys.argv[1]); result = "accepted"
except BundleError as e:
    result = e.code + ": " + e.message
print(json.dumps({"result": result, "grew_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base}))
"""


def verify_in_child(path: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", VERIFY_RSS, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_oversize_member_refused_before_reading(tmp_path: Path) -> None:
    path = zero_bundle(tmp_path, CAP + 1)
    assert path.stat().st_size < CAP // 100
    got = verify_in_child(path)
    # Before: accepted, after reading the whole member into memory.
    assert got["result"].startswith("bundle_too_large") and REL in got["result"] and "too large" in got["result"]
    assert got["grew_kib"] < 16 * 1024
    assert B.MAX_MEMBER == CAP


def test_verify_streams_members(tmp_path: Path) -> None:
    got = verify_in_child(zero_bundle(tmp_path, 48 * 1024 * 1024))
    assert got["result"] == "accepted"
    # Before: the 48 MiB member was held in memory (and joined again): RSS grew by more than its size.
    assert got["grew_kib"] < 16 * 1024, got


def test_bundle_paths_stay_inside_the_package(tmp_path: Path) -> None:
    b = make_bundle(tmp_path / "dist", new_paths=("sglang/srt/speculative/ddtree_utils.py", "evil.pth"))
    # Before: verified, and push installed evil.pth at the site-packages root.
    with pytest.raises(B.BundleError, match=r"evil\.pth.*outside sglang/"):
        B.verify_bundle(b.path)


def test_payload_descriptor_paths_stay_inside_the_package(tmp_path: Path) -> None:
    (tmp_path / "evil.pth").write_text("import os\n")
    (tmp_path / "payload.json").write_text(json.dumps({
        "version": "1", "base_package": "sglang", "base_version": "0.5.13.post1", "patches": [],
        "new_files": ["evil.pth"]}))
    with pytest.raises(B.BundleError, match=r"evil\.pth.*outside sglang/"):
        B.load_payload(tmp_path)

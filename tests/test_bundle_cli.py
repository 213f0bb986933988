"""`ddtree-ops build` as an operator runs it: build from the real wheel, --verify, exit codes."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from test_cli import cli

from tests.payload_helpers import real_wheel


def test_build_then_verify_then_tampered(tmp_path: Path) -> None:
    wheel = real_wheel()
    built = cli("build", "--wheel", str(wheel), "--out", str(tmp_path / "dist"), "--json")
    assert built.returncode == 0, built.stderr
    doc = json.loads(built.stdout)
    bundle = Path(doc["bundle"])
    assert bundle.is_file() and bundle.name == "ddtree-payload-0.6.0.tar.gz"
    manifest = doc["manifest"]
    assert manifest["base_package"] == "sglang" and manifest["base_version"] == "0.5.13.post1"
    assert {f["path"] for f in manifest["patched_files"]} >= {"sglang/srt/server_args.py"}
    assert all(f["pristine_sha256"] != f["sha256"] for f in manifest["patched_files"])

    verified = cli("build", "--verify", str(bundle), "--json")
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["bundle_sha256"] == doc["bundle_sha256"]

    # Swap one file's bytes but keep the manifest: verify must name the file and exit 1.
    tampered = tmp_path / "tampered.tar.gz"
    with tarfile.open(bundle) as src, tarfile.open(tampered, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            if member.name.endswith("ddtree_utils.py"):
                data += b"\n# changed\n"
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    refused = cli("build", "--verify", str(tampered))
    assert refused.returncode == 1
    assert "ddtree_utils.py" in refused.stderr and "tampered" in refused.stderr


def test_build_usage_errors_exit_2(tmp_path: Path) -> None:
    two_sources = cli("build", "--download", "--wheel", str(tmp_path / "x.whl"), "--out", str(tmp_path))
    assert two_sources.returncode == 2 and "one pristine source" in two_sources.stderr
    verify_with_source = cli("build", "--verify", str(tmp_path / "b.tar.gz"), "--download")
    assert verify_with_source.returncode == 2
    assert not any(tmp_path.iterdir())  # nothing written on a usage error

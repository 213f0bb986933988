"""`ddtree-ops build` as an operator runs it: build from the real wheel, --verify, exit codes."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest
from test_cli import cli

from tests.payload_helpers import real_wheel


def test_build_then_verify_then_tampered(tmp_path: Path) -> None:
    wheel = real_wheel()
    built = cli("build", "--wheel", str(wheel), "--out", str(tmp_path / "dist"), "--json")
    assert built.returncode == 0, built.stderr
    doc = json.loads(built.stdout)
    bundle = Path(doc["bundle"])
    version = json.loads((Path(__file__).resolve().parents[1] / "ddtree_ops/payload/payload.json").read_text())["version"]
    assert bundle.is_file() and bundle.name == f"ddtree-payload-{version}.tar.gz"
    manifest = doc["manifest"]
    assert manifest["base_package"] == "sglang" and manifest["base_version"] == "0.5.13.post1"
    assert {f["path"] for f in manifest["patched_files"]} >= {"sglang/srt/server_args.py"}
    assert all(f["pristine_sha256"] != f["sha256"] for f in manifest["patched_files"])

    verified = cli("build", "--verify", str(bundle), "--allow-unsigned", "--json")
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
    refused = cli("build", "--verify", str(tampered), "--allow-unsigned")
    assert refused.returncode == 1
    assert "ddtree_utils.py" in refused.stderr and "tampered" in refused.stderr


def test_build_usage_errors_exit_2(tmp_path: Path) -> None:
    two_sources = cli("build", "--download", "--wheel", str(tmp_path / "x.whl"), "--out", str(tmp_path))
    assert two_sources.returncode == 2 and "one pristine source" in two_sources.stderr
    verify_with_source = cli("build", "--verify", str(tmp_path / "b.tar.gz"), "--download")
    assert verify_with_source.returncode == 2
    no_key = cli("build", "--wheel", str(tmp_path / "x.whl"), "--sign-key", str(tmp_path / "nokey"), "--out", str(tmp_path))
    assert no_key.returncode == 2 and "signing key" in no_key.stderr
    assert not any(tmp_path.iterdir())  # nothing written on a usage error


@pytest.mark.parametrize("case", ["missing bundle", "bundle is a directory", "wheel is not a zip", "wheel is a directory"])
def test_bad_input_files_are_input_errors_not_internal_errors(tmp_path: Path, case: str) -> None:
    (tmp_path / "not-a-wheel.whl").write_text("hello\n")
    (tmp_path / "dir").mkdir()
    argv = {"missing bundle": ["--verify", str(tmp_path / "missing.tar.gz")],
            "bundle is a directory": ["--verify", str(tmp_path / "dir")],
            "wheel is not a zip": ["--wheel", str(tmp_path / "not-a-wheel.whl"), "--out", str(tmp_path / "out")],
            "wheel is a directory": ["--wheel", str(tmp_path / "dir"), "--out", str(tmp_path / "out")]}[case]
    result = cli("build", *argv, *(["--allow-unsigned"] if "--verify" in argv else []), "--json")
    assert result.returncode == 2, result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr
    doc = json.loads(result.stdout)
    assert doc["exit_code"] == 2 and doc["error"]["code"] in ("bundle_missing", "wheel_missing", "wheel_invalid")
    assert doc["error"]["hint"] and not (tmp_path / "out").exists()


def test_build_signs_and_a_rebuild_without_a_key_drops_the_old_signature(tmp_path: Path) -> None:
    wheel = real_wheel()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    (tmp_path / "inv.yaml").write_text(f"hosts:\n  a: {{address: 10.0.0.1}}\nsigners:\n  ci: {tmp_path / 'k.pub'}\n")
    built = cli("build", "--wheel", str(wheel), "--out", str(tmp_path / "dist"), "--sign-key", str(tmp_path / "k"), "--json")
    assert built.returncode == 0, built.stderr
    bundle = Path(json.loads(built.stdout)["bundle"])
    assert json.loads(built.stdout)["signature"]["key"].startswith("ED25519 SHA256:")
    verified = cli("build", "--verify", str(bundle), "-i", str(tmp_path / "inv.yaml"), "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["signature"]["signer"] == "ci", verified.stderr
    unsigned = cli("build", "--wheel", str(wheel), "--out", str(tmp_path / "dist"))
    assert unsigned.returncode == 0 and "UNSIGNED" in unsigned.stdout
    assert not bundle.with_name(bundle.name + ".sig").exists()  # no stale signature beside the new bytes
    refused = cli("build", "--verify", str(bundle), "-i", str(tmp_path / "inv.yaml"))
    assert refused.returncode == 1 and "is not signed" in refused.stderr

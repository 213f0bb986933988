"""Control-side release helpers that need no host: bundle loading, defaults, summaries, CLI help."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ddtree_ops import release
from ddtree_ops.cli import app
from ddtree_ops.errors import OpsError, UsageError
from ddtree_ops.fleet import HostResult
from tests.release_fixtures import make_bundle


def test_local_bundle_verifies_before_any_host(tmp_path: Path) -> None:
    good = make_bundle(tmp_path / "ok")
    local = release.LocalBundle.load(good.path)
    assert local.sha256 == good.sha256 and local.manifest["base_version"] == "0.5.13.post1"
    bad = make_bundle(tmp_path / "bad", tamper="sglang/srt/server_args.py")
    with pytest.raises(OpsError, match="tampered"):
        release.LocalBundle.load(bad.path)


def test_local_bundle_refuses_extra_members(tmp_path: Path) -> None:
    good = make_bundle(tmp_path / "ok")
    buf = io.BytesIO()
    with tarfile.open(good.path, "r:gz") as tin, tarfile.open(fileobj=buf, mode="w:gz") as tout:
        for m in tin.getmembers():
            tout.addfile(m, tin.extractfile(m))
        info = tarfile.TarInfo("files/sglang/evil.py")
        info.size = 4
        tout.addfile(info, io.BytesIO(b"boom"))
    good.path.write_bytes(buf.getvalue())
    with pytest.raises(OpsError):
        release.LocalBundle.load(good.path)


def test_default_bundle(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        release.default_bundle(tmp_path)
    b = make_bundle(tmp_path)
    assert release.default_bundle(tmp_path) == b.path


def test_summary_names_failed_and_unreachable() -> None:
    results = [HostResult("a", "ok", data={"noop": True}), HostResult("b", "failed"), HostResult("c", "unreachable"),
               HostResult("d", "ok", data={"noop": False}), HostResult("e", "interrupted")]
    assert release.summary(results) == {"hosts": 5, "ok": 2, "noop": ["a"], "failed": ["b"], "unreachable": ["c"],
                                        "interrupted": ["e"]}


@pytest.mark.parametrize("command", ["push", "smoke", "rollback", "history", "unlock"])
def test_release_commands_have_help(command: str) -> None:
    out = CliRunner().invoke(app, [command, "--help"])
    assert out.exit_code == 0, out.output
    assert "--inventory" in out.output and "--limit" in out.output and "--json" in out.output


def test_push_without_inventory_is_a_usage_error() -> None:
    out = CliRunner().invoke(app, ["push", "--bundle", "x.tar.gz"], env={"DDTREE_INVENTORY": ""})
    assert out.exit_code == 2

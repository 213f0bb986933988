"""SGLang upgraded under an installed release (0.5.13.post1 -> 0.5.23): the release's backups and pristine
copies are 0.5.13.post1 files, so push and rollback must refuse the host (naming it, the installed SGLang and
the release's base, and the repair) with nothing changed, and `status` must show it stale, never healthy.

Real control side, real SSH (the in-process server) and the real agent; the host is a venv whose
site-packages is a fake SGLang tree, upgraded in place the way pip does it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
import yaml
from ssh_server import LocalSSHServer, write_private_key
from test_bases import _host_python
from test_cli import cli

from ddtree_ops import release, rollout
from ddtree_ops.inventory import load_inventory
from tests.release_fixtures import PRISTINE, make_bundle, sha

NEW = "0.5.23"
UPSTREAM_23 = {  # 0.5.23's own files: server_args.py changed, dflash_worker.py gone (the v1 worker)
    "sglang/__init__.py": PRISTINE["sglang/__init__.py"],
    "sglang/srt/server_args.py": b"# 0.5.23 server_args\nY = 2\n",
    "sglang/srt/speculative/dflash_info.py": PRISTINE["sglang/srt/speculative/dflash_info.py"],
    "sglang/srt/untouched.py": PRISTINE["sglang/srt/untouched.py"],
}


def _upgrade(site: Path, version: str = NEW) -> None:
    """pip install sglang==0.5.23 over 0.5.13.post1: its files replaced or removed, a new dist-info; the
    modules a release added (not in any RECORD) stay."""
    for info in site.glob("sglang-*.dist-info"):
        shutil.rmtree(info)
    (site / "sglang/srt/speculative/dflash_worker.py").unlink()
    for rel, data in UPSTREAM_23.items():
        (site / rel).write_bytes(data)
    dist = site / f"sglang-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    rows = [f"{rel},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).decode().rstrip('=')},{len(d)}"
            for rel, d in UPSTREAM_23.items()]
    (dist / "RECORD").write_text("\n".join(rows + [f"{dist.name}/RECORD,,"]) + "\n")


def _tree(site: Path) -> dict[str, str]:
    """Every file under sglang/ with its sha256 (what must not change)."""
    return {p.relative_to(site).as_posix(): sha(p.read_bytes()) for p in sorted((site / "sglang").rglob("*"))
            if p.is_file()}


@pytest.fixture
def upgraded(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """Host `gpu1`: v1 bundle pushed on 0.5.13.post1, then SGLang upgraded to 0.5.23 under it."""
    client_key = paramiko.ECDSAKey.generate()
    server = LocalSSHServer(host_key=paramiko.ECDSAKey.generate(), authorized_key=client_key).start()
    write_private_key(client_key, tmp_path / "id_ecdsa")
    (tmp_path / "known_hosts").write_text(server.known_hosts_line())
    python, site = _host_python(tmp_path / "venv", "0.5.13.post1")
    inventory = {"all": {"vars": {"identity_file": "id_ecdsa", "known_hosts": "known_hosts", "connect_timeout": 5}},
                 "hosts": {"gpu1": {"address": "127.0.0.1", "port": server.port, "python": str(python),
                                    "state_dir": str(tmp_path / "state")}}}
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(inventory))
    inv = load_inventory(tmp_path / "inv.yaml")
    v1 = make_bundle(tmp_path / "dist1", "1.0.0", tag="v1")
    [done] = release.push(inv, inv.select(None), release.load_bundles([v1.path]))
    assert done.ok, done.to_dict()
    _upgrade(site)
    yield tmp_path / "inv.yaml", site
    server.stop()


def _v2_bundle(tmp_path: Path):
    # A 0.5.23 bundle that no longer patches server_args.py / dflash_worker.py (the v1 release did): before the
    # fix its plan "reverted" them to 0.5.13.post1's pristine bytes.
    return make_bundle(tmp_path / "dist23", "1.0.0", tag="v23", base_version=NEW,
                       patched_paths=("sglang/srt/speculative/dflash_info.py",))


def _assert_stale(err, host: str = "gpu1") -> None:
    assert err.code == "stale_base", (err.code, err.message)
    assert err.message.startswith(f"{host}: ")
    assert f"sglang here is {NEW}" in err.message and "0.5.13.post1" in err.message
    assert "pip install --force-reinstall --no-deps sglang==0.5.23" in err.hint
    assert "rollback --forget-stale" in err.hint


def test_push_of_the_new_bases_bundle_is_refused_and_changes_nothing(upgraded, tmp_path: Path) -> None:
    inv_path, site = upgraded
    inv = load_inventory(inv_path)
    before, state_before = _tree(site), (tmp_path / "state" / "state.json").read_bytes()
    bundles = release.load_bundles([_v2_bundle(tmp_path).path])
    [dry] = release.push(inv, inv.select(None), bundles, dry_run=True)
    assert dry.ok, dry.to_dict()
    assert dry.data["refusals"][0]["code"] == "stale_base"
    assert not [f for f in dry.data["files"] if f["action"] == "revert"], dry.data["files"]
    [done] = release.push(inv, inv.select(None), bundles)
    assert done.status == "failed"
    _assert_stale(done.error)
    assert _tree(site) == before
    assert "sglang/srt/speculative/dflash_worker.py" not in _tree(site)  # no 0.5.13.post1 file written into 0.5.23
    assert (tmp_path / "state" / "state.json").read_bytes() == state_before


@pytest.mark.parametrize("to,adopt", [("previous", False), ("previous", True), ("pristine", False),
                                      ("pristine", True)])
def test_rollback_is_refused_and_changes_nothing(upgraded, tmp_path: Path, to: str, adopt: bool) -> None:
    inv_path, site = upgraded
    inv = load_inventory(inv_path)
    before, state_before = _tree(site), (tmp_path / "state" / "state.json").read_bytes()
    [r] = release.rollback(inv, inv.select(None), to=to, adopt=adopt)
    assert r.status == "failed"
    _assert_stale(r.error)
    [r2] = rollout.rollback(inv, inv.select(None), to=to, adopt=adopt)  # the CLI's: unit first, then files
    assert r2.status == "failed"
    _assert_stale(r2.error)
    assert _tree(site) == before
    assert (tmp_path / "state" / "state.json").read_bytes() == state_before


def test_status_shows_the_host_stale_with_the_repair(upgraded) -> None:
    inv_path, _ = upgraded
    doc = json.loads(cli("status", "-i", str(inv_path), "--json").stdout)
    [res] = doc["results"]
    stale = res["data"]["release"]["stale"]
    assert stale["installed_version"] == NEW and set(stale["release_bases"].values()) == {"0.5.13.post1"}
    assert "rollback --forget-stale" in stale["repair"] and "--force-reinstall" in stale["repair"]
    table = cli("status", "-i", str(inv_path), env={"COLUMNS": "250"})
    flat = " ".join(table.stdout.split())
    assert "STALE" in flat and "0.5.13.post1" in flat
    assert "gpu1: STALE release" in table.stderr and "repair:" in table.stderr


# ------------------------------------------------------------------------------------- the repair
def test_forget_stale_refuses_until_sglangs_own_files_are_the_wheels(upgraded, tmp_path: Path) -> None:
    inv_path, site = upgraded
    inv = load_inventory(inv_path)
    (site / "sglang/srt/server_args.py").write_bytes(b"# half an upgrade\n")
    before, state_before = _tree(site), (tmp_path / "state" / "state.json").read_bytes()
    [r] = rollout.rollback(inv, inv.select(None), forget_stale=True)
    assert r.status == "failed" and r.error.code == "not_reinstalled", r.to_dict()
    assert "sglang/srt/server_args.py" in r.error.message and "--force-reinstall" in r.error.hint
    assert _tree(site) == before and (tmp_path / "state" / "state.json").read_bytes() == state_before
    assert not (tmp_path / "state" / "forgotten").exists()


def test_forget_stale_then_push_and_rollback_on_the_new_base(upgraded, tmp_path: Path) -> None:
    inv_path, site = upgraded
    inv = load_inventory(inv_path)
    out = cli("rollback", "-i", str(inv_path), "--forget-stale", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    [res] = json.loads(out.stdout)["results"]
    assert set(res["data"]["forgotten"].values()) == {"0.5.13.post1"}
    assert sorted(res["data"]["removed"]) == ["sglang/srt/speculative/ddtree_args.py",
                                               "sglang/srt/speculative/ddtree_utils.py"]
    wheel = {rel: sha(d) for rel, d in UPSTREAM_23.items()}
    assert _tree(site) == wheel  # exactly the 0.5.23 wheel: the old release's modules gone, nothing written
    kept = Path(res["data"]["kept_as"])
    assert (kept / "releases").is_dir() and (kept / "pristine").is_dir() and (kept / "site").is_dir()
    assert not (tmp_path / "state" / "releases").exists() and not (tmp_path / "state" / "pristine").exists()
    status = json.loads(cli("status", "-i", str(inv_path), "--json").stdout)["results"][0]["data"]["release"]
    assert status["stale"] is None and status["current"] is None
    again = rollout.rollback(inv, inv.select(None), forget_stale=True)[0]
    assert again.status == "failed" and again.error.code == "not_stale"

    v2 = _v2_bundle(tmp_path)
    [pushed] = release.push(inv, inv.select(None), release.load_bundles([v2.path]))
    assert pushed.ok, pushed.to_dict()
    assert all(_tree(site)[rel] == sha(v2.patched[rel]) for rel in v2.paths)
    [back] = release.rollback(inv, inv.select(None), to="pristine")
    assert back.ok, back.to_dict()
    assert _tree(site) == wheel  # pristine is 0.5.23's own bytes


def test_forget_stale_takes_no_target(upgraded) -> None:
    inv_path, _ = upgraded
    bad = cli("rollback", "-i", str(inv_path), "--forget-stale", "--to", "pristine", "--json")
    assert bad.returncode == 2 and "--forget-stale" in bad.stdout + bad.stderr


def test_promote_refuses_a_stale_host_before_any_change(upgraded, tmp_path: Path) -> None:
    """unit_inspect's release info says the host is stale; promote's refusals (checked before any change) name it."""
    from ddtree_ops.agent.remote import units
    from ddtree_ops.inventory import HostConfig

    _, site = upgraded
    info = {"release": units._release_info(tmp_path / "state", [str(site)]), "promotion": {}}
    assert info["release"]["stale"]["code"] == "stale_base"
    refusals = rollout._refusals(HostConfig(name="gpu1", address="127.0.0.1"),
                                 rollout.PromoteOptions(mode="shadow-linear"), info, [])
    assert refusals[0]["code"] == "stale_base" and "0.5.13.post1" in refusals[0]["message"]
    assert "rollback --forget-stale" in refusals[0]["hint"]


def test_push_of_the_old_bases_bundle_says_stale_first(upgraded, tmp_path: Path) -> None:
    """Only a bundle for the old base given: the host is refused as stale (not merely 'no bundle for 0.5.23')."""
    inv_path, site = upgraded
    inv = load_inventory(inv_path)
    before = _tree(site)
    v1 = make_bundle(tmp_path / "dist1b", "1.0.1", tag="v1b")
    [done] = release.push(inv, inv.select(None), release.load_bundles([v1.path]))
    assert done.status == "failed"
    _assert_stale(done.error)
    [dry] = release.push(inv, inv.select(None), release.load_bundles([v1.path]), dry_run=True)
    assert dry.data["refusals"][0]["code"] == "stale_base"
    assert _tree(site) == before


def test_smoke_says_the_host_is_stale(upgraded) -> None:
    from ddtree_ops import smoke

    inv_path, _ = upgraded
    inv = load_inventory(inv_path)
    [r] = smoke.smoke(inv, inv.select(None))
    assert r.status == "failed" and r.error.code == "smoke_failed"
    assert "step release failed" in r.error.message and "sglang here is 0.5.23" in r.error.message
    assert "rollback --forget-stale" in r.error.message


def test_forget_stale_supersedes_a_damaged_state_and_an_old_journal(upgraded, tmp_path: Path) -> None:
    """state.json damaged and a journal of the old release left behind: refused as stale by rollback --to pristine
    (whose hint names forget), and forget sets both aside (never deleted) and finishes."""
    inv_path, site = upgraded
    inv = load_inventory(inv_path)
    sd = tmp_path / "state"
    (sd / "state.json").write_text("{not json")
    (sd / "journal.json").write_text(json.dumps({"action": "push", "release": "x", "operator": "o",
                                                 "site_packages": str(site), "stack_before": [], "stack_after": [],
                                                 "steps": []}))
    [r] = release.rollback(inv, inv.select(None), to="pristine")
    assert r.status == "failed" and r.error.code == "stale_base"
    [f] = rollout.rollback(inv, inv.select(None), forget_stale=True)
    assert f.ok, f.to_dict()
    assert _tree(site) == {rel: sha(d) for rel, d in UPSTREAM_23.items()}
    assert sorted(p.name.split(".damaged-")[0] for p in sd.glob("*.damaged-*")) == ["journal.json", "state.json"]
    assert json.loads((sd / "state.json").read_text())["stack"] == []
    assert not (sd / "journal.json").exists()


def test_unlock_does_not_finish_an_old_releases_journal_on_a_stale_host(upgraded, tmp_path: Path) -> None:
    """An interrupted change of the old release (its steps write 0.5.13.post1 bytes): unlock breaks the lock but
    refuses to roll it forward, naming the repair; nothing is written."""
    inv_path, site = upgraded
    inv = load_inventory(inv_path)
    sd = tmp_path / "state"
    [rid] = json.loads((sd / "state.json").read_text())["stack"]
    rdir = sd / "releases" / rid
    jr = {"op": "rollback", "action": "rollback", "release": rid, "operator": "o", "site_packages": str(site),
          "stack_before": [rid], "stack_after": [],
          "steps": [{"rel": "sglang/srt/speculative/dflash_worker.py", "before": None, "before_src": None,
                     "after": sha(PRISTINE["sglang/srt/speculative/dflash_worker.py"]),
                     "after_src": str(rdir / "backup/sglang/srt/speculative/dflash_worker.py"), "mode": None}]}
    (sd / "journal.json").write_text(json.dumps(jr))
    before = _tree(site)
    [r] = release.unlock(inv, inv.select(None))
    assert r.status == "failed" and r.error.code == "stale_base", r.to_dict()
    assert _tree(site) == before and (sd / "journal.json").exists()

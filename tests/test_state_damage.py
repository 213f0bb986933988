"""Host state that is missing, corrupt or planted (issue 11), on the agent against a temporary root.

Each test is one way an operator (or a bad disk) breaks the state dir; each one failed on the agent
before issue 11: a lost pristine copy, a write redirected through a link, a crash or a refusal that
only a hand could clear, a live lock taken over.
"""

from __future__ import annotations

import io
import json
import os
import socket
import tarfile
from pathlib import Path

import pytest

from tests.release_fixtures import PRISTINE, make_bundle, run_agent, sha
from tests.test_agent_release import KILL_ENV, Host, patched_hashes


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


def refused(ans: dict, code: str, *words: str) -> dict:
    assert not ans["ok"], ans
    err = ans["error"]
    assert err["code"] == code, err
    text = err["message"] + " " + (err.get("hint") or "")
    for w in words:
        assert w in text, (w, err)
    return err


def try_push(host: Host, bundle, env: dict | None = None) -> dict:
    """host.push, but a refusal at staging is an answer too."""
    ans = host.call("stage_begin", name=bundle.path.name, size=bundle.path.stat().st_size)
    if not ans["ok"]:
        return ans
    Path(ans["result"]["path"]).write_bytes(bundle.path.read_bytes())
    return run_agent("install", {**host.base, "bundle": bundle.path.name, "bundle_sha256": bundle.sha256}, env=env)


def pushed(host: Host, tmp_path: Path):
    b = make_bundle(tmp_path / "dist")
    ans = host.push(b)
    assert ans["ok"], ans
    return b, ans["result"]["release"]


# --- 1. pristine backups are never lost ------------------------------------------------------------


@pytest.mark.parametrize("damage", ["delete", "{}", "[]", "truncate"])
def test_lost_state_json_never_costs_the_pristine_copy(host: Host, tmp_path: Path, damage: str) -> None:
    before = host.snapshot()
    b, rid = pushed(host, tmp_path)
    st = host.state_dir / "state.json"
    if damage == "delete":
        st.unlink()
    elif damage == "truncate":
        st.write_bytes(st.read_bytes()[:7])
    else:
        st.write_text(damage)
    backup = (host.state_dir / "releases" / rid / "backup.json").read_bytes()
    # Before: "installed (0 files changed)" and backup.json rewritten with the patched hashes as "before".
    err = refused(host.push(b), "state_damaged", str(st), "rollback --to pristine")
    assert err["path"] == str(st)
    refused(host.call("rollback", to="previous"), "state_damaged", str(st))
    refused(host.call("plan", manifest=b.manifest), "state_damaged", str(st))
    assert (host.state_dir / "releases" / rid / "backup.json").read_bytes() == backup
    ans = host.call("rollback", to="pristine")
    assert ans["ok"], ans
    assert host.snapshot() == before
    assert any(p.name.startswith("state.json.damaged-") for p in host.state_dir.iterdir()) == (damage != "delete")
    # The host is usable again: a new state.json, and the same push works from scratch.
    assert host.push(b)["ok"] and host.hashes(b.paths) == patched_hashes(b)


def test_missing_backup_record_on_repair_push(host: Host, tmp_path: Path) -> None:
    before = host.snapshot()
    b, rid = pushed(host, tmp_path)
    record = host.state_dir / "releases" / rid / "backup.json"
    record.unlink()
    (host.site / "sglang/srt/server_args.py").write_bytes(PRISTINE["sglang/srt/server_args.py"])
    # Before: the repair path rebuilt the release dir, backing up the patched files as "before".
    refused(host.push(b), "state_damaged", str(record), "rollback --to pristine")
    assert not record.exists()
    assert host.call("rollback", to="pristine")["ok"]
    assert host.snapshot() == before


def test_rollback_to_pristine_checks_the_originals_not_the_backup(host: Host, tmp_path: Path) -> None:
    """A backup that recorded patched bytes as "before" (what the old repair path wrote)."""
    before = host.snapshot()
    b, rid = pushed(host, tmp_path)
    rdir = host.state_dir / "releases" / rid
    rec = json.loads((rdir / "backup.json").read_text())
    for rel, f in rec["files"].items():
        f["before"] = f["after"]
        (rdir / "backup" / rel).parent.mkdir(parents=True, exist_ok=True)
        (rdir / "backup" / rel).write_bytes(b.patched[rel])
    (rdir / "backup.json").write_text(json.dumps(rec))
    ans = host.call("rollback", to="pristine")
    assert ans["ok"], ans
    # Before: "rolled back" while server_args.py and dflash_worker.py stayed patched.
    assert host.snapshot() == before
    assert set(ans["result"]["verified"]) == set(b.paths)


def test_pristine_copy_checked_against_the_wheel_record(host: Host, tmp_path: Path) -> None:
    record = host.site / "sglang-0.5.13.post1.dist-info" / "RECORD"
    rel = "sglang/srt/server_args.py"
    record.write_text(record.read_text().replace(rel + ",sha256=", rel + ",sha256=AAAA"))
    before = host.snapshot()
    refused(host.push(make_bundle(tmp_path / "dist")), "pristine_mismatch", rel, "RECORD")
    assert host.snapshot() == before


def test_pristine_copy_written_once(host: Host, tmp_path: Path) -> None:
    pushed(host, tmp_path)
    copy = host.state_dir / "pristine" / "files" / "sglang/srt/server_args.py"
    assert copy.read_bytes() == PRISTINE["sglang/srt/server_args.py"]
    stamp = copy.stat().st_mtime_ns
    v2 = make_bundle(tmp_path / "d2", "2.0.0", tag="v2")
    assert host.push(v2)["ok"]
    assert copy.stat().st_mtime_ns == stamp  # a later release never rewrites it
    copy.write_bytes(b"# damaged\n")
    # A damaged copy heals only from bytes with the original hash (here: release 1's backup).
    ans = host.push(make_bundle(tmp_path / "d3", "3.0.0", tag="v3"))
    assert ans["ok"], ans
    assert copy.read_bytes() == PRISTINE["sglang/srt/server_args.py"]


# --- 2. planted links are never followed -----------------------------------------------------------


def test_staging_link_does_not_empty_its_target(host: Host, tmp_path: Path) -> None:
    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep me")
    host.state_dir.mkdir(mode=0o700)
    (host.state_dir / "staging").symlink_to(elsewhere)
    refused(host.call("stage_begin", name="b.tar.gz", size=10), "state_damaged",
            str(host.state_dir / "staging"), "symbolic link", "ddtree-ops unlock")
    assert (elsewhere / "keep.txt").read_text() == "keep me"


@pytest.mark.parametrize("planted", ["audit.log", "releases/{rid}/payload", "releases/{rid}/drift"])
def test_links_in_the_state_dir_redirect_nothing(host: Host, tmp_path: Path, planted: str) -> None:
    b, rid = pushed(host, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    link = host.state_dir / planted.format(rid=rid)
    if link.exists():
        os.replace(link, tmp_path / "moved-away")
    link.symlink_to(outside if "audit" not in planted else outside / "log")
    (host.site / "sglang/srt/server_args.py").write_text("# drifted\n")
    for ans in (try_push(host, b), host.call("rollback", to="previous", adopt=True), host.call("history")):
        refused(ans, "state_damaged", str(link), "symbolic link")
    assert list(outside.iterdir()) == []
    # The repair is the tool's: unlock removes the link (never its target), then the host is workable.
    ans = host.call("unlock", force=True)
    assert ans["ok"] and [r["path"] for r in ans["result"]["removed"]] == [str(link)], ans
    assert outside.is_dir() and not link.is_symlink()


def test_scan_survives_a_concurrent_ops_temp_file_vanishing(host: Host, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A second agent scans the state dir while the lock holder renames its state.json temp file
    into place: the scan listed the temp file, then lstat found it gone. That interleaving crashed
    the second agent (agent_crash, FileNotFoundError) on a loaded CI machine instead of answering
    "locked"; here it is forced, on real files, between os.walk's listing and the lstat."""
    from ddtree_ops.agent.remote import statefs

    pushed(host, tmp_path)
    planted = host.state_dir / "planted-link"
    planted.symlink_to(tmp_path / "nowhere")
    tmp = host.state_dir / ".state.json.x1y2z3.ddtree-tmp"
    tmp.write_text("{}")
    real_walk = os.walk

    def walk_then_rename(top, *a, **kw):
        for entry in real_walk(top, *a, **kw):
            if tmp.name in entry[2] and tmp.exists():  # the holder's os.replace lands right after the listing
                os.replace(tmp, host.state_dir / "state.json")
            yield entry

    monkeypatch.setattr(statefs.os, "walk", walk_then_rename)
    found = statefs.scan(host.state_dir)
    # The vanished temp file is simply not there; a planted link is still found.
    assert [f[0] for f in found] == [str(planted)]
    tmp.write_text("{}")
    assert [r["path"] for r in statefs.remove_planted(host.state_dir)] == [str(planted)]


def test_dangling_lock_link(host: Host, tmp_path: Path) -> None:
    host.state_dir.mkdir(mode=0o700)
    (host.state_dir / "lock").symlink_to(tmp_path / "nowhere")
    b = make_bundle(tmp_path / "dist")
    # Before: every push said "locked by ? (?)" and unlock found nothing to release.
    refused(try_push(host, b), "state_damaged", str(host.state_dir / "lock"), "ddtree-ops unlock")
    status = host.call("lock_status")["result"]
    assert [p["path"] for p in status["problems"]] == [str(host.state_dir / "lock")]
    ans = host.call("unlock", force=True)
    assert ans["ok"] and ans["result"]["removed"][0]["path"] == str(host.state_dir / "lock")
    assert host.push(b)["ok"]


@pytest.mark.parametrize("op", ["lock", "unlock", "install", "rollback", "history", "lock_status"])
def test_relative_state_dir_refused(tmp_path: Path, op: str) -> None:
    ans = run_agent(op, {"state_dir": "relative/state", "force": True, "bundle": "x", "bundle_sha256": "0" * 64})
    refused(ans, "bad_request", "absolute")
    assert not (Path.cwd() / "relative").exists()


def test_state_dir_link_or_shared_dir_refused(host: Host, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    host.state_dir.symlink_to(real)
    refused(host.call("lock", who="a", command="push"), "state_dir", "symbolic link")
    host.state_dir.unlink()
    host.state_dir.mkdir()
    host.state_dir.chmod(0o777)
    refused(host.call("lock", who="a", command="push"), "state_dir", "writable by nobody else", "chmod go-w")
    assert list(host.state_dir.iterdir()) == []


# --- 3. corrupt files the tool repairs -------------------------------------------------------------


@pytest.mark.parametrize("owner", ['{"who": "al', '{"who": 1, "command": "push"}', "[]"])
def test_corrupt_lock_owner_is_refused_then_unlocked(host: Host, tmp_path: Path, owner: str) -> None:
    assert host.call("lock", who="alice", command="push")["ok"]
    path = host.state_dir / "lock" / "owner.json"
    path.write_text(owner)
    # Before: install, lock_status and unlock --force all crashed (agent_crash).
    refused(host.push(make_bundle(tmp_path / "dist")), "locked", str(path), "ddtree-ops unlock")
    status = host.call("lock_status")
    assert status["ok"] and str(path) in status["result"]["holder"]["damaged"]
    ans = host.call("unlock", force=True)
    assert ans["ok"] and ans["result"]["released"] and ans["result"]["holder"]["damaged"]
    assert host.call("lock_status")["result"]["holder"] is None


def test_corrupt_journal_with_mixed_files(host: Host, tmp_path: Path) -> None:
    before = host.snapshot()
    b = make_bundle(tmp_path / "dist")
    with pytest.raises(AssertionError, match="gave no answer"):
        host.push(b, env={**os.environ, KILL_ENV: "1"})
    jr = host.state_dir / "journal.json"
    jr.write_bytes(jr.read_bytes()[:40])
    for ans in (host.push(b), host.call("plan", manifest=b.manifest), host.call("recover"),
                host.call("rollback", to="previous")):
        refused(ans, "state_damaged", str(jr), "ddtree-ops unlock")
    # unlock shows it, and refuses to discard a journal while a file is half changed.
    assert str(jr) in {p["path"] for p in host.call("lock_status")["result"]["problems"]}
    refused(host.call("recover", repair=True), "files_mixed", "rollback --to pristine")
    assert jr.exists()
    ans = host.call("rollback", to="pristine")
    assert ans["ok"], ans
    assert host.snapshot() == before and not jr.exists()
    assert host.push(b)["ok"] and host.hashes(b.paths) == patched_hashes(b)


def test_corrupt_journal_with_consistent_files_is_cleared_by_unlock(host: Host, tmp_path: Path) -> None:
    b, rid = pushed(host, tmp_path)
    jr = host.state_dir / "journal.json"
    jr.write_text('{"action": "push", "steps": 3}')
    refused(host.push(b), "state_damaged", str(jr), "is not a string")
    ans = host.call("recover", repair=True)
    assert ans["ok"], ans
    cleared = ans["result"]["journal_cleared"]
    assert Path(cleared["kept_as"]).read_text() == '{"action": "push", "steps": 3}'
    assert set(cleared["checked"]) == set(b.paths)
    assert not jr.exists() and host.push(b)["result"]["noop"]


def test_journal_sources_must_be_state_dir_files(host: Host, tmp_path: Path) -> None:
    b, rid = pushed(host, tmp_path)
    evil = tmp_path / "evil.py"
    evil.write_text("import os\n")
    step = {"rel": "sglang/srt/server_args.py", "before": sha(b.patched["sglang/srt/server_args.py"]),
            "before_src": None, "after": sha(evil.read_bytes()), "after_src": str(evil), "mode": 420}
    (host.state_dir / "journal.json").write_text(json.dumps({
        "action": "push", "release": rid, "operator": "x", "site_packages": str(host.site), "steps": [step],
        "stack_before": [rid], "stack_after": [rid]}))
    refused(host.push(b), "state_damaged", "journal.json", "state dir")
    assert host.hashes(["sglang/srt/server_args.py"]) == {"sglang/srt/server_args.py": step["before"]}


# --- 4. a live lock is never taken over ------------------------------------------------------------


def test_live_lock_of_a_control_machine_with_the_same_host_name(host: Host) -> None:
    # The control machine has our host name, and its pid does not exist here: that says nothing.
    dead = 4194305  # above Linux's largest pid_max: no such process here
    first = host.call("lock", who="alice", command="push", host=socket.gethostname(), pid=dead, ttl_s=60)
    assert first["ok"], first
    # Before: "owner pid gone" on this host, so the second run broke the live lock and took it.
    refused(host.call("lock", who="bob", command="push"), "locked", "alice")
    assert host.call("lock_status")["result"]["holder"]["lock_id"] == first["result"]["lock_id"]


# --- 6. bundles ------------------------------------------------------------------------------------


def _bundle_with(tmp_path: Path, members: list[tuple[str, int, bytes | None]]) -> Path:
    path = tmp_path / "odd.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, size, data in members:
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(data if data is not None else b"\0" * size))
    return path


def _stage_file(host: Host, path: Path) -> dict:
    name = host.call("stage_begin", name=path.name, size=path.stat().st_size)["result"]["path"]
    Path(name).write_bytes(path.read_bytes())
    return host.call("stage_verify", bundle=path.name, bundle_sha256=sha(path.read_bytes()))


def test_agent_refuses_an_oversize_member_by_name(host: Host, tmp_path: Path) -> None:
    big = 65 * 1024 * 1024
    manifest = json.dumps({"payload_version": "1", "base_package": "sglang", "base_version": "0.5.13.post1",
                           "new_files": [{"path": "sglang/srt/server_args.py", "sha256": "0" * 64}]}).encode()
    path = _bundle_with(tmp_path, [("files/sglang/srt/server_args.py", big, None),
                                   ("manifest.json", len(manifest), manifest)])
    assert path.stat().st_size < 1024 * 1024
    # Before: "bundle member files/... missing or not a regular file".
    refused(_stage_file(host, path), "bad_bundle", "files/sglang/srt/server_args.py", "too large")


def test_agent_refuses_paths_outside_the_package(host: Host, tmp_path: Path) -> None:
    b = make_bundle(tmp_path / "dist", new_paths=("sglang/srt/speculative/ddtree_utils.py", "evil.pth"))
    ans = host.push(b)
    # Before: installed, and evil.pth ran at every interpreter start.
    refused(ans, "bad_bundle", "evil.pth", "outside sglang/")
    assert not (host.site / "evil.pth").exists()


def test_adopted_file_that_is_the_wheels_again_stays_pristine(host: Host, tmp_path: Path) -> None:
    """--adopt keeps the foreign bytes as the original; once a hand put the wheel's bytes back,
    rollback --to pristine must not bring the foreign ones back (the lab's hotfix case)."""
    rel = "sglang/srt/server_args.py"
    (host.site / rel).write_bytes(PRISTINE[rel] + b"# hotfix\n")
    b = make_bundle(tmp_path / "dist")
    assert host.push(b, adopt=True)["ok"]
    assert host.call("rollback", to="previous")["ok"]
    assert (host.site / rel).read_bytes() == PRISTINE[rel] + b"# hotfix\n"
    (host.site / rel).write_bytes(PRISTINE[rel])
    ans = host.call("rollback", to="pristine", adopt=True)
    assert ans["ok"], ans
    assert (host.site / rel).read_bytes() == PRISTINE[rel]
    # While the release is installed, --to pristine returns to the adopted original and says so.
    (host.site / rel).write_bytes(PRISTINE[rel] + b"# hotfix\n")
    assert host.push(b, adopt=True)["ok"]
    ans = host.call("rollback", to="pristine")
    assert ans["ok"] and ans["result"]["not_pristine"] == [rel], ans
    assert (host.site / rel).read_bytes() == PRISTINE[rel] + b"# hotfix\n"

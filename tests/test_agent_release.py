"""Agent release ops (lock, stage, plan, install, rollback, history) against a fake site-packages.

Each call goes through the real agent transport (`python -I -c bootstrap`, JSON on stdin).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.release_fixtures import PRISTINE, make_bundle, make_site, run_agent, sha, site_hashes

KILL_ENV = "DDTREE_OPS_TEST_KILL_AFTER_FILES"


class Host:
    """One fake host: a site-packages and a state dir under tmp."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.site = make_site(root)
        self.state_dir = root / "state"
        self.base = {"state_dir": str(self.state_dir), "sys_path": [str(self.site)], "operator": "tester"}

    def call(self, op: str, **args: object) -> dict:
        return run_agent(op, {**self.base, **args})

    def stage(self, bundle) -> str:
        ans = self.call("stage_begin", name=bundle.path.name, size=bundle.path.stat().st_size)
        assert ans["ok"], ans
        shutil.copyfile(bundle.path, ans["result"]["path"])
        return bundle.path.name

    def push(self, bundle, env: dict | None = None, **args: object) -> dict:
        name = self.stage(bundle)
        req = {**self.base, "bundle": name, "bundle_sha256": bundle.sha256, **args}
        return run_agent("install", req, env=env)

    def hashes(self, rels) -> dict:
        return site_hashes(self.site, list(rels))

    def snapshot(self) -> dict[str, bytes]:
        return {str(p.relative_to(self.site)): p.read_bytes() for p in sorted(self.site.rglob("*")) if p.is_file()}


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


def pristine_hashes(rels) -> dict:
    return {rel: (sha(PRISTINE[rel]) if rel in PRISTINE else None) for rel in rels}


def patched_hashes(bundle) -> dict:
    return {rel: sha(data) for rel, data in bundle.patched.items()}


def test_push_then_rollback_byte_for_byte(host: Host, tmp_path: Path) -> None:
    before = host.snapshot()
    b = make_bundle(tmp_path / "dist")
    ans = host.push(b)
    assert ans["ok"], ans
    res = ans["result"]
    assert res["noop"] is False and len(res["changed"]) == 4
    assert host.hashes(b.paths) == patched_hashes(b)
    assert host.snapshot()["sglang/srt/untouched.py"] == before["sglang/srt/untouched.py"]
    st = json.loads((host.state_dir / "state.json").read_text())
    assert st["current"] == res["release"] and st["previous"] is None
    assert not (host.state_dir / "journal.json").exists()
    rb = host.call("rollback", to="previous")
    assert rb["ok"], rb
    assert rb["result"]["current"] is None and rb["result"]["popped"] == [res["release"]]
    assert host.snapshot() == before  # byte for byte; new files removed again
    hist = host.call("history")["result"]
    assert [a["result"] for a in hist["audit"]] == ["installed", "rolled-back"]
    assert [h["action"] for h in hist["history"]] == ["push", "rollback"]


def test_repush_is_noop_and_rollback_of_pristine_is_noop(host: Host, tmp_path: Path) -> None:
    rb = host.call("rollback", to="previous")
    assert rb["ok"] and rb["result"]["noop"] and "nothing to roll back" in rb["result"]["message"]
    b = make_bundle(tmp_path / "dist")
    first = host.push(b)["result"]
    again = host.push(b)
    assert again["ok"] and again["result"]["noop"] is True
    assert "already current" in again["result"]["message"]
    # A rebuilt bundle of the same content (other build time) has the same release id.
    b2 = make_bundle(tmp_path / "dist2")
    b2.manifest["build_time"] = "2027-01-01T00:00:00Z"
    assert host.push(b2)["result"]["release"] == first["release"]


def test_upgrade_then_rollback_previous_and_pristine(host: Host, tmp_path: Path) -> None:
    before = host.snapshot()
    v1 = make_bundle(tmp_path / "d1", "1.0.0", tag="v1")
    v2 = make_bundle(tmp_path / "d2", "2.0.0", tag="v2",
                     patched_paths=("sglang/srt/server_args.py", "sglang/srt/speculative/dflash_info.py"))
    r1 = host.push(v1)["result"]["release"]
    a2 = host.push(v2)
    assert a2["ok"], a2
    # dflash_worker.py was v1's but v2 does not ship it: back to pristine.
    assert host.hashes(["sglang/srt/speculative/dflash_worker.py"]) == \
        pristine_hashes(["sglang/srt/speculative/dflash_worker.py"])
    assert host.hashes(v2.paths) == patched_hashes(v2)
    st = host.call("history")["result"]["state"]
    assert st["current"] == a2["result"]["release"] and st["previous"] == r1
    rb = host.call("rollback", to="previous")["result"]
    assert rb["current"] == r1 and host.hashes(v1.paths) == patched_hashes(v1)
    assert host.hashes(["sglang/srt/speculative/dflash_info.py"]) == pristine_hashes(["sglang/srt/speculative/dflash_info.py"])
    host.push(v2)
    rb = host.call("rollback", to="pristine")
    assert rb["ok"], rb
    assert host.snapshot() == before


def test_rollback_to_named_release(host: Host, tmp_path: Path) -> None:
    v1 = make_bundle(tmp_path / "d1", "1.0.0", tag="v1")
    v2 = make_bundle(tmp_path / "d2", "2.0.0", tag="v2")
    r1 = host.push(v1)["result"]["release"]
    r2 = host.push(v2)["result"]["release"]
    assert host.call("rollback", to=r1)["result"]["current"] == r1
    # r2 is no longer in the stack but its bundle is kept: "rollback --to r2" reinstalls it.
    again = host.call("rollback", to=r2)
    assert again["ok"] and again["result"]["release"] == r2 and host.hashes(v2.paths) == patched_hashes(v2)
    unknown = host.call("rollback", to="nope-123")
    assert not unknown["ok"] and unknown["error"]["code"] == "unknown_release"


def test_foreign_file_refused_unless_adopt(host: Host, tmp_path: Path) -> None:
    (host.site / "sglang/srt/server_args.py").write_bytes(b"# hand-edited by someone\n")
    before = host.snapshot()
    b = make_bundle(tmp_path / "dist")
    ans = host.push(b)
    assert not ans["ok"] and ans["error"]["code"] == "foreign"
    assert "sglang/srt/server_args.py" in ans["error"]["message"] and "--adopt" in ans["error"]["hint"]
    assert host.snapshot() == before
    plan = host.call("plan", manifest=b.manifest)["result"]
    assert {f["path"]: f["action"] for f in plan["files"]}["sglang/srt/server_args.py"] == "foreign"
    ans = host.push(b, adopt=True)
    assert ans["ok"], ans
    host.call("rollback", to="previous")
    assert host.snapshot() == before  # the adopted foreign bytes came back from the backup


def test_wrong_version_refused(tmp_path: Path) -> None:
    host = Host(tmp_path)
    b = make_bundle(tmp_path / "dist", base_version="0.5.12")
    before = host.snapshot()
    ans = host.push(b)
    assert not ans["ok"] and ans["error"]["code"] == "wrong_version"
    assert "0.5.13.post1" in ans["error"]["message"] and "0.5.12" in ans["error"]["message"]
    assert host.snapshot() == before and not (host.state_dir / "releases").exists()


def test_tampered_bundle_refused_before_any_change(host: Host, tmp_path: Path) -> None:
    before = host.snapshot()
    b = make_bundle(tmp_path / "dist", tamper="sglang/srt/server_args.py")
    ans = host.push(b)
    assert not ans["ok"] and ans["error"]["code"] == "bad_bundle"
    assert "server_args.py" in ans["error"]["message"]
    assert host.snapshot() == before and not (host.state_dir / "releases").exists()
    # A bundle damaged in transit (sha256 differs from the one the control side sent).
    good = make_bundle(tmp_path / "dist2")
    name = host.stage(good)
    staged = host.state_dir / "staging" / name
    staged.write_bytes(staged.read_bytes()[:-10])
    ans = run_agent("install", {**host.base, "bundle": name, "bundle_sha256": good.sha256})
    assert not ans["ok"] and ans["error"]["code"] == "bad_bundle" and host.snapshot() == before


def test_plan_is_a_dry_run(host: Host, tmp_path: Path) -> None:
    b = make_bundle(tmp_path / "dist")
    before = host.snapshot()
    plan = host.call("plan", manifest=b.manifest)
    assert plan["ok"], plan
    files = {f["path"]: f for f in plan["result"]["files"]}
    assert files["sglang/srt/server_args.py"]["now"] == sha(PRISTINE["sglang/srt/server_args.py"])
    assert files["sglang/srt/speculative/ddtree_utils.py"]["now"] is None
    assert {f["action"] for f in files.values()} == {"install"} and plan["result"]["changes"] == 4
    assert host.snapshot() == before and not (host.state_dir / "releases").exists()


def _assert_all_or_nothing(host: Host, bundle) -> str:
    got = host.hashes(bundle.paths)
    if got == patched_hashes(bundle):
        return "patched"
    assert got == pristine_hashes(bundle.paths), f"mixed or missing: {got}"
    return "pristine"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(min_value=1, max_value=4), then=st.sampled_from(["push", "rollback"]))
def test_sigkill_mid_install_converges(tmp_path_factory, k: int, then: str) -> None:
    root = tmp_path_factory.mktemp("kill")
    host = Host(root)
    before = host.snapshot()
    b = make_bundle(root / "dist")
    env = {**os.environ, KILL_ENV: str(k)}
    with pytest.raises(AssertionError, match="gave no answer"):
        host.push(b, env=env)
    assert (host.state_dir / "journal.json").exists()
    # The host right after the kill: k files changed, the rest not. Never a torn file.
    for rel in b.paths:
        h = host.hashes([rel])[rel]
        assert h in (sha(b.patched[rel]), pristine_hashes([rel])[rel])
    # The dead agent held its own lock (same host, pid gone): stale, so the next run proceeds.
    if then == "push":
        ans = host.push(b)
        assert ans["ok"], ans
        assert ans["result"]["recovered"]["direction"] == "completed"
        assert _assert_all_or_nothing(host, b) == "patched"
    else:
        ans = host.call("rollback", to="previous")
        assert ans["ok"], ans
        assert ans["result"]["recovered"]["direction"] == "completed"
        assert _assert_all_or_nothing(host, b) == "pristine"
        assert host.snapshot() == before
    assert not (host.state_dir / "journal.json").exists()
    assert not list(host.site.rglob("*.ddtree-tmp"))


@pytest.mark.parametrize("k", [1, 2])
def test_sigkill_mid_rollback_converges(host: Host, tmp_path: Path, k: int) -> None:
    before = host.snapshot()
    b = make_bundle(tmp_path / "dist")
    assert host.push(b)["ok"]
    env = {**os.environ, KILL_ENV: str(k)}
    with pytest.raises(AssertionError, match="gave no answer"):
        run_agent("rollback", {**host.base, "to": "previous"}, env=env)
    ans = host.call("history")["result"]
    assert ans["state"]["current"] is not None  # not recorded yet
    again = host.call("rollback", to="previous")
    assert again["ok"], again
    # Recovery completed the interrupted rollback; the second rollback then found nothing to do.
    assert again["result"]["recovered"]["direction"] == "completed" and again["result"]["noop"]
    assert host.snapshot() == before


def test_lock_contention_names_holder(host: Host) -> None:
    # As the control side does: its own host and pid, so a crash of the caller is detectable.
    held = host.call("lock", who="alice", command="push", ttl_s=60, host=socket.gethostname(), pid=os.getpid())
    assert held["ok"], held
    lock_id = held["result"]["lock_id"]
    t0 = time.monotonic()
    other = host.call("lock", who="bob", command="push", wait_s=1.0)
    waited = time.monotonic() - t0
    assert not other["ok"] and other["error"]["code"] == "locked"
    assert "alice" in other["error"]["message"] and "unlock" in other["error"]["hint"]
    assert waited >= 1.0
    # A push without the lock_id is refused too, and does nothing.
    b = make_bundle(host.root / "dist")
    before = host.snapshot()
    ans = host.push(b)
    assert not ans["ok"] and ans["error"]["code"] == "locked" and host.snapshot() == before
    # With the lock_id the push runs under the held lock.
    ans = host.push(b, lock_id=lock_id)
    assert ans["ok"], ans
    assert host.call("lock_status")["result"]["holder"]["who"] == "alice"
    assert host.call("unlock", lock_id="wrong")["result"]["released"] is False
    assert host.call("unlock", lock_id=lock_id)["result"]["released"] is True
    assert host.call("lock_status")["result"]["holder"] is None


def test_lock_waits_for_release(host: Host) -> None:
    lock_id = host.call("lock", who="alice", command="push")["result"]["lock_id"]
    waiter = subprocess.Popen(
        [sys.executable, "-c", "import json,sys; from tests.release_fixtures import run_agent; "
         "print(json.dumps(run_agent('lock', json.loads(sys.argv[1]))))",
         json.dumps({**host.base, "who": "bob", "command": "push", "wait_s": 20})],
        stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    time.sleep(1.0)
    host.call("unlock", lock_id=lock_id)
    out, _ = waiter.communicate(timeout=30)
    ans = json.loads(out)
    assert ans["ok"] and ans["result"]["lock"]["who"] == "bob"


def test_two_concurrent_pushes_never_both_write(host: Host, tmp_path: Path) -> None:
    b = make_bundle(tmp_path / "dist")
    name = host.stage(b)
    req = json.dumps({**host.base, "bundle": name, "bundle_sha256": b.sha256})
    code = ("import json,sys; from tests.release_fixtures import run_agent; "
            "print(json.dumps(run_agent('install', json.loads(sys.argv[1]))))")
    procs = [subprocess.Popen([sys.executable, "-c", code, req], stdout=subprocess.PIPE,
                              cwd=Path(__file__).resolve().parents[1]) for _ in range(2)]
    answers = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    installed = [a for a in answers if a["ok"] and not a["result"]["noop"]]
    assert len(installed) <= 1
    others = [a for a in answers if a not in installed]
    for a in others:
        assert (a["ok"] and a["result"]["noop"]) or a["error"]["code"] in ("locked", "not_staged"), a
    assert host.hashes(b.paths) == patched_hashes(b) or len(installed) == 0


def test_stale_lock_by_ttl_is_broken(host: Host) -> None:
    lock_id = host.call("lock", who="ghost", command="push", ttl_s=0.5, host="elsewhere", pid=1)["result"]["lock_id"]
    assert lock_id
    time.sleep(0.7)
    ans = host.call("lock", who="bob", command="push")
    assert ans["ok"] and ans["result"]["lock"]["who"] == "bob"


def test_a_dead_control_run_is_told_apart_and_its_lock_broken_by_run_id_only(host: Host) -> None:
    from ddtree_ops.agent.remote import lock as agent_lock

    # A run of this machine that has exited (its pid gone, or reused by a process with another start).
    child = subprocess.run([sys.executable, "-c", "import json; from ddtree_ops.agent.remote import lock; "
                            "print(json.dumps(lock.control_process()))"], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[1])
    dead = json.loads(child.stdout)
    alive = agent_lock.control_process()
    assert agent_lock.died_here(dead) and not agent_lock.died_here(alive)
    # Another machine (or boot, or pid namespace) cannot be judged from here: never called dead.
    assert not agent_lock.died_here({**dead, "boot_id": "another-boot"})
    assert not agent_lock.died_here({**dead, "pid_ns": "pid:[1]"})
    assert not agent_lock.died_here({**dead, "start_ticks": None})

    held = host.call("lock", who="alice", command="promote --mode full", run_id="run-a", control_process=dead)
    assert held["ok"], held
    refused = host.call("lock", who="bob", command="promote --mode full")
    assert refused["error"]["code"] == "locked"
    assert refused["error"]["holder"]["control_process"] == dead and refused["error"]["holder"]["run_id"] == "run-a"
    # Broken by its run id only: a lock some other run took meanwhile stays.
    assert host.call("unlock", run_id="run-b")["result"]["released"] is False
    assert host.call("lock_status")["result"]["holder"]["run_id"] == "run-a"
    assert host.call("unlock", run_id="run-a")["result"]["released"] is True
    assert host.call("lock_status")["result"]["holder"] is None
    bad = host.call("lock", who="bob", command="push", control_process={"pid": "1"})
    assert bad["error"]["code"] == "bad_request"


def test_force_unlock_breaks_only_a_dead_runs_lock(host: Host) -> None:
    """`unlock` never breaks a lock whose heartbeat is fresh (a live run's): only a stale one, or one
    whose run the control side saw die (by its run id)."""
    host.call("lock", who="alice", command="push", host="laptop", pid=99999, run_id="run-a", ttl_s=60)
    refused = host.call("unlock", force=True)
    assert refused["error"]["code"] == "lock_alive" and "alice" in refused["error"]["message"], refused
    assert "wait" in refused["error"]["hint"] and host.call("lock_status")["result"]["holder"]["who"] == "alice"
    assert host.call("unlock", force=True, dead_run_id="run-b")["error"]["code"] == "lock_alive"
    ans = host.call("unlock", force=True, dead_run_id="run-a")
    assert ans["result"]["released"] and ans["result"]["holder"]["who"] == "alice"
    host.call("lock", who="ghost", command="push", host="laptop", pid=99999, ttl_s=0.2)
    time.sleep(0.4)
    ans = host.call("unlock", force=True)
    assert ans["result"]["released"] and ans["result"]["holder"]["who"] == "ghost"


def _fill_leaving(d: Path, leave: int) -> None:
    st = os.statvfs(d)
    free = st.f_bavail * st.f_frsize
    (d / "filler").write_bytes(b"\0" * max(0, free - leave))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_full_state_dir_fs_leaves_host_unchanged(host: Host, tmp_path: Path) -> None:
    host.state_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(host.state_dir)], check=True)
    try:
        b = make_bundle(tmp_path / "dist")
        before = host.snapshot()
        _fill_leaving(host.state_dir, 0)
        # 1. Upload refused up front.
        ans = host.call("stage_begin", name=b.path.name, size=b.path.stat().st_size)
        assert not ans["ok"] and ans["error"]["code"] == "no_space", ans
        assert "nothing was changed" in ans["error"]["hint"]
        # 2. The upload landed, then the disk filled: install refuses before any backup.
        (host.state_dir / "filler").unlink()
        name = host.stage(b)
        _fill_leaving(host.state_dir, 8 * 1024)
        ans = run_agent("install", {**host.base, "bundle": name, "bundle_sha256": b.sha256})
        assert not ans["ok"] and ans["error"]["code"] == "no_space", ans
        assert host.snapshot() == before
        # 3. ENOSPC in the middle of writing the release dir (the free-space check skipped).
        (host.state_dir / "filler").unlink()
        _fill_leaving(host.state_dir, 3 * 4096)
        ans = run_agent("install", {**host.base, "bundle": name, "bundle_sha256": b.sha256,
                                    "test_skip_space_check": True})
        assert not ans["ok"] and ans["error"]["code"] == "no_space", ans
        assert "site-packages was not touched" in ans["error"]["hint"]
        assert "filled up" in ans["error"]["message"], ans
        assert host.snapshot() == before
        assert not (host.state_dir / "journal.json").exists() and not (host.state_dir / "lock").exists()
        assert not [p for p in (host.state_dir / "releases").iterdir()] if (host.state_dir / "releases").exists() \
            else True
        # 4. With room again the same push works.
        (host.state_dir / "filler").unlink()
        ans = run_agent("install", {**host.base, "bundle": name, "bundle_sha256": b.sha256})
        assert ans["ok"], ans
        assert host.hashes(b.paths) == patched_hashes(b)
    finally:
        subprocess.run(["umount", "-l", str(host.state_dir)], check=False)


def test_repush_repairs_a_reverted_file(host: Host, tmp_path: Path) -> None:
    before = host.snapshot()
    b = make_bundle(tmp_path / "dist")
    rid = host.push(b)["result"]["release"]
    # Someone reinstalled sglang's wheel file: back to pristine, our current release half gone.
    (host.site / "sglang/srt/server_args.py").write_bytes(PRISTINE["sglang/srt/server_args.py"])
    ans = host.push(b)
    assert ans["ok"] and not ans["result"]["noop"] and ans["result"]["changed"] == ["sglang/srt/server_args.py"]
    assert host.hashes(b.paths) == patched_hashes(b)
    st = host.call("history")["result"]["state"]
    assert st["stack"] == [rid]
    assert host.call("rollback", to="previous")["ok"]
    assert host.snapshot() == before


def test_dry_run_reports_an_interrupted_install(host: Host, tmp_path: Path) -> None:
    b = make_bundle(tmp_path / "dist")
    with pytest.raises(AssertionError, match="gave no answer"):
        host.push(b, env={**os.environ, KILL_ENV: "1"})
    plan = host.call("plan", manifest=b.manifest)["result"]
    assert plan["interrupted"]["action"] == "push" and plan["noop"] is False
    assert host.push(b)["result"]["recovered"]["direction"] == "completed"
    assert host.call("plan", manifest=b.manifest)["result"]["interrupted"] is None

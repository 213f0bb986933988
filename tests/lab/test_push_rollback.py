"""push → smoke → rollback on the lab fleet, and every way a release can go wrong there.

The bundle is the real payload built against the pristine sglang 0.5.13.post1 files of the dev
venv (the same wheel the lab hosts run). Every test starts from pristine hosts with an empty
state dir (fixture `pristine_fleet`) and asserts file hashes as read on the hosts themselves.
"""

from __future__ import annotations

import io
import json
import shlex
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from ddtree_ops import release
from ddtree_ops.bundle import build_bundle
from ddtree_ops.errors import OpsError
from ddtree_ops.fleet import run_on_hosts
from ddtree_ops.inventory import load_inventory
from tests.lab.remote_sglang import remote_hashes, site_path

pytestmark = pytest.mark.lab

STATE_DIR = "/var/lib/ddtree-ops"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> release.LocalBundle:
    import importlib.metadata

    site = importlib.metadata.distribution("sglang").locate_file("")
    out = tmp_path_factory.mktemp("dist")
    built = build_bundle(None, out, site_dir=site)
    return release.LocalBundle.load(built.bundle_path)


@pytest.fixture(scope="module")
def inv(lab_fleet):
    return load_inventory(lab_fleet.inventory_path)


def paths(bundle: release.LocalBundle) -> list[str]:
    m = bundle.manifest
    return sorted([f["path"] for f in m["patched_files"]] + [f["path"] for f in m["new_files"]])


def patched(bundle: release.LocalBundle) -> dict[str, str]:
    m = bundle.manifest
    return {f["path"]: f["sha256"] for f in m["patched_files"] + m["new_files"]}


def pristine(bundle: release.LocalBundle) -> dict[str, str | None]:
    m = bundle.manifest
    return {**{f["path"]: f["pristine_sha256"] for f in m["patched_files"]}, **{f["path"]: None for f in m["new_files"]}}


def by_host(results) -> dict:
    return {r.host: r for r in results}


@pytest.fixture
def pristine_fleet(lab_fleet, inv, bundle):
    """Before and after each test: every host pristine, no lock, empty state dir."""

    def reset() -> None:
        hosts = inv.select(None)
        release.unlock(inv, hosts)
        release.rollback(inv, hosts, to="pristine", adopt=True)
        for h in lab_fleet.hosts:
            lab_fleet.ssh(h, f"umount -l {STATE_DIR} 2>/dev/null; rm -rf {STATE_DIR}")
            assert remote_hashes(lab_fleet, h, paths(bundle)) == pristine(bundle), f"{h} not pristine"

    reset()
    yield inv.select(None)
    reset()


def test_push_smoke_rollback_three_hosts(lab_fleet, inv, bundle, pristine_fleet):
    hosts = pristine_fleet
    results = release.push(inv, hosts, bundle)
    assert all(r.ok for r in results), [r.to_dict() for r in results]
    rid = results[0].data["release"]
    for h in lab_fleet.hosts:
        assert remote_hashes(lab_fleet, h, paths(bundle)) == patched(bundle)
    from ddtree_ops.smoke import smoke

    smoked = smoke(inv, hosts)
    assert all(r.ok for r in smoked), [r.to_dict() for r in smoked]
    for r in smoked:
        steps = {s["name"]: s for s in r.data["steps"]}
        assert set(steps) == {"import", "server_args", "tree"} and all(s["passed"] for s in steps.values())
        cases = {c["case"]: c for c in steps["server_args"]["detail"]}
        assert cases["budget 513"]["ok"] and "--speculative-ddtree-budget" in cases["budget 513"]["detail"]
    back = release.rollback(inv, hosts)
    assert all(r.ok and r.data["popped"] == [rid] for r in back), [r.to_dict() for r in back]
    for h in lab_fleet.hosts:
        assert remote_hashes(lab_fleet, h, paths(bundle)) == pristine(bundle)
    hist = by_host(release.history(inv, hosts))
    audit = [a["result"] for a in hist["lab-1"].data["audit"]]
    assert audit[-2:] == ["installed", "rolled-back"]
    # Nothing left to roll back: a clear no-op.
    again = release.rollback(inv, hosts)
    assert all(r.ok and r.data["noop"] and "nothing to roll back" in r.data["message"] for r in again)


def test_repush_is_a_noop(lab_fleet, inv, bundle, pristine_fleet):
    first = release.push(inv, pristine_fleet, bundle)
    assert all(r.ok and not r.data["noop"] for r in first)
    second = release.push(inv, pristine_fleet, bundle)
    assert all(r.ok and r.data["noop"] and "already current" in r.data["message"] for r in second)
    hist = release.history(inv, pristine_fleet)
    assert all(len(r.data["history"]) == 1 for r in hist)


def test_dry_run_changes_nothing(lab_fleet, inv, bundle, pristine_fleet):
    results = release.push(inv, pristine_fleet, bundle, dry_run=True)
    assert all(r.ok and r.data["dry_run"] and r.data["changes"] == len(paths(bundle)) for r in results)
    f = {x["path"]: x for x in results[0].data["files"]}
    some = paths(bundle)[0]
    assert f[some]["now"] == pristine(bundle)[some] and f[some]["target"] == patched(bundle)[some]
    for h in lab_fleet.hosts:
        assert remote_hashes(lab_fleet, h, paths(bundle)) == pristine(bundle)
        assert lab_fleet.ssh(h, f"test -e {STATE_DIR}/state.json").returncode != 0


def test_foreign_file_refused_then_adopted(lab_fleet, inv, bundle, pristine_fleet):
    rel = bundle.manifest["patched_files"][0]["path"]
    target = site_path(lab_fleet, "lab-1", rel)
    size = lab_fleet.ssh("lab-1", f"stat -c %s {shlex.quote(target)}").stdout.strip()
    assert lab_fleet.ssh("lab-1", f"echo '# hotfix by someone' >> {shlex.quote(target)}").returncode == 0
    try:
        foreign = remote_hashes(lab_fleet, "lab-1", [rel])[rel]
        res = by_host(release.push(inv, pristine_fleet, bundle))
        assert res["lab-2"].ok and res["lab-3"].ok
        assert res["lab-1"].status == "failed" and res["lab-1"].error.code == "foreign"
        assert rel in res["lab-1"].error.message and "--adopt" in res["lab-1"].error.hint
        assert remote_hashes(lab_fleet, "lab-1", [rel])[rel] == foreign
        adopted = release.push(inv, inv.select("lab-1"), bundle, adopt=True)
        assert adopted[0].ok, adopted[0].to_dict()
        assert remote_hashes(lab_fleet, "lab-1", paths(bundle)) == patched(bundle)
        release.rollback(inv, inv.select("lab-1"))
        assert remote_hashes(lab_fleet, "lab-1", [rel])[rel] == foreign  # the hotfix came back from backup
    finally:
        lab_fleet.ssh("lab-1", f"truncate -s {size} {shlex.quote(target)}")


def test_wrong_version_refused(lab_fleet, inv, bundle, pristine_fleet):
    meta = site_path(lab_fleet, "lab-2", "sglang-0.5.13.post1.dist-info/METADATA")
    q = shlex.quote(meta)
    assert lab_fleet.ssh("lab-2", f"sed -i 's/^Version: 0.5.13.post1$/Version: 0.5.14/' {q}").returncode == 0
    try:
        res = by_host(release.push(inv, pristine_fleet, bundle))
        assert res["lab-2"].status == "failed" and res["lab-2"].error.code == "wrong_version"
        assert "0.5.14" in res["lab-2"].error.message and "0.5.13.post1" in res["lab-2"].error.message
        assert remote_hashes(lab_fleet, "lab-2", paths(bundle)) == pristine(bundle)
        assert res["lab-1"].ok and res["lab-3"].ok
    finally:
        lab_fleet.ssh("lab-2", f"sed -i 's/^Version: 0.5.14$/Version: 0.5.13.post1/' {q}")


def _tampered_copy(bundle: release.LocalBundle, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    dst = out / bundle.path.name
    victim = "files/" + paths(bundle)[0]
    src = io.BytesIO(bundle.path.read_bytes())
    buf = io.BytesIO()
    with tarfile.open(fileobj=src, mode="r:gz") as tin, tarfile.open(fileobj=buf, mode="w:gz") as tout:
        for m in tin.getmembers():
            data = tin.extractfile(m).read()
            if m.name == victim:
                data += b"\nimport os  # injected\n"
                m.size = len(data)
            tout.addfile(m, io.BytesIO(data))
    dst.write_bytes(buf.getvalue())
    return dst


def test_tampered_bundle_refused_before_any_change(lab_fleet, inv, bundle, pristine_fleet, tmp_path):
    bad = _tampered_copy(bundle, tmp_path)
    with pytest.raises(OpsError, match="tampered"):
        release.push(inv, pristine_fleet, bad)
    # Skip the local check (as if the bundle changed after it): the agent refuses it on the host.
    import hashlib

    data = bad.read_bytes()
    sneaky = release.LocalBundle(bad, hashlib.sha256(data).hexdigest(), len(data), bundle.manifest)
    res = release.push(inv, pristine_fleet, sneaky)
    assert all(r.status == "failed" and r.error.code == "bad_bundle" for r in res), [r.to_dict() for r in res]
    for h in lab_fleet.hosts:
        assert remote_hashes(lab_fleet, h, paths(bundle)) == pristine(bundle)
        assert lab_fleet.ssh(h, f"ls {STATE_DIR}/releases 2>/dev/null | wc -l").stdout.strip() == "0"
        assert lab_fleet.ssh(h, f"test -e {STATE_DIR}/lock").returncode != 0


def test_two_concurrent_pushes_never_both_write(lab_fleet, inv, bundle, pristine_fleet):
    hosts = inv.select("lab-1")
    results: list = []
    barrier = threading.Barrier(2)

    def go(who: str) -> None:
        barrier.wait()
        results.append(release.push(inv, hosts, bundle, operator=who)[0])

    threads = [threading.Thread(target=go, args=(w,)) for w in ("alice@a", "bob@b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    installed = [r for r in results if r.ok and not r.data["noop"]]
    assert len(installed) == 1, [r.to_dict() for r in results]
    other = next(r for r in results if r is not installed[0])
    assert (other.ok and other.data["noop"]) or (other.error.code == "locked" and "@" in other.error.message)
    hist = release.history(inv, hosts)[0].data
    assert [a["result"] for a in hist["audit"]].count("installed") == 1
    # With --lock-wait, a second push waits for the first and then finds nothing to do.
    release.rollback(inv, hosts)
    results.clear()
    barrier.reset()

    def go_wait(who: str) -> None:
        barrier.wait()
        results.append(release.push(inv, hosts, bundle, operator=who, lock_wait_s=60)[0])

    threads = [threading.Thread(target=go_wait, args=(w,)) for w in ("alice@a", "bob@b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(r.ok for r in results), [r.to_dict() for r in results]
    assert sorted(r.data["noop"] for r in results) == [False, True]


@pytest.mark.parametrize("then", ["push", "rollback"])
def test_sigkill_mid_install_converges(lab_fleet, inv, bundle, pristine_fleet, then):
    hosts = inv.select("lab-3")
    killed = run_on_hosts(hosts, lambda ctx: release.push_host(ctx, inv, bundle, test_kill_after_files=2))
    assert killed[0].status == "failed" and killed[0].error.code == "agent_no_answer", killed[0].to_dict()
    assert lab_fleet.ssh("lab-3", f"test -e {STATE_DIR}/journal.json").returncode == 0
    assert lab_fleet.ssh("lab-3", f"test -e {STATE_DIR}/lock").returncode != 0  # released in finally
    now = remote_hashes(lab_fleet, "lab-3", paths(bundle))
    assert sum(now[p] == patched(bundle)[p] for p in now) == 2
    assert all(now[p] in (patched(bundle)[p], pristine(bundle)[p]) for p in now)
    if then == "push":
        res = release.push(inv, hosts, bundle)[0]
        assert res.ok and res.data["recovered"]["direction"] == "completed", res.to_dict()
        assert remote_hashes(lab_fleet, "lab-3", paths(bundle)) == patched(bundle)
    else:
        res = release.rollback(inv, hosts)[0]
        assert res.ok and res.data["recovered"]["direction"] == "completed", res.to_dict()
        assert remote_hashes(lab_fleet, "lab-3", paths(bundle)) == pristine(bundle)
    assert lab_fleet.ssh("lab-3", f"test -e {STATE_DIR}/journal.json").returncode != 0


def test_full_state_dir_filesystem(lab_fleet, inv, bundle, pristine_fleet):
    sd = STATE_DIR
    # 256 KiB with 16 KiB left: the lock fits, the upload plus backups do not.
    r = lab_fleet.ssh("lab-2", f"mkdir -p {sd} && mount -t tmpfs -o size=256k,mode=0700 tmpfs {sd} && "
                               f"dd if=/dev/zero of={sd}/filler bs=4k count=60 2>/dev/null")
    assert r.returncode == 0, r.stderr
    try:
        res = by_host(release.push(inv, pristine_fleet, bundle))
        assert res["lab-2"].status == "failed" and res["lab-2"].error.code == "no_space", res["lab-2"].to_dict()
        assert "state dir" in res["lab-2"].error.message
        assert remote_hashes(lab_fleet, "lab-2", paths(bundle)) == pristine(bundle)
        assert lab_fleet.ssh("lab-2", f"test -e {sd}/journal.json -o -e {sd}/lock").returncode != 0
        assert res["lab-1"].ok and res["lab-3"].ok
    finally:
        lab_fleet.ssh("lab-2", f"umount -l {sd}")


def test_nothing_secret_in_json_or_logs(lab_fleet, inv, bundle, pristine_fleet):
    from ddtree_ops.signing import sign_bundle

    # Signed with the lab's key, which the lab inventory trusts: push refuses an unsigned bundle.
    signer_key = lab_fleet.inventory_path.parent / "lab" / "signer_ed25519"
    sign_bundle(bundle.path, signer_key)
    cmd = [sys.executable, "-c", "from ddtree_ops.cli import main; main()", "push",
           "-i", str(lab_fleet.inventory_path), "--bundle", str(bundle.path), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=lab_fleet.repo_root)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["summary"]["ok"] == 3 and doc["bundle"]["signature"]["signer"] == "lab"
    key_text = lab_fleet.identity_file.read_text()
    key_body = "".join(key_text.strip().splitlines()[1:-1])
    secrets = [key_body[i:i + 24] for i in range(0, len(key_body) - 24, 24)]
    signer_body = "".join(signer_key.read_text().strip().splitlines()[1:-1])
    signer_secrets = [signer_body[i:i + 24] for i in range(0, len(signer_body) - 24, 24)]
    for h in lab_fleet.hosts:
        logs = lab_fleet.ssh(h, f"cat {STATE_DIR}/audit.log {STATE_DIR}/state.json").stdout
        for text in (proc.stdout, proc.stderr, logs):
            assert "PRIVATE KEY" not in text
            assert not any(s in text for s in secrets + signer_secrets)
    assert "lock_id" not in proc.stdout


@pytest.mark.lab_destructive
def test_unreachable_host_others_complete(lab_exclusive, inv, bundle, pristine_fleet):
    # Stopping a host would pull it from under other sessions' tests: lab_exclusive waits for them.
    from ddtree_ops.lab.fleet import start_host, stop_host

    lab_fleet = lab_exclusive

    stop_host("lab-3")
    try:
        results = release.push(inv, pristine_fleet, bundle)
        res = by_host(results)
        assert res["lab-1"].ok and res["lab-2"].ok
        assert res["lab-3"].status == "unreachable"
        assert release.summary(results)["unreachable"] == ["lab-3"]
    finally:
        start_host("lab-3")
    for h in ("lab-1", "lab-2"):
        assert remote_hashes(lab_fleet, h, paths(bundle)) == patched(bundle)


def test_unlock_shows_and_repairs_a_damaged_state_dir(lab_fleet, inv, bundle, pristine_fleet):
    """Issue 11 on a real host, through the CLI: a torn journal and a garbage lock owner are shown by
    `unlock`, which clears the lock but keeps a journal whose change is half done; `rollback --to
    pristine` then repairs the host without hand work."""
    hosts = inv.select("lab-2")
    killed = run_on_hosts(hosts, lambda ctx: release.push_host(ctx, inv, bundle, test_kill_after_files=1))
    assert killed[0].error.code == "agent_no_answer", killed[0].to_dict()
    sd = STATE_DIR
    r = lab_fleet.ssh("lab-2", f"truncate -s 30 {sd}/journal.json && mkdir {sd}/lock && "
                               f"printf '{{\"who\": ' > {sd}/lock/owner.json")
    assert r.returncode == 0, r.stderr
    refused = by_host(release.push(inv, hosts, bundle))["lab-2"]
    assert refused.error.code == "state_damaged" and f"{sd}/journal.json" in refused.error.message
    assert "ddtree-ops unlock" in refused.error.hint

    def cli(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", "from ddtree_ops.cli import main; main()", *args, "-i", str(lab_fleet.inventory_path)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=lab_fleet.repo_root)

    unlocked = cli("unlock", "lab-2", "--yes")
    assert f"found {sd}/journal.json" in unlocked.stderr and "damaged lock" in unlocked.stderr, unlocked.stderr
    # Exit 1: the lock is broken, but the half-done change's journal is not discarded; the hint names the repair.
    assert unlocked.returncode == 1 and "rollback --to pristine" in unlocked.stderr, unlocked.stderr
    assert lab_fleet.ssh("lab-2", f"test -e {sd}/lock").returncode != 0
    assert lab_fleet.ssh("lab-2", f"test -e {sd}/journal.json").returncode == 0  # half done: kept
    repaired = cli("rollback", "--to", "pristine", "--limit", "lab-2")
    assert repaired.returncode == 0, repaired.stderr
    assert remote_hashes(lab_fleet, "lab-2", paths(bundle)) == pristine(bundle)
    assert lab_fleet.ssh("lab-2", f"test -e {sd}/journal.json").returncode != 0
    again = by_host(release.push(inv, hosts, bundle))["lab-2"]
    assert again.ok, again.to_dict()
    assert remote_hashes(lab_fleet, "lab-2", paths(bundle)) == patched(bundle)

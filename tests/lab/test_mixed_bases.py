"""A mixed-version fleet on the lab: one host on SGLang 0.5.13.post1 (v1 worker), one on 0.5.23 (v2 worker,
its own venv in the lab image), driven through the CLI as an operator would: build every base's bundle, push
them together (each host gets its own), smoke, promote shadow-linear, status, full refused on 0.5.23 before
anything changes, rollback to pristine (each host's own wheel bytes back).

The two hosts are lab-4 and lab-5, booted beside the session's three for this module only (fresh overlays, so
nothing another module left on lab-1 … lab-3 matters), and removed again at its end.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.lab.conftest import EXCLUSIVE_WAIT_S, LAB_HOSTS, REPO_ROOT, LabFleet, LabLease
from tests.lab.remote_sglang import remote_hashes

pytestmark = pytest.mark.lab

OLD, NEW = "lab-4", "lab-5"
VERSIONS = {OLD: "0.5.13.post1", NEW: "0.5.23"}
PYTHON = {OLD: "/opt/sglang/venv/bin/python", NEW: "/opt/sglang-0.5.23/venv/bin/python"}
SERVER_INFO = ("import json, urllib.request; print(urllib.request.urlopen("
               "'http://127.0.0.1:30000/server_info', timeout=30).read().decode())")


def cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    # This checkout's ddtree-ops (not whichever one the venv's console script points at); wide enough that
    # the status table does not wrap a cell.
    argv = [sys.executable, "-c", "from ddtree_ops.cli import main; main()", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")} | {"COLUMNS": "300"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)


def cli_json(*args: str, expect: int = 0) -> dict:
    proc = cli(*args, "--json")
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def by_host(doc: dict) -> dict[str, dict]:
    return {r["host"]: r for r in doc["results"]}


@pytest.fixture(scope="module")
def mixed(lab_fleet: LabFleet, lab_lease: LabLease, tmp_path_factory) -> Iterator[tuple[LabFleet, Path]]:
    """lab-4 (0.5.13.post1) and lab-5 (0.5.23) up beside the session's hosts, and an inventory of those two.

    Adding hosts rewrites inventory/lab.yaml, which other test sessions read: the lab is this module's alone."""
    from ddtree_ops.lab.fleet import lab_up

    if not lab_lease.try_exclusive(EXCLUSIVE_WAIT_S):
        pytest.skip(f"other test sessions kept using the lab for {EXCLUSIVE_WAIT_S:.0f} s")
    try:
        status = lab_up(LAB_HOSTS + 2, REPO_ROOT, sglang={NEW: VERSIONS[NEW]})
        assert {h.name: h.sglang for h in status.gpu_hosts if h.name in VERSIONS} == VERSIONS
        data = lab_fleet.inventory_data()
        data["hosts"] = {h: data["hosts"][h] for h in VERSIONS}
        data["groups"] = {"main": {"hosts": [OLD, NEW]}}  # no canary: promote --batch 100% gates both at once
        data["all"]["vars"].update(start_timeout_s=240, restart_sec=2)
        tmp = tmp_path_factory.mktemp("mixed")
        inv = tmp / "mixed.yaml"
        inv.write_text(yaml.safe_dump(data, sort_keys=False))
        yield lab_fleet, inv
    finally:
        lab_up(LAB_HOSTS, REPO_ROOT)  # lab-4 and lab-5 go; lab.yaml is the session's again
        lab_lease.shared()


def server_info(lab_fleet: LabFleet, host: str) -> dict:
    r = lab_fleet.ssh(host, shlex.join([PYTHON[host], "-c", SERVER_INFO]))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def main_pid(lab_fleet: LabFleet, host: str) -> str:
    return lab_fleet.ssh(host, "systemctl show -p MainPID --value sglang.service").stdout.strip()


def test_mixed_fleet_push_smoke_promote_rollback(mixed, tmp_path: Path) -> None:
    lab_fleet, inv = mixed
    # The lab's ready inventory gives the 0.5.23 host its own venv's interpreter, and facts read 0.5.23 there.
    lab_yaml = yaml.safe_load(lab_fleet.inventory_path.read_text())
    assert lab_yaml["hosts"][NEW]["python"] == PYTHON[NEW] and "python" not in lab_yaml["hosts"][OLD]
    rows = by_host(cli_json("status", "-i", str(inv)))
    for h, version in VERSIONS.items():
        facts = rows[h]["data"]
        assert facts["sglang"]["version"] == version and facts["python"]["executable"].startswith(PYTHON[h][:-6])
    assert {h: rows[h]["data"]["payload_base"]["worker"] for h in VERSIONS} == {OLD: "v1", NEW: "v2"}

    # One bundle per base, signed with the key lab.yaml trusts; push picks each host's own.
    dist = tmp_path / "dist"
    built = cli("build", "--all-bases", "-o", str(dist), "--sign-key", str(lab_fleet.inventory_path.parent / "lab"
                                                                             / "signer_ed25519"))
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    manifests = {json.loads(p.read_text())["base_version"]: json.loads(p.read_text())
                 for p in dist.glob("*.manifest.json")}
    assert set(VERSIONS.values()) <= set(manifests)
    files = {h: manifests[v]["patched_files"] + manifests[v]["new_files"] for h, v in VERSIONS.items()}
    rels = {h: sorted(f["path"] for f in fs) for h, fs in files.items()}
    pristine = {h: remote_hashes(lab_fleet, h, rels[h], PYTHON[h]) for h in VERSIONS}
    for h, v in VERSIONS.items():  # the hosts start pristine: patched files are the wheel's, new ones absent
        want = {f["path"]: f.get("pristine_sha256") for f in manifests[v]["patched_files"]}
        assert pristine[h] == {**want, **{f["path"]: None for f in manifests[v]["new_files"]}}, h

    pushed = by_host(cli_json("push", "-i", str(inv), "--bundle", str(dist)))
    for h, v in VERSIONS.items():
        assert pushed[h]["status"] == "ok", pushed[h]
        assert pushed[h]["data"]["bundle"]["base_version"] == pushed[h]["data"]["bundle"]["host_version"] == v
        assert remote_hashes(lab_fleet, h, rels[h], PYTHON[h]) == {f["path"]: f["sha256"] for f in files[h]}, h
    assert "ddtree_v2_args.py" in json.dumps(rels[NEW]) and "ddtree_v2_args.py" not in json.dumps(rels[OLD])

    smoked = by_host(cli_json("smoke", "-i", str(inv)))
    for h in VERSIONS:
        assert smoked[h]["status"] == "ok", smoked[h]
        steps = {s["name"]: s for s in smoked[h]["data"]["steps"]}
        assert all(s["passed"] for s in steps.values()), steps
    cases = {c["case"]: c for c in {s["name"]: s for s in smoked[NEW]["data"]["steps"]}["server_args"]["detail"]}
    assert any("not available yet" in c for c in cases), sorted(cases)

    # shadow-linear: the lab engine starts through each host's own SGLang parser (0.5.23's via ddtree_v2_args).
    evidence = tmp_path / "ev"
    shadow = by_host(cli_json("promote", "-i", str(inv), "--mode", "shadow-linear", "--batch", "100%",
                              "--evidence-dir", str(evidence)))
    for h, v in VERSIONS.items():
        assert shadow[h]["status"] == "ok", shadow[h]
        assert all(g["verdict"] == "pass" for g in shadow[h]["data"]["gates"]), shadow[h]["data"]["gates"]
        info = server_info(lab_fleet, h)
        assert info["version"] == v and info["speculative_ddtree_mode"] == "shadow-linear", info
        # As each base's real worker reports: v1's shadow-linear builds the trees it never verifies, v2's none.
        report = info["internal_states"][0]["ddtree"]
        assert report["mode"] == "shadow-linear" and bool(report["build_budgets"]) == (h == OLD), report
    rows = by_host(cli_json("status", "-i", str(inv)))
    assert {h: rows[h]["data"]["payload_base"]["label"] for h in VERSIONS} == {OLD: "0.5.13.post1 v1",
                                                                                NEW: "0.5.23 v2"}
    table = cli("status", "-i", str(inv))
    assert table.returncode == 0 and "0.5.23 v2" in table.stdout and "0.5.13.post1 v1" in table.stdout, table.stdout

    # full on 0.5.23: refused by the installed payload's own words before the unit changes; still serving.
    pid = main_pid(lab_fleet, NEW)
    refused = by_host(cli_json("promote", "-i", str(inv), "--limit", NEW, "--mode", "full",
                               "--evidence-dir", str(evidence), expect=1))[NEW]
    assert refused["status"] == "failed" and refused["error"]["code"] == "full_mode_refused", refused
    assert "not available yet on SGLang 0.5.23" in refused["error"]["message"], refused["error"]
    assert main_pid(lab_fleet, NEW) == pid
    assert server_info(lab_fleet, NEW)["speculative_ddtree_mode"] == "shadow-linear"

    # rollback to pristine: each host's own wheel bytes (its RECORD hashes), the payload's new files gone.
    back = by_host(cli_json("rollback", "-i", str(inv), "--to", "pristine"))
    for h in VERSIONS:
        assert back[h]["status"] == "ok", back[h]
        assert remote_hashes(lab_fleet, h, rels[h], PYTHON[h]) == pristine[h], h

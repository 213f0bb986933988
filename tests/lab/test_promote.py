"""promote on the lab fleet: real sshd, real systemd, the lab engine serving SGLang's HTTP API and
decoding through the payload each host has installed.

One rollout (off → shadow-linear → full on 3 hosts) is shared by the tests that follow it, in file
order; each later test breaks one thing on one host and checks that promote catches it, rolls
that host back by itself, and leaves it serving its previous mode. Engine starts cost seconds
(SGLang's import alone), so tests share restarts where that stays honest.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddtree_ops import release, rollout, service
from ddtree_ops.bundle import build_bundle
from ddtree_ops.inventory import load_inventory
from ddtree_ops.lab.config import HYBRID_TARGET_MODEL, TARGET_MODEL
from ddtree_ops.lab.engine import faults

pytestmark = pytest.mark.lab

STATE_DIR = "/var/lib/ddtree-ops"
UNIT = "/etc/systemd/system/sglang.service"
SECRET = "hf_pl4nted-S3CRET-$HOME-%n-\"q\"-value"
# A model directory name and a served name that a shell, or careless unit quoting, would split or expand.
HOSTILE_DIR = "/opt/ddtree-lab/ho st 'q' \"dq\" %n $HOME ${X}"
HOSTILE_NAME = "served name; $X ${HOME} %i 'q' \"dq\" \\"
SERVER_INFO = ("import json, urllib.request; print(urllib.request.urlopen("
               "'http://127.0.0.1:30000/server_info', timeout=30).read().decode())")


# ----------------------------------------------------------------------------- helpers


def ssh(lab_fleet, host: str, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return lab_fleet.ssh(host, command, timeout=timeout)


def sha_of(lab_fleet, host: str, path: str) -> str | None:
    r = ssh(lab_fleet, host, f"sha256sum {shlex.quote(path)} 2>/dev/null")
    return r.stdout.split()[0] if r.returncode == 0 else None


def main_pid(lab_fleet, host: str) -> str:
    return ssh(lab_fleet, host, "systemctl show -p MainPID --value sglang.service").stdout.strip()


def server_info(lab_fleet, host: str) -> dict:
    r = ssh(lab_fleet, host, shlex.join(["/opt/sglang/venv/bin/python", "-c", SERVER_INFO]))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def state(lab_fleet, host: str) -> dict:
    return json.loads(ssh(lab_fleet, host, f"cat {STATE_DIR}/state.json").stdout)


class Inventories:
    """The lab inventory with absolute key paths, plus per-test host overrides."""

    def __init__(self, lab_fleet, tmp: Path, secrets_file: Path) -> None:
        self.lab_fleet, self.tmp, self.secrets_file = lab_fleet, tmp, secrets_file
        self.n = 0

    def write(self, hosts: dict[str, dict] | None = None, **all_vars: object) -> Path:
        data = yaml.safe_load(self.lab_fleet.inventory_path.read_text())
        v = data["all"]["vars"]
        v.update(identity_file=str(self.lab_fleet.identity_file), known_hosts=str(self.lab_fleet.known_hosts),
                 service_secrets_file=str(self.secrets_file), start_timeout_s=240, restart_sec=2, **all_vars)
        # lab-3 always carries the hostile model path and served name: every stage must keep them intact.
        data["hosts"]["lab-3"].update(model_path=HOSTILE_DIR,
                                      extra_args=[*v.get("extra_args", []), "--served-model-name", HOSTILE_NAME])
        for name, extra in (hosts or {}).items():
            data["hosts"][name].update(extra)
        self.n += 1
        path = self.tmp / f"inv-{self.n}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path


def run_cli(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", "from ddtree_ops.cli import main; main()", *args]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    full_env.update(env or {})
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env)


def promote_json(inv: Path, *args: str, evidence: Path, env: dict | None = None, expect: int = 0,
                 outputs: list | None = None) -> dict:
    proc = run_cli("promote", "-i", str(inv), "--json", "--evidence-dir", str(evidence), *args, env=env)
    if outputs is not None:
        outputs += [proc.stdout, proc.stderr]
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def by_host(doc: dict) -> dict[str, dict]:
    return {r["host"]: r for r in doc["results"]}


def reset_hosts(lab_fleet) -> None:
    """No unit, no env file, no state: as a host is before ddtree-ops touched it."""
    for h in lab_fleet.hosts:
        ssh(lab_fleet, h, f"systemctl stop sglang.service; rm -rf {UNIT} {UNIT}.d /etc/ddtree-ops; "
                          f"systemctl daemon-reload; systemctl reset-failed sglang.service; true")
    inv = load_inventory(lab_fleet.inventory_path)
    release.unlock(inv, inv.select(None))
    release.rollback(inv, inv.select(None), to="pristine", adopt=True)
    for h in lab_fleet.hosts:
        ssh(lab_fleet, h, f"rm -rf {STATE_DIR}")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> release.LocalBundle:
    import importlib.metadata

    site = importlib.metadata.distribution("sglang").locate_file("")
    built = build_bundle(None, tmp_path_factory.mktemp("dist"), site_dir=site)
    return release.LocalBundle.load(built.bundle_path)


@pytest.fixture(scope="module")
def lab(lab_fleet, bundle, tmp_path_factory):
    """Fresh hosts with the DDTree bundle pushed; the hostile model directory on lab-3."""
    tmp = tmp_path_factory.mktemp("promote")
    secrets_file = tmp / "secrets.env"
    secrets_file.write_text(f"HF_TOKEN={SECRET}\n")
    secrets_file.chmod(0o600)
    reset_hosts(lab_fleet)
    ssh(lab_fleet, "lab-3", f"ln -sfn {TARGET_MODEL} {shlex.quote(HOSTILE_DIR)}")
    inv = load_inventory(lab_fleet.inventory_path)
    pushed = release.push(inv, inv.select(None), bundle)
    assert all(r.ok for r in pushed), [r.to_dict() for r in pushed]
    yield Inventories(lab_fleet, tmp, secrets_file), tmp
    reset_hosts(lab_fleet)
    ssh(lab_fleet, "lab-3", f"rm -f {shlex.quote(HOSTILE_DIR)}")


# ----------------------------------------------------------------------------- the rollout


def test_dry_run_shows_diff_and_plan_and_changes_nothing(lab_fleet, lab):
    invs, tmp = lab
    inv = invs.write()
    before = {h: ssh(lab_fleet, h, f"find {STATE_DIR} -type f | sort | xargs sha256sum").stdout for h in lab_fleet.hosts}
    doc = promote_json(inv, "--mode", "shadow-linear", "--dry-run", evidence=tmp / "ev")
    for h, r in by_host(doc).items():
        d = r["data"]
        assert d["dry_run"] and d["first_installs_off_stage"] and d["lint"]["ok"], d
        assert d["unit_diff"].startswith("--- /dev/null") and "+ExecStart=:" in d["unit_diff"]
        assert any(g.startswith("ready:") for g in d["gate_plan"]) and not any("acceptance" in g for g in d["gate_plan"])
        assert sha_of(lab_fleet, h, UNIT) is None
        assert ssh(lab_fleet, h, f"find {STATE_DIR} -type f | sort | xargs sha256sum").stdout == before[h]
    assert doc["batches"] == [["lab-1"], ["lab-2"], ["lab-3"]]


def test_full_rollout_on_three_hosts(lab_fleet, lab):
    """off (no unit yet) → shadow-linear → full on every host, every gate passing; hostile values
    intact through systemd; the secret reaches the server and nothing else."""
    invs, tmp = lab
    inv = invs.write()
    outputs: list[str] = []
    shadow = promote_json(inv, "--mode", "shadow-linear", evidence=tmp / "ev", outputs=outputs)
    full = promote_json(inv, "--mode", "full", evidence=tmp / "ev", outputs=outputs)
    for h in lab_fleet.hosts:
        s, f = by_host(shadow)[h]["data"], by_host(full)[h]["data"]
        assert [g["gate"] for g in s["gates"]] == ["ready", "settings", "canary", "liveness"]
        assert [g["gate"] for g in f["gates"]] == ["ready", "settings", "canary", "liveness", "acceptance"]
        assert all(g["verdict"] == "pass" for g in s["gates"] + f["gates"])
        assert s["first_stage"]["mode"] == "off" and s["baseline"]["source"].startswith("service as it ran")
        assert f["baseline"]["source"] == "recorded shadow-linear canary"
        assert f["accept_length"] > s["accept_length"] > 1.0, (f["accept_length"], s["accept_length"])
        assert isinstance(f["exposure"], float) and 0 < f["exposure"] < 10
        info = server_info(lab_fleet, h)
        assert info["speculative_ddtree_mode"] == "full" and info["internal_states"][0]["ddtree"]["tree_steps"] > 0
        st = state(lab_fleet, h)
        assert st["mode"] == "full" and [st["promotion"]["stages"][u]["mode"] for u in st["promotion"]["stack"]] \
            == ["off", "shadow-linear", "full"]
        evidence = json.loads(Path(f["evidence"]["local"]).read_text())
        assert evidence["unit"]["exposure"] == f["exposure"] and evidence["unit"]["diff"]
        assert ssh(lab_fleet, h, f"test -s {shlex.quote(f['evidence']['host'])}").returncode == 0
    # Hostile values reached the server word for word: systemd itself parsed the unit.
    info = server_info(lab_fleet, "lab-3")
    assert info["model_path"] == HOSTILE_DIR and info["served_model_name"] == HOSTILE_NAME
    # The secret is in the server's environment (so it is really used) ...
    pid = main_pid(lab_fleet, "lab-1")
    environ = ssh(lab_fleet, "lab-1", f"cat /proc/{pid}/environ").stdout.split("\0")
    assert f"HF_TOKEN={SECRET}" in environ
    assert ssh(lab_fleet, "lab-1", "stat -c %a /etc/ddtree-ops/sglang.env").stdout.strip() == "600"
    # ... and nowhere else: outputs, local evidence, state dir files, the journal, the unit.
    status = run_cli("status", "-i", str(inv), "--json")
    history = run_cli("history", "-i", str(inv), "--json")
    outputs += [status.stdout, status.stderr, history.stdout, history.stderr]
    outputs += [p.read_text() for p in (tmp / "ev").rglob("*.json")]
    assert len(outputs) > 10 and not any(SECRET in text for text in outputs)
    needle = shlex.quote(SECRET)
    for h in lab_fleet.hosts:
        found = ssh(lab_fleet, h, f"grep -rlF -e {needle} {STATE_DIR} {UNIT}; "
                                  f"journalctl --no-pager -u sglang.service | grep -cF -e {needle}")
        assert found.stdout.split() == ["0"], (h, found.stdout)
    rows = {r["host"]: r for r in json.loads(status.stdout)["results"]}
    assert rows["lab-2"]["data"]["release"]["promotion"]["last_result"] == "passed"
    assert rows["lab-2"]["data"]["release"]["mode"] == "full"
    audit = {r["host"]: [a.get("command") for a in r["data"]["audit"]] for r in json.loads(history.stdout)["results"]}
    assert "promote --mode full" in audit["lab-1"]


def test_lossy_fault_caught_and_batch_stops(lab_fleet, lab):
    """A lossy payload on the first batch's host: the canary catches it, that host is back on its
    previous unit and serves correctly, and the next batch is never touched."""
    invs, tmp = lab
    inv = invs.write({"lab-2": {"service_environment": {faults.WRONG_TOKENS_AFTER: "3"}}})
    lab3_pid, lab3_unit = main_pid(lab_fleet, "lab-3"), sha_of(lab_fleet, "lab-3", UNIT)
    lab2_unit = sha_of(lab_fleet, "lab-2", UNIT)
    doc = promote_json(inv, "--mode", "full", "--limit", "lab-2,lab-3", "--batch", "1", evidence=tmp / "ev",
                       expect=1)
    r = by_host(doc)["lab-2"]
    assert r["status"] == "failed" and r["error"]["code"] == "gate_canary_failed", r
    detail = r["error"]["detail"]
    assert detail["serving_again"] and "first differing position" in detail["reason"]
    evidence = json.loads(Path(detail["evidence"]).read_text())
    assert any(row.get("first_difference") is not None for row in evidence["gates"][2]["evidence"]["comparison"])
    assert evidence["rollback"]["canary"]["verdict"] == "pass"
    assert doc["untouched"] == ["lab-3"] and "stopped after batch 1" in doc["stopped"]
    assert sha_of(lab_fleet, "lab-2", UNIT) == lab2_unit
    assert faults.WRONG_TOKENS_AFTER not in ssh(lab_fleet, "lab-2", "systemctl show -p Environment sglang").stdout
    assert server_info(lab_fleet, "lab-2")["speculative_ddtree_mode"] == "full"
    assert main_pid(lab_fleet, "lab-3") == lab3_pid and sha_of(lab_fleet, "lab-3", UNIT) == lab3_unit
    assert state(lab_fleet, "lab-2")["promotion"]["last"]["result"] == "rolled-back"


def test_unhealthy_and_crash_looping_starts_roll_back(lab_fleet, lab):
    """In one batch: lab-2 never becomes healthy (the ready gate times out), lab-3 crashes at every
    start (systemd's start limit ends the loop, the gate fails). Both are rolled back by themselves."""
    invs, tmp = lab
    inv = invs.write({"lab-2": {"service_environment": {faults.NEVER_HEALTHY: "1"}, "start_timeout_s": 45},
                      "lab-3": {"service_environment": {faults.FAIL_AT_START: "1"}, "restart_sec": 1}})
    doc = promote_json(inv, "--mode", "full", "--limit", "lab-2,lab-3", "--batch", "100%", "--max-fail", "100%",
                       evidence=tmp / "ev", expect=1)
    assert doc["batches"] == [["lab-2", "lab-3"]]
    never, crash = by_host(doc)["lab-2"]["error"], by_host(doc)["lab-3"]["error"]
    assert never["code"] == "gate_ready_failed" and "within 45s" in never["message"], never
    assert crash["code"] == "gate_ready_failed" and "unit failed/failed" in crash["message"], crash
    evidence = json.loads(Path(crash["detail"]["evidence"]).read_text())
    assert "Start request repeated too quickly" in evidence["gates"][0]["evidence"]["journal"]
    for h, err in (("lab-2", never), ("lab-3", crash)):
        assert err["detail"]["serving_again"], err
        assert server_info(lab_fleet, h)["speculative_ddtree_mode"] == "full"


def test_hybrid_target_refused_before_any_change(lab_fleet, lab):
    invs, tmp = lab
    inv = invs.write({"lab-1": {"model_path": HYBRID_TARGET_MODEL}})
    unit, pid = sha_of(lab_fleet, "lab-1", UNIT), main_pid(lab_fleet, "lab-1")
    doc = promote_json(inv, "--mode", "full", "--limit", "lab-1", "--force", evidence=tmp / "ev", expect=1)
    err = by_host(doc)["lab-1"]["error"]
    assert err["code"] == "full_mode_refused" and "hybrid" in err["message"], err
    assert sha_of(lab_fleet, "lab-1", UNIT) == unit and main_pid(lab_fleet, "lab-1") == pid
    refused = run_cli("promote", "-i", str(inv), "--mode", "full", "--allow-hybrid-unsafe")
    assert refused.returncode == 2 and "not supported yet" in refused.stderr


def test_unit_failing_lint_stops_before_install(lab_fleet, lab, monkeypatch):
    invs, tmp = lab
    inventory = load_inventory(invs.write())
    render = service.render_unit

    def broken(host, mode, **kw):
        unit = render(host, mode, **kw)
        return service.RenderedUnit(unit.host, unit.mode, unit.paths, unit.argv,
                                    unit.text.replace("[Service]\n", "[Service]\nFrobnicateGPUs=yes\n"),
                                    unit.env_text, unit.secret_values)

    monkeypatch.setattr(service, "render_unit", broken)
    units_before = ssh(lab_fleet, "lab-2", f"ls {STATE_DIR}/units").stdout
    unit, pid = sha_of(lab_fleet, "lab-2", UNIT), main_pid(lab_fleet, "lab-2")
    report = rollout.promote(inventory, inventory.select("lab-2"),
                             rollout.PromoteOptions(mode="full", evidence_dir=tmp / "ev"))
    r = report.results[0]
    assert r.status == "failed" and r.error.code == "unit_lint_failed" and "FrobnicateGPUs" in r.error.message
    assert sha_of(lab_fleet, "lab-2", UNIT) == unit and main_pid(lab_fleet, "lab-2") == pid
    assert ssh(lab_fleet, "lab-2", f"ls {STATE_DIR}/units").stdout == units_before


def _altered_walk_bundle(tmp: Path) -> release.LocalBundle:
    """The real payload with one bug in follow_verified_tree: the bonus token taken at the root."""
    import importlib.metadata

    payload = tmp / "payload"
    shutil.copytree(Path(service.__file__).parent / "payload", payload)
    utils = payload / "sglang/srt/speculative/ddtree_utils.py"
    text = utils.read_text()
    good = "    bonus_tokens = target.gather(1, last).view(-1)\n"
    assert good in text
    utils.write_text(text.replace(good, "    bonus_tokens = target[:, 0].clone()\n"))
    built = build_bundle(payload, tmp / "dist-altered", site_dir=importlib.metadata.distribution("sglang").locate_file(""))
    return release.LocalBundle.load(built.bundle_path)


def test_bundle_with_altered_walk_caught_by_the_canary(lab_fleet, lab, bundle):
    invs, tmp = lab
    inventory = load_inventory(invs.write())
    hosts = inventory.select("lab-1")
    # Back to shadow-linear (linear verify never walks the tree), then the bad bundle, then full.
    back = rollout.rollback(inventory, hosts)[0]
    assert back.ok and back.data["current_mode"] == "shadow-linear", back.to_dict()
    altered = _altered_walk_bundle(tmp)
    pushed = release.push(inventory, hosts, altered)[0]
    assert pushed.ok and not pushed.data["noop"], pushed.to_dict()
    try:
        doc = promote_json(invs.write(), "--mode", "full", "--limit", "lab-1", evidence=tmp / "ev", expect=1)
        err = by_host(doc)["lab-1"]["error"]
        assert err["code"] == "gate_canary_failed" and err["detail"]["serving_again"], err
        assert server_info(lab_fleet, "lab-1")["speculative_ddtree_mode"] == "shadow-linear"
    finally:
        good = rollout.rollback(inventory, hosts, to=pushed.data["previous"])[0]
        assert good.ok and good.data.get("ready", {}).get("verdict") == "pass", good.to_dict()


def test_interrupted_promote_converges(lab_fleet, lab):
    """The CLI killed after the gates but before the record: unlock undoes the stage. The CLI killed
    mid-gates: the next promote from this machine sees that run is gone, breaks its lock, undoes the
    stage and does it again. The agent killed mid-install (a lost connection): the next promote undoes
    it first, then does the stage."""
    invs, tmp = lab
    inv = invs.write({"lab-1": {"service_environment": {"PROMOTE_TEST_CHANGE": "1"}}})  # a unit that differs
    unit = sha_of(lab_fleet, "lab-1", UNIT)
    stack = state(lab_fleet, "lab-1")["promotion"]["stack"]
    killed = run_cli("promote", "-i", str(inv), "--mode", "full", "--limit", "lab-1", "--evidence-dir",
                     str(tmp / "ev"), env={rollout.KILL_ENV: "during_gates"})
    assert killed.returncode == -9, killed.stderr
    assert ssh(lab_fleet, "lab-1", f"test -e {STATE_DIR}/units-journal.json").returncode == 0
    rerun = run_cli("promote", "-i", str(inv), "--mode", "full", "--limit", "lab-1", "--json", "--evidence-dir",
                    str(tmp / "ev"))
    assert rerun.returncode == 0, (rerun.stdout[-2000:], rerun.stderr[-2000:])
    assert by_host(json.loads(rerun.stdout))["lab-1"]["status"] == "ok"
    assert "a run of this machine that is gone" in rerun.stderr + rerun.stdout
    assert ssh(lab_fleet, "lab-1", f"test -e {STATE_DIR}/units-journal.json").returncode != 0
    assert server_info(lab_fleet, "lab-1")["speculative_ddtree_mode"] == "full"
    # Back to the stage before, for the next interruption.
    assert rollout.rollback(load_inventory(inv), load_inventory(inv).select("lab-1"))[0].status == "ok"
    unit = sha_of(lab_fleet, "lab-1", UNIT)
    stack = state(lab_fleet, "lab-1")["promotion"]["stack"]
    for point in ("before_commit",):  # before_commit: every gate passed, nothing recorded
        killed = run_cli("promote", "-i", str(inv), "--mode", "full", "--limit", "lab-1", "--evidence-dir",
                         str(tmp / "ev"), env={rollout.KILL_ENV: point})
        assert killed.returncode == -9, killed.stderr
        assert ssh(lab_fleet, "lab-1", f"test -e {STATE_DIR}/units-journal.json").returncode == 0
        unlocked = run_cli("unlock", "-i", str(inv), "lab-1", "--yes", "--json")
        assert unlocked.returncode == 0, unlocked.stderr
        undone = json.loads(unlocked.stdout)["results"][0]["data"]["unit_recovered"]
        assert undone["mode"] == "full" and undone["restart"]["action"] == "restart", (point, undone)
        assert sha_of(lab_fleet, "lab-1", UNIT) == unit, point
        assert ssh(lab_fleet, "lab-1", f"test -e {STATE_DIR}/units-journal.json").returncode != 0
        assert state(lab_fleet, "lab-1")["promotion"]["stack"] == stack, point

    lost = run_cli("promote", "-i", str(inv), "--mode", "full", "--limit", "lab-1", "--json", "--evidence-dir",
                   str(tmp / "ev"), env={rollout.AGENT_KILL_ENV: "after_write"})
    assert lost.returncode == 1 and by_host(json.loads(lost.stdout))["lab-1"]["error"]["code"] == "agent_no_answer"
    assert sha_of(lab_fleet, "lab-1", UNIT) != unit  # the new unit is written, not yet reloaded
    again = promote_json(inv, "--mode", "full", "--limit", "lab-1", evidence=tmp / "ev")
    assert by_host(again)["lab-1"]["status"] == "ok"
    assert ssh(lab_fleet, "lab-1", f"test -e {STATE_DIR}/units-journal.json").returncode != 0
    assert server_info(lab_fleet, "lab-1")["speculative_ddtree_mode"] == "full"


def test_rollback_steps_back_then_to_pristine(lab_fleet, lab):
    invs, _ = lab
    inventory = load_inventory(invs.write())
    hosts = inventory.select("lab-2")
    back = rollout.rollback(inventory, hosts)[0]
    assert back.ok and back.data["current_mode"] == "shadow-linear" and back.data["ready"]["verdict"] == "pass"
    assert server_info(lab_fleet, "lab-2")["speculative_ddtree_mode"] == "shadow-linear"
    gone = rollout.rollback(inventory, hosts, to="pristine")[0]
    assert gone.ok, gone.to_dict()
    assert sha_of(lab_fleet, "lab-2", UNIT) is None
    assert ssh(lab_fleet, "lab-2", "systemctl is-active sglang.service").stdout.strip() != "active"
    st = state(lab_fleet, "lab-2")
    assert st["current"] is None and st["mode"] is None and st["promotion"]["stack"] == []


def test_drop_in_over_an_existing_unit(lab_fleet, lab, bundle):
    """unit_kind: drop-in over the operator's own sglang.service: promote adds one file, and
    rollback --to pristine deletes just that file; their unit is never rewritten."""
    invs, tmp = lab
    own = ("[Unit]\nDescription=the operator's own SGLang unit\n\n[Service]\nType=exec\n"
           f"ExecStart=/opt/sglang/venv/bin/python -m ddtree_lab_engine --model-path {TARGET_MODEL} "
           "--host 127.0.0.1 --port 30000 --device cpu\n")
    r = ssh(lab_fleet, "lab-2", f"printf %s {shlex.quote(own)} > {UNIT} && systemctl daemon-reload && "
                                "systemctl start sglang.service")
    assert r.returncode == 0, r.stderr
    own_sha = sha_of(lab_fleet, "lab-2", UNIT)
    inventory = load_inventory(invs.write({"lab-2": {"unit_kind": "drop-in"}}))
    hosts = inventory.select("lab-2")
    assert release.push(inventory, hosts, bundle)[0].ok
    doc = promote_json(inventory.path, "--mode", "shadow-linear", "--limit", "lab-2", evidence=tmp / "ev")
    data = by_host(doc)["lab-2"]["data"]
    assert data["result"] == "passed" and "first_stage" not in data, data
    drop_in = "/etc/systemd/system/sglang.service.d/50-ddtree-ops.conf"
    assert sha_of(lab_fleet, "lab-2", drop_in) and sha_of(lab_fleet, "lab-2", UNIT) == own_sha
    assert server_info(lab_fleet, "lab-2")["speculative_ddtree_mode"] == "shadow-linear"
    gone = rollout.rollback(inventory, hosts, to="pristine")[0]
    assert gone.ok and gone.data["ready"]["verdict"] == "pass", gone.to_dict()
    assert sha_of(lab_fleet, "lab-2", drop_in) is None and sha_of(lab_fleet, "lab-2", UNIT) == own_sha
    info = server_info(lab_fleet, "lab-2")
    assert not info.get("speculative_algorithm") and "speculative_ddtree_mode" not in info

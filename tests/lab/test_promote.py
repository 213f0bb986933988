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
import time
from pathlib import Path

import pytest
import yaml

from ddtree_ops import release, rollout, service
from ddtree_ops.agent.remote import envfile
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
HOSTILE_NAME = "served name; $X ${HOME} %i 'q' \"dq\" \\ $$ end"
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
        data = self.lab_fleet.inventory_data()
        v = data["all"]["vars"]
        v.update(service_secrets_file=str(self.secrets_file), start_timeout_s=240, restart_sec=2, **all_vars)
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
    # Written in systemd's EnvironmentFile syntax, as the operator's file is read: "…" with \" \$ escaped.
    secrets_file.write_text(f"HF_TOKEN={envfile.quote(SECRET)}\n")
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
        assert d["unit_diff"].startswith("--- /dev/null") and '+ExecStart="' in d["unit_diff"]
        assert any(g.startswith("ready:") for g in d["gate_plan"]) and not any("acceptance" in g for g in d["gate_plan"])
        assert sha_of(lab_fleet, h, UNIT) is None
        assert ssh(lab_fleet, h, f"find {STATE_DIR} -type f | sort | xargs sha256sum").stdout == before[h]
    assert doc["batches"] == [["lab-1"], ["lab-2"], ["lab-3"]]
    # What a real run would refuse, the dry run refuses too, with the same exit code.
    refused = promote_json(inv, "--mode", "full", "--dry-run", evidence=tmp / "ev", expect=1)
    for r in by_host(refused).values():
        assert r["status"] == "failed" and r["error"]["code"] == "shadow_linear_not_passed", r
        assert "would be refused" in r["error"]["message"] and r["error"]["detail"]["unit_diff"]


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
    assert refused.returncode == 2 and "no unsafe override" in refused.stderr


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
        # A shadow-linear pass counts for the release it ran on only: full is refused until it runs again.
        stale = promote_json(invs.write(), "--mode", "full", "--limit", "lab-1", evidence=tmp / "ev", expect=1)
        err = by_host(stale)["lab-1"]["error"]
        assert err["code"] == "shadow_linear_not_passed" and "ran on release" in err["message"], err
        promote_json(invs.write(), "--mode", "shadow-linear", "--limit", "lab-1", evidence=tmp / "ev")
        doc = promote_json(invs.write(), "--mode", "full", "--limit", "lab-1", evidence=tmp / "ev", expect=1)
        err = by_host(doc)["lab-1"]["error"]
        assert err["code"] == "gate_canary_failed" and err["detail"]["serving_again"], err
        assert server_info(lab_fleet, "lab-1")["speculative_ddtree_mode"] == "shadow-linear"
    finally:
        good = rollout.rollback(inventory, hosts, to=pushed.data["previous"])[0]
        assert good.ok and good.data.get("ready", {}).get("verdict") == "pass", good.to_dict()
        # The good release again: its shadow-linear pass is recorded anew, for full later on.
        promote_json(invs.write(), "--mode", "shadow-linear", "--limit", "lab-1", evidence=tmp / "ev")


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
    err = by_host(json.loads(lost.stdout))["lab-1"]["error"]
    assert lost.returncode == 1 and err["code"] == "agent_no_answer", err
    # The unit was written, not yet reloaded: the run put the previous one back at once.
    assert "previous unit was put back" in err["message"] and sha_of(lab_fleet, "lab-1", UNIT) == unit
    again = promote_json(inv, "--mode", "full", "--limit", "lab-1", evidence=tmp / "ev")
    assert by_host(again)["lab-1"]["status"] == "ok"
    assert ssh(lab_fleet, "lab-1", f"test -e {STATE_DIR}/units-journal.json").returncode != 0
    assert server_info(lab_fleet, "lab-1")["speculative_ddtree_mode"] == "full"


# ----------------------------------------------------------------------------- fail closed (issue 22)


def _changed(invs, host: str, **extra: object) -> Path:
    """An inventory whose unit for `host` differs from the installed one (so a stage really changes it)."""
    env = {"PROMOTE_TEST_CHANGE": str(time.monotonic_ns()), **extra.pop("service_environment", {})}
    return invs.write({host: {"service_environment": env, **extra}})


def _wait_for(check, timeout: float, what: str):
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < end, f"not within {timeout:.0f}s: {what}"
        time.sleep(0.5)


def _serving(lab_fleet, host: str, unit_sha: str | None):
    """True once the host's unit is these bytes, no stage is in flight and the server answers."""
    if sha_of(lab_fleet, host, UNIT) != unit_sha:
        return False
    if ssh(lab_fleet, host, f"test -e {STATE_DIR}/units-journal.json").returncode == 0:
        return False
    r = ssh(lab_fleet, host, shlex.join(["/opt/sglang/venv/bin/python", "-c",
                                          "import urllib.request; print(urllib.request.urlopen("
                                          "'http://127.0.0.1:30000/health_generate', timeout=10).status)"]))
    return r.stdout.strip() == "200"


def _audit(lab_fleet, host: str) -> list[dict]:
    return [json.loads(line) for line in ssh(lab_fleet, host, f"cat {STATE_DIR}/audit.log").stdout.splitlines()]


def test_cli_killed_mid_gates_the_host_puts_its_previous_unit_back_by_itself(lab_fleet, lab):
    """Nobody helps: the CLI dies mid-gates, its heartbeat stops, and within the confirm deadline the
    host's watchdog puts the previous unit back and restarts it; the record says why."""
    invs, tmp = lab
    unit = sha_of(lab_fleet, "lab-1", UNIT)
    stack = state(lab_fleet, "lab-1")["promotion"]["stack"]
    inv = _changed(invs, "lab-1", confirm_timeout_s=10)
    killed = run_cli("promote", "-i", str(inv), "--mode", "full", "--limit", "lab-1", "--evidence-dir",
                     str(tmp / "ev"), env={rollout.KILL_ENV: "during_gates"})
    dead_at = time.monotonic()
    assert killed.returncode == -9, killed.stderr
    assert sha_of(lab_fleet, "lab-1", UNIT) != unit  # the unconfirmed stage is installed, for now
    _wait_for(lambda: _serving(lab_fleet, "lab-1", unit), 10 + 60, "lab-1 back on its previous unit")
    took = time.monotonic() - dead_at
    undone = [a for a in _audit(lab_fleet, "lab-1") if a.get("result") == "undone"][-1]
    assert "not confirmed within its deadline" in undone["reason"], undone
    assert state(lab_fleet, "lab-1")["promotion"]["stack"] == stack
    assert server_info(lab_fleet, "lab-1")["speculative_ddtree_mode"] == "full"
    print(f"confirm: control side killed -> previous unit serving again in {took:.1f}s (window 10s)")


def _promote_held(inv: Path, tmp: Path, point: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """A promote of lab-1 that stops at `point` until released (rollout.HOLD_ENV)."""
    hold = tmp / f"hold-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    env[rollout.HOLD_ENV] = f"{point}:{hold}"
    proc = subprocess.Popen([sys.executable, "-c", "from ddtree_ops.cli import main; main()", "promote", "-i", str(inv),
                             "--mode", "full", "--limit", "lab-1", "--json", "--evidence-dir", str(tmp / "ev"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _wait_for(lambda: Path(f"{hold}.reached").exists() or proc.poll() is not None, 300, f"promote reaching {point}")
    assert proc.poll() is None, proc.communicate()
    return proc, hold


def test_control_traffic_dropped_mid_gates_the_host_restores_itself(lab_fleet, lab):
    """The control side's link to lab-1 goes dark mid-gates (the host's side of the lab bridge is
    cut): its heartbeats stop arriving and the host's watchdog restores the previous unit by itself."""
    invs, tmp = lab
    unit = sha_of(lab_fleet, "lab-1", UNIT)
    proc, hold = _promote_held(_changed(invs, "lab-1", confirm_timeout_s=10), tmp, "during_gates",
                               "--gate-timeout", "20", "--liveness-bound", "10")
    link = "vb-lab-1"
    subprocess.run(["ip", "link", "set", link, "down"], check=True)
    cut_at = time.time()
    try:
        Path(f"{hold}.go").touch()
        time.sleep(10 + 15)  # the confirm window, the watchdog's poll and a restart
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
    _wait_for(lambda: _serving(lab_fleet, "lab-1", unit), 120, "lab-1 back on its previous unit")
    undone = [a for a in _audit(lab_fleet, "lab-1") if a.get("result") == "undone"][-1]
    assert "not confirmed within its deadline" in undone["reason"], undone
    restored = time.mktime(time.strptime(undone["time"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert restored - cut_at < 10 + 10, (restored, cut_at)  # the window, plus beats and polls
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1 and by_host(json.loads(out))["lab-1"]["status"] != "ok", err[-2000:]
    print(f"confirm: link cut -> stage undone by the host after {restored - cut_at:.0f}s (window 10s)")


def test_a_second_operators_rollback_during_a_long_gate_is_refused(lab_fleet, lab):
    """A run held mid-gates far longer than the lock's TTL and the confirm window: its heartbeat keeps
    both, so a second operator's rollback and unlock are refused, and the stage still confirms."""
    invs, tmp = lab
    inv = _changed(invs, "lab-1", confirm_timeout_s=10, lock_ttl_s=10)
    prompts = tmp / "operator.jsonl"
    prompts.write_text(json.dumps({"text": "An operator's own prompt, run at every stage:", "max_new_tokens": 24}) + "\n")
    proc, hold = _promote_held(inv, tmp, "during_gates", "--prompts", str(prompts))
    try:
        time.sleep(25)
        other = run_cli("rollback", "-i", str(inv), "--limit", "lab-1", "--json")
        assert other.returncode == 1, other.stdout + other.stderr
        err = json.loads(other.stdout)["results"][0]["error"]
        assert err["code"] == "locked" and "promote --mode full" in err["message"], err
        breaker = run_cli("unlock", "-i", str(inv), "lab-1", "--yes", "--json")
        assert breaker.returncode == 1 and "live run" in breaker.stdout + breaker.stderr, breaker.stdout
    finally:
        Path(f"{hold}.go").touch()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    data = by_host(json.loads(out))["lab-1"]["data"]
    assert data["result"] == "passed" and "operator prompt" in data["baseline"]["source"], data["baseline"]
    canary = next(g for g in json.loads(Path(data["evidence"]["local"]).read_text())["gates"] if g["gate"] == "canary")
    assert any(row["prompt"] == "operator-1-now" and row["identical"] for row in canary["evidence"]["comparison"])
    assert ssh(lab_fleet, "lab-1", f"test -e {STATE_DIR}/units-journal.json").returncode != 0


@pytest.mark.parametrize("lie", ["drip", "meta-list", "empty-output"])
def test_a_lying_server_fails_its_gate_within_the_bound(lab_fleet, lab, lie):
    invs, tmp = lab
    unit = sha_of(lab_fleet, "lab-1", UNIT)
    inv = _changed(invs, "lab-1", service_environment={faults.LIE: lie})
    started = time.monotonic()
    doc = promote_json(inv, "--mode", "full", "--limit", "lab-1", "--gate-timeout", "15", evidence=tmp / "ev",
                       expect=1)
    took = time.monotonic() - started
    err = by_host(doc)["lab-1"]["error"]
    assert err["code"] == "gate_canary_failed" and err["detail"]["serving_again"], err
    assert took < 300, took  # engine restarts twice, the gate itself 15 s at most
    assert sha_of(lab_fleet, "lab-1", UNIT) == unit


def test_secrets_live_only_in_the_env_file(lab_fleet, lab):
    """An --api-key in extra_args and a token in the secrets file: the server gets both (the lab
    engine, like SGLang, refuses requests without the key: the gates pass only by sending it); no
    unit, diff, dry run, --json, evidence, audit or journal line holds either; env backups are 0600,
    go with their stage, and are all gone after rollback --to pristine."""
    invs, tmp = lab
    key = "sk-l4b-$HOME-%n-key"
    lab_args = yaml.safe_load(lab_fleet.inventory_path.read_text())["all"]["vars"].get("extra_args", [])
    inv = _changed(invs, "lab-3", extra_args=[*lab_args, "--served-model-name", HOSTILE_NAME, "--api-key", key])
    texts = [run_cli("promote", "-i", str(inv), "--mode", "full", "--limit", "lab-3", "--dry-run", "--json").stdout]
    doc = promote_json(inv, "--mode", "full", "--limit", "lab-3", evidence=tmp / "ev-secrets", outputs=texts)
    assert by_host(doc)["lab-3"]["status"] == "ok", by_host(doc)["lab-3"]
    pid = main_pid(lab_fleet, "lab-3")
    assert key in ssh(lab_fleet, "lab-3", f"cat /proc/{pid}/cmdline").stdout.split("\0")
    assert "${DDTREE_OPS_ARG_API_KEY}" in ssh(lab_fleet, "lab-3", f"cat {UNIT}").stdout
    assert ssh(lab_fleet, "lab-3", "stat -c %a /etc/ddtree-ops/sglang.env").stdout.strip() == "600"
    texts += [p.read_text() for p in (tmp / "ev-secrets").rglob("*.json")]
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in (tmp / "ev-secrets").rglob("*.json"))
    for value in (key, SECRET):
        assert not any(value in t for t in texts), value
        needle = shlex.quote(value)
        found = ssh(lab_fleet, "lab-3", f"grep -rlF -e {needle} {STATE_DIR} {UNIT} /etc/systemd; "
                                        f"journalctl --no-pager -u sglang.service | grep -cF -e {needle}")
        assert found.stdout.split() == ["0"], (value, found.stdout)
    backups = ssh(lab_fleet, "lab-3", "stat -c '%a %n' /etc/ddtree-ops/.ddtree-ops-backup/*").stdout.split("\n")
    assert backups and all(line.startswith("600 ") for line in backups if line), backups
    # Back one stage: that stage's env copy goes with it.
    before = set(backups)
    back = rollout.rollback(load_inventory(inv), load_inventory(inv).select("lab-3"))[0]
    assert back.ok, back.to_dict()
    after = set(ssh(lab_fleet, "lab-3", "stat -c '%a %n' /etc/ddtree-ops/.ddtree-ops-backup/*").stdout.split("\n"))
    assert after < before, (before, after)


def test_a_unit_edited_by_hand_is_drift(lab_fleet, lab):
    """A unit changed by hand since ddtree-ops installed it is not overwritten without --adopt, by a
    rollback or a promote; with --adopt, what was found is kept."""
    invs, tmp = lab
    inv = invs.write()
    r = ssh(lab_fleet, "lab-3", f"echo '# tuned by hand at 3 a.m.' >> {UNIT}")
    assert r.returncode == 0
    hand = sha_of(lab_fleet, "lab-3", UNIT)
    refused = run_cli("rollback", "-i", str(inv), "--limit", "lab-3", "--json")
    err = json.loads(refused.stdout)["results"][0]["error"]
    assert refused.returncode == 1 and err["code"] == "unit_drift" and UNIT in err["message"], err
    assert "--adopt" in err["hint"] and sha_of(lab_fleet, "lab-3", UNIT) == hand
    doc = promote_json(_changed(invs, "lab-3"), "--mode", "full", "--limit", "lab-3", evidence=tmp / "ev", expect=1)
    assert by_host(doc)["lab-3"]["error"]["code"] == "unit_drift"
    adopted = run_cli("rollback", "-i", str(inv), "--limit", "lab-3", "--adopt", "--json")
    assert adopted.returncode == 0, adopted.stdout[-2000:] + adopted.stderr[-2000:]
    kept = ssh(lab_fleet, "lab-3", f"grep -rl 'tuned by hand' {STATE_DIR}/units-found").stdout.split()
    assert kept and sha_of(lab_fleet, "lab-3", kept[0]) == hand


def test_repairs_run_on_the_damage_they_repair(lab_fleet, lab):
    """A stage's env backup gone: a clear refusal that names the file and the repair (never an agent
    crash), and --adopt runs. A damaged state.json: the agent's own file repair keeps the promotion
    stack (rebuilt from the stage records), and rollback --to pristine runs on it."""
    invs, tmp = lab
    inv = invs.write()
    inventory = load_inventory(inv)
    hosts = inventory.select("lab-3")
    rotated = tmp / "rotated.env"
    rotated.write_text(f"HF_TOKEN={envfile.quote(SECRET + '-rotated')}\n")
    assert promote_json(_changed(invs, "lab-3", service_secrets_file=str(rotated)), "--mode", "full", "--limit",
                        "lab-3", evidence=tmp / "ev")
    stack = state(lab_fleet, "lab-3")["promotion"]["stack"]
    top = stack[-1]
    ssh(lab_fleet, "lab-3", f"rm /etc/ddtree-ops/.ddtree-ops-backup/{top}.env")
    refused = rollout.rollback(inventory, hosts)[0]
    assert refused.error.code == "unit_backup_missing" and f"{top}.env" in refused.error.message, refused.to_dict()
    assert "--adopt" in refused.error.hint and "sha256" in refused.error.hint
    assert rollout.rollback(inventory, hosts, adopt=True)[0].ok
    ssh(lab_fleet, "lab-3", f"echo '{{not json' > {STATE_DIR}/state.json")
    files_only = release.rollback(inventory, hosts, to="pristine")[0]
    assert files_only.ok, files_only.to_dict()
    rebuilt = state(lab_fleet, "lab-3")["promotion"]
    assert rebuilt["stack"] == stack[:-1] and rebuilt["rebuilt"], rebuilt
    ssh(lab_fleet, "lab-3", f"echo '{{not json' > {STATE_DIR}/state.json")
    gone = rollout.rollback(inventory, hosts, to="pristine")[0]
    assert gone.ok, gone.to_dict()
    assert sha_of(lab_fleet, "lab-3", UNIT) is None
    assert ssh(lab_fleet, "lab-3", "ls -A /etc/ddtree-ops/.ddtree-ops-backup 2>/dev/null").stdout.strip() == ""
    st = state(lab_fleet, "lab-3")
    assert st["current"] is None and not (st.get("promotion") or {}).get("stack")
    assert ssh(lab_fleet, "lab-3", f"ls {STATE_DIR} | grep -c state.json.damaged").stdout.strip() != "0"


def test_a_commit_whose_answer_is_lost(lab_fleet, lab):
    """The agent dies inside unit_commit: after the commit point the stage stands (and the run says
    so, ok); before it, the stage is undone at once and the host serves its previous unit."""
    invs, tmp = lab
    unit = sha_of(lab_fleet, "lab-1", UNIT)
    lost = promote_json(_changed(invs, "lab-1"), "--mode", "full", "--limit", "lab-1", evidence=tmp / "ev",
                        env={rollout.AGENT_KILL_ENV: "after_evidence"}, expect=1)
    err = by_host(lost)["lab-1"]["error"]
    assert err["code"] == "commit_failed" and err["detail"]["serving_again"], err
    assert _serving(lab_fleet, "lab-1", unit)
    landed = promote_json(_changed(invs, "lab-1"), "--mode", "full", "--limit", "lab-1", evidence=tmp / "ev",
                          env={rollout.AGENT_KILL_ENV: "after_state"})
    r = by_host(landed)["lab-1"]
    assert r["status"] == "ok" and any("had confirmed the stage" in n for n in r["notices"]), r
    assert ssh(lab_fleet, "lab-1", f"test -e {STATE_DIR}/units-journal.json").returncode != 0
    assert sha_of(lab_fleet, "lab-1", UNIT) != unit


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

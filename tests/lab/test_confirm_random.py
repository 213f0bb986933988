"""Commit-confirmed stages under a knife, on a lab host with real systemd: the control side or the
agent is SIGKILLed at a step boundary of a stage, chosen by seed; then, with nobody helping, the host
must end on exactly its old unit or on the confirmed new one, never on an unconfirmed one, within
its confirm deadline; and a plain re-run must converge.

The stage is the real thing (tests/lab/confirm_driver.py: the lease, install with its watchdog, the
wait for the new invocation, the commit), on a stub service that starts in a blink, so many seeds
fit in a test run; the promote tests cover the same stages with the gates and the lab engine.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("confirm_driver.py")
HOST = "lab-2"
SERVICE = "ddtree-stub.service"
STATE_DIR = "/var/lib/ddtree-ops-stub"
UNIT = f"/etc/systemd/system/{SERVICE}"
PORT = 30100
CONFIRM_S = 5  # the inventory's minimum
STUB = """\
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port, tag = int(sys.argv[1]), sys.argv[2]
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"tag": tag}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""
POINTS = ["after_lock", "after_install", "after_ready", "before_commit", "after_commit",
          *(f"agent:{p}" for p in ("after_backup", "after_journal", "after_watchdog", "after_write", "after_reload",
                                   "after_restart", "after_evidence", "after_state"))]
SEEDS = range(16)


@pytest.fixture(scope="module")
def stub(lab_fleet, tmp_path_factory):
    ssh = lab_fleet.ssh
    r = ssh(HOST, f"mkdir -p /opt/ddtree-lab && printf %s {shlex.quote(STUB)} > /opt/ddtree-lab/confirm_stub.py")
    assert r.returncode == 0, r.stderr
    reset = (f"systemctl stop {SERVICE}; rm -rf {UNIT} {STATE_DIR} /etc/ddtree-ops/ddtree-stub.env "
             f"/etc/ddtree-ops/.ddtree-ops-backup; systemctl daemon-reload; systemctl reset-failed; true")
    ssh(HOST, reset)
    data = lab_fleet.inventory_data()
    data["hosts"][HOST].update(service=SERVICE, serve_port=PORT, state_dir=STATE_DIR, confirm_timeout_s=CONFIRM_S,
                               lock_ttl_s=10)
    inv = tmp_path_factory.mktemp("confirm") / "inv.yaml"
    inv.write_text(yaml.safe_dump(data, sort_keys=False))
    yield inv
    ssh(HOST, reset)


def drive(inv: Path, tag: str, point: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(DRIVER), str(inv), HOST, tag, *([point] if point else [])],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)


def host_view(lab_fleet) -> dict:
    """What the host runs and records, read in one ssh round trip."""
    probe = (f"import json, os, subprocess, urllib.request\n"
             f"def read(p):\n"
             f"    try:\n        return open(p).read()\n    except OSError:\n        return None\n"
             f"try:\n    served = json.load(urllib.request.urlopen('http://127.0.0.1:{PORT}/', timeout=5))['tag']\n"
             f"except Exception as e:\n    served = None\n"
             f"state = read('{STATE_DIR}/state.json')\n"
             f"active = subprocess.run(['systemctl', 'is-active', '{SERVICE}'], capture_output=True, text=True)\n"
             f"watch = subprocess.run(['systemctl', 'list-units', '--no-legend', '--state=active,activating',"
             f" 'ddtree-ops-confirm-*'], capture_output=True, text=True)\n"
             f"print(json.dumps({{'unit': read('{UNIT}'), 'served': served, 'journal': "
             f"os.path.exists('{STATE_DIR}/units-journal.json'), 'state': json.loads(state) if state else None,"
             f" 'active': active.stdout.strip(), 'watchdogs': watch.stdout.strip()}}))\n")
    r = lab_fleet.ssh(HOST, shlex.join(["python3", "-c", probe]))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def tag_of(unit: str | None) -> str | None:
    return unit.split(f" {PORT} ", 1)[1].split()[0] if unit else None


def settled(lab_fleet, deadline_s: float) -> dict:
    """The host's view once no stage is in flight and the service serves its unit (or the deadline)."""
    end = time.monotonic() + deadline_s
    while True:
        view = host_view(lab_fleet)
        if (not view["journal"] and not view["watchdogs"] and view["active"] == "active"
                and view["served"] == tag_of(view["unit"])) or time.monotonic() > end:
            return view
        time.sleep(0.5)


def stack_top(view: dict) -> str | None:
    stack = ((view["state"] or {}).get("promotion") or {}).get("stack") or []
    return stack[-1] if stack else None


def test_a_stage_killed_anywhere_ends_old_or_confirmed_new_and_a_rerun_converges(lab_fleet, stub):
    first = drive(stub, "t0")
    assert first.returncode == 0, first.stdout + first.stderr
    old = settled(lab_fleet, 30)
    assert old["served"] == "t0" and stack_top(old)
    rng = random.Random(20261202)
    order = [POINTS[i % len(POINTS)] for i in range(len(SEEDS))]
    rng.shuffle(order)
    outcomes = []
    for seed, point in zip(SEEDS, order, strict=True):
        tag = f"s{seed}"
        killed_at = time.monotonic()
        run = drive(stub, tag, point)
        assert run.returncode != 0, (point, run.stdout)
        # No help from anyone: the watchdog (or the commit that landed) settles the stage by itself.
        view = settled(lab_fleet, CONFIRM_S + 25)
        took = time.monotonic() - killed_at
        assert not view["journal"] and not view["watchdogs"], (point, view)
        on_disk = tag_of(view["unit"])
        assert view["active"] == "active" and view["served"] == on_disk, (point, view)
        if on_disk == tag:  # confirmed-new: the stack names this stage
            record = view["state"]["promotion"]["stages"][stack_top(view)]
            assert record["mode"] == tag, (point, view["state"]["promotion"])
            outcome = "confirmed-new"
        else:  # exactly-old: the unit and the stack as they were
            assert view["unit"] == old["unit"] and stack_top(view) == stack_top(old), (point, view)
            outcome = "exactly-old"
        outcomes.append((point, outcome, round(took, 1)))
        # A plain re-run converges: the new stage confirmed, served, recorded.
        again = drive(stub, f"{tag}-again")
        assert again.returncode == 0, (point, again.stdout + again.stderr)
        old = settled(lab_fleet, 30)
        assert old["served"] == f"{tag}-again" and old["state"]["promotion"]["mode"] == f"{tag}-again", (point, old)
    by_point = dict((p, o) for p, o, _ in outcomes)
    # The commit point decides: killed after it, the stage stays; killed before it, it goes.
    assert by_point.get("after_commit", "confirmed-new") == "confirmed-new"
    assert by_point.get("agent:after_state", "confirmed-new") == "confirmed-new"
    assert by_point.get("before_commit", "exactly-old") == "exactly-old"
    assert by_point.get("agent:after_evidence", "exactly-old") == "exactly-old"
    print(json.dumps(outcomes))

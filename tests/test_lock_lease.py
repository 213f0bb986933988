"""Locks that outlive their longest wait: renewed by heartbeat, never stale (so never breakable) while
the holder's heartbeat is fresh or an agent op of its run still executes on the host.

The agent runs as on a host (python -I -c <bootstrap>, JSON on stdin); a long op is a real agent
process holding `lock.held` under the run's lock_id, gated on a file, not a sleep.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.release_fixtures import run_agent

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sd(tmp_path: Path) -> Path:
    return tmp_path / "state"


def call(sd: Path, op: str, **args: object) -> dict:
    return run_agent(op, {"state_dir": str(sd), **args})


LONG_OP = r"""
import sys, time
from pathlib import Path
from ddtree_ops.agent.remote import lock
sd, lock_id, gate = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
with lock.held(sd, lock_id, who="alice", command="unit_apply"):
    (gate.parent / "entered").touch()
    while not gate.exists():
        time.sleep(0.05)
"""


def test_a_running_op_keeps_its_runs_lock_past_the_ttl(sd: Path, tmp_path: Path) -> None:
    lock_id = call(sd, "lock", who="alice", command="promote", ttl_s=0.3)["result"]["lock_id"]
    gate = tmp_path / "gate"
    op = subprocess.Popen([sys.executable, "-c", LONG_OP, str(sd), lock_id, str(gate)], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "entered").exists():
            assert time.monotonic() < deadline and op.poll() is None
            time.sleep(0.05)
        time.sleep(0.5)  # well past the TTL, no heartbeat
        holder = call(sd, "lock_status")["result"]["holder"]
        assert holder["lock_id"] == lock_id and not holder["stale"] and len(holder["ops"]) == 1, holder
        other = call(sd, "lock", who="bob", command="rollback --to previous")
        assert other["error"]["code"] == "locked", other
        # The control side gave up waiting and releases: the lock stays while its op runs.
        released = call(sd, "unlock", lock_id=lock_id)["result"]
        assert not released["released"] and released["busy"][0]["op"] == "unit_apply"
        assert call(sd, "unlock", force=True)["error"]["code"] == "lock_alive"
    finally:
        gate.touch()
        op.wait(30)
    # The op ended (its end counts as the run's last sign of life): one TTL later, with no heartbeat and
    # nothing running, the lock is stale.
    assert not call(sd, "lock_status")["result"]["holder"]["ops"]
    time.sleep(0.5)
    holder = call(sd, "lock_status")["result"]["holder"]
    assert holder["stale"] and not holder["ops"], holder
    assert call(sd, "lock", who="bob", command="rollback")["ok"]


def test_heartbeat_renews_and_refuses_a_lock_it_does_not_hold(sd: Path) -> None:
    lock_id = call(sd, "lock", who="alice", command="promote", ttl_s=1.0)["result"]["lock_id"]
    for _ in range(4):  # 2 s of beats every 0.5 s: never stale
        time.sleep(0.5)
        assert call(sd, "heartbeat", lock_id=lock_id)["result"] == {"lock": "held"}
        assert not call(sd, "lock_status")["result"]["holder"]["stale"]
    assert call(sd, "lock", who="bob", command="push")["error"]["code"] == "locked"
    lost = call(sd, "heartbeat", lock_id="not-mine")
    assert lost["error"]["code"] == "lock_lost" and "alice" in lost["error"]["message"]
    time.sleep(1.2)
    assert call(sd, "lock_status")["result"]["holder"]["stale"]


def test_a_killed_op_does_not_hold_the_lock(sd: Path, tmp_path: Path) -> None:
    """An op registered under the lock and then SIGKILLed (it never unregisters) holds nothing."""
    lock_id = call(sd, "lock", who="alice", command="promote", ttl_s=0.3)["result"]["lock_id"]
    op = subprocess.Popen([sys.executable, "-c", LONG_OP, str(sd), lock_id, str(tmp_path / "never")], cwd=REPO)
    deadline = time.monotonic() + 30
    while not (tmp_path / "entered").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    op.kill()
    op.wait(30)
    time.sleep(0.5)
    holder = call(sd, "lock_status")["result"]["holder"]
    assert holder["stale"], holder
    assert call(sd, "unlock", force=True)["result"]["released"]
    owner = json.loads(json.dumps(holder))
    assert owner["ops"][0]["op"] == "unit_apply"  # it was registered, and judged gone

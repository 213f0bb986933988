"""The control side of one commit-confirmed stage, for tests/lab/test_confirm_random.py: the real
library calls promote makes (lock + heartbeat lease, install with its confirm deadline and watchdog,
wait for the new invocation, confirm), with no gates in between, on a small stub service.

    python tests/lab/confirm_driver.py INVENTORY HOST TAG [KILL_POINT]

KILL_POINT: a control-side point where this process SIGKILLs itself (after_lock, after_install,
after_ready, before_commit, after_commit), or an agent point (agent:after_backup, ...) passed on to
the agent, which then dies there; with an agent point this process also stops at the first failed
call, as a control side that dies with its connection would. Prints one JSON line on success.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from ddtree_ops import release, service
from ddtree_ops.fleet import HostContext
from ddtree_ops.inventory import load_inventory

STUB = "/opt/ddtree-lab/confirm_stub.py"
APPLY_POINTS = ("after_backup", "after_journal", "after_watchdog", "after_write", "after_reload", "after_restart")
COMMIT_POINTS = ("after_evidence", "after_state")
CONTROL_POINTS = ("after_lock", "after_install", "after_ready", "before_commit", "after_commit")


def unit_text(host, tag: str) -> str:
    paths = service.unit_paths(host)
    return (f"[Unit]\nDescription=ddtree-ops confirm test stub {tag}\n\n[Service]\nType=exec\n"
            f"ExecStart=/usr/bin/python3 {STUB} {host.serve_port} {tag}\nEnvironmentFile={paths.env_path}\n")


def main() -> int:
    inventory, name, tag = sys.argv[1:4]
    point = sys.argv[4] if len(sys.argv) > 4 else ""
    agent_point = point.removeprefix("agent:") if point.startswith("agent:") else None

    def kill(here: str) -> None:
        if point == here:
            os.kill(os.getpid(), signal.SIGKILL)

    inv = load_inventory(Path(inventory))
    host = inv.hosts[name]
    paths = service.unit_paths(host)
    unit = service.RenderedUnit(host.name, tag, paths, [], unit_text(host, tag), f'STUB_SECRET="tag-{tag}"\n')
    ctx = HostContext(host, None)
    with release._session(ctx, inv) as session, \
            release._host_lock(ctx, session, command="confirm test", operator="tester", wait_s=60) as lease:
        kill("after_lock")
        applied = service.install(session, host, unit, lock_id=lease.lock_id, operator="tester", confirm_hard_s=120,
                                  test_kill=agent_point if agent_point in APPLY_POINTS else None)
        lease.follow(applied["unit_id"])
        kill("after_install")
        ready = service.wait_ready(session, host, timeout_s=60, after_invocation=applied["restart"]["invocation_before"])
        if not ready["ready"]:
            print(json.dumps({"error": ready.get("reason")}))
            return 1
        kill("after_ready")
        time.sleep(1.0)  # a gate's worth of waiting, with the lease beating
        kill("before_commit")
        service.commit(session, host, lock_id=lease.lock_id, operator="tester", unit_id=applied["unit_id"], mode=tag,
                       record={}, evidence={"tag": tag}, canary=None,
                       test_kill=agent_point if agent_point in COMMIT_POINTS else None)
        lease.follow(None)
        kill("after_commit")
    print(json.dumps({"committed": applied["unit_id"], "tag": tag}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

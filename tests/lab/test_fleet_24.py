"""24 GPU hosts behind the bastion on this 2-core machine: status, push and promote --dry-run across all of
them, as the operator (sudo) through the jump host, with the CLI an operator runs. (`smoke` across 24 is
measured by bench/bench_fleet.py: each host imports SGLang three times, about 7 min on 2 cores.)"""

from __future__ import annotations

import importlib.metadata
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_status import cli

from ddtree_ops.bundle import build_bundle
from ddtree_ops.lab.config import LabPaths
from ddtree_ops.signing import sign_bundle

pytestmark = [pytest.mark.lab, pytest.mark.lab_destructive]

HOSTS = 24


@pytest.fixture
def fleet_24(lab_exclusive) -> Iterator[Path]:
    from ddtree_ops.lab.fleet import lab_up

    status = lab_up(HOSTS, lab_exclusive.repo_root)
    assert status.all_up and len(status.gpu_hosts) == HOSTS
    try:
        yield status.inventory_path
    finally:
        # Back to the session's three hosts, the first three pristine again for whatever runs next.
        cli("rollback", "-i", str(status.inventory_path), "--to", "pristine", "--adopt", "--json",
            timeout=900)
        assert lab_up(3, lab_exclusive.repo_root).all_up


def _rows(result, command: str) -> dict[str, dict]:
    assert result.returncode == 0, f"{command}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
    doc = json.loads(result.stdout)
    rows = {row["host"]: row for row in doc["results"]}
    assert len(rows) == HOSTS and all(row["status"] == "ok" for row in rows.values()), (command, doc)
    return rows


def test_24_hosts_status_push_and_promote_dry_run(fleet_24: Path, tmp_path: Path) -> None:
    site = importlib.metadata.distribution("sglang").locate_file("")
    built = build_bundle(None, tmp_path, site_dir=site)
    sign_bundle(built.bundle_path, LabPaths.from_env().signing_key)
    inv = str(fleet_24)
    timings: dict[str, float] = {}

    def timed(name: str, *args: str) -> dict[str, dict]:
        started = time.monotonic()
        result = cli(*args, "-i", inv, "--json", timeout=900)
        timings[name] = time.monotonic() - started
        return _rows(result, name)

    status = timed("status", "status")
    assert {row["data"]["user"]["uid"] for row in status.values()} == {0}  # the agent, through sudo
    pushed = timed("push", "push", "--bundle", str(built.bundle_path))
    assert len({row["data"]["release"] for row in pushed.values()}) == 1
    planned = timed("promote --dry-run", "promote", "--mode", "shadow-linear", "--dry-run",
                    "--evidence-dir", str(tmp_path / "evidence"))
    assert all(row["data"]["dry_run"] for row in planned.values())
    print(f"24 hosts through the bastion: {json.dumps({k: round(v, 1) for k, v in timings.items()})}")

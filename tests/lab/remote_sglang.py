"""What a lab host's SGLang install holds, read over SSH: files' sha256 by path inside its site-packages."""

from __future__ import annotations

import json
import shlex

from tests.lab.conftest import LabFleet

DEFAULT_PYTHON = "/opt/sglang/venv/bin/python"

HASH_PROBE = """
import hashlib, json, sys, importlib.metadata as m
root = m.distribution("sglang").locate_file("")
out = {}
for rel in json.loads(sys.argv[1]):
    try:
        out[rel] = hashlib.sha256(open(root / rel, "rb").read()).hexdigest()
    except FileNotFoundError:
        out[rel] = None
print(json.dumps({"root": str(root), "files": out}))
"""


def _probe(lab_fleet: LabFleet, host: str, rels: list[str], python: str) -> dict:
    r = lab_fleet.ssh(host, shlex.join([python, "-c", HASH_PROBE, json.dumps(rels)]))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def remote_hashes(lab_fleet: LabFleet, host: str, rels: list[str], python: str = DEFAULT_PYTHON) -> dict[str, str | None]:
    """sha256 of each path (relative to the site-packages that holds sglang); None where it is missing."""
    return _probe(lab_fleet, host, rels, python)["files"]


def site_path(lab_fleet: LabFleet, host: str, rel: str, python: str = DEFAULT_PYTHON) -> str:
    """The absolute path on the host of a path inside the site-packages that holds sglang."""
    return _probe(lab_fleet, host, [], python)["root"].rstrip("/") + "/" + rel

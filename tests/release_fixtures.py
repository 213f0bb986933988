"""A fake SGLang site-packages, fake bundles and a local agent runner for the release tests.

The agent runs exactly as on a host: `python -I -c <bootstrap>` with the shipped sources and
one JSON request on stdin, so these tests exercise the real transport, only without SSH.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from ddtree_ops.agent.shipping import agent_argv, agent_stdin

BASE_VERSION = "0.5.13.post1"

PRISTINE = {
    "sglang/__init__.py": b"# sglang\n",
    "sglang/srt/server_args.py": b"# pristine server_args\nX = 1\n",
    "sglang/srt/speculative/dflash_worker.py": b"# pristine dflash worker\n",
    "sglang/srt/speculative/dflash_info.py": b"# pristine dflash info\n",
    "sglang/srt/untouched.py": b"# never touched by any bundle\n",
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_site(root: Path, version: str = BASE_VERSION) -> Path:
    site = root / "site-packages"
    for rel, data in PRISTINE.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    dist = site / f"sglang-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    # The wheel's RECORD, as pip writes it: the agent checks pristine copies against it.
    rows = [f"{rel},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip('=')},{len(data)}"
            for rel, data in PRISTINE.items()]
    (dist / "RECORD").write_text("\n".join(rows + [f"{dist.name}/RECORD,,"]) + "\n")
    return site


@dataclass
class FakeBundle:
    path: Path
    manifest: dict
    patched: dict[str, bytes] = field(default_factory=dict)  # rel -> bytes the bundle installs

    @property
    def sha256(self) -> str:
        return sha(self.path.read_bytes())

    @property
    def paths(self) -> list[str]:
        return sorted(self.patched)


def make_bundle(out: Path, version: str = "1.0.0", *, tag: str = "v1", base_version: str = BASE_VERSION,
                patched_paths: tuple[str, ...] = ("sglang/srt/server_args.py", "sglang/srt/speculative/dflash_worker.py"),
                new_paths: tuple[str, ...] = ("sglang/srt/speculative/ddtree_utils.py",
                                              "sglang/srt/speculative/ddtree_args.py"),
                tamper: str | None = None) -> FakeBundle:
    """A bundle in bundle.py's format; `tamper` names a file whose bytes differ from the manifest."""
    patched_files, new_files, blobs = [], [], {}
    for rel in patched_paths:
        data = PRISTINE[rel] + f"# patched {tag}\n".encode()
        blobs[rel] = data
        patched_files.append({"path": rel, "patch": "x.patch", "pristine_sha256": sha(PRISTINE[rel]),
                              "sha256": sha(data), "size": len(data)})
    for rel in new_paths:
        data = f"# new ddtree module {rel} {tag}\n".encode()
        blobs[rel] = data
        new_files.append({"path": rel, "sha256": sha(data), "size": len(data)})
    manifest = {"format": 1, "payload_name": "ddtree-payload", "payload_version": version,
                "base_package": "sglang", "base_version": base_version, "build_time": "2026-01-01T00:00:00Z",
                "patched_files": patched_files, "new_files": new_files}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        members = [("manifest.json", json.dumps(manifest).encode())]
        members += [("files/" + rel, (data + b"evil\n") if rel == tamper else data) for rel, data in blobs.items()]
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ddtree-payload-{version}-{tag}.tar.gz"
    path.write_bytes(raw.getvalue())
    return FakeBundle(path, manifest, blobs)


# The agent must run on the hosts' interpreters, not only ours: DDTREE_TEST_AGENT_PYTHON=python3.12 ...
AGENT_PYTHON = os.environ.get("DDTREE_TEST_AGENT_PYTHON") or sys.executable


def run_agent(op: str, args: dict, *, env: dict | None = None, timeout: float = 60,
              python: str | None = None) -> dict:
    proc = subprocess.run(agent_argv(python or AGENT_PYTHON), input=agent_stdin(op, args), capture_output=True,
                          timeout=timeout, env=env)
    assert proc.stdout, f"agent {op} gave no answer (rc {proc.returncode}): {proc.stderr.decode()[-2000:]}"
    return json.loads(proc.stdout)


def site_hashes(site: Path, rels: list[str]) -> dict[str, str | None]:
    out = {}
    for rel in rels:
        p = site / rel
        out[rel] = sha(p.read_bytes()) if p.exists() else None
    return out

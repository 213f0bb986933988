"""What `lab up` puts on every lab host besides the base image: the lab engine and its models.

The engine (`ddtree_ops/lab/engine/`) becomes the top-level package `ddtree_lab_engine` in the
site-packages of the host's SGLang venv (the default one below, or the one its `sglang` names), so `/opt/sglang/venv/bin/python -m ddtree_lab_engine ARGS` runs it; the
models go to `/opt/ddtree-lab/models/{target,target-hybrid,draft}`. Both are copied at every
`lab up`, onto running hosts too, so engine changes never need a base-image rebuild. Each tree is
swapped in with renames (extract beside it, rename the old one away, rename the new one in), so a
host never sees half an engine.

The models are written once on this machine (seeded, so always the same bytes) into the lab cache,
keyed by the hash of the module that writes them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import tarfile
from pathlib import Path

from ddtree_ops.lab.config import LAB_MODELS_DIR, LabPaths
from ddtree_ops.lab.host import LabHost, ssh_argv
from ddtree_ops.lab.steps import LabError, Progress, no_progress, on_each

ENGINE_SOURCE = Path(__file__).resolve().parent / "engine"
ENGINE_PACKAGE = "ddtree_lab_engine"

# Runs on the host under its venv's python, the tar on stdin; prints one JSON line.
_INSTALL_SCRIPT = r"""
import io, json, os, shutil, sys, sysconfig, tarfile, tempfile
site = sysconfig.get_paths()["purelib"]
targets = {"ddtree_lab_engine": os.path.join(site, "ddtree_lab_engine"), "models": sys.argv[1]}
with tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read())) as tar:
    members = tar.getmembers()
    for top, dest in targets.items():
        parent = os.path.dirname(dest)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=".ddtree-lab-")
        mine = [m for m in members if m.name == top or m.name.startswith(top + "/")]
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp, members=mine, **kwargs)
        old = dest + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.lexists(dest):
            os.rename(dest, old)
        os.rename(os.path.join(tmp, top), dest)
        shutil.rmtree(old, ignore_errors=True)
        os.rmdir(tmp)
print(json.dumps({"engine": targets["ddtree_lab_engine"], "models": sys.argv[1]}))
"""


def _engine_files() -> list[Path]:
    return sorted(p for p in ENGINE_SOURCE.glob("*.py"))


def models_dir(paths: LabPaths) -> Path:
    """The cached model directories, written on first use (needs torch and safetensors here)."""
    writer = ENGINE_SOURCE / "model_files.py"
    key = hashlib.sha256(writer.read_bytes()).hexdigest()[:16]
    target = paths.cache / f"models-{key}"
    if (target / "draft" / "config.json").is_file():
        return target
    from ddtree_ops.lab.engine.model_files import write_models

    tmp = paths.cache / f".models-{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_models(tmp)
    for old in paths.cache.glob("models-*"):
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, target)
    return target


def bundle(paths: LabPaths) -> bytes:
    """A tar of ddtree_lab_engine/*.py and models/<name>/…, every file 0644, directories 0755."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add(src: Path, name: str) -> None:
            info = tar.gettarinfo(str(src), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mode = 0o755 if src.is_dir() else 0o644
            if src.is_dir():
                tar.addfile(info)
            else:
                with src.open("rb") as f:
                    tar.addfile(info, f)

        add(ENGINE_SOURCE, ENGINE_PACKAGE)
        for f in _engine_files():
            add(f, f"{ENGINE_PACKAGE}/{f.name}")
        models = models_dir(paths)
        add(models, "models")
        for model in sorted(p for p in models.iterdir() if p.is_dir()):
            add(model, f"models/{model.name}")
            for f in sorted(model.iterdir()):
                add(f, f"models/{model.name}/{f.name}")
    return buf.getvalue()


def install(hosts: list[LabHost], paths: LabPaths, progress: Progress = no_progress, via: LabHost | None = None) -> None:
    """Copy the engine and the models onto every host (running hosts included), through `via` (the bastion)."""
    data = bundle(paths)

    def install_on(h: LabHost) -> None:
        # Into the host's own SGLang venv: the unit runs `<that python> -m ddtree_lab_engine`.
        remote = shlex.join([h.python, "-c", _INSTALL_SCRIPT, LAB_MODELS_DIR])
        argv = ssh_argv(h, paths.client_key, paths.known_hosts, remote, via=via)
        try:
            result = subprocess.run(argv, input=data, capture_output=True, timeout=120, check=False)
        except subprocess.TimeoutExpired as e:
            raise LabError(f"{h.name}: installing the lab engine did not finish within 120 s") from e
        out, err = result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
        if result.returncode != 0:
            raise LabError(f"{h.name}: installing the lab engine failed (exit {result.returncode}): {err.strip()[-2000:]}")
        try:
            json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise LabError(f"{h.name}: the lab engine installer printed no result: {out!r} {err[-500:]!r}") from None

    on_each(hosts, install_on)
    progress(f"lab engine and models installed on {len(hosts)} host(s)")

"""Shared fixtures for the payload tests: the real sglang 0.5.13.post1 wheel, and a patched copy
of the dev venv's sglang tree."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

import pytest

from ddtree_ops import bundle as B

BASE_PACKAGE = "sglang"
BASE_VERSION = "0.5.13.post1"


def real_wheel() -> Path:
    """$DDTREE_SGLANG_WHEEL, else ~/.cache/ddtree-ops/wheels (downloaded once with pip)."""
    try:
        return B.default_wheel(BASE_PACKAGE, BASE_VERSION)
    except B.BundleError as e:
        pytest.skip(f"no sglang {BASE_VERSION} wheel available (set DDTREE_SGLANG_WHEEL): {e}")


def venv_site() -> Path:
    try:
        dist = importlib.metadata.distribution(BASE_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed in this venv")
    if dist.version != BASE_VERSION:
        pytest.skip(f"needs sglang {BASE_VERSION}, found {dist.version}")
    return Path(dist.locate_file(""))


def copy_sglang_tree(dest: Path) -> Path:
    """A site-packages dir holding a copy of the venv's sglang + its dist-info. Hard links where
    possible (install_bundle replaces files by rename, so the venv's inodes are never written)."""
    src = venv_site()
    dest.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["cp", "-al", str(src / "sglang"), str(dest)], capture_output=True).returncode != 0:
        shutil.copytree(src / "sglang", dest / "sglang")
    info = f"{BASE_PACKAGE}-{BASE_VERSION}.dist-info"
    shutil.copytree(src / info, dest / info)
    return dest

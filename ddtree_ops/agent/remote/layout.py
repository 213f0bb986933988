"""Where things live on the host: the SGLang site-packages and the state-dir tree (stdlib only).

    <state_dir>/staging/<bundle>            uploads land here, verified before use
    <state_dir>/releases/<id>/bundle.tar.gz the bundle as installed
    <state_dir>/releases/<id>/manifest.json its manifest
    <state_dir>/releases/<id>/payload/<rel> the patched files, extracted (a journal can redo from them)
    <state_dir>/releases/<id>/backup/<rel>  what each file was before this release replaced it
    <state_dir>/releases/<id>/backup.json   per file: before/after sha256, mode
    <state_dir>/journal.json                only while files in site-packages are changing
    <state_dir>/pristine/index.json         per file every release ever touched: its original sha256
    <state_dir>/pristine/files/<rel>        the original bytes, written once (pristine.py)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path, PurePosixPath

from .atomic import AgentError

STAGING = "staging"
RELEASES = "releases"
PRISTINE = "pristine"
REPLACED = "replaced"  # replaced/<time>/<rel>: what rollback --to pristine overwrote, so it can be undone
JOURNAL = "journal.json"
BACKUP_RECORD = "backup.json"


def is_release_id(value: object) -> bool:
    return isinstance(value, str) and bool(value) and "/" not in value and "\\" not in value \
        and not value.startswith(".") and "\0" not in value


def release_dir(state_dir: Path, release: str) -> Path:
    safe_name(release, "release id")
    return state_dir / RELEASES / release


def safe_name(name: str, what: str) -> str:
    """A single path component: no separators, no dot-dirs (names travel in requests)."""
    if not is_release_id(name):
        raise AgentError("bad_request", f"invalid {what}: {name!r}", "use the name ddtree-ops printed")
    return name


def safe_relpath(rel: str, package: str = "sglang") -> PurePosixPath:
    """A site-packages-relative path from a manifest: never absolute, never escaping, and inside the
    base package's own tree: never the site-packages root (where a .pth file runs at every interpreter
    start) nor another package."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\0" in rel or any(part in ("", ".") for part in p.parts) \
            or str(p) != rel:
        raise AgentError("bad_bundle", f"manifest path {rel!r} is not a safe site-packages-relative path",
                         "rebuild the bundle with ddtree-ops build")
    if p.parts[0] != package or len(p.parts) < 2:
        raise AgentError("bad_bundle", f"manifest path {rel!r} is outside {package}/ (a payload only patches or adds "
                         f"files of the {package} package)", "rebuild the bundle with ddtree-ops build")
    return p


def find_base(package: str, sys_path: list | None = None) -> tuple[str, Path]:
    """(version, site-packages dir) of the installed base package as this interpreter sees it.

    importlib.metadata reads dist-info only, so this costs milliseconds where `import sglang`
    costs seconds. sys_path (as in facts) puts directories first; tests point it at a fake tree.
    """
    import importlib.metadata  # here, not at the top: 25 ms of every agent start that imports layout for its names

    if sys_path is not None and (not isinstance(sys_path, list) or not all(isinstance(p, str) for p in sys_path)):
        raise AgentError("bad_request", "sys_path must be a list of strings")
    dists = list(importlib.metadata.distributions(name=package, path=list(sys_path or []) + sys.path))
    if not dists:
        raise AgentError("base_missing", f"{package} is not installed for this interpreter",
                         "check `python` in the inventory points at the SGLang venv")
    dist = dists[0]
    root = Path(os.fspath(dist.locate_file("")))
    return dist.version, root

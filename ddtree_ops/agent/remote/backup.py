"""releases/<id>/backup.json: what one release replaced, per file (stdlib only).

    {"release": id, "files": {rel: {"before": sha256 | null, "after": sha256 | null, "mode": int}}}

`before` is what the file was when the release was installed (its bytes in releases/<id>/backup/),
`after` what the release put there. rollback --to previous pops a release with it, and push uses
the stack's records to tell our own bytes from a foreign change, so a record that is missing or
damaged is refused (never read as "this release replaced nothing").
"""

from __future__ import annotations

from pathlib import Path

from . import statefs
from .layout import BACKUP_RECORD, release_dir


def _hash_or_none(v: object) -> bool:
    return v is None or (isinstance(v, str) and len(v) == 64)


def problem_of(raw: object) -> str | None:
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, dict):
        return "has no `files` object"
    for rel, f in files.items():
        if not (isinstance(f, dict) and _hash_or_none(f.get("before")) and _hash_or_none(f.get("after"))
                and isinstance(f.get("mode"), int)):
            return f"entry {rel!r} is not {{before, after, mode}}"
    return None


def read(sd: Path, rid: str) -> dict:
    """The validated record of release rid; statefs.damaged() naming the file when it is not."""
    path = release_dir(sd, rid) / BACKUP_RECORD
    try:
        raw = statefs.read_json(path, "the backup record", statefs.REPAIR_PRISTINE)
    except FileNotFoundError:
        raise statefs.damaged(path, f"the backup record of installed release {rid} is missing: what it replaced "
                              "is unknown", statefs.REPAIR_PRISTINE) from None
    problem = problem_of(raw)
    if problem:
        raise statefs.damaged(path, f"the backup record {problem}", statefs.REPAIR_PRISTINE)
    assert isinstance(raw, dict)
    return raw

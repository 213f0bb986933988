"""The pristine store: the original bytes of every file a payload touches (stdlib only).

    <state_dir>/pristine/index.json    {"files": {rel: {"sha256": hex | null, "adopted": bool}}}
    <state_dir>/pristine/files/<rel>   the bytes (none for a file that did not exist: a new module)

An entry is written once, before the first install that touches its file changes anything, and
only from bytes that hash to the manifest's pristine sha256 (the wheel's RECORD digest, checked at
build time) and to the host's own dist-info RECORD where that lists the file. With --adopt a
foreign file is kept as the original instead, marked adopted. A later release never overwrites
an entry: a copy that verifies is left alone, and a copy that is missing or damaged is re-taken
only from bytes on this host with the recorded hash (the site file or a release backup), so the
store can heal but never change. A missing or damaged index is rebuilt (never read as empty) from
every trace of a touched file under releases/ and pristine/ and the originals the manifests or,
failing those, the host's wheel RECORD state; an entry must agree with the manifests to be trusted.
`rollback --to pristine` restores from here and checks each file against the recorded sha256.
"""

from __future__ import annotations

import base64
import csv
import io
import os
from pathlib import Path

from . import statefs
from .atomic import AgentError, copy_file_atomic, sha256_file, write_json_atomic
from .bundle import normalize_manifest
from .layout import BACKUP_RECORD, PRISTINE, RELEASES, safe_relpath

INDEX = "index.json"


def copy_path(sd: Path, rel: str) -> Path:
    return sd / PRISTINE / "files" / rel


def kept_releases(sd: Path) -> list[Path]:
    try:
        return sorted(p for p in (sd / RELEASES).iterdir() if not p.name.startswith("."))
    except FileNotFoundError:
        return []


def _json_or_none(path: Path) -> object:
    """A release's own record for rebuilding; a damaged one is skipped (every copy is re-hashed anyway)."""
    try:
        return statefs.read_json(path, path.name, statefs.REPAIR_PRISTINE)
    except (FileNotFoundError, AgentError):
        return None


class Known:
    """What releases/ holds for each file: `copies` rel -> sha256 -> files with exactly those bytes
    (payload and backup copies, hashed here rather than taken on a record's word), `ours` rel ->
    the sha256s our releases install (payload copies, and what manifests and backup records state,
    so our own bytes are recognised even when every copy of them is damaged), and `wheel` rel ->
    the pristine sha256 the manifests state."""

    def __init__(self, sd: Path) -> None:
        self.copies: dict[str, dict[str | None, list[Path]]] = {}
        self.ours: dict[str, set[str | None]] = {}
        self.wheel: dict[str, set[str | None]] = {}  # the wheel's own bytes, as the manifests state them
        # Every file any trace in the state dir says a release touched: one damaged record must not
        # hide a file from rollback --to pristine.
        self.touched: set[str] = {p.relative_to(sd / PRISTINE / "files").as_posix()
                                  for p in (sd / PRISTINE / "files").rglob("*") if p.is_file()}
        for rdir in kept_releases(sd):
            for sub in ("payload", "backup"):
                for p in sorted((rdir / sub).rglob("*")):
                    if p.is_file() and not p.is_symlink():
                        rel, h = p.relative_to(rdir / sub).as_posix(), sha256_file(p)
                        self.copies.setdefault(rel, {}).setdefault(h, []).append(p)
                        self.touched.add(rel)
                        if sub == "payload":
                            self.ours.setdefault(rel, set()).add(h)
            man = _manifest(rdir)
            for f in man["files"] if man else []:
                self.ours.setdefault(f["path"], set()).add(f["patched_sha256"])
                self.wheel.setdefault(f["path"], set()).add(f["pristine_sha256"])
                self.touched.add(f["path"])
            rec = _json_or_none(rdir / BACKUP_RECORD)
            files = rec.get("files") if isinstance(rec, dict) else None
            for rel, f in (files.items() if isinstance(files, dict) else ()):
                self.touched.add(rel)
                if isinstance(f, dict) and isinstance(f.get("after"), str):
                    self.ours.setdefault(rel, set()).add(f["after"])

    def with_hash(self, rel: str, h: str | None) -> list[Path]:
        return self.copies.get(rel, {}).get(h, [])


def _manifest(rdir: Path) -> dict | None:
    raw = _json_or_none(rdir / "manifest.json")
    try:
        return normalize_manifest(raw) if raw is not None else None
    except AgentError:
        return None


def _index_problem(raw: object) -> str | None:
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, dict):
        return "has no `files` object"
    for rel, e in files.items():
        if not (isinstance(e, dict) and (e.get("sha256") is None or isinstance(e.get("sha256"), str))
                and isinstance(e.get("adopted"), bool)):
            return f"entry {rel!r} is not {{sha256, adopted}}"
        try:
            safe_relpath(rel, rel.split("/", 1)[0])
        except AgentError:
            return f"entry {rel!r} is not a safe path"
    return None


def _rebuilt(sd: Path, known: Known, record: dict[str, str] | None) -> dict[str, dict]:
    """The index from what else the state dir and the host know: the original sha256 each kept
    manifest states; for a file only other traces name, the host's wheel RECORD (a file the wheel
    does not list did not exist: a new module). With no RECORD such a file's original is unknown,
    and rollback --to pristine refuses it rather than guess. An adopted original is recognised by
    a kept copy hashing to a backup's before-hash."""
    files: dict[str, dict] = {}
    for rdir in kept_releases(sd):
        man = _manifest(rdir)
        for f in man["files"] if man else []:
            files.setdefault(f["path"], {"sha256": f["pristine_sha256"], "adopted": False})
    for rel in sorted(known.touched - set(files)):
        files[rel] = {"sha256": record.get(rel), "adopted": False} if record else \
            {"sha256": None, "adopted": False, "unknown": True}
    for rel, e in files.items():
        have = sha256_file(copy_path(sd, rel)) if e["sha256"] is not None else None
        if have is not None and have != e["sha256"] and known.with_hash(rel, have) and have not in known.ours.get(rel, ()):
            files[rel] = {"sha256": have, "adopted": True}
    return files


def load_index(sd: Path, known: Known, record: dict[str, str] | None) -> dict[str, dict]:
    """rel -> {"sha256", "adopted"} for every file a kept release touches: index.json's entries,
    completed from releases/ and the wheel's RECORD (all of it when index.json is missing or damaged,
    or for releases an older agent installed before the store existed). `record`: host_record()."""
    path = sd / PRISTINE / INDEX
    try:
        raw = statefs.read_json(path, "the pristine index", statefs.REPAIR_PRISTINE)
    except (FileNotFoundError, AgentError):
        raw = None
    stored = raw["files"] if isinstance(raw, dict) and not _index_problem(raw) else {}
    rebuilt = _rebuilt(sd, known, record)
    # An original must be the one the manifests state (an adopted file's is whatever was there).
    trusted = {rel: e for rel, e in stored.items()
               if e["adopted"] or rel not in rebuilt or rebuilt[rel]["sha256"] == e["sha256"]}
    return {**rebuilt, **trusted}


def host_record(site: Path, package: str, version: str) -> dict[str, str]:
    """The installed wheel's RECORD as {rel: sha256 hex}; empty when the install has none."""
    name = f"{package.replace('-', '_')}-{version}.dist-info"
    try:
        fd = os.open(site / name / "RECORD", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return {}
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        rows = list(csv.reader(io.StringIO(f.read(statefs.MAX_STATE_FILE))))
    out = {}
    for row in rows:
        if len(row) >= 2 and row[1].startswith("sha256="):
            b64 = row[1][len("sha256="):]
            try:
                out[row[0]] = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
            except ValueError:
                continue
    return out


def heal(sd: Path, site: Path, rel: str, want: str, known: Known) -> bool:
    """Make pristine/files/rel hash to want from bytes on this host that do; False when none do."""
    target = copy_path(sd, rel)
    if sha256_file(target) == want:
        return True
    for src in [site / rel, *known.with_hash(rel, want)]:
        if sha256_file(src) == want:
            copy_file_atomic(src, target)
            if sha256_file(target) == want:
                return True
    return False


def lost(rel: str, want: str | None, package: str, version: str | None = None) -> AgentError:
    wheel = f"{package}=={version}" if version else f"the {package} version the host runs"
    return AgentError("pristine_lost", f"no copy of the original {rel} (sha256 {want}) is left on this host: "
                      f"{rel} is not pristine and pristine/files/{rel} is missing or damaged",
                      f"reinstall the wheel on the host (pip install --force-reinstall --no-deps {wheel}) so the "
                      "original is back, then repeat the command; nothing was changed", path=rel)


def ensure(sd: Path, site: Path, man: dict, *, adopt: bool) -> dict[str, dict]:
    """Give every file of the manifest a verified original in the store before anything changes."""
    known = Known(sd)
    record = host_record(site, man["package"], man["version"])
    index = load_index(sd, known, record)
    for f in man["files"]:
        rel, want = f["path"], f["pristine_sha256"]
        entry = index.get(rel)
        if entry is not None and not entry["adopted"] and not entry.get("unknown") and entry["sha256"] != want:
            raise AgentError("pristine_mismatch", f"{rel}: the bundle's pristine sha256 {want} differs from the original "
                             f"recorded on this host ({entry['sha256']})",
                             "rebuild the bundle against the wheel installed here; nothing was changed")
        if entry is None or entry.get("unknown"):
            if want is not None and record.get(rel, want) != want:
                raise AgentError("pristine_mismatch", f"{rel}: the bundle's pristine sha256 {want} differs from this "
                                 f"host's {man['package']} RECORD ({record[rel]})",
                                 "rebuild the bundle against the wheel installed here; nothing was changed")
            now = sha256_file(site / rel)
            ours = known.ours.get(rel, set())
            # Not pristine: for a new module, present but not ours; for an upstream file, no bytes
            # with the pristine hash anywhere on the host (site file, store, release backups).
            foreign = (now is not None and now not in ours) if want is None else not heal(sd, site, rel, want, known)
            if not foreign:
                entry = {"sha256": want, "adopted": False}
            elif adopt and now not in ours:
                # The operator takes over a foreign file: its bytes are the original rollback returns to.
                if now is not None:
                    copy_file_atomic(site / rel, copy_path(sd, rel))
                entry = {"sha256": now, "adopted": True}
            else:
                raise lost(rel, want, man["package"], man["version"])
            index[rel] = entry
        elif entry["sha256"] is not None and not heal(sd, site, rel, entry["sha256"], known):
            raise lost(rel, entry["sha256"], man["package"], man["version"])
    write_json_atomic(sd / PRISTINE / INDEX, {"files": {rel: e for rel, e in index.items() if not e.get("unknown")}})
    return index

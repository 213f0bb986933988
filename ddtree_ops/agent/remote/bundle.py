"""A payload bundle as the agent reads it: manifest, release id, streamed verify and extract (stdlib only).

A bundle is `manifest.json` + `files/<site-packages-relative path>` in a .tar.gz (../../bundle.py
builds it). The agent trusts nothing in it: every member is hashed while it streams by, in
chunks, against the manifest; a member's declared size is checked against MAX_MEMBER before a
byte of it is read, so a small archive that inflates to gigabytes is refused at its header.
Release ids are content addressed (payload version + hash of the (path, patched sha256)
list), so rebuilding the same payload gives the same id and re-pushing it is a no-op.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path

from .atomic import CHUNK, AgentError
from .layout import safe_relpath

MAX_MEMBER = 64 * 1024 * 1024  # the biggest sglang file is < 1 MiB
MAX_MANIFEST = 4 * 1024 * 1024
MAX_TOTAL = 256 * 1024 * 1024
MAX_MEMBERS = 4096
MANIFEST = "manifest.json"
FILES = "files/"


def _bad(message: str, hint: str = "rebuild the bundle with ddtree-ops build; nothing was changed") -> AgentError:
    return AgentError("bad_bundle", message, hint)


def normalize_manifest(raw: object) -> dict:
    """The fields the agent needs from manifest.json (bundle.BundleManifest), validated.

    -> {"package", "version", "payload_version", "files": [{"path", "pristine_sha256", "patched_sha256"}]}
    New files carry pristine_sha256 None: "absent" is their pristine state.
    """
    if not isinstance(raw, dict):
        raise _bad("manifest.json is not a JSON object")
    package, version = raw.get("base_package"), raw.get("base_version")
    payload_version = raw.get("payload_version")
    groups = (raw.get("patched_files") or [], raw.get("new_files") or [])
    if not (isinstance(package, str) and isinstance(version, str) and isinstance(payload_version, str)
            and all(isinstance(g, list) and all(isinstance(f, dict) for f in g) for g in groups) and any(groups)):
        raise _bad("manifest.json lacks base_package/base_version, payload_version or files")
    entries = [(f.get("path"), f.get("pristine_sha256"), f.get("sha256")) for f in groups[0]]
    entries += [(f.get("path"), None, f.get("sha256")) for f in groups[1]]
    files = []
    for path, pristine, patched in entries:
        rel = str(safe_relpath(str(path or ""), package))
        for what, h in (("sha256", patched), ("pristine_sha256", pristine)):
            if (h is not None or what == "sha256") and not (isinstance(h, str) and len(h) == 64):
                raise _bad(f"manifest entry {rel} has no valid {what}")
        files.append({"path": rel, "pristine_sha256": pristine, "patched_sha256": patched})
    files.sort(key=lambda f: f["path"])
    if len({f["path"] for f in files}) != len(files):
        raise _bad("manifest lists a file twice")
    return {"package": package, "version": version, "payload_version": payload_version, "files": files}


def release_id(man: dict) -> str:
    h = hashlib.sha256()
    for f in man["files"]:
        h.update(f"{f['path']}\0{f['patched_sha256']}\n".encode())
    pv = "".join(c if c.isalnum() or c in "._-+" else "_" for c in man["payload_version"])
    return f"{pv}-{h.hexdigest()[:12]}"


def _members(tar: tarfile.TarFile, path: Path):
    """(name, member) of each regular file, refusing links, oversize members and too many members
    as their headers stream by (before their data is read)."""
    total = count = 0
    for m in tar:
        name = m.name[2:] if m.name.startswith("./") else m.name
        if m.isdir():
            continue
        if not m.isreg():
            raise _bad(f"bundle member {name} is not a regular file (links and devices are refused)")
        count += 1
        total += m.size
        cap = MAX_MANIFEST if name.endswith(MANIFEST) else MAX_MEMBER
        if m.size > cap:
            raise _bad(f"bundle member {name} is too large: {m.size} bytes, the cap is {cap}",
                       "a payload file is never that big: the bundle is damaged or not ours; rebuild it")
        if total > MAX_TOTAL or count > MAX_MEMBERS:
            raise _bad(f"bundle {path.name} is too large: more than {MAX_TOTAL} bytes or {MAX_MEMBERS} members")
        yield name, m


def _stream(tar: tarfile.TarFile, m: tarfile.TarInfo, sink=None) -> str:
    h = hashlib.sha256()
    fobj = tar.extractfile(m)
    assert fobj is not None
    while chunk := fobj.read(CHUNK):
        h.update(chunk)
        if sink is not None:
            sink.write(chunk)
    return h.hexdigest()


def _prefix(names: list[str]) -> str:
    # Tolerate a single top-level directory around manifest.json (tar czf dir/ style).
    if MANIFEST in names:
        return ""
    tops = {n.split("/", 1)[0] for n in names}
    if len(tops) == 1 and f"{next(iter(tops))}/{MANIFEST}" in names:
        return next(iter(tops)) + "/"
    raise _bad("bundle has no manifest.json")


def read_bundle(path: Path) -> dict:
    """The normalized manifest (plus "_raw" bytes and per-file "size"), every file's sha256 checked
    against it while streaming; nothing is held in memory but the manifest."""
    digests: dict[str, tuple[str, int]] = {}
    raw_manifest: dict[str, bytes] = {}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for name, m in _members(tar, path):
                if name.endswith(MANIFEST):
                    fobj = tar.extractfile(m)
                    assert fobj is not None
                    raw_manifest[name] = fobj.read(MAX_MANIFEST + 1)
                digests[name] = (_stream(tar, m), m.size)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise _bad(f"cannot read bundle {path.name}: {exc}", "re-upload or rebuild it") from exc
    prefix = _prefix(list(digests))
    try:
        raw = raw_manifest[prefix + MANIFEST]
        man = normalize_manifest(json.loads(raw))
    except (KeyError, ValueError) as exc:
        raise _bad(f"bundle {path.name}: manifest.json unreadable ({exc})") from None
    missing = [f["path"] for f in man["files"] if prefix + FILES + f["path"] not in digests]
    if missing:
        raise _bad(f"bundle member files/{missing[0]} is missing")
    bad = [f["path"] for f in man["files"] if digests[prefix + FILES + f["path"]][0] != f["patched_sha256"]]
    if bad:
        raise _bad(f"bundle files do not match the manifest (tampered?): {', '.join(bad)}")
    for f in man["files"]:
        f["size"] = digests[prefix + FILES + f["path"]][1]
    man["_raw"], man["_prefix"] = raw, prefix
    return man


def extract(path: Path, man: dict, dest: Path) -> None:
    """Stream the manifest's files into dest/<rel>, each re-hashed as written (the staged archive
    was verified by read_bundle; this guards against it changing in between)."""
    want = {man["_prefix"] + FILES + f["path"]: f for f in man["files"]}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for name, m in _members(tar, path):
                f = want.pop(name, None)
                if f is None:
                    continue
                target = dest / f["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as sink:
                    got = _stream(tar, m, sink)
                    sink.flush()
                    os.fsync(sink.fileno())
                if got != f["patched_sha256"]:
                    raise _bad(f"bundle file {f['path']} changed while extracting (sha256 {got})", "push again")
    except (tarfile.TarError, EOFError) as exc:
        raise _bad(f"cannot read bundle {path.name}: {exc}", "re-upload or rebuild it") from exc
    if want:
        raise _bad(f"bundle file {sorted(want)[0]} vanished while extracting", "push again")

"""Agent ops for installing a payload bundle: stage, plan (dry run), install (stdlib only).

A bundle is `manifest.json` + `files/<site-packages-relative path>` in a .tar.gz. The agent
trusts nothing it is sent: it re-hashes the uploaded archive against the sha256 the
control side computed, then every file in it against the manifest, all before any change.
Release ids are content addressed (payload version + hash of the (path, patched sha256)
list), so rebuilding the same payload gives the same id and re-pushing it is a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tarfile
from pathlib import Path

from . import journal, lock, state
from .atomic import (
    AgentError,
    copy_file_atomic,
    free_bytes,
    fsync_dir,
    is_enospc,
    read_json,
    sha256_bytes,
    sha256_file,
    write_bytes_atomic,
    write_json_atomic,
)
from .layout import (
    BACKUP_RECORD,
    RELEASES,
    STAGING,
    find_base,
    release_dir,
    safe_name,
    safe_relpath,
    state_dir_of,
)

# Room kept free beyond the bytes we can count (json files, directory blocks).
SPACE_MARGIN = 64 * 1024
MAX_MEMBER = 64 * 1024 * 1024


# ---------------------------------------------------------------- manifest


def normalize_manifest(raw: object) -> dict:
    """The fields the agent needs from manifest.json (bundle.BundleManifest), validated.

    -> {"package", "version", "payload_version", "files": [{"path", "pristine_sha256", "patched_sha256"}]}
    New files carry pristine_sha256 None: "absent" is their pristine state.
    """
    if not isinstance(raw, dict):
        raise AgentError("bad_bundle", "manifest.json is not a JSON object", "rebuild the bundle")
    package, version = raw.get("base_package"), raw.get("base_version")
    payload_version = raw.get("payload_version")
    entries = []
    for f in raw.get("patched_files") or []:
        entries.append((f.get("path"), f.get("pristine_sha256"), f.get("sha256")))
    for f in raw.get("new_files") or []:
        entries.append((f.get("path"), None, f.get("sha256")))
    if not (isinstance(package, str) and isinstance(version, str) and isinstance(payload_version, str) and entries):
        raise AgentError("bad_bundle", "manifest.json lacks base_package/base_version, payload_version or files",
                         "rebuild the bundle with ddtree-ops build")
    files = []
    for path, pristine, patched in entries:
        rel = str(safe_relpath(str(path or "")))
        for what, h in (("sha256", patched), ("pristine_sha256", pristine)):
            if (h is not None or what == "sha256") and not (isinstance(h, str) and len(h) == 64):
                raise AgentError("bad_bundle", f"manifest entry {rel} has no valid {what}", "rebuild the bundle")
        files.append({"path": rel, "pristine_sha256": pristine, "patched_sha256": patched})
    files.sort(key=lambda f: f["path"])
    if len({f["path"] for f in files}) != len(files):
        raise AgentError("bad_bundle", "manifest lists a file twice", "rebuild the bundle")
    return {"package": package, "version": version, "payload_version": payload_version, "files": files}


def release_id(man: dict) -> str:
    h = hashlib.sha256()
    for f in man["files"]:
        h.update(f"{f['path']}\0{f['patched_sha256']}\n".encode())
    pv = "".join(c if c.isalnum() or c in "._-+" else "_" for c in man["payload_version"])
    return f"{pv}-{h.hexdigest()[:12]}"


def _member_prefix(names: list[str]) -> str:
    # Tolerate a single top-level directory around manifest.json (tar czf dir/ style).
    if "manifest.json" in names:
        return ""
    tops = {n.split("/", 1)[0] for n in names}
    if len(tops) == 1:
        top = tops.pop()
        if f"{top}/manifest.json" in names:
            return top + "/"
    raise AgentError("bad_bundle", "bundle has no manifest.json", "rebuild the bundle with ddtree-ops build")


def read_bundle(path: Path) -> tuple[dict, dict[str, bytes]]:
    """(normalized manifest, {rel: bytes}) with every file hash checked against the manifest."""
    try:
        with tarfile.open(path, "r:gz") as tar:
            members = {(m.name[2:] if m.name.startswith("./") else m.name): m for m in tar.getmembers()}
            prefix = _member_prefix(list(members))

            def read(name: str) -> bytes:
                m = members.get(prefix + name)
                if m is None or not m.isreg() or m.size > MAX_MEMBER:
                    raise AgentError("bad_bundle", f"bundle member {name} missing or not a regular file",
                                     "rebuild the bundle")
                fobj = tar.extractfile(m)
                assert fobj is not None
                return fobj.read()

            raw_manifest = read("manifest.json")
            man = normalize_manifest(json.loads(raw_manifest))
            blobs = {f["path"]: read("files/" + f["path"]) for f in man["files"]}
    except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
        if isinstance(exc, AgentError):
            raise
        raise AgentError("bad_bundle", f"cannot read bundle {path.name}: {exc}", "re-upload or rebuild it") from exc
    bad = [rel for rel, data in blobs.items()
           if sha256_bytes(data) != next(f["patched_sha256"] for f in man["files"] if f["path"] == rel)]
    if bad:
        raise AgentError("bad_bundle", f"bundle files do not match the manifest (tampered?): {', '.join(bad)}",
                         "rebuild the bundle; nothing was changed")
    man["_raw"] = raw_manifest
    return man, blobs


# ---------------------------------------------------------------- staging


def op_stage_begin(request: dict) -> dict:
    """Make room for an upload: refuse early (before sftp writes) when the disk cannot hold it."""
    sd = state_dir_of(request)
    name = safe_name(str(request.get("name", "")), "bundle name")
    size = int(request.get("size", 0))
    staging = sd / STAGING
    try:
        staging.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AgentError("state_dir", f"cannot create {staging}: {exc}", "check the state_dir in the inventory") from exc
    # Twice the bundle: the staged copy plus the copy kept under releases/.
    need = 2 * size + SPACE_MARGIN
    have = free_bytes(staging)
    if have < need:
        raise AgentError("no_space", f"state dir {sd} has {have} bytes free, the upload needs about {need}",
                         "free space on the state-dir filesystem; nothing was changed")
    # Leftovers from earlier runs would only eat space: staging holds one upload at a time.
    for old in staging.iterdir():
        if old.name != name:
            with contextlib.suppress(OSError):
                old.unlink()
    return {"path": str(staging / name), "free_bytes": have}


def _staged(sd: Path, request: dict) -> Path:
    name = safe_name(str(request.get("bundle", "")), "bundle name")
    path = sd / STAGING / name
    want = request.get("bundle_sha256")
    if not isinstance(want, str):
        raise AgentError("bad_request", "bundle_sha256 is required", "")
    got = sha256_file(path)
    if got is None:
        raise AgentError("not_staged", f"bundle {name} is not in {sd / STAGING}", "upload it first")
    if got != want:
        raise AgentError("bad_bundle", f"uploaded bundle sha256 {got} differs from the sent one {want}",
                         "the upload was damaged or the bundle changed; push again")
    return path


def op_stage_verify(request: dict) -> dict:
    sd = state_dir_of(request)
    src = request.get("import_from")
    if src:
        # sudo hosts: the login user uploaded to its tmp; move it into the root-owned staging dir.
        if not isinstance(src, str) or not src.startswith("/tmp/.ddtree-upload-") or "/" in src[5:]:
            raise AgentError("bad_request", f"import_from must be a /tmp/.ddtree-upload-* file, got {src!r}")
        name = safe_name(str(request.get("bundle", "")), "bundle name")
        try:
            copy_file_atomic(src, sd / STAGING / name, mode=0o640)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(src)
    man, _ = read_bundle(_staged(sd, request))
    return {"release": release_id(man), "payload_version": man["payload_version"],
            "base": {"package": man["package"], "version": man["version"]}, "files": len(man["files"])}


# ---------------------------------------------------------------- plan


def _stack_records(sd: Path, stack: list[str]) -> list[dict]:
    return [read_json(release_dir(sd, r) / BACKUP_RECORD, {}) or {} for r in stack]


def plan(sd: Path, man: dict, *, sys_path: list | None = None, adopt: bool = False) -> dict:
    """Per file: now / target hashes and the action; refusals as a list, nothing changed."""
    version, site = find_base(man["package"], sys_path)
    st = state.load(sd)
    rid = release_id(man)
    stack = list(st.get("stack") or [])
    records = _stack_records(sd, stack)
    # What our own current release put in each file counts as known, not foreign.
    ours: dict[str, str | None] = {}
    for rec in records:
        for rel, f in (rec.get("files") or {}).items():
            ours[rel] = f.get("after")
    refusals: list[dict] = []
    if version != man["version"]:
        refusals.append({"code": "wrong_version",
                         "message": f"{man['package']} here is {version}, the bundle is built for {man['version']}",
                         "hint": "rebuild the bundle for this version, or upgrade/downgrade the host"})
    if rid in stack[:-1]:
        refusals.append({"code": "below_current",
                         "message": f"release {rid} is installed below the current {stack[-1]}",
                         "hint": f"use: ddtree-ops rollback --to {rid}"})
    files = []
    for f in man["files"]:
        rel = f["path"]
        now = sha256_file(site / rel)
        if now == f["patched_sha256"]:
            action = "unchanged"
        elif now == f["pristine_sha256"] or (rel in ours and now == ours[rel]):
            action = "install"
        elif adopt:
            action = "adopt"
        else:
            action = "foreign"
            refusals.append({"code": "foreign", "path": rel,
                             "message": f"{rel} hashes to {now or 'absent'}, neither pristine "
                                        f"({f['pristine_sha256'] or 'absent'}) nor patched ({f['patched_sha256']})",
                             "hint": "someone changed it; inspect, or push --adopt to take it over (it is backed up)"})
        files.append({"path": rel, "now": now, "target": f["patched_sha256"], "action": action})
    # Files an earlier release of ours touched that this bundle no longer ships go back to
    # what they were before ddtree-ops touched them.
    bundle_paths = {f["path"] for f in man["files"]}
    for rel in sorted(set(ours) - bundle_paths):
        i = next(i for i, rec in enumerate(records) if rel in (rec.get("files") or {}))
        origin, first = stack[i], records[i]["files"][rel]
        now = sha256_file(site / rel)
        files.append({"path": rel, "now": now, "target": first.get("before"), "origin": origin,
                      "mode": first.get("mode"), "action": "unchanged" if now == first.get("before") else "revert"})
    changes = [f for f in files if f["action"] != "unchanged"]
    noop = not changes and st.get("current") == rid
    jr = journal.pending(sd)
    # An interrupted change is completed first by the real run; a dry run says so.
    interrupted = {"action": jr.get("action"), "release": jr.get("release"), "started": jr.get("started")} if jr else None
    return {"release": rid, "payload_version": man["payload_version"], "site_packages": str(site),
            "base_version": version, "current": st.get("current"), "files": files,
            "changes": len(changes), "noop": noop and not jr, "refusals": refusals, "interrupted": interrupted}


def op_plan(request: dict) -> dict:
    """Dry run: works from a manifest sent inline, so nothing needs uploading."""
    sd = state_dir_of(request)
    man = normalize_manifest(request.get("manifest"))
    return plan(sd, man, sys_path=request.get("sys_path"), adopt=bool(request.get("adopt")))


# ---------------------------------------------------------------- install


def _write_release_dir(sd: Path, rid: str, bundle: Path, man: dict, blobs: dict[str, bytes],
                       site: Path, pl: dict) -> dict:
    """Write releases/<id>/ (bundle, manifest, payload, backup, backup.json) in a temp dir, then rename."""
    final = release_dir(sd, rid)
    tmp = sd / RELEASES / f".{rid}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    copy_file_atomic(bundle, tmp / "bundle.tar.gz", mode=0o640)
    write_bytes_atomic(tmp / "manifest.json", man["_raw"])
    for rel, data in blobs.items():
        write_bytes_atomic(tmp / "payload" / rel, data)
    record: dict = {"release": rid, "files": {}}
    targets = {f["path"]: f["target"] for f in pl["files"]}
    for f in pl["files"]:
        rel = f["path"]
        src = site / rel
        before = sha256_file(src)
        mode = (os.stat(src).st_mode & 0o7777) if before is not None else 0o644
        if before is not None:
            copy_file_atomic(src, tmp / "backup" / rel)
            if sha256_file(tmp / "backup" / rel) != before:
                raise AgentError("backup_failed", f"backup of {rel} does not verify", "the file changed while copying")
        record["files"][rel] = {"before": before, "after": targets[rel], "mode": f.get("mode") or mode}
        if "origin" in f and f["target"] is not None:
            # A file this bundle dropped: its "new" bytes are the pre-ddtree bytes from the
            # release that first touched it.
            copy_file_atomic(release_dir(sd, f["origin"]) / "backup" / rel, tmp / "payload" / rel)
    write_json_atomic(tmp / BACKUP_RECORD, record)
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    return record


def _space_needed(bundle: Path, blobs: dict[str, bytes], site: Path, pl: dict) -> int:
    backup = sum((site / f["path"]).stat().st_size for f in pl["files"] if f["now"] is not None)
    return bundle.stat().st_size + sum(len(b) for b in blobs.values()) + backup + SPACE_MARGIN


def install(sd: Path, bundle: Path, *, operator: str, sys_path: list | None = None, adopt: bool = False,
            kill_after: int | None = None, skip_space_check: bool = False) -> dict:
    """Install a staged, hash-verified bundle; the caller holds the lock. Returns the result dict."""
    recovered = journal.recover(sd)
    man, blobs = read_bundle(bundle)
    pl = plan(sd, man, sys_path=sys_path, adopt=adopt)
    rid = pl["release"]
    if pl["refusals"]:
        first = pl["refusals"][0]
        state.audit_best_effort(sd, operator=operator, command="push", release=rid, result="refused",
                                reason=first["code"])
        raise AgentError(first["code"], "; ".join(r["message"] for r in pl["refusals"]), first["hint"],
                         refusals=pl["refusals"], plan=pl)
    if pl["noop"]:
        state.audit_best_effort(sd, operator=operator, command="push", release=rid, result="noop")
        return {"release": rid, "noop": True, "message": f"{rid} is already current; nothing to do",
                "files": pl["files"], "recovered": recovered}
    site = Path(pl["site_packages"])
    st = state.load(sd)
    stack = list(st.get("stack") or [])
    repairing = bool(stack) and stack[-1] == rid
    need = _space_needed(bundle, blobs, site, pl)
    have = free_bytes(sd)
    if have < need and not skip_space_check:
        raise AgentError("no_space", f"state dir {sd} has {have} bytes free; backups and release need about {need}",
                         "free space on the state-dir filesystem; nothing was changed")
    tmp = sd / RELEASES / f".{rid}.tmp"
    try:
        prior = read_json(release_dir(sd, rid) / BACKUP_RECORD) if repairing else None
        if isinstance(prior, dict) and isinstance(prior.get("files"), dict):
            # Repairing the current release (someone reverted some of its files): its backup still
            # holds the true "before", and a content-addressed id means the same patched bytes, so
            # the release dir is kept as is; only a damaged payload copy is rewritten.
            record = prior
            for rel, data in blobs.items():
                if sha256_file(release_dir(sd, rid) / "payload" / rel) != sha256_bytes(data):
                    write_bytes_atomic(release_dir(sd, rid) / "payload" / rel, data)
        else:
            record = _write_release_dir(sd, rid, bundle, man, blobs, site, pl)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_enospc(exc):
            raise AgentError("no_space", f"state dir {sd} filled up while writing backups ({exc})",
                             "free space on the state-dir filesystem; site-packages was not touched") from exc
        raise
    rdir = release_dir(sd, rid)
    steps = []
    for rel, f in sorted(record["files"].items()):
        steps.append({"rel": rel, "before": f["before"],
                      "before_src": str(rdir / "backup" / rel) if f["before"] is not None else None,
                      "after": f["after"], "after_src": str(rdir / "payload" / rel) if f["after"] is not None else None,
                      "mode": f.get("mode")})
    jr = {"op": "install", "action": "push", "release": rid, "operator": operator, "started": state.now_iso(),
          "steps": steps, "stack_before": stack, "stack_after": stack if repairing else stack + [rid]}
    try:
        changed = journal.run(sd, site, jr, kill_after=kill_after)
    except AgentError as exc:
        state.audit_best_effort(sd, operator=operator, command="push", release=rid, result="failed", reason=exc.code)
        raise
    with contextlib.suppress(OSError):
        (sd / "staging" / bundle.name).unlink()
    warn = state.audit_best_effort(sd, operator=operator, command="push", release=rid, result="installed",
                                   files_changed=len(changed))
    return {"release": rid, "noop": False, "previous": stack[-1] if stack else None,
            "message": f"installed {rid} ({len(changed)} files changed)", "files": pl["files"],
            "changed": changed, "recovered": recovered, "warnings": [warn] if warn else []}


def op_install(request: dict) -> dict:
    sd = state_dir_of(request)
    operator = str(request.get("operator", "?"))
    hook = request.get("test_kill_after_files")
    with lock.held(sd, request.get("lock_id"), who=operator, command="push",
                   wait_s=float(request.get("lock_wait_s", 0))):
        bundle = _staged(sd, request) if request.get("bundle") else None
        if bundle is None:
            raise AgentError("bad_request", "bundle (a staged bundle name) is required", "")
        return install(sd, bundle, operator=operator, sys_path=request.get("sys_path"),
                       adopt=bool(request.get("adopt")), kill_after=int(hook) if hook is not None else None,
                       skip_space_check=bool(request.get("test_skip_space_check")))

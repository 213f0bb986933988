"""Agent ops for installing a payload bundle: stage, plan (dry run), install (stdlib only).

The agent trusts nothing it is sent: it re-hashes the uploaded archive against the sha256 the
control side computed, then every file in it against the manifest (bundle.py), all before any
change. Before the first file changes, every file the bundle touches has a verified original in
the pristine store (pristine.py), and the release's own backup is taken.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

from . import backup, journal, lock, pristine, stale, state, statefs
from .atomic import (
    AgentError,
    copy_file_atomic,
    free_bytes,
    fsync_dir,
    is_enospc,
    sha256_file,
    write_bytes_atomic,
    write_json_atomic,
)
from .bundle import extract, normalize_manifest, read_bundle, release_id
from .layout import BACKUP_RECORD, RELEASES, STAGING, find_base, release_dir, safe_name

# Room kept free beyond the bytes we can count (json files, directory blocks).
SPACE_MARGIN = 64 * 1024


# ---------------------------------------------------------------- staging


def op_stage_begin(request: dict) -> dict:
    """Make room for an upload: refuse early (before sftp writes) when the disk cannot hold it."""
    sd = statefs.state_dir(request)
    name = safe_name(str(request.get("name", "")), "bundle name")
    size = int(request.get("size", 0))
    staging = sd / STAGING
    try:
        staging.mkdir(exist_ok=True)
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
    sd = statefs.state_dir(request)
    src = request.get("import_from")
    if src:
        # sudo hosts: the login user uploaded to its tmp; move it into the root-owned staging dir.
        if not isinstance(src, str) or not src.startswith("/tmp/.ddtree-upload-") or "/" in src[5:]:
            raise AgentError("bad_request", f"import_from must be a /tmp/.ddtree-upload-* file, got {src!r}")
        name = safe_name(str(request.get("bundle", "")), "bundle name")
        try:
            _import_upload(src, sd / STAGING / name)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(src)
    man = read_bundle(_staged(sd, request))
    return {"release": release_id(man), "payload_version": man["payload_version"],
            "base": {"package": man["package"], "version": man["version"]}, "files": len(man["files"])}


def _import_upload(src: str, dest: Path) -> None:
    """Copy the login user's upload into the root-owned staging dir. Opened without following links and
    checked to be a regular file of the user sudo came from (SUDO_UID), so no other file on the host can
    be passed off as the upload; the hash check that follows judges its bytes."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise AgentError("bad_upload", f"cannot open the upload {src}: {exc.strerror} (a link is refused)",
                         "push again; nothing was changed") from None
    st = os.fstat(fd)
    owner = os.environ.get("SUDO_UID")
    problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"belongs to uid {st.st_uid}, not to the login user (uid {owner})" if owner and str(st.st_uid) != owner
               else None)
    if problem:
        os.close(fd)
        raise AgentError("bad_upload", f"the upload {src} {problem}; refused", "push again; nothing was changed")
    copy_file_atomic(fd, dest, mode=0o640)  # closes fd


# ---------------------------------------------------------------- plan


def plan(sd: Path, man: dict, *, sys_path: list | None = None, adopt: bool = False) -> dict:
    """Per file: now / target hashes and the action; refusals as a list, nothing changed."""
    version, site = find_base(man["package"], sys_path)
    st = state.load(sd)
    rid = release_id(man)
    stack = list(st.get("stack") or [])
    records = [backup.read(sd, r) for r in stack]
    # What our own current release put in each file counts as known, not foreign.
    ours: dict[str, str | None] = {}
    for rec in records:
        for rel, f in (rec.get("files") or {}).items():
            ours[rel] = f.get("after")
    refusals: list[dict] = []
    old = stale.stale_releases(sd, version)
    if old:
        # SGLang changed under a release: its records describe another version's files (stale.py).
        d = stale.describe(version, old, man["package"])
        refusals.append({k: d[k] for k in ("code", "message", "hint", "installed_version", "release_bases")})
        ours = {}  # never "revert" a file to another version's bytes, not even in a dry run's plan
        stack, records = [], []
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
    sd = statefs.state_dir(request)
    man = normalize_manifest(request.get("manifest"))
    return plan(sd, man, sys_path=request.get("sys_path"), adopt=bool(request.get("adopt")))


# ---------------------------------------------------------------- install


def _write_release_dir(sd: Path, rid: str, bundle: Path, man: dict, site: Path, pl: dict) -> dict:
    """Write releases/<id>/ (bundle, manifest, payload, backup, backup.json) in a temp dir, then rename."""
    final = release_dir(sd, rid)
    tmp = sd / RELEASES / f".{rid}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    copy_file_atomic(bundle, tmp / "bundle.tar.gz", mode=0o640)
    write_bytes_atomic(tmp / "manifest.json", man["_raw"])
    extract(bundle, man, tmp / "payload")
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
            # A file this bundle dropped: its "new" bytes are the pre-ddtree bytes, from the pristine
            # store or the backup of the release that first touched it, whichever still verifies.
            src = next((p for p in (pristine.copy_path(sd, rel), release_dir(sd, f["origin"]) / "backup" / rel)
                        if sha256_file(p) == f["target"]), None)
            if src is None:
                raise pristine.lost(rel, f["target"], man["package"], man["version"])
            copy_file_atomic(src, tmp / "payload" / rel)
    write_json_atomic(tmp / BACKUP_RECORD, record)
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    return record


def _space_needed(bundle: Path, man: dict, site: Path, pl: dict) -> int:
    # The backups, plus (at most) as much again for the pristine copies of a first install.
    backups = sum((site / f["path"]).stat().st_size for f in pl["files"] if f["now"] is not None)
    return bundle.stat().st_size + sum(f["size"] for f in man["files"]) + 2 * backups + SPACE_MARGIN


def install(sd: Path, bundle: Path, *, operator: str, sys_path: list | None = None, adopt: bool = False,
            kill_after: int | None = None, skip_space_check: bool = False, signer: str | None = None) -> dict:
    """Install a staged, hash-verified bundle; the caller holds the lock. Returns the result dict."""
    man = read_bundle(bundle)
    # SGLang changed under a release: refused before even an interrupted change is finished (stale.py).
    stale.refuse_if_stale(sd, find_base(man["package"], sys_path)[0], man["package"])
    recovered = journal.recover(sd)
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
    if not (sd / state.STATE).exists():
        # A fresh host: from now on the state dir holds a release, so state.json must exist too.
        state.save(sd, st)
    stack = list(st.get("stack") or [])
    repairing = bool(stack) and stack[-1] == rid
    need = _space_needed(bundle, man, site, pl)
    have = free_bytes(sd)
    if have < need and not skip_space_check:
        raise AgentError("no_space", f"state dir {sd} has {have} bytes free; backups and release need about {need}",
                         "free space on the state-dir filesystem; nothing was changed")
    tmp = sd / RELEASES / f".{rid}.tmp"
    try:
        pristine.ensure(sd, site, man, adopt=adopt)
        if repairing:
            # Repairing the current release (someone reverted some of its files): its backup (plan
            # checked the record) still holds the true "before", and a content-addressed id means the
            # same patched bytes, so the release dir is kept; only damaged payload copies are rewritten.
            record = backup.read(sd, rid)
            payload = release_dir(sd, rid) / "payload"
            if any(sha256_file(payload / f["path"]) != f["patched_sha256"] for f in man["files"]):
                extract(bundle, man, payload)
        else:
            record = _write_release_dir(sd, rid, bundle, man, site, pl)
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
    signed = {"signer": signer} if signer else {}
    warn = state.audit_best_effort(sd, operator=operator, command="push", release=rid, result="installed",
                                   files_changed=len(changed), **signed)
    return {"release": rid, "noop": False, "previous": stack[-1] if stack else None,
            "message": f"installed {rid} ({len(changed)} files changed)", "files": pl["files"],
            "changed": changed, "recovered": recovered, "warnings": [warn] if warn else []}


def op_install(request: dict) -> dict:
    sd = statefs.state_dir(request)
    operator = str(request.get("operator", "?"))
    hook = request.get("test_kill_after_files")
    with lock.held(sd, request.get("lock_id"), who=operator, command="push",
                   wait_s=float(request.get("lock_wait_s", 0))):
        bundle = _staged(sd, request) if request.get("bundle") else None
        if bundle is None:
            raise AgentError("bad_request", "bundle (a staged bundle name) is required", "")
        return install(sd, bundle, operator=operator, sys_path=request.get("sys_path"),
                       adopt=bool(request.get("adopt")), kill_after=int(hook) if hook is not None else None,
                       skip_space_check=bool(request.get("test_skip_space_check")),
                       signer=str(request["signer"])[:300] if request.get("signer") else None)

"""Build and verify DDTree payload bundles.

A bundle is `ddtree-payload-<version>.tar.gz` holding
- `manifest.json`: base package and version, payload version, build time, and for every file the
  bundle installs its path relative to site-packages with sha256 digests (pristine and patched for
  patched upstream files, one digest for our new files);
- `files/<site-packages-relative path>`: the patched files and the new files, ready to copy.

Pristine upstream files come from a wheel file, an installed sglang (its site-packages), or the
package registry (`pip download`), and each is checked against the wheel's own RECORD digest
before a patch touches it. Patches are applied by a strict unified-diff applier in this module
(exact context, no fuzz, no offsets), so hosts and CI need no GNU patch.

Reproducible: the same payload and pristine files give the same manifest apart from
`build_time`, and, with a fixed build time (`build_time=` or SOURCE_DATE_EPOCH), the same bytes:
sorted members, fixed mtimes/owners/modes, gzip header mtime 0.
"""

from __future__ import annotations

import base64
import csv
import datetime as _dt
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ddtree_ops.errors import OpsError, UsageError
from ddtree_ops.signing import signature_path

PAYLOAD_DIR = Path(__file__).resolve().parent / "payload"
DEFAULT_WHEEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ddtree-ops" / "wheels"
MANIFEST_NAME = "manifest.json"
FILES_PREFIX = "files/"
MANIFEST_FORMAT = 1
# Fixed tar member mtime: 2000-01-01, because some extractors warn on mtime 0.
_TAR_MTIME = 946684800
# Caps on what a bundle may hold, checked from each member's header before its data is read, so a
# small archive that inflates to gigabytes is refused at once (the agent has the same caps).
MAX_MEMBER = 64 * 1024 * 1024  # the biggest sglang file is < 1 MiB
MAX_MANIFEST = 4 * 1024 * 1024
MAX_TOTAL = 256 * 1024 * 1024
MAX_MEMBERS = 4096
_CHUNK = 1 << 20


class BundleError(OpsError):
    """Building, verifying or installing a bundle failed; the message says which file and why."""

    code = "bundle"


class BundleInputError(BundleError, UsageError):
    """The file named on the command line is missing or not what it should be (exit code 2: nothing was done)."""

    code = "bundle_input"


class PatchError(BundleError):
    """A patch did not apply exactly (names patch file, hunk and target file)."""

    code = "patch_mismatch"


class PristineError(BundleError):
    """An upstream file is missing or does not match the wheel's RECORD digest."""

    code = "pristine_mismatch"


# ----------------------------------------------------------------------------------- models
class PatchedFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str  # relative to site-packages, POSIX separators
    patch: str  # patch file, relative to the payload directory
    pristine_sha256: str
    sha256: str
    size: int


class NewFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    sha256: str
    size: int


class BundleManifest(BaseModel):
    """What a bundle installs; `manifest.json` inside every bundle."""

    model_config = ConfigDict(extra="forbid")

    format: int = MANIFEST_FORMAT
    payload_name: str
    payload_version: str
    base_package: str
    base_version: str
    build_time: str  # ISO 8601 UTC; the only field that differs between two builds
    patched_files: list[PatchedFile] = Field(default_factory=list)
    new_files: list[NewFile] = Field(default_factory=list)

    @property
    def bundle_name(self) -> str:
        """`<name>-<version>.tar.gz` for the default base (as before bases were added); other bases carry
        theirs, `<name>-<version>-sglang<base>.tar.gz`, so one dist/ holds a bundle per base."""
        from ddtree_ops.bases import DEFAULT_BASE

        suffix = "" if self.base_version == DEFAULT_BASE else f"-{self.base_package}{self.base_version}"
        return f"{self.payload_name}-{self.payload_version}{suffix}.tar.gz"

    def all_paths(self) -> list[str]:
        return sorted([f.path for f in self.patched_files] + [f.path for f in self.new_files])

    def digest_view(self) -> dict:
        """The manifest without its build time: equal for two builds of the same source."""
        return self.model_dump(exclude={"build_time"})


class PatchSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file: str  # relative to the payload dir
    targets: list[str]  # site-packages-relative paths the patch touches (checked against it)


class PayloadDescriptor(BaseModel):
    """A base's payload descriptor: `payload/payload.json` (the default base) or
    `payload/bases/<version>/payload.json` (see bases.py)."""

    model_config = ConfigDict(extra="forbid")

    name: str = "ddtree-payload"
    version: str
    base_package: str
    base_version: str
    patches: list[PatchSpec]  # files relative to the descriptor's directory
    new_files: list[str]  # site-packages-relative; sources live at <descriptor dir>/<path> (this base's own)
    # site-packages-relative; sources live at <payload root>/<path>: the modules every base shares (one copy)
    shared: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class BuildResult:
    manifest: BundleManifest
    bundle_path: Path
    bundle_sha256: str
    source: str  # where the pristine files came from, for the operator


# ----------------------------------------------------------------------------------- helpers
def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _record_digest_to_hex(value: str) -> str:
    """RECORD stores `sha256=<urlsafe base64, no padding>`; return hex."""
    algo, _, b64 = value.partition("=")
    if algo != "sha256" or not b64:
        raise PristineError(f"unsupported RECORD digest {value!r} (expected sha256=...)")
    raw = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
    return raw.hex()


def parse_record(text: str) -> dict[str, str]:
    """RECORD csv → {path: sha256 hex} for rows that carry a digest."""
    out: dict[str, str] = {}
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2 and row[1]:
            out[row[0]] = _record_digest_to_hex(row[1])
    return out


def _safe_relpath(path: str, what: str) -> str:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts or path != str(p) or "\\" in path:
        raise BundleError(f"{what}: unsafe or non-normal path {path!r}")
    return str(p)


def _payload_path(path: str, package: str, what: str) -> str:
    """A path a payload may install: inside the base package's own tree, never the site-packages
    root (where a .pth file runs at every interpreter start) nor another package."""
    rel = _safe_relpath(path, what)
    if not rel.startswith(f"{package}/"):
        raise BundleError(f"{what}: {rel!r} is outside {package}/ (a payload only patches or adds files of {package})",
                          hint=f"put the file under {package}/ in the payload")
    return rel


def _dist_info_name(package: str, version: str) -> str:
    return f"{package.replace('-', '_')}-{version}.dist-info"


# ----------------------------------------------------------------------------------- pristine sources
class PristineSource:
    """Gives pristine upstream file bytes, each checked against the wheel's RECORD."""

    description: str = "pristine source"
    record: dict[str, str]

    def _read(self, path: str) -> bytes:  # pragma: no cover - interface
        raise NotImplementedError

    def has(self, path: str) -> bool:
        return path in self.record

    def read(self, path: str) -> bytes:
        path = _safe_relpath(path, "pristine file")
        expected = self.record.get(path)
        if expected is None:
            raise PristineError(f"{path} is not listed in the RECORD of {self.description}")
        try:
            data = self._read(path)
        except (FileNotFoundError, KeyError):
            raise PristineError(f"{path} is listed in RECORD but missing from {self.description}") from None
        got = sha256_hex(data)
        if got != expected:
            raise PristineError(
                f"{path} in {self.description} does not match the wheel's RECORD: sha256 {got}, "
                f"RECORD says {expected} (is this sglang install already patched or modified?)",
                hint="build from the pristine wheel (--wheel or --download)",
            )
        return data


class WheelSource(PristineSource):
    def __init__(self, wheel: str | os.PathLike[str], package: str, version: str) -> None:
        self.path = Path(wheel)
        if not self.path.is_file():
            raise BundleInputError(f"wheel not found: {self.path}" + (" (it is a directory)" if self.path.is_dir() else ""),
                                   hint="pass the sglang .whl file itself, or use --download", code="wheel_missing")
        self.description = f"wheel {self.path.name}"
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise BundleInputError(f"{self.path} is not a wheel: {exc}", code="wheel_invalid",
                                   hint=f"a wheel is a zip file such as sglang-{version}-py3-none-any.whl; "
                                        "or build with --download") from None
        record_name = f"{_dist_info_name(package, version)}/RECORD"
        try:
            record_text = self._zip.read(record_name).decode()
        except KeyError:
            raise PristineError(
                f"{self.path.name} has no {record_name}: not a {package} {version} wheel"
            ) from None
        self.record = parse_record(record_text)

    def _read(self, path: str) -> bytes:
        return self._zip.read(path)


class InstalledSource(PristineSource):
    """An installed tree (a site-packages directory holding `<pkg>-<ver>.dist-info/RECORD`)."""

    def __init__(self, site_dir: str | os.PathLike[str], package: str, version: str) -> None:
        self.site = Path(site_dir)
        record_path = self.site / _dist_info_name(package, version) / "RECORD"
        if not record_path.is_file():
            raise PristineError(f"no {package} {version} install in {self.site} ({record_path} missing)")
        self.description = f"installed {package} in {self.site}"
        self.record = parse_record(record_path.read_text())

    def _read(self, path: str) -> bytes:
        return (self.site / path).read_bytes()


def site_dir_of_python(python: str, package: str = "sglang") -> Path:
    """The site-packages dir holding `package` for interpreter `python` (does not import it)."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        f"d = m.distribution({package!r})\n"
        "print(json.dumps({'version': d.version, 'site': str(d.locate_file(''))}))\n"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except OSError as e:
        raise BundleError(f"cannot run {python}: {e}") from None
    if out.returncode != 0:
        raise BundleError(f"{python} has no {package} installed: {out.stderr.strip().splitlines()[-1:]}")
    return Path(json.loads(out.stdout.strip().splitlines()[-1])["site"])


def download_wheel(package: str, version: str, cache_dir: Path | None = None, python: str | None = None) -> Path:
    """`pip download <package>==<version> --no-deps` into a cache dir (reused when present)."""
    cache = Path(cache_dir) if cache_dir else DEFAULT_WHEEL_CACHE
    cache.mkdir(parents=True, exist_ok=True)
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(cache.glob(f"{stem}*.whl"))
    if found:
        return found[0]
    cmd = [python or sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "-d", str(cache), f"{package}=={version}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(cache.glob(f"{stem}*.whl"))
    if out.returncode != 0 or not found:
        raise BundleError(f"pip download {package}=={version} failed: {out.stderr.strip()[-800:]}")
    return found[0]


def default_wheel(package: str = "sglang", version: str = "0.5.13.post1") -> Path:
    """$DDTREE_SGLANG_WHEEL if set, else a cached or freshly downloaded wheel."""
    env = os.environ.get("DDTREE_SGLANG_WHEEL")
    if env:
        return Path(env)
    return download_wheel(package, version)


# ----------------------------------------------------------------------------------- unified diffs
_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class _Hunk:
    header: str
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[tuple[str, str]]  # (' '|'-'|'+', text without newline)
    old_eof_nonl: bool = False
    new_eof_nonl: bool = False


@dataclass
class FilePatch:
    patch_file: str
    old_path: str
    new_path: str
    hunks: list[_Hunk]

    @property
    def target(self) -> str:
        return self.new_path


def _strip_prefix(path: str) -> str:
    path = path.split("\t", 1)[0].strip()
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return path


def parse_unified_diff(text: str, patch_file: str) -> list[FilePatch]:
    """Parse a unified diff strictly; any line that is not part of a well-formed hunk is an error
    (except free text before the first `---` header of a file)."""
    lines = text.splitlines()
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("--- "):
            if patches and line.strip():
                raise PatchError(f"{patch_file}: unexpected line {i + 1} outside a hunk: {line!r}")
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"{patch_file}: line {i + 1}: '---' header without '+++'")
        fp = FilePatch(patch_file, _strip_prefix(line[4:]), _strip_prefix(lines[i + 1][4:]), [])
        if fp.old_path == "/dev/null" or fp.new_path == "/dev/null":
            raise PatchError(f"{patch_file}: creating or deleting files is done by new_files, not patches")
        try:
            _safe_relpath(fp.new_path, f"{patch_file} target")
        except BundleError as e:
            raise PatchError(str(e)) from None
        if fp.old_path != fp.new_path:
            raise PatchError(f"{patch_file}: renames are not supported ({fp.old_path} -> {fp.new_path})")
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK_RE.match(lines[i])
            if not m:
                raise PatchError(f"{patch_file}: line {i + 1}: malformed hunk header {lines[i]!r}")
            h = _Hunk(
                lines[i], int(m.group(1)), int(m.group(2) if m.group(2) is not None else 1),
                int(m.group(3)), int(m.group(4) if m.group(4) is not None else 1), [],
            )
            i += 1
            old_seen = new_seen = 0
            while i < len(lines) and (old_seen < h.old_len or new_seen < h.new_len):
                body = lines[i]
                tag, rest = (body[:1], body[1:]) if body else (" ", "")
                if tag not in " -+":
                    raise PatchError(
                        f"{patch_file}: hunk #{len(fp.hunks) + 1} ({h.header}) for {fp.target}: "
                        f"line {i + 1} {body!r} is not context/removal/addition (truncated hunk?)"
                    )
                h.lines.append((tag, rest))
                old_seen += tag in " -"
                new_seen += tag in " +"
                i += 1
                if i < len(lines) and lines[i].startswith("\\"):
                    if tag in " -":
                        h.old_eof_nonl = True
                    if tag in " +":
                        h.new_eof_nonl = True
                    i += 1
            if old_seen != h.old_len or new_seen != h.new_len:
                raise PatchError(
                    f"{patch_file}: hunk #{len(fp.hunks) + 1} ({h.header}) for {fp.target} is truncated: "
                    f"{old_seen}/{h.old_len} old and {new_seen}/{h.new_len} new lines"
                )
            fp.hunks.append(h)
        if not fp.hunks:
            raise PatchError(f"{patch_file}: no hunks for {fp.target}")
        patches.append(fp)
    if not patches:
        raise PatchError(f"{patch_file}: not a unified diff (no '---'/'+++' headers)")
    return patches


def apply_file_patch(original: bytes, fp: FilePatch) -> bytes:
    """Apply one file's hunks at exactly their stated line numbers with exact context."""
    try:
        text = original.decode("utf-8")
    except UnicodeDecodeError:
        raise PatchError(f"{fp.patch_file}: target {fp.target} is not UTF-8 text") from None
    src = text.splitlines(keepends=True)
    newline = "\r\n" if src and src[0].endswith("\r\n") else "\n"
    out: list[str] = []
    pos = 0  # index into src of the next line not yet copied
    for n, h in enumerate(fp.hunks, start=1):
        start = h.old_start - 1 if h.old_len > 0 else h.old_start  # a pure insertion is after old_start
        if start < pos:
            raise PatchError(f"{fp.patch_file}: hunk #{n} ({h.header}) for {fp.target} overlaps the previous hunk")
        out.extend(src[pos:start])
        cur = start
        for tag, body in h.lines:
            if tag in " -":
                if cur >= len(src):
                    raise PatchError(
                        f"{fp.patch_file}: hunk #{n} ({h.header}) does not apply to {fp.target}: "
                        f"expected {body!r} at line {cur + 1}, but the file has {len(src)} lines"
                    )
                have = src[cur].rstrip("\r\n")
                if have != body:
                    raise PatchError(
                        f"{fp.patch_file}: hunk #{n} ({h.header}) does not apply to {fp.target}: "
                        f"line {cur + 1} is {have!r}, the patch expects {body!r}",
                        hint="the patch was made against another version of the file; regenerate it "
                        "against the pristine sglang wheel",
                    )
                if tag == " ":
                    out.append(src[cur])
                cur += 1
            else:
                out.append(body + newline)
        if h.new_eof_nonl and out and out[-1].endswith(newline):
            out[-1] = out[-1][: -len(newline)]
        pos = cur
    out.extend(src[pos:])
    return "".join(out).encode("utf-8")


# ----------------------------------------------------------------------------------- payload
def load_payload(source: str | os.PathLike[str] | None = None, base: str | None = None) -> tuple[Path, PayloadDescriptor]:
    """(descriptor directory, descriptor) of one base's payload. `source` is the payload root (None: the one
    shipped in this package); `base` a version from bases.py (None: the root's own payload.json, the default
    base's). A base without a descriptor yet, or an unknown one, is refused naming the known bases."""
    root = Path(source) if source is not None else PAYLOAD_DIR
    if base is None:
        desc_path = root / "payload.json"
    else:
        from ddtree_ops.bases import base_with_payload

        desc_path = base_with_payload(base, root).descriptor_path(root)
    if not desc_path.is_file():
        raise BundleError(f"no payload descriptor at {desc_path}")
    desc_dir = desc_path.parent
    try:
        desc = PayloadDescriptor.model_validate_json(desc_path.read_text())
    except ValueError as e:
        raise BundleError(f"{desc_path}: invalid payload descriptor: {e}") from None
    if base is not None and desc.base_version != base:
        raise BundleError(f"{desc_path} is for {desc.base_package} {desc.base_version}, not {base}",
                          hint="fix base_version in the descriptor or its place in bases.py")
    listed = set()
    for rel in desc.new_files:
        _payload_path(rel, desc.base_package, "payload.json new_files")
        if not (desc_dir / rel).is_file():
            raise BundleError(f"payload.json lists new file {rel}, but {desc_dir / rel} does not exist")
        listed.add(rel)
    for rel in desc.shared:
        _payload_path(rel, desc.base_package, "payload.json shared")
        if rel in listed:
            raise BundleError(f"{desc_path}: {rel} is listed both in new_files and in shared")
        if desc_dir != root and (desc_dir / rel).exists():
            raise BundleError(f"{desc_path}: shared file {rel} also has a copy at {desc_dir / rel}",
                              hint="a shared module exists once, in the payload root; delete the copy")
        if not (root / rel).is_file():
            raise BundleError(f"payload.json lists shared file {rel}, but {root / rel} does not exist")
    # Every module under the descriptor's own package tree must be listed: an unlisted file would be
    # silently left off the hosts.
    pkg_root = desc_dir / desc.base_package
    if pkg_root.is_dir():
        on_disk = {
            p.relative_to(desc_dir).as_posix()
            for p in pkg_root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
        }
        shipped = listed | (set(desc.shared) | _shared_by_other_bases(root) if desc_dir == root else set())
        unlisted = sorted(on_disk - shipped)
        if unlisted:
            raise BundleError(
                f"payload files not listed in {desc_path.name} new_files: {', '.join(unlisted)}",
                hint="add them to new_files (or delete them)",
            )
    for spec in desc.patches:
        _safe_relpath(spec.file, "payload.json patches")
        for target in spec.targets:
            _payload_path(target, desc.base_package, f"payload.json targets of {spec.file}")
        if not (desc_dir / spec.file).is_file():
            raise BundleError(f"payload.json lists patch {spec.file}, but {desc_dir / spec.file} does not exist")
    return desc_dir, desc


def _shared_by_other_bases(root: Path) -> set[str]:
    """Shared modules the v2 bases list (e.g. their server-args glue): they live in the root's tree, once, without
    being the root base's own. An unreadable descriptor adds nothing here; building that base says what is wrong."""
    from ddtree_ops.bases import BASES

    out: set[str] = set()
    for b in BASES:
        path = b.descriptor_path(root)
        if path.parent == root or not path.is_file():
            continue
        try:
            out.update(PayloadDescriptor.model_validate_json(path.read_text()).shared)
        except ValueError:
            continue
    return out


def payload_sources(source: str | os.PathLike[str] | None = None, base: str | None = None) -> dict[str, Path]:
    """{site-packages path: the file in the payload} of every file a base's payload adds (its own and the shared)."""
    root = Path(source) if source is not None else PAYLOAD_DIR
    desc_dir, desc = load_payload(source, base)
    out = {rel: desc_dir / rel for rel in desc.new_files}
    out.update({rel: root / rel for rel in desc.shared})
    return out


def _build_time(build_time: str | _dt.datetime | None) -> str:
    if isinstance(build_time, _dt.datetime):
        return build_time.astimezone(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(build_time, str):
        return build_time
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = _dt.datetime.fromtimestamp(int(epoch), _dt.UTC) if epoch else _dt.datetime.now(_dt.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def make_pristine_source(
    *,
    wheel: str | os.PathLike[str] | None = None,
    python: str | None = None,
    site_dir: str | os.PathLike[str] | None = None,
    download: bool = False,
    package: str = "sglang",
    version: str = "0.5.13.post1",
    cache_dir: str | os.PathLike[str] | None = None,
) -> PristineSource:
    """Exactly one of wheel / python / site_dir / download."""
    chosen = [k for k, v in (("wheel", wheel), ("python", python), ("site_dir", site_dir), ("download", download)) if v]
    if len(chosen) != 1:
        raise BundleError(
            f"choose exactly one pristine source (wheel, python, site_dir or download); got {chosen or 'none'}"
        )
    if wheel:
        return WheelSource(wheel, package, version)
    if python:
        return InstalledSource(site_dir_of_python(python, package), package, version)
    if site_dir:
        return InstalledSource(site_dir, package, version)
    return WheelSource(download_wheel(package, version, Path(cache_dir) if cache_dir else None), package, version)


def build_files(
    pristine: PristineSource, source: str | os.PathLike[str] | None = None, base: str | None = None
) -> tuple[PayloadDescriptor, list[tuple[PatchedFile, bytes]], list[tuple[NewFile, bytes]]]:
    """Apply the payload to the pristine files in memory (no I/O besides reading)."""
    root, desc = load_payload(source, base)
    sources = payload_sources(source, base)
    patched: dict[str, tuple[str, bytes, bytes]] = {}  # path -> (patch file, pristine, current)
    for spec in desc.patches:
        text = (root / spec.file).read_text(encoding="utf-8")
        file_patches = parse_unified_diff(text, spec.file)
        targets = sorted({fp.target for fp in file_patches})
        if targets != sorted(spec.targets):
            raise PatchError(
                f"{spec.file}: touches {', '.join(targets)} but payload.json says {', '.join(sorted(spec.targets))}"
            )
        for fp in file_patches:
            if fp.target in patched:
                raise PatchError(f"{spec.file}: {fp.target} is already patched by {patched[fp.target][0]}")
            pristine_bytes = pristine.read(fp.target)
            patched[fp.target] = (spec.file, pristine_bytes, apply_file_patch(pristine_bytes, fp))
    patched_out = [
        (PatchedFile(path=p, patch=pf, pristine_sha256=sha256_hex(a), sha256=sha256_hex(b), size=len(b)), b)
        for p, (pf, a, b) in sorted(patched.items())
    ]
    new_out = []
    for rel in sorted(sources):
        if pristine.has(rel):
            raise BundleError(f"new file {rel} collides with an upstream file of {pristine.description}")
        data = sources[rel].read_bytes()
        new_out.append((NewFile(path=rel, sha256=sha256_hex(data), size=len(data)), data))
    return desc, patched_out, new_out


def _tar_bytes(members: Iterable[tuple[str, bytes]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(members):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = _TAR_MTIME
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    gz = io.BytesIO()
    # mtime=0 and no file name in the gzip header: byte-identical output for identical input.
    with gzip.GzipFile(filename="", mode="wb", fileobj=gz, mtime=0, compresslevel=9) as f:
        f.write(raw.getvalue())
    return gz.getvalue()


def build_bundle(
    source: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
    *,
    wheel: str | os.PathLike[str] | None = None,
    python: str | None = None,
    site_dir: str | os.PathLike[str] | None = None,
    download: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    build_time: str | _dt.datetime | None = None,
    base: str | None = None,
) -> BuildResult:
    """Build `out_dir/ddtree-payload-<version>.tar.gz` from the payload at `source`
    (None: the payload shipped in this package) and pristine files from exactly one of
    wheel / python / site_dir / download. Returns the manifest, the bundle path, its sha256 and
    where the pristine files came from; `base` picks a base's payload (bases.py; None: the default
    descriptor). The manifest is also written beside the bundle as `<bundle>.manifest.json` for humans
    and CI artifacts."""
    _, desc = load_payload(source, base)
    pristine = make_pristine_source(
        wheel=wheel, python=python, site_dir=site_dir, download=download,
        package=desc.base_package, version=desc.base_version, cache_dir=cache_dir,
    )
    desc, patched, new = build_files(pristine, source, base)
    manifest = BundleManifest(
        payload_name=desc.name,
        payload_version=desc.version,
        base_package=desc.base_package,
        base_version=desc.base_version,
        build_time=_build_time(build_time),
        patched_files=[m for m, _ in patched],
        new_files=[m for m, _ in new],
    )
    manifest_bytes = (json.dumps(manifest.model_dump(), indent=2, sort_keys=True) + "\n").encode()
    members = [(MANIFEST_NAME, manifest_bytes)]
    members += [(FILES_PREFIX + m.path, data) for m, data in patched]
    members += [(FILES_PREFIX + m.path, data) for m, data in new]
    blob = _tar_bytes(members)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bundle_path = out / manifest.bundle_name
    tmp = bundle_path.with_name(bundle_path.name + ".tmp")
    try:
        tmp.write_bytes(blob)
        # A signature of the bundle this one replaces would be reported as "does not match"; gone, this one
        # reads as what it is: unsigned until signed (signing.sign_bundle).
        signature_path(bundle_path).unlink(missing_ok=True)
        os.replace(tmp, bundle_path)  # never leave a half-written bundle under the final name
    finally:
        tmp.unlink(missing_ok=True)
    (out / (manifest.bundle_name + ".manifest.json")).write_bytes(manifest_bytes)
    return BuildResult(manifest, bundle_path, sha256_hex(blob), pristine.description)


# ----------------------------------------------------------------------------------- verify / install
def _read_member(tar: tarfile.TarFile, m: tarfile.TarInfo, keep: bool) -> tuple[str, bytes | None]:
    """(sha256, the bytes when keep), streamed in chunks."""
    h = hashlib.sha256()
    parts: list[bytes] = []
    f = tar.extractfile(m)
    while f is not None and (chunk := f.read(_CHUNK)):
        h.update(chunk)
        if keep:
            parts.append(chunk)
    return h.hexdigest(), b"".join(parts) if keep else None


def _scan_bundle(p: Path, keep: bool) -> tuple[bytes, dict[str, str], dict[str, bytes]]:
    """(manifest bytes, {rel: sha256}, {rel: bytes} when keep), refusing links, unsafe names and
    members over the caps as their headers stream by."""
    if p.is_dir():
        raise BundleInputError(f"{p} is a directory, not a bundle", code="bundle_missing",
                               hint=f"name the .tar.gz itself, e.g. {p / 'ddtree-payload-VERSION.tar.gz'}")
    if not p.is_file():
        raise BundleInputError(f"bundle not found: {p}", code="bundle_missing",
                               hint="check the path, or run `ddtree-ops build` first")
    manifest_bytes: bytes | None = None
    digests: dict[str, str] = {}
    files: dict[str, bytes] = {}
    total = 0
    try:
        with tarfile.open(p, mode="r:gz") as tar:
            for count, m in enumerate(tar, 1):
                if m.isdir():
                    continue
                if not m.isfile():
                    raise BundleError(f"{p.name}: member {m.name!r} is not a regular file (links are refused)")
                name = _safe_relpath(m.name, f"{p.name} member")
                cap = MAX_MANIFEST if name == MANIFEST_NAME else MAX_MEMBER
                total += m.size
                if m.size > cap:
                    raise BundleError(f"{p.name}: member {name} is too large ({m.size} bytes; the cap is {cap})",
                                      hint="a payload file is never that big: the bundle is damaged or not ours; rebuild it",
                                      code="bundle_too_large")
                if total > MAX_TOTAL or count > MAX_MEMBERS:
                    raise BundleError(f"{p.name}: too large (over {MAX_TOTAL} bytes or {MAX_MEMBERS} members)",
                                      code="bundle_too_large")
                if name == MANIFEST_NAME:
                    manifest_bytes = _read_member(tar, m, True)[1]
                elif name.startswith(FILES_PREFIX):
                    rel = name[len(FILES_PREFIX):]
                    if rel in digests:
                        raise BundleError(f"{p.name}: duplicate member {name}")
                    digests[rel], data = _read_member(tar, m, keep)
                    if data is not None:
                        files[rel] = data
                else:
                    raise BundleError(f"{p.name}: unexpected member {name!r}")
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise BundleError(f"{p.name}: not a readable .tar.gz bundle: {e}") from None
    if manifest_bytes is None:
        raise BundleError(f"{p.name}: no {MANIFEST_NAME}")
    return manifest_bytes, digests, files


def _checked_bundle(path: str | os.PathLike[str], keep: bool) -> tuple[BundleManifest, dict[str, bytes]]:
    p = Path(path)
    manifest_bytes, digests, files = _scan_bundle(p, keep)
    try:
        manifest = BundleManifest.model_validate_json(manifest_bytes)
    except ValueError as e:
        raise BundleError(f"{p.name}: invalid {MANIFEST_NAME}: {e}") from None
    if manifest.format != MANIFEST_FORMAT:
        raise BundleError(f"{p.name}: manifest format {manifest.format}, this ddtree-ops reads {MANIFEST_FORMAT}")
    expected = {f.path: f.sha256 for f in manifest.patched_files}
    for f in manifest.new_files:
        if f.path in expected:
            raise BundleError(f"{p.name}: {f.path} is listed twice in the manifest")
        expected[f.path] = f.sha256
    for rel, digest in sorted(expected.items()):
        _payload_path(rel, manifest.base_package, f"{p.name} manifest path")
        if rel not in digests:
            raise BundleError(f"{p.name}: manifest lists {rel}, but files/{rel} is missing")
        if digests[rel] != digest:
            raise BundleError(
                f"{p.name}: files/{rel} has sha256 {digests[rel]}, the manifest says {digest} (tampered or corrupt)",
                code="bundle_tampered",
            )
    extra = sorted(set(digests) - set(expected))
    if extra:
        raise BundleError(f"{p.name}: files not in the manifest: {', '.join(extra)}", code="bundle_tampered")
    return manifest, files


def read_bundle(path: str | os.PathLike[str]) -> tuple[BundleManifest, dict[str, bytes]]:
    """Open and fully verify a bundle; returns its manifest and {site-packages path: bytes}."""
    return _checked_bundle(path, keep=True)


def verify_bundle(path: str | os.PathLike[str]) -> BundleManifest:
    """Re-check a bundle: readable, only regular files with safe paths inside the base package, every
    member under the size caps, every file's sha256 equal to the manifest, nothing extra. Streams:
    nothing but the manifest is held in memory. Raises BundleError naming the first problem."""
    return _checked_bundle(path, keep=False)[0]


def install_bundle(
    bundle: str | os.PathLike[str], site_dir: str | os.PathLike[str], *, check_pristine: bool = True
) -> BundleManifest:
    """Copy a verified bundle into a site-packages tree (for tests, the lab and the GPU proof;
    hosts use the agent's transactional install). Each patched file must currently be pristine
    (or already equal to the patched bytes, so a second install is a no-op)."""
    manifest, files = read_bundle(bundle)
    site = Path(site_dir)
    plan: list[tuple[Path, bytes]] = []
    for f in manifest.patched_files:
        dest = site / f.path
        if not dest.is_file():
            raise PristineError(f"{dest} does not exist: is {manifest.base_package} installed in {site}?")
        cur = sha256_hex(dest.read_bytes())
        if cur == f.sha256:
            continue
        if check_pristine and cur != f.pristine_sha256:
            raise PristineError(
                f"{dest} is neither pristine {manifest.base_package} {manifest.base_version} nor this "
                f"bundle's version (sha256 {cur}); refusing to overwrite it"
            )
        plan.append((dest, files[f.path]))
    for f in manifest.new_files:
        plan.append((site / f.path, files[f.path]))
    for dest, data in plan:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".ddtree-tmp")
        tmp.write_bytes(data)
        if dest.exists():
            shutil.copymode(dest, tmp)
        os.replace(tmp, dest)
    return manifest


def check_tree_against_record(
    site_dir: str | os.PathLike[str],
    package: str = "sglang",
    version: str = "0.5.13.post1",
    *,
    ignore: Iterable[str] = (),
) -> list[str]:
    """Paths listed in the dist-info RECORD whose bytes differ from RECORD (or are missing),
    skipping `ignore` (e.g. the files a bundle patched on purpose)."""
    src = InstalledSource(site_dir, package, version)
    skip = set(ignore)
    bad = []
    for rel, digest in sorted(src.record.items()):
        if rel in skip:
            continue
        try:
            data = (Path(site_dir) / rel).read_bytes()
        except FileNotFoundError:
            bad.append(f"{rel}: missing")
            continue
        if sha256_hex(data) != digest:
            bad.append(f"{rel}: sha256 differs from RECORD")
    return bad


BundleSourceKind = Literal["wheel", "python", "site_dir", "download"]

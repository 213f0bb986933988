"""Crash-safe file primitives for the host agent (stdlib only).

Every write that must survive a power cut or SIGKILL goes through here: a temp file in
the *same* directory (so the final rename never crosses a filesystem), fsync of the data,
rename over the target, fsync of the directory (so the rename itself is durable).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from . import errors

CHUNK = 1 << 20


class AgentError(errors.AgentError):
    """errors.AgentError plus structured detail (e.g. the per-file refusals) in the answer."""

    def __init__(self, code: str, message: str, hint: str | None = None, **extra: object) -> None:
        super().__init__(code, message, hint)
        self.extra = extra

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.update(self.extra)
        return out


def is_enospc(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def sha256_file(path: str | os.PathLike[str]) -> str | None:
    """sha256 hex of a file, or None when it does not exist (absent is a state, not an error)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    except FileNotFoundError:
        return None
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _temp_beside(target: Path) -> Iterator[tuple[int, str]]:
    """A temp file next to target; removed again unless the caller renamed it away."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".ddtree-tmp", dir=target.parent)
    try:
        yield fd, tmp
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_bytes_atomic(target: str | os.PathLike[str], data: bytes, mode: int | None = None) -> None:
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _temp_beside(target) as (fd, tmp):
        with os.fdopen(os.dup(fd), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    fsync_dir(target.parent)


def copy_file_atomic(src: str | os.PathLike[str] | int, target: str | os.PathLike[str], mode: int | None = None) -> None:
    """Copy src (a path, or an open file descriptor, which is closed) over target atomically; keeps src's
    permission bits unless mode is given."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _temp_beside(target) as (fd, tmp):
        with open(src, "rb") as s, os.fdopen(os.dup(fd), "wb") as f:
            shutil.copyfileobj(s, f, CHUNK)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode if mode is not None else (os.stat(src).st_mode & 0o7777))
        os.replace(tmp, target)
    fsync_dir(target.parent)


def write_json_atomic(target: str | os.PathLike[str], obj: object) -> None:
    write_bytes_atomic(target, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def remove_durably(path: str | os.PathLike[str]) -> bool:
    """Unlink a file and fsync its directory; False when it was already gone."""
    path = Path(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


def free_bytes(path: str | os.PathLike[str]) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize

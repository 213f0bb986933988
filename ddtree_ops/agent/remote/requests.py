"""Typed access to request arguments: a bad argument is the caller's bug, reported as bad_request."""

from __future__ import annotations

import posixpath

from .errors import AgentError


def get_str(args: dict, key: str, default: str | None = None, *, required: bool = False) -> str | None:
    value = args.get(key, default)
    if value is None:
        if required:
            raise AgentError("bad_request", f"missing argument `{key}`")
        return None
    if not isinstance(value, str):
        raise AgentError("bad_request", f"argument `{key}` must be a string, got {type(value).__name__}")
    return value


def get_str_list(args: dict, key: str) -> list:
    value = args.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AgentError("bad_request", f"argument `{key}` must be a list of strings")
    return value


def get_abs_path(args: dict, key: str, default: str | None = None) -> str | None:
    value = get_str(args, key, default)
    if value is not None and not value.startswith("/"):
        raise AgentError("bad_request", f"argument `{key}` must be an absolute path, got {value!r}")
    return value


def relative_inside(rel: str) -> str:
    """A relative path that cannot escape the directory it is joined to."""
    norm = posixpath.normpath(rel)
    if rel.startswith("/") or norm == ".." or norm.startswith("../") or "\x00" in rel:
        raise AgentError("bad_request", f"path {rel!r} must be relative and stay inside its directory")
    return norm

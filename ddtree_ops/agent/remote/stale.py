"""Releases made for another SGLang than the one installed now (stdlib only).

A release is built for one SGLang version (its manifest's `version`, the base). If SGLang is upgraded
or downgraded under an installed release (pip install sglang==0.5.23 over 0.5.13.post1), everything
the state dir holds for it is about the old version: the backups and the pristine copies are the old
version's files, and the after-hashes are the old payload's. Acting on them would write old-version
files into the new install (a push "reverting" files its predecessor touched, a rollback restoring
backups, `--to pristine` restoring pristine copies). So every release op refuses such a host, naming
the installed version and the releases' bases, and `rollback --forget-stale` (forget.py) is the repair
once SGLang's own files are the installed wheel's again.

A kept release counts even off the stack: the pristine store is rebuilt from every kept manifest.
"""

from __future__ import annotations

from pathlib import Path

from .atomic import AgentError
from .pristine import _manifest, kept_releases

FORGET = "ddtree-ops rollback --forget-stale --limit HOST"


def stale_releases(sd: Path, version: str | None) -> dict[str, str]:
    """{release id: its base} for every kept release whose manifest names another base than `version`.
    A release whose manifest cannot be read is left to the damage checks that already guard it."""
    out: dict[str, str] = {}
    for rdir in kept_releases(sd):
        man = _manifest(rdir)
        if man is not None and man.get("version") != version:
            out[rdir.name] = str(man.get("version"))
    return out


def describe(version: str | None, stale: dict[str, str], package: str = "sglang") -> dict:
    """The refusal's message and hint (and what facts reports for `status`)."""
    bases = sorted(set(stale.values()))
    releases = ", ".join(f"{rid} (for {base})" for rid, base in sorted(stale.items()))
    message = (f"{package} here is {version}, but the ddtree-ops release state is for {package} {', '.join(bases)}: "
               f"{releases}. {package} was changed under the release, so its backups and pristine copies are "
               f"{', '.join(bases)} files; pushing or rolling back would write them into {version}. Refused, "
               "nothing was changed")
    hint = (f"the release is stale: reinstall {package}'s own files (pip install --force-reinstall --no-deps "
            f"{package}=={version}), then `{FORGET}` (it checks every file is the wheel's, removes the DDTree "
            "modules the old release added, and sets the old release state aside), then push a bundle built for "
            f"{version}")
    return {"code": "stale_base", "message": message, "hint": hint, "installed_version": version,
            "release_bases": stale}


def installed_version(package: str, sys_path: list | None) -> str | None:
    """The installed version, None when the package is not installed (the op's own lookup then says so)."""
    from .layout import find_base

    try:
        return find_base(package, sys_path)[0]
    except AgentError as exc:
        if exc.code != "base_missing":
            raise
        return None


def refuse_if_stale(sd: Path, version: str | None, package: str = "sglang") -> None:
    if version is None:  # not installed: nothing can be restored into it either; the op's lookup refuses
        return
    stale = stale_releases(sd, version)
    if stale:
        d = describe(version, stale, package)
        raise AgentError(d["code"], d["message"], d["hint"], installed_version=version, release_bases=stale)


def op_stale_check(request: dict) -> dict:
    """Refuse (stale_base) a host whose kept releases were made for another SGLang than the installed one;
    rollback asks this before it touches the unit, so a stale host is refused with nothing changed."""
    from . import statefs

    sd = statefs.state_dir(request, create=False)
    package = str(request.get("package") or "sglang")
    version = installed_version(package, request.get("sys_path"))
    refuse_if_stale(sd, version, package)
    return {"installed_version": version, "stale": False}

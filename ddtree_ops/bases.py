"""The SGLang versions ("bases") this tool knows, and where each one's payload descriptor lives.

A payload is built for exactly one base: its patches are made against that version's pristine files.
What every base shares — the DDTree algorithm modules (`payload/sglang/srt/speculative/ddtree_*.py`) —
exists once, in the payload root's shared tree; a base's descriptor lists which of them it ships
(`shared`) and adds its own glue and patches from its own directory:

    payload/
      payload.json                   0.5.13.post1 (v1 worker): patches/ and the shared tree, as before
      patches/*.patch                0.5.13.post1's patches
      sglang/srt/speculative/        the shared modules, one copy each: the algorithm, 0.5.13.post1's v1 glue
                                     (ddtree_worker.py) and the v2 bases' server-args glue (ddtree_v2_args.py)
      bases/<version>/payload.json   a v2 base: `shared` (paths in the tree above), `new_files` (glue of its own,
      bases/<version>/patches/       under bases/<version>/, if any) and its patches

A payload root without a base's descriptor (e.g. an older `--payload` tree) has no payload for it: `build` and
`push` say so, naming the descriptor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ddtree_ops.errors import UsageError

Worker = Literal["v1", "v2"]


class UnknownBaseError(UsageError):
    """A base version the registry does not know (exit code 2: nothing was done)."""

    code = "unknown_base"


class NoPayloadError(UsageError):
    """A known base whose payload descriptor is not written yet."""

    code = "no_payload_for_base"


@dataclass(frozen=True)
class PayloadBase:
    """One SGLang version a payload can be built for."""

    version: str
    worker: Worker  # v1: `dflash_worker.py` (≤ 0.5.13.post1); v2: `DFlashWorkerV2` (0.5.14 on)
    descriptor: str  # the payload descriptor, relative to the payload root

    def descriptor_path(self, root: Path) -> Path:
        return root / self.descriptor

    @property
    def pending(self) -> str:
        """Why a payload root has no payload for this base (said when the descriptor does not exist)."""
        return f"its descriptor {self.descriptor} is missing from this payload"

    def has_payload(self, root: Path) -> bool:
        return self.descriptor_path(root).is_file()

    def describe(self, root: Path) -> str:
        """One line for the operator: version, worker generation, and whether a payload exists."""
        state = "payload" if self.has_payload(root) else f"no payload yet: {self.pending}"
        return f"{self.version} ({self.worker} worker; {state})"


DEFAULT_BASE = "0.5.13.post1"

BASES: tuple[PayloadBase, ...] = (
    PayloadBase("0.5.13.post1", "v1", "payload.json"),
    # The v2 bases carry the DDTree fields and their validation, and a tree step: served on 0.5.17 (GPU-proven),
    # refused to operators on 0.5.23 (CPU-proven only; payload ddtree_v2_args.PROVEN_TREE_BASES).
    PayloadBase("0.5.17", "v2", "bases/0.5.17/payload.json"),
    PayloadBase("0.5.23", "v2", "bases/0.5.23/payload.json"),
)


def known_versions() -> list[str]:
    return [b.version for b in BASES]


def find_base(version: str | None) -> PayloadBase | None:
    """The registered base for an installed SGLang version, or None (unknown or not installed)."""
    return next((b for b in BASES if b.version == version), None)


def get_base(version: str) -> PayloadBase:
    base = find_base(version)
    if base is None:
        raise UnknownBaseError(f"SGLang {version} is not a base this ddtree-ops knows",
                               hint=f"known bases: {', '.join(known_versions())}")
    return base


def base_with_payload(version: str, root: Path) -> PayloadBase:
    """The base, refusing one that is known but has no payload yet (the message says why)."""
    base = get_base(version)
    if not base.has_payload(root):
        built = [b.version for b in BASES if b.has_payload(root)]
        raise NoPayloadError(f"no payload for SGLang {version} yet: {base.pending}",
                             hint=f"bases with a payload: {', '.join(built) or 'none'}")
    return base


def host_base(version: str | None, root: Path | None = None) -> dict[str, object]:
    """What `status` says about a host's installed SGLang: the base it is and whether a payload exists."""
    if root is None:
        from ddtree_ops.bundle import PAYLOAD_DIR

        root = PAYLOAD_DIR
    base = find_base(version)
    if version is None:
        return {"version": None, "known": False, "worker": None, "payload": False, "label": "absent"}
    if base is None:
        return {"version": version, "known": False, "worker": None, "payload": False,
                "label": f"{version} (unknown base)"}
    has = base.has_payload(root)
    return {"version": version, "known": True, "worker": base.worker, "payload": has,
            "label": f"{version} {base.worker}" + ("" if has else " (no payload)")}

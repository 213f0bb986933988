"""stage_verify: check an uploaded bundle's sha256 and contents (see ../install.py)."""

from __future__ import annotations

from ..install import op_stage_verify


def run(args: dict) -> dict:
    return op_stage_verify(args)

"""stage_begin: check room for an upload and name its staging path (see ../install.py)."""

from __future__ import annotations

from ..install import op_stage_begin


def run(args: dict) -> dict:
    return op_stage_begin(args)

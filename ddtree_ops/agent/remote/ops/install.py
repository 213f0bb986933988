"""install: install a staged bundle: backup, journaled atomic replace, record (see ../install.py)."""

from __future__ import annotations

from ..install import op_install


def run(args: dict) -> dict:
    return op_install(args)

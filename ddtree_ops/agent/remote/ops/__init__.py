"""Registry of agent operations: op name -> module (imported only when called).

Each op module defines `run(args: dict) -> dict` and raises AgentError for expected failures.
Later ops (lock, install, rollback, state, smoke) add a module here and a line below.
"""

from __future__ import annotations

import importlib

from ..errors import AgentError

REGISTRY = {
    "facts": "facts",
    # releases (issue 5): lock / stage / plan / install / rollback / history / smoke
    "lock": "lock",
    "unlock": "unlock",
    "lock_status": "lock_status",
    "stage_begin": "stage_begin",
    "stage_verify": "stage_verify",
    "plan": "plan",
    "install": "install",
    "rollback": "rollback",
    "recover": "recover",
    "history": "history",
    "smoke": "smoke",
}


def dispatch(op: object, args: dict) -> dict:
    if not isinstance(op, str) or op not in REGISTRY:
        raise AgentError("unknown_op", f"unknown agent op {op!r}", f"known ops: {', '.join(sorted(REGISTRY))}")
    module = importlib.import_module("." + REGISTRY[op], __name__)
    return module.run(args)

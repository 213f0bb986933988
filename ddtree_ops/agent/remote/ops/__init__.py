"""Registry of agent operations: op name -> (module of the agent package, function), imported
only when called.

Each op function takes the request's `args` dict, returns a dict and raises AgentError for
expected failures. A new op adds its function to a module and a line below.
"""

from __future__ import annotations

import importlib

from ..errors import AgentError

REGISTRY = {
    "facts": ("ops.facts", "run"),  # what the host is and runs; changes nothing
    # releases (issue 5): lock / stage / plan / install / rollback / history / smoke
    "lock": ("lock", "op_lock"),  # take the host lock; answers the lock_id later calls pass
    "unlock": ("lock", "op_unlock"),  # release the lock by lock_id, or break it with force
    "lock_status": ("lock", "op_lock_status"),  # who holds the lock, and whether it is stale
    "stage_begin": ("install", "op_stage_begin"),  # check room for an upload, name its staging path
    "stage_verify": ("install", "op_stage_verify"),  # check an uploaded bundle's sha256 and contents
    "plan": ("install", "op_plan"),  # dry run of a push from an inline manifest; changes nothing
    "install": ("install", "op_install"),  # backup, journaled atomic replace, record
    "rollback": ("rollback", "op_rollback"),  # restore a previous release or pristine from backups
    "stale_check": ("stale", "op_stale_check"),  # refuse a host whose releases were made for another SGLang
    "forget_stale": ("forget", "op_forget_stale"),  # a stale host's repair, after pip --force-reinstall
    "recover": ("journal", "op_recover"),  # finish an interrupted install or rollback
    "history": ("state", "op_history"),  # state.json and the audit log tail
    "smoke": ("smoke", "op_smoke"),  # import, server-args and tree-builder checks with the host's Python
    # promote (issue 10): the serving unit, its gates' ready probe, its journal
    "unit_inspect": ("units", "op_unit_inspect"),  # installed unit, service, release, promotion record, lint
    "unit_apply": ("units", "op_unit_apply"),  # lint, back up, journal + watchdog, unit + env file, reload, restart
    "unit_wait": ("units", "op_unit_wait"),  # ready probe on the host: /health_generate 200 while the unit is up
    "unit_commit": ("units", "op_unit_commit"),  # a stage passed: record it, write evidence, drop the journal
    "unit_restore": ("units", "op_unit_restore"),  # undo the stage in flight, the last stage, or all (pristine)
    "unit_recover": ("units", "op_unit_recover"),  # undo a stage a dead run left in flight
    "unit_service": ("units", "op_unit_service"),  # restart or stop the service as its unit stands
    # commit-confirmed stages (issue 22)
    "heartbeat": ("units", "op_heartbeat"),  # the control side lives: refresh its lock, renew its stage's deadline
    "unit_watch": ("units", "op_unit_watch"),  # the confirm watchdog (systemd-run): undo the stage at its deadline
}


def dispatch(op: object, args: dict) -> dict:
    if not isinstance(op, str) or op not in REGISTRY:
        raise AgentError("unknown_op", f"unknown agent op {op!r}", f"known ops: {', '.join(sorted(REGISTRY))}")
    module, function = REGISTRY[op]
    return getattr(importlib.import_module(".." + module, __name__), function)(args)

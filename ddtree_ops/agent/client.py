"""Control side of the agent protocol: one SSH exec per op, JSON in, JSON out.

Nothing here parses free text from a host: the answer is the agent's JSON, or, when the agent
never started (wrong interpreter path, sudo refused), a structured error built from the exit
status, with stderr attached for the operator.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ddtree_ops import sudo
from ddtree_ops.agent.shipping import READY, agent_argv, agent_stdin
from ddtree_ops.errors import OpsError

if TYPE_CHECKING:
    from ddtree_ops.ssh import HostSession, RemoteResult

DEFAULT_TIMEOUT_S = 120.0


class AgentCallError(OpsError):
    """The agent answered `ok: false`, or never produced an answer."""

    def __init__(self, message: str, *, code: str, hint: str | None = None, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message, hint=hint, code=code)
        self.detail = detail or {}


def call_agent(session: HostSession, op: str, args: dict[str, Any], *, timeout: float | None = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Run agent `op` on the session's host with the host's interpreter; returns the op's result."""
    host = session.host
    # A sudo password is given only once the agent says it runs (--ready): never into the agent's input.
    ready = host.sudo and host.sudo_password_env is not None
    result = session.run(agent_argv(host.python, ready=ready), stdin=agent_stdin(op, args), timeout=timeout,
                         ready=READY.encode() if ready else None)
    answer = parse_answer(host.name, host.python, result, sudo_user=host.user if host.sudo else None)
    if not answer.get("ok"):
        error = answer.get("error") or {}
        raise AgentCallError(
            f"{host.name}: {op}: {error.get('message') or 'agent reported a failure'}",
            code=str(error.get("code") or "agent_error"),
            hint=error.get("hint"),
            detail={k: v for k, v in error.items() if k not in ("code", "message", "hint")},
        )
    return answer.get("result") or {}


def parse_answer(host_name: str, python: str, result: RemoteResult, *, sudo_user: str | None = None) -> dict[str, Any]:
    """The agent's JSON answer, or an error saying why it never spoke (`sudo_user`: the login user when the
    agent ran under sudo, whose refusals are told apart)."""
    stderr_tail = result.stderr.decode("utf-8", "replace").strip()[-2000:]
    line = result.stdout.strip().splitlines()[-1:] if result.stdout.strip() else []
    if line:
        try:
            answer = json.loads(line[0])
        except ValueError:
            answer = None
        if isinstance(answer, dict) and "ok" in answer:
            return answer
    # No JSON answer: the interpreter (or sudo) failed before the agent could speak.
    refused = sudo.refusal(stderr_tail, result.exit_code, user=sudo_user, python=python) if sudo_user else None
    if refused is not None:
        raise AgentCallError(f"{host_name}: {refused.message}", code=refused.code, hint=refused.hint,
                             detail={"stderr": stderr_tail})
    if result.exit_code == 127:
        raise AgentCallError(
            f"{host_name}: interpreter {python!r} not found on the host",
            code="python_not_found",
            hint="set `python` in the inventory to the interpreter of the host's SGLang venv",
            detail={"stderr": stderr_tail},
        )
    if result.exit_code == 126:
        raise AgentCallError(f"{host_name}: interpreter {python!r} is not executable", code="python_not_executable",
                             hint="check `python` in the inventory and the file's permissions", detail={"stderr": stderr_tail})
    raise AgentCallError(
        f"{host_name}: the agent gave no answer (exit status {result.exit_code})",
        code="agent_no_answer",
        hint="check that `python` is a Python 3.8+ interpreter; stderr is in error detail",
        detail={"stderr": stderr_tail},
    )

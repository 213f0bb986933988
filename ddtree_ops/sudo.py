"""Running the host agent as root through sudo, for operators who log in as themselves (`sudo: true`).

Without a password (a NOPASSWD rule) the agent runs as `sudo -n -- python ...`: -n makes sudo fail at
once instead of waiting for a password nobody types.

With `sudo_password_env: NAME` the password comes from $NAME on the control machine or, when that is
unset, from one prompt per run on the terminal (never echoed). It reaches sudo on its standard input
(`sudo -S`), ahead of the agent's own input, and only when sudo asks for it: sudo prints a prompt of
ours on stderr, or, with cached credentials or a NOPASSWD rule, starts the agent at once, which then
says so on stdout (agent/shipping.READY) before it reads anything. So the password is never sent
blind into the agent, never put on a command line (where `ps` would show it), never written to a file,
a log or an error. A wrong password is sent once, not three times, so that a PAM lockout (faillock)
is not run into by a script.

What sudo says when it refuses is turned into what to fix on the host (`refusal`).
"""

from __future__ import annotations

import getpass
import os
import secrets
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddtree_ops.errors import UsageError

if TYPE_CHECKING:
    from ddtree_ops.inventory import HostConfig

# Passwords typed at the prompt this run, by the name of the variable they stand in for.
_typed: dict[str, str] = {}


def argv(command: Sequence[str], *, with_password: bool, prompt: str = "") -> list[str]:
    """`command` under sudo. `--`: nothing after it is a sudo option, whatever the inventory holds."""
    if with_password:
        # -S: the password from stdin; -p: a prompt of ours, recognisable on stderr (no `%`: sudo expands those).
        return ["sudo", "-S", "-p", prompt, "--", *command]
    return ["sudo", "-n", "--", *command]


def new_prompt() -> str:
    return f"[ddtree-ops sudo password {secrets.token_hex(6)}]"


def password_for(host: HostConfig) -> str | None:
    """The sudo password for `host`: None when it uses none. Raises UsageError when it needs one that
    neither the environment nor this run's prompt gave (ask_passwords runs before any host is contacted)."""
    if not host.sudo or host.sudo_password_env is None:
        return None
    name = host.sudo_password_env
    value = os.environ.get(name) or _typed.get(name)
    if not value:
        raise UsageError(f"{host.name}: sudo needs a password and ${name} is not set", code="sudo_password_missing",
                         hint=f"export {name}=... (from a password manager) or run at a terminal to be asked")
    return value


def ask_passwords(hosts: Sequence[HostConfig], ask: Callable[[str], str] | None = None) -> None:
    """Before any host is contacted: every password the selected hosts need is in the environment, or asked
    for once (per variable) on the terminal. Without a terminal, a usage error naming the hosts and variable."""
    needed: dict[str, list[str]] = {}
    for h in hosts:
        if h.sudo and h.sudo_password_env and not (os.environ.get(h.sudo_password_env) or _typed.get(h.sudo_password_env)):
            needed.setdefault(h.sudo_password_env, []).append(h.name)
    if not needed:
        return
    if ask is None:
        if not sys.stdin.isatty():
            name, names = next(iter(needed.items()))
            raise UsageError(f"{', '.join(names)}: sudo needs a password, ${name} is not set and there is no terminal "
                             "to ask on", code="sudo_password_missing",
                             hint=f"export {name}=... before running (e.g. from a password manager), or run at a terminal")
        ask = getpass.getpass  # reads from the terminal, echoes nothing
    for name, names in needed.items():
        value = ask(f"sudo password for {', '.join(names)} (${name}): ")
        if not value:
            raise UsageError("no sudo password given", code="sudo_password_missing", hint=f"or export {name}=...")
        _typed[name] = value


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str
    hint: str


def wrong_password(user: str) -> Refusal:
    return Refusal("sudo_password_wrong", f"sudo refused the password for {user}",
                   "check the variable named by `sudo_password_env` (it was tried once, to stay clear of lockouts)")


def refusal(stderr: str, exit_code: int, *, user: str, python: str) -> Refusal | None:
    """What sudo's own words on stderr mean and what to fix, or None when sudo did not refuse."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    sudo_words = ("sudo:", "sudoers", "Sorry, user", "Sorry, try again")
    said = next((ln for ln in reversed(lines) if any(w in ln for w in sudo_words)), lines[-1] if lines else "")
    rule = f"`{user} ALL=(root) NOPASSWD: {python}` in /etc/sudoers.d/ (visudo -f)"
    if exit_code == 127 and any(ln.endswith(("sudo: not found", "sudo: command not found")) for ln in lines):
        return Refusal("sudo_missing", "sudo is not installed on the host (the login shell cannot find it)",
                       "install sudo there (apt-get install sudo), or log in as root (`user: root`, `sudo: false`)")
    if not any(w in said for w in sudo_words):
        return None
    if "a password is required" in said or "terminal is required to read the password" in said:
        return Refusal("sudo_password_required", f"sudo asks for {user}'s password and the inventory gives none",
                       f"set `sudo_password_env: NAME` for this host (the password then comes from $NAME or a prompt), "
                       f"or allow it without one: {rule}")
    if "incorrect password" in said or "Sorry, try again" in stderr:
        return wrong_password(user)
    if "must have a tty" in said:
        return Refusal("sudo_needs_tty", f"sudo insists on a terminal for {user} (requiretty)",
                       f"add `Defaults:{user} !requiretty` in /etc/sudoers.d/ (visudo -f)")
    if "not in the sudoers" in said or "not allowed to" in said or "may not run sudo" in said:
        return Refusal("sudo_not_allowed", f"sudo does not allow {user} to run the agent: {said}",
                       f"add a rule for it on the host: {rule}")
    if said.endswith("command not found"):
        return Refusal("python_not_found", f"interpreter {python!r} not found on the host (sudo: {said})",
                       "set `python` in the inventory to the interpreter of the host's SGLang venv")
    return Refusal("sudo_failed", f"sudo refused: {said}", "run `sudo -v` as that user on the host to see why")

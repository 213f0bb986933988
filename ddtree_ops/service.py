"""The serving unit: render it from the Jinja templates, quote every value for systemd, and ask the
host's agent to lint, install, restart, wait for, commit or restore it.

Two kinds (inventory `unit_kind`):
  unit      a full unit we own:   /etc/systemd/system/<service>
  drop-in   over an existing one: /etc/systemd/system/<service>.d/50-ddtree-ops.conf
            (rollback --to pristine is then a one-file delete)
plus, for both, the EnvironmentFile (`env_file`, default /etc/ddtree-ops/<service>.env, mode 0600)
that holds the secrets read from the local `service_secrets_file`.

Quoting: systemd has its own syntax, not a shell's. Every ExecStart= word is double-quoted with `\\`
and `"` escaped, `%` doubled (the specifier character) and `$` doubled (systemd's literal dollar):
the only `${NAME}` on the line is the reference to a secret, so a secret travels through the 0600
EnvironmentFile and never through the unit. Environment= assignments are quoted the same way (it
never expands `$`); paths in ReadWritePaths= likewise. EnvironmentFile lines follow systemd's own
syntax (agent/remote/envfile.py). So a space, quote, `%` or `$` in a path or an extra arg cannot
change the command line; tests read it back through systemd itself.

Secrets: the values of the local `service_secrets_file`, and the value of every credential flag in
`extra_args` (`--api-key X`, `--api-key=X`: a flag named like a key, token, secret or password),
which is moved to the env file as DDTREE_OPS_ARG_<FLAG> and referenced as `${…}` in ExecStart=.
"""

from __future__ import annotations

import difflib
import functools
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ddtree_ops.agent.remote import envfile
from ddtree_ops.agent.remote.redaction import is_secret_name, redact_text
from ddtree_ops.errors import OpsError, UsageError

if TYPE_CHECKING:
    import jinja2

    from ddtree_ops.inventory import HostConfig
    from ddtree_ops.ssh import HostSession

Mode = Literal["off", "shadow-linear", "full"]
MODES: tuple[str, ...] = ("off", "shadow-linear", "full")
DDTREE_MODES = ("shadow-linear", "full")
# The payload's default for --speculative-ddtree-budget-max (ddtree_args.DEFAULT_AUTO_MAX_BUDGET).
AUTO_MAX_BUDGET = 127
TEMPLATES = Path(__file__).with_name("templates")
DROP_IN_NAME = "50-ddtree-ops.conf"
UNIT_DIR = "/etc/systemd/system"
ENV_DIR = "/etc/ddtree-ops"
START_LIMIT_BURST = 3
STEP_TIMEOUT_S = 120.0  # every unit op is quick: restarts are queued, never waited for inside an op
# Full mode needs a backend that takes a custom tree mask and page size 1; shadow-linear runs with
# the same two so that its canary is a like-for-like baseline for full (bf16 kernels differ by backend).
DDTREE_SERVER_DEFAULTS = (("--attention-backend", "triton"), ("--page-size", "1"))


class ServiceError(OpsError):
    """A unit step failed on a host; `detail` carries the agent's structured extras (lint output...)."""

    def __init__(self, message: str, *, code: str, hint: str | None = None, detail: dict | None = None) -> None:
        super().__init__(message, hint=hint, code=code)
        self.detail = detail or {}


# ----------------------------------------------------------------------------- quoting


def _escape(value: str) -> str:
    if any(ord(c) < 32 or c == "\x7f" for c in value):
        # The inventory refuses these already; a unit line must never be split by one.
        raise UsageError(f"control character in a unit value: {value!r}", code="unit_value_invalid")
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")


def exec_word(word: str) -> str:
    """One literal ExecStart= word: `$` doubled, since the line expands `${NAME}` (secret references)."""
    return f'"{_escape(word).replace("$", "$$")}"'


def env_assignment(assignment: str) -> str:
    """One Environment= entry, `NAME=value` quoted as a whole (Environment= never expands `$`)."""
    return f'"{_escape(assignment)}"'


def path_word(path: str) -> str:
    """One path in a space-separated path list (ReadWritePaths=)."""
    return f'"{_escape(path)}"'


def specifier_safe(value: str) -> str:
    """A whole-line value that systemd takes literally except for `%` specifiers (Description=,
    EnvironmentFile=, WorkingDirectory=): no quotes allowed there, so leading/trailing space is refused,
    and a trailing backslash, which would join the next line to this one."""
    if value != value.strip() or value.endswith("\\"):
        raise UsageError(f"leading or trailing whitespace or backslash in a unit value: {value!r}",
                         code="unit_value_invalid")
    return _escape(value).replace('\\"', '"').replace("\\\\", "\\")


def env_file_value(value: str) -> str:
    """A value in an EnvironmentFile, as systemd reads it back."""
    try:
        return envfile.quote(value)
    except ValueError:
        raise UsageError("control character in a secret value (the value is not shown)", code="secret_invalid") from None


@dataclass(frozen=True)
class SecretArg:
    """An ExecStart= word whose value comes from the env file: `prefix` + `${name}`."""

    name: str
    prefix: str = ""

    def shown(self) -> str:
        return f"{self.prefix}${{{self.name}}}"


def secret_arg_name(flag: str) -> str:
    return "DDTREE_OPS_ARG_" + re.sub(r"[^A-Za-z0-9]+", "_", flag.lstrip("-")).upper().strip("_")


def split_secret_args(argv: Sequence[str]) -> tuple[list[str | SecretArg], dict[str, str]]:
    """The words with every credential flag's value replaced by a reference into the env file, and
    those values by name (`--api-key X` and `--api-key=X` alike)."""
    words: list[str | SecretArg] = []
    secrets: dict[str, str] = {}
    take_next: str | None = None
    for word in argv:
        if take_next is not None:
            secrets[take_next] = word
            words.append(SecretArg(take_next))
            take_next = None
            continue
        flag, eq, value = word.partition("=")
        if word.startswith("--") and is_secret_name(flag):
            name = secret_arg_name(flag)
            if name in secrets:
                raise UsageError(f"{flag} given twice in extra_args", code="secret_arg_twice")
            if eq:
                secrets[name] = value
                words.append(SecretArg(name, f"{flag}="))
                continue
            take_next = name
        words.append(word)
    if take_next is not None:
        raise UsageError(f"{argv[-1]} in extra_args has no value", hint="give it as two items or as --flag=VALUE",
                         code="secret_arg_missing")
    return words, secrets


def api_key(host: HostConfig) -> str | None:
    """The server's --api-key from extra_args (SGLang then wants it as a bearer token on every path
    but /health* and /metrics): the gates must send it. A secret: never printed."""
    _, secrets = split_secret_args(host.extra_args)
    return secrets.get(secret_arg_name("--api-key"))


def exec_line(words: Sequence[str | SecretArg]) -> str:
    return " ".join(f'"{_escape(w.prefix).replace("$", "$$")}${{{w.name}}}"' if isinstance(w, SecretArg)
                    else exec_word(w) for w in words)


# ----------------------------------------------------------------------------- what to render


@dataclass(frozen=True)
class UnitPaths:
    kind: Literal["unit", "drop-in"]
    service: str
    unit_path: str  # the file promote writes: the unit, or the drop-in
    env_path: str

    @property
    def stem(self) -> str:
        return self.service.removesuffix(".service")


def unit_paths(host: HostConfig) -> UnitPaths:
    stem = host.service.removesuffix(".service")
    if host.unit_kind == "drop-in":
        path = posixpath.join(UNIT_DIR, f"{host.service}.d", DROP_IN_NAME)
    else:
        path = posixpath.join(UNIT_DIR, host.service)
    return UnitPaths(host.unit_kind, host.service, path, host.env_file or posixpath.join(ENV_DIR, f"{stem}.env"))


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def largest_budget(host: HostConfig) -> int:
    """The largest tree a step verifies: the fixed budget, auto's maximum, or the draft's depth."""
    if host.ddtree_budget == "auto":
        return host.ddtree_budget_max or AUTO_MAX_BUDGET
    return host.ddtree_budget or host.draft_block_size - 1


def server_argv(host: HostConfig, mode: str) -> list[str]:
    """The launcher's argv: `PYTHON -m MODULE ARGS`, ARGS the same in production and in the lab.

    off: plain DFLASH (linear verify) when a draft model is set, plain decoding otherwise;
    shadow-linear / full: DFLASH plus the DDTree flags of the mode, the inventory's budget, cap and
    keep-chain.
    """
    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r}", hint=f"one of {', '.join(MODES)}", code="bad_mode")
    if host.model_path is None:
        raise UsageError(f"{host.name}: no model_path in the inventory", hint="set model_path (and draft_model_path)",
                         code="model_path_missing")
    if any(c in host.python for c in "'\"\\$"):
        # systemd itself refuses these in an ExecStart executable ("contains special characters"), and
        # does not expand `$$` there.
        raise UsageError(f"{host.name}: python {host.python!r} has a quote, backslash or `$`, which systemd "
                         "refuses in the executable of ExecStart=", hint="install the venv under a path without them",
                         code="python_path_unsupported")
    argv = [host.python, "-m", host.server_module, "--model-path", host.model_path,
            "--host", host.serve_host, "--port", str(host.serve_port), "--enable-metrics"]
    if mode in DDTREE_MODES and host.draft_model_path is None:
        raise UsageError(f"{host.name}: --mode {mode} needs draft_model_path (the DFlash drafter)",
                         hint="set draft_model_path in the inventory", code="draft_model_missing")
    if host.draft_model_path is not None:
        argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", host.draft_model_path,
                 "--speculative-num-draft-tokens", str(host.draft_block_size)]
    if mode in DDTREE_MODES:
        argv += ["--speculative-ddtree-mode", mode]
        if host.ddtree_budget is not None:
            argv += ["--speculative-ddtree-budget", str(host.ddtree_budget)]
        if host.ddtree_budget_max is not None:
            argv += ["--speculative-ddtree-budget-max", str(host.ddtree_budget_max)]
        if host.ddtree_topk_cap is not None:
            argv += ["--speculative-ddtree-topk-cap", str(host.ddtree_topk_cap)]
        if host.ddtree_keep_chain:
            depth = host.draft_block_size - 1
            if largest_budget(host) < depth:
                # The payload refuses this at argument parsing: the unit would never start.
                raise UsageError(f"{host.name}: ddtree_keep_chain needs ddtree_budget >= the draft depth {depth} "
                                 f"(draft_block_size {host.draft_block_size} - 1), got a largest budget of "
                                 f"{largest_budget(host)}", hint=f"set ddtree_budget (or ddtree_budget_max with auto) "
                                 f"to at least {depth} or drop "
                                 "ddtree_keep_chain", code="keep_chain_budget")
            argv += ["--speculative-ddtree-keep-chain"]
        for flag, value in DDTREE_SERVER_DEFAULTS:
            if not _has_flag(host.extra_args, flag):
                argv += [flag, value]
    return argv + list(host.extra_args)


@dataclass(frozen=True)
class RenderedUnit:
    """What promote installs on one host for one mode; `env_text` holds secrets: never print it."""

    host: str
    mode: str
    paths: UnitPaths
    argv: list[str]  # as shown: a secret flag's value appears as its ${DDTREE_OPS_ARG_…} reference
    text: str
    env_text: str = field(repr=False)
    secret_values: tuple[str, ...] = field(default=(), repr=False)


@functools.cache
def _jinja() -> jinja2.Environment:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             autoescape=False, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(exec_word=exec_word, env_assignment=env_assignment, path_word=path_word,
                       specifier_safe=specifier_safe, env_file_value=env_file_value)
    return env


def load_secrets(host: HostConfig) -> dict[str, str]:
    """The host's local `service_secrets_file`, read with systemd's own EnvironmentFile syntax (so
    `KEY="v"` is v, exactly as systemd would hand it to the server). Errors name the file and line,
    never the value."""
    if host.service_secrets_file is None:
        return {}
    path = Path(host.service_secrets_file)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{host.name}: cannot read service_secrets_file {path}: {exc.strerror}",
                         hint="fix service_secrets_file in the inventory", code="secrets_unreadable") from None
    except UnicodeDecodeError:
        raise UsageError(f"{host.name}: service_secrets_file {path} is not UTF-8 text", code="secrets_invalid") from None
    try:
        return {name: value for _, name, value in envfile.parse(text)}
    except envfile.EnvFileError as exc:
        raise UsageError(f"{path}:{exc.line}: {exc.problem}", hint="one NAME=VALUE a line, systemd EnvironmentFile "
                         "syntax (quotes optional: KEY=\"v\" means v)", code="secrets_invalid") from None


def render_unit(host: HostConfig, mode: str, *, secrets: Mapping[str, str] | None = None) -> RenderedUnit:
    """Render the unit (or drop-in) and the env file for `mode` from the templates."""
    paths = unit_paths(host)
    secrets = dict(load_secrets(host) if secrets is None else secrets)
    clash = sorted(set(secrets) & set(host.service_environment))
    if clash:
        raise UsageError(f"{host.name}: {', '.join(clash)} set both in service_environment and the secrets file",
                         hint="keep each variable in one place", code="environment_clash")
    words, arg_secrets = split_secret_args(server_argv(host, mode))
    clash = sorted(set(arg_secrets) & set(secrets))
    if clash:
        raise UsageError(f"{host.name}: {', '.join(clash)} is both a secrets-file variable and the env name of a "
                         "credential flag in extra_args", hint="rename the variable", code="environment_clash")
    secrets.update(arg_secrets)
    state_directory = f"ddtree-ops-{paths.stem}"
    environment = {"HOME": f"/var/lib/{state_directory}", "XDG_CACHE_HOME": f"/var/cache/{state_directory}",
                   # Never reach a model hub from a serving host unless the operator says so.
                   "HF_HUB_OFFLINE": "1", **host.service_environment}
    context = {
        "mode": mode, "service": paths.service, "exec_line": exec_line(words), "environment": environment,
        "env_file": paths.env_path, "description": f"SGLang server (DDTree {mode}), managed by ddtree-ops",
        "state_directory": state_directory, "state_directory_path": f"/var/lib/{state_directory}",
        "start_timeout_s": host.start_timeout_s, "stop_timeout_s": host.stop_timeout_s,
        "restart_sec": host.restart_sec, "read_write_paths": list(host.read_write_paths),
        # Long enough to count START_LIMIT_BURST full load attempts, so a slow load-time crash loop trips it too.
        "start_limit_burst": START_LIMIT_BURST,
        "start_limit_interval_s": START_LIMIT_BURST * (host.start_timeout_s + host.restart_sec) + 60,
    }
    template = "ddtree-ops.conf.j2" if paths.kind == "drop-in" else "sglang.service.j2"
    text = _jinja().get_template(template).render(**context)
    env_text = _jinja().get_template("service.env.j2").render(service=paths.service, secrets=secrets)
    shown = [w.shown() if isinstance(w, SecretArg) else w for w in words]
    return RenderedUnit(host.name, mode, paths, shown, text, env_text, tuple(v for v in secrets.values() if v))


def unit_diff(before: str | None, after: str, path: str) -> str:
    """Unified diff of the installed file against the rendered one ('' when identical)."""
    return "".join(difflib.unified_diff((before or "").splitlines(True), after.splitlines(True),
                                        fromfile=f"{path} (installed)" if before is not None else "/dev/null",
                                        tofile=f"{path} (rendered)"))


def redact(value: Any, secrets: Sequence[str]) -> Any:
    """A copy of a JSON-like value with every secret value replaced, and whatever a credential-named
    flag or variable assigns in its text: the last guard before anything is printed, logged or stored."""
    if isinstance(value, str):
        return redact_text(value, tuple(secrets))
    if isinstance(value, Mapping):
        return {redact(k, secrets): redact(v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v, secrets) for v in value]
    return value


# ----------------------------------------------------------------------------- agent steps


def _call(session: HostSession, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    from ddtree_ops.agent.client import AgentCallError, call_agent

    try:
        return call_agent(session, op, args, timeout=timeout)
    except AgentCallError as exc:
        raise ServiceError(exc.message, code=exc.code, hint=exc.hint, detail=exc.detail) from None


def _unit_args(host: HostConfig, paths: UnitPaths) -> dict[str, Any]:
    return {"state_dir": host.state_dir, "service": paths.service, "kind": paths.kind,
            "unit_path": paths.unit_path, "env_path": paths.env_path}


def inspect(session: HostSession, host: HostConfig, unit: RenderedUnit | None, *, mode: str | None = None,
            check_mode: bool = False) -> dict[str, Any]:
    """Read-only: the installed unit text, service state, release, promotion record, and (given a
    rendered unit) its lint; with check_mode, the installed payload's own verdict on serving `mode` for the target
    model (full: the target's kind; shadow-linear: the base's own DFLASH on a hybrid with the radix cache)."""
    paths = unit.paths if unit else unit_paths(host)
    args = {**_unit_args(host, paths), "model_path": host.model_path if check_mode else None,
            "disable_radix_cache": _has_flag(host.extra_args, "--disable-radix-cache"),
            "lint_text": unit.text if unit else None, "mode": mode}
    return _call(session, "unit_inspect", args, timeout=120)


def install(session: HostSession, host: HostConfig, unit: RenderedUnit, *, lock_id: str, operator: str,
            confirm_hard_s: float, adopt: bool = False, test_kill: str | None = None) -> dict[str, Any]:
    """Lint, back up, journal with the confirm deadline, start its watchdog, write unit + env file,
    daemon-reload, queue the restart: one agent call, quick (the restart is waited for by wait_ready).

    Unless `commit` confirms it (or the run's heartbeat renews it) within host.confirm_timeout_s, and
    never later than confirm_hard_s, the host puts the previous unit back by itself."""
    args = {**_unit_args(host, unit.paths), "lock_id": lock_id, "operator": operator, "mode": unit.mode,
            "unit_text": unit.text, "env_text": unit.env_text, "adopt": adopt,
            "confirm_window_s": host.confirm_timeout_s, "confirm_hard_s": max(confirm_hard_s, host.confirm_timeout_s)}
    if test_kill:
        args["test_kill"] = test_kill
    return _call(session, "unit_apply", args, timeout=STEP_TIMEOUT_S)


def wait_ready(session: HostSession, host: HostConfig, *, timeout_s: float, since: float | None = None,
               after_invocation: str | None = None, start_if_inactive: bool = False) -> dict[str, Any]:
    """The ready probe, run on the host: /health_generate 200 within timeout_s while the unit stays
    active (with after_invocation: from a new invocation of the unit, once a queued restart has
    stopped the old process, which may take the unit's stop timeout first)."""
    stop_s = float(host.stop_timeout_s) + 30 if after_invocation is not None else 0.0
    args = {"service": host.service, "url": f"http://{_url_host(host.serve_host)}:{host.serve_port}/health_generate",
            "timeout_s": timeout_s, "stop_timeout_s": stop_s, "since": since, "start_if_inactive": start_if_inactive,
            "after_invocation": after_invocation, "env_path": unit_paths(host).env_path}
    return _call(session, "unit_wait", args, timeout=stop_s + timeout_s + 60)


def commit(session: HostSession, host: HostConfig, *, lock_id: str, operator: str, unit_id: str, mode: str,
           record: dict[str, Any], evidence: dict[str, Any], canary: dict[str, Any] | None,
           test_kill: str | None = None) -> dict[str, Any]:
    """Confirm the stage in flight (refused, and the stage undone, once its deadline has passed)."""
    args = {"state_dir": host.state_dir, "lock_id": lock_id, "operator": operator, "unit_id": unit_id,
            "mode": mode, "record": record, "evidence": evidence, "canary": canary}
    if test_kill:
        args["test_kill"] = test_kill
    return _call(session, "unit_commit", args, timeout=STEP_TIMEOUT_S)


def restore(session: HostSession, host: HostConfig, *, lock_id: str | None, operator: str, to: str,
            evidence: dict[str, Any] | None = None, restart: bool = True, since: float | None = None,
            adopt: bool = False, reason: str | None = None, timeout: float = STEP_TIMEOUT_S) -> dict[str, Any]:
    """Put the unit back: `journal` (undo the stage in flight), `previous` (undo the last stage) or
    `pristine` (as before ddtree-ops touched it); daemon-reload; queue the restart (or the stop, when
    nothing ran). A unit changed by hand since its stage is refused unless adopt."""
    paths = unit_paths(host)
    args = {**_unit_args(host, paths), "lock_id": lock_id, "operator": operator, "to": to, "evidence": evidence,
            "restart": restart, "since": since, "adopt": adopt, "reason": reason}
    return _call(session, "unit_restore", args, timeout=timeout)


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address

"""The YAML inventory: which hosts exist, how to reach them, and how each one is configured.

Shape (see inventory/example.yaml for every field):

    all:    {vars: {...}}                       # defaults for every host
    groups: {canary: {vars: {...}, hosts: [gpu-1]}}
    hosts:  {gpu-1: {address: 10.0.0.5, ...}}

A host's settings are layered all.vars < group vars < the host's own entry. Every mapping
forbids unknown keys, and every problem is reported with the file, the YAML line, the field
path (`hosts.gpu-1.adress`), what was expected and a hint, so a typo never passes silently.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import importlib.util
import posixpath
import re
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    create_model,
)
from pydantic_core import PydanticCustomError

from ddtree_ops.errors import UsageError
from ddtree_ops.signing import SIGNER_NAME_RE, PublicKey

DEFAULT_STATE_DIR = "/var/lib/ddtree-ops"
# A file whose aliases expand past this many YAML values is refused before it is walked: a few
# hundred bytes of nested aliases ("billion laughs") would otherwise take minutes and gigabytes.
# A 1000-host inventory with 20 settings each is about 40 000 values.
MAX_VALUES = 100_000
# Fields whose values may carry credentials (an `--api-key` in extra_args, tokens, environment):
# never echoed in an error, in `hosts` or in --json.
SECRET_FIELDS = frozenset({"extra_args", "environment", "env", "token", "api_key", "password"})
REDACTED = "<redacted>"


def is_secret_field(name: object) -> bool:
    return isinstance(name, str) and (name in SECRET_FIELDS or name.endswith(("_token", "_secret", "_password")))


def redacted(value: object) -> object:
    """What may be shown of a secret-bearing value: its shape, never its text."""
    if isinstance(value, list):
        return [REDACTED] * len(value)
    if isinstance(value, dict):
        return dict.fromkeys(value, REDACTED)
    return REDACTED if value not in (None, "") else value

# Inventory keys (host and group names) end up in logs, lock owners, file names and --limit
# patterns, so they are restricted to a boring alphabet instead of being quoted everywhere.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
# Addresses are handed to the socket layer, never to a shell; still, anything outside
# DNS-name / IPv4 / IPv6 characters is a mistake worth stopping early.
_ADDRESS_RE = re.compile(r"[A-Za-z0-9_:.%-]{1,253}")
_USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
# systemd unit names: letters, digits, ":-_.\" and "@" for template instances.
_UNIT_RE = re.compile(r"[A-Za-z0-9:_.@\\-]{1,240}")
# `python -m MODULE`: a dotted Python module name, nothing a unit's ExecStart could misread.
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
# Environment variable names, as systemd accepts them in Environment= and EnvironmentFile=.
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_JUMP_RE = re.compile(r"(?:(?P<user>[A-Za-z_][A-Za-z0-9_.-]{0,31})@)?(?P<address>[A-Za-z0-9_.%-]{1,253}|\[[0-9A-Fa-f:.%]+\])(?::(?P<port>[0-9]{1,5}))?")


def _invalid(reason: str, hint: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", "{reason}", {"reason": reason, "hint": hint})


def _reject_control_chars(value: str, what: str) -> None:
    if any(ord(c) < 32 or c == "\x7f" for c in value):
        raise _invalid(
            f"{what} contains a newline or control character",
            "remove it; such characters are never legitimate here and would corrupt logs and unit files",
        )


def _check_address(value: str) -> str:
    if not _ADDRESS_RE.fullmatch(value) or value.startswith("-"):
        raise _invalid(f"`{value}` is not a host name or IP address", "use a DNS name, IPv4 or IPv6 address (no spaces, quotes or shell characters)")
    return value


def _check_budget(value: object) -> int | str:
    """A tree budget: an integer >= 1 or `auto` (one error for either, not one per type tried)."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(f"`{value}` is neither a node count nor `auto`",
                       "write an integer >= 1 (non-root tree nodes) or `auto` (the budget picked per step)")
    if value < 1:
        raise _invalid(f"Input should be greater than or equal to 1 (got {value})",
                       "write an integer >= 1 (non-root tree nodes) or `auto`")
    return value


def _check_user(value: str) -> str:
    if not _USER_RE.fullmatch(value):
        raise _invalid(f"`{value}` is not a valid login name", "use a POSIX user name such as `root` or `deploy`")
    return value


def _reject_trailing_backslash(value: str, what: str) -> None:
    if value.endswith("\\"):
        raise _invalid(
            f"{what} ends with a backslash",
            "remove it: in a unit file a trailing `\\` joins the next line to this one, changing the unit",
        )


def _check_remote_path(value: str) -> str:
    # Remote paths travel as JSON to the agent or through shlex.quote, so quotes, `;`, `$()` and
    # backticks are carried safely; control characters and relative paths are rejected.
    _reject_control_chars(value, "path")
    _reject_trailing_backslash(value, "path")
    if not value.startswith("/"):
        raise _invalid(f"`{value}` is not an absolute path", "remote paths must start with `/` (they are resolved on the host)")
    if ".." in value.split("/"):
        raise _invalid(f"`{value}` contains `..`", "write the path without `..` components")
    return posixpath.normpath(value)


def _check_local_path(value: str, info: ValidationInfo) -> str:
    # Local files are opened by paramiko, never by a shell; only control characters are refused.
    _reject_control_chars(value, "path")
    path = Path(value).expanduser()
    base_dir = (info.context or {}).get("base_dir")
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return str(path)


def _check_service(value: str) -> str:
    _reject_trailing_backslash(value, "service name")
    if not _UNIT_RE.fullmatch(value) or value.startswith("-"):
        raise _invalid(f"`{value}` is not a systemd unit name", "use a unit name such as `sglang.service` (letters, digits, `:_.@-`)")
    # `systemctl` treats a bare name as `.service`; normalizing keeps state and logs consistent.
    return value if value.endswith(".service") else f"{value}.service"


def _check_module(value: str) -> str:
    if not _MODULE_RE.fullmatch(value) or len(value) > 200:
        raise _invalid(f"`{value}` is not a Python module name", "use a dotted module name such as `sglang.launch_server`")
    return value


def _check_jump_host(value: str) -> str:
    if not _JUMP_RE.fullmatch(value):
        raise _invalid(f"`{value}` is not a jump host", "name another host of this inventory, or write `[user@]address[:port]`")
    return value


def _check_env_name(value: str) -> str:
    if not _ENV_NAME_RE.fullmatch(value):
        raise _invalid(f"`{value}` is not an environment variable name", "use letters, digits and `_`, not starting with a digit")
    return value


def _check_plain_env_name(value: str) -> str:
    """service_environment lands in the unit file (mode 0644): a credential belongs in the secrets file."""
    from ddtree_ops.agent.remote.redaction import is_secret_name

    if is_secret_name(value):
        raise _invalid(f"`{value}` looks like a credential, and service_environment is written into the unit "
                       "file (readable by every user of the host)",
                       "move it to service_secrets_file: those values reach the server only through the 0600 "
                       "EnvironmentFile")
    return _check_env_name(value)


def _check_text(value: str) -> str:
    _reject_control_chars(value, "value")
    _reject_trailing_backslash(value, "value")
    if not value:
        raise _invalid("empty string", "remove the field or give it a value")
    return value


Address = Annotated[str, AfterValidator(_check_address)]
LoginName = Annotated[str, AfterValidator(_check_user)]
RemotePath = Annotated[str, AfterValidator(_check_remote_path)]
LocalPath = Annotated[str, AfterValidator(_check_local_path)]
ServiceName = Annotated[str, AfterValidator(_check_service)]
JumpHost = Annotated[str, AfterValidator(_check_jump_host)]
ModuleName = Annotated[str, AfterValidator(_check_module)]
Text = Annotated[str, AfterValidator(_check_text)]
EnvName = Annotated[str, AfterValidator(_check_env_name)]
PlainEnvName = Annotated[str, AfterValidator(_check_plain_env_name)]


class HostConfig(BaseModel):
    """Everything needed to reach and operate one host, after layering all < group < host."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # Set by the loader, not by the inventory file.
    name: str = Field(exclude=True)
    groups: tuple[str, ...] = Field(default=(), exclude=True)

    # Connection.
    address: Address
    port: int = Field(22, ge=1, le=65535)
    user: LoginName = "root"
    identity_file: LocalPath | None = None
    known_hosts: LocalPath = Field("~/.ssh/known_hosts", validate_default=True)
    host_key_policy: Literal["strict", "accept-new"] = "strict"
    jump_host: JumpHost | None = None
    connect_timeout: float = Field(10.0, gt=0, le=300)
    # Log in as `user` and run the host agent as root through sudo (sudo.py). With sudo_password_env, the
    # password comes from that environment variable of the control machine, or a prompt; never from here.
    sudo: bool = False
    sudo_password_env: EnvName | None = None

    # The SGLang installation and its service.
    python: RemotePath = "/usr/bin/python3"
    service: ServiceName = "sglang.service"
    server_module: ModuleName = "sglang.launch_server"  # the unit runs `{python} -m {server_module} ARGS`
    serve_host: Address = "127.0.0.1"
    serve_port: int = Field(30000, ge=1, le=65535)
    model_path: Text | None = None
    draft_model_path: Text | None = None
    extra_args: list[Text] = Field(default_factory=list)
    state_dir: RemotePath = DEFAULT_STATE_DIR

    # The serving unit promote renders (ddtree_ops/templates/, service.py).
    unit_kind: Literal["unit", "drop-in"] = "unit"
    start_timeout_s: int = Field(900, ge=10, le=86400)
    stop_timeout_s: int = Field(120, ge=5, le=3600)
    restart_sec: int = Field(10, ge=1, le=3600)
    # Commit-confirmed stages: an installed stage puts the previous unit back by itself unless the
    # control side renews it (by heartbeat, while its gates run) or confirms it within this window.
    confirm_timeout_s: int = Field(60, ge=5, le=3600)
    # A dead run's lock goes stale this long after its last heartbeat (a live run renews it).
    lock_ttl_s: int = Field(120, ge=10, le=3600)
    service_environment: dict[PlainEnvName, Text] = Field(default_factory=dict)
    service_secrets_file: LocalPath | None = None
    env_file: RemotePath | None = None
    read_write_paths: list[RemotePath] = Field(default_factory=list)
    draft_block_size: int = Field(16, ge=2, le=64)

    # Rollout settings (push / smoke / promote).
    canary: bool = False
    # Upper bounds and how budget, cap and keep_chain fit together: the payload's own check (_payload_refusals).
    # A fixed budget, or "auto": each step picks its budget for throughput, at most ddtree_budget_max.
    ddtree_budget: Annotated[int | str, PlainValidator(_check_budget)] | None = None
    ddtree_budget_max: int | None = Field(None, ge=1)
    ddtree_topk_cap: int | None = Field(None, ge=1)
    ddtree_keep_chain: bool = False
    allow_hybrid_unsafe: bool = False
    acceptance_margin: float = Field(0.05, ge=0, le=10)

    def public_dict(self) -> dict[str, Any]:
        """The settings as JSON-able values, secret-bearing fields redacted (for `hosts`, logs)."""
        return {k: redacted(v) if is_secret_field(k) else v for k, v in self.model_dump(mode="json").items()}

    @property
    def identity_path(self) -> Path | None:
        return Path(self.identity_file) if self.identity_file is not None else None

    @property
    def known_hosts_path(self) -> Path:
        return Path(self.known_hosts).expanduser()


_LOADER_FIELDS = {"name", "groups"}
HOST_FIELDS: tuple[str, ...] = tuple(n for n in HostConfig.model_fields if n not in _LOADER_FIELDS)


def _optional_layer_model() -> type[BaseModel]:
    """The same fields as HostConfig, all optional: validates one layer (all/group/host) on its own."""
    fields: dict[str, Any] = {}
    for name in HOST_FIELDS:
        info = HostConfig.model_fields[name]
        annotation: Any = info.annotation
        if info.metadata:
            annotation = Annotated[(annotation, *info.metadata)]
        fields[name] = (annotation | None, None)
    return create_model("HostVars", __config__=ConfigDict(extra="forbid", strict=True), **fields)


HostVars = _optional_layer_model()


class _AllBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    vars: dict[str, Any] | None = None


class _GroupBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    vars: dict[str, Any] | None = None
    hosts: list[str] = Field(default_factory=list)


class _InventoryFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    all: _AllBlock | None = None
    groups: dict[str, _GroupBlock | None] = Field(default_factory=dict)
    hosts: dict[str, dict[str, Any] | None]
    # Who may sign bundles: name -> public key (`ssh-ed25519 AAAA...`) or a .pub file. Fleet-wide, not a
    # host setting: push checks the one bundle it sends against this list before any host is contacted.
    signers: dict[str, str] | None = None


_ALLOWED_KEYS: dict[str, tuple[str, ...]] = {
    "top": tuple(_InventoryFile.model_fields),
    "all": tuple(_AllBlock.model_fields),
    "group": tuple(_GroupBlock.model_fields),
    "host": HOST_FIELDS,
}


@dataclass
class InventoryIssue:
    """One problem in an inventory file, precise enough to fix without reading the code."""

    path: str
    message: str
    line: int | None = None
    expected: str | None = None
    hint: str | None = None

    def render(self, file: Path | str) -> str:
        where = f"{file}:{self.line}" if self.line else str(file)
        lines = [f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"]
        if self.expected:
            lines.append(f"    expected: {self.expected}")
        if self.hint:
            lines.append(f"    hint: {self.hint}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "line": self.line, "message": self.message, "expected": self.expected, "hint": self.hint}


class InventoryError(UsageError):
    """The inventory file is missing, unreadable or invalid; carries every problem found."""

    code = "inventory_invalid"

    def __init__(self, file: Path | str, issues: list[InventoryIssue]) -> None:
        self.file = Path(file)
        self.issues = sorted(issues, key=lambda i: (i.line is None, i.line or 0))
        issues = self.issues
        rendered = "\n".join(issue.render(self.file) for issue in issues)
        first_hint = next((i.hint for i in issues if i.hint), None)
        super().__init__(rendered, hint=first_hint)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "hint": self.hint,
            "file": str(self.file),
            "issues": [i.to_dict() for i in self.issues],
        }


class LimitError(UsageError):
    code = "limit_no_match"


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: dict[str, HostConfig]
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    signers: dict[str, PublicKey] = field(default_factory=dict)
    # Not errors, but likely mistakes (two hosts at one address): printed by the CLI, in --json.
    warnings: list[InventoryIssue] = field(default_factory=list)

    def select(self, limit: str | None) -> list[HostConfig]:
        """Hosts named by `limit` (comma-separated host names, group names or globs), in file order.

        No limit selects every host. An empty limit, and a pattern that matches nothing, are usage
        errors, so an unset shell variable or a typo in `--limit` cannot silently grow or shrink a rollout.
        """
        if limit is None:
            return list(self.hosts.values())
        patterns = [p.strip() for p in limit.split(",") if p.strip()]
        if not patterns:
            # `--limit "$HOSTS"` with HOSTS unset must never mean the whole fleet (nor silently nothing).
            raise LimitError(f"--limit {limit!r} names no host or group",
                             hint="name hosts, groups or globs (comma-separated), or leave --limit out to select "
                                  "every host")
        chosen: set[str] = set()
        for pattern in patterns:
            matched = self._match(pattern)
            if not matched:
                raise LimitError(
                    f"--limit `{pattern}` matches no host or group in {self.path}",
                    hint=_did_you_mean(pattern, [*self.hosts, *self.groups])
                    or f"hosts: {', '.join(self.hosts)}; groups: {', '.join(self.groups) or '(none)'}",
                )
            chosen.update(matched)
        return [h for name, h in self.hosts.items() if name in chosen]

    def _match(self, pattern: str) -> set[str]:
        if pattern in self.hosts:
            return {pattern}
        if pattern in self.groups:
            return set(self.groups[pattern])
        if not any(c in pattern for c in "*?["):
            return set()
        names = {h for h in self.hosts if fnmatch.fnmatchcase(h, pattern)}
        for group, members in self.groups.items():
            if fnmatch.fnmatchcase(group, pattern):
                names.update(members)
        return names

    def jump_chain(self, host: HostConfig) -> list[HostConfig]:
        """Hosts to hop through to reach `host`, nearest first (loops are refused at load time)."""
        chain: list[HostConfig] = []
        hop = self.jump_for(host)
        while hop is not None:
            chain.append(hop)
            hop = self.jump_for(hop)
        return chain

    def jump_for(self, host: HostConfig) -> HostConfig | None:
        """The host to hop through, as a full config: an inventory host, or an ad-hoc
        `[user@]address[:port]` that borrows the target's keys, known_hosts and timeouts."""
        if host.jump_host is None:
            return None
        if host.jump_host in self.hosts:
            return self.hosts[host.jump_host]
        spec = _JUMP_RE.fullmatch(host.jump_host)
        assert spec is not None  # validated at load time
        return HostConfig(
            name=f"{host.name}-jump",
            address=spec["address"].strip("[]"),
            port=int(spec["port"] or 22),
            user=spec["user"] or host.user,
            identity_file=host.identity_file,
            known_hosts=host.known_hosts,
            host_key_policy=host.host_key_policy,
            connect_timeout=host.connect_timeout,
        )


# --- loading ------------------------------------------------------------------------------------

PathKey = tuple[str | int, ...]


def _dotted(path: Iterable[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else None


class _Marks:
    """YAML line numbers by field path, from the composed node tree (1-based)."""

    def __init__(self) -> None:
        self.lines: dict[PathKey, int] = {}
        self.duplicates: list[tuple[PathKey, int]] = []

    def index(self, node: yaml.Node, path: PathKey = ()) -> None:
        self.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, value_node in node.value:
                key = key_node.value
                if key == "<<":  # merge keys: their contents are indexed where they are defined
                    continue
                if key in seen:
                    self.duplicates.append(((*path, key), key_node.start_mark.line + 1))
                seen.add(key)
                # The key's line is the most useful one to point at for both key and value errors.
                self.lines[(*path, key)] = key_node.start_mark.line + 1
                self.index(value_node, (*path, key))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.index(item, (*path, i))

    def line_for(self, path: PathKey) -> int | None:
        for end in range(len(path), -1, -1):
            line = self.lines.get(path[:end])
            if line is not None:
                return line
        return None


def _check_graph(path: Path, root: yaml.Node) -> None:
    """Refuse, before anything walks the tree, what would make walking it explode or crash:
    aliases that expand past MAX_VALUES, an alias inside its own anchor, and keys that are not
    plain scalars (a list or mapping as a key cannot name a field)."""
    sizes: dict[int, int] = {}  # id(node) -> values it expands to; aliases share nodes, so each is sized once
    open_nodes: set[int] = set()

    def fail(node: yaml.Node, message: str, hint: str) -> InventoryError:
        return InventoryError(path, [InventoryIssue("", message, line=node.start_mark.line + 1, hint=hint)])

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise fail(node, "recursive YAML alias: this value contains itself", "replace the alias by the values it should hold")
        open_nodes.add(id(node))
        total = 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode):
                    raise fail(key, "a key must be a plain name, not a list or mapping", "write the key as a plain word")
                total += 1 + size(value)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(size(item) for item in node.value)
        open_nodes.discard(id(node))
        if total > MAX_VALUES:
            raise fail(node, f"this value expands to more than {MAX_VALUES} YAML values (nested aliases)",
                       "an inventory needs no aliases that multiply; write the values out")
        sizes[id(node)] = total
        return total

    size(root)


def _parse_yaml(path: Path, text: str) -> tuple[Any, _Marks]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise InventoryError(path, [InventoryIssue("", "the file is empty", hint="start from inventory/example.yaml")])
        _check_graph(path, node)
        marks = _Marks()
        marks.index(node)
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise InventoryError(
            path,
            [InventoryIssue("", f"YAML syntax error: {problem}", line=mark.line + 1 if mark else None,
                            hint="check indentation, colons and quoting on that line or the one before")],
        ) from None
    except yaml.YAMLError as exc:
        raise InventoryError(path, [InventoryIssue("", f"YAML error: {exc}")]) from None
    except RecursionError:
        raise InventoryError(path, [InventoryIssue("", "values are nested too deeply to read",
                                                   hint="an inventory is a few levels deep; check the brackets")]) from None
    finally:
        loader.dispose()
    return data, marks


def _issues_from_validation(
    exc: ValidationError, prefix: PathKey, marks: _Marks, level_of: Any
) -> list[InventoryIssue]:
    issues = []
    for err in exc.errors(include_url=False):
        loc: PathKey = (*prefix, *err["loc"])
        ctx = err.get("ctx") or {}
        kind = err["type"]
        expected = None
        hint = ctx.get("hint")
        if kind == "extra_forbidden":
            key = str(err["loc"][-1])
            allowed = _ALLOWED_KEYS[level_of(loc[:-1])]
            message = f"unknown field `{key}`"
            expected = "one of: " + ", ".join(allowed)
            hint = _did_you_mean(key, allowed) or "see inventory/example.yaml for the documented fields"
        elif kind == "missing":
            message = "required field is missing"
            if loc[-1] == "address":
                hint = "every host needs an `address` (set it on the host entry)"
        elif kind == "invalid_value":
            message = ctx.get("reason", err["msg"])
        elif any(is_secret_field(part) for part in loc):
            # The value may be a credential (`extra_args: "--api-key sk-..."`): name its type only.
            message = f"{err['msg']} (got a {type(err.get('input')).__name__}; the value is not shown)"
            expected = err["msg"].removeprefix("Input should be ")
        else:
            message = f"{err['msg']} (got {err.get('input')!r})"
            expected = err["msg"].removeprefix("Input should be ").removeprefix("input should be ")
            if kind in ("int_type", "float_type", "bool_type") and isinstance(err.get("input"), str):
                hint = "write the value without quotes (YAML reads quoted values as text)"
        issues.append(InventoryIssue(_dotted(loc), message, marks.line_for(loc), expected, hint))
    return issues


def _level_of(path: PathKey) -> str:
    if len(path) == 0:
        return "top"
    if path[0] == "all":
        return "all" if len(path) == 1 else "host"
    if path[0] == "groups":
        return "group" if len(path) == 2 else "host"
    return "host"


def load_inventory(path: Path | str) -> Inventory:
    """Read and validate an inventory file; raises InventoryError listing every problem found."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InventoryError(path, [InventoryIssue("", "file not found", hint="pass -i PATH or set DDTREE_INVENTORY; see inventory/example.yaml")]) from None
    except IsADirectoryError:
        raise InventoryError(path, [InventoryIssue("", "is a directory, not a YAML file", hint="pass the inventory file itself")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(path, [InventoryIssue("", f"cannot read: {exc}")]) from None

    data, marks = _parse_yaml(path, text)
    issues: list[InventoryIssue] = [
        InventoryIssue(_dotted(p), "duplicate key (YAML keeps only the last one)", line, hint="remove or rename one of them")
        for p, line in marks.duplicates
    ]
    if not isinstance(data, dict):
        issues.append(InventoryIssue("", f"top level must be a mapping with `hosts:`, got {type(data).__name__}", marks.line_for(()),
                                     hint="start from inventory/example.yaml"))
        raise InventoryError(path, issues)
    context = {"base_dir": path.resolve().parent}
    try:
        shape = _InventoryFile.model_validate(data)
    except ValidationError as exc:
        issues += _issues_from_validation(exc, (), marks, _level_of)
        # Keep checking the layers that did parse, so one mistake does not hide the others.
        issues += _layer_issues(_layers_of_raw(data), context, marks)
        raise InventoryError(path, issues) from None

    all_vars = (shape.all.vars if shape.all else None) or {}
    groups = {name: g or _GroupBlock() for name, g in shape.groups.items()}
    host_entries = {name: entry or {} for name, entry in shape.hosts.items()}

    # Each layer on its own, so an error names the layer that holds the bad value.
    layers: list[tuple[PathKey, dict[str, Any]]] = [(("all", "vars"), all_vars)]
    layers += [(("groups", name, "vars"), g.vars or {}) for name, g in groups.items()]
    layers += [(("hosts", name), entry) for name, entry in host_entries.items()]
    issues += _layer_issues(layers, context, marks)

    issues += _check_names(host_entries, groups, marks)
    signers, signer_issues = _signers(shape.signers or {}, path.resolve().parent, marks)
    issues += signer_issues
    membership: dict[str, list[str]] = {h: [] for h in host_entries}
    for gname, group in groups.items():
        for i, member in enumerate(group.hosts):
            if member in membership:
                if gname not in membership[member]:
                    membership[member].append(gname)
            else:
                loc = ("groups", gname, "hosts", i)
                issues.append(InventoryIssue(_dotted(loc), f"unknown host `{member}`", marks.line_for(loc),
                                             expected="a host defined under `hosts:`",
                                             hint=_did_you_mean(member, host_entries) or "define it under `hosts:` or remove it"))
    if not host_entries:
        issues.append(InventoryIssue("hosts", "no hosts defined", marks.line_for(("hosts",)), hint="add at least one host under `hosts:`"))
    if issues:
        raise InventoryError(path, issues)

    hosts: dict[str, HostConfig] = {}
    for name, entry in host_entries.items():
        merged = dict(all_vars)
        from_group: dict[str, str] = {}
        for gname in membership[name]:
            for key, value in (groups[gname].vars or {}).items():
                if key in from_group and key not in entry and merged[key] != value:
                    loc = ("hosts", name)
                    values = "values not shown" if is_secret_field(key) else f"{merged[key]!r} vs {value!r}"
                    issues.append(InventoryIssue(
                        _dotted(loc), f"groups `{from_group[key]}` and `{gname}` both set `{key}` ({values})",
                        marks.line_for(loc), hint=f"set `{key}` on the host itself to decide, or remove it from one group"))
                merged[key] = value
                from_group[key] = gname
        merged.update(entry)
        try:
            hosts[name] = HostConfig.model_validate({**merged, "name": name, "groups": tuple(membership[name])}, context=context)
        except ValidationError as exc:
            issues += _issues_from_validation(exc, ("hosts", name), marks, _level_of)
    if not issues:
        issues += _check_jumps(hosts, marks)
        def origin(host: str, key: str) -> PathKey:
            """Where a host's setting was written: its own entry, else the group or all.vars it came from."""
            if key in host_entries[host]:
                return ("hosts", host, key)
            group = next((g for g in reversed(membership[host]) if key in (groups[g].vars or {})), None)
            return ("groups", group, "vars", key) if group else ("all", "vars", key) if key in all_vars else ("hosts", host)

        issues += _payload_refusals(hosts, marks, origin)
        for name, host in hosts.items():
            if host.sudo_password_env is not None and not host.sudo:
                loc = origin(name, "sudo_password_env")
                if not any(i.path == _dotted(loc) for i in issues):
                    issues.append(InventoryIssue(_dotted(loc), f"sudo_password_env is set but host `{name}` does not "
                                                 "use sudo", marks.line_for(loc),
                                                 hint="set `sudo: true` for it, or drop sudo_password_env"))
    if issues:
        raise InventoryError(path, issues)
    return Inventory(path=path, hosts=hosts, groups={g: tuple(m for m in hosts if m in groups[g].hosts) for g in groups},
                     signers=signers, warnings=_shared_addresses(hosts, marks))


def _layer_issues(layers: list[tuple[PathKey, dict[str, Any]]], context: dict[str, Any], marks: _Marks) -> list[InventoryIssue]:
    issues = []
    for prefix, values in layers:
        try:
            HostVars.model_validate(values, context=context)
        except ValidationError as exc:
            issues += _issues_from_validation(exc, prefix, marks, _level_of)
    return issues


def _layers_of_raw(data: dict[str, Any]) -> list[tuple[PathKey, dict[str, Any]]]:
    """The host-variable mappings of a file whose overall shape is wrong, as far as they parse."""
    layers: list[tuple[PathKey, dict[str, Any]]] = []
    all_block = data.get("all")
    if isinstance(all_block, dict) and isinstance(all_block.get("vars"), dict):
        layers.append((("all", "vars"), all_block["vars"]))
    groups = data.get("groups")
    for name, group in (groups.items() if isinstance(groups, dict) else ()):
        if isinstance(group, dict) and isinstance(group.get("vars"), dict):
            layers.append((("groups", name, "vars"), group["vars"]))
    hosts = data.get("hosts")
    for name, entry in (hosts.items() if isinstance(hosts, dict) else ()):
        if isinstance(entry, dict):
            layers.append((("hosts", name), entry))
    return layers


def _check_names(host_entries: dict[str, Any], groups: dict[str, Any], marks: _Marks) -> list[InventoryIssue]:
    issues = []
    name_hint = "names use letters, digits, `.`, `_` and `-` (they appear in logs, lock owners and --limit patterns)"
    for kind, names in (("hosts", host_entries), ("groups", groups)):
        for name in names:
            loc = (kind, name)
            if not _NAME_RE.fullmatch(name):
                issues.append(InventoryIssue(_dotted(loc), f"invalid {kind[:-1]} name {name!r}", marks.line_for(loc),
                                             expected="[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", hint=name_hint))
    for name in groups:
        loc = ("groups", name)
        if name in host_entries:
            issues.append(InventoryIssue(_dotted(loc), f"group `{name}` has the same name as a host", marks.line_for(loc),
                                         hint="rename one so --limit is unambiguous"))
        if name == "all":
            issues.append(InventoryIssue(_dotted(loc), "`all` is reserved", marks.line_for(loc), hint="put defaults under top-level `all: {vars: ...}`"))
    return issues


def _check_jumps(hosts: dict[str, HostConfig], marks: _Marks) -> list[InventoryIssue]:
    issues = []
    for name, host in hosts.items():
        if host.jump_host is not None and host.jump_host not in hosts:
            issue = _foreign_jump(name, host.jump_host, hosts, marks)
            if issue is not None:
                issues.append(issue)
                continue
        seen = [name]
        current = host
        while current.jump_host is not None and current.jump_host in hosts:
            if current.jump_host in seen:
                loc = ("hosts", name, "jump_host")
                issues.append(InventoryIssue(_dotted(loc), "jump hosts form a loop: " + " -> ".join([*seen, current.jump_host]),
                                             marks.line_for(loc), hint="a jump host must not (indirectly) jump through itself"))
                break
            seen.append(current.jump_host)
            current = hosts[current.jump_host]
    return issues


_KEY_TEXT_RE = re.compile(r"(?:ssh|ecdsa|sk)-[A-Za-z0-9@.-]+\s")


def _signers(entries: dict[str, str], base_dir: Path, marks: _Marks) -> tuple[dict[str, PublicKey], list[InventoryIssue]]:
    """`signers:` -> {name: public key}; a value is the key itself or a public key file (relative to the inventory)."""
    signers: dict[str, PublicKey] = {}
    issues: list[InventoryIssue] = []
    for name, value in entries.items():
        loc = ("signers", name)
        if not SIGNER_NAME_RE.fullmatch(name):
            issues.append(InventoryIssue(_dotted(loc), f"invalid signer name {name!r}", marks.line_for(loc),
                                         expected=SIGNER_NAME_RE.pattern,
                                         hint="use letters, digits and `_.@+-` (e.g. alice@example.com or ci)"))
            continue
        text, source = value, "the key"
        if not _KEY_TEXT_RE.match(value):
            key_file = Path(value).expanduser()
            key_file = key_file if key_file.is_absolute() else base_dir / key_file
            source = f"key file {key_file}"
            try:
                text = key_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                issues.append(InventoryIssue(_dotted(loc), f"cannot read {source}: {getattr(exc, 'strerror', None) or exc}",
                                             marks.line_for(loc), expected="`ssh-ed25519 AAAA...` or a .pub file",
                                             hint="give the signer's public key, or the path of its .pub file "
                                                  "(relative to this inventory)"))
                continue
        try:
            key = PublicKey.parse(text)
        except ValueError as exc:
            issues.append(InventoryIssue(_dotted(loc), f"{source} is not an SSH public key: {exc}", marks.line_for(loc),
                                         hint="copy the one line of the signer's .pub file (never the private key)"))
            continue
        twin = next((n for n, k in signers.items() if k.blob == key.blob), None)
        if twin is not None:
            issues.append(InventoryIssue(_dotted(loc), f"the same key as signer `{twin}`", marks.line_for(loc),
                                         hint="one key is one signer: remove one of them"))
            continue
        signers[name] = key
    return signers, issues


def _foreign_jump(name: str, jump: str, hosts: dict[str, HostConfig], marks: _Marks) -> InventoryIssue | None:
    """A jump_host that names no inventory host is an address; refuse the ones that are almost surely
    meant as an inventory host (a typo of one, or one with a user or port added), since they would
    silently connect somewhere else."""
    spec = _JUMP_RE.fullmatch(jump)
    assert spec is not None  # validated with the field
    loc = ("hosts", name, "jump_host")
    address = spec["address"]
    if address in hosts:
        return InventoryIssue(_dotted(loc), f"`{jump}` adds a user or port to inventory host `{address}`, so it is "
                              f"taken as the address `{address}`, not as that host", marks.line_for(loc),
                              hint=f"write `jump_host: {address}` and set `user`/`port` on host `{address}`")
    bare = spec["user"] is None and spec["port"] is None and "." not in address and ":" not in address
    close = difflib.get_close_matches(address, list(hosts), n=1, cutoff=0.75) if bare else []
    if close:
        return InventoryIssue(_dotted(loc), f"`{jump}` is not a host of this inventory", marks.line_for(loc),
                              hint=f"did you mean `{close[0]}`? (a jump_host naming no inventory host is taken as an "
                                   f"address; write `{jump}:22` if that machine is meant)")
    return None


def _shared_addresses(hosts: dict[str, HostConfig], marks: _Marks) -> list[InventoryIssue]:
    """Two entries that reach the same sshd (same address and port, through the same jump host) are one
    machine worked on twice at once: both take its lock and write its state dir."""
    seen: dict[tuple[str, int, str | None], str] = {}
    warnings = []
    for name, host in hosts.items():
        key = (host.address.lower(), host.port, host.jump_host)
        if key in seen:
            loc = ("hosts", name, "address")
            warnings.append(InventoryIssue(
                _dotted(loc), f"same address and port as host `{seen[key]}` ({host.address}:{host.port}"
                + (f" through {host.jump_host}" if host.jump_host else "") + ")", marks.line_for(loc),
                hint="one machine listed twice is worked on twice at once; remove one entry or fix the address"))
        else:
            seen[key] = name
    return warnings


_PAYLOAD_ARGS = Path(__file__).resolve().parent / "payload" / "sglang" / "srt" / "speculative" / "ddtree_args.py"
# The inventory field each of the payload's flags comes from.
# Longest flag first: a message about --speculative-ddtree-budget-max also starts with --speculative-ddtree-budget.
_FLAG_FIELDS = {"--speculative-ddtree-topk-cap": "ddtree_topk_cap", "--speculative-ddtree-keep-chain": "ddtree_keep_chain",
                "--speculative-ddtree-budget-max": "ddtree_budget_max", "--speculative-ddtree-budget": "ddtree_budget"}


@functools.cache
def _payload_validator() -> Any:
    """The shipped payload's own flag check (ddtree_args.handle_ddtree_server_args, stdlib only), so the
    inventory refuses exactly what the servers would refuse at start, with the payload's words."""
    spec = importlib.util.spec_from_file_location("_ddtree_payload_args", _PAYLOAD_ARGS)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (OSError, ImportError, SyntaxError):  # a payload-less install: promote still checks on the host
        return None
    return module


def _payload_refusals(hosts: dict[str, HostConfig], marks: _Marks,
                      origin: Callable[[str, str], PathKey]) -> list[InventoryIssue]:
    payload = _payload_validator()
    if payload is None:
        return []
    issues = []
    for name, host in hosts.items():
        # shadow-linear: the flag values alone (full's extra checks read extra_args, judged on the host).
        args = types.SimpleNamespace(
            speculative_algorithm="DFLASH", speculative_ddtree_mode="shadow-linear",
            speculative_num_draft_tokens=host.draft_block_size, speculative_ddtree_budget=host.ddtree_budget,
            speculative_ddtree_budget_max=host.ddtree_budget_max,
            speculative_ddtree_topk_cap=host.ddtree_topk_cap, speculative_ddtree_keep_chain=host.ddtree_keep_chain,
            speculative_ddtree_allow_hybrid_unsafe=False)
        try:
            payload.handle_ddtree_server_args(args)
        except ValueError as exc:
            message = str(exc)
            flag = next((f for f in _FLAG_FIELDS if message.startswith(f)), "--speculative-ddtree-budget")
            loc = origin(name, _FLAG_FIELDS[flag])
            if any(i.path == _dotted(loc) for i in issues):  # one report per setting, not per host that inherits it
                continue
            issues.append(InventoryIssue(
                _dotted(loc), f"the payload would refuse this at server start on host `{name}`: {message}", marks.line_for(loc),
                hint=f"{flag} is `{_FLAG_FIELDS[flag]}` here (ddtree_budget defaults to draft_block_size - 1)"))
    return issues

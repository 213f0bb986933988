"""SSH sessions to hosts: Fabric connections with strict host keys, jump hosts, retries, TCP_NODELAY.

Fabric's Connection installs paramiko's AutoAddPolicy and silently trusts any host key; here every
connection gets RejectPolicy semantics (or accept-new, when the inventory asks for it) against an
explicitly loaded known_hosts file, and ~/.ssh/config is ignored so the inventory is the only
source of truth. Commands run on a raw paramiko channel (one exec, stdin, stdout, stderr, exit
status) rather than through Invoke's runner threads, which poll and add latency per call.
"""

from __future__ import annotations

import errno
import logging
import random
import shlex
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko
from fabric import Config, Connection

from ddtree_ops.errors import OpsError
from ddtree_ops.sudo import argv as sudo_argv
from ddtree_ops.sudo import new_prompt as sudo_new_prompt
from ddtree_ops.sudo import password_for as sudo_password_for
from ddtree_ops.sudo import wrong_password as sudo_wrong_password

if TYPE_CHECKING:
    from ddtree_ops.inventory import HostConfig

# Paramiko logs handshake failures at ERROR through the root logger's last-resort handler, which
# would print raw tracebacks on stderr; our errors already say what happened.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

DEFAULT_RETRIES = 2
BACKOFF_S = 0.5
SUDO_TIMEOUT_S = 30.0  # sudo's authentication (PAM, a wrong password's delay): seconds, not minutes
_TRANSIENT_ERRNOS = {
    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT,
    errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN,
}
_known_hosts_write_lock = threading.Lock()


class ConnectionFailure(OpsError):
    """Could not open an SSH session. `unreachable` is True for network-level failures."""

    def __init__(self, message: str, *, code: str, hint: str | None = None, unreachable: bool = False) -> None:
        super().__init__(message, hint=hint, code=code)
        self.unreachable = unreachable


class RemoteTimeout(OpsError):
    code = "remote_timeout"


class SudoRefused(OpsError):
    """sudo did not run the command: a wrong password, or no answer in time."""

    code = "sudo_failed"


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, key: paramiko.PKey) -> None:
        super().__init__(f"host key for {hostname} not in known_hosts")
        self.hostname = hostname
        self.key = key


def fingerprint(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.fingerprint}"


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    """RejectPolicy, raising an exception that carries the offered key for a useful message."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise UnknownHostKey(hostname, key)


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """OpenSSH's StrictHostKeyChecking=accept-new: trust an unknown key once, append it to the
    known_hosts file and say so. A key that differs from a known one is still refused (paramiko
    raises BadHostKeyException before consulting the policy)."""

    def __init__(self, known_hosts: Path, notice: Callable[[str], None]) -> None:
        self.known_hosts = known_hosts
        self.notice = notice

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        line = paramiko.hostkeys.HostKeyEntry([hostname], key).to_line()
        with _known_hosts_write_lock:
            self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
            with self.known_hosts.open("a", encoding="utf-8") as f:
                f.write(line)
            self.known_hosts.chmod(0o600)
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.notice(f"accepted new host key for {hostname} ({fingerprint(key)}) and added it to {self.known_hosts}")


class NoBanner(paramiko.SSHException):
    """The TCP connection was accepted, but no SSH banner (or no finished key exchange) came in time."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage  # "banner" or "handshake"


class _HopError(Exception):
    def __init__(self, hop: HostConfig, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.hop = hop
        self.cause = cause


@dataclass
class RemoteResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    elapsed_s: float


def remote_command(argv: Sequence[str], *, sudo: bool = False, sudo_prompt: str | None = None) -> str:
    """The one place a remote shell line is built: every element quoted with shlex (sudo.argv adds sudo's)."""
    if sudo:
        argv = sudo_argv(argv, with_password=sudo_prompt is not None, prompt=sudo_prompt or "")
    return shlex.join(argv)


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, UnknownHostKey | paramiko.BadHostKeyException | paramiko.AuthenticationException):
        return False
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError | socket.timeout | TimeoutError):
        return True
    if isinstance(exc, socket.gaierror):
        return exc.errno == socket.EAI_AGAIN
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if isinstance(exc, paramiko.ChannelException | NoBanner):  # a jump host's target not up yet; sshd starting
        return True
    # sshd still starting, or MaxStartups throttling: the banner never arrives. "Timeout opening channel":
    # a jump host that cannot reach the target (powered off: its neighbour lookup never answers).
    return isinstance(exc, paramiko.SSHException) and any(
        words in str(exc) for words in ("protocol banner", "Timeout opening channel"))


def _describe_failure(host: HostConfig, exc: BaseException, attempts: int) -> ConnectionFailure:
    target = f"{host.user}@{host.address}:{host.port}"
    if isinstance(exc, UnknownHostKey):
        return ConnectionFailure(
            f"{host.name}: host key of {exc.hostname} ({fingerprint(exc.key)}) is not in {host.known_hosts}; refused",
            code="host_key_unknown",
            hint=f"verify that fingerprint out of band, then add it (ssh-keyscan -p {host.port} {host.address} >> "
            f"{host.known_hosts}), or set `host_key_policy: accept-new` for first contact",
        )
    if isinstance(exc, paramiko.BadHostKeyException):
        return ConnectionFailure(
            f"{host.name}: host key of {exc.hostname} CHANGED: known {exc.expected_key.fingerprint}, "
            f"offered {exc.key.fingerprint}; refused (possible man-in-the-middle)",
            code="host_key_changed",
            hint=f"if the host was reinstalled, remove its old line from {host.known_hosts} and verify the new key",
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return ConnectionFailure(
            f"{host.name}: authentication failed for {target}: {exc}",
            code="auth_failed",
            hint="check `user` and `identity_file` in the inventory, and that the key is authorized on the host",
        )
    if isinstance(exc, socket.gaierror):
        return ConnectionFailure(f"{host.name}: cannot resolve {host.address}: {exc.strerror}", code="unreachable",
                                 hint="check `address` in the inventory", unreachable=True)
    if isinstance(exc, NoBanner):
        what = ("sent no SSH banner" if exc.stage == "banner" else "sent its banner but did not finish the SSH key exchange")
        return ConnectionFailure(
            f"{host.name}: {target} accepted the TCP connection but {what} within {host.connect_timeout:g}s "
            f"({attempts} attempt(s))", code=f"{exc.stage}_timeout", unreachable=True,
            hint="sshd there may be overloaded (MaxStartups) or hung, or what listens on that port is not sshd "
                 f"(check `port`); raise connect_timeout ({host.connect_timeout:g}s) for a slow host")
    if _is_transient(exc):
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
            reason = "; ".join(sorted({e.strerror or str(e) for e in exc.errors.values()}))
        return ConnectionFailure(
            f"{host.name}: cannot reach {target} after {attempts} attempt(s): {reason}",
            code="unreachable",
            hint=f"check that the host is up and sshd listens on port {host.port}"
            + (f" (through jump host {host.jump_host})" if host.jump_host else "")
            + f"; connect_timeout is {host.connect_timeout:g}s",
            unreachable=True,
        )
    return ConnectionFailure(f"{host.name}: SSH error with {target}: {type(exc).__name__}: {exc}", code="ssh_error",
                             hint="rerun with --debug for details")


def _fabric_connection(host: HostConfig, gateway: Connection | None, notice: Callable[[str], None]) -> Connection:
    known_hosts = host.known_hosts_path
    if not known_hosts.is_file() and host.host_key_policy == "strict":
        raise ConnectionFailure(
            f"{host.name}: known_hosts file {known_hosts} does not exist, so no host key can be verified",
            code="known_hosts_missing",
            hint="set `known_hosts` in the inventory to a file holding the hosts' keys, "
            "or `host_key_policy: accept-new` for first contact",
        )
    if host.identity_path is not None and not host.identity_path.is_file():
        raise ConnectionFailure(f"{host.name}: identity_file {host.identity_path} does not exist", code="identity_missing",
                                hint="fix `identity_file` in the inventory (relative paths start at the inventory's directory)")
    connect_kwargs: dict[str, object] = {
        "banner_timeout": host.connect_timeout,
        "auth_timeout": host.connect_timeout,
        "channel_timeout": host.connect_timeout,
    }
    if host.identity_path is not None:
        # An explicit key is the only one offered: predictable, and no agent keys leak to hosts.
        connect_kwargs.update(key_filename=[str(host.identity_path)], look_for_keys=False, allow_agent=False)
    # An empty SSHConfig keeps ~/.ssh/config (and its ProxyJump, User, ...) out: the inventory decides.
    config = Config(ssh_config=paramiko.SSHConfig(), lazy=True)
    conn = Connection(
        host=host.address, user=host.user, port=host.port, config=config,
        connect_timeout=host.connect_timeout, connect_kwargs=connect_kwargs,
        gateway=gateway if gateway is not None else False,
    )
    client: paramiko.SSHClient = conn.client
    if known_hosts.is_file():
        try:
            client.load_host_keys(str(known_hosts))
        except (OSError, paramiko.SSHException) as exc:
            raise ConnectionFailure(f"{host.name}: cannot read known_hosts {known_hosts}: {exc}", code="known_hosts_invalid",
                                    hint="fix or replace the file") from None
    if host.host_key_policy == "accept-new":
        client.set_missing_host_key_policy(_AcceptNew(known_hosts, notice))
    else:
        client.set_missing_host_key_policy(_RejectUnknown())
    return conn


def _set_nodelay(conn: Connection) -> None:
    """Disable Nagle on the real TCP socket(s): an exec is several small writes (channel open,
    exec request, stdin, EOF) and Nagle + delayed ACK stalls each exchange by tens of ms."""
    transport = conn.transport
    sock = getattr(transport, "sock", None)
    if isinstance(sock, socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if isinstance(conn.gateway, Connection):
        _set_nodelay(conn.gateway)


def nodelay_enabled(conn: Connection) -> bool:
    sock = getattr(conn.transport, "sock", None)
    return isinstance(sock, socket.socket) and bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


class HostSession:
    """One SSH connection to one host; use as a context manager.

    `jump_chain` lists the hosts to hop through, nearest first (Inventory.jump_chain).
    """

    def __init__(
        self,
        host: HostConfig,
        *,
        jump_chain: Sequence[HostConfig] = (),
        retries: int = DEFAULT_RETRIES,
        nodelay: bool = True,
        notice: Callable[[str], None] | None = None,
    ) -> None:
        self.host = host
        self.jump_chain = list(jump_chain)
        self.retries = retries
        self.nodelay = nodelay
        self.notices: list[str] = []
        self._notice_sink = notice
        self.conn: Connection | None = None
        self.attempts = 0

    def _notice(self, message: str) -> None:
        self.notices.append(message)
        if self._notice_sink is not None:
            self._notice_sink(message)

    def open(self) -> HostSession:
        """Connect, retrying transient failures (refused, reset, no route, timeout, no banner).

        Retries stop after `retries` or once a whole connect_timeout has been spent: a refused
        port (sshd restarting) is retried quickly, while a host that times out is not waited
        for three times over.
        """
        started = time.monotonic()
        for attempt in range(self.retries + 1):
            self.attempts = attempt + 1
            try:
                self.conn = self._connect_once()
                return self
            except _HopError as failed:
                out_of_time = time.monotonic() - started >= self.host.connect_timeout
                if not _is_transient(failed.cause) or attempt == self.retries or out_of_time:
                    raise _describe_failure(failed.hop, failed.cause, self.attempts) from failed.cause
            # Exponential backoff with jitter so a fleet does not retry in lockstep.
            time.sleep(BACKOFF_S * (2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable: the last attempt raises")

    def _connect_once(self) -> Connection:
        """One attempt through every hop; a failure is wrapped with the hop it happened on."""
        gateway: Connection | None = None
        for hop in [*reversed(self.jump_chain), self.host]:  # the outermost hop is opened first
            conn = _fabric_connection(hop, gateway, self._notice)
            try:
                conn.open()
            except Exception as exc:
                transport = conn.client.get_transport()
                if transport is not None and not isinstance(exc, UnknownHostKey | paramiko.BadHostKeyException):
                    if not transport.remote_version or not transport.initial_kex_done:
                        # TCP is up (the transport exists) but the handshake is not: paramiko's start_client
                        # returns at its timeout without raising, and the auth that follows fails with "No
                        # existing session", which is no authentication failure.
                        exc = NoBanner("banner" if not transport.remote_version else "handshake")
                    elif transport.is_active() and not transport.is_authenticated():
                        # Keys were offered and refused; paramiko may surface this as a key-parsing
                        # SSHException from trying the file as another key type, so name it here.
                        exc = paramiko.AuthenticationException(str(exc))
                conn.close()
                raise _HopError(hop, exc) from exc
            gateway = conn
        assert gateway is not None
        if self.nodelay:
            _set_nodelay(gateway)
        return gateway

    def close(self) -> None:
        if self.conn is not None:
            gateway = self.conn.gateway
            self.conn.close()
            while isinstance(gateway, Connection):
                gateway.close()
                gateway = gateway.gateway
            self.conn = None

    def __enter__(self) -> HostSession:
        return self.open() if self.conn is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def run(self, argv: Sequence[str], *, stdin: bytes = b"", timeout: float | None = 120.0,
            ready: bytes | None = None) -> RemoteResult:
        """Run argv on the host, feeding stdin; under sudo when the host sets `sudo`. `ready` is the line the
        command prints before it reads stdin (the agent's, with --ready): only with it can a sudo password be
        given (sudo.py says why); without it a host that needs one fails with sudo's own "password is required"."""
        password = sudo_password_for(self.host) if self.host.sudo and ready is not None else None
        if password is None:
            return self.run_command(remote_command(argv, sudo=self.host.sudo), stdin=stdin, timeout=timeout)
        prompt = sudo_new_prompt()
        return self.run_command(remote_command(argv, sudo=True, sudo_prompt=prompt), stdin=stdin, timeout=timeout,
                                become=(prompt.encode(), password, ready))

    def run_command(self, command: str, *, stdin: bytes = b"", timeout: float | None = 120.0,
                    become: tuple[bytes, str, bytes] | None = None) -> RemoteResult:
        """Run an already-quoted command line. Prefer run(argv). `become`: (sudo's prompt, the password, the
        command's ready line) for a command under `sudo -S`."""
        if self.conn is None:
            self.open()
        assert self.conn is not None and self.conn.transport is not None
        started = time.monotonic()
        try:
            chan = self.conn.transport.open_session(timeout=timeout)
        except paramiko.SSHException as exc:
            raise ConnectionFailure(f"{self.host.name}: cannot open an SSH channel: {exc}", code="ssh_error") from None
        try:
            chan.settimeout(timeout)
            chan.exec_command(command)
            stdout, stderr = bytearray(), bytearray()
            if become is not None:
                self._sudo_handshake(chan, become, stdout, stderr, min(timeout or SUDO_TIMEOUT_S, SUDO_TIMEOUT_S))

            def drain_stderr() -> None:
                try:
                    while chunk := chan.recv_stderr(65536):
                        stderr.extend(chunk)
                except (TimeoutError, OSError):
                    pass

            reader = threading.Thread(target=drain_stderr, daemon=True)
            reader.start()
            try:
                if stdin:
                    chan.sendall(stdin)
                chan.shutdown_write()
            except OSError:
                # The command exited (and sshd closed the channel) before reading all of its
                # stdin, e.g. a missing interpreter answering 127: its exit status still counts.
                pass
            while chunk := chan.recv(65536):
                stdout.extend(chunk)
            if not chan.status_event.wait(timeout):
                raise TimeoutError("no exit status")
            reader.join(timeout)
            return RemoteResult(chan.recv_exit_status(), bytes(stdout), bytes(stderr), time.monotonic() - started)
        except TimeoutError:
            raise RemoteTimeout(
                f"{self.host.name}: remote command did not finish within {timeout:g}s",
                hint="the host may be overloaded or the command hung; rerun with a larger timeout",
            ) from None
        finally:
            chan.close()

    def _sudo_handshake(self, chan: paramiko.Channel, become: tuple[bytes, str, bytes], stdout: bytearray,
                        stderr: bytearray, limit_s: float) -> None:
        """Until the command says it is ready (or sudo gives up): answer sudo's prompt with the password, once.
        Polls both streams, which is only done here, for the few round trips of sudo's authentication."""
        prompt, password, ready = become
        answered = False
        deadline = time.monotonic() + limit_s
        while True:
            while chan.recv_stderr_ready():
                stderr.extend(chan.recv_stderr(65536))
            while chan.recv_ready():
                stdout.extend(chan.recv(65536))
            if ready + b"\n" in stdout:
                del stdout[: stdout.index(ready + b"\n") + len(ready) + 1]
                break
            prompts = stderr.count(prompt)
            if prompts >= 2:  # asked again: the password was wrong; never try it a second time (lockouts)
                wrong = sudo_wrong_password(self.host.user)
                raise SudoRefused(f"{self.host.name}: {wrong.message}", code=wrong.code, hint=wrong.hint)
            if prompts == 1 and not answered:
                chan.sendall(password.encode() + b"\n")
                answered = True
            if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                break  # sudo gave up on its own: the caller reads its exit status and words
            if time.monotonic() > deadline:
                said = stderr.replace(prompt, b"").decode("utf-8", "replace").strip()[-300:]
                raise SudoRefused(f"{self.host.name}: sudo did not start the command within {limit_s:g}s"
                                  + (f"; it said: {said}" if said else ""), code="sudo_timeout",
                                  hint="something other than a password prompt may be waiting (an OTP, a PAM "
                                       "module): run `sudo -v` as that user on the host")
            time.sleep(0.005)
        stderr[:] = stderr.replace(prompt, b"")

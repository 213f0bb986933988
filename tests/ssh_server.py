"""A tiny in-process SSH server (paramiko) for unit tests of ssh.py and the agent round trip.

It accepts one public key, runs each exec request with `sh -c` as the current user (in `env` when
given), serves SFTP on the local files (enough for push's upload) and records every command it was
asked to run, so tests can assert that a refused connection ran nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import paramiko


class _Handler(paramiko.ServerInterface):
    def __init__(self, server: LocalSSHServer) -> None:
        self.server = server
        self.pending_forwards: dict[int, tuple] = {}

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        if key == self.server.authorized_key:
            return paramiko.AUTH_SUCCESSFUL
        return paramiko.AUTH_FAILED

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_direct_tcpip_request(self, chanid: int, origin: tuple, destination: tuple) -> int:
        # Jump-host support: remember where this channel goes; _serve_channels bridges it.
        self.server.forwards.append(destination)
        self.pending_forwards[chanid] = destination
        return paramiko.OPEN_SUCCEEDED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        self.server.commands.append(command.decode())
        threading.Thread(target=_execute, args=(channel, command.decode(), self.server.env), daemon=True).start()
        return True


def _execute(channel: paramiko.Channel, command: str, env: dict[str, str] | None = None) -> None:
    proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)

    def feed() -> None:
        assert proc.stdin is not None
        try:
            while data := channel.recv(65536):
                proc.stdin.write(data)
                proc.stdin.flush()  # as sshd does: a command may answer before its input ends (sudo -S)
            proc.stdin.close()
        except BrokenPipeError:  # the command exited without reading all of its stdin
            pass

    def pump(stream, send) -> None:
        # A client may close its channel at any time (as on a wrong sudo password): the rest is read and
        # dropped, so the command never blocks on a full pipe.
        while data := stream.read1(65536):
            with contextlib.suppress(OSError):
                send(data)

    threads = [threading.Thread(target=feed, daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, channel.sendall_stderr), daemon=True)]
    for t in threads:
        t.start()
    pump(proc.stdout, channel.sendall)
    threads[1].join()
    channel.send_exit_status(proc.wait())
    # paramiko acknowledges the exec request only after check_channel_exec_request returns, and this
    # thread starts inside it: a quick command could close the channel before that reply, and the
    # client's exec_command then fails with "Channel closed" (once in a CI run, 2026-12-02). Close once the
    # client's EOF has arrived, which it sends only after the acknowledgement, as sshd's order is.
    threads[0].join(timeout=30)
    channel.close()


class _LocalSFTPHandle(paramiko.SFTPHandle):
    def stat(self):
        return paramiko.SFTPAttributes.from_stat(os.fstat(self.readfile.fileno()))


class _LocalSFTP(paramiko.SFTPServerInterface):
    """The SFTP subsystem on this machine's own files, as the current user: enough for `sftp.put` (push's upload)."""

    def open(self, path, flags, attr):
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            return paramiko.SFTPServer.convert_errno(exc.errno)
        mode = "r+b" if flags & (os.O_WRONLY | os.O_RDWR) else "rb"
        f = os.fdopen(fd, mode if not flags & os.O_APPEND else "ab")
        handle = _LocalSFTPHandle(flags)
        handle.readfile = handle.writefile = f
        return handle

    def stat(self, path):
        try:
            return paramiko.SFTPAttributes.from_stat(os.stat(path))
        except OSError as exc:
            return paramiko.SFTPServer.convert_errno(exc.errno)

    lstat = stat

    def remove(self, path):
        try:
            os.remove(path)
        except OSError as exc:
            return paramiko.SFTPServer.convert_errno(exc.errno)
        return paramiko.SFTP_OK


def _serve_channels(transport: paramiko.Transport, handler: _Handler) -> None:
    while transport.is_active():
        chan = transport.accept(1)
        if chan is None:
            continue
        destination = handler.pending_forwards.pop(chan.get_id(), None)
        if destination is not None:
            threading.Thread(target=_bridge, args=(chan, destination), daemon=True).start()


def _bridge(chan: paramiko.Channel, destination: tuple) -> None:
    try:
        upstream = socket.create_connection(destination, timeout=5)
    except OSError:
        chan.close()
        return

    def forward(read, write) -> None:
        try:
            while data := read(65536):
                write(data)
        except (OSError, EOFError):
            pass
        finally:
            # Both directions close both ends; the second close can meet a transport that the
            # client already tore down (paramiko raises EOFError then), which is the normal end.
            with contextlib.suppress(OSError, EOFError):
                chan.close()
            upstream.close()

    threading.Thread(target=forward, args=(chan.recv, upstream.sendall), daemon=True).start()
    forward(upstream.recv, chan.sendall)


@dataclass
class LocalSSHServer:
    host_key: paramiko.PKey
    authorized_key: paramiko.PKey
    commands: list[str] = field(default_factory=list)
    forwards: list[tuple] = field(default_factory=list)
    port: int = 0
    connections: int = 0
    env: dict[str, str] | None = None  # the commands' environment (None: this process's), e.g. a PATH

    def start(self) -> LocalSSHServer:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            transport = paramiko.Transport(client)
            transport.add_server_key(self.host_key)
            transport.set_subsystem_handler("sftp", paramiko.SFTPServer, _LocalSFTP)
            handler = _Handler(self)
            try:
                transport.start_server(server=handler)
            except (paramiko.SSHException, EOFError, OSError):
                transport.close()
                continue
            threading.Thread(target=_serve_channels, args=(transport, handler), daemon=True).start()

    def stop(self) -> None:
        self._sock.close()

    def known_hosts_line(self) -> str:
        return paramiko.hostkeys.HostKeyEntry([f"[127.0.0.1]:{self.port}"], self.host_key).to_line()


def write_private_key(key: paramiko.PKey, path: Path) -> Path:
    key.write_private_key_file(str(path))
    return path

"""A local TCP port forwarded over a host's SSH session to its server's HTTP port.

Serving ports (127.0.0.1:30000 on a GPU host) are rarely reachable from an operator's laptop, and
should not need to be: the gates talk HTTP to `http://127.0.0.1:<local port>` and every connection
is carried by a `direct-tcpip` channel of the SSH connection the host already has (what
`ssh -L` does). Nothing listens beyond this machine's loopback.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import paramiko

    from ddtree_ops.ssh import HostSession


def _pump(client: socket.socket, channel: paramiko.Channel) -> None:
    try:
        while True:
            ready, _, _ = select.select([client, channel], [], [], 1.0)
            if client in ready:
                data = client.recv(65536)
                if not data:
                    break
                channel.sendall(data)
            if channel in ready:
                data = channel.recv(65536)
                if not data:
                    break
                client.sendall(data)
    except OSError:
        pass
    finally:
        channel.close()
        client.close()


@contextlib.contextmanager
def forward(session: HostSession, remote_host: str, remote_port: int) -> Iterator[int]:
    """Yield a local port whose connections reach remote_host:remote_port as seen from the host."""
    if session.conn is None:
        session.open()
    assert session.conn is not None and session.conn.transport is not None
    transport = session.conn.transport
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.5)
    stop = threading.Event()

    def accept_loop() -> None:
        while not stop.is_set():
            try:
                client, peer = listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                channel = transport.open_channel("direct-tcpip", (remote_host, remote_port), peer, timeout=10)
            except Exception:  # refused by the host (server down): the HTTP client sees a closed connection
                client.close()
                continue
            threading.Thread(target=_pump, args=(client, channel), daemon=True, name="ddtree-tunnel").start()

    thread = threading.Thread(target=accept_loop, daemon=True, name="ddtree-tunnel-accept")
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(2)
        listener.close()

"""Fixtures shared by the unit tests (tests/lab/ has its own conftest for the lab fleet)."""

from __future__ import annotations

import signal
import socket
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
import yaml
from ssh_server import LocalSSHServer, write_private_key


@pytest.fixture(autouse=True)
def _sigint_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves its own SIGINT handler behind would turn every later Ctrl-C test (and pytest's own
    Ctrl-C) into a hang: put the handler back and name the test in the warnings summary."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        signal.signal(signal.SIGINT, before)
        warnings.warn(f"{request.node.nodeid} left SIGINT's handler changed ({after!r}, was {before!r}); restored",
                      stacklevel=1)


@pytest.fixture
def two_host_inventory(tmp_path: Path) -> Iterator[Path]:
    client_key = paramiko.ECDSAKey.generate()
    server = LocalSSHServer(host_key=paramiko.ECDSAKey.generate(), authorized_key=client_key).start()
    write_private_key(client_key, tmp_path / "id_ecdsa")
    (tmp_path / "known_hosts").write_text(server.known_hosts_line())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    inventory = {
        "all": {"vars": {"identity_file": "id_ecdsa", "known_hosts": "known_hosts", "python": sys.executable,
                         "state_dir": str(tmp_path / "state"), "connect_timeout": 3}},
        "hosts": {"up": {"address": "127.0.0.1", "port": server.port},
                  "down": {"address": "127.0.0.1", "port": dead_port}},
    }
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inventory))
    yield path
    server.stop()

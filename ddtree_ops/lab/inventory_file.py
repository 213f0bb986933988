"""The ready inventory `lab up` writes: inventory/lab.yaml, inventory/lab/id_ed25519, inventory/lab/known_hosts,
and the bundle signing key inventory/lab/signer_ed25519 (+ .pub) that the rehearsal signs with and lab.yaml trusts.

Paths inside lab.yaml are relative to the file, as the inventory loader resolves them. All of them
are git-ignored; they are copies of the lab's state (the lab is the trust root for the host keys).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ddtree_ops.lab.config import (
    BASTION,
    DRAFT_MODEL,
    HOST_STATE_DIR,
    OPERATOR,
    SERVE_PORT,
    SERVER_MODULE,
    SERVICE,
    SSH_PORT,
    TARGET_MODEL,
    VENV_DIR,
    LabPaths,
    host_address,
)
from ddtree_ops.lab.host import LabHost

INVENTORY_NAME = "lab.yaml"
FILES_DIR = "lab"
SIGNER_KEY = "signer_ed25519"


def path(repo_root: Path) -> Path:
    return repo_root / "inventory" / INVENTORY_NAME


def render(hosts: list[LabHost]) -> dict[str, object]:
    names = [h.name for h in hosts]
    groups: dict[str, object] = {"canary": {"hosts": names[:1]}}
    if names[1:]:
        groups["main"] = {"hosts": names[1:]}
    return {
        "all": {
            "vars": {
                # As on a real GPU fleet: log in as yourself, through the bastion, and let sudo run the agent.
                "user": OPERATOR,
                "sudo": True,
                "jump_host": f"{OPERATOR}@{host_address(0)}",
                "identity_file": f"{FILES_DIR}/id_ed25519",
                "known_hosts": f"{FILES_DIR}/known_hosts",
                "python": f"{VENV_DIR}/bin/python",
                "service": SERVICE,
                "state_dir": HOST_STATE_DIR,
                "serve_port": SERVE_PORT,
                "server_module": SERVER_MODULE,
                "model_path": TARGET_MODEL,
                "draft_model_path": DRAFT_MODEL,
                # prepare_server_args refuses a machine with no accelerator unless told CPU.
                "extra_args": ["--device", "cpu"],
            }
        },
        "groups": groups,
        "hosts": {h.name: _host_vars(h) for h in hosts},
        # push accepts only bundles signed by this key (`build --sign-key inventory/lab/signer_ed25519`).
        "signers": {"lab": f"{FILES_DIR}/{SIGNER_KEY}.pub"},
    }


def _host_vars(h: LabHost) -> dict[str, object]:
    out: dict[str, object] = {"address": h.address, "port": SSH_PORT}
    if h.python != f"{VENV_DIR}/bin/python":
        # A host on another SGLang runs its own venv's interpreter (push reads its version from there).
        out["python"] = h.python
    return out


def write(repo_root: Path, paths: LabPaths, hosts: list[LabHost]) -> Path:
    import yaml  # lazy: keeps `import ddtree_ops.lab.cli` light

    target = path(repo_root)
    files = target.parent / FILES_DIR
    files.mkdir(parents=True, exist_ok=True)
    _copy_private(paths.client_key, files / "id_ed25519")
    shutil.copyfile(paths.client_key.with_suffix(".pub"), files / "id_ed25519.pub")
    _copy_private(paths.signing_key, files / SIGNER_KEY)
    shutil.copyfile(paths.signing_key.with_suffix(".pub"), files / f"{SIGNER_KEY}.pub")
    shutil.copyfile(paths.known_hosts, files / "known_hosts")
    header = ("# Written by `ddtree-ops lab up`; rewritten on every run, removed by `ddtree-ops lab down`.\n"
              f"# jump_host is {BASTION}, the only lab host this machine reaches by ssh.\n")
    text = header + yaml.safe_dump(render(hosts), sort_keys=False, default_flow_style=None, width=200)
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
    return target


def remove(repo_root: Path) -> None:
    target = path(repo_root)
    target.unlink(missing_ok=True)
    shutil.rmtree(target.parent / FILES_DIR, ignore_errors=True)


def _copy_private(src: Path, dst: Path) -> None:
    # ssh refuses a private key that others can read, so create it 0600 before writing the bytes.
    tmp = dst.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(src.read_bytes())
    os.replace(tmp, dst)

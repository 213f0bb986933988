"""Bundle signatures: an SSH signature (`ssh-keygen -Y sign`) over the bundle's bytes, kept beside
it as `<bundle>.sig`, checked against the inventory's trusted `signers:`.

Why SSH signatures and not minisign: operators already hold SSH keys (in ssh-agent, on hardware
tokens) and OpenSSH's ssh-keygen is on every machine that runs this tool, so signing needs no new
tool and no second kind of key to distribute and revoke.

What is signed: the whole bundle file, byte for byte. The manifest and every file are inside it,
so a bundle whose files were changed and whose manifest was re-hashed to match (which passes the
hash check on its own) no longer matches its signature. The namespace keeps a signature that the
same key made for something else (a git commit, `-n file`) from passing as a bundle signature.

Who is trusted: only the keys the inventory names. The signature's own key is looked up among
them (by its public key blob, never by a name inside the signature), then `ssh-keygen -Y verify`
checks it with an allowed-signers file holding that one key, limited to our namespace.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree_ops.errors import OpsError, UsageError

NAMESPACE = "ddtree-ops-bundle"
SIG_SUFFIX = ".sig"
# Signer names become allowed-signers principals: no commas, wildcards, `!` or quotes there.
SIGNER_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,63}")
_ARMOR_BEGIN, _ARMOR_END = "-----BEGIN SSH SIGNATURE-----", "-----END SSH SIGNATURE-----"
_KEY_TYPE_NAMES = {"ssh-ed25519": "ED25519", "ssh-rsa": "RSA", "sk-ssh-ed25519@openssh.com": "ED25519-SK",
                   "sk-ecdsa-sha2-nistp256@openssh.com": "ECDSA-SK"}
SSH_KEYGEN_TIMEOUT_S = 120.0


class SignatureError(OpsError):
    """A bundle's signature is missing, not trusted or does not match; the bundle is refused."""

    code = "bundle_signature"


@dataclass(frozen=True)
class PublicKey:
    """An SSH public key: its type and wire-format blob (what fingerprints and comparisons use)."""

    key_type: str
    blob: bytes

    @classmethod
    def parse(cls, text: str) -> PublicKey:
        """`<type> <base64> [comment]`, as in a .pub file or authorized_keys. Raises ValueError."""
        if "PRIVATE KEY" in text:
            raise ValueError("this is a PRIVATE key: give the public one (its .pub file)")
        parts = text.strip().split()
        if len(parts) < 2:
            raise ValueError("expected `<key type> <base64 key> [comment]`, as in a .pub file")
        try:
            blob = base64.b64decode(parts[1], validate=True)
        except binascii.Error:
            raise ValueError("the key's base64 part does not decode") from None
        inner = _read_string(blob, 0)[0] if len(blob) >= 4 else b""
        if inner.decode("ascii", "replace") != parts[0]:
            raise ValueError(f"the key says it is `{parts[0]}` but its data is not one")
        return cls(parts[0], blob)

    @property
    def fingerprint(self) -> str:
        digest = base64.b64encode(hashlib.sha256(self.blob).digest()).decode().rstrip("=")
        return f"SHA256:{digest}"

    def describe(self) -> str:
        kind = _KEY_TYPE_NAMES.get(self.key_type) or ("ECDSA" if self.key_type.startswith("ecdsa-") else self.key_type)
        return f"{kind} {self.fingerprint}"

    def openssh(self) -> str:
        return f"{self.key_type} {base64.b64encode(self.blob).decode()}"


@dataclass(frozen=True)
class Signature:
    """What a check found: who signed (an inventory signer name, None when the key is unknown)."""

    signed: bool
    signer: str | None = None
    key: str | None = None  # `ED25519 SHA256:...`
    trusted: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"signed": self.signed, "signer": self.signer, "key": self.key, "trusted": self.trusted,
                "namespace": NAMESPACE}

    def describe(self) -> str:
        if not self.signed:
            return "UNSIGNED"
        if self.trusted:
            return f"signed by {self.signer} ({self.key})"
        return f"signed by a key the inventory does not trust ({self.key})"


def signature_path(bundle: str | os.PathLike[str]) -> Path:
    p = Path(bundle)
    return p.with_name(p.name + SIG_SUFFIX)


# ----------------------------------------------------------------------------------- the signature file
def _read_string(data: bytes, at: int) -> tuple[bytes, int]:
    if at + 4 > len(data):
        raise ValueError("truncated")
    n = int.from_bytes(data[at:at + 4], "big")
    if at + 4 + n > len(data):
        raise ValueError("truncated")
    return data[at + 4:at + 4 + n], at + 4 + n


def _parse_sshsig(text: str) -> tuple[PublicKey, str]:
    """(the signing key, the namespace) of an armored SSH signature (PROTOCOL.sshsig); ValueError if it is not one."""
    body = text.strip()
    if not (body.startswith(_ARMOR_BEGIN) and body.endswith(_ARMOR_END)):
        raise ValueError(f"not an SSH signature (no {_ARMOR_BEGIN} armor)")
    try:
        raw = base64.b64decode("".join(body[len(_ARMOR_BEGIN):-len(_ARMOR_END)].split()), validate=True)
    except binascii.Error:
        raise ValueError("its base64 does not decode") from None
    if raw[:6] != b"SSHSIG" or len(raw) < 10:
        raise ValueError("not an SSH signature (no SSHSIG magic)")
    blob, at = _read_string(raw, 10)
    namespace, _ = _read_string(raw, at)
    key_type = _read_string(blob, 0)[0].decode("ascii", "replace")
    return PublicKey(key_type, blob), namespace.decode("utf-8", "replace")


# ----------------------------------------------------------------------------------- ssh-keygen
def _ssh_keygen() -> str:
    exe = shutil.which("ssh-keygen")
    if exe is None:
        raise OpsError("ssh-keygen not found: bundle signatures are made and checked with OpenSSH's ssh-keygen",
                       hint="install OpenSSH's client tools (Debian: apt-get install openssh-client)",
                       code="ssh_keygen_missing")
    return exe


def _run_keygen(args: list[str], stdin_file: Path) -> subprocess.CompletedProcess[bytes]:
    with stdin_file.open("rb") as message:
        return subprocess.run([_ssh_keygen(), *args], stdin=message, capture_output=True,
                              timeout=SSH_KEYGEN_TIMEOUT_S, check=False)


def signing_key(key_file: str | os.PathLike[str]) -> Path:
    """The key file to sign with, checked before anything is built. Raises UsageError when it is missing."""
    key = Path(key_file).expanduser()
    if not key.is_file():
        raise UsageError(f"signing key {key} does not exist", code="signing_key_missing",
                         hint="pass --sign-key PATH: an SSH private key, or the .pub of a key held by ssh-agent")
    return key


def sign_bundle(bundle: str | os.PathLike[str], key_file: str | os.PathLike[str]) -> Signature:
    """Sign `bundle` with an SSH private key (or a .pub whose private half is in ssh-agent) and write
    `<bundle>.sig` atomically. Raises UsageError for a missing key, SignatureError when ssh-keygen fails."""
    bundle, key = Path(bundle), signing_key(key_file)
    # stdin → stdout keeps ssh-keygen from writing `<file>.sig` itself, so a failure leaves no half-written
    # signature, and os.replace makes the new one appear whole.
    out = _run_keygen(["-Y", "sign", "-q", "-f", str(key), "-n", NAMESPACE], bundle)
    if out.returncode != 0 or _ARMOR_BEGIN.encode() not in out.stdout:
        reason = out.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {out.returncode}"]
        raise SignatureError(f"signing {bundle.name} with {key} failed: {reason[0]}", code="sign_failed",
                             hint="check the key (a passphrase needs a terminal or ssh-agent); the bundle is left unsigned")
    sig = signature_path(bundle)
    tmp = sig.with_name(sig.name + ".tmp")
    try:
        tmp.write_bytes(out.stdout)
        os.replace(tmp, sig)
    finally:
        tmp.unlink(missing_ok=True)  # after a Ctrl-C or a full disk: no stray half-written file
    signer_key, _ = _parse_sshsig(out.stdout.decode())
    return Signature(True, None, signer_key.describe(), trusted=False)


def _verify_with(bundle: Path, sig: Path, principal: str, key: PublicKey, workdir: Path) -> bool:
    allowed = workdir / "allowed_signers"
    allowed.write_text(f'{principal} namespaces="{NAMESPACE}" {key.openssh()}\n')
    out = _run_keygen(["-Y", "verify", "-f", str(allowed), "-I", principal, "-n", NAMESPACE, "-s", str(sig)], bundle)
    return out.returncode == 0


def check_signature(bundle: str | os.PathLike[str], signers: Mapping[str, PublicKey], *,
                    allow_unsigned: bool = False) -> Signature:
    """The signature policy of push and `build --verify`: the bundle must carry a signature by one of
    `signers` that matches its bytes. `allow_unsigned` accepts a bundle with no signature or with one by
    a key the inventory does not name (reported as such); a signature that does not match the bundle's
    bytes is refused even then, since that bundle changed after someone signed it."""
    bundle = Path(bundle)
    sig = signature_path(bundle)
    fix = (f"sign it (ddtree-ops build --sign-key KEY, or ssh-keygen -Y sign -n {NAMESPACE} -f KEY {bundle.name}) "
           "with a key listed under `signers:` in the inventory")
    if not sig.is_file():
        if allow_unsigned:
            return Signature(False)
        raise SignatureError(f"{bundle.name} is not signed (no {sig.name} beside it); refused",
                             code="bundle_unsigned", hint=f"{fix}, or pass --allow-unsigned to accept it anyway")
    try:
        key, namespace = _parse_sshsig(sig.read_text(encoding="ascii", errors="replace"))
    except ValueError as exc:
        raise SignatureError(f"{sig}: {exc}; refused", code="bundle_bad_signature", hint=fix) from None
    if namespace != NAMESPACE:
        raise SignatureError(f"{sig.name} is a signature for `{namespace}`, not a bundle signature (`{NAMESPACE}`); refused",
                             code="bundle_bad_signature", hint=fix)
    name = next((n for n, k in signers.items() if k.blob == key.blob), None)
    with tempfile.TemporaryDirectory(prefix="ddtree-sig-") as tmp:
        # An unknown key is still checked against the bytes (as a throwaway principal), so that
        # --allow-unsigned never accepts a bundle that changed after it was signed.
        matches = _verify_with(bundle, sig, name or "unknown-signer", key, Path(tmp))
    if not matches:
        who = name or f"an untrusted key ({key.describe()})"
        raise SignatureError(
            f"{bundle.name}: the signature by {who} does not match the bundle's bytes: the bundle changed after it "
            "was signed (or the .sig belongs to another build); refused", code="bundle_bad_signature",
            hint="rebuild and sign the bundle; never push one whose signature fails")
    if name is None:
        trusted = ", ".join(signers) or "none: the inventory has no `signers:`"
        if allow_unsigned:
            return Signature(True, None, key.describe(), trusted=False)
        raise SignatureError(f"{bundle.name} is signed by {key.describe()}, which is not a trusted signer "
                             f"(trusted: {trusted}); refused", code="bundle_signer_unknown",
                             hint="add that public key under `signers:` in the inventory if it is to be trusted, "
                                  "or pass --allow-unsigned to accept it anyway")
    return Signature(True, name, key.describe(), trusted=True)

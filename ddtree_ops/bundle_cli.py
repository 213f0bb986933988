"""CLI command `build`: a thin wrapper over bundle.py (build a payload bundle, or re-check one).

Registered on the main app by `register(app)` (called from cli.py); options from cli_common. Works on this machine only,
so it takes no inventory; --json prints one document on stdout; exit 0 ok / 1 build or verify
failed / 2 usage error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ddtree_ops.cli_common import JsonOption, reported_errors
from ddtree_ops.errors import UsageError


def _describe(manifest: Any, bundle_path: Path | None, bundle_sha256: str | None, source: str | None) -> dict[str, Any]:
    return {
        "ok": True,
        "bundle": str(bundle_path) if bundle_path else None,
        "bundle_sha256": bundle_sha256,
        "pristine_source": source,
        "manifest": manifest.model_dump(),
    }


def _render(doc: dict[str, Any], verb: str) -> None:
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
    where = f" → {doc['bundle']}" if doc["bundle"] else ""
    source = f" (pristine files from {doc['pristine_source']})" if doc["pristine_source"] else ""
    console.print(f"{verb}{where}{source}; bundle sha256 {doc['bundle_sha256']}")


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
        verify: Annotated[Path | None, typer.Option("--verify", metavar="BUNDLE",
                          help="Re-check an existing bundle instead of building: every file's sha256 "
                               "against its manifest, nothing extra, no links.")] = None,
        json_output: JsonOption = False,
    ) -> None:
        """Build the DDTree payload bundle, or re-check one with --verify.

        Pristine files of the pinned sglang come from one of --wheel, --from-python or --download
        (the default), each checked against the wheel's RECORD; patches apply strictly (no fuzz).
        Writes OUT/ddtree-payload-<version>.tar.gz; two builds of the same source are identical
        apart from the manifest's build time (set SOURCE_DATE_EPOCH for byte-identical output).
        """
        with reported_errors(json_output):
            from ddtree_ops import bundle as bundle_lib
            from ddtree_ops.output import emit_json

            if verify is not None:
                if wheel or from_python or download or payload:
                    raise UsageError("--verify re-checks a bundle; it takes no pristine source or payload",
                                     hint="drop --wheel/--from-python/--download/--payload")
                manifest = bundle_lib.verify_bundle(verify)
                doc = _describe(manifest, verify, bundle_lib.sha256_hex(verify.read_bytes()), None)
                verb = "verified"
            else:
                sources = [name for name, given in (("--wheel", wheel), ("--from-python", from_python),
                                                    ("--download", download)) if given]
                if len(sources) > 1:
                    raise UsageError(f"choose one pristine source, got {', '.join(sources)}",
                                     hint="--wheel PATH, --from-python PYTHON or --download")
                # No source named: the registry's wheel (cached), the one that is checkable anywhere.
                download = download or not sources
                result = bundle_lib.build_bundle(payload, out, wheel=wheel, python=from_python,
                                                        download=download)
                doc = _describe(result.manifest, result.bundle_path, result.bundle_sha256, result.source)
                verb = "built"
            if json_output:
                emit_json(doc)
            else:
                _render(doc, verb)

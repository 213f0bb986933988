"""scripts/rehearsal_summary.py reads push's --json document in both forms: one bundle (`bundle`) and one per
SGLang base (`bundles`, with no `bundle` key when push was given bundles for several bases)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "rehearsal_summary.py"


def _script():
    spec = importlib.util.spec_from_file_location("rehearsal_summary_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SUMMARY = {"hosts": 2, "ok": 2, "failed": []}
SIGNED = {"signed": True, "signer": "ci", "key": "ab12"}


def test_push_with_one_bundle() -> None:
    doc = {"summary": SUMMARY, "results": [], "bundle": {"path": "a.tar.gz", "signature": SIGNED},
           "bundles": [{"path": "a.tar.gz", "signature": SIGNED, "base_version": "0.5.13.post1"}]}
    assert _script().describe("push", doc, 1.0) == ["2/2 hosts ok", "    bundle signed by ci (ab12)"]


def test_push_with_bundles_for_several_bases() -> None:
    doc = {"summary": SUMMARY, "results": [],
           "bundles": [{"path": "a.tar.gz", "signature": SIGNED, "base_version": "0.5.13.post1"},
                       {"path": "b.tar.gz", "signature": {"signed": False}, "base_version": "0.5.23"}]}
    assert _script().describe("push", doc, 1.0) == [
        "2/2 hosts ok", "    bundle for SGLang 0.5.13.post1 signed by ci (ab12)",
        "    bundle for SGLang 0.5.23 UNSIGNED (--allow-unsigned)"]


def test_push_with_an_old_document_and_no_signature() -> None:
    s = _script()
    assert s.describe("push", {"summary": SUMMARY, "results": [], "bundle": {"path": "a", "signature": None}},
                      1.0) == ["2/2 hosts ok"]
    assert s.describe("push", {"summary": SUMMARY, "results": []}, 1.0) == ["2/2 hosts ok"]

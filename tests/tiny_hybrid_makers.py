"""bench/gpu's tiny-model makers (make_tiny_hybrid, make_tiny_models), imported by the tests of the tiny hybrid
targets; skipped where the venv lacks what they build models with."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

GPU = Path(__file__).resolve().parents[1] / "bench" / "gpu"


def tiny_hybrid_makers() -> tuple[ModuleType, ModuleType]:
    """(make_tiny_hybrid, make_tiny_models)."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    if str(GPU) not in sys.path:
        sys.path.insert(0, str(GPU))
    import make_tiny_hybrid as mth
    import make_tiny_models as tm

    return mth, tm

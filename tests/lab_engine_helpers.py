"""Helpers shared by the lab engine tests (CPU and lab fleet)."""

from __future__ import annotations


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first output index where two token lists differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))

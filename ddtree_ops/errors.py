"""Errors the operator sees: a code machines can match, a message, and a hint saying what to do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ErrorInfo:
    """The `{code, message, hint}` triple carried by host results and `--json` output, plus the
    error's structured `detail` (e.g. promote's gate verdicts) when it has one."""

    code: str
    message: str
    hint: str | None = None
    detail: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message, "hint": self.hint}
        if self.detail:
            out["detail"] = self.detail
        return out


class OpsError(Exception):
    """An expected failure with a readable explanation; the CLI prints it without a traceback."""

    code = "error"

    def __init__(self, message: str, *, hint: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if code is not None:
            self.code = code

    def info(self) -> ErrorInfo:
        detail = getattr(self, "detail", None)
        return ErrorInfo(self.code, self.message, self.hint, detail if isinstance(detail, dict) and detail else None)


class UsageError(OpsError):
    """Bad command line or inventory: nothing was attempted on any host (exit code 2)."""

    code = "usage"

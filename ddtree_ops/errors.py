"""Errors the operator sees: a code machines can match, a message, and a hint saying what to do."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ErrorInfo:
    """The `{code, message, hint}` triple carried by host results and `--json` output."""

    code: str
    message: str
    hint: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return {"code": self.code, "message": self.message, "hint": self.hint}


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
        return ErrorInfo(self.code, self.message, self.hint)


class UsageError(OpsError):
    """Bad command line or inventory: nothing was attempted on any host (exit code 2)."""

    code = "usage"

"""The one error type ops raise for an expected failure; main turns it into `{"ok": false, ...}`."""

from __future__ import annotations


class AgentError(Exception):
    def __init__(self, code: str, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "hint": self.hint}

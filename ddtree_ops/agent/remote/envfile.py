"""systemd's EnvironmentFile= syntax, read and written exactly as systemd does (stdlib only).

The control side reads the operator's secrets file with it (so `KEY="v"` means v, as it would to
systemd, never a value with quotes in it) and writes the host's env file with `quote`; the agent
reads the env file with it to know the values it must redact. `parse` follows the state machine
of systemd's parse_env_file_internal (src/basic/env-file.c): `#`/`;` comment lines, whitespace
around keys and unquoted values dropped, '…' literal, "…" with \\ \" \\$ \\` unescaped (any other
backslash kept), an unquoted backslash escaping the next character, backslash-newline a
continuation; a quote opens a quoted piece only where a piece begins (after `=` or a closing
quote), elsewhere it is a character of the value.
"""

from __future__ import annotations

import re

COMMENTS = "#;"
WHITESPACE = " \t\n\r"
NEWLINE = "\n\r"
SHELL_NEED_ESCAPE = '"\\`$'
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class EnvFileError(ValueError):
    def __init__(self, line: int, problem: str) -> None:
        super().__init__(f"line {line}: {problem}")
        self.line = line
        self.problem = problem


def _append(buf: list, trailing_ws: int | None, c: str) -> int | None:
    """Append c to an unquoted key or value; returns where its run of trailing whitespace starts (None:
    it ends in a non-blank), which systemd strips at the end of the line or before `=`."""
    if c not in WHITESPACE:
        trailing_ws = None
    elif trailing_ws is None:
        trailing_ws = len(buf)
    buf.append(c)
    return trailing_ws


def parse(text: str) -> list:
    """[(line, key, value)] in file order, as systemd reads them. Lines systemd would drop or
    misread silently (no `=`, a key that is no variable name) are errors here, naming the line but
    never the value."""
    out = []
    state, key, value, line, start = "pre_key", [], [], 1, 1
    key_ws = value_ws = None  # where trailing whitespace began in key / unquoted value

    def push() -> None:
        name = "".join(key[:key_ws] if key_ws is not None else key)
        if not NAME.fullmatch(name):
            raise EnvFileError(start, "not NAME=VALUE (systemd would ignore this line; the line is not shown: "
                                      "it may hold a secret)")
        out.append((start, name, "".join(value)))

    for c in text:
        if state == "pre_key":
            if c in COMMENTS:
                state = "comment"
            elif c not in WHITESPACE:
                state, key, key_ws, start = "key", [c], None, line
            elif c == "\n":
                line += 1
        elif state == "key":
            if c in NEWLINE:
                raise EnvFileError(start, "no `=` (systemd would ignore this line; the line is not shown)")
            if c == "=":
                state, value, value_ws = "pre_value", [], None
            else:
                key_ws = _append(key, key_ws, c)
        elif state in ("pre_value", "value"):
            if c in NEWLINE:
                if state == "value" and value_ws is not None:
                    del value[value_ws:]
                push()
                state, line = "pre_key", line + 1
            elif c == "'" and state == "pre_value":  # a quote opens only where a value (piece) begins
                state = "single"
            elif c == '"' and state == "pre_value":
                state = "double"
            elif c == "\\":
                state, value_ws = "value_escape", None
            elif state == "pre_value":
                if c not in WHITESPACE:
                    state = "value"
                    value.append(c)
            else:
                value_ws = _append(value, value_ws, c)
        elif state == "value_escape":
            state = "value"
            if c not in NEWLINE:
                value.append(c)
            else:
                line += 1
        elif state == "single":
            if c == "'":
                state = "pre_value"
            else:
                value.append(c)
                line += c == "\n"
        elif state == "double":
            if c == '"':
                state = "pre_value"
            elif c == "\\":
                state = "double_escape"
            else:
                value.append(c)
                line += c == "\n"
        elif state == "double_escape":
            state = "double"
            if c in SHELL_NEED_ESCAPE:
                value.append(c)
            elif c != "\n":
                value += ["\\", c]
            else:
                line += 1
        elif state == "comment":
            if c == "\\":
                state = "comment_escape"
            elif c in NEWLINE:
                state, line = "pre_key", line + 1
        elif state == "comment_escape":
            state = "pre_key" if c in NEWLINE else "comment"
            line += c == "\n"
    if state == "key":
        raise EnvFileError(start, "no `=` (systemd would ignore this line; the line is not shown)")
    if state in ("single", "double", "double_escape"):
        raise EnvFileError(start, "a quote is never closed (the line is not shown: it may hold a secret)")
    if state in ("pre_value", "value", "value_escape"):
        if state == "value" and value_ws is not None:
            del value[value_ws:]
        push()
    return out


def values(text: str) -> list:
    """Every value of an env file, for redaction; an unreadable file gives what it can."""
    try:
        return [v for _, _, v in parse(text) if v]
    except EnvFileError:
        return [line.split("=", 1)[1].strip().strip("\"'") for line in text.splitlines() if "=" in line]


def quote(value: str) -> str:
    """A value as the env file holds it: double-quoted, with exactly the characters systemd
    unescapes there escaped. Control characters are refused (they would end or split the line)."""
    if any(ord(c) < 32 or c == "\x7f" for c in value):
        raise ValueError("control character in a value")
    return '"' + re.sub(r'([\\"$`])', r"\\\1", value) + '"'

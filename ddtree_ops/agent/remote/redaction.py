"""Secrets out of everything the agent sends back or keeps (stdlib only; the control side uses it too).

Two sources of secrets: values we know (the env file's, the secrets the control side rendered), and
values we can only recognise by their name in text we did not write (a unit an operator wrote by
hand with `--api-key sk-…` in its ExecStart=, or `Environment="HF_TOKEN=…"`; SGLang logging
`api_key='…'`). Both are replaced by SECRET before a text leaves the host or reaches evidence.
"""

from __future__ import annotations

import re

SECRET = "[secret]"
# Names that carry credentials: flags (`--api-key`), variables (`HF_TOKEN`), Python reprs (`api_key=`).
# `token` but not `tokens`, `tokenizer` or `token_id` (SGLang's logs are full of those).
SECRET_WORD = r"(?:api[_-]?key|token(?![a-z]|_?ids?\b)|secret|passw(?:or)?d|credential|private[_-]?key|authorization)"
_SECRET_NAME = re.compile(SECRET_WORD, re.IGNORECASE)
_VALUE = r"""(?:"(?:\\.|[^"\\])*"|'[^']*'|(?:\\.|[^\s"'\\])+)"""
_UNQUOTED = r"(?:\\.|[^\s\"\\])+"
# `--api-key VALUE`, `--api-key=VALUE`, `"--api-key" "VALUE"`, `"--api-key=VALUE"` (systemd quoting).
# A `${NAME}` value is ddtree-ops' own reference into the env file: not a secret, and worth showing.
_FLAG = re.compile(r'(?P<head>"?--[A-Za-z0-9_-]*' + SECRET_WORD + r'[A-Za-z0-9_-]*)(?P<sep>"?[ \t]+"?|=)'
                   r"(?!\$\{)(?P<value>" + _UNQUOTED + ")", re.IGNORECASE)
# `"NAME=value with spaces"` (a quoted Environment= assignment), then `NAME=value` / `name='value'`.
_QUOTED_ASSIGNMENT = re.compile(r'(?P<head>"[A-Za-z0-9_]*' + SECRET_WORD
                                + r'[A-Za-z0-9_]*=)(?P<value>(?:\\.|[^"\\])*)"', re.IGNORECASE)
_ASSIGNMENT = re.compile(r"(?P<head>\b[A-Za-z0-9_]*" + SECRET_WORD + r"[A-Za-z0-9_]*\s*[=:]\s*)(?P<value>"
                         + _VALUE + ")", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """A flag or variable name that carries credentials (`--api-key`, `HF_TOKEN`, `admin_password`)."""
    return bool(_SECRET_NAME.search(name))


def redact_known(text: str, values: list | tuple) -> str:
    # Longest first: a secret that contains another must not be left half-shown.
    for value in sorted((v for v in values if v), key=len, reverse=True):
        text = text.replace(value, SECRET)
    return text


def redact_text(text: str, values: list | tuple = ()) -> str:
    """Known values, then whatever a credential-named flag or variable assigns."""
    text = redact_known(text, values)
    text = _FLAG.sub(lambda m: m["head"] + m["sep"] + SECRET, text)
    text = _QUOTED_ASSIGNMENT.sub(lambda m: m["head"] + SECRET + '"', text)
    text = _ASSIGNMENT.sub(lambda m: m["head"] + (m["value"] if m["value"] == SECRET else SECRET), text)
    return text

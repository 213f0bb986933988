"""The two texts secrets pass through: systemd's EnvironmentFile syntax (read and written exactly as
systemd does: the lab reads it back through systemd itself, tests/lab/test_promote.py) and the
redaction of credentials in units and logs we did not write."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_ops import service
from ddtree_ops.agent.remote import envfile
from ddtree_ops.agent.remote.redaction import SECRET, redact_text

printable = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF, blacklist_characters="\x7f"), max_size=40)


@settings(max_examples=400)
@given(values=st.lists(printable, min_size=1, max_size=5))
def test_quote_then_parse_gives_every_value_back(values: list[str]) -> None:
    text = "".join(f"K{i}={envfile.quote(v)}\n" for i, v in enumerate(values))
    assert envfile.parse(text) == [(i + 1, f"K{i}", v) for i, v in enumerate(values)]


@pytest.mark.parametrize(("line", "value"), [
    ('A="x y"', "x y"),                 # quotes are syntax, never part of the value
    ("A='x \"$y\"'", 'x "$y"'),         # single quotes: literal
    ('A="a\\"b\\\\c\\$d\\`e\\nf"', 'a"b\\c$d`e\\nf'),  # only \" \\ \$ \` unescape; \n stays two characters
    ("A=  plain value  ", "plain value"),  # unquoted: outer whitespace dropped
    ("A=a\\ b", "a b"),                 # unquoted backslash escapes the next character
    ('A="x" y', "xy"),                  # pieces join, the space after a closing quote is dropped
    ('A="x"y \'z\'', "xy 'z'"),         # past an unquoted piece, quotes are characters
    ("  A = v", "v"),                   # whitespace around the key
    ("A=", ""),
    ("A=#not a comment", "#not a comment"),
])
def test_parse_reads_what_systemd_reads(line: str, value: str) -> None:
    assert envfile.parse(line + "\n") == [(1, "A", value)]


@pytest.mark.parametrize("text", ["export A=1\n", "A B=1\n", "just words\n", 'A="never closed\n', "=v\n"])
def test_lines_systemd_would_drop_or_misread_are_refused(text: str) -> None:
    with pytest.raises(envfile.EnvFileError):
        envfile.parse(text)


def test_comments_and_continuations() -> None:
    text = "# c\n; c2\nA=1 \\\n2\nB=\"x\\\ny\"\n"
    assert [(k, v) for _, k, v in envfile.parse(text)] == [("A", "1 2"), ("B", "xy")]


secret_values = st.text(st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters="\"'\\"),
                        min_size=6, max_size=30).filter(lambda s: "[secret]" not in s and not s.startswith("${"))


@settings(max_examples=300)
@given(secret=secret_values, flag=st.sampled_from(["--api-key", "--admin-api-key", "--hf-token", "--db-password"]),
       name=st.sampled_from(["HF_TOKEN", "OPENAI_API_KEY", "DB_PASSWORD", "client_secret"]))
def test_credentials_in_units_we_did_not_write_never_survive_redaction(secret: str, flag: str, name: str) -> None:
    quoted = service.exec_word(secret)
    forms = [
        f"ExecStart=/opt/venv/bin/python -m sglang.launch_server {flag} {secret} --port 30000",
        f"ExecStart=/opt/venv/bin/python -m sglang.launch_server {flag}={secret}",
        f'ExecStart="/opt/venv/bin/python" "{flag}" {quoted} "--port" "1"',
        f'ExecStart="/opt/venv/bin/python" "{flag}={quoted[1:-1]}"',
        f'Environment="{name}={quoted[1:-1]}" "OTHER=1"',
        f"Environment={name}={secret} OTHER=1",
        f"server_args=ServerArgs({name.lower()}='{secret}', port=30000)",
    ]
    for form in forms:
        out = redact_text(form)
        assert secret not in out and SECRET in out, (form, out)


def test_references_and_ordinary_words_are_kept() -> None:
    line = '"--api-key" "${DDTREE_OPS_ARG_API_KEY}" "--max-total-tokens" "4096" "--tokenizer-path" "/m"'
    assert redact_text(line) == line
    assert redact_text("max_new_tokens: 48, bos_token_id=1") == "max_new_tokens: 48, bos_token_id=1"

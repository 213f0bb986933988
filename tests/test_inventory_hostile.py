"""Hostile inventories (issue 11): loading is bounded, odd YAML is a usage error with file and line,
and values of secret-bearing fields are never echoed (errors, `hosts`, `hosts --json`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ddtree_ops.inventory import MAX_VALUES, REDACTED, InventoryError, load_inventory
from tests.test_cli import cli

SECRET = "sk-live-7f3a9c0d1e2b"


def alias_bomb(levels: int) -> str:
    """The "billion laughs" in inventory form: 9**levels values from a few hundred bytes."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nhosts:\n  a: {{address: x, extra_args: *l{levels - 1}}}\n"


def load_error(tmp_path: Path, text: str) -> InventoryError:
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    with pytest.raises(InventoryError) as info:
        load_inventory(path)
    return info.value


def test_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    text = alias_bomb(7)
    assert len(text) < 400 and MAX_VALUES < 9 ** 7
    t0 = time.monotonic()
    err = load_error(tmp_path, text)
    # Before: 13.7 s and 2.3 GB for these 7 levels (minutes for 8).
    assert time.monotonic() - t0 < 2.0
    assert err.issues[0].line == 6 and "aliases" in err.issues[0].message  # l5: the first past the cap


def test_a_few_harmless_aliases_still_load(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text("defaults: &d {user: deploy, port: 2222}\nhosts:\n  a: {address: x, <<: *d}\n  b: {address: y, <<: *d}\n")
    err = load_error(tmp_path, path.read_text())  # `defaults` is not an inventory key: a normal, named error
    assert [i.path for i in err.issues] == ["defaults"]
    path.write_text("hosts:\n  a: &a {address: x, user: deploy}\n  b: {<<: *a, address: y}\n")
    inv = load_inventory(path)
    assert inv.hosts["b"].user == "deploy" and inv.hosts["b"].address == "y"


@pytest.mark.parametrize(("text", "line", "words"), [
    ("hosts: &h\n  a: {address: x, extra_args: *h}\n", 1, "recursive"),
    ("x: &a [*a]\nhosts: {a: {address: x}}\n", 1, "recursive"),
    ("hosts:\n  [a, b]: {address: x}\n", 2, "plain name"),
    ("hosts:\n  ? {a: 1}\n  : {address: x}\n", 2, "plain name"),
])
def test_recursion_and_odd_keys_are_usage_errors_with_a_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    # Before: RecursionError / "unhashable type: 'list'", i.e. "internal error".
    err = load_error(tmp_path, text)
    assert err.issues[0].line == line and words in err.issues[0].message
    inv = tmp_path / "inv.yaml"
    result = cli("hosts", "-i", str(inv))
    assert result.returncode == 2 and f"{inv}:{line}:" in result.stderr and "internal error" not in result.stderr


def test_deep_nesting_is_a_usage_error(tmp_path: Path) -> None:
    err = load_error(tmp_path, "hosts: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nested too deeply" in err.issues[0].message


@pytest.mark.parametrize("text", [
    f"hosts:\n  a: {{address: x, extra_args: '--api-key {SECRET}'}}\n",
    f"hosts:\n  a: {{address: x, extra_args: [--api-key, {{k: {SECRET}}}]}}\n",
    f"groups:\n  g1: {{hosts: [a], vars: {{extra_args: [--api-key, {SECRET}]}}}}\n"
    f"  g2: {{hosts: [a], vars: {{extra_args: [--api-key, other]}}}}\nhosts:\n  a: {{address: x}}\n",
])
def test_secret_values_are_never_echoed_in_errors(tmp_path: Path, text: str) -> None:
    err = load_error(tmp_path, text)
    assert "extra_args" in err.message and SECRET not in err.message
    assert SECRET not in json.dumps(err.to_dict())
    result = cli("hosts", "-i", str(tmp_path / "inv.yaml"), "--json")
    assert result.returncode == 2 and SECRET not in result.stdout + result.stderr


def test_hosts_redacts_secret_bearing_fields(tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  a: {{address: x, extra_args: [--api-key, {SECRET}]}}\n")
    result = cli("hosts", "-i", str(inv), "--json")
    assert result.returncode == 0, result.stderr
    # Before: extra_args verbatim, key included.
    assert SECRET not in result.stdout and json.loads(result.stdout)["results"][0]["data"]["extra_args"] == [REDACTED, REDACTED]
    table = cli("hosts", "-i", str(inv))
    assert table.returncode == 0 and SECRET not in table.stdout + table.stderr

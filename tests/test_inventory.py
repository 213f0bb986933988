"""Inventory: layering, --limit, and every error path with file, line, field, expected and hint."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ddtree_ops.errors import UsageError
from ddtree_ops.inventory import DEFAULT_STATE_DIR, InventoryError, LimitError, load_inventory

REPO = Path(__file__).resolve().parents[1]

GOOD = """\
all:
  vars: {user: deploy, python: /opt/sglang/venv/bin/python, serve_port: 30000}
groups:
  canary:
    vars: {canary: true, serve_port: 30001}
    hosts: [gpu-1]
  main:
    vars: {ddtree_budget: 64}
    hosts: [gpu-2, gpu-3]
hosts:
  gpu-1: {address: 10.0.0.5}
  gpu-2: {address: 10.0.0.6, serve_port: 31000, identity_file: keys/id, known_hosts: kh}
  gpu-3: {address: gpu-3.example, port: 2222}
"""


def write(tmp_path: Path, text: str, name: str = "inv.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def issues_of(tmp_path: Path, text: str) -> InventoryError:
    with pytest.raises(InventoryError) as info:
        load_inventory(write(tmp_path, text))
    return info.value


def only_issue(tmp_path: Path, text: str):
    err = issues_of(tmp_path, text)
    assert len(err.issues) == 1, err.message
    return err.issues[0]


# --- the good path -------------------------------------------------------------------------------


def test_layering_host_over_group_over_all(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, GOOD))
    g1, g2, g3 = inv.hosts["gpu-1"], inv.hosts["gpu-2"], inv.hosts["gpu-3"]
    assert (g1.user, g1.serve_port, g1.canary, g1.groups) == ("deploy", 30001, True, ("canary",))
    assert (g2.serve_port, g2.ddtree_budget, g2.canary) == (31000, 64, False)
    assert (g3.port, g3.serve_port, g3.python) == (2222, 30000, "/opt/sglang/venv/bin/python")
    assert g1.state_dir == DEFAULT_STATE_DIR and g1.host_key_policy == "strict" and g1.port == 22


def test_relative_local_paths_resolve_against_inventory_dir(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, GOOD))
    g2 = inv.hosts["gpu-2"]
    assert g2.identity_path == tmp_path.resolve() / "keys" / "id"
    assert g2.known_hosts_path == tmp_path.resolve() / "kh"
    assert inv.hosts["gpu-1"].known_hosts_path == Path("~/.ssh/known_hosts").expanduser()


def test_example_inventory_is_valid_and_documents_every_field() -> None:
    from ddtree_ops.inventory import HOST_FIELDS

    example = REPO / "inventory" / "example.yaml"
    inv = load_inventory(example)
    assert set(inv.hosts) == {"gpu-1", "gpu-2", "gpu-3", "bastion"}
    text = example.read_text()
    missing = [f for f in HOST_FIELDS if f"{f}:" not in text]
    assert not missing, f"example.yaml does not document {missing}"
    assert [h.name for h in inv.jump_chain(inv.hosts["gpu-2"])] == ["bastion"]
    jump = inv.jump_chain(inv.hosts["gpu-3"])[0]
    assert (jump.user, jump.address, jump.port) == ("ops", "bastion.example.internal", 22)


def test_service_name_gets_service_suffix(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, "hosts: {a: {address: h, service: sglang}}\n"))
    assert inv.hosts["a"].service == "sglang.service"


def test_server_module_is_a_dotted_module_name(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, "hosts: {a: {address: h}, b: {address: h, server_module: ddtree_lab_engine}}\n"))
    assert (inv.hosts["a"].server_module, inv.hosts["b"].server_module) == ("sglang.launch_server", "ddtree_lab_engine")
    for bad in ("'sglang.launch_server; rm -rf /'", "'-m x'", "sglang..launch", "'a b'", "1abc"):
        issue = only_issue(tmp_path, f"hosts: {{a: {{address: h, server_module: {bad}}}}}\n")
        assert issue.path == "hosts.a.server_module" and "not a Python module name" in issue.message


def test_host_in_two_groups_is_fine_and_conflicts_need_the_host_to_decide(tmp_path: Path) -> None:
    text = """\
    groups:
      a: {hosts: [h1], vars: {serve_port: 1}}
      b: {hosts: [h1, h1], vars: {serve_port: 2, canary: true}}
    hosts:
      h1: {address: x}
    """
    issue = only_issue(tmp_path, text)
    assert issue.path == "hosts.h1" and "both set `serve_port`" in issue.message and issue.line == 5
    fixed = text.replace("h1: {address: x}", "h1: {address: x, serve_port: 3}")
    h1 = load_inventory(write(tmp_path, fixed)).hosts["h1"]
    assert (h1.serve_port, h1.canary, h1.groups) == (3, True, ("a", "b"))


# --- --limit ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        (None, ["gpu-1", "gpu-2", "gpu-3"]),
        ("gpu-3", ["gpu-3"]),
        ("main", ["gpu-2", "gpu-3"]),
        ("gpu-3,canary", ["gpu-1", "gpu-3"]),
        ("gpu-[12]", ["gpu-1", "gpu-2"]),
        ("can*", ["gpu-1"]),
        (" gpu-2 , gpu-2 ", ["gpu-2"]),
    ],
)
def test_limit_selects_by_name_group_and_glob_in_file_order(tmp_path: Path, limit, expected) -> None:
    inv = load_inventory(write(tmp_path, GOOD))
    assert [h.name for h in inv.select(limit)] == expected


@pytest.mark.parametrize("limit", ["", " ", ",", " , "])
def test_empty_limit_is_a_usage_error_not_the_whole_fleet(tmp_path: Path, limit: str) -> None:
    """`--limit "$HOSTS"` with HOSTS unset must not select every host (nor, silently, none)."""
    inv = load_inventory(write(tmp_path, GOOD))
    with pytest.raises(LimitError, match="names no host or group"):
        inv.select(limit)


@pytest.mark.parametrize("limit", ["gpu-9", "gpu-1,nope", "x*"])
def test_limit_matching_nothing_is_a_usage_error(tmp_path: Path, limit: str) -> None:
    inv = load_inventory(write(tmp_path, GOOD))
    with pytest.raises(LimitError) as info:
        inv.select(limit)
    assert isinstance(info.value, UsageError)
    assert "matches no host or group" in info.value.message and info.value.hint


def test_limit_typo_gets_a_suggestion(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, GOOD))
    with pytest.raises(LimitError) as info:
        inv.select("canery")
    assert info.value.hint == "did you mean `canary`?"


# --- error paths --------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InventoryError) as info:
        load_inventory(tmp_path / "nope.yaml")
    assert "file not found" in info.value.message and "DDTREE_INVENTORY" in (info.value.hint or "")
    assert str(tmp_path / "nope.yaml") in info.value.message


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="directory"):
        load_inventory(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    assert "empty" in only_issue(tmp_path, "# nothing\n").message


def test_yaml_syntax_error_has_line_number(tmp_path: Path) -> None:
    issue = only_issue(tmp_path, "hosts:\n  a: {address: x}\n  b: [unclosed\n  c: {address: y}\n")
    assert issue.message.startswith("YAML syntax error") and issue.line in (3, 4, 5)


def test_top_level_not_a_mapping(tmp_path: Path) -> None:
    assert "top level must be a mapping" in only_issue(tmp_path, "- a\n- b\n").message


@pytest.mark.parametrize(
    ("text", "path", "line", "suggestion"),
    [
        ("hosts: {a: {address: x}}\nhostz: {}\n", "hostz", 2, "hosts"),
        ("all: {varz: {}}\nhosts: {a: {address: x}}\n", "all.varz", 1, "vars"),
        ("all: {vars: {usr: root}}\nhosts: {a: {address: x}}\n", "all.vars.usr", 1, "user"),
        ("groups: {g: {hosts: [a], vars: {pyhton: /x}}}\nhosts: {a: {address: x}}\n", "groups.g.vars.pyhton", 1, "python"),
        ("groups: {g: {host: [a]}}\nhosts: {a: {address: x}}\n", "groups.g.host", 1, "hosts"),
        ("hosts:\n  gpu-1:\n    adress: 10.0.0.1\n", "hosts.gpu-1.adress", 3, "address"),
    ],
)
def test_unknown_key_at_each_level(tmp_path: Path, text, path, line, suggestion) -> None:
    err = issues_of(tmp_path, text)
    issue = next(i for i in err.issues if i.path == path)
    assert issue.message.startswith("unknown field")
    assert issue.line == line
    assert issue.hint == f"did you mean `{suggestion}`?"
    assert str(tmp_path / "inv.yaml") in err.message and f":{line}: {path}" in err.message


def test_unknown_key_message_names_file_line_field_expected_hint(tmp_path: Path) -> None:
    err = issues_of(tmp_path, "hosts:\n  gpu-1:\n    adress: 10.0.0.1\n")
    rendered = err.message
    assert f"{tmp_path / 'inv.yaml'}:3: hosts.gpu-1.adress: unknown field `adress`" in rendered
    assert "expected: one of: address, port" in rendered
    assert "hint: did you mean `address`?" in rendered


def test_missing_address(tmp_path: Path) -> None:
    issue = only_issue(tmp_path, "hosts:\n  a: {port: 22}\n")
    assert issue.path == "hosts.a.address" and issue.message == "required field is missing" and issue.line == 2


def test_host_with_null_entry_misses_address(tmp_path: Path) -> None:
    assert only_issue(tmp_path, "hosts:\n  a:\n").path == "hosts.a.address"


@pytest.mark.parametrize(
    ("fields", "path", "fragment"),
    [
        ("port: 0", "hosts.a.port", "greater than or equal to 1"),
        ("port: 70000", "hosts.a.port", "less than or equal to 65535"),
        ("port: ssh", "hosts.a.port", "valid integer"),
        ("port: '22'", "hosts.a.port", "valid integer"),
        ("sudo: maybe", "hosts.a.sudo", "valid boolean"),
        ("extra_args: --foo", "hosts.a.extra_args", "valid list"),
        ("connect_timeout: -1", "hosts.a.connect_timeout", "greater than 0"),
        ("host_key_policy: yolo", "hosts.a.host_key_policy", "'strict' or 'accept-new'"),
        ("ddtree_budget: 0", "hosts.a.ddtree_budget", "greater than or equal to 1"),
    ],
)
def test_wrong_types_and_ranges(tmp_path: Path, fields: str, path: str, fragment: str) -> None:
    issue = only_issue(tmp_path, f"hosts:\n  a:\n    address: x\n    {fields}\n")
    assert issue.path == path and fragment in issue.message and issue.line == 4


def test_quoted_number_hint(tmp_path: Path) -> None:
    assert "without quotes" in (only_issue(tmp_path, "hosts:\n  a: {address: x, port: '22'}\n").hint or "")


def test_unknown_group_host_reference(tmp_path: Path) -> None:
    issue = only_issue(tmp_path, "groups:\n  g:\n    hosts: [gpu-1, gpu-2]\nhosts:\n  gpu-1: {address: x}\n  gpu-3: {address: y}\n")
    assert issue.path == "groups.g.hosts[1]" and "unknown host `gpu-2`" in issue.message and issue.line == 3
    assert issue.hint in ("did you mean `gpu-1`?", "did you mean `gpu-3`?")


def test_duplicate_host_key_is_an_error_not_silently_merged(tmp_path: Path) -> None:
    issue = only_issue(tmp_path, "hosts:\n  a: {address: x}\n  a: {address: y}\n")
    assert issue.path == "hosts.a" and "duplicate key" in issue.message and issue.line == 3


def test_no_hosts(tmp_path: Path) -> None:
    assert "no hosts" in only_issue(tmp_path, "hosts: {}\n").message


def test_missing_hosts_section(tmp_path: Path) -> None:
    issue = only_issue(tmp_path, "all: {vars: {user: root}}\n")
    assert issue.path == "hosts" and issue.message == "required field is missing"


def test_group_named_like_a_host_or_all(tmp_path: Path) -> None:
    err = issues_of(tmp_path, "groups:\n  a: {hosts: [a]}\n  all: {hosts: [a]}\nhosts:\n  a: {address: x}\n")
    messages = {i.path: i.message for i in err.issues}
    assert "same name as a host" in messages["groups.a"] and "reserved" in messages["groups.all"]


def test_jump_host_loop(tmp_path: Path) -> None:
    err = issues_of(tmp_path, "hosts:\n  a: {address: x, jump_host: b}\n  b: {address: y, jump_host: a}\n")
    assert [i.path for i in err.issues] == ["hosts.a.jump_host", "hosts.b.jump_host"]
    assert "a -> b -> a" in err.issues[0].message


def test_several_problems_are_reported_together_in_line_order(tmp_path: Path) -> None:
    err = issues_of(tmp_path, "hosts:\n  a: {address: x, port: 0}\n  b: {adress: y}\n  c: {address: z, sudo: 3}\n")
    assert [i.line for i in err.issues] == sorted(i.line for i in err.issues)
    assert {i.path for i in err.issues} >= {"hosts.a.port", "hosts.b.adress", "hosts.c.sudo"}


# --- hostile values: rejected, or carried verbatim where legal -----------------------------------

HOSTILE = ["a'b", 'a"b', "a;b", "a$(touch /tmp/x)", "a`id`", "a\nb", "a b"]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_host_names_rejected(tmp_path: Path, value: str) -> None:
    path = tmp_path / "inv.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"hosts": {value: {"address": "x"}}}))
    with pytest.raises(InventoryError) as info:
        load_inventory(path)
    assert any("invalid host name" in i.message for i in info.value.issues)


@pytest.mark.parametrize("field", ["address", "user", "service", "serve_host", "jump_host"])
@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_rejected_for_name_like_fields(tmp_path: Path, field: str, value: str) -> None:
    import yaml

    entry = {"address": "x", field: value}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"a": entry}}))
    with pytest.raises(InventoryError) as info:
        load_inventory(path)
    assert info.value.issues[0].path == f"hosts.a.{field}"


@pytest.mark.parametrize("field", ["python", "state_dir"])
def test_remote_paths_carry_shell_characters_but_not_newlines(tmp_path: Path, field: str) -> None:
    import yaml

    path = tmp_path / "inv.yaml"
    legal = "/opt/we ird/'q\"uo;te$(touch /tmp/x)`id`"
    path.write_text(yaml.safe_dump({"hosts": {"a": {"address": "x", field: legal}}}))
    assert getattr(load_inventory(path).hosts["a"], field) == legal
    for bad in ("/opt/a\nb", "relative/path", "/opt/../etc"):
        path.write_text(yaml.safe_dump({"hosts": {"a": {"address": "x", field: bad}}}))
        with pytest.raises(InventoryError):
            load_inventory(path)


def test_local_paths_carry_shell_characters(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "inv.yaml"
    weird = "keys/it's;$(x)`y`.key"
    path.write_text(yaml.safe_dump({"hosts": {"a": {"address": "x", "identity_file": weird}}}))
    assert load_inventory(path).hosts["a"].identity_path == tmp_path.resolve() / weird


def test_a_shape_error_does_not_hide_field_errors(tmp_path: Path) -> None:
    err = issues_of(tmp_path, "groups:\n  g: {hostz: []}\nhosts:\n  a: {adress: x}\n")
    assert {i.path for i in err.issues} == {"groups.g.hostz", "hosts.a.adress"}


# --- settings the payload would refuse at server start, jump host typos, one machine listed twice --------


@pytest.mark.parametrize(("text", "path", "line", "fragment"), [
    ("all:\n  vars: {ddtree_budget: 600}\nhosts:\n  a: {address: x}\n", "all.vars.ddtree_budget", 2,
     "--speculative-ddtree-budget must be in 1..512"),
    ("groups:\n  g: {vars: {ddtree_budget: 8, ddtree_topk_cap: 9}, hosts: [a]}\nhosts:\n  a: {address: x}\n",
     "groups.g.vars.ddtree_topk_cap", 2, "--speculative-ddtree-topk-cap must be in 1..8"),
    ("hosts:\n  a: {address: x, ddtree_topk_cap: 16}\n", "hosts.a.ddtree_topk_cap", 2,
     "must be in 1..15"),  # the cap above the default budget (draft_block_size 16 - 1)
    ("hosts:\n  a: {address: x}\n  b: {address: y, ddtree_keep_chain: true, ddtree_budget: 4}\n",
     "hosts.b.ddtree_keep_chain", 3, "needs --speculative-ddtree-budget >= the draft depth 15"),
    ("hosts:\n  a: {address: x, ddtree_budget: auto, ddtree_budget_max: 600}\n", "hosts.a.ddtree_budget_max", 2,
     "--speculative-ddtree-budget-max must be in 1..512"),
    ("hosts:\n  a: {address: x, ddtree_budget: 64, ddtree_budget_max: 63}\n", "hosts.a.ddtree_budget_max", 2,
     "is the largest budget of --speculative-ddtree-budget auto"),
    ("hosts:\n  a: {address: x, ddtree_budget: auto, ddtree_budget_max: 31, ddtree_topk_cap: 40}\n",
     "hosts.a.ddtree_topk_cap", 2, "must be in 1..31 (1..--speculative-ddtree-budget-max)"),
])
def test_settings_the_payload_refuses_are_refused_where_they_are_written(tmp_path: Path, text, path, line,
                                                                         fragment) -> None:
    issue = only_issue(tmp_path, text)
    assert (issue.path, issue.line) == (path, line)
    assert "the payload would refuse this at server start" in issue.message and fragment in issue.message
    assert issue.hint and "ddtree_" in issue.hint


def test_a_value_every_host_inherits_is_reported_once(tmp_path: Path) -> None:
    err = issues_of(tmp_path, "all:\n  vars: {ddtree_budget: 1000}\nhosts:\n  a: {address: x}\n  b: {address: y}\n")
    assert [i.path for i in err.issues] == ["all.vars.ddtree_budget"]


def test_settings_the_payload_accepts_load(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, "hosts:\n  a: {address: x, ddtree_budget: 512, ddtree_topk_cap: 512}\n"
                                         "  b: {address: y, ddtree_keep_chain: true, draft_block_size: 8, ddtree_budget: 7}\n"))
    assert inv.hosts["a"].ddtree_budget == 512 and inv.hosts["b"].ddtree_keep_chain


def test_a_jump_host_typo_gets_the_inventory_host_it_probably_meant(tmp_path: Path) -> None:
    issue = only_issue(tmp_path, "hosts:\n  bastion: {address: 203.0.113.10}\n  a: {address: x, jump_host: bastoin}\n")
    assert (issue.path, issue.line) == ("hosts.a.jump_host", 3)
    assert "not a host of this inventory" in issue.message and "did you mean `bastion`?" in issue.hint
    assert "bastoin:22" in issue.hint  # how to say that an outside machine of that name is meant


def test_a_jump_host_naming_an_inventory_host_with_a_user_is_refused(tmp_path: Path) -> None:
    issue = only_issue(tmp_path, "hosts:\n  bastion: {address: 203.0.113.10}\n  a: {address: x, jump_host: ops@bastion}\n")
    assert "taken as the address `bastion`, not as that host" in issue.message
    assert issue.hint == "write `jump_host: bastion` and set `user`/`port` on host `bastion`"


def test_outside_jump_hosts_still_load(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, "hosts:\n  bastion: {address: 203.0.113.10}\n"
                                         "  a: {address: x, jump_host: ops@bastion.example.net:22}\n"
                                         "  b: {address: y, jump_host: jumpbox}\n  c: {address: z, jump_host: 'bastoin:22'}\n"))
    assert [inv.jump_for(h).address for h in inv.hosts.values() if h.jump_host] == ["bastion.example.net", "jumpbox", "bastoin"]


def test_two_hosts_at_one_address_and_port_are_a_warning(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, "hosts:\n  a: {address: 10.0.0.5}\n  b: {address: 10.0.0.6}\n"
                                         "  c: {address: 10.0.0.5, port: 22}\n  d: {address: 10.0.0.5, port: 2222}\n"
                                         "  e: {address: 10.0.0.5, jump_host: b}\n"))
    assert len(inv.hosts) == 5  # loads: two names for one machine may be meant, but it is worth a word
    (warning,) = inv.warnings
    assert (warning.path, warning.line) == ("hosts.c.address", 4)
    assert warning.message == "same address and port as host `a` (10.0.0.5:22)" and "twice at once" in warning.hint


def test_inventory_warnings_reach_stderr_and_the_json_document(tmp_path: Path) -> None:
    from test_cli import cli

    path = write(tmp_path, "hosts:\n  a: {address: 10.0.0.5}\n  b: {address: 10.0.0.5}\n")
    result = cli("hosts", "-i", str(path), "--json")
    assert result.returncode == 0
    assert f"warning: {path}:3: hosts.b.address: same address and port as host `a`" in result.stderr
    import json

    assert json.loads(result.stdout)["warnings"][0]["path"] == "hosts.b.address"


def test_auto_budget_is_a_setting(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"a": {"address": "x", "ddtree_budget": "auto"},
                                              "b": {"address": "y", "ddtree_budget": "auto", "ddtree_budget_max": 63,
                                                    "ddtree_keep_chain": True}}}))
    hosts = load_inventory(path).hosts
    assert (hosts["a"].ddtree_budget, hosts["a"].ddtree_budget_max) == ("auto", None)
    assert (hosts["b"].ddtree_budget, hosts["b"].ddtree_budget_max) == ("auto", 63)
    path.write_text(yaml.safe_dump({"hosts": {"a": {"address": "x", "ddtree_budget": "fast"}}}))
    with pytest.raises(InventoryError) as info:
        load_inventory(path)
    assert info.value.issues[0].path == "hosts.a.ddtree_budget"

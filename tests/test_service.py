"""Unit rendering: templates, systemd quoting (checked by systemd-analyze itself), secrets."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddtree_ops import service
from ddtree_ops.agent.remote.redaction import redact_text
from ddtree_ops.errors import UsageError
from ddtree_ops.inventory import load_inventory

HOSTILE_MODEL = "/models/with space/\"dq\" 'sq' %n $HOME ${X} \\back"
HOSTILE_ARGS = ["--served-model-name", "a b;c", ";", "$X", "${HOME}", "%i", "\\x", "'", '"', "--", "%%", "$$"]
SECRET = 'pl4nted-$ecret "quoted" `tick` \\ %h'


def _inventory(tmp_path: Path, **vars_: object) -> Path:
    base = {"python": sys.executable, "model_path": "/models/target", "draft_model_path": "/models/draft"}
    doc = {"all": {"vars": {**base, **vars_}}, "hosts": {"h1": {"address": "10.0.0.1"}}}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _host(tmp_path: Path, **vars_: object):
    return load_inventory(_inventory(tmp_path, **vars_)).hosts["h1"]


def test_server_argv_per_mode(tmp_path: Path) -> None:
    host = _host(tmp_path, ddtree_budget=8, ddtree_topk_cap=4, extra_args=["--tp-size", "1"])
    off = service.server_argv(host, "off")
    assert off[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert "--speculative-ddtree-mode" not in off and off[off.index("--speculative-algorithm") + 1] == "DFLASH"
    full = service.server_argv(host, "full")
    assert full[full.index("--speculative-ddtree-mode") + 1] == "full"
    assert full[full.index("--speculative-ddtree-budget") + 1] == "8"
    assert full[full.index("--speculative-ddtree-topk-cap") + 1] == "4"
    assert full[full.index("--attention-backend") + 1] == "triton" and full[-2:] == ["--tp-size", "1"]
    # The operator's own backend wins (and the payload then judges it).
    own = _host(tmp_path, extra_args=["--attention-backend=fa3"])
    assert service.server_argv(own, "full").count("--attention-backend") == 0


def test_server_argv_keep_chain(tmp_path: Path) -> None:
    assert "--speculative-ddtree-keep-chain" not in service.server_argv(_host(tmp_path), "full")
    keep = service.server_argv(_host(tmp_path, ddtree_keep_chain=True), "shadow-linear")  # default budget 15
    assert keep.count("--speculative-ddtree-keep-chain") == 1
    assert "--speculative-ddtree-keep-chain" not in service.server_argv(_host(tmp_path, ddtree_keep_chain=True), "off")
    # The inventory refuses this at load (the payload's own check); a HostConfig built in code meets service's.
    too_small = _host(tmp_path, ddtree_keep_chain=True).model_copy(update={"ddtree_budget": 14})
    with pytest.raises(UsageError, match="ddtree_keep_chain needs ddtree_budget >= the draft depth 15") as err:
        service.server_argv(too_small, "full")
    assert err.value.code == "keep_chain_budget"
    small = _host(tmp_path, ddtree_keep_chain=True, ddtree_budget=7, draft_block_size=8)
    assert "--speculative-ddtree-keep-chain" in service.server_argv(small, "full")


def test_server_argv_auto_budget(tmp_path: Path) -> None:
    full = service.server_argv(_host(tmp_path, ddtree_budget="auto", ddtree_budget_max=63), "full")
    assert full[full.index("--speculative-ddtree-budget") + 1] == "auto"
    assert full[full.index("--speculative-ddtree-budget-max") + 1] == "63"
    default = service.server_argv(_host(tmp_path, ddtree_budget="auto"), "full")
    assert "--speculative-ddtree-budget-max" not in default  # the payload's default maximum
    assert service.largest_budget(_host(tmp_path, ddtree_budget="auto")) == service.AUTO_MAX_BUDGET == 127
    keep = _host(tmp_path, ddtree_budget="auto", ddtree_keep_chain=True).model_copy(update={"ddtree_budget_max": 7})
    with pytest.raises(UsageError, match="got a largest budget of 7"):
        service.server_argv(keep, "full")


def test_unit_has_the_required_settings(tmp_path: Path) -> None:
    unit = service.render_unit(_host(tmp_path, start_timeout_s=1200, stop_timeout_s=90), "full", secrets={})
    lines = unit.text.splitlines()
    for want in ("Type=exec", "TimeoutStartSec=1200", "TimeoutStopSec=90", "Restart=on-failure", "KillMode=control-group",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes", "ProtectKernelTunables=yes",
                 "DeviceAllow=/dev/nvidiactl rw", "StartLimitBurst=3", "EnvironmentFile=/etc/ddtree-ops/sglang.env"):
        assert want in lines, want
    assert not any(line.startswith(("PrivateDevices", "MemoryDenyWriteExecute")) for line in lines)
    assert unit.paths.unit_path == "/etc/systemd/system/sglang.service"


def test_drop_in_clears_execstart_first(tmp_path: Path) -> None:
    unit = service.render_unit(_host(tmp_path, unit_kind="drop-in"), "shadow-linear", secrets={})
    assert unit.paths.unit_path == "/etc/systemd/system/sglang.service.d/50-ddtree-ops.conf"
    lines = unit.text.splitlines()
    assert lines.index("ExecStart=") < next(i for i, line in enumerate(lines) if line.startswith('ExecStart="'))


def test_strict_undefined(tmp_path: Path) -> None:
    import jinja2

    with pytest.raises(jinja2.UndefinedError):
        service._jinja().get_template("sglang.service.j2").render(mode="full")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_hostile_values_verify_clean_with_systemd(tmp_path: Path) -> None:
    """systemd parses the rendered unit without a single warning (it exits 0 on unknown keys, so
    any output fails), whatever the paths and args hold."""
    exe_dir = tmp_path / "ven v %n"
    exe_dir.mkdir()
    (exe_dir / "python").symlink_to(sys.executable)
    host = _host(tmp_path, python=str(exe_dir / "python"), model_path=HOSTILE_MODEL, extra_args=HOSTILE_ARGS,
                 service_environment={"WEIRD": "a b $HOME %h \"q\" 'q'"}, read_write_paths=["/data/a b %n"])
    for mode in service.MODES:
        unit = service.render_unit(host, mode, secrets={"HF_TOKEN": SECRET})
        path = tmp_path / "sglang.service"
        path.write_text(unit.text)
        proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stdout + proc.stderr
        assert SECRET not in unit.text and "HF_TOKEN" not in unit.text.replace("(e.g. HF_TOKEN,", "")


def test_quoting_words() -> None:
    assert service.exec_word('a "b" %i \\ $X') == '"a \\"b\\" %%i \\\\ $$X"'
    assert service.env_file_value('x$y"z`\\') == '"x\\$y\\"z\\`\\\\"'
    with pytest.raises(UsageError):
        service.exec_word("a\nExecStartPre=/bin/evil")


def test_python_path_systemd_refuses(tmp_path: Path) -> None:
    for python in ("/opt/it's/python", "/opt/$venv/python"):
        with pytest.raises(UsageError, match="systemd"):
            service.server_argv(_host(tmp_path, python=python), "off")


def test_secrets_file_only_in_env_text(tmp_path: Path) -> None:
    secrets = tmp_path / "s.env"
    quoted = SECRET.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("`", "\\`")
    secrets.write_text(f'# comment\nHF_TOKEN="{quoted}"\n\n  OTHER = second-secret  \nSINGLE=\'a "b" $c\'\n')
    unit = service.render_unit(_host(tmp_path, service_secrets_file=str(secrets)), "full")
    assert SECRET not in unit.text and SECRET not in repr(unit)
    # KEY="v" is v, as systemd reads it: the quotes never reach the server or defeat redaction.
    assert f"HF_TOKEN={service.env_file_value(SECRET)}" in unit.env_text.splitlines()
    assert set(unit.secret_values) == {SECRET, "second-secret", 'a "b" $c'}
    assert service.redact({"a": [f"x{SECRET}y"]}, unit.secret_values) == {"a": ["x[secret]y"]}
    for bad in (f"not an assignment {SECRET}\n", f"export HF_TOKEN={SECRET}\n", "HF_TOKEN='pl4nted never closed\n"):
        secrets.write_text(bad)
        with pytest.raises(UsageError) as err:
            service.render_unit(_host(tmp_path, service_secrets_file=str(secrets)), "full")
        assert SECRET not in str(err.value) and "pl4nted" not in str(err.value) and ":1:" in str(err.value)


def test_credential_flags_go_to_the_env_file(tmp_path: Path) -> None:
    """An --api-key in extra_args: its value only in the 0600 env file, the unit says ${NAME}."""
    host = _host(tmp_path, extra_args=["--api-key", SECRET, "--admin-api-key=sk-admin", "--port-offset", "3"])
    unit = service.render_unit(host, "full", secrets={"HF_TOKEN": "hf-x"})
    assert SECRET not in unit.text and "sk-admin" not in unit.text and "hf-x" not in unit.text
    exec_line = next(line for line in unit.text.splitlines() if line.startswith("ExecStart="))
    assert '"--api-key" "${DDTREE_OPS_ARG_API_KEY}"' in exec_line
    assert '"--admin-api-key=${DDTREE_OPS_ARG_ADMIN_API_KEY}"' in exec_line and '"--port-offset" "3"' in exec_line
    assert f"DDTREE_OPS_ARG_API_KEY={service.env_file_value(SECRET)}" in unit.env_text.splitlines()
    assert "--api-key" in unit.argv and "${DDTREE_OPS_ARG_API_KEY}" in unit.argv and SECRET not in unit.argv
    assert set(unit.secret_values) >= {SECRET, "sk-admin", "hf-x"}
    with pytest.raises(UsageError, match="no value"):
        service.render_unit(_host(tmp_path, extra_args=["--api-key"]), "full", secrets={})


def test_credential_names_refused_in_the_unit_environment(tmp_path: Path) -> None:
    from ddtree_ops.inventory import InventoryError

    with pytest.raises(InventoryError, match="service_secrets_file"):
        _host(tmp_path, service_environment={"HF_TOKEN": "x"})


@pytest.mark.parametrize("field,value", [("env_file", "/etc/x.env\\"), ("service", "sglang\\"),
                                         ("model_path", "/m\\"), ("extra_args", ["--x", "y\\"])])
def test_trailing_backslash_refused(tmp_path: Path, field: str, value: object) -> None:
    """In a unit a trailing backslash joins the next line to this one: refused at load time."""
    from ddtree_ops.inventory import InventoryError

    with pytest.raises(InventoryError, match="backslash"):
        _host(tmp_path, **{field: value})


def test_unit_diff(tmp_path: Path) -> None:
    unit = service.render_unit(_host(tmp_path), "full", secrets={})
    assert service.unit_diff(unit.text, unit.text, "/x") == ""
    diff = service.unit_diff(unit.text.replace("full", "shadow-linear"), unit.text, "/x")
    assert "+ExecStart=" in diff and "-ExecStart=" in diff


def test_host_side_redaction_reads_the_env_file_we_write(tmp_path: Path) -> None:
    """The agent redacts journal excerpts with the env file's values: it must parse what
    service.py wrote back to the very same secret."""
    from ddtree_ops.agent.remote import units

    unit = service.render_unit(_host(tmp_path), "full", secrets={"HF_TOKEN": SECRET, "OTHER": "plain"})
    env = tmp_path / "sglang.env"
    env.write_text(unit.env_text)
    assert sorted(units._secret_values(env)) == sorted([SECRET, "plain"])
    assert redact_text(f"value={SECRET} ok", units._secret_values(env)) == "value=[secret] ok"

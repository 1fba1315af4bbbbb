"""One-line errors: a bad option or setting fails every ``gds-kv`` command, the demo's owner processes
included, in one line naming it and what it allows; the config file is every command's too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gds_kv_connector.cli.main import main
from gds_kv_connector.format.layout import LAYOUT_DIR


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("TLLM_GDS_KV_"):
            monkeypatch.delenv(k)
    return monkeypatch


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("argv, says", [
    (["demo", "--owners", "0"], "argument --owners: must be a whole number from 1 to 64, got '0'"),
    (["demo", "--rounds", "-1"], "argument --rounds: must be a whole number of at least 1, got '-1'"),
    (["demo", "--conversations", "many"], "argument --conversations: must be a whole number"),
    (["verify", "--workers", "0"], "argument --workers: must be a whole number from 1 to 256"),
    (["gc", "--max-age-s", "-5"], "argument --max-age-s: must be a number of seconds, 0 or more"),
    (["gc", "--quota", "3Q"], "argument --quota: expected a byte size such as 4MiB, got '3Q'"),
    (["metrics", "--port", "70000"], "argument --port: must be a whole number from 0 to 65535"),
])
def test_a_bad_option_is_one_line_naming_it_and_what_it_allows(capsys, clean_env, argv, says):
    err = _usage_error(capsys, argv)
    assert err.startswith(f"gds-kv {argv[0]}: ") and says in err and f"(see gds-kv {argv[0]} --help)" in err


@pytest.mark.parametrize("argv, hint", [
    (["stat"], "(did you mean stats?)"),
    (["stats", "--rooot", "/x"], "(did you mean --root?)"),
    (["demo", "--device", "cudaa"], "(did you mean cuda?)"),
])
def test_a_near_miss_names_what_was_meant(capsys, clean_env, argv, hint):
    assert hint in _usage_error(capsys, argv)


COMMANDS = [["demo"], ["settings", "--check"], ["doctor"], ["stats"], ["gc"], ["verify"], ["metrics"],
            ["bench", "--quick"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_every_command_refuses_a_bad_setting_in_one_line(capsys, clean_env, tmp_path, argv):
    clean_env.setenv("TLLM_GDS_KV_ROOT", str(tmp_path))
    clean_env.setenv("TLLM_GDS_KV_IO_THREADS", "0")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"gds-kv {argv[0]}: TLLM_GDS_KV_IO_THREADS='0': must be 1..256\n"
    clean_env.delenv("TLLM_GDS_KV_IO_THREADS")
    clean_env.setenv("TLLM_GDS_KV_QUOTA_BYTE", "1GiB")
    assert main(argv) == 2
    assert "TLLM_GDS_KV_QUOTA_BYTE (did you mean TLLM_GDS_KV_QUOTA_BYTES?)" in capsys.readouterr().err


def test_the_settings_reference_still_lists_with_a_bad_setting(capsys, clean_env):
    clean_env.setenv("TLLM_GDS_KV_IO_THREADS", "0")
    assert main(["settings"]) == 0
    assert "TLLM_GDS_KV_IO_THREADS" in capsys.readouterr().out


def test_every_command_takes_the_root_from_the_config_file(capsys, clean_env, tmp_path, monkeypatch):
    root = tmp_path / "pool"
    os.makedirs(root / LAYOUT_DIR)
    config = tmp_path / "gdskv.toml"
    config.write_text(f'root = "{root}"\n')
    clean_env.setenv("TLLM_GDS_KV_CONFIG", str(config))
    for argv in (["stats", "--json"], ["gc", "--dry-run", "--json"], ["verify", "--json"]):
        assert main(argv) == 0
        assert json.loads(capsys.readouterr().out)["root"] == str(root)
    assert main(["metrics"]) == 0
    assert f'root="{root}"' in capsys.readouterr().out
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["roots"][0]["path"] == str(root)
    assert main(["settings", "--check"]) == 0
    assert f"pool root(s) {root} (" in capsys.readouterr().out
    from gds_kv_connector.cli import demo
    seen = []
    monkeypatch.setattr(demo, "main", lambda root, **kw: seen.append(root) or 0)
    assert main(["demo"]) == 0 and seen == [str(root)]


def test_demo_device_cuda_without_a_gpu_is_one_line(capsys, clean_env, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert main(["demo", "--device", "cuda", "--root", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("gds-kv demo: --device cuda: torch sees no CUDA device here; use --device cpu "
                                       "(or auto)\n")


@pytest.mark.timeout(180)
def test_an_owner_process_that_fails_ends_the_demo_in_one_line(tmp_path):
    """A setting every value check passes but the connector refuses at start (a save backlog below one
    block) fails in the demo's owner process: one line naming it, no traceback from any process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")}
    env["TLLM_GDS_KV_MAX_QUEUED_SAVE_BYTES"] = "1"
    proc = subprocess.run([sys.executable, "-m", "gds_kv_connector.cli", "demo", "--root", str(tmp_path / "pool"),
                           "--device", "cpu", "--owners", "1", "--conversations", "1", "--rounds", "1"],
                          env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("gds-kv demo:")]
    assert line.startswith("gds-kv demo: owner 0: TLLM_GDS_KV_MAX_QUEUED_SAVE_BYTES=1 is below one block's")
    assert proc.stderr.strip() == line

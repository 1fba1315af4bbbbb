import json
import os
import re

import pytest

from gds_kv_connector.config.settings import SPECS, Settings, SettingsError, parse_size


def test_defaults_and_env(tmp_path):
    s = Settings.load_from(env={"TLLM_GDS_KV_ROOT": str(tmp_path), "TLLM_GDS_KV_ASYNC_LOAD_BYTES": "2MiB",
                                "TLLM_GDS_KV_FSYNC": "yes"})
    assert s.async_load_bytes == 2 << 20 and s.fsync is True and s.io_threads == 16 and s.roots == (str(tmp_path),)


def test_missing_root_is_one_clear_line():
    with pytest.raises(SettingsError, match="TLLM_GDS_KV_ROOT is not set"):
        Settings.load_from(env={})


@pytest.mark.parametrize("name,value,msg", [("IO_THREADS", "0", "1..256"), ("DEADLINE_S", "-1", "0.1s..1e+09s"),
                                            ("ASYNC_LOAD_BYTES", "lots", "byte size"), ("ENGINE", "gpu", "one of"),
                                            ("LOW_WATERMARK", "1.5", "between"), ("FSYNC", "maybe", "boolean"),
                                            ("ADMISSION", "seen:0", "seen:N"), ("COMPAT_IO", "cufile", "one of"),
                                            # infinities passed the range checks and failed while serving
                                            ("EVICT_GRACE_S", "inf", "a number"),
                                            ("STATS_INTERVAL_S", "1e400", "0 (off) or 0.1s..1e+09s"),
                                            ("DEADLINE_S", "2e9", "0.1s..1e+09s"), ("QUOTA_BYTES", "1e400", "whole number of bytes")])
def test_bad_values_fail_with_the_variable_named(name, value, msg):
    with pytest.raises(SettingsError, match=f"TLLM_GDS_KV_{name}.*{re.escape(msg)}"):
        Settings.load_from(env={"TLLM_GDS_KV_ROOT": "/x", f"TLLM_GDS_KV_{name}": value})


def test_unknown_variable_is_rejected():
    with pytest.raises(SettingsError, match="TLLM_GDS_KV_ROTO"):
        Settings.load_from(env={"TLLM_GDS_KV_ROOT": "/x", "TLLM_GDS_KV_ROTO": "/y"})


def test_a_name_in_the_wrong_case_is_rejected_not_ignored():
    """Only the upper-case name is read: a lower-case one would leave the default silently in force."""
    with pytest.raises(SettingsError, match="TLLM_GDS_KV_verify"):
        Settings.load_from(env={"TLLM_GDS_KV_ROOT": "/x", "TLLM_GDS_KV_verify": "0"})


@pytest.mark.parametrize("name,value", [("io_threads", 16.9), ("read_retries", True), ("root", None),
                                        ("model_id", None), ("deadline_s", "soon"), ("quota_bytes", 1.5),
                                        ("arena_bytes", False)])
def test_a_config_file_value_of_the_wrong_type_is_rejected_not_coerced(tmp_path, name, value):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"root": "/x", name: value}))
    with pytest.raises(SettingsError, match=name):
        Settings.load_from(env={"TLLM_GDS_KV_CONFIG": str(cfg)})


def test_config_file_and_env_precedence(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"root": "/from-file", "io_threads": 8, "fsync": True, "deadline_s": 30}))
    s = Settings.load_from(env={"TLLM_GDS_KV_CONFIG": str(cfg), "TLLM_GDS_KV_IO_THREADS": "4"})
    assert s.root == "/from-file" and s.io_threads == 4 and s.fsync is True and s.deadline_s == 30.0
    toml = tmp_path / "c.toml"
    toml.write_text('root = "/t"\nquota_bytes = "1GiB"\n')
    assert Settings.load_from(env={"TLLM_GDS_KV_CONFIG": str(toml)}).quota_bytes == 1 << 30
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"root": "/x", "nope": 1}))
    with pytest.raises(SettingsError, match="nope"):
        Settings.load_from(env={"TLLM_GDS_KV_CONFIG": str(bad)})


def test_every_setting_is_documented():
    """docs/configuration.md is the generated reference of SPECS, current: regenerate it with
    ``gds-kv settings --markdown > docs/configuration.md`` after changing a setting."""
    from gds_kv_connector.config.reference import markdown
    from tests.support import REPO

    assert all(s.doc and s.env.startswith("TLLM_GDS_KV_") for s in SPECS)
    with open(os.path.join(REPO, "docs", "configuration.md")) as fh:
        assert fh.read() == markdown(), "docs/configuration.md is stale: gds-kv settings --markdown > docs/configuration.md"
    assert parse_size("256KiB") == 262144 and parse_size("4M") == 4 << 20


def test_a_deadline_that_outlasts_tensorrt_llms_transfer_timeout_is_refused(pool_env, monkeypatch):
    """A save may end twice the deadline plus the grace after acceptance; past TensorRT-LLM's own
    timeout the process would fail before the connector could drop it."""
    import sys
    from types import SimpleNamespace

    from gds_kv_connector import GdsKvConnectorWorker
    from gds_kv_connector.simulator import fake_llm_args

    la = fake_llm_args(16)
    la.kv_connector_config = SimpleNamespace(transfer_timeout_sec=100)
    with pytest.raises(SettingsError, match=r"DEADLINE_S=60 lets a save end up to 121s .* timeout of 100s: set "
                                            r"TLLM_GDS_KV_DEADLINE_S below 49\.5"):
        GdsKvConnectorWorker(la)
    monkeypatch.setenv("TLLM_GDS_KV_DEADLINE_S", "45")
    GdsKvConnectorWorker(la)  # 91 s fits
    # a version without the setting: the executor module's constant, once the executor imported it
    monkeypatch.setitem(sys.modules, "tensorrt_llm._torch.pyexecutor.py_executor",
                        SimpleNamespace(_KV_CONNECTOR_LOAD_TIMEOUT_SEC=90))
    with pytest.raises(SettingsError, match="timeout of 90s"):
        GdsKvConnectorWorker(fake_llm_args(16))
    monkeypatch.setenv("TLLM_GDS_KV_DEADLINE_S", "40")
    GdsKvConnectorWorker(fake_llm_args(16))

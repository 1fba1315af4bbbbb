"""Trace ranges: NVTX ranges recorded while a tool is attached and free (the callback itself)
otherwise; torch.profiler ranges with TLLM_GDS_KV_TRACE=torch."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys

import pytest

from gds_kv_connector.config import trace_ranges
from gds_kv_connector.config.settings import Settings, SettingsError, import_time_value


class _FakeNvtx:
    """Records the ranges entered and left, as an attached tool would see them."""

    def __init__(self) -> None:
        self.entered: list[str] = []

    def annotate(self, message: str, color: str, domain: str):
        entered = self.entered

        @contextlib.contextmanager
        def rng():
            entered.append(f"{domain}:{message}")
            try:
                yield
            finally:
                entered.append("left")
        return _Reusable(rng)


class _Reusable:
    """A context manager that can be entered again, as nvtx.annotate can."""

    def __init__(self, factory) -> None:
        self.factory, self.cm = factory, None

    def __enter__(self):
        self.cm = self.factory()
        return self.cm.__enter__()

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


def test_without_a_tool_callbacks_are_returned_unwrapped(monkeypatch):
    monkeypatch.setattr(trace_ranges, "TRACING", False)

    def callback(x):
        return x + 1
    assert trace_ranges.traced("sched/match")(callback) is callback
    with trace_ranges.trace_range("io/load r{} x{}", "red", 1, 2) as got:
        assert got is None


def test_with_a_tool_callbacks_run_inside_their_range(monkeypatch):
    fake = _FakeNvtx()
    monkeypatch.setattr(trace_ranges, "TRACING", True)
    monkeypatch.setattr(trace_ranges, "_nvtx", fake)

    def get_num_new_matched_tokens(request, n):
        """doc"""
        assert fake.entered, "the range is entered before the callback runs"
        return n * 2, False
    wrapped = trace_ranges.traced("sched/match", "green")(get_num_new_matched_tokens)
    assert wrapped is not get_num_new_matched_tokens
    assert wrapped.__name__ == "get_num_new_matched_tokens" and wrapped.__doc__ == "doc"
    assert wrapped(None, 3) == (6, False)
    assert wrapped(None, n=4) == (8, False)
    with trace_ranges.trace_range("io/save r{} x{}", "orange", 7, 3):
        pass
    assert fake.entered == ["gds-kv-connector:gdskv/sched/match", "left", "gds-kv-connector:gdskv/sched/match",
                            "left", "gds-kv-connector:gdskv/io/save r7 x3", "left"]


def test_a_range_is_left_when_its_callback_raises(monkeypatch):
    fake = _FakeNvtx()
    monkeypatch.setattr(trace_ranges, "TRACING", True)
    monkeypatch.setattr(trace_ranges, "_nvtx", fake)

    @trace_ranges.traced("worker/get_finished")
    def failing():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        failing()
    assert fake.entered == ["gds-kv-connector:gdskv/worker/get_finished", "left"]


def test_the_tool_check_agrees_with_nvtx():
    nvtx = pytest.importorskip("nvtx")
    attached = isinstance(nvtx.get_domain("gds-kv-connector"), nvtx.Domain)
    assert trace_ranges.TRACING is attached


def _run_torch_mode(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")}
    env.update(TLLM_GDS_KV_TRACE="torch", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_torch_mode_puts_the_ranges_in_a_torch_profile():
    proc = _run_torch_mode(
        "import json, torch\n"
        "from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker\n"
        "from gds_kv_connector.config import trace_ranges\n"
        "assert trace_ranges.MODE == 'torch' and trace_ranges.TRACING\n"
        "decorated = [hasattr(c.__dict__[m], '__wrapped__') for c, m in ((GdsKvConnectorScheduler,\n"
        "             'get_num_new_matched_tokens'), (GdsKvConnectorWorker, 'get_finished'))]\n"
        "@trace_ranges.traced('sched/match')\n"
        "def callback(n):\n"
        "    return n + 1\n"
        "idle = trace_ranges.trace_range('io/load r{} x{}', 'red', 1, 2) is trace_ranges._NULL\n"
        "with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:\n"
        "    assert callback(1) == 2 and callback(n=2) == 3\n"
        "    with trace_ranges.trace_range('io/save r{} x{}', 'orange', 7, 3):\n"
        "        pass\n"
        "print(json.dumps({'decorated': decorated, 'idle': idle, 'names': [e.name for e in prof.events()]}))\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["decorated"] == [True, True]
    assert got["idle"], "no range is entered while no profiler runs"
    assert got["names"].count("gdskv/sched/match") == 2
    assert "gdskv/io/save r7 x3" in got["names"]


def test_default_mode_leaves_the_real_callbacks_undecorated_without_a_tool():
    if trace_ranges.TRACING:
        pytest.skip("an NVTX tool is attached to this run")
    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    assert trace_ranges.MODE == "nvtx"
    assert not hasattr(GdsKvConnectorScheduler.__dict__["get_num_new_matched_tokens"], "__wrapped__")
    assert not hasattr(GdsKvConnectorWorker.__dict__["get_finished"], "__wrapped__")


def test_a_mode_set_after_import_is_reported_not_silently_ignored(caplog):
    other = "torch" if trace_ranges.MODE == "nvtx" else "nvtx"
    with caplog.at_level(logging.WARNING, logger=trace_ranges.__name__):
        trace_ranges.check_mode(trace_ranges.MODE)
        assert not caplog.records
        trace_ranges.check_mode(other)
    assert len(caplog.records) == 1
    assert f"TLLM_GDS_KV_TRACE={other} is not in effect" in caplog.records[0].getMessage()


def test_the_import_time_read_takes_environment_then_file_then_default(monkeypatch, tmp_path):
    for k in [k for k in os.environ if k.startswith("TLLM_GDS_KV_")]:
        monkeypatch.delenv(k)
    assert import_time_value("trace") == "nvtx"
    cfg = tmp_path / "gdskv.toml"
    cfg.write_text('trace = "torch"\n')
    monkeypatch.setenv("TLLM_GDS_KV_CONFIG", str(cfg))
    assert import_time_value("trace") == "torch"
    monkeypatch.setenv("TLLM_GDS_KV_TRACE", "nvtx")
    assert import_time_value("trace") == "nvtx"
    monkeypatch.setenv("TLLM_GDS_KV_TRACE", "perfetto")  # malformed: the default here, an error at start-up
    assert import_time_value("trace") == "nvtx"
    with pytest.raises(SettingsError, match="TLLM_GDS_KV_TRACE='perfetto': must be one of nvtx, torch"):
        Settings.load_from(require_root=False)

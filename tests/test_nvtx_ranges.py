"""NVTX ranges: recorded while a tool is attached, and free (the callback itself) otherwise."""

from __future__ import annotations

import contextlib

import pytest

from gds_kv_connector import nvtx_ranges


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
    monkeypatch.setattr(nvtx_ranges, "TRACING", False)

    def callback(x):
        return x + 1
    assert nvtx_ranges.traced("sched/match")(callback) is callback
    with nvtx_ranges.nvtx_range("io/load r{} x{}", "red", 1, 2) as got:
        assert got is None


def test_with_a_tool_callbacks_run_inside_their_range(monkeypatch):
    fake = _FakeNvtx()
    monkeypatch.setattr(nvtx_ranges, "TRACING", True)
    monkeypatch.setattr(nvtx_ranges, "_nvtx", fake)

    def get_num_new_matched_tokens(request, n):
        """doc"""
        assert fake.entered, "the range is entered before the callback runs"
        return n * 2, False
    wrapped = nvtx_ranges.traced("sched/match", "green")(get_num_new_matched_tokens)
    assert wrapped is not get_num_new_matched_tokens
    assert wrapped.__name__ == "get_num_new_matched_tokens" and wrapped.__doc__ == "doc"
    assert wrapped(None, 3) == (6, False)
    assert wrapped(None, n=4) == (8, False)
    with nvtx_ranges.nvtx_range("io/save r{} x{}", "orange", 7, 3):
        pass
    assert fake.entered == ["gds-kv-connector:gdskv/sched/match", "left", "gds-kv-connector:gdskv/sched/match",
                            "left", "gds-kv-connector:gdskv/io/save r7 x3", "left"]


def test_a_range_is_left_when_its_callback_raises(monkeypatch):
    fake = _FakeNvtx()
    monkeypatch.setattr(nvtx_ranges, "TRACING", True)
    monkeypatch.setattr(nvtx_ranges, "_nvtx", fake)

    @nvtx_ranges.traced("worker/get_finished")
    def failing():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        failing()
    assert fake.entered == ["gds-kv-connector:gdskv/worker/get_finished", "left"]


def test_the_tool_check_agrees_with_nvtx():
    nvtx = pytest.importorskip("nvtx")
    attached = isinstance(nvtx.get_domain("gds-kv-connector"), nvtx.Domain)
    assert nvtx_ranges.TRACING is attached

"""Shared fixtures: an isolated pool root per test and the `gpu` marker's skip rule."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def pool_env(tmp_path, monkeypatch):
    """A fresh pool root in TLLM_GDS_KV_ROOT and no other connector settings from the caller."""
    for k in list(os.environ):
        if k.startswith("TLLM_GDS_KV_"):
            monkeypatch.delenv(k)
    root = tmp_path / "pool"
    monkeypatch.setenv("TLLM_GDS_KV_ROOT", str(root))
    return root


@pytest.fixture(params=["c", "python"])
def native_impl(request, monkeypatch):
    """Run a test with the C per-block loops (where the extension is built) and with their Python fallback."""
    from gds_kv_connector import native

    if request.param == "c" and not native.BUILT:
        pytest.skip("the C extension is not built here")
    if request.param == "python":
        monkeypatch.setattr(native, "_lib", None)
    return request.param

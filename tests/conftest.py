"""Shared fixtures: an isolated pool root per test, connector pairs, gated transfer rigs, and the `gpu`
marker's skip rule."""

from __future__ import annotations

import os

import pytest
import torch


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


@pytest.fixture
def connector_pair(pool_env):
    """``make(model, kv_shape, **llm_kw) -> (scheduler, worker)``: a worker registered over a zeroed
    bf16 KV cache of ``kv_shape`` and its scheduler, initialized; every worker made is shut down at
    the end of the test."""
    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    from gds_kv_connector.simulator import fake_llm_args

    made = []

    def make(model, kv_shape, tokens_per_block=4, **llm_kw):
        la = fake_llm_args(tokens_per_block, model=model, **llm_kw)
        worker = GdsKvConnectorWorker(la)
        made.append(worker)
        worker.register_kv_caches(torch.zeros(kv_shape, dtype=torch.bfloat16))
        sched = GdsKvConnectorScheduler(la)
        sched.wait_for_initialization()
        return sched, worker

    yield make
    for w in made:
        w.shutdown()


@pytest.fixture(params=["c", "python"])
def native_impl(request, monkeypatch):
    """Run a test with the C per-block loops (where the extension is built) and with their Python fallback."""
    from gds_kv_connector.format import native

    if request.param == "c" and not native.BUILT:
        pytest.skip("the C extension is not built here")
    if request.param == "python":
        monkeypatch.setattr(native, "_lib", None)
    return request.param


@pytest.fixture
def rig(tmp_path):
    """``make(**env) -> GatedRig``: a transfer manager over a fresh pool whose file operations the
    test holds and releases (gated_ops), with TLLM_GDS_KV_* overrides; each closed at the end."""
    from tests.support.gated_ops import GatedRig

    made = []

    def make(**env):
        r = GatedRig(str(tmp_path / f"pool{len(made)}"), **env)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()

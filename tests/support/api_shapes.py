"""Run a module's reference-executor tests against both TensorRT-LLM manager shapes.

A module that imports ``both_apis`` and says ``pytestmark = pytest.mark.usefixtures("both_apis")``
runs each test twice: with the release manager's call sequence and with the newest one's
(``ExecutorConfig.api``: prefix reservations, two bindings and three ``start_load_kv`` per
iteration).  A test that sets ``api`` itself (``"release"`` for one about the legacy query) keeps it.
"""

from __future__ import annotations

import dataclasses

import pytest

from gds_kv_connector.simulator import executor as executor_module


@pytest.fixture(params=["release", "newest"])
def both_apis(request, monkeypatch):
    init = executor_module.ReferenceExecutor.__init__

    def with_api(self, scheduler, worker, config):
        if not config.api:
            config = dataclasses.replace(config, api=request.param)
        init(self, scheduler, worker, config)

    monkeypatch.setattr(executor_module.ReferenceExecutor, "__init__", with_api)
    return request.param

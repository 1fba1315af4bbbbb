"""What besides tokens and salt decides a request's KV: a LoRA adapter (``lora_task_id``) and
multimodal inputs (``multimodal_hashes``).  Keyed on tokens alone, a request of another adapter, or
with another image behind the same placeholder tokens, loaded KV computed for the first one: wrong
answers and no error.  Multimodal data without hashes can be named by no key: such a request is
neither matched nor saved."""

from __future__ import annotations

import pytest

from tests.support.connector_helpers import make_executor, rand_tokens
from gds_kv_connector.format.keys import chain_seed, inputs_seed
from gds_kv_connector.simulator import SimRequest
from tests.support.api_shapes import both_apis  # noqa: E402,F401 (the fixture, used through pytestmark)

pytestmark = pytest.mark.usefixtures("both_apis")

PROMPT = rand_tokens(200, 1)  # 12 full blocks of 16 and 8 tokens


@pytest.fixture
def ex(pool_env):
    e = make_executor()
    yield e
    e.worker.shutdown()


def _serve(ex, rid: int, **inputs) -> int:
    """Run one request of PROMPT with ``inputs`` set on it: the blocks it saved."""
    req = SimRequest(rid, list(PROMPT), max_new_tokens=2)
    for name, value in inputs.items():
        setattr(req, name, value)
    saved = ex.worker.stats.snapshot().get("blocks_saved", 0)
    ex.submit(req)
    ex.run_until_done()
    for _ in range(3):  # its saves complete
        ex.step()
    return ex.worker.stats.snapshot().get("blocks_saved", 0) - saved


@pytest.mark.parametrize("first, other", [
    ({"lora_task_id": 1}, {"lora_task_id": 2}),
    ({}, {"lora_task_id": 7}),
    ({"multimodal_hashes": [[1, 2, 3, 4]]}, {"multimodal_hashes": [[9, 9, 9, 9]]}),
    ({"lora_task_id": 1, "multimodal_hashes": [[1, 2]]}, {"lora_task_id": 1, "multimodal_hashes": [[1, 3]]}),
])
def test_another_adapter_or_input_never_loads_the_first_one_s_kv(ex, first, other):
    before = ex.stats.loaded_tokens
    _serve(ex, 0, **first)
    assert ex.stats.loaded_tokens == before
    _serve(ex, 1, **other)
    assert ex.stats.loaded_tokens == before  # nothing of request 0's blocks
    _serve(ex, 2, **first)
    assert ex.stats.loaded_tokens - before == 12 * 16  # the same adapter and inputs still share


@pytest.mark.parametrize("media", [{"py_multimodal_data": {"image": object()}},
                                   # how the newest TensorRT-LLM marks media whose content it did not hash
                                   {"multimodal_positions": [3], "multimodal_lengths": [16]}])
def test_multimodal_data_without_hashes_is_neither_matched_nor_saved(ex, media):
    _serve(ex, 0)  # the plain prompt's blocks are in the pool
    before = ex.stats.loaded_tokens
    saved = _serve(ex, 1, **media)
    assert ex.stats.loaded_tokens == before and saved == 0
    assert ex.sched._opaque == set()  # forgotten when it finished


def test_inputs_seed_names_adapter_and_hashes_apart():
    base = chain_seed(b"\x01" * 32, None)
    seeds = {inputs_seed(base, lora, mm) for lora, mm in
             [(None, ()), (0, ()), (1, ()), (None, (0,)), (None, (0, 0)), (1, (0,)), (-1, ())]}
    assert len(seeds) == 7 and base not in seeds


def test_with_loading_off_the_salt_and_adapter_come_from_the_request(pool_env, monkeypatch):
    """The seed was made from the first report, which older RequestData versions give no salt: a
    writer with TLLM_GDS_KV_LOAD=false saved salted requests under the unsalted seed."""
    monkeypatch.setenv("TLLM_GDS_KV_LOAD", "false")
    writer = make_executor()
    try:
        req = SimRequest(0, list(PROMPT), max_new_tokens=2, cache_salt="tenant-a")
        req.lora_task_id = 3
        writer.submit(req)
        writer.run_until_done()
        for _ in range(3):
            writer.step()
        assert writer.worker.stats.snapshot().get("blocks_saved", 0) >= 12
    finally:
        writer.worker.shutdown()
    monkeypatch.setenv("TLLM_GDS_KV_LOAD", "true")
    reader = make_executor()
    try:
        plain = SimRequest(1, list(PROMPT), max_new_tokens=2)
        reader.submit(plain)
        assert reader.run_until_done().loaded_tokens == 0
        same = SimRequest(2, list(PROMPT), max_new_tokens=2, cache_salt="tenant-a")
        same.lora_task_id = 3
        reader.submit(same)
        assert reader.run_until_done().loaded_tokens == 12 * 16
    finally:
        reader.worker.shutdown()

"""The drop-in classes bind to TensorRT-LLM's real bases when present, and the mirror matches the contract."""

import inspect
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import gds_kv_connector.connector.trtllm_mirror as mirror
from tests.support import REPO as _REPO

REPO = pathlib.Path(_REPO)

STUB = textwrap.dedent("""
    import sys, types
    from dataclasses import dataclass, field
    from abc import ABC
    def mod(name):
        m = types.ModuleType(name); sys.modules[name] = m; return m
    for n in ["tensorrt_llm", "tensorrt_llm._torch", "tensorrt_llm._torch.pyexecutor",
              "tensorrt_llm._torch.pyexecutor.connectors", "tensorrt_llm._utils"]:
        mod(n)
    sys.modules["tensorrt_llm._utils"].mpi_rank = lambda: 0
    target = mod("{path}")
    class KvCacheConnectorScheduler(ABC):
        supports_attention_dp = False
        def __init__(self, llm_args): self._llm_args = llm_args
    class KvCacheConnectorWorker(ABC):
        supports_attention_dp = False
        def __init__(self, llm_args): self._llm_args = llm_args; self._metadata = None
        def bind_connector_meta(self, m): self._metadata = m
    @dataclass
    class RequestData:
        request_id: int; new_tokens: list; new_block_ids: list; computed_position: int; num_scheduled_tokens: int
        cache_salt: str = None
    @dataclass
    class SchedulerOutput:
        new_requests: list = field(default_factory=list); cached_requests: list = field(default_factory=list)
    for c in (KvCacheConnectorScheduler, KvCacheConnectorWorker, RequestData, SchedulerOutput):
        setattr(target, c.__name__, c)
    {hide_new}
    import gds_kv_connector as g
    from gds_kv_connector.connector import trtllm_api
    assert trtllm_api.SOURCE == "{path}", trtllm_api.SOURCE
    assert issubclass(g.GdsKvConnectorScheduler, KvCacheConnectorScheduler)
    assert issubclass(g.GdsKvConnectorWorker, KvCacheConnectorWorker)
    assert g.GdsKvConnectorScheduler.supports_attention_dp is True and g.GdsKvConnectorWorker.supports_attention_dp is True
    print("BOUND", trtllm_api.SOURCE)
""")

NEW = "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"
OLD = "tensorrt_llm._torch.pyexecutor.kv_cache_connector"


def _run(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_binds_to_new_module_path():
    assert f"BOUND {NEW}" in _run(STUB.format(path=NEW, hide_new=""))


def test_falls_back_to_old_module_path():
    # the new path's parent exists but the module does not: the import of NEW fails, OLD is used
    assert f"BOUND {OLD}" in _run(STUB.format(path=OLD, hide_new=""))


def test_without_tensorrt_llm_uses_mirror():
    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    from gds_kv_connector.connector import trtllm_api
    assert trtllm_api.SOURCE == "gds_kv_connector.connector.trtllm_mirror"
    assert issubclass(GdsKvConnectorScheduler, mirror.KvCacheConnectorScheduler)
    assert issubclass(GdsKvConnectorWorker, mirror.KvCacheConnectorWorker)


def test_only_one_module_imports_tensorrt_llm():
    pattern = re.compile(r"^\s*(from|import)\s+tensorrt_llm", re.M)
    importers = [p.name for p in (REPO / "gds_kv_connector").rglob("*.py") if pattern.search(p.read_text())]
    assert importers == ["trtllm_api.py"]


def _params(fn):
    return [p.name for p in inspect.signature(fn).parameters.values()]


def test_mirror_matches_contract():
    W, S = mirror.KvCacheConnectorWorker, mirror.KvCacheConnectorScheduler
    assert W.supports_attention_dp is False and S.supports_attention_dp is False
    expected_worker = {
        "__init__": ["self", "llm_args"], "bind_connector_meta": ["self", "metadata"],
        "get_connector_meta": ["self"], "_clear_connector_meta": ["self"],
        "register_forward_pass_callable": ["self"], "register_kv_caches": ["self", "kv_cache_tensor"],
        "register_kv_cache_layout": ["self", "layout"], "start_load_kv": ["self", "stream"],
        "wait_for_layer_load": ["self", "layer_idx", "stream"], "save_kv_layer": ["self", "layer_idx", "stream"],
        "wait_for_save": ["self", "stream"],
        "get_finished": ["self", "finished_gen_req_ids", "started_loading_req_ids"],
        "get_finished_prefix_loads": ["self"]}
    expected_sched = {
        "__init__": ["self", "llm_args"], "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
        "update_state_after_alloc": ["self", "request", "block_ids"],
        "update_state_after_alloc_by_layer_group": ["self", "request", "block_ids_by_layer_group"],
        "build_connector_meta": ["self", "scheduler_output"],
        "request_finished": ["self", "request", "cache_block_ids"],
        "request_finished_by_layer_group": ["self", "request", "cache_block_ids_by_layer_group"],
        "wait_for_initialization": ["self"],
        "reserve_prefix": ["self", "request", "num_computed_tokens", "reservation_id"],
        "release_prefix_reservation": ["self", "request", "reservation_id", "start", "end"]}
    for cls, table in ((W, expected_worker), (S, expected_sched)):
        for name, params in table.items():
            assert _params(getattr(cls, name)) == params, (cls.__name__, name)
    assert W.__abstractmethods__ == {"register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                                     "wait_for_save", "get_finished"}
    assert S.__abstractmethods__ == {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                                     "request_finished"}
    rd = [f for f in mirror.RequestData.__dataclass_fields__]
    assert rd == ["request_id", "new_tokens", "new_block_ids", "computed_position", "num_scheduled_tokens",
                  "block_hashes", "priorities", "cache_salt", "new_block_ids_by_layer_group"]
    assert list(mirror.SchedulerOutput.__dataclass_fields__) == ["new_requests", "cached_requests",
                                                                  "attention_dp_rank", "prefix_loads"]
    assert list(mirror.PrefixLoad.__dataclass_fields__) == ["reservation_id", "request_id", "start", "end",
                                                             "is_async", "block_ids_by_layer_group", "tokens",
                                                             "cache_salt"]


def test_connector_signatures_match_the_bases():
    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    for ours, base, extra in ((GdsKvConnectorWorker, mirror.KvCacheConnectorWorker, {"register_kv_cache_layout"}),
                              (GdsKvConnectorScheduler, mirror.KvCacheConnectorScheduler,
                               {"update_state_after_alloc_by_layer_group", "request_finished_by_layer_group"})):
        for name in base.__abstractmethods__ | extra:
            assert _params(getattr(ours, name)) == _params(getattr(base, name)), name


def test_the_model_revision_and_a_zero_block_size_are_read_not_defaulted():
    """Two checkpoints of one model name must not share a fingerprint; tokens_per_block=0 is an
    error, not the default 32."""
    from types import SimpleNamespace

    from gds_kv_connector.connector.llm_config import read_llm_args

    def args(**kw):
        return SimpleNamespace(model="org/m", kv_cache_config=SimpleNamespace(tokens_per_block=32), **kw)

    assert read_llm_args(args()).model_id == "org/m"
    assert read_llm_args(args(revision="main")).model_id == "org/m@main"
    assert read_llm_args(args(revision="0123abcd")).model_id == "org/m@0123abcd"
    assert read_llm_args(args(revision="main"), "mine").model_id == "mine"  # TLLM_GDS_KV_MODEL_ID replaces both
    with pytest.raises(ValueError, match="tokens_per_block must be positive, got 0"):
        read_llm_args(SimpleNamespace(model="org/m", kv_cache_config=SimpleNamespace(tokens_per_block=0)))

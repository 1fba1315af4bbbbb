"""Connector behaviour through the reference executor (contract sections 4 and 5)."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tests.support.connector_helpers import SHAPE, make_executor, rand_tokens, serve
from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
from gds_kv_connector.engines.fileops import FileOps
from gds_kv_connector.engines.kv_layout import LayoutError, pool_from_tensor
from gds_kv_connector.connector.metadata import GdsKvMetadata
from gds_kv_connector.simulator import ExecutorConfig, InvariantViolation, ReferenceExecutor, SimRequest, fake_llm_args
from tests.support.api_shapes import both_apis  # noqa: E402,F401 (the fixture, used through pytestmark)

pytestmark = pytest.mark.usefixtures("both_apis")

SYSTEM = rand_tokens(200, 1)
PROMPTS = [SYSTEM + rand_tokens(30 + i, 100 + i) for i in range(4)]


def _restart_hits(**cfg_kw):
    ex1 = make_executor(**cfg_kw)
    serve(ex1, PROMPTS)
    ex1.worker.shutdown()
    ex2 = make_executor(**cfg_kw)
    st = serve(ex2, PROMPTS)
    for i, p in enumerate(PROMPTS):
        assert ex2.output_tokens(i) == ex1.output_tokens(i)
    ex2.worker.shutdown()
    return ex1, ex2, st


def test_restart_loads_every_full_prompt_block(pool_env):
    _, ex2, st = _restart_hits()
    tpb = SHAPE.tokens_per_block
    assert st.loaded_tokens == sum((len(p) - 1) // tpb * tpb for p in PROMPTS)
    assert st.blocks_verified >= st.loaded_tokens // tpb
    assert ex2.worker.stats.snapshot().get("load_failures", 0) == 0


def test_restart_loads_a_long_prompt_keyed_and_stat_ed_in_one_call(pool_env, monkeypatch):
    """A prompt of CHAIN_PRESENT_MIN_BLOCKS blocks or more that a new process finds saved is
    matched through match_chain's one call (FileOps.chain_present) and loads whole."""
    from gds_kv_connector.format import native
    from gds_kv_connector.store.pool import CHAIN_PRESENT_MIN_BLOCKS

    calls = []
    real = FileOps.chain_present

    def spy(self, *args):
        got = real(self, *args)
        calls.append(None if got is None else len(got[1]))
        return got

    monkeypatch.setattr(FileOps, "chain_present", spy)
    tpb = SHAPE.tokens_per_block
    prompt = rand_tokens((CHAIN_PRESENT_MIN_BLOCKS + 8) * tpb + 3, 77)
    cfg = dict(shape=SHAPE, num_blocks=CHAIN_PRESENT_MIN_BLOCKS + 32)
    ex1 = make_executor(ExecutorConfig(**cfg))
    serve(ex1, [prompt], max_new_tokens=2)
    ex1.worker.shutdown()
    ex2 = make_executor(ExecutorConfig(**cfg))
    st = serve(ex2, [prompt], max_new_tokens=2, first_id=10)
    ex2.worker.shutdown()
    assert ex2.output_tokens(10) == ex1.output_tokens(0)
    assert st.loaded_tokens == (len(prompt) - 1) // tpb * tpb
    # the first process answered from the first block alone (not in the pool); the second found every
    # block in the one call (None: the extension is not built)
    assert calls == ([CHAIN_PRESENT_MIN_BLOCKS + 8] if native.BUILT else [None])


def test_chunked_prefill_and_overlap(pool_env):
    ex1, _, st = _restart_hits(chunk_size=20, overlap=True)
    assert st.loaded_tokens > 0
    # generated tokens become full blocks and are saved too (prompts + 40 generated tokens)
    assert ex1.worker.stats.snapshot()["blocks_saved"] >= len(PROMPTS[0]) // SHAPE.tokens_per_block


def test_generated_blocks_are_saved_and_reused(pool_env):
    ex1 = make_executor()
    serve(ex1, [PROMPTS[0]], max_new_tokens=40)
    ex1.worker.shutdown()
    follow_up = PROMPTS[0] + ex1.output_tokens(0) + rand_tokens(5, 9)
    ex2 = make_executor()
    st = serve(ex2, [follow_up], first_id=50)
    tpb = SHAPE.tokens_per_block
    assert st.loaded_tokens >= (len(PROMPTS[0]) + 40 - tpb) // tpb * tpb  # prompt + generated blocks hit


def test_matching_starts_after_the_device_hit(pool_env):
    ex1 = make_executor()
    serve(ex1, PROMPTS[:1])
    ex1.worker.shutdown()
    ex2 = make_executor()
    st = serve(ex2, PROMPTS[:1], first_id=10, device_hit_blocks=3)
    tpb = SHAPE.tokens_per_block
    assert st.device_hit_tokens == 3 * tpb
    assert st.loaded_tokens == (len(PROMPTS[0]) - 1) // tpb * tpb - 3 * tpb


def test_cache_salt_separates(pool_env):
    ex1 = make_executor()
    serve(ex1, PROMPTS[:1], salt="tenant-a")
    ex1.worker.shutdown()
    ex2 = make_executor()
    assert serve(ex2, PROMPTS[:1], first_id=10, salt="tenant-b").loaded_tokens == 0
    ex3 = make_executor()
    assert serve(ex3, PROMPTS[:1], first_id=20, salt="tenant-a").loaded_tokens > 0


@pytest.mark.parametrize("threshold,expect_async", [("0", True), ("1GiB", False)])
def test_async_threshold(pool_env, monkeypatch, threshold, expect_async):
    serve(make_executor(), PROMPTS[:2])
    monkeypatch.setenv("TLLM_GDS_KV_ASYNC_LOAD_BYTES", threshold)
    st = serve(make_executor(), PROMPTS[:2], first_id=10)
    assert (st.async_loads, st.sync_loads) == ((2, 0) if expect_async else (0, 2))


class SlowWrites(FileOps):
    """Holds every payload write until released, so saves are observably in flight."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def pwrite(self, fd, data, offset):
        if offset > 0:
            self.release.wait(timeout=30)
        return super().pwrite(fd, data, offset)


def test_request_finishing_with_saves_in_flight_keeps_blocks_until_reported(pool_env):
    ops = SlowWrites()
    llm_args = fake_llm_args(SHAPE.tokens_per_block)
    ex = ReferenceExecutor(GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args, fileops=ops),
                           ExecutorConfig(shape=SHAPE, num_blocks=64))
    ex.submit(SimRequest(1, PROMPTS[0], max_new_tokens=2))
    for _ in range(50):
        ex.step()
        if ex.reqs[1].state.value == "saving":
            break
    assert ex.reqs[1].state.value == "saving" and ex.reqs[1].block_ids  # blocks retained
    t0 = time.monotonic()
    for _ in range(20):  # idle iterations: only get_finished runs, the save must not be reported
        ex.step()
    assert ex.reqs[1].state.value == "saving" and ex.stats.idle_iterations >= 20
    ops.release.set()
    ex.run_until_done()
    assert ex.reqs[1].state.value == "done" and len(ex.free) == 64
    assert ex.worker.stats.snapshot()["blocks_saved"] == len(PROMPTS[0]) // SHAPE.tokens_per_block
    assert time.monotonic() - t0 < 30


class _BrokenScheduler(GdsKvConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, True


class _DoubleReportWorker(GdsKvConnectorWorker):
    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        saving, loading = super().get_finished(finished_gen_req_ids, started_loading_req_ids)
        return saving + saving, loading  # every finished id reported twice


class _GreedyScheduler(GdsKvConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return len(request.get_tokens(0)), False


@pytest.mark.parametrize("sched_cls,worker_cls,match,api", [
    (_BrokenScheduler, GdsKvConnectorWorker, "load_kv_async must be False", "release"),  # the legacy query's
    (GdsKvConnectorScheduler, _DoubleReportWorker, "not pending", ""),
    (_GreedyScheduler, GdsKvConnectorWorker, "leaves no prompt token", "release"),
])
def test_executor_invariants_catch_broken_connectors(pool_env, sched_cls, worker_cls, match, api):
    llm_args = fake_llm_args(SHAPE.tokens_per_block)
    ex = ReferenceExecutor(sched_cls(llm_args), worker_cls(llm_args),
                           ExecutorConfig(shape=SHAPE, num_blocks=128, api=api))
    with pytest.raises(InvariantViolation, match=match):
        serve(ex, PROMPTS[:2])


def test_executor_catches_wrong_bytes_when_verification_is_off(pool_env, monkeypatch):
    serve(make_executor(), PROMPTS[:1])
    monkeypatch.setenv("TLLM_GDS_KV_VERIFY", "0")
    ex = make_executor()
    for path in (pool_env / "gdskv-v1").rglob("*.blk"):  # corrupt payloads, leave headers valid
        with open(path, "r+b") as fh:
            fh.seek(4096 + 100)
            fh.write(b"\xde\xad")
    with pytest.raises(InvariantViolation, match="does not hold the KV of its prefix"):
        serve(ex, PROMPTS[:1], first_id=5)


def test_corrupted_block_is_detected_by_checksum_and_quarantined(pool_env, monkeypatch):
    serve(make_executor(), PROMPTS[:1])
    files = sorted((pool_env / "gdskv-v1").rglob("*.blk"))
    with open(files[0], "r+b") as fh:
        fh.seek(4096 + 7)
        b = fh.read(1)
        fh.seek(4096 + 7)
        fh.write(bytes([b[0] ^ 0x01]))
    ex = make_executor()
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        serve(ex, PROMPTS[:1], first_id=5)
    assert not files[0].exists() and list((pool_env / "gdskv-v1" / "quarantine").iterdir())


def test_empty_metadata_and_dummies(pool_env):
    llm_args = fake_llm_args(SHAPE.tokens_per_block)
    s, w = GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args)
    w.register_kv_caches(torch.zeros((8, 2, 2, 1024), dtype=torch.bfloat16))
    s.wait_for_initialization()
    dummy = SimpleNamespace(request_id=1, is_dummy_request=True, get_tokens=lambda b: list(range(100)))
    assert s.get_num_new_matched_tokens(dummy, 0) == (0, False)
    assert s.request_finished(dummy, [1, 2]) is False
    for meta in (GdsKvMetadata(), None):
        w.bind_connector_meta(meta)
        w.start_load_kv(None)
        for layer in range(2):
            w.wait_for_layer_load(layer, None)
            w.save_kv_layer(layer, None)
        w.wait_for_save(None)
        assert w.get_finished([], []) == ([], [])
    empty = s.build_connector_meta(SimpleNamespace(new_requests=[], cached_requests=[]))
    assert empty is None  # nothing to load or save: nothing to broadcast or bind


def test_bad_page_entries_are_skipped(pool_env):
    ex1 = make_executor()
    serve(ex1, PROMPTS[:1])
    ex1.worker.shutdown()
    llm_args = fake_llm_args(SHAPE.tokens_per_block)
    s, w = GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args)
    w.register_kv_caches(torch.zeros((64, 2, 2, 1024), dtype=torch.bfloat16))
    req = SimpleNamespace(request_id=3, get_tokens=lambda b: list(PROMPTS[0]))
    n, _ = s.get_num_new_matched_tokens(req, 0)
    blocks = list(range(n // SHAPE.tokens_per_block + 1))
    blocks[1] = -1
    s.update_state_after_alloc(req, blocks)
    first = SimpleNamespace(request_id=3, new_tokens=list(PROMPTS[0]), new_block_ids=blocks, computed_position=0,
                            num_scheduled_tokens=1)
    meta = s.build_connector_meta(SimpleNamespace(new_requests=[first], cached_requests=[]))
    (op,) = meta.loads
    assert -1 not in op.block_ids and len(op.block_ids) == len(blocks) - 2


class _Layout:
    def __init__(self, tensor, groups=1, regions=1, dtype=None):
        self._t = tensor
        if dtype is not None:
            self.dtype = dtype
        region = SimpleNamespace()
        self.groups = tuple(SimpleNamespace(layer_group_id=g, regions=(region,) * regions, replicated_regions=())
                            for g in range(groups))

    def as_single_pool_tensor(self):
        return self._t


def test_register_kv_cache_layout(pool_env):
    llm_args = fake_llm_args(SHAPE.tokens_per_block)
    w = GdsKvConnectorWorker(llm_args)
    w.register_kv_cache_layout(_Layout(torch.zeros((8, 2, 2, 1024), dtype=torch.uint8)))
    assert w.kv.block_bytes == 2 * 2 * 1024 and w.kv.dtype_name == "uint8"
    for bad, match in ((_Layout(None, groups=2), "2 layer groups"), (_Layout(None, regions=2), "2 regions"),
                       (_Layout(None), "as_single_pool_tensor")):
        with pytest.raises(LayoutError, match=match):
            GdsKvConnectorWorker(llm_args).register_kv_cache_layout(bad)
    with pytest.raises(LayoutError, match="contiguous"):
        GdsKvConnectorWorker(llm_args).register_kv_caches(torch.zeros((2, 8, 4, 64)).transpose(0, 1))


def test_a_byte_layout_is_fingerprinted_with_the_configured_precision(pool_env):
    """A V2 layout's byte tensor looks the same for fp16 and bf16 KV (equal block sizes): the
    configured dtypes (or the layout's declared dtype) keep their pools apart; a typed tensor's
    fingerprint does not depend on them (pools saved before stay found)."""
    def fingerprint(tensor, layout_dtype=None, as_layout=True, **cfg):
        llm_args = fake_llm_args(SHAPE.tokens_per_block)
        for name, value in cfg.items():
            if name == "kv":
                llm_args.kv_cache_config.dtype = value
            elif name == "quant":
                llm_args.quant_config = SimpleNamespace(kv_cache_quant_algo=value)
            else:
                setattr(llm_args, name, value)
        w = GdsKvConnectorWorker(llm_args)
        if as_layout:
            w.register_kv_cache_layout(_Layout(tensor, dtype=layout_dtype))
        else:
            w.register_kv_caches(tensor)
        try:
            return w.pool.fingerprint
        finally:
            w.shutdown()

    raw = torch.zeros((8, 2, 2, 1024), dtype=torch.uint8)
    fp16, bf16 = fingerprint(raw, dtype="float16"), fingerprint(raw, dtype="bfloat16")
    assert fp16 != bf16 != fingerprint(raw) != fp16
    assert fingerprint(raw, dtype="float16") == fp16  # the same configuration finds its pool again
    assert fingerprint(raw, kv="fp8") != fingerprint(raw, kv="auto") == fingerprint(raw)
    assert fingerprint(raw, quant="FP8") != fingerprint(raw)
    assert fingerprint(raw, torch.float16) != fingerprint(raw, torch.bfloat16)
    assert fingerprint(raw, torch.bfloat16) == fingerprint(torch.zeros((8, 2, 2, 512), dtype=torch.bfloat16))
    typed = torch.zeros((8, 2, 2, 512), dtype=torch.bfloat16)
    assert fingerprint(typed, dtype="float16") == fingerprint(typed) == fingerprint(typed, kv="fp8")
    # a uint8 tensor handed to register_kv_caches (V1: a packed FP4 cache) keeps its fingerprint
    assert fingerprint(raw, as_layout=False, dtype="float16") == fingerprint(raw, as_layout=False) != fingerprint(raw)


def test_block_views_are_each_blocks_bytes_made_once():
    t = torch.arange(6 * 2 * 2 * 8, dtype=torch.int16).reshape(6, 2, 2, 8)
    kv = pool_from_tensor(t)
    views = kv.block_views([4, 0, 4])
    assert [v.numpy().tobytes() for v in views] == [t[b].numpy().tobytes() for b in (4, 0, 4)]
    assert views[0] is views[2] is kv.block_view(4)  # kept, not made again
    views[1][:] = 0  # a view, not a copy
    assert not t[0].any()
    for bad in (-1, 6):
        with pytest.raises(IndexError, match="outside the pool's 6 blocks"):
            kv.block_views([1, bad])


def test_executor_splits_its_callback_time_by_callback(pool_env):
    """The reference executor's per-callback account covers the same spans as its totals (the bench's
    breakdown reads it instead of wrapping the callbacks, whose wrapper time would land in the totals)."""
    ex = make_executor(api="release")  # counts the legacy query's callbacks
    ex.stats = type(ex.stats)()
    ex.callback_times.clear()  # start-up callbacks are not per-iteration cost
    st = serve(ex, PROMPTS[:2], max_new_tokens=4)
    times = ex.callback_times
    hooks = ("save_kv_layer", "wait_for_layer_load")
    assert sum(c for name, (c, _) in times.items() if name in hooks) == st.layer_hook_calls > 0
    assert sum(s for name, (_, s) in times.items() if name in hooks) == pytest.approx(st.layer_hook_s, rel=1e-9)
    assert sum(s for name, (_, s) in times.items() if name not in hooks) == pytest.approx(st.callback_s, rel=1e-9)
    assert times["get_num_new_matched_tokens"][0] == times["update_state_after_alloc"][0] == 2
    assert times["request_finished"][0] == 2
    assert times["get_finished"][0] == st.iterations
    ex.worker.shutdown()


def test_a_layout_of_another_page_size_than_llm_args_says_is_refused(pool_env):
    """Keys cut every 16 tokens over pages of 32 would publish each page's bytes under the key of a
    shorter prefix, which another prompt sharing only that prefix would load."""
    llm_args = fake_llm_args(SHAPE.tokens_per_block)
    layout = _Layout(torch.zeros((8, 2, 2, 1024), dtype=torch.uint8))
    layout.tokens_per_block = 2 * SHAPE.tokens_per_block
    with pytest.raises(LayoutError, match="layout has 32 tokens per block, but llm_args says 16"):
        GdsKvConnectorWorker(llm_args).register_kv_cache_layout(layout)
    layout.tokens_per_block = SHAPE.tokens_per_block
    w = GdsKvConnectorWorker(llm_args)
    w.register_kv_cache_layout(layout)
    w.shutdown()


@pytest.mark.parametrize("where", ["kv_dtype", "quant_algo"])
def test_an_nvfp4_kv_cache_is_refused(pool_env, where):
    """Its block scales live in a pool of their own: a loaded block would be read with whatever
    scales its page's scale slot held."""
    llm_args = fake_llm_args(SHAPE.tokens_per_block)
    if where == "kv_dtype":
        llm_args.kv_cache_config.dtype = "nvfp4"
    else:
        llm_args.quant_config = SimpleNamespace(kv_cache_quant_algo="NVFP4")
    with pytest.raises(LayoutError, match="NVFP4 KV cache"):
        GdsKvConnectorWorker(llm_args).register_kv_caches(torch.zeros((8, 2, 2, 512), dtype=torch.int8))
    llm_args.dtype = "nvfp4-is-not-the-kv"  # the model's dtype is not the KV's
    llm_args.kv_cache_config.dtype, llm_args.quant_config = "fp8", None
    w = GdsKvConnectorWorker(llm_args)
    w.register_kv_caches(torch.zeros((8, 2, 2, 512), dtype=torch.int8))
    w.shutdown()


@pytest.mark.parametrize("where", ["llm_args", "parallel_config"])
@pytest.mark.parametrize("kind", ["cp", "pp"])
def test_context_and_pipeline_parallelism_are_refused(pool_env, where, kind):
    """Under CP each rank holds part of a sequence's KV, under PP some layers' KV: a block saved
    under its prefix's key would be a fragment.  Both halves refuse them in one line at start-up."""
    llm_args = fake_llm_args(SHAPE.tokens_per_block)
    if where == "llm_args":
        setattr(llm_args, "context_parallel_size" if kind == "cp" else "pipeline_parallel_size", 2)
    else:
        llm_args.parallel_config = SimpleNamespace(tp_size=1, **{f"{kind}_size": 2})
    for cls in (GdsKvConnectorWorker, GdsKvConnectorScheduler):
        with pytest.raises(ValueError, match=rf"{kind}_size=2\b") as err:
            cls(llm_args)
        assert "\n" not in str(err.value)
    llm_args.context_parallel_size = llm_args.pipeline_parallel_size = 1
    llm_args.parallel_config = SimpleNamespace(tp_size=1, cp_size=1, pp_size=1)
    w = GdsKvConnectorWorker(llm_args)
    w.register_kv_caches(torch.zeros((8, 2, 2, 512), dtype=torch.int8))
    w.shutdown()

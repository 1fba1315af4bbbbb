"""The slot arena on a CUDA KV pool: registered slabs, coalesced 2D DMA, a second owner's mapping,
and the connector end to end with TLLM_GDS_KV_ARENA_BYTES on a /dev/shm root."""

import hashlib
import os
import shutil
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.support.connector_helpers import serve  # noqa: E402
from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker  # noqa: E402
from gds_kv_connector.store.arena import SlotArena  # noqa: E402
from gds_kv_connector.store.base import open_store  # noqa: E402
from gds_kv_connector.engines.select import make_engine  # noqa: E402
from gds_kv_connector.store.pool import BlockPool  # noqa: E402
from gds_kv_connector.format.records import ZERO_KEY  # noqa: E402
from gds_kv_connector.simulator import ExecutorConfig, ModelShape, ReferenceExecutor, fake_llm_args  # noqa: E402

from tests.gpu.test_gpu_connector import PROMPTS  # noqa: E402

FP = hashlib.sha256(b"gpu-arena").digest()


@pytest.fixture
def shm_root():
    d = f"/dev/shm/gdskv-gpu-arena-{os.getpid()}-{time.time_ns()}"
    os.makedirs(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _arena_pool(root, engine, payload, slots, mapped=True):
    pool = BlockPool((root,), FP, payload, 32, refs=True)
    pool.arena = SlotArena(pool, engine, slots * pool.file_size, 64 * pool.file_size, 0.0, mapped=mapped)
    pool.arena.start(background=False)
    return pool


@pytest.mark.parametrize("order", ["consecutive", "shuffled"])
def test_arena_round_trip_and_second_owner(shm_root, order):
    payload, n = 256 << 10, 96
    engine = make_engine("kvikio", torch.device("cuda"), 8)
    kv = torch.randint(0, 256, (n, payload), dtype=torch.uint8, device="cuda")
    idx = list(range(n)) if order == "consecutive" else list(torch.randperm(n).tolist())
    keys = [hashlib.sha256(bytes([i, 7])).digest() for i in range(n)]
    a = _arena_pool(shm_root, engine, payload, 128)
    out = open_store(a, engine).save([keys[i] for i in idx], [ZERO_KEY] * n, [kv[i] for i in idx])
    assert (out.published, out.arena_fallback) == (n, 0), out.failed[:1]
    # the second owner: its own arena, a's slabs mapped and registered read-side on first use
    b = _arena_pool(shm_root, make_engine("kvikio", torch.device("cuda"), 8), payload, 64)
    for pool in (a, b):
        got = torch.zeros_like(kv)
        pins = open_store(pool).pin([keys[i] for i in idx])
        open_store(pool, pool.arena.mapper).load(pins, [got[i] for i in idx], verify=True, retries=0,
                    deadline=time.monotonic() + 30)
        torch.cuda.synchronize()
        assert torch.equal(got, kv)
    a.arena.close(), b.arena.close()


@pytest.mark.parametrize("compat_io", ["staged", "kvikio"])
@pytest.mark.parametrize("order", ["consecutive", "shuffled"])
def test_disk_arena_round_trip_and_second_owner(tmp_path, order, compat_io):
    """Slabs on a disk filesystem (pytest's tmp_path), moved by the engine: the staged O_DIRECT
    path joins adjacent slots into larger I/Os; KvikIO's path moves them one by one."""
    payload, n = 256 << 10, 96
    engine = make_engine("kvikio", torch.device("cuda"), 8, compat_io=compat_io)
    kv = torch.randint(0, 256, (n, payload), dtype=torch.uint8, device="cuda")
    idx = list(range(n)) if order == "consecutive" else list(torch.randperm(n).tolist())
    keys = [hashlib.sha256(bytes([i, 9])).digest() for i in range(n)]
    a = _arena_pool(str(tmp_path), engine, payload, 128, mapped=False)
    out = open_store(a, engine).save([keys[i] for i in idx], [ZERO_KEY] * n, [kv[i] for i in idx])
    assert (out.published, out.arena_fallback) == (n, 0), out.failed[:1]
    other = make_engine("kvikio", torch.device("cuda"), 8, compat_io=compat_io)
    b = _arena_pool(str(tmp_path), other, payload, 64, mapped=False)
    for pool, eng in ((a, engine), (b, other)):
        got = torch.zeros_like(kv)
        pins = open_store(pool).pin([keys[i] for i in idx])
        open_store(pool, eng).load(pins, [got[i] for i in idx], verify=False, retries=0,
                    deadline=time.monotonic() + 30)
        torch.cuda.synchronize()
        assert torch.equal(got, kv)
    a.arena.close(), b.arena.close()
    engine.close(), other.close()


def test_connector_with_arena_restart_round_trip(pool_env, monkeypatch, shm_root):
    monkeypatch.setenv("TLLM_GDS_KV_ROOT", shm_root)
    monkeypatch.setenv("TLLM_GDS_KV_ARENA_BYTES", "64MiB")
    shape = ModelShape(num_layers=4, kv_factor=2, block_elems=8192, tokens_per_block=16)

    def executor():
        llm_args = fake_llm_args(16)
        ex = ReferenceExecutor(GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args),
                               ExecutorConfig(shape=shape, num_blocks=256, device="cuda", chunk_size=128))
        return ex

    ex1 = executor()
    ex1.worker.pool.arena.wait_ready(60)
    serve(ex1, PROMPTS)
    saved = ex1.worker.stats.snapshot()
    ex1.worker.shutdown()
    assert saved.get("blocks_saved", 0) > 0 and not saved.get("save_arena_fallback")
    ex2 = executor()  # a restart: adopts ex1's slabs (their owner lock is free) and loads from them
    ex2.worker.pool.arena.wait_ready(60)
    assert ex2.worker.pool.arena.usage().get("slabs_adopted", 0) >= 1
    st = serve(ex2, PROMPTS)
    assert st.loaded_tokens == sum((len(p) - 1) // 16 * 16 for p in PROMPTS)
    assert st.blocks_verified >= st.loaded_tokens // 16
    for i in range(len(PROMPTS)):
        assert ex2.output_tokens(i) == ex1.output_tokens(i)
    ex2.worker.shutdown()


def test_host_dma_round_trip_in_any_order(shm_root):
    """The engine's copies alone, consecutive and scattered slots, both directions."""
    payload, n = 64 << 10, 40
    engine = make_engine("kvikio", torch.device("cuda"), 8)
    pool = _arena_pool(shm_root, engine, payload, 64)
    slots = pool.arena.alloc(n)
    kv = torch.randint(0, 256, (n, payload), dtype=torch.uint8, device="cuda")
    scattered = torch.randperm(n)[:20].tolist()  # 20 blocks into the first 20 slots, in random order
    rest = sorted(set(range(n)) - set(scattered))  # the others into the next slots, consecutively
    pairs = ([(pool.arena.payload_addr(*slots[j]), i) for j, i in enumerate(scattered)]
             + [(pool.arena.payload_addr(*slots[20 + j]), i) for j, i in enumerate(rest)])
    engine.copy_to_host([(a, kv[i]) for a, i in pairs[:20]], pool.file_size)
    engine.copy_to_host([(a, kv[i]) for a, i in pairs[20:]], pool.file_size)
    back = torch.zeros_like(kv)
    engine.copy_from_host([(a, back[i]) for a, i in pairs], pool.file_size)
    torch.cuda.synchronize()
    assert torch.equal(back, kv)
    pool.arena.close()

"""The connector on a CUDA KV pool: KvikIO engine, CUDA-event ordering, 2 ADP owners on one GPU."""

import os
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.support.connector_helpers import rand_tokens, serve  # noqa: E402
from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker  # noqa: E402
from gds_kv_connector.cli.demo import run_phase, summarize  # noqa: E402
from gds_kv_connector.simulator import ExecutorConfig, ModelShape, ReferenceExecutor, fake_llm_args  # noqa: E402
from gds_kv_connector.simulator.workload import Workload  # noqa: E402

SHAPE = ModelShape(num_layers=4, kv_factor=2, block_elems=8192, tokens_per_block=16)
PROMPTS = [rand_tokens(300, 1) + rand_tokens(40, 10 + i) for i in range(4)]


def _gpu_executor(dtype=torch.bfloat16):
    shape = ModelShape(num_layers=4, kv_factor=2, block_elems=8192 if dtype == torch.bfloat16 else 16384,
                       tokens_per_block=16, dtype=dtype)
    llm_args = fake_llm_args(shape.tokens_per_block)
    return ReferenceExecutor(GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args),
                             ExecutorConfig(shape=shape, num_blocks=256, device="cuda", chunk_size=128))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=["bf16", "fp8-as-uint8"])
@pytest.mark.parametrize("compat", ["ON", "OFF"], ids=["kvikio-posix", "cufile-or-fallback"])
def test_restart_round_trip_on_gpu(pool_env, monkeypatch, dtype, compat):
    monkeypatch.setenv("KVIKIO_COMPAT_MODE", compat)
    ex1 = _gpu_executor(dtype)
    path = ex1.worker.transfers.engine.data_path()
    assert ex1.worker.transfers.engine.name == "kvikio"
    serve(ex1, PROMPTS)
    ex1.worker.shutdown()
    ex2 = _gpu_executor(dtype)
    st = serve(ex2, PROMPTS)
    assert st.loaded_tokens == sum((len(p) - 1) // 16 * 16 for p in PROMPTS)
    assert st.blocks_verified >= st.loaded_tokens // 16
    for i in range(len(PROMPTS)):
        assert ex2.output_tokens(i) == ex1.output_tokens(i)
    print(f"data path ({compat}): {path}")
    assert ("ON" in path) if compat == "ON" else ("cufile" in path or "gds" in path or "fallback:" in path)
    ex2.worker.shutdown()


def test_wait_for_save_does_not_block_and_disk_matches_gpu(pool_env):
    llm_args = fake_llm_args(16)
    s, w = GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args)
    pool = torch.zeros((32, 4, 2, 8192), dtype=torch.bfloat16, device="cuda")
    w.register_kv_caches(pool)
    s.wait_for_initialization()
    from gds_kv_connector.connector.metadata import GdsKvMetadata
    from gds_kv_connector.transfer.jobs import SaveOp
    key = os.urandom(32)
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU time queued before the "forward" writes the block
    pool[3].fill_(1.5)  # the forward's write, ordered after the sleep on the stream
    w.bind_connector_meta(GdsKvMetadata(saves=[SaveOp(7, (key,), (b"\0" * 32,), (3,))]))
    t0 = time.perf_counter()
    w.wait_for_save(stream)
    returned_after = time.perf_counter() - t0
    assert returned_after < 0.2, returned_after  # no stream.synchronize() on the executor thread
    assert w.get_finished([7], []) == ([], [])  # the save cannot have finished: its event is still pending
    deadline = time.monotonic() + 30
    done = []
    while not done and time.monotonic() < deadline:
        done, _ = w.get_finished([], [])
        time.sleep(0.01)
    assert done == [7]
    with open(w.pool.path_for(key), "rb") as fh:
        fh.seek(4096)
        on_disk = torch.frombuffer(bytearray(fh.read(pool[3].numel() * 2)), dtype=torch.bfloat16)
    assert torch.equal(on_disk, pool[3].flatten().cpu())
    w.shutdown()


def test_corrupted_file_is_caught_by_the_gpu_checksum(pool_env):
    ex1 = _gpu_executor()
    serve(ex1, PROMPTS[:1])
    ex1.worker.shutdown()
    victim = sorted((pool_env / "gdskv-v1").rglob("*.blk"))[0]
    with open(victim, "r+b") as fh:
        fh.seek(4096 + 12345)
        b = fh.read(1)
        fh.seek(4096 + 12345)
        fh.write(bytes([b[0] ^ 0x80]))
    ex2 = _gpu_executor()
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        serve(ex2, PROMPTS[:1], first_id=9)
    assert not victim.exists()


def test_two_adp_owners_on_one_gpu_share_a_pool(tmp_path):
    env = {"TLLM_GDS_KV_ROOT": str(tmp_path), "TLLM_GDS_KV_ASYNC_LOAD_BYTES": "256KiB"}
    cfg = ExecutorConfig(shape=SHAPE, num_blocks=512, chunk_size=128, device="cuda")
    wl = Workload(conversations=4, rounds=2, system_tokens=320, turn_tokens=40, answer_tokens=16)
    s = summarize("adp-gpu", run_phase("adp-gpu", 2, wl, cfg, env, progress=False), SHAPE.block_bytes)
    assert s["rounds"][1]["loaded_tokens"] > 0 and s["connector"].get("load_failures", 0) == 0
    assert "staged" in s["data_path"] or "kvikio" in s["data_path"] or "cufile" in s["data_path"] or "gds" in s["data_path"]

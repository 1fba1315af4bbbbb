"""Saves staged ahead on a CUDA device: a request is reported once its batch's pages are staged, and
what its pages hold after that never reaches its files, with more batches staged than transfer
threads (TLLM_GDS_KV_STAGE_AHEAD)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time

import pytest
import torch

from gds_kv_connector.engines.select import make_engine
from gds_kv_connector.engines.kv_layout import pool_from_tensor
from gds_kv_connector.transfer.jobs import SaveOp
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.records import HEADER_SIZE, ZERO_KEY
from gds_kv_connector.config.settings import Settings
from gds_kv_connector.util.counters import Stats
from gds_kv_connector.transfer.manager import TransferManager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("kvikio") is None,
                       reason="needs a CUDA device and KvikIO"),
]

BLOCK = 1 << 20
REQUESTS, PER_REQUEST = 8, 4


def test_pages_reused_at_report_never_reach_the_files(tmp_path):
    root = str(tmp_path)
    env = {"TLLM_GDS_KV_TRANSFER_THREADS": "1", "TLLM_GDS_KV_STAGE_AHEAD": "3", "TLLM_GDS_KV_IO_THREADS": "2",
           "TLLM_GDS_KV_DEADLINE_S": "60", "TLLM_GDS_KV_MAX_QUEUED_SAVE_BYTES": "0"}
    kv_tensor = torch.randint(0, 256, (REQUESTS * PER_REQUEST, BLOCK), dtype=torch.uint8, device="cuda")
    want = kv_tensor.to("cpu", copy=True)
    engine = make_engine("auto", torch.device("cuda", 0), 2)
    pool = BlockPool((root,), hashlib.sha256(root.encode()).digest(), BLOCK, 32, index_ttl_s=600)
    tm = TransferManager(pool, engine, pool_from_tensor(kv_tensor), Settings.load_from(env=env, require_root=False,
                                                                                       root=root), Stats())
    try:
        ops = []
        for r in range(REQUESTS):
            keys = tuple(os.urandom(32) for _ in range(PER_REQUEST))
            ops.append(SaveOp(r + 1, keys, (ZERO_KEY,) * PER_REQUEST,
                              tuple(range(r * PER_REQUEST, (r + 1) * PER_REQUEST))))
        torch.cuda.synchronize()
        for op in ops:  # one batch each: with one transfer thread, all but the first queue
            tm.submit_saves([op], None)
        finished, reported, most = [op.request_id for op in ops], set(), 0
        end = time.monotonic() + 60
        while len(reported) < REQUESTS or tm._inflight:
            most = max(most, tm._running)
            done, _ = tm.poll(finished, [])
            finished = []
            for rid in done:  # TensorRT-LLM hands the pages to another request at once
                reported.add(rid)
                kv_tensor[(rid - 1) * PER_REQUEST:rid * PER_REQUEST].fill_(0xEE)
            torch.cuda.synchronize()
            assert time.monotonic() < end, f"reported {sorted(reported)} of {REQUESTS} within 60 s"
            time.sleep(0.0005)
        print(f"\ndata path {engine.data_path()}; at most {most} batches running at once")
        for op in ops:
            for key, block in zip(op.keys, op.block_ids):
                with open(pool.path_for(key), "rb") as f:
                    f.seek(HEADER_SIZE)
                    assert f.read(BLOCK) == bytes(want[block].numpy()), f"request {op.request_id} block {block}"
        assert tm.stats.snapshot()["blocks_saved"] == REQUESTS * PER_REQUEST
    finally:
        tm.shutdown()

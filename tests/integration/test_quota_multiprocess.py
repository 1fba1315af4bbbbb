"""Writers fill a shared pool past its quota while readers keep loading blocks they touched.

The guarantee under test: once a reader's touch is flushed (and any eviction run that started
before it has finished), the block stays loadable for the grace period, and every owner's
CapacityGuard keeps the pool within quota in the end.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
import traceback

import torch

from gds_kv_connector.store.base import LoadFailure, open_store
from gds_kv_connector.maintenance.capacity import CapacityGuard
from gds_kv_connector.engines.posix import PosixEngine
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.records import ZERO_KEY
from gds_kv_connector.maintenance.pool_scan import scan_pool
from gds_kv_connector.maintenance.recency import RecencyLog

FP = b"\x42" * 32
PAYLOAD = 16384
FILE = 4096 + PAYLOAD
QUOTA = 200 * FILE
GRACE_S = 1.5
SETTLE_S = 0.3  # longer than any eviction run here: a run that read recency before a flush is over
WRITE_S = 6.0
BLOCKS_PER_SECOND = 60  # per writer: 3 writers x 6 s x 60 = 1080 blocks, over 5x the quota


def _pool(root: str) -> BlockPool:
    return BlockPool((root,), FP, PAYLOAD, 16, geometry_note="multiprocess test")


def writer(root: str, seed: int, results) -> None:
    try:
        pool, engine = _pool(root), PosixEngine(io_threads=2)
        rl = RecencyLog(root, f"writer{seed}", flush_interval_s=0.2)
        guard = CapacityGuard([root], quota_bytes=QUOTA, low_watermark=0.8, min_free_bytes=0, grace_s=GRACE_S,
                              recency=rl, check_interval_s=0.5)
        rng = random.Random(seed)
        written, start = 0, time.monotonic()
        while time.monotonic() - start < WRITE_S:
            keys = [rng.randbytes(32) for _ in range(4)]  # one chain of four blocks
            views = [torch.randint(0, 256, (PAYLOAD,), dtype=torch.uint8) for _ in keys]
            out = open_store(pool, engine).save(keys, [ZERO_KEY] + keys[:-1], views)
            assert not out.failed, out.failed
            guard.note_saved(out.published * FILE)
            written += out.published
            time.sleep(max(0.0, start + written / BLOCKS_PER_SECOND - time.monotonic()))
        time.sleep(GRACE_S)  # let the last writes age out of the grace, then a final run
        assert guard.check_now(timeout=10)
        guard.close()
        rl.close()
        engine.close()
        results.put(("writer", seed, written, 0, ""))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put(("writer", seed, 0, 0, traceback.format_exc()))


def reader(root: str, seed: int, results) -> None:
    try:
        pool, engine = _pool(root), PosixEngine(io_threads=2)
        pool.index_ttl_s = 0  # every lookup asks the filesystem: eviction is the point here
        rl = RecencyLog(root, f"reader{seed}", flush_interval_s=0)  # flushes explicitly below
        rng = random.Random(seed)
        loads = established = 0
        failures: list[str] = []
        end = time.monotonic() + WRITE_S
        while time.monotonic() < end:
            blocks = scan_pool(root).blocks
            if not blocks:
                time.sleep(0.05)
                continue
            keys = [b.key for b in rng.sample(blocks, min(4, len(blocks)))]
            rl.touch(keys)
            rl.flush()
            protected_until = time.monotonic() + GRACE_S - 0.2
            time.sleep(SETTLE_S)
            present = [k for k in keys if pool.contains(k)]  # gone before the touch counted: not ours
            established += len(present)
            while present and time.monotonic() < protected_until:
                try:
                    pins = open_store(pool).pin(present)
                    try:
                        views = [torch.empty(PAYLOAD, dtype=torch.uint8) for _ in pins]
                        open_store(pool, engine).load(pins, views, verify=True, retries=0,
                                    deadline=time.monotonic() + 5)
                        loads += len(pins)
                    finally:
                        for p in pins:
                            pool.unpin(p)
                except LoadFailure as exc:
                    failures.append(str(exc))
                    break
                time.sleep(0.05)
        rl.close()
        engine.close()
        results.put(("reader", seed, loads, established, "\n".join(failures)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put(("reader", seed, 0, 0, traceback.format_exc()))


def test_quota_holds_and_touched_blocks_stay_loadable(tmp_path):
    root = str(tmp_path)
    _pool(root)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=writer, args=(root, i, results)) for i in range(3)]
    procs += [ctx.Process(target=reader, args=(root, 100 + i, results)) for i in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    problems = [f"{role} {seed}: {err}" for role, seed, _, _, err in outcomes if err]
    assert not problems, "\n".join(problems)
    written = sum(n for role, _, n, _, _ in outcomes if role == "writer")
    assert written * FILE > 3 * QUOTA  # the pool really was pushed past its quota
    for role, seed, loads, established, _ in outcomes:
        if role == "reader":
            assert loads > 0 and established > 0, f"reader {seed} never held a touched block"
    usage = sum(b.size for b in scan_pool(root).blocks)
    assert usage <= QUOTA, f"{usage} bytes in the pool, quota {QUOTA}"
    assert os.listdir(os.path.join(root, "gdskv-v1", "owners"))

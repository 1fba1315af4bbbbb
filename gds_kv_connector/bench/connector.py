"""The connector's own save and load paths (store.blocks with the engine the connector would choose), run on
long-lived, warmed transfer threads as a worker's are.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from gds_kv_connector.store.arena import SlotArena, maps_slabs
from gds_kv_connector.store.base import open_store
from gds_kv_connector.engines.select import make_engine
from gds_kv_connector.engines.kv_layout import pool_from_tensor
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.records import ZERO_KEY
from gds_kv_connector.config.settings import Settings
from gds_kv_connector.bench.common import (
    Budget, GC, KvikioDefaults, TOKENS_PER_BLOCK, Tracer, rand_bytes, sync_device, drop_caches, gbps, syncfs)


def _run_batches(batches: list[list[int]], fn: Callable[[list[int]], int], threads: int,
                 deadline: float, pool: ThreadPoolExecutor | None = None) -> tuple[int, float, int, bool]:
    """Run ``fn`` over batches on ``threads`` threads (like the connector's transfer threads) until
    all are done or ``deadline``; returns (bytes, seconds, batches done, capped by time).  ``pool``:
    long-lived threads to run on (a rig's, set up by its warm-up), else new ones for this call."""
    it = iter(batches)
    lock = threading.Lock()
    capped = [False]
    count = [0]

    def worker() -> int:
        moved = 0
        while True:
            if time.monotonic() >= deadline:
                capped[0] = True
                return moved
            with lock:
                b = next(it, None)
            if b is None:
                return moved
            moved += fn(b)
            with lock:
                count[0] += 1

    t0 = time.perf_counter()
    ex = pool or ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bench-xfer")
    try:
        total = sum(f.result() for f in [ex.submit(worker) for _ in range(min(threads, len(batches)))])
    finally:
        if pool is None:
            ex.shutdown(wait=True)
    secs = time.perf_counter() - t0
    return total, secs, count[0], capped[0] and count[0] < len(batches)


class ConnectorRig:
    """A pool directory, a BlockPool and an engine as the worker would build them."""

    def __init__(self, root: str, payload: int, device: torch.device, io_threads: int, tag: str,
                 kvd: KvikioDefaults, arena_bytes: int = 0, transfer_threads: int = 1) -> None:
        """``arena_bytes`` > 0: the pool runs a slot arena of that size (TLLM_GDS_KV_ARENA_BYTES), built
        here before anything is timed; how long that took is kept in ``arena_setup_s``.
        ``transfer_threads``: the long-lived threads the timed phases run on, as a worker's are."""
        kvd.restore()  # a fresh engine, as in a fresh process
        self.root = root
        fp = hashlib.sha256(f"gdskv-bench/{tag}/{os.getpid()}/{time.time_ns()}".encode()).digest()
        self.pool = BlockPool((root,), fp, payload, TOKENS_PER_BLOCK, index_ttl_s=600.0, refs=arena_bytes > 0)
        # TLLM_GDS_KV_COMPAT_IO, as the worker reads it (the user's to force, like the engine)
        compat_io = Settings.load_from(require_root=False).compat_io
        self.engine = make_engine("auto", device, io_threads, compat_io=compat_io)
        self.device = device
        self.payload = payload
        self.arena_setup_s: float | None = None
        self.transfer_threads = transfer_threads
        self.xfer = ThreadPoolExecutor(max_workers=transfer_threads, thread_name_prefix="bench-xfer")
        if arena_bytes:
            t0 = time.perf_counter()
            self.pool.arena = SlotArena(self.pool, self.engine, arena_bytes, 256 << 20, 5.0,
                                        mapped=maps_slabs(root))
            self.pool.arena.start(background=False)
            self.arena_setup_s = round(time.perf_counter() - t0, 3)

    @property
    def mode(self) -> str:
        if self.pool.arena is None:
            return "block files"
        return "arena" if self.pool.arena.mapped else "arena on disk"

    def warm_up(self) -> None:
        """Probe, thread pools and checksum kernels, outside every timed region: one block saved
        and loaded on each transfer thread, which sets up its CUDA streams and pinned staging as a
        connector's long-lived transfer threads do once in their life (the barrier puts one
        warm-up on each thread)."""
        views = rand_bytes((self.transfer_threads, self.payload), self.device, 1)
        gate = threading.Barrier(self.transfer_threads)

        def one(view: torch.Tensor) -> None:
            gate.wait(timeout=120)
            key = hashlib.sha256(b"warm" + os.urandom(8)).digest()
            out = open_store(self.pool, self.engine).save([key], [ZERO_KEY], [view])
            if out.failed:
                raise RuntimeError(f"warm-up save failed: {out.failed[0][1]}")
            load_keys(self.pool, self.engine, [key], [view], retries=2, timeout_s=60)
            with contextlib.suppress(OSError):
                os.unlink(self.pool.path_for(key))
            self.pool.forget(key)

        for f in [self.xfer.submit(one, views[t]) for t in range(self.transfer_threads)]:
            f.result()

    def close(self) -> None:
        self.xfer.shutdown(wait=True)
        if self.pool.arena is not None:
            self.pool.arena.close()
        self.engine.close()


def load_keys(pool: BlockPool, engine: Any, keys: list[bytes], views: list[torch.Tensor], retries: int,
              timeout_s: float) -> int:
    """Pin, load (checksums verified) and unpin one batch, as a connector's transfer thread does;
    returns the bytes loaded."""
    pins = open_store(pool).pin(keys)
    try:
        return open_store(pool, engine).load(pins, views, verify=True, retries=retries,
                           deadline=time.monotonic() + timeout_s)
    finally:
        pool.unpin_all(pins)


def save_timing(nbytes: int, secs: float, sync_s: float) -> dict:
    """A save row's bytes and times: GBps counts until syncfs returned, returned_GBps without it."""
    return {"bytes": nbytes, "seconds": round(secs, 4), "syncfs_seconds": round(sync_s, 4),
            "returned_GBps": round(gbps(nbytes, secs), 3), "GBps": round(gbps(nbytes, secs + sync_s), 3)}


def median_run(rows: list[dict]) -> dict:
    """The run with the median GB/s, with every run's GB/s beside it: a phase of a fraction of a
    second is moved by a single stall of the host, so one run alone can mislead."""
    ordered = sorted(rows, key=lambda r: r["GBps"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["GBps_runs"] = [r["GBps"] for r in rows]
    out["gc_runs"] = [r.get("gc") for r in rows]
    return out


def connector_phase(rig: ConnectorRig, kv: torch.Tensor, keys: list[bytes], parents: list[bytes],
                    batch_blocks: int, budget: Budget, is_memory: bool, global_drop: bool,
                    tracer: Tracer, label: str) -> tuple[dict, dict]:
    pool, engine, threads = rig.pool, rig.engine, rig.transfer_threads
    n = kv.shape[0]
    # The blocks as the worker's KvPool hands them to transfers.  Every view is made here, before the
    # clock starts: a worker makes each block's view once in its life, and making them inside the first
    # save phase (1-2 us of GIL-held time each) cut 256 KiB saves by about a sixth.
    blocks = pool_from_tensor(kv)
    blocks.block_views(range(n))
    saved: list[int] = []
    lock = threading.Lock()

    def do_save(idx: list[int]) -> int:
        with tracer.rf(f"bench/save_blocks x{len(idx)}"):
            out = open_store(pool, engine).save([keys[i] for i in idx], [parents[i] for i in idx],
                              blocks.block_views(idx))
        if out.failed:
            raise RuntimeError(f"{len(out.failed)} block saves failed (first cause: {out.failed[0][1]})")
        with lock:
            saved.extend(idx)
        return out.bytes_written

    batches = [list(range(i, min(n, i + batch_blocks))) for i in range(0, n, batch_blocks)]
    sync_device(rig.device)
    with tracer.rf(f"bench/connector/{label}/save"):
        gc_mark = GC.mark()
        nbytes, secs, _, capped = _run_batches(batches, do_save, threads, time.monotonic() + budget.cap(), rig.xfer)
        gc_save = GC.since(gc_mark)
        t0 = time.perf_counter()
        syncfs(rig.root)
        sync_s = time.perf_counter() - t0
    budget.phases_left -= 1
    save = {"direction": "save", "blocks": len(saved), **save_timing(nbytes, secs, sync_s), "capped_by_time": capped,
            "gc": gc_save}

    # load what was saved, into zeroed blocks, cold from the device for a disk target; arena slots
    # are looked up through their reference files, as an owner that did not save them would
    saved.sort()
    if pool.arena is not None:
        pool.arena.drop_caches()
    kv.zero_()
    sync_device(rig.device)
    drop = None if is_memory else drop_caches([rig.root], global_drop)

    def do_load(idx: list[int]) -> int:
        with tracer.rf(f"bench/load_blocks x{len(idx)}"):
            return load_keys(pool, engine, [keys[i] for i in idx], blocks.block_views(idx), retries=2,
                             timeout_s=120)

    batches = [saved[i:i + batch_blocks] for i in range(0, len(saved), batch_blocks)]
    with tracer.rf(f"bench/connector/{label}/load"):
        gc_mark = GC.mark()
        nbytes, secs, _, capped = _run_batches(batches, do_load, threads, time.monotonic() + budget.cap(), rig.xfer)
        gc_load = GC.since(gc_mark)
    budget.phases_left -= 1
    load = {"direction": "load", "blocks": nbytes // rig.payload, "bytes": nbytes, "seconds": round(secs, 4),
            "GBps": round(gbps(nbytes, secs), 3), "capped_by_time": capped, "cold_cache": not is_memory,
            "drop_caches": drop, "gc": gc_load}
    return save, load

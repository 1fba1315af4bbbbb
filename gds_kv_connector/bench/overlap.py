"""How much saves and loads running beside a GPU compute loop slow that loop."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
import time

import torch

from gds_kv_connector.store.base import open_store
from gds_kv_connector.format.records import ZERO_KEY
from gds_kv_connector.bench.common import KvikioDefaults, MiB, Tracer, rand_bytes, gbps
from gds_kv_connector.bench.connector import ConnectorRig, load_keys


def overlap(root: str, device: torch.device, io_threads: int, threads: int, block: int, kvd: KvikioDefaults,
            target_s: float, tracer: Tracer) -> dict:
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    stream = torch.cuda.Stream(device)

    def compute(k: int) -> tuple[float, float]:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            start.record(stream)
            for _ in range(k):
                torch.mm(a, b, out=c)
            end.record(stream)
        end.synchronize()
        return time.perf_counter() - t0, start.elapsed_time(end) / 1e3

    compute(5)
    per = compute(20)[0] / 20
    k = int(min(20000, max(20, target_s / per)))
    rig = ConnectorRig(os.path.join(root, "overlap"), block, device, io_threads, "overlap", kvd)
    per_thread = max(2, (256 * MiB) // block)
    kv = rand_bytes((threads * per_thread, block), device, 11)
    stop = threading.Event()
    moved = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []
    started = threading.Barrier(threads + 1)
    try:
        rig.warm_up()
        with tracer.rf("bench/overlap/compute_alone"):
            alone = [compute(k) for _ in range(2)]

        def xfer(t: int) -> None:
            views = [kv[t * per_thread + j] for j in range(per_thread)]
            gen = 0
            with contextlib.suppress(threading.BrokenBarrierError):
                started.wait()
            try:
                while not stop.is_set():
                    keys = [hashlib.sha256(f"ov/{t}/{gen}/{j}".encode()).digest() for j in range(per_thread)]
                    gen += 1
                    with tracer.rf(f"bench/save_blocks x{per_thread}"):
                        o = open_store(rig.pool, rig.engine).save(keys, [ZERO_KEY] * per_thread, views)
                    if o.failed:
                        raise RuntimeError(f"overlap save failed: {o.failed[0][1]}")
                    with tracer.rf(f"bench/load_blocks x{per_thread}"):
                        load_keys(rig.pool, rig.engine, keys, views, retries=2, timeout_s=120)
                    for key in keys:
                        with contextlib.suppress(OSError):
                            os.unlink(rig.pool.path_for(key))
                        rig.pool.forget(key)
                    with lock:
                        moved[0] += 2 * per_thread * block
            except BaseException as exc:  # noqa: BLE001 - reported
                errors.append(exc)

        ths = [threading.Thread(target=xfer, args=(t,), daemon=True) for t in range(threads)]
        for th in ths:
            th.start()
        started.wait()
        time.sleep(0.2)  # transfers in full flight before the clock starts
        m0 = moved[0]
        with tracer.rf("bench/overlap/compute_with_transfers"):
            wall, gpu = compute(k)
        m1 = moved[0]
        stop.set()
        for th in ths:
            th.join(120)
        with tracer.rf("bench/overlap/compute_alone_after"):
            alone.append(compute(k))
    finally:
        stop.set()
        rig.close()
        shutil.rmtree(rig.root, ignore_errors=True)
    if errors:
        raise errors[0]
    alone_wall = min(x[0] for x in alone)
    alone_gpu = min(x[1] for x in alone)
    return {"matmul": f"bf16 {n}x{n} @ {n}x{n}", "iterations": k, "alone_s": round(alone_wall, 4),
            "alone_gpu_s": round(alone_gpu, 4), "with_transfers_s": round(wall, 4),
            "with_transfers_gpu_s": round(gpu, 4),
            "slowdown_pct": round(100.0 * (wall / alone_wall - 1.0), 2),
            "slowdown_gpu_pct": round(100.0 * (gpu / alone_gpu - 1.0), 2),
            "transfer_block_bytes": block, "transfer_threads": threads, "engine": rig.engine.data_path(),
            "bytes_moved_during_compute": m1 - m0, "transfer_GBps_during_compute": round(gbps(m1 - m0, wall), 3),
            "target_dir": root}

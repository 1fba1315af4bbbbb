"""How long a small load takes while save batches write to the same pool, against the same load alone.

    python profiling/load_under_saves.py [--block 2MiB] [--load-blocks 4] [--loads 20] [--save-threads 2]
                                         [--io-threads 8] [--dir /tmp] [--arena 0] [--save-limit 8GiB]

A load is what the forward (or a parked request) waits for; saves are what the storage is busy
with.  Each load here reads ``--load-blocks`` blocks saved beforehand (distinct keys, so no load
re-reads another's), ``--loads`` times with nothing else running, then as many times while
``--save-threads`` threads save 64 MiB batches of new blocks through the same engine, as the
connector's transfer threads do.  One JSON line: each phase's load latency in ms (median, p90,
max), the ratio of the medians (under saves / alone), and the save GB/s meanwhile.  An engine
whose reads share one FIFO queue with the writes makes a load wait for every write handed over
before it; with read threads of their own (the POSIX engine's and the staged path's) it waits only
for the device.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_connector import load_keys  # noqa: E402

from gds_kv_connector.arena import SlotArena, maps_slabs  # noqa: E402
from gds_kv_connector.block_io import save_blocks  # noqa: E402
from gds_kv_connector.engines import make_engine  # noqa: E402
from gds_kv_connector.pool import BlockPool  # noqa: E402
from gds_kv_connector.pool_format import ZERO_KEY  # noqa: E402
from gds_kv_connector.settings import parse_size  # noqa: E402


def latencies_ms(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"median": round(statistics.median(ordered), 2),
            "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 2),
            "max": round(ordered[-1], 2), "n": len(ordered)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", default="2MiB")
    ap.add_argument("--load-blocks", type=int, default=4)
    ap.add_argument("--loads", type=int, default=20)
    ap.add_argument("--save-threads", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--arena", default="0", help="slot arena bytes (TLLM_GDS_KV_ARENA_BYTES); 0: block files")
    ap.add_argument("--save-limit", default="8GiB", help="saves stop after this many bytes (the disk's room)")
    a = ap.parse_args()
    size, save_limit = parse_size(a.block), parse_size(a.save_limit)
    if a.load_blocks < 1 or a.loads < 1 or a.save_threads < 1:
        ap.error("--load-blocks, --loads and --save-threads must be at least 1")
    batch = max(1, (64 << 20) // size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = tempfile.mkdtemp(prefix="gdskv-load-under-saves-", dir=a.dir)
    try:
        engine = make_engine("auto", device, a.io_threads)
        arena_bytes = parse_size(a.arena)
        pool = BlockPool((root,), hashlib.sha256(root.encode()).digest(), size, 32, index_ttl_s=600,
                         refs=arena_bytes > 0)
        if arena_bytes:
            pool.arena = SlotArena(pool, engine, arena_bytes, 256 << 20, 5.0, mapped=maps_slabs(root))
            pool.arena.start(background=False)
        kv = torch.randint(0, 256, (batch + a.load_blocks, size), dtype=torch.uint8, device=device)
        save_views = [kv[i] for i in range(batch)]
        load_views = [kv[batch + i] for i in range(a.load_blocks)]
        stored = [[os.urandom(32) for _ in range(a.load_blocks)] for _ in range(2 * a.loads)]
        for keys in stored:
            out = save_blocks(pool, engine, keys, [ZERO_KEY] * len(keys), save_views[:len(keys)])
            if out.failed or out.published != len(keys):
                raise RuntimeError(f"could not store the blocks to load: {out}")
        os.sync()

        def timed_loads(sets: list[list[bytes]]) -> list[float]:
            out: list[float] = []
            for keys in sets:
                t0 = time.perf_counter()
                load_keys(pool, engine, keys, load_views, retries=1, timeout_s=120)
                out.append(1e3 * (time.perf_counter() - t0))
            return out

        alone = timed_loads(stored[:a.loads])
        stop = threading.Event()
        saved = [0] * a.save_threads
        errors: list[BaseException] = []

        def saver(n: int) -> None:
            try:
                while not stop.is_set() and sum(saved) < save_limit:
                    keys = [os.urandom(32) for _ in range(batch)]
                    out = save_blocks(pool, engine, keys, [ZERO_KEY] * batch, save_views)
                    saved[n] += out.bytes_written
            except BaseException as exc:  # noqa: BLE001 - reported after the phase
                errors.append(exc)
        threads = [threading.Thread(target=saver, args=(n,), daemon=True) for n in range(a.save_threads)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(0.3)  # the writes' queues filled
        under = timed_loads(stored[a.loads:])
        still_saving = sum(saved) < save_limit and all(t.is_alive() for t in threads)
        stop.set()
        for t in threads:
            t.join()
        secs = time.perf_counter() - t0
        if errors:
            raise errors[0]
        a_ms, u_ms = latencies_ms(alone), latencies_ms(under)
        print(json.dumps({
            "data_path": engine.data_path(), "block": size, "load_blocks": a.load_blocks,
            "save_threads": a.save_threads, "io_threads": a.io_threads,
            "pool_mode": "block files" if pool.arena is None else "arena" if pool.arena.mapped else "arena on disk",
            "load_ms_alone": a_ms, "load_ms_under_saves": u_ms,
            "median_ratio": round(u_ms["median"] / a_ms["median"], 2),
            "save_GBps_meanwhile": round(sum(saved) / secs / 1e9, 3),
            "saves_ran_throughout": still_saving}))
        if pool.arena is not None:
            pool.arena.close()
        engine.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

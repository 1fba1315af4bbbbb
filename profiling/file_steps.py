"""Where the block-file path's time goes, step by step, on a real pool directory.

    python profiling/file_steps.py [--block 256KiB] [--total 512MiB] [--transfer-threads 2]
                                   [--io-threads 8] [--dir /tmp] [--compat-io staged] [--arena 2GiB]

Saves ``--total`` bytes of blocks through ``block_io`` (one file per block, or with ``--arena``
slots of slabs of that many bytes, ``publish_refs`` then being the publish step) on
``--transfer-threads`` threads in 64 MiB batches, as the connector's transfer threads do, then
loads them back cold (page cache dropped where this process may), and prints one JSON line:
GB/s of each direction (saves counted until ``sync`` returns) and the time summed over threads
in each pool and engine step (``create_tmp``, ``write``, ``publish``, ``pin``, ``read``,
``check_header``, ``checksums``).  A step whose sum is near threads x wall time is what the
transfer threads wait in; the bench gives the GB/s, this says which step to change.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_connector import _run_batches, load_keys  # noqa: E402

from gds_kv_connector.arena import SlotArena, maps_slabs  # noqa: E402
from gds_kv_connector.block_io import save_blocks  # noqa: E402
from gds_kv_connector.engines import make_engine  # noqa: E402
from gds_kv_connector.pool import BlockPool  # noqa: E402
from gds_kv_connector.pool_format import ZERO_KEY  # noqa: E402
from gds_kv_connector.settings import parse_size  # noqa: E402

POOL_STEPS = ("create_tmp", "publish", "publish_refs", "pin", "check_header", "unpin")
ENGINE_STEPS = ("write", "read", "checksums")


class StepClock:
    """Wall time per wrapped method, summed over the threads that call it."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = collections.defaultdict(float)
        self._lock = threading.Lock()

    def wrap(self, obj: Any, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with self._lock:
                    self.acc[name] += time.perf_counter() - t0
        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        out = {k: round(v, 3) for k, v in self.acc.items()}
        self.acc.clear()
        return out


def drop_page_cache() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", default="256KiB")
    ap.add_argument("--total", default="512MiB")
    ap.add_argument("--transfer-threads", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--compat-io", default="staged", choices=("staged", "kvikio"))
    ap.add_argument("--arena", default="0", help="slot arena bytes (TLLM_GDS_KV_ARENA_BYTES); 0: block files")
    a = ap.parse_args()
    size, total = parse_size(a.block), parse_size(a.total)
    n = max(1, total // size)
    batch = max(1, (64 << 20) // size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = tempfile.mkdtemp(prefix="gdskv-file-steps-", dir=a.dir)
    clock = StepClock()
    try:
        engine = make_engine("auto", device, a.io_threads, compat_io=a.compat_io)
        arena_bytes = parse_size(a.arena)
        pool = BlockPool((root,), hashlib.sha256(root.encode()).digest(), size, 32, index_ttl_s=600,
                         refs=arena_bytes > 0)
        if arena_bytes:
            pool.arena = SlotArena(pool, engine, arena_bytes, 256 << 20, 5.0, mapped=maps_slabs(root))
            pool.arena.start(background=False)
        kv = torch.randint(0, 256, (n, size), dtype=torch.uint8, device=device)
        views = [kv[i] for i in range(n)]
        save_blocks(pool, engine, [os.urandom(32)], [ZERO_KEY], [views[0]])  # warm-up: kernels, staging
        for name in POOL_STEPS:
            clock.wrap(pool, name)
        for name in ENGINE_STEPS:
            clock.wrap(engine, name)
        keys = [os.urandom(32) for _ in range(n)]
        batches = [list(range(i, min(n, i + batch))) for i in range(0, n, batch)]

        def save(b: list[int]) -> int:
            out = save_blocks(pool, engine, [keys[i] for i in b], [ZERO_KEY] * len(b), [views[i] for i in b])
            if out.failed:
                raise RuntimeError(f"{len(out.failed)} saves failed, first: {out.failed[0][1]}")
            return out.bytes_written

        def load(b: list[int]) -> int:
            return load_keys(pool, engine, [keys[i] for i in b], [views[i] for i in b], retries=1, timeout_s=60)

        _, save_s, _, _ = _run_batches(batches, save, a.transfer_threads, float("inf"))
        t0 = time.perf_counter()
        os.sync()
        sync_s = time.perf_counter() - t0
        save_steps = clock.take()
        cold = drop_page_cache()
        _, load_s, _, _ = _run_batches(batches, load, a.transfer_threads, float("inf"))
        print(json.dumps({
            "data_path": engine.data_path(), "block": size, "blocks": n, "transfer_threads": a.transfer_threads,
            "io_threads": a.io_threads, "pool_mode": "block files" if pool.arena is None else
            "arena" if pool.arena.mapped else "arena on disk", "save_GBps": round(n * size / (save_s + sync_s) / 1e9, 3),
            "save_s": round(save_s, 3), "sync_s": round(sync_s, 3), "load_GBps": round(n * size / load_s / 1e9, 3),
            "load_s": round(load_s, 3), "load_cold": cold, "save_steps_s": save_steps,
            "load_steps_s": clock.take()}))
        if pool.arena is not None:
            pool.arena.close()
        engine.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""How soon a cancelled request's load is reported done, against the same load run to its end.

    python profiling/cancel_latency.py [--block 2MiB] [--blocks 512] [--cancel-after-ms 50] [--rounds 3]
                                       [--io-threads 8] [--dir /tmp]

TensorRT-LLM waits for a cancelled request's transfers before it frees its pages, and after a
cancel only for its control grace (about a second in its ADP tests) before it fails the process,
while a parked request's asynchronous load of a long prompt from disk can take longer than that.
This saves ``--blocks`` blocks into a pool under ``--dir`` and loads them all as one request's
asynchronous load through the connector's TransferManager, cold cache each time (fadvise
DONTNEED): once to its end (the baseline), and once stopped ``--cancel-after-ms`` after it was
handed over (``cancel_loads``, what ``cancel_load`` of the whole offer calls), polling as
``get_finished`` does.  One JSON line: each round's full load time, the time from the cancel to
the report, the blocks not read, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import close_tool, drop_caches  # noqa: E402

from gds_kv_connector.block_io import save_blocks  # noqa: E402
from gds_kv_connector.engines import make_engine  # noqa: E402
from gds_kv_connector.kv_layout import pool_from_tensor  # noqa: E402
from gds_kv_connector.metadata import LoadOp  # noqa: E402
from gds_kv_connector.pool import BlockPool  # noqa: E402
from gds_kv_connector.pool_format import ZERO_KEY  # noqa: E402
from gds_kv_connector.settings import Settings, parse_size  # noqa: E402
from gds_kv_connector.stats import Stats  # noqa: E402
from gds_kv_connector.transfers import TransferManager  # noqa: E402


def _reported(tm: TransferManager, rid: int, timeout_s: float) -> float:
    """Poll as get_finished does until ``rid`` is reported loaded; when it was (perf_counter)."""
    end = time.monotonic() + timeout_s
    loading = [rid]
    while True:
        _, done = tm.poll([], loading)
        if rid in done:
            return time.perf_counter()
        loading = []
        if time.monotonic() > end:
            raise TimeoutError(f"request {rid} not reported within {timeout_s}s")
        time.sleep(0.001)  # TensorRT-LLM's executor polls about this often while a request is parked


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", default="2MiB")
    ap.add_argument("--blocks", type=int, default=512, help="blocks in the one load (2 MiB x 512: 1 GiB)")
    ap.add_argument("--cancel-after-ms", type=float, default=50.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    size = parse_size(a.block)
    if a.blocks < 1 or a.rounds < 1 or a.cancel_after_ms < 0:
        ap.error("--blocks and --rounds must be at least 1, --cancel-after-ms not negative")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = tempfile.mkdtemp(prefix="gdskv-cancel-latency-", dir=a.dir)
    engine, tm = None, None
    try:
        engine = make_engine("auto", device, a.io_threads)
        pool = BlockPool((root,), hashlib.sha256(root.encode()).digest(), size, 32, index_ttl_s=600)
        kv_tensor = torch.randint(0, 256, (a.blocks, size), dtype=torch.uint8, device=device)
        kv = pool_from_tensor(kv_tensor)
        env = {"TLLM_GDS_KV_DEADLINE_S": "300", "TLLM_GDS_KV_IO_THREADS": str(a.io_threads)}
        settings = Settings.load_from(env=env, require_root=False, root=root)
        stats = Stats()
        tm = TransferManager(pool, engine, kv, settings, stats)
        keys = [os.urandom(32) for _ in range(a.blocks)]
        per = max(1, (64 << 20) // size)
        for lo in range(0, a.blocks, per):
            part = keys[lo:lo + per]
            views = [kv.block_view(b) for b in range(lo, lo + len(part))]
            out = save_blocks(pool, engine, part, [ZERO_KEY] * len(part), views)
            if out.failed or out.published != len(part):
                raise RuntimeError(f"could not store the blocks to load: {out}")
        paths = [pool.path_for(k) for k in keys]
        ids = tuple(range(a.blocks))
        full_ms: list[float] = []
        after_cancel_ms: list[float] = []
        unread: list[int] = []
        rid = 0
        for _ in range(a.rounds):
            for cancel in (False, True):
                drop_caches(paths, global_drop=False)
                rid += 1
                before = stats.snapshot().get("load_blocks_cancelled", 0)
                t0 = time.perf_counter()
                tm.submit_loads([LoadOp(rid, tuple(keys), ids, True)], None)
                if not cancel:
                    full_ms.append(1e3 * (_reported(tm, rid, 300) - t0))
                    continue
                time.sleep(a.cancel_after_ms / 1e3)
                tc = time.perf_counter()
                tm.cancel_loads([rid])
                after_cancel_ms.append(1e3 * (_reported(tm, rid, 300) - tc))
                unread.append(stats.snapshot().get("load_blocks_cancelled", 0) - before)
        full, after = statistics.median(full_ms), statistics.median(after_cancel_ms)
        print(json.dumps({
            "data_path": engine.data_path(), "block": size, "blocks": a.blocks, "io_threads": a.io_threads,
            "cancel_after_ms": a.cancel_after_ms, "full_load_ms": [round(x, 1) for x in full_ms],
            "reported_after_cancel_ms": [round(x, 1) for x in after_cancel_ms], "blocks_not_read": unread,
            "load_GBps": round(a.blocks * size / full * 1e3 / 1e9, 3),
            "median_ratio": round(after / full, 3)}))
    finally:
        close_tool(tm, engine, root)


if __name__ == "__main__":
    main()

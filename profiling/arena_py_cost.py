"""The Python (GIL-held) cost per block of the arena save and load paths, without a GPU.

    python profiling/arena_py_cost.py [--block 64KiB] [--blocks 8192] [--batch 256] [--rounds 6] [--profile save|load]

Saves then loads ``--blocks`` blocks of a CPU tensor through ``block_io`` into a slot arena on
/dev/shm, with the engine's copies and checksums made no-ops, so what is timed is the Python and the
C header loops and system calls around them, per block, in thread CPU time (``time.thread_time``;
steadier than wall time on a shared machine).  ``save-link`` leaves out the link(2) calls, which run
with the GIL released.  Transfer threads at 256 KiB have about 5 us per block of DMA to hide this in;
on the H200 host Python runs about twice as slow as on the CPU machine.  The minimum over rounds is
the figure to compare between trees; ``--profile`` prints cProfile's table of one path.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import os
import pstats
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gds_kv_connector import block_io, native  # noqa: E402
from gds_kv_connector.arena import SlotArena  # noqa: E402
from gds_kv_connector.engines import make_engine  # noqa: E402
from gds_kv_connector.kv_layout import pool_from_tensor  # noqa: E402
from gds_kv_connector.pool import BlockPool  # noqa: E402
from gds_kv_connector.pool_format import ZERO_KEY  # noqa: E402
from gds_kv_connector.settings import parse_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", default="64KiB")
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--profile", choices=("save", "load"))
    a = ap.parse_args()
    gc.set_threshold(20000, 10, 10)
    size, n, batch = parse_size(a.block), a.blocks, a.batch
    root = tempfile.mkdtemp(prefix="gdskv-pycost-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    engine = make_engine("auto", torch.device("cpu"), 4)
    engine.checksums = lambda views, load=False: [0] * len(views)
    engine.copy_to_host = lambda pairs, pitch: None
    engine.copy_from_host = lambda pairs, pitch: None
    pool = BlockPool((root,), hashlib.sha256(root.encode()).digest(), size, 32, refs=True, index_ttl_s=600)
    pool.arena = SlotArena(pool, engine, (n + 64) * pool.file_size, 64 << 20, 0.0)
    pool.arena.start(background=False)
    kv = pool_from_tensor(torch.zeros(n, 2, 1, size // 2, dtype=torch.uint8))
    link_s = [0.0]
    link_keys = native.link_keys

    def timed_link(*args):
        t0 = time.thread_time()
        try:
            return link_keys(*args)
        finally:
            link_s[0] += time.thread_time() - t0

    native.link_keys = timed_link
    prof = cProfile.Profile() if a.profile else None
    res: dict[str, list[float]] = {"save": [], "save-link": [], "pin": [], "load": []}
    try:
        for rnd in range(a.rounds):
            keys = [hashlib.sha256(b"%d %d" % (rnd, i)).digest() for i in range(n)]
            link_s[0] = ts = tp = tl = 0.0
            for lo in range(0, n, batch):
                views = kv.block_views(range(lo, lo + batch))
                if a.profile == "save":
                    prof.enable()
                t0 = time.thread_time()
                out = block_io.save_blocks(pool, engine, keys[lo:lo + batch], [ZERO_KEY] * batch, views)
                ts += time.thread_time() - t0
                if a.profile == "save":
                    prof.disable()
                assert out.published == batch, out
            pool.arena.drop_caches()  # load as an owner that did not save them would: through the reference files
            for lo in range(0, n, batch):
                if a.profile == "load":
                    prof.enable()
                t0 = time.thread_time()
                pins = block_io.pin_blocks(pool, keys[lo:lo + batch])
                t1 = time.thread_time()
                block_io.load_blocks(pool, engine, pins, kv.block_views(range(lo, lo + batch)), verify=True,
                                     retries=0, deadline=time.monotonic() + 60)
                pool.unpin_all(pins)
                tl += time.thread_time() - t1
                tp += t1 - t0
                if a.profile == "load":
                    prof.disable()
            for k in keys:  # unpublish this round's blocks so the next round finds free slots
                pool.unpublish_ref(k, pool.read_ref(k))
            pool.arena._reclaim(n)
            for name, secs in (("save", ts), ("save-link", ts - link_s[0]), ("pin", tp), ("load", tl)):
                res[name].append(secs / n * 1e6)
    finally:
        pool.arena.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{size} B blocks, {n} per round, batches of {batch}, native {native.BUILT}; us per block, "
          f"min / median of {a.rounds} rounds:")
    for name, v in res.items():
        print(f"  {name:10s} {min(v):6.2f} / {sorted(v)[len(v) // 2]:6.2f}")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

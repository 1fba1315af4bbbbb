"""Where a transfer thread's time goes in the arena save and load paths (cProfile, one thread).

    python profiling/arena_profile.py [--block 256KiB] [--blocks 2048] [--batch 256] [--dir /dev/shm]

Saves then loads ``--blocks`` blocks through ``block_io`` with the engine the connector would build,
on a slot arena in ``--dir``, once plain (one thread's real GB/s) and once under cProfile (the top
functions by own time for each direction).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import os
import pstats
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gds_kv_connector.arena import SlotArena  # noqa: E402
from gds_kv_connector.block_io import load_blocks, pin_blocks, save_blocks  # noqa: E402
from gds_kv_connector.engines import make_engine  # noqa: E402
from gds_kv_connector.pool import BlockPool  # noqa: E402
from gds_kv_connector.pool_format import ZERO_KEY  # noqa: E402
from gds_kv_connector.settings import parse_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", default="256KiB")
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--top", type=int, default=18)
    a = ap.parse_args()
    size, n = parse_size(a.block), a.blocks
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = tempfile.mkdtemp(prefix="gdskv-arena-profile-", dir=a.dir)
    try:
        engine = make_engine("auto", device, 16)
        pool = BlockPool((root,), hashlib.sha256(root.encode()).digest(), size, 32, refs=True, index_ttl_s=600)
        pool.arena = SlotArena(pool, engine, (2 * n + 2) * pool.file_size + (64 << 20), 256 << 20, 5.0)
        pool.arena.start(background=False)
        kv = torch.randint(0, 256, (n, size), dtype=torch.uint8, device=device)
        views = [kv[i] for i in range(n)]
        save_blocks(pool, engine, [os.urandom(32)], [ZERO_KEY], [views[0]])  # warm-up (kernels, streams)

        def run(direction: str, keys: list[bytes]) -> float:
            t0 = time.perf_counter()
            for i in range(0, n, a.batch):
                if direction == "save":
                    save_blocks(pool, engine, keys[i:i + a.batch], [ZERO_KEY] * len(keys[i:i + a.batch]),
                                views[i:i + a.batch])
                else:
                    pins = pin_blocks(pool, keys[i:i + a.batch])
                    load_blocks(pool, engine, pins, views[i:i + a.batch], verify=True, retries=0,
                                deadline=time.monotonic() + 60)
            return time.perf_counter() - t0

        # one unprofiled round (its GB/s is one thread's real rate), then one under cProfile, fresh keys each
        for tag in ("plain", "profiled"):
            keys = [hashlib.sha256(b"%s %d" % (tag.encode(), i)).digest() for i in range(n)]
            for direction in ("save", "load"):
                prof = cProfile.Profile() if tag == "profiled" else None
                if prof:
                    prof.enable()
                dt = run(direction, keys)
                if prof:
                    prof.disable()
                print(f"== {direction}: {n} x {size} B in {dt:.3f} s = {n * size / dt / 1e9:.2f} GB/s, "
                      f"{dt / n * 1e6:.1f} us/block ({tag}, one thread)")
                if prof:
                    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
                if direction == "save":
                    pool.arena.drop_caches()  # load as an owner that did not save them would
        pool.arena.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

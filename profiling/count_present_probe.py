"""How long ``BlockPool.count_present`` takes over files this process never indexed: a 128k-token
prompt (4096 blocks) that another process or node saved, as the executor thread's match meets it.

    python profiling/count_present_probe.py [--blocks 4096] [--reps 7] [--dir /dev/shm]

Writes ``--blocks`` empty block files of the pool's size (their contents are never read: the match
stats them) under a temporary pool, then times ``count_present`` with the index emptied before each
call and prints the median and minimum in milliseconds.  Run from two checkouts (``PYTHONPATH=DIR``)
to compare them in one sitting.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time

try:  # the package of PYTHONPATH or the install; a source checkout's own otherwise
    import gds_kv_connector
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import gds_kv_connector
from gds_kv_connector.pool import BlockPool  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    a = ap.parse_args()
    if a.blocks < 1 or a.reps < 1:
        raise SystemExit("count_present_probe.py: --blocks and --reps must be positive")
    with tempfile.TemporaryDirectory(prefix="gdskv-countprobe-", dir=a.dir) as root:
        pool = BlockPool([root], hashlib.sha256(b"count-present-probe").digest(), 65536, 32)
        keys = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(a.blocks)]
        for k in keys:
            path = pool.path_for(k)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(pool.file_size)
        times = []
        for _ in range(a.reps):
            pool._index.clear()  # as a process that saw none of them published
            t0 = time.perf_counter()
            n = pool.count_present(keys)
            times.append((time.perf_counter() - t0) * 1e3)
            if n != a.blocks:
                raise SystemExit(f"count_present_probe.py: counted {n} of {a.blocks} files")
    print(f"{os.path.dirname(os.path.dirname(os.path.abspath(gds_kv_connector.__file__)))}: count_present of "
          f"{a.blocks} unindexed files: median {statistics.median(times):.2f} ms, min {min(times):.2f} ms")


if __name__ == "__main__":
    main()

"""How long a short call into the C extension takes while other threads want the GIL.

    python profiling/gil_probe.py [--threads 2] [--calls 3000] [--tree DIR]

Background threads stand in for transfer threads: each runs ``--python-us`` of Python, then waits
``--wait-us`` with the GIL released (as a DMA sync or a system call does), over and over.  The
measuring thread times ``native.chain_keys`` of a 4-block prompt (what the executor hashes per
admitted request) and ``native.clear_headers`` of 64 slots (a 256 KiB save batch) and prints mean,
median and 99th percentile.  A call that releases the GIL can come back only when the GIL is free
again, so its tail is a background thread's Python segment; one that keeps it does not wait.
``--tree`` imports the package from another checkout (its own built extension), so two builds are
compared in one sitting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--python-us", type=float, default=50.0)
    ap.add_argument("--wait-us", type=float, default=200.0)
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.tree))
    import numpy as np

    from gds_kv_connector import native

    if not native.BUILT:
        raise SystemExit(f"the C extension is not built in {a.tree}")
    stop = threading.Event()

    def background() -> None:
        while not stop.is_set():
            until = time.perf_counter() + a.python_us / 1e6
            while time.perf_counter() < until:
                pass
            time.sleep(a.wait_us / 1e6)

    threads = [threading.Thread(target=background, daemon=True) for _ in range(a.threads)]
    for t in threads:
        t.start()
    seed, tokens = bytes(32), list(range(4 * 32 + 5))
    slots = bytearray(64 * 4096)
    base = np.frombuffer(slots, dtype=np.uint8).ctypes.data
    addrs = np.array([base + i * 4096 for i in range(64)], dtype=np.uint64)
    calls = (("chain_keys, 4 blocks", lambda: native.chain_keys(seed, tokens, 0, 32, 4)),
             ("clear_headers, 64 slots", lambda: native.clear_headers(addrs)))
    try:
        for name, fn in calls:
            lat = []
            for _ in range(a.calls):
                t0 = time.perf_counter()
                fn()
                lat.append(time.perf_counter() - t0)
            lat.sort()
            print(f"{a.tree}: {a.threads} background threads, {name}: mean {1e6 * statistics.mean(lat):.1f} us, "
                  f"median {1e6 * lat[len(lat) // 2]:.1f}, p99 {1e6 * lat[int(len(lat) * 0.99)]:.1f}", flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join()


if __name__ == "__main__":
    main()

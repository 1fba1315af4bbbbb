"""How long a short call into the C extension takes while other threads want the GIL.

    python profiling/gil_probe.py [--threads 2] [--calls 3000] [--tree DIR] [--costs]

Background threads stand in for transfer threads: each runs ``--python-us`` of Python, then waits
``--wait-us`` with the GIL released (as a DMA sync or a system call does), over and over.  The
measuring thread times ``native.chain_keys`` of a 4-block prompt (what the executor hashes per
admitted request) and ``native.clear_headers`` of 64 slots (a 256 KiB save batch) and prints mean,
median and 99th percentile.  A call that releases the GIL can come back only when the GIL is free
again, so its tail is a background thread's Python segment; one that keeps it does not wait.
``--tree`` imports the package from another checkout (its own built extension), so two builds are
compared in one sitting.  ``--costs`` instead prints each C loop's time per item with no other
thread running (best of 5 x 50 calls at 16 / 64 / 256 / 1024 items), from which csrc/native.c's
threshold for releasing the GIL in ``chain_keys`` was set (the header loops release it at any length:
keeping it there showed no gain on the H200, profiling/results/h200-0e74e6a/).
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
    ap.add_argument("--costs", action="store_true", help="per-item cost of each C loop, alone")
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.tree))
    import numpy as np

    from gds_kv_connector import native

    if not native.BUILT:
        raise SystemExit(f"the C extension is not built in {a.tree}")
    if a.costs:
        _costs(native, np)
        return
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


def _costs(native, np) -> None:
    import hashlib

    fp = bytes(32)
    for n in (16, 64, 256, 1024):
        slots = bytearray(n * 8192)
        base = np.frombuffer(slots, dtype=np.uint8).ctypes.data
        addrs = np.array([base + i * 8192 for i in range(n)], dtype=np.uint64)
        keys = [hashlib.sha256(i.to_bytes(2, "little")).digest() for i in range(n)]
        tokens = list(range(n * 32))
        native.write_headers(addrs, fp, keys, keys, [1] * n, 4096, 1, 32, 5)
        fields = native.check_headers(addrs, fp, keys, [5] * n, 4096)[0]
        loops = (("write_headers", lambda: native.write_headers(addrs, fp, keys, keys, [1] * n, 4096, 1, 32, 5)),
                 ("check_headers", lambda: native.check_headers(addrs, fp, keys, [5] * n, 4096)),
                 ("first_changed", lambda: native.first_changed(addrs, fields)),
                 ("clear_headers", lambda: native.clear_headers(addrs)),
                 ("chain_keys", lambda: native.chain_keys(fp, tokens, 0, 32, n)))
        row = []
        for name, fn in loops:
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(50):
                    fn()
                best = min(best, (time.perf_counter() - t0) / 50)
            if name == "clear_headers":  # the next rounds check written headers again
                native.write_headers(addrs, fp, keys, keys, [1] * n, 4096, 1, 32, 5)
            row.append(f"{name} {1e6 * best:.1f} us ({1e6 * best / n:.3f}/item)")
        print(f"{n:5d} items: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()

"""What one system call costs the executor thread when it releases the GIL, against one that keeps it,
at the moments the scheduler's match makes its pool stats.

    python profiling/stat_gil_probe.py [--order pa] [--device cpu]

Runs the bench's executor phase (``bench_executor.executor_cost``) and, at each of the first 64 block-file
stats the match makes on the executor thread (the cold round's admissions: one miss per request), times
the same name's lookup done first in the ways ``--order`` lists, one letter each: ``p``, lstat(2) through
``ctypes.PyDLL`` (the GIL kept, as ``native.present_run`` keeps it); ``a``, ``os.access`` (the GIL
released around the call, as every ``os`` function does); ``g``, ``os.getppid`` (a system call with no
path, the GIL kept).  Prints each way's total over 63 stats (the first is left out) and the first
few pairs, in microseconds.  On the CI VM the first GIL-releasing call after a stretch of Python took
17-20 us and a second one right after it 2-3 us, whichever came first; on the H200 host all took 1-5 us
(``profiling/results/vm-f515ce3/``, ``h200-f515ce3/``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_executor  # noqa: E402
from bench_common import KvikioDefaults, Tracer  # noqa: E402
from gds_kv_connector.pool import BLOCK_SUFFIX  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--order", default="pa", help="letters p, a, g: the lookups made at each stat, in order")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    if not a.order or set(a.order) - set("pag"):
        raise SystemExit("stat_gil_probe.py: --order takes the letters p, a and g")
    gc.set_threshold(20000, 10, 10)  # as the bench
    libc = ctypes.PyDLL(None)
    buf = ctypes.create_string_buffer(512)  # larger than struct stat
    timed: list[list[float]] = []
    real_lstat = os.lstat

    def probe(path: str) -> None:
        if len(timed) >= 64:
            return
        raw, row = path.encode(), []
        for way in a.order:
            t0 = time.perf_counter()
            if way == "p":
                libc.lstat(raw, buf)
            elif way == "a":
                os.access(path, os.F_OK, follow_symlinks=False)
            else:
                os.getppid()
            row.append((time.perf_counter() - t0) * 1e6)
        timed.append(row)

    def lstat(path, *args, **kw):
        if isinstance(path, str) and path.endswith(BLOCK_SUFFIX):
            probe(path)
        return real_lstat(path, *args, **kw)

    from gds_kv_connector import fileops
    real_present_run = fileops.FileOps.present_run if hasattr(fileops.FileOps, "present_run") else None

    def present_run(self, dirs, keys, start, suffix):
        if start < len(keys):
            probe(fileops.key_name(dirs, keys[start], suffix))
        return real_present_run(self, dirs, keys, start, suffix)

    os.lstat = lstat  # a tree whose match stats through os.lstat
    if real_present_run is not None:  # one that stats through FileOps.present_run
        fileops.FileOps.present_run = present_run
    root = tempfile.mkdtemp(prefix="gdskv-statgil-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    try:
        bench_executor.executor_cost(root, torch.device(a.device), KvikioDefaults(), Tracer(None, False))
    finally:
        os.lstat = real_lstat
        shutil.rmtree(root, ignore_errors=True)
    rows = timed[1:]
    names = {"p": "lstat, GIL kept", "a": "os.access, GIL released", "g": "getppid, GIL kept"}
    totals = ", ".join(f"{names[w]} {sum(r[i] for r in rows):.0f}" for i, w in enumerate(a.order))
    print(f"order {a.order}, {len(rows)} stats, total us: {totals}; first pairs: "
          f"{[[round(x, 1) for x in r] for r in rows[:6]]}")


if __name__ == "__main__":
    main()

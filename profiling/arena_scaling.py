"""How the arena save and load paths scale with threads, and which step stops scaling.

    python profiling/arena_scaling.py [--block 256KiB] [--blocks 2048] [--batch 256] [--threads 1,2,4,8]

Each of T threads saves (then loads) its own ``--blocks`` blocks through ``block_io`` in batches of
``--batch``, as transfer threads do.  Every step of the path (checksum kernel, header clear, DMA,
header write, reference file + links, bookkeeping, pins, header checks) is timed per call on the
thread that ran it; the table gives each step's wall time per block, averaged over threads.  A step
whose per-block time grows with T is where threads wait for each other: for the GIL if it is Python,
for the copy engines if it is the DMA, for the kernel if it is link(2).  Each step's CPU time on its
thread is printed beside its wall time (``thread_clock``): wall growing while CPU does not is
waiting (the GIL, a lock, a blocking sync); CPU growing too is work or spinning (a CUDA
synchronize spins by default while cores are free).

``--ablate publish_refs,checksums,copy_to_host`` replaces those steps with no-ops (saves only: the
pool is then not loadable), so the GB/s without a step bounds what making that step free would give.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gds_kv_connector import block_io, native  # noqa: E402
from gds_kv_connector.arena import SlotArena  # noqa: E402
from gds_kv_connector.engines import make_engine  # noqa: E402
from gds_kv_connector.kv_layout import pool_from_tensor  # noqa: E402
from gds_kv_connector.pool import BlockPool  # noqa: E402
from gds_kv_connector.pool_format import ZERO_KEY  # noqa: E402
from gds_kv_connector.settings import parse_size  # noqa: E402
from bench_connector import load_keys  # noqa: E402
from thread_clock import clock_bias  # noqa: E402

_acc: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])  # step -> [wall s, CPU s]
_lock = threading.Lock()
_WARM_BLOCKS = 8  # per thread, saved and loaded before timing
_BIAS = clock_bias()


def _timed(name: str, fn):
    def wrapper(*a, **k):
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            t1, c1 = time.perf_counter(), time.thread_time()
            with _lock:
                e = _acc[name]
                e[0] += t1 - t0
                e[1] += c1 - c0 - _BIAS
    return wrapper


def _instrument(pool: BlockPool, engine) -> None:
    for name in ("checksums", "copy_to_host", "copy_from_host"):
        setattr(engine, name, _timed(name, getattr(engine, name)))
    pool.publish_refs = _timed("publish_refs (ref file + link)", pool.publish_refs)
    pool.arena.published = _timed("arena.published", pool.arena.published)
    pool.arena.alloc = _timed("arena.alloc", pool.arena.alloc)
    pool.arena.check_records = _timed("arena.check_records", pool.arena.check_records)
    pool.arena.touch = _timed("arena.touch", pool.arena.touch)


_ABLATIONS = ("publish_refs", "checksums", "copy_to_host")


def _ablate(pool: BlockPool, engine, steps: list[str]) -> None:
    """No-op stand-ins with the real return shapes: every ref published, every sum 0, no bytes moved."""
    for step in steps:
        if step == "publish_refs":
            pool.publish_refs = lambda slab, refs: [True] * len(refs)
        elif step == "checksums":
            engine.checksums = lambda views, load=False: [0] * len(views)
        elif step == "copy_to_host":
            engine.copy_to_host = lambda pairs, pitch: None
        else:
            raise SystemExit(f"--ablate: {step!r} is not one of {', '.join(_ABLATIONS)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", default="256KiB")
    ap.add_argument("--blocks", type=int, default=2048, help="blocks per thread")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--repeat", type=int, default=1, help="timed save+load rounds per thread count, fresh keys "
                    "each (a round of 256 KiB blocks lasts a fraction of a second: one host stall moves it)")
    ap.add_argument("--cold-threads", action="store_true", help="time new threads whose first batch sets up "
                    "their CUDA streams and staging (the way this script ran before its threads were warmed)")
    ap.add_argument("--switch-interval-us", type=float, help="sys.setswitchinterval for the run: how long a "
                    "thread back from a GIL-free call may wait before it forces the holder to let go")
    ap.add_argument("--ablate", default="", help=f"comma-separated steps made no-ops: {', '.join(_ABLATIONS)}")
    a = ap.parse_args()
    ablate = [x for x in a.ablate.split(",") if x]
    if a.switch_interval_us:
        sys.setswitchinterval(a.switch_interval_us / 1e6)
    size, n = parse_size(a.block), a.blocks
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name in ("clear_headers", "write_headers", "first_changed"):  # the C steps, as block_io calls them
        setattr(block_io.native, name, _timed(f"native.{name}", getattr(native, name)))
    block_io.pin_blocks = _timed("pin_blocks", block_io.pin_blocks)
    print(f"{size} B blocks, {n} per thread, batches of {a.batch}, device {device}, native {native.BUILT}, "
          f"switch interval {sys.getswitchinterval() * 1e6:.0f} us"
          + (f", no-op steps: {', '.join(ablate)} (saves only)" if ablate else ""))
    for threads in [int(t) for t in a.threads.split(",")]:
        root = tempfile.mkdtemp(prefix="gdskv-arena-scaling-", dir=a.dir)
        xfer = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="scaling-xfer")
        try:
            engine = make_engine("auto", device, 16)
            pool = BlockPool((root,), hashlib.sha256(root.encode()).digest(), size, 32, refs=True, index_ttl_s=600)
            slots = a.repeat * threads * n + threads * _WARM_BLOCKS + 64
            pool.arena = SlotArena(pool, engine, slots * pool.file_size + (64 << 20), 256 << 20, 5.0)
            pool.arena.start(background=False)
            kv = torch.randint(0, 256, (threads * n, size), dtype=torch.uint8, device=device)
            blocks = pool_from_tensor(kv)  # views as the worker's KvPool hands them to transfers,
            blocks.block_views(range(threads * n))  # all made before timing, as a worker's are once

            def warm(t: int, gate: threading.Barrier) -> None:
                """One small save and load on this thread, so its CUDA streams, pinned staging and
                kernels exist before anything is timed, as in a connector's long-lived transfer threads;
                the barrier puts one warm-up on each thread of the pool."""
                gate.wait()
                ks = [os.urandom(32) for _ in range(_WARM_BLOCKS)]
                vs = blocks.block_views(range(t * n, t * n + _WARM_BLOCKS))
                block_io.save_blocks(pool, engine, ks, [ZERO_KEY] * len(ks), vs)
                load_keys(pool, engine, ks, vs, retries=0, timeout_s=60)

            if a.cold_threads:  # the old way: the timed threads are new, their first batch sets them up
                warm(0, threading.Barrier(1))
            else:
                gate = threading.Barrier(threads)
                for f in [xfer.submit(warm, t, gate) for t in range(threads)]:
                    f.result()
            _ablate(pool, engine, ablate)
            _instrument(pool, engine)
            thread_cpu: list[float] = []

            def work(t: int, direction: str, keys: list[bytes]) -> None:
                c0 = time.thread_time()
                for lo in range(t * n, (t + 1) * n, a.batch):
                    ks, vs = keys[lo:lo + a.batch], blocks.block_views(range(lo, min(lo + a.batch, (t + 1) * n)))
                    if direction == "save":
                        out = block_io.save_blocks(pool, engine, ks, [ZERO_KEY] * len(ks), vs)
                        assert not out.failed, out.failed[:1]
                    else:
                        pins = block_io.pin_blocks(pool, ks)
                        block_io.load_blocks(pool, engine, pins, vs, verify=True, retries=0,
                                             deadline=time.monotonic() + 60)
                with _lock:
                    thread_cpu.append(time.thread_time() - c0)

            for rep in range(a.repeat):
                keys = [hashlib.sha256(b"%d %d %d" % (threads, rep, i)).digest() for i in range(threads * n)]
                for direction in ("save",) if ablate else ("save", "load"):
                    _acc.clear()
                    thread_cpu.clear()
                    if direction == "load":
                        pool.arena.drop_caches()
                    t0 = time.perf_counter()
                    if a.cold_threads:
                        ts = [threading.Thread(target=work, args=(t, direction, keys)) for t in range(threads)]
                        for th in ts:
                            th.start()
                        for th in ts:
                            th.join()
                    else:
                        for f in [xfer.submit(work, t, direction, keys) for t in range(threads)]:
                            f.result()
                    wall = time.perf_counter() - t0
                    total = threads * n
                    print(f"== {threads} thread(s) {direction}{f' (repeat {rep + 1})' if a.repeat > 1 else ''}: "
                          f"{total} blocks in {wall:.3f} s = {total * size / wall / 1e9:.2f} GB/s, "
                          f"{wall / total * 1e6:.2f} us/block overall")
                    per_thread_wall = wall * 1e6 / n  # each thread's wall time per block it moved
                    steps = sorted(_acc.items(), key=lambda kv: -kv[1][0])
                    print(f"     {'step':<34} {'wall':>7} {'CPU':>7}  us/block on its thread")
                    for name, (secs, cpu) in steps:
                        print(f"     {name:<34} {secs / total * 1e6:7.2f} {cpu / total * 1e6:7.2f}")
                    rest = per_thread_wall - sum(e[0] for _, e in steps) / total * 1e6
                    rest_cpu = (sum(thread_cpu) - sum(e[1] for _, e in steps)) / total * 1e6
                    print(f"     {'(the rest: Python in block_io)':<34} {rest:7.2f} {rest_cpu:7.2f}")
            pool.arena.close()
        finally:
            xfer.shutdown(wait=True)
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

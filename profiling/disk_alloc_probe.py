"""Does the way a file's space was made change what O_DIRECT writes into it cost?

    python profiling/disk_alloc_probe.py --dir /tmp/probe [--total 2GiB] [--streams 4] [--pairs 2]

The bench's raw write ceiling writes fresh files (each write extends the file); the disk arena
writes into slabs preallocated with ``posix_fallocate`` (ext4: unwritten extents, converted to
written ones as each write completes); a slab written once before is a plain overwrite.  This
writes ``--total`` bytes as 4 MiB O_DIRECT writes from ``--streams`` threads (one file each) in
each way, the ways alternated ``--pairs`` times in one run, and prints GB/s per leg, so the three
are compared on one disk in one sitting.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gds_kv_connector.settings import parse_size  # noqa: E402

CHUNK = 4 << 20
MODES = ("extend", "fallocated", "overwrite")


def _prepare(path: str, mode: str, nbytes: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        if mode == "fallocated":
            os.posix_fallocate(fd, 0, nbytes)
        elif mode == "overwrite":
            buf = mmap.mmap(-1, CHUNK)
            buf.write(b"\xa5" * CHUNK)
            dfd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
            try:
                for at in range(0, nbytes, CHUNK):
                    os.pwrite(dfd, buf, at)
                os.fsync(dfd)
            finally:
                os.close(dfd)
                buf.close()
        os.fsync(fd)
    finally:
        os.close(fd)


def _leg(dirpath: str, mode: str, total: int, streams: int) -> float:
    per = total // streams // CHUNK * CHUNK
    paths = [os.path.join(dirpath, f"{mode}-{k}") for k in range(streams)]
    for p in paths:
        _prepare(p, mode, per)
    errors: list[BaseException] = []
    barrier = threading.Barrier(streams + 1)

    def write(path: str) -> None:
        buf = mmap.mmap(-1, CHUNK)
        buf.write(b"\x5a" * CHUNK)
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
        try:
            barrier.wait()
            for at in range(0, per, CHUNK):
                os.pwrite(fd, buf, at)
            os.fdatasync(fd)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
        finally:
            os.close(fd)
            buf.close()

    threads = [threading.Thread(target=write, args=(p,), daemon=True) for p in paths]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    for p in paths:
        os.unlink(p)
    if errors:
        raise errors[0]
    return per * streams / secs / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--total", default="2GiB")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    total = parse_size(args.total)
    os.makedirs(args.dir, exist_ok=True)
    results: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for p in range(args.pairs):
            for mode in (MODES if p % 2 == 0 else MODES[::-1]):
                gbps = _leg(args.dir, mode, total, args.streams)
                results[mode].append(gbps)
                print(f"pass {p} {mode:10s} {gbps:6.3f} GB/s ({args.streams} streams of 4 MiB O_DIRECT writes)",
                      flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    for mode, v in results.items():
        print(f"{mode:10s} " + " ".join(f"{x:.3f}" for x in v))


if __name__ == "__main__":
    main()

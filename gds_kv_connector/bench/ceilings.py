"""Ceilings: pinned host<->device copies (the PCIe limit) and raw O_DIRECT storage over 1-16 parallel
streams, page cache dropped before reads.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import threading
import time
from typing import Any

import torch

from gds_kv_connector.util.mounts import fs_type
from gds_kv_connector.bench.common import Budget, MiB, RAW_BESIDE_BYTES, RAW_CHUNK, Tracer, drop_caches, gbps


def pinned_copy_ceiling(device: torch.device, quick: bool, tracer: Tracer) -> dict:
    """Pinned host<->device copy bandwidth, each direction the best of two shapes: whole-buffer copies
    on one stream, and 4 MiB copies spread over 4 streams (how the connector's DMAs go).  Either shape
    alone can read host-to-device up to a sixth below what the connector's loads then reach: a ceiling one
    shape undershoots is no ceiling."""
    n = (64 if quick else 512) * MiB
    reps = 4
    chunk, streams = 4 * MiB, [torch.cuda.Stream(device) for _ in range(4)]
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    out = {"bytes_per_copy": n, "copies_per_trial": reps, "trials": 3, "chunk_bytes": chunk, "streams": len(streams)}

    def whole(dst: torch.Tensor, src: torch.Tensor) -> None:
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)

    def chunked(dst: torch.Tensor, src: torch.Tensor) -> None:
        main = torch.cuda.current_stream(device)
        for s in streams:
            s.wait_stream(main)
        for _ in range(reps):
            for i, at in enumerate(range(0, n, chunk)):
                with torch.cuda.stream(streams[i % len(streams)]):
                    dst[at:at + chunk].copy_(src[at:at + chunk], non_blocking=True)
        for s in streams:
            main.wait_stream(s)

    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        for shape, copy in (("one_stream", whole), ("4_streams", chunked)):
            best = 0.0
            with tracer.rf(f"bench/ceiling/pinned_{name}_{shape}"):
                copy(dst, src)
                torch.cuda.synchronize(device)
                for _ in range(3):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    copy(dst, src)
                    end.record()
                    end.synchronize()
                    best = max(best, gbps(n * reps, start.elapsed_time(end) / 1e3))
            out[f"{name}_GBps_{shape}"] = round(best, 3)
        out[f"{name}_GBps"] = max(out[f"{name}_GBps_one_stream"], out[f"{name}_GBps_4_streams"])
    del host, dev
    return out


def best_pinned(first: dict | None, again: dict | None) -> dict | None:
    """The pinned-copy ceiling measured before the connector's phases and again after them: each
    direction's best, both measurements kept (``*_GBps_runs``).  The first one runs on a GPU idle
    until then, and once came out at 45.9 GB/s H2D where the connector's loads later ran at 54."""
    if not first or not again:
        return first or again
    out = dict(first)
    for key in ("h2d_GBps", "d2h_GBps"):
        runs = [first[key], again[key]]
        out[key] = max(runs)
        out[key + "_runs"] = runs
        for shape in ("one_stream", "4_streams"):
            if f"{key}_{shape}" in first and f"{key}_{shape}" in again:
                out[f"{key}_{shape}"] = max(first[f"{key}_{shape}"], again[f"{key}_{shape}"])
    return out


def _o_direct_ok(dirpath: str) -> tuple[bool, str]:
    if not hasattr(os, "O_DIRECT"):
        return False, "os.O_DIRECT not available"
    path = os.path.join(dirpath, f".odirect-probe-{os.getpid()}")
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, buf, 0)
        finally:
            os.close(fd)
        return True, "O_DIRECT"
    except OSError as exc:
        return False, f"O_DIRECT refused ({errno.errorcode.get(exc.errno, exc.errno)}): buffered I/O measured instead"
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


def _raw_streams(dirpath: str, streams: int, total: int, direct: bool, cap_s: float, write: bool,
                 written: list[int] | None, pattern: bytes, one_file: bool = False) -> tuple[list[int], float]:
    """``streams`` threads, each moving its share in RAW_CHUNK calls: to a file of its own, or with
    ``one_file`` to interleaved chunks of one shared file (thread k takes chunks k, k+streams, ...),
    which keeps the device's accesses near-sequential with ``streams`` of them in flight.

    A write with ``written`` (each stream's bytes from an earlier write of the same layout)
    overwrites those bytes in place instead of writing new files."""
    per = max(RAW_CHUNK, (total // streams) // RAW_CHUNK * RAW_CHUNK)
    overwrite = write and written is not None
    if one_file:
        shared = os.path.join(dirpath, f"raw-{streams}-one-file")
        paths = [shared] * streams
        if write and not overwrite:
            os.close(os.open(shared, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
    else:
        paths = [os.path.join(dirpath, f"raw-{streams}-{k}") for k in range(streams)]
    done = [0] * streams
    errors: list[BaseException] = []
    barrier = threading.Barrier(streams + 1)
    deadline = [0.0]

    def worker(k: int) -> None:
        buf = mmap.mmap(-1, RAW_CHUNK)
        fd = -1
        try:
            if write:
                buf.write(pattern)
                flags = os.O_WRONLY if one_file or overwrite else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            else:
                flags = os.O_RDONLY
            fd = os.open(paths[k], flags | os.O_CLOEXEC | (os.O_DIRECT if direct else 0), 0o600)
            limit = per if write and not overwrite else written[k]
            barrier.wait()
            pos = 0
            while pos < limit and time.monotonic() < deadline[0]:
                # this thread's pos-th byte: in its own file, or in its own chunks of the shared one
                at = (pos // RAW_CHUNK * streams + k) * RAW_CHUNK + pos % RAW_CHUNK if one_file else pos
                n = os.pwrite(fd, buf, at) if write else os.preadv(fd, [buf], at)
                if n <= 0:
                    break
                pos += n
            if write:
                os.fdatasync(fd)
            done[k] = pos
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
            errors.append(exc)
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.abort()
        finally:
            if fd >= 0:
                os.close(fd)
            buf.close()

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(streams)]
    for t in threads:
        t.start()
    deadline[0] = time.monotonic() + cap_s  # set before the barrier releases the streams
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return done, secs


def raw_storage_ceiling(name: str, dirpath: str, streams_list: list[int], total: int, budget: Budget,
                        global_drop: bool, is_memory: bool, tracer: Tracer, progress) -> dict:
    raw_dir = os.path.join(dirpath, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    direct, how = _o_direct_ok(raw_dir)
    pattern = os.urandom(RAW_CHUNK)
    res: dict[str, Any] = {"dir": dirpath, "fs": fs_type(dirpath), "io": how, "o_direct": direct,
                           "chunk_bytes": RAW_CHUNK, "bytes_per_test": total,
                           "write": {"by_streams": {}, "one_file_by_streams": {}, "overwrite_by_streams": {},
                                     "overwrite_one_file_by_streams": {}},
                           "read": {"by_streams": {}, "one_file_by_streams": {}}}
    try:
        for s in streams_list:
            for one_file in ((False, True) if s > 1 else (False,)):
                key, tag = ("one_file_by_streams", f"x{s}_one_file") if one_file else ("by_streams", f"x{s}")
                progress(f"raw {name} {tag}")
                with tracer.rf(f"bench/ceiling/raw_{name}_write_{tag}"):
                    done, secs = _raw_streams(raw_dir, s, total, direct, budget.cap(), True, None, pattern, one_file)
                budget.phases_left -= 1
                res["write"][key][str(s)] = {"bytes": sum(done), "seconds": round(secs, 4),
                                             "GBps": round(gbps(sum(done), secs), 3)}
                if not is_memory:
                    drop_caches([raw_dir], global_drop)
                with tracer.rf(f"bench/ceiling/raw_{name}_read_{tag}"):
                    got, secs = _raw_streams(raw_dir, s, total, direct, budget.cap(), False, done, pattern, one_file)
                budget.phases_left -= 1
                res["read"][key][str(s)] = {"bytes": sum(got), "seconds": round(secs, 4),
                                            "GBps": round(gbps(sum(got), secs), 3)}
                # the same bytes written again in place: no allocation (what a disk arena's slots get)
                progress(f"raw {name} {tag} overwrite")
                with tracer.rf(f"bench/ceiling/raw_{name}_overwrite_{tag}"):
                    over, secs = _raw_streams(raw_dir, s, total, direct, budget.cap(), True, done, pattern, one_file)
                budget.phases_left -= 1
                res["write"]["overwrite_" + key][str(s)] = {"bytes": sum(over), "seconds": round(secs, 4),
                                                           "GBps": round(gbps(sum(over), secs), 3)}
                for f in os.listdir(raw_dir):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(raw_dir, f))
    finally:
        shutil.rmtree(raw_dir, ignore_errors=True)
    for d in ("write", "read"):
        legs = [(v["GBps"], int(s), layout) for layout, key in _RAW_LAYOUTS for s, v in res[d].get(key, {}).items()]
        if legs:
            best = max(legs)
            res[d]["best_GBps"], res[d]["best_streams"], res[d]["best_layout"] = best
    return res


# (layout, key in a direction's dict): files of their own, one shared file, and each written again in place
_RAW_LAYOUTS = (("files", "by_streams"), ("one file", "one_file_by_streams"),
                ("files overwritten", "overwrite_by_streams"), ("one file overwritten", "overwrite_one_file_by_streams"))


def raw_phases(streams_list: list[int]) -> int:
    """Timed phases of one target's raw sweep: write, read and overwrite per stream count and layout."""
    return 3 * sum(2 if s > 1 else 1 for s in streams_list)


def raw_beside(dirpath: str, sweep: dict, budget: Budget, global_drop: bool, tracer: Tracer,
               label: str) -> dict:
    """The sweep's best write and read legs again, right beside a connector row.

    A disk's own bandwidth can move by 30-50% within minutes, so a ratio to a
    ceiling measured at the start of the run mixes that drift into the connector's figure; this
    re-measure (RAW_BESIDE_BYTES per direction) is reported next to the sweep's ceiling.
    """
    raw_dir = os.path.join(dirpath, "raw-beside")
    os.makedirs(raw_dir, exist_ok=True)
    direct, _ = _o_direct_ok(raw_dir)
    pattern = os.urandom(RAW_CHUNK)
    out: dict[str, float] = {}
    try:
        w, rd = sweep.get("write", {}), sweep.get("read", {})
        if not w.get("best_streams") or not rd.get("best_streams"):
            return out
        with tracer.rf(f"bench/ceiling/raw_beside_{label}"):
            s, layout = w["best_streams"], w.get("best_layout", "files")
            one = layout.startswith("one file")
            done, secs = _raw_streams(raw_dir, s, RAW_BESIDE_BYTES, direct, budget.cap(), True, None, pattern, one)
            if layout.endswith("overwritten"):  # the first write only makes the bytes to overwrite
                done, secs = _raw_streams(raw_dir, s, RAW_BESIDE_BYTES, direct, budget.cap(), True, done, pattern,
                                          one)
            budget.phases_left -= 1
            out["write_GBps"] = round(gbps(sum(done), secs), 3)
            s2, one2 = rd["best_streams"], rd.get("best_layout") == "one file"
            if (s2, one2) != (s, one):  # the read leg needs its own files
                for f in os.listdir(raw_dir):
                    os.unlink(os.path.join(raw_dir, f))
                done, _ = _raw_streams(raw_dir, s2, RAW_BESIDE_BYTES, direct, budget.cap(), True, None, pattern, one2)
            drop_caches([raw_dir], global_drop)
            got, secs = _raw_streams(raw_dir, s2, RAW_BESIDE_BYTES, direct, budget.cap(), False, done, pattern, one2)
            budget.phases_left -= 1
            out["read_GBps"] = round(gbps(sum(got), secs), 3)
    finally:
        shutil.rmtree(raw_dir, ignore_errors=True)
    return out

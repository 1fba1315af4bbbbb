#!/usr/bin/env python
"""gds-kv-connector benchmark: ceilings, baselines, the connector's own paths, executor cost, overlap.

One command, one machine, one run; every ratio it prints is between numbers measured in this run.

Phases (each bounded in bytes and in time; the whole run shares a time budget, --budget-s):

* ceilings   pinned host<->device copy bandwidth (CUDA only) and raw storage bandwidth of every
             target directory (O_DIRECT with page-aligned mmap buffers where the filesystem allows
             it; best over 1,2,4,8,16 parallel streams of 4 MiB pwrite/pread, page cache dropped
             before reads; writes both into new files and again in place, which ext4 takes faster);
* baselines  the TensorRT-LLM example's per-block ``torch.save(block.cpu())`` / ``torch.load`` +
             ``copy_``, and naive KvikIO (one ``kvikio.CuFile`` per block, library defaults,
             sequential ``pwrite``/``pread(...).get()``; CUDA + KvikIO only);
* connector  ``block_io.save_blocks`` and ``pin_blocks`` + ``load_blocks`` (checksums on) with the
             engine the connector would choose (``make_engine("auto", ...)``), per block size and
             target, disk loads from a cold page cache;
* executor   connector callback time on the executor thread through the reference executor
             (64-request batch, 32 layers), and the match time of a fully cached 128k-token prompt;
* overlap    (CUDA only) slowdown of a bf16 matmul loop while saves and loads run concurrently.

Usage: ``python profiling/bench.py [--quick] [--json FILE] [--trace FILE] ...``
(``gds-kv bench ...`` runs the same ``main``).  See profiling/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import gc
import hashlib
import json
import mmap
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
try:  # a source checkout without `pip install -e .`
    import gds_kv_connector  # noqa: F401
except ImportError:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402

from gds_kv_connector.arena import HOST_FS_TYPES, SlotArena, maps_slabs  # noqa: E402
from gds_kv_connector.mounts import fs_type  # noqa: E402
from gds_kv_connector.block_io import load_blocks, pin_blocks, save_blocks  # noqa: E402
from gds_kv_connector.engines import make_engine  # noqa: E402
from gds_kv_connector.kv_layout import pool_from_tensor  # noqa: E402
from gds_kv_connector.pool import BlockPool  # noqa: E402
from gds_kv_connector.pool_format import ZERO_KEY, file_size_for  # noqa: E402
from gds_kv_connector.settings import Settings, parse_size  # noqa: E402

GB = 1e9
MiB = 1 << 20
KiB = 1 << 10
RAW_CHUNK = 4 * MiB
RAW_BESIDE_BYTES = 256 * MiB  # each direction of the raw re-measure beside a disk row
DEFAULT_SIZES = "256KiB,1MiB,2.25MiB,4MiB,10MiB"
QUICK_SIZES = "256KiB,1MiB"
TOKENS_PER_BLOCK = 32
MATCH_BLOCKS = 4096  # a 128k-token prompt of 32-token blocks
MATCH_BLOCK_ELEMS = 1024  # bf16, 1 layer, K+V -> 4 KiB blocks: only matching is timed

# The goals; the bench prints PASS/MISS against them and never asserts.
GOALS = {
    "host_ge1m_vs_pinned": 0.85,
    "host_256k_vs_pinned": 0.60,
    "disk_vs_raw": 0.90,
    "host_vs_trtllm_x": 30.0,
    "exec_callback_us_per_iter": 100.0,
    "exec_layer_hook_us": 5.0,
    "match_128k_ms": 5.0,
    "overlap_slowdown_pct": 5.0,
}


# ----------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------
def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 and nbytes > 0 else 0.0


def fmt_size(n: int) -> str:
    if n >= MiB:
        v = n / MiB
        return f"{v:g}M" if v != int(v) else f"{int(v)}M"
    return f"{n // KiB}K"


def _opt_version(mod: str) -> str | None:
    try:
        m = __import__(mod)
        return str(getattr(m, "__version__", "?"))
    except Exception:  # noqa: BLE001 - absent or broken: recorded as absent
        return None


def git_commit() -> dict:
    """GDS_KV_COMMIT wins when set: a copied working tree (the device machine's) can carry a stale .git."""
    out: dict[str, Any] = {"commit": None, "dirty": None, "source": None}
    if os.environ.get("GDS_KV_COMMIT"):
        out["commit"], out["source"] = os.environ["GDS_KV_COMMIT"], "env GDS_KV_COMMIT"
        return out
    try:
        head = subprocess.run(["git", "-C", _REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            out["commit"], out["source"] = head.stdout.strip(), "git rev-parse HEAD"
            st = subprocess.run(["git", "-C", _REPO, "status", "--porcelain"], capture_output=True, text=True,
                                timeout=10)
            out["dirty"] = bool(st.stdout.strip()) if st.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return out


_libc = None


def syncfs(path: str) -> None:
    """Flush the filesystem holding ``path`` (syncfs(2); sync(2) where unavailable)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    os.sync()


def _iter_files(paths: list[str]):
    for p in paths:
        if os.path.isdir(p):
            for d, _, names in os.walk(p):
                for n in names:
                    yield os.path.join(d, n)
        elif os.path.exists(p):
            yield p


def drop_caches(paths: list[str], global_drop: bool) -> dict:
    """Make the next reads of ``paths`` come from the device: write back, then drop the pages."""
    t0 = time.perf_counter()
    os.sync()  # dirty pages cannot be dropped
    n = 0
    for f in _iter_files(paths):
        try:
            fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    dropped = False
    if global_drop:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("1\n")
            dropped = True
        except OSError:
            pass
    return {"fadvise_files": n, "proc_drop_caches": dropped, "seconds": round(time.perf_counter() - t0, 3)}


class Budget:
    """The run's time budget; each phase gets a share of what is left."""

    def __init__(self, total_s: float, phase_cap_s: float) -> None:
        self.t0 = time.monotonic()
        self.total = total_s
        self.phase_cap = phase_cap_s
        self.phases_left = 1

    def left(self) -> float:
        return self.total - (time.monotonic() - self.t0)

    def cap(self, want: float | None = None) -> float:
        want = self.phase_cap if want is None else want
        share = 0.8 * self.left() / max(1, self.phases_left)
        return max(0.3, min(want, share))


class Tracer:
    """torch.profiler around the whole run when --trace is given; ``rf`` marks ranges in it."""

    def __init__(self, path: str | None, cuda: bool) -> None:
        self.path = path
        self.prof = None
        if path:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            kw: dict[str, Any] = {}
            try:  # the per-batch ranges run on transfer threads, which Kineto skips unless told
                kw["experimental_config"] = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
            except (AttributeError, TypeError):
                pass
            self.prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False, **kw)

    def rf(self, name: str):
        return torch.profiler.record_function(name) if self.prof is not None else contextlib.nullcontext()

    def __enter__(self):
        if self.prof is not None:
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.prof is not None:
            self.prof.__exit__(*exc)
            os.makedirs(os.path.dirname(os.path.abspath(self.path)) or ".", exist_ok=True)
            self.prof.export_chrome_trace(self.path)
        return False


class GcWatch:
    """Python's cyclic GC pauses every thread; a full (generation 2) collection in a process holding
    torch costs tens of milliseconds, longer than a whole 256 KiB phase.  Counted per phase so a slow
    run can be told apart from a paused one."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.secs = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.secs += time.perf_counter() - self._t0

    def mark(self) -> tuple[list[int], float]:
        return list(self.count), self.secs

    def since(self, mark: tuple[list[int], float]) -> dict:
        return {"collections": [a - b for a, b in zip(self.count, mark[0])],
                "ms": round(1e3 * (self.secs - mark[1]), 2)}

    def close(self) -> None:
        gc.callbacks.remove(self._cb)


GC = GcWatch()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rand_bytes(shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)
    _sync(device)
    return t


# ----------------------------------------------------------------------------------------------
# kvikio defaults: every engine and the naive baseline start from the library's own defaults
# ----------------------------------------------------------------------------------------------
class KvikioDefaults:
    NAMES = ("compat_mode", "num_threads", "task_size")

    def __init__(self) -> None:
        self.kv = None
        self.snapshot: dict[str, Any] = {}
        try:
            import kvikio
            import kvikio.defaults
            self.kv = kvikio
            for n in self.NAMES:
                try:
                    self.snapshot[n] = kvikio.defaults.get(n)
                except Exception:  # noqa: BLE001 - older KvikIO: nothing to restore
                    pass
        except Exception:  # noqa: BLE001 - absent: baselines and engine say so
            self.kv = None

    def restore(self) -> None:
        if self.kv is None:
            return
        for n, v in self.snapshot.items():
            try:
                if self.kv.defaults.get(n) != v:
                    self.kv.defaults.set(n, v)
            except Exception:  # noqa: BLE001
                pass

    def describe(self) -> dict:
        return {k: str(v) for k, v in self.snapshot.items()}


# ----------------------------------------------------------------------------------------------
# ceilings
# ----------------------------------------------------------------------------------------------
def pinned_copy_ceiling(device: torch.device, quick: bool, tracer: Tracer) -> dict:
    n = (64 if quick else 512) * MiB
    reps = 4
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    out = {"bytes_per_copy": n, "copies_per_trial": reps, "trials": 3}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        best = 0.0
        with tracer.rf(f"bench/ceiling/pinned_{name}"):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                best = max(best, gbps(n * reps, start.elapsed_time(end) / 1e3))
        out[f"{name}_GBps"] = round(best, 3)
    del host, dev
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

    A disk's own bandwidth moved by 30-50% within minutes on the H200 host, so a ratio to a
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


# ----------------------------------------------------------------------------------------------
# the connector's path: block_io with the engine the connector would choose
# ----------------------------------------------------------------------------------------------
def _run_batches(batches: list[list[int]], fn: Callable[[list[int]], int], threads: int,
                 deadline: float, pool: ThreadPoolExecutor | None = None) -> tuple[int, float, int, bool]:
    """Run ``fn`` over batches on ``threads`` threads (like the connector's transfer threads) until
    all are done or ``deadline``; returns (bytes, seconds, batches done, capped by time).  ``pool``:
    long-lived threads to run on (a rig's, set up by its warm-up), else new ones for this call."""
    it = iter(batches)
    lock = threading.Lock()
    capped = [False]
    count = [0]

    def worker() -> int:
        moved = 0
        while True:
            if time.monotonic() >= deadline:
                capped[0] = True
                return moved
            with lock:
                b = next(it, None)
            if b is None:
                return moved
            moved += fn(b)
            with lock:
                count[0] += 1

    t0 = time.perf_counter()
    ex = pool or ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bench-xfer")
    try:
        total = sum(f.result() for f in [ex.submit(worker) for _ in range(min(threads, len(batches)))])
    finally:
        if pool is None:
            ex.shutdown(wait=True)
    secs = time.perf_counter() - t0
    return total, secs, count[0], capped[0] and count[0] < len(batches)


class ConnectorRig:
    """A pool directory, a BlockPool and an engine as the worker would build them."""

    def __init__(self, root: str, payload: int, device: torch.device, io_threads: int, tag: str,
                 kvd: KvikioDefaults, arena_bytes: int = 0, transfer_threads: int = 1) -> None:
        """``arena_bytes`` > 0: the pool runs a slot arena of that size (TLLM_GDS_KV_ARENA_BYTES), built
        here before anything is timed; how long that took is kept in ``arena_setup_s``.
        ``transfer_threads``: the long-lived threads the timed phases run on, as a worker's are."""
        kvd.restore()  # a fresh engine, as in a fresh process
        self.root = root
        fp = hashlib.sha256(f"gdskv-bench/{tag}/{os.getpid()}/{time.time_ns()}".encode()).digest()
        self.pool = BlockPool((root,), fp, payload, TOKENS_PER_BLOCK, index_ttl_s=600.0, refs=arena_bytes > 0)
        # TLLM_GDS_KV_COMPAT_IO, as the worker reads it (the user's to force, like the engine)
        compat_io = Settings.load_from(require_root=False).compat_io
        self.engine = make_engine("auto", device, io_threads, compat_io=compat_io)
        self.device = device
        self.payload = payload
        self.arena_setup_s: float | None = None
        self.transfer_threads = transfer_threads
        self.xfer = ThreadPoolExecutor(max_workers=transfer_threads, thread_name_prefix="bench-xfer")
        if arena_bytes:
            t0 = time.perf_counter()
            self.pool.arena = SlotArena(self.pool, self.engine, arena_bytes, 256 << 20, 5.0,
                                        mapped=maps_slabs(root))
            self.pool.arena.start(background=False)
            self.arena_setup_s = round(time.perf_counter() - t0, 3)

    @property
    def mode(self) -> str:
        if self.pool.arena is None:
            return "block files"
        return "arena" if self.pool.arena.mapped else "arena on disk"

    def warm_up(self) -> None:
        """Probe, thread pools and checksum kernels, outside every timed region: one block saved
        and loaded on each transfer thread, which sets up its CUDA streams and pinned staging as a
        connector's long-lived transfer threads do once in their life (the barrier puts one
        warm-up on each thread)."""
        views = _rand_bytes((self.transfer_threads, self.payload), self.device, 1)
        gate = threading.Barrier(self.transfer_threads)

        def one(view: torch.Tensor) -> None:
            gate.wait(timeout=120)
            key = hashlib.sha256(b"warm" + os.urandom(8)).digest()
            out = save_blocks(self.pool, self.engine, [key], [ZERO_KEY], [view])
            if out.failed:
                raise RuntimeError(f"warm-up save failed: {out.failed[0][1]}")
            load_keys(self.pool, self.engine, [key], [view], retries=2, timeout_s=60)
            with contextlib.suppress(OSError):
                os.unlink(self.pool.path_for(key))
            self.pool.forget(key)

        for f in [self.xfer.submit(one, views[t]) for t in range(self.transfer_threads)]:
            f.result()

    def close(self) -> None:
        self.xfer.shutdown(wait=True)
        if self.pool.arena is not None:
            self.pool.arena.close()
        self.engine.close()


def load_keys(pool: BlockPool, engine: Any, keys: list[bytes], views: list[torch.Tensor], retries: int,
              timeout_s: float) -> int:
    """Pin, load (checksums verified) and unpin one batch, as a connector's transfer thread does;
    returns the bytes loaded."""
    pins = pin_blocks(pool, keys)
    try:
        return load_blocks(pool, engine, pins, views, verify=True, retries=retries,
                           deadline=time.monotonic() + timeout_s)
    finally:
        for p in pins:
            pool.unpin(p)


def _save_timing(nbytes: int, secs: float, sync_s: float) -> dict:
    """A save row's bytes and times: GBps counts until syncfs returned, returned_GBps without it."""
    return {"bytes": nbytes, "seconds": round(secs, 4), "syncfs_seconds": round(sync_s, 4),
            "returned_GBps": round(gbps(nbytes, secs), 3), "GBps": round(gbps(nbytes, secs + sync_s), 3)}


def _median_run(rows: list[dict]) -> dict:
    """The run with the median GB/s, with every run's GB/s beside it: a phase of a fraction of a
    second is moved by a single stall of the host, so one run alone can mislead."""
    ordered = sorted(rows, key=lambda r: r["GBps"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["GBps_runs"] = [r["GBps"] for r in rows]
    out["gc_runs"] = [r.get("gc") for r in rows]
    return out


def connector_phase(rig: ConnectorRig, kv: torch.Tensor, keys: list[bytes], parents: list[bytes],
                    batch_blocks: int, budget: Budget, is_memory: bool, global_drop: bool,
                    tracer: Tracer, label: str) -> tuple[dict, dict]:
    pool, engine, threads = rig.pool, rig.engine, rig.transfer_threads
    n = kv.shape[0]
    # The blocks as the worker's KvPool hands them to transfers.  Every view is made here, before the
    # clock starts: a worker makes each block's view once in its life, and making them inside the first
    # save phase (1-2 us of GIL-held time each) cut 256 KiB saves by 17% at d0eec26 (h200-d0eec26/).
    blocks = pool_from_tensor(kv)
    blocks.block_views(range(n))
    saved: list[int] = []
    lock = threading.Lock()

    def do_save(idx: list[int]) -> int:
        with tracer.rf(f"bench/save_blocks x{len(idx)}"):
            out = save_blocks(pool, engine, [keys[i] for i in idx], [parents[i] for i in idx],
                              blocks.block_views(idx))
        if out.failed:
            raise RuntimeError(f"{len(out.failed)} block saves failed (first cause: {out.failed[0][1]})")
        with lock:
            saved.extend(idx)
        return out.bytes_written

    batches = [list(range(i, min(n, i + batch_blocks))) for i in range(0, n, batch_blocks)]
    _sync(rig.device)
    with tracer.rf(f"bench/connector/{label}/save"):
        gc_mark = GC.mark()
        nbytes, secs, _, capped = _run_batches(batches, do_save, threads, time.monotonic() + budget.cap(), rig.xfer)
        gc_save = GC.since(gc_mark)
        t0 = time.perf_counter()
        syncfs(rig.root)
        sync_s = time.perf_counter() - t0
    budget.phases_left -= 1
    save = {"direction": "save", "blocks": len(saved), **_save_timing(nbytes, secs, sync_s), "capped_by_time": capped,
            "gc": gc_save}

    # load what was saved, into zeroed blocks, cold from the device for a disk target; arena slots
    # are looked up through their reference files, as an owner that did not save them would
    saved.sort()
    if pool.arena is not None:
        pool.arena.drop_caches()
    kv.zero_()
    _sync(rig.device)
    drop = None if is_memory else drop_caches([rig.root], global_drop)

    def do_load(idx: list[int]) -> int:
        with tracer.rf(f"bench/load_blocks x{len(idx)}"):
            return load_keys(pool, engine, [keys[i] for i in idx], blocks.block_views(idx), retries=2,
                             timeout_s=120)

    batches = [saved[i:i + batch_blocks] for i in range(0, len(saved), batch_blocks)]
    with tracer.rf(f"bench/connector/{label}/load"):
        gc_mark = GC.mark()
        nbytes, secs, _, capped = _run_batches(batches, do_load, threads, time.monotonic() + budget.cap(), rig.xfer)
        gc_load = GC.since(gc_mark)
    budget.phases_left -= 1
    load = {"direction": "load", "blocks": nbytes // rig.payload, "bytes": nbytes, "seconds": round(secs, 4),
            "GBps": round(gbps(nbytes, secs), 3), "capped_by_time": capped, "cold_cache": not is_memory,
            "drop_caches": drop, "gc": gc_load}
    return save, load


# ----------------------------------------------------------------------------------------------
# baselines
# ----------------------------------------------------------------------------------------------
def baseline_trtllm(kv: torch.Tensor, n: int, bdir: str, budget: Budget, is_memory: bool, global_drop: bool,
                    tracer: Tracer, label: str) -> tuple[dict, dict]:
    """TensorRT-LLM's example connector: one torch.save file per block, torch.load + copy_ back."""
    os.makedirs(bdir, exist_ok=True)
    cuda = kv.device.type == "cuda"
    payload = kv.shape[1]
    done = 0
    _sync(kv.device)
    deadline = time.monotonic() + budget.cap()
    with tracer.rf(f"bench/baseline_trtllm/{label}/save"):
        t0 = time.perf_counter()
        for i in range(n):
            if time.monotonic() >= deadline:
                break
            # .cpu() of a CUDA block copies it; of a CPU view it would be the view, and torch.save
            # would serialize the whole pool storage, so a host pool gets clone() instead.
            blk = kv[i].cpu() if cuda else kv[i].clone()
            torch.save(blk, os.path.join(bdir, f"{i}.pt"))
            done += 1
        secs = time.perf_counter() - t0
        t1 = time.perf_counter()
        syncfs(bdir)
        sync_s = time.perf_counter() - t1
    budget.phases_left -= 1
    save = {"method": "trtllm_example", "direction": "save", "blocks": done,
            **_save_timing(done * payload, secs, sync_s), "capped_by_time": done < n}
    if not is_memory:
        drop_caches([bdir], global_drop)
    loaded = 0
    deadline = time.monotonic() + budget.cap()
    with tracer.rf(f"bench/baseline_trtllm/{label}/load"):
        t0 = time.perf_counter()
        for i in range(done):
            if time.monotonic() >= deadline:
                break
            t = torch.load(os.path.join(bdir, f"{i}.pt"), map_location="cpu", weights_only=True)
            kv[i].copy_(t)
            loaded += 1
        _sync(kv.device)
        secs = time.perf_counter() - t0
    budget.phases_left -= 1
    load = {"method": "trtllm_example", "direction": "load", "blocks": loaded, "bytes": loaded * payload,
            "seconds": round(secs, 4), "GBps": round(gbps(loaded * payload, secs), 3),
            "capped_by_time": loaded < done, "cold_cache": not is_memory}
    shutil.rmtree(bdir, ignore_errors=True)
    return save, load


def baseline_naive_kvikio(kv: torch.Tensor, n: int, bdir: str, budget: Budget, is_memory: bool,
                          global_drop: bool, kvd: KvikioDefaults, tracer: Tracer, label: str) -> tuple[dict, dict]:
    """One kvikio.CuFile per block with KvikIO's own defaults, sequential pwrite/pread(...).get()."""
    kvikio = kvd.kv
    kvd.restore()
    os.makedirs(bdir, exist_ok=True)
    payload = kv.shape[1]
    result: dict[str, Any] = {}

    def run(direction: str, count: int, cap: float) -> None:
        deadline = time.monotonic() + cap
        k = 0
        t0 = time.perf_counter()
        for i in range(count):
            if time.monotonic() >= deadline:
                break
            path = os.path.join(bdir, f"{i}.bin")
            f = kvikio.CuFile(path, "w" if direction == "save" else "r")
            try:
                (f.pwrite(kv[i]) if direction == "save" else f.pread(kv[i])).get()
            finally:
                f.close()
            k += 1
        _sync(kv.device)
        result[direction] = (k, time.perf_counter() - t0)

    def guarded(direction: str, count: int) -> tuple[int, float, str | None]:
        cap = budget.cap()
        err: list[BaseException] = []

        def body() -> None:
            try:
                run(direction, count, cap)
            except BaseException as exc:  # noqa: BLE001 - reported in the row
                err.append(exc)
        th = threading.Thread(target=body, daemon=True, name=f"bench-naive-kvikio-{direction}")
        th.start()
        th.join(cap + 60)
        if th.is_alive():
            return 0, 0.0, f"did not finish within {cap + 60:.0f} s (left running)"
        if err:
            return 0, 0.0, f"{type(err[0]).__name__}: {err[0]}"
        k, secs = result[direction]
        return k, secs, None

    _sync(kv.device)
    with tracer.rf(f"bench/baseline_naive_kvikio/{label}/save"):
        done, secs, error = guarded("save", n)
        t1 = time.perf_counter()
        syncfs(bdir)
        sync_s = time.perf_counter() - t1
    budget.phases_left -= 1
    save = {"method": "naive_kvikio", "direction": "save", "blocks": done, **_save_timing(done * payload, secs, sync_s),
            "capped_by_time": done < n, "error": error, "kvikio_defaults": kvd.describe()}
    if not is_memory:
        drop_caches([bdir], global_drop)
    with tracer.rf(f"bench/baseline_naive_kvikio/{label}/load"):
        loaded, secs, error = guarded("load", done) if done else (0, 0.0, "nothing saved")
    budget.phases_left -= 1
    load = {"method": "naive_kvikio", "direction": "load", "blocks": loaded, "bytes": loaded * payload,
            "seconds": round(secs, 4), "GBps": round(gbps(loaded * payload, secs), 3),
            "capped_by_time": loaded < done, "cold_cache": not is_memory, "error": error}
    shutil.rmtree(bdir, ignore_errors=True)
    return save, load


# ----------------------------------------------------------------------------------------------
# executor-thread cost and match time
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def connector_env(root: str, arena_bytes: int = 0):
    saved = {k: v for k, v in os.environ.items() if k.startswith("TLLM_GDS_KV_")}
    for k in saved:
        del os.environ[k]
    os.environ["TLLM_GDS_KV_ROOT"] = root
    if arena_bytes:
        os.environ["TLLM_GDS_KV_ARENA_BYTES"] = str(arena_bytes)
    # the engine and thread counts are the user's to force
    for k in ("TLLM_GDS_KV_ENGINE", "TLLM_GDS_KV_COMPAT_IO", "TLLM_GDS_KV_IO_THREADS", "TLLM_GDS_KV_TRANSFER_THREADS"):
        if k in saved:
            os.environ[k] = saved[k]
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("TLLM_GDS_KV_")]:
            del os.environ[k]
        os.environ.update(saved)


def executor_cost(root: str, device: torch.device, kvd: KvikioDefaults, tracer: Tracer, requests: int = 64,
                  layers: int = 32, arena_bytes: int = 0, new_tokens: int = 16) -> dict:
    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    from gds_kv_connector.reference import (ExecutorConfig, ModelShape, ReferenceExecutor, RunStats, SimRequest,
                                            fake_llm_args)

    kvd.restore()
    prompt_blocks = 4
    shape = ModelShape(num_layers=layers, kv_factor=2, block_elems=512, tokens_per_block=TOKENS_PER_BLOCK)
    prompt_tokens = prompt_blocks * TOKENS_PER_BLOCK + 5
    blocks_per_request = -(-(prompt_tokens + new_tokens) // TOKENS_PER_BLOCK) + 1
    cfg = ExecutorConfig(shape=shape, num_blocks=requests * blocks_per_request + 32, max_batch=requests,
                         device=str(device))
    rng = random.Random(1234)
    prompts = [[rng.randrange(32000) for _ in range(prompt_tokens)] for _ in range(requests)]
    out: dict[str, Any] = {"requests_per_batch": requests, "num_layers": layers, "block_bytes": shape.block_bytes,
                           "prompt_tokens": len(prompts[0]), "max_new_tokens": new_tokens, "rounds": [],
                           "arena_bytes": arena_bytes}
    with connector_env(root, arena_bytes):
        llm_args = fake_llm_args(TOKENS_PER_BLOCK, model="gdskv-bench-executor")
        worker = GdsKvConnectorWorker(llm_args)
        ex = ReferenceExecutor(GdsKvConnectorScheduler(llm_args), worker, cfg)
        try:
            out["engine"] = worker.transfers.engine.data_path()
            if worker.pool.arena is not None:  # built in the background at start-up; not per-iteration cost
                worker.pool.arena.wait_ready(120)
            ex.stats = RunStats()  # start-up (register_kv_caches, engine probe) is not per-iteration cost
            totals = RunStats()
            acc: dict[str, list] = {}
            _instrument(ex.sched, _SCHED_CALLBACKS, acc)
            _instrument(ex.worker, _WORKER_CALLBACKS, acc)
            for r, what in enumerate(("cold: saves only", "warm: same prompts again, loads from the pool")):
                before = RunStats(**vars(ex.stats))
                wait_before = worker.stats.snapshot().get("sync_load_wait_us", 0)
                acc.clear()
                for i, p in enumerate(prompts):
                    ex.submit(SimRequest(r * 10_000 + i, p, max_new_tokens=new_tokens))
                per_iter: list[float] = []
                step = ex.step

                def timed_step(_step=step, _per=per_iter):
                    c0 = ex.stats.callback_s
                    _step()
                    _per.append(ex.stats.callback_s - c0)
                ex.step = timed_step
                with tracer.rf(f"bench/executor/round{r}"):
                    ex.run_until_done()
                ex.step = step
                now = ex.stats
                d = {k: getattr(now, k) - getattr(before, k) for k in vars(now)}
                for k, v in d.items():
                    setattr(totals, k, getattr(totals, k) + v)
                d["sync_load_wait_s"] = (worker.stats.snapshot().get("sync_load_wait_us", 0) - wait_before) / 1e6
                totals.sync_load_wait_s = getattr(totals, "sync_load_wait_s", 0.0) + d["sync_load_wait_s"]
                summary = _exec_summary(d, what)
                rest = sorted(per_iter[1:]) or [0.0]
                summary["iteration_us"] = {  # the admission iteration apart from the steady ones after it
                    "first": round(1e6 * per_iter[0], 1) if per_iter else None,
                    "rest_median": round(1e6 * rest[len(rest) // 2], 1), "rest_max": round(1e6 * rest[-1], 1)}
                summary["by_callback"] = {
                    name: {"calls": c, "total_us": round(1e6 * secs, 1), "us_per_call": round(1e6 * secs / c, 3),
                           "us_per_iteration": round(1e6 * secs / d["iterations"], 3) if d["iterations"] else None}
                    for name, (c, secs) in sorted(acc.items(), key=lambda kv: -kv[1][1])}
                out["rounds"].append(summary)
            out.update(_exec_summary({**vars(totals), "sync_load_wait_s": getattr(totals, "sync_load_wait_s", 0.0)},
                                     "both rounds"))
        finally:
            worker.shutdown()
    return out


_SCHED_CALLBACKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                    "request_finished")
_WORKER_CALLBACKS = ("bind_connector_meta", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                     "wait_for_save", "get_finished")


def _instrument(obj: Any, names: tuple[str, ...], acc: dict[str, list]) -> None:
    """Per-callback time, for the breakdown only (RunStats gives the totals the goals use)."""
    for name in names:
        fn = getattr(obj, name, None)
        if fn is None:
            continue

        def wrapped(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                e = acc.setdefault(_name, [0, 0.0])
                e[0] += 1
                e[1] += time.perf_counter() - t0
        setattr(obj, name, wrapped)


def _exec_summary(d: dict, what: str) -> dict:
    iters = d["iterations"]
    busy = iters - d["idle_iterations"]
    return {"what": what, "iterations": iters, "busy_iterations": busy, "idle_iterations": d["idle_iterations"],
            "callback_s": round(d["callback_s"], 6),
            "callback_us_per_iteration": round(1e6 * d["callback_s"] / iters, 3) if iters else None,
            "callback_us_per_busy_iteration": round(1e6 * d["callback_s"] / busy, 3) if busy else None,
            "layer_hook_calls": d["layer_hook_calls"], "layer_hook_s": round(d["layer_hook_s"], 6),
            "layer_hook_us_per_call": (round(1e6 * d["layer_hook_s"] / d["layer_hook_calls"], 3)
                                       if d["layer_hook_calls"] else None),
            # synchronous loads are waited for in layer 0's hook: their bytes' transfer time, not callback cost
            "sync_load_wait_s": round(d.get("sync_load_wait_s", 0.0), 6),
            "layer_hook_us_per_call_excl_sync_load_wait": (
                round(1e6 * (d["layer_hook_s"] - d.get("sync_load_wait_s", 0.0)) / d["layer_hook_calls"], 3)
                if d["layer_hook_calls"] else None),
            "loaded_tokens": d["loaded_tokens"], "async_loads": d["async_loads"], "sync_loads": d["sync_loads"],
            "wall_s": round(d["wall_s"], 3)}


def match_time(root: str, device: torch.device, io_threads: int, kvd: KvikioDefaults, tracer: Tracer,
               time_cap_s: float, arena_bytes: int = 0) -> dict:
    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    from gds_kv_connector import native
    from gds_kv_connector.keys import base_fingerprint, chain_from_tokens, chain_seed, extend_chain, tokens_to_bytes
    from gds_kv_connector.local_peer import lookup
    from gds_kv_connector.reference import SimRequest, fake_llm_args

    kvd.restore()
    tokens = MATCH_BLOCKS * TOKENS_PER_BLOCK + 1  # one prompt token is always left to compute
    rng = random.Random(99)
    prompt = [rng.randrange(32000) for _ in range(tokens)]
    out: dict[str, Any] = {"prompt_tokens": tokens, "blocks": MATCH_BLOCKS, "tokens_per_block": TOKENS_PER_BLOCK,
                           "arena_bytes": arena_bytes}
    with connector_env(root, arena_bytes):
        llm_args = fake_llm_args(TOKENS_PER_BLOCK, model="gdskv-bench-match")
        sched, worker = GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args)
        try:
            worker.register_kv_caches(torch.zeros((8, 1, 2, MATCH_BLOCK_ELEMS), dtype=torch.bfloat16, device=device))
            sched.wait_for_initialization()
            if worker.pool.arena is not None:
                worker.pool.arena.wait_ready(120)
            peer = lookup(llm_args)
            payload = worker.pool.payload_len
            out["block_bytes"] = payload
            keys = extend_chain(chain_seed(base_fingerprint(peer.geometry), None), tokens_to_bytes(prompt),
                                TOKENS_PER_BLOCK, 0, MATCH_BLOCKS)
            data = _rand_bytes((MATCH_BLOCKS, payload), device, 5)
            t0 = time.perf_counter()
            with tracer.rf("bench/match/build_pool"):
                for i in range(0, MATCH_BLOCKS, 512):
                    o = save_blocks(worker.pool, worker.transfers.engine, keys[i:i + 512],
                                    [keys[j - 1] if j else ZERO_KEY for j in range(i, min(MATCH_BLOCKS, i + 512))],
                                    [data[j] for j in range(i, min(MATCH_BLOCKS, i + 512))])
                    if o.failed:
                        raise RuntimeError(f"building the match pool: {len(o.failed)} saves failed ({o.failed[0][1]})")
            out["build_s"] = round(time.perf_counter() - t0, 3)
            times: list[float] = []
            rid = 1_000_000
            deadline = time.monotonic() + time_cap_s
            with tracer.rf("bench/match/calls"):
                while len(times) < 3 or (len(times) < 30 and time.monotonic() < deadline):
                    req = SimRequest(rid, prompt)
                    req.tokens = list(prompt)
                    t0 = time.perf_counter()
                    matched, is_async = sched.get_num_new_matched_tokens(req, 0)
                    times.append(time.perf_counter() - t0)
                    sched.request_reset(req)
                    rid += 1
                    if matched != MATCH_BLOCKS * TOKENS_PER_BLOCK:
                        raise RuntimeError(f"fully cached prompt matched {matched} tokens, expected "
                                           f"{MATCH_BLOCKS * TOKENS_PER_BLOCK}")
            comp: dict[str, Any] = {"native": native.BUILT}
            seed = chain_seed(base_fingerprint(peer.geometry), None)
            t0 = time.perf_counter()
            chain_from_tokens(seed, prompt, 0, TOKENS_PER_BLOCK, MATCH_BLOCKS)
            comp["key_chain_ms"] = round(1e3 * (time.perf_counter() - t0), 3)
            t0 = time.perf_counter()
            extend_chain(seed, tokens_to_bytes(prompt), TOKENS_PER_BLOCK, 0, MATCH_BLOCKS)
            comp["key_chain_python_ms"] = round(1e3 * (time.perf_counter() - t0), 3)
            worker.pool.count_present(keys)
            t0 = time.perf_counter()
            worker.pool.count_present(keys)
            comp["count_present_warm_ms"] = round(1e3 * (time.perf_counter() - t0), 3)
            out["components"] = comp
            warm = sorted(times[1:])
            out.update({"first_call_ms": round(times[0] * 1e3, 3), "warm_calls": len(warm),
                        "warm_median_ms": round(warm[len(warm) // 2] * 1e3, 3),
                        "warm_min_ms": round(warm[0] * 1e3, 3), "warm_max_ms": round(warm[-1] * 1e3, 3),
                        "is_async": bool(is_async), "index_ttl_s": worker.pool.index_ttl_s,
                        "note": "first call stats every block file; later calls hit the index (warm)"})
        finally:
            worker.shutdown()
    return out


# ----------------------------------------------------------------------------------------------
# overlap with GPU compute
# ----------------------------------------------------------------------------------------------
def overlap(root: str, device: torch.device, io_threads: int, threads: int, block: int, kvd: KvikioDefaults,
            target_s: float, tracer: Tracer) -> dict:
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    stream = torch.cuda.Stream(device)

    def compute(k: int) -> tuple[float, float]:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            start.record(stream)
            for _ in range(k):
                torch.mm(a, b, out=c)
            end.record(stream)
        end.synchronize()
        return time.perf_counter() - t0, start.elapsed_time(end) / 1e3

    compute(5)
    per = compute(20)[0] / 20
    k = int(min(20000, max(20, target_s / per)))
    rig = ConnectorRig(os.path.join(root, "overlap"), block, device, io_threads, "overlap", kvd)
    per_thread = max(2, (256 * MiB) // block)
    kv = _rand_bytes((threads * per_thread, block), device, 11)
    stop = threading.Event()
    moved = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []
    started = threading.Barrier(threads + 1)
    try:
        rig.warm_up()
        with tracer.rf("bench/overlap/compute_alone"):
            alone = [compute(k) for _ in range(2)]

        def xfer(t: int) -> None:
            views = [kv[t * per_thread + j] for j in range(per_thread)]
            gen = 0
            with contextlib.suppress(threading.BrokenBarrierError):
                started.wait()
            try:
                while not stop.is_set():
                    keys = [hashlib.sha256(f"ov/{t}/{gen}/{j}".encode()).digest() for j in range(per_thread)]
                    gen += 1
                    with tracer.rf(f"bench/save_blocks x{per_thread}"):
                        o = save_blocks(rig.pool, rig.engine, keys, [ZERO_KEY] * per_thread, views)
                    if o.failed:
                        raise RuntimeError(f"overlap save failed: {o.failed[0][1]}")
                    with tracer.rf(f"bench/load_blocks x{per_thread}"):
                        load_keys(rig.pool, rig.engine, keys, views, retries=2, timeout_s=120)
                    for key in keys:
                        with contextlib.suppress(OSError):
                            os.unlink(rig.pool.path_for(key))
                        rig.pool.forget(key)
                    with lock:
                        moved[0] += 2 * per_thread * block
            except BaseException as exc:  # noqa: BLE001 - reported
                errors.append(exc)

        ths = [threading.Thread(target=xfer, args=(t,), daemon=True) for t in range(threads)]
        for th in ths:
            th.start()
        started.wait()
        time.sleep(0.2)  # transfers in full flight before the clock starts
        m0 = moved[0]
        with tracer.rf("bench/overlap/compute_with_transfers"):
            wall, gpu = compute(k)
        m1 = moved[0]
        stop.set()
        for th in ths:
            th.join(120)
        with tracer.rf("bench/overlap/compute_alone_after"):
            alone.append(compute(k))
    finally:
        stop.set()
        rig.close()
        shutil.rmtree(rig.root, ignore_errors=True)
    if errors:
        raise errors[0]
    alone_wall = min(x[0] for x in alone)
    alone_gpu = min(x[1] for x in alone)
    return {"matmul": f"bf16 {n}x{n} @ {n}x{n}", "iterations": k, "alone_s": round(alone_wall, 4),
            "alone_gpu_s": round(alone_gpu, 4), "with_transfers_s": round(wall, 4),
            "with_transfers_gpu_s": round(gpu, 4),
            "slowdown_pct": round(100.0 * (wall / alone_wall - 1.0), 2),
            "slowdown_gpu_pct": round(100.0 * (gpu / alone_gpu - 1.0), 2),
            "transfer_block_bytes": block, "transfer_threads": threads, "engine": rig.engine.data_path(),
            "bytes_moved_during_compute": m1 - m0, "transfer_GBps_during_compute": round(gbps(m1 - m0, wall), 3),
            "target_dir": root}


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def ceiling_for(res: dict, target: str, direction: str) -> tuple[float | None, str]:
    pinned = res["ceilings"].get("pinned_copy")
    raw = res["ceilings"]["storage"].get(target) or {}
    rw = "write" if direction == "save" else "read"
    raw_bw = (raw.get(rw) or {}).get("best_GBps")
    if res["targets_info"][target]["memory"]:
        if pinned:
            key = "d2h_GBps" if direction == "save" else "h2d_GBps"
            return pinned.get(key), f"pinned {key[:3].upper()}"
        return raw_bw, f"host {rw} ({raw.get('io', '?')})"
    return raw_bw, f"raw {rw} ({'O_DIRECT' if raw.get('o_direct') else 'buffered'})"


def _find(rows: list[dict], **kw) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def compute_ratios(res: dict) -> None:
    for row in res["connector"]:
        ceil, what = ceiling_for(res, row["target"], row["direction"])
        row["ceiling_GBps"], row["ceiling"] = ceil, what
        row["ratio_to_ceiling"] = round(row["GBps"] / ceil, 4) if ceil else None
        beside = row.get("raw_beside_GBps")
        row["ratio_to_raw_beside"] = round(row["GBps"] / beside, 4) if beside else None
        for method in ("trtllm_example", "naive_kvikio"):
            b = _find(res["baselines"], method=method, target=row["target"], block_bytes=row["block_bytes"],
                      direction=row["direction"])
            row[f"x_{method}"] = round(row["GBps"] / b["GBps"], 3) if b and b.get("GBps") else None


def _pool_modes(info: dict, args: argparse.Namespace) -> tuple[bool, ...]:
    """Whether each connector pass at one size uses the slot arena: a host-memory target runs it
    unless --shm-files; a disk target as --disk-pool says."""
    if info.get("fs") in HOST_FS_TYPES or info.get("memory"):
        return (info.get("fs") in HOST_FS_TYPES and not args.shm_files,)
    return {"files": (False,), "arena": (True,), "both": (False, True)}[args.disk_pool]


def evaluate_goals(res: dict) -> list[dict]:
    goals: list[dict] = []

    def add(name: str, goal: str, measured: str, ok: bool | None, why: str = "") -> None:
        goals.append({"goal": name, "target": goal, "measured": measured,
                      "status": "n/a" if ok is None else ("PASS" if ok else "MISS"), "note": why})

    conn = res["connector"]
    mem = [t for t, info in res["targets_info"].items() if info["memory"]]
    disk = [t for t, info in res["targets_info"].items() if not info["memory"]]
    pinned = res["ceilings"].get("pinned_copy")
    ceil_note = "" if pinned else "no CUDA: ceiling is host-memory bandwidth of the tmpfs target"

    def worst(rows: list[dict], key: str) -> tuple[dict | None, float | None]:
        rows = [r for r in rows if r.get(key) is not None]
        if not rows:
            return None, None
        r = min(rows, key=lambda r: r[key])
        return r, r[key]

    def label(r: dict) -> str:
        return f"{r['target']} {r['direction']} {fmt_size(r['block_bytes'])}"

    for name, lo, hi, g in (("host-memory pool >=1MiB vs pinned-copy ceiling", MiB, None, GOALS["host_ge1m_vs_pinned"]),
                            ("host-memory pool 256KiB vs pinned-copy ceiling", 0, MiB, GOALS["host_256k_vs_pinned"])):
        rows = [r for r in conn if r["target"] in mem and r["block_bytes"] >= lo and (hi is None or r["block_bytes"] < hi)]
        r, v = worst(rows, "ratio_to_ceiling")
        add(name, f">= {g:.0%} both directions", f"worst {v:.0%} ({label(r)})" if r else "not measured",
            None if r is None else v >= g, ceil_note)
    disk_rows = [x for x in conn if x["target"] in disk]
    for mode in sorted({x.get("pool_mode", "block files") for x in disk_rows}) or ["block files"]:
        rows = [x for x in disk_rows if x.get("pool_mode", "block files") == mode]
        r, v = worst(rows, "ratio_to_ceiling")
        rb, vb = worst(rows, "ratio_to_raw_beside")
        beside_note = (f"; against the raw legs re-measured beside each row, worst {vb:.0%} ({label(rb)})"
                       if rb else "")
        add("disk pool vs raw O_DIRECT ceiling" + ("" if mode == "block files" else f" ({mode})"),
            f">= {GOALS['disk_vs_raw']:.0%} both directions, every size",
            f"worst {v:.0%} ({label(r)})" if r else "not measured", None if r is None else v >= GOALS["disk_vs_raw"],
            "saves counted until syncfs returns (bytes on the device)" + beside_note)
    trt_rows = [x for x in conn if x["target"] in mem]
    r, v = worst(trt_rows, "x_trtllm_example")
    add("vs TensorRT-LLM example path (host-memory pool)", f">= {GOALS['host_vs_trtllm_x']:g}x every size",
        f"worst {v:.1f}x ({label(r)})" if r else "not measured",
        None if r is None else v >= GOALS["host_vs_trtllm_x"], _trtllm_bound_note(trt_rows, GOALS["host_vs_trtllm_x"]))
    r, v = worst(conn, "x_naive_kvikio")
    add("vs naive KvikIO", "> 1x every size, target and direction",
        f"worst {v:.2f}x ({label(r)})" if r else "not measured", None if r is None else v > 1.0,
        "" if r else "needs CUDA and KvikIO")
    ex = res.get("executor") or {}
    if ex.get("callback_us_per_iteration") is not None:
        cb, hook = ex["callback_us_per_iteration"], ex["layer_hook_us_per_call"]
        own = ex.get("layer_hook_us_per_call_excl_sync_load_wait", hook)
        per_round = "; ".join(f"round {i}: {x['callback_us_per_iteration']:.1f} us/iter, "
                              f"{x['layer_hook_us_per_call']:.2f} us/hook" for i, x in enumerate(ex["rounds"]))
        add("executor callbacks per iteration", f"<= {GOALS['exec_callback_us_per_iter']:g} us avg",
            f"{cb:.1f} us ({per_round})", cb <= GOALS["exec_callback_us_per_iter"],
            f"{ex['requests_per_batch']} requests of {ex['prompt_tokens']} prompt tokens, {ex['max_new_tokens']} new "
            f"tokens each: admission is spread over that many iterations")
        add("executor per layer hook", f"<= {GOALS['exec_layer_hook_us']:g} us",
            f"{own:.2f} us ({hook:.2f} us with the {1e3 * ex.get('sync_load_wait_s', 0):.1f} ms that layer 0's hooks "
            f"waited for synchronous loads' bytes)", own <= GOALS["exec_layer_hook_us"],
            "the goal is read as the hooks' own cost; the wait is the loads' transfer time")
    else:
        add("executor callbacks", "<= 100 us/iter, <= 5 us/hook", "not measured", None)
    m = res.get("match") or {}
    if m.get("warm_median_ms") is not None:
        add("128k-token prompt match (warm index)", f"<= {GOALS['match_128k_ms']:g} ms",
            f"median {m['warm_median_ms']:.2f} ms (min {m['warm_min_ms']:.2f}, first {m['first_call_ms']:.1f})",
            m["warm_median_ms"] <= GOALS["match_128k_ms"])
    else:
        add("128k-token prompt match", "<= 5 ms", "not measured", None)
    ov = res.get("overlap") or {}
    if ov.get("slowdown_pct") is not None:
        add("compute slowdown with transfers", f"<= {GOALS['overlap_slowdown_pct']:g}%",
            f"{ov['slowdown_pct']:.1f}% wall ({ov['slowdown_gpu_pct']:.1f}% GPU time) at "
            f"{ov['transfer_GBps_during_compute']:.1f} GB/s", ov["slowdown_pct"] <= GOALS["overlap_slowdown_pct"])
    else:
        add("compute slowdown with transfers", "<= 5%", ov.get("skipped", "not measured"), None)
    return goals


def _trtllm_bound_note(rows: list[dict], goal_x: float) -> str:
    """Rows where the goal multiple of the example's own speed is above the ceiling: no connector could
    reach it there, and the note says so with the figures (ceiling = GB/s / ratio to it)."""
    bounded, room = [], []
    for r in rows:
        x, ratio = r.get("x_trtllm_example"), r.get("ratio_to_ceiling")
        if not x or not ratio or x >= goal_x:
            continue
        base, ceiling = r["GBps"] / x, r["GBps"] / ratio
        where = f"{r['direction']} {fmt_size(r['block_bytes'])}"
        if goal_x * base > ceiling:
            bounded.append(f"{where}: {goal_x:g}x its {base:.2f} GB/s is {goal_x * base:.0f} GB/s, above the "
                           f"{ceiling:.1f} GB/s ceiling (at most {ceiling / base:.1f}x)")
        else:
            room.append(f"{where} {x:.1f}x")
    parts = (["bounded by the ceiling: " + "; ".join(bounded)] if bounded else []) + \
        (["below the goal with the ceiling above it: " + ", ".join(room)] if room else [])
    return "; ".join(parts)


def _raw_leg(d: dict) -> str:
    """Which raw leg gave a direction's ceiling: ``x4`` (files of their own) or ``x4 one file``."""
    s, layout = d.get("best_streams", "?"), d.get("best_layout", "files")
    return f"x{s}" if layout == "files" else f"x{s} {layout}"


def render_table(res: dict) -> str:
    L: list[str] = []
    meta = res["meta"]
    L.append(f"gds-kv-connector bench  host={meta['hostname']}  commit={(meta['git']['commit'] or '?')[:12]}"
             f"{' (dirty)' if meta['git'].get('dirty') else ''}  device={meta['device']}  "
             f"torch={meta['versions']['torch']}  kvikio={meta['versions']['kvikio']}  cupy={meta['versions']['cupy']}")
    for t, info in res["targets_info"].items():
        L.append(f"  target {t}: {info['dir']} ({info['fs']}); engine: {info.get('engine_data_path', '?')}")
    gct = res["config"].get("gc_threshold")
    if gct:
        L.append(f"  Python GC thresholds {tuple(gct)} (--gc-gen0; TensorRT-LLM's executor runs with 20000)")
    L.append("")
    L.append("Ceilings (GB/s = 1e9 B/s)")
    p = res["ceilings"].get("pinned_copy")
    if p:
        L.append(f"  pinned copy          H2D {p['h2d_GBps']:8.2f}   D2H {p['d2h_GBps']:8.2f}")
    else:
        L.append("  pinned copy          (no CUDA)")
    for t, r in res["ceilings"]["storage"].items():
        w, rd = r.get("write", {}), r.get("read", {})
        L.append(f"  raw {t:<6} {r['io'][:30]:<30} write {w.get('best_GBps', 0):7.2f} ({_raw_leg(w)})"
                 f"   read {rd.get('best_GBps', 0):7.2f} ({_raw_leg(rd)})")
    L.append("")
    hdr = (f"  {'target':<6} {'dir':<4} {'block':>6} {'conn':>8} {'ceiling':>8} {'%ceil':>6} "
           f"{'trtllm':>8} {'x':>7} {'kvikio':>8} {'x':>6}  notes")
    L.append("Connector (block_io + make_engine('auto'), checksums on) vs ceiling and baselines, GB/s")
    L.append(hdr)
    for r in res["connector"]:
        trt = _find(res["baselines"], method="trtllm_example", target=r["target"], block_bytes=r["block_bytes"],
                    direction=r["direction"])
        kvi = _find(res["baselines"], method="naive_kvikio", target=r["target"], block_bytes=r["block_bytes"],
                    direction=r["direction"])
        notes = [] if r.get("pool_mode") in (None, "block files", "arena") else [r["pool_mode"]]
        runs = r.get("GBps_runs") or []
        if len(runs) > 1:  # the median is reported; the spread says how far one run can be trusted
            notes.append(f"runs {min(runs):.1f}-{max(runs):.1f}")
        if r["direction"] == "save" and r.get("returned_GBps"):
            notes.append(f"returned {r['returned_GBps']:.2f}")
        if r.get("capped_by_time"):
            notes.append("time-capped")
        if r.get("cold_cache"):
            notes.append("cold")
        if r.get("raw_beside_GBps"):
            notes.append(f"raw beside {r['raw_beside_GBps']:.2f} ({100 * r['ratio_to_raw_beside']:.0f}%)")
        gcr = r.get("gc") or {}
        if gcr.get("collections", [0, 0, 0])[2]:
            notes.append(f"full GC x{gcr['collections'][2]} ({gcr['ms']:.0f} ms)")
        ceil = r.get("ceiling_GBps")
        L.append(f"  {r['target']:<6} {r['direction']:<4} {fmt_size(r['block_bytes']):>6} {r['GBps']:8.2f} "
                 f"{ceil if ceil is not None else float('nan'):8.2f} "
                 f"{(100 * r['ratio_to_ceiling']) if r.get('ratio_to_ceiling') is not None else float('nan'):5.0f}% "
                 f"{trt['GBps'] if trt else float('nan'):8.3f} "
                 f"{r['x_trtllm_example'] if r.get('x_trtllm_example') is not None else float('nan'):7.1f} "
                 f"{kvi['GBps'] if kvi else float('nan'):8.3f} "
                 f"{r['x_naive_kvikio'] if r.get('x_naive_kvikio') is not None else float('nan'):6.2f}  "
                 f"{', '.join(notes)}")
    L.append("  (save GB/s counts until syncfs returns; 'returned' = when save_blocks returned, data maybe "
             "still in the page cache)")
    ex = res.get("executor") or {}
    L.append("")
    if ex.get("callback_us_per_iteration") is not None:
        L.append(f"Executor thread ({ex['requests_per_batch']}-request batch, {ex['num_layers']} layers): "
                 f"{ex['callback_us_per_iteration']:.1f} us/iteration over {ex['iterations']} iterations "
                 f"({ex['callback_us_per_busy_iteration']:.1f} us per busy iteration), "
                 f"{ex['layer_hook_us_per_call']:.2f} us per layer hook ({ex['layer_hook_calls']} calls)")
        for i, x in enumerate(ex["rounds"]):
            it = x.get("iteration_us") or {}
            L.append(f"  round {i} ({x['what']}): {x['callback_us_per_iteration']:.1f} us/iter, "
                     f"{x['layer_hook_us_per_call']:.2f} us/hook, {x['iterations']} iterations "
                     f"({x['idle_iterations']} idle), loaded {x['loaded_tokens']} tokens")
            if it:
                L.append(f"    first iteration (admits {ex['requests_per_batch']} requests) {it['first']:.0f} us; the "
                         f"others median {it['rest_median']:.0f} us, max {it['rest_max']:.0f} us; hooks "
                         f"{x['layer_hook_us_per_call_excl_sync_load_wait']:.2f} us/call without the "
                         f"{1e3 * x['sync_load_wait_s']:.1f} ms waited for synchronous loads")
            top = list(x.get("by_callback", {}).items())[:4]
            if top:
                L.append("    " + ", ".join(f"{n} {v['us_per_iteration']:.0f} us/iter ({v['us_per_call']:.1f} us/call)"
                                            for n, v in top))
    else:
        L.append(f"Executor thread: {ex.get('error', 'not measured')}")
    m = res.get("match") or {}
    if m.get("warm_median_ms") is not None:
        L.append(f"Match of a fully cached {m['prompt_tokens']}-token prompt ({m['blocks']} blocks): "
                 f"median {m['warm_median_ms']:.2f} ms warm (min {m['warm_min_ms']:.2f}, max {m['warm_max_ms']:.2f}, "
                 f"{m['warm_calls']} calls); first call {m['first_call_ms']:.1f} ms")
        c = m.get("components") or {}
        if c:
            L.append(f"  parts: key chain {c['key_chain_ms']:.2f} ms ({'C extension' if c['native'] else 'Python'}; "
                     f"the Python definition {c['key_chain_python_ms']:.2f} ms), index lookups "
                     f"{c['count_present_warm_ms']:.2f} ms")
    else:
        L.append(f"Match: {m.get('error', 'not measured')}")
    ov = res.get("overlap") or {}
    if ov.get("slowdown_pct") is not None:
        L.append(f"Overlap: {ov['matmul']} x{ov['iterations']}: alone {ov['alone_s']:.3f} s, with transfers "
                 f"{ov['with_transfers_s']:.3f} s -> slowdown {ov['slowdown_pct']:.1f}% "
                 f"(GPU time {ov['slowdown_gpu_pct']:.1f}%), transfers {ov['transfer_GBps_during_compute']:.2f} GB/s")
    else:
        L.append(f"Overlap: {ov.get('skipped') or ov.get('error') or 'not measured'}")
    L.append("")
    L.append("Goals (reported, never asserted)")
    for g in res["goals"]:
        L.append(f"  [{g['status']:>4}] {g['goal']}: {g['measured']}  (goal {g['target']})"
                 f"{'  - ' + g['note'] if g['note'] else ''}")
    if res["errors"]:
        L.append("")
        L.append("Errors")
        for e in res["errors"]:
            L.append(f"  {e}")
    return "\n".join(L)


def plot(res: dict, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - optional
        return f"plot skipped: matplotlib not importable ({type(exc).__name__})"
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=False)
    colors = {}
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for ax, direction in zip(axes, ("save", "load")):
        for t in res["targets_info"]:
            col = colors.setdefault(t, palette[len(colors) % len(palette)])
            rows = sorted((r for r in res["connector"] if r["target"] == t and r["direction"] == direction),
                          key=lambda r: r["block_bytes"])
            if rows:
                ax.plot([r["block_bytes"] / MiB for r in rows], [r["GBps"] for r in rows], "o-", color=col,
                        label=f"connector {t}")
            for method, style in (("trtllm_example", "s--"), ("naive_kvikio", "^:")):
                b = sorted((r for r in res["baselines"] if r["target"] == t and r["direction"] == direction
                            and r["method"] == method and r.get("GBps")), key=lambda r: r["block_bytes"])
                if b:
                    ax.plot([r["block_bytes"] / MiB for r in b], [r["GBps"] for r in b], style, color=col,
                            alpha=0.7, label=f"{method} {t}")
            ceil, what = ceiling_for(res, t, direction)
            if ceil:
                ax.axhline(ceil, color=col, lw=0.8, ls="-.", alpha=0.6, label=f"ceiling {t}: {what}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        sizes = sorted({r["block_bytes"] for r in res["connector"]})
        if sizes:
            ax.set_xticks([b / MiB for b in sizes], [fmt_size(b) for b in sizes])
            ax.minorticks_off()
        ax.set_xlabel("block size (MiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{direction} ({res['meta']['device']})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"gds-kv-connector bench, {res['meta']['hostname']}, {(res['meta']['git']['commit'] or '?')[:12]}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gds-kv bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small run for CPU tests: ~64 MiB per phase, 2 sizes")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the KV pool lives")
    p.add_argument("--sizes", help=f"block sizes (default {DEFAULT_SIZES}; --quick {QUICK_SIZES})")
    p.add_argument("--total-mib", type=float, help="bytes per connector phase per size (default 1536 on GPU, "
                   "256 on CPU, 64 with --quick)")
    p.add_argument("--baseline-mib", type=float, help="bytes per baseline phase (default 512, 32 with --quick)")
    p.add_argument("--raw-mib", type=float, help="bytes per raw-storage test (default 1024, 32 with --quick)")
    p.add_argument("--streams", help="parallel streams of the raw-storage tests (default 1,2,4,8,16; --quick 1,2,4)")
    p.add_argument("--shm-dir", help="host-memory target directory (default /dev/shm/gdskv-bench-PID, or a tmp dir)")
    p.add_argument("--disk-dir", help="disk target directory (default ./bench-pool)")
    p.add_argument("--targets", default="shm,disk", help="which targets to run: shm, disk or both")
    p.add_argument("--io-threads", type=int, default=16, help="engine I/O threads (TLLM_GDS_KV_IO_THREADS default)")
    p.add_argument("--transfer-threads", type=int, default=4, help="concurrent batches, like the connector's "
                   "transfer threads (TLLM_GDS_KV_TRANSFER_THREADS default)")
    p.add_argument("--batch-mib", type=float, help="bytes per save/load batch, one block at least (default 64, "
                   "8 with --quick so several transfer threads take part)")
    p.add_argument("--phase-s", type=float, help="time cap per phase (default 10 s, 6 s with --quick)")
    p.add_argument("--budget-s", type=float, help="time budget of the whole run (default 420 s, 150 s with --quick)")
    p.add_argument("--overlap-s", type=float, default=1.5, help="duration of the compute loop (CUDA only)")
    p.add_argument("--repeat", type=int, default=3, help="connector save/load runs per size and target, fresh "
                   "keys each; the median run is reported (default 3; 1 with --quick)")
    p.add_argument("--shm-files", action="store_true", help="host-memory target as one file per block, "
                   "without the slot arena (TLLM_GDS_KV_ARENA_BYTES unset)")
    p.add_argument("--disk-pool", choices=("files", "arena", "both"), default="files",
                   help="how the disk target keeps blocks: one file per block (the connector's default), the slot "
                   "arena on disk (TLLM_GDS_KV_ARENA_BYTES: preallocated slabs, O_DIRECT at slot offsets; rows "
                   "noted 'arena on disk'), or both, one after the other at each size")
    p.add_argument("--gc-gen0", type=int, default=20000, help="Python GC generation-0 threshold for the run; "
                   "the default is what TensorRT-LLM's PyExecutor sets around its loop "
                   "(TorchLlmArgs.garbage_collection_gen0_threshold); 0 keeps Python's own (700)")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--no-executor", action="store_true")
    p.add_argument("--exec-new-tokens", type=int, default=16, help="tokens each of the executor phase's 64 "
                   "requests generates: its rounds run about this many iterations, one of which admits all 64 "
                   "requests, so the average per iteration spreads admission over this many")
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--no-drop-caches", action="store_true", help="never write /proc/sys/vm/drop_caches "
                   "(posix_fadvise DONTNEED is still used on the files read)")
    p.add_argument("--json", help="result file (default profiling/results/bench-<host>.json)")
    p.add_argument("--png", help="plot file (default: the JSON path with .png)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace of the run (torch.profiler) to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (on a terminal) or progress lines "
                   "(otherwise)")
    p.add_argument("--keep", action="store_true", help="keep the target directories' bench files")
    return p


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        argv = list(argv)
        if argv[:1] == ["--"]:  # `gds-kv bench -- --quick ...` forwards the separator too
            argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.exec_new_tokens < 1:
        parser.error(f"--exec-new-tokens must be at least 1, got {args.exec_new_tokens}")
    if args.device == "auto":
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    elif args.device == "cuda":
        if not torch.cuda.is_available():
            print("gds-kv bench: --device cuda but CUDA is not available", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    cuda = device.type == "cuda"
    quick = args.quick
    if quick and "--repeat" not in (argv if argv is not None else sys.argv):
        args.repeat = 1
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if quick else DEFAULT_SIZES)).split(",") if s]
    total = int((args.total_mib or (64 if quick else (1536 if cuda else 256))) * MiB)
    base_total = int((args.baseline_mib or (32 if quick else 512)) * MiB)
    raw_total = int((args.raw_mib or (32 if quick else 1024)) * MiB)
    batch_bytes = int((args.batch_mib or (8 if quick else 64)) * MiB)
    streams = [int(s) for s in (args.streams or ("1,2,4" if quick else "1,2,4,8,16")).split(",") if s]
    budget = Budget(args.budget_s or (150 if quick else 420), args.phase_s or (6 if quick else 10))
    global_drop = not args.no_drop_caches
    host = socket.gethostname()
    json_path = args.json or os.path.join(_HERE, "results", f"bench-{host}.json")
    png_path = args.png or (os.path.splitext(json_path)[0] + ".png")
    want = [t.strip() for t in args.targets.split(",") if t.strip()]

    # target directories
    made: list[str] = []
    targets: dict[str, dict] = {}
    # Every target gets a fresh subdirectory of its own, removed at the end; the given directories
    # themselves are never removed (only their bench-pool default, when this run created it).
    if "shm" in want:
        if args.shm_dir:
            base = os.path.abspath(args.shm_dir)
        elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
            base = "/dev/shm"
        else:
            base = tempfile.gettempdir()
        targets["shm"] = {"dir": os.path.join(base, f"gdskv-bench-{os.getpid()}"), "memory": True}
    if "disk" in want:
        base = os.path.abspath(args.disk_dir or "bench-pool")
        targets["disk"] = {"dir": os.path.join(base, f"gdskv-bench-{os.getpid()}"), "memory": False,
                           "parent": base if not args.disk_dir else None, "parent_existed": os.path.isdir(base)}
    for t, info in targets.items():
        os.makedirs(info["dir"], exist_ok=True)
        made.append(info["dir"])
        info["fs"] = fs_type(info["dir"])
        if info["memory"] and info["fs"] not in ("tmpfs", "ramfs"):
            info["note"] = f"host-memory target is on {info['fs']}, not tmpfs"

    kvd = KvikioDefaults()
    versions = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                "numpy": _opt_version("numpy"), "kvikio": _opt_version("kvikio"), "cupy": _opt_version("cupy"),
                "nvtx": _opt_version("nvtx"), "matplotlib": _opt_version("matplotlib")}
    res: dict[str, Any] = {
        "meta": {"hostname": host, "git": git_commit(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "device": torch.cuda.get_device_name(device) if cuda else "cpu", "pool_device": str(device),
                 "cpu_count": os.cpu_count(), "kernel": platform.release(), "versions": versions,
                 "kvikio_defaults_at_start": kvd.describe(), "argv": list(argv) if argv is not None else sys.argv[1:],
                 "env": {k: v for k, v in os.environ.items() if k.startswith(("KVIKIO_", "CUFILE_", "TLLM_GDS_KV_"))}},
        "config": {"quick": quick, "sizes": sizes, "bytes_per_connector_phase": total,
                   "bytes_per_baseline_phase": base_total, "bytes_per_raw_test": raw_total, "streams": streams,
                   "io_threads": args.io_threads, "transfer_threads": args.transfer_threads,
                   "batch_bytes": batch_bytes, "phase_cap_s": budget.phase_cap,
                   "budget_s": budget.total, "checksums": True, "drop_caches_global": global_drop,
                   "gc_threshold": list(gc.get_threshold()) if args.gc_gen0 <= 0 else
                   [args.gc_gen0, *gc.get_threshold()[1:]]},
        "units": {"GBps": "1e9 bytes per second", "seconds": "wall-clock seconds", "bytes": "bytes",
                  "us": "microseconds", "ms": "milliseconds", "pct": "percent"},
        "targets_info": targets, "ceilings": {"pinned_copy": None, "storage": {}}, "baselines": [], "connector": [],
        "executor": None, "match": None, "overlap": None, "errors": [], "notes": [],
    }

    has_kvikio = cuda and kvd.kv is not None
    n_methods = (0 if args.no_baselines else 1 + int(has_kvikio))
    modes = {t: _pool_modes(info, args) for t, info in targets.items()}  # use the arena or not, in turn
    budget.phases_left = (1 + len(targets) * raw_phases(streams)
                          + sum(2 * (args.repeat * len(modes[t]) + n_methods) for t in targets) * len(sizes)
                          + sum(2 * len(modes[t]) for t, info in targets.items() if not info["memory"]) * len(sizes)
                          + (0 if args.no_executor else 2) + (1 if cuda and not args.no_overlap else 0))
    steps = (int(cuda) + len(targets) + len(targets) * len(sizes) + (0 if args.no_executor else 2)
             + (1 if cuda and not args.no_overlap else 0))
    bar = None
    if not args.no_progress and sys.stderr.isatty():  # a log (e.g. a remote run) gets plain lines instead
        try:
            from tqdm import tqdm
            bar = tqdm(total=steps, desc="bench", unit="phase", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            bar = None

    marks: list[tuple[str, float]] = []

    def progress(msg: str) -> None:
        marks.append((msg, time.monotonic()))
        if bar is not None:
            bar.set_postfix_str(msg[:40], refresh=True)
        elif not args.no_progress:
            print(f"[bench {time.monotonic() - budget.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def step_done() -> None:
        if bar is not None:
            bar.update(1)

    def guarded(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - one failed phase must not lose the others
            import traceback
            res["errors"].append(f"{what}: {type(exc).__name__}: {exc}")
            traceback.print_exc(file=sys.stderr)
            return None

    rc = 0
    gc_default = gc.get_threshold()
    if args.gc_gen0 > 0:
        gc.set_threshold(args.gc_gen0)
    try:
        with Tracer(args.trace, cuda) as tracer:
            # -- ceilings
            if cuda:
                progress("pinned copy ceiling")
                res["ceilings"]["pinned_copy"] = guarded("pinned copy", lambda: pinned_copy_ceiling(device, quick, tracer))
                budget.phases_left -= 1
                step_done()
            for t, info in targets.items():
                r = guarded(f"raw storage {t}", lambda: raw_storage_ceiling(
                    t, info["dir"], streams, raw_total, budget, global_drop, info["memory"], tracer, progress))
                res["ceilings"]["storage"][t] = r or {"io": "failed", "write": {}, "read": {}}
                step_done()

            # -- connector and baselines, per target and size
            for t, info in targets.items():
                for size in sizes:
                    label = f"{t}/{fmt_size(size)}"
                    progress(f"connector {label}")
                    fsize = file_size_for(size)
                    n = max(4, total // size)
                    free = shutil.disk_usage(info["dir"]).free
                    if n * fsize > 0.45 * free:
                        n2 = max(2, int(0.45 * free) // fsize)
                        res["notes"].append(f"{label}: {n} blocks do not fit in {free >> 20} MiB free; using {n2}")
                        n = n2
                    nb = max(4, min(n, base_total // size))

                    def one_size() -> None:
                        kv = _rand_bytes((n, size), device, size)
                        for use_arena in modes[t]:
                            connector_rows(kv, use_arena)
                        baselines(kv)

                    def connector_rows(kv: torch.Tensor, use_arena: bool) -> None:
                        arena = args.repeat * (n + 2) * fsize + (256 << 20) if use_arena else 0
                        rig = ConnectorRig(os.path.join(info["dir"], f"pool-{fmt_size(size)}"), size, device,
                                           args.io_threads, label, kvd, arena_bytes=arena,
                                           transfer_threads=args.transfer_threads)
                        try:
                            rig.warm_up()
                            info["engine_data_path"] = rig.engine.data_path()
                            batch = max(1, batch_bytes // size)
                            runs = []
                            for rep in range(args.repeat):  # fresh keys and fresh random bytes each time
                                if rep:
                                    kv.random_(0, 256)
                                keys = [hashlib.sha256(f"{label}/{time.time_ns()}/{rep}/{i}".encode()).digest()
                                        for i in range(n)]
                                parents = [ZERO_KEY] + keys[:-1]
                                runs.append(connector_phase(rig, kv, keys, parents, batch,
                                                            budget, info["memory"], global_drop, tracer, label))
                            save, load = (_median_run([r[k] for r in runs]) for k in (0, 1))
                            sweep = res["ceilings"]["storage"].get(t) or {}
                            if not info["memory"] and sweep.get("o_direct"):
                                beside = guarded(f"raw beside {label}", lambda: raw_beside(
                                    info["dir"], sweep, budget, global_drop, tracer, label)) or {}
                                save["raw_beside_GBps"] = beside.get("write_GBps")
                                load["raw_beside_GBps"] = beside.get("read_GBps")
                            for row in (save, load):
                                row.update({"target": t, "block_bytes": size, "engine": rig.engine.data_path(),
                                            "pool_mode": rig.mode, "arena_setup_s": rig.arena_setup_s,
                                            "batch_blocks": batch, "transfer_threads": args.transfer_threads,
                                            "io_threads": args.io_threads, "checksums": True})
                                res["connector"].append(row)
                        finally:
                            rig.close()
                            if not args.keep:
                                shutil.rmtree(rig.root, ignore_errors=True)

                    def baselines(kv: torch.Tensor) -> None:
                        if not args.no_baselines:
                            progress(f"trtllm example {label}")
                            rows = guarded(f"trtllm baseline {label}", lambda: baseline_trtllm(
                                kv, nb, os.path.join(info["dir"], "baseline-trtllm"), budget, info["memory"],
                                global_drop, tracer, label))
                            for row in rows or ():
                                row.update({"target": t, "block_bytes": size})
                                res["baselines"].append(row)
                            if has_kvikio:
                                progress(f"naive kvikio {label}")
                                rows = guarded(f"naive kvikio baseline {label}", lambda: baseline_naive_kvikio(
                                    kv, nb, os.path.join(info["dir"], "baseline-kvikio"), budget, info["memory"],
                                    global_drop, kvd, tracer, label))
                                for row in rows or ():
                                    row.update({"target": t, "block_bytes": size})
                                    res["baselines"].append(row)

                    guarded(f"connector {label}", one_size)
                    if cuda:
                        torch.cuda.empty_cache()
                    step_done()
            if not has_kvikio and not args.no_baselines:
                res["notes"].append("naive KvikIO baseline skipped: " + ("no CUDA" if not cuda else "kvikio not importable"))

            # -- executor thread
            exec_root = targets.get("shm", next(iter(targets.values()), {"dir": tempfile.mkdtemp()}))["dir"]
            exec_arena = (512 << 20 if "shm" in targets and targets["shm"].get("fs") in HOST_FS_TYPES
                          and not args.shm_files else 0)
            if not args.no_executor:
                progress("executor cost")
                with tracer.rf("bench/executor"):
                    res["executor"] = guarded("executor cost", lambda: executor_cost(
                        os.path.join(exec_root, "exec-pool"), device, kvd, tracer, arena_bytes=exec_arena,
                        new_tokens=args.exec_new_tokens)) \
                        or {"error": "failed"}
                budget.phases_left -= 1
                step_done()
                progress("128k match")
                with tracer.rf("bench/match"):
                    res["match"] = guarded("match time", lambda: match_time(
                        os.path.join(exec_root, "match-pool"), device, args.io_threads, kvd, tracer,
                        budget.cap(5.0), arena_bytes=exec_arena)) or {"error": "failed"}
                budget.phases_left -= 1
                step_done()
                for d in ("exec-pool", "match-pool"):
                    shutil.rmtree(os.path.join(exec_root, d), ignore_errors=True)

            # -- overlap
            if cuda and not args.no_overlap:
                progress("overlap")
                blk = min(sizes, key=lambda s: abs(s - 2.25 * MiB))
                with tracer.rf("bench/overlap"):
                    res["overlap"] = guarded("overlap", lambda: overlap(
                        exec_root, device, args.io_threads, args.transfer_threads, blk, kvd,
                        min(args.overlap_s, max(0.5, budget.left() / 4)), tracer)) or {"error": "failed"}
                budget.phases_left -= 1
                step_done()
            else:
                res["overlap"] = {"skipped": "no CUDA device" if not cuda else "--no-overlap"}
    finally:
        gc.set_threshold(*gc_default)
        if bar is not None:
            bar.close()
        if not args.keep:
            for t, info in targets.items():
                shutil.rmtree(info["dir"], ignore_errors=True)
                parent = info.get("parent")
                if parent and not info.get("parent_existed"):
                    with contextlib.suppress(OSError):
                        os.rmdir(parent)

    res["meta"]["wall_s"] = round(time.monotonic() - budget.t0, 2)
    ends = [t for _, t in marks[1:]] + [time.monotonic()]
    res["meta"]["phase_seconds"] = [[m, round(e - t, 3)] for (m, t), e in zip(marks, ends)]
    compute_ratios(res)
    res["goals"] = evaluate_goals(res)
    if args.trace:
        res["meta"]["trace"] = os.path.abspath(args.trace)
        res["notes"].append("measured with torch.profiler tracing on: numbers include its overhead")
    res["meta"]["plot"] = plot(res, png_path)
    os.makedirs(os.path.dirname(os.path.abspath(json_path)) or ".", exist_ok=True)
    with open(json_path, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(render_table(res))
    for note in res["notes"]:
        print(f"note: {note}")
    print(f"\nJSON: {os.path.abspath(json_path)}")
    print(f"plot: {res['meta']['plot']}")
    if args.trace:
        print(f"trace: {os.path.abspath(args.trace)}")
    print(f"wall: {res['meta']['wall_s']} s")
    if res["errors"]:
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())

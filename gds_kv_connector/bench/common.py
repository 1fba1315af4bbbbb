"""The bench's shared pieces: units and the issue's goals, the time budget, trace ranges, the GC watch,
dropping caches, KvikIO's defaults.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import shutil
import subprocess
import time
from typing import Any

import torch

# where the package's source is: in a git checkout, the commit the results are labelled with
_SOURCE = os.path.dirname(os.path.abspath(__file__))


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


def opt_version(mod: str) -> str | None:
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
        head = subprocess.run(["git", "-C", _SOURCE, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            out["commit"], out["source"] = head.stdout.strip(), "git rev-parse HEAD"
            st = subprocess.run(["git", "-C", _SOURCE, "status", "--porcelain"], capture_output=True, text=True,
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


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rand_bytes(shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)
    sync_device(device)
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


def close_tool(tm: Any, engine: Any, root: str) -> None:
    """A profiling tool's end: its TransferManager shut down (which closes the engine), or the engine
    alone where none was made, and its pool removed."""
    if tm is not None:
        tm.shutdown()
    elif engine is not None:
        engine.close()
    shutil.rmtree(root, ignore_errors=True)

"""Fault injection for the pool and the POSIX engine: a :class:`FileOps` that misbehaves on demand.

Everything that touches pool files goes through a ``FileOps`` (fileops.py), so passing a
:class:`FaultyFileOps` to ``BlockPool(ops=...)`` and ``PosixEngine(ops=...)`` makes the connector
meet the storage failures it must survive -- stalls, EIO, ENOSPC, EROFS, short transfers and files
that end early -- without patching ``os``.  The fault suite (tests/test_fault_*.py) and the
benchmarks use it; it is part of the package so other repositories' tests can too.

A fault is a rule: *which* operation (a FileOps method name), *what* goes wrong, *how often*
(a probability, an optional maximum count and a number of matching calls to let through first),
and optionally *which files* (a substring of the path, also matched for descriptor operations
through the path each descriptor was opened with).  Rules are checked in the order added; the
first that fires applies.  Counters of calls and injections are thread-safe, because the engine
calls in from many I/O threads at once.

Example::

    ops = FaultyFileOps(seed=1)
    ops.add("preadv", "eio", count=1)            # one transient read error
    ops.add("pwrite", "enospc", probability=0.2) # a filling disk
    stall = ops.add("preadv", "stall", stall_s=30.0)
    ...
    ops.release()                                # end every stall now (test teardown)
"""

from __future__ import annotations

import errno as _errno
import os
import random
import threading
from collections import Counter
from dataclasses import dataclass

from gds_kv_connector.engines.fileops import FileOps

#: fault kinds that raise an OSError, and the errno each raises
ERRNO_KINDS = {"eio": _errno.EIO, "enospc": _errno.ENOSPC, "erofs": _errno.EROFS, "eagain": _errno.EAGAIN,
               "enoent": _errno.ENOENT, "eacces": _errno.EACCES, "estale": _errno.ESTALE}
#: fault kinds that change what a transfer returns instead of raising
TRANSFER_KINDS = {"short", "truncate"}
KINDS = set(ERRNO_KINDS) | TRANSFER_KINDS | {"stall", "errno"}
OPS = {"open", "close", "pwrite", "preadv", "pread", "fsync", "fstat", "stat", "link", "rename", "unlink",
       "ftruncate", "fchmod"}


@dataclass
class Fault:
    """One injection rule; see the module docstring.

    ``kind``: ``stall`` (wait ``stall_s`` seconds or until :meth:`FaultyFileOps.release`, then do
    the real call), an errno name from :data:`ERRNO_KINDS` or ``errno`` with ``errno=`` (raise
    ``OSError``), ``short`` (transfer only part of the bytes and return the smaller count; a short
    ``pread`` returns fewer bytes), ``truncate`` (a read finds end-of-file: 0 bytes, as if the file
    had been truncated under the reader).
    """

    op: str
    kind: str
    probability: float = 1.0
    count: int | None = None
    skip: int = 0
    stall_s: float = 0.0
    errno: int = 0
    path_contains: str | None = None
    short_fraction: float = 0.5
    seen: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown FileOps operation {self.op!r} (known: {', '.join(sorted(OPS))})")
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r} (known: {', '.join(sorted(KINDS))})")
        if self.kind in TRANSFER_KINDS and self.op not in ("pwrite", "preadv", "pread"):
            raise ValueError(f"a {self.kind} fault applies to pwrite/preadv/pread, not {self.op}")
        if self.kind == "errno" and not self.errno:
            raise ValueError("kind 'errno' needs errno=")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError("probability must be within [0, 1]")
        if not 0.0 < self.short_fraction < 1.0:
            raise ValueError("short_fraction must be within (0, 1)")
        if self.kind in ERRNO_KINDS:
            self.errno = ERRNO_KINDS[self.kind]


class FaultyFileOps(FileOps):
    """A FileOps whose calls fail, stall or come up short according to the rules added."""

    def __init__(self, seed: int | None = 0) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._paths: dict[int, str] = {}
        self._released = threading.Event()
        self.calls: Counter[str] = Counter()
        self.injected: Counter[tuple[str, str]] = Counter()
        self.stalls_active = 0
        self.stall_started = threading.Event()

    # -- configuration ----------------------------------------------------------------------------
    def add(self, op: str, kind: str, **kw) -> Fault:
        fault = Fault(op, kind, **kw)
        with self._lock:
            self._faults.append(fault)
        return fault

    def remove(self, fault: Fault) -> None:
        with self._lock:
            if fault in self._faults:
                self._faults.remove(fault)

    def clear(self) -> None:
        """Drop every rule (counters stay); stalls in progress keep waiting until release()."""
        with self._lock:
            self._faults.clear()

    def release(self) -> None:
        """End every stall now and make later stalls return at once."""
        self._released.set()

    def total_injected(self, op: str | None = None, kind: str | None = None) -> int:
        with self._lock:
            return sum(n for (o, k), n in self.injected.items()
                       if (op is None or o == op) and (kind is None or k == kind))

    # -- rule matching ----------------------------------------------------------------------------
    def _fire(self, op: str, path: str | None) -> Fault | None:
        with self._lock:
            self.calls[op] += 1
            for fault in self._faults:
                if fault.op != op:
                    continue
                if fault.path_contains is not None and (path is None or fault.path_contains not in path):
                    continue
                fault.seen += 1
                if fault.seen <= fault.skip:
                    continue
                if fault.count is not None and fault.fired >= fault.count:
                    continue
                if fault.probability < 1.0 and self._rng.random() >= fault.probability:
                    continue
                fault.fired += 1
                self.injected[(op, fault.kind)] += 1
                return fault
        return None

    def _path_of(self, fd: int) -> str | None:
        with self._lock:
            return self._paths.get(fd)

    def _apply(self, fault: Fault | None, op: str, path: str | None) -> None:
        """Raise or stall for a fault that does not change the call's result."""
        if fault is None:
            return
        if fault.kind == "stall":
            with self._lock:
                self.stalls_active += 1
            self.stall_started.set()
            try:
                self._released.wait(fault.stall_s)
            finally:
                with self._lock:
                    self.stalls_active -= 1
            return
        if fault.errno:
            raise OSError(fault.errno, f"{os.strerror(fault.errno)} (injected into {op})", path)

    # -- path operations --------------------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        self._apply(self._fire("open", path), "open", path)
        fd = super().open(path, flags, mode)
        with self._lock:
            self._paths[fd] = path
        return fd

    def close(self, fd: int) -> None:
        path = self._path_of(fd)
        with self._lock:
            self._paths.pop(fd, None)
        fault = self._fire("close", path)
        try:
            self._apply(fault, "close", path)
        finally:
            super().close(fd)  # the descriptor is gone even when close reports an error

    def stat(self, path: str) -> os.stat_result:
        self._apply(self._fire("stat", path), "stat", path)
        return super().stat(path)

    def link(self, src: str, dst: str) -> None:
        self._apply(self._fire("link", dst), "link", dst)
        super().link(src, dst)

    def rename(self, src: str, dst: str) -> None:
        self._apply(self._fire("rename", src), "rename", src)
        super().rename(src, dst)

    def unlink(self, path: str) -> None:
        self._apply(self._fire("unlink", path), "unlink", path)
        super().unlink(path)

    # -- descriptor operations --------------------------------------------------------------------
    def fsync(self, fd: int) -> None:
        path = self._path_of(fd)
        self._apply(self._fire("fsync", path), "fsync", path)
        super().fsync(fd)

    def fstat(self, fd: int) -> os.stat_result:
        path = self._path_of(fd)
        self._apply(self._fire("fstat", path), "fstat", path)
        return super().fstat(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        path = self._path_of(fd)
        self._apply(self._fire("ftruncate", path), "ftruncate", path)
        super().ftruncate(fd, length)

    def fchmod(self, fd: int, mode: int) -> None:
        path = self._path_of(fd)
        self._apply(self._fire("fchmod", path), "fchmod", path)
        super().fchmod(fd, mode)

    def pwrite(self, fd: int, data, offset: int) -> int:
        path = self._path_of(fd)
        fault = self._fire("pwrite", path)
        if fault is not None and fault.kind == "short":
            view = memoryview(data).cast("B")
            if len(view) > 1:
                return super().pwrite(fd, view[:_short_len(len(view), fault)], offset)
        elif fault is not None and fault.kind == "truncate":
            return 0
        else:
            self._apply(fault, "pwrite", path)
        return super().pwrite(fd, data, offset)

    def preadv(self, fd: int, buf, offset: int) -> int:
        path = self._path_of(fd)
        fault = self._fire("preadv", path)
        if fault is not None and fault.kind == "short":
            view = memoryview(buf).cast("B")
            if len(view) > 1:
                return super().preadv(fd, view[:_short_len(len(view), fault)], offset)
        elif fault is not None and fault.kind == "truncate":
            return 0
        else:
            self._apply(fault, "preadv", path)
        return super().preadv(fd, buf, offset)

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        path = self._path_of(fd)
        fault = self._fire("pread", path)
        if fault is not None and fault.kind == "short" and n > 1:
            return super().pread(fd, _short_len(n, fault), offset)
        if fault is not None and fault.kind == "truncate":
            return b""
        self._apply(fault, "pread", path)
        return super().pread(fd, n, offset)


def _short_len(n: int, fault: Fault) -> int:
    return max(1, min(n - 1, int(n * fault.short_fraction)))

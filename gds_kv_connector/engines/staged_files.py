"""Block files moved through a registered host staging area with O_DIRECT, where GDS is absent.

Without nvidia-fs, KvikIO's POSIX path moves each block on its own: a new ``CuFile`` per file,
a bounce-buffer copy per 4 MiB task, payload reads through the page cache.  This path does what
the raw-disk ceiling does instead: the batch's payloads are copied device -> host in one
coalesced DMA (at the PCIe limit) into page-aligned staging slots, then every file is
written with one O_DIRECT ``pwrite`` on an I/O thread: its header page (``TransferItem.header``),
payload and zero padding together, so a block costs the disk one write and, loading, one read.
Items that sit end to end in one file (arena slots of a slab on disk, saved or loaded together)
share one I/O of up to 4 MiB.  Loads run the same in reverse.  The file layout is unchanged
(payload at ``HEADER_SIZE``, zero padding to a page), so files written either way are read
either way.  A filesystem that refuses O_DIRECT (tmpfs on older kernels) gets the same writes
through the plain descriptor.  Reads and writes have ``io_threads`` threads each, so a load's reads
never queue behind the writes of save batches already handed over.

The DMA is a callable (:class:`~.host_dma.CudaHostDma` on GPU hosts), so the CPU tests drive
this module with host tensors and ``memmove``.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from gds_kv_connector.engines.fileops import FileOps, write_all
from gds_kv_connector.format.records import PAGE, align_up
from gds_kv_connector.engines.base import InTime, TransferItem, ViewsRead, expired_check, run_all

# Holds a merged save batch whole (transfers.MERGE_BYTES, 64 MiB of payload) with each block's header
# page, for blocks of 32 KiB and more: its pages are then read in one copy and free before its writes.
DEFAULT_STAGE_BYTES = 72 << 20
# Largest single O_DIRECT I/O of coalesced slots: an NVMe disk reaches its rate with a few 4 MiB
# streams in flight, and a bigger I/O would leave the other I/O threads idle.  8 MiB I/Os (three
# 2.25 MiB slots a write) saved about a fifth slower, and cutting every run into even I/Os of at most
# 4 MiB (10 MiB blocks as three) gained nothing.
DEFAULT_MAX_IO_BYTES = 4 << 20
# O_DIRECT is refused at open by filesystems without it; the plain descriptor is used then.
_NO_DIRECT = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}

CopyFn = Callable[[list[tuple[int, torch.Tensor]], int], None]
RegisterFn = Callable[[int, int, bool], None]
UnregisterFn = Callable[[int], None]


def _unpinned(exc: BaseException) -> BaseException:
    """An I/O error without its traceback, whose frames hold slices of the stage (a FileOps.preadv's
    buffer argument): kept by the caller, it would pin the stage's mapping (BufferError on release)."""
    return exc.with_traceback(None)


def plan_chunks(sizes: list[int], stage_bytes: int) -> tuple[int, list[range]]:
    """Slot pitch (the largest payload, page-aligned) and the item ranges that fit the stage
    together; a stage smaller than one slot still takes one item at a time (it is grown)."""
    if not sizes:
        return PAGE, []
    pitch = align_up(max(max(sizes), 1), PAGE)
    per = max(1, stage_bytes // pitch)
    n = len(sizes)
    return pitch, [range(lo, min(n, lo + per)) for lo in range(0, n, per)]


def plan_runs(spans: list[tuple[int, int, int]], pitch: int, max_io_bytes: int) -> list[tuple[int, int]]:
    """(fd, file offset, bytes) of consecutive stage slots -> [lo, hi) ranges moved by one I/O each.

    Items join a run when they are the same file, each starts where the one before ends on disk,
    and each but the last fills its stage slot (so they sit end to end in the stage too), up to
    ``max_io_bytes`` a run.  Block files never join (one descriptor each); slots of one arena slab
    saved together do, so 256 KiB blocks reach the disk as 4 MiB writes instead of 256 KiB ones.
    """
    runs: list[tuple[int, int]] = []
    lo, run_bytes = 0, 0
    for k, (fd, start, span) in enumerate(spans):
        if k > lo:
            pfd, pstart, pspan = spans[k - 1]
            if fd != pfd or start != pstart + pspan or pspan != pitch or run_bytes + span > max_io_bytes:
                runs.append((lo, k))
                lo, run_bytes = k, 0
        run_bytes += span
    if spans:
        runs.append((lo, len(spans)))
    return runs


@dataclass
class _Job:
    """One I/O: ``buf`` holds the items end to end (``pitch`` apart), each its header then payload."""

    items: list[TransferItem]
    leads: list[int]
    sizes: list[int]
    buf: memoryview
    pitch: int
    in_time: InTime | None = None  # checked before the I/O starts

    @property
    def start(self) -> int:
        return self.items[0].offset - self.leads[0]


class _Stage:
    """One thread's page-aligned, DMA-registered staging buffer."""

    def __init__(self, nbytes: int, register: RegisterFn) -> None:
        self.map = mmap.mmap(-1, nbytes)
        self.view = memoryview(self.map)
        self._anchor = ctypes.c_char.from_buffer(self.map)
        self.addr = ctypes.addressof(self._anchor)
        self.nbytes = nbytes
        register(self.addr, nbytes, False)

    def release(self, unregister: UnregisterFn) -> None:
        unregister(self.addr)
        self.view.release()
        del self._anchor
        self.map.close()


class StagedFileIo:
    """Batched O_DIRECT file I/O through per-thread staging buffers (see the module docstring)."""

    def __init__(self, copy_to_host: CopyFn, copy_from_host: CopyFn, register: RegisterFn,
                 unregister: UnregisterFn, io_threads: int, stage_bytes: int = DEFAULT_STAGE_BYTES,
                 ops: FileOps | None = None, max_io_bytes: int = DEFAULT_MAX_IO_BYTES) -> None:
        if stage_bytes < PAGE:
            raise ValueError(f"stage_bytes must be at least {PAGE}, got {stage_bytes}")
        self._to_host, self._from_host = copy_to_host, copy_from_host
        self._register, self._unregister = register, unregister
        self._stage_bytes = align_up(stage_bytes, PAGE)
        self._max_io_bytes = max_io_bytes
        self.ops = ops or FileOps()
        self._writes = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="gdskv-staged-w")
        self._reads = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="gdskv-staged-r")
        self._local = threading.local()
        self._stages: list[_Stage] = []
        self._lock = threading.Lock()
        self.direct_refused = 0  # files moved through the plain descriptor because O_DIRECT was refused

    def write(self, items: list[TransferItem], in_time: InTime | None = None,
              views_read: ViewsRead | None = None) -> list[BaseException | None]:
        """Also calls ``views_read`` right after the last chunk's copy to the stage, before that
        chunk's writes: where the batch fits the stage, the pages are free after one DMA."""
        return self._run(items, write=True, in_time=in_time, views_read=views_read)

    def read(self, items: list[TransferItem], in_time: InTime | None = None) -> list[BaseException | None]:
        return self._run(items, write=False, in_time=in_time)

    def close(self) -> None:
        self._writes.shutdown(wait=True)
        self._reads.shutdown(wait=True)
        with self._lock:
            stages, self._stages = self._stages, []
        for stage in stages:
            stage.release(self._unregister)

    # -- internals --------------------------------------------------------------------------------
    def _run(self, items: list[TransferItem], write: bool, in_time: InTime | None = None,
             views_read: ViewsRead | None = None) -> list[BaseException | None]:
        results: list[BaseException | None] = [None] * len(items)
        sizes = [it.view.numel() * it.view.element_size() for it in items]
        # Items with a header move it in the same I/O: their slot starts that many bytes before the payload.
        leads = [0 if it.header is None else len(it.header) for it in items]
        for i, (it, lead) in enumerate(zip(items, leads)):
            if lead and (lead > it.offset or lead % PAGE):
                results[i] = ValueError(f"a header of {lead} bytes before payload offset {it.offset} cannot join "
                                        "the payload's I/O (it must be whole pages inside the file)")
        spans = [lead + align_up(n, PAGE) for lead, n in zip(leads, sizes)]  # each item's bytes on disk
        pitch, chunks = plan_chunks(spans, self._stage_bytes)
        if not chunks:
            return results
        stage = self._stage(pitch * len(chunks[0]))
        for c, indices in enumerate(chunks):
            chunk = [i for i in indices if results[i] is None]
            if not chunk:
                continue
            pairs = [(stage.addr + k * pitch + leads[i], items[i].view) for k, i in enumerate(chunk)]
            try:
                expired_check(in_time, reading=not write)  # stopped: the chunk's pages are not touched
                if write:
                    self._to_host(pairs, pitch)
                    # No view is read again.  Called only where writes from the stage are still to come:
                    # where this copy does not run (stopped, failed), the caller's own end is the moment.
                    if c == len(chunks) - 1 and views_read is not None:
                        views_read()
            except Exception as exc:  # noqa: BLE001 - every item of the chunk fails with it
                for i in chunk:
                    results[i] = exc
                continue
            runs = plan_runs([(items[i].fd, items[i].offset - leads[i], spans[i]) for i in chunk], pitch,
                             self._max_io_bytes)
            jobs = [_Job([items[i] for i in chunk[lo:hi]], [leads[i] for i in chunk[lo:hi]],
                         [sizes[i] for i in chunk[lo:hi]],
                         stage.view[lo * pitch:(hi - 1) * pitch + spans[chunk[hi - 1]]], pitch, in_time)
                    for lo, hi in runs]
            if write:
                run_errors = run_all(self._writes, self._write_one, jobs, in_time)
            else:
                run_errors = run_all(self._reads, self._read_one, jobs, in_time, reading=True)
            for job in jobs:  # a job cancelled before it ran still holds its view of the stage
                job.buf.release()
            errors = [err for (lo, hi), err in zip(runs, run_errors) for _ in range(hi - lo)]
            for i, err in zip(chunk, errors):
                results[i] = err
            if not write:
                ok = [pair for pair, err in zip(pairs, errors) if err is None]
                try:
                    self._from_host(ok, pitch)
                except Exception as exc:  # noqa: BLE001 - the items it should have filled fail
                    for i, err in zip(chunk, errors):
                        if err is None:
                            results[i] = exc
        return results

    def _stage(self, need: int) -> _Stage:
        stage: _Stage | None = getattr(self._local, "stage", None)
        if stage is not None and stage.nbytes >= need:
            return stage
        fresh = _Stage(max(need, self._stage_bytes), self._register)
        with self._lock:
            if stage is not None:
                self._stages.remove(stage)
                stage.release(self._unregister)
            self._stages.append(fresh)
        self._local.stage = fresh
        return fresh

    def _direct_fd(self, fd: int, flags: int) -> int:
        """A second descriptor of the same file with O_DIRECT, or -1 where it is refused."""
        try:
            return self.ops.open(f"/proc/self/fd/{fd}", flags | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in _NO_DIRECT:
                raise
            self.direct_refused += 1
            return -1

    def _write_one(self, job: _Job) -> BaseException | None:
        buf = job.buf
        try:
            expired_check(job.in_time)
            for k, (item, lead, nbytes) in enumerate(zip(job.items, job.leads, job.sizes)):
                at, end = k * job.pitch, min(len(buf), (k + 1) * job.pitch)
                if lead:
                    buf[at:at + lead] = item.header
                if end > at + lead + nbytes:
                    buf[at + lead + nbytes:end] = bytes(end - at - lead - nbytes)  # the zero padding readers expect
            fd = job.items[0].fd
            dfd = self._direct_fd(fd, os.O_WRONLY)
            try:
                write_all(self.ops, fd if dfd < 0 else dfd, buf, job.start)
            finally:
                if dfd >= 0:
                    self.ops.close(dfd)
            return None
        except BaseException as exc:  # noqa: BLE001 - reported per item to the caller
            return _unpinned(exc)
        finally:
            buf.release()

    def _read_one(self, job: _Job) -> BaseException | None:
        """Reads whole pages (O_DIRECT needs them); the file may end inside the last one, after
        the payload, but a file ending before the last payload's end is short (EOFError, as
        store.blocks expects).  A short count is not the end: the rest is read on, through the plain
        descriptor once the position is no longer page-aligned (O_DIRECT would refuse it), so
        only a read of nothing ends the file early."""
        buf = job.buf
        try:
            expired_check(job.in_time, reading=True)
            fd = job.items[0].fd
            dfd = self._direct_fd(fd, os.O_RDONLY)
            start = job.start
            need = (len(job.items) - 1) * job.pitch + job.leads[-1] + job.sizes[-1]
            try:
                done, rfd = 0, fd if dfd < 0 else dfd
                while done < need:
                    n = self.ops.preadv(rfd, buf[done:], start + done)
                    if n <= 0:
                        raise EOFError(f"file ended after {start + done} bytes, {need - done} short of the "
                                       "payload's end")
                    done += n
                    if done % PAGE:
                        rfd = fd
            finally:
                if dfd >= 0:
                    self.ops.close(dfd)
            for k, (item, lead) in enumerate(zip(job.items, job.leads)):
                if lead:
                    item.header[:] = buf[k * job.pitch:k * job.pitch + lead]
            return None
        except BaseException as exc:  # noqa: BLE001 - reported per item to the caller
            return _unpinned(exc)
        finally:
            buf.release()

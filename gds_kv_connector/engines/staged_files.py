"""Block files moved through a registered host staging area with O_DIRECT, where GDS is absent.

Without nvidia-fs, KvikIO's POSIX path moves each block on its own: a new ``CuFile`` per file,
a bounce-buffer copy per 4 MiB task, payload reads through the page cache.  This path does what
the raw-disk ceiling does instead: the batch's payloads are copied device -> host in one
coalesced DMA (55 GB/s on the H200 host) into page-aligned staging slots, then every file is
written with one O_DIRECT ``pwrite`` on an I/O thread: its header page (``TransferItem.header``),
payload and zero padding together, so a block costs the disk one write and, loading, one read.
Loads run the same in reverse.  The file layout is unchanged (payload at ``HEADER_SIZE``, zero
padding to a page), so files written either way are read either way.  A filesystem that refuses O_DIRECT (tmpfs on
older kernels) gets the same writes through the plain descriptor.

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
from typing import Callable

import torch

from ..fileops import FileOps, write_all
from ..pool_format import PAGE, align_up
from .base import TransferItem

DEFAULT_STAGE_BYTES = 64 << 20
# O_DIRECT is refused at open by filesystems without it; the plain descriptor is used then.
_NO_DIRECT = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}

CopyFn = Callable[[list[tuple[int, torch.Tensor]], int], None]
RegisterFn = Callable[[int, int, bool], None]
UnregisterFn = Callable[[int], None]


def plan_chunks(sizes: list[int], stage_bytes: int) -> tuple[int, list[range]]:
    """Slot pitch (the largest payload, page-aligned) and the item ranges that fit the stage
    together; a stage smaller than one slot still takes one item at a time (it is grown)."""
    if not sizes:
        return PAGE, []
    pitch = align_up(max(max(sizes), 1), PAGE)
    per = max(1, stage_bytes // pitch)
    n = len(sizes)
    return pitch, [range(lo, min(n, lo + per)) for lo in range(0, n, per)]


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
                 ops: FileOps | None = None) -> None:
        if stage_bytes < PAGE:
            raise ValueError(f"stage_bytes must be at least {PAGE}, got {stage_bytes}")
        self._to_host, self._from_host = copy_to_host, copy_from_host
        self._register, self._unregister = register, unregister
        self._stage_bytes = align_up(stage_bytes, PAGE)
        self.ops = ops or FileOps()
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="gdskv-staged")
        self._local = threading.local()
        self._stages: list[_Stage] = []
        self._lock = threading.Lock()
        self.direct_refused = 0  # files moved through the plain descriptor because O_DIRECT was refused

    def write(self, items: list[TransferItem]) -> list[BaseException | None]:
        return self._run(items, write=True)

    def read(self, items: list[TransferItem]) -> list[BaseException | None]:
        return self._run(items, write=False)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            stages, self._stages = self._stages, []
        for stage in stages:
            stage.release(self._unregister)

    # -- internals --------------------------------------------------------------------------------
    def _run(self, items: list[TransferItem], write: bool) -> list[BaseException | None]:
        results: list[BaseException | None] = [None] * len(items)
        sizes = [it.view.numel() * it.view.element_size() for it in items]
        # Items with a header move it in the same I/O: the slot then starts at file offset 0.
        leads = [0 if it.header is None else it.offset for it in items]
        for i, (it, lead) in enumerate(zip(items, leads)):
            if lead and (len(it.header) != lead or lead % PAGE):
                results[i] = ValueError(f"a header of {len(it.header)} bytes at payload offset {it.offset} "
                                        "cannot join the payload's I/O (it must fill whole pages before it)")
        pitch, chunks = plan_chunks([lead + align_up(n, PAGE) for lead, n in zip(leads, sizes)], self._stage_bytes)
        if not chunks:
            return results
        stage = self._stage(pitch * len(chunks[0]))
        for chunk in chunks:
            chunk = [i for i in chunk if results[i] is None]
            if not chunk:
                continue
            pairs = [(stage.addr + k * pitch + leads[i], items[i].view) for k, i in enumerate(chunk)]
            if write:
                try:
                    self._to_host(pairs, pitch)
                except Exception as exc:  # noqa: BLE001 - every item of the chunk fails with it
                    for i in chunk:
                        results[i] = exc
                    continue
            jobs = [(items[i], stage.view[k * pitch:k * pitch + leads[i] + align_up(sizes[i], PAGE)], leads[i], sizes[i])
                    for k, i in enumerate(chunk)]
            fn = self._write_one if write else self._read_one
            errors = list(self._pool.map(fn, jobs)) if len(jobs) > 1 else [fn(jobs[0])]
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

    def _write_one(self, job: tuple[TransferItem, memoryview, int, int]) -> BaseException | None:
        item, buf, lead, nbytes = job
        try:
            if lead:
                buf[:lead] = item.header
            if len(buf) > lead + nbytes:
                buf[lead + nbytes:] = bytes(len(buf) - lead - nbytes)  # the zero padding readers expect
            dfd = self._direct_fd(item.fd, os.O_WRONLY)
            try:
                write_all(self.ops, item.fd if dfd < 0 else dfd, buf, item.offset - lead)
            finally:
                if dfd >= 0:
                    self.ops.close(dfd)
            return None
        except BaseException as exc:  # noqa: BLE001 - reported per item to the caller
            return exc
        finally:
            buf.release()  # an error's traceback keeps this frame: it must not pin the stage's mapping

    def _read_one(self, job: tuple[TransferItem, memoryview, int, int]) -> BaseException | None:
        """Reads whole pages (O_DIRECT needs them); the file may end inside the last one, after
        the payload, but a file ending before the payload is short (EOFError, as block_io expects)."""
        item, buf, lead, nbytes = job
        try:
            dfd = self._direct_fd(item.fd, os.O_RDONLY)
            fd = item.fd if dfd < 0 else dfd
            start, need = item.offset - lead, lead + nbytes
            try:
                done = 0
                while done < need:
                    n = self.ops.preadv(fd, buf[done:], start + done)
                    if n <= 0 or (done + n < need and n % PAGE):
                        raise EOFError(f"file ended after {start + done + max(n, 0)} bytes, "
                                       f"{need - done - max(n, 0)} short of the payload's end")
                    done += n
            finally:
                if dfd >= 0:
                    self.ops.close(dfd)
            if lead:
                item.header[:] = buf[:lead]
            return None
        except BaseException as exc:  # noqa: BLE001 - reported per item to the caller
            return exc
        finally:
            buf.release()  # an error's traceback keeps this frame: it must not pin the stage's mapping

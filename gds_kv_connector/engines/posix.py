"""POSIX engine: pread/pwrite on a thread pool into a host-memory KV pool.

This is the engine of every CPU test and of host-memory pools; it moves bytes with plain
system calls through :class:`~gds_kv_connector.engines.fileops.FileOps` (so faults can be injected),
with the GIL released inside each call so ``io_threads`` transfers proceed in parallel.
Reads, writes and a save's checksums have a pool of ``io_threads`` each: a save batch hands every
block to its pool at once, and a load (or another save's checksums, which a fence may be waiting
to stop) behind it in one FIFO queue would wait for all of them (on slow storage, past its deadline).
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from gds_kv_connector.format.checksum import checksum_bytes
from gds_kv_connector.engines.fileops import FileOps, read_exact, write_all
from gds_kv_connector.engines.base import InTime, IoEngine, TransferItem, ViewsRead, expired_check, header_io, run_all


class PosixEngine(IoEngine):
    name = "posix"

    def __init__(self, io_threads: int = 16, ops: FileOps | None = None) -> None:
        self.ops = ops or FileOps()
        self._writes = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="gdskv-posix-w")
        self._reads = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="gdskv-posix-r")
        self._sums = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="gdskv-posix-c")

    def write(self, items: list[TransferItem], in_time: InTime | None = None,
              views_read: ViewsRead | None = None) -> list[BaseException | None]:
        # the writes read the views themselves, to the end: views_read is left to the caller
        return _each(self._writes, self._write_one, items, in_time, reading=False)

    def read(self, items: list[TransferItem], in_time: InTime | None = None) -> list[BaseException | None]:
        return _each(self._reads, self._read_one, items, in_time, reading=True)

    def _write_one(self, it: TransferItem) -> None:
        data = _host_bytes(it.view)
        header_io(it, True, self.ops.pwrite, self.ops.preadv)
        write_all(self.ops, it.fd, data, it.offset)

    def _read_one(self, it: TransferItem) -> None:
        data = _host_bytes(it.view)
        header_io(it, False, self.ops.pwrite, self.ops.preadv)
        read_exact(self.ops, it.fd, data, it.offset)

    def checksums(self, views: list[torch.Tensor], load: bool = False) -> list[int]:
        if len(views) <= 1:
            return [checksum_bytes(_host_bytes(v)) for v in views]
        return list((self._reads if load else self._sums).map(lambda v: checksum_bytes(_host_bytes(v)), views))

    def copy_to_host(self, pairs: list[tuple[int, torch.Tensor]], pitch: int) -> None:
        for addr, view in pairs:
            ctypes.memmove(addr, _host_bytes(view).ctypes.data, view.nbytes)

    def copy_from_host(self, pairs: list[tuple[int, torch.Tensor]], pitch: int) -> None:
        for addr, view in pairs:
            ctypes.memmove(_host_bytes(view).ctypes.data, addr, view.nbytes)

    def data_path(self) -> str:
        return "posix (host-memory pool, pread/pwrite)"

    def close(self) -> None:
        for pool in (self._writes, self._reads, self._sums):
            pool.shutdown(wait=True)


def _host_bytes(view: torch.Tensor):
    if view.device.type != "cpu":
        raise ValueError("the POSIX engine moves host-memory blocks only; use the kvikio engine for CUDA")
    return view.numpy()


def _each(pool: ThreadPoolExecutor, one: Callable[[TransferItem], None], items: list[TransferItem],
          in_time: InTime | None, reading: bool) -> list[BaseException | None]:
    """``one`` for every item on ``pool``, each started only while ``in_time`` says yes; errors per item."""
    def step(it: TransferItem) -> None:
        expired_check(in_time, reading)
        one(it)
    return run_all(pool, lambda it: _capture(step, it), items, in_time, reading)


def _capture(fn, item) -> BaseException | None:
    try:
        fn(item)
        return None
    except BaseException as exc:  # noqa: BLE001 - reported per item to the caller
        return exc

"""Reads never queue behind writes inside an engine: with every write thread stuck on slow storage
and more writes queued, a load's reads (and its checksums) still run.  Before, both engines had one
FIFO pool: a save batch handed over all its blocks at once, and a load behind them waited for every
one (on slow storage, past its deadline, which is fatal)."""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
pytest.register_assert_rewrite("fault_helpers")
import fault_helpers as fh  # noqa: E402

from gds_kv_connector.checksum import checksum_bytes  # noqa: E402
from gds_kv_connector.engines.base import TransferItem, WriteExpired  # noqa: E402
from gds_kv_connector.engines.posix import PosixEngine  # noqa: E402
from gds_kv_connector.engines.staged_files import StagedFileIo  # noqa: E402
from gds_kv_connector.faults import FaultyFileOps  # noqa: E402
from gds_kv_connector.pool_format import PAGE  # noqa: E402

from test_staged_files import _from_host, _to_host  # noqa: E402  (memmove in place of the DMA)

pytest_plugins = ["fault_helpers"]

THREADS = 2
PAYLOAD = 2 * PAGE


def _files(directory, name: str, n: int, fill: int) -> list[str]:
    paths = []
    for i in range(n):
        p = os.path.join(directory, f"{name}{i}")
        with open(p, "wb") as f:
            f.write(bytes([fill + i]) * (PAGE + PAYLOAD))
        paths.append(p)
    return paths


def _wait_for(cond, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def _open(paths, flags):
    return [os.open(p, flags) for p in paths]


def _writes_stuck(engine_write, paths, ops: FaultyFileOps) -> threading.Thread:
    """A save batch of ``len(paths)`` files whose writes all stall: every write thread holds one,
    the rest wait in the write queue."""
    fds = _open(paths, os.O_WRONLY)
    views = [torch.full((PAYLOAD,), 7, dtype=torch.uint8) for _ in paths]
    t = threading.Thread(target=engine_write, args=([TransferItem(fd, PAGE, v) for fd, v in zip(fds, views)],),
                         daemon=True)
    t.start()
    _wait_for(lambda: ops.stalls_active == THREADS, what="every write thread stalled")
    t.fds = fds  # closed by the caller once released
    return t


def _read_beside(engine_read, paths) -> tuple[list, list[torch.Tensor]]:
    fds = _open(paths, os.O_RDONLY)
    views = [torch.zeros(PAYLOAD, dtype=torch.uint8) for _ in paths]
    out: list = []
    t = threading.Thread(target=lambda: out.extend(engine_read([TransferItem(fd, PAGE, v)
                                                                 for fd, v in zip(fds, views)])), daemon=True)
    t.start()
    t.join(10.0)  # with one FIFO pool it waited for the stalled writes: 60 s, then the test fails
    for fd in fds:
        os.close(fd)
    return out, views


@fh.timeout(60)
def test_posix_reads_and_load_checksums_run_while_every_write_thread_is_stuck(tmp_path):
    ops = FaultyFileOps()
    ops.add("pwrite", "stall", stall_s=60.0)
    engine = PosixEngine(io_threads=THREADS, ops=ops)
    writer = _writes_stuck(engine.write, _files(tmp_path, "save", 2 * THREADS + 2, 1), ops)
    try:
        errors, views = _read_beside(engine.read, _files(tmp_path, "load", 3, 100))
        assert errors == [None, None, None]
        assert [v.numpy().tobytes() for v in views] == [bytes([100 + i]) * PAYLOAD for i in range(3)]
        sums: list[int] = []
        t = threading.Thread(target=lambda: sums.extend(engine.checksums(views, load=True)), daemon=True)
        t.start()
        t.join(10.0)
        assert sums == [checksum_bytes(v.numpy()) for v in views]
        assert ops.stalls_active == THREADS  # the writes were held all along
    finally:
        ops.release()
        writer.join(30)
        for fd in writer.fds:
            os.close(fd)
        engine.close()


@fh.timeout(60)
def test_staged_reads_run_while_every_write_thread_is_stuck(tmp_path):
    ops = FaultyFileOps()
    ops.add("pwrite", "stall", stall_s=60.0)
    io = StagedFileIo(_to_host, _from_host, lambda *a: None, lambda *a: None, io_threads=THREADS, ops=ops)
    writer = _writes_stuck(io.write, _files(tmp_path, "save", 2 * THREADS + 2, 1), ops)
    try:
        errors, views = _read_beside(io.read, _files(tmp_path, "load", 3, 100))
        assert errors == [None, None, None]
        assert [v.numpy().tobytes() for v in views] == [bytes([100 + i]) * PAYLOAD for i in range(3)]
        assert ops.stalls_active == THREADS
    finally:
        ops.release()
        writer.join(30)
        for fd in writer.fds:
            os.close(fd)
        io.close()


def test_staged_writes_stop_between_chunks_and_jobs_once_out_of_time(tmp_path):
    """One slot a chunk: the first item's chunk and write start in time, then the deadline passes:
    the other items are neither copied (their pages are not read) nor written."""
    copied: list[int] = []

    def copy_in(pairs, pitch):
        copied.extend(v.data_ptr() for _, v in pairs)
        _to_host(pairs, pitch)
    io = StagedFileIo(copy_in, _from_host, lambda *a: None, lambda *a: None, io_threads=THREADS,
                      stage_bytes=PAGE + PAYLOAD)
    paths = _files(tmp_path, "save", 4, 1)
    fds = _open(paths, os.O_WRONLY)
    views = [torch.full((PAYLOAD,), 50 + i, dtype=torch.uint8) for i in range(4)]
    calls = itertools.count()
    try:
        errors = io.write([TransferItem(fd, PAGE, v) for fd, v in zip(fds, views)], lambda: next(calls) < 2)
    finally:
        for fd in fds:
            os.close(fd)
        io.close()
    assert errors[0] is None and all(isinstance(e, WriteExpired) for e in errors[1:])
    assert copied == [views[0].data_ptr()]
    contents = [open(p, "rb").read()[PAGE:] for p in paths]
    assert contents == [bytes([50]) * PAYLOAD] + [bytes([2 + i]) * PAYLOAD for i in range(3)]


def test_posix_writes_not_started_in_time_are_not_written(tmp_path):
    engine = PosixEngine(io_threads=1)
    paths = _files(tmp_path, "save", 3, 1)
    fds = _open(paths, os.O_WRONLY)
    calls = itertools.count()
    try:
        errors = engine.write([TransferItem(fd, PAGE, torch.full((PAYLOAD,), 90, dtype=torch.uint8)) for fd in fds],
                              lambda: next(calls) < 1)
    finally:
        for fd in fds:
            os.close(fd)
        engine.close()
    assert errors[0] is None and all(isinstance(e, WriteExpired) for e in errors[1:])
    assert [open(p, "rb").read()[PAGE:PAGE + 1] for p in paths] == [bytes([90]), bytes([2]), bytes([3])]

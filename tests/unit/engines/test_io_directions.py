"""Reads never queue behind writes inside an engine: with every write thread stuck on slow storage
and more writes queued, a load's reads (and its checksums) still run.  Before, both engines had one
FIFO pool: a save batch handed over all its blocks at once, and a load behind them waited for every
one (on slow storage, past its deadline, which is fatal)."""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.register_assert_rewrite("tests.support.fault_helpers")
from tests.support import fault_helpers as fh  # noqa: E402

from gds_kv_connector.format.checksum import checksum_bytes  # noqa: E402
from gds_kv_connector.engines.base import ReadStopped, TransferItem, WriteExpired  # noqa: E402
from gds_kv_connector.engines.kvikio_engine import run_windowed  # noqa: E402
from gds_kv_connector.engines.posix import PosixEngine  # noqa: E402
from gds_kv_connector.engines.staged_files import StagedFileIo  # noqa: E402
from tests.support.faults import FaultyFileOps  # noqa: E402
from gds_kv_connector.format.records import PAGE  # noqa: E402

from tests.unit.engines.test_staged_files import _from_host, _to_host  # noqa: E402  (memmove in place of the DMA)

pytest_plugins = ["tests.support.fault_helpers"]

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
    engine = PosixEngine(io_threads=1)  # one write at a time: the deadline passes after the first
    paths = _files(tmp_path, "save", 3, 1)
    fds = _open(paths, os.O_WRONLY)
    written = fh.count_writes(engine)
    try:
        errors = engine.write([TransferItem(fd, PAGE, torch.full((PAYLOAD,), 90, dtype=torch.uint8)) for fd in fds],
                              lambda: written[0] < 1)
    finally:
        for fd in fds:
            os.close(fd)
        engine.close()
    assert errors[0] is None and all(isinstance(e, WriteExpired) for e in errors[1:])
    assert [open(p, "rb").read()[PAGE:PAGE + 1] for p in paths] == [bytes([90]), bytes([2]), bytes([3])]


# -- KvikIO's own thread pool (real GDS, or TLLM_GDS_KV_COMPAT_IO=kvikio): one FIFO for every caller -------
class _FifoPool:
    """Stands in for KvikIO's thread pool: ``workers`` threads, one FIFO queue, futures with get()."""

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers)
        self.order: list[str] = []  # the tasks in the order they started
        self._lock = threading.Lock()

    def submit(self, name: str, fn) -> "_Got":
        def task():
            with self._lock:
                self.order.append(name)
            return fn()
        return _Got(self._pool.submit(task))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _Got:
    def __init__(self, future) -> None:
        self._future = future

    def get(self):
        return self._future.result()


def _items(n: int) -> list[TransferItem]:
    return [TransferItem(-1, PAGE, torch.zeros(PAYLOAD, dtype=torch.uint8)) for _ in range(n)]


@fh.timeout(60)
def test_kvikio_reads_wait_for_at_most_a_window_of_writes():
    """A write batch of 20 items with a window of 4 in a 2-thread FIFO pool: a read started while the
    writes are held runs after the 4 handed over, not after all 20."""
    pool, go = _FifoPool(2), threading.Event()
    writes = _items(20)
    names = {id(it): f"w{k}" for k, it in enumerate(writes)}
    out: list = []
    got_read: list = []
    handed: list[str] = []

    def start_write(it):
        handed.append(names[id(it)])
        return pool.submit(names[id(it)], lambda: go.wait(10) and PAYLOAD)
    writer = threading.Thread(target=lambda: out.extend(run_windowed(writes, start_write, 4, True)), daemon=True)
    writer.start()
    _wait_for(lambda: len(pool.order) == 2 and len(handed) == 4, "two writes running, two queued")
    time.sleep(0.05)
    assert len(handed) == 4  # the writer waits for w0 before it hands over w4
    submitted = threading.Event()

    def start_read(it):
        got = pool.submit("read", lambda: PAYLOAD)
        submitted.set()
        return got
    reader = threading.Thread(target=lambda: got_read.extend(run_windowed(_items(1), start_read, 4, False)),
                              daemon=True)
    reader.start()
    assert submitted.wait(10)  # queued behind what the writer handed over so far
    go.set()
    writer.join(10)
    reader.join(10)
    pool.close()
    assert pool.order.index("read") == 4  # after w0-w3; with the whole batch handed over it was 20th
    assert out == [None] * 20 and got_read == [None]


def test_kvikio_window_bounds_the_futures_in_flight_and_settles_each_item():
    in_flight, most = [0], [0]
    lock = threading.Lock()

    class Counted:
        def __init__(self, nbytes):
            self.nbytes = nbytes
            with lock:
                in_flight[0] += 1
                most[0] = max(most[0], in_flight[0])

        def get(self):
            with lock:
                in_flight[0] -= 1
            if self.nbytes is None:
                raise RuntimeError("Input/output error")  # as KvikIO raises it
            return self.nbytes
    items = _items(10)
    sizes = [PAYLOAD] * 10
    sizes[3], sizes[6] = None, PAYLOAD // 2

    index = {id(it): k for k, it in enumerate(items)}

    def start(it):
        k = index[id(it)]
        if k == 8:
            raise ValueError("bad view")
        return Counted(sizes[k])
    errors = run_windowed(items, start, 3, True)
    assert most[0] == 3 and in_flight[0] == 0
    assert [type(e).__name__ if e else None for e in errors] == \
        [None, None, None, "OSError", None, None, "OSError", None, "ValueError", None]
    assert errors[3].errno == errno.EIO and "short write" in str(errors[6])


@pytest.mark.parametrize("write,stopped", [(True, WriteExpired), (False, ReadStopped)])
def test_kvikio_transfers_not_started_by_the_stop_are_not_started(write, stopped):
    """A save past its deadline, or a load whose request will not use it: no further I/O starts."""
    started: list[int] = []
    items = _items(6)

    class Done:
        def get(self):
            return PAYLOAD
    index = {id(it): k for k, it in enumerate(items)}
    calls = itertools.count()
    errors = run_windowed(items, lambda it: started.append(index[id(it)]) or Done(), 2, write,
                          lambda: next(calls) < 3)
    assert started == [0, 1, 2]
    assert errors[:3] == [None] * 3 and all(isinstance(e, stopped) for e in errors[3:])


# -- reads stop too: a load whose request will not use it (cancel_load of a handed-over offer, a reset) --
def test_staged_reads_not_started_when_stopped_are_not_read(tmp_path):
    """One slot a chunk: the first chunk is read and copied to its view, then the load is stopped:
    the other items are neither read nor copied, their views keep what they held."""
    io = StagedFileIo(_to_host, _from_host, lambda *a: None, lambda *a: None, io_threads=THREADS,
                      stage_bytes=PAGE + PAYLOAD)
    paths = _files(tmp_path, "load", 4, 1)
    fds = _open(paths, os.O_RDONLY)
    views = [torch.full((PAYLOAD,), 200, dtype=torch.uint8) for _ in range(4)]
    calls = itertools.count()
    try:
        errors = io.read([TransferItem(fd, PAGE, v) for fd, v in zip(fds, views)], lambda: next(calls) < 2)
    finally:
        for fd in fds:
            os.close(fd)
        io.close()
    assert errors[0] is None and all(isinstance(e, ReadStopped) for e in errors[1:])
    assert [bytes(v[:1].numpy()) for v in views] == [bytes([1]), bytes([200]), bytes([200]), bytes([200])]


def test_posix_reads_not_started_when_stopped_are_not_read(tmp_path):
    engine = PosixEngine(io_threads=1)  # one read at a time: the stop comes after the first
    paths = _files(tmp_path, "load", 3, 1)
    fds = _open(paths, os.O_RDONLY)
    read = [0]
    real = engine._read_one

    def counted(it):
        real(it)
        read[0] += 1
    engine._read_one = counted
    views = [torch.full((PAYLOAD,), 200, dtype=torch.uint8) for _ in range(3)]
    try:
        errors = engine.read([TransferItem(fd, PAGE, v) for fd, v in zip(fds, views)], lambda: read[0] < 1)
    finally:
        for fd in fds:
            os.close(fd)
        engine.close()
    assert errors[0] is None and all(isinstance(e, ReadStopped) for e in errors[1:])
    assert [bytes(v[:1].numpy()) for v in views] == [bytes([1]), bytes([200]), bytes([200])]


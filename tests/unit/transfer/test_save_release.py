"""A finished request's pages go back once its save has staged them, not once the storage has them.

Where the engine copies a save's payloads to a host stage before writing them (the staged O_DIRECT
path, which runs where GDS does not), no page is read after that copy.  TensorRT-LLM frees a
finished request's pages only once ``get_finished`` reports it, so reporting it after the write
held them for the storage's time (tens of milliseconds a batch on a disk, more behind a backlog).
Now it is reported once the copy is done: what the pages hold later never reaches the files, a
reset does not wait for the write, and a write slower than the deadline fails nothing.  An engine
that reads the pages while it writes (the POSIX engine here, KvikIO's own path) still holds them
to the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import types

import pytest
import torch

pytest.register_assert_rewrite("tests.support.fault_helpers", "gated_ops")
from tests.support import fault_helpers as fh  # noqa: E402
from tests.support import gated_ops as go  # noqa: E402
from gds_kv_connector.engines import host_dma  # noqa: E402
from gds_kv_connector.engines.base import TransferItem  # noqa: E402
from gds_kv_connector.engines.staged_files import StagedFileIo  # noqa: E402
from gds_kv_connector.transfer.manager import ConnectorFailure  # noqa: E402

pytest_plugins = ["tests.support.fault_helpers"]


def _held_save(r: go.GatedRig, rid: int, tag: str, n: int = 2) -> tuple[list[bytes], go.Gate]:
    """A save of ``n`` blocks whose first write is held (its copy to the stage, if any, is done)."""
    op = r.save_op(rid, tag, n, 0)
    gate = r.ops.hold(op.keys[0])
    r.tm.submit_saves([op], None)
    assert gate.started.wait(go.WAIT_S)
    return list(op.keys), gate


def _reported_only_once_released(r: go.GatedRig, gate: go.Gate) -> None:
    """Request 1, finished, is not reported while its held write waits, and is once it is let go."""
    r.poll(finished=[1])
    time.sleep(0.05)
    r.poll()
    assert r.reported == []
    gate.release()
    r.poll_until(want_saved=[1])


def _settled(r: go.GatedRig) -> None:
    go.wait_until(lambda: r.poll() is not None and not r.tm._inflight, "the save batch to settle")


def test_a_staged_save_reports_its_request_while_its_write_runs(tmp_path):
    r = go.GatedRig(str(tmp_path / "pool"), staged=True)
    try:
        keys, gate = _held_save(r, 1, "early")
        r.poll(finished=[1])
        assert r.reported == [("saved", 1)]  # its write is still held
        for b in range(2):  # TensorRT-LLM gives the pages to another request, which writes its KV
            r.kv.block_view(b).numpy()[:] = 0xEE
        gate.release()
        _settled(r)
        assert sorted(fh.verify_file(r.pool.path_for(k)) for k in keys) == sorted(keys)  # the staged bytes
        assert r.stats.snapshot()["blocks_saved"] == 2 and r.reported == [("saved", 1)]
    finally:
        r.close()


def test_an_engine_that_reads_pages_while_it_writes_holds_them_to_the_end(tmp_path):
    r = go.GatedRig(str(tmp_path / "pool"))  # the POSIX engine writes straight from the views
    try:
        _, gate = _held_save(r, 1, "late")
        _reported_only_once_released(r, gate)
    finally:
        r.close()


def test_a_reset_does_not_wait_for_a_save_writing_from_its_stage(tmp_path):
    r = go.GatedRig(str(tmp_path / "pool"), staged=True)
    try:
        _, gate = _held_save(r, 1, "reset")
        t0 = time.monotonic()
        r.tm.fence([1])  # before, it waited for the held write (up to the deadline)
        assert time.monotonic() - t0 < 2.0
        assert not r.stats.snapshot().get("fenced_batches_waited")
        gate.release()
        _settled(r)
        assert r.stats.snapshot()["blocks_saved"] == 2
    finally:
        r.close()


def test_a_staged_write_slower_than_the_deadline_fails_nothing(tmp_path, caplog):
    """Its pages are free, so its request is reported; the write ends when the storage lets it, and
    a warning names the file while it holds a transfer thread."""
    r = go.GatedRig(str(tmp_path / "pool"), staged=True, TLLM_GDS_KV_DEADLINE_S="0.2",
                    TLLM_GDS_KV_CONTROL_GRACE_S="0.1")
    try:
        _, gate = _held_save(r, 1, "slow")
        time.sleep(0.5)  # past its deadline and the grace after it, the write still held
        with caplog.at_level(logging.WARNING, logger="gds_kv_connector.transfer.manager"):
            r.poll(finished=[1])  # before, a ConnectorFailure: "save of request 1 exceeded its 0.2s deadline"
        assert r.reported == [("saved", 1)]
        assert "has not returned" in caplog.text
        gate.release()
        _settled(r)
    finally:
        r.close()


def test_a_batch_larger_than_the_stage_frees_its_pages_after_its_last_copy(tmp_path):
    """Two chunks (the stage holds one block): the first chunk's writes run before the second copy,
    so the request is reported only after that copy, never while a page is still to be read."""
    r = go.GatedRig(str(tmp_path / "pool"), staged=True)
    r.engine.staged._stage_bytes = r.pool.file_size  # one block a chunk
    try:
        keys, gate = _held_save(r, 1, "chunks")  # the first chunk's write held: the second copy not made
        _reported_only_once_released(r, gate)
        _settled(r)
        assert sorted(fh.verify_file(r.pool.path_for(k)) for k in keys) == sorted(keys)
    finally:
        r.close()


@pytest.mark.parametrize("block", [32 << 10, 256 << 10, 2 << 20, 2359296, 4 << 20, 10 << 20])
def test_the_default_stage_holds_a_merged_batch_in_one_chunk(block):
    """A merged save batch (at most MERGE_BYTES of payload) is copied to the stage in one go, so its
    pages are free after that one copy rather than after the writes of every chunk but the last."""
    from gds_kv_connector.engines.staged_files import DEFAULT_STAGE_BYTES, plan_chunks
    from gds_kv_connector.format.records import HEADER_SIZE, align_up
    from gds_kv_connector.transfer.manager import MERGE_BYTES

    n = max(1, MERGE_BYTES // block)
    _, chunks = plan_chunks([HEADER_SIZE + align_up(block, 4096)] * n, DEFAULT_STAGE_BYTES)
    assert len(chunks) == 1


def test_a_save_writing_its_pages_itself_is_reported_only_once_published(tmp_path):
    """The POSIX engine reads the pages to its writes' end: the report comes with the batch's end,
    after its files are linked, as before (a request reported saved is in the pool)."""
    r = go.GatedRig(str(tmp_path / "pool"))
    held = threading.Event()
    publish = r.pool.publish

    def slow_publish(*a, **k):
        assert held.wait(go.WAIT_S)
        return publish(*a, **k)
    r.pool.publish = slow_publish
    try:
        op = r.save_op(1, "pub", 2, 0)
        r.tm.submit_saves([op], None)
        r.poll(finished=[1])
        time.sleep(0.05)  # its writes are done by now, its first link held
        r.poll()
        assert r.reported == []
        held.set()
        r.poll_until(want_saved=[1])
        assert all(r.pool.contains(k) for k in op.keys)
    finally:
        held.set()
        r.close()


def test_a_fence_stops_waiting_once_the_save_it_waits_for_is_staged(tmp_path):
    """A reset catches a two-request batch before its copy (it waits for its forward's event), then
    the batch is staged and its write held past the deadline and grace: the fence returns once the
    pages are staged instead of failing the process over a write that reads no page."""
    r = go.GatedRig(str(tmp_path / "pool"), staged=True, TLLM_GDS_KV_DEADLINE_S="0.5",
                    TLLM_GDS_KV_CONTROL_GRACE_S="0.2")
    try:
        op1, op2 = r.save_op(1, "fa", 2, 0), r.save_op(2, "fb", 2, 2)
        gate = r.ops.hold(op1.keys[0])
        event = go.HeldEvent()
        r.tm.submit_saves([op1, op2], event)
        batch = r.tm._inflight[0]
        go.wait_until(lambda: batch.started, "the batch to start")
        outcome: list[str] = []

        def fence() -> None:
            try:
                r.tm.fence([1])
                outcome.append("returned")
            except ConnectorFailure as exc:
                outcome.append(str(exc))
        t = threading.Thread(target=fence)
        t.start()
        time.sleep(0.05)
        event.go.set()  # the copy runs, then the first write is held
        t.join(go.WAIT_S)
        assert outcome == ["returned"] and batch.views_done and not batch.future.done()
        gate.release()
        _settled(r)
    finally:
        r.close()


def test_a_dma_launch_that_fails_leaves_no_copy_running_when_the_pages_are_freed(tmp_path):
    """The second of several asynchronous copies fails to launch: the first is waited for before the
    staged path returns, and it never calls views_read (the caller's end frees the pages, after it)."""
    log: list[str] = []

    class Stream:
        def __init__(self, i: int) -> None:
            self.ptr = i

        def synchronize(self) -> None:
            log.append(f"sync {self.ptr}")

    class Runtime:
        memcpyDeviceToHost, memcpyHostToDevice = 2, 1
        launches = 0

        def memcpyAsync(self, *args) -> None:
            Runtime.launches += 1
            if Runtime.launches == 2:
                raise RuntimeError("cudaErrorInvalidValue")
            log.append(f"launch {args[-1]}")
        memcpy2DAsync = memcpyAsync

    dma = object.__new__(host_dma.CudaHostDma)
    dma._cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda i: contextlib.nullcontext()))
    dma._rt, dma._index, dma._local = Runtime(), 0, threading.local()
    dma._local.streams = [Stream(i) for i in range(4)]
    pages = torch.zeros(8 * 4096, dtype=torch.uint8)
    views = [pages[i * 4096:(i + 1) * 4096] for i in range(8)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host_dma, "_device_ptrs", lambda vs: [v.data_ptr() for v in vs])  # host tensors stand in
        mp.setattr(host_dma, "_SPLIT_MIN_BYTES", 1)  # the run split over the streams, as a large batch's is
        io = StagedFileIo(lambda p, pitch: dma.copy(p, pitch, to_host=True), None, lambda *a: None,
                          lambda *a: None, 2)
        fds = [os.open(str(tmp_path / f"f{i}"), os.O_RDWR | os.O_CREAT) for i in range(8)]
        try:
            errors = io.write([TransferItem(fd, 4096, v, bytes(4096)) for fd, v in zip(fds, views)], None,
                              lambda: log.append("views_read"))
        finally:
            for fd in fds:
                os.close(fd)
            io.close()
    assert all(isinstance(e, RuntimeError) for e in errors)
    assert log[0] == "launch 0" and "sync 0" in log and "views_read" not in log

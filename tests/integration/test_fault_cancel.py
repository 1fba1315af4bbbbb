"""Cancellation and shutdown with transfers queued and in flight.

TensorRT-LLM has no transfer abort: a cancelled request's pages stay allocated until the connector
reports it, so a transfer already moving bytes must finish before poll() reports the request, while
queued batches can be dropped.  shutdown() must return within the control grace even when a transfer
is stuck, and say how many it dropped and how many are stuck.  In-flight work is held with a
FaultyFileOps stall that the test releases with an event, not with sleeps.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.register_assert_rewrite("tests.support.fault_helpers")
from tests.support import fault_helpers as fh  # noqa: E402
from tests.support import gated_ops as go  # noqa: E402
from tests.integration.test_fault_storage import Rig  # noqa: E402
from gds_kv_connector.transfer.jobs import LoadOp  # noqa: E402

pytest_plugins = ["tests.support.fault_helpers"]
GRACE = 0.5


@pytest.fixture
def rig(tmp_path):
    r = Rig(str(tmp_path / "pool"), TLLM_GDS_KV_TRANSFER_THREADS="1", TLLM_GDS_KV_DEADLINE_S="20",
            TLLM_GDS_KV_CONTROL_GRACE_S=str(GRACE))
    yield r
    r.close()


def _hold_first_payload_write(r):
    """Stall the first payload pwrite (header writes go through) until r.ops.release()."""
    r.ops.add("pwrite", "stall", stall_s=30.0, count=1, skip=1)


def test_a_reset_drops_queued_saves_and_waits_for_the_one_in_flight(rig):
    """request_reset's fence without waiting (what the scheduler calls with TP 1 or ADP): the queued
    save is dropped, the one moving bytes finishes, and the request is not reported before it has."""
    r = rig
    _hold_first_payload_write(r)
    a = r.save_op(1, [fh.key_of("cancel", "a")], first_block=0)
    b = r.save_op(1, [fh.key_of("cancel", "b")], first_block=1)
    c = r.save_op(2, [fh.key_of("cancel", "c")], first_block=2)
    for op in (a, b, c):
        r.tm.submit_save(op, None)
    assert r.ops.stall_started.wait(5), "the first save never started"
    r.tm.fence([1], wait=False)  # b was queued behind the stalled a
    for _ in range(5):  # while a's bytes are still moving, request 1 must not be reported
        saved, _ = r.tm.poll([1], [])
        assert 1 not in saved
        assert r.ops.stalls_active == 1
    r.ops.release()
    r.poll_until(finished=[2], want_saved=[1, 2])
    assert r.ops.stalls_active == 0
    stats = r.stats.snapshot()
    assert stats.get("fenced_blocks_skipped") == 1 and stats.get("save_batches_cancelled") == 1
    assert r.pool.contains(a.keys[0]) and r.pool.contains(c.keys[0]) and not r.pool.contains(b.keys[0])
    assert fh.tmp_files(r.pool) == []
    fh.record("cancel", trials=1, injected=1, detected=1)


@pytest.mark.parametrize("is_async", [True, False])
def test_a_load_dropped_at_shutdown_is_a_failure_never_a_load(rig, is_async):
    """A load shutdown dropped from the queue left its pages without their KV: a poll (async) or the
    wait before the first layer (sync) after it says so with a ConnectorFailure naming the request,
    never reports it loaded and never leaks CancelledError."""
    r = rig
    keys = [fh.key_of("cancel-load", i) for i in range(4)]
    r.preload(keys)
    _hold_first_payload_write(r)
    r.tm.submit_save(r.save_op(5, [fh.key_of("blocker")], first_block=0), None)
    assert r.ops.stall_started.wait(5)  # the one transfer thread is writing
    r.ops.add("preadv", "stall", stall_s=30.0, count=1)
    r.tm.submit_load(LoadOp(7, tuple(keys[2:]), (6, 7), True), None)  # the load lane takes it, and stalls
    go.wait_until(lambda: r.ops.stalls_active == 2, "the load lane's read to stall")
    r.tm.submit_load(LoadOp(6, tuple(keys[:2]), (4, 5), is_async), None)  # queued: no thread is free
    releaser = threading.Timer(0.1, r.ops.release)  # the stalled I/O returns within the grace
    releaser.start()
    assert r.tm.shutdown() == {"dropped": 1, "stuck": 0}
    releaser.join()
    from gds_kv_connector.transfer.manager import ConnectorFailure
    if is_async:
        with pytest.raises(ConnectorFailure, match="load for request 6 failed.*cancelled"):
            r.poll_until(loading=[6], want_loaded=[6], timeout=3)
    else:
        with pytest.raises(ConnectorFailure, match="synchronous load of request 6 was cancelled"):
            r.tm.wait_sync_loads()


def test_a_parked_request_with_nothing_to_load_is_reported_at_its_first_poll(rig):
    """An async offer whose blocks all lost their pages (BAD_PAGE_INDEX, or cancel_load took them)
    arrives as an empty load: nothing to wait for, so not held until the deadline fails the process."""
    r = rig
    r.tm.submit_loads([LoadOp(8, (), (), True)], None)
    assert r.tm.poll([], [8]) == ([], [8])


def test_shutdown_with_stuck_transfer_returns_within_grace(rig):
    r = rig
    _hold_first_payload_write(r)
    ops = [r.save_op(10 + i, [fh.key_of("shutdown", i)], first_block=i) for i in range(4)]
    for op in ops:
        r.tm.submit_save(op, None)
    assert r.ops.stall_started.wait(5)
    t0 = time.monotonic()
    result = r.tm.shutdown()
    elapsed = time.monotonic() - t0
    assert result == {"dropped": 3, "stuck": 1}
    assert GRACE <= elapsed <= GRACE + 0.5, f"shutdown took {elapsed:.2f}s"
    # Let the stuck write finish: it completes normally; no temporary file remains, the pool is valid.
    r.ops.release()
    inflight = r.tm._inflight[0].future
    inflight.result(timeout=10)
    assert fh.tmp_files(r.pool) == []
    assert [fh.verify_file(p) for p in fh.block_files(r.pool)] == [ops[0].keys[0]]
    fh.record("cancel", trials=1, injected=1, detected=1)


def test_shutdown_drains_in_flight_within_grace(rig):
    r = rig
    r.ops.add("pwrite", "stall", stall_s=0.1, count=1, skip=1)
    r.tm.submit_save(r.save_op(20, [fh.key_of("drain")]), None)
    assert r.ops.stall_started.wait(5)
    t0 = time.monotonic()
    assert r.tm.shutdown() == {"dropped": 0, "stuck": 0}
    assert time.monotonic() - t0 <= GRACE + 0.5
    assert fh.tmp_files(r.pool) == [] and r.pool.contains(fh.key_of("drain"))
    from gds_kv_connector.transfer.manager import ConnectorFailure
    with pytest.raises(ConnectorFailure, match="after shutdown"):
        r.tm.submit_save(r.save_op(21, [fh.key_of("late")]), None)


def test_shutdown_counts_what_it_drops_once(rig):
    """Saves handed over by the scheduler after the last poll are counted as dropped instead of
    vanishing, and a batch a reset took out earlier is not counted again."""
    r = rig
    _hold_first_payload_write(r)
    r.tm.submit_save(r.save_op(30, [fh.key_of("once", 0)], first_block=0), None)
    assert r.ops.stall_started.wait(5)
    r.tm.submit_save(r.save_op(31, [fh.key_of("once", 1)], first_block=1), None)
    r.tm.fence([31], wait=False)
    r.tm.deliver_saves([r.save_op(32, [fh.key_of("once", 2), fh.key_of("once", 3)], first_block=2)])
    r.ops.release()
    assert r.tm.shutdown() == {"dropped": 0, "stuck": 0}
    stats = r.stats.snapshot()
    assert stats.get("fenced_blocks_skipped") == 1 and stats.get("save_blocks_dropped_at_shutdown") == 2

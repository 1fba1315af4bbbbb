"""Saves queued behind slow writes are staged ahead: their pages go back at PCIe speed.

A save batch on the staged path copies its pages to a host stage, then waits for its writes.  With
``TLLM_GDS_KV_TRANSFER_THREADS`` threads taking batches, saves queued behind that many writing
batches held their finished requests' pages until a write ended (the storage's time, a batch each).
Since ``TLLM_GDS_KV_STAGE_AHEAD``, a batch that has staged its pages stops counting against the
transfer threads, and up to that many more batches are taken and staged while the writes run; a
load is never kept waiting for them.
"""

from __future__ import annotations

import time

import pytest

pytest.register_assert_rewrite("tests.support.fault_helpers", "gated_ops")
from tests.support import fault_helpers as fh  # noqa: E402
from tests.support import gated_ops as go  # noqa: E402
from gds_kv_connector.transfer.jobs import LoadOp  # noqa: E402

pytest_plugins = ["tests.support.fault_helpers"]


def _rig(tmp_path, ahead: int) -> go.GatedRig:
    """One transfer thread, a staged engine with two write threads, ``ahead`` batches staged ahead."""
    return go.GatedRig(str(tmp_path / "pool"), staged=True, TLLM_GDS_KV_STAGE_AHEAD=str(ahead))


def _held(r: go.GatedRig, rid: int, tag: str, first_block: int) -> tuple[bytes, go.Gate]:
    """A one-block save of request ``rid`` submitted with its write held; once that write has begun
    (its pages staged), its key and gate."""
    op = r.save_op(rid, tag, 1, first_block)
    gate = r.ops.hold(op.keys[0])
    r.tm.submit_saves([op], None)
    assert gate.started.wait(go.WAIT_S)
    return op.keys[0], gate


def _not_reported_for_a_while(r: go.GatedRig, rid: int) -> None:
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        r.poll()
        assert ("saved", rid) not in r.reported, f"request {rid} was reported"
        time.sleep(0.005)


def _settled(r: go.GatedRig) -> None:
    go.wait_until(lambda: r.poll() is not None and not r.tm._inflight, "every batch to settle")


def test_a_save_queued_behind_a_writing_batch_is_staged_and_written_meanwhile(tmp_path):
    r = _rig(tmp_path, ahead=1)
    try:
        _, gate = _held(r, 1, "first", 0)
        behind = r.save_op(2, "behind", 2, 1)
        r.tm.submit_saves([behind], None)
        r.poll(finished=[1, 2])
        r.poll_until(want_saved=[1, 2])  # request 1: staged; request 2: taken beside the held write
        go.wait_until(lambda: all(r.pool.contains(k) for k in behind.keys), "the second batch's blocks")
        assert sorted(fh.verify_file(r.pool.path_for(k)) for k in behind.keys) == sorted(behind.keys)
        gate.release()
        _settled(r)
        assert r.stats.snapshot()["blocks_saved"] == 3
    finally:
        r.close()


def test_without_stage_ahead_the_queued_save_waits_for_the_write(tmp_path):
    r = _rig(tmp_path, ahead=0)
    try:
        _, gate = _held(r, 1, "first", 0)
        behind = r.save_op(2, "behind", 1, 1)
        r.tm.submit_saves([behind], None)
        r.poll(finished=[1, 2])
        _not_reported_for_a_while(r, 2)  # its pages still wait for the one transfer thread
        assert ("saved", 1) in r.reported and not r.ops.did_move(behind.keys[0])
        gate.release()
        r.poll_until(want_saved=[2])
        _settled(r)
    finally:
        r.close()


def test_a_save_queued_while_the_running_one_waits_for_its_event_is_taken_once_that_one_stages(tmp_path):
    """Queued before the running batch staged its pages, it is started by that staging (no batch
    ends to take it), not by the write's end."""
    r = _rig(tmp_path, ahead=1)
    try:
        first = r.save_op(1, "first", 1, 0)
        gate = r.ops.hold(first.keys[0])
        event = go.HeldEvent()
        r.tm.submit_saves([first], event)
        assert event.started.wait(go.WAIT_S)  # running, its pages not copied yet
        behind = r.save_op(2, "behind", 1, 1)
        r.tm.submit_saves([behind], None)
        time.sleep(0.05)
        assert not r.ops.did_move(behind.keys[0])  # one transfer thread, taken by a batch not staged
        event.go.set()
        assert gate.started.wait(go.WAIT_S)  # staged, its write held
        go.wait_until(lambda: r.pool.contains(behind.keys[0]), "the queued batch saved beside the held write")
        gate.release()
        _settled(r)
    finally:
        r.close()


def test_once_a_staged_save_ends_one_unstaged_batch_runs_at_a_time_again(tmp_path):
    r = _rig(tmp_path, ahead=1)
    try:
        r.tm.submit_saves([r.save_op(1, "first", 1, 0)], None)
        _settled(r)  # staged, then ended: its place is counted back
        event = go.HeldEvent()
        r.tm.submit_saves([r.save_op(2, "held", 1, 1)], event)
        assert event.started.wait(go.WAIT_S)  # running, not staged
        behind = r.save_op(3, "behind", 1, 2)
        r.tm.submit_saves([behind], None)
        time.sleep(0.1)
        assert not r.ops.did_move(behind.keys[0]), "a second batch not staged ran beside the first"
        event.go.set()
        _settled(r)
        assert r.pool.contains(behind.keys[0])
    finally:
        r.close()


def test_no_more_batches_than_stage_ahead_are_staged_beyond_the_threads(tmp_path):
    r = _rig(tmp_path, ahead=1)
    try:
        _, gate_a = _held(r, 1, "a", 0)
        _, gate_b = _held(r, 2, "b", 1)  # staged ahead: both write threads now held
        third = r.save_op(3, "c", 1, 2)
        r.tm.submit_saves([third], None)
        r.poll(finished=[1, 2, 3])
        r.poll_until(want_saved=[1, 2])
        _not_reported_for_a_while(r, 3)  # both transfer threads write: the third waits for one
        gate_a.release()
        r.poll_until(want_saved=[3])
        gate_b.release()
        _settled(r)
        assert r.stats.snapshot()["blocks_saved"] == 3
        assert fh.verify_file(r.pool.path_for(third.keys[0])) == third.keys[0]
    finally:
        r.close()


def test_a_load_runs_while_every_transfer_thread_writes_a_staged_save(tmp_path):
    r = _rig(tmp_path, ahead=1)
    try:
        stored = r.save_op(9, "stored", 2, 0)
        r.tm.submit_saves([stored], None)
        _settled(r)
        _, gate_a = _held(r, 1, "a", 2)
        _, gate_b = _held(r, 2, "b", 3)
        r.tm.submit_loads([LoadOp(5, stored.keys, (10, 11), True)], None)
        r.poll(loading=[5])
        r.poll_until(want_loaded=[5])  # on the load lane: both transfer threads wait for held writes
        for i, k in enumerate(stored.keys):
            assert r.kv.block_view(10 + i).numpy().tobytes() == r.kv.block_view(i).numpy().tobytes(), k.hex()
        gate_a.release()
        gate_b.release()
        _settled(r)
    finally:
        r.close()

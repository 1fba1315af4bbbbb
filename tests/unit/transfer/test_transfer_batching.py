"""Requests submitted in one iteration move as a few shared batches, not one batch each.

A 64-request prefill used to hand 64 jobs to the transfer threads, each paying a pin, an event
wait, a checksum launch and a future; now they are merged into at most ``transfer_threads``
batches (``transfers._batches``).  What must not change: every request is reported exactly when
its bytes are in place, a save is counted once, a failed block is attributed to its own request,
and cancelling one request never drops another's work.
"""

from __future__ import annotations

import logging
import os
import time

import pytest

pytest.register_assert_rewrite("tests.support.fault_helpers")
from tests.support import fault_helpers as fh  # noqa: E402
from tests.integration.test_fault_storage import Rig  # noqa: E402
from tests.support.connector_helpers import make_executor, rand_tokens, serve  # noqa: E402
from gds_kv_connector.engines.fileops import FileOps  # noqa: E402
from gds_kv_connector.transfer.jobs import LoadOp, SaveOp  # noqa: E402
from gds_kv_connector.transfer.manager import MERGE_BYTES, ConnectorFailure, _batches  # noqa: E402

pytest_plugins = ["tests.support.fault_helpers"]


def _ops(sizes: list[int]) -> list[SaveOp]:
    return [SaveOp(rid, tuple(fh.key_of("b", rid, j) for j in range(n)), (b"",) * n, tuple(range(n)))
            for rid, n in enumerate(sizes)]


@pytest.mark.parametrize("sizes,threads,payload,want", [
    ([1] * 10, 4, 1000, [3, 3, 3, 1]),         # about total / threads blocks each
    ([4] * 64, 4, 65536, [16] * 4),            # the bench's prefill: 64 requests of 4 blocks
    ([2], 4, 1000, [1]),
    ([5, 1, 1], 2, 1000, [1, 2]),              # a large request alone, the small ones together
    ([1] * 8, 1, MERGE_BYTES // 2, [2] * 4),   # never above MERGE_BYTES per batch
    ([1, 4, 1], 1, MERGE_BYTES // 4, [1, 1, 1]),  # ... even when the next request would overshoot it
    ([3], 1, MERGE_BYTES, [1]),                # one request larger than MERGE_BYTES is not split
])
def test_batches_cover_every_op_once_in_order(sizes, threads, payload, want):
    ops = _ops(sizes)
    got = _batches(ops, payload, threads)
    assert [len(g) for g, _ in got] == want
    assert [op for g, _ in got for op in g] == ops
    assert [n for _, n in got] == [sum(len(op.keys) for op in g) for g, _ in got]


def test_requests_submitted_together_share_batches_and_all_arrive(tmp_path):
    r = Rig(str(tmp_path / "pool"), num_blocks=40, TLLM_GDS_KV_TRANSFER_THREADS="2")
    try:
        saves = [r.save_op(rid, [fh.key_of("share", rid, j) for j in range(2)], first_block=2 * rid)
                 for rid in range(6)]
        r.tm.submit_saves(saves, None)
        assert len(r.tm._inflight) == 2  # 6 requests, 2 transfer threads
        r.poll_until(finished=range(6), want_saved=range(6))
        assert r.stats.snapshot()["blocks_saved"] == 12  # a shared batch is counted once, not per request
        for i in range(12):
            r.kv.block_view(i).numpy()[:] = 0
        # loads into other pages: requests 10-12 synchronous, 13-14 asynchronous, in one submission
        loads = [LoadOp(10 + n, op.keys, (20 + 2 * n, 21 + 2 * n), n >= 3) for n, op in enumerate(saves[:5])]
        r.tm.submit_loads(loads, None)
        assert r.tm.has_sync_loads
        r.tm.wait_sync_loads()
        for op in loads[:3]:  # in place as soon as wait_sync_loads returns
            for k, b in zip(op.keys, op.block_ids):
                assert r.kv.block_view(b).numpy().tobytes() == fh.expected_payload(k)
        r.poll_until(loading=[13, 14], want_loaded=[13, 14])
        for op in loads[3:]:
            for k, b in zip(op.keys, op.block_ids):
                assert r.kv.block_view(b).numpy().tobytes() == fh.expected_payload(k)
        snap = r.stats.snapshot()
        assert snap["loads_sync"] == 3 and snap["loads_async"] == 2
    finally:
        r.close()


def test_nothing_is_kept_once_every_request_is_reported(tmp_path):
    """Requests are tracked by counts of their batches in flight: once each is reported, finished or
    loaded, no count, batch or failure is left, including an async load (one failed, one not) of a
    request that finished without ever being polled as loading."""
    r = Rig(str(tmp_path / "pool"), num_blocks=24, TLLM_GDS_KV_TRANSFER_THREADS="2")
    try:
        keys = [fh.key_of("kept", i) for i in range(6)]
        r.preload(keys)
        os.unlink(r.pool.path_for(keys[5]))
        r.tm.submit_saves([r.save_op(rid, [fh.key_of("kept-save", rid)], first_block=10 + rid) for rid in (1, 2, 3)],
                          None)
        r.tm.submit_loads([LoadOp(4, (keys[0],), (16,), True), LoadOp(5, (keys[1], keys[2]), (17, 18), True),
                           LoadOp(6, (keys[3],), (19,), False), LoadOp(7, (keys[4], keys[5]), (20, 21), True)], None)
        r.tm.wait_sync_loads()
        r.poll_until(finished=[1, 2, 3, 4, 7], loading=[5], want_saved=[1, 2, 3, 4, 7], want_loaded=[5])
        assert (r.tm._inflight, r.tm._pending, r.tm._pending_loads, r.tm._load_failed) == ([], {}, {}, {})
        snap = r.stats.snapshot()
        assert snap["loads_sync"] == 1 and snap["loads_async"] == 2 and snap["blocks_saved"] == 3
    finally:
        r.close()


def test_a_failed_block_in_a_shared_batch_names_its_own_request(tmp_path):
    r = Rig(str(tmp_path / "pool"), num_blocks=16, TLLM_GDS_KV_TRANSFER_THREADS="1")
    try:
        keys = [fh.key_of("own", i) for i in range(4)]
        r.preload(keys)
        os.unlink(r.pool.path_for(keys[3]))  # request 2's second block vanishes before the load
        r.tm.submit_loads([LoadOp(1, tuple(keys[:2]), (8, 9), True), LoadOp(2, tuple(keys[2:]), (10, 11), True)],
                          None)
        with pytest.raises(ConnectorFailure) as info:
            r.poll_until(loading=[1, 2], want_loaded=[1, 2])
        msg = str(info.value)
        assert "request 1 failed (in one batch with request 2, whose block failed)" in msg
        assert keys[3].hex() in msg and "vanished" in msg
    finally:
        r.close()


def test_a_failed_save_in_a_shared_batch_is_logged_under_its_own_request(tmp_path, caplog):
    r = Rig(str(tmp_path / "pool"), TLLM_GDS_KV_TRANSFER_THREADS="1")
    try:
        k1, k2 = fh.key_of("attr", 1), fh.key_of("attr", 2)
        r.ops.add("open", "eio", path_contains=k2.hex())  # only request 2's block fails
        with caplog.at_level(logging.WARNING, logger="gds_kv_connector.transfer.manager"):
            r.tm.submit_saves([r.save_op(1, [k1], first_block=0), r.save_op(2, [k2], first_block=1)], None)
            assert len(r.tm._inflight) == 1  # one shared batch
            r.poll_until(finished=[1, 2], want_saved=[1, 2])
        assert r.pool.contains(k1) and not r.pool.contains(k2)
        assert "first: request 2," in " ".join(rec.getMessage() for rec in caplog.records)
    finally:
        r.close()


def test_cancelling_one_request_never_drops_a_batch_it_shares(tmp_path):
    r = Rig(str(tmp_path / "pool"), num_blocks=16, TLLM_GDS_KV_TRANSFER_THREADS="1",
            TLLM_GDS_KV_CONTROL_GRACE_S="0.5")
    try:
        r.ops.add("pwrite", "stall", stall_s=30.0, count=1, skip=1)
        r.tm.submit_save(r.save_op(1, [fh.key_of("blocker")], first_block=0), None)
        assert r.ops.stall_started.wait(5)
        shared = [r.save_op(2, [fh.key_of("s", 2)], first_block=1), r.save_op(3, [fh.key_of("s", 3)], first_block=2)]
        r.tm.submit_saves(shared, None)
        r.tm.fence([2], wait=False)  # queued; request 3's block rides in the same batch
        r.ops.release()
        r.poll_until(finished=[1, 2, 3], want_saved=[1, 2, 3])
        assert not r.pool.contains(shared[0].keys[0]) and r.pool.contains(shared[1].keys[0])
    finally:
        r.close()


def test_matching_a_block_this_process_saved_needs_no_stat(pool_env, monkeypatch):
    """The scheduler matches through the worker's pool view, whose index knows what it published."""
    ex = make_executor()
    prompt = rand_tokens(100, 5)
    serve(ex, [prompt], max_new_tokens=2)
    deadline = time.monotonic() + 5
    while ex.worker.stats.snapshot().get("blocks_saved", 0) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats: list[str] = []
    real_stat = FileOps.stat

    def counting_stat(self, path):
        stats.append(path)
        return real_stat(self, path)
    monkeypatch.setattr(FileOps, "stat", counting_stat)  # every pool view's lookups go through it
    st = serve(ex, [prompt], max_new_tokens=2, first_id=10)
    assert st.loaded_tokens == 96
    assert stats == []
    ex.worker.shutdown()


def test_time_held_for_synchronous_loads_is_counted(tmp_path):
    r = Rig(str(tmp_path / "pool"), num_blocks=8)
    try:
        keys = [fh.key_of("held", i) for i in range(2)]
        r.preload(keys)
        r.ops.add("preadv", "stall", stall_s=0.3, count=1)
        r.tm.submit_loads([LoadOp(1, tuple(keys), (4, 5), False)], None)
        t0 = time.monotonic()
        r.tm.wait_sync_loads()
        held = time.monotonic() - t0
        waited_us = r.stats.snapshot()["sync_load_wait_us"]
        assert 0.25e6 <= waited_us <= 1e6 * held + 1000
    finally:
        r.close()


class _Event:
    """Stands in for a CUDA event: which stream it was recorded on, and that the save waited for it."""

    def __init__(self, stream) -> None:
        self.stream, self.waited = stream, 0

    def synchronize(self) -> None:
        self.waited += 1


def test_delivered_saves_wait_for_an_event_recorded_only_when_they_arrive(tmp_path):
    recorded: list[_Event] = []

    def record(stream):
        recorded.append(_Event(stream))
        return recorded[-1]

    r = Rig(str(tmp_path / "pool"), num_blocks=8)
    r.tm._record_event = record
    try:
        r.tm.note_forward("stream-1")  # an iteration without saves: nothing recorded
        r.tm.poll([], [])
        assert recorded == []
        r.tm.deliver_saves([r.save_op(1, [fh.key_of("late", 1, j) for j in range(2)])])
        r.poll_until(finished=[1], want_saved=[1])
        assert [e.stream for e in recorded] == ["stream-1"] and recorded[0].waited == 1
        given = _Event("stream-2")  # wait_for_save with saves recorded one: delivered saves reuse it
        r.tm.note_forward("stream-2", given)
        r.tm.deliver_saves([r.save_op(2, [fh.key_of("late", 2, 0)], first_block=2)])
        r.poll_until(finished=[2], want_saved=[2])
        assert len(recorded) == 1 and given.waited == 1
        assert r.stats.snapshot()["blocks_saved"] == 3
    finally:
        r.close()


def test_saves_of_requests_finished_together_go_out_as_one_submission(tmp_path):
    """With generated blocks saved at the end, a batch's requests finish in one iteration and each
    hands its saves over: the next poll submits them together (shared batches, one hand-off), and
    each request is still reported once its own blocks are saved."""
    r = Rig(str(tmp_path / "pool"), num_blocks=40, TLLM_GDS_KV_TRANSFER_THREADS="2")
    submissions = []
    submit = r.tm._submit_many
    r.tm._submit_many = lambda ops, *a: submissions.append(len(ops)) or submit(ops, *a)
    try:
        for rid in range(6):
            r.tm.deliver_saves([r.save_op(rid, [fh.key_of("end", rid, j) for j in range(2)], first_block=2 * rid)])
        r.poll_until(finished=range(6), want_saved=range(6))
        assert submissions == [6]
        assert r.stats.snapshot()["blocks_saved"] == 12
    finally:
        r.close()


def test_match_counters_reach_the_shared_stats_once_per_iteration(pool_env):
    ex = make_executor()
    prompts = [rand_tokens(70, seed) for seed in (1, 2)]
    serve(ex, prompts, max_new_tokens=2)
    serve(ex, prompts, max_new_tokens=2, first_id=100)  # the same prompts again: 2 full blocks each hit
    got = ex.worker.stats.snapshot()
    tpb = ex.cfg.shape.tokens_per_block
    full = (70 - 1) // tpb
    assert got["match_queries"] == 4
    assert got["match_blocks_hit"] == 2 * full and got["match_blocks_miss"] == 2 * full
    ex.worker.shutdown()

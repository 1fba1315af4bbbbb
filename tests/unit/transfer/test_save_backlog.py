"""Storage slower than the KV the forward produces: saves are best-effort, so their slowness, like
their errors, costs saves and never the process.

A save batch that no transfer thread has started by its deadline is dropped (counted) and its
request reported as usual; saves beyond ``max_queued_save_bytes`` are dropped before they are
queued; loads are taken before queued saves.  Only a save whose bytes are still moving a deadline
after it *started* fails the process while its request waits (its pages cannot be freed under it).
The manager's clock is shifted by the tests (``clock``) instead of sleeping through deadlines, and
running or queued transfers are held with gates the tests open (``gated_ops``).
"""

from __future__ import annotations

import time

import pytest

pytest.register_assert_rewrite("tests.support.fault_helpers", "gated_ops")
from tests.support import fault_helpers as fh  # noqa: E402
from tests.support.gated_ops import WAIT_S, release_when, wait_until  # noqa: E402
from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker  # noqa: E402
from gds_kv_connector.transfer import manager as transfers  # noqa: E402
from gds_kv_connector.store.base import open_store  # noqa: E402
from gds_kv_connector.engines.fileops import FileOps  # noqa: E402
from gds_kv_connector.transfer.jobs import LoadOp  # noqa: E402
from gds_kv_connector.simulator import (ExecutorConfig, ModelShape, ReferenceExecutor, SimRequest, State,  # noqa: E402
                                        fake_llm_args)
from gds_kv_connector.transfer.manager import ConnectorFailure  # noqa: E402

pytest_plugins = ["tests.support.fault_helpers"]
DEADLINE = 1.0


@pytest.fixture
def clock(monkeypatch):
    """Shift the transfer manager's clock forward (``clock(seconds)``) without sleeping."""
    shift = [0.0]

    class Shifted:
        perf_counter = staticmethod(time.perf_counter)

        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + shift[0]

    monkeypatch.setattr(transfers, "time", Shifted)

    def advance(seconds: float) -> None:
        shift[0] += seconds
    return advance


def _settled(r, batch_index: int = 0) -> None:
    r.tm._inflight[batch_index].future.exception(timeout=WAIT_S)


def test_a_save_that_never_started_is_dropped_at_its_deadline_and_its_request_reported(rig, clock):
    r = rig(TLLM_GDS_KV_DEADLINE_S=str(DEADLINE))
    a, gate = r.running_save(1, "late")
    b = r.save_op(2, "late", 2, first_block=1)
    r.tm.submit_saves([b], None)  # queued behind a, which is stuck in the storage
    assert r.poll(finished=[2]) == ([], [])
    clock(DEADLINE * 0.9)
    assert r.poll() == ([], [])
    clock(DEADLINE * 0.2)
    assert r.poll() == ([2], [])  # dropped, and its pages freed: never a ConnectorFailure
    stats = r.stats.snapshot()
    assert stats["save_blocks_dropped_deadline"] == 2 and stats["save_batches_cancelled"] == 1
    gate.release()
    _settled(r)
    r.poll(finished=[1])
    r.poll_until(want_saved=[1, 2])
    assert r.pool.contains(a.keys[0])
    assert not any(r.pool.contains(k) or r.ops.did_move(k) for k in b.keys)
    assert (r.tm._inflight, r.tm._pending, r.tm._save_bytes) == ([], {}, 0)


def test_a_running_save_fails_the_process_only_a_deadline_and_a_grace_after_it_started(rig, clock):
    """Its request's pages cannot be freed while the write reads them, so a write stuck past the
    deadline (when the save stops between blocks) and the control grace after it is fatal; the
    time it spent queued does not count against it."""
    r = rig(TLLM_GDS_KV_DEADLINE_S=str(DEADLINE), TLLM_GDS_KV_CONTROL_GRACE_S="0.5")
    a, gate_a = r.running_save(1, "stuck")
    b = r.save_op(2, "stuck", 1, first_block=1)
    gate_b = r.ops.hold(b.keys[0])
    r.tm.submit_saves([b], None)
    r.poll(finished=[2])
    clock(DEADLINE * 0.8)
    gate_a.release()  # b starts 0.8 deadlines after it was accepted, and sticks
    assert gate_b.started.wait(WAIT_S)
    clock(DEADLINE * 0.7)  # 1.5 deadlines since b was accepted, 0.7 since it started
    assert r.poll() == ([], [])
    clock(DEADLINE * 0.4)  # past the deadline, inside the grace: its one write may still return
    assert r.poll() == ([], [])
    clock(0.5)
    with pytest.raises(ConnectorFailure, match=r"save of request 2 exceeded its 1\.0s deadline and a write in flight "
                                               r"then has not returned 0\.5s later \(started 1\.6s ago"):
        r.poll()
    gate_b.release()


def test_a_running_save_stops_between_blocks_at_its_deadline(rig, clock):
    """Storage slow enough that a save batch outlasts its deadline: the blocks whose writes have not
    started then are dropped (counted), and the request is reported once the writes in flight end;
    before, the process failed a deadline after the save started."""
    r = rig(TLLM_GDS_KV_DEADLINE_S=str(DEADLINE))  # the rig's engine has 2 I/O threads
    op = r.save_op(1, "slow", 4, first_block=0)
    gates = r.writing([op], op.keys[:2])  # both I/O threads writing; blocks 3 and 4 wait for one
    assert r.poll(finished=[1]) == ([], [])
    clock(DEADLINE * 1.2)
    for g in gates:
        g.release()
    r.poll_until(want_saved=[1])  # never a ConnectorFailure
    assert [r.pool.contains(k) for k in op.keys] == [True, True, False, False]
    assert not any(r.ops.did_move(k) for k in op.keys[2:])  # their writes never started
    stats = r.stats.snapshot()
    assert stats["save_blocks_dropped_deadline"] == 2 and stats["blocks_saved"] == 2
    assert not any(name.startswith("save_failed") for name in stats)
    assert (r.tm._inflight, r.tm._pending, r.tm._save_bytes) == ([], {}, 0)


def test_blocks_dropped_at_the_deadline_stay_counted_so_when_a_reset_follows(rig, clock):
    """The deadline stopped the save first; a fence of its request while its last writes run does
    not make those blocks fenced ones."""
    r = rig(TLLM_GDS_KV_DEADLINE_S=str(DEADLINE))
    op = r.save_op(1, "late", 4, first_block=0)
    gates = r.writing([op], op.keys[:2])
    clock(DEADLINE * 1.2)
    batch = r.tm._inflight[0]
    gates[0].release()
    wait_until(lambda: batch.stop_cause != "", "the freed thread to find the deadline passed at block 3")
    release_when(lambda: batch.stopped, gates[1:])
    r.tm.fence([1])
    stats = r.stats.snapshot()
    assert stats["save_blocks_dropped_deadline"] == 2 and "fenced_blocks_skipped" not in stats


def test_saves_beyond_the_backlog_bound_are_dropped_and_each_request_is_reported_once(rig):
    payload = fh.PAYLOAD_LEN
    r = rig(TLLM_GDS_KV_MAX_QUEUED_SAVE_BYTES=str(3 * payload))
    a, gate = r.running_save(1, "backlog", 2)
    b = r.save_op(2, "backlog", 2, first_block=2)
    c = r.save_op(3, "backlog", 1, first_block=4)
    r.tm.submit_saves([b, c], None)  # room for one block: b's first (a block needs its prefix), not c
    assert r.stats.snapshot()["save_blocks_dropped_backlog"] == 2
    assert r.poll(finished=[3]) == ([3], [])  # nothing of it was queued: finished at once
    r.poll(finished=[2])
    gate.release()
    r.poll(finished=[1])
    r.poll_until(want_saved=[1, 2, 3])
    assert [r.pool.contains(k) for k in (*a.keys, *b.keys, *c.keys)] == [True, True, True, False, False]
    assert r.tm._save_bytes == 0
    d = r.save_op(4, "backlog", 3, first_block=5)  # the backlog drained: a full bound fits again
    r.tm.submit_saves([d], None)
    r.poll(finished=[4])
    r.poll_until(want_saved=[4])
    assert all(r.pool.contains(k) for k in d.keys)
    assert r.stats.snapshot()["save_blocks_dropped_backlog"] == 2


def test_loads_overtake_queued_saves(rig):
    """A synchronous load holds the forward and an asynchronous one a parked request; a queued save
    holds nothing until its request finishes, so loads submitted behind saves run first."""
    r = rig(TLLM_GDS_KV_DEADLINE_S="3")
    stored = [fh.key_of("overtake", i) for i in range(4)]
    views = [fh.fill(r.kv, 20 + i, k) for i, k in enumerate(stored)]
    assert open_store(r.pool, r.engine).save(stored, [b""] * 4, views).published == 4
    a, gate_a = r.running_save(1, "queued")
    b = r.save_op(2, "queued", 2, first_block=1)
    gate_b = r.ops.hold(b.keys[0])
    r.tm.submit_saves([b], None)
    r.tm.submit_loads([LoadOp(11, tuple(stored[2:]), (12, 13), True)], None)
    r.tm.submit_loads([LoadOp(10, tuple(stored[:2]), (10, 11), False)], None)
    gate_a.release()
    r.tm.wait_sync_loads()  # behind b, this would wait for b's held write until the deadline
    r.poll(loading=[11])
    r.poll_until(want_loaded=[11])
    for i, k in enumerate(stored):
        assert r.kv.block_view(10 + i).numpy().tobytes() == fh.expected_payload(k)
    gate_b.release()
    r.poll(finished=[1, 2])
    r.poll_until(want_saved=[1, 2])
    moved = r.ops.moved

    def at(key: bytes) -> int:  # when the key's file last began to move (a stored key's: its load)
        return max(n for n, name in enumerate(moved) if key.hex() in name)
    # The sync load runs on the load lane (the one transfer thread was writing a) and the async one
    # on the transfer thread once a ended, each through the engine's read threads: the two loads'
    # reads interleave, and both come before b's write.
    loads = [at(k) for k in stored]
    assert at(a.keys[0]) < min(loads) and max(loads) < at(b.keys[0])


class _SlowWrites(FileOps):
    """Every write takes 5 ms: far under the deadline, but slower than the executor makes KV."""

    def pwrite(self, fd, data, offset):
        time.sleep(0.005)
        return super().pwrite(fd, data, offset)


@fh.timeout(120)
def test_a_sync_load_passes_queued_async_loads(rig):
    """The one transfer thread is reading an async load (no save runs, so no load lane): a sync
    load submitted behind a second async load runs before it, as the forward waits for it."""
    r = rig()
    stored = [fh.key_of("passes", i) for i in range(3)]
    views = [fh.fill(r.kv, 20 + i, k) for i, k in enumerate(stored)]
    assert open_store(r.pool, r.engine).save(stored, [b""] * 3, views).published == 3
    gate = r.ops.hold(stored[0])
    r.tm.submit_loads([LoadOp(1, (stored[0],), (10,), True)], None)
    assert gate.started.wait(WAIT_S)
    r.tm.submit_loads([LoadOp(2, (stored[1],), (11,), True)], None)
    r.tm.submit_loads([LoadOp(3, (stored[2],), (12,), False)], None)
    gate.release()
    r.tm.wait_sync_loads()
    r.poll(loading=[1, 2])
    r.poll_until(want_loaded=[1, 2])
    names = [n for n in r.ops.moved if any(k.hex() in n for k in stored)]
    order = [next(i for i, k in enumerate(stored) if k.hex() in n) for n in names]
    assert order[-2:] == [2, 1]  # after the saves that stored them: the held load, then sync, then async
    for i, k in enumerate(stored):
        assert r.kv.block_view(10 + i).numpy().tobytes() == fh.expected_payload(k)


def test_storage_slower_than_the_forward_costs_saves_not_the_process(pool_env, monkeypatch):
    """The reviewer's reproducer, smaller: 30 requests of 10 prompt blocks with one transfer thread
    and a 1 s deadline: 1.5 s or more of writes in all, none of one iteration's batches (at most 4
    requests' prompts, about 0.2 s) near the deadline.  Saves queued past the deadline used to fail
    the executor when their request finished."""
    for name, value in (("DEADLINE_S", "1.0"), ("TRANSFER_THREADS", "1"), ("IO_THREADS", "1"), ("ENGINE", "posix")):
        monkeypatch.setenv(f"TLLM_GDS_KV_{name}", value)
    tpb = 4
    la = fake_llm_args(tpb, model="slow-storage")
    ex = ReferenceExecutor(GdsKvConnectorScheduler(la), GdsKvConnectorWorker(la, fileops=_SlowWrites()),
                           ExecutorConfig(shape=ModelShape(num_layers=1, kv_factor=2, block_elems=128,
                                                           tokens_per_block=tpb),
                                          num_blocks=1024, max_batch=4))
    try:
        for rid in range(30):
            ex.submit(SimRequest(rid, [(rid * 7919 + t * 31) % 30000 for t in range(41)], max_new_tokens=4))
        ex.run_until_done()  # the executor checks every report: none twice, none missing
        assert all(req.state is State.DONE for req in ex.reqs.values())
        snap = ex.worker.stats.snapshot()
        assert snap.get("save_blocks_dropped_deadline", 0) + snap.get("save_blocks_dropped_backlog", 0) > 0
    finally:
        ex.worker.shutdown()


def test_a_backlog_bound_below_one_block_is_refused_at_start_up(connector_pair, monkeypatch):
    """Every save would be dropped, and the one warning would blame the storage."""
    from gds_kv_connector.config.settings import SettingsError

    monkeypatch.setenv("TLLM_GDS_KV_MAX_QUEUED_SAVE_BYTES", "1KiB")
    with pytest.raises(SettingsError, match="MAX_QUEUED_SAVE_BYTES=1024 is below one block"):
        connector_pair("tiny-backlog", (8, 1, 2, 1024), 4)


def test_a_load_does_not_wait_for_saves_already_running(rig):
    """Every transfer thread writing a save batch (up to 64 MiB each, slow storage): a synchronous
    load, which holds up the forward, runs beside them on the load lane."""
    r = rig(TLLM_GDS_KV_DEADLINE_S="5")
    stored = [fh.key_of("beside", i) for i in range(2)]
    views = [fh.fill(r.kv, 20 + i, k) for i, k in enumerate(stored)]
    assert open_store(r.pool, r.engine).save(stored, [b""] * 2, views).published == 2
    a, gate = r.running_save(1, "running")  # the rig's only transfer thread is now writing it
    r.tm.submit_loads([LoadOp(10, tuple(stored), (10, 11), False)], None)
    r.tm.wait_sync_loads()  # before: until the held write ended, here at the 5 s deadline (fatal)
    for i, k in enumerate(stored):
        assert r.kv.block_view(10 + i).numpy().tobytes() == fh.expected_payload(k)
    assert not r.pool.contains(a.keys[0])  # the save was still being written all along
    gate.release()
    r.poll(finished=[1])
    r.poll_until(want_saved=[1])

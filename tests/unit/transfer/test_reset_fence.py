"""V2 ``request_reset`` with the request's transfers in flight: a fence before its pages are reused.

A reset request's pages were released and the next forward may write another request's KV into
them.  A save of it that ran later would publish that KV under this request's keys (silent
corruption of every later hit), a load would write into another request's pages.  So before that
forward every worker skips the request's transfers not yet started (its ops taken out of batches
shared with other requests, whose ops still run) and waits for those running; one still running
after the control grace fails the process.  The process's only worker is fenced by
``request_reset`` itself (queued ones) and in start_load_kv (running ones); under plain TP the id
rides in the next metadata and each worker fences in start_load_kv, before the forward.  Transfers are held with gates the tests open (``gated_ops``), never slept for.
"""

from __future__ import annotations

import pickle
import random
import threading
import time

import pytest
import torch

pytest.register_assert_rewrite("tests.support.fault_helpers", "gated_ops")
from tests.support import fault_helpers as fh  # noqa: E402
from tests.support.gated_ops import WAIT_S, GatedOps, release_when, wait_until  # noqa: E402
from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker  # noqa: E402
from gds_kv_connector.store.base import open_store  # noqa: E402
from gds_kv_connector.transfer.jobs import LoadOp  # noqa: E402
from gds_kv_connector.simulator import SimRequest, fake_llm_args  # noqa: E402
from gds_kv_connector.transfer.manager import ConnectorFailure  # noqa: E402
from gds_kv_connector.connector.trtllm_api import RequestData, SchedulerOutput  # noqa: E402

pytest_plugins = ["tests.support.fault_helpers"]


def test_queued_saves_of_a_reset_request_are_skipped_and_batch_mates_still_saved(rig):
    r = rig()
    a, gate = r.running_save(1, "blocker")
    b = r.save_op(2, "reset", 2, first_block=1)
    c = r.save_op(3, "mate", 1, first_block=3)
    r.tm.submit_saves([b, c], None)  # one batch shared by requests 2 and 3
    d = r.save_op(2, "reset-alone", 1, first_block=4)
    r.tm.submit_saves([d], None)  # a batch of request 2 alone
    assert len(r.tm._inflight) == 3
    r.tm.fence([2])  # nothing of request 2 is moving: returns at once
    for page in (*b.block_ids, *d.block_ids):  # the pages now belong to another request
        r.kv.block_view(page).numpy()[:] = 0x5A
    stats = r.stats.snapshot()
    assert stats["fenced_blocks_skipped"] == 3 and stats.get("fenced_batches_waited", 0) == 0
    gate.release()
    r.poll(finished=[1, 3])
    r.poll_until(want_saved=[1, 3])
    assert r.pool.contains(a.keys[0]) and r.pool.contains(c.keys[0])
    assert not any(r.pool.contains(k) or r.ops.did_move(k) for k in (*b.keys, *d.keys))
    assert (r.tm._inflight, r.tm._pending) == ([], {})  # request 2's counts drained with the batches
    fh.verify_file(r.pool.path_for(c.keys[0]))


def test_a_running_save_of_a_reset_request_is_waited_for(rig):
    r = rig()
    a, gate = r.running_save(1, "blocker")
    threading.Timer(0.05, gate.release).start()
    r.tm.fence([1])
    assert r.pool.contains(a.keys[0])  # the fence returned only once the save had finished
    assert r.stats.snapshot()["fenced_batches_waited"] == 1
    r.poll(finished=[1])
    r.poll_until(want_saved=[1])


def test_a_running_save_of_reset_requests_only_stops_between_blocks(rig):
    """The fence need not wait for the blocks a reset request's own save has not begun to write:
    they are skipped, and the wait ends with the writes in flight."""
    r = rig()  # two I/O threads
    op = r.save_op(1, "stopped", 4, first_block=0)
    gates = r.writing([op], op.keys[:2])
    batch = r.tm._inflight[0]
    release_when(lambda: batch.stopped, gates)
    r.tm.fence([1])
    assert [r.pool.contains(k) for k in op.keys] == [True, True, False, False]
    assert not any(r.ops.did_move(k) for k in op.keys[2:])
    stats = r.stats.snapshot()
    assert stats["fenced_blocks_skipped"] == 2 and "save_blocks_dropped_deadline" not in stats
    r.poll(finished=[1])
    r.poll_until(want_saved=[1])


def test_a_running_save_shared_with_another_request_is_not_stopped(rig):
    r = rig()  # two I/O threads, both held on request 1's blocks: request 2's wait in the queue
    a, b = r.save_op(1, "shared", 2, first_block=0), r.save_op(2, "shared", 2, first_block=2)
    gates = r.writing([a, b], a.keys)
    assert len(r.tm._inflight) == 1  # one batch, running
    assert not any(r.ops.did_move(k) for k in b.keys)
    for g in gates:
        threading.Timer(0.05, g.release).start()
    r.tm.fence([1])
    assert all(r.pool.contains(k) for k in (*a.keys, *b.keys))  # request 2's blocks were still saved
    r.poll(finished=[1, 2])
    r.poll_until(want_saved=[1, 2])


def test_a_shared_running_save_stops_once_each_of_its_requests_was_reset(rig):
    """request_reset fences each request on its own (wait=False): the batch stops at the second."""
    r = rig()
    a, b = r.save_op(1, "both", 2, first_block=0), r.save_op(2, "both", 2, first_block=2)
    gates = r.writing([a, b], a.keys)
    batch = r.tm._inflight[0]
    r.tm.fence([1], wait=False)
    assert not batch.stopped
    r.tm.fence([2], wait=False)
    assert batch.stopped
    for g in gates:
        g.release()
    r.poll(finished=[1, 2])
    r.poll_until(want_saved=[1, 2])
    assert not any(r.ops.did_move(k) for k in b.keys)
    assert r.stats.snapshot()["fenced_blocks_skipped"] == 2


def test_a_stopped_save_does_not_wait_for_another_requests_stuck_writes(rig):
    """Request 2's save holds both I/O threads (storage stuck) with more of its writes queued;
    request 1's save runs behind them.  Reset, request 1's save gives up its queued writes at once
    instead of waiting in the engine's queue for request 2's."""
    r = rig(TLLM_GDS_KV_TRANSFER_THREADS="2")
    other = r.save_op(2, "stuck", 6, first_block=0)
    gates = r.writing([other], other.keys[:2])
    mine = r.save_op(1, "reset", 4, first_block=8)
    r.tm.submit_saves([mine], None)
    wait_until(lambda: r.tm._inflight[1].future.running())
    t0 = time.monotonic()
    r.tm.fence([1])
    assert time.monotonic() - t0 < WAIT_S / 2  # before: until request 2's writes were let go
    assert not any(r.ops.did_move(k) for k in mine.keys)
    assert r.stats.snapshot()["fenced_blocks_skipped"] == 4
    for g in gates:
        g.release()
    r.poll(finished=[1, 2])
    r.poll_until(want_saved=[1, 2])
    assert all(r.pool.contains(k) for k in other.keys)


def test_shutdown_stops_a_running_save_between_blocks(rig):
    r = rig(TLLM_GDS_KV_CONTROL_GRACE_S="0.2")
    op = r.save_op(1, "shut", 4, first_block=0)
    gates = r.writing([op], op.keys[:2])
    assert r.tm.shutdown()["stuck"] == 1
    for g in gates:
        g.release()
    wait_until(lambda: r.tm._inflight[0].future.done())
    assert not any(r.ops.did_move(k) for k in op.keys[2:])  # their pages were never read after shutdown


def test_what_a_save_stopped_by_shutdown_wrote_and_dropped_is_counted(rig):
    """No poll follows shutdown: it settles the batches that ended within the grace itself."""
    r = rig(TLLM_GDS_KV_CONTROL_GRACE_S="5")
    op = r.save_op(1, "shut", 4, first_block=0)
    gates = r.writing([op], op.keys[:2])
    batch = r.tm._inflight[0]
    release_when(lambda: batch.stopped, gates)
    assert r.tm.shutdown()["stuck"] == 0
    stats = r.stats.snapshot()
    assert stats["blocks_saved"] == 2 and stats["save_blocks_dropped_at_shutdown"] == 2


def test_a_save_still_running_at_its_deadline_fails_the_reset(rig):
    """Worse than a crash: the save would read pages the next forward fills with another request's KV."""
    r = rig(TLLM_GDS_KV_CONTROL_GRACE_S="0.05", TLLM_GDS_KV_DEADLINE_S="0.3")
    _, gate = r.running_save(7, "blocker")
    with pytest.raises(ConnectorFailure, match="request 7 was reset while its save .* still running 0.05s after its 0.3s deadline"):
        r.tm.fence([7])
    gate.release()


def test_a_save_slower_than_the_control_grace_is_waited_for_not_fatal(rig):
    """Slow storage, not stuck: a reset must not crash the server because a save takes a second."""
    import threading

    r = rig(TLLM_GDS_KV_CONTROL_GRACE_S="0.05")
    a, gate = r.running_save(7, "blocker")
    threading.Timer(0.3, gate.release).start()
    r.tm.fence([7])  # returns once the save is done, past the grace
    assert r.pool.contains(a.keys[0])
    assert r.stats.snapshot()["fence_wait_us"] >= 200_000


@pytest.mark.parametrize("is_async", [True, False])
def test_a_queued_load_of_a_reset_request_never_writes_its_old_pages(rig, is_async):
    """Those pages may be another request's by now.  The skipped load is no failure (it owed those
    pages nothing), and a parked request already passed to get_finished is still reported once."""
    r = rig()
    stored = [fh.key_of("reset-load", i) for i in range(2)]
    views = [fh.fill(r.kv, 20 + i, k) for i, k in enumerate(stored)]
    assert open_store(r.pool, r.engine).save(stored, [b""] * 2, views).published == 2
    _, gate = r.running_save(1, "blocker")
    r.tm.submit_loads([LoadOp(5, tuple(stored), (10, 11), is_async)], None)
    if is_async:
        r.poll(loading=[5])
    r.tm.fence([5])
    gate.release()
    if is_async:
        r.poll_until(want_loaded=[5])
    else:
        r.tm.wait_sync_loads()
    r.poll(finished=[1])
    r.poll_until(want_saved=[1])
    assert not any(r.kv.block_view(b).numpy().any() for b in (10, 11))
    assert r.stats.snapshot().get("load_failures", 0) == 0


def test_a_running_load_of_a_reset_request_is_waited_for(rig):
    r = rig()
    stored = [fh.key_of("reset-running-load", 0)]
    assert open_store(r.pool, r.engine).save(stored, [b""], [fh.fill(r.kv, 20, stored[0])]).published == 1
    gate = r.ops.hold(stored[0])
    r.tm.submit_loads([LoadOp(6, tuple(stored), (10,), True)], None)
    r.poll(loading=[6])
    assert gate.started.wait(WAIT_S)
    threading.Timer(0.05, gate.release).start()
    r.tm.fence([6])
    assert r.kv.block_view(10).numpy().tobytes() == fh.expected_payload(stored[0])  # done before the fence returned
    r.poll_until(want_loaded=[6])


@fh.timeout(120)
def test_no_op_of_a_fenced_request_starts_after_the_fence_returns(rig):
    """The fence and the transfer threads race for each batch (a thread starting it, the fence
    filtering it): whatever the interleaving, a fenced op is either finished when the fence returns
    or never moves."""
    r = rig(TLLM_GDS_KV_TRANSFER_THREADS="2")
    rng = random.Random(5)
    fenced_after: list[tuple[list[bytes], int]] = []
    for i in range(150):
        x = r.save_op(2 * i, f"race-{i}", rng.randint(1, 3), first_block=0)
        y = r.save_op(2 * i + 1, f"race-{i}", rng.randint(1, 3), first_block=4)
        r.tm.submit_saves([x, y] if rng.random() < 0.5 else [y, x], None)
        time.sleep(rng.choice([0, 0, 0, 1e-4, 3e-4, 1e-3, 3e-3]))  # fence before, while or after they start
        r.tm.fence([x.request_id])
        with r.ops._lock:
            mark = len(r.ops.moved)
        for k in x.keys:  # begun before the fence returned: then finished before it returned
            assert not r.ops.did_move(k) or r.pool.contains(k), f"round {i}: a fenced save was still running"
        fenced_after.append((list(x.keys), mark))
        if i % 10 == 9:
            r.poll(finished=range(2 * i - 18, 2 * i + 2))
    r.poll_until(want_saved=range(300))
    for keys, mark in fenced_after:
        assert not any(k.hex() in name for name in r.ops.moved[mark:] for k in keys)
    assert (r.tm._inflight, r.tm._pending) == ([], {})
    stats = r.stats.snapshot()  # both sides of the race were taken
    assert stats["fenced_blocks_skipped"] > 0 and stats["fenced_batches_waited"] > 0


# -- through the scheduler ----------------------------------------------------------------------
TPB = 4


@pytest.fixture
def gated_pair(pool_env, monkeypatch):
    """``make(**llm_kw) -> (scheduler, worker, ops)`` over a host KV cache, one transfer thread."""
    monkeypatch.setenv("TLLM_GDS_KV_TRANSFER_THREADS", "1")
    made = []

    def make(**llm_kw):
        la = fake_llm_args(TPB, model="reset-fence", **llm_kw)
        ops = GatedOps()
        worker = GdsKvConnectorWorker(la, fileops=ops)
        made.append((worker, ops))
        worker.register_kv_caches(torch.zeros((16, 1, 2, 128), dtype=torch.bfloat16))
        sched = GdsKvConnectorScheduler(la)
        sched.wait_for_initialization()
        return sched, worker, ops
    yield make
    for worker, ops in made:
        ops.release_all()
        worker.shutdown()


def _iteration(sched, worker, new=(), gate_first_save=None):
    meta = sched.build_connector_meta(SchedulerOutput(new_requests=list(new)))
    meta = pickle.loads(pickle.dumps(meta))  # as the TP broadcast hands it over
    worker.bind_connector_meta(meta)
    worker.start_load_kv(None)
    gate = None
    if gate_first_save is not None:
        gate = gate_first_save.hold(meta.saves[0].keys[0])
    worker.wait_for_save(None)
    if gate is not None:
        assert gate.started.wait(WAIT_S)
    return meta, gate


def _prefill(sched, worker, rid, pages, gate_ops=None):
    prompt = [rid * 100 + t for t in range(4 * len(pages))]
    req = SimRequest(rid, prompt, tokens=list(prompt))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, list(pages))
    meta, gate = _iteration(sched, worker, [RequestData(rid, list(prompt), list(pages), 0, len(prompt))], gate_ops)
    return req, meta.saves[0].keys, gate


def _reused_by_another_request(worker, pages):
    for page in pages:
        worker.kv.block_view(page).view(torch.uint8).fill_(0x5A)


def _drain(worker, gate, blocker_key):
    gate.release()
    for _ in range(2000):
        worker.get_finished([], [])
        if worker.pool.contains(blocker_key) and not worker.transfers._inflight:
            return
        time.sleep(0.002)
    raise AssertionError("the transfers never drained")


def test_request_reset_fences_the_only_worker_before_it_returns(gated_pair):
    sched, worker, ops = gated_pair()  # attention DP: the scheduler's own worker is the only one
    _, blocker_keys, gate = _prefill(sched, worker, 1, [0, 1], gate_ops=ops)
    req, keys, _ = _prefill(sched, worker, 2, [4, 5])  # its save is queued behind request 1's
    sched.request_reset(req)
    _reused_by_another_request(worker, [4, 5])  # the next forward writes another request's KV there
    _drain(worker, gate, blocker_keys[0])
    assert not any(worker.pool.contains(k) or ops.did_move(k) for k in keys)
    assert worker.stats.snapshot()["fenced_blocks_skipped"] == 2
    meta, _ = _iteration(sched, worker)  # start_load_kv would wait for what still ran: nothing here
    assert meta.resets == [2]
    assert sched.build_connector_meta(SchedulerOutput()) is None  # sent once


def test_request_reset_never_raises_a_running_save_s_deadline_fails_start_load_kv(gated_pair, monkeypatch):
    """TensorRT-LLM treats exceptions as fatal from the worker's callbacks; one from request_reset
    might be caught per request while the save goes on reading pages given away."""
    monkeypatch.setenv("TLLM_GDS_KV_DEADLINE_S", "0.3")
    monkeypatch.setenv("TLLM_GDS_KV_CONTROL_GRACE_S", "0.05")
    sched, worker, ops = gated_pair()
    req, keys, gate = _prefill(sched, worker, 1, [0, 1], gate_ops=ops)  # its save runs, held in storage
    sched.request_reset(req)  # returns at once
    with pytest.raises(ConnectorFailure, match="request 1 was reset while its save"):
        _iteration(sched, worker)
    gate.release()


def test_under_plain_tp_the_next_metadata_fences_every_worker_when_bound(gated_pair):
    sched, worker, ops = gated_pair(attention_dp=False, tp_size=2)
    _, blocker_keys, gate = _prefill(sched, worker, 1, [0, 1], gate_ops=ops)
    req, keys, _ = _prefill(sched, worker, 2, [4, 5])
    sched.request_reset(req)
    assert worker.stats.snapshot().get("fenced_blocks_skipped", 0) == 0  # other ranks learn of it with the metadata
    meta, _ = _iteration(sched, worker)  # bound before start_load_kv and the forward
    assert meta.resets == [2] and not meta.loads and not meta.saves
    assert worker.stats.snapshot()["fenced_blocks_skipped"] == 2
    _reused_by_another_request(worker, [4, 5])
    _drain(worker, gate, blocker_keys[0])
    assert not any(worker.pool.contains(k) or ops.did_move(k) for k in keys)
    assert sched.build_connector_meta(SchedulerOutput()) is None  # sent once


def test_a_reset_request_s_settled_load_failure_does_not_fail_its_replay(rig):
    """A failed async load settled before the request was passed as loading is kept for its poll;
    the fence returned early (nothing in flight) and kept it, and the replay's good load raised it."""
    r = rig()
    r.tm.submit_loads([LoadOp(5, (fh.key_of("never-saved", 0),), (10,), True)], None)
    end = time.monotonic() + WAIT_S
    while r.tm._inflight:
        assert time.monotonic() < end
        r.poll()
        time.sleep(0.002)
    r.tm.fence([5])
    stored = [fh.key_of("replay", 0)]
    assert open_store(r.pool, r.engine).save(stored, [b""], [fh.fill(r.kv, 20, stored[0])]).published == 1
    r.tm.submit_loads([LoadOp(5, tuple(stored), (11,), True)], None)
    r.poll(loading=[5])
    r.poll_until(want_loaded=[5])

"""``cancel_load`` of a whole offer already handed to the workers stops the parked request's load.

TensorRT-LLM waits for a cancelled request's transfers before it frees its pages, and after a
cancel only for its control grace (about a second) before it fails the process, while a long
prompt's load from disk can take many seconds.  So a load whose requests will not use it stops:
its queued blocks are never read, a running one reads no further block, and the request is
reported loaded, not failed.  A load shared with a request that still wants its blocks runs on, and
a reset (``fence``) stops a running load of its own the same way.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

pytest.register_assert_rewrite("tests.support.fault_helpers", "gated_ops")
from tests.support import fault_helpers as fh  # noqa: E402
from tests.support import gated_ops as go  # noqa: E402
from tests.support.connector_helpers import SHAPE, make_executor, rand_tokens, serve  # noqa: E402
from gds_kv_connector import GdsKvConnectorScheduler  # noqa: E402
from gds_kv_connector.connector.cancel_board import CancelBoard, CancelReader  # noqa: E402
from gds_kv_connector.transfer.jobs import LoadOp  # noqa: E402
from gds_kv_connector.simulator import SimRequest  # noqa: E402
from tests.support.api_shapes import both_apis  # noqa: E402,F401 (the fixture, used through pytestmark)

pytestmark = pytest.mark.usefixtures("both_apis")

pytest_plugins = ["tests.support.fault_helpers"]
TPB = SHAPE.tokens_per_block


@pytest.fixture
def gated(tmp_path):
    r = go.GatedRig(str(tmp_path / "pool"), num_blocks=32)  # one transfer thread, two I/O threads
    yield r
    r.close()


def _saved(r: go.GatedRig, rid: int, tag: str, n: int, first_block: int) -> tuple[bytes, ...]:
    """``n`` blocks in the pool, saved by request ``rid``; the record of moved files cleared after."""
    op = r.save_op(rid, tag, n, first_block)
    r.tm.submit_saves([op], None)
    r.poll(finished=[rid])
    r.poll_until(want_saved=[rid])
    r.ops.moved.clear()
    return op.keys


def _page(r: go.GatedRig, block: int) -> bytes:
    return r.kv.block_view(block).numpy().tobytes()


def test_a_cancelled_request_s_queued_load_is_never_read(gated):
    a = _saved(gated, 1, "a", 4, 0)
    b = _saved(gated, 2, "b", 2, 4)
    gate = gated.ops.hold(b[0])
    gated.tm.submit_loads([LoadOp(12, b, (20, 21), True)], None)
    assert gate.started.wait(go.WAIT_S)  # running on the one transfer thread
    gated.tm.submit_loads([LoadOp(11, a, (10, 11, 12, 13), True)], None)  # queued behind it
    gated.poll(loading=[11, 12])
    gated.tm.cancel_loads([11])
    gate.release()
    gated.poll_until(want_loaded=[11, 12])
    assert not any(gated.ops.did_move(k) for k in a)
    assert [_page(gated, p) for p in (20, 21)] == [fh.expected_payload(k) for k in b]
    snap = gated.stats.snapshot()
    assert snap.get("load_blocks_cancelled") == 4 and not snap.get("load_failures")
    assert (gated.tm._inflight, gated.tm._pending, gated.tm._pending_loads) == ([], {}, {})


def test_a_cancelled_request_s_running_load_reads_no_further_block(gated):
    keys = _saved(gated, 1, "run", 6, 0)
    gates = [gated.ops.hold(k) for k in keys[:2]]  # both I/O threads busy with the first two blocks
    gated.tm.submit_loads([LoadOp(11, keys, tuple(range(10, 16)), True)], None)
    assert all(g.started.wait(go.WAIT_S) for g in gates)
    gated.poll(loading=[11])
    gated.tm.cancel_loads([11])
    for g in gates:
        g.release()
    gated.poll_until(want_loaded=[11])
    assert [gated.ops.did_move(k) for k in keys] == [True, True, False, False, False, False]
    snap = gated.stats.snapshot()
    assert snap.get("load_blocks_cancelled") == 4 and not snap.get("load_failures")


def test_a_load_shared_with_a_request_that_still_wants_it_runs_on(gated):
    a = _saved(gated, 1, "sa", 2, 0)
    b = _saved(gated, 2, "sb", 2, 2)
    gate = gated.ops.hold(a[0])
    gated.tm.submit_loads([LoadOp(11, a, (10, 11), True), LoadOp(12, b, (12, 13), True)], None)
    assert len(gated.tm._inflight) == 1 and gate.started.wait(go.WAIT_S)  # one batch, running
    gated.poll(loading=[11, 12])
    gated.tm.cancel_loads([11])
    gate.release()
    gated.poll_until(want_loaded=[11, 12])
    assert [_page(gated, p) for p in (10, 11, 12, 13)] == [fh.expected_payload(k) for k in (*a, *b)]
    snap = gated.stats.snapshot()
    assert not snap.get("load_blocks_cancelled") and snap.get("loads_async") == 2


def test_cancelling_a_request_without_a_load_in_flight_changes_nothing(gated):
    keys = _saved(gated, 1, "none", 2, 0)
    gated.tm.cancel_loads([11, 99])  # nothing submitted for either
    gated.tm.submit_loads([LoadOp(11, keys, (10, 11), True)], None)
    gated.poll(loading=[11])
    gated.poll_until(want_loaded=[11])
    assert [_page(gated, p) for p in (10, 11)] == [fh.expected_payload(k) for k in keys]


def test_a_reset_stops_its_running_load_instead_of_waiting_for_every_block(gated):
    keys = _saved(gated, 1, "fence", 6, 0)
    gates = [gated.ops.hold(k) for k in keys[:2]]
    gated.tm.submit_loads([LoadOp(11, keys, tuple(range(10, 16)), True)], None)
    assert all(g.started.wait(go.WAIT_S) for g in gates)
    batch = gated.tm._inflight[0]
    go.release_when(lambda: batch.stopped, gates)
    gated.tm.fence([11])  # waits for the running load, which stops after its two reads in flight
    assert batch.future.done()
    assert [gated.ops.did_move(k) for k in keys] == [True, True, False, False, False, False]
    gated.poll(loading=[11])
    snap = gated.stats.snapshot()
    assert snap.get("fenced_blocks_skipped") == 4 and not snap.get("load_failures")


def test_a_block_failing_after_the_cancel_fails_nothing(gated):
    """Both reads were in flight when the offer was cancelled, and one block turns out damaged: the
    request will not use it, so it is reported loaded, not a ConnectorFailure from get_finished."""
    keys = _saved(gated, 1, "rot", 2, 0)
    gates = [gated.ops.hold(k) for k in keys]
    gated.tm.submit_loads([LoadOp(11, keys, (10, 11), True)], None)
    assert all(g.started.wait(go.WAIT_S) for g in gates)
    gated.poll(loading=[11])
    gated.tm.cancel_loads([11])
    with open(gated.pool.path_for(keys[1]), "r+b") as f:  # damaged on storage while its read waits
        f.seek(4096 + 10)
        f.write(b"\xff\xfe\xfd")
    for g in gates:
        g.release()
    gated.poll_until(want_loaded=[11])
    snap = gated.stats.snapshot()
    assert snap.get("load_blocks_cancelled") == 2 and not snap.get("load_failures")
    assert not gated.tm._dropped_loads and not gated.tm._load_failed


def test_a_load_cancelled_while_it_waits_for_the_forward_opens_no_file(gated):
    keys = _saved(gated, 1, "event", 3, 0)
    event = go.HeldEvent()
    gated.tm.submit_loads([LoadOp(11, keys, (10, 11, 12), True)], event)
    assert event.started.wait(go.WAIT_S)
    gated.poll(loading=[11])
    gated.tm.cancel_loads([11])
    os.unlink(gated.pool.path_for(keys[2]))  # evicted meanwhile: pinning it would be a LoadFailure
    event.go.set()
    gated.poll_until(want_loaded=[11])
    assert not any(gated.ops.did_move(k) for k in keys)
    snap = gated.stats.snapshot()
    assert snap.get("load_blocks_cancelled") == 3 and not snap.get("load_failures")


def test_bytes_loaded_counts_only_the_blocks_of_requests_still_in_a_batch(gated):
    a = _saved(gated, 1, "ba", 2, 0)
    b = _saved(gated, 2, "bb", 4, 2)
    gate = gated.ops.hold(a[0])
    gated.tm.submit_loads([LoadOp(11, a, (10, 11), True)], None)
    assert gate.started.wait(go.WAIT_S)
    gated.tm.submit_loads([LoadOp(12, b[:2], (12, 13), True), LoadOp(13, b[2:], (14, 15), True)], None)
    gated.poll(loading=[11, 12, 13])
    gated.tm.cancel_loads([13])  # taken out of the queued batch it shares with request 12
    gate.release()
    gated.poll_until(want_loaded=[11, 12, 13])
    snap = gated.stats.snapshot()
    assert snap["bytes_loaded"] == 4 * gated.pool.payload_len and snap.get("load_blocks_cancelled") == 2


# -- the scheduler: which cancel_load stops a handed-over load, and how it reaches the workers ---------
def _request(rid: int, prompt: list[int]) -> SimRequest:
    """A new request of ``prompt``, its tokens where TensorRT-LLM's binding would read them."""
    req = SimRequest(rid, prompt)
    req.tokens = list(prompt)
    req.hold_tokens()
    return req


def _handed_over(ex, rid: int, prompt: list[int]) -> tuple[SimRequest, int]:
    """A new request whose asynchronous load of the prompt's saved blocks went out in the metadata."""
    req = _request(rid, prompt)
    matched, is_async = ex.sched.get_num_new_matched_tokens(req, 0)
    assert matched and is_async
    ex.sched.update_state_after_alloc(req, list(range(200, 200 + len(prompt) // TPB + 1)))
    meta = ex.sched.build_connector_meta(SimpleNamespace(new_requests=[], cached_requests=[]))
    assert [op.request_id for op in meta.loads] == [rid]
    return req, matched


@pytest.fixture
def served(pool_env, monkeypatch):
    monkeypatch.setenv("TLLM_GDS_KV_ASYNC_LOAD_BYTES", "1")  # every load asynchronous
    ex = make_executor()
    prompt = rand_tokens(6 * TPB + 3, seed=5)
    serve(ex, [prompt])  # six full blocks saved
    yield ex, prompt
    ex.worker.shutdown()


def test_only_a_cut_of_the_whole_handed_over_offer_stops_its_load(served, monkeypatch):
    ex, prompt = served
    calls: list[list[int]] = []
    monkeypatch.setattr(ex.sched._connect(), "cancel_loads", lambda rids: calls.append(list(rids)))
    req, matched = _handed_over(ex, 100, prompt)
    ex.sched.cancel_load(req, TPB, matched)  # the tail only: the head must still arrive
    assert calls == []
    ex.sched.cancel_load(req, 0, matched)  # the whole offer (TP 1: the worker is told at once)
    ex.sched.cancel_load(req, 0, matched)  # once is enough
    assert calls == [[100]]
    assert ex.sched.build_connector_meta(SimpleNamespace(new_requests=[], cached_requests=[])) is None


@pytest.mark.parametrize("before,after", [
    ([(3, 6)], [(0, 3)]),          # the tail cut before the hand-over: the rest is the whole of it
    ([], [(0, 2), (2, 6)]),        # the head, then the tail, cut after it
])
def test_what_counts_is_the_part_handed_over(served, monkeypatch, before, after):
    ex, prompt = served
    calls: list[list[int]] = []
    monkeypatch.setattr(ex.sched._connect(), "cancel_loads", lambda rids: calls.append(list(rids)))
    req = _request(102, prompt)
    matched, _ = ex.sched.get_num_new_matched_tokens(req, 0)
    assert matched == 6 * TPB
    for lo, hi in before:
        ex.sched.cancel_load(req, lo * TPB, hi * TPB)
    ex.sched.update_state_after_alloc(req, list(range(200, 208)))
    assert ex.sched.build_connector_meta(SimpleNamespace(new_requests=[], cached_requests=[])).loads
    for lo, hi in after:
        assert calls == []
        ex.sched.cancel_load(req, lo * TPB, hi * TPB)
    assert calls == [[102]]


def test_under_plain_tp_the_cancel_rides_in_the_next_metadata(served, monkeypatch):
    ex, prompt = served
    monkeypatch.setattr(GdsKvConnectorScheduler, "_sole_worker", property(lambda self: False))
    stopped: list[list[int]] = []
    monkeypatch.setattr(ex.worker.transfers, "cancel_loads", lambda rids: stopped.append(list(rids)))
    req, matched = _handed_over(ex, 101, prompt)
    ex.sched.cancel_load(req, 0, matched)
    meta = ex.sched.build_connector_meta(SimpleNamespace(new_requests=[], cached_requests=[]))
    assert meta.cancels == [101] and not meta.loads
    ex.worker.bind_connector_meta(meta)
    ex.worker.start_load_kv(None)
    assert stopped == [[101]]


def _until_loaded(worker, rid: int) -> None:
    """Poll as TensorRT-LLM does, every iteration, until the worker reports ``rid`` loaded."""
    done = worker.get_finished([], [rid])[1]
    end = time.monotonic() + 10
    while not done:
        assert time.monotonic() < end, f"request {rid} not reported loaded"
        time.sleep(0.002)
        done = worker.get_finished([], [])[1]
    assert done == [rid]


def test_under_plain_tp_a_cancel_reaches_the_workers_while_no_metadata_comes(served, monkeypatch):
    """Every request parked: TensorRT-LLM builds no metadata, yet the cancel must stop the other
    ranks' loads within its control grace.  The scheduler posts it to the board the hand-over named,
    which each worker reads in get_finished."""
    ex, prompt = served
    monkeypatch.setattr(GdsKvConnectorScheduler, "_sole_worker", property(lambda self: False))
    stopped: list[list[int]] = []
    real_cancel = ex.worker.transfers.cancel_loads

    def cancel(rids):
        stopped.append(list(rids))
        real_cancel(rids)
    monkeypatch.setattr(ex.worker.transfers, "cancel_loads", cancel)
    req = _request(104, prompt)
    matched, _ = ex.sched.get_num_new_matched_tokens(req, 0)
    ex.sched.update_state_after_alloc(req, list(range(200, 207)))
    meta = ex.sched.build_connector_meta(SimpleNamespace(new_requests=[], cached_requests=[]))
    assert meta.cancel_board and os.path.exists(meta.cancel_board)
    other_rank = CancelReader(meta.cancel_board)  # another rank's worker, in its own process
    ex.worker.bind_connector_meta(meta)
    ex.worker.start_load_kv(None)
    ex.sched.cancel_load(req, 0, matched)  # no build_connector_meta follows
    done = ex.worker.get_finished([], [104])[1]  # TensorRT-LLM polls every iteration, with or without a forward
    end = time.monotonic() + 10
    while not done and time.monotonic() < end:
        time.sleep(0.002)
        done = ex.worker.get_finished([], [])[1]
    assert stopped[:1] == [[104]] and done == [104]
    assert other_rank.new_ids() == [104] and other_rank.new_ids() == []
    other_rank.close()


def test_a_cancel_board_reads_whole_ids_once_and_goes_with_its_scheduler():
    board = CancelBoard.open()
    reader = CancelReader(board.path)
    assert reader.new_ids() == []
    board.post([7, 2**40])
    with open(board.path, "ab") as f:
        f.write(b"\x05\x00\x00")  # the first bytes of an id whose post has not ended
    assert reader.new_ids() == [7, 2**40]
    with open(board.path, "ab") as f:
        f.write(b"\x00\x00\x00\x00\x00")
    assert reader.new_ids() == [5]
    board.close()
    assert not os.path.exists(board.path)
    assert CancelReader(board.path).new_ids() == []  # gone, or on another node: the metadata still comes
    reader.close()


def test_a_cancel_posted_while_a_rank_had_nothing_in_flight_never_stops_a_replay_s_load(served, monkeypatch):
    """This rank had finished its part of request 300's load when the runtime cancelled the whole offer
    (another rank still loading), so it did not read the board; the request is reset and replays
    under the same id: its new load must arrive whole, the stale board entry notwithstanding."""
    ex, prompt = served
    monkeypatch.setattr(GdsKvConnectorScheduler, "_sole_worker", property(lambda self: False))
    sched, worker = ex.sched, ex.worker
    req = _request(300, prompt)
    matched, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, list(range(200, 207)))
    worker.bind_connector_meta(sched.build_connector_meta(SimpleNamespace(new_requests=[], cached_requests=[])))
    worker.start_load_kv(None)
    _until_loaded(worker, 300)
    sched.cancel_load(req, 0, matched)  # posted; nothing in flight here, so not read
    worker.get_finished([], [])
    sched.request_reset(req)
    again = _request(300, prompt)
    assert sched.get_num_new_matched_tokens(again, 0) == (matched, True)
    sched.update_state_after_alloc(again, list(range(100, 107)))
    meta = sched.build_connector_meta(SimpleNamespace(new_requests=[], cached_requests=[]))
    event = go.HeldEvent()  # the forward after start_load_kv has not ended: the load is still queued
    monkeypatch.setattr(worker, "_record_event", lambda stream: event)
    before = worker.stats.snapshot().get("load_blocks_cancelled", 0)
    worker.bind_connector_meta(meta)
    worker.start_load_kv(None)
    event.go.set()
    _until_loaded(worker, 300)
    assert worker.stats.snapshot().get("load_blocks_cancelled", 0) == before
    for b in range(matched // TPB):
        assert worker.kv.block_view(100 + b).numpy().tobytes() == worker.kv.block_view(200 + b).numpy().tobytes()


def test_tp1_and_adp_make_no_cancel_board(served):
    ex, prompt = served  # TP 1: the worker is told at once
    req = _request(105, prompt)
    ex.sched.get_num_new_matched_tokens(req, 0)
    ex.sched.update_state_after_alloc(req, list(range(200, 207)))
    meta = ex.sched.build_connector_meta(SimpleNamespace(new_requests=[], cached_requests=[]))
    assert meta.loads and meta.cancel_board == "" and ex.sched._board is None


def test_a_board_that_cannot_be_made_or_written_leaves_the_cancels_to_the_metadata(tmp_path, caplog):
    assert CancelBoard.open(str(tmp_path / "missing")) is None  # logged, not raised
    board = CancelBoard.open(str(tmp_path))
    os.close(board._fd)
    board._fd = os.open(os.devnull, os.O_RDONLY)  # a write fails, as on a full /dev/shm
    board.post([1])
    board.post([2])
    assert caplog.text.count("not written") == 1
    board.close()


def test_a_killed_scheduler_s_board_is_swept_by_the_next_one(tmp_path):
    import subprocess
    import sys
    code = ("import os,sys; from gds_kv_connector.connector.cancel_board import CancelBoard; "
            "b = CancelBoard.open(sys.argv[1]); print(b.path, flush=True); os._exit(1)")
    left = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          check=False, timeout=60).stdout.strip()
    assert os.path.exists(left)  # killed: nothing removed it
    other_host = tmp_path / "gdskv-cancels-elsewhere-1-00"
    other_host.write_bytes(b"")
    board = CancelBoard.open(str(tmp_path))
    assert not os.path.exists(left) and other_host.exists() and os.path.exists(board.path)
    board.close()

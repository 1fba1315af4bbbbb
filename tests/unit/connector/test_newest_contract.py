"""TensorRT-LLM's newest connector manager beyond replays: plans bound again in one iteration, prefix
reservations (prefix-aware scheduling with KVCacheManagerV2) and its deadlines."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import weakref
from types import SimpleNamespace

import pytest
import torch

from tests.support.connector_helpers import SHAPE, make_executor, rand_tokens, serve
from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
from gds_kv_connector.simulator import ExecutorConfig, InvariantViolation, ReferenceExecutor, SimRequest, fake_llm_args
from gds_kv_connector.config.settings import SettingsError
from gds_kv_connector.connector.trtllm_api import PrefixLoad, RequestData, SchedulerOutput, has_prefix_reservations

TPB = SHAPE.tokens_per_block
PROMPT = rand_tokens(100, 3)  # six full blocks and four tokens
OTHER = rand_tokens(40, 4)


def _fill(prompts) -> None:
    ex = make_executor()
    try:
        serve(ex, prompts, max_new_tokens=1, first_id=900)
    finally:
        ex.worker.shutdown()


def _pair(**llm_kw):
    la = fake_llm_args(TPB, **llm_kw)
    worker = GdsKvConnectorWorker(la)
    worker.register_kv_caches(torch.zeros((64, SHAPE.num_layers, SHAPE.kv_factor, SHAPE.block_elems),
                                          dtype=torch.bfloat16))
    sched = GdsKvConnectorScheduler(la)
    sched.wait_for_initialization()
    return sched, worker


def _counting(worker, name: str) -> list:
    """Record what the worker's transfer manager is given through ``name``."""
    seen: list = []
    real = getattr(worker.transfers, name)

    def record(ops, event):
        seen.extend(ops)
        return real(ops, event)
    setattr(worker.transfers, name, record)
    return seen


def _bind(worker, meta) -> None:
    worker.bind_connector_meta(pickle.loads(pickle.dumps(meta)))  # as the TP broadcast hands it over


def test_the_mirror_offers_the_reservation_protocol():
    assert has_prefix_reservations()
    out = SchedulerOutput()
    assert out.prefix_loads == []


def test_start_load_kv_again_with_the_same_binding_starts_nothing(pool_env):
    _fill([PROMPT])
    sched, worker = _pair()
    try:
        req = SimRequest(1, PROMPT, tokens=list(PROMPT))
        matched, is_async = sched.get_num_new_matched_tokens(req, 0)
        assert matched == 6 * TPB and not is_async
        pages = list(range(7))
        sched.update_state_after_alloc(req, pages)
        out = SchedulerOutput(new_requests=[RequestData(1, list(PROMPT), pages, 0, len(PROMPT) - matched)])
        _bind(worker, sched.build_connector_meta(out))
        loads = _counting(worker, "submit_loads")
        for _ in range(3):  # the executor may call it again; nothing newly bound: nothing started
            worker.start_load_kv(None)
        worker.wait_for_layer_load(0, None)
        assert sum(len(op.keys) for op in loads) == 6
    finally:
        worker.shutdown()


def test_a_rebuilt_plan_replaces_the_bound_one_and_keeps_the_others_saves(pool_env):
    """The newest manager's ``release_unstarted_prefix_loads``: a request whose accepted load was
    bound but not dispatched is taken out of the bound scheduler output, its reservation released,
    and the plan built again from that same output and bound in place of the first."""
    _fill([PROMPT])
    sched, worker = _pair()
    try:
        req_a, req_b = SimRequest(1, PROMPT, tokens=list(PROMPT)), SimRequest(2, OTHER, tokens=list(OTHER))
        count, is_async = sched.reserve_prefix(req_a, 0, 7)
        assert count == 6 * TPB and not is_async
        assert sched.get_num_new_matched_tokens(req_b, 0) == (0, False)
        pages_a, pages_b = list(range(7)), list(range(7, 10))
        sched.update_state_after_alloc(req_a, pages_a)
        sched.update_state_after_alloc(req_b, pages_b)
        report_a = RequestData(1, list(PROMPT), pages_a, 0, len(PROMPT) - count)
        report_b = RequestData(2, list(OTHER), pages_b, 0, len(OTHER))
        out = SchedulerOutput(new_requests=[report_a, report_b],
                              prefix_loads=[PrefixLoad(7, 1, 0, count, False, [pages_a], list(PROMPT), None)])
        first = sched.build_connector_meta(out)
        _bind(worker, first)
        assert [op.reservation for op in first.loads] == [7]
        saves_b = [op for op in first.saves if op.request_id == 2]
        assert sum(len(op.keys) for op in saves_b) == 2
        # TensorRT-LLM takes request 1 out before dispatch and rebuilds the bound plan
        sched.release_prefix_reservation(req_a, 7, 0, count)
        out.prefix_loads, out.new_requests = [], [report_b]
        second = sched.build_connector_meta(out)
        assert second.replaces == first.serial and second.serial != first.serial
        assert not [op for op in second.loads + second.saves if op.request_id == 1]
        assert [op for op in second.saves if op.request_id == 2] == saves_b  # carried over, not folded twice
        _bind(worker, second)
        loads, saves = _counting(worker, "submit_loads"), _counting(worker, "submit_saves")
        worker.start_load_kv(None)
        worker.start_load_kv(None)
        worker.wait_for_layer_load(0, None)
        worker.wait_for_save(None)
        assert loads == [] and [op.request_id for op in saves] == [2]
        assert 1 not in sched._reqs  # its state went with its allocation
    finally:
        worker.shutdown()


class _SlottedOutput:
    """A scheduler output of a type without weak references."""

    __slots__ = ("new_requests", "cached_requests", "prefix_loads")

    def __init__(self, new_requests) -> None:
        self.new_requests, self.cached_requests, self.prefix_loads = new_requests, [], []


@pytest.mark.parametrize("kind", ["mirror", "slotted"])
def test_a_plans_output_is_not_kept_alive_and_a_rebuild_is_still_told_apart(pool_env, kind):
    """The scheduler remembers the output it planned from only to tell TensorRT-LLM's rebuild (the
    same object given again) from a new plan: weakly, so the output and its reports are freed where
    TensorRT-LLM drops them, not inside the next iteration's callback; an output type without weak
    references is held until the next plan, and its rebuild is told apart all the same."""
    sched, worker = _pair()
    try:
        req = SimRequest(2, OTHER, tokens=list(OTHER))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, [0, 1, 2])
        report = RequestData(2, list(OTHER), [0, 1, 2], 0, len(OTHER))
        out = SchedulerOutput(new_requests=[report]) if kind == "mirror" else _SlottedOutput([report])
        first = sched.build_connector_meta(out)
        assert first is not None and first.saves
        again = sched.build_connector_meta(out)
        assert again.replaces == first.serial and again.saves == first.saves
        if kind == "mirror":
            gone = weakref.ref(out)
            del out
            assert gone() is None  # nothing in the scheduler holds it
        nxt = sched.build_connector_meta(SchedulerOutput())
        assert nxt is None or nxt.replaces == 0
    finally:
        worker.shutdown()


def test_a_decode_steps_output_given_again_is_not_folded_twice(pool_env, monkeypatch):
    """A decode step's plan is None and its requests are not named (nothing in it can be rebuilt with
    requests gone), but the same output given again is still a rebuild: its reports are not folded again
    (generated tokens saved eagerly, so a decode report is folded)."""
    monkeypatch.setenv("TLLM_GDS_KV_SAVE_GENERATED", "eager")
    sched, worker = _pair()
    try:
        req = SimRequest(2, OTHER, tokens=list(OTHER))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, [0, 1, 2])
        assert sched.build_connector_meta(SchedulerOutput(new_requests=[RequestData(2, list(OTHER), [0, 1, 2], 0,
                                                                                    len(OTHER))])) is not None
        step = SchedulerOutput(cached_requests=[RequestData(2, [7], [], len(OTHER), 1)])
        tokens = len(sched._reqs[2].tokens)
        assert sched.build_connector_meta(step) is None
        assert sched.build_connector_meta(step) is None
        assert len(sched._reqs[2].tokens) == tokens + 1
        assert 2 in sched._reqs  # nothing taken out, nothing dropped
    finally:
        worker.shutdown()


def _gc(root, quota: int) -> None:
    """``gds-kv gc`` in a process of its own, as an operator runs it."""
    env = dict(os.environ, TLLM_GDS_KV_ROOT=str(root))
    proc = subprocess.run([sys.executable, "-m", "gds_kv_connector.cli.main", "gc", "--quota", str(quota), "--json"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr  # 1: still over the quota (what it may not remove)


def test_a_reservation_keeps_its_blocks_from_eviction_until_released(pool_env, monkeypatch):
    grace = 1.0
    monkeypatch.setenv("TLLM_GDS_KV_EVICT_GRACE_S", str(grace))
    _fill([PROMPT, OTHER])
    sched, worker = _pair()
    try:
        req = SimRequest(1, PROMPT, tokens=list(PROMPT))
        count, _ = sched.reserve_prefix(req, 0, 5)
        keys = sched._reservations[5].keys
        paths = [worker.pool.path_for(k) for k in keys]
        time.sleep(2.5 * grace)  # past the grace: only the keeper's touches protect them now
        _gc(pool_env, 1)
        kept = sum(os.path.exists(p) for p in paths)
        left = sum(1 for _ in pool_env.rglob("*.blk"))
        print(f"reserved blocks kept: {kept}/{len(paths)}, block files left in the pool: {left}")
        assert kept == len(paths) and left == len(paths)  # OTHER's blocks went, the reserved stayed
        sched.release_prefix_reservation(req, 5, 0, count)
        time.sleep(2.5 * grace)
        _gc(pool_env, 1)
        assert not any(os.path.exists(p) for p in paths)  # released: evictable again
    finally:
        worker.shutdown()


class AcceptTwoBlocks(ReferenceExecutor):
    """The runtime accepts the first two blocks of each reservation; records each accepted load's
    destination pages as they were at admission, and checks them untouched until dispatch."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.snapshots = {}

    def accept(self, req, start, end):
        return start, min(end, start + 2 * TPB)

    def _reserve(self, req, device):
        found = super()._reserve(req, device)
        load = found[2]
        if load is not None:
            self.snapshots[load.reservation_id] = self.pool_bytes[req.block_ids].clone()
        return found

    def _bind_and_start(self, output):
        for rid, load in self._accepted.items():
            pages = load.block_ids_by_layer_group[0]
            assert torch.equal(self.pool_bytes[pages], self.snapshots[rid]), "a page written before dispatch"
        super()._bind_and_start(output)


def test_an_accepted_load_writes_only_its_range_and_only_after_dispatch(pool_env):
    _fill([PROMPT])
    la = fake_llm_args(TPB)
    ex = AcceptTwoBlocks(GdsKvConnectorScheduler(la), GdsKvConnectorWorker(la),
                         ExecutorConfig(shape=SHAPE, num_blocks=64, api="newest", scribble_freed=True))
    loads = _counting(ex.worker, "submit_loads")
    try:
        ex.submit(SimRequest(1, PROMPT, max_new_tokens=2))
        stats = ex.run_until_done()
    finally:
        ex.worker.shutdown()
        ex.check_free_pages()
    pages = ex.reqs[1]
    assert stats.loaded_tokens == 2 * TPB
    assert [op.reservation for op in loads] == [1] and len(loads[0].keys) == 2
    assert ex.callback_times["release_prefix_reservation"][0] == 2  # the tail at acceptance, the head at retirement
    assert pages.state.value == "done"


class _TwiceReportingWorker(GdsKvConnectorWorker):
    def get_finished_prefix_loads(self):
        done = super().get_finished_prefix_loads()
        return done + done


def test_the_executor_refuses_a_reservation_reported_twice(pool_env):
    _fill([PROMPT])
    la = fake_llm_args(TPB)
    ex = ReferenceExecutor(GdsKvConnectorScheduler(la), _TwiceReportingWorker(la),
                           ExecutorConfig(shape=SHAPE, num_blocks=64, api="newest"))
    try:
        with pytest.raises(InvariantViolation, match="not dispatched"):
            serve(ex, [PROMPT])
    finally:
        ex.worker.shutdown()


def test_the_connector_grace_must_end_before_tensorrt_llm_s(pool_env, monkeypatch):
    la = fake_llm_args(TPB)
    la.kv_connector_config = SimpleNamespace(transfer_timeout_sec=600, control_grace_sec=0.5)
    monkeypatch.setenv("TLLM_GDS_KV_CONTROL_GRACE_S", "1")
    with pytest.raises(SettingsError, match="control_grace_sec=0.5") as err:
        GdsKvConnectorWorker(la)
    assert "\n" not in str(err.value)
    la.kv_connector_config.control_grace_sec = 60  # the newest default: no grace of about a second assumed
    monkeypatch.setenv("TLLM_GDS_KV_CONTROL_GRACE_S", "30")
    GdsKvConnectorWorker(la)

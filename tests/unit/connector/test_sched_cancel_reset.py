"""V2's ``cancel_load(request, start, end)`` (the runtime will not use offered tokens ``[start, end)``)
and ``request_reset`` (the allocation was released; the request replays from scratch), driven
through the reference executor: only the blocks the runtime keeps are loaded, no save claims KV
that was not loaded or computed, and a reset request's queued load never reaches its old pages."""

import pytest

from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
from gds_kv_connector.simulator import (ExecutorConfig, InvariantViolation, ModelShape, ReferenceExecutor,
                                        SimRequest, State, fake_llm_args)

TPB = 4
SHAPE = ModelShape(num_layers=1, kv_factor=2, block_elems=128, tokens_per_block=TPB)
PROMPT = [1000 + i for i in range(22)]  # five full blocks and two tokens
OTHER = [5000 + i for i in range(14)]


@pytest.fixture(autouse=True)
def sync_loads(pool_env, monkeypatch):
    monkeypatch.setenv("TLLM_GDS_KV_ASYNC_LOAD_BYTES", "1GiB")  # every load synchronous


class Trimming(ReferenceExecutor):
    """Honours only ``honour_blocks`` blocks of each offer and cancels the rest with cancel_load,
    ``when`` = "before" or "after" update_state_after_alloc."""

    honour_blocks = 1
    when = "before"

    def _cuts(self, matched: int, tpb: int):
        """The token ranges cancelled before and after update_state_after_alloc, and the tokens honoured."""
        honoured = min(matched, self.honour_blocks * tpb)
        cut = [(honoured, matched)] if honoured < matched else []
        return (cut, [], honoured) if self.when == "before" else ([], cut, honoured)

    def _admit(self):  # the reference _admit, with a partly honoured offer
        tpb = self.cfg.shape.tokens_per_block
        while self.waiting:
            req = self.waiting.popleft()
            need = -(-len(req.prompt) // tpb)
            req.block_ids = [self.free.popleft() for _ in range(need)]
            req.hashes.extend_to(req.tokens, len(req.prompt))
            matched, is_async = self.sched.get_num_new_matched_tokens(req, 0)
            assert not is_async
            before, after, honoured = self._cuts(matched, tpb)
            for start, end in before:
                self.sched.cancel_load(req, start, end)
            self.sched.update_state_after_alloc(req, self._allocated(req))
            for start, end in after:
                self.sched.cancel_load(req, start, end)
            req.pos, req.external, req.load_async = honoured, honoured, False
            req.verified_blocks = 0
            self.stats.loaded_tokens += honoured
            req.state = State.CONTEXT
        return False

    def _allocated(self, req):
        """The page ids update_state_after_alloc is given: all of the request's."""
        return list(req.block_ids)


def _run(ex_cls, prompt, rid, premature=None, **kw):
    la = fake_llm_args(TPB, model="cancel-load")
    ex = ex_cls(GdsKvConnectorScheduler(la), GdsKvConnectorWorker(la),
                ExecutorConfig(shape=SHAPE, num_blocks=32, **kw))
    real = ex.sched.build_connector_meta

    def build(out):  # every saved page must hold KV the forward of this iteration has written
        meta = real(out)
        for op in (meta.saves if meta else []):
            r = ex.reqs[op.request_id]
            written = r.pos + ex._chunk(r) if r.state is State.CONTEXT else len(r.tokens)
            for page in op.block_ids:
                b = r.block_ids.index(page)
                if (b + 1) * TPB > written and premature is not None:
                    premature.append((op.request_id, b, written))
        return meta
    ex.sched.build_connector_meta = build
    try:
        ex.submit(SimRequest(rid, prompt, max_new_tokens=1))
        ex.run_until_done()
        return ex.stats
    finally:
        ex.worker.shutdown()


def test_a_tail_cancelled_before_allocation_still_loads_the_head():
    _run(ReferenceExecutor, PROMPT[:13], 0)  # blocks 0..2 in the pool
    Trimming.when = "before"
    try:  # offer: blocks 0..2; honoured: block 0; cancelled: tokens [4, 12)
        _run(Trimming, PROMPT, 1)
    except InvariantViolation as exc:
        pytest.fail(f"the honoured head was never loaded: {exc}")


def test_a_tail_cancelled_after_allocation_is_not_counted_as_written():
    _run(ReferenceExecutor, PROMPT[:13], 0)  # blocks 0..2 in the pool
    Trimming.when = "after"
    premature = []
    _run(Trimming, PROMPT, 1, premature, chunk_size=4)  # honours block 0, computes the rest 4 tokens a chunk
    # a later request with the same prompt loads what was saved: it must be the KV of its prefix
    try:
        _run(ReferenceExecutor, PROMPT, 2)
        later = None
    except Exception as exc:  # noqa: BLE001
        later = f"{type(exc).__name__}: {exc}"
    assert not premature and later is None


class HeadThenTail(Trimming):
    """Cancels the offer's first block before update_state_after_alloc and its last block after it,
    and honours nothing (the runtime computes the prompt from its first token)."""

    def _cuts(self, matched: int, tpb: int):
        assert matched >= 3 * tpb
        return [(0, tpb)], [(matched - tpb, matched)], 0


def test_a_head_cut_before_allocation_and_a_tail_cut_after_count_nothing_as_loaded():
    """The second cut rebuilds the load from what is queued; the first cut's blocks must still count
    as not loaded, or the blocks after them look written and are saved before their KV is computed."""
    _run(ReferenceExecutor, PROMPT[:17], 0)  # blocks 0..3 in the pool
    premature = []
    _run(HeadThenTail, PROMPT, 1, premature, chunk_size=4)
    assert not premature
    _run(ReferenceExecutor, PROMPT, 2)  # what was saved is the KV of its prefix (checked as it loads)


class RollingBack(ReferenceExecutor):
    """Admission of request 1 is rolled back once after its allocation (V2 MAX_UTILIZATION): its
    pages are released and it is queued again to replay from scratch."""

    rolled = False

    def _admit(self):
        tpb = self.cfg.shape.tokens_per_block
        while self.waiting:
            req = self.waiting.popleft()
            need = -(-len(req.prompt) // tpb)
            req.block_ids = [self.free.popleft() for _ in range(need)]
            device = min(req.device_hit_blocks, (len(req.prompt) - 1) // tpb) * tpb
            req.hashes.extend_to(req.tokens, len(req.prompt))
            if device:
                self.model.write_tokens(self.pool_bytes, req.block_ids, req.hashes.hashes, 0, device)
            matched, is_async = self.sched.get_num_new_matched_tokens(req, device)
            self.sched.update_state_after_alloc(req, list(req.block_ids))
            if req.request_id == 1 and not self.rolled:  # roll back: release the pages, replay later
                self.rolled = True
                self.sched.request_reset(req)
                self.free.extendleft(reversed(req.block_ids))
                req.block_ids = []
                self.waiting.append(req)
                continue
            req.pos, req.external, req.load_async = device + matched, matched, False
            req.verified_blocks = 0
            req.state = State.CONTEXT
        return False


def _ex(cls):
    la = fake_llm_args(TPB, model="request-reset")
    return cls(GdsKvConnectorScheduler(la), GdsKvConnectorWorker(la), ExecutorConfig(shape=SHAPE, num_blocks=32))


def test_a_reset_request_s_queued_load_is_dropped():
    ex = _ex(ReferenceExecutor)
    try:  # A's blocks 0..2 in the pool
        ex.submit(SimRequest(0, PROMPT[:14], max_new_tokens=1))
        ex.run_until_done()
    finally:
        ex.worker.shutdown()

    ex = _ex(RollingBack)
    loads = []
    real = ex.sched.build_connector_meta

    def build(out):
        meta = real(out)
        loads.extend((op.request_id, op.block_ids) for op in (meta.loads if meta else []))
        return meta
    ex.sched.build_connector_meta = build
    try:
        # request 1 (prompt A) matches 3 blocks, is allocated pages 0..3, then reset; request 2
        # (prompt B, a device prefix-cache hit of one block) is given pages 0..3 in the same pass
        ex.submit(SimRequest(1, PROMPT[:14], max_new_tokens=1))
        ex.submit(SimRequest(2, OTHER, max_new_tokens=1, device_hit_blocks=1))
        try:
            ex.run_until_done()
            err = None
        except InvariantViolation as exc:
            err = str(exc)
        assert err is None
        assert [rid for rid, _ in loads].count(1) == 1
    finally:
        ex.worker.shutdown()


class ShortAllocation(Trimming):
    """V2 with pages running short: the offer's tail is handed back with cancel_load before the
    allocation, which then covers only the honoured head and the first chunk (fewer pages than the
    offer; TensorRT-LLM's test_offer_is_handed_back_when_pages_run_out)."""

    when = "before"

    def _allocated(self, req):
        return req.block_ids[:self.honour_blocks + 1]


@pytest.mark.parametrize("honour", [0, 1])
def test_an_allocation_shorter_than_the_offer_loads_what_has_pages(honour):
    """It raised ("promised n blocks ... only k pages were allocated") inside the runtime's
    resource preparation, which kills the executor."""
    _run(ReferenceExecutor, PROMPT[:13], 0)  # blocks 0..2 in the pool
    ShortAllocation.honour_blocks = honour
    stats = _run(ShortAllocation, PROMPT, 1, chunk_size=4)
    assert stats.loaded_tokens == honour * TPB
    _run(ReferenceExecutor, PROMPT, 2)  # what was saved meanwhile is the prefix's KV (checked on load)

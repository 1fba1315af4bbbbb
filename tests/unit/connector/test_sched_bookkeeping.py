"""The scheduler's per-iteration plan: what is saved, with which keys, and when nothing is due.

These fold decode reports, so they run with ``TLLM_GDS_KV_SAVE_GENERATED=eager``; the default for one
worker (generated blocks saved when the request finishes) is tested in test_sched_save_generated.py.
"""

from types import SimpleNamespace

import pytest
import torch

from tests.support.connector_helpers import CountedRequest, plan
from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
from gds_kv_connector.store.base import open_store
from gds_kv_connector.format.keys import base_fingerprint, block_keys
from gds_kv_connector.transfer.jobs import LoadOp
from gds_kv_connector.format.records import ZERO_KEY
from gds_kv_connector.simulator import SimRequest, fake_llm_args
from gds_kv_connector.connector.trtllm_api import RequestData, SchedulerOutput

TPB = 4


@pytest.fixture(autouse=True)
def _eager(pool_env, monkeypatch):
    monkeypatch.setenv("TLLM_GDS_KV_SAVE_GENERATED", "eager")


def _pair():
    la = fake_llm_args(TPB, model="sched-bookkeeping")
    worker = GdsKvConnectorWorker(la)
    worker.register_kv_caches(torch.zeros((16, 1, 2, 1024), dtype=torch.bfloat16))
    sched = GdsKvConnectorScheduler(la)
    sched.wait_for_initialization()
    return sched, worker


def _keys(sched, tokens):
    return block_keys(base_fingerprint(sched._peer.geometry), None, tokens, TPB)


def _report(sched, rid, tokens, block_ids, computed, scheduled, first):
    out = SchedulerOutput()
    rd = RequestData(request_id=rid, new_tokens=tokens, new_block_ids=block_ids, computed_position=computed,
                     num_scheduled_tokens=scheduled)
    (out.new_requests if first else out.cached_requests).append(rd)
    return plan(sched, out)


def test_saves_carry_chain_keys_and_only_completed_blocks(pool_env):
    sched, worker = _pair()
    try:
        prompt = list(range(100, 110))  # two full blocks and two tokens
        assert sched.get_num_new_matched_tokens(SimRequest(1, prompt, tokens=list(prompt)), 0) == (0, False)
        meta = _report(sched, 1, prompt, [7, 8, 9], 0, len(prompt), first=True)
        keys = _keys(sched, prompt)
        assert [(s.keys, s.parents, s.block_ids) for s in meta.saves] == [(tuple(keys), (ZERO_KEY, keys[0]), (7, 8))]
        tokens = prompt + [1]  # decode: the third block is not full yet
        assert not _report(sched, 1, [1], [], len(tokens) - 1, 1, first=False).saves
        tokens.append(2)  # its last token, whose KV this step writes
        meta = _report(sched, 1, [2], [], len(tokens) - 1, 1, first=False)
        k3 = _keys(sched, tokens)[2]
        assert [(s.keys, s.parents, s.block_ids) for s in meta.saves] == [((k3,), (keys[1],), (9,))]
    finally:
        worker.shutdown()


@pytest.mark.parametrize("first_report", ["prompt", "empty"])
def test_token_lists_passed_in_are_never_mutated(pool_env, first_report):
    """The match keeps get_tokens' list instead of copying a long prompt, so the first report must
    leave the scheduler a list of its own to extend: a request that hands out its own list, and the
    first report's list (the prompt, or empty), stay as they were, and later saves still key the
    generated tokens."""
    sched, worker = _pair()
    try:
        prompt = list(range(300, 310))
        held = list(prompt)
        req = SimRequest(3, prompt, tokens=list(prompt))
        req.get_tokens = lambda beam=0: held
        sched.get_num_new_matched_tokens(req, 0)
        reported = list(prompt) if first_report == "prompt" else []
        _report(sched, 3, reported, [7, 8, 9], 0, len(prompt), first=True)
        tokens = prompt + [1]
        _report(sched, 3, [1], [], len(tokens) - 1, 1, first=False)
        tokens.append(2)
        meta = _report(sched, 3, [2], [], len(tokens) - 1, 1, first=False)
        assert held == prompt and reported == (prompt if first_report == "prompt" else [])
        assert [s.keys for s in meta.saves] == [(_keys(sched, tokens)[2],)]
    finally:
        worker.shutdown()


def test_only_tokens_of_blocks_not_yet_keyed_are_held(pool_env):
    """The scheduler drops the tokens of blocks it has keyed (a 128k-token prompt's list was copied in
    the first report and released at the end); the keys of later blocks still come from the right
    tokens, and tokens that differ from those held make the match key the request anew."""
    sched, worker = _pair()
    try:
        prompt = list(range(500, 542))  # ten full blocks and two tokens
        req = SimRequest(6, prompt, tokens=list(prompt))
        sched.get_num_new_matched_tokens(req, 0)
        st = sched._reqs[6]
        assert (st.base, st.tokens) == (40, prompt[40:])  # the match keyed ten blocks
        meta = _report(sched, 6, list(prompt), list(range(11)), 0, len(prompt), first=True)
        assert (st.base, st.tokens) == (40, prompt[40:]) and st.tokens is not req.tokens
        assert [s.keys for s in meta.saves] == [tuple(_keys(sched, prompt))]
        tokens = prompt + [1, 2]  # completes block 10
        _report(sched, 6, [1], [], len(tokens) - 2, 1, first=False)
        meta = _report(sched, 6, [2], [], len(tokens) - 1, 1, first=False)
        assert [(s.keys, s.parents) for s in meta.saves] == [((_keys(sched, tokens)[10],), (_keys(sched, tokens)[9],))]
        assert (st.base, st.tokens) == (44, [])

        other = prompt[:40] + [9, 9]  # the same keyed blocks, different tokens after them: still matched
        sched.get_num_new_matched_tokens(SimRequest(7, prompt, tokens=list(prompt)), 0)
        sched.get_num_new_matched_tokens(SimRequest(7, other, tokens=list(other)), 0)
        assert sched._reqs[7].tokens == [9, 9] and sched._reqs[7].keys == _keys(sched, other)
        changed = list(prompt)
        changed[0] = changed[41] = 0  # a held token differs: the keys are made again from all tokens
        sched.get_num_new_matched_tokens(SimRequest(8, prompt, tokens=list(prompt)), 0)
        assert sched._reqs[8].keys == _keys(sched, prompt)
        req8 = SimRequest(8, changed, tokens=list(changed))
        sched.get_num_new_matched_tokens(req8, 0)
        assert _keys(sched, changed) != _keys(sched, prompt)
        assert sched._reqs[8].keys == _keys(sched, changed) and sched._reqs[8].tokens == changed[40:]
    finally:
        worker.shutdown()


def test_request_finished_saves_a_block_completed_by_unreported_tokens(pool_env):
    sched, worker = _pair()
    delivered = []
    sched._connect().deliver_saves = delivered.extend
    try:
        prompt = list(range(200, 206))
        req = SimRequest(2, prompt, tokens=list(prompt))
        sched.get_num_new_matched_tokens(req, 0)
        assert len(_report(sched, 2, prompt, [3, 4], 0, len(prompt), first=True).saves) == 1
        # the next step writes the KV of positions 6 and 7, whose tokens are never reported (overlap);
        # it samples token 8, whose KV no forward wrote
        assert not _report(sched, 2, [], [], len(prompt), 2, first=False).saves
        req.tokens = prompt + [1, 2, 3]
        assert sched.request_finished(req, [3, 4, 5]) is True
        want = _keys(sched, req.tokens)
        assert [(s.keys, s.parents, s.block_ids) for s in delivered] == [((want[1],), (want[0],), (4,))]
    finally:
        worker.shutdown()


@pytest.mark.parametrize("counted", [True, False])
def test_request_finished_reads_the_tokens_only_when_a_block_may_complete(pool_env, counted):
    """A request that can count its tokens (TensorRT-LLM's get_num_tokens) is asked for its token
    list at the end only if unreported tokens complete a block; one that cannot is asked anyway."""
    sched, worker = _pair()
    delivered = []
    sched._connect().deliver_saves = delivered.extend
    try:
        prompt = list(range(400, 406))
        req = SimpleNamespace(request_id=4, tokens=list(prompt), asked=0)

        def get_tokens(beam=0):
            req.asked += 1
            return list(req.tokens)
        req.get_tokens = get_tokens
        if counted:
            req.get_num_tokens = lambda beam=0: len(req.tokens)
        sched.get_num_new_matched_tokens(req, 0)
        _report(sched, 4, prompt, [3, 4], 0, len(prompt), first=True)
        req.tokens = prompt + [1]  # block 1 still one token short
        req.asked = 0
        sched.request_finished(req, [3, 4])
        assert req.asked == (0 if counted else 1) and not delivered

        sched.get_num_new_matched_tokens(SimpleNamespace(request_id=5, get_tokens=lambda b=0: list(prompt)), 0)
        _report(sched, 5, prompt, [3, 4], 0, len(prompt), first=True)
        _report(sched, 5, [], [], len(prompt), 2, first=False)  # KV of positions 6 and 7; token 8 sampled
        req.request_id, req.tokens, req.asked = 5, prompt + [1, 2, 3], 0
        sched.request_finished(req, [3, 4])
        want = _keys(sched, req.tokens)
        assert req.asked == 1 and [s.keys for s in delivered] == [(want[1],)]
    finally:
        worker.shutdown()


def _first_report(rid: int, prompt: list[int], pages: list[int]) -> SchedulerOutput:
    """The scheduler output of a synchronous load's admission iteration: the request reported new
    (a synchronous load is handed over with its request's first report)."""
    return SchedulerOutput(new_requests=[RequestData(rid, list(prompt), list(pages), 0, 1)])


def test_a_load_skips_blocks_without_a_page(pool_env):
    sched, worker = _pair()
    try:
        prompt = list(range(300, 313))  # three full blocks, one token to compute
        keys = _keys(sched, prompt)
        data = torch.zeros(worker.pool.payload_len, dtype=torch.uint8)
        assert not open_store(worker.pool, worker.transfers.engine).save(keys, [ZERO_KEY] + keys[:-1],
                               [data] * len(keys)).failed
        req = SimRequest(3, prompt, tokens=list(prompt))
        matched, _ = sched.get_num_new_matched_tokens(req, 0)
        assert matched == 3 * TPB
        sched.update_state_after_alloc(req, [5, -1, 6, 7])
        meta = plan(sched, _first_report(3, prompt, [5, -1, 6, 7]))
        assert [(op.keys, op.block_ids) for op in meta.loads] == [((keys[0], keys[2]), (5, 6))]
        # no page for any block: a synchronous offer loads nothing; a parked (async) request gets an
        # empty load, which tells the workers it is done instead of leaving it to the deadline
        for rid, is_async in ((4, False), (5, True)):
            other = SimRequest(rid, prompt, tokens=list(prompt))
            sched.get_num_new_matched_tokens(other, 0)
            sched._reqs[rid].pending_load = (0, keys, is_async)
            sched.update_state_after_alloc(other, [-1, -1, -1, 7])
            meta = plan(sched, _first_report(rid, prompt, [-1, -1, -1, 7]))
            assert (meta.loads if meta else []) == ([LoadOp(rid, (), (), True)] if is_async else []), rid
    finally:
        worker.shutdown()


def test_block_ids_reported_per_layer_group_or_by_an_older_report_type(pool_env):
    """V2 reports carry new pages in new_block_ids_by_layer_group (new_block_ids empty); reports of a
    TensorRT-LLM before that field (no attribute at all) carry them in new_block_ids. Both land in
    the saves, block for block."""
    from types import SimpleNamespace

    sched, worker = _pair()
    try:
        prompt = list(range(300, 310))  # two full blocks and two tokens
        keys = _keys(sched, prompt + [1, 2])
        sched.get_num_new_matched_tokens(SimRequest(3, prompt, tokens=list(prompt)), 0)
        v2 = RequestData(request_id=3, new_tokens=prompt, new_block_ids=[], computed_position=0,
                         num_scheduled_tokens=len(prompt), new_block_ids_by_layer_group=[[4, 5, 6]])
        meta = plan(sched, SchedulerOutput(new_requests=[v2]))
        assert [(s.keys, s.block_ids) for s in meta.saves] == [(tuple(keys[:2]), (4, 5))]
        old = SimpleNamespace(request_id=3, new_tokens=[1, 2], new_block_ids=[], computed_position=11,
                              num_scheduled_tokens=1)  # no new_block_ids_by_layer_group attribute
        idle = RequestData(request_id=99, new_tokens=[], new_block_ids=[], computed_position=0,
                           num_scheduled_tokens=0)  # first in the list: the list's type has the field
        meta = plan(sched, SchedulerOutput(cached_requests=[idle, old]))
        assert [(s.keys, s.block_ids) for s in meta.saves] == [((keys[2],), (6,))]
    finally:
        worker.shutdown()


def test_a_new_long_prompt_missing_from_the_pool_is_answered_from_its_first_block(pool_env):
    """TensorRT-LLM's get_tokens converts every token; a long prompt whose first block is not in the
    pool cannot match, so only that block's tokens are read, and its first report's tokens key its
    saves. One whose first block is there is matched as before."""
    from gds_kv_connector.connector.scheduler import _PROBE_MIN_TOKENS

    sched, worker = _pair()
    try:
        prompt = list(range(7000, 7000 + _PROBE_MIN_TOKENS + 2))
        req = CountedRequest(1, list(prompt))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert (req.whole, req.single) == (0, TPB)
        n_blocks = len(prompt) // TPB
        meta = _report(sched, 1, list(prompt), list(range(n_blocks + 1)), 0, len(prompt), first=True)
        keys = _keys(sched, prompt)
        assert [t for s in meta.saves for t in s.keys] == keys[:n_blocks]

        # only the first block saved: the probe finds it, the match runs as before and finds one block
        other = list(range(9000, 9000 + _PROBE_MIN_TOKENS + 2))
        okeys = _keys(sched, other)
        data = torch.zeros(worker.pool.payload_len, dtype=torch.uint8)
        assert not open_store(worker.pool, worker.transfers.engine).save(okeys[:1], [ZERO_KEY], [data]).failed
        worker.pool.forget(okeys[0])  # as another process saved it
        req2 = CountedRequest(2, list(other))
        assert sched.get_num_new_matched_tokens(req2, 0)[0] == TPB
        assert req2.whole == 1

        # a short prompt, or a request without get_token, is read whole
        req3 = CountedRequest(3, list(range(300, 310)))
        sched.get_num_new_matched_tokens(req3, 0)
        assert (req3.whole, req3.single) == (1, 0)
        bare = SimpleNamespace(request_id=4, whole=0)

        def whole(beam=0):
            bare.whole += 1
            return other[5:]
        bare.get_tokens = whole
        assert sched.get_num_new_matched_tokens(bare, 0) == (0, False) and bare.whole == 1
    finally:
        worker.shutdown()


def test_admission_by_seen_count_reads_the_whole_prompt(pool_env, monkeypatch):
    """seen:N counts every prefix of a prompt, so the first-block answer is not taken."""
    from gds_kv_connector.connector.scheduler import _PROBE_MIN_TOKENS

    monkeypatch.setenv("TLLM_GDS_KV_ADMISSION", "seen:2")
    sched, worker = _pair()
    try:
        prompt = list(range(7000, 7000 + _PROBE_MIN_TOKENS + 2))
        req = CountedRequest(1, list(prompt))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert req.whole == 1 and len(sched._seen) == len(prompt) // TPB
    finally:
        worker.shutdown()

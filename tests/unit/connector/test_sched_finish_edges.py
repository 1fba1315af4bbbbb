"""What ``request_finished`` may still save, in the cases where a late or stale save would publish
KV that is not the request's: plain TP (a save sent after the request's pages are freed), a last
token whose KV no forward wrote (speculative decoding's rejected drafts), and the cache salt of a
request first seen in a report of an older ``RequestData``."""

from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch

from gds_kv_connector import GdsKvConnectorScheduler
from gds_kv_connector.format.keys import base_fingerprint, block_keys
from gds_kv_connector.simulator import SimRequest, fake_llm_args
from gds_kv_connector.config.settings import SettingsError
from gds_kv_connector.connector.trtllm_api import RequestData, SchedulerOutput

TPB = 4


@pytest.fixture
def pair(connector_pair):
    return lambda **llm_kw: connector_pair("sched-finish-edges", (16, 1, 2, 128), TPB, **llm_kw)


def _plan(sched, new=(), cached=()):
    return sched.build_connector_meta(SchedulerOutput(new_requests=list(new), cached_requests=list(cached)))


def _finish_after_a_lagging_step(sched, worker, rid):
    """A prompt of 6 tokens, then a step whose 2 tokens' KV is written but whose tokens the report
    does not carry (the overlap scheduler), then the end: block 1 is completed only by tokens that
    ``request_finished`` reads."""
    prompt = list(range(200, 206))
    req = SimRequest(rid, prompt, tokens=list(prompt))
    sched.get_num_new_matched_tokens(req, 0)
    for meta in (_plan(sched, new=[RequestData(rid, list(prompt), [3, 4], 0, len(prompt))]),
                 _plan(sched, cached=[RequestData(rid, [], [], len(prompt), 2)])):
        worker.bind_connector_meta(meta)
        worker.start_load_kv(None)
        worker.wait_for_save(None)
    req.tokens = prompt + [1, 2, 3]
    return req


def test_under_plain_tp_a_save_due_at_the_end_is_dropped_not_sent_after_the_pages_are_freed(pair):
    sched, worker = pair(attention_dp=False, tp_size=2)  # auto: eager
    req = _finish_after_a_lagging_step(sched, worker, 2)
    before = worker.stats.snapshot().get("save_blocks_dropped_at_finish", 0)
    keep = sched.request_finished(req, [3, 4, 5])
    # what get_finished reports next frees the pages; nothing of this request may be sent after it
    assert keep is True  # its prompt block's save (sent earlier) is still held for
    assert _plan(sched) is None
    assert worker.stats.snapshot()["save_blocks_dropped_at_finish"] - before == 1


def test_with_one_worker_the_save_due_at_the_end_is_handed_over_at_once(pair):
    sched, worker = pair()
    delivered = []
    sched._connect().deliver_saves = delivered.extend
    req = _finish_after_a_lagging_step(sched, worker, 2)
    assert sched.request_finished(req, [3, 4, 5]) is True
    want = block_keys(base_fingerprint(sched._peer.geometry), None, req.tokens, TPB)
    assert [(op.keys, op.block_ids) for op in delivered] == [((want[1],), (4,))]


def test_finish_mode_under_plain_tp_is_refused_at_start_up(pool_env, monkeypatch):
    monkeypatch.setenv("TLLM_GDS_KV_SAVE_GENERATED", "finish")
    la = fake_llm_args(TPB, model="sched-finish-edges", attention_dp=False, tp_size=2)
    with pytest.raises(SettingsError, match="SAVE_GENERATED=finish.*plain TP"):
        GdsKvConnectorScheduler(la)


@pytest.mark.parametrize("mode", ["finish", "eager"])
def test_the_block_of_a_last_token_no_forward_wrote_is_not_saved(pair, monkeypatch, mode):
    """Speculative decoding: a decode report counts its drafts' positions as written; with every
    draft rejected, the last token's position holds a rejected draft's KV and no forward follows."""
    monkeypatch.setenv("TLLM_GDS_KV_SAVE_GENERATED", mode)
    sched, worker = pair()
    delivered = []
    sched._connect().deliver_saves = delivered.extend
    prompt = list(range(100, 106))
    req = SimRequest(1, prompt, tokens=list(prompt))
    sched.get_num_new_matched_tokens(req, 0)
    _plan(sched, new=[RequestData(1, list(prompt), [3, 4], 0, 6)])
    _plan(sched, cached=[RequestData(1, [6000], [], 6, 1 + 3)])  # position 6 and 3 drafts forwarded
    req.tokens = prompt + [6000, 7777]  # all drafts rejected: 7777 at position 7, the request's last
    sched.request_finished(req, [3, 4])
    assert 4 not in [b for op in delivered for b in op.block_ids]


@dataclass
class _OlderRequestData:  # RequestData with cache_salt_id and no cache_salt (contract 3.1)
    request_id: int
    new_tokens: List[int]
    new_block_ids: List[int]
    computed_position: int
    num_scheduled_tokens: int
    cache_salt_id: Optional[int] = None


def test_a_request_first_seen_in_a_report_takes_its_salt_from_cache_salt_id(pair, monkeypatch):
    monkeypatch.setenv("TLLM_GDS_KV_LOAD", "0")  # no match: the state is made from the first report
    sched, _ = pair()
    prompt = list(range(100, 110))
    meta = _plan(sched, new=[_OlderRequestData(1, list(prompt), [3, 4, 5], 0, len(prompt), cache_salt_id=12345)])
    fp = base_fingerprint(sched._peer.geometry)
    saved = [k for op in meta.saves for k in op.keys]
    assert saved == block_keys(fp, 12345, prompt, TPB)[:2] != block_keys(fp, None, prompt, TPB)[:2]


def test_a_request_ended_before_the_metadata_that_carries_its_load_does_not_load(pair, monkeypatch):
    """Its load was queued by update_state_after_alloc; sent with a later iteration's metadata, it
    would write pages the runtime freed when the request ended (and may have given to another)."""
    from gds_kv_connector.store.base import open_store
    from gds_kv_connector.format.records import ZERO_KEY

    monkeypatch.setenv("TLLM_GDS_KV_ASYNC_LOAD_BYTES", "1GiB")
    sched, worker = pair()
    prompt = list(range(300, 310))  # two full blocks and two tokens
    keys = block_keys(base_fingerprint(sched._peer.geometry), None, prompt, TPB)
    data = torch.zeros(worker.pool.payload_len, dtype=torch.uint8)
    assert not open_store(worker.pool, worker.transfers.engine).save(keys, [ZERO_KEY, keys[0]], [data] * 2).failed
    req = SimRequest(5, prompt, tokens=list(prompt))
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * TPB, False)
    sched.update_state_after_alloc(req, [3, 4, 5])
    sched.request_finished(req, [3, 4, 5])
    meta = _plan(sched)
    assert not (meta and meta.loads)


def test_a_decode_report_of_a_request_without_state_saves_nothing(pair, monkeypatch):
    """A request whose state request_reset dropped, reported again as cached rather than new: its
    report carries only the tokens and pages since the last one, and keys made from those would
    name the KV of another prefix."""
    monkeypatch.setenv("TLLM_GDS_KV_SAVE_GENERATED", "eager")
    sched, _ = pair()
    tokens = list(range(400, 408))  # two full blocks of some later position's tokens
    meta = _plan(sched, cached=[RequestData(9, tokens, [5, 6], 40, len(tokens))])
    assert not (meta and meta.saves)

"""When generated blocks are saved (``TLLM_GDS_KV_SAVE_GENERATED``).

``finish`` (the default with one worker) folds no decode report: the blocks a request generated are
saved when it finishes, from its final tokens and page ids. It must save exactly the blocks, keys,
parents and pages that ``eager`` saves one by one, and still save prompt blocks as chunked prefill
computes them.
"""

from types import SimpleNamespace

import pytest

from tests.support.connector_helpers import CountedRequest, plan
from gds_kv_connector.format.keys import base_fingerprint, block_keys
from gds_kv_connector.format.records import ZERO_KEY
from gds_kv_connector.config.settings import Settings
from gds_kv_connector.connector.trtllm_api import RequestData, SchedulerOutput
from tests.support.api_shapes import both_apis  # noqa: E402,F401 (the fixture, used through pytestmark)

pytestmark = pytest.mark.usefixtures("both_apis")

TPB = 4


@pytest.fixture
def connector(connector_pair, monkeypatch):
    def make(mode: str, **llm_kw):
        monkeypatch.setenv("TLLM_GDS_KV_SAVE_GENERATED", mode)
        sched, _ = connector_pair("sched-save-generated", (64, 1, 2, 1024), TPB, **llm_kw)
        delivered = []
        sched._connect().deliver_saves = delivered.extend  # a finished request's saves, handed over
        return sched, delivered

    return make


class _Req(SimpleNamespace):
    """A request without ``get_token``: its end reads the whole token list (``CountedRequest`` has it)."""

    def get_tokens(self, beam=0):
        return list(self.tokens)

    def get_num_tokens(self, beam=0):
        return len(self.tokens)


def _meta(sched, new=(), cached=()):
    return plan(sched, SchedulerOutput(new_requests=list(new), cached_requests=list(cached)))


def _triples(ops):
    return [t for op in ops for t in zip(op.keys, op.parents, op.block_ids)]


def _drive(sched, delivered, rid, prompt, generated, chunk, finish=True):
    """One request in TensorRT-LLM's order: the match, its prompt in chunks of ``chunk`` tokens, one
    decode step per generated token after the first (each forwards the last token), then
    ``request_finished``. Returns the saves of each iteration and those handed over at the end."""
    pages = list(range(10, 10 + len(prompt) // TPB + len(generated) // TPB + 2))
    req = _Req(request_id=rid, tokens=list(prompt))
    sched.get_num_new_matched_tokens(req, 0)
    per_iter = []
    given = -(-min(chunk, len(prompt)) // TPB)
    rd = RequestData(request_id=rid, new_tokens=list(prompt), new_block_ids=pages[:given], computed_position=0,
                     num_scheduled_tokens=min(chunk, len(prompt)))
    per_iter.append(_triples(_meta(sched, new=[rd]).saves))
    done = min(chunk, len(prompt))
    while done < len(prompt):  # later chunks: cached reports with the pages they need
        n = min(chunk, len(prompt) - done)
        need = -(-(done + n) // TPB)
        rd = RequestData(request_id=rid, new_tokens=[], new_block_ids=pages[given:need], computed_position=done,
                         num_scheduled_tokens=n)
        given = need
        per_iter.append(_triples(_meta(sched, cached=[rd]).saves))
        done += n
    if not finish:
        return per_iter, req, pages[:given]
    for i, tok in enumerate(generated):
        req.tokens.append(tok)  # sampled by the last forward
        if i == len(generated) - 1:
            break  # the last token is never forwarded
        pos = len(req.tokens) - 1
        need = pos // TPB + 1
        rd = RequestData(request_id=rid, new_tokens=[tok], new_block_ids=pages[given:need], computed_position=pos,
                         num_scheduled_tokens=1)
        given = max(given, need)
        per_iter.append(_triples(_meta(sched, cached=[rd]).saves))
    delivered.clear()
    sched.request_finished(req, pages[:given])
    return per_iter, _triples(delivered), pages


@pytest.mark.parametrize("prompt_len,gen,chunk", [(10, 11, 64), (9, 24, 64), (13, 3, 5), (8, 1, 64), (17, 16, 4)])
def test_finish_saves_what_eager_saves(connector, prompt_len, gen, chunk):
    prompt = list(range(100, 100 + prompt_len))
    generated = list(range(900, 900 + gen))
    runs = {}
    for rid, mode in enumerate(("eager", "finish")):
        sched, delivered = connector(mode)
        runs[mode] = _drive(sched, delivered, rid, prompt, generated, chunk)
    tokens = prompt + generated
    keys = block_keys(base_fingerprint(sched._peer.geometry), None, tokens, TPB)
    pages = runs["finish"][2]
    want = [(keys[b], keys[b - 1] if b else ZERO_KEY, pages[b]) for b in range((len(tokens) - 1) // TPB)]
    for mode, (per_iter, at_end, _) in runs.items():
        assert [t for it in per_iter for t in it] + at_end == want, mode
    prompt_iters = -(-prompt_len // chunk)
    eager_iters, finish_iters = runs["eager"][0], runs["finish"][0]
    # prompt blocks go out in the iteration their chunk completes, in both modes
    assert finish_iters[:prompt_iters] == eager_iters[:prompt_iters]
    # no decode iteration saves anything in finish mode: generated blocks go at the end
    assert not any(finish_iters[prompt_iters:])
    n_prompt_saved = sum(len(it) for it in finish_iters[:prompt_iters])
    assert len(runs["finish"][1]) == len(want) - n_prompt_saved


class _Untouchable:
    """A decode report whose every field but the id raises: the finish mode must not read them."""

    def __init__(self, rid):
        self.request_id = rid

    def __getattr__(self, name):
        raise AssertionError(f"decode report field {name} was read")


def test_finish_reads_no_decode_report_of_a_decoding_request(connector):
    sched, delivered = connector("finish")
    prompt = list(range(10))
    _drive(sched, delivered, 1, prompt, [], 64, finish=False)  # prompt computed in one report
    state = sched._reqs[1]
    tokens, kv_end = list(state.tokens), state.kv_end
    assert not _meta(sched, cached=[_Untouchable(1)]).saves  # nothing else prefilling: not even the id
    # another request in chunked prefill: reports are sifted by id, and only its own is folded
    other = list(range(50, 63))
    sched.get_num_new_matched_tokens(_Req(request_id=2, tokens=other), 0)
    rd = RequestData(request_id=2, new_tokens=other, new_block_ids=[12], computed_position=0, num_scheduled_tokens=4)
    assert [t[2] for t in _triples(_meta(sched, new=[rd]).saves)] == [12]  # its first chunk's block at once
    rd = RequestData(request_id=2, new_tokens=[], new_block_ids=[13], computed_position=4, num_scheduled_tokens=4)
    saves = _triples(_meta(sched, cached=[_Untouchable(1), rd]).saves)
    assert [t[2] for t in saves] == [13]
    assert (state.tokens, state.kv_end) == (tokens, kv_end)


def test_finish_during_prefill_saves_only_computed_blocks(connector):
    """A request that ends before its prompt is computed (cancelled between chunks): its KV covers
    only the chunks reported, whatever its token count says."""
    for mode in ("eager", "finish"):
        sched, delivered = connector(mode)
        prompt = list(range(200, 220))
        req = _Req(request_id=3, tokens=list(prompt))
        sched.get_num_new_matched_tokens(req, 0)
        rd = RequestData(request_id=3, new_tokens=list(prompt), new_block_ids=[20, 21], computed_position=0,
                         num_scheduled_tokens=6)
        first = _triples(_meta(sched, new=[rd]).saves)
        delivered.clear()
        sched.request_finished(req, [20, 21])
        assert [t[2] for t in first] == [20] and _triples(delivered) == [], mode  # block 1 half computed


def test_auto_is_finish_with_one_worker_and_eager_under_plain_tp(connector):
    prompt = list(range(300, 310))
    generated = list(range(700, 707))
    for kw, decode_saves in (({}, False), ({"attention_dp": True, "tp_size": 2}, False),
                             ({"attention_dp": False, "tp_size": 2}, True)):
        sched, delivered = connector("auto", **kw)
        per_iter, _, _ = _drive(sched, delivered, 4, prompt, generated, 64)
        assert any(per_iter[1:]) is decode_saves, kw


def test_a_bad_value_is_refused_at_start_up(pool_env, monkeypatch):
    monkeypatch.setenv("TLLM_GDS_KV_SAVE_GENERATED", "later")
    with pytest.raises(ValueError, match="SAVE_GENERATED.*must be one of auto, finish, eager"):
        Settings.load_from()


@pytest.mark.parametrize("mode", ["eager", "finish"])
def test_a_long_request_reads_only_its_new_tokens_at_the_end(connector, mode):
    """Saving the few generated blocks of a long prompt reads those tokens one by one, not the whole
    list (TensorRT-LLM converts every token of it); the saves are those made from the whole list.
    A request whose last held token differs is read whole, as before. Eager saving meets the same
    case when the last reports carried no tokens."""
    sched, delivered = connector(mode)
    prompt = list(range(1000, 1000 + 40 * TPB + 2))  # 40 full blocks and two tokens, held
    generated = list(range(5000, 5000 + 2 * TPB))  # completes two more blocks
    pages = list(range(43))
    req = CountedRequest(7, list(prompt))
    sched.get_num_new_matched_tokens(req, 0)
    rd = RequestData(request_id=7, new_tokens=list(prompt), new_block_ids=pages[:40], computed_position=0,
                     num_scheduled_tokens=len(prompt))
    first = _triples(_meta(sched, new=[rd]).saves)
    if mode == "eager":  # its reports say the KV is written but carry no tokens (the overlap scheduler's lag)
        _meta(sched, cached=[RequestData(request_id=7, new_tokens=[], new_block_ids=pages[40:], computed_position=
                                         len(prompt), num_scheduled_tokens=len(generated) + 1)])
    req.tokens += generated
    req.whole = 0
    sched.request_finished(req, pages)
    keys = block_keys(base_fingerprint(sched._peer.geometry), None, req.tokens, TPB)
    assert len(first) == 40
    assert _triples(delivered) == [(keys[b], keys[b - 1], pages[b]) for b in (40, 41)]
    assert req.whole == 0 and req.single == len(generated) + 1  # the tail and one check of the held token

    delivered.clear()
    other = CountedRequest(8, list(prompt))
    sched.get_num_new_matched_tokens(other, 0)
    _meta(sched, new=[RequestData(request_id=8, new_tokens=list(prompt), new_block_ids=pages[:40],
                                  computed_position=0, num_scheduled_tokens=len(prompt))])
    other.tokens = prompt[:-1] + [7] + generated  # its last held token changed: read whole, nothing saved
    other.whole = 0
    sched.request_finished(other, pages)
    assert other.whole == 1 and delivered == []


@pytest.mark.parametrize("mode", ["eager", "finish"])
def test_with_the_overlap_scheduler_every_block_with_kv_is_saved(pool_env, monkeypatch, mode):
    """The overlap scheduler reports a sampled token one step late, so eager saving's last report
    did not cover the final forward's KV: its last full block was never saved."""
    import random

    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    from gds_kv_connector.simulator import ExecutorConfig, ModelShape, ReferenceExecutor, SimRequest, fake_llm_args

    monkeypatch.setenv("TLLM_GDS_KV_SAVE_GENERATED", mode)
    shape = ModelShape(num_layers=1, kv_factor=2, block_elems=128, tokens_per_block=TPB)

    def run(req, overlap):
        la = fake_llm_args(TPB, model="overlap-saves")
        ex = ReferenceExecutor(GdsKvConnectorScheduler(la), GdsKvConnectorWorker(la),
                               ExecutorConfig(shape=shape, num_blocks=64, overlap=overlap))
        try:
            ex.submit(req)
            ex.run_until_done()
            for _ in range(3):  # the finished request's saves complete
                ex.step()
            return ex
        finally:
            ex.worker.shutdown()

    rng = random.Random(1)
    ex = run(SimRequest(0, [rng.randrange(30000) for _ in range(22)], max_new_tokens=7), overlap=True)
    conversation = ex.reqs[0].tokens  # 29 tokens, the last one's KV never computed: 7 full blocks
    assert ex.worker.stats.snapshot().get("blocks_saved") == 7
    again = run(SimRequest(1, conversation + [5], max_new_tokens=1), overlap=False)
    assert again.stats.loaded_tokens == 7 * TPB

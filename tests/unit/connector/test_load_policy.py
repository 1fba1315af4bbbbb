"""TLLM_GDS_KV_LOAD_POLICY: a matched prefix is loaded only when that beats computing it.

The decision runs through the reference executor against a real worker and pool, on a simulated
clock: every byte the pool reads advances it at the pool's bandwidth (a fake slow or fast pool),
every token a forward computes at a fixed prefill speed, so the rates the worker measures, and the
bandwidth at which the decision flips, are exact.  KV of 128 KiB per token (Llama-3.1-8B in bf16:
32 layers x 2 x 8 KV heads x 128) at 40k prefill tokens per second break even at 5.2 GB/s.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
from gds_kv_connector.connector.load_policy import REPROBE_S, ForwardClock, ForwardCost, LoadEstimates, LoadPolicy, LoadRate
from gds_kv_connector.engines.fileops import FileOps
from gds_kv_connector.simulator import ExecutorConfig, ModelShape, ReferenceExecutor, SimRequest, State, fake_llm_args
from tests.support.connector_helpers import rand_tokens

TPB = 16
BYTES_PER_TOKEN = 128 << 10
# 2 layers x K/V x block_elems bf16 elements = 128 KiB per token
SHAPE = ModelShape(num_layers=2, kv_factor=2, block_elems=BYTES_PER_TOKEN * TPB // 8, tokens_per_block=TPB)
PREFILL_TOKENS_PER_S = 40_000.0
BREAK_EVEN = BYTES_PER_TOKEN * PREFILL_TOKENS_PER_S  # bytes/s


class SimClock:
    """A clock that moves only when told to (from any thread)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class PacedReads(FileOps):
    """A pool whose reads take ``bytes / bandwidth`` simulated seconds."""

    def __init__(self, clock: SimClock, bandwidth: float) -> None:
        self.clock, self.bandwidth = clock, bandwidth

    def preadv(self, fd: int, buf, offset: int) -> int:
        n = super().preadv(fd, buf, offset)
        self.clock.advance(n / self.bandwidth)
        return n


class PacedExecutor(ReferenceExecutor):
    """The reference executor whose forwards take ``tokens / PREFILL_TOKENS_PER_S`` simulated seconds."""

    def __init__(self, scheduler, worker, config, clock: SimClock) -> None:
        self.clock = clock
        super().__init__(scheduler, worker, config)

    def _forward(self, batch) -> None:
        before = self.stats.computed_tokens
        super()._forward(batch)  # its first layer hook starts the worker's timing, wait_for_save ends it
        self.clock.advance((self.stats.computed_tokens - before) / PREFILL_TOKENS_PER_S)


class SlowAfterLoad(PacedExecutor):
    """A paced executor where a loaded prefix costs its request more than its bytes: the first
    forward after a load takes ``AFTER_LOAD_S`` longer than its tokens', and a parked request's
    forward starts ``RESUME_S`` after the poll that reported its load."""

    AFTER_LOAD_S, RESUME_S = 0.004, 0.002

    def _forward(self, batch) -> None:
        first_after_load = any(r.external and r.pos == r.external for r in batch)
        super()._forward(batch)
        if first_after_load:  # before wait_for_save: inside the forward the worker times
            self.clock.advance(self.AFTER_LOAD_S)

    def _poll_finished(self) -> None:
        parked = [r for r in self.reqs.values() if r.state is State.PARKED]
        super()._poll_finished()
        if any(r.state is not State.PARKED for r in parked):
            self.clock.advance(self.RESUME_S)


@pytest.fixture
def rig(pool_env, monkeypatch):
    """``make(bandwidth, policy="latency", executor=PacedExecutor, **env) -> (executor, clock)``, each
    over a pool of its own; workers shut down at the end."""
    made = []

    def make(bandwidth: float, policy: str = "latency", executor=PacedExecutor, **env):
        monkeypatch.setenv("TLLM_GDS_KV_ROOT", str(pool_env / f"pool{len(made)}"))
        monkeypatch.setenv("TLLM_GDS_KV_LOAD_POLICY", policy)
        for k, v in env.items():
            monkeypatch.setenv(f"TLLM_GDS_KV_{k.upper()}", str(v))
        clock = SimClock()
        llm_args = fake_llm_args(TPB)
        worker = GdsKvConnectorWorker(llm_args, fileops=PacedReads(clock, bandwidth), clock=clock)
        made.append(worker)
        ex = executor(GdsKvConnectorScheduler(llm_args), worker, ExecutorConfig(shape=SHAPE, num_blocks=48), clock)
        return ex, clock
    yield make
    for w in made:
        w.shutdown()


def loaded(ex: ReferenceExecutor, prompt: list[int], rid: int) -> int:
    """Serve ``prompt`` as request ``rid``; the tokens it loaded from the pool."""
    before = ex.stats.loaded_tokens
    ex.submit(SimRequest(rid, prompt, max_new_tokens=2))
    ex.run_until_done()
    return ex.stats.loaded_tokens - before


def warmed(ex: ReferenceExecutor) -> list[list[int]]:
    """Three prompts of different lengths computed and saved (the compute fit sees three shapes), then
    the longest served again: nothing measured the pool yet, so it is loaded, which measures it."""
    prompts = [rand_tokens(n, seed) for n, seed in ((48, 1), (96, 2), (160, 3))]
    for i, p in enumerate(prompts):
        assert loaded(ex, p, i) == 0
    assert loaded(ex, prompts[2], 10) == 144  # the optimistic probe
    return prompts


def test_a_slow_pool_recomputes_and_a_fast_pool_loads(rig):
    slow, _ = rig(bandwidth=1e9)
    prompts = warmed(slow)
    saved = slow.worker.stats.snapshot().get("blocks_saved", 0)
    assert loaded(slow, prompts[1], 20) == 0  # 10 MiB at 1 GB/s = 10.5 ms > 80 tokens at 40k/s = 2 ms
    stats = slow.worker.stats.snapshot()
    assert stats["policy_loads_declined"] == 1 and stats["policy_blocks_declined"] == 5
    assert stats.get("blocks_saved", 0) == saved  # the recomputed prefix is in the pool: not saved again
    fast, _ = rig(bandwidth=50e9)
    prompts = warmed(fast)
    assert loaded(fast, prompts[1], 20) == 80
    assert "policy_loads_declined" not in fast.worker.stats.snapshot()


@pytest.mark.parametrize("factor,loads", [(0.8, False), (0.95, False), (1.05, True), (1.25, True)])
def test_the_decision_flips_at_the_break_even_bandwidth(rig, factor, loads):
    """Load time bytes / bandwidth against compute time tokens / prefill speed: they cross where the
    bandwidth is KV bytes per token times prefill tokens per second, whatever the prompt's length."""
    ex, _ = rig(bandwidth=factor * BREAK_EVEN)
    prompts = warmed(ex)
    assert loaded(ex, prompts[0], 20) == (32 if loads else 0)
    assert loaded(ex, prompts[1], 21) == (80 if loads else 0)


def test_measured_figures_are_the_pool_and_prefill_speeds(rig):
    ex, _ = rig(bandwidth=2e9)
    warmed(ex)
    est = ex.worker.estimates
    assert est.rate.bytes_per_s() == pytest.approx(2e9, rel=0.01)  # the block headers read too: just below
    assert est.forwards.cost.prefill_s(0, 4000) == pytest.approx(0.1, rel=1e-3)
    assert est.rate.queued_bytes == 0  # every load batch settled


def test_throughput_loads_asynchronously_even_from_a_slow_pool(rig):
    """A parked request's load costs the GPU nothing: only a synchronous load (the whole batch's forward
    waits for it) must beat computing."""
    ex, _ = rig(bandwidth=1e9, policy="throughput")
    prompts = warmed(ex)
    assert loaded(ex, prompts[1], 20) == 80  # 10 MiB > TLLM_GDS_KV_ASYNC_LOAD_BYTES: asynchronous
    sync, _ = rig(bandwidth=1e9, policy="throughput", async_load_bytes="1GiB")
    prompts = warmed(sync)
    assert loaded(sync, prompts[1], 20) == 0


def test_no_policy_loads_what_would_outlast_half_the_deadline(rig):
    ex, _ = rig(bandwidth=10e6, policy="throughput", deadline_s=1.0)  # 10 MiB at 10 MB/s: 1 s
    prompts = warmed(ex)
    assert loaded(ex, prompts[1], 20) == 0


def test_a_pool_unmeasured_for_a_while_is_probed_again(rig):
    ex, clock = rig(bandwidth=1e9)
    prompts = warmed(ex)
    assert loaded(ex, prompts[1], 20) == 0
    clock.advance(REPROBE_S + 1)
    assert loaded(ex, prompts[1], 21) == 80  # measured again: still slow
    assert loaded(ex, prompts[1], 22) == 0


def test_always_measures_nothing(pool_env):
    worker = GdsKvConnectorWorker(fake_llm_args(TPB))
    worker.register_kv_caches(torch.zeros((4, 2, 2, 256)))
    try:
        assert worker.estimates is None and worker.transfers._load_meter is None
    finally:
        worker.shutdown()


def test_load_rate_counts_overlapping_batches_once_and_drops_failed_periods():
    clock = SimClock()
    rate = LoadRate("test", clock)
    rate.started()
    clock.advance(0.1)
    rate.started()
    clock.advance(0.1)
    rate.ended(100 << 20)
    clock.advance(0.2)
    rate.ended(300 << 20)  # 400 MiB over the 0.4 s at least one batch ran
    assert rate.bytes_per_s() == pytest.approx((400 << 20) / 0.4)
    rate.started()
    clock.advance(10.0)
    rate.ended(0)  # failed: its time without bytes would read as a slow pool
    assert rate.bytes_per_s() == pytest.approx((400 << 20) / 0.4)
    rate.queue(1 << 30)
    assert rate.seconds_for(1 << 30) == pytest.approx((2 << 30) / ((400 << 20) / 0.4))
    clock.advance(REPROBE_S + 1)
    assert rate.bytes_per_s() is None and rate.seconds_for(1) is None


def test_each_parked_load_reports_its_time_from_acceptance_to_the_poll(rig):
    """The manager times every asynchronous load from its acceptance to the poll that settles it,
    behind the bytes queued ahead of it and its own: the samples of a parked load's fixed cost."""
    ex, _ = rig(bandwidth=2e9)
    rate = ex.worker.estimates.rate
    calls = []
    settled = rate.settled
    rate.settled = lambda seconds, nbytes: (calls.append((seconds, nbytes)), settled(seconds, nbytes))
    warmed(ex)  # one load: the probe of 9 blocks, above TLLM_GDS_KV_ASYNC_LOAD_BYTES
    assert len(calls) == 1
    seconds, nbytes = calls[0]
    assert nbytes == 9 * ex.worker.pool.payload_len
    assert seconds >= nbytes / 2e9  # its reads alone advanced the clock this far
    assert rate.fixed_s() == pytest.approx(max(0.0, seconds - nbytes / rate.bytes_per_s()))


def test_load_rate_fixed_cost_of_parked_loads():
    clock = SimClock()
    rate = LoadRate("test", clock)
    rate.settled(1.0, 1 << 20)  # no rate measured yet: nothing to subtract its bytes with
    assert rate.fixed_s() == 0.0
    rate.started()
    clock.advance(0.01)
    rate.ended(10_000_000)  # 1 GB/s
    rate.settled(0.01 + 0.02, 10_000_000)
    assert rate.fixed_s() == pytest.approx(0.02)
    assert rate.seconds_for(10_000_000, parked=True) == pytest.approx(0.03)
    assert rate.seconds_for(10_000_000) == pytest.approx(0.01)  # a synchronous load is not parked
    rate.settled(0.005, 10_000_000)  # faster than its bytes: no negative cost
    assert rate.fixed_s() == pytest.approx(0.8 * 0.02 / 1.8)


def test_a_parked_load_costs_its_fixed_part_so_a_short_prefix_is_computed():
    """At 50 GB/s a 1k-token prefix of 128 KiB per token loads in 2.7 ms and computes in 25 ms; with
    30 ms from a parked load's acceptance to its request's resume beyond that, computing it is
    sooner; a 4k one (10.7 ms of bytes, 100 ms of compute) still loads, and a synchronous load
    (no parking) of the 1k one too."""
    clock = SimClock()
    rate = LoadRate("test", clock)
    rate.started()
    clock.advance(1.0)
    rate.ended(50_000_000_000)
    rate.settled(0.030 + 0.1, 5_000_000_000)
    cost = ForwardCost()
    for n in (1024, 4096, 16384):
        cost.add(0.005 + 25e-6 * n, n, 0)
    policy = LoadPolicy("latency", LoadEstimates(rate, ForwardClock(cost, lambda s: None, lambda a, b: None)),
                        block_bytes=TPB * BYTES_PER_TOKEN, tokens_per_block=TPB, deadline_s=60.0)
    assert not policy.offers(0, 1024 // TPB, is_async=True)
    assert policy.offers(0, 4096 // TPB, is_async=True)
    assert policy.offers(0, 1024 // TPB, is_async=False)


def test_forward_cost_separates_fixed_token_and_attention_cost():
    cost = ForwardCost()
    fixed, per_token, per_pair = 2e-3, 25e-6, 4e-10
    for n in (1024, 4096, 16384, 65536):
        cost.add(fixed + per_token * n + per_pair * n * (n + 1) / 2, n, n * (n + 1) // 2)
    # a 32k prefix after 1k computed tokens: the fixed part is paid by the forward either way
    pairs = 32768 * 1024 + 32768 * 32769 // 2
    assert cost.prefill_s(1024, 32768) == pytest.approx(per_token * 32768 + per_pair * pairs, rel=1e-3)


def test_forward_cost_with_one_shape_seen_costs_tokens_linearly():
    cost = ForwardCost()
    cost.add(1.0, 32768, 32768 * 32769 // 2)
    assert cost.prefill_s(0, 32768) == pytest.approx(1.0, rel=1e-3)
    assert cost.prefill_s(0, 16384) == pytest.approx(0.5, rel=0.02)


def test_what_a_load_costs_after_its_bytes_is_learned_and_a_short_prefix_computed(rig):
    """At 50 GB/s an 80-token prefix's bytes take 0.2 ms against 2 ms of compute, but its request
    resumes 2 ms after the poll and its first forward takes 4 ms more than its tokens': the policy
    learns that from the probe's load and computes it; a 640-token one (1.7 ms of bytes, 16 ms of
    compute) still loads.  The slow forward after a load is not a compute sample: the prefill fit
    stays exact."""
    ex, _ = rig(bandwidth=50e9, executor=SlowAfterLoad)
    prompts = warmed(ex)
    forwards = ex.worker.estimates.forwards
    assert forwards.after_load_s(parked=False) == pytest.approx(SlowAfterLoad.AFTER_LOAD_S, rel=0.05)
    assert forwards.after_load_s(parked=True) == pytest.approx(SlowAfterLoad.AFTER_LOAD_S + SlowAfterLoad.RESUME_S,
                                                                rel=0.05)
    assert forwards.cost.prefill_s(0, 4000) == pytest.approx(0.1, rel=1e-3)
    assert loaded(ex, prompts[1], 20) == 0
    long = rand_tokens(648, 4)
    assert loaded(ex, long, 21) == 0  # computed and saved
    assert loaded(ex, long, 22) == 640
    # the same pool and forwards without the cost after a load: the short prefix loads
    fast, _ = rig(bandwidth=50e9)
    prompts = warmed(fast)
    assert fast.worker.estimates.forwards.after_load_s(parked=True) == pytest.approx(0.0, abs=1e-9)
    assert loaded(fast, prompts[1], 20) == 80


def test_forward_clock_keeps_a_loaded_requests_forward_out_of_the_fit():
    clock = SimClock()
    cost = ForwardCost()
    forwards = ForwardClock(cost, lambda stream: clock(), lambda start, end: end - start, clock)

    def forward(tokens: int, seconds: float, before: int = 0, after_load: tuple[int, ...] = ()) -> None:
        forwards.note_work([(before, tokens, True)], after_load)
        forwards.begin(None)
        clock.advance(seconds)
        forwards.end(None)
    assert forwards.after_load_s(parked=True) == 0.0
    forward(32, 0.010, before=992, after_load=(1,))  # nothing fitted yet: no figure to subtract
    assert forwards.after_load_s(parked=True) == 0.0 and cost.samples == 0
    for n in (1024, 4096, 16384):
        forward(n, 0.005 + 25e-6 * n)
    fit = cost.coefficients()
    forwards.loads_reported([7])
    clock.advance(0.003)  # the parked request's forward starts 3 ms after its load's report
    forward(32, 0.005 + 25e-6 * 32 + 0.010, before=992, after_load=(7,))
    assert cost.samples == 3 and cost.coefficients() == fit
    assert forwards.after_load_s(parked=False) == pytest.approx(0.010, abs=2e-4)
    assert forwards.after_load_s(parked=True) == pytest.approx(0.013, abs=2e-4)
    # a prefix reservation's report resumes the request it was made for; a synchronously loaded
    # request (never reported) adds its forward's part only
    forwards.expect_reservation(40, 9)
    forwards.loads_reported((), [40])
    clock.advance(0.003)
    forward(32, 0.005 + 25e-6 * 32 + 0.010, before=992, after_load=(9,))
    forward(32, 0.005 + 25e-6 * 32 + 0.010, before=992, after_load=(11,))
    assert forwards.after_load_s(parked=True) == pytest.approx(0.013, abs=2e-4)
    assert cost.samples == 3

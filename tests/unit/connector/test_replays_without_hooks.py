"""Replays as TensorRT-LLM does them: no ``request_reset``, no ``cancel_load``.

After a rollback or a failed admission the manager destroys the allocation (its pages are free at
once, and hold another request's KV by the next forward) and queries the same request id again from
scratch.  The reference executor does exactly that (``drop_after_alloc``, ``roll_back``) with
``scribble_freed``: a freed page is overwritten at once and checked untouched when allocated again,
so a connector that writes a free page fails the run, and one that saves from a freed page
publishes the scribble, which the byte-exact check of every later load catches.  Each scenario runs
under both manager shapes, then a restart loads every prompt again and checks each loaded block.
"""

from __future__ import annotations

import pytest

from tests.support import gated_ops as go
from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
from gds_kv_connector.format.keys import base_fingerprint, block_keys
from gds_kv_connector.simulator import ExecutorConfig, ModelShape, ReferenceExecutor, SimRequest, fake_llm_args

TPB = 4
SHAPE = ModelShape(num_layers=1, kv_factor=2, block_elems=128, tokens_per_block=TPB)
PROMPT = [1000 + i for i in range(26)]  # six full blocks and two tokens
OTHER = [5000 + i for i in range(18)]
APIS = ["release", "newest"]


def _executor(cls=ReferenceExecutor, api="release", fileops=None, chunk_size=None, num_blocks=48):
    la = fake_llm_args(TPB, model="replays")
    worker = GdsKvConnectorWorker(la, fileops=fileops)
    cfg = ExecutorConfig(shape=SHAPE, num_blocks=num_blocks, chunk_size=chunk_size, api=api, scribble_freed=True)
    return cls(GdsKvConnectorScheduler(la), worker, cfg)


def _finish(ex: ReferenceExecutor) -> None:
    """Drain the worker, then check no free page was written meanwhile."""
    try:
        ex.worker.shutdown()
    finally:
        checked = ex.check_free_pages()
    print(f"free pages checked untouched: {checked}, pages found written while free: {ex.pages_written_free}")


def _restart_loads_everything(prompts: list[list[int]], first_id: int = 100) -> int:
    """A new server loads each prompt's saved prefix; the executor checks every loaded block byte
    for byte against its prefix's KV.  Returns the tokens loaded."""
    ex = _executor()
    try:
        for i, p in enumerate(prompts):
            ex.submit(SimRequest(first_id + i, p, max_new_tokens=1))
        stats = ex.run_until_done()
    finally:
        _finish(ex)
    print(f"restart: {stats.loaded_tokens} tokens loaded, {stats.blocks_verified} blocks verified byte-exact")
    return stats.loaded_tokens


def _fill_pool(prompts: list[list[int]]) -> None:
    ex = _executor(ReferenceExecutor)
    try:
        for i, p in enumerate(prompts):
            ex.submit(SimRequest(50 + i, p, max_new_tokens=1))
        ex.run_until_done()
    finally:
        _finish(ex)


def _settled(ex: ReferenceExecutor) -> bool:
    """No transfer of the worker is still running or queued."""
    return all(batch.future.done() for batch in ex.worker.transfers._inflight)


class RollBackFirstChunk(ReferenceExecutor):
    """Request 1's allocation is destroyed after its first (partial) prefill chunk, once, when the
    saves of that chunk are done (a save still reading the pages then is the case below)."""

    rolled = False

    def roll_back(self, req):
        if req.request_id == 1 and not self.rolled:
            go.wait_until(lambda: _settled(self), "the first chunk's saves")
            self.rolled = True
            return True
        return False


@pytest.mark.parametrize("api", APIS)
def test_a_replay_after_a_partial_first_chunk_saves_only_its_own_pages(pool_env, api):
    ex = _executor(RollBackFirstChunk, api, chunk_size=8)
    try:
        ex.submit(SimRequest(1, PROMPT, max_new_tokens=2))
        ex.submit(SimRequest(2, OTHER, max_new_tokens=2))  # takes the freed pages
        ex.run_until_done()
    finally:
        _finish(ex)
    assert ex.rolled
    assert _restart_loads_everything([PROMPT, OTHER]) == (6 + 4) * TPB


class DropAfterAlloc(ReferenceExecutor):
    """Request 1's first admission fails right after update_state_after_alloc (before the runtime
    committed it); its freed pages stay free for a while (at the back of the free list), where a
    write into them is caught when they are next allocated or checked at the end."""

    dropped = False

    def drop_after_alloc(self, req):
        if req.request_id == 1 and not self.dropped:
            self.dropped = True
            return True
        return False


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_load_queued_for_a_dropped_admission_never_writes_its_freed_pages(pool_env, monkeypatch, api, is_async):
    _fill_pool([PROMPT[:13]])  # blocks 0..2 of PROMPT in the pool
    monkeypatch.setenv("TLLM_GDS_KV_ASYNC_LOAD_BYTES", "1" if is_async else str(1 << 30))
    ex = _executor(DropAfterAlloc, api)
    try:
        ex.submit(SimRequest(1, PROMPT, max_new_tokens=1))
        ex.submit(SimRequest(2, OTHER, max_new_tokens=1))
        stats = ex.run_until_done()
    finally:
        _finish(ex)
    assert ex.dropped
    assert stats.loaded_tokens >= 3 * TPB  # the replay loaded the prefix (and checked it)
    assert _restart_loads_everything([PROMPT, OTHER]) == (6 + 4) * TPB


class RollBackWithSavesQueued(ReferenceExecutor):
    """Request 9 goes first and its save is held running on the only transfer thread; request 1's
    first chunk is computed behind it, its saves queued, and its allocation is then destroyed (its
    pages scribbled).  The held save is let go once request 1's replay was admitted again: the
    first sight of the id after the destruction, where the connector learns of it."""

    rolled = False
    gate: go.Gate | None = None

    def roll_back(self, req):
        if req.request_id == 1 and not self.rolled:
            self.rolled = True
            return True
        return False

    def step(self):
        super().step()
        if self.rolled and self.reqs[1].block_ids and self.gate is not None:
            self.gate.release()


@pytest.mark.parametrize("api", APIS)
def test_a_replay_s_first_attempt_saves_queued_are_never_written(pool_env, monkeypatch, api):
    monkeypatch.setenv("TLLM_GDS_KV_TRANSFER_THREADS", "1")
    monkeypatch.setenv("TLLM_GDS_KV_STAGE_AHEAD", "0")
    ops = go.GatedOps()
    ex = _executor(RollBackWithSavesQueued, api, fileops=ops, chunk_size=8)
    fp = base_fingerprint(ex.sched._connect().geometry)
    first_of_other = block_keys(fp, None, OTHER, TPB)[0]
    ex.gate = ops.hold(first_of_other)
    try:
        ex.submit(SimRequest(9, OTHER, max_new_tokens=1))
        ex.step()  # request 9's blocks computed; its save is taken by the transfer thread and held
        go.wait_until(lambda: ex.gate.started.is_set(), "request 9's save to start")
        ex.submit(SimRequest(1, PROMPT, max_new_tokens=2))
        ex.run_until_done()
    finally:
        ops.release_all()
        _finish(ex)
    assert ex.rolled
    assert _restart_loads_everything([PROMPT, OTHER]) == (6 + 4) * TPB

"""Build a connector pair and a reference executor for tests."""

from __future__ import annotations

import random
from types import SimpleNamespace

from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
from gds_kv_connector.connector.metadata import GdsKvMetadata
from gds_kv_connector.simulator import ExecutorConfig, ModelShape, ReferenceExecutor, SimRequest, fake_llm_args

SHAPE = ModelShape(num_layers=2, kv_factor=2, block_elems=1024, tokens_per_block=16)


def make_executor(cfg: ExecutorConfig | None = None, **kw) -> ReferenceExecutor:
    cfg = cfg or ExecutorConfig(shape=SHAPE, num_blocks=256, **kw)
    llm_args = fake_llm_args(cfg.shape.tokens_per_block)
    return ReferenceExecutor(GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args), cfg)


def plan(sched: GdsKvConnectorScheduler, scheduler_output) -> GdsKvMetadata:
    """``build_connector_meta``'s result, an empty plan where it returned None (nothing to do)."""
    meta = sched.build_connector_meta(scheduler_output)
    return GdsKvMetadata() if meta is None else meta


def rand_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def serve(ex: ReferenceExecutor, prompts: list[list[int]], max_new_tokens: int = 8, first_id: int = 0,
          salt: str | None = None, device_hit_blocks: int = 0):
    for i, p in enumerate(prompts):
        ex.submit(SimRequest(first_id + i, p, max_new_tokens=max_new_tokens, cache_salt=salt,
                             device_hit_blocks=device_hit_blocks))
    return ex.run_until_done()


class CountedRequest(SimpleNamespace):
    """TensorRT-LLM's request surface for reading tokens: a count (``get_num_tokens``), one token at a
    time (``get_token``) and the whole list (``get_tokens``, which the binding converts), each read
    counted in ``single`` and ``whole``."""

    def __init__(self, request_id: int, tokens: list[int]) -> None:
        super().__init__(request_id=request_id, tokens=tokens, whole=0, single=0)

    def get_tokens(self, beam: int = 0) -> list[int]:
        self.whole += 1
        return list(self.tokens)

    def get_token(self, beam: int, pos: int) -> int:
        self.single += 1
        return self.tokens[pos]

    def get_num_tokens(self, beam: int = 0) -> int:
        return len(self.tokens)

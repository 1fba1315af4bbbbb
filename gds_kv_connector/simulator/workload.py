"""Shared-prefix multi-round conversations, and owner processes that serve them.

Every conversation starts with the same system prompt; round ``r`` of a conversation is its
round ``r-1`` prompt plus the model's answer plus a new user turn.  Answers are a function of
the prompt (the reference model is deterministic), so the whole workload is computed up front
and any owner can serve any request.  Owners are separate processes (spawned, as TensorRT-LLM's
MPI workers are) that meet at a barrier between rounds so that one owner's saves are in the
pool before another owner's next round asks for them.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from gds_kv_connector.config.settings import SettingsError
from gds_kv_connector.simulator.executor import ExecutorConfig, ReferenceExecutor, RunStats, SimRequest
from gds_kv_connector.simulator.model import PrefixHashes, ReferenceModel


@dataclass(frozen=True)
class Workload:
    conversations: int = 6
    rounds: int = 3
    system_tokens: int = 480
    turn_tokens: int = 40
    answer_tokens: int = 24
    seed: int = 1234

    def prompts(self, model: ReferenceModel) -> list[list[list[int]]]:
        """prompts[round][conversation]."""
        rng = random.Random(self.seed)
        vocab = model.shape.vocab
        system = [rng.randrange(vocab) for _ in range(self.system_tokens)]
        history = [list(system) for _ in range(self.conversations)]
        out = []
        for _ in range(self.rounds):
            this_round = []
            for c in range(self.conversations):
                prompt = history[c] + [rng.randrange(vocab) for _ in range(self.turn_tokens)]
                this_round.append(prompt)
                history[c] = prompt + answer(model, prompt, self.answer_tokens)
            out.append(this_round)
        return out


def answer(model: ReferenceModel, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    hashes = PrefixHashes()
    for _ in range(n):
        hashes.extend_to(tokens, len(tokens))
        tokens.append(model.next_token(hashes.hashes[-1]))
    return tokens[len(prompt):]


# An owner's error when it stopped because another failed (the barrier between rounds broke): the
# other's error is the one to report
PEER_FAILED = "stopped: another owner failed"


@dataclass
class OwnerReport:
    owner: int
    rounds: list[dict[str, Any]] = field(default_factory=list)
    connector: dict[str, int] = field(default_factory=dict)
    data_path: str = ""
    error: str = ""


def serve_rounds(owner: int, owners: int, workload: Workload, cfg: ExecutorConfig, env: dict[str, str],
                 barrier: Any = None, progress: Any = None, rotate: bool = True) -> OwnerReport:
    """Serve this owner's share of every round with one connector; verify every answer.  Any failure,
    the connector's start included (a bad setting), ends up in the report's ``error`` as one line."""
    os.environ.update(env)
    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    from gds_kv_connector.simulator import fake_llm_args

    report = OwnerReport(owner)
    worker = None
    try:
        llm_args = fake_llm_args(cfg.shape.tokens_per_block, attention_dp=owners > 1)
        sched, worker = GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args)
        ex = ReferenceExecutor(sched, worker, cfg)
        report.data_path = worker.transfers.engine.data_path()
        prompts = workload.prompts(ex.model)
        for r, round_prompts in enumerate(prompts):
            before = RunStats(**asdict(ex.stats))
            before_io = worker.stats.snapshot()
            mine = [c for c in range(workload.conversations) if (c + (r if rotate else 0)) % owners == owner]
            for c in mine:
                ex.submit(SimRequest(request_id=r * 10_000 + c, prompt=round_prompts[c],
                                     max_new_tokens=workload.answer_tokens))
            t0 = time.perf_counter()
            ex.run_until_done()
            wall = time.perf_counter() - t0
            for c in mine:
                expected = answer(ex.model, round_prompts[c], workload.answer_tokens)
                if ex.output_tokens(r * 10_000 + c) != expected:
                    raise AssertionError(f"owner {owner}: wrong answer for conversation {c} round {r}")
            report.rounds.append(_round_delta(r, mine, before, ex.stats, before_io, worker.stats.snapshot(), wall))
            if progress is not None:
                progress.put(("round", (owner, r)))
            if barrier is not None:
                barrier.wait(timeout=300)
    except BaseException as exc:  # reported to the parent, which fails loudly
        report.error = describe_error(exc)
        if barrier is not None:
            barrier.abort()
    finally:
        if worker is not None and worker.transfers is not None:
            worker.shutdown()
            report.connector = worker.stats.snapshot()
    return report


def describe_error(exc: BaseException) -> str:
    """An owner's failure in one line: a bad setting's own message (it names the setting and what it
    allows), any other error's type and message."""
    if isinstance(exc, threading.BrokenBarrierError):
        return PEER_FAILED
    text = " ".join(str(exc).split())
    return text if isinstance(exc, SettingsError) else f"{type(exc).__name__}: {text}".rstrip(": ")


def _round_delta(r: int, mine: list[int], a: RunStats, b: RunStats, io_a: dict, io_b: dict,
                 wall: float) -> dict[str, Any]:
    def d(name: str) -> int:
        return getattr(b, name) - getattr(a, name)

    def io(name: str) -> int:
        return io_b.get(name, 0) - io_a.get(name, 0)

    return {"round": r, "requests": len(mine), "prompt_tokens": d("prompt_tokens"),
            "loaded_tokens": d("loaded_tokens"), "computed_tokens": d("computed_tokens"),
            "blocks_verified": d("blocks_verified"), "bytes_loaded": io("bytes_loaded"),
            "bytes_saved": io("bytes_saved"), "blocks_saved": io("blocks_saved"), "wall_s": wall}


def owner_process(owner: int, owners: int, workload: Workload, cfg: ExecutorConfig, env: dict[str, str],
                  barrier: Any, results: Any) -> None:
    """Entry point of a spawned owner process; progress and the final report go to ``results``."""
    results.put(("report", asdict(serve_rounds(owner, owners, workload, cfg, env, barrier, results))))

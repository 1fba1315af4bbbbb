"""The executor thread's connector-callback latency while an eviction pass runs in the same serving process,
against none, in one run.

The reference executor (``gds_kv_connector.simulator``) serves a steady CPU workload through a real scheduler
and worker on a host-memory pool: each round submits requests of which some repeat earlier prompts (loads)
and the rest are new (saves).  Every connector callback the executor makes is timed on the executor thread
(``ReferenceExecutor._timed``'s span, per call).  Phases, in this order, repeated ``--rounds`` times:

* ``none``: no maintenance, for ``--idle-s`` seconds;
* ``thread``: a :class:`~gds_kv_connector.maintenance.capacity.CapacityGuard` with ``runner="thread"`` runs
  one eviction pass in its thread, in this process, over a separate pool of ``--blocks`` tiny block files
  (chains of :data:`CHAIN` blocks) that must free nearly all of them; the phase lasts as long as the pass;
* ``process``: the same pass over an identical pool, with ``runner="process"`` (a child interpreter; the
  serving default, ``TLLM_GDS_KV_EVICT_RUNNER``).

The eviction pool is built again before each pass, between phases, off the clock.  Latencies are pooled per
phase over the rounds; each phase's p50 and p99 are also given per round, and ``ratio`` divides a phase's
figure by ``none``'s of the same run (``ratio_per_round``: by the ``none`` of the same round).  Beside the
callbacks: each whole iteration's latency (``step_*``, the executor's own Python included) and callbacks per
second served, where a pass that takes the GIL shows as well.  Output: a table, then one JSON line
(``--json PATH`` writes it too).

    .venv/bin/python profiling/executor_under_eviction.py [--blocks 40000] [--rounds 3] [--idle-s 6] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gds_kv_connector.format.records import ZERO_KEY, BlockHeader  # noqa: E402
from gds_kv_connector.maintenance.capacity import CapacityGuard  # noqa: E402
from gds_kv_connector.simulator import ExecutorConfig, ModelShape, ReferenceExecutor, SimRequest  # noqa: E402
from gds_kv_connector.simulator import fake_llm_args  # noqa: E402
from gds_kv_connector.store.pool import BlockPool  # noqa: E402

PHASES = ("none", "thread", "process")
TOKENS_PER_BLOCK = 16
LAYERS = 8
REQUESTS_PER_ROUND = 8
REPEATS_PER_ROUND = 6  # of the requests, how many replay an earlier prompt (loads); the rest save
NEW_TOKENS = 8
CHAIN = 8  # blocks per prompt chain in the eviction pool
EVICT_PAYLOAD = 64  # bytes: tiny files, so the pass is its per-file work (scan, headers, unlinks)
OLD_NS = 1_000_000_000  # the eviction pool's blocks were published long ago: all evictable
EVICT_KEEP_FRACTION = 0.05  # of the eviction pool's bytes, the pass's quota; it frees down to half of it


class RecordingExecutor(ReferenceExecutor):
    """The reference executor, with each callback's seconds (``_timed``'s span) appended to ``samples``."""

    def __init__(self, *args: Any) -> None:
        self.samples: list[float] = []  # before the base's __init__, which calls back already
        self.steps: list[float] = []  # seconds of each whole iteration (the executor's own Python too)
        super().__init__(*args)

    def step(self) -> None:
        t0 = time.perf_counter()
        super().step()
        self.steps.append(time.perf_counter() - t0)

    def _timed(self, fn, *args, layer_hook: bool = False):
        t0 = time.perf_counter()
        try:
            return super()._timed(fn, *args, layer_hook=layer_hook)
        finally:
            self.samples.append(time.perf_counter() - t0)


def build_evict_pool(root: str, blocks: int) -> int:
    """``blocks`` tiny block files in chains, published long ago; returns their bytes."""
    pool = BlockPool((root,), b"\x77" * 32, EVICT_PAYLOAD, TOKENS_PER_BLOCK, geometry_note="evict-bench")
    rng = random.Random(blocks)
    payload = b"\x5a" * EVICT_PAYLOAD
    parent = ZERO_KEY
    for i in range(blocks):
        key = rng.randbytes(32)
        if i % CHAIN == 0:
            parent = ZERO_KEY
        fd, tmp = pool.create_tmp(key, BlockHeader(pool.fingerprint, key, EVICT_PAYLOAD, 0, 1, TOKENS_PER_BLOCK,
                                                   OLD_NS, parent))
        os.pwrite(fd, payload, 4096)
        assert pool.publish(fd, tmp, key), "key clash in the eviction pool"
        os.utime(pool.path_for(key), ns=(OLD_NS, OLD_NS))
        parent = key
    return blocks * pool.file_size


class Workload:
    """Rounds of requests: repeats of earlier prompts (loads) and new prompts (saves)."""

    def __init__(self, ex: Any) -> None:
        self.ex = ex
        self.rng = random.Random(4321)
        self.prompt_tokens = 4 * TOKENS_PER_BLOCK + 5
        self.seen: list[list[int]] = []
        self.next_id = 0

    def _prompt(self) -> list[int]:
        return [self.rng.randrange(32000) for _ in range(self.prompt_tokens)]

    def round(self) -> None:
        prompts = [self.rng.choice(self.seen) for _ in range(min(REPEATS_PER_ROUND, len(self.seen)))]
        fresh = [self._prompt() for _ in range(REQUESTS_PER_ROUND - len(prompts))]
        self.seen = (self.seen + fresh)[-256:]  # a working set the pool keeps serving
        for p in prompts + fresh:
            self.ex.submit(SimRequest(self.next_id, p, max_new_tokens=NEW_TOKENS))
            self.next_id += 1
        self.ex.run_until_done()

    def serve_while(self, going: Callable[[], bool]) -> dict:
        """Serve rounds while ``going()``: the callback and iteration latencies meanwhile (seconds), and
        how long it served."""
        ex = self.ex
        ex.samples.clear()
        ex.steps.clear()
        t0 = time.perf_counter()
        while going():
            self.round()
        out = {"callbacks": list(ex.samples), "steps": list(ex.steps), "wall_s": time.perf_counter() - t0}
        ex.samples.clear()
        ex.steps.clear()
        return out


def run_pass(work: Workload, runner: str, base: str, blocks: int, tag: str) -> tuple[dict, dict]:
    """Serve while one eviction pass over a fresh pool runs with ``runner``; latencies and the pass's facts."""
    root = tempfile.mkdtemp(prefix=f"evict-{tag}-", dir=base)
    nbytes = build_evict_pool(root, blocks)
    guard = CapacityGuard([root], quota_bytes=max(1, int(nbytes * EVICT_KEEP_FRACTION)), low_watermark=0.5,
                          min_free_bytes=0, grace_s=0, check_interval_s=3600, runner=runner)
    done = threading.Event()
    gc.collect()
    t0 = time.perf_counter()
    waiter = threading.Thread(target=lambda: (guard.check_now(timeout=3600), done.set()), name="bench-waiter")
    waiter.start()
    samples = work.serve_while(lambda: not done.is_set())
    pass_s = time.perf_counter() - t0
    waiter.join()
    reports = guard.last_reports
    guard.close()
    facts = {"pass_s": round(pass_s, 3), "blocks": blocks, "failed_runs": guard.failed_runs,
             "evicted_blocks": sum(r.evicted_blocks for r in reports), "skipped": any(r.skipped for r in reports)}
    return samples, facts


def summarize(served: dict) -> dict:
    """Callback latency quantiles (us), iteration p50/p99 (us) and callbacks per second of one serving span."""
    s, steps = sorted(served["callbacks"]), sorted(served["steps"])
    if not s:
        return {"calls": 0}

    def q(xs: list[float], p: float) -> float:
        return round(1e6 * xs[min(len(xs) - 1, int(p * len(xs)))], 2)
    return {"calls": len(s), "p50_us": q(s, 0.50), "p99_us": q(s, 0.99), "p999_us": q(s, 0.999),
            "max_us": round(1e6 * s[-1], 2), "mean_us": round(1e6 * sum(s) / len(s), 2),
            "calls_per_s": round(len(s) / served["wall_s"], 1),
            "step_p50_us": q(steps, 0.50), "step_p99_us": q(steps, 0.99)}


RATIO_KEYS = ("p50_us", "p99_us", "p999_us", "calls_per_s", "step_p50_us", "step_p99_us")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=40_000, help="block files of the eviction pool")
    ap.add_argument("--rounds", type=int, default=3, help="times the three phases run, in turn")
    ap.add_argument("--idle-s", type=float, default=6.0, help="seconds of the 'none' phase")
    ap.add_argument("--quick", action="store_true", help="a small run that only shows it works (tests)")
    ap.add_argument("--json", default="", help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.rounds, args.idle_s = 1_500, 1, 0.5
    warm_rounds = 5 if args.quick else 20

    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    from gds_kv_connector.bench.executor import connector_env

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    per_round: dict[str, list[dict]] = {p: [] for p in PHASES}
    pooled: dict[str, dict] = {p: {"callbacks": [], "steps": [], "wall_s": 0.0} for p in PHASES}
    passes: dict[str, list[dict]] = {"thread": [], "process": []}
    with tempfile.TemporaryDirectory(dir=shm) as serve_root, tempfile.TemporaryDirectory() as evict_base, \
            connector_env(serve_root):
        shape = ModelShape(num_layers=LAYERS, kv_factor=2, block_elems=512, tokens_per_block=TOKENS_PER_BLOCK)
        cfg = ExecutorConfig(shape=shape, num_blocks=REQUESTS_PER_ROUND * 8 + 32, max_batch=REQUESTS_PER_ROUND)
        llm_args = fake_llm_args(TOKENS_PER_BLOCK, model="gdskv-executor-under-eviction")
        worker = GdsKvConnectorWorker(llm_args)
        ex = RecordingExecutor(GdsKvConnectorScheduler(llm_args), worker, cfg)
        try:
            work = Workload(ex)
            for _ in range(warm_rounds):  # warm: the working set saved, every path taken once
                work.round()
            for rnd in range(args.rounds):
                for phase in PHASES:
                    if phase == "none":
                        gc.collect()
                        end = time.perf_counter() + args.idle_s
                        samples = work.serve_while(lambda: time.perf_counter() < end)
                    else:
                        samples, facts = run_pass(work, phase, evict_base, args.blocks, f"{phase}{rnd}")
                        passes[phase].append(facts)
                    for k in ("callbacks", "steps", "wall_s"):
                        pooled[phase][k] += samples[k]
                    per_round[phase].append(summarize(samples))
                    print(f"round {rnd} {phase:8s} {per_round[phase][-1]}", file=sys.stderr, flush=True)
        finally:
            worker.shutdown()
    result: dict[str, Any] = {"blocks": args.blocks, "rounds": args.rounds, "idle_s": args.idle_s,
                              "cpus": os.cpu_count(), "phases": {}}
    base = summarize(pooled["none"])
    for phase in PHASES:
        s = summarize(pooled[phase])
        if phase != "none" and s["calls"] and base["calls"]:
            s["ratio"] = {k: round(s[k] / base[k], 3) for k in RATIO_KEYS}
            s["ratio_per_round"] = [{k: round(r[k] / b[k], 3) for k in RATIO_KEYS}
                                    for r, b in zip(per_round[phase], per_round["none"]) if r["calls"] and b["calls"]]
        s["per_round"] = per_round[phase]
        if phase in passes:
            s["passes"] = passes[phase]
        result["phases"][phase] = s
    print(f"{'phase':8s} {'calls':>7s} {'p50 us':>7s} {'p99 us':>7s} {'p99.9':>8s} {'max us':>9s} {'calls/s':>8s} "
          f"{'step p99':>9s}  p50/none p99/none calls/s/none  pass s")
    for phase in PHASES:
        s = result["phases"][phase]
        r = s.get("ratio", {})
        pass_s = "/".join(f"{p['pass_s']:.1f}" for p in s.get("passes", [])) or "-"
        print(f"{phase:8s} {s['calls']:7d} {s.get('p50_us', 0):7.1f} {s.get('p99_us', 0):7.1f} "
              f"{s.get('p999_us', 0):8.1f} {s.get('max_us', 0):9.1f} {s.get('calls_per_s', 0):8.0f} "
              f"{s.get('step_p99_us', 0):9.0f}  {r.get('p50_us', 1.0):8.3f} {r.get('p99_us', 1.0):8.3f} "
              f"{r.get('calls_per_s', 1.0):12.3f}  {pass_s}")
    line = json.dumps(result)
    print(line)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(line + "\n")
    return result


if __name__ == "__main__":
    main()

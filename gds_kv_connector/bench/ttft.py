"""gds-kv bench --ttft: time to first token when a prompt's prefix is computed, loaded from a
host-memory pool, or loaded from a cold disk pool; and with TLLM_GDS_KV_LOAD_POLICY choosing.

For each model geometry (``bench.ttft_model``: Llama-3.1-8B, a Llama-3.1-70B shard at TP 8), prompt
length and pool, one cell: a fresh connector pair over a fresh pool, driven by the reference
executor whose forward is the decoder's (``TtftExecutor``), with the KV pool tensor registered
through ``register_kv_caches`` as TensorRT-LLM registers it.  In a cell, each run serves a new
random prompt three times, one request at a time:

* compute: nothing is in the pool; the whole prompt is computed (and saved, as the connector does);
* load: the same prompt again, with every match loaded (``always``): its full blocks are loaded
  into other pages, which are then compared byte for byte with the pages the first request computed;
* policy: the same prompt again, under the policy (``--policy``), which loads or computes.

The load and policy runs take turns going first (run to run; a cell run once serves its prompt's
pairs two at a time, once each way round: ``Cell.more_pairs``), so what drifts between two runs on
a host (a disk's read rate, caches warmed by the run before) does not fall on one of them: the
policy is compared with the path it chose, not with the order it ran in.  The computed pages are
held out of the free pages until the pairs are done, so every load is compared with them whatever
ran in between.  Each run's row in the JSON also says where its time went (``phases_ms``:
milliseconds from arrival to admission, to a parked load's report, to the first forward and to the
first token).

Time to first token runs from the request's arrival to its first token on the host: admission and
the match, the load (asynchronous: the request is parked, and resumes once the load is polled
done), the forward of the uncached suffix and the greedy first token (``.item()``, which waits for
the device).  A disk pool is cold for each load: page cache dropped (``/proc/sys/vm/drop_caches``
where permitted, else ``posix_fadvise(DONTNEED)`` on each file; the row says which).  Each cell
first serves a short prompt computed and then loaded (not reported), so the transfer threads'
staging and the kernels are warm, as in a serving process; it also gives the policy its first
measurements, as a serving process's earlier requests would.  Before the cells of a length of up to
REPEAT_MAX_TOKENS the decoder runs that length's forwards (the whole prompt, and its last block after
the rest) outside any connector, as a server's warm-up covers the shapes it serves: a shape's first
forward builds kernel plans and can take twice as long, and the policy would learn that as compute.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import shutil
import socket
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
from gds_kv_connector.bench.common import drop_caches, git_commit, opt_version, sync_device
from gds_kv_connector.bench.executor import connector_env
from gds_kv_connector.bench.ttft_model import GEOMETRIES, Decoder, Geometry
from gds_kv_connector.format.records import file_size_for
from gds_kv_connector.simulator import ExecutorConfig, ModelShape, ReferenceExecutor, SimRequest, State, fake_llm_args
from gds_kv_connector.simulator.model import PrefixHashes
from gds_kv_connector.store.arena import HOST_FS_TYPES
from gds_kv_connector.util.mounts import fs_type

DEFAULT_MODELS = "llama-3.1-8b,llama-3.1-70b-tp8"
DEFAULT_LENGTHS = "1k,2k,4k,8k,16k,32k,64k,128k"
QUICK_LENGTHS = "64,128,256,512"
WARM_TOKENS = 2048  # the cell's warm-up prompt, at most
# Runs of a short cell by default: one path's TTFT of tens of milliseconds moves run to run by as much
# as the policy's target (POLICY_SLACK), so a median of three says little.
DEFAULT_REPEAT = 5
# Cells of up to this many tokens are run --repeat times (the median reported): their times to first token
# are tens of milliseconds, where one run is noisy; longer ones run once (their prompts' KV fills pools).
REPEAT_MAX_TOKENS = 8192
# A prompt computed once serves load and policy pairs, two at a time, while they fit in this many times
# its compute, up to MAX_PAIRS (Cell.more_pairs).
PAIRS_TIME, MAX_PAIRS = 2.0, 6
GROWTH = 2.5  # a cell is expected to take this many times the previous one's (twice the tokens, attention)
SCRIBBLE = 0xA5
# The targets; the bench prints PASS/MISS and never asserts.
HOST_TARGET = ("llama-3.1-8b", 32768, 0.10)  # host-memory pool: load TTFT at most this fraction of recompute
POLICY_SLACK = 1.10  # with the policy: TTFT within 10% of the better of load and recompute
# Where a request's time to first token goes, stamped on the host: admitted (the match and the
# policy's decision made), loaded (a parked load reported done by get_finished), forward (its first
# forward starts), first_token (sampled, the device waited for).
PHASES = ("admitted", "loaded", "forward", "first_token")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gds-kv bench --ttft", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"tiny model, prompts of {QUICK_LENGTHS} tokens (CPU tests)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--models", help=f"model geometries, of {', '.join(GEOMETRIES)} (default {DEFAULT_MODELS}; "
                   "--quick tiny)")
    p.add_argument("--lengths", help=f"prompt lengths in tokens, k = 1024 (default {DEFAULT_LENGTHS}; --quick "
                   f"{QUICK_LENGTHS})")
    p.add_argument("--sources", default="shm,disk", help="pools to load from: shm (host memory, slot arena on "
                   "tmpfs), disk (block files, cold page cache), or both")
    p.add_argument("--policy", default="latency", choices=("latency", "throughput"),
                   help="TLLM_GDS_KV_LOAD_POLICY of the policy runs")
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--repeat", type=int, help=f"runs of a cell of up to {REPEAT_MAX_TOKENS} tokens, each with a "
                   f"new prompt; the median is reported (default {DEFAULT_REPEAT}, 1 with --quick)")
    p.add_argument("--budget-s", type=float, default=450.0, help="time budget of the run: cells expected to end "
                   "past their model's share of it are skipped, each with a line")
    p.add_argument("--shm-dir", help="host-memory pool directory (default /dev/shm, else a temporary one)")
    p.add_argument("--disk-dir", help="disk pool directory (default ./ttft-pool)")
    p.add_argument("--no-drop-caches", action="store_true", help="never write /proc/sys/vm/drop_caches "
                   "(posix_fadvise DONTNEED on each pool file is still used)")
    p.add_argument("--json", help="result file (default gds-kv-ttft-<host>.json)")
    p.add_argument("--png", help="plot file (default: the JSON path with .png)")
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_lengths(text: str) -> list[int]:
    """``1k,2k,512`` -> [1024, 2048, 512]."""
    return [int(float(t[:-1]) * 1024) if t.lower().endswith("k") else int(t) for t in text.split(",") if t]


@dataclass
class Pair:
    """One load run and one policy run of a computed prompt, in the order ``policy_first`` says."""

    load_s: float
    policy_s: float
    loaded_tokens: int
    policy_loaded_tokens: int
    verified: bool
    policy_first: bool
    estimate: dict[str, Any] = field(default_factory=dict)
    cold: dict[str, Any] | None = None  # how the disk pool was made cold before the load
    load_phases: dict[str, float] = field(default_factory=dict)
    policy_phases: dict[str, float] = field(default_factory=dict)


class _Unhashed(PrefixHashes):
    """No per-token hashes: the reference model's, which the decoder replaces, cost a SHA-256 per token."""

    def extend_to(self, tokens: list[int], n: int) -> None:
        pass


class TtftExecutor(ReferenceExecutor):
    """The reference executor with the decoder's forward and greedy sampling: the connector's
    callbacks, their order and the parking of asynchronously loaded requests are the executor's."""

    def __init__(self, scheduler: Any, worker: Any, config: ExecutorConfig, decoder: Decoder) -> None:
        self.decoder = decoder
        super().__init__(scheduler, worker, config)
        self.kv = decoder.pool_view(self.pool, config.shape.tokens_per_block)
        self.first_token_at: dict[int, float] = {}
        self.pages: dict[int, list[int]] = {}  # each request's pages at its first token
        self.marks: dict[int, dict[str, float]] = {}  # each request's phases (PHASES), host clock
        self._last: dict[int, torch.Tensor] = {}

    def hold(self, pages: list[int]) -> None:
        """Keep a finished request's ``pages`` out of the free pages (their bytes stay as they are)."""
        held = set(pages)
        rest = [p for p in self.free if p not in held]
        if len(rest) != len(self.free) - len(held):
            raise RuntimeError("hold: some of the pages are not free")
        self.free = deque(rest)

    def release(self, pages: list[int]) -> None:
        """Give pages :meth:`hold` kept back to the free pages."""
        self.free.extend(pages)

    def _admit(self, limit: int | None = None) -> bool:
        waiting = list(self.waiting)
        out = super()._admit(limit)
        now = time.perf_counter()
        for r in waiting:
            if r.state is not State.WAITING:
                self.marks.setdefault(r.request_id, {"admitted": now})
        return out

    def _poll_finished(self) -> None:
        parked = [r for r in self.reqs.values() if r.state is State.PARKED]
        super()._poll_finished()
        now = time.perf_counter()
        for r in parked:
            if r.state is not State.PARKED:
                self.marks[r.request_id]["loaded"] = now

    def _forward(self, batch: list[SimRequest]) -> None:
        now = time.perf_counter()
        for r in batch:
            self.marks[r.request_id].setdefault("forward", now)
        dec, tpb = self.decoder, self.cfg.shape.tokens_per_block
        work = []
        for r in batch:
            start, end = (r.pos, r.pos + self._chunk(r)) if r.state is State.CONTEXT else (len(r.tokens) - 1,
                                                                                          len(r.tokens))
            work.append([r, dec.span(r.block_ids, start, end, tpb), dec.embed_tokens(r.tokens[start:end])])
        for layer in range(dec.geo.layers):
            self._timed(self.worker.wait_for_layer_load, layer, self._stream, layer_hook=True)
            for item in work:
                item[2] = dec.layer(layer, item[2], self.kv, item[1])
            self._timed(self.worker.save_kv_layer, layer, self._stream, layer_hook=True)
        for r, span, x in work:
            self._last[r.request_id] = x[-1]
            self.stats.computed_tokens += span.end - span.start
            if r.state is State.CONTEXT:
                r.pos = span.end

    def _sample_and_finish(self, batch: list[SimRequest]) -> None:
        for r in batch:
            if r.state is State.CONTEXT and r.pos < len(r.prompt):
                continue
            token = self.decoder.next_token(self._last.pop(r.request_id))
            if not r.generated:
                self.first_token_at[r.request_id] = time.perf_counter()
                self.pages[r.request_id] = list(r.block_ids)
            r.tokens.append(token)
            r.generated += 1
            self.stats.generated_tokens += 1
            r.state = State.GENERATION
            if r.generated >= r.max_new_tokens:
                self._finish(r)


@dataclass
class Cell:
    """One model, prompt length and pool, with what the run is allowed (args) and where its pool lives."""

    geo: Geometry
    decoder: Decoder
    length: int
    source: str
    root: str
    args: argparse.Namespace
    arena_bytes: int = 0  # 0: block files
    slab_bytes: int = 0

    @property
    def blocks(self) -> int:
        return -(-self.length // self.args.tokens_per_block)

    @property
    def runs(self) -> int:
        return self.args.repeat if self.length <= REPEAT_MAX_TOKENS else 1

    def more_pairs(self, done: int, spent_s: float, compute_s: float) -> bool:
        """Whether the computed prompt serves another load and policy pair, ``done`` served in
        ``spent_s``: one per prompt of a repeated cell; a prompt computed once serves two (each order
        once), and two more while all of them fit in :data:`PAIRS_TIME` times its compute, up to
        :data:`MAX_PAIRS` (a host-memory load of tens of milliseconds moves run to run by more than
        the policy's target, and such pairs are cheap beside the prompt's compute)."""
        if self.runs > 1:
            return done < 1
        if done < 2 or done % 2:
            return True
        return done < MAX_PAIRS and spent_s / done * (done + 2) <= PAIRS_TIME * compute_s

    @property
    def block_bytes(self) -> int:
        return self.geo.kv_bytes_per_token * self.args.tokens_per_block


def ttft(ex: TtftExecutor, rid: int, prompt: list[int]) -> tuple[float, int, list[int], dict[str, float]]:
    """Serve ``prompt`` as request ``rid`` alone: (seconds to its first token, tokens it loaded, its
    pages, the milliseconds from its arrival to each of its PHASES that it passed)."""
    sync_device(ex.pool.device)
    ex.submit(SimRequest(rid, prompt, max_new_tokens=1, hashes=_Unhashed()))
    before = ex.stats.loaded_tokens
    t0 = time.perf_counter()
    ex.run_until_done()  # until its saves are done too: the next request finds them in the pool
    first = ex.first_token_at.pop(rid)
    marks = {**ex.marks.pop(rid), "first_token": first}
    phases = {name: round(1e3 * (marks[name] - t0), 3) for name in PHASES if name in marks}
    return first - t0, ex.stats.loaded_tokens - before, ex.pages.pop(rid), phases


def same_bytes(ex: TtftExecutor, a: list[int], b: list[int], chunk: int = 64) -> bool:
    """Whether pages ``a`` and ``b`` hold the same bytes, compared ``chunk`` pages at a time."""
    for i in range(0, len(a), chunk):
        if not torch.equal(ex.pool_bytes[a[i:i + chunk]], ex.pool_bytes[b[i:i + chunk]]):
            return False
    return True


def scribble_next(ex: TtftExecutor, n: int) -> None:
    """Fill the pages the next request will get, so a load that writes nothing cannot pass the comparison."""
    pages = list(ex.free)[:n]
    ex.pool_bytes[torch.tensor(pages, device=ex.pool.device)] = SCRIBBLE


@contextlib.contextmanager
def _settings(**values: Any) -> Iterator[None]:
    """TLLM_GDS_KV_* settings for what is built inside (each connector object reads them once, when made)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def rig(cell: Cell) -> Iterator[tuple[TtftExecutor, Any, Any]]:
    """(executor, the scheduler that loads every match, the policy's scheduler) over a fresh pool.

    The worker measures (it reads the policy's setting); the measuring scheduler reads ``always``.
    Transfers get a deadline and a save backlog that a 128k-token prompt's KV on a slow disk fits."""
    args = cell.args
    tpb = args.tokens_per_block
    shape = ModelShape(num_layers=cell.geo.layers, kv_factor=2,
                       block_elems=tpb * cell.geo.kv_heads * cell.geo.head_dim, tokens_per_block=tpb,
                       vocab=cell.geo.vocab)
    cfg = ExecutorConfig(shape=shape, num_blocks=2 * cell.blocks + 2, max_batch=1, device=str(cell.decoder.device),
                         transfer_timeout_s=900.0, idle_sleep_s=0.0002)
    extra = {"TLLM_GDS_KV_DEADLINE_S": 600, "TLLM_GDS_KV_MAX_QUEUED_SAVE_BYTES": 0, "TLLM_GDS_KV_STATS_INTERVAL_S": 0}
    if cell.arena_bytes:
        extra["TLLM_GDS_KV_ARENA_SLAB_BYTES"] = cell.slab_bytes
    os.makedirs(cell.root, exist_ok=True)
    with connector_env(cell.root, cell.arena_bytes), _settings(**extra):
        llm_args = fake_llm_args(tpb, model=f"gdskv-ttft-{cell.geo.name}")
        with _settings(TLLM_GDS_KV_LOAD_POLICY=args.policy):
            worker = GdsKvConnectorWorker(llm_args)
            policy = GdsKvConnectorScheduler(llm_args)
        measure = GdsKvConnectorScheduler(llm_args)
        try:
            ex = TtftExecutor(measure, worker, cfg, cell.decoder)
            policy.wait_for_initialization()
            if worker.pool.arena is not None:  # built in the background at start-up
                worker.pool.arena.wait_ready(300)
            yield ex, measure, policy
        finally:
            worker.shutdown()
            shutil.rmtree(cell.root, ignore_errors=True)


def _slab_bytes(need: int) -> int:
    """Slabs of 256 MiB, smaller for a small arena (a quarter of it, at least 1 MiB: the setting's floor)."""
    return max(1 << 20, min(256 << 20, (need // 4) >> 20 << 20))


def run_cell(cell: Cell, seed: int) -> dict[str, Any]:
    """Serve the cell's prompts each way (module docstring); its row."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(cell.geo.vocab) for _ in range(n)]
    cold = drops = None
    computes: list[float] = []
    compute_phases: list[dict[str, float]] = []
    pairs: list[Pair] = []
    with rig(cell) as (ex, measure, policy):
        rid = iter(range(1, 1 << 30))
        warm = prompt(min(cell.length, WARM_TOKENS))
        ttft(ex, next(rid), warm)
        drops = _cold(cell)
        ttft(ex, next(rid), warm)
        for i in range(cell.runs):
            p = prompt(cell.length)
            ex.sched = measure
            compute_s, _, computed, phases = ttft(ex, next(rid), p)
            computes.append(compute_s)
            compute_phases.append(phases)
            ex.hold(computed)
            try:
                k, started = 0, time.perf_counter()
                while cell.more_pairs(k, time.perf_counter() - started, compute_s):
                    pair = _serve_pair(cell, ex, measure, policy, p, computed, rid, policy_first=(i + k) % 2 == 1)
                    cold = pair.cold or cold
                    pairs.append(pair)
                    k += 1
            finally:
                ex.release(computed)
        stats = ex.worker.stats.snapshot()
        engine = ex.worker.transfers.engine.data_path()
    return _row(cell, computes, compute_phases, pairs, cold or drops, stats, engine)


def _serve_pair(cell: Cell, ex: TtftExecutor, measure: Any, policy: Any, p: list[int], computed: list[int],
                rid: Iterator[int], policy_first: bool) -> Pair:
    """The computed prompt ``p`` served again with every match loaded and under the policy, in the
    order ``policy_first`` says, a disk pool made cold before each."""
    runs = {"load": lambda: _serve_load(cell, ex, measure, p, computed, next(rid)),
            "policy": lambda: _serve_policy(cell, ex, policy, p, next(rid))}
    got = {way: runs[way]() for way in (("policy", "load") if policy_first else ("load", "policy"))}
    (load_s, loaded, verified, load_phases, cold), (policy_s, policy_loaded, policy_phases, estimate) = (
        got["load"], got["policy"])
    return Pair(load_s, policy_s, loaded, policy_loaded, verified, policy_first, estimate, cold, load_phases,
                policy_phases)


def _serve_load(cell: Cell, ex: TtftExecutor, measure: Any, p: list[int], computed: list[int],
                rid: int) -> tuple[float, int, bool, dict[str, float], dict[str, Any] | None]:
    """``p`` with every match loaded: (TTFT, tokens loaded, whether the loaded pages hold the
    ``computed`` pages' bytes, its phases, how the pool was made cold)."""
    cold = _cold(cell)
    ex.sched = measure
    scribble_next(ex, cell.blocks)
    seconds, loaded, pages, phases = ttft(ex, rid, p)
    n = loaded // cell.args.tokens_per_block
    return seconds, loaded, same_bytes(ex, computed[:n], pages[:n]), phases, cold


def _serve_policy(cell: Cell, ex: TtftExecutor, policy: Any, p: list[int],
                  rid: int) -> tuple[float, int, dict[str, float], dict[str, Any]]:
    """``p`` under the policy: (TTFT, tokens loaded, its phases, what the policy knew before it)."""
    _cold(cell)
    tpb = cell.args.tokens_per_block
    estimate = _estimate(policy, (len(p) - 1) // tpb, cell.block_bytes)
    ex.sched = policy
    seconds, loaded, _, phases = ttft(ex, rid, p)
    return seconds, loaded, phases, estimate


def _cold(cell: Cell) -> dict[str, Any] | None:
    """Drop a disk pool's cached pages before a load; nothing for a host-memory pool."""
    if cell.source != "disk":
        return None
    out = drop_caches([cell.root], not cell.args.no_drop_caches)
    out["method"] = "drop_caches" if out["proc_drop_caches"] else "posix_fadvise(DONTNEED)"
    return out


def _estimate(policy: GdsKvConnectorScheduler, blocks: int, block_bytes: int) -> dict[str, Any]:
    """What ``policy`` (the policy's scheduler) expects before its run, for a prefix of ``blocks``
    from the first: the load rate, what a load costs beyond its bytes, and the expected times."""
    decide = policy.load_policy
    est = decide.estimates
    parked = blocks * block_bytes > policy.settings.async_load_bytes
    load_s, compute_s = decide.expected(0, blocks, parked)
    rate = est.rate.bytes_per_s()
    fit = est.forwards.cost.coefficients()
    return {"load_GBps": None if rate is None else round(rate / 1e9, 3),
            "load_s": None if load_s is None else round(load_s, 6), "load_fixed_s": round(est.rate.fixed_s(), 6),
            # a loaded request's first forward beyond its work's, and its resume (ForwardClock.after_load_s)
            "after_load_s": round(est.forwards.after_load_s(parked), 6),
            "compute_s": None if compute_s is None else round(compute_s, 6),
            # the forward's fitted cost (load_policy.ForwardCost): fixed seconds, per 1e3 tokens, per 1e6 pairs
            "compute_fit": None if fit is None else [round(c, 6) for c in fit]}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _row(cell: Cell, computes: list[float], compute_phases: list[dict[str, float]], pairs: list[Pair],
         cold: dict | None, stats: dict[str, int], engine: str) -> dict[str, Any]:
    compute_s = _median(computes)
    load_s = _median([r.load_s for r in pairs])
    policy_s = _median([r.policy_s for r in pairs])
    loaded = pairs[0].loaded_tokens
    per_token = cell.geo.kv_bytes_per_token
    return {
        "model": cell.geo.name, "prompt_tokens": cell.length, "source": cell.source,
        "pool": "slot arena" if cell.arena_bytes else "block files", "engine": engine,
        "ttft_compute_s": round(compute_s, 6), "ttft_load_s": round(load_s, 6), "ttft_policy_s": round(policy_s, 6),
        "ratio": round(load_s / compute_s, 4),
        "policy_vs_best": round(policy_s / min(load_s, compute_s), 4),
        "policy_loaded": [r.policy_loaded_tokens > 0 for r in pairs],
        "policy_first": [r.policy_first for r in pairs],
        "loaded_tokens": loaded, "loaded_bytes": loaded * per_token, "kv_bytes_per_token": per_token,
        "break_even_GBps": round(per_token * cell.length / compute_s / 1e9, 3),
        "load_GBps": round(loaded * per_token / load_s / 1e9, 3),
        "verified": all(r.verified for r in pairs) and bool(loaded),
        "runs": {"compute_s": [round(c, 6) for c in computes], "load_s": [round(r.load_s, 6) for r in pairs],
                 "policy_s": [round(r.policy_s, 6) for r in pairs]},
        "phases_ms": {"compute": compute_phases, "load": [r.load_phases for r in pairs],
                      "policy": [r.policy_phases for r in pairs]},
        "spans_ms": {"compute": spans(compute_phases), "load": spans([r.load_phases for r in pairs])},
        "policy_estimate": pairs[-1].estimate, "cold": cold,
        "policy_loads_declined": stats.get("policy_loads_declined", 0),
    }


def spans(runs: list[dict[str, float]]) -> dict[str, float]:
    """Medians over ``runs`` of the milliseconds between their phases: ``to_admitted`` (arrival to
    admission: the match and the decision), ``parked`` (admission to the load's report, for runs
    whose load was asynchronous), ``to_forward`` (from the later of those to the first forward) and
    ``forward`` (the first forward and the first token)."""
    parts: dict[str, list[float]] = {"to_admitted": [], "parked": [], "to_forward": [], "forward": []}
    for run in runs:
        ready = run.get("loaded", run["admitted"])
        parts["to_admitted"].append(run["admitted"])
        if "loaded" in run:
            parts["parked"].append(run["loaded"] - run["admitted"])
        parts["to_forward"].append(run["forward"] - ready)
        parts["forward"].append(run["first_token"] - run["forward"])
    return {name: round(_median(values), 3) for name, values in parts.items() if values}


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = _device(args.device)
    if device is None:
        print("gds-kv bench --ttft: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    args.repeat = args.repeat or (1 if args.quick else DEFAULT_REPEAT)
    models = (args.models or ("tiny" if args.quick else DEFAULT_MODELS)).split(",")
    unknown = [m for m in models if m not in GEOMETRIES]
    if unknown:
        print(f"gds-kv bench --ttft: unknown model(s) {', '.join(unknown)}; known: {', '.join(GEOMETRIES)}",
              file=sys.stderr)
        return 2
    lengths = parse_lengths(args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS))
    sources = [s for s in args.sources.split(",") if s]
    json_path = args.json or f"gds-kv-ttft-{socket.gethostname()}.json"
    res = _header(args, device, models, lengths, sources, argv if argv is not None else sys.argv[1:])
    bases = _pool_bases(args, sources, res["notes"])
    t0 = time.monotonic()
    try:
        for i, name in enumerate(models):
            deadline = t0 + args.budget_s * (i + 1) / len(models)
            _run_model(GEOMETRIES[name], device, lengths, bases, args, deadline, res, t0)
    finally:
        for base in bases.values():
            shutil.rmtree(base["dir"], ignore_errors=True)
            if base.get("made_parent"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(base["dir"]))
    res["meta"]["wall_s"] = round(time.monotonic() - t0, 2)
    res["targets"] = evaluate_targets(res["rows"])
    res["meta"]["plot"] = plot(res, args.png or os.path.splitext(json_path)[0] + ".png")
    os.makedirs(os.path.dirname(os.path.abspath(json_path)) or ".", exist_ok=True)
    with open(json_path, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(render(res))
    print(f"\nJSON: {os.path.abspath(json_path)}\nplot: {res['meta']['plot']}\nwall: {res['meta']['wall_s']} s")
    return 1 if res["errors"] else 0


def _device(choice: str) -> torch.device | None:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _header(args: argparse.Namespace, device: torch.device, models: list[str], lengths: list[int],
            sources: list[str], argv: list[str]) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {
        "meta": {"hostname": socket.gethostname(), "git": git_commit(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                 "python": platform.python_version(), "kvikio": opt_version("kvikio"),
                 "argv": argv},
        "config": {"models": {m: vars(GEOMETRIES[m]) for m in models}, "lengths": lengths, "sources": sources,
                   "policy": args.policy, "tokens_per_block": args.tokens_per_block, "repeat": args.repeat,
                   "budget_s": args.budget_s, "drop_caches_global": not args.no_drop_caches},
        "units": {"s": "seconds, wall clock on the host", "GBps": "1e9 bytes per second"},
        "rows": [], "skipped": [], "notes": [], "errors": [],
    }


def _pool_bases(args: argparse.Namespace, sources: list[str], notes: list[str]) -> dict[str, dict[str, Any]]:
    """Each source's directory (a fresh one inside the given or default parent) and whether it runs an arena."""
    bases: dict[str, dict[str, Any]] = {}
    tag = f"gdskv-ttft-{os.getpid()}"
    if "shm" in sources:
        parent = args.shm_dir or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
        os.makedirs(parent, exist_ok=True)
        arena = fs_type(parent) in HOST_FS_TYPES
        if not arena:
            notes.append(f"host-memory pool {parent} is on {fs_type(parent)}, not tmpfs: block files, no arena")
        bases["shm"] = {"dir": os.path.join(parent, tag), "arena": arena}
    if "disk" in sources:
        parent = os.path.abspath(args.disk_dir or "ttft-pool")
        made = not os.path.isdir(parent)
        os.makedirs(parent, exist_ok=True)
        bases["disk"] = {"dir": os.path.join(parent, tag), "arena": False, "made_parent": made and not args.disk_dir}
    return bases


def _run_model(geo: Geometry, device: torch.device, lengths: list[int], bases: dict[str, dict[str, Any]],
               args: argparse.Namespace, deadline: float, res: dict[str, Any], t0: float) -> None:
    """Every cell of one model, shortest prompts first; a cell that does not fit, or would end past
    ``deadline``, is skipped with a line."""
    _progress(args, t0, f"{geo.name}: random weights ({geo.weight_bytes() / 1e9:.1f} GB)")
    decoder = Decoder(geo, device)
    decoder.warm_up(min(max(lengths), WARM_TOKENS), args.tokens_per_block)
    _free_device(device)
    last: dict[str, float] = {}
    try:
        for length in lengths:
            if length <= REPEAT_MAX_TOKENS:  # a new shape's first forward (kernel plans, heuristics) is no sample
                decoder.warm_up(length, args.tokens_per_block)
            for source, base in bases.items():
                cell = _cell(geo, decoder, length, source, base, args)
                why = _skip_reason(cell, deadline, last.get(source))
                if why:
                    _skip(res, cell, why)
                    continue
                _progress(args, t0, f"{geo.name} {length} tokens, {source}")
                started = time.monotonic()
                try:
                    res["rows"].append(run_cell(cell, seed=length))
                except Exception as exc:  # noqa: BLE001 - one cell's failure is recorded; the run goes on
                    res["errors"].append(f"{geo.name} {length} {source}: {type(exc).__name__}: {exc}")
                    print(f"error: {res['errors'][-1]}", file=sys.stderr)
                last[source] = time.monotonic() - started
                _free_device(device)
    finally:
        del decoder
        _free_device(device)


def _cell(geo: Geometry, decoder: Decoder, length: int, source: str, base: dict[str, Any],
          args: argparse.Namespace) -> Cell:
    cell = Cell(geo, decoder, length, source, os.path.join(base["dir"], f"{geo.name}-{length}"), args)
    if base["arena"]:  # room for every block the cell saves, and a slab to spare
        need = _pool_need(cell)
        cell.slab_bytes = _slab_bytes(need)
        cell.arena_bytes = cell.slab_bytes * (-(-need // cell.slab_bytes) + 1)
    return cell


def _pool_need(cell: Cell) -> int:
    """Pool bytes the cell saves: its prompt once per run and the warm-up prompt, a block more each."""
    per_prompt = (cell.blocks + 1) * file_size_for(cell.block_bytes)
    return (cell.runs + 1) * per_prompt + 2 * file_size_for(cell.block_bytes)


def _skip_reason(cell: Cell, deadline: float, previous_s: float | None) -> str | None:
    """Why the cell cannot run here and now, or None."""
    if previous_s is not None and time.monotonic() + GROWTH * previous_s > deadline:
        return f"time budget (the previous length took {previous_s:.0f} s)"
    need = (2 * cell.blocks + 2) * cell.block_bytes + cell.geo.activation_bytes(cell.length)
    room = _device_room(cell.decoder.device)
    if need > room:
        return f"needs {need / 2**30:.1f} GiB of {cell.decoder.device.type} memory, {room / 2**30:.1f} GiB free"
    parent = os.path.dirname(os.path.dirname(cell.root))
    free = shutil.disk_usage(parent).free
    pool = cell.arena_bytes or _pool_need(cell)
    if pool > 0.9 * free:
        return f"its pool needs {pool / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free in {parent}"
    return None


def _device_room(device: torch.device) -> int:
    """Bytes a cell may take on ``device``: free memory plus what the caching allocator holds unused."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.95 * (free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)))
    return int(0.8 * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _free_device(device: torch.device) -> None:
    """Give a finished cell's memory back: its executor and worker refer to each other (callbacks), so
    its pool tensor is freed only by the cycle collector, and only then can the allocator return it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _skip(res: dict[str, Any], cell: Cell, why: str) -> None:
    res["skipped"].append({"model": cell.geo.name, "prompt_tokens": cell.length, "source": cell.source, "reason": why})
    print(f"skipped {cell.geo.name} {cell.length} tokens from {cell.source}: {why}", file=sys.stderr, flush=True)


def _progress(args: argparse.Namespace, t0: float, msg: str) -> None:
    if not args.no_progress:
        print(f"[ttft {time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def evaluate_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets against the rows: PASS, MISS, or not run."""
    model, length, most = HOST_TARGET
    host = [r for r in rows if r["model"] == model and r["prompt_tokens"] == length and r["source"] == "shm"]
    worst = max(rows, key=lambda r: r["policy_vs_best"], default=None)
    oks = [choices_ok(r) for r in rows]
    wrong = [r for r, ok in zip(rows, oks) if not all(ok)]
    return [
        {"name": f"host-memory pool, {model}, {length // 1024}k-token prefix: load TTFT / recompute TTFT",
         "goal": f"<= {most}", "value": host[0]["ratio"] if host else None,
         "pass": (host[0]["ratio"] <= most) if host else None},
        {"name": "policy TTFT / min(load, recompute), worst row", "goal": f"<= {POLICY_SLACK}",
         "value": worst["policy_vs_best"] if worst else None,
         "where": f"{worst['model']} {worst['prompt_tokens']} {worst['source']}" if worst else None,
         "pass": (worst["policy_vs_best"] <= POLICY_SLACK) if worst else None},
        {"name": "policy runs that chose a path whose median TTFT is within 10% of the better path's "
                 "(the decision, apart from the spread of the runs)", "goal": "every run",
         "value": f"{sum(map(sum, oks))} of {sum(map(len, oks))}",
         "where": ", ".join(f"{r['model']} {r['prompt_tokens']} {r['source']}" for r in wrong) or None,
         "pass": (not wrong) if rows else None},
    ]


def choices_ok(row: dict[str, Any]) -> list[bool]:
    """For each policy run of ``row``: whether the path it took (load or compute) has a median TTFT
    within POLICY_SLACK of the better path's."""
    best = min(row["ttft_load_s"], row["ttft_compute_s"])
    return [(row["ttft_load_s"] if loaded else row["ttft_compute_s"]) <= POLICY_SLACK * best
            for loaded in row["policy_loaded"]]


def render(res: dict[str, Any]) -> str:
    meta = res["meta"]
    lines = [f"gds-kv bench --ttft  host={meta['hostname']}  device={meta['device']}  torch={meta['torch']}  "
             f"policy={res['config']['policy']}",
             f"  {'model':<18} {'tokens':>7} {'pool':<5} {'compute':>9} {'load':>9} {'ratio':>6} {'policy':>9} "
             f"{'pol/best':>8} {'policy did':<10} {'break-even':>10} {'load':>7}  verified  cold",
             f"  {'':<18} {'':>7} {'':<5} {'ms':>9} {'ms':>9} {'':>6} {'ms':>9} {'':>8} {'':<10} {'GB/s':>10} "
             f"{'GB/s':>7}"]
    for r in res["rows"]:
        did = f"loaded {sum(r['policy_loaded'])}/{len(r['policy_loaded'])}"
        cold = (r["cold"] or {}).get("method", "-")
        lines.append(f"  {r['model']:<18} {r['prompt_tokens']:>7} {r['source']:<5} {1e3 * r['ttft_compute_s']:>9.1f} "
                     f"{1e3 * r['ttft_load_s']:>9.1f} {r['ratio']:>6.3f} {1e3 * r['ttft_policy_s']:>9.1f} "
                     f"{r['policy_vs_best']:>8.3f} {did[:10]:<10} {r['break_even_GBps']:>10.2f} "
                     f"{r['load_GBps']:>7.2f}  {'yes' if r['verified'] else 'NO':<8}  {cold}")
    lines.append("  ratio = load TTFT / recompute TTFT; break-even = KV bytes per token x prompt tokens per second "
                 "of recompute; load GB/s = KV loaded / load TTFT")
    lines.append("  where the time went, medians in ms: compute (to admission, to its forward, forward and first "
                 "token) | load (to admission, parked until reported, to its forward, forward and first token; a "
                 "synchronous load's bytes are waited for in its forward) | what the policy expected before its "
                 "last run: load (of it after the bytes), compute")
    for r in res["rows"]:
        c, ld, est = r["spans_ms"]["compute"], r["spans_ms"]["load"], r["policy_estimate"]
        lines.append(f"  {r['model']:<18} {r['prompt_tokens']:>7} {r['source']:<5} "
                     f"{c['to_admitted']:>7.1f} {c['to_forward']:>7.1f} {c['forward']:>8.1f} | "
                     f"{ld['to_admitted']:>7.1f} {_ms(ld.get('parked')):>8} {ld['to_forward']:>7.1f} "
                     f"{ld['forward']:>8.1f} | {_s_as_ms(est['load_s'])} ({_s_as_ms(est['after_load_s'])}), "
                     f"{_s_as_ms(est['compute_s'])}")
    for s in res["skipped"]:
        lines.append(f"  skipped {s['model']} {s['prompt_tokens']} {s['source']}: {s['reason']}")
    for t in res.get("targets", []):
        verdict = "not run" if t["pass"] is None else ("PASS" if t["pass"] else "MISS")
        where = f" ({t['where']})" if t.get("where") else ""
        lines.append(f"  [{verdict}] {t['name']}: {t['value']}{where} (goal {t['goal']})")
    lines += [f"note: {n}" for n in res["notes"]] + [f"error: {e}" for e in res["errors"]]
    return "\n".join(lines)


def _s_as_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def _ms(value: float | None) -> str:
    """``value`` to one decimal; ``-`` where the runs had no such phase (a synchronous load is never parked)."""
    return "-" if value is None else f"{value:.1f}"


def plot(res: dict[str, Any], path: str) -> str:
    """TTFT against prompt length, one panel per model, a line per source and way; skipped with a
    line where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed (pip install matplotlib)"
    models = list(dict.fromkeys(r["model"] for r in res["rows"]))
    if not models:
        return "skipped: no rows"
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in res["rows"] if r["model"] == model]
        for source in dict.fromkeys(r["source"] for r in rows):
            mine = sorted((r for r in rows if r["source"] == source), key=lambda r: r["prompt_tokens"])
            x = [r["prompt_tokens"] for r in mine]
            ax.plot(x, [r["ttft_compute_s"] for r in mine], "k--" if source == "shm" else "k:",
                    label=f"recompute ({source} cells)")
            ax.plot(x, [r["ttft_load_s"] for r in mine], "o-", label=f"load from {source}")
            ax.plot(x, [r["ttft_policy_s"] for r in mine], "x-", label=f"policy, {source}")
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (s)", title=model)
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return os.path.abspath(path)


if __name__ == "__main__":
    sys.exit(main())

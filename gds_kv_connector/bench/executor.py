"""Executor-thread cost of the connector's callbacks, through the reference executor, and the match time
of a fully cached 128k-token prompt.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import time
from typing import Any

import torch

from gds_kv_connector.store.base import open_store
from gds_kv_connector.format.records import ZERO_KEY
from gds_kv_connector.bench.common import GC, KvikioDefaults, MATCH_BLOCKS, MATCH_BLOCK_ELEMS, TOKENS_PER_BLOCK, Tracer, rand_bytes


@contextlib.contextmanager
def connector_env(root: str, arena_bytes: int = 0):
    saved = {k: v for k, v in os.environ.items() if k.startswith("TLLM_GDS_KV_")}
    for k in saved:
        del os.environ[k]
    os.environ["TLLM_GDS_KV_ROOT"] = root
    if arena_bytes:
        os.environ["TLLM_GDS_KV_ARENA_BYTES"] = str(arena_bytes)
    # the engine and thread counts are the user's to force; the trace mode is the process's (--trace)
    for k in ("TLLM_GDS_KV_ENGINE", "TLLM_GDS_KV_COMPAT_IO", "TLLM_GDS_KV_IO_THREADS", "TLLM_GDS_KV_TRANSFER_THREADS",
              "TLLM_GDS_KV_TRACE"):
        if k in saved:
            os.environ[k] = saved[k]
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("TLLM_GDS_KV_")]:
            del os.environ[k]
        os.environ.update(saved)


@contextlib.contextmanager
def cpu_connector(model: str, tokens_per_block: int, kv_blocks: int):
    """A scheduler and a worker over a host-memory pool in a temporary directory (under /dev/shm where
    there is one) and a CPU KV cache of ``kv_blocks`` blocks: the rig of the profiling tools that time
    callbacks without a GPU."""
    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    from gds_kv_connector.simulator import fake_llm_args

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base) as root, connector_env(root):
        llm_args = fake_llm_args(tokens_per_block, model=model)
        worker = GdsKvConnectorWorker(llm_args)
        try:
            worker.register_kv_caches(torch.zeros((kv_blocks, 2, 2, 512), dtype=torch.bfloat16))
            sched = GdsKvConnectorScheduler(llm_args)
            sched.wait_for_initialization()
            yield sched, worker
        finally:
            worker.shutdown()


def _workload(device: torch.device, requests: int, layers: int, new_tokens: int) -> tuple[Any, list[list[int]]]:
    """The executor phase's configuration and prompts: ``requests`` prompts of 4 blocks and 5 tokens."""
    from gds_kv_connector.simulator import ExecutorConfig, ModelShape

    shape = ModelShape(num_layers=layers, kv_factor=2, block_elems=512, tokens_per_block=TOKENS_PER_BLOCK)
    prompt_tokens = 4 * TOKENS_PER_BLOCK + 5
    blocks_per_request = -(-(prompt_tokens + new_tokens) // TOKENS_PER_BLOCK) + 1
    cfg = ExecutorConfig(shape=shape, num_blocks=requests * blocks_per_request + 32, max_batch=requests,
                         device=str(device))
    rng = random.Random(1234)
    return cfg, [[rng.randrange(32000) for _ in range(prompt_tokens)] for _ in range(requests)]


class _NullScheduler:
    """A connector scheduler that matches nothing and plans nothing."""

    def wait_for_initialization(self) -> None: ...
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None: ...
    def build_connector_meta(self, scheduler_output: Any) -> None: ...
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return False


class _NullWorker:
    """A connector worker that moves nothing."""

    def register_kv_caches(self, kv_cache_tensor: Any) -> None: ...
    def bind_connector_meta(self, metadata: object) -> None: ...
    def start_load_kv(self, stream: Any) -> None: ...
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None: ...
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None: ...
    def wait_for_save(self, stream: Any) -> None: ...
    def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]) -> tuple[list, list]:
        return [], []


def null_connector_us(device: torch.device, requests: int = 64, layers: int = 32, new_tokens: int = 16) -> float:
    """Callback microseconds per iteration of a connector that does nothing, in the same executor and
    workload as :func:`executor_cost` (both rounds): the share of the executor figure that is the
    callbacks' calls and their timing, not the connector's work."""
    from gds_kv_connector.simulator import ReferenceExecutor, RunStats, SimRequest

    cfg, prompts = _workload(device, requests, layers, new_tokens)
    ex = ReferenceExecutor(_NullScheduler(), _NullWorker(), cfg)
    ex.stats = RunStats()
    for r in range(2):
        for i, p in enumerate(prompts):
            ex.submit(SimRequest(r * 10_000 + i, p, max_new_tokens=new_tokens))
        ex.run_until_done()
    return round(1e6 * ex.stats.callback_s / ex.stats.iterations, 3)


def executor_cost(root: str, device: torch.device, kvd: KvikioDefaults, tracer: Tracer, requests: int = 64,
                  layers: int = 32, arena_bytes: int = 0, new_tokens: int = 16) -> dict:
    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    from gds_kv_connector.simulator import ReferenceExecutor, RunStats, SimRequest, fake_llm_args

    kvd.restore()
    cfg, prompts = _workload(device, requests, layers, new_tokens)
    shape = cfg.shape
    out: dict[str, Any] = {"requests_per_batch": requests, "num_layers": layers, "block_bytes": shape.block_bytes,
                           "prompt_tokens": len(prompts[0]), "max_new_tokens": new_tokens, "rounds": [],
                           "arena_bytes": arena_bytes}
    with connector_env(root, arena_bytes):
        llm_args = fake_llm_args(TOKENS_PER_BLOCK, model="gdskv-bench-executor")
        worker = GdsKvConnectorWorker(llm_args)
        ex = ReferenceExecutor(GdsKvConnectorScheduler(llm_args), worker, cfg)
        try:
            out["engine"] = worker.transfers.engine.data_path()
            if worker.pool.arena is not None:  # built in the background at start-up; not per-iteration cost
                worker.pool.arena.wait_ready(120)
            ex.stats = RunStats()  # start-up (register_kv_caches, engine probe) is not per-iteration cost
            totals = RunStats()
            acc = ex.callback_times  # per callback, timed by the executor inside the spans the totals sum
            for r, what in enumerate(("cold: saves only", "warm: same prompts again, loads from the pool")):
                before = RunStats(**vars(ex.stats))
                wait_before = worker.stats.snapshot().get("sync_load_wait_us", 0)
                acc.clear()
                for i, p in enumerate(prompts):
                    ex.submit(SimRequest(r * 10_000 + i, p, max_new_tokens=new_tokens))
                per_iter: list[float] = []
                step = ex.step

                def timed_step(_step=step, _per=per_iter):
                    c0 = ex.stats.callback_s
                    _step()
                    _per.append(ex.stats.callback_s - c0)
                ex.step = timed_step
                gc_mark = GC.mark()
                with tracer.rf(f"bench/executor/round{r}"):
                    ex.run_until_done()
                gc_round = GC.since(gc_mark)
                ex.step = step
                now = ex.stats
                d = {k: getattr(now, k) - getattr(before, k) for k in vars(now)}
                for k, v in d.items():
                    setattr(totals, k, getattr(totals, k) + v)
                d["sync_load_wait_s"] = (worker.stats.snapshot().get("sync_load_wait_us", 0) - wait_before) / 1e6
                totals.sync_load_wait_s = getattr(totals, "sync_load_wait_s", 0.0) + d["sync_load_wait_s"]
                summary = _exec_summary(d, what)
                summary["gc"] = gc_round  # a collection pauses the executor thread, in a callback or not
                rest = sorted(per_iter[1:]) or [0.0]
                summary["iteration_us"] = {  # the admission iteration apart from the steady ones after it
                    "first": round(1e6 * per_iter[0], 1) if per_iter else None,
                    "rest_median": round(1e6 * rest[len(rest) // 2], 1), "rest_max": round(1e6 * rest[-1], 1)}
                summary["by_callback"] = {
                    name: {"calls": c, "total_us": round(1e6 * secs, 1), "us_per_call": round(1e6 * secs / c, 3),
                           "us_per_iteration": round(1e6 * secs / d["iterations"], 3) if d["iterations"] else None}
                    for name, (c, secs) in sorted(acc.items(), key=lambda kv: -kv[1][1])}
                out["rounds"].append(summary)
            out.update(_exec_summary({**vars(totals), "sync_load_wait_s": getattr(totals, "sync_load_wait_s", 0.0)},
                                     "both rounds"))
        finally:
            worker.shutdown()
    return out


def read_report_fields(reports: list[Any]) -> None:
    """What every fold must do at least: read each report's fields (TensorRT-LLM's objects, new each
    iteration); the rest of a fold's cost is the connector's own state."""
    for rd in reports:
        rd.request_id, rd.new_tokens, rd.new_block_ids, rd.computed_position, rd.num_scheduled_tokens


def python_reference_us(requests: int = 64, reps: int = 300) -> float:
    """This host's speed at the executor's kind of Python, apart from the connector: microseconds to
    read the fields of ``requests`` decode reports (:func:`read_report_fields`), the minimum of
    ``reps`` tries on warm caches.  The executor figure follows the host's single-thread Python
    speed (the same tree's Python-heavy callbacks run 1.5-1.7 times slower on one host than on
    another), so the bench prints this beside it for comparing hosts: an indicator, not a scale,
    since the reference itself moves 1.3-2.2 times between such hosts."""
    from gds_kv_connector.connector.trtllm_api import RequestData

    reports = [RequestData(request_id=i, new_tokens=[7], new_block_ids=[], computed_position=133,
                           num_scheduled_tokens=1) for i in range(requests)]
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        read_report_fields(reports)
        best = min(best, time.perf_counter_ns() - t0)
    return round(best / 1e3, 2)


def median_executor_run(runs: list[dict]) -> dict | None:
    """The run with the median callback time per iteration, with every run's figure beside it: single
    runs on one host can differ by a factor of two or more (a slow admission iteration, a cyclic-GC
    pass), so one run says little.  Each run's admission iterations and cyclic-GC time go beside its
    figure, so an outlier says which it was."""
    if not runs:
        return None
    ordered = sorted(runs, key=lambda r: r["callback_us_per_iteration"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["callback_us_per_iteration_runs"] = [r["callback_us_per_iteration"] for r in runs]
    out["runs_detail"] = [_run_detail(r) for r in runs]
    return out


def _run_detail(run: dict) -> dict:
    rounds = run.get("rounds", [])
    gcs = [x.get("gc") or {"collections": [0, 0, 0], "ms": 0.0} for x in rounds]
    return {"callback_us_per_iteration": run["callback_us_per_iteration"],
            "first_iteration_us": [(x.get("iteration_us") or {}).get("first") for x in rounds],
            "gc_collections": [sum(g["collections"][k] for g in gcs) for k in range(3)],
            "gc_ms": round(sum(g["ms"] for g in gcs), 2)}


def _exec_summary(d: dict, what: str) -> dict:
    iters = d["iterations"]
    busy = iters - d["idle_iterations"]
    return {"what": what, "iterations": iters, "busy_iterations": busy, "idle_iterations": d["idle_iterations"],
            "callback_s": round(d["callback_s"], 6),
            "callback_us_per_iteration": round(1e6 * d["callback_s"] / iters, 3) if iters else None,
            "callback_us_per_busy_iteration": round(1e6 * d["callback_s"] / busy, 3) if busy else None,
            "layer_hook_calls": d["layer_hook_calls"], "layer_hook_s": round(d["layer_hook_s"], 6),
            "layer_hook_us_per_call": (round(1e6 * d["layer_hook_s"] / d["layer_hook_calls"], 3)
                                       if d["layer_hook_calls"] else None),
            # synchronous loads are waited for in layer 0's hook: their bytes' transfer time, not callback cost
            "sync_load_wait_s": round(d.get("sync_load_wait_s", 0.0), 6),
            "layer_hook_us_per_call_excl_sync_load_wait": (
                round(1e6 * (d["layer_hook_s"] - d.get("sync_load_wait_s", 0.0)) / d["layer_hook_calls"], 3)
                if d["layer_hook_calls"] else None),
            "loaded_tokens": d["loaded_tokens"], "async_loads": d["async_loads"], "sync_loads": d["sync_loads"],
            "wall_s": round(d["wall_s"], 3)}


def save_chain(worker: Any, keys: list[bytes], data: torch.Tensor) -> None:
    """Save ``data[i]`` as the block of ``keys[i]``, each block the parent of the next (a prompt's
    chain), through the worker's pool and engine in batches of 512; raises if any save fails."""
    for i in range(0, len(keys), 512):
        idx = range(i, min(len(keys), i + 512))
        o = open_store(worker.pool, worker.transfers.engine).save(keys[i:i + 512],
                        [keys[j - 1] if j else ZERO_KEY for j in idx], [data[j] for j in idx])
        if o.failed:
            raise RuntimeError(f"saving a prompt's blocks: {len(o.failed)} saves failed ({o.failed[0][1]})")


def match_time(root: str, device: torch.device, io_threads: int, kvd: KvikioDefaults, tracer: Tracer,
               time_cap_s: float, arena_bytes: int = 0) -> dict:
    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    from gds_kv_connector.format import native
    from gds_kv_connector.format.keys import base_fingerprint, chain_from_tokens, chain_seed, extend_chain, tokens_to_bytes
    from gds_kv_connector.connector.local_peer import lookup
    from gds_kv_connector.simulator import SimRequest, fake_llm_args

    kvd.restore()
    tokens = MATCH_BLOCKS * TOKENS_PER_BLOCK + 1  # one prompt token is always left to compute
    rng = random.Random(99)
    prompt = [rng.randrange(32000) for _ in range(tokens)]
    out: dict[str, Any] = {"prompt_tokens": tokens, "blocks": MATCH_BLOCKS, "tokens_per_block": TOKENS_PER_BLOCK,
                           "arena_bytes": arena_bytes}
    with connector_env(root, arena_bytes):
        llm_args = fake_llm_args(TOKENS_PER_BLOCK, model="gdskv-bench-match")
        sched, worker = GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args)
        try:
            worker.register_kv_caches(torch.zeros((8, 1, 2, MATCH_BLOCK_ELEMS), dtype=torch.bfloat16, device=device))
            sched.wait_for_initialization()
            if worker.pool.arena is not None:
                worker.pool.arena.wait_ready(120)
            peer = lookup(llm_args)
            payload = worker.pool.payload_len
            out["block_bytes"] = payload
            keys = extend_chain(chain_seed(base_fingerprint(peer.geometry), None), tokens_to_bytes(prompt),
                                TOKENS_PER_BLOCK, 0, MATCH_BLOCKS)
            data = rand_bytes((MATCH_BLOCKS, payload), device, 5)
            t0 = time.perf_counter()
            with tracer.rf("bench/match/build_pool"):
                save_chain(worker, keys, data)
            out["build_s"] = round(time.perf_counter() - t0, 3)
            rid = 1_000_000

            def match_calls(label: str, unindexed: bool) -> tuple[list[float], bool]:
                """Seconds per match of the whole prompt (3 to 30 calls within the time cap); with
                ``unindexed`` the scheduler's lookup pools are emptied of what they indexed before
                each, so every block file is stat'ed, as a scheduler that did not see these blocks
                published (another process or node saved them, or the index entries passed
                index_ttl_s) finds them."""
                nonlocal rid
                times: list[float] = []
                is_async = False
                deadline = time.monotonic() + time_cap_s
                with tracer.rf(f"bench/match/{label}"):
                    while len(times) < 3 or (len(times) < 30 and time.monotonic() < deadline):
                        if unindexed:
                            for pool in sched._lookup_pools:
                                pool._index.clear()
                        req = SimRequest(rid, prompt, tokens=list(prompt))  # held as C ints, as TensorRT-LLM's
                        t0 = time.perf_counter()
                        matched, is_async = sched.get_num_new_matched_tokens(req, 0)
                        times.append(time.perf_counter() - t0)
                        sched.request_reset(req)
                        rid += 1
                        if matched != MATCH_BLOCKS * TOKENS_PER_BLOCK:
                            raise RuntimeError(f"fully cached prompt matched {matched} tokens ({label}), expected "
                                               f"{MATCH_BLOCKS * TOKENS_PER_BLOCK}")
                return times, is_async

            times, is_async = match_calls("calls", False)
            unindexed, _ = match_calls("unindexed", True)
            unindexed.sort()
            out.update({"unindexed_calls": len(unindexed),
                        "unindexed_median_ms": round(unindexed[len(unindexed) // 2] * 1e3, 3),
                        "unindexed_min_ms": round(unindexed[0] * 1e3, 3)})
            comp: dict[str, Any] = {"native": native.BUILT}
            seed = chain_seed(base_fingerprint(peer.geometry), None)
            t0 = time.perf_counter()
            chain_from_tokens(seed, prompt, 0, TOKENS_PER_BLOCK, MATCH_BLOCKS)
            comp["key_chain_ms"] = round(1e3 * (time.perf_counter() - t0), 3)
            t0 = time.perf_counter()
            extend_chain(seed, tokens_to_bytes(prompt), TOKENS_PER_BLOCK, 0, MATCH_BLOCKS)
            comp["key_chain_python_ms"] = round(1e3 * (time.perf_counter() - t0), 3)
            worker.pool.count_present(keys)
            t0 = time.perf_counter()
            worker.pool.count_present(keys)
            comp["count_present_warm_ms"] = round(1e3 * (time.perf_counter() - t0), 3)
            out["components"] = comp
            warm = sorted(times[1:])
            out.update({"first_call_ms": round(times[0] * 1e3, 3), "warm_calls": len(warm),
                        "warm_median_ms": round(warm[len(warm) // 2] * 1e3, 3),
                        "warm_min_ms": round(warm[0] * 1e3, 3), "warm_max_ms": round(warm[-1] * 1e3, 3),
                        "is_async": bool(is_async), "index_ttl_s": worker.pool.index_ttl_s,
                        "note": "first call after the saves, then calls that hit the index (warm), then calls "
                                "with the index emptied before each (unindexed: every block file stat'ed)"})
        finally:
            worker.shutdown()
    return out

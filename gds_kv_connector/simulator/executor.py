"""A reference executor that drives a connector the way TensorRT-LLM's PyExecutor does.

It follows the contract's call order (sections 4 and 5): admission calls
``get_num_new_matched_tokens`` once, allocates pages and calls ``update_state_after_alloc``;
an asynchronous load parks the request; each iteration that can queue work builds the
scheduler output, the metadata (pickled, as the TP broadcast would), binds it, starts loads,
runs the forward with per-layer hooks and ``wait_for_save``; finished requests go through
``request_finished``; and every iteration ends with ``get_finished``, including idle ones in
which nothing else runs.  It checks the executor's invariants and raises
:class:`InvariantViolation` when a connector breaks one, and it verifies every block that it
did not compute itself (loaded, or a simulated device-cache hit) byte for byte before use.

Two manager versions are modelled (``ExecutorConfig.api``).  ``"release"`` is the release
manager.  ``"newest"`` is the newest one: where the connector implements the prefix-reservation
protocol (all of it, or start-up fails) admission reserves with ``reserve_prefix``, the accepted
load reaches the connector in ``SchedulerOutput.prefix_loads``, is retired by
``get_finished_prefix_loads`` and its reservation released then; each iteration binds a plan and
calls ``start_load_kv`` twice, for two rounds of admissions (newly bound work each time), and
once more with nothing new bound.  In both, allocations can be destroyed and replayed as
TensorRT-LLM does, with no connector hook (:meth:`ReferenceExecutor.drop_after_alloc`,
:meth:`ReferenceExecutor.roll_back`), and with ``scribble_freed`` a page is overwritten the
moment it is freed and checked untouched when it is allocated again, so a connector that writes
a free page, or saves from one, is caught.
"""

from __future__ import annotations

import array
import pickle
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from gds_kv_connector.config.trace_ranges import trace_range
from gds_kv_connector.connector.trtllm_api import KvCacheConnectorScheduler, KvCacheConnectorWorker, PrefixLoad, RequestData, SchedulerOutput
from gds_kv_connector.simulator.model import ModelShape, PrefixHashes, ReferenceModel


class InvariantViolation(AssertionError):
    """The connector broke a rule the real executor relies on."""


class State(Enum):
    WAITING = "waiting"
    PARKED = "parked"  # async load in flight
    CONTEXT = "context"
    GENERATION = "generation"
    SAVING = "saving"  # finished; blocks held for async saves
    DONE = "done"


@dataclass
class SimRequest:
    request_id: int
    prompt: list[int]
    max_new_tokens: int = 4
    cache_salt: str | None = None
    device_hit_blocks: int = 0
    is_dummy_request: bool = False
    # what TensorRT-LLM's LlmRequest also carries, None when unused: the connector reads them per request
    lora_task_id: int | None = None
    multimodal_hashes: list[list[int]] | None = None
    py_multimodal_data: dict | None = None
    multimodal_embedding: Any = None
    # executor state
    tokens: list[int] = field(default_factory=list)
    state: State = State.WAITING
    pos: int = 0
    block_ids: list[int] = field(default_factory=list)
    reported_tokens: int = 0
    reported_blocks: int = 0
    external: int = 0
    load_async: bool = False
    verified_blocks: int = 0
    generated: int = 0
    hashes: PrefixHashes = field(default_factory=PrefixHashes)

    def __post_init__(self) -> None:
        self.hold_tokens()

    def hold_tokens(self) -> None:
        """Take ``tokens`` into the C copy that ``get_tokens`` converts (the request's C++ side), so
        outside any timed callback: the executor calls it when a request arrives."""
        self._held = array.array("i", self.tokens)
        self._held_for: list[int] | None = self.tokens

    @property
    def py_request_id(self) -> int:
        return self.request_id

    def get_tokens(self, beam: int = 0) -> list[int]:
        """A new list with a new int per token, as TensorRT-LLM's binding converts its C++ vector on
        each call (about 22 ns a token against 1.2 for copying a list: 2.9 ms for a 128k-token
        prompt, which a connector's match pays).  Tokens appended since the last call are added to
        the C copy; a list put in place of ``tokens`` is copied anew."""
        held, tokens = self._held, self.tokens
        if self._held_for is not tokens or len(held) > len(tokens):
            self.hold_tokens()
            held = self._held
        elif len(held) < len(tokens):
            held.extend(tokens[len(held):])
        return held.tolist()

    def get_num_tokens(self, beam: int = 0) -> int:
        return len(self.tokens)

    def get_token(self, beam: int, pos: int) -> int:
        return self.tokens[pos]


@dataclass
class ExecutorConfig:
    shape: ModelShape = field(default_factory=ModelShape)
    num_blocks: int = 512
    max_batch: int = 8
    chunk_size: int | None = None  # chunked prefill: tokens per context chunk
    overlap: bool = False  # deliver sampled tokens one report late, like the overlap scheduler
    device: str = "cpu"
    transfer_timeout_s: float = 120.0
    idle_sleep_s: float = 0.001
    api: str = ""  # the manager modelled: "release" (also "") or "newest" (the module docstring)
    scribble_freed: bool = False  # overwrite a page when it is freed; check it untouched when allocated


SCRIBBLE = 0xA5  # the byte a freed page is filled with under ``scribble_freed``


@dataclass
class RunStats:
    iterations: int = 0
    idle_iterations: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    loaded_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    async_loads: int = 0
    sync_loads: int = 0
    blocks_verified: int = 0
    max_meta_bytes: int = 0
    callback_s: float = 0.0
    layer_hook_calls: int = 0
    layer_hook_s: float = 0.0
    wall_s: float = 0.0


class ReferenceExecutor:
    def __init__(self, scheduler: Any, worker: Any, config: ExecutorConfig) -> None:
        self.sched, self.worker, self.cfg = scheduler, worker, config
        s = config.shape
        self.model = ReferenceModel(s)
        self.pool = torch.zeros((config.num_blocks, s.num_layers, s.kv_factor, s.block_elems), dtype=s.dtype,
                                device=config.device)
        self.pool_bytes = self.pool.view(config.num_blocks, -1).view(torch.uint8)
        self.free = deque(range(config.num_blocks))
        self.reqs: dict[int, SimRequest] = {}
        self.waiting: deque[SimRequest] = deque()
        self.stats = RunStats()
        # callback name -> [calls, seconds]: the same spans as the stats' totals, split by callback, so a
        # breakdown needs no wrapper of its own (a wrapper's time would land inside these spans)
        self.callback_times: dict[str, list] = {}
        self._new_saving: list[int] = []
        self._new_loading: list[int] = []
        self._pending: dict[int, tuple[str, float]] = {}  # id -> (kind, deadline)
        if config.api not in ("", "release", "newest"):
            raise ValueError(f"ExecutorConfig.api must be 'release' or 'newest', not {config.api!r}")
        self._newest = config.api == "newest"
        self._reserving = self._newest and _implements_reservations(scheduler, worker)
        self._next_reservation = 1
        self._accepted: dict[int, Any] = {}  # reservation id -> accepted PrefixLoad not dispatched yet
        self._dispatched: dict[int, tuple[Any, float]] = {}  # reservation id -> (PrefixLoad, deadline)
        self._held_for_load: set[int] = set()  # finished requests whose pages wait for a prefix load
        self.pages_written_free = 0  # pages found written while free (scribble_freed)
        if config.scribble_freed:
            self.pool_bytes.fill_(SCRIBBLE)
        self._stream = torch.cuda.current_stream() if config.device.startswith("cuda") else None
        self._timed(self.worker.register_kv_caches, self.pool)
        self._timed(self.sched.wait_for_initialization)

    # -- public -----------------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        req.tokens = list(req.prompt)
        req.hold_tokens()
        self.reqs[req.request_id] = req
        self.waiting.append(req)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(req.prompt)

    def run_until_done(self, max_iterations: int = 1_000_000) -> RunStats:
        t0 = time.perf_counter()
        for _ in range(max_iterations):
            if all(r.state is State.DONE for r in self.reqs.values()):
                break
            self.step()
        else:
            raise InvariantViolation(f"requests not done after {max_iterations} iterations")
        self.stats.wall_s += time.perf_counter() - t0
        return self.stats

    def output_tokens(self, rid: int) -> list[int]:
        r = self.reqs[rid]
        return r.tokens[len(r.prompt):]

    # -- one iteration ----------------------------------------------------------------------------
    def step(self) -> None:
        self.stats.iterations += 1
        for r in [r for r in self.reqs.values() if r.state is State.CONTEXT and r.pos]:
            if self.roll_back(r):  # scheduling destroys a running allocation (V2 MAX_UTILIZATION)
                self._destroy(r)
        if self._newest:
            self._step_newest()
        else:
            admitted_parked = self._admit()
            batch = self._batch()
            if batch or admitted_parked:
                with trace_range("executor/iteration"):
                    self._ensure_generation_blocks(batch)
                    self._bind_and_start(self._scheduler_output(batch))
                    self._run_forward(batch)
            else:
                self._idle()
        self._poll_finished()

    def _step_newest(self) -> None:
        """Two admission rounds, each bound and started on its own (``start_load_kv`` covers newly
        bound work only), a third ``start_load_kv`` with nothing new bound, then the forward."""
        first = self._admit(limit=1)
        batch = self._batch()
        reported = set()
        if batch or first or self._accepted:
            self._ensure_generation_blocks(batch)
            self._bind_and_start(self._scheduler_output(batch))
            reported = {r.request_id for r in batch}
        second = self._admit()
        more = [r for r in self._batch() if r.request_id not in reported]
        if more or second or self._accepted:
            self._bind_and_start(self._scheduler_output(more))
        batch = self._batch()
        if not (batch or first or second or reported):
            self._idle()
            return
        self._timed(self.worker.start_load_kv, self._stream)  # nothing newly bound: must start nothing
        self._run_forward(batch)

    def _batch(self) -> list[SimRequest]:
        return [r for r in self.reqs.values() if r.state in (State.CONTEXT, State.GENERATION)][:self.cfg.max_batch]

    def _idle(self) -> None:
        self.stats.idle_iterations += 1
        time.sleep(self.cfg.idle_sleep_s)

    def _bind_and_start(self, output: Any) -> None:
        """Build the plan (pickled, as the TP broadcast would), bind it, mark the accepted prefix
        loads dispatched (the newest manager does so before the worker can write), start loads."""
        if self._reserving:
            output.prefix_loads = list(self._accepted.values())
        with trace_range("executor/iteration"):
            meta = self._timed(self.sched.build_connector_meta, output)
            blob = pickle.dumps(meta)  # the TP broadcast pickles it
            self.stats.max_meta_bytes = max(self.stats.max_meta_bytes, len(blob))
            self._timed(self.worker.bind_connector_meta, pickle.loads(blob))
            deadline = time.monotonic() + self.cfg.transfer_timeout_s
            for load in output.prefix_loads if self._reserving else ():
                self._dispatched[load.reservation_id] = (self._accepted.pop(load.reservation_id), deadline)
            self._timed(self.worker.start_load_kv, self._stream)

    def _run_forward(self, batch: list[SimRequest]) -> None:
        if batch:
            self._forward(batch)
            self._timed(self.worker.wait_for_save, self._stream)
            self._sample_and_finish(batch)

    def _admit(self, limit: int | None = None) -> bool:
        admitted_parked = False
        tpb = self.cfg.shape.tokens_per_block
        admitted = 0
        while self.waiting and (limit is None or admitted < limit):
            req = self.waiting[0]
            need = -(-len(req.prompt) // tpb)
            if len(self.free) < need + 1:
                if not any(r.state not in (State.WAITING, State.DONE) for r in self.reqs.values()):
                    raise InvariantViolation(f"request {req.request_id} needs {need} blocks; pool too small")
                break
            self.waiting.popleft()
            admitted += 1
            req.block_ids = self._allocate(need)
            device = min(req.device_hit_blocks, (len(req.prompt) - 1) // tpb) * tpb
            req.hashes.extend_to(req.tokens, len(req.prompt))
            if device:  # a device prefix-cache hit: those pages already hold the right KV
                self.model.write_tokens(self.pool_bytes, req.block_ids, req.hashes.hashes, 0, device)
            if self._reserving:
                matched, is_async, load = self._reserve(req, device)
            else:
                matched, is_async = self._timed(self.sched.get_num_new_matched_tokens, req, device)
                load = None
            if not isinstance(matched, int) or matched < 0:
                raise InvariantViolation(f"get_num_new_matched_tokens returned {matched!r}")
            if matched == 0 and is_async:
                raise InvariantViolation("load_kv_async must be False when num_tokens is 0!")
            if device + matched > len(req.prompt) - 1:
                raise InvariantViolation(f"request {req.request_id}: matched {matched} + device {device} leaves no "
                                         f"prompt token of {len(req.prompt)} to compute")
            self._timed(self.sched.update_state_after_alloc, req, list(req.block_ids))
            if self.drop_after_alloc(req):  # a failed admission: destroyed before it was committed
                if load is not None:  # the runtime releases an accepted load that never started
                    self._timed(self.sched.release_prefix_reservation, req, load.reservation_id, load.start,
                                load.end)
                self._destroy(req)
                continue
            if load is not None:
                self._accepted[load.reservation_id] = load
            req.pos, req.external, req.load_async = device + matched, matched, bool(is_async)
            req.verified_blocks = 0
            self.stats.device_hit_tokens += device
            self.stats.loaded_tokens += matched
            if is_async:
                req.state = State.PARKED
                if load is None:  # a reservation's load is reported by its id
                    self._new_loading.append(req.request_id)
                self.stats.async_loads += 1
                admitted_parked = True
            else:
                req.state = State.CONTEXT
                self.stats.sync_loads += bool(matched)
        return admitted_parked

    def _reserve(self, req: SimRequest, device: int) -> tuple[int, bool, Any]:
        """The newest manager's admission: reserve, accept (the whole offer, or what ``accept``
        keeps), release the rest; the accepted load waits for the next plan's ``prefix_loads``."""
        rid = self._next_reservation
        self._next_reservation += 1
        count, is_async = self._timed(self.sched.reserve_prefix, req, device, rid)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0 or not isinstance(is_async, bool):
            raise InvariantViolation(f"reserve_prefix returned {(count, is_async)!r}")
        if count == 0:
            if is_async:
                raise InvariantViolation("An empty prefix reservation cannot load asynchronously")
            return 0, False, None
        start, end = self.accept(req, device, device + count)
        if not device <= start <= end <= device + count:
            raise InvariantViolation("the accepted prefix must be inside its reservation")
        for lo, hi in ((device, start), (end, device + count)):
            if lo < hi:
                self._timed(self.sched.release_prefix_reservation, req, rid, lo, hi)
        if start == end:
            return 0, False, None
        load = PrefixLoad(rid, req.request_id, start, end, is_async, [list(req.block_ids)], list(req.tokens),
                          req.cache_salt)
        return end - start, is_async, load

    # -- what a test decides ------------------------------------------------------------------------
    def accept(self, req: SimRequest, start: int, end: int) -> tuple[int, int]:
        """The part of a reservation ``[start, end)`` the runtime accepts: all of it by default."""
        return start, end

    def drop_after_alloc(self, req: SimRequest) -> bool:
        """Whether this admission fails right after ``update_state_after_alloc`` (no by default)."""
        return False

    def roll_back(self, req: SimRequest) -> bool:
        """Whether scheduling destroys this request's allocation now, part of its prompt computed (no
        by default)."""
        return False

    # -- pages ------------------------------------------------------------------------------------
    def _allocate(self, n: int) -> list[int]:
        """``n`` free pages; with ``scribble_freed`` each must hold what it was filled with when freed."""
        pages = [self.free.popleft() for _ in range(n)]
        if self.cfg.scribble_freed:
            for p in pages:
                if not bool((self.pool_bytes[p] == SCRIBBLE).all()):
                    self.pages_written_free += 1
                    raise InvariantViolation(f"page {p} was written while it was free")
        return pages

    def _free_pages(self, pages: list[int]) -> None:
        if self.cfg.scribble_freed and pages:
            self.pool_bytes[pages] = SCRIBBLE  # another request's KV, at once
        self.free.extend(pages)

    def check_free_pages(self) -> int:
        """Raise if a free page was written since it was freed (``scribble_freed``); the pages checked."""
        if not self.cfg.scribble_freed:
            return 0
        for p in self.free:
            if not bool((self.pool_bytes[p] == SCRIBBLE).all()):
                self.pages_written_free += 1
                raise InvariantViolation(f"page {p} was written while it was free")
        return len(self.free)

    def _destroy(self, req: SimRequest) -> None:
        """Destroy the request's allocation and queue it to replay from scratch, with no connector
        hook, as TensorRT-LLM does after a rollback or a failed admission; like its manager, refuse
        while a load owns the allocation."""
        rid = req.request_id
        if rid in self._pending or any(load.request_id == rid for load, _ in self._dispatched.values()):
            raise InvariantViolation(f"cannot destroy request {rid}'s allocation while a load owns it")
        if req.generated:
            raise InvariantViolation("the reference executor replays requests still in their prompt only")
        self._free_pages(req.block_ids)
        req.block_ids = []
        req.state = State.WAITING
        req.pos = req.reported_tokens = req.reported_blocks = req.external = req.verified_blocks = 0
        req.load_async = False
        self.waiting.append(req)

    def _ensure_generation_blocks(self, batch: list[SimRequest]) -> None:
        tpb = self.cfg.shape.tokens_per_block
        for r in batch:
            if r.state is State.GENERATION:
                while len(r.block_ids) * tpb < len(r.tokens):
                    if not self.free:
                        raise InvariantViolation("out of KV blocks during generation")
                    r.block_ids += self._allocate(1)

    def _scheduler_output(self, batch: list[SimRequest]) -> Any:
        out = SchedulerOutput()
        for r in batch:
            visible = len(r.tokens) - (1 if self.cfg.overlap and r.state is State.GENERATION else 0)
            visible = max(visible, r.reported_tokens)
            first = r.reported_tokens == 0
            if r.state is State.CONTEXT:
                computed = r.pos - (r.external if first and not r.load_async else 0)
                scheduled = self._chunk(r)
            else:
                computed, scheduled = visible - 1, 1
            rd = RequestData(request_id=r.request_id, new_tokens=r.tokens[r.reported_tokens:visible],
                             new_block_ids=r.block_ids[r.reported_blocks:], computed_position=computed,
                             num_scheduled_tokens=scheduled)
            if hasattr(rd, "cache_salt"):
                rd.cache_salt = r.cache_salt
            r.reported_tokens, r.reported_blocks = visible, len(r.block_ids)
            (out.new_requests if first else out.cached_requests).append(rd)
        return out

    def _chunk(self, r: SimRequest) -> int:
        remaining = len(r.prompt) - r.pos
        return min(remaining, self.cfg.chunk_size) if self.cfg.chunk_size else remaining

    def _forward(self, batch: list[SimRequest]) -> None:
        s = self.cfg.shape
        spans = []
        for r in batch:
            if r.state is State.CONTEXT:
                start, end = r.pos, r.pos + self._chunk(r)
            else:
                start, end = len(r.tokens) - 1, len(r.tokens)
            r.hashes.extend_to(r.tokens, end)
            spans.append((r, start, end))
        with trace_range("executor/forward"):
            for layer in range(s.num_layers):
                self._timed(self.worker.wait_for_layer_load, layer, self._stream, layer_hook=True)
                if layer == 0:
                    for r, start, _ in spans:
                        self._verify_prefix(r, start)
                for r, start, end in spans:
                    self.model.write_tokens(self.pool_bytes, r.block_ids, r.hashes.hashes, start, end, layer)
                self._timed(self.worker.save_kv_layer, layer, self._stream, layer_hook=True)
        for r, start, end in spans:
            self.stats.computed_tokens += end - start
            if r.state is State.CONTEXT:
                r.pos = end

    def _verify_prefix(self, r: SimRequest, start: int) -> None:
        """Check every full block before ``start`` that this executor did not write itself."""
        tpb = self.cfg.shape.tokens_per_block
        for b in range(r.verified_blocks, start // tpb):
            if not self.model.block_matches(self.pool_bytes, r.block_ids[b], r.hashes.hashes, b):
                raise InvariantViolation(f"request {r.request_id}: block {b} (page {r.block_ids[b]}) does not hold "
                                         "the KV of its prefix: wrong, torn or stale load")
            self.stats.blocks_verified += 1
        r.verified_blocks = max(r.verified_blocks, start // tpb)

    def _sample_and_finish(self, batch: list[SimRequest]) -> None:
        for r in batch:
            if r.state is State.CONTEXT and r.pos < len(r.prompt):
                continue
            r.tokens.append(self.model.next_token(r.hashes.hashes[len(r.tokens) - 1]))
            r.generated += 1
            self.stats.generated_tokens += 1
            r.state = State.GENERATION
            if r.generated >= r.max_new_tokens:
                self._finish(r)

    def _finish(self, r: SimRequest) -> None:
        keep = self._timed(self.sched.request_finished, r, list(r.block_ids))
        if keep:
            r.state = State.SAVING
            self._new_saving.append(r.request_id)
        else:
            self._release(r)

    def _release(self, r: SimRequest) -> None:
        if any(load.request_id == r.request_id for load, _ in self._dispatched.values()):
            self._held_for_load.add(r.request_id)  # a prefix load still owns its pages
            r.state = State.SAVING
            return
        self._free_pages(r.block_ids)
        r.block_ids = []
        r.state = State.DONE

    def _poll_finished(self) -> None:
        now = time.monotonic()
        for rid in self._new_saving:
            self._pending[rid] = ("save", now + self.cfg.transfer_timeout_s)
        for rid in self._new_loading:
            self._pending[rid] = ("load", now + self.cfg.transfer_timeout_s)
        saving, loading = self._timed(self.worker.get_finished, self._new_saving, self._new_loading)
        self._new_saving, self._new_loading = [], []
        for kind, ids in (("save", saving), ("load", loading)):
            for rid in ids:
                entry = self._pending.pop(rid, None)
                if entry is None or entry[0] != kind:
                    raise InvariantViolation(f"get_finished reported {kind} of request {rid}, which was not pending "
                                             f"(never passed in, or already reported)")
                r = self.reqs[rid]
                if kind == "save":
                    self._release(r)
                else:
                    r.state = State.CONTEXT
        for rid, (kind, deadline) in self._pending.items():
            if now > deadline:
                raise InvariantViolation(f"KV connector failed: {kind} of request {rid} timed out")
        if self._reserving:
            self._retire_prefix_loads(now)

    def _retire_prefix_loads(self, now: float) -> None:
        """Reservations whose loads the worker finished: each must have been dispatched and be
        reported once; its range is released, a parked request resumes, a finished one is freed."""
        for res in self._timed(self.worker.get_finished_prefix_loads):
            entry = self._dispatched.pop(res, None)
            if entry is None:
                raise InvariantViolation(f"get_finished_prefix_loads reported reservation {res}, which was not "
                                         "dispatched (never accepted, or already reported)")
            load = entry[0]
            r = self.reqs[load.request_id]
            self._timed(self.sched.release_prefix_reservation, r, res, load.start, load.end)
            if r.request_id in self._held_for_load:
                self._held_for_load.discard(r.request_id)
                self._release(r)
            elif r.state is State.PARKED:
                r.state = State.CONTEXT
        for res, (load, deadline) in self._dispatched.items():
            if now > deadline:
                raise InvariantViolation(f"KV connector failed: prefix load {res} of request {load.request_id} "
                                         "timed out")

    # -- timing -----------------------------------------------------------------------------------
    def _timed(self, fn, *args, layer_hook: bool = False):
        """Call a connector callback, charging its time to the executor thread's account."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            dt = time.perf_counter() - t0
            if layer_hook:
                self.stats.layer_hook_s += dt
                self.stats.layer_hook_calls += 1
            else:
                self.stats.callback_s += dt
            e = self.callback_times.get(fn.__name__)
            if e is None:
                e = self.callback_times[fn.__name__] = [0, 0.0]
            e[0] += 1
            e[1] += dt


def _implements_reservations(scheduler: Any, worker: Any) -> bool:
    """Whether the connector implements the prefix-reservation protocol, as the newest manager
    decides: all of it (reserve_prefix, release_prefix_reservation, get_finished_prefix_loads
    overridden), or none; a part of it fails start-up."""
    def overridden(obj: Any, base: type, name: str) -> bool:
        own = getattr(type(obj), name, None)
        return own is not None and own is not getattr(base, name, None)
    have = [overridden(scheduler, KvCacheConnectorScheduler, "reserve_prefix"),
            overridden(scheduler, KvCacheConnectorScheduler, "release_prefix_reservation"),
            overridden(worker, KvCacheConnectorWorker, "get_finished_prefix_loads")]
    if any(have) and not all(have):
        raise InvariantViolation("KV connector prefix reservations require reserve_prefix and "
                                 "release_prefix_reservation on the scheduler and get_finished_prefix_loads on "
                                 "every worker")
    return all(have)

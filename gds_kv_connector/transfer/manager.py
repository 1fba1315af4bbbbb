"""Worker-side transfer bookkeeping: batches run on transfer threads and are polled, never awaited.

The executor calls ``start_load_kv`` and ``wait_for_save`` only in iterations that run a
forward, so every accepted batch must finish on its own threads; ``get_finished`` (called
every iteration) only looks at futures with ``done()``.  A batch first waits for the CUDA
event that orders it after the forward stream, then moves bytes through the pool layer.

Saves are best-effort and loads are not: a load is waited for (by the forward, or by a parked
request), so transfer threads take every queued load before any queued save, and storage slower
than the KV the forward produces costs saves (dropped beyond ``max_queued_save_bytes``, or when
they cannot start before the deadline), never the process.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Callable, Collection, Iterable, Protocol

from gds_kv_connector.store.base import LoadFailure, LoadStopped, SaveOutcome, open_store
from gds_kv_connector.engines.base import IoEngine
from gds_kv_connector.engines.kv_layout import KvPool
from gds_kv_connector.transfer.jobs import LoadOp, SaveOp
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.config.settings import Settings
from gds_kv_connector.util.counters import Stats
from gds_kv_connector.config.trace_ranges import trace_range

log = logging.getLogger(__name__)


# Requests submitted together are merged into batches of up to this many payload bytes (one
# request is never split).  One request's transfer is often a few blocks; run alone it pays a
# pin, an event wait, a checksum launch and a future each, and a 64-request prefill paid that 64
# times on the executor and transfer threads.  64 MiB is a batch the bench finds no slower
# than larger ones (nor are 8 or 16 transfer threads faster than 4 with it).
MERGE_BYTES = 64 << 20
# How often a fence waiting for a running save asks whether its engine has staged its pages
STAGED_POLL_S = 0.005


# Which queue a batch of each kind waits in: transfer threads take from the first non-empty one, so
# a synchronous load (the forward waits for it) passes asynchronous ones, and every load passes
# saves, which nothing waits for until their request finishes.
_QUEUE_OF = {"sync": 0, "load": 1, "save": 2}
# The latency histogram (util.counters) a completed batch of each kind is observed in
_LATENCY = {"sync": "load_latency_us", "load": "load_latency_us", "save": "save_latency_us"}


@dataclass(slots=True)
class _Batch:
    """One future's work: the ops of one or more requests merged by ``_batches``.

    The executor thread makes one per batch, not one per request: a 64-request prefill is a few
    batches, and each request is tracked only by a count of its batches in flight."""

    kind: str  # "save", "load" (asynchronous) or "sync" (a synchronous load)
    future: Future
    accepted: float
    ops: list[Any]  # what the requests' counts were raised for; settled as such
    nbytes: int
    run: list[Any]  # what the batch moves: ``ops`` less those of requests fenced before it started
    event: Any
    deadline: float
    started: float = 0.0  # when a transfer thread took it (0 until then)
    # A running batch none of whose requests needs it any more (each reset, or for a load each offer
    # cancelled; or shutdown): it stops between blocks
    stopped: bool = False
    stop_cause: str = ""  # a save: why its in_time first said no, "stopped" or "deadline"; a load: "cancel" or "fence"
    fenced: set[int] = field(default_factory=set)  # requests in it that stopped needing it while it ran
    # A save whose pages will not be read again (the engine staged them; set on the transfer thread),
    # and whether its requests' counts were taken off for that already (the executor thread, in poll)
    views_done: bool = False
    released: bool = False
    ahead: bool = False  # staged, it stopped counting against transfer_threads (stage_ahead)
    watch: _Watch | None = None  # an asynchronous load's submission, for the load meter

    @property
    def shared(self) -> bool:
        """More than one request rides in it, so cancelling one must not drop it."""
        rid = self.ops[0].request_id
        return any(op.request_id != rid for op in self.ops)


class ConnectorFailure(RuntimeError):
    """A promised transfer cannot complete; TensorRT-LLM treats this as fatal."""


class LoadMeter(Protocol):
    """What the manager tells about its loads to whoever estimates their speed
    (``connector.load_policy.LoadRate``): bytes accepted and settled, each batch's start and end, and
    for each asynchronous load, the time from its acceptance to the poll that settled its last batch."""

    queued_bytes: int

    def now(self) -> float: ...
    def queue(self, nbytes: int) -> None: ...
    def started(self) -> None: ...
    def ended(self, nbytes: int) -> None: ...
    def settled(self, seconds: float, nbytes: int) -> None: ...


@dataclass
class _Watch:
    """One submission of asynchronous loads, timed for the load meter: accepted at ``since`` (the
    meter's clock), ``nbytes`` its own bytes and those of the loads queued ahead of it then; done when
    its ``left`` batches have settled, reported only if none failed or stopped (its time would not be
    a load's)."""

    since: float
    nbytes: int
    left: int
    spoiled: bool = False


class TransferManager:
    def __init__(self, pool: BlockPool, engine: IoEngine, kv: KvPool, settings: Settings, stats: Stats,
                 on_saved: Callable[[int], None] | None = None,
                 record_event: Callable[[Any], Any] | None = None, load_meter: LoadMeter | None = None) -> None:
        self.pool, self.engine, self.kv, self.settings, self.stats = pool, engine, kv, settings, stats
        self._load_meter = load_meter
        self._on_saved = on_saved  # bytes of files published, for the capacity guard
        # stream -> an event after the work queued on it so far (None for a host pool): recorded
        # for finished requests' saves only when some arrive, not every iteration
        self._record_event = record_event or (lambda stream: None)
        # transfer_threads batches run at once, and up to stage_ahead more while saves whose engine has
        # staged their pages write from the stage (each such save gives its place back: _stage_next)
        self._threads = settings.transfer_threads + settings.stage_ahead
        self._exec = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="gdskv-xfer")
        # Start every transfer thread now: ThreadPoolExecutor starts them lazily, one per submit, which
        # would put thread creation on the executor thread in the first iteration that transfers.
        started = threading.Barrier(self._threads + 1)
        for _ in range(self._threads):
            self._exec.submit(started.wait)
        started.wait()
        # A runner that takes loads only, started for a load submitted while every transfer thread is
        # writing a save batch (up to MERGE_BYTES each): the load would wait for one of them to end.
        self._load_lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gdskv-load")
        self._load_lane.submit(int).result()  # its thread started now, not in an iteration that needs it
        self._running = 0  # batches running on transfer threads (the load lane's not counted)
        self._saving = 0  # of those, saves (transfer threads that would not take a load)
        self._staged_saves = 0  # of those, saves writing from their stage: not counted against transfer_threads
        self._inflight: list[_Batch] = []  # in submission order, so by acceptance time
        # request id -> its batches in flight that may still touch its pages: every kind, a save until
        # the engine has staged what it reads (then the request may be reported while the write runs)
        self._pending: dict[int, int] = {}
        self._pending_loads: dict[int, int] = {}  # request id -> its asynchronous load batches in flight
        self._load_failed: dict[int, BaseException] = {}  # a failed async load, until its request is polled
        self._dropped_loads: set[int] = set()  # requests whose whole handed-over offer was cancelled, until reported
        self._sync_loads: list[_Batch] = []
        # Loads of prefix reservations (``LoadOp.reservation``): batches in flight per reservation,
        # the first failure of one, and those done and not yet reported (``finished_reservations``)
        self._res_left: dict[int, int] = {}
        self._res_failed: dict[int, BaseException] = {}
        self._res_done: list[int] = []
        self._queues: tuple[collections.deque[_Batch], ...] = (collections.deque(), collections.deque(),
                                                               collections.deque())
        # Held while a transfer thread starts a batch and while a fence filters one, so a batch is
        # either started with its fenced ops already out, or running where the fence waits for it.
        self._start_lock = threading.Lock()
        self._save_bytes = 0  # payload bytes of save batches accepted and not yet settled
        self._finishing: dict[int, float] = {}  # request id -> when it was handed to us
        self._loading: dict[int, float] = {}
        self._inbox: queue.SimpleQueue[list[SaveOp]] = queue.SimpleQueue()
        self._forward_stream: Any = None  # where the latest forward was queued
        self._last_event: Any = None  # an event after that forward, once one was recorded
        self._causes_logged: set[str] = set()
        self._closed = False

    # -- submission (executor thread) -------------------------------------------------------------
    def submit_loads(self, ops: list[LoadOp], event: Any) -> None:
        self._check_open()
        if not all(op.keys for op in ops):
            # a parked request left with no block to load (no page for any, or cancel_load took them
            # all): done at its first poll, not waited for until the deadline fails the process
            for op in ops:
                if not op.keys:
                    if op.reservation:
                        self._res_done.append(op.reservation)
                    else:
                        self._pending_loads.setdefault(op.request_id, 0)
            ops = [op for op in ops if op.keys]
        sync = [op for op in ops if not op.is_async]
        if sync:  # waited for together before the first layer: batched apart from async loads
            self._sync_loads.extend(self._submit_many(sync, "sync", event))
        if len(sync) < len(ops):
            self._submit_many([op for op in ops if op.is_async], "load", event)

    def submit_saves(self, ops: list[SaveOp], event: Any) -> None:
        self._check_open()
        self._submit_many(ops, "save", event)

    def submit_load(self, op: LoadOp, event: Any) -> None:
        self.submit_loads([op], event)

    def submit_save(self, op: SaveOp, event: Any) -> None:
        self.submit_saves([op], event)

    def deliver_saves(self, ops: list[SaveOp]) -> None:
        """Saves of a finished request handed over by the in-process scheduler (any thread)."""
        self._inbox.put(ops)

    def note_forward(self, stream: Any, event: Any = None) -> None:
        """This iteration's forward was queued on ``stream``; ``event``, if one was recorded, marks
        its end.  Saves handed over later (:meth:`deliver_saves`) wait for that event, recorded on
        ``stream`` when they arrive if none was: later on the same stream is still after the forward."""
        self._forward_stream, self._last_event = stream, event

    def _submit_many(self, ops: list[Any], kind: str, event: Any) -> list[_Batch]:
        """Merge the ops into batches (``_batches``), one future each, queued by kind and run by at
        most ``transfer_threads`` runners that take batches from the shared queues: the executor
        thread pays one thread-pool hand-off (``_fan_out`` starts the other runners), and no runner
        idles while work is left."""
        now = time.monotonic()
        deadline = now + self.settings.deadline_s
        payload = self.pool.payload_len
        threads = self.settings.transfer_threads
        groups = _batches(ops, payload, threads)
        if kind == "save":
            groups = self._within_backlog(groups, payload)
            if not groups:
                return []
        pending = self._pending
        loads = self._pending_loads if kind == "load" else None
        res_left = self._res_left if kind != "save" else None
        batches: list[_Batch] = []
        for group, blocks in groups:
            batches.append(_Batch(kind, Future(), now, group, blocks * payload, group, event, deadline))
            for op in group:
                rid = op.request_id
                pending[rid] = pending.get(rid, 0) + 1
                if loads is not None and not op.reservation:  # a reservation's load is reported by its id
                    loads[rid] = loads.get(rid, 0) + 1
            if res_left is not None:
                for res in _reservations_in(group):
                    res_left[res] = res_left.get(res, 0) + 1
        meter = self._load_meter
        if kind != "save" and meter is not None:
            nbytes = sum(b.nbytes for b in batches)
            if kind == "load":
                watch = _Watch(meter.now(), meter.queued_bytes + nbytes, len(batches))
                for b in batches:
                    b.watch = watch
            meter.queue(nbytes)
        self._inflight += batches
        self._queues[_QUEUE_OF[kind]].extend(batches)
        self._exec.submit(_fan_out, self._exec, min(len(batches), threads), self._run_queued)
        if kind != "save" and (self._saving - self._staged_saves >= threads or self._saving >= self._threads):
            self._load_lane.submit(self._run_queued, True)
        return batches

    def _within_backlog(self, groups: list[tuple[list[SaveOp], int]], payload: int) -> list[tuple[list[SaveOp], int]]:
        """The save batches that fit under ``max_queued_save_bytes`` with those already accepted; the
        rest is dropped and counted, never queued.  Unbounded, saves that storage cannot keep up with
        queue without end: each holds its finished request's pages while it waits, and waits longer
        than the one before.  Where a batch does not fit, each request keeps its first blocks that do
        (a block is found only after the blocks before it)."""
        limit = self.settings.max_queued_save_bytes
        blocks = sum(n for _, n in groups)
        if not limit or self._save_bytes + blocks * payload <= limit:
            self._save_bytes += blocks * payload
            return groups
        room = max(limit - self._save_bytes, 0) // payload
        kept: list[tuple[list[SaveOp], int]] = []
        saved = 0
        for group, n in groups:
            if n > room:
                fit: list[SaveOp] = []
                n = 0
                for op in group:
                    take = min(len(op.keys), room - n)
                    if take <= 0:
                        break
                    fit.append(op if take == len(op.keys) else
                               op._replace(keys=op.keys[:take], parents=op.parents[:take],
                                           block_ids=op.block_ids[:take]))
                    n += take
                group = fit
            if group:
                kept.append((group, n))
                room -= n
                saved += n
        self._save_bytes += saved * payload
        self.stats.add("save_blocks_dropped_backlog", blocks - saved)
        if "backlog" not in self._causes_logged:
            self._causes_logged.add("backlog")
            log.warning("gds-kv-connector: dropping saves beyond TLLM_GDS_KV_MAX_QUEUED_SAVE_BYTES=%d (storage "
                        "writes slower than the KV is produced); serving continues, further drops are only "
                        "counted (save_blocks_dropped_backlog)", limit)
        return kept

    # -- transfer threads -------------------------------------------------------------------------
    def _run_queued(self, loads_only: bool = False) -> None:
        """A runner: take batches until none is left, from the first non-empty queue (loads before
        saves), or with ``loads_only`` from the load queues (the load lane); a cancelled one is
        skipped.  A transfer thread's runner stops while ``transfer_threads`` batches that are not
        staged saves run: the one that ends or stages next takes the following batch.  Several
        requests' ops are merged here, on the transfer thread, not by the executor thread."""
        queues, lock = (self._queues[:2] if loads_only else self._queues), self._start_lock
        limit = self.settings.transfer_threads
        while True:
            with lock:
                if not loads_only and self._running - self._staged_saves >= limit:
                    return
                batch = _take(queues)
                if batch is None:
                    return
                future = batch.future
                if not future.set_running_or_notify_cancel():
                    continue
                batch.started = time.monotonic()
                run = batch.run
                saving = batch.kind == "save"
                if not loads_only:
                    self._running += 1
                if saving:
                    self._saving += 1
            op = run[0] if len(run) == 1 else _Merged(run)
            try:
                if saving:  # its deadline counts from its start (its time queued was the storage's, not its own)
                    future.set_result(self._run_save(op, batch.event, _save_in_time(batch, self.settings.deadline_s),
                                                     _views_done(batch), self._stage_next(batch)))
                else:
                    future.set_result(self._timed_load(op, batch))
            except BaseException as exc:  # noqa: BLE001 - delivered through the future, as the pool would
                future.set_exception(exc)
            else:  # latency as its requests see it: from acceptance (time queued included) to the last byte
                self.stats.observe_us(_LATENCY[batch.kind], int(1e6 * (time.monotonic() - batch.accepted)))
            finally:
                with lock:
                    if not loads_only:
                        self._running -= 1
                    if saving:
                        self._saving -= 1
                        if batch.ahead:
                            self._staged_saves -= 1

    def _timed_load(self, op: LoadOp | _Merged, batch: _Batch) -> int:
        """Run a load batch; with a load meter, timed from after its event (the forward it is ordered
        after is not the storage's time) to its return, with the bytes it moved (0: failed or stopped)."""
        meter = self._load_meter
        if meter is None:
            return self._run_load(op, batch.event, batch.deadline, _load_in_time(batch))
        _wait_event(batch.event)
        meter.started()
        moved = 0
        try:
            moved = self._run_load(op, batch.event, batch.deadline, _load_in_time(batch))
            return moved
        finally:
            meter.ended(moved)

    def _stage_next(self, batch: _Batch) -> Callable[[], None] | None:
        """A running save's ``on_staged`` (with ``stage_ahead``): its engine has staged its pages and
        only writes from the stage are left, so its place among the ``transfer_threads`` running
        batches goes to the next queued one, whose pages are then copied off at PCIe speed instead of
        waiting for this write to end."""
        if not self.settings.stage_ahead:
            return None

        def staged() -> None:
            with self._start_lock:
                batch.ahead = True
                self._staged_saves += 1
                more = any(self._queues)
            if more:
                try:
                    self._exec.submit(self._run_queued)
                except RuntimeError:  # shutting down: nothing further starts
                    pass
        return staged

    def _run_load(self, op: LoadOp | _Merged, event: Any, deadline: float, in_time: Callable[[], bool]) -> int:
        with trace_range("io/load r{} x{}", "red", op.request_id, len(op.keys)):
            _wait_event(event)
            if not in_time():  # stopped while queued behind its event: not one file is opened
                raise LoadStopped(len(op.keys))
            store = open_store(self.pool, self.engine)
            try:
                pins = store.pin(list(op.keys))
                try:
                    views = self.kv.block_views(op.block_ids)
                    return store.load(pins, views, verify=self.settings.verify, retries=self.settings.read_retries,
                                      deadline=deadline, in_time=in_time)
                finally:
                    store.unpin(pins)
            except LoadFailure as exc:
                if isinstance(op, _Merged):
                    exc.request_id = op.owner_of(exc.key)
                raise

    def _run_save(self, op: SaveOp | _Merged, event: Any, in_time: Callable[[], bool],
                  views_read: Callable[[], None], on_staged: Callable[[], None] | None) -> SaveOutcome:
        with trace_range("io/save r{} x{}", "orange", op.request_id, len(op.keys)):
            _wait_event(event)
            views = self.kv.block_views(op.block_ids)
            out = open_store(self.pool, self.engine).save(list(op.keys), list(op.parents), views, in_time,
                                                          views_read, on_staged)
            if self._on_saved is not None and out.published:
                self._on_saved(out.published * self.pool.file_size)
            return out

    # -- completion (executor thread) -------------------------------------------------------------
    def wait_sync_loads(self) -> None:
        """Block until this iteration's synchronous loads are in place (before the first layer)."""
        jobs, self._sync_loads = self._sync_loads, []
        t0 = time.perf_counter()
        try:
            self._wait_all(jobs)
        finally:  # how long the forward was held for bytes, apart from the callbacks' own cost
            self.stats.add("sync_load_wait_us", int(1e6 * (time.perf_counter() - t0)))

    def _wait_all(self, batches: list[_Batch]) -> None:
        for batch in batches:
            remaining = batch.accepted + self.settings.deadline_s - time.monotonic()
            rid = batch.ops[0].request_id
            try:
                batch.future.result(timeout=max(remaining, 0.0))
            except CancelledError:
                if not batch.run:
                    continue  # fenced: every request in it was reset, and its pages are no longer theirs
                raise ConnectorFailure(f"gds-kv-connector: synchronous load of request {rid} was cancelled "
                                       "before it ran") from None
            except TimeoutError:
                raise ConnectorFailure(f"gds-kv-connector: synchronous load of request {rid} "
                                       f"({batch.nbytes} bytes from {self.pool.path_for(batch.ops[0].keys[0])}) "
                                       f"passed its {self.settings.deadline_s:.1f}s deadline") from None
            except Exception as exc:  # noqa: BLE001 - LoadFailure, or anything a transfer thread raised
                if batch.stopped:  # no request in it needs it (reset, or shutdown): counted when it settles
                    continue
                if isinstance(exc, LoadFailure):
                    raise self._load_failure(rid, exc) from None
                raise
            self.stats.add_many(loads_sync=len(batch.run), bytes_loaded=self._run_bytes(batch),
                                tokens_loaded=_blocks(batch.run) * self.pool.tokens_per_block)

    @property
    def has_sync_loads(self) -> bool:
        return bool(self._sync_loads)

    @property
    def has_async_loads(self) -> bool:
        """Asynchronous loads not yet reported (a cancel can still stop them)."""
        return bool(self._pending_loads)

    def queue_gauges(self) -> dict[str, int]:
        """Batches waiting for a transfer thread (loads, saves), batches accepted and not settled, and
        the bytes of saves accepted and not done (what ``max_queued_save_bytes`` bounds): the owner's
        transfer queue, as gauges of its stats file.  Read on the stats thread without the lock:
        each is one length or one integer, and a gauge a batch stale is still the queue's depth."""
        sync, load, save = map(len, self._queues)
        return {"transfer_queued_load_batches": sync + load, "transfer_queued_save_batches": save,
                "transfer_inflight_batches": len(self._inflight), "transfer_save_backlog_bytes": self._save_bytes}

    def poll(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        now = time.monotonic()
        if not self._inbox.empty():
            # One submission for every request that finished since the last poll: a batch's requests
            # finish together, and a submission each cost a thread hand-off and a future per request.
            if self._last_event is None:
                self._last_event = self._record_event(self._forward_stream)
            handed: list[SaveOp] = []
            while not self._inbox.empty():
                handed += self._inbox.get_nowait()
            self.submit_saves(handed, self._last_event)
        finishing, loading = self._finishing, self._loading
        for rid in finished_gen_req_ids:
            finishing.setdefault(rid, now)
        for rid in started_loading_req_ids:
            loading.setdefault(rid, now)
        inflight = self._inflight
        if inflight:
            if now - inflight[0].accepted > self.settings.deadline_s:
                self._check_deadlines(now)  # saves it cancels are settled at once, below
            self._settle_done()
        done_loading = [rid for rid in loading if self._loads_done(rid, now)] if loading else []
        for rid in done_loading:
            del loading[rid]
        done_saving = []
        if finishing:
            pending = self._pending
            done_saving = [rid for rid in finishing if rid not in pending and rid not in loading]
            for rid in done_saving:
                del finishing[rid]
                if not self._pending_loads.get(rid, 1):  # loads it never waited for (it was not polled)
                    del self._pending_loads[rid]
                    self._load_failed.pop(rid, None)
                    self._dropped_loads.discard(rid)
        return done_saving, done_loading

    def _settle_done(self) -> None:
        """Account each batch that completed since the last poll, once, and take it off its
        requests' counts (a save whose engine has staged its pages comes off them already while it
        writes); a failed asynchronous load is kept for its requests' next poll."""
        still: list[_Batch] = []
        loads, failed = self._pending_loads, self._load_failed
        for batch in self._inflight:
            future = batch.future
            if not future.done():
                if batch.views_done and not batch.released:  # a save writing from its stage: pages free
                    batch.released = True
                    self._uncount(batch)
                still.append(batch)
                continue
            cancelled = future.cancelled()
            exc = None if cancelled else future.exception()
            kind = batch.kind
            if cancelled and kind != "save" and batch.run:  # its pages never got their KV (a fenced
                # request's pages are no longer its own: nothing was owed to them)
                exc = CancelledError(f"load batch of {len(batch.ops)} request(s) cancelled before it ran")
            if not batch.released:
                self._uncount(batch)
            if kind != "save" and self._load_meter is not None:
                self._load_meter.queue(-batch.nbytes)
                if batch.watch is not None:
                    _watch_settled(self._load_meter, batch.watch, cancelled or exc is not None or batch.stopped)
            if kind == "load":
                for op in batch.ops:
                    if not op.reservation:
                        loads[op.request_id] -= 1
            if kind != "save" and self._res_left:
                self._settle_reservations(batch, exc)
            if kind == "save":
                self._save_bytes -= batch.nbytes
                self._account_save(batch, cancelled, exc)
            elif exc is not None and not cancelled and batch.stopped:  # a load no request needs now
                self._count_stopped_load(batch, exc)
            elif kind == "load":
                if exc is not None:
                    dropped = self._dropped_loads
                    for op in batch.run:
                        if op.reservation:
                            continue  # failed through its reservation (_settle_reservations)  # a fenced request's failure concerns pages it no longer holds,
                        if op.request_id not in dropped:  # and a cancelled one's, tokens it will not use
                            failed.setdefault(op.request_id, exc)
                elif not cancelled:
                    self.stats.add_many(loads_async=len(batch.run), bytes_loaded=self._run_bytes(batch),
                                        tokens_loaded=_blocks(batch.run) * self.pool.tokens_per_block)
        self._inflight = still

    def _settle_reservations(self, batch: _Batch, exc: BaseException | None) -> None:
        """Take a settled load batch off its reservations' counts; one whose last batch settled is done."""
        left, failed = self._res_left, self._res_failed
        for res in _reservations_in(batch.ops):
            if exc is not None and not batch.stopped and any(op.reservation == res for op in batch.run):
                failed.setdefault(res, exc)
            n = left.get(res, 0) - 1
            if n > 0:
                left[res] = n
            else:
                left.pop(res, None)
                self._res_done.append(res)

    @property
    def loading_ids(self) -> Collection[int]:
        """Requests TensorRT-LLM reported parked for an asynchronous load and not reported loaded yet."""
        return self._loading.keys()

    def finished_reservations(self) -> list[int]:
        """Reservations whose every load batch has settled since the last call, each reported once;
        one that failed raises ConnectorFailure (its pages did not get the KV TensorRT-LLM will use)."""
        if self._inflight:
            self._settle_done()
        done, self._res_done = self._res_done, []
        for res in done:
            exc = self._res_failed.pop(res, None)
            if exc is not None:
                raise ConnectorFailure(f"gds-kv-connector: load of prefix reservation {res} failed: {exc!r}") from None
        return done

    def _uncount(self, batch: _Batch) -> None:
        """Take the batch off its requests' counts of batches that may still touch their pages."""
        pending = self._pending
        for op in batch.ops:
            rid = op.request_id
            left = pending[rid] - 1
            if left:
                pending[rid] = left
            else:
                del pending[rid]

    def _run_bytes(self, batch: _Batch) -> int:
        """Payload bytes of the ops a batch ran (those of requests taken out before it started are not)."""
        return _blocks(batch.run) * self.pool.payload_len

    def _count_stopped_load(self, batch: _Batch, exc: BaseException) -> None:
        """A load stopped between blocks (or one that failed once stopped: its blocks will not be
        used): its unread blocks, all of them for a failure, under the cause that stopped it."""
        name = {"cancel": "load_blocks_cancelled", "fence": "fenced_blocks_skipped"}.get(
            batch.stop_cause, "load_blocks_dropped_at_shutdown")
        self.stats.add(name, exc.blocks if isinstance(exc, LoadStopped) else _blocks(batch.run))

    def _loads_done(self, rid: int, now: float) -> bool:
        left = self._pending_loads.get(rid)
        if left is None:  # no load was ever submitted for it
            self._check_deadline(rid, "load", self._loading[rid], now, None)
            return False
        if left:
            return False  # its batches' deadlines are checked in poll
        del self._pending_loads[rid]
        self._dropped_loads.discard(rid)
        failed = self._load_failed.pop(rid, None)
        if failed is not None:
            raise self._load_failure(rid, failed)
        return True

    def _check_deadlines(self, now: float) -> None:
        """Batches past the deadline; they are in acceptance order, so the scan stops at the first in time.

        A save that has not started by then is dropped: saves are best-effort, and a queued one only
        holds its finished request's pages (TensorRT-LLM frees them once the request is reported).
        A running save stops between blocks at its deadline (its blocks not written yet are dropped,
        counted), so slow storage ends it a write later.  A load, or a save whose write in flight at
        its deadline has still not returned the control grace after it, fails the first request
        waited on (finishing or loading) that rides in it: a running write cannot be dropped, its
        request's pages can be freed only once nothing reads them, TensorRT-LLM's own transfer
        timeout would fail the process later anyway, and this failure names the file.  A save
        writing from its stage reads no page, so it fails nothing: its requests are reported."""
        limit = self.settings.deadline_s
        for batch in self._inflight:
            if now - batch.accepted <= limit:
                return
            future = batch.future
            if future.done():
                continue
            if batch.kind == "save":
                if future.cancel():
                    self.stats.add("save_blocks_dropped_deadline", _blocks(batch.run))
                    continue
                since = batch.started  # running; 0 while the thread that took it is still starting it
                if not since or now - since <= limit + self.settings.control_grace_s:
                    continue
                if batch.views_done:  # writing from its stage: no page held, its requests reported
                    if "stuck-staged" not in self._causes_logged:
                        self._causes_logged.add("stuck-staged")
                        log.warning("gds-kv-connector: a save's write (first file %s) has not returned %.1fs after "
                                    "its deadline; its requests were reported (their pages were staged), but it "
                                    "holds a transfer thread and %d bytes of the save backlog until it does",
                                    self.pool.path_for(batch.run[0].keys[0]), self.settings.control_grace_s,
                                    batch.nbytes)
                    continue
                kind, grace = "save", self.settings.control_grace_s
            else:
                since, kind, grace = batch.accepted, "load", 0.0
            for op in batch.run:
                rid = op.request_id
                if rid in self._finishing or rid in self._loading:
                    self._check_deadline(rid, kind, since, now, op.keys[0], grace)

    def _account_save(self, batch: _Batch, cancelled: bool, exc: BaseException | None) -> None:
        """Count a completed save batch's outcome (its future's, read once by the caller)."""
        if cancelled:
            self.stats.add("save_batches_cancelled")
            return
        if exc is not None:
            self._note_save_failure(type(exc).__name__, batch, str(exc))
            return
        out: SaveOutcome = batch.future.result()
        self.stats.add_many(blocks_saved=out.published, tokens_saved=out.published * self.pool.tokens_per_block,
                            blocks_already_present=out.already_present,
                            save_lost_race=out.lost_race, bytes_saved=out.bytes_written,
                            save_blocks_failed=len(out.failed), save_arena_fallback=out.arena_fallback)
        if batch.stop_cause == "stopped":
            self.stats.add("fenced_blocks_skipped" if not self._closed else "save_blocks_dropped_at_shutdown",
                           out.expired)
        elif out.expired:
            self.stats.add("save_blocks_dropped_deadline", out.expired)
        if out.expired and batch.stop_cause == "deadline" and "expired" not in self._causes_logged:
            self._causes_logged.add("expired")
            log.warning("gds-kv-connector: a save batch stopped at its %.1fs deadline with %d blocks unwritten "
                        "(storage slower than the KV is produced); serving continues, further drops are only "
                        "counted (save_blocks_dropped_deadline)", self.settings.deadline_s, out.expired)
        for key, cause in out.failed:
            self._note_save_failure(cause, batch, self.pool.path_for(key), key)

    def _note_save_failure(self, cause: str, batch: _Batch, detail: str, key: bytes | None = None) -> None:
        self.stats.add(f"save_failed_{cause}")
        if cause not in self._causes_logged:
            self._causes_logged.add(cause)
            rid = next((op.request_id for op in batch.ops if key in op.keys), batch.ops[0].request_id)
            log.warning("gds-kv-connector: dropping saves that fail with %s (first: request %d, %s); "
                        "serving continues, further %s failures are only counted", cause, rid, detail, cause)

    def _check_deadline(self, rid: int, kind: str, since: float, now: float, first_key: bytes | None,
                        grace: float = 0.0) -> None:
        if now - since <= self.settings.deadline_s + grace:
            return
        where = self.pool.path_for(first_key) if first_key else "(no transfer was ever submitted for it)"
        late = f" and a write in flight then has not returned {grace:g}s later" if grace else ""
        raise ConnectorFailure(f"gds-kv-connector: {kind} of request {rid} exceeded its "
                               f"{self.settings.deadline_s:.1f}s deadline{late} (started {now - since:.1f}s ago; "
                               f"first file {where})")

    def _load_failure(self, rid: int, exc: BaseException) -> ConnectorFailure:
        self.stats.add("load_failures")
        if isinstance(exc, LoadFailure):
            owner = exc.request_id
            batched = f" (in one batch with request {owner}, whose block failed)" if owner not in (None, rid) else ""
            return ConnectorFailure(f"gds-kv-connector: load for request {rid} failed{batched}: key "
                                    f"{exc.key.hex()}, file {exc.path}: {exc.reason}")
        return ConnectorFailure(f"gds-kv-connector: load for request {rid} failed: {exc!r}")

    # -- cancellation and shutdown ----------------------------------------------------------------
    def fence(self, request_ids: Collection[int], wait: bool = True) -> None:
        """Stop every transfer of these requests from touching their pages, before this returns.

        V2's ``request_reset``: the requests' pages were released, and the next forward may write
        another request's KV into them.  Their transfers not started yet are skipped (their ops are
        taken out of shared batches, whose other requests' ops still run); a running save or load of
        theirs alone stops between blocks; those already moving bytes are waited for, up to their
        deadline (a running save's from its start, plus the control grace for the write in flight
        when it stopped between blocks; a load's from its acceptance: where the next poll would fail
        the process anyway), so storage that is slow, not stuck, costs the executor a wait (logged
        once it passes the control grace), not the process.  One still running then raises
        ConnectorFailure, fatal to the process: a save
        reading pages that another request overwrites would publish that request's KV under these
        requests' keys, and a load would write into another request's KV, silently wrong answers
        either way, which is worse than a crash.
        Their counts stay as they are and drain as the batches settle, so a request is still
        reported once, whether or not TensorRT-LLM goes on to pass it again.  Without ``wait`` the
        queued ops are taken out and running batches marked, but nothing is waited for (``request_reset``
        itself, which must not raise: TensorRT-LLM treats exceptions as fatal only from the worker's
        callbacks; ``start_load_kv`` waits)."""
        rids = set(request_ids)
        for rid in rids:  # a failed load of theirs concerns pages they no longer hold
            self._load_failed.pop(rid, None)
        if not any(rid in self._pending for rid in rids):
            return
        skipped, running = self._take_out(rids, ("save", "load", "sync"), "fence")
        if not wait:
            self.stats.add("fenced_blocks_skipped", skipped)
            return
        self.stats.add_many(fenced_blocks_skipped=skipped, fenced_batches_waited=len(running))
        grace, limit = self.settings.control_grace_s, self.settings.deadline_s
        t0 = time.monotonic()
        for batch in running:
            saving = batch.kind == "save" and batch.started
            # a save stops between blocks at its deadline: its write in flight then gets the grace to return
            end = batch.started + limit + grace if saving else batch.accepted + limit
            if not _off_the_pages(batch, min(grace, max(end - time.monotonic(), 0.0))):
                log.warning("gds-kv-connector: a reset request's %s of %d bytes is still running after the "
                            "%.1fs control grace; the executor waits for it, until its deadline", batch.kind,
                            batch.nbytes, grace)
                if not _off_the_pages(batch, max(end - time.monotonic(), 0.0)):
                    reset = ", ".join(str(rid) for rid in sorted(rids & {op.request_id for op in batch.run}))
                    when = f"{grace:g}s after its {limit:.1f}s deadline" if saving else f"at its {limit:.1f}s deadline"
                    raise ConnectorFailure(
                        f"gds-kv-connector: request {reset} was reset while its {batch.kind} of {batch.nbytes} "
                        f"bytes (first file {self.pool.path_for(batch.run[0].keys[0])}) was still running {when}: "
                        "its pages may now be another request's, and that transfer would move the wrong KV") from None
        if running:
            self.stats.add("fence_wait_us", int(1e6 * (time.monotonic() - t0)))
        self._settle_done()
        for rid in rids:  # and one that settled while it waited
            self._load_failed.pop(rid, None)

    def cancel_loads(self, request_ids: Collection[int]) -> None:
        """``cancel_load`` of whole offers already handed over: the requests will not use the blocks,
        and TensorRT-LLM waits for their loads to end before it frees the pages, after a cancel for
        at most its control grace (then it fails the process).  Their queued loads are taken out of
        their batches, and a running load all of whose requests were cancelled stops between blocks
        (``load_blocks_cancelled``); a running load shared with a request that still wants its blocks
        runs on.  The requests are reported loaded as their batches settle, as usual."""
        for rid in request_ids:  # a failed load of theirs concerns tokens they will not use
            self._load_failed.pop(rid, None)
        rids = {rid for rid in request_ids if self._pending_loads.get(rid)}
        if rids:
            self._dropped_loads |= rids  # until reported: a block failing meanwhile fails nothing
            skipped, _ = self._take_out(rids, ("load",), "cancel")
            self.stats.add("load_blocks_cancelled", skipped)

    def _take_out(self, rids: set[int], kinds: tuple[str, ...], cause: str) -> tuple[int, list[_Batch]]:
        """Take the ops of ``rids`` out of batches of ``kinds`` not started yet (one left empty is
        cancelled; other requests' ops in it still run) and mark each running one of theirs stopped
        once every request in it is out, by this call or earlier ones: (blocks taken out, their
        running batches)."""
        running: list[_Batch] = []
        skipped = 0
        with self._start_lock:  # no batch starts while it is filtered
            for batch in self._inflight:
                run = batch.run
                if batch.kind not in kinds or batch.future.done() or batch.views_done or \
                        not any(op.request_id in rids for op in run):
                    continue  # (a save whose views were all read writes from its stage: no page of theirs)
                if batch.future.running():
                    running.append(batch)
                    batch.fenced |= rids
                    if not batch.stopped and all(op.request_id in batch.fenced for op in run):
                        batch.stopped = True
                        if batch.kind != "save":  # a save's in_time records its own cause
                            batch.stop_cause = cause
                    continue
                keep = [op for op in run if op.request_id not in rids]
                skipped += _blocks(run) - _blocks(keep)
                batch.run = keep
                if not keep:
                    batch.future.cancel()
        return skipped, running

    def shutdown(self) -> dict[str, int]:
        """Stop accepting work, drop queued batches, stop running transfers between blocks, wait for
        in-flight ones up to the control grace."""
        self._closed = True
        with self._start_lock:  # no batch starts meanwhile; running transfers start no further block
            dropped = sum(1 for b in self._inflight if not b.future.done() and b.future.cancel())
            for batch in self._inflight:
                if batch.future.running():
                    batch.stopped = True
        while not self._inbox.empty():  # saves of finished requests handed over after the last poll
            dropped_saves = self._inbox.get_nowait()
            self.stats.add("save_blocks_dropped_at_shutdown", _blocks(dropped_saves))
        end = time.monotonic() + self.settings.control_grace_s
        stuck = 0
        for batch in self._inflight:
            try:
                batch.future.exception(timeout=max(end - time.monotonic(), 0.0))
            except TimeoutError:
                stuck += 1
            except Exception:  # noqa: BLE001 - cancelled futures raise CancelledError
                pass
        self._exec.shutdown(wait=stuck == 0, cancel_futures=True)
        self._load_lane.shutdown(wait=stuck == 0, cancel_futures=True)
        if stuck == 0:
            self._settle_done()  # no poll follows: what the last batches saved, dropped or cancelled is counted now
            self.engine.close()
        else:
            log.error("gds-kv-connector: %d transfer(s) still in flight after the %.1fs control grace",
                      stuck, self.settings.control_grace_s)
        return {"dropped": dropped, "stuck": stuck}

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorFailure("gds-kv-connector: transfer submitted after shutdown")


def _blocks(ops: Iterable[Any]) -> int:
    """How many blocks the ops move."""
    return sum(len(op.keys) for op in ops)


def _watch_settled(meter: LoadMeter, watch: _Watch, spoiled: bool) -> None:
    """One batch of ``watch`` settled; with its last, the submission's time goes to ``meter``."""
    watch.left -= 1
    watch.spoiled |= spoiled
    if watch.left == 0 and not watch.spoiled:
        meter.settled(meter.now() - watch.since, watch.nbytes)


def _wait_event(event: Any) -> None:
    if event is not None:
        event.synchronize()


def _save_in_time(batch: _Batch, deadline_s: float) -> Callable[[], bool]:
    """A running save's ``in_time``: False once it is stopped or its deadline (from its start) has
    passed; the first False records which, so its unwritten blocks are counted under that cause."""
    end = batch.started + deadline_s

    def in_time() -> bool:
        stopped = batch.stopped  # read once: a fence setting it meanwhile must not take over a deadline's drop
        if not stopped and time.monotonic() < end:
            return True
        if not batch.stop_cause:
            batch.stop_cause = "stopped" if stopped else "deadline"
        return False
    return in_time


def _off_the_pages(batch: _Batch, timeout: float) -> bool:
    """Wait up to ``timeout`` until the batch no longer touches its pages: it ended, or (a save) its
    engine has staged what it reads, which may come while a fence waits; False on the timeout."""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        try:
            batch.future.exception(timeout=max(0.0, min(left, STAGED_POLL_S) if batch.kind == "save" else left))
            return True
        except TimeoutError:
            if batch.views_done:
                return True
            if left <= 0:
                return False


def _views_done(batch: _Batch) -> Callable[[], None]:
    """A running save's ``views_read``: its pages are no longer read (the engine staged them), so
    the next poll may report its requests finished while their bytes are still being written."""
    def done() -> None:
        batch.views_done = True
    return done


def _load_in_time(batch: _Batch) -> Callable[[], bool]:
    """A running load's ``in_time``: False once it is stopped (no request of it needs its blocks)."""
    return lambda: not batch.stopped


def _fan_out(pool: ThreadPoolExecutor, runners: int, run: Callable[[], None]) -> None:
    """The first runner of a submission: it starts the others, so the executor thread pays one
    thread-pool hand-off per submission, not one per runner (each wakes a thread: 3-40 us on the
    executor thread in a 64-request admission)."""
    for _ in range(runners - 1):
        try:
            pool.submit(run)
        except RuntimeError:  # the pool is shutting down: this runner takes what is left
            break
    run()


def _take(queues: tuple[collections.deque[_Batch], ...]) -> _Batch | None:
    """The next batch of the first queue that has one; None when all are empty."""
    for waiting in queues:
        try:
            return waiting.popleft()
        except IndexError:
            continue
    return None


class _Merged:
    """Several requests' ops as one batch: the fields ``_run_load`` and ``_run_save`` read."""

    __slots__ = ("request_id", "keys", "parents", "block_ids", "_owners")

    def __init__(self, ops: list[Any]) -> None:
        self.request_id = ops[0].request_id
        self.keys = tuple(chain.from_iterable([op.keys for op in ops]))
        self.block_ids = tuple(chain.from_iterable([op.block_ids for op in ops]))
        self.parents = tuple(chain.from_iterable([op.parents for op in ops])) if isinstance(ops[0], SaveOp) else ()
        self._owners = [(len(op.keys), op.request_id) for op in ops]

    def owner_of(self, key: bytes) -> int:
        """The request whose part of the batch holds ``key`` (the first, for a key two requests share)."""
        at = self.keys.index(key)
        for n, rid in self._owners:
            if at < n:
                return rid
            at -= n
        return self.request_id


def _reservations_in(ops: Iterable[Any]) -> set[int]:
    """The prefix reservations whose loads are among ``ops``."""
    return {op.reservation for op in ops if getattr(op, "reservation", 0)}


def _batches(ops: list[Any], payload: int, threads: int) -> list[tuple[list[Any], int]]:
    """Consecutive ops grouped into batches of about total / ``threads`` bytes (a batch closes
    once it reaches that), never above ``MERGE_BYTES`` unless one op alone is larger, so every
    transfer thread gets a share: (ops, blocks in them) per batch."""
    total = _blocks(ops) * payload
    target = min(MERGE_BYTES, -(-total // threads))
    out: list[tuple[list[Any], int]] = []
    group: list[Any] = []
    blocks = 0
    for op in ops:
        n = len(op.keys)
        if group and (blocks + n) * payload > MERGE_BYTES:
            out.append((group, blocks))
            group, blocks = [], 0
        group.append(op)
        blocks += n
        if blocks * payload >= target:
            out.append((group, blocks))
            group, blocks = [], 0
    if group:
        out.append((group, blocks))
    return out

"""Worker-side transfer bookkeeping: batches run on transfer threads and are polled, never awaited.

The executor calls ``start_load_kv`` and ``wait_for_save`` only in iterations that run a
forward, so every accepted batch must finish on its own threads; ``get_finished`` (called
every iteration) only looks at futures with ``done()``.  A batch first waits for the CUDA
event that orders it after the forward stream, then moves bytes through the pool layer.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from .block_io import LoadFailure, SaveOutcome, load_blocks, pin_blocks, save_blocks
from .engines.base import IoEngine
from .kv_layout import KvPool
from .metadata import LoadOp, SaveOp
from .nvtx_ranges import nvtx_range
from .pool import BlockPool
from .settings import Settings
from .stats import Stats

log = logging.getLogger(__name__)


# Requests submitted together are merged into batches of up to this many payload bytes (one
# request is never split).  One request's transfer is often a few blocks; run alone it pays a
# pin, an event wait, a checksum launch and a future each, and a 64-request prefill paid that 64
# times on the executor and transfer threads.  64 MiB is the batch the bench found no slower than
# larger ones (profiling/results/h200-native-1f88463/threads.log).
MERGE_BYTES = 64 << 20


@dataclass(slots=True)
class _Job:
    """One request's part of a batch; requests merged into one batch share its future."""

    rid: int
    kind: str  # "load" or "save"
    future: Future
    accepted: float
    nbytes: int
    first_key: bytes
    lead: bool = True  # the batch's outcome (a SaveOutcome) is accounted through its lead job only
    shared: bool = False  # the future belongs to a batch of several requests


class ConnectorFailure(RuntimeError):
    """A promised transfer cannot complete; TensorRT-LLM treats this as fatal."""


class TransferManager:
    def __init__(self, pool: BlockPool, engine: IoEngine, kv: KvPool, settings: Settings, stats: Stats,
                 on_saved: Callable[[int], None] | None = None,
                 record_event: Callable[[Any], Any] | None = None) -> None:
        self.pool, self.engine, self.kv, self.settings, self.stats = pool, engine, kv, settings, stats
        self._on_saved = on_saved  # bytes of files published, for the capacity guard
        # stream -> an event after the work queued on it so far (None for a host pool): recorded
        # for finished requests' saves only when some arrive, not every iteration
        self._record_event = record_event or (lambda stream: None)
        self._exec = ThreadPoolExecutor(max_workers=settings.transfer_threads, thread_name_prefix="gdskv-xfer")
        # Start every transfer thread now: ThreadPoolExecutor starts them lazily, one per submit, which
        # would put thread creation on the executor thread in the first iteration that transfers.
        started = threading.Barrier(settings.transfer_threads + 1)
        for _ in range(settings.transfer_threads):
            self._exec.submit(started.wait)
        started.wait()
        self._jobs: dict[int, list[_Job]] = {}
        self._sync_loads: list[_Job] = []
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
        sync = [op for op in ops if not op.is_async]
        if sync:  # waited for together before the first layer: batched apart from async loads
            self._sync_loads.extend(self._submit_many(sync, "load", self._run_load, event))
        if len(sync) < len(ops):
            self._submit_many([op for op in ops if op.is_async], "load", self._run_load, event)

    def submit_saves(self, ops: list[SaveOp], event: Any) -> None:
        self._check_open()
        self._submit_many(ops, "save", self._run_save, event)

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

    def _submit_many(self, ops: list[Any], kind: str, fn: Callable[[Any, Any, float], Any], event: Any) -> list[_Job]:
        """Merge the ops into batches (``_batches``), one future each, run by at most
        ``transfer_threads`` runners that take batches from a shared queue: the executor thread
        pays one thread-pool hand-off per runner, and no runner idles while work is left."""
        now = time.monotonic()
        deadline = now + self.settings.deadline_s
        payload = self.pool.payload_len
        jobs: list[_Job] = []
        work: collections.deque = collections.deque()
        for group in _batches(ops, payload, self.settings.transfer_threads):
            future: Future = Future()
            shared = len(group) > 1
            for n, op in enumerate(group):
                job = _Job(op.request_id, kind, future, now, len(op.keys) * payload, op.keys[0], n == 0, shared)
                self._jobs.setdefault(op.request_id, []).append(job)
                jobs.append(job)
            work.append((_Merged(group) if shared else group[0], future))
        for _ in range(min(len(work), self.settings.transfer_threads)):
            self._exec.submit(_run_queued, work, fn, event, deadline)
        return jobs

    # -- transfer threads -------------------------------------------------------------------------
    def _run_load(self, op: LoadOp | _Merged, event: Any, deadline: float) -> int:
        with nvtx_range(f"io/load r{op.request_id} x{len(op.keys)}", "red"):
            _wait_event(event)
            try:
                pins = pin_blocks(self.pool, list(op.keys))
                try:
                    views = self.kv.block_views(op.block_ids)
                    return load_blocks(self.pool, self.engine, pins, views, verify=self.settings.verify,
                                       retries=self.settings.read_retries, deadline=deadline)
                finally:
                    self.pool.unpin_all(pins)
            except LoadFailure as exc:
                if isinstance(op, _Merged):
                    exc.request_id = op.owner_of(exc.key)
                raise

    def _run_save(self, op: SaveOp | _Merged, event: Any, deadline: float) -> SaveOutcome:
        with nvtx_range(f"io/save r{op.request_id} x{len(op.keys)}", "orange"):
            _wait_event(event)
            views = self.kv.block_views(op.block_ids)
            out = save_blocks(self.pool, self.engine, list(op.keys), list(op.parents), views)
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

    def _wait_all(self, jobs: list[_Job]) -> None:
        for job in jobs:
            remaining = job.accepted + self.settings.deadline_s - time.monotonic()
            try:
                job.future.result(timeout=max(remaining, 0.0))
            except TimeoutError:
                raise ConnectorFailure(f"gds-kv-connector: synchronous load of request {job.rid} "
                                       f"({job.nbytes} bytes from {self.pool.path_for(job.first_key)}) passed "
                                       f"its {self.settings.deadline_s:.1f}s deadline") from None
            except LoadFailure as exc:
                raise self._load_failure(job, exc) from None
            self.stats.add_many(loads_sync=1, bytes_loaded=job.nbytes)

    @property
    def has_sync_loads(self) -> bool:
        return bool(self._sync_loads)

    def poll(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        now = time.monotonic()
        while not self._inbox.empty():
            if self._last_event is None:
                self._last_event = self._record_event(self._forward_stream)
            self.submit_saves(self._inbox.get_nowait(), self._last_event)
        for rid in finished_gen_req_ids:
            self._finishing.setdefault(rid, now)
        for rid in started_loading_req_ids:
            self._loading.setdefault(rid, now)
        done_loading = [rid for rid in list(self._loading) if self._loads_done(rid, now)]
        for rid in done_loading:
            del self._loading[rid]
        done_saving = []
        for rid in list(self._finishing):
            if rid in self._loading or not self._all_done(rid, now):
                continue
            del self._finishing[rid]
            self._reap(rid, keep_pending=False)
            done_saving.append(rid)
        for rid in list(self._jobs):
            if rid not in self._finishing and rid not in self._loading:
                self._reap(rid, keep_pending=True)
        return done_saving, done_loading

    def _loads_done(self, rid: int, now: float) -> bool:
        loads = [j for j in self._jobs.get(rid, ()) if j.kind == "load"]
        if not loads:
            self._check_deadline(rid, "load", self._loading[rid], now, None)
            return False
        for job in loads:
            if not job.future.done():
                self._check_deadline(rid, "load", job.accepted, now, job)
                return False
        for job in loads:
            exc = None if job.future.cancelled() else job.future.exception()  # cancelled: never touched pages
            if exc is not None:
                raise self._load_failure(job, exc)
        self.stats.add_many(loads_async=len(loads), bytes_loaded=sum(j.nbytes for j in loads))
        self._jobs[rid] = [j for j in self._jobs[rid] if j.kind != "load"]
        return True

    def _all_done(self, rid: int, now: float) -> bool:
        for job in self._jobs.get(rid, ()):
            if not job.future.done():
                self._check_deadline(rid, job.kind, job.accepted, now, job)
                return False
        return True

    def _reap(self, rid: int, keep_pending: bool) -> None:
        """Account finished jobs of a request; drop its record when nothing is pending."""
        kept = []
        for job in self._jobs.get(rid, ()):
            if not job.future.done():
                kept.append(job)
                continue
            if job.kind == "save":
                if job.lead:
                    self._account_save(job)
            elif not job.future.cancelled() and job.future.exception() is not None:
                if keep_pending:
                    kept.append(job)  # a load failure is reported when its id is polled
        if kept:
            self._jobs[rid] = kept
        else:
            self._jobs.pop(rid, None)

    def _account_save(self, job: _Job) -> None:
        if job.future.cancelled():
            self.stats.add("save_batches_cancelled")
            return
        exc = job.future.exception()
        if exc is not None:
            self._note_save_failure(type(exc).__name__, job, str(exc))
            return
        out: SaveOutcome = job.future.result()
        self.stats.add_many(blocks_saved=out.published, blocks_already_present=out.already_present,
                            save_lost_race=out.lost_race, bytes_saved=out.bytes_written,
                            save_blocks_failed=len(out.failed), save_arena_fallback=out.arena_fallback)
        for key, cause in out.failed:
            self._note_save_failure(cause, job, self.pool.path_for(key))

    def _note_save_failure(self, cause: str, job: _Job, detail: str) -> None:
        self.stats.add(f"save_failed_{cause}")
        if cause not in self._causes_logged:
            self._causes_logged.add(cause)
            log.warning("gds-kv-connector: dropping saves that fail with %s (first: request %d, %s); "
                        "serving continues, further %s failures are only counted", cause, job.rid, detail, cause)

    def _check_deadline(self, rid: int, kind: str, since: float, now: float, job: _Job | None) -> None:
        if now - since <= self.settings.deadline_s:
            return
        where = self.pool.path_for(job.first_key) if job else "(no transfer was ever submitted for it)"
        raise ConnectorFailure(f"gds-kv-connector: {kind} of request {rid} exceeded its "
                               f"{self.settings.deadline_s:.1f}s deadline (started {now - since:.1f}s ago; "
                               f"first file {where})")

    def _load_failure(self, job: _Job, exc: BaseException) -> ConnectorFailure:
        self.stats.add("load_failures")
        if isinstance(exc, LoadFailure):
            owner = exc.request_id
            batched = f" (in one batch with request {owner}, whose block failed)" if owner not in (None, job.rid) else ""
            return ConnectorFailure(f"gds-kv-connector: load for request {job.rid} failed{batched}: key "
                                    f"{exc.key.hex()}, file {exc.path}: {exc.reason}")
        return ConnectorFailure(f"gds-kv-connector: load for request {job.rid} failed: {exc!r}")

    # -- cancellation and shutdown ----------------------------------------------------------------
    def cancel_queued(self, rid: int) -> int:
        """Drop transfers of a request that have not started; in-flight ones, and batches it shares
        with other requests (cancelling one would drop theirs), run to completion."""
        dropped = sum(1 for job in self._jobs.get(rid, ()) if not job.shared and job.future.cancel())
        self.stats.add("transfers_dropped_queued", dropped)
        return dropped

    def shutdown(self) -> dict[str, int]:
        """Stop accepting work, drop queued batches, wait for in-flight ones up to the control grace."""
        self._closed = True
        dropped = sum(1 for jobs in self._jobs.values() for j in jobs if j.future.cancel())
        end = time.monotonic() + self.settings.control_grace_s
        stuck = 0
        for jobs in self._jobs.values():
            for job in jobs:
                try:
                    job.future.exception(timeout=max(end - time.monotonic(), 0.0))
                except TimeoutError:
                    stuck += 1
                except Exception:  # noqa: BLE001 - cancelled futures raise CancelledError
                    pass
        self._exec.shutdown(wait=stuck == 0, cancel_futures=True)
        if stuck == 0:
            self.engine.close()
        else:
            log.error("gds-kv-connector: %d transfer(s) still in flight after the %.1fs control grace",
                      stuck, self.settings.control_grace_s)
        return {"dropped": dropped, "stuck": stuck}

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorFailure("gds-kv-connector: transfer submitted after shutdown")


def _wait_event(event: Any) -> None:
    if event is not None:
        event.synchronize()


def _run_queued(work: collections.deque, fn: Callable[[Any, Any, float], Any], event: Any, deadline: float) -> None:
    """A runner: take (op, future) pairs until none is left; a cancelled future is skipped."""
    while True:
        try:
            op, future = work.popleft()
        except IndexError:
            return
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn(op, event, deadline))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future, as the pool would
            future.set_exception(exc)


class _Merged:
    """Several requests' ops as one batch: the fields ``_run_load`` and ``_run_save`` read."""

    __slots__ = ("request_id", "keys", "parents", "block_ids", "_owners")

    def __init__(self, ops: list[Any]) -> None:
        self.request_id = ops[0].request_id
        self.keys = tuple(k for op in ops for k in op.keys)
        self.block_ids = tuple(b for op in ops for b in op.block_ids)
        self.parents = tuple(p for op in ops for p in op.parents) if isinstance(ops[0], SaveOp) else ()
        self._owners = [(len(op.keys), op.request_id) for op in ops]

    def owner_of(self, key: bytes) -> int:
        """The request whose part of the batch holds ``key`` (the first, for a key two requests share)."""
        at = self.keys.index(key)
        for n, rid in self._owners:
            if at < n:
                return rid
            at -= n
        return self.request_id


def _batches(ops: list[Any], payload: int, threads: int) -> list[list[Any]]:
    """Consecutive ops grouped into batches of about total / ``threads`` bytes (a batch closes
    once it reaches that), never above ``MERGE_BYTES`` unless one op alone is larger, so every
    transfer thread gets a share."""
    total = sum(len(op.keys) for op in ops) * payload
    target = min(MERGE_BYTES, -(-total // threads))
    out: list[list[Any]] = []
    group: list[Any] = []
    size = 0
    for op in ops:
        nbytes = len(op.keys) * payload
        if group and size + nbytes > MERGE_BYTES:
            out.append(group)
            group, size = [], 0
        group.append(op)
        size += nbytes
        if size >= target:
            out.append(group)
            group, size = [], 0
    if group:
        out.append(group)
    return out

"""Running eviction from a serving process without ever stalling a save or the executor.

Saves only bump a byte counter (:meth:`CapacityGuard.note_saved`); one background thread per
process runs :func:`~gds_kv_connector.maintenance.eviction.evict_pool` over all roots when a slice of the quota
has been written since the last run, or every ``check_interval_s`` regardless (other owners
and other tenants of the filesystem fill it too).  Across processes the eviction lock makes
the run a no-op for all but one owner at a time.

Where the run goes (``runner``, ``TLLM_GDS_KV_EVICT_RUNNER``): ``process``, the serving default, runs
it in a child interpreter (:mod:`.evict_process`) while this thread waits on its pipes without the
GIL, so a run of minutes over a large pool takes no GIL time from the executor thread (it shares
only the CPU, and the child lowers its priority); ``thread`` runs it
here, in this thread, for hosts that forbid starting processes (and for library callers and tests,
the constructor's default), where it competes with the executor for the GIL but keeps a header cache
and incremental access-log indexes from run to run.  A child that cannot start, crashes or passes
its time limit (then killed) fails only that run: saves never wait for it, the failure is counted
(``evict_child_failed``) and logged once per spell, and the next run comes at the next interval
(a save's wake-up does not bring it sooner; :meth:`CapacityGuard.check_now` does).  The counters
and the last reports come from the child's reports as from an in-process run.

Its grace is at least the owner's index window (:func:`evictor_grace_s`): an owner promises a
block its index still trusts without looking at the file, and the evictor must not have removed
it.  At its start the guard marks this process as a writer of the pool and removes the temporary
files dead writers of this host left (:mod:`.atomic_file`), at once rather than once they are old.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

from gds_kv_connector.util.atomic_file import WriterMark
from gds_kv_connector.maintenance.evict_process import EvictChildFailed, evict_in_child
from gds_kv_connector.maintenance.eviction import EvictionReport, HeaderCache, evict_pool, remove_dead_writers_tmp
from gds_kv_connector.maintenance.pool_scan import owners_dir
from gds_kv_connector.maintenance.recency import HORIZON_SLACK_NS, RecencyIndex, RecencyLog
from gds_kv_connector.config.settings import SPECS, Settings
from gds_kv_connector.util.counters import Stats

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 60.0
CLOSE_WAIT_S = 10.0  # how long shutdown waits for an eviction run in progress
SLICE_FRACTION = 0.05  # of the quota written since the last run triggers the next one
MIN_FREE_SLICE_FRACTION = 0.25  # of min_free_bytes, when there is no quota
CLOCK_SLACK_S = 2.0  # how far two nodes' clocks may differ: an index's window is timed on its owner's
RUNNERS = ("process", "thread")
CANCEL_WAIT_S = 10.0  # after close() kills a child run, for its waiting thread to return
HORIZON_STEP_NS = 60 * 10**9  # PromisedKeys moves its indexes' horizon (access_horizon) in steps of this
EVICT_TIME_LIMIT_S = next(spec.default for spec in SPECS if spec.name == "evict_time_limit_s")


def evictor_grace_s(grace_s: float, index_ttl_s: float) -> float:
    """The grace an owner's evictor keeps accesses and publications for: ``grace_s``, and never less
    than the owner's index may promise a block without looking at its file (``index_ttl_s``, from
    the lookup or publication, which precedes the promise's access record) plus
    :data:`CLOCK_SLACK_S`, since any owner's evictor reads that record by its own clock.  Without an
    index (TTL 0) every lookup looks: nothing to cover.  Settings refuse a grace below the TTL at
    start-up; this keeps an evictor made without them from removing what its index still promises."""
    return max(grace_s, index_ttl_s + CLOCK_SLACK_S) if index_ttl_s > 0 else grace_s


class CapacityGuard:
    """Per-process trigger for eviction; disabled (``enabled`` False) without quota or min_free."""

    def __init__(self, roots: Sequence[str], *, quota_bytes: int, low_watermark: float, min_free_bytes: int,
                 grace_s: float, index_ttl_s: float = 0.0, recency: RecencyLog | None = None,
                 stats: Stats | None = None, check_interval_s: float = CHECK_INTERVAL_S, runner: str = "thread",
                 time_limit_s: float = 0.0, child_argv: Sequence[str] | None = None) -> None:
        """``index_ttl_s``: how long this process's pool index trusts a lookup (0: no index).
        ``runner``: ``process`` or ``thread`` (the module docstring); with ``process``, ``time_limit_s``
        bounds a run (0: the setting's default) and ``child_argv`` is the child's command
        (:func:`~.evict_process.child_argv` by default)."""
        if runner not in RUNNERS:
            raise ValueError(f"eviction runner {runner!r}: must be one of {', '.join(RUNNERS)}")
        self.roots = tuple(roots)
        self.quota_bytes, self.low_watermark = quota_bytes, low_watermark
        self.min_free_bytes, self.grace_s = min_free_bytes, evictor_grace_s(grace_s, index_ttl_s)
        self.enabled = bool(quota_bytes or min_free_bytes)
        self.slice_bytes = max(1, int(quota_bytes * SLICE_FRACTION if quota_bytes
                                      else min_free_bytes * MIN_FREE_SLICE_FRACTION))
        self.last_reports: list[EvictionReport] = []
        self._recency_log = recency
        self._stats = stats
        self._interval = check_interval_s
        self._since = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._idle_lock = threading.Lock()
        self.runner = runner
        self.time_limit_s = time_limit_s or EVICT_TIME_LIMIT_S
        self.failed_runs = 0  # child runs that failed in a row
        self.child_argv = child_argv  # the child's command; None: evict_process.child_argv()
        self._asked = threading.Event()  # check_now wants a run, even within a failure's back-off
        self._cancel = threading.Event()  # close() gave up waiting: kill the child
        self._retry_at = 0.0  # monotonic time before which only check_now starts a run, after a failure
        self._cache: HeaderCache = {}  # headers of every root, keyed by path (in-process runs)
        self._unreadable = [0] * len(self.roots)  # entries the last run could not read, per root
        if recency is not None and list(map(os.path.abspath, recency.roots)) != list(map(os.path.abspath, roots)):
            raise ValueError(f"access log of roots {recency.roots} for a pool of roots {self.roots}: a key's "
                             "records would be read as another root's")
        self._indexes = recency_indexes(self.roots, recency)
        self._mark = WriterMark([owners_dir(r) for r in self.roots])
        self._remove_dead_writers_tmp()
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="gdskv-evict", daemon=True)
            self._thread.start()

    @classmethod
    def from_settings(cls, settings: Settings, *, recency: RecencyLog | None = None,
                      stats: Stats | None = None) -> "CapacityGuard":
        return cls(settings.roots, quota_bytes=settings.quota_bytes, low_watermark=settings.low_watermark,
                   min_free_bytes=settings.min_free_bytes, grace_s=settings.evict_grace_s,
                   index_ttl_s=settings.index_ttl_s, recency=recency, stats=stats,
                   runner=settings.evict_runner, time_limit_s=settings.evict_time_limit_s)

    def note_saved(self, nbytes: int) -> None:
        """Count bytes just published; wakes the evictor once a slice of the quota is written.

        Callable from any thread; a lost update between two transfer threads only delays the
        next run a little, so there is no lock here.
        """
        if not self.enabled:
            return
        self._since += nbytes
        if self._since >= self.slice_bytes:
            self._wake.set()

    def check_now(self, timeout: float | None = None) -> bool:
        """Ask for a run and wait until the evictor is idle again (tests, operator hooks)."""
        if not self.enabled:
            return True
        with self._idle_lock:  # the evictor must not take itself for idle between these
            self._idle.clear()
            self._asked.set()
            self._wake.set()
        return self._idle.wait(timeout)

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Stop the evictor, waiting at most ``timeout`` for a run in progress: a run scans the whole
        pool (minutes on a large shared filesystem), and shutdown must not wait for it.  A child run
        still going then is killed; an in-process one left going is a daemon thread.  Either way its
        locks die with it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive() and self.runner == "process":
                self._cancel.set()
                self._thread.join(CANCEL_WAIT_S)
            if self._thread.is_alive():
                log.warning("gds-kv: an eviction run is still going after %.0f s; shutdown does not wait for it",
                            timeout)
        self._mark.close()

    def _remove_dead_writers_tmp(self) -> None:
        """Start-up clean-up, which must never stop a start: a root it cannot list keeps its files."""
        for root in self.roots:
            try:
                remove_dead_writers_tmp(root)
            except OSError as exc:
                log.warning("pool %s: temporary files of dead writers not removed: %s", root, exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            if self._stop.is_set():
                break
            self._wake.clear()
            if self._asked.is_set() or time.monotonic() >= self._retry_at:
                self._asked.clear()
                self._since = 0
                try:
                    self._check()
                except Exception:  # noqa: BLE001 - a failed run must not end eviction for good
                    log.exception("eviction run failed")
            with self._idle_lock:
                if not self._wake.is_set():
                    self._idle.set()
        self._idle.set()

    def _check(self) -> None:
        if self._recency_log is not None:
            self._recency_log.flush()  # this process's own touches must protect its blocks
        # One run over every root: a chain's blocks are spread over the roots by key, and only a run
        # that sees them all keeps tails going before heads and a head as recent as its descendants.
        t0 = time.monotonic()
        if self.runner == "thread":
            reports = evict_pool(self.roots, self.quota_bytes, self.low_watermark, self.min_free_bytes, self.grace_s,
                                 header_cache=self._cache, recency=self._indexes)
        else:
            try:
                reports = evict_in_child(self.roots, self.quota_bytes, self.low_watermark, self.min_free_bytes,
                                         self.grace_s, time_limit_s=self.time_limit_s, recency=self._recency_log,
                                         argv=self.child_argv, cancel=self._cancel)
            except EvictChildFailed as exc:
                self._child_failed(exc)
                return
            if self.failed_runs:
                log.warning("gds-kv: eviction runs in a child process work again, after %d failed", self.failed_runs)
                self.failed_runs = 0
        if self._stats is not None:
            self._stats.add_many(evict_runs=1, evict_skipped=int(any(rep.skipped for rep in reports)),
                                 evict_blocks=sum(rep.evicted_blocks for rep in reports),
                                 evict_bytes=sum(rep.evicted_bytes for rep in reports),
                                 evict_short=int(any(not rep.skipped and not rep.reached_target for rep in reports)),
                                 evict_ms=int((time.monotonic() - t0) * 1000))
        for i, (root, rep) in enumerate(zip(self.roots, reports)):
            if rep.unreadable_entries and not self._unreadable[i]:  # once per spell, not once per run
                log.warning("pool %s: %d directories or entries cannot be read by this process (another owner's "
                            "modes? set TLLM_GDS_KV_SHARE_GROUP on every owner): eviction counts only the rest",
                            root, rep.unreadable_entries)
            self._unreadable[i] = rep.unreadable_entries
            if not rep.skipped and not rep.reached_target:
                log.warning("pool %s stays over its budget: freed %d of %d bytes, %d block(s) within the "
                            "%.0f s grace", root, rep.evicted_bytes, rep.target_bytes, rep.protected_blocks,
                            self.grace_s)
        self.last_reports = reports

    def _child_failed(self, exc: EvictChildFailed) -> None:
        """A run that gave no reports: counted, logged at the first of a spell, tried again at the next
        interval (not at the next save's wake-up, which would start a failing child at every slice)."""
        if self._stop.is_set():  # close() killed it
            return
        self.failed_runs += 1
        self._retry_at = time.monotonic() + self._interval
        if self._stats is not None:
            self._stats.add("evict_child_failed")
        if self.failed_runs == 1:
            log.warning("gds-kv: eviction run failed (%s); saves go on, the next run in %.0f s; further "
                        "failures are counted in evict_child_failed, not logged", exc, self._interval)


def recency_indexes(roots: Sequence[str], recency: RecencyLog | None) -> list[RecencyIndex]:
    """One merged access-log index per root.  This process's queued touches count too: while its log
    cannot be written (a full disk, when eviction runs), they are the only record of the blocks it has
    just promised."""
    return [RecencyIndex(r, None if recency is None else partial(recency.unwritten, i)) for i, r in enumerate(roots)]


class PromisedKeys:
    """Which blocks some owner of the pool promised or used within the evictor's grace, from every
    owner's access log (this owner's queued records included): what a remover other than the
    evictor, the arena taking back its own least recently used slots, must keep.  Logs are read
    incrementally and only when asked, on the transfer thread that needs a slot."""

    def __init__(self, root_of: Callable[[bytes], int], roots: Sequence[str], recency: RecencyLog | None,
                 grace_s: float) -> None:
        self._root_of = root_of
        self._indexes = recency_indexes(roots, recency)
        self._grace_ns = int(grace_s * 1e9)
        self._lock = threading.Lock()  # several transfer threads may need slots at once

    def __call__(self, keys: list[bytes]) -> list[bool]:
        cutoff = time.time_ns() - self._grace_ns
        with self._lock:
            # only accesses within the grace matter here: older records are neither read nor kept, so the
            # indexes follow the access rate, not the pool; moved in steps, since a move copies the keys kept
            horizon = cutoff - HORIZON_SLACK_NS
            for index in self._indexes:
                if horizon - index.horizon_ns >= HORIZON_STEP_NS:
                    index.set_horizon(horizon)
            latest = [index.refresh() for index in self._indexes]
        root_of = self._root_of
        return [latest[root_of(k)].get(k, 0) >= cutoff for k in keys]


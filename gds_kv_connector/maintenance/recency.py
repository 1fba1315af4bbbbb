"""Block recency shared by every owner of a pool, without atime.

atime is unreliable on shared filesystems (noatime, relatime, NFS attribute caching) and a stat
per lookup would be too slow anyway, so each owner appends ``(key, unix ns)`` records to its own
log ``<root>/gdskv-v1/owners/<owner>.access``.  One writer per file means appends never
interleave, even on NFS where O_APPEND is not atomic across clients; readers merge every log
(newest time per key wins).  Records are fixed-size binary so a torn tail is detectable and
nothing from the shared directory is ever unpickled.

The executor thread only appends to an in-memory deque (:meth:`RecencyLog.touch`); a background
thread writes batches.  A touch therefore protects a block from eviction only once flushed, so
the flush interval must stay far below the eviction grace, and the touch of a block just promised
to a request (:meth:`RecencyLog.promise`) wakes the flusher at once: until it is written, another
owner's evictor may remove the block whose load is about to start.  A write that fails (the disk
is full exactly when eviction runs) leaves its records queued, within :data:`MAX_PENDING_BATCHES`,
and its root backs off: the flusher retries it once per interval, while the other roots' records
are still written at once.  Other owners cannot see queued records, but this process's own
evictor can (:meth:`RecencyLog.unwritten`, read by :class:`RecencyIndex`).

Idle logs are folded into one archive by the evictor (:func:`fold_stale_logs`), which renames
a log to a private ``<name>.fold-...`` before reading it; readers still merge such a file until
the fold unlinks it, and an owner checks after each write that its file still has its name, so a
record written while its log is being folded is written again to a new log instead of being lost.

Every read of a log is bounded, since anyone who can write to the owners directory can plant a
file there (a 2 GiB sparse ``.access`` file, a FIFO): a log is read :data:`READ_CHUNK_BYTES` at a
time, so memory grows with the keys read, never with the file, and of a log larger than
:data:`MAX_READ_BYTES` (a writer compacts its own at :data:`MAX_LOG_BYTES`) only the newest part
is read; the rest is counted (:attr:`RecencyIndex.skipped_bytes`) and logged once per file.  A
fold takes such a log like any idle one, so it goes.  Only regular files are opened, without
blocking (:func:`~.pool_scan.open_regular`).

An evictor needs only the records newer than a *horizon* (:meth:`RecencyIndex.set_horizon`): the
shard summaries it plans over already hold, in each entry's recency, every access logged before
they were built (:mod:`.shard_summary`).  Records older than the horizon are not kept, and not read
where the file's order allows: every log is written in time order (an owner appends in flush order;
a compaction and a fold write oldest first), so the first record that may be newer is found by
bisection over the fixed-size records (:func:`_first_since`), and only the rest is read.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import secrets
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from itertools import chain

import numpy as np

from gds_kv_connector.util.atomic_file import atomic_write, pwrite_all, still_named, warn_once
from gds_kv_connector.util.host import HOST
from gds_kv_connector.maintenance.pool_scan import NotRegularFile, open_regular, owners_dir

log = logging.getLogger(__name__)

RECORD = struct.Struct("<32sQ")
ACCESS_SUFFIX = ".access"
ARCHIVE_NAME = "archive" + ACCESS_SUFFIX
ARCHIVE_KEEP_FRACTION = 0.75  # an archive is rewritten for dead keys alone once they are over a quarter
FOLD_MARK = ".fold-"  # <owner>.access.fold-<host>-<pid>-<hex>: a log taken by a fold, still read
MAX_LOG_BYTES = 64 << 20  # compact an owner's log beyond this: ~1.6M records
# Of one log at one read, its newest part: 6.7M records, four times what a writer lets its log reach;
# an archive of a pool with more keys loses the recency of those it wrote first (they look older).
MAX_READ_BYTES = 4 * MAX_LOG_BYTES // RECORD.size * RECORD.size
READ_CHUNK_BYTES = 100_000 * RECORD.size  # 4 MB: what one pread of a log brings into memory
# RECORD as a numpy record, so that a fold sorts and deduplicates records in arrays of 40 bytes each,
# not a dict of Python objects; and a view of it with the key as four big-endian words, whose order is
# the key's bytewise order (a view only: numpy turns such fields native in a copy)
_RECORDS = np.dtype([("key", "V32"), ("t", "<u8")])
_WORDS = np.dtype([("k0", ">u8"), ("k1", ">u8"), ("k2", ">u8"), ("k3", ">u8"), ("t", "<u8")])
MAX_PENDING_BATCHES = 1 << 16  # touches kept unwritten (a failed write's, one per root they went to)
#: How far a record may be out of time order and still be found by bisection, and how much older
#: than a summary's build an access may be stamped and still have been logged after the build read
#: the logs: a writer's clock skew (NTP keeps hosts within milliseconds), its flush interval (1 s;
#: a promise is written at once) and its retry after a failed write (one interval), a touch stamped
#: before a concurrent one took the queue first (microseconds), with a wide margin.  A record later
#: than that (a clock stepped back further, a write failing for minutes) loses its ordering effect
#: only: a horizon is never later than the grace (:func:`access_horizon`), so promises all count.
HORIZON_SLACK_NS = 120 * 10**9
_EPOCH_2020_NS = 1_577_836_800 * 10**9
_FUTURE_SLACK_NS = 86_400 * 10**9
_OPEN_LOCK = threading.RLock()  # for_process holds it while __init__ takes it again
_OPEN_PATHS: set[str] = set()
_SHARED: dict[tuple[str, ...], "RecencyLog"] = {}
#: one touch: (unix ns, keys, offsets); key i is stamped ns - offsets[i], or ns - i when offsets is
#: None (:meth:`RecencyLog.touch`); a root's part of a touch keeps its keys' stamps through offsets
Batch = tuple[int, Sequence[bytes], Sequence[int] | None]


def stamped(batch: Batch) -> Iterator[tuple[bytes, int]]:
    """(key, unix ns) of each key of ``batch``: strictly descending in the order the keys were given."""
    ts, keys, offsets = batch
    if offsets is None:
        return ((key, ts - i) for i, key in enumerate(keys))
    return ((key, ts - off) for key, off in zip(keys, offsets))


def default_owner_id() -> str:
    """``<host>-<pid>``: unique per live process across the nodes sharing a pool."""
    return f"{HOST}-{os.getpid()}"


class RecencyLog:
    """This owner's access log, over one or several pool roots.

    With several roots a key's records go to the root that holds the key (the same
    ``key[0] % len(roots)`` rule as :class:`~gds_kv_connector.store.pool.BlockPool`), so each root's
    evictor sees every touch of its blocks.
    """

    def __init__(self, roots: str | Sequence[str], owner_id: str | None = None, *,
                 flush_interval_s: float = 1.0, max_log_bytes: int = MAX_LOG_BYTES) -> None:
        self.roots = (roots,) if isinstance(roots, str) else tuple(roots)
        if not self.roots:
            raise ValueError("RecencyLog needs at least one pool root")
        self.owner_id = owner_id or default_owner_id()
        self.max_log_bytes = max_log_bytes
        self.dropped = 0  # touches lost to a full backlog (failed writes stay queued until it is full)
        self._pending_lock = threading.Lock()  # never held across I/O: the executor thread takes it
        self._pending: deque[Batch] = deque()  # touches not yet taken by a flush
        # per root, its part of touches a failed write gave back, oldest first; kept apart from
        # _pending so that a flush while that root backs off adds to it without going through it
        self._held: list[deque[Batch]] = [deque() for _ in self.roots]
        self._held_n = 0  # batches in _held, for touch() to keep the bound in O(1)
        self._writing: list[Iterable[Batch]] = []  # taken by the flush under way: still unwritten
        self._failing = [False] * len(self.roots)  # the last write to that root's log failed
        self._retry_at = [0.0] * len(self.roots)  # monotonic time before which the flusher leaves it
        self._interval = flush_interval_s
        self._logs = [_OwnerLog(os.path.join(owners_dir(r), self.owner_id + ACCESS_SUFFIX)) for r in self.roots]
        with _OPEN_LOCK:
            clash = [lg.path for lg in self._logs if lg.path in _OPEN_PATHS]
            if clash:
                raise ValueError(f"access log {clash[0]} is already open in this process; share one "
                                 "RecencyLog (RecencyLog.for_process) instead of opening it twice")
            _OPEN_PATHS.update(lg.path for lg in self._logs)
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a promise is waiting to be written
        self._thread: threading.Thread | None = None
        if flush_interval_s > 0:
            self._thread = threading.Thread(target=self._run, args=(flush_interval_s,),
                                            name="gdskv-recency", daemon=True)
            self._thread.start()

    @classmethod
    def for_process(cls, roots: str | Sequence[str]) -> "RecencyLog":
        """The one log of this process for ``roots``, created on first use and flushed at exit.

        The scheduler and the worker of one rank share a process; one writer per file is what
        keeps the log's records aligned, so both must use this instead of constructing their own.
        """
        key = (roots,) if isinstance(roots, str) else tuple(roots)
        with _OPEN_LOCK:
            shared = _SHARED.get(key)
            if shared is None:
                shared = _SHARED[key] = cls(key)
                atexit.register(shared.flush)
            return shared

    def touch(self, keys: Sequence[bytes], now_ns: int | None = None) -> None:
        """Record an access to ``keys``; the sequence is kept as is, so do not mutate it later.

        The keys get strictly descending stamps in the order given: ``keys[0]`` the touch's time
        (``now_ns``, else now), ``keys[i]`` that minus ``i`` ns.  Callers pass a chain head first, so
        within one access a tail is always older than its head, and the evictor, which reads the
        oldest blocks first and looks no further than it needs (:mod:`.eviction`), meets a chain's
        tail before its head.

        Only a deque append (under a lock that is never held across I/O), so it is safe on the
        executor thread; if flushes fail for long enough the oldest batches are dropped rather
        than letting memory grow.
        """
        if keys:
            batch = (now_ns or time.time_ns(), keys, None)
            with self._pending_lock:
                if len(self._pending) + self._held_n >= MAX_PENDING_BATCHES:
                    self._drop_oldest()
                self._pending.append(batch)

    def promise(self, keys: Sequence[bytes]) -> None:
        """:meth:`touch` for blocks just promised to a request, written by the flusher now rather
        than within its interval (a set Event: the executor thread does no I/O)."""
        self.touch(keys)
        if self._thread is not None and not self._wake.is_set():
            self._wake.set()

    @property
    def failing(self) -> bool:
        """Whether the last flush left records queued because a log could not be written."""
        return any(self._failing)

    def unwritten(self, root: int) -> dict[bytes, int]:
        """Newest queued time per key of ``self.roots[root]`` not yet in its log.

        While a disk is full no evictor reads this owner's promises from its logs; this process's
        own evictor can still keep the promised blocks by adding these (:class:`RecencyIndex`).
        A record leaves the queues only once written, so a caller that takes this before reading
        the logs misses none.
        """
        with self._pending_lock:
            queued = [*self._held[root], *self._pending, *chain.from_iterable(self._writing)]
        n_roots = len(self.roots)
        newest: dict[bytes, int] = {}
        get = newest.get
        for batch in queued:
            for key, ts in stamped(batch):
                if key[0] % n_roots == root and get(key, 0) < ts:
                    newest[key] = ts
        return newest

    def flush(self) -> int:
        """Write pending touches to every root, backing off or not; returns the records written.

        A root whose write fails keeps its records queued for the next flush, not dropped: the
        write fails when the disk is full, which is when eviction runs, and a lost promise would
        let it remove the promised block.  Only the queue's bound drops records, oldest first.
        """
        return self._flush(backoff=False)

    def _flush(self, backoff: bool) -> int:
        """:meth:`flush`; with ``backoff``, a root whose write failed within the flush interval
        only queues its new records, without a write: a retry writes a root's whole backlog, and
        the flusher runs at every promise.  Its backlog is then neither copied nor packed, so a
        promise costs the flusher its own records, whatever another root owes."""
        with self._flush_lock:
            with self._pending_lock:
                if not self._pending and not self._held_n:
                    return 0
                batches, self._pending = self._pending, deque()
                self._writing = [batches]
            now = time.monotonic()
            fresh = self._split(batches)
            out: dict[int, list[Batch]] = {}
            with self._pending_lock:
                for i, new in enumerate(fresh):
                    if backoff and self._failing[i] and now < self._retry_at[i]:
                        self._held[i].extend(new)
                        self._held_n += len(new)
                    elif new or self._held[i]:
                        out[i] = [*self._held[i], *new]
                        self._held_n -= len(self._held[i])
                        self._held[i].clear()
                self._writing = list(out.values())
                self._keep_bound()
            written = 0
            failed: list[int] = []
            for i in sorted(out, key=self._failing.__getitem__):  # a retry may be slow: healthy roots first
                owner_log, batches_i = self._logs[i], out[i]
                records = [RECORD.pack(key, ts) for batch in batches_i for key, ts in stamped(batch)]
                try:
                    owner_log.append(b"".join(records))
                except OSError as exc:
                    failed.append(i)
                    self._retry_at[i] = time.monotonic() + self._interval
                    if not self._failing[i]:  # once per failing spell, not once per flush
                        log.warning("could not write access log %s (%s); its touches stay queued and "
                                    "are retried once per flush interval", owner_log.path, exc)
                    self._failing[i] = True
                    continue
                written += len(records)
                if self._failing[i]:
                    self._failing[i] = False
                    log.info("access log %s is written again", owner_log.path)
                if owner_log.size > self.max_log_bytes:
                    try:
                        owner_log.compact(self.max_log_bytes // 2)
                    except OSError as exc:  # the records are written: only the size stays over
                        log.warning("could not compact access log %s (%s)", owner_log.path, exc)
            with self._pending_lock:
                for i in failed:  # before any touch made meanwhile, and within the bound
                    self._held[i].extendleft(reversed(out[i]))
                    self._held_n += len(out[i])
                self._writing = []
                self._keep_bound()
            return written

    def _split(self, batches: deque[Batch]) -> list[Sequence[Batch]]:
        """Each root's part of ``batches``, in their order."""
        n_roots = len(self.roots)
        if n_roots == 1:
            return [batches]
        parts: list[list[Batch]] = [[] for _ in self.roots]
        for ts, keys, offsets in batches:
            by_root: list[tuple[list[bytes], list[int]]] = [([], []) for _ in self.roots]
            for i, key in enumerate(keys):
                root_keys, root_offsets = by_root[key[0] % n_roots]
                root_keys.append(key)
                root_offsets.append(i if offsets is None else offsets[i])
            for part, (root_keys, root_offsets) in zip(parts, by_root):
                if root_keys:
                    part.append((ts, root_keys, root_offsets))
        return parts

    def _keep_bound(self) -> None:
        """Drop the oldest batches over :data:`MAX_PENDING_BATCHES` (``_pending_lock`` held)."""
        while len(self._pending) + self._held_n > MAX_PENDING_BATCHES:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """Drop the oldest queued batch (``_pending_lock`` held): a failing root's backlog, older
        than any touch not yet taken by a flush, goes before the new touches of healthy roots."""
        held = min((q for q in self._held if q), key=lambda q: q[0][0], default=None)
        if held is not None:
            self._held_n -= 1
            self.dropped += len(held.popleft()[1])
        else:
            self.dropped += len(self._pending.popleft()[1])

    def close(self) -> None:
        """Stop the flusher and write what is pending; the log stays for other owners to read."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()
        with self._pending_lock:
            lost = sum(len(batch[1]) for batch in chain(self._pending, *self._held))
            self._pending.clear()
            for q in self._held:
                q.clear()
            self._held_n = 0
            self.dropped += lost
        if lost:
            log.warning("access log of %s closed with %d touch(es) it could not write", self.owner_id, lost)
        for owner_log in self._logs:
            owner_log.close()
        with _OPEN_LOCK:
            _OPEN_PATHS.difference_update(lg.path for lg in self._logs)
            for k in [k for k, v in _SHARED.items() if v is self]:
                del _SHARED[k]

    def _run(self, interval: float) -> None:
        while True:
            self._wake.wait(interval)
            if self._stop.is_set():
                return  # close() writes what is left
            self._wake.clear()
            try:
                self._flush(backoff=True)
            except Exception:  # noqa: BLE001 - the flusher must outlive one bad flush
                log.exception("access log flush failed")


class _OwnerLog:
    """One append-only file with a single writer; positional writes make retries idempotent.

    After each write it checks that the path still names its file: a fold renames an idle log
    away before reading it, and a record that landed in the renamed file may have come after
    the fold read it, so it is written again to a new log (a duplicate is harmless: readers keep
    the newest time per key).  That costs a stat and an fstat per flush and root.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1
        self.size = 0

    def append(self, data: bytes) -> None:
        for _ in range(3):
            if self.fd < 0:
                self._open()
            try:
                pwrite_all(self.fd, data, self.size)
            except OSError as exc:
                if exc.errno != errno.ESTALE:
                    raise
                self.close()  # an evictor folded this log away on another node: start a new one
                continue
            self.size += len(data)
            if still_named(self.path, self.fd):
                return
            self.close()  # folded (renamed or unlinked) under us: write it again to a new log
        raise OSError(errno.ESTALE, f"access log {self.path} keeps being replaced")

    def compact(self, target_bytes: int) -> None:
        """Rewrite the log as one record per key, only the newest keys if still too large, written
        oldest first: appends then go on in time order, which a reader's bisection relies on."""
        keep = _by_time(_newest_per_key(_read_records(self.path)))[-max(1, target_bytes // RECORD.size):]
        atomic_write(self.path, keep.tobytes())
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _open(self) -> None:
        self.close()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fd, st = open_regular(self.path, os.O_WRONLY | os.O_CREAT)  # a FIFO there fails, never blocks
        size = st.st_size
        self.size = size - size % RECORD.size  # overwrite a torn record left by a crash


def access_horizon(oldest_built_ns: int, held_ns: int) -> int:
    """The horizon of a run: the records it must see are those newer than the oldest summary it uses
    (``oldest_built_ns``; 0 when a shard has none: a first build needs every record) and every one
    within its grace (newer than ``held_ns``), both less :data:`HORIZON_SLACK_NS`."""
    if oldest_built_ns <= 0:
        return 0
    return max(0, min(oldest_built_ns, held_ns) - HORIZON_SLACK_NS)


class RecencyIndex:
    """Merged recency of every owner's log in one root, refreshed incrementally.

    Keeps each log's identity and read offset so a refresh reads only appended bytes; a log
    replaced by compaction (new inode, or shorter) is read again from the start.  A log gone from
    the directory is forgotten at the next refresh, and the keys of blocks gone from the pool
    when the evictor passes its scan to :meth:`retain`, so a long-lived index stays as large as
    the pool and its logs, not as everything the pool ever held.

    ``unwritten`` (an owner's :meth:`RecencyLog.unwritten` for this root) adds the records that
    owner could not write yet: its own evictor then keeps the blocks it promised while the disk is
    full.  They are accesses all the same, so they join :attr:`latest` like logged ones.

    Appended bytes beyond :data:`MAX_READ_BYTES` since the last read are skipped, the oldest
    first, and counted in :attr:`skipped_bytes`.

    With a horizon (:meth:`set_horizon`), records older than it are neither kept nor, where a
    bisection finds where the newer ones begin, read: memory and reads follow the records since
    the horizon, not the logs.  :attr:`read_bytes` counts the bytes of records read, bisection
    probes included.
    """

    def __init__(self, root: str, unwritten: Callable[[], dict[bytes, int]] | None = None) -> None:
        self.dir = owners_dir(root)
        self.latest: dict[bytes, int] = {}
        self.skipped_bytes = 0
        self.read_bytes = 0
        self.horizon_ns = 0  # records older than this are neither kept nor read where avoidable
        self._offsets: dict[str, tuple[int, int]] = {}  # name -> (inode, bytes consumed)
        self._unwritten = unwritten

    def set_horizon(self, horizon_ns: int) -> None:
        """Keep only the records newer than ``horizon_ns`` from now on.

        A later horizon drops the keys last accessed before it (a new dict: deleting in place would
        keep the table at its largest size).  An earlier one makes the next refresh read every log
        again from the new horizon on, since the records before the old one were passed over.
        """
        if horizon_ns < self.horizon_ns:
            self._offsets.clear()
        elif horizon_ns > self.horizon_ns:
            self.latest = {k: t for k, t in self.latest.items() if t >= horizon_ns}
        self.horizon_ns = horizon_ns

    def refresh(self) -> dict[bytes, int]:
        queued = self._unwritten() if self._unwritten is not None else {}  # first: see unwritten()
        self._read_logs()
        latest, horizon = self.latest, self.horizon_ns
        for key, ts in queued.items():
            if ts >= horizon and latest.get(key, 0) < ts:
                latest[key] = ts
        return latest

    def _read_logs(self) -> None:
        try:
            names = [n for n in os.listdir(self.dir) if _is_log(n)]
        except FileNotFoundError:
            self._offsets.clear()
            return
        for gone in self._offsets.keys() - set(names):
            del self._offsets[gone]
        for name in names:
            path = os.path.join(self.dir, name)
            try:
                fd, st = open_regular(path)  # a FIFO planted in owners/ must not hang the evictor
            except OSError:
                continue
            try:
                ino, done = self._offsets.get(name, (st.st_ino, 0))
                if ino != st.st_ino or st.st_size < done:
                    done = 0
                end = done + (st.st_size - done) // RECORD.size * RECORD.size
                first = done
                if self.horizon_ns and end > done:
                    first, probes = _first_since(fd, done, end, self.horizon_ns - HORIZON_SLACK_NS)
                    self.read_bytes += probes * RECORD.size
                start = _capped_start(path, first, end)
                self.skipped_bytes += start - first
                done = _merge_range(fd, start, end, self.latest, self.horizon_ns)
                self.read_bytes += done - start
            except OSError:
                continue
            finally:
                os.close(fd)
            self._offsets[name] = (st.st_ino, done)

    def forget(self, gone: Iterable[bytes], scanned_ns: int) -> int:
        """Forget the keys in ``gone`` (blocks an eviction run removed) unless touched at or after
        ``scanned_ns``; returns how many.  Safe as :meth:`retain` is: a block saved again under a
        forgotten key is newer than any touch forgotten."""
        latest = self.latest
        n = 0
        for key in gone:
            if latest.get(key, scanned_ns) < scanned_ns:
                del latest[key]
                n += 1
        return n

    def retain(self, live_keys: Iterable[bytes], scanned_ns: int) -> int:
        """Forget the keys not in ``live_keys`` (a scan of the pool); returns how many.

        A key touched at or after ``scanned_ns`` (when that scan began) stays, since its block
        may have been published after the scan; it goes at the next call if it is still absent.
        Forgetting is safe otherwise: a block saved again under a forgotten key is newer than any
        touch forgotten (its mtime is its publication), and records already consumed are not read
        again, so a forgotten key does not come back.
        """
        live = live_keys if isinstance(live_keys, (set, frozenset, dict)) else set(live_keys)
        before = len(self.latest)
        # a new dict: deleting in place would keep the table at its largest size
        self.latest = {k: t for k, t in self.latest.items() if k in live or t >= scanned_ns}
        return before - len(self.latest)


def load_recency(root: str) -> dict[bytes, int]:
    """Newest access time (unix ns) per key over every owner's log in ``root``."""
    return RecencyIndex(root).refresh()


def merge_records(data: bytes, into: dict[bytes, int] | None = None, since_ns: int = 0) -> dict[bytes, int]:
    """Fold records into ``into``, ignoring a partial trailing record, impossible times and times
    before ``since_ns`` (a horizon).

    A time before 2020 or more than a day ahead is garbage (zero-filled blocks after a crash,
    a foreign file), not an access, and must not make a block look fresh forever.
    """
    latest = {} if into is None else into
    lo, hi = max(_EPOCH_2020_NS, since_ns), time.time_ns() + _FUTURE_SLACK_NS
    usable = len(data) - len(data) % RECORD.size
    get = latest.get
    for key, ts in RECORD.iter_unpack(memoryview(data)[:usable]):
        if lo <= ts <= hi and get(key, 0) < ts:
            latest[key] = ts
    return latest


def fold_stale_logs(root: str, live_keys: Iterable[bytes] | Container[bytes], older_than_s: float,
                    now: float | None = None, *, dead_at_most: int | None = None) -> int:
    """Merge logs untouched for ``older_than_s`` into one archive log, keeping only live keys.

    ``live_keys`` is tested by ``in``: a set of every live key, or, for an evictor that does not
    list the pool, a container of every key but those it removed.  The archive is written oldest
    record first, so that when it outgrows :data:`MAX_READ_BYTES` the records a read passes over
    are the oldest, whatever keys of removed blocks it still holds.

    Every process start creates a new log, so without this the owners directory grows for
    ever.  Must run under the eviction lock (one archiver at a time).  A stale log is renamed
    to a private name before it is read: an idle but live owner that writes to it meanwhile
    sees on that write that its file lost its name and writes the records again to a new log,
    so nothing it writes after the read is unlinked with it.  Readers merge the private file
    too until it is unlinked, and a fold that dies or fails (a full disk) before the unlink
    leaves it for the next fold to take.  Returns the number of logs folded.

    ``dead_at_most``, when given, is how many keys ``live_keys`` leaves out at most (an evictor's
    removals): with no log to fold and too few of them to make a quarter of the archive's records
    (one per key), the archive would not be rewritten, so it is not read either.

    A fold reads the archive whole, up to :data:`MAX_READ_BYTES`, so its records are deduplicated
    in numpy arrays of 40-byte records, not a dict of Python keys, several times their size.
    """
    d = owners_dir(root)
    now = time.time() if now is None else now
    taken: list[str] = []
    for name in _listdir(d):
        path = os.path.join(d, name)
        if ACCESS_SUFFIX + FOLD_MARK in name:
            taken.append(path)  # left by a fold that died before its unlink
            continue
        if not name.endswith(ACCESS_SUFFIX) or name == ARCHIVE_NAME:
            continue
        private = f"{path}{FOLD_MARK}{HOST}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            if now - os.stat(path, follow_symlinks=False).st_mtime <= older_than_s:
                continue
            os.rename(path, private)
        except FileNotFoundError:
            continue
        taken.append(private)
    archive = os.path.join(d, ARCHIVE_NAME)
    if not taken:
        try:
            archived = min(os.stat(archive).st_size, MAX_READ_BYTES) // RECORD.size
        except FileNotFoundError:
            return 0
        if dead_at_most is not None and dead_at_most < (1 - ARCHIVE_KEEP_FRACTION) * archived:
            return 0
    latest = _newest_per_key(np.concatenate([_read_records(p) for p in [archive, *taken]]))
    # a list is a container too, but a slow one: only a set-like or custom one is used as given
    live = live_keys if isinstance(live_keys, Container) and not isinstance(live_keys, Sequence) \
        else set(live_keys)  # type: ignore[arg-type]
    raw = memoryview(latest.tobytes())
    size = RECORD.size
    kept = latest[np.fromiter((bytes(raw[o:o + 32]) in live for o in range(0, len(raw), size)), dtype=bool,
                              count=len(latest))]
    del raw
    if not taken and len(kept) >= ARCHIVE_KEEP_FRACTION * len(latest):
        # Nothing folded and few keys to drop: a rewrite is a new inode that every owner's index
        # then reads whole again, on every eviction run.
        return 0
    del latest
    atomic_write(archive, _by_time(kept).tobytes())
    for path in taken:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return len(taken)


def _read_records(path: str) -> np.ndarray:
    """A log's records with a possible time (:func:`merge_records`' rule), of its newest
    :data:`MAX_READ_BYTES`, as :data:`_RECORDS`; none where it is gone or not a regular file."""
    try:
        fd, st = open_regular(path)
    except (FileNotFoundError, NotRegularFile):
        return np.empty(0, _RECORDS)
    lo, hi = _EPOCH_2020_NS, time.time_ns() + _FUTURE_SLACK_NS
    parts = []
    try:
        end = st.st_size - st.st_size % RECORD.size
        for chunk, _ in _chunks(fd, _capped_start(path, 0, end), end):
            recs = np.frombuffer(chunk, _RECORDS)
            parts.append(recs[(recs["t"] >= lo) & (recs["t"] <= hi)])
    finally:
        os.close(fd)
    return np.concatenate(parts) if parts else np.empty(0, _RECORDS)


def _newest_per_key(recs: np.ndarray) -> np.ndarray:
    """The newest record of each key (``recs`` contiguous, :data:`_RECORDS`): sorted by key, then
    time, and the last of each key kept."""
    w = recs.view(_WORDS)
    recs = recs[np.lexsort((w["t"], w["k3"], w["k2"], w["k1"], w["k0"]))]
    if len(recs) < 2:
        return recs
    w = recs.view(_WORDS)
    last = np.ones(len(recs), dtype=bool)
    last[:-1] = ((w["k0"][:-1] != w["k0"][1:]) | (w["k1"][:-1] != w["k1"][1:])
                 | (w["k2"][:-1] != w["k2"][1:]) | (w["k3"][:-1] != w["k3"][1:]))
    return recs[last]


def _by_time(recs: np.ndarray) -> np.ndarray:
    """Records oldest first, as logs are written: a reader's bisection relies on that order."""
    return recs[np.argsort(recs["t"], kind="stable")]


def _is_log(name: str) -> bool:
    """An owner's log, the archive, or a log taken by a fold that has not unlinked it yet."""
    return name.endswith(ACCESS_SUFFIX) or ACCESS_SUFFIX + FOLD_MARK in name


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []


def _capped_start(path: str, start: int, end: int) -> int:
    """Where to read records ``[start, end)`` of a log from: ``start``, or, for more than
    :data:`MAX_READ_BYTES`, that much before ``end`` (the newest records are the last written);
    the part passed over is logged once per file."""
    skip = end - start - MAX_READ_BYTES
    if skip <= 0:
        return start
    warn_once(path, "access log %s: %d bytes to read, over the %d-byte bound: the oldest %d are skipped (a log "
              "is compacted by its writer long before; a file planted in the owners directory?)",
              path, end - start, MAX_READ_BYTES, skip)
    return start + skip


def _first_since(fd: int, start: int, end: int, since_ns: int) -> tuple[int, int]:
    """(where to read records ``[start, end)`` of a log from so as to miss none stamped after
    ``since_ns`` + :data:`HORIZON_SLACK_NS`, records probed): a bisection, one record per pread.

    A log is in time order within :data:`HORIZON_SLACK_NS` (records ``i < j`` have ``t_j >= t_i -
    slack``): where a probe at ``m`` is older than ``since_ns``, every record up to ``m`` is older than
    ``since_ns`` + slack, so reading starts past it.  The first record is probed first: a log compacted
    by an earlier version starts with its compacted records newest first, so either it is recent
    enough and the log is read whole, or all of them are older and the rest is in order.  A probe
    that is not a time (a hole left by a crash, a clock beyond tolerance, a foreign file) ends the
    search where it stands, reading more rather than missing anything.
    """
    size = RECORD.size
    hi_ns = time.time_ns() + _FUTURE_SLACK_NS
    lo, hi, probes = start, end, 0
    mid = start
    while lo < hi:
        raw = os.pread(fd, size, mid)
        probes += 1
        if len(raw) < size:
            return lo, probes
        ts = RECORD.unpack(raw)[1]
        if not _EPOCH_2020_NS <= ts <= hi_ns:
            return lo, probes
        if ts >= since_ns:
            hi = mid
        else:
            lo = mid + size
        mid = lo + (hi - lo) // size // 2 * size
    return lo, probes


def _merge_range(fd: int, start: int, end: int, into: dict[bytes, int], since_ns: int = 0) -> int:
    """Fold the records in bytes ``[start, end)`` of ``fd`` stamped at or after ``since_ns`` into
    ``into``, :data:`READ_CHUNK_BYTES` at a time; returns where reading stopped (``end``, or where the
    file now ends).  A chunk of zeros (a hole, blocks zero-filled by a crash) holds no record and is
    not parsed."""
    pos = start
    for chunk, pos in _chunks(fd, start, end):
        if chunk.count(0) != len(chunk):
            merge_records(chunk, into, since_ns)
    return pos


def _chunks(fd: int, start: int, end: int) -> Iterator[tuple[bytes, int]]:
    """The whole records of bytes ``[start, end)`` of ``fd``, :data:`READ_CHUNK_BYTES` at a time, each
    with the position after it; stops early where the file now ends."""
    pos = start
    while pos < end:
        chunk = os.pread(fd, min(READ_CHUNK_BYTES, end - pos), pos)
        usable = len(chunk) - len(chunk) % RECORD.size
        if not usable:
            return
        pos += usable
        yield (chunk if usable == len(chunk) else chunk[:usable]), pos

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
is full exactly when eviction runs) leaves its records queued for the next flush, within
:data:`MAX_PENDING_BATCHES`.

Idle logs are folded into one archive by the evictor (:func:`fold_stale_logs`), which renames
a log to a private ``<name>.fold-...`` before reading it; readers still merge such a file until
the fold unlinks it, and an owner checks after each write that its file still has its name, so a
record written while its log is being folded is written again to a new log instead of being lost.
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
from collections.abc import Iterable, Sequence

from .atomic_file import atomic_write, pwrite_all, still_named
from .pool import _HOST
from .pool_scan import NotRegularFile, open_regular, owners_dir

log = logging.getLogger(__name__)

RECORD = struct.Struct("<32sQ")
ACCESS_SUFFIX = ".access"
ARCHIVE_NAME = "archive" + ACCESS_SUFFIX
ARCHIVE_KEEP_FRACTION = 0.75  # an archive is rewritten for dead keys alone once they are over a quarter
FOLD_MARK = ".fold-"  # <owner>.access.fold-<host>-<pid>-<hex>: a log taken by a fold, still read
MAX_LOG_BYTES = 64 << 20  # compact an owner's log beyond this: ~1.6M records
MAX_PENDING_BATCHES = 1 << 16  # touches kept while the filesystem does not accept writes
_EPOCH_2020_NS = 1_577_836_800 * 10**9
_FUTURE_SLACK_NS = 86_400 * 10**9
_OPEN_LOCK = threading.RLock()  # for_process holds it while __init__ takes it again
_OPEN_PATHS: set[str] = set()
_SHARED: dict[tuple[str, ...], "RecencyLog"] = {}


def default_owner_id() -> str:
    """``<host>-<pid>``: unique per live process across the nodes sharing a pool."""
    return f"{_HOST}-{os.getpid()}"


class RecencyLog:
    """This owner's access log, over one or several pool roots.

    With several roots a key's records go to the root that holds the key (the same
    ``key[0] % len(roots)`` rule as :class:`~gds_kv_connector.pool.BlockPool`), so each root's
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
        self._pending: deque[tuple[int, Sequence[bytes]]] = deque()
        self._pending_lock = threading.Lock()  # never held across I/O: the executor thread takes it
        self._failing = [False] * len(self.roots)  # the last write to that root's log failed
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

        Only a deque append (under a lock that is never held across I/O), so it is safe on the
        executor thread; if flushes fail for long enough the oldest batches are dropped rather
        than letting memory grow.
        """
        if keys:
            batch = (now_ns or time.time_ns(), keys)
            with self._pending_lock:
                if len(self._pending) >= MAX_PENDING_BATCHES:
                    self.dropped += len(self._pending.popleft()[1])
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

    def flush(self) -> int:
        """Write pending touches; returns the number of records written.

        A root whose write fails gets its records back at the front of the queue for the next
        flush, not dropped: the write fails when the disk is full, which is when eviction runs,
        and a lost promise would let it remove the promised block.  Only the queue's bound drops
        records, oldest first.
        """
        with self._flush_lock:
            with self._pending_lock:
                batches, self._pending = self._pending, deque()
            if not batches:
                return 0
            per_root: list[list[bytes]] = [[] for _ in self.roots]
            n_roots = len(self.roots)
            for ts, keys in batches:
                for key in keys:
                    per_root[key[0] % n_roots].append(RECORD.pack(key, ts))
            written = 0
            failed: set[int] = set()
            for i, (owner_log, records) in enumerate(zip(self._logs, per_root)):
                if not records:
                    continue
                try:
                    owner_log.append(b"".join(records))
                except OSError as exc:
                    failed.add(i)
                    if not self._failing[i]:  # once per failing spell, not once per flush
                        log.warning("could not write access log %s (%s); its touches stay queued and "
                                    "are retried at each flush", owner_log.path, exc)
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
            if failed:
                self._requeue(batches, failed)
            return written

    def _requeue(self, batches: deque[tuple[int, Sequence[bytes]]], failed: set[int]) -> None:
        """Put the failed roots' records back before any touch made meanwhile, within the bound."""
        n_roots = len(self.roots)
        back: list[tuple[int, Sequence[bytes]]]
        if n_roots == 1:
            back = list(batches)
        else:
            back = []
            for ts, keys in batches:
                kept = [k for k in keys if k[0] % n_roots in failed]
                if kept:
                    back.append((ts, kept))
        with self._pending_lock:
            cut = len(back) - max(0, MAX_PENDING_BATCHES - len(self._pending))
            if cut > 0:  # the oldest go, as when touch() finds the queue full
                self.dropped += sum(len(keys) for _, keys in back[:cut])
                back = back[cut:]
            self._pending.extendleft(reversed(back))

    def close(self) -> None:
        """Stop the flusher and write what is pending; the log stays for other owners to read."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()
        with self._pending_lock:
            lost = sum(len(keys) for _, keys in self._pending)
            self._pending.clear()
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
        retry_at = 0.0
        while True:
            self._wake.wait(interval)
            if self._stop.is_set():
                return  # close() writes what is left
            pause = retry_at - time.monotonic()
            if pause > 0 and self._stop.wait(pause):  # a failing log is retried once per interval,
                return                                # not once per promise
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the flusher must outlive one bad flush
                log.exception("access log flush failed")
            retry_at = time.monotonic() + interval if self.failing else 0.0


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
        """Rewrite the log as one record per key, newest keys first if still too large."""
        latest = merge_records(_read_file(self.path))
        keep = sorted(latest.items(), key=lambda kv: kv[1], reverse=True)[:max(1, target_bytes // RECORD.size)]
        atomic_write(self.path, b"".join(RECORD.pack(k, t) for k, t in keep))
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


class RecencyIndex:
    """Merged recency of every owner's log in one root, refreshed incrementally.

    Keeps each log's identity and read offset so a refresh reads only appended bytes; a log
    replaced by compaction (new inode, or shorter) is read again from the start.  A log gone from
    the directory is forgotten at the next refresh, and the keys of blocks gone from the pool
    when the evictor passes its scan to :meth:`retain`, so a long-lived index stays as large as
    the pool and its logs, not as everything the pool ever held.
    """

    def __init__(self, root: str) -> None:
        self.dir = owners_dir(root)
        self.latest: dict[bytes, int] = {}
        self._offsets: dict[str, tuple[int, int]] = {}  # name -> (inode, bytes consumed)

    def refresh(self) -> dict[bytes, int]:
        try:
            names = [n for n in os.listdir(self.dir) if _is_log(n)]
        except FileNotFoundError:
            self._offsets.clear()
            return self.latest
        for gone in self._offsets.keys() - set(names):
            del self._offsets[gone]
        for name in names:
            path = os.path.join(self.dir, name)
            try:
                fd, _ = open_regular(path)  # a FIFO planted in owners/ must not hang the evictor
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                ino, done = self._offsets.get(name, (st.st_ino, 0))
                if ino != st.st_ino or st.st_size < done:
                    done = 0
                usable = (st.st_size - done) // RECORD.size * RECORD.size
                data = _pread_all(fd, usable, done) if usable else b""
                data = data[:len(data) - len(data) % RECORD.size]
            except OSError:
                continue
            finally:
                os.close(fd)
            self._offsets[name] = (st.st_ino, done + len(data))
            merge_records(data, self.latest)
        return self.latest

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


def merge_records(data: bytes, into: dict[bytes, int] | None = None) -> dict[bytes, int]:
    """Fold records into ``into``, ignoring a partial trailing record and impossible times.

    A time before 2020 or more than a day ahead is garbage (zero-filled blocks after a crash,
    a foreign file), not an access, and must not make a block look fresh forever.
    """
    latest = {} if into is None else into
    hi = time.time_ns() + _FUTURE_SLACK_NS
    usable = len(data) - len(data) % RECORD.size
    get = latest.get
    for key, ts in RECORD.iter_unpack(memoryview(data)[:usable]):
        if _EPOCH_2020_NS <= ts <= hi and get(key, 0) < ts:
            latest[key] = ts
    return latest


def fold_stale_logs(root: str, live_keys: Iterable[bytes], older_than_s: float, now: float | None = None) -> int:
    """Merge logs untouched for ``older_than_s`` into one archive log, keeping only live keys.

    Every process start creates a new log, so without this the owners directory grows for
    ever.  Must run under the eviction lock (one archiver at a time).  A stale log is renamed
    to a private name before it is read: an idle but live owner that writes to it meanwhile
    sees on that write that its file lost its name and writes the records again to a new log,
    so nothing it writes after the read is unlinked with it.  Readers merge the private file
    too until it is unlinked, and a fold that dies or fails (a full disk) before the unlink
    leaves it for the next fold to take.  Returns the number of logs folded.
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
        private = f"{path}{FOLD_MARK}{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            if now - os.stat(path, follow_symlinks=False).st_mtime <= older_than_s:
                continue
            os.rename(path, private)
        except FileNotFoundError:
            continue
        taken.append(private)
    archive = os.path.join(d, ARCHIVE_NAME)
    if not taken and not os.path.exists(archive):
        return 0
    latest = merge_records(_read_file(archive))
    for path in taken:
        merge_records(_read_file(path), latest)
    live = set(live_keys)
    kept = {k: t for k, t in latest.items() if k in live}
    if not taken and len(kept) >= ARCHIVE_KEEP_FRACTION * len(latest):
        # Nothing folded and few keys to drop: a rewrite is a new inode that every owner's index
        # then reads whole again, on every eviction run.
        return 0
    atomic_write(archive, b"".join(RECORD.pack(k, t) for k, t in kept.items()))
    for path in taken:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return len(taken)


def _is_log(name: str) -> bool:
    """An owner's log, the archive, or a log taken by a fold that has not unlinked it yet."""
    return name.endswith(ACCESS_SUFFIX) or ACCESS_SUFFIX + FOLD_MARK in name


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []


def _read_file(path: str) -> bytes:
    """The file's bytes; none where it is gone or not a regular file (a FIFO must not hang a fold)."""
    try:
        fd, _ = open_regular(path)
    except (FileNotFoundError, NotRegularFile):
        return b""
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)

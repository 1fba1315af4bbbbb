"""Keeping a pool root within its byte budget while other owners keep reading and writing it.

Rules, and why:

* One evictor per root at a time, chosen by a non-blocking lock that dies with its holder
  (``flock``; the kernel and NFSv4 leases release it), so a crashed owner never blocks
  eviction and a busy one never makes another owner's save path wait.
* Least recently used first, where recency is the newest of publication (header ``created_ns``
  or mtime) and the last access any owner logged (:mod:`.recency`).
* Nothing accessed within ``grace_s`` is removed, by any remover: loaders touch keys when they
  promise them (:meth:`~.recency.RecencyLog.promise`, written at once), which is what keeps a
  promised block on disk until it is pinned (an open descriptor then keeps the bytes readable
  even after unlink).  The connector's evictor, ``gds-kv gc``'s quota step and its max-age step
  (:func:`expire_pool`: the age decides for publications, never against an access within the
  grace) and their dry runs all plan by this rule.  The connector's evictor takes a grace of at
  least its index's trust window (:func:`~.capacity.evictor_grace_s`): an owner promises from its
  index without looking at the file.
* A promise written after a run read the logs still counts: the run reads them again, at most
  :data:`RECHECK_S` apart, while it unlinks.  Left unprotected are a promise written within that
  interval before its block's unlink, and one its owner could not write (a full disk), which only
  that owner's own evictor sees (:meth:`~.recency.RecencyLog.unwritten`).
* Tails before heads: prefix matching stops at the first missing block, so a block whose child
  is still present is only removed after that child, and a parent is as recent as its most
  recent descendant.  Evicting a head first would orphan the whole chain behind it.
* Arena pools (docs/format.md, "Arena"): a key's name is a reference file, one per save batch,
  hard-linked under every key of the batch.  Its block's creation time and parent come from the
  header of the slot it names; its bytes count once, however many keys it is linked under, and
  are freed when its last name goes; a name is known by inode, mtime and size, since removing
  another key of the batch changes the ctime every name shows.  Slabs are not counted: they are
  preallocated, and an evicted block frees its slot for its owner's reuse, not disk space.
* One plan for the whole pool: with several roots a key lives under root ``key[0] % n``, so a
  chain's blocks are spread over them.  A root planned alone would take a block whose parent is
  in another root for one cut off from its head (and remove it first), and would never see that
  a head leads to a fresh block in another root.  :func:`evict_pool` takes every root's lock
  and plans over the blocks of all roots.  Each root keeps its own budget; one within it gives
  up a chain's tail only to uncover a block of a root still short of room.
* A clock is not trusted beyond the evictor's: a time ahead of its now counts as now, and one
  more than :data:`FUTURE_TOLERANCE_NS` ahead as unknown, so a writer with a wrong clock cannot
  keep its blocks, and with them their ancestors, fresh for ever.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Callable

from gds_kv_connector.util.atomic_file import TMP_MARK, WRITER_SUFFIX, dead_writers, mark_held, tmp_writer
from gds_kv_connector.util.host import HOST, HOST_TAG, pid_alive
from gds_kv_connector.format.layout import BLOCK_SUFFIX, EVICTED_DIR, EVICTED_KEEP_S, evicted_path
from gds_kv_connector.util.mounts import is_shared_fs
from gds_kv_connector.format.records import ZERO_KEY, BlockHeader, FormatError, is_ref_size
from gds_kv_connector.maintenance.pool_scan import (BadReference, BlockFile, RefFile, fingerprint_dirs, layout_dir,
                                                    mkdir_like_parent, open_regular, owners_dir, quarantine_dir,
                                                    quarantined_at_ns, read_published)
from gds_kv_connector.maintenance.shard_summary import (E_INO, E_KEY, E_MTIME, E_RECENCY, E_SHARE, E_SIZE, FUTURE_TOLERANCE_NS, FX_ONE,
                                                        Entry, OwnChanges, RootSummaries, Shard, clamp_ns, fx_bytes,
                                                        refresh)
from gds_kv_connector.maintenance.recency import RecencyIndex, access_horizon, fold_stale_logs
from gds_kv_connector.maintenance.retired_owners import fold_retired_owners
from gds_kv_connector.config.settings import SPECS

log = logging.getLogger(__name__)

LOCKS_DIR = "locks"
LOCK_NAME = "evict.lock"
EXCL_LOCK_STALE_S = 900.0  # an O_EXCL lock older than this is from a dead or hung evictor
EXCL_LOCK_PID_CHECK_S = 60.0  # a younger one is never broken on a pid check alone
QUARANTINE_KEEP_S = 86_400.0
LOG_FOLD_AGE_S = 3_600.0  # access logs idle this long are folded into the archive log
OWNER_STATS_KEEP_S = 7 * 86_400.0
OWNER_TMP_KEEP_S = 3_600.0
WINDOW_MIN = 2048  # summary entries a run takes at least: a pool with fewer is planned whole, as one graph
WINDOW_SLACK = 1.25  # a window's first size: this many times the bytes each short root must free
HEADER_CACHE_MAX = 1 << 16  # headers a long-lived caller's cache keeps beyond the last window's
RECHECK_S = 0.05  # how often a run reads the access logs again while it unlinks
DEFAULT_GRACE_S = next(spec.default for spec in SPECS if spec.name == "evict_grace_s")
# flock(2) errors that mean "no flock here": the lease lock file is used instead.  EBADF is NFS's: its
# clients emulate flock with a byte-range lock, which a descriptor open for reading only cannot take.
_FLOCK_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF}

#: header facts of one published file: path -> (identity, created_ns, parent key); the identity is
#: (inode, ctime_ns) for a block file and BlockFile.file_id, (inode, mtime_ns, size), for an arena
#: reference file, whose ctime changes whenever another key of its batch is evicted
HeaderCache = dict[str, tuple[tuple[int, ...], int, bytes]]
#: a block of the plan: (fingerprint dir, key), the same in every root
NodeId = tuple[str, bytes]


@dataclass
class EvictionReport:
    root: str
    skipped: bool = False  # another owner holds the eviction lock
    dry_run: bool = False
    reason: str = ""  # what made this run remove blocks: quota, min_free, age; empty if nothing
    scanned_blocks: int = 0
    scanned_bytes: int = 0
    free_bytes: int = -1  # of the root's filesystem at the start; -1 if unknown
    target_bytes: int = 0  # bytes this run tried to free
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    protected_blocks: int = 0  # blocks inside the grace window, or promised while the run unlinked
    failed: int = 0  # unlink refused (permissions) or the file was replaced meanwhile
    unreadable_headers: int = 0
    unreadable_entries: int = 0  # directories or entries the rebuilds could not read: usage is a floor
    names_listed: int = 0  # by this run's rebuilds of shard summaries
    summaries_stale: int = 0  # shards whose summary is stale or missing after this run: usage lags
    tmp_removed: int = 0
    quarantine_removed: int = 0
    evicted_kept_removed: int = 0  # blocks an evictor kept on a shared filesystem, removed once old enough
    logs_folded: int = 0
    log_bytes_skipped: int = 0  # of access logs over the read cap (recency.MAX_READ_BYTES), not read
    duration_s: float = 0.0

    @property
    def reached_target(self) -> bool:
        return self.evicted_bytes >= self.target_bytes

    @property
    def usage_after(self) -> int:
        return self.scanned_bytes - self.evicted_bytes

    def to_dict(self) -> dict:
        return asdict(self) | {"reached_target": self.reached_target, "usage_after": self.usage_after}


class EvictLock:
    """Non-blocking per-root lock; ``flock`` where supported, else an O_EXCL file with a lease.

    The O_EXCL fallback (filesystems without working locks) is broken when its holder is a dead
    local process (checked once the lock is :data:`EXCL_LOCK_PID_CHECK_S` old) or older than
    :data:`EXCL_LOCK_STALE_S`; two breakers racing can both win,
    which costs over-eviction at worst, never a corrupt pool.
    """

    def __init__(self, root: str, stale_s: float = EXCL_LOCK_STALE_S) -> None:
        self.dir = os.path.join(layout_dir(root), LOCKS_DIR)
        self.path = os.path.join(self.dir, LOCK_NAME)
        self.excl_path = self.path + ".excl"
        self.stale_s = stale_s
        self._fd = -1
        self._token = ""

    def acquire(self) -> bool:
        mkdir_like_parent(self.dir)
        # read-only is enough for flock, and works for every member of a shared group whatever
        # the creator's umask left of the file's mode
        fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                     _file_mode(self.dir))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _FLOCK_UNSUPPORTED:
                raise
            return self._acquire_excl()
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1
        if self._token:
            if self._excl_holder().get("token") == self._token:
                _unlink_quiet(self.excl_path)
            self._token = ""

    def __enter__(self) -> "EvictLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _acquire_excl(self) -> bool:
        for _ in range(2):
            token = secrets.token_hex(8)
            try:
                fd = os.open(self.excl_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             _file_mode(self.dir))
            except FileExistsError:
                if not self._break_if_stale():
                    return False
                continue
            try:
                os.write(fd, json.dumps({"host": HOST, "pid": os.getpid(), "time": time.time(),
                                         "token": token}).encode())
            finally:
                os.close(fd)
            self._token = token
            return True
        return False

    def _excl_holder(self) -> dict:
        try:
            with os.fdopen(open_regular(self.excl_path)[0], "rb") as fh:  # a FIFO there must not hang us
                data = json.loads(fh.read(4096))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _break_if_stale(self) -> bool:
        holder = self._excl_holder()
        try:
            age = time.time() - os.stat(self.excl_path).st_mtime
        except FileNotFoundError:
            return True
        # A pid is checked only once the lock is old enough: from another pid namespace on a host of
        # the same name (a sidecar, `kubectl exec`) a live evictor's pid looks dead.
        dead_local = age > EXCL_LOCK_PID_CHECK_S and holder.get("host") == HOST \
            and isinstance(holder.get("pid"), int) and not pid_alive(holder["pid"])
        if not dead_local and age <= self.stale_s:
            return False
        broken = f"{self.excl_path}.broken-{secrets.token_hex(4)}"
        try:
            os.rename(self.excl_path, broken)
        except FileNotFoundError:
            return True
        _unlink_quiet(broken)
        log.warning("broke a stale eviction lock held by %s", holder or "an unknown owner")
        return True


@dataclass
class _Node:
    block: BlockFile
    recency: int  # ns; raised to the newest descendant's before planning
    parent: NodeId | None
    children: int = 0
    orphan: bool = False  # its parent is gone
    dangling: bool = False  # it or an ancestor is an orphan: no lookup can reach it any more
    root: int = 0  # index of its root in the pool's roots
    above: int = 0  # bit i set: an ancestor old enough to evict lives in root i (several roots only)
    ref: bool = False  # an arena reference file: one name of a file linked under every key of a batch
    accessed: int = 0  # ns of its newest logged access (a promise is one), clamped like recency
    protected: bool = False  # within its run's age or grace: neither it nor its ancestors go


def evict(root: str, quota_bytes: int, low_watermark: float, min_free_bytes: int, grace_s: float,
          now: float | None = None, *, dry_run: bool = False, header_cache: HeaderCache | None = None,
          recency: RecencyIndex | None = None) -> EvictionReport:
    """Bring ``root`` to ``low_watermark * quota_bytes`` (and its filesystem to
    ``min_free_bytes / low_watermark`` free) once it is over quota or below ``min_free_bytes``.

    ``quota_bytes`` 0 means no quota.  ``header_cache`` and ``recency`` let a long-lived
    caller avoid re-reading unchanged headers and whole access logs on every run.  ``root``
    is the pool's only root; a pool of several roots goes through :func:`evict_pool`.
    """
    return evict_pool((root,), quota_bytes, low_watermark, min_free_bytes, grace_s, now, dry_run=dry_run,
                      header_cache=header_cache, recency=None if recency is None else (recency,))[0]


def evict_pool(roots: Sequence[str], quota_bytes: int, low_watermark: float, min_free_bytes: int,
               grace_s: float, now: float | None = None, *, dry_run: bool = False,
               header_cache: HeaderCache | None = None,
               recency: Sequence[RecencyIndex] | None = None) -> list[EvictionReport]:
    """:func:`evict` every root of one pool in one run; one report per root, in ``roots`` order.

    ``roots`` are all the roots of the pool (``TLLM_GDS_KV_ROOT``); the budget applies to each
    root.  ``recency`` holds one index per root, in the same order; ``header_cache`` may hold
    the headers of every root.  Taking every root's lock, rather than one root's lock and a
    read-only look at the others, is what lets a run remove a chain's tail in one root before
    its head in another: only the holder of a root's lock removes blocks there.
    """
    def plan(report: EvictionReport, free: int) -> tuple[int, int]:
        usage, by_quota, by_space, reasons = report.scanned_bytes, 0, 0, []
        if quota_bytes and usage > quota_bytes:
            by_quota = usage - int(low_watermark * quota_bytes)
            reasons.append("quota")
        if min_free_bytes and 0 <= free < min_free_bytes:
            by_space = int(min_free_bytes / low_watermark) - free
            reasons.append("min_free")
        report.reason = "+".join(reasons)
        return by_quota, by_space

    return _run(tuple(roots), now, dry_run, header_cache, recency, plan, int(grace_s * 1e9), int(grace_s * 1e9))


def expire(root: str, max_age_s: float, now: float | None = None, *, grace_s: float = DEFAULT_GRACE_S,
           dry_run: bool = False, header_cache: HeaderCache | None = None,
           recency: RecencyIndex | None = None) -> EvictionReport:
    """Remove every block neither published nor accessed within ``max_age_s``, nor accessed within
    ``grace_s``: an access within the grace may be a promise, whose load has not begun.

    A parent is as recent as its newest descendant, so a chain expires from its tail and an
    old head that still leads to a fresh block stays.  ``root`` is the pool's only root; a pool
    of several roots goes through :func:`expire_pool`.
    """
    return expire_pool((root,), max_age_s, now, grace_s=grace_s, dry_run=dry_run, header_cache=header_cache,
                       recency=None if recency is None else (recency,))[0]


def expire_pool(roots: Sequence[str], max_age_s: float, now: float | None = None, *,
                grace_s: float = DEFAULT_GRACE_S, dry_run: bool = False, header_cache: HeaderCache | None = None,
                recency: Sequence[RecencyIndex] | None = None) -> list[EvictionReport]:
    """:func:`expire` every root of one pool in one run (arguments as for :func:`evict_pool`)."""
    def plan(report: EvictionReport, free: int) -> tuple[int, int]:
        report.reason = "age"
        return report.scanned_bytes, 0

    return _run(tuple(roots), now, dry_run, header_cache, recency, plan, int(max_age_s * 1e9) + 1,
                int(grace_s * 1e9))


def _run(roots: tuple[str, ...], now: float | None, dry_run: bool, header_cache: HeaderCache | None,
         recency: Sequence[RecencyIndex] | None, plan: Callable[[EvictionReport, int], tuple[int, int]],
         min_age_ns: int, hold_ns: int) -> list[EvictionReport]:
    """Lock every root, bring the shard summaries up to date within their budget, remove what
    ``plan`` asks of each root (blocks at least ``min_age_ns`` old and not accessed within
    ``hold_ns``), tidy up.  ``plan`` gives a root's bytes to free for its own budget and for its
    filesystem's free space; roots on one filesystem share the latter (each takes a part in
    proportion to its usage), since what one frees, the others' filesystem gains.

    The locks are tried without waiting, in the pool's order of roots, and the run is skipped
    unless it holds all of them: never waiting means no deadlock, and the same order for every
    owner means two of them meet at the first root, where one goes ahead.  Roots naming one
    directory (a repeated path, a link) are planned once, under the first name.
    """
    if recency is not None and len(recency) != len(roots):
        raise ValueError(f"{len(recency)} recency index(es) for {len(roots)} root(s)")
    t0 = time.monotonic()
    now = time.time() if now is None else now
    reports = [EvictionReport(os.path.abspath(r), dry_run=dry_run) for r in roots]
    devs = _distinct_roots(roots, reports)  # root index -> device of its pool directory
    live = list(devs)
    if not live:
        return reports
    with ExitStack() as held:
        # A dry run removes nothing, so it needs no lock (taking one would create locks/ in a
        # pool it must leave as it found it); it rebuilds summaries in memory only.
        for i in ([] if dry_run else live):
            if not held.enter_context(EvictLock(roots[i])).acquire():
                for report in reports:
                    report.skipped = True
                return reports
        now_ns = int(now * 1e9)
        indexes = recency or [RecencyIndex(r) for r in roots]
        skipped = [index.skipped_bytes for index in indexes]
        sums = {i: RootSummaries.load(roots[i], i) for i in live}
        # Only the accesses since the oldest summary (and the grace) are needed: older ones are in
        # the entries' recency.  Read before the rebuilds, whose entries record them.
        horizon = _horizon(sums.values(), now_ns - hold_ns)
        for index in indexes:
            index.set_horizon(horizon)
        access = [index.refresh() for index in indexes]
        tallies = refresh(list(sums.values()), access, now, write=not dry_run)
        # Part of the pool could not be read: a block there may be another's parent, and its access
        # records must not be forgotten.
        blind = any(t.unreadable for t in tallies.values())
        usage = {i: fx_bytes(s.live_fx) for i, s in sums.items()}
        space_share = _space_shares(devs, usage)
        ref_budget = [0] * len(roots)  # bytes reference names may free: a budget's, never free space's
        for i, s in sums.items():
            report, tally = reports[i], tallies[i]
            report.scanned_blocks, report.scanned_bytes = s.live_count, usage[i]
            report.unreadable_entries, report.tmp_removed = tally.unreadable, tally.tmp_removed
            report.names_listed, report.summaries_stale = tally.listed + tally.counted, tally.stale
            report.free_bytes = _free_bytes(roots[i])
            by_quota, by_space = plan(report, report.free_bytes)
            report.target_bytes = max(0, by_quota, int(by_space * space_share[i]))
            ref_budget[i] = max(0, by_quota)
            if not report.target_bytes:
                report.reason = ""
        planner: _Planner | None = None
        if any(report.target_bytes for report in reports):
            planner = _Planner(roots, [sh for s in sums.values() for sh in s.shards], reports, header_cache,
                               now_ns, access, min_age_ns, hold_ns)
            planner.run(ref_budget, None if dry_run else _Fresh(indexes, now_ns - hold_ns, now_ns,
                                                                      [is_shared_fs(r) for r in roots]))
            if not dry_run:
                planner.update_summaries()
            for i in sums:
                reports[i].log_bytes_skipped = indexes[i].skipped_bytes - skipped[i]
                indexes[i].forget(planner.removed_keys.get(i, ()), now_ns)
        if not dry_run:  # a long-lived index keeps only what the next run needs
            horizon = _horizon(sums.values(), now_ns - hold_ns)
            for index in indexes:
                index.set_horizon(horizon)
        if header_cache is not None:
            _keep_cache(header_cache, planner)
        if not dry_run:
            for i in sums:
                report, root = reports[i], roots[i]
                report.quarantine_removed = _expire_quarantine(root, now)
                report.evicted_kept_removed = _expire_evicted(root, now)
                _tidy_owners(root, now)
                if not blind:  # a fold drops the records of the blocks this run removed
                    gone = planner.removed_keys.get(i, set()) if planner is not None else set()
                    report.logs_folded = fold_stale_logs(root, _Except(gone), LOG_FOLD_AGE_S, now,
                                                         dead_at_most=len(gone))
    duration = time.monotonic() - t0
    for report in reports:
        report.duration_s = duration
        if report.target_bytes:
            log.info("pool %s: %s %d block(s), %d bytes (%s; target %d bytes, %d within the protected age)",
                     report.root, "would evict" if dry_run else "evicted", report.evicted_blocks,
                     report.evicted_bytes, report.reason, report.target_bytes, report.protected_blocks)
    return reports


def _horizon(sums: Iterable[RootSummaries], held_ns: int) -> int:
    """The access records a run needs: since its oldest summary and within its grace
    (:func:`~.recency.access_horizon`); 0 (all of them) while a shard has no summary."""
    return access_horizon(min((s.oldest_built_ns() for s in sums), default=held_ns), held_ns)


class _Except:
    """Every key but ``gone``: what a fold keeps (:func:`~.recency.fold_stale_logs`)."""

    def __init__(self, gone: set[bytes]) -> None:
        self._gone = gone

    def __contains__(self, key: object) -> bool:
        return key not in self._gone


def _distinct_roots(roots: tuple[str, ...], reports: list[EvictionReport]) -> dict[int, int]:
    """The roots with a pool, one per directory, by index, with the device their pool is on: a
    root naming the directory of an earlier one (a repeated path, a link) is left out and reported
    skipped, since locking one directory twice from one process fails and would skip every run."""
    seen: dict[tuple[int, int], int] = {}
    live: dict[int, int] = {}
    for i, r in enumerate(roots):
        try:
            st = os.stat(layout_dir(r))
        except OSError:
            continue
        first = seen.setdefault((st.st_dev, st.st_ino), i)
        if first != i:
            reports[i].skipped = True
            log.warning("pool root %s names the directory of root %s: planned once, under the latter", r,
                        roots[first])
            continue
        live[i] = st.st_dev
    return live


def _space_shares(devs: dict[int, int], usage: dict[int, int]) -> dict[int, float]:
    """Each root's part of its filesystem's free-space shortfall: roots on one filesystem (``devs``)
    split it by usage (one root alone takes all of it), so that together they free it once, not
    once each."""
    by_fs: dict[int, list[int]] = {}
    for i in usage:
        by_fs.setdefault(devs[i], []).append(i)
    shares: dict[int, float] = {}
    for members in by_fs.values():
        total = sum(usage[i] for i in members)
        for i in members:
            shares[i] = usage[i] / total if total else 1.0 / len(members)
    return shares


@dataclass
class _Cand:
    """A summary entry taken into a run's window, with what its header says."""

    block: BlockFile
    root: int
    sid: int  # its shard, by the planner's numbering
    index: int  # of the entry in its shard's summary
    share: int  # its part of the file's bytes, in 1/FX_ONE
    recency: int  # its entry's: publication and the accesses logged before its summary was built
    ref: bool
    created: int
    parent: bytes


class _Planner:
    """The oldest blocks of the pool, read from the shard summaries in order, planned as a graph.

    A lazy merge over every shard summary of every root yields entries oldest first; a run takes
    them into its *window* until every root short of its target could meet it
    (:data:`WINDOW_SLACK` times its bytes, and at least :data:`WINDOW_MIN` entries), plans the
    window as one graph (:func:`_peel`: dangling first, then LRU; tails before heads; protected
    blocks and their ancestors stay), and doubles the window while a root is still short.  The
    merge stops at the first entry younger than the run's age limit: nothing after it can go.

    Within the window the rules are the whole-pool plan's.  At its edge: a candidate whose parent
    is not in the window is a leaf, or an orphan when the parent's file is absent (one lstat);
    one whose recency, raised by its logged accesses and its descendants', passes the window's
    edge (accessed since its summary was built) stays for a later, larger window.  A child beyond
    the window is not seen, so a head it leads to can go before it: what keeps chains whole there
    is the writer rule of :meth:`~.recency.RecencyLog.touch` (a chain touched head first has
    strictly older tails), which puts tails before their heads in the merge.
    """

    def __init__(self, roots: tuple[str, ...], shards: list[Shard], reports: list[EvictionReport],
                 cache: HeaderCache | None, now_ns: int, access: list[dict[bytes, int]], min_age_ns: int,
                 hold_ns: int) -> None:
        self.roots, self.reports, self.cache, self.now_ns, self.access = roots, reports, cache, now_ns, access
        self.newest_ns, self.held_ns = now_ns - min_age_ns, now_ns - hold_ns
        self.shards = [s for s in shards if s.header is not None]
        self.merge = heapq.merge(*(_heads(sid, s) for sid, s in enumerate(self.shards)))
        self.cands: dict[str, _Cand] = {}  # by path
        self.pulled = 0
        self.pulled_fx = [0] * len(roots)
        self.edge = 0  # summary recency of the last entry taken
        self.exhausted = False
        self.names: dict[tuple[int, tuple[int, int, int]], int] = {}  # names left of each reference file
        self.exists: dict[NodeId, bool] = {}  # files outside the window looked up as parents
        self.dead: dict[int, set[int]] = {}  # shard id -> entries removed or found gone
        self.freed: dict[int, list[int]] = {}  # shard id -> [names removed, their bytes in 1/FX_ONE]
        self.removed_keys: dict[int, set[bytes]] = {}  # root -> keys removed
        self.removed_paths: set[str] = set()
        self.promised = [0] * len(roots)  # blocks found promised while unlinking, per root
        self._counted = [0] * len(roots)  # protected blocks of the last window, per root
        self.own = OwnChanges(self.shards)  # shard directories changed by this run's unlinks alone

    def run(self, ref_budget: list[int], fresh: "_Fresh | None") -> None:
        want = WINDOW_MIN
        while True:
            self._pull(want)
            nodes = self._graph()
            removed = _peel(nodes, self.reports, ref_budget, fresh, self.names, self.own)
            for i, report in enumerate(self.reports):
                self.promised[i] = report.protected_blocks - self._counted[i]
            for path in removed:
                self._removed(self.cands.pop(path), fresh is None)
            short = any(r.evicted_bytes < r.target_bytes for r in self.reports)
            if not short or self.exhausted:
                return
            want = 2 * self.pulled

    def _pull(self, want: int) -> None:
        """Take entries until ``want`` are taken and every short root has its target's worth."""
        slack = [int(WINDOW_SLACK * max(0, r.target_bytes - r.evicted_bytes)) * FX_ONE for r in self.reports]
        batch: list[tuple[Shard, int, int, Entry]] = []
        while self.pulled < want or any(self.pulled_fx[i] < slack[i] for i in range(len(slack))):
            item = next(self.merge, None)
            # what follows is within the age limit; a small pool is still taken whole, as one graph
            if item is None or (item[0] > self.newest_ns and self.pulled >= WINDOW_MIN):
                self.exhausted = True
                break
            _, _, sid, idx, e = item
            shard = self.shards[sid]
            self.edge = item[0]
            self.pulled += 1
            self.pulled_fx[shard.root] += e[E_SHARE]
            batch.append((shard, sid, idx, e))
        # names of one reference file one after another: it is parsed, and its slab opened, once
        batch.sort(key=lambda c: (c[3][E_INO], c[3][E_MTIME]) if is_ref_size(c[3][E_SIZE]) else (0, 0))
        with _Reader() as reader:
            for shard, sid, idx, e in batch:
                self._read(reader, shard, sid, idx, e)

    def _read(self, reader: "_Reader", shard: Shard, sid: int, idx: int, e: Entry) -> None:
        key = e[E_KEY]
        path = os.path.join(shard.dir, key.hex() + BLOCK_SUFFIX)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self.dead.setdefault(sid, set()).add(idx)
            return
        except OSError:
            return
        if (st.st_ino, st.st_mtime_ns) != (e[E_INO], e[E_MTIME]) or not stat.S_ISREG(st.st_mode):
            return  # replaced since the summary: its shard is stale, and its next rebuild sees the new file
        b = BlockFile(shard.fp, key, path, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        hit = self.cache.get(path) if self.cache is not None else None
        if hit is not None and hit[0] == _identity(b, len(hit[0]) == 3):
            ref, created, parent = len(hit[0]) == 3, hit[1], hit[2]
        else:
            try:
                ref, created, parent_read = reader.read(b)
            except FileNotFoundError:
                self.dead.setdefault(sid, set()).add(idx)
                return
            if parent_read is None:
                self.reports[shard.root].unreadable_headers += 1
                parent = ZERO_KEY
            else:
                parent = parent_read
                if self.cache is not None:
                    self.cache[path] = (_identity(b, ref), created, parent)
        if ref:
            self.names.setdefault((shard.root, b.file_id), st.st_nlink)
        self.cands[path] = _Cand(b, shard.root, sid, idx, e[E_SHARE], e[E_RECENCY], ref, created, parent)

    def _graph(self) -> dict[NodeId, _Node]:
        """The window as a graph: nodes keyed by (fingerprint dir, key), parent links across roots,
        recency raised by accesses and descendants, protection marked.  A block's recency starts as
        the newest of its header's ``created_ns``, its mtime and its entry's recency, each clamped
        (:func:`clamp_ns`): the entry's holds the accesses older than the index's horizon."""
        n_roots, now_ns = len(self.roots), self.now_ns
        nodes: dict[NodeId, _Node] = {}
        for c in self.cands.values():
            b = c.block
            published = max(clamp_ns(c.created, now_ns), clamp_ns(b.mtime_ns, now_ns), clamp_ns(c.recency, now_ns))
            node = _Node(b, published, None if c.parent == ZERO_KEY else (b.fp, c.parent), root=c.root, ref=c.ref)
            if n_roots > 1 and (b.fp, b.key) in nodes:
                node = _keep_readable_copy(nodes, node, n_roots)
            nodes[(b.fp, b.key)] = node
        for n in nodes.values():
            if n.parent is not None:
                if n.parent in nodes:
                    nodes[n.parent].children += 1
                else:  # outside the window: a leaf here, an orphan if its parent's file is gone
                    n.parent, n.orphan = None, not self._parent_exists(n.parent)
        _mark_dangling(nodes)
        _apply_recency(nodes, self.access, now_ns)
        self._counted = [0] * len(self.roots)
        for n in nodes.values():
            n.protected = n.recency > self.newest_ns or n.accessed > self.held_ns
            self._counted[n.root] += n.protected
            if not n.protected and not self.exhausted and n.recency > self.edge:
                n.protected = True  # newer than the window's edge: older blocks may lie beyond it
        if len(self.roots) > 1:
            _mark_ancestor_roots(nodes)
        for i, report in enumerate(self.reports):
            report.protected_blocks = self.promised[i] + self._counted[i]
        return nodes

    def _parent_exists(self, parent: NodeId) -> bool:
        known = self.exists.get(parent)
        if known is None:
            fp, key = parent
            name = key.hex()
            path = os.path.join(layout_dir(self.roots[key[0] % len(self.roots)]), fp, name[:2], name + BLOCK_SUFFIX)
            try:
                os.lstat(path)
                known = True
            except FileNotFoundError:
                known = False
            except OSError:
                known = True  # unreadable: perhaps there, so nothing is taken for cut off
            self.exists[parent] = known
        return known

    def _removed(self, c: _Cand, dry_run: bool) -> None:
        sid = c.sid
        self.removed_paths.add(c.block.path)
        self.exists[(c.block.fp, c.block.key)] = False
        self.removed_keys.setdefault(c.root, set()).add(c.block.key)
        if not dry_run:
            self.dead.setdefault(sid, set()).add(c.index)
            freed = self.freed.setdefault(sid, [0, 0])
            freed[0] += 1
            freed[1] += c.share

    def update_summaries(self) -> None:
        """Rewrite the header of every summary whose shard this run unlinked in (or found entries gone)."""
        for sid, dead in self.dead.items():
            removed, fx = self.freed.get(sid, (0, 0))
            shard = self.shards[sid]
            shard.update(dead, removed, fx, self.own.left(shard.dir))



def _heads(sid: int, shard: Shard) -> Iterator[tuple[int, bytes, int, int, Entry]]:
    """A shard summary's entries as the planner's merge takes them: (recency, key, shard id, index, entry)."""
    for idx, e in shard.cursor():
        yield e[E_RECENCY], e[E_KEY], sid, idx, e


def _keep_cache(cache: HeaderCache, planner: "_Planner | None") -> None:
    """Keep in a long-lived caller's header cache the headers of the window's blocks that stay (the
    next run reads the same oldest blocks first), and no more than :data:`HEADER_CACHE_MAX`."""
    if planner is not None:
        for path in planner.removed_paths:
            cache.pop(path, None)
    if len(cache) > HEADER_CACHE_MAX:
        kept = planner.cands if planner is not None else {}
        for path in [p for p in cache if p not in kept]:
            del cache[path]


def _identity(b: BlockFile, ref: bool) -> tuple[int, ...]:
    """What tells the scanned file from another one at its name later (see :data:`HeaderCache`)."""
    return b.file_id if ref else (b.ino, b.ctime_ns)


class _Reader:
    """Reads the header facts of published names for one plan.

    A block file's header is its first page.  An arena reference file names, for each key of its
    batch, a slot of a slab; the slot holds the block's header, which must be a valid header of that
    key and of the record the reference names (its ``created``), as :mod:`.operations` verify checks
    it.  The names of one reference file are read one after another (:meth:`_Planner._pull` groups them), so
    the file is parsed once for all its keys and its slab opened once, not once per key.
    """

    def __init__(self) -> None:
        self._id: tuple[int, int, int] | None = None  # file_id of the reference file in _ref
        self._ref: RefFile | None = None
        self._slab: tuple[int, int] | None = None  # (descriptor, size) of _ref's slab, once opened
        self._slab_failed = False

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self._drop()

    def read(self, b: BlockFile) -> tuple[bool, int, bytes | None]:
        """(whether ``b`` is a reference file, its block's created_ns, its parent key or None when
        unreadable); raises FileNotFoundError when the name is gone.  A reference whose slot cannot
        be read keeps the creation time its entry records."""
        ref_file = self._ref if self._id == b.file_id else None
        if ref_file is None:
            self._drop()
            try:
                st, what = read_published(b)
            except FileNotFoundError:
                raise
            except BadReference:
                return True, 0, None
            except (OSError, FormatError):
                return False, 0, None
            if isinstance(what, BlockHeader):
                return False, what.created_ns, what.parent_key
            ref_file = what
            if b.same_reference(st):  # else the name was replaced since the scan: not for the other names
                self._id, self._ref = b.file_id, what
        entry = ref_file.entries.get(b.key)
        if entry is None:
            return True, 0, None
        slab = self._slab_of(b, ref_file)
        if slab is None:
            return True, entry.created_ns, None
        try:
            _, header = ref_file.slot_header(slab[0], slab[1], b.key)
        except (OSError, FormatError):
            return True, entry.created_ns, None
        return True, header.created_ns, header.parent_key

    def _slab_of(self, b: BlockFile, ref_file: RefFile) -> tuple[int, int] | None:
        """(descriptor, size) of the slab ``ref_file`` names, opened once per reference file read."""
        if self._slab is None and not self._slab_failed:
            try:
                fd, st = open_regular(ref_file.slab_path(b))
            except OSError:  # gone (gc, an operator), or not a regular file
                self._slab_failed = True
                return None
            self._slab = (fd, st.st_size)
        return self._slab

    def _drop(self) -> None:
        if self._slab is not None:
            os.close(self._slab[0])
        self._id, self._ref, self._slab, self._slab_failed = None, None, None, False


def _keep_readable_copy(nodes: dict[NodeId, _Node], node: _Node, n_roots: int) -> _Node:
    """Of two copies of one key in two roots (the pool's roots were listed differently when one
    was written), return the copy lookups read (root ``key[0] % n``); the other joins the plan as
    an orphan of its own, dead weight to remove first."""
    other = nodes[(node.block.fp, node.block.key)]
    if node.block.key[0] % n_roots != node.root:
        node, other = other, node
    other.parent, other.orphan = None, True
    nodes[(f"{other.block.fp}@{other.root}", other.block.key)] = other
    return node


def _mark_dangling(nodes: dict[NodeId, _Node]) -> None:
    """Flag blocks cut off from their chain's head: a lookup stops at the first missing block,
    so they are dead weight until someone saves the missing prefix again."""
    known: dict[NodeId, bool] = {}
    for start in nodes:
        walk: list[NodeId] = []
        on_walk: set[NodeId] = set()  # a set beside the list: chains run to thousands of blocks
        cur = start
        while cur not in known:
            n = nodes[cur]
            if n.parent is None:
                known[cur] = n.orphan
            elif cur in on_walk:
                known[cur] = True  # a cycle only garbage headers can make
            else:
                walk.append(cur)
                on_walk.add(cur)
                cur = n.parent
        for k in walk:
            known[k] = known[cur]
    for k, n in nodes.items():
        n.dangling = known[k]


def _apply_recency(nodes: dict[NodeId, _Node], access: list[dict[bytes, int]], now_ns: int) -> None:
    """Fold logged accesses in (``access[i]``: root i's logs, where a key's records go), then raise
    every parent to its newest descendant (leaves up).  Access times are taken as
    :meth:`_Planner._graph` takes publication times: clamped to ``now_ns``, ignored far beyond it."""
    latest = now_ns + FUTURE_TOLERANCE_NS
    for n in nodes.values():
        t = access[n.root].get(n.block.key, 0)
        if t <= latest:
            n.accessed = min(t, now_ns)
            n.recency = max(n.recency, n.accessed)
    waiting = {k: n.children for k, n in nodes.items()}
    ready = [n for n in nodes.values() if n.children == 0]
    while ready:
        n = ready.pop()
        if n.parent is None:
            continue
        p = nodes[n.parent]
        p.recency = max(p.recency, n.recency)
        waiting[n.parent] -= 1
        if waiting[n.parent] == 0:
            ready.append(p)


def _mark_ancestor_roots(nodes: dict[NodeId, _Node]) -> None:
    """Set ``above``: the roots of the ancestors that removing a block could make evictable, those
    up to the first protected one (which never goes, so neither do those above it)."""
    above: dict[NodeId, int] = {}
    for start in nodes:
        walk: list[NodeId] = []
        on_walk: set[NodeId] = set()
        cur = start
        while cur not in above:
            p = nodes[cur].parent
            if p is None or cur in on_walk or nodes[p].protected:
                above[cur] = 0  # a head, a cycle (garbage headers), or a protected parent
                break
            walk.append(cur)
            on_walk.add(cur)
            cur = p
        for k in reversed(walk):
            p = nodes[k].parent
            above[k] = (1 << nodes[p].root) | above[p]
    for k, n in nodes.items():
        n.above = above[k]


def _peel(nodes: dict[NodeId, _Node], reports: list[EvictionReport], ref_budget: list[int],
          fresh: "_Fresh | None", names: dict[tuple[int, tuple[int, int, int]], int],
          own: OwnChanges) -> set[str]:
    """Remove leaves, dangling ones first, then oldest first, until every root has met its target;
    a parent becomes a leaf once all its children are gone, and nothing protected goes, nor what
    ``fresh`` finds promised since the plan (without ``fresh``, a dry run: nothing is unlinked).
    ``names`` holds the names left of each reference file (its link count when first read): its
    bytes are freed, and counted, when the last one goes.  ``own`` watches the shard directories
    around each unlink (:class:`~.shard_summary.OwnChanges`).

    A leaf in a root already within its target goes only when an ancestor of it lies in a root
    still short of its target: a chain's tail in one root is what keeps its head in another
    from being evicted, and keeping that tail would make the short root evict newer blocks.
    """
    short = sum(1 << i for i, r in enumerate(reports) if r.evicted_bytes < r.target_bytes)
    left = {k: n.children for k, n in nodes.items()}
    heap = [(not n.dangling, n.recency, n.block.path, k) for k, n in nodes.items() if n.children == 0]
    heapq.heapify(heap)
    removed: set[str] = set()
    while heap and short:
        _, _, path, k = heapq.heappop(heap)
        n = nodes[k]
        if n.protected:
            continue  # and so its ancestors stay: they never become leaves
        if not (short >> n.root) & 1 and not n.above & short:
            continue  # its root has room, and no root short of room waits for it to go
        if n.ref and reports[n.root].evicted_bytes >= ref_budget[n.root]:
            # free space gains nothing from a reference name going (its block is a preallocated
            # arena slot): references go towards a root's own budget only, never to free space
            continue
        report = reports[n.root]
        if fresh is not None and fresh.promised(n):
            report.protected_blocks += 1
            continue
        if fresh is not None:
            shard_dir = os.path.dirname(n.block.path)
            own.before(shard_dir)
            gone = _remove_if_same(n.block, n.ref, fresh.keeps[n.root])
            own.after(shard_dir)
            if not gone:
                report.failed += 1
                continue
        removed.add(path)
        report.evicted_blocks += 1
        if n.ref:
            names[(n.root, n.block.file_id)] -= 1
            if names[(n.root, n.block.file_id)] == 0:
                report.evicted_bytes += n.block.size
        else:
            report.evicted_bytes += n.block.size
        if report.evicted_bytes >= report.target_bytes:
            short &= ~(1 << n.root)
        if n.parent is not None:
            left[n.parent] -= 1
            if left[n.parent] == 0:
                p = nodes[n.parent]
                heapq.heappush(heap, (not p.dangling, p.recency, p.block.path, n.parent))
    return removed


class _Fresh:
    """Accesses logged since a run's plan read the logs, read again at most :data:`RECHECK_S` apart
    while it unlinks: a block promised meanwhile (the plan took it for old) stays, and so do its
    ancestors, which then never become leaves."""

    def __init__(self, indexes: Sequence[RecencyIndex], held_ns: int, now_ns: int, keeps: Sequence[bool]) -> None:
        self._indexes, self._held_ns = indexes, held_ns
        self.keeps = keeps  # per root: on a shared filesystem, removed blocks are kept a while (_remove_if_same)
        self._latest = now_ns + FUTURE_TOLERANCE_NS  # beyond it a time is a bad clock's, as in the plan
        self._due = 0.0  # read at the first unlink: the plan read them before it planned

    def promised(self, n: _Node) -> bool:
        if time.monotonic() >= self._due:
            for index in self._indexes:
                index.refresh()
            self._due = time.monotonic() + RECHECK_S
        return self._held_ns < self._indexes[n.root].latest.get(n.block.key, 0) <= self._latest


def _remove_if_same(block: BlockFile, ref: bool, keep: bool) -> bool:
    """Remove the scanned file, not one republished under its name since the scan.  A reference file
    (``ref``) is known by inode, mtime and size: removing another of its names, another key of its
    save batch, changes the ctime that this one shows too.

    With ``keep`` (a root on a shared filesystem) the file is renamed into its fingerprint directory's
    :data:`~gds_kv_connector.format.layout.EVICTED_DIR` instead, and unlinked by a later run once
    :data:`~gds_kv_connector.format.layout.EVICTED_KEEP_S` has passed (:func:`_expire_evicted`): another
    node's client may still show the name from its caches, its owner may have promised the block from
    that, and its load then finds the block there (BlockPool._open_block) instead of failing the process.
    """
    try:
        st = os.stat(block.path, follow_symlinks=False)
        if not (block.same_reference(st) if ref else block.same_file(st)):
            return False
        if not keep:
            os.unlink(block.path)
            return True
        dest = evicted_path(os.path.dirname(os.path.dirname(block.path)), block.key)
        try:
            os.rename(block.path, dest)
        except FileNotFoundError:
            if os.path.isdir(os.path.dirname(dest)):
                raise  # the block went meanwhile
            mkdir_like_parent(os.path.dirname(dest))
            os.rename(block.path, dest)
    except FileNotFoundError:
        return True  # another evictor (lock fallback race) or an operator got there first
    except OSError as exc:
        log.warning("cannot evict %s: %s", block.path, exc)
        return False
    return True


def _expire_evicted(root: str, now: float) -> int:
    """Unlink the blocks :func:`_remove_if_same` kept in each fingerprint's evicted directory once
    :data:`~gds_kv_connector.format.layout.EVICTED_KEEP_S` old, by their ctime (set by the rename that
    put them there); returns how many.  Only runs on a shared filesystem make such directories."""
    removed = 0
    base = layout_dir(root)
    for fp in fingerprint_dirs(root):
        d = os.path.join(base, fp, EVICTED_DIR)
        for name in _listdir(d):
            path = os.path.join(d, name)
            try:
                if now - os.lstat(path).st_ctime > EVICTED_KEEP_S and _unlink_quiet(path):
                    removed += 1
            except FileNotFoundError:
                pass
    return removed


def _expire_quarantine(root: str, now: float) -> int:
    removed = 0
    qdir = quarantine_dir(root)
    for name in _listdir(qdir):
        path = os.path.join(qdir, name)
        try:
            if now - quarantined_at_ns(path) / 1e9 > QUARANTINE_KEEP_S and _unlink_quiet(path):
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def _tidy_owners(root: str, now: float) -> None:
    """Drop stats files of owners gone for a week, their counters kept in the root's archive of
    retired owners, temporary files of crashed writers, and writer marks a week old that no process
    holds (those of this host go at its next owner's start: :func:`remove_dead_writers_tmp`)."""
    d = owners_dir(root)
    retired: list[str] = []
    for name in _listdir(d):
        stats_file = name.endswith(".stats.json")
        mark = name.endswith(WRITER_SUFFIX)
        keep = OWNER_STATS_KEEP_S if stats_file or mark else OWNER_TMP_KEEP_S if TMP_MARK in name else 0
        if not keep:
            continue
        path = os.path.join(d, name)
        try:
            if now - os.stat(path, follow_symlinks=False).st_mtime > keep:
                if stats_file:
                    retired.append(name)
                elif not (mark and mark_held(path)):
                    _unlink_quiet(path)
        except FileNotFoundError:
            pass
    if retired:  # folded first: a file goes only once its counters are in the archive
        for name in fold_retired_owners(root, retired, now):
            _unlink_quiet(os.path.join(d, name))


def remove_dead_writers_tmp(root: str) -> int:
    """Remove the temporary files of this host's dead writers (:func:`~.atomic_file.dead_writers`)
    from the key directories and the owners directory of ``root`` at once, then their marks;
    returns the files removed.  A file changed after the marks were found unlocked stays: it is a
    process's that took a dead writer's pid since.  The pool is listed only when a writer died."""
    marks = owners_dir(root)
    found_ns = time.time_ns()
    dead = dead_writers(marks)
    if not dead:
        return 0
    removed = sum(_unlink_quiet(path) for path in _tmp_files(root) if _left_by(path, dead, found_ns))
    for paths in dead.values():
        for path in paths:
            _unlink_quiet(path)  # after its files: a start that dies between does the rest
    log.info("pool %s: removed %d temporary file(s) of %d dead writer(s) of this host", root, removed, len(dead))
    return removed


def _tmp_files(root: str) -> list[str]:
    """Temporary files of ``root``: in every key directory of every fingerprint, and in its owners
    directory (:func:`~.atomic_file.atomic_write`'s).  A directory this process cannot read (another
    user's, without the share group) is passed over, not raised: an owner's start must go on."""
    dirs = [owners_dir(root)]
    for fp in fingerprint_dirs(root):
        fp_dir = os.path.join(layout_dir(root), fp)
        dirs += (os.path.join(fp_dir, sub) for sub in _readable_names(fp_dir) if len(sub) == 2)
    return [os.path.join(d, n) for d in dirs for n in _readable_names(d) if TMP_MARK in n]


def _readable_names(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def _left_by(path: str, dead: dict[int, list[str]], found_ns: int) -> bool:
    """Whether the temporary file at ``path`` names one of this host's ``dead`` writers and last
    changed before ``found_ns``."""
    writer = tmp_writer(os.path.basename(path))
    if writer is None or writer[0] != HOST_TAG or writer[1] not in dead:
        return False
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return max(st.st_mtime_ns, st.st_ctime_ns) < found_ns


def _free_bytes(root: str) -> int:
    try:
        st = os.statvfs(root)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def _file_mode(d: str) -> int:
    return os.stat(d).st_mode & 0o666


def _unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
        return False


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []

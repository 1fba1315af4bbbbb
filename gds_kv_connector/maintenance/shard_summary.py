"""Shard summaries: what a key directory holds, kept on disk so that maintenance does not list the pool.

A pool holds millions of block files in 256 key directories ("shards") per fingerprint.  Listing and
lstat'ing all of them on every eviction run, ``gds-kv gc`` or ``gds-kv stats`` costs time and memory
linear in the pool.  Instead each shard has a summary, ``<root>/gdskv-v1/summaries/<fp>/<shard>.sum``
(docs/format.md, "Shard summaries"): its live count and bytes, and its entries sorted oldest first,
so that the evictor reads only the oldest entries of each shard, and stats only the headers.

Rules, and why:

* A summary is current while its shard directory's (inode, mtime_ns) are the ones recorded when it
  was listed: creating or removing a name in a directory changes its mtime.  The directory is
  stat'ed *before* it is listed, so a publication during the listing leaves the summary stale.
* A rebuild lists the directory once (``scandir``; the inode is in the directory entry) and keeps
  the data of every name whose inode the old summary recorded, lstat'ing only new names; it never
  opens a block (a block's mtime is its publication time).  One shard is in memory at a time.
* A missing summary is built in the run that finds it, whatever the budget: until then its shard
  counts nothing, and a pool's usage must be right from its first run (``gds-kv gc`` must not
  decide on an under-counted pool).  Rebuilds of stale ones are budgeted (:data:`LIST_BUDGET`
  names per run, the missing ones' included, oldest-built first); a summary older than
  :data:`MAX_AGE_S` is rebuilt like a stale one.  Until rebuilt, a shard's order of entries lags;
  its usage does not: a sample of the stale shards within :data:`COUNT_BUDGET` names is counted by
  one listing, and the rest are estimated from that sample (:func:`_count_stale`).
* The evictor's own unlinks do not make a summary stale: :class:`OwnChanges` stats the directory
  just before and just after each of them, and the summary records the mtime they left only while
  every "before" matched the last "after" (or the listing), that is, while no other process
  created or removed a name there since it was listed.  A publication during the run breaks that
  chain and leaves the summary stale, so the next run counts it.
* An entry's recency folds in the newest access logged before its summary was built (the run that
  builds it read the logs first), so a run needs only the access records since the oldest summary
  it uses (:meth:`RootSummaries.oldest_built_ns`, :func:`~.recency.access_horizon`).
* Only the holder of the pool's eviction lock writes summaries (whole, by rename; or the header
  alone, in place, after its own unlinks).  A reader that finds a header failing its magic,
  version, CRC or size takes the summary for missing.
* A shard listed is a shard whose writers' stale temporary files are removed (:func:`~.pool.tmp_is_stale`);
  a summary that counted temporary files is rebuilt once they may have become stale.
"""

from __future__ import annotations

import os
import stat
import struct
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields

from gds_kv_connector.format.layout import BLOCK_SUFFIX, TMP_PREFIX
from gds_kv_connector.format.records import is_ref_size
from gds_kv_connector.maintenance.pool_scan import (fingerprint_dirs, is_key_stem, layout_dir, list_dir,
                                                    mkdir_like_parent, open_regular)
from gds_kv_connector.store.pool import TMP_YOUNG_S, tmp_is_stale
from gds_kv_connector.util.atomic_file import TMP_MARK, atomic_write, pwrite_all

SUMMARIES_DIR = "summaries"  # not 16 hex digits: pool walks take it for no fingerprint
SUMMARY_SUFFIX = ".sum"
MAGIC = b"GDKVSUM\x00"
VERSION = 1
#: magic, version, header size, entry size, the shard directory's inode and mtime_ns when listed,
#: built_ns, entries in the file, start (leading entries consumed), live count, live bytes (in
#: 1/FX_ONE bytes), temporary files, their bytes, foreign entries; then a CRC32 of all that
_HEAD = struct.Struct("<8sHHIQqqQQQQQQQ")
_CRC = struct.Struct("<I")
HEADER_SIZE = _HEAD.size + _CRC.size
#: key, recency_ns, size, inode, mtime_ns, share (this name's part of the file's bytes, in 1/FX_ONE)
ENTRY = struct.Struct("<32sqQQqQ")
FX_ONE = 1 << 10  # a reference file's bytes are split over its names: sizes are kept in 1/1024 byte
MAX_ENTRIES = 1 << 26  # per shard: what a header may claim before its file is taken for garbage
READ_ENTRIES = 256  # entries of one summary brought into memory by one read
LIST_BUDGET = 200_000  # names listed by the rebuilds of one run
COUNT_BUDGET = 200_000  # names listed by one run to count stale shards it does not rebuild; the rest are estimated
MAX_AGE_S = 900.0  # a summary older than this is rebuilt even when its directory looks unchanged
TMP_KEEP_S = 3_600.0  # a summary's own temporary file (a writer that died) goes after this
FUTURE_TOLERANCE_NS = 86_400 * 10**9  # a time further ahead than this is a broken clock's: unknown

# entry fields, by position (entries are plain tuples: millions go through a run's merge)
E_KEY, E_RECENCY, E_SIZE, E_INO, E_MTIME, E_SHARE = range(6)
Entry = tuple[bytes, int, int, int, int, int]


def clamp_ns(t: int, now_ns: int) -> int:
    """A time as the evictor takes it: one ahead of ``now_ns`` counts as now, one more than
    :data:`FUTURE_TOLERANCE_NS` ahead as unknown (0), so a wrong clock cannot keep a block fresh."""
    return 0 if t > now_ns + FUTURE_TOLERANCE_NS else min(t, now_ns)


@dataclass
class Header:
    dir_ino: int = 0
    dir_mtime_ns: int = 0
    built_ns: int = 0
    count: int = 0
    start: int = 0
    live_count: int = 0
    live_fx: int = 0
    tmp_files: int = 0
    tmp_bytes: int = 0
    foreign: int = 0

    def pack(self) -> bytes:
        head = _HEAD.pack(MAGIC, VERSION, HEADER_SIZE, ENTRY.size, *(getattr(self, f.name) for f in fields(self)))
        return head + _CRC.pack(zlib.crc32(head))

    @property
    def live_bytes(self) -> int:
        return fx_bytes(self.live_fx)


def fx_bytes(fx: int) -> int:
    """Whole bytes of ``fx`` 1/:data:`FX_ONE` bytes, rounded."""
    return (fx + FX_ONE // 2) // FX_ONE


def parse_header(raw: bytes, file_size: int) -> Header | None:
    """The header at the start of a summary of ``file_size`` bytes, or None (the summary is then
    missing) when its magic, version, sizes or CRC are wrong or the file's size does not match its count."""
    if len(raw) < HEADER_SIZE:
        return None
    head = raw[:_HEAD.size]
    magic, version, header_size, entry_size, *values = _HEAD.unpack(head)
    (crc,) = _CRC.unpack_from(raw, _HEAD.size)
    if (magic, version, header_size, entry_size) != (MAGIC, VERSION, HEADER_SIZE, ENTRY.size) \
            or crc != zlib.crc32(head):
        return None
    h = Header(*values)
    if h.count > MAX_ENTRIES or file_size != HEADER_SIZE + h.count * ENTRY.size or h.start > h.count \
            or h.live_count > h.count - h.start:
        return None
    return h


def read_header(path: str) -> tuple[Header, int] | None:
    """(header, inode) of the summary at ``path``, or None when it is missing or unusable."""
    try:
        fd, st = open_regular(path)
    except OSError:
        return None
    try:
        h = parse_header(os.pread(fd, HEADER_SIZE, 0), st.st_size)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None if h is None else (h, st.st_ino)


def encode(header: Header, entries: Sequence[Entry]) -> bytes:
    """A whole summary: ``header`` (its count set from ``entries``), then the entries."""
    header.count = len(entries)
    return header.pack() + b"".join(ENTRY.pack(*e) for e in entries)


@dataclass
class Shard:
    """One key directory and its summary, as one run sees them."""

    root: int  # index of the pool root
    fp: str
    sub: str
    dir: str
    path: str  # the summary file
    dir_id: tuple[int, int] | None = None  # (inode, mtime_ns) of the directory now; None: gone or unreadable
    header: Header | None = None
    ino: int = 0  # the summary file's inode, when read from a file
    data: bytes | None = None  # a summary rebuilt but not written (a dry run): read from here
    fresh: bool = False  # rebuilt by this run
    # a stale shard this run did not rebuild: its block names counted by a listing or estimated from
    # shards that were (_count_stale), and their bytes (in 1/FX_ONE) at its summary's mean size, so that
    # usage does not lag behind what writers added
    counted: tuple[int, int] | None = None

    @property
    def live_count(self) -> int:
        if self.counted is not None:
            return self.counted[0]
        return self.header.live_count if self.header is not None else 0

    @property
    def live_fx(self) -> int:
        if self.counted is not None:
            return self.counted[1]
        return self.header.live_fx if self.header is not None else 0

    @property
    def current(self) -> bool:
        h = self.header
        return h is not None and self.dir_id == (h.dir_ino, h.dir_mtime_ns)

    def entries(self, first: int, n: int) -> list[Entry]:
        """Entries ``[first, first + n)``, fewer at the end or if the file was replaced since."""
        h = self.header
        if h is None or first >= h.count:
            return []
        n = min(n, h.count - first)
        off = HEADER_SIZE + first * ENTRY.size
        if self.data is not None:
            raw = self.data[off:off + n * ENTRY.size]
        else:
            try:
                fd, st = open_regular(self.path)
            except OSError:
                return []
            try:
                if st.st_ino != self.ino:
                    return []
                raw = os.pread(fd, n * ENTRY.size, off)
            finally:
                os.close(fd)
        return list(ENTRY.iter_unpack(raw[:len(raw) - len(raw) % ENTRY.size]))

    def cursor(self) -> Iterator[tuple[int, Entry]]:
        """(index, entry) from ``start`` on, :data:`READ_ENTRIES` at a time."""
        i = self.header.start if self.header is not None else 0
        while True:
            chunk = self.entries(i, READ_ENTRIES)
            if not chunk:
                return
            for e in chunk:
                yield i, e
                i += 1

    def update(self, dead: set[int], removed: int, removed_fx: int, dir_id: tuple[int, int] | None) -> None:
        """After this run unlinked ``removed`` names (``removed_fx`` bytes) of the shard: move ``start``
        past the leading entries in ``dead`` (removed, or found gone), take them off the live totals,
        and record ``dir_id``, the directory as the run's own unlinks left it (:meth:`OwnChanges.left`;
        None: changed by another process too, so the summary stays stale).  The header is rewritten
        in place; a failure leaves it stale."""
        h = self.header
        if h is None or self.data is not None:
            return
        while h.start < h.count and h.start in dead:
            h.start += 1
        h.live_count = max(0, h.live_count - removed)
        h.live_fx = max(0, h.live_fx - removed_fx)
        if self.counted is not None:
            self.counted = (max(0, self.counted[0] - removed), max(0, self.counted[1] - removed_fx))
        if dir_id is not None:
            self.dir_id = dir_id
            h.dir_ino, h.dir_mtime_ns = dir_id
        try:
            fd, st = open_regular(self.path, os.O_WRONLY)
        except OSError:
            return
        try:
            if st.st_ino == self.ino:
                pwrite_all(fd, h.pack(), 0)
        except OSError:
            pass
        finally:
            os.close(fd)


class OwnChanges:
    """Which shard directories only this run has changed since they were listed.

    A directory starts known when its summary is current (its (inode, mtime) as listed).  Around
    each unlink the caller calls :meth:`before` and :meth:`after`: a "before" that differs from
    what the last "after" (or the listing) saw means another process changed the directory, and
    it is known no more.  Two stats per unlink: the run's cost stays that of the blocks it frees.
    A publication inside the unlink itself, between its two stats, is not seen (the mtime shows
    only the latest change); :data:`MAX_AGE_S` bounds how long it goes uncounted.
    """

    def __init__(self, shards: Sequence[Shard]) -> None:
        self._ids: dict[str, tuple[int, int] | None] = {s.dir: s.dir_id if s.current else None for s in shards}

    def before(self, d: str) -> None:
        if self._ids.get(d) is not None and _dir_id(d) != self._ids[d]:
            self._ids[d] = None

    def after(self, d: str) -> None:
        if self._ids.get(d) is not None:
            self._ids[d] = _dir_id(d)

    def left(self, d: str) -> tuple[int, int] | None:
        """The directory as this run's unlinks left it, or None if another process changed it too."""
        return self._ids.get(d)


@dataclass
class Refresh:
    """What one run's rebuilds did in one root."""

    listed: int = 0  # names listed
    rebuilt: int = 0  # shards
    lstats: int = 0  # names lstat'ed (new since the old summary)
    tmp_removed: int = 0
    counted: int = 0  # names listed to count the stale shards not rebuilt (Shard.counted)
    estimated: int = 0  # stale shards not rebuilt whose count is estimated from those counted
    unreadable: int = 0  # directories or entries that could not be read
    stale: int = 0  # shards left stale or missing after the run


@dataclass
class RootSummaries:
    """Every shard of one pool root with its summary header (no entries read)."""

    root: str
    index: int
    shards: list[Shard] = field(default_factory=list)
    unreadable: int = 0  # fingerprint directories that could not be listed

    @classmethod
    def load(cls, root: str, index: int) -> "RootSummaries":
        out = cls(root, index)
        base = layout_dir(root)
        for fp in fingerprint_dirs(root):
            fp_dir = os.path.join(base, fp)
            try:
                subs = sorted(n for n in os.listdir(fp_dir) if len(n) == 2 and is_key_stem(n))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError:
                out.unreadable += 1
                continue
            sum_dir = summary_dir(root, fp)
            for sub in subs:
                shard = Shard(index, fp, sub, os.path.join(fp_dir, sub), os.path.join(sum_dir, sub + SUMMARY_SUFFIX))
                shard.dir_id = _dir_id(shard.dir)
                found = read_header(shard.path)
                if found is not None:
                    shard.header, shard.ino = found
                out.shards.append(shard)
        return out

    @property
    def live_count(self) -> int:
        return sum(s.live_count for s in self.shards)

    @property
    def live_fx(self) -> int:
        return sum(s.live_fx for s in self.shards)

    def oldest_built_ns(self) -> int:
        """built_ns of the oldest summary of a shard whose directory is there; 0 when such a shard
        has none (its first build needs every access ever logged)."""
        built = [s.header.built_ns if s.header is not None else 0 for s in self.shards if s.dir_id is not None]
        return min(built, default=time.time_ns())

    def live_fx_by_fp(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.shards:
            if s.header is not None:
                out[s.fp] = out.get(s.fp, 0) + s.live_fx
        return out

    def remove_orphans(self, now: float) -> None:
        """Remove summaries whose shard directory is gone, and summary temporary files a dead
        writer left (older than :data:`TMP_KEEP_S`), in the fingerprints of this root."""
        known = {s.path for s in self.shards}
        for fp in {s.fp for s in self.shards}:
            d = summary_dir(self.root, fp)
            for name in list_dir(d):
                path = os.path.join(d, name)
                stale_tmp = TMP_MARK in name and _older_than(path, now, TMP_KEEP_S)
                if stale_tmp or (name.endswith(SUMMARY_SUFFIX) and path not in known):
                    _unlink_quiet(path)


def summary_dir(root: str, fp: str) -> str:
    return os.path.join(layout_dir(root), SUMMARIES_DIR, fp)


def needs_rebuild(shard: Shard, now_ns: int) -> bool:
    """Missing, stale, older than :data:`MAX_AGE_S`, or recording temporary files that may have
    become stale since (:data:`~.pool.TMP_YOUNG_S`), while its directory is there."""
    h = shard.header
    if shard.dir_id is None:
        return False
    if not shard.current:
        return True
    age_ns = now_ns - h.built_ns
    return age_ns > MAX_AGE_S * 1e9 or (h.tmp_files > 0 and age_ns > TMP_YOUNG_S * 1e9)


def refresh(roots: Sequence[RootSummaries], access: Sequence[dict[bytes, int]], now: float, *,
            write: bool, budget: int | None = LIST_BUDGET,
            count_budget: int | None = COUNT_BUDGET) -> dict[int, Refresh]:
    """Build every missing summary of ``roots``, then rebuild those stale or too old, oldest-built
    first, while fewer than ``budget`` names have been listed (at least one shard; None: all of
    them); then count the stale ones left within ``count_budget`` names (:func:`_count_stale`).
    ``access[i]`` is root i's newest logged access per key, folded into the recency of the entries.
    With ``write`` off (a dry run) summaries are rebuilt in memory only and no file is removed.
    Returns what was done, by root index."""
    now_ns = int(now * 1e9)
    out = {r.index: Refresh() for r in roots}
    todo = [s for r in roots for s in r.shards if needs_rebuild(s, now_ns)]
    todo.sort(key=lambda s: s.header.built_ns if s.header is not None else -1)
    listed = 0
    for shard in todo:
        if budget is not None and listed >= budget and shard.header is not None:
            break  # missing ones come first (built_ns -1), and are all built
        r = out[shard.root]
        n = rebuild(shard, access[shard.root], now, write, r)
        listed += n
        r.listed += n
    for r in roots:
        out[r.index].counted, out[r.index].estimated = _count_stale(r.shards, count_budget)
    for r in roots:
        if write:
            r.remove_orphans(now)
        out[r.index].unreadable += r.unreadable
        out[r.index].stale = sum(not s.current for s in r.shards)
    return out


def _mean_fx(shards: Sequence[Shard]) -> int:
    """Bytes (in 1/FX_ONE) per live name over the summaries of one root: a counted shard's estimate
    where its own summary holds none."""
    count = sum(s.header.live_count for s in shards if s.header is not None)
    return sum(s.header.live_fx for s in shards if s.header is not None) // count if count else 0


def _count_stale(shards: Sequence[Shard], budget: int | None) -> tuple[int, int]:
    """Set ``counted`` on every stale shard of one root that is not rebuilt: list about ``budget``
    names' worth of them (None: all) and estimate the others.  Returns (names listed, shards estimated).

    Keys are hashes, so the writers of a fingerprint spread their blocks evenly over its 256
    shards: shards whose summaries were built at about the same time have gained about the same
    number of names since.  So, per fingerprint, the stale shards are sorted by when their summary
    was built, an evenly spaced sample of them is listed (at least one), and each other shard is
    taken to have gained what the sampled shard nearest to it in that order gained.  The cost is
    the budget, not the pool; the error is the spread of one shard's gain, a few percent of it.
    """
    stale = [s for s in shards if s.header is not None and s.dir_id is not None and not s.current]
    if not stale:
        return 0, 0
    mean = _mean_fx(shards)
    names = sum(s.header.live_count for s in stale) or 1
    groups: dict[str, list[Shard]] = {}
    for s in stale:
        groups.setdefault(s.fp, []).append(s)
    listed = estimated = 0
    for group in groups.values():
        group.sort(key=lambda s: s.header.built_ns)
        n = len(group)
        k = n if budget is None else max(1, min(n, budget * n // names))
        picks = sorted({(2 * i + 1) * n // (2 * k) for i in range(k)})
        gains = []
        for i in picks:
            listed += _count(group[i], mean)
            counted = group[i].counted
            gains.append((i, counted[0] - group[i].header.live_count if counted is not None else 0))
        for i, shard in enumerate(group):
            if shard.counted is None:
                gain = min(gains, key=lambda g: abs(g[0] - i))[1]
                count = max(0, shard.header.live_count + gain)
                shard.counted = (count, count * _per_name_fx(shard.header, mean))
                estimated += 1
    return listed, estimated


def _per_name_fx(h: Header, mean_fx: int) -> int:
    return h.live_fx // h.live_count if h.live_count else mean_fx


def _count(shard: Shard, mean_fx: int) -> int:
    """Count the block names of a stale shard that is not rebuilt (``Shard.counted``): one listing of
    names, nothing lstat'ed, its bytes estimated at its summary's mean size (the root's when it has
    none), which is what every block file of a fingerprint has.  Returns the names listed."""
    try:
        names = os.listdir(shard.dir)
    except OSError:
        return 0
    n = sum(map(_is_block_name, names))
    shard.counted = (n, n * _per_name_fx(shard.header, mean_fx))
    return len(names)


def _is_block_name(name: str) -> bool:
    return name.endswith(BLOCK_SUFFIX) and not name.startswith(TMP_PREFIX)


def rebuild(shard: Shard, access: dict[bytes, int], now: float, write: bool, tally: Refresh) -> int:
    """List ``shard``'s directory and replace its summary; returns the names listed.

    A name the old summary recorded at the same inode keeps its entry (its recency raised by a
    newer access in ``access``); others are lstat'ed.  Temporary files of writers are counted, and
    removed when stale if ``write``.  A directory that cannot be listed keeps its old summary."""
    now_ns = int(now * 1e9)
    old: dict[str, Entry] = {}
    if shard.header is not None:
        old = {e[E_KEY].hex(): e for _, e in shard.cursor()}
    dir_id = _dir_id(shard.dir)  # before listing: a name added meanwhile leaves it stale
    if dir_id is None:
        return 0
    h = Header(dir_ino=dir_id[0], dir_mtime_ns=dir_id[1], built_ns=now_ns)
    entries: list[Entry] = []
    listed = 0
    get = access.get
    try:
        with os.scandir(shard.dir) as it:
            for d in it:
                listed += 1
                name = d.name
                if name.startswith(TMP_PREFIX):
                    _tmp(d, h, now, write, tally)
                    continue
                stem = name[:-len(BLOCK_SUFFIX)]
                if not name.endswith(BLOCK_SUFFIX) or len(stem) != 64 or stem[:2] != shard.sub \
                        or not is_key_stem(stem):
                    h.foreign += 1
                    continue
                e = old.get(stem)
                if e is not None and e[E_INO] == d.inode():
                    t = clamp_ns(get(e[E_KEY], 0), now_ns)
                    if t > e[E_RECENCY]:
                        e = (e[E_KEY], t, *e[2:])
                else:
                    try:
                        st = d.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    except OSError:
                        tally.unreadable += 1
                        continue
                    tally.lstats += 1
                    if not stat.S_ISREG(st.st_mode):
                        h.foreign += 1
                        continue
                    k = bytes.fromhex(stem)
                    share = st.st_size * FX_ONE
                    if is_ref_size(st.st_size) and st.st_nlink > 1:
                        share //= st.st_nlink  # a reference file, linked under every key of its batch
                    e = (k, max(clamp_ns(st.st_mtime_ns, now_ns), clamp_ns(get(k, 0), now_ns)), st.st_size,
                         st.st_ino, st.st_mtime_ns, share)
                entries.append(e)
                h.live_fx += e[E_SHARE]
    except (FileNotFoundError, NotADirectoryError):
        shard.dir_id = None
        return listed
    except OSError:
        tally.unreadable += 1
        return listed
    del old
    entries.sort(key=_order)
    h.live_count = len(entries)
    data = encode(h, entries)
    del entries
    shard.header, shard.dir_id, shard.fresh = h, dir_id, True
    tally.rebuilt += 1
    if not write:
        shard.data = data
        return listed
    d = os.path.dirname(shard.path)
    try:
        mkdir_like_parent(os.path.dirname(d))
        mkdir_like_parent(d)
        atomic_write(shard.path, data, os.stat(d).st_mode & 0o666)
        shard.ino = os.stat(shard.path).st_ino
    except OSError:
        shard.data = data  # usable by this run; rebuilt by the next one
    return listed


def _order(e: Entry) -> tuple[int, bytes]:
    return e[E_RECENCY], e[E_KEY]


def _tmp(d: os.DirEntry, h: Header, now: float, write: bool, tally: Refresh) -> None:
    try:
        size = d.stat(follow_symlinks=False).st_size
    except OSError:
        return
    if write and tmp_is_stale(d.name, d.path, now) and _unlink_quiet(d.path):
        tally.tmp_removed += 1
        return
    h.tmp_files += 1
    h.tmp_bytes += size


def _dir_id(d: str) -> tuple[int, int] | None:
    try:
        st = os.stat(d, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns) if stat.S_ISDIR(st.st_mode) else None


def _older_than(path: str, now: float, age_s: float) -> bool:
    try:
        return now - os.stat(path, follow_symlinks=False).st_mtime > age_s
    except OSError:
        return False


def _unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


@dataclass
class Usage:
    """What the summaries of one root say, for ``gds-kv stats``."""

    blocks_by_fp: dict[str, int] = field(default_factory=dict)
    bytes_by_fp: dict[str, int] = field(default_factory=dict)
    tmp_files: int = 0
    tmp_bytes: int = 0
    foreign: int = 0
    unreadable: int = 0
    shards: int = 0
    stale: int = 0  # summaries whose directory changed since they were built: counts lag
    listed: int = 0  # shards without a summary, listed by this call (nothing is written)
    oldest_built_ns: int | None = None  # of the summaries read


def usage(root: str, now: float) -> Usage:
    """Blocks, bytes and leftovers of ``root`` from its summaries' headers: one stat and one read
    per shard.  A shard without a usable summary (an evictor never ran, or not since it appeared)
    is listed now, in memory, one at a time; a stale one is counted as its summary says."""
    out = Usage()
    sums = RootSummaries.load(root, 0)
    out.unreadable = sums.unreadable
    tally = Refresh()
    for shard in sums.shards:
        out.shards += 1
        if shard.header is None:
            if shard.dir_id is None:
                continue
            rebuild(shard, {}, now, False, tally)
            if shard.header is None:
                continue
            out.listed += 1
            shard.data = None  # only its header is needed: one shard's entries in memory at a time
        else:
            out.stale += not shard.current
            built = shard.header.built_ns
            out.oldest_built_ns = built if out.oldest_built_ns is None else min(out.oldest_built_ns, built)
        h = shard.header
        out.blocks_by_fp[shard.fp] = out.blocks_by_fp.get(shard.fp, 0) + h.live_count
        out.bytes_by_fp[shard.fp] = out.bytes_by_fp.get(shard.fp, 0) + h.live_fx
        out.tmp_files += h.tmp_files
        out.tmp_bytes += h.tmp_bytes
        out.foreign += h.foreign
    out.bytes_by_fp = {fp: fx_bytes(fx) for fp, fx in out.bytes_by_fp.items()}
    out.unreadable += tally.unreadable
    return out

"""What ``gds-kv verify`` does: re-check every block's header and payload checksum, and move to
quarantine what fails, by shard directory, resumable, in parts across processes.

The walk takes one shard directory ``<root>/gdskv-v1/<fp16>/<kk>/`` at a time (memory is bounded by
one directory, not the pool), ``kk`` by ``kk`` and in each ``kk`` every root and fingerprint, and
verifies a directory's names in sorted order with ``workers`` threads.  ``--shard I/N`` walks only
the directories :class:`~.verify_state.Shard` gives process ``I``.  With a state file the run records
every few seconds, and when stopped, which directories are done, the name reached in the current one
and the totals (:mod:`.verify_state`); a run started again with it skips what is done and reports
totals that include it.  A stop (SIGINT, SIGTERM: the ``stop`` event) finishes the names already
handed to the threads, saves, and raises :class:`VerifyInterrupted`.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gds_kv_connector.config.settings import import_time_value
from gds_kv_connector.format.checksum import checksum_bytes
from gds_kv_connector.format.records import (HEADER_SIZE, MAX_PAYLOAD, REF_MAGIC, FormatError, file_size_for,
                                             is_ref_size, parse_header)
from gds_kv_connector.maintenance.operations import (EXIT_OK, EXIT_PROBLEMS, UsageError, format_over_roots,
                                                     over_roots, require_pool, pool_roots)
from gds_kv_connector.maintenance.pool_scan import (BlockFile, NotRegularFile, PoolScan, classify_entry, fp_names,
                                                    list_counted, layout_dir, open_regular, parse_ref_file,
                                                    quarantine_destination, read_geometry)
from gds_kv_connector.maintenance.verify_progress import VerifyProgress
from gds_kv_connector.maintenance.verify_state import (MAX_LISTED_BAD, SHARD_DIRS, WHOLE_POOL, Shard, StateError,
                                                       VerifyState, load_state, remove_state, save_state)
from gds_kv_connector.store.pool import PoolTrust, file_kind

SAVE_EVERY_S = 2.0  # a stop without warning (SIGKILL, a lost node) redoes at most this much work
_ALL_KK = [f"{i:02x}" for i in range(SHARD_DIRS)]

Outcome = tuple[str, str, int, str | None]  # kind, detail, bytes read, where it was moved (None: not)


class VerifyInterrupted(Exception):
    """A run stopped by its ``stop`` event, its state saved (where it has one)."""

    def __init__(self, state_path: str | None, shards_done: int, shards_total: int) -> None:
        super().__init__("verify interrupted")
        self.state_path, self.shards_done, self.shards_total = state_path, shards_done, shards_total


def verify(root: str | Sequence[str], workers: int = 8, progress: bool = True, quarantine: bool = True,
           share_group: bool | None = None, *, shard: Shard = WHOLE_POOL, state_path: str | None = None,
           restart: bool = False, state_optional: bool = False, progress_every_s: float | None = None,
           stop: threading.Event | None = None) -> dict[str, Any]:
    """Re-check every block's header and payload checksum in every root; move to quarantine the bad
    ones, the files of writers the pool does not trust (``untrusted``, :class:`~.pool.PoolTrust`;
    ``share_group``: TLLM_GDS_KV_SHARE_GROUP where not given) and whatever else sits at a block name
    (``junk``: a directory, FIFO or symbolic link).

    ``shard``: only this process's shard directories.  ``state_path``: resume from and record into
    this state file (``restart``: ignore what it holds); it is removed when the run ends.  Where it
    cannot be written, the run stops before any work, or with ``state_optional`` (a default place)
    goes on without one, saying so.
    ``progress``: on stderr, a bar redrawn in place, or with ``progress_every_s`` one line that
    often.  ``stop``: once set, save and raise :class:`VerifyInterrupted`.
    """
    roots = pool_roots(root)
    for r in roots:
        require_pool(r)
    if workers < 1:
        raise UsageError(f"workers must be >= 1, got {workers}")
    share = import_time_value("share_group") if share_group is None else share_group
    abs_roots = [os.path.abspath(r) for r in roots]
    state = None
    if state_path is not None and not restart:
        try:
            state = load_state(state_path, abs_roots, shard, quarantine)
        except StateError as exc:
            raise UsageError(str(exc)) from None
    resumed = state is not None
    state = state or VerifyState(abs_roots, shard, quarantine)
    if resumed:
        _say(f"verify: resuming from {state_path} (started {time.ctime(state.started_ns / 1e9)}): "
             f"{state.shards_done} shard directories done; --restart starts over")
    report = None if not progress else VerifyProgress(sys.stderr, bar=progress_every_s is None,
                                                       every_s=progress_every_s or 0.0)
    if state_path is not None:
        try:
            save_state(state_path, state)  # an unwritable state fails here, before any work
        except OSError as exc:
            if not state_optional:
                raise
            _say(f"verify: cannot write the state {state_path} ({exc.strerror or exc}): this run cannot be "
                 "resumed; --state FILE names another place")
            state_path = None
    unlisted = _Walk(roots, state, state_path, workers, quarantine, share, report, stop or threading.Event()).run()
    if state_path is not None:
        remove_state(state_path)
    results = [{"root": r, **t, "duration_s": round(t["duration_s"], 3),
                "unreadable_entries": t["unreadable_entries"] + u}
               for r, t, u in zip(abs_roots, state.totals, unlisted)]
    for res in results:  # unreadable: its blocks were not checked, not a clean bill
        res["exit_code"] = EXIT_PROBLEMS if res["bad"] or res["unreadable_entries"] else EXIT_OK
    reasons: Counter[str] = Counter()
    for r in results:
        reasons.update(r["reasons"])
    totals = {k: sum(r[k] for r in results) for k in ("checked", "ok", "bad", "vanished", "quarantined",
                                                      "unreadable_entries")}
    totals |= {"reasons": dict(reasons),
               "bad_files": [f for r in results for f in r["bad_files"]][:MAX_LISTED_BAD],
               "bytes_read": sum(r["bytes_read"] for r in results),
               "duration_s": round(sum(r["duration_s"] for r in results), 3),
               "shard": str(shard), "resumed": resumed, "state": state_path}
    return over_roots(results, totals)


class _Walk:
    """One run over this process's shard directories, recording into ``state``."""

    def __init__(self, roots: list[str], state: VerifyState, state_path: str | None, workers: int,
                 quarantine: bool, share_group: bool, report: VerifyProgress | None, stop: threading.Event) -> None:
        self.roots, self.state, self.state_path = roots, state, state_path
        self.workers, self.quarantine, self.report, self.stop = workers, quarantine, report, stop
        self.trust = [PoolTrust.of_roots((r,), share_group) for r in roots]
        self.payload_lens: dict[tuple[int, str], int | None] = {}
        self.saved = time.monotonic()
        # names done before this run, and per directory listed in it (for the estimate of the total)
        self.done_names = sum(t["checked"] + t["vanished"] for t in state.totals)
        self.shards_before, self.names_before = state.shards_done, state.entries_done
        self.listed_shards = self.listed_names = 0
        self.plan: list[tuple[int, str, str]] = []

    def run(self) -> list[int]:
        """Walk the plan; returns per root the directories that could not be listed to plan it."""
        self.plan, unlisted = self._plan()
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="gdskv-verify") as ex:
            for i, fp, kk in self.plan:
                self._shard(ex, i, fp, kk)
        if self.report is not None:
            self.report.update(self.done_names, self.done_names, False, final=True)
        return unlisted

    def _plan(self) -> tuple[list[tuple[int, str, str]], list[int]]:
        """This process's shard directories not done yet, ``kk`` by ``kk``, and per root the
        directories that could not be listed (counted in this run's result, not in the state: a later
        run lists them again)."""
        st = self.state
        present: dict[str, list[tuple[int, str]]] = {kk: [] for kk in _ALL_KK if st.shard.owns(kk)}
        unlisted = []
        for i, root in enumerate(self.roots):
            listing = PoolScan()
            for fp in fp_names(list_counted(layout_dir(root), listing)):
                for kk in list_counted(os.path.join(layout_dir(root), fp), listing):
                    if kk in present and not st.is_done(i, fp, kk):
                        present[kk].append((i, fp))
            unlisted.append(listing.unreadable)
        plan = [(i, fp, kk) for kk, where in present.items() for i, fp in sorted(where)]
        if st.current is not None:  # the directory a stopped run was in goes first
            cur = st.current[:3]
            plan.sort(key=lambda p: p != cur)
        return plan, unlisted

    def _shard(self, ex: ThreadPoolExecutor, i: int, fp: str, kk: str) -> None:
        root, st, t0 = self.roots[i], self.state, time.monotonic()
        totals = st.totals[i]
        listing = PoolScan()
        try:
            with os.scandir(os.path.join(layout_dir(root), fp, kk)) as it:
                for entry in it:
                    classify_entry(listing, fp, kk, entry)
        except (FileNotFoundError, NotADirectoryError):
            pass  # removed meanwhile, or not a directory
        except OSError:  # unreadable, or a read error part way: what was listed is verified
            listing.unreadable += 1
        names = sorted([(b, True) for b in listing.junk] + [(b, False) for b in listing.blocks],
                       key=lambda e: e[0].key)
        listed = len(names)
        self.listed_shards += 1
        self.listed_names += listed
        after = st.current[3] if st.current is not None and st.current[:3] == (i, fp, kk) else None
        if after is None:
            totals["unreadable_entries"] += listing.unreadable
        else:  # resumed inside this directory: the names up to ``after`` are counted already
            names = [e for e in names if e[0].key.hex() > after]
        if (i, fp) not in self.payload_lens:
            self.payload_lens[i, fp] = _geometry_payload_len(root, fp)
        payload_len, trust, quarantine = self.payload_lens[i, fp], self.trust[i], self.quarantine

        def check(entry: tuple[BlockFile, bool]) -> Outcome:
            block, junk = entry
            if junk:
                return _verify_junk(root, block, quarantine)
            return _verify_one(root, block, quarantine, trust, payload_len)

        window = self.workers * 64  # never millions of futures at once
        for start in range(0, len(names), window):
            chunk = names[start:start + window]
            for (block, _), outcome in zip(chunk, ex.map(check, chunk)):
                _count(totals, block, outcome)
            self.done_names += len(chunk)
            st.current = (i, fp, kk, chunk[-1][0].key.hex())
            now = time.monotonic()
            totals["duration_s"] += now - t0
            t0 = now
            self._tick()
        st.mark_done(i, fp, kk, listed)
        totals["duration_s"] += time.monotonic() - t0
        self._tick()

    def _tick(self) -> None:
        """Progress, a save every few seconds, and a stop once asked for."""
        if self.report is not None:
            self.report.update(self.done_names, *self._total())
        stopping = self.stop.is_set()
        if self.state_path is not None and (stopping or time.monotonic() - self.saved >= SAVE_EVERY_S):
            save_state(self.state_path, self.state)
            self.saved = time.monotonic()
        if stopping:
            raise VerifyInterrupted(self.state_path, self.state.shards_done, self.shards_before + len(self.plan))

    def _total(self) -> tuple[int, bool]:
        """Names in this process's part of the pool, and whether that is an estimate: exact once
        every directory is listed, else the names per directory listed so far times the
        directories (:mod:`.verify_progress`)."""
        listed = self.shards_before + self.listed_shards
        names = self.names_before + self.listed_names
        shards = self.shards_before + len(self.plan)
        if listed >= shards:
            return names, False
        return round(names / max(listed, 1) * shards), True


def _count(totals: dict[str, Any], block: BlockFile, outcome: Outcome) -> None:
    """Add one name's outcome to a root's running totals."""
    kind, detail, size, moved = outcome
    totals["bytes_read"] += size
    if kind == "vanished":
        totals["vanished"] += 1
        return
    totals["checked"] += 1
    if kind == "ok":
        totals["ok"] += 1
        return
    totals["bad"] += 1
    totals["reasons"][kind] = totals["reasons"].get(kind, 0) + 1
    totals["quarantined"] += moved is not None
    if len(totals["bad_files"]) < MAX_LISTED_BAD:
        totals["bad_files"].append({"path": block.path, "reason": kind, "detail": detail, "quarantined_to": moved})


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def format_verify(result: dict[str, Any]) -> str:
    total = (f"{result['checked']} blocks checked, {result['ok']} ok, {result['bad']} bad "
             f"({result['quarantined']} quarantined)")
    lines = format_over_roots(result, _verify_lines, total)
    if result.get("shard", "0/1") != "0/1":
        lines.append(f"shard {result['shard']}: only the shard directories of this process; the other "
                     "processes' results complete the pool")
    if result.get("resumed"):
        lines.append(f"resumed from {result['state']}: the totals include the runs before")
    return "\n".join(lines)
def _verify_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"pool {result['root']}: {result['checked']} blocks checked, {result['ok']} ok, {result['bad']} bad "
             f"({result['quarantined']} quarantined) in {result['duration_s']:.1f} s"]
    for reason, n in sorted(result["reasons"].items()):
        lines.append(f"  {reason}: {n}")
    for f in result["bad_files"]:
        lines.append(f"  {f['path']}: {f['reason']}: {f['detail']}")
    if result["bad"] > len(result["bad_files"]):
        lines.append(f"  ... and {result['bad'] - len(result['bad_files'])} more")
    if result["unreadable_entries"]:
        lines.append(f"  {result['unreadable_entries']} directories or entries could not be read: their blocks "
                     "were not checked")
    return lines


def _geometry_payload_len(root: str, fp: str) -> int | None:
    """The payload size the owners of fingerprint ``fp`` recorded (fingerprint.json): every block of
    it has that size (the fingerprint covers it), so no header claiming another is read further;
    None when the file is absent or garbage (a block's own size is then the only bound)."""
    value = (read_geometry(root, fp) or {}).get("payload_len")
    return value if type(value) is int and 0 < value <= MAX_PAYLOAD else None


def _verify_junk(root: str, entry: BlockFile, quarantine: bool) -> Outcome:
    """An entry at a block name that is not a regular file: it never loads and keeps its key from
    being saved, so it is moved to quarantine whole (renamed: a link is not followed, a FIFO not
    opened, a directory not emptied)."""
    try:
        kind = file_kind(os.lstat(entry.path).st_mode)
    except FileNotFoundError:
        return "vanished", "", 0, None
    return "junk", f"a {kind} at a block name", 0, _quarantine(root, entry, entry.ino, "junk", quarantine)


def _verify_one(root: str, block: BlockFile, quarantine: bool, trust: PoolTrust,
                payload_len: int | None) -> Outcome:
    """(kind, detail, bytes read, quarantine path); kind is ok, vanished, untrusted, header, checksum
    or io.  A file a writer outside ``trust`` made or could change is not read at all; a header is
    read further only if its payload fits the file and the geometry (``payload_len``), so no
    allocation exceeds either."""
    try:
        fd, st = open_regular(block.path)
    except FileNotFoundError:
        return "vanished", "", 0, None  # evicted while we walked
    except OSError as exc:
        return "io", f"open failed: {exc.strerror}", 0, None
    try:
        untrusted = trust.why_not(st)
        if untrusted is not None:
            return "untrusted", untrusted, 0, _quarantine(root, block, st.st_ino, "untrusted", quarantine)
        raw = os.pread(fd, HEADER_SIZE, 0)
        if raw[:len(REF_MAGIC)] == REF_MAGIC and is_ref_size(st.st_size):
            return _verify_ref(root, block, fd, st, quarantine, payload_len)
        try:
            header = parse_header(raw, key=block.key, file_size=st.st_size, payload_len=payload_len)
            if header.fingerprint.hex()[:len(block.fp)] != block.fp:
                raise FormatError("fingerprint differs from its directory")
        except FormatError as exc:
            return "header", str(exc), len(raw), _quarantine(root, block, st.st_ino, "bad header", quarantine)
        payload = _pread_exact(fd, header.payload_len, HEADER_SIZE)
        got = checksum_bytes(payload)
        if got != header.checksum:
            return ("checksum", f"header {header.checksum:#018x}, data {got:#018x}", len(raw) + len(payload),
                    _quarantine(root, block, st.st_ino, "checksum mismatch", quarantine))
        return "ok", "", len(raw) + len(payload), None
    except OSError as exc:
        return "io", f"read failed: {exc.strerror or exc}", 0, None
    finally:
        os.close(fd)


def _verify_ref(root: str, block: BlockFile, fd: int, st: os.stat_result, quarantine: bool,
                payload_len: int | None) -> Outcome:
    """An arena reference: check it, then the slab slot it names, like a block file (the checks
    eviction reads a reference's recency through: :class:`~.pool_scan.RefFile`); a slot size other
    than the geometry's (``payload_len``) is a bad reference, so a slot read is bounded by it."""
    raw = _pread_exact(fd, st.st_size, 0)
    try:
        ref_file = parse_ref_file(block, raw)
        ref_file.entry(block.key)
        if payload_len is not None and ref_file.slot_bytes != file_size_for(payload_len):
            raise FormatError(f"slot size {ref_file.slot_bytes} differs from the geometry's "
                              f"{file_size_for(payload_len)}")
    except FormatError as exc:
        return "header", f"reference: {exc}", len(raw), _quarantine(root, block, st.st_ino, "bad reference", quarantine)
    try:
        sfd, sst = open_regular(ref_file.slab_path(block))
    except (FileNotFoundError, NotRegularFile) as exc:  # a FIFO there no longer hangs verify for ever
        what = "missing" if isinstance(exc, FileNotFoundError) else "not a regular file"
        return "header", f"slab {ref_file.slab} is {what}", len(raw), _quarantine(
            root, block, st.st_ino, "missing slab", quarantine)
    try:
        try:
            ref, header = ref_file.slot_header(sfd, sst.st_size, block.key)
        except FormatError as exc:
            ref = ref_file.entries[block.key]
            return "header", f"slot {ref.slab}#{ref.slot}: {exc}", len(raw) + HEADER_SIZE, _quarantine(
                root, block, st.st_ino, "bad slot", quarantine)
        off = ref.slot * ref_file.slot_bytes
        payload = _pread_exact(sfd, header.payload_len, off + HEADER_SIZE)
        got = checksum_bytes(payload)
        read = len(raw) + HEADER_SIZE + len(payload)
        if got != header.checksum:
            return ("checksum", f"slot {ref.slab}#{ref.slot}: header {header.checksum:#018x}, data {got:#018x}",
                    read, _quarantine(root, block, st.st_ino, "checksum mismatch", quarantine))
        return "ok", "", read, None
    finally:
        os.close(sfd)


def _quarantine(root: str, block: BlockFile, ino: int, reason: str, enabled: bool) -> str | None:
    """Move the file we checked (same inode) out of the lookup path; None if not moved."""
    if not enabled:
        return None
    try:
        if os.stat(block.path, follow_symlinks=False).st_ino != ino:
            return None
        dest = quarantine_destination(root, block.key.hex(), reason)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.rename(block.path, dest)
    except FileNotFoundError:
        return None
    return dest


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    done = 0
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(errno.EIO, f"file ended {n - done} bytes short")
        done += got
    return bytes(buf)

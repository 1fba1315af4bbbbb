"""Access logs: what one owner touches, every owner and every restart can see."""

from __future__ import annotations

import errno
import os
import struct
import time
from collections.abc import Callable, Sequence
from itertools import chain

import pytest

from gds_kv_connector.maintenance import recency
from gds_kv_connector.maintenance.pool_scan import owners_dir
from gds_kv_connector.maintenance.recency import (ARCHIVE_NAME, RECORD, RecencyIndex, RecencyLog, fold_stale_logs,
                                      load_recency, merge_records)

NOW = time.time_ns()


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_touch_is_only_buffered_until_flush(tmp_path):
    rl = RecencyLog(str(tmp_path), "a", flush_interval_s=0)
    rl.touch([key(1), key(2)], NOW)
    assert load_recency(str(tmp_path)) == {}
    assert rl.flush() == 2
    # one touch stamps its keys strictly descending, in the order given: a chain's head first
    assert load_recency(str(tmp_path)) == {key(1): NOW, key(2): NOW - 1}
    rl.close()


def test_background_thread_flushes(tmp_path):
    rl = RecencyLog(str(tmp_path), "a", flush_interval_s=0.05)
    rl.touch([key(7)], NOW)
    deadline = time.monotonic() + 5
    while key(7) not in load_recency(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert load_recency(str(tmp_path)) == {key(7): NOW}
    rl.close()


def test_a_promise_is_written_at_once_a_touch_within_the_interval(tmp_path):
    """Until a promised block's touch is written, another owner's evictor does not see it."""
    rl = RecencyLog(str(tmp_path), "a", flush_interval_s=60)
    try:
        rl.touch([key(8)], NOW)
        time.sleep(0.2)
        assert load_recency(str(tmp_path)) == {}  # a plain touch waits for the interval
        rl.promise([key(9)])
        deadline = time.monotonic() + 5
        while key(9) not in load_recency(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(load_recency(str(tmp_path))) == {key(8), key(9)}
    finally:
        rl.close()


def test_merge_keeps_newest_time_over_owners_and_restarts(tmp_path):
    a = RecencyLog(str(tmp_path), "a", flush_interval_s=0)
    b = RecencyLog(str(tmp_path), "b", flush_interval_s=0)
    a.touch([key(1), key(2)], NOW)
    b.touch([key(1)], NOW + 5)
    a.touch([key(2)], NOW + 9)
    a.close()
    b.close()
    again = RecencyLog(str(tmp_path), "a", flush_interval_s=0)  # a restart with the same owner id appends
    again.touch([key(3)], NOW + 1)
    again.close()
    assert load_recency(str(tmp_path)) == {key(1): NOW + 5, key(2): NOW + 9, key(3): NOW + 1}


def test_partial_and_garbage_records_are_ignored(tmp_path):
    rl = RecencyLog(str(tmp_path), "a", flush_interval_s=0)
    rl.touch([key(1)], NOW)
    rl.close()
    path = os.path.join(owners_dir(str(tmp_path)), "a.access")
    with open(path, "ab") as fh:
        fh.write(RECORD.pack(key(2), 0))  # zero-filled after a crash
        fh.write(RECORD.pack(key(3), NOW + 10**18))  # far in the future: garbage
        fh.write(RECORD.pack(key(4), NOW)[:17])  # torn trailing record
    with open(os.path.join(owners_dir(str(tmp_path)), "junk.access"), "wb") as fh:
        fh.write(b"\xff" * 95)
    assert load_recency(str(tmp_path)) == {key(1): NOW}
    # the same owner reopening its log overwrites the torn record instead of staying misaligned
    rl = RecencyLog(str(tmp_path), "a", flush_interval_s=0)
    rl.touch([key(5)], NOW + 2)
    rl.close()
    assert load_recency(str(tmp_path)) == {key(1): NOW, key(5): NOW + 2}


def test_log_is_compacted_when_large(tmp_path):
    cap = 100 * RECORD.size
    rl = RecencyLog(str(tmp_path), "a", flush_interval_s=0, max_log_bytes=cap)
    for round_ in range(30):
        rl.touch([key(i) for i in range(20)], NOW + round_)
        rl.flush()
    path = os.path.join(owners_dir(str(tmp_path)), "a.access")
    assert os.path.getsize(path) <= cap + 20 * RECORD.size
    assert load_recency(str(tmp_path)) == {key(i): NOW + 29 - i for i in range(20)}
    rl.close()


def test_index_reads_only_appended_records_and_survives_compaction(tmp_path):
    rl = RecencyLog(str(tmp_path), "a", flush_interval_s=0, max_log_bytes=80 * RECORD.size)
    idx = RecencyIndex(str(tmp_path))
    rl.touch([key(1)], NOW)
    rl.flush()
    assert idx.refresh() == {key(1): NOW}
    rl.touch([key(2)], NOW + 1)
    rl.flush()
    assert idx.refresh() == {key(1): NOW, key(2): NOW + 1}
    ino = os.stat(os.path.join(owners_dir(str(tmp_path)), "a.access")).st_ino
    for t in range(3):
        rl.touch([key(i) for i in range(30)], NOW + 3 + t)
    rl.flush()  # 92 records > 80: compacted into a new file of 30
    assert os.stat(os.path.join(owners_dir(str(tmp_path)), "a.access")).st_ino != ino
    rl.touch([key(99)], NOW + 9)
    rl.flush()
    assert idx.refresh() == {key(i): NOW + 5 - i for i in range(30)} | {key(99): NOW + 9}
    rl.close()


def test_keys_go_to_the_root_that_holds_them(tmp_path):
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    rl = RecencyLog(roots, "a", flush_interval_s=0)
    rl.touch([key(0x10), bytes([1]) + bytes(31)], NOW)  # key[0] % 2 picks the root
    rl.close()
    assert load_recency(roots[0]) == {key(0x10): NOW}
    assert load_recency(roots[1]) == {bytes([1]) + bytes(31): NOW - 1}  # the touch's second key


def test_fold_stale_logs_keeps_live_keys_and_owner_restarts_its_log(tmp_path):
    root = str(tmp_path)
    dead = RecencyLog(root, "dead", flush_interval_s=0)
    dead.touch([key(1), key(2)], NOW)
    dead.close()
    idle = RecencyLog(root, "idle", flush_interval_s=0)
    idle.touch([key(3)], NOW + 1)
    idle.flush()
    for name in ("dead.access", "idle.access"):
        os.utime(os.path.join(owners_dir(root), name), (time.time() - 7200,) * 2)
    assert fold_stale_logs(root, [key(1), key(3)], older_than_s=3600) == 2
    assert sorted(os.listdir(owners_dir(root))) == [ARCHIVE_NAME]
    assert load_recency(root) == {key(1): NOW, key(3): NOW + 1}  # key 2's block is gone: dropped
    idle.touch([key(4)], NOW + 2)  # the idle owner's file was folded away under it
    idle.close()
    assert load_recency(root) == {key(1): NOW, key(3): NOW + 1, key(4): NOW + 2}


def test_an_archive_is_rewritten_only_when_it_folds_a_log_or_sheds_many_dead_keys(tmp_path):
    """Every eviction run folds: rewriting the archive each time (a new inode) made every owner's
    index read it whole again, though nothing changed but a few keys gone."""
    root = str(tmp_path)
    log = RecencyLog(root, "old", flush_interval_s=0)
    log.touch([key(i) for i in range(8)], NOW)
    log.close()
    os.utime(os.path.join(owners_dir(root), "old.access"), (time.time() - 7200,) * 2)
    assert fold_stale_logs(root, [key(i) for i in range(8)], older_than_s=3600) == 1
    archive = os.path.join(owners_dir(root), ARCHIVE_NAME)
    ino = os.stat(archive).st_ino
    assert fold_stale_logs(root, [key(i) for i in range(7)], older_than_s=3600) == 0
    assert os.stat(archive).st_ino == ino  # one dead key of eight: left for later
    assert fold_stale_logs(root, [key(i) for i in range(5)], older_than_s=3600) == 0
    assert os.stat(archive).st_ino != ino  # three of eight: the archive sheds them
    assert load_recency(root) == {key(i): NOW - i for i in range(5)}


def test_one_log_per_process_and_owner(tmp_path):
    shared = RecencyLog.for_process(str(tmp_path))
    try:
        assert RecencyLog.for_process(str(tmp_path)) is shared
        with pytest.raises(ValueError, match="already open"):
            RecencyLog(str(tmp_path), shared.owner_id)
    finally:
        shared.close()
    assert RecencyLog.for_process(str(tmp_path)) is not shared
    RecencyLog.for_process(str(tmp_path)).close()


def _failing_writes(monkeypatch, errno_: int = errno.ENOSPC, times: int | None = None,
                    only_fd: Callable[[], int] | None = None, during: Callable[[], None] | None = None) -> list[int]:
    """Make access-log writes fail with ``errno_`` (``times`` times, or always; only to the fd
    ``only_fd()`` if given), calling ``during`` inside each failing write; returns the attempts."""
    real = recency.pwrite_all
    attempts: list[int] = []

    def pwrite(fd: int, data: bytes, offset: int) -> None:
        if only_fd is not None and fd != only_fd():
            return real(fd, data, offset)
        attempts.append(len(data) // RECORD.size)
        if times is not None and len(attempts) > times:
            return real(fd, data, offset)
        if during is not None:
            during()
        raise OSError(errno_, os.strerror(errno_))

    monkeypatch.setattr(recency, "pwrite_all", pwrite)
    return attempts


def _queued(rl: RecencyLog) -> list[Sequence[bytes]]:
    """Every root's records a failed write gave back, then the touches no flush has taken yet."""
    return [batch[1] for batch in chain(*rl._held, rl._pending)]


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EIO])
def test_a_failed_write_keeps_its_touches_for_the_next_flush(tmp_path, monkeypatch, errno_):
    """The disk is full exactly when eviction runs: a promise lost to a failed write would let the
    evictor remove the block whose load is about to start."""
    rl = RecencyLog(str(tmp_path), "a", flush_interval_s=0)
    _failing_writes(monkeypatch, errno_, times=1)
    rl.touch([key(1)], NOW)
    rl.promise([key(2)])
    assert rl.flush() == 0
    assert load_recency(str(tmp_path)) == {}
    rl.touch([key(3)], NOW + 1)
    assert rl.flush() == 3
    assert set(load_recency(str(tmp_path))) == {key(1), key(2), key(3)}
    assert rl.dropped == 0
    rl.close()


def test_a_failing_log_keeps_its_newest_touches_within_the_bound(tmp_path, monkeypatch):
    """Records put back go before the touches made during the failed write, and the bound drops
    the oldest of all, so memory stays bounded however long the filesystem refuses writes."""
    monkeypatch.setattr(recency, "MAX_PENDING_BATCHES", 4)
    rl = RecencyLog(str(tmp_path), "a", flush_interval_s=0)
    meanwhile = [4, 5]

    def executor_touches() -> None:  # the executor thread goes on during the failed write
        while meanwhile:
            i = meanwhile.pop(0)
            rl.touch([key(i)], NOW + i)

    _failing_writes(monkeypatch, during=executor_touches)
    for i in (1, 2, 3):
        rl.touch([key(i)], NOW + i)
    assert rl.flush() == 0
    assert _queued(rl) == [[key(2)], [key(3)], [key(4)], [key(5)]]
    assert rl.dropped == 1  # key 1, the oldest, made room
    for i in range(6, 20):
        rl.touch([key(i)], NOW + i)
        rl.flush()
        assert len(_queued(rl)) == 4
    assert rl.dropped == 15
    monkeypatch.undo()  # the disk has room again
    assert rl.flush() == 4
    assert load_recency(str(tmp_path)) == {key(i): NOW + i for i in range(16, 20)}
    rl.close()


def test_only_the_failing_roots_records_are_kept(tmp_path):
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    rl = RecencyLog(roots, "a", flush_interval_s=0)
    k0, k1 = key(0x10), bytes([1]) + bytes(31)
    rl.touch([k1], NOW)
    rl.flush()  # opens root 1's log
    with pytest.MonkeyPatch.context() as mp:
        _failing_writes(mp, only_fd=lambda: rl._logs[0].fd)
        rl.touch([k0, k1], NOW + 1)
        assert rl.flush() == 1  # root 1 written, root 0 kept
    assert load_recency(roots[1]) == {k1: NOW} and load_recency(roots[0]) == {}  # its second key: NOW + 1 - 1
    assert rl.flush() == 1  # only root 0's record: root 1's is not written twice
    assert load_recency(roots[0]) == {k0: NOW + 1}  # the touch's first key
    assert os.path.getsize(os.path.join(owners_dir(roots[1]), "a.access")) == 2 * RECORD.size
    assert rl.dropped == 0
    rl.close()


def test_a_failing_log_is_retried_once_per_interval_not_once_per_promise(tmp_path, monkeypatch):
    """Each retry writes the whole backlog: retried at every promise, a full disk would keep the
    flusher busy rewriting it."""
    interval = 0.2
    attempts = _failing_writes(monkeypatch)
    rl = RecencyLog(str(tmp_path), "a", flush_interval_s=interval)
    try:
        t0 = time.monotonic()
        for i in range(40):
            rl.promise([key(i)])
            time.sleep(0.005)
        elapsed = time.monotonic() - t0
        assert len(attempts) <= elapsed / interval + 2
    finally:
        rl.close()
    assert attempts and rl.dropped == 40  # close() could not write them either, and counts them


def test_a_log_renamed_away_is_written_again_under_its_name(tmp_path):
    """A fold renames an idle log before reading it: a record that lands in the renamed file may
    come after the read, so the owner writes it again to a new log with the old name."""
    rl = RecencyLog(str(tmp_path), "a", flush_interval_s=0)
    rl.touch([key(1)], NOW)
    rl.flush()
    path = os.path.join(owners_dir(str(tmp_path)), "a.access")
    os.rename(path, path + ".fold-elsewhere")  # as fold_stale_logs does
    rl.touch([key(2)], NOW + 1)
    assert rl.flush() == 1
    with open(path, "rb") as fh:
        assert merge_records(fh.read()) == {key(2): NOW + 1}
    rl.close()


def test_a_promise_written_while_its_log_is_folded_is_not_lost(tmp_path, monkeypatch):
    """The fold reads an idle log, writes the archive, then unlinks the log: a promise its live
    owner writes in between must still reach every evictor."""
    root = str(tmp_path)
    idle = RecencyLog(root, "idle", flush_interval_s=0)
    idle.touch([key(1)], NOW - 7200 * 10**9)
    idle.flush()
    os.utime(os.path.join(owners_dir(root), "idle.access"), (time.time() - 7200,) * 2)
    real = recency.atomic_write

    def archive_write(path: str, data: bytes) -> None:
        idle.promise([key(2)])
        assert idle.flush() == 1
        real(path, data)

    monkeypatch.setattr(recency, "atomic_write", archive_write)
    assert fold_stale_logs(root, [key(1), key(2)], older_than_s=3600) == 1
    assert key(2) in load_recency(root)
    assert sorted(os.listdir(owners_dir(root))) == [ARCHIVE_NAME, "idle.access"]
    idle.close()


def test_a_log_taken_by_a_failed_fold_stays_visible_until_the_next_fold(tmp_path, monkeypatch):
    root = str(tmp_path)
    dead = RecencyLog(root, "dead", flush_interval_s=0)
    dead.touch([key(1), key(2)], NOW)
    dead.close()
    os.utime(os.path.join(owners_dir(root), "dead.access"), (time.time() - 7200,) * 2)

    def disk_full(path: str, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recency, "atomic_write", disk_full)
        with pytest.raises(OSError):
            fold_stale_logs(root, [key(1)], older_than_s=3600)
    assert [n for n in os.listdir(owners_dir(root)) if not n.startswith("dead.access.fold-")] == []
    assert load_recency(root) == {key(1): NOW, key(2): NOW - 1}  # still read under its private name
    assert fold_stale_logs(root, [key(1)], older_than_s=3600) == 1  # the next fold takes it
    assert sorted(os.listdir(owners_dir(root))) == [ARCHIVE_NAME]
    assert load_recency(root) == {key(1): NOW}


def test_index_forgets_logs_that_are_gone(tmp_path):
    root = str(tmp_path)
    for owner in ("a", "b"):
        rl = RecencyLog(root, owner, flush_interval_s=0)
        rl.touch([key(1)], NOW)
        rl.close()
    idx = RecencyIndex(root)
    idx.refresh()
    assert set(idx._offsets) == {"a.access", "b.access"}
    os.unlink(os.path.join(owners_dir(root), "a.access"))
    idx.refresh()
    assert set(idx._offsets) == {"b.access"}


def test_index_retains_only_live_keys_and_touches_after_the_scan(tmp_path):
    """A long-lived evictor's index must not hold every key the pool ever saw; a key touched
    after the scan may be a block published after it, so it waits for the next scan."""
    root = str(tmp_path)
    rl = RecencyLog(root, "a", flush_interval_s=0)
    rl.touch([key(1), key(2), key(3)], NOW)
    rl.touch([key(4)], NOW + 20)
    rl.flush()
    idx = RecencyIndex(root)
    idx.refresh()
    assert idx.retain(iter([key(1), key(9)]), scanned_ns=NOW + 10) == 2
    assert idx.latest == {key(1): NOW, key(4): NOW + 20}
    rl.touch([key(5)], NOW + 30)
    rl.flush()
    assert idx.refresh() == {key(1): NOW, key(4): NOW + 20, key(5): NOW + 30}  # 2 and 3 stay forgotten
    assert idx.retain({key(1), key(5)}, scanned_ns=NOW + 40) == 1
    assert idx.refresh() == {key(1): NOW, key(5): NOW + 30}
    rl.close()


def test_a_fifo_among_the_logs_hangs_neither_the_index_nor_a_fold_nor_an_owner(tmp_path):
    """A FIFO planted in owners/ (under a log's name, or an owner's own) is skipped: opening one for
    reading waits for a writer for ever, and the evictor holds the pool's eviction lock meanwhile."""
    import threading

    root = str(tmp_path)
    rl = RecencyLog(root, "real", flush_interval_s=0)
    ts = time.time_ns()
    rl.touch([b"\x01" * 32], ts)
    rl.flush()
    rl.close()
    fifo = os.path.join(owners_dir(root), "planted.access")
    os.mkfifo(fifo)
    out: dict = {}

    def run() -> None:
        out["index"] = dict(RecencyIndex(root).refresh())
        out["folded"] = fold_stale_logs(root, [b"\x01" * 32], 0.0, now=time.time() + 3600)
        os.mkfifo(os.path.join(owners_dir(root), "victim.access"))  # after the fold, which removes it
        victim = RecencyLog(root, "victim", flush_interval_s=0)
        victim.touch([b"\x02" * 32], ts)
        out["written"] = victim.flush()
        victim.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        for path in (fifo, os.path.join(owners_dir(root), "victim.access")):
            try:  # release a reader stuck on a FIFO so the thread ends
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        pytest.fail("a FIFO in owners/ blocked the recency code")
    assert out["index"] == {b"\x01" * 32: ts}
    assert out["written"] == 0  # the owner's own name is a FIFO: nothing written, nothing hung


def _wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class _CountingRecord(struct.Struct):
    """RECORD that counts the records packed: what a flush costs the flusher, on the GIL."""

    packed = 0

    def pack(self, *values: object) -> bytes:
        type(self).packed += 1
        return super().pack(*values)


def test_a_failing_root_backs_off_alone(tmp_path, monkeypatch):
    """The back-off was the flusher's: while one root's log could not be written, a promise of a
    block in a healthy root waited out the failing root's interval, and another owner's evictor could
    remove that block meanwhile.  The failing root's backlog must not be packed again at each promise
    either (the flusher runs at every promise)."""
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    backlog = [bytes([2 * i]) + bytes(31) for i in range(100)]  # all in root 0
    healthy = [bytes([2 * i + 1]) + bytes(31) for i in range(3)]  # root 1
    monkeypatch.setattr(_CountingRecord, "packed", 0)
    rl = RecencyLog(roots, "a", flush_interval_s=60)
    try:
        attempts = _failing_writes(monkeypatch, only_fd=lambda: rl._logs[0].fd)
        rl.promise(backlog)
        assert _wait_for(lambda: rl.failing)
        monkeypatch.setattr(recency, "RECORD", _CountingRecord(RECORD.format))
        for n, k in enumerate(healthy, 1):
            rl.promise([k])
            assert _wait_for(lambda: k in load_recency(roots[1])), "the healthy root waited for the failing one"
            assert _CountingRecord.packed == n  # its own record, not root 0's backlog as well
        rl.promise([backlog[0]])  # root 0 backs off: queued by the flusher, not retried at this promise
        assert _wait_for(lambda: [len(batch[1]) for batch in rl._held[0]] == [len(backlog), 1])
        assert len(attempts) == 1 and _CountingRecord.packed == len(healthy)
        assert load_recency(roots[0]) == {}
    finally:
        rl.close()


def test_a_root_backing_off_is_retried_by_the_flusher_on_its_own(tmp_path, monkeypatch):
    """Its backlog waits for its interval, not for a promise or a write to another root."""
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    k0 = bytes([0]) + bytes(31)
    rl = RecencyLog(roots, "a", flush_interval_s=0.05)
    try:
        attempts = _failing_writes(monkeypatch, times=1, only_fd=lambda: rl._logs[0].fd)
        rl.promise([k0])
        assert _wait_for(lambda: k0 in load_recency(roots[0]))
        assert len(attempts) == 2 and not rl.failing and _queued(rl) == []
    finally:
        rl.close()


def test_a_failing_roots_backlog_goes_before_a_healthy_roots_new_touches(tmp_path, monkeypatch):
    """The bound holds over every root's queue, and what it drops is the oldest: a root that keeps
    failing fills the queue, and must not make another root's new promise the one dropped."""
    monkeypatch.setattr(recency, "MAX_PENDING_BATCHES", 4)
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    rl = RecencyLog(roots, "a", flush_interval_s=0)
    rl.touch([bytes([1]) + bytes(31)], NOW)
    rl.flush()  # opens root 1's log
    with pytest.MonkeyPatch.context() as mp:
        _failing_writes(mp, only_fd=lambda: rl._logs[0].fd)
        for i in range(6):
            rl.touch([bytes([2 * i]) + bytes(31)], NOW + i)
            rl.flush()
        assert len(_queued(rl)) == 4 and rl.dropped == 2
        fresh = bytes([3]) + bytes(31)
        rl.touch([fresh, bytes([12]) + bytes(31)], NOW + 9)  # one batch over both roots
        assert rl.flush() == 1
        assert fresh in load_recency(roots[1])
        assert _queued(rl) == [[bytes([2 * i]) + bytes(31)] for i in (3, 4, 5)] + [[bytes([12]) + bytes(31)]]
        assert rl.dropped == 3
    assert rl.flush() == 4
    assert set(load_recency(roots[0])) == {bytes([2 * i]) + bytes(31) for i in (3, 4, 5, 6)}
    rl.close()


@pytest.mark.parametrize("n_roots", [1, 2])
def test_this_processs_evictor_keeps_the_blocks_it_promised_while_its_log_cannot_be_written(
        tmp_path, monkeypatch, n_roots):
    """A full disk is when eviction runs, and when no access log can be written: the promise stayed
    queued, and the serving process's own evictor removed the block whose load was about to start."""
    from gds_kv_connector.maintenance.capacity import CapacityGuard
    from gds_kv_connector.store.pool import BlockPool
    from gds_kv_connector.format.records import ZERO_KEY, BlockHeader
    from gds_kv_connector.maintenance.pool_scan import scan_pool

    roots = [str(tmp_path / f"r{i}") for i in range(n_roots)]
    pool = BlockPool(tuple(roots), b"\x11" * 32, 4096, 4, geometry_note="test")
    keys = [bytes([1]) + i.to_bytes(31, "big") for i in range(6)]  # the last root's, with two roots
    for k in keys:
        fd, tmp = pool.create_tmp(k, BlockHeader(pool.fingerprint, k, 4096, 0, 1, 4, 1, ZERO_KEY))
        os.pwrite(fd, b"\x5a" * 4096, 4096)
        assert pool.publish(fd, tmp, k)
        os.utime(pool.path_for(k), ns=(1, 1))  # old: only an access keeps a block
    rl = RecencyLog(roots, "own", flush_interval_s=0)
    guard = CapacityGuard(roots, quota_bytes=4 * 8192, low_watermark=0.5, min_free_bytes=0, grace_s=600,
                          recency=rl, check_interval_s=3600)
    try:
        _failing_writes(monkeypatch)  # the disk is full
        rl.promise([keys[0]])  # the first block a run would remove, all being as old
        assert guard.check_now(timeout=30)
        assert load_recency(roots[-1]) == {}  # no owner could read the promise from a log
        rep = guard.last_reports[-1]
        assert rep.evicted_blocks == 4 and rep.protected_blocks == 1
        assert {b.key for r in roots for b in scan_pool(r).blocks} == {keys[0], keys[5]}
    finally:
        guard.close()
        rl.close()

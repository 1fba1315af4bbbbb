"""Access logs: what one owner touches, every owner and every restart can see."""

from __future__ import annotations

import os
import time

import pytest

from gds_kv_connector.pool_scan import owners_dir
from gds_kv_connector.recency import (ARCHIVE_NAME, RECORD, RecencyIndex, RecencyLog, fold_stale_logs,
                                      load_recency)

NOW = time.time_ns()


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_touch_is_only_buffered_until_flush(tmp_path):
    rl = RecencyLog(str(tmp_path), "a", flush_interval_s=0)
    rl.touch([key(1), key(2)], NOW)
    assert load_recency(str(tmp_path)) == {}
    assert rl.flush() == 2
    assert load_recency(str(tmp_path)) == {key(1): NOW, key(2): NOW}
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
    assert load_recency(str(tmp_path)) == {key(i): NOW + 29 for i in range(20)}
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
    assert idx.refresh() == {key(i): NOW + 5 for i in range(30)} | {key(99): NOW + 9}
    rl.close()


def test_keys_go_to_the_root_that_holds_them(tmp_path):
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    rl = RecencyLog(roots, "a", flush_interval_s=0)
    rl.touch([key(0x10), bytes([1]) + bytes(31)], NOW)  # key[0] % 2 picks the root
    rl.close()
    assert load_recency(roots[0]) == {key(0x10): NOW}
    assert load_recency(roots[1]) == {bytes([1]) + bytes(31): NOW}


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

"""Eviction reads the access logs only since a horizon: the oldest shard summary's build (and the
grace) less a slack.  Older records are already in the summaries' entries, so a pass that has its
summaries reads each log's tail (found by bisection) and keeps only the keys accessed since."""

from __future__ import annotations

import functools
import os
import random
import time

from gds_kv_connector.maintenance import eviction, recency
from gds_kv_connector.maintenance import shard_summary as ss
from gds_kv_connector.maintenance.eviction import evict, expire
from gds_kv_connector.maintenance.pool_scan import owners_dir
from gds_kv_connector.maintenance.recency import (
    ARCHIVE_NAME,
    HORIZON_SLACK_NS,
    RECORD,
    RecencyIndex,
    RecencyLog,
    access_horizon,
    fold_stale_logs,
    load_recency,
)
from gds_kv_connector.store.pool import BlockPool
from tests.support.sparse_pool import FILE, make_pool, put

S = 10**9
T = float(int(time.time()) - 3600)  # the first pass's "now"; later passes run up to an hour after it
T_NS = int(T * S)




def key(i: int) -> bytes:
    return bytes([i % 256]) + i.to_bytes(31, "big")


def write_log(root, name: str, records: list[tuple[bytes, int]], mode: str = "ab") -> str:
    path = os.path.join(owners_dir(str(root)), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as fh:
        fh.write(b"".join(RECORD.pack(k, t) for k, t in records))
    return path


def touch(root, k: bytes, t_ns: int) -> None:
    rl = RecencyLog(str(root), "toucher", flush_interval_s=0)
    rl.touch([k], t_ns)
    rl.flush()
    rl.close()


def present(pool: BlockPool, *keys: bytes) -> list[bool]:
    return [os.path.exists(pool.path_for(k)) for k in keys]


def three_blocks(tmp_path) -> tuple[BlockPool, bytes, bytes, bytes]:
    """A (oldest), B, C, published long before the first pass, in three shards."""
    pool = make_pool(tmp_path)
    a, b, c = key(1), key(2), key(3)
    for k, age_s in ((a, 3000), (b, 2000), (c, 1000)):
        put(pool, k, T_NS - age_s * S)
    return pool, a, b, c


def build_pass(root, now: float = T) -> eviction.EvictionReport:
    """A pass with nothing to free: it builds every summary (at ``now``)."""
    return evict(str(root), 0, 0.9, 0, 0.0, now=now)


def free_one_block(root, now: float, grace_s: float = 0.0, index: RecencyIndex | None = None):
    usage = ss.RootSummaries.load(str(root), 0)
    quota = ss.fx_bytes(usage.live_fx) - FILE
    return evict(str(root), quota, 1.0, 0, grace_s, now=now, recency=index)


def test_a_pass_with_its_summaries_reads_the_log_tail_only_and_keeps_only_newer_keys(tmp_path, monkeypatch):
    pool, a, b, c = three_blocks(tmp_path)
    old = [(key(1000 + i), T_NS - 7200 * S + i * S // 10) for i in range(20_000)]  # two hours, then stop
    path = write_log(tmp_path, "other-1.access", old)
    full = build_pass(tmp_path)
    assert full.summaries_stale == 0
    recent = [(key(50_000 + i), T_NS + 600 * S + i * S) for i in range(50)]  # after the build
    write_log(tmp_path, "other-1.access", recent)
    pread_bytes = []
    real_pread = os.pread

    def pread(fd: int, n: int, off: int) -> bytes:
        data = real_pread(fd, n, off)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".access"):  # a log's, not a summary's
            pread_bytes.append(len(data))
        return data

    monkeypatch.setattr(recency.os, "pread", pread)

    index = RecencyIndex(str(tmp_path))
    report = free_one_block(tmp_path, now=T + 700, index=index)
    assert report.evicted_blocks == 1 and present(pool, a, b, c) == [False, True, True]
    horizon = access_horizon(T_NS, T_NS + 700 * S)
    assert horizon == T_NS - HORIZON_SLACK_NS
    # what was read: the 50 new records, those of the slack before the horizon, and the bisection's probes
    in_slack = sum(horizon - HORIZON_SLACK_NS <= t for _, t in old)
    assert index.read_bytes == sum(pread_bytes) < (len(recent) + in_slack + 40) * RECORD.size
    assert index.read_bytes < os.path.getsize(path) // 10
    assert set(index.latest) == {k for k, _ in recent}


def test_an_access_after_the_build_reorders_and_a_promise_protects(tmp_path):
    pool, a, b, c = three_blocks(tmp_path)
    build_pass(tmp_path)
    touch(tmp_path, a, T_NS + 50 * S)  # after the build: only the log knows it
    report = free_one_block(tmp_path, now=T + 100)
    assert report.evicted_blocks == 1 and present(pool, a, b, c) == [True, False, True]
    # a promise (an access within the grace) keeps its block whatever must be freed
    touch(tmp_path, c, T_NS + 1950 * S)
    report = evict(str(tmp_path), FILE // 2, 1.0, 0, 120.0, now=T + 2000)
    assert present(pool, a, b, c) == [False, False, True] and report.protected_blocks == 1


def test_an_access_older_than_the_horizon_still_counts_through_the_summary(tmp_path):
    pool, a, b, c = three_blocks(tmp_path)
    touch(tmp_path, a, T_NS - 500 * S)  # before the build, so in A's entry
    build_pass(tmp_path)
    entries = [e for s in ss.RootSummaries.load(str(tmp_path), 0).shards if s.header for _, e in s.cursor()]
    assert {e[ss.E_KEY]: e[ss.E_RECENCY] for e in entries}[a] == T_NS - 500 * S
    # an hour later the record is older than the horizon: not in the index, yet A is newer than B
    expired = expire(str(tmp_path), max_age_s=3600 + 1600, now=T + 3600, grace_s=0)
    assert expired.evicted_blocks == 1 and present(pool, a, b, c) == [True, False, True]
    index = RecencyIndex(str(tmp_path))
    report = free_one_block(tmp_path, now=T + 3600, index=index)
    assert a not in index.latest and index.horizon_ns > T_NS - 500 * S
    assert report.evicted_blocks == 1 and present(pool, a, b, c) == [True, False, False]


def test_a_missing_summary_makes_the_horizon_zero_and_everything_is_read(tmp_path):
    _, _, b, _ = three_blocks(tmp_path)
    touch(tmp_path, b, T_NS - 900 * S)
    old = [(key(1000 + i), T_NS - 7200 * S + i * S) for i in range(1000)]
    write_log(tmp_path, "other-1.access", old)
    build_pass(tmp_path)
    sums = ss.RootSummaries.load(str(tmp_path), 0)
    assert sums.oldest_built_ns() == T_NS
    b_shard = next(s for s in sums.shards if s.sub == b.hex()[:2])
    os.unlink(b_shard.path)
    assert ss.RootSummaries.load(str(tmp_path), 0).oldest_built_ns() == 0
    logs = sum(os.path.getsize(os.path.join(owners_dir(str(tmp_path)), n))
               for n in os.listdir(owners_dir(str(tmp_path))) if n.endswith(".access"))

    seen = []
    real_set = RecencyIndex.set_horizon
    fresh = RecencyIndex(str(tmp_path))
    fresh.set_horizon = lambda h: seen.append(h) or real_set(fresh, h)
    evict(str(tmp_path), 0, 0.9, 0, 0.0, now=T + 3700, recency=fresh)
    assert seen[0] == 0 and fresh.read_bytes == logs  # every record of every log
    rebuilt = next(s for s in ss.RootSummaries.load(str(tmp_path), 0).shards if s.sub == b.hex()[:2])
    assert [e[ss.E_RECENCY] for _, e in rebuilt.cursor()] == [T_NS - 900 * S]  # the old access, kept
    assert seen[-1] > 0 and fresh.latest == {}  # then pruned: every record is older than the new horizon


def test_a_long_lived_index_follows_its_horizon_both_ways(tmp_path):
    records = [(key(i), T_NS + i * S) for i in range(1000)]
    write_log(tmp_path, "o-1.access", records)
    index = RecencyIndex(str(tmp_path))
    index.refresh()
    assert len(index.latest) == 1000
    index.set_horizon(T_NS + 600 * S)  # later: the older keys go now
    assert set(index.latest) == {k for k, t in records[600:]}
    index.refresh()
    assert len(index.latest) == 400  # nothing read again, nothing older kept
    index.set_horizon(T_NS + 100 * S)  # earlier: the next refresh reads what it passed over
    index.refresh()
    assert set(index.latest) == {k for k, t in records[100:]}


def test_compaction_writes_oldest_first_and_appends_stay_in_time_order(tmp_path):
    rl = RecencyLog(str(tmp_path), "w", flush_interval_s=0, max_log_bytes=200 * RECORD.size)
    rng = random.Random(3)
    for i in range(600):
        rl.touch([key(rng.randrange(150))], T_NS + i * S)
        rl.flush()
    rl.close()
    with open(os.path.join(owners_dir(str(tmp_path)), "w.access"), "rb") as fh:
        stamps = [t for _, t in RECORD.iter_unpack(fh.read())]
    assert len(stamps) < 600 and stamps == sorted(stamps)


def _first_since_finds_every_newer_record(tmp_path, records: list[tuple[bytes, int]], horizon: int) -> None:
    write_log(tmp_path, "o-1.access", records, "wb")
    index = RecencyIndex(str(tmp_path))
    index.set_horizon(horizon)
    index.refresh()
    newest: dict[bytes, int] = {}
    for k, t in records:
        if t >= horizon and t > newest.get(k, 0):
            newest[k] = t
    assert index.latest == newest


def test_bisection_misses_no_record_of_a_log_out_of_order_within_the_slack(tmp_path):
    rng = random.Random(5)
    n = 5000
    for _ in range(20):
        base = [T_NS + i * S for i in range(n)]
        jitter = [t - rng.randrange(HORIZON_SLACK_NS) for t in base]  # a touch stamped before an earlier one
        records = [(key(rng.randrange(2000)), t) for t in jitter]
        _first_since_finds_every_newer_record(tmp_path, records, base[rng.randrange(n)])


def test_a_log_compacted_newest_first_by_an_earlier_version_is_read_where_it_matters(tmp_path):
    head = [(key(i), T_NS + (100 - i) * S) for i in range(100)]  # newest first, then appends in order
    tail = [(key(1000 + i), T_NS + (200 + i) * S) for i in range(2000)]
    for horizon_s in (50, 150, 1000):  # within the head (read whole), past it, within the appends
        _first_since_finds_every_newer_record(tmp_path, head + tail, T_NS + horizon_s * S)


def test_a_hole_in_a_log_ends_the_bisection_where_it_stands(tmp_path):
    before = [(key(i), T_NS + i * S) for i in range(1000)]
    hole = [(bytes(32), 0)] * 1000  # blocks a crash left zero-filled
    after = [(key(5000 + i), T_NS + (1000 + i) * S) for i in range(1000)]
    for horizon_s in (10, 900, 1500):
        _first_since_finds_every_newer_record(tmp_path, before + hole + after, T_NS + horizon_s * S)


def test_the_first_pass_builds_every_summary_whatever_the_listing_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(eviction, "refresh", functools.partial(ss.refresh, budget=5))
    pool = make_pool(tmp_path)
    for sub in range(12):
        for i in range(10):
            put(pool, bytes([sub, i]) + bytes(30), T_NS - 3000 * S)
    report = build_pass(tmp_path)
    assert (report.scanned_blocks, report.names_listed, report.summaries_stale) == (120, 120, 0)
    for sub in range(12):  # every shard stale now: those keep the budget
        put(pool, bytes([sub, 99]) + bytes(30), T_NS - 3000 * S)
    report = build_pass(tmp_path, now=T + 1)
    # one shard rebuilt (11 names), the other 11 stale ones only counted (11 names each), all in the usage
    assert report.names_listed == 11 + 11 * 11 and report.summaries_stale == 11 and report.scanned_blocks == 132


def test_a_fold_with_nothing_to_take_reads_the_archive_only_when_removals_may_matter(tmp_path, monkeypatch):
    write_log(tmp_path, ARCHIVE_NAME, [(key(i), T_NS + i) for i in range(100)])
    reads = []
    real_read = recency._read_records
    monkeypatch.setattr(recency, "_read_records", lambda p: reads.append(p) or real_read(p))
    live = {key(i) for i in range(100)} - {key(0)}
    assert fold_stale_logs(str(tmp_path), live, 3600, dead_at_most=1) == 0 and reads == []
    assert fold_stale_logs(str(tmp_path), live, 3600, dead_at_most=30) == 0 and len(reads) == 1
    gone = {key(i) for i in range(100)} - {key(i) for i in range(30)}
    fold_stale_logs(str(tmp_path), {key(i) for i in range(30)}, 3600, dead_at_most=len(gone))
    assert os.path.getsize(os.path.join(owners_dir(str(tmp_path)), ARCHIVE_NAME)) == 30 * RECORD.size


def test_a_fold_holds_records_in_arrays_not_python_objects(tmp_path):
    """A fold deduplicates every record of the archive and the logs it takes: in numpy records its
    peak stays under 160 bytes a record read, which a dict of Python keys exceeds; the result is the
    same, newest per key, dead keys dropped."""
    import tracemalloc

    rng = random.Random(5)
    keys = [rng.randbytes(32) for _ in range(40_000)]
    write_log(tmp_path, ARCHIVE_NAME, [(k, T_NS + i) for i, k in enumerate(keys[:20_000])])
    path = write_log(tmp_path, "old.access", [(k, T_NS + 10**9 + i) for i, k in enumerate(keys[10_000:])])
    os.utime(path, (time.time() - 7200,) * 2)
    gone = set(keys[:100])
    tracemalloc.start()
    try:
        assert fold_stale_logs(str(tmp_path), eviction._Except(gone), 3600) == 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 160 * 50_000, peak  # 50,000 records read
    archived = load_recency(str(tmp_path))
    assert len(archived) == 40_000 - 100
    assert archived[keys[5_000]] == T_NS + 5_000 and archived[keys[15_000]] == T_NS + 10**9 + 5_000

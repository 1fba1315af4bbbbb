"""Shard summaries and the eviction planner over them: the format, when a summary is current, rebuilds
that keep what they know, their budget, and runs whose file-system work follows the blocks they free,
not the pool."""

from __future__ import annotations

import os
import random
import time

import pytest

from gds_kv_connector.format.records import ZERO_KEY
from gds_kv_connector.maintenance import eviction
from gds_kv_connector.maintenance import shard_summary as ss
from gds_kv_connector.maintenance.eviction import evict, evict_pool, expire
from gds_kv_connector.maintenance.operations import format_stats, stats
from gds_kv_connector.maintenance.pool_scan import scan_pool
from gds_kv_connector.maintenance.recency import RecencyLog
from gds_kv_connector.store.pool import STALE_FOREIGN_TMP_S, BlockPool
from tests.support.sparse_pool import FILE, make_pool
from tests.support.sparse_pool import put as sparse_put

NOW = float(int(time.time()))  # "now" of every run (access logs take no time far from the clock's)
NOW_NS = int(NOW * 1e9)


def put(pool: BlockPool, k: bytes, parent: bytes = ZERO_KEY, t_ns: int = NOW_NS - 10**12) -> None:
    sparse_put(pool, k, t_ns, parent)


def rkey(rng: random.Random) -> bytes:
    return rng.randbytes(32)


def present(*roots) -> set[bytes]:
    return {b.key for r in roots for b in scan_pool(str(r)).blocks}


def shards_of(root) -> ss.RootSummaries:
    return ss.RootSummaries.load(str(root), 0)


def build(root, budget: int | None = None) -> ss.Refresh:
    return ss.refresh([shards_of(root)], [{}], NOW, write=True, budget=budget)[0]


class Calls:
    """Counts the file-system calls a run makes through os.open, os.lstat, os.stat and os.scandir."""

    def __init__(self, monkeypatch) -> None:
        self.n = {"open": 0, "lstat": 0, "stat": 0, "scandir": 0}
        for name in self.n:
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._counting(name, real))

    def _counting(self, name, real):
        def call(*a, **kw):
            self.n[name] += 1
            return real(*a, **kw)
        return call


# -- the format ------------------------------------------------------------------------------------
def test_a_summary_round_trips_sorted_oldest_first(tmp_path):
    pool = make_pool(tmp_path)
    keys = [bytes([0x5A]) + bytes([i]) * 31 for i in range(5)]
    for i, k in enumerate(keys):
        put(pool, k, t_ns=NOW_NS - (10 - i) * 10**9)  # keys[0] oldest
    build(tmp_path)
    (shard,) = shards_of(tmp_path).shards
    assert shard.current and shard.header.count == shard.header.live_count == 5
    assert shard.header.live_bytes == 5 * FILE and shard.header.start == 0
    entries = [e for _, e in shard.cursor()]
    assert [e[ss.E_KEY] for e in entries] == keys
    st = os.lstat(pool.path_for(keys[2]))
    assert entries[2][1:5] == (st.st_mtime_ns, FILE, st.st_ino, st.st_mtime_ns)
    assert os.path.getsize(shard.path) == ss.HEADER_SIZE + 5 * ss.ENTRY.size


@pytest.mark.parametrize("damage", ["crc", "magic", "version", "short", "truncated entry", "empty"])
def test_a_damaged_summary_is_missing_and_rebuilt(tmp_path, damage):
    pool = make_pool(tmp_path)
    put(pool, bytes([0x5A]) * 32)
    build(tmp_path)
    (shard,) = shards_of(tmp_path).shards
    raw = bytearray(open(shard.path, "rb").read())
    if damage == "crc":
        raw[40] ^= 1  # the built time
    elif damage == "magic":
        raw[0] ^= 1
    elif damage == "version":
        raw[8] = 99
    elif damage == "short":
        raw = raw[:ss.HEADER_SIZE - 1]
    elif damage == "truncated entry":
        raw = raw[:-1]
    else:
        raw = bytearray()
    open(shard.path, "wb").write(bytes(raw))
    (again,) = shards_of(tmp_path).shards
    assert again.header is None and not again.current
    assert build(tmp_path).rebuilt == 1
    assert shards_of(tmp_path).shards[0].header.live_count == 1


# -- current, stale, and what a rebuild keeps -------------------------------------------------------
def test_a_summary_is_current_until_a_name_comes_or_goes(tmp_path):
    pool = make_pool(tmp_path)
    a, b = bytes([0x5A]) * 32, bytes([0x5A]) + bytes(31)
    put(pool, a)
    build(tmp_path)
    os.utime(pool.path_for(a), ns=(NOW_NS, NOW_NS))  # a file's own change leaves its directory alone
    assert shards_of(tmp_path).shards[0].current
    put(pool, b)
    assert not shards_of(tmp_path).shards[0].current
    build(tmp_path)
    assert shards_of(tmp_path).shards[0].current
    os.unlink(pool.path_for(a))
    assert not shards_of(tmp_path).shards[0].current


def test_a_rebuild_keeps_known_names_without_looking_at_them_again(tmp_path):
    pool = make_pool(tmp_path)
    old = [bytes([0x5A, i]) + bytes(30) for i in range(3)]
    for k in old:
        put(pool, k, t_ns=NOW_NS - 50 * 10**9)
    build(tmp_path)
    # changing a known file's mtime is invisible to a rebuild that keeps its entry by inode
    os.utime(pool.path_for(old[0]), ns=(NOW_NS - 10**9, NOW_NS - 10**9))
    new = bytes([0x5A, 9]) + bytes(30)
    put(pool, new, t_ns=NOW_NS - 99 * 10**9)
    tally = build(tmp_path)
    assert (tally.rebuilt, tally.listed, tally.lstats) == (1, 4, 1)  # only the new name was lstat'ed
    entries = {e[ss.E_KEY]: e for _, e in shards_of(tmp_path).shards[0].cursor()}
    assert entries[old[0]][ss.E_MTIME] == NOW_NS - 50 * 10**9  # kept, not read again
    assert [e[ss.E_KEY] for e in sorted(entries.values(), key=lambda e: e[1])][0] == new


def test_missing_summaries_are_all_built_stale_ones_within_the_budget_oldest_built_first(tmp_path):
    pool = make_pool(tmp_path)
    for sub in range(12):
        for i in range(10):
            put(pool, bytes([sub, i]) + bytes(30))
    first = build(tmp_path, budget=25)  # every summary missing: all built, whatever the budget
    assert (first.rebuilt, first.listed, first.stale) == (12, 120, 0)

    def make_stale(subs: range) -> None:
        for sub in subs:
            put(pool, bytes([sub, 99 - len(os.listdir(os.path.dirname(pool.path_for(bytes([sub]) * 32))))])
                + bytes(30))

    make_stale(range(6, 12))
    ss.refresh([shards_of(tmp_path)], [{}], NOW + 1, write=True, budget=None)  # 6..11 built later
    make_stale(range(12))
    second = ss.refresh([shards_of(tmp_path)], [{}], NOW + 2, write=True, budget=25)[0]
    assert (second.rebuilt, second.stale) == (3, 9)  # 11 names a shard: the third passes the budget
    now_current = {int(s.sub, 16) for s in shards_of(tmp_path).shards if s.current}
    assert len(now_current) == 3 and now_current < set(range(6))  # the oldest-built first
    assert build(tmp_path, budget=None).stale == 0


def summarised_then_grown(tmp_path, shards: int, added: int) -> BlockPool:
    """A pool of ``shards`` shards of 10 blocks each, summarised, then ``added`` blocks more in each
    (so every summary is stale)."""
    pool = make_pool(tmp_path)
    for sub in range(shards):
        for i in range(10):
            put(pool, bytes([sub, i]) + bytes(30))
    build(tmp_path)
    for sub in range(shards):
        for i in range(added):
            put(pool, bytes([sub, 50 + i]) + bytes(30))
    return pool


def test_stale_shards_past_the_budget_are_counted_so_usage_does_not_lag(tmp_path):
    """What writers added to shards a run does not rebuild still counts: their names are listed and
    counted (nothing lstat'ed), each at its summary's mean size, which is what a fingerprint's block
    files all have; a quota is then held against the pool as it is, not as it was summarised."""
    summarised_then_grown(tmp_path, shards=12, added=1)
    sums = shards_of(tmp_path)
    assert sums.live_count == 120  # as summarised
    tally = ss.refresh([sums], [{}], NOW + 1, write=True, budget=1)[0]
    assert tally.rebuilt == 1 and tally.stale == 11 and tally.counted >= 11 * 11
    assert sums.live_count == 132
    assert sums.live_fx == 132 * sums.shards[0].header.live_fx // sums.shards[0].header.live_count


def test_stale_shards_past_the_count_budget_are_estimated_from_a_sample_of_them(tmp_path):
    """Past the count budget, the stale shards not counted are taken to have gained what the
    counted shard nearest to them in build order gained: writers' keys are hashes, spread evenly,
    so a pool whose every shard gained alike is estimated exactly, from a listing of a few shards."""
    pool = summarised_then_grown(tmp_path, shards=40, added=3)
    sums = shards_of(tmp_path)
    tally = ss.refresh([sums], [{}], NOW + 1, write=True, budget=1, count_budget=50)[0]
    assert tally.rebuilt == 1 and tally.stale == 39
    assert 1 <= 39 - tally.estimated <= 5 and tally.counted <= 5 * 13  # a few shards listed, not 39
    assert sums.live_count == 40 * 13
    per = sums.shards[0].header.live_fx // sums.shards[0].header.live_count
    assert sums.live_fx == 40 * 13 * per
    # within the count budget every stale shard is counted, none estimated
    sums = shards_of(tmp_path)
    ss.refresh([sums], [{}], NOW + 2, write=True, budget=None)
    for sub in range(0, 40, 2):
        put(pool, bytes([sub, 90]) + bytes(30))
    sums = shards_of(tmp_path)
    tally = ss.refresh([sums], [{}], NOW + 3, write=True, budget=0, count_budget=10**6)[0]
    assert tally.estimated == 0 and sums.live_count == 40 * 13 + 20  # within the budget: all counted


def test_own_unlinks_keep_a_summary_current_another_writers_publication_during_the_run_does_not(
        tmp_path, monkeypatch):
    """The evictor records the mtime its own unlinks leave, so they do not make the shard stale;
    but a block another process publishes in that shard while the run unlinks there must leave
    the summary stale, or the pool's usage would lack it until the summary's maximum age."""
    pool = make_pool(tmp_path)
    old = [bytes([0x3C, i]) + bytes(30) for i in range(6)]  # one shard
    for i, k in enumerate(old):
        put(pool, k, t_ns=NOW_NS - 10**12 + i)
    build(tmp_path)
    (report,) = evict_pool([str(tmp_path)], 5 * FILE, 0.8, 0, 0.0, now=NOW)  # frees 2
    assert report.evicted_blocks == 2
    assert shards_of(tmp_path).shards[0].current  # its own unlinks: still current

    real = eviction._Fresh.promised
    late = bytes([0x3C, 0x77]) + bytes(30)
    asked = []

    def publish_between_unlinks(fresh, n):
        asked.append(n)
        if len(asked) == 2:  # after the run's first unlink, before its second: another owner publishes
            put(pool, late, t_ns=NOW_NS)
        return real(fresh, n)

    monkeypatch.setattr(eviction._Fresh, "promised", publish_between_unlinks)
    (report,) = evict_pool([str(tmp_path)], 3 * FILE, 0.7, 0, 0.0, now=NOW)
    assert report.evicted_blocks == 2 and len(asked) == 2
    monkeypatch.undo()
    sums = shards_of(tmp_path)
    assert not sums.shards[0].current
    assert late in present(tmp_path)
    (again,) = evict_pool([str(tmp_path)], 0, 0.9, 0, 0.0, now=NOW + 1)  # usage as the next run sees it
    assert again.scanned_blocks == len(present(tmp_path))


def test_a_shard_listing_removes_stale_temporary_files(tmp_path):
    pool = make_pool(tmp_path)
    k = bytes([0x5A]) * 32
    put(pool, k)
    d = os.path.dirname(pool.path_for(k))
    dead = os.path.join(d, f".tmp-{k.hex()}-otherhost-1-abcd")
    open(dead, "wb").close()
    young = build(tmp_path)
    assert young.tmp_removed == 0 and shards_of(tmp_path).shards[0].header.tmp_files == 1
    later = time.time() + STALE_FOREIGN_TMP_S + 10  # a foreign writer's, older than every age rule by then
    tally = ss.refresh([shards_of(tmp_path)], [{}], later, write=True)[0]  # current, but it counted one
    assert tally.tmp_removed == 1 and not os.path.exists(dead)
    assert shards_of(tmp_path).shards[0].header.tmp_files == 0


# -- runs whose work follows the blocks they free -------------------------------------------------
def test_a_run_freeing_k_blocks_of_a_large_pool_opens_and_lstats_about_k_files(tmp_path, monkeypatch):
    pool = make_pool(tmp_path)
    rng = random.Random(7)
    n, k = 20_000, 2_500
    keys = [rkey(rng) for _ in range(n)]
    for i, key in enumerate(keys):
        put(pool, key, t_ns=NOW_NS - (n - i) * 10**9)  # keys[0] oldest
    evict(str(tmp_path), 0, 0.5, 0, 1, now=NOW)  # no quota: builds the summaries, removes nothing
    assert present(tmp_path) == set(keys)
    calls = Calls(monkeypatch)
    rep = evict(str(tmp_path), quota_bytes=(n - k) * FILE, low_watermark=1.0, min_free_bytes=0, grace_s=1, now=NOW)
    monkeypatch.undo()
    assert rep.scanned_blocks == n and rep.evicted_blocks == k and rep.reached_target
    assert rep.names_listed == 0 and calls.n["scandir"] == 0  # no key directory listed
    shards = len({key.hex()[:2] for key in keys})
    # a whole-pool scan opens every header (20,000); this run reads the summaries and its window
    assert calls.n["open"] + calls.n["lstat"] <= 3 * k + 3 * shards, calls.n
    assert present(tmp_path) == set(keys[k:])  # the k least recently used
    again = evict(str(tmp_path), 0, 0.5, 0, 1, now=NOW)
    assert again.summaries_stale == 0 and again.scanned_blocks == n - k  # its own unlinks kept them current


def _chains(pool: BlockPool, rng: random.Random, n: int, length: int) -> list[list[bytes]]:
    chains = []
    for c in range(n):
        chain = [rkey(rng) for _ in range(length)]
        for j, key in enumerate(chain):  # a tail is published after its head
            put(pool, key, ZERO_KEY if j == 0 else chain[j - 1], t_ns=NOW_NS - 10**12 + c * 10**6 + j)
        chains.append(chain)
    return chains


def _whole(chains: list[list[bytes]], left: set[bytes]) -> bool:
    """Every chain left is a prefix: no block outlives its parent."""
    return all(all(k in left for k in chain[:j]) for chain in chains for j, k in enumerate(chain) if k in left)


def test_lru_and_tails_before_heads_in_a_window_smaller_than_the_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(eviction, "WINDOW_MIN", 8)
    pool = make_pool(tmp_path)
    rng = random.Random(3)
    chains = _chains(pool, rng, 60, 5)
    order = list(range(60))
    rng.shuffle(order)  # chain order[0] used longest ago
    log = RecencyLog(str(tmp_path), "owner", flush_interval_s=0)
    for n, c in enumerate(order):
        log.touch(chains[c], NOW_NS - 10**11 + n * 10**9)  # head first: the writer rule
    log.close()
    rep = evict(str(tmp_path), quota_bytes=150 * FILE, low_watermark=1.0, min_free_bytes=0, grace_s=1, now=NOW)
    assert rep.evicted_blocks == 150 and rep.reached_target
    left = present(tmp_path)
    assert _whole(chains, left)
    assert left == {k for c in order[30:] for k in chains[c]}  # the 30 least recently used chains went


def test_promised_blocks_stay_though_their_summary_says_they_are_old(tmp_path, monkeypatch):
    monkeypatch.setattr(eviction, "WINDOW_MIN", 4)
    pool = make_pool(tmp_path)
    chains = _chains(pool, random.Random(5), 20, 3)
    evict(str(tmp_path), 0, 0.5, 0, 1, now=NOW)  # summaries built before the promise
    log = RecencyLog(str(tmp_path), "loader", flush_interval_s=0)
    log.touch(chains[0], NOW_NS - 5 * 10**9)  # the oldest chain, promised 5 s ago
    log.close()
    rep = evict(str(tmp_path), quota_bytes=FILE, low_watermark=1.0, min_free_bytes=0, grace_s=30, now=NOW)
    left = present(tmp_path)
    assert left == set(chains[0]) and rep.protected_blocks == 3 and not rep.reached_target


def test_expire_takes_the_old_prefix_of_each_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(eviction, "WINDOW_MIN", 4)
    pool = make_pool(tmp_path)
    rng = random.Random(9)
    old = [rkey(rng) for _ in range(40)]
    new = [rkey(rng) for _ in range(40)]
    for key in old:
        put(pool, key, t_ns=NOW_NS - 7200 * 10**9)
    for key in new:
        put(pool, key, t_ns=NOW_NS - 60 * 10**9)
    rep = expire(str(tmp_path), max_age_s=3600, now=NOW, grace_s=1)
    assert rep.evicted_blocks == 40 and present(tmp_path) == set(new)


def test_several_roots_planned_together_in_a_small_window(tmp_path, monkeypatch):
    monkeypatch.setattr(eviction, "WINDOW_MIN", 8)
    roots = (tmp_path / "a", tmp_path / "b")
    pool = make_pool(*roots)
    rng = random.Random(11)
    chains = _chains(pool, rng, 40, 4)  # a chain's blocks are spread over both roots
    log = RecencyLog([str(r) for r in roots], "owner", flush_interval_s=0)
    for n, chain in enumerate(chains):
        log.touch(chain, NOW_NS - 10**11 + n * 10**9)
    log.close()
    before = {str(r): len(present(r)) for r in roots}
    quota = min(before.values()) // 2 * FILE
    reports = evict_pool([str(r) for r in roots], quota, 1.0, 0, 1, now=NOW)
    assert all(rep.reached_target for rep in reports)
    assert all(len(present(r)) * FILE <= quota for r in roots)
    assert _whole(chains, present(*roots))


# -- stats ------------------------------------------------------------------------------------------
def test_stats_reads_one_summary_per_shard_and_says_how_current_it_is(tmp_path, monkeypatch):
    pool = make_pool(tmp_path)
    rng = random.Random(13)
    keys = [rkey(rng) for _ in range(2000)]
    for key in keys:
        put(pool, key)
    evict(str(tmp_path), 0, 0.5, 0, 1, now=NOW)
    shards = len({key.hex()[:2] for key in keys})
    calls = Calls(monkeypatch)
    result = stats(str(tmp_path), now=NOW)
    monkeypatch.undo()
    assert result["blocks"] == 2000 and result["bytes"] == 2000 * FILE
    assert result["summaries"] == {"shards": shards, "stale": 0, "listed": 0, "oldest_built_ns": NOW_NS}
    assert calls.n["scandir"] == 0 and calls.n["open"] <= shards + 20, calls.n  # not one per block
    extra = bytes([keys[0][0]]) + bytes(31)
    put(pool, extra)  # published since: its shard's summary lags until the evictor rebuilds it
    lagging = stats(str(tmp_path), now=NOW)
    assert lagging["blocks"] == 2000 and lagging["summaries"]["stale"] == 1
    assert f"1 of {shards} stale" in format_stats(lagging)
    assert stats(str(tmp_path), now=NOW, exact=True)["blocks"] == 2001

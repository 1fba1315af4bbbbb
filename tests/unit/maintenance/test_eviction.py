"""Eviction: budget, LRU order, chain tails first, grace, a lock that survives its holder, pools of
several roots planned as one, and clocks that run ahead."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import REPO

from gds_kv_connector.maintenance import eviction
from gds_kv_connector.maintenance.capacity import CapacityGuard
from gds_kv_connector.maintenance.eviction import EvictLock, evict, evict_pool, expire
from gds_kv_connector.store.pool import TMP_YOUNG_S, BlockPool
from gds_kv_connector.util.host import HOST_TAG
from gds_kv_connector.format.layout import TMP_PREFIX
from gds_kv_connector.format.records import ZERO_KEY, BlockHeader
from gds_kv_connector.maintenance.pool_scan import quarantine_dir, scan_pool
from gds_kv_connector.maintenance.recency import RecencyLog

PAYLOAD = 4096
FILE = 8192  # header page + one payload page
T0 = time.time_ns() + 10 * 10**9  # touches after every header's created_ns
LATER = T0 / 1e9 + 10_000  # "now" for eviction runs: everything is old unless the grace says otherwise


def key(i: int) -> bytes:
    return bytes([0xAA]) + i.to_bytes(31, "big")


def make_pool(root) -> BlockPool:
    return BlockPool((str(root),), b"\x11" * 32, PAYLOAD, 4, geometry_note="test")


def put(pool: BlockPool, k: bytes, parent: bytes = ZERO_KEY, created_ns: int = 1) -> None:
    """Publish a block whose header says it was created at ``created_ns``."""
    header = BlockHeader(pool.fingerprint, k, PAYLOAD, 0, 1, 4, created_ns, parent)
    fd, tmp = pool.create_tmp(k, header)
    os.pwrite(fd, b"\x5a" * PAYLOAD, 4096)
    assert pool.publish(fd, tmp, k)
    os.utime(pool.path_for(k), ns=(1, 1))  # recency comes from the header and the access log only


def touch(root, stamps: dict[bytes, int]) -> None:
    rl = RecencyLog(str(root), "tester", flush_interval_s=0)
    for k, ts in stamps.items():
        rl.touch([k], ts)
    rl.close()


def present(root) -> set[bytes]:
    return {b.key for b in scan_pool(str(root)).blocks}


def test_quota_enforced_down_to_low_watermark(tmp_path):
    pool = make_pool(tmp_path)
    for i in range(20):
        put(pool, key(i))
    rep = evict(str(tmp_path), quota_bytes=10 * FILE, low_watermark=0.5, min_free_bytes=0, grace_s=60, now=LATER)
    assert not rep.skipped and rep.reason == "quota"
    assert rep.scanned_bytes == 20 * FILE and rep.target_bytes == 15 * FILE
    assert rep.evicted_blocks == 15 and rep.reached_target
    assert len(present(tmp_path)) == 5
    again = evict(str(tmp_path), 10 * FILE, 0.5, 0, 60, now=LATER)
    assert again.target_bytes == 0 and again.evicted_blocks == 0


def test_least_recently_used_go_first(tmp_path):
    pool = make_pool(tmp_path)
    for i in range(8):
        put(pool, key(i))
    order = [5, 2, 7, 0, 3, 1, 6, 4]  # oldest access first
    touch(tmp_path, {key(i): T0 + n * 10**9 for n, i in enumerate(order)})
    rep = evict(str(tmp_path), quota_bytes=6 * FILE, low_watermark=0.5, min_free_bytes=0, grace_s=1, now=LATER)
    assert rep.evicted_blocks == 5
    assert present(tmp_path) == {key(i) for i in order[5:]}


def test_created_ns_counts_as_recency(tmp_path):
    pool = make_pool(tmp_path)
    put(pool, key(1), created_ns=T0)
    put(pool, key(2), created_ns=T0 + 10**9)
    evict(str(tmp_path), quota_bytes=2 * FILE - 1, low_watermark=0.9, min_free_bytes=0, grace_s=1, now=LATER)
    assert present(tmp_path) == {key(2)}


def test_tails_are_evicted_before_their_parents(tmp_path):
    pool = make_pool(tmp_path)
    put(pool, key(0))
    put(pool, key(1), parent=key(0))
    put(pool, key(2), parent=key(1))
    put(pool, key(9))
    # the head was used long ago; plain LRU would remove it first and orphan the chain
    touch(tmp_path, {key(0): T0, key(1): T0 + 1, key(9): T0 + 5, key(2): T0 + 10})
    rep = evict(str(tmp_path), quota_bytes=3 * FILE, low_watermark=0.67, min_free_bytes=0, grace_s=1,
                now=LATER)
    assert rep.evicted_blocks == 2
    assert present(tmp_path) == {key(0), key(1)}
    # the whole chain goes tail first when more must go
    evict(str(tmp_path), quota_bytes=FILE, low_watermark=0.5, min_free_bytes=0, grace_s=1, now=LATER)
    assert present(tmp_path) == set()


def test_grace_protects_recent_blocks_and_their_ancestors(tmp_path):
    pool = make_pool(tmp_path)
    put(pool, key(0))
    put(pool, key(1), parent=key(0))
    put(pool, key(5))
    now = T0 / 1e9 + 100
    touch(tmp_path, {key(1): T0 + 90 * 10**9, key(5): T0})  # the tail was used 10 s ago
    rep = evict(str(tmp_path), quota_bytes=FILE, low_watermark=0.5, min_free_bytes=0, grace_s=30, now=now)
    assert present(tmp_path) == {key(0), key(1)}  # the old head stays: it leads to a protected tail
    assert rep.evicted_blocks == 1 and not rep.reached_target and rep.protected_blocks == 2


def test_low_free_space_triggers_eviction(tmp_path, monkeypatch):
    pool = make_pool(tmp_path)
    for i in range(4):
        put(pool, key(i))
    monkeypatch.setattr(eviction, "_free_bytes", lambda root: FILE)
    rep = evict(str(tmp_path), quota_bytes=0, low_watermark=0.5, min_free_bytes=2 * FILE, grace_s=1, now=LATER)
    assert rep.reason == "min_free" and rep.target_bytes == 3 * FILE and rep.evicted_blocks == 3


def test_expire_removes_old_chains_from_the_tail(tmp_path):
    pool = make_pool(tmp_path)
    put(pool, key(0))
    put(pool, key(1), parent=key(0))
    put(pool, key(2), parent=key(0))
    put(pool, key(3))
    now = T0 / 1e9 + 1000
    touch(tmp_path, {key(2): T0 + 900 * 10**9})
    rep = expire(str(tmp_path), max_age_s=500, now=now)
    assert present(tmp_path) == {key(0), key(2)} and rep.evicted_blocks == 2


def test_dry_run_removes_nothing(tmp_path):
    pool = make_pool(tmp_path)
    for i in range(4):
        put(pool, key(i))
    rep = evict(str(tmp_path), FILE, 0.5, 0, 1, now=LATER, dry_run=True)
    assert rep.evicted_blocks == 4 and len(present(tmp_path)) == 4


def test_replaced_file_is_not_evicted(tmp_path, monkeypatch):
    pool = make_pool(tmp_path)
    put(pool, key(1))
    real_read = eviction._Reader.read

    def read_then_replace(self, block):
        facts = real_read(self, block)
        os.unlink(pool.path_for(key(1)))  # evicted by someone else and republished since it was read
        put(pool, key(1))
        return facts
    monkeypatch.setattr(eviction._Reader, "read", read_then_replace)
    rep = evict(str(tmp_path), 1, 0.5, 0, 1, now=LATER)
    assert rep.failed == 1 and present(tmp_path) == {key(1)}


def test_second_evictor_skips_while_the_lock_is_held(tmp_path):
    pool = make_pool(tmp_path)
    put(pool, key(1))
    with EvictLock(str(tmp_path)) as holder:
        assert holder.acquire()
        rep = evict(str(tmp_path), 1, 0.5, 0, 1, now=LATER)
        assert rep.skipped and rep.evicted_blocks == 0
    assert evict(str(tmp_path), 1, 0.5, 0, 1, now=LATER).evicted_blocks == 1


def test_killed_holder_does_not_block_the_next_evictor(tmp_path):
    pool = make_pool(tmp_path)
    put(pool, key(1))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from gds_kv_connector.maintenance.eviction import EvictLock; "
         "lock = EvictLock(sys.argv[1]); assert lock.acquire(); print('locked', flush=True); time.sleep(60)",
         str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert evict(str(tmp_path), 1, 0.5, 0, 1, now=LATER).skipped
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    rep = evict(str(tmp_path), 1, 0.5, 0, 1, now=LATER)
    assert not rep.skipped and rep.evicted_blocks == 1


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EBADF], ids=["ENOLCK", "EBADF (NFS, read-only fd)"])
def test_exclusive_file_lock_when_flock_is_unsupported(tmp_path, monkeypatch, err):
    def no_flock(fd, op):
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(eviction.fcntl, "flock", no_flock)
    make_pool(tmp_path)
    first, second = EvictLock(str(tmp_path)), EvictLock(str(tmp_path))
    assert first.acquire()
    assert not second.acquire()
    first.release()
    assert second.acquire()
    second.release()
    # a lock file of a local pid that is not running is broken once it is a minute old (younger, the
    # pid may be a live evictor's in another pid namespace); a fresh foreign one is respected
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with open(first.excl_path, "w") as fh:
        json.dump({"host": eviction.HOST, "pid": int(dead.stdout), "time": time.time(), "token": "x"}, fh)
    assert not first.acquire()
    minute = time.time() - eviction.EXCL_LOCK_PID_CHECK_S - 5
    os.utime(first.excl_path, (minute, minute))
    assert first.acquire()
    first.release()
    os.mkfifo(first.excl_path)  # a FIFO at the lock's name: no hang, and broken once old
    assert not first.acquire()
    old = time.time() - 2 * eviction.EXCL_LOCK_STALE_S
    os.utime(first.excl_path, (old, old))
    assert first.acquire()
    first.release()
    with open(first.excl_path, "w") as fh:
        json.dump({"host": "elsewhere", "pid": 1, "time": time.time(), "token": "y"}, fh)
    assert not first.acquire()
    old = time.time() - 2 * eviction.EXCL_LOCK_STALE_S
    os.utime(first.excl_path, (old, old))
    assert first.acquire()
    first.release()


def test_tidies_stale_tmp_and_old_quarantine(tmp_path):
    pool = make_pool(tmp_path)
    put(pool, key(1))
    d = pool.dir_for(key(1))
    dead_tmp = os.path.join(d, f"{TMP_PREFIX}{key(1).hex()}-{HOST_TAG}-999999999-abcd")
    live_tmp = os.path.join(d, f"{TMP_PREFIX}{key(1).hex()}-{HOST_TAG}-{os.getpid()}-abcd")
    for p in (dead_tmp, live_tmp):
        open(p, "wb").close()
    qdir = quarantine_dir(str(tmp_path))
    old_q = os.path.join(qdir, f"{key(2).hex()}.{time.time_ns() - 2 * 86_400 * 10**9}.bad")
    new_q = os.path.join(qdir, f"{key(3).hex()}.{time.time_ns()}.bad")
    for p in (old_q, new_q):
        open(p, "wb").close()
    rep = evict(str(tmp_path), 0, 0.5, 0, 1)
    assert rep.tmp_removed == 0 and rep.quarantine_removed == 1  # young: its writer may be in another pid namespace
    assert os.path.exists(dead_tmp) and os.path.exists(live_tmp)
    assert not os.path.exists(old_q) and os.path.exists(new_q)
    rep = evict(str(tmp_path), 0, 0.5, 0, 1, now=time.time() + TMP_YOUNG_S + 5)
    assert rep.tmp_removed == 1
    assert not os.path.exists(dead_tmp) and os.path.exists(live_tmp)


def test_capacity_guard_evicts_in_the_background(tmp_path):
    pool = make_pool(tmp_path)
    rl = RecencyLog(str(tmp_path), "guard", flush_interval_s=0)
    guard = CapacityGuard([str(tmp_path)], quota_bytes=10 * FILE, low_watermark=0.5, min_free_bytes=0,
                          grace_s=0, recency=rl, check_interval_s=3600)
    try:
        for i in range(12):
            put(pool, key(i))
        rl.touch([key(0)])  # this owner's own unflushed touch is flushed before the run
        guard.note_saved(12 * FILE)
        assert guard.check_now(timeout=10)
        rep = guard.last_reports[0]
        assert rep.evicted_blocks == 7 and len(present(tmp_path)) == 5
        assert key(0) in present(tmp_path)
    finally:
        guard.close()
        rl.close()


def test_capacity_guard_is_inert_without_a_budget(tmp_path):
    guard = CapacityGuard([str(tmp_path)], quota_bytes=0, low_watermark=0.9, min_free_bytes=0, grace_s=1)
    guard.note_saved(1 << 40)
    assert not guard.enabled and guard.check_now() and guard.last_reports == []
    guard.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_unreadable_header_is_evictable_without_parent(tmp_path, damage):
    pool = make_pool(tmp_path)
    put(pool, key(1))
    with open(pool.path_for(key(1)), "r+b") as fh:
        if damage == "garbage":
            fh.write(b"garbage" * 10)
        else:
            fh.truncate(100)
    rep = evict(str(tmp_path), 1, 0.5, 0, 1, now=LATER)
    assert rep.unreadable_headers == 1 and rep.evicted_blocks == 1


def test_blocks_cut_off_from_their_head_go_first(tmp_path):
    pool = make_pool(tmp_path)
    put(pool, key(0))
    put(pool, key(1), parent=key(0))
    put(pool, key(2), parent=key(1))
    put(pool, key(3), parent=key(2))
    put(pool, key(9))
    os.unlink(pool.path_for(key(1)))  # key 2 and 3 can no longer be reached by any lookup
    touch(tmp_path, {key(9): T0, key(0): T0 + 1, key(2): T0 + 5, key(3): T0 + 6})
    rep = evict(str(tmp_path), quota_bytes=3 * FILE, low_watermark=0.67, min_free_bytes=0, grace_s=1, now=LATER)
    assert rep.evicted_blocks == 2 and present(tmp_path) == {key(0), key(9)}


# -- several roots: a key lives under root key[0] % 2 here, so a chain's blocks are spread over both --
def rkey(root: int, i: int) -> bytes:
    return bytes([0xA0 + root]) + i.to_bytes(31, "big")


def two_roots(tmp_path) -> tuple[BlockPool, list[str]]:
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    for r in roots:
        os.mkdir(r)
    return BlockPool(tuple(roots), b"\x11" * 32, PAYLOAD, 4, geometry_note="test"), roots


def touch_pool(roots: list[str], stamps: dict[bytes, int]) -> None:
    rl = RecencyLog(tuple(roots), "tester", flush_interval_s=0)  # each record goes to its key's root
    for k, ts in stamps.items():
        rl.touch([k], ts)
    rl.close()


def record_calls(monkeypatch, name: str) -> list[bytes]:
    """The keys of the blocks eviction's function ``name`` is called with, in order; the function
    still runs."""
    keys: list[bytes] = []
    real = getattr(eviction, name)

    def recorded(block, *args, **kwargs):
        keys.append(block.key)
        return real(block, *args, **kwargs)
    monkeypatch.setattr(eviction, name, recorded)
    return keys


def record_unlinks(monkeypatch) -> list[bytes]:
    return record_calls(monkeypatch, "_remove_if_same")


def split_chains(tmp_path) -> tuple[list[str], bytes, bytes, bytes, bytes]:
    """Two roots holding a hot and a cold chain, each with its head in root 0 and its tail in
    root 1; the hot head was read long ago, so only its tail makes it recent."""
    pool, roots = two_roots(tmp_path)
    hot_head, hot_tail, cold_head, cold_tail = rkey(0, 1), rkey(1, 1), rkey(0, 2), rkey(1, 2)
    for head, tail in ((hot_head, hot_tail), (cold_head, cold_tail)):
        put(pool, head)
        put(pool, tail, parent=head)
    touch_pool(roots, {hot_head: T0, cold_head: T0 + 2, cold_tail: T0 + 3, hot_tail: T0 + 100})
    return roots, hot_head, hot_tail, cold_head, cold_tail


def test_chains_across_roots_are_planned_as_one_pool(tmp_path, monkeypatch):
    roots, hot_head, hot_tail, cold_head, cold_tail = split_chains(tmp_path)
    order = record_unlinks(monkeypatch)
    reports = evict_pool(roots, quota_bytes=2 * FILE - 8, low_watermark=0.75, min_free_bytes=0, grace_s=1,
                         now=LATER)
    assert [(r.target_bytes > 0, r.evicted_blocks, r.reached_target) for r in reports] == [(True, 1, True)] * 2
    assert order == [cold_tail, cold_head]  # tail first, though it lives in the other root
    assert present(roots[0]) == {hot_head} and present(roots[1]) == {hot_tail}


def test_parent_in_another_root_does_not_make_a_block_dangling(tmp_path):
    pool, roots = two_roots(tmp_path)
    head, tail, lone = rkey(0, 1), rkey(1, 1), rkey(1, 2)
    put(pool, head)
    put(pool, tail, parent=head)
    put(pool, lone)
    touch_pool(roots, {head: T0 + 100, tail: T0 + 100, lone: T0})
    reports = evict_pool(roots, quota_bytes=2 * FILE - 8, low_watermark=0.75, min_free_bytes=0, grace_s=1,
                         now=LATER)
    assert reports[0].target_bytes == 0 and reports[1].evicted_blocks == 1
    assert present(roots[0]) == {head} and present(roots[1]) == {tail}  # the cold block went, not the tail


def test_root_within_budget_gives_up_a_tail_only_to_uncover_an_older_head(tmp_path, monkeypatch):
    pool, roots = two_roots(tmp_path)
    hot_head, hot_tail, cold_head, cold_tail = rkey(0, 1), rkey(1, 1), rkey(0, 2), rkey(1, 2)
    busy, busier, lone = rkey(0, 3), rkey(0, 4), rkey(1, 3)
    for head, tail in ((hot_head, hot_tail), (cold_head, cold_tail)):
        put(pool, head)
        put(pool, tail, parent=head)
    for k in (busy, busier, lone):
        put(pool, k)
    touch_pool(roots, {lone: T0 - 1, hot_head: T0, cold_head: T0 + 2, cold_tail: T0 + 3, hot_tail: T0 + 100,
                       busy: T0 + 200, busier: T0 + 300})
    order = record_unlinks(monkeypatch)
    # root 0 (4 blocks) must free one; root 1 (3 blocks) is within its budget
    reports = evict_pool(roots, quota_bytes=int(3.5 * FILE), low_watermark=0.9, min_free_bytes=0, grace_s=1,
                         now=LATER)
    assert reports[0].reached_target and reports[1].target_bytes == 0
    assert order == [cold_tail, cold_head]  # not the hot head, and not its own coldest block (lone)
    assert present(roots[0]) == {hot_head, busy, busier} and present(roots[1]) == {hot_tail, lone}
    assert [r.evicted_blocks for r in reports] == [1, 1]


def test_pool_run_takes_every_root_lock_or_none(tmp_path):
    pool, roots = two_roots(tmp_path)
    put(pool, rkey(0, 1))
    put(pool, rkey(1, 1))
    with EvictLock(roots[1]) as holder:
        assert holder.acquire()
        reports = evict_pool(roots, 1, 0.5, 0, 1, now=LATER)
        assert all(r.skipped for r in reports) and present(roots[0]) == {rkey(0, 1)}
        with EvictLock(roots[0]) as first:
            assert first.acquire()  # the skipped run let go of the lock it did get
    assert [r.evicted_blocks for r in evict_pool(roots, 1, 0.5, 0, 1, now=LATER)] == [1, 1]


def test_copy_of_a_key_in_the_wrong_root_goes_first(tmp_path):
    pool, roots = two_roots(tmp_path)
    k, cold = rkey(0, 1), rkey(1, 2)
    put(pool, k)
    put(pool, cold)
    # written while the pool had root 1 alone: no lookup reads it now that k belongs to root 0
    put(BlockPool((roots[1],), pool.fingerprint, PAYLOAD, 4), k, created_ns=T0 + 100)
    touch_pool(roots, {k: T0 + 100, cold: T0})
    reports = evict_pool(roots, quota_bytes=2 * FILE - 8, low_watermark=0.75, min_free_bytes=0, grace_s=1,
                         now=LATER)
    assert reports[1].evicted_blocks == 1 and present(roots[1]) == {cold}
    assert present(roots[0]) == {k}


def test_times_from_a_clock_far_ahead_protect_nothing(tmp_path):
    pool = make_pool(tmp_path)
    now_ns = int(LATER * 1e9)
    decade = 10 * 365 * 86_400 * 10**9
    put(pool, key(0))
    put(pool, key(1), parent=key(0), created_ns=now_ns + decade)  # its writer's clock is ten years ahead
    put(pool, key(2))
    os.utime(pool.path_for(key(2)), ns=(1, now_ns + decade))
    put(pool, key(3), created_ns=now_ns + 60 * 10**9)  # a minute ahead: as new as now
    rep = evict(str(tmp_path), quota_bytes=1, low_watermark=0.5, min_free_bytes=0, grace_s=30, now=LATER)
    assert present(tmp_path) == {key(3)} and rep.protected_blocks == 1
    # ...and only until that minute has passed, not for as long as the clock stays ahead
    assert expire(str(tmp_path), max_age_s=60, now=LATER + 200).evicted_blocks == 1


def test_capacity_guard_runs_one_eviction_over_every_root(tmp_path, monkeypatch):
    """The serving process's evictor plans a multi-root pool as one: a cold chain whose tail lives in
    the other root goes tail first, and the hot head, as recent as its tail in root 1, stays (per
    root, root 0 saw an old head without descendants and removed it)."""
    from gds_kv_connector.maintenance import capacity

    roots, hot_head, hot_tail, cold_head, cold_tail = split_chains(tmp_path)
    real = capacity.evict_pool
    monkeypatch.setattr(capacity, "evict_pool", lambda *a, **kw: real(*a, now=LATER, **kw))
    order = record_unlinks(monkeypatch)
    guard = CapacityGuard(roots, quota_bytes=2 * FILE - 8, low_watermark=0.75, min_free_bytes=0, grace_s=1,
                          check_interval_s=3600)
    try:
        assert guard.check_now(timeout=10)
        assert [r.evicted_blocks for r in guard.last_reports] == [1, 1]
        assert order == [cold_tail, cold_head]
        assert present(roots[0]) == {hot_head} and present(roots[1]) == {hot_tail}
    finally:
        guard.close()


def test_a_long_lived_recency_index_forgets_evicted_blocks(tmp_path):
    """The serving evictor keeps one RecencyIndex per root for the process's life: it holds the
    keys of the blocks a run scanned (and touches newer than the scan), not every key any owner
    ever touched (a new owner per round, as restarts make, and logs folded away)."""
    from gds_kv_connector.maintenance.recency import RecencyIndex

    pool = make_pool(tmp_path)
    index = RecencyIndex(str(tmp_path))
    for rnd in range(5):
        keys = [key(100 * rnd + i) for i in range(20)]
        for k in keys:
            put(pool, k)
        rl = RecencyLog(str(tmp_path), f"owner-{rnd}", flush_interval_s=0)
        rl.touch(keys, T0 + rnd)
        rl.close()
        rep = evict(str(tmp_path), 5 * FILE, 0.5, 0, 1, now=LATER, recency=index)
        assert rep.evicted_blocks > 0
        assert len(index.latest) <= rep.scanned_blocks
    assert len(index.latest) < 40  # 100 keys were touched over the rounds


def test_closing_the_capacity_guard_does_not_wait_for_a_long_run(tmp_path, monkeypatch):
    """Shutdown joined the evictor without a limit: a run scanning a large shared pool held it."""
    import threading

    from gds_kv_connector.maintenance import capacity

    release = threading.Event()
    started = threading.Event()

    def slow_run(*a, **kw):
        started.set()
        release.wait(30)
        return []
    monkeypatch.setattr(capacity, "evict_pool", slow_run)
    guard = CapacityGuard([str(tmp_path)], quota_bytes=10 * FILE, low_watermark=0.5, min_free_bytes=0,
                          grace_s=1, check_interval_s=3600)
    try:
        guard.note_saved(10 * FILE)
        assert started.wait(10)
        t0 = time.monotonic()
        guard.close(timeout=0.2)
        assert time.monotonic() - t0 < 5
    finally:
        release.set()


def test_roots_on_one_filesystem_free_its_shortfall_once(tmp_path, monkeypatch):
    """Two roots on one filesystem short of min_free by 5 blocks: each planned the whole shortfall,
    and together they removed twice what was needed."""
    pool, roots = two_roots(tmp_path)
    for r in range(2):
        for i in range(10):
            put(pool, rkey(r, i))
    capacity_bytes = 28 * FILE  # 20 blocks used: 8 blocks free

    def free(root):
        return capacity_bytes - sum(scan_pool(r).block_bytes for r in roots)
    monkeypatch.setattr(eviction, "_free_bytes", free)
    reports = evict_pool(roots, 0, 0.8, 10 * FILE, 1, now=LATER)  # 12.5 blocks must be free: 5 go
    assert 5 <= sum(r.evicted_blocks for r in reports) <= 6  # whole blocks, each root rounding up


def test_an_unreadable_directory_makes_no_block_cut_off_and_forgets_no_record(tmp_path, monkeypatch):
    """A chain whose head sits in a key directory the evictor cannot read: its tail was taken for
    cut off and evicted first, and the head's access records were folded away."""
    from gds_kv_connector.maintenance.recency import load_recency

    root = str(tmp_path)
    pool = make_pool(tmp_path)
    head = bytes([0xBB]) + bytes(31)
    t1, t2, old = (key(i) for i in (1, 2, 3))
    put(pool, head)
    put(pool, t1, parent=head)
    put(pool, t2, parent=t1)
    put(pool, old)
    touch(root, {old: T0, head: T0 + 5 * 10**9, t1: T0 + 5 * 10**9, t2: T0 + 6 * 10**9})
    real = os.scandir
    hidden = os.path.dirname(pool.path_for(head))

    def scandir(path="."):
        if str(path) == hidden:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path)
    monkeypatch.setattr(os, "scandir", scandir)
    rep = evict(root, quota_bytes=3 * FILE - 1, low_watermark=0.99, min_free_bytes=0, grace_s=1,
                now=LATER + 2 * eviction.LOG_FOLD_AGE_S)
    monkeypatch.setattr(os, "scandir", real)
    assert rep.evicted_blocks == 1 and present(root) == {head, t1, t2}  # the oldest went, not the tail
    assert head in load_recency(root)


def test_a_root_named_twice_is_planned_once(tmp_path):
    """`/a:/a`, or a root and a link to it: the second lock of one directory failed in the same
    process and every run was skipped."""
    pool = make_pool(tmp_path / "r")
    for i in range(10):
        put(pool, key(i))
    os.symlink(tmp_path / "r", tmp_path / "link")
    reports = evict_pool([str(tmp_path / "r"), str(tmp_path / "link")], 4 * FILE, 0.5, 0, 1, now=LATER)
    assert [r.skipped for r in reports] == [False, True]
    assert len(present(tmp_path / "r")) == 2


def test_the_eviction_lock_needs_no_write_permission(tmp_path, monkeypatch):
    """In a group-shared pool the lock file is the first evictor's, 0640 after its umask: another
    member could not open it for writing, and never evicted.  flock needs only a read descriptor."""
    make_pool(tmp_path)
    lock = EvictLock(str(tmp_path))
    assert lock.acquire()
    lock.release()
    real = os.open

    def no_write(path, flags, *a):
        if path == lock.path and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, flags, *a)
    monkeypatch.setattr(eviction.os, "open", no_write)
    assert lock.acquire()
    lock.release()


def test_the_serving_evictor_warns_once_about_entries_it_cannot_read(tmp_path, monkeypatch, caplog):
    """A key directory an owner cannot read (another owner's modes) makes its evictor count only the
    rest of the pool: said once, when it starts, not at every run."""
    import logging

    pool = make_pool(tmp_path)
    for i in range(3):
        put(pool, key(i))
    hidden = os.path.dirname(pool.path_for(key(0)))
    real = os.scandir

    def scandir(path="."):
        if str(path) == hidden:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path)
    monkeypatch.setattr(os, "scandir", scandir)
    guard = CapacityGuard([str(tmp_path)], quota_bytes=100 * FILE, low_watermark=0.5, min_free_bytes=0,
                          grace_s=1, check_interval_s=3600)
    try:
        with caplog.at_level(logging.WARNING, logger="gds_kv_connector.maintenance.capacity"):
            for _ in range(3):
                assert guard.check_now(timeout=10)
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "cannot be read by this process" in caplog.records[0].message
        assert guard.last_reports[0].unreadable_entries == 1
    finally:
        guard.close()

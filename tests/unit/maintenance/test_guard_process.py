"""CapacityGuard with eviction in a child process (TLLM_GDS_KV_EVICT_RUNNER=process): real children over
a real pool.  A child that cannot start, crashes or hangs fails only its run: saves go on, the failure
is counted and logged once, the next run works; the child takes the pool's eviction lock; a promise
this process could not write reaches the child, and its block stays."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import sys
import threading
import time

import pytest

from gds_kv_connector.config.settings import Settings
from gds_kv_connector.format.records import ZERO_KEY, BlockHeader
from gds_kv_connector.maintenance import recency
from gds_kv_connector.maintenance.capacity import CapacityGuard
from gds_kv_connector.maintenance.evict_process import MODULE
from gds_kv_connector.maintenance.eviction import EvictLock
from gds_kv_connector.maintenance.pool_scan import scan_pool
from gds_kv_connector.maintenance.recency import RecencyLog, load_recency
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.util.counters import Stats

PAYLOAD = 4096
FILE = 8192  # a block file: its header page and its payload
N_BLOCKS = 12


def make_pool(root: str) -> BlockPool:
    return BlockPool((root,), b"\x22" * 32, PAYLOAD, 4, geometry_note="guard-process")


def key(i: int) -> bytes:
    return bytes([1]) + i.to_bytes(31, "big")


def put(pool: BlockPool, k: bytes) -> None:
    """Publish a block as a save does, made old: only an access keeps it."""
    fd, tmp = pool.create_tmp(k, BlockHeader(pool.fingerprint, k, PAYLOAD, 0, 1, 4, 1, ZERO_KEY))
    os.pwrite(fd, b"\x5a" * PAYLOAD, PAYLOAD)
    assert pool.publish(fd, tmp, k)
    os.utime(pool.path_for(k), ns=(1, 1))


def present(root: str) -> set[bytes]:
    return {b.key for b in scan_pool(root).blocks}


def filled(root: str) -> BlockPool:
    pool = make_pool(root)
    for i in range(N_BLOCKS):
        put(pool, key(i))
    return pool


def guard_for(root: str, **kw) -> CapacityGuard:
    """Over quota at once: 12 blocks for a quota of 10, down to 5."""
    kw.setdefault("check_interval_s", 3600)
    return CapacityGuard([root], quota_bytes=10 * FILE, low_watermark=0.5, min_free_bytes=0, grace_s=1,
                         runner="process", **kw)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_child_frees_space_and_its_report_updates_the_counters(tmp_path):
    root = str(tmp_path)
    filled(root)
    stats = Stats()
    guard = guard_for(root, stats=stats)
    try:
        assert guard.check_now(timeout=60)
        rep = guard.last_reports[0]
        assert rep.evicted_blocks == 7 and rep.evicted_bytes == 7 * FILE and rep.reached_target
        assert len(present(root)) == 5 and rep.usage_after == 5 * FILE
        counts = stats.snapshot()
        assert counts["evict_runs"] == 1 and counts["evict_blocks"] == 7 and counts["evict_bytes"] == 7 * FILE
        assert "evict_child_failed" not in counts and guard.failed_runs == 0
    finally:
        guard.close()


def test_the_settings_default_runs_eviction_in_a_child(tmp_path):
    settings = dataclasses.replace(Settings.load_from({"TLLM_GDS_KV_ROOT": str(tmp_path)}), quota_bytes=10 * FILE,
                                   low_watermark=0.5, evict_grace_s=1.0, index_ttl_s=0.0)
    assert settings.evict_runner == "process"
    guard = CapacityGuard.from_settings(settings)
    try:
        assert guard.runner == "process" and guard.time_limit_s == settings.evict_time_limit_s
    finally:
        guard.close()


def test_the_child_takes_the_pools_eviction_lock(tmp_path):
    """Another evictor of the pool (here, this test) holds the lock: the child's run is skipped."""
    root = str(tmp_path)
    filled(root)
    guard = guard_for(root)
    lock = EvictLock(root)
    try:
        assert lock.acquire()
        assert guard.check_now(timeout=60)
        assert guard.last_reports[0].skipped and len(present(root)) == N_BLOCKS
        lock.release()
        assert guard.check_now(timeout=60)
        assert guard.last_reports[0].evicted_blocks == 7
    finally:
        lock.release()
        guard.close()


@pytest.mark.parametrize("failure", ["exits 1", "killed", "no reports"])
def test_a_failed_child_fails_only_its_run(tmp_path, caplog, failure):
    """Three failed runs: each counted, one warning; saves go on meanwhile; once the child works the
    next run evicts, and the recovery is logged."""
    root = str(tmp_path)
    pool = filled(root)
    flag = tmp_path / "broken"
    flag.touch()
    fail = {"exits 1": "sys.exit(1)", "killed": "os.kill(os.getpid(), 9)", "no reports": "sys.exit(0)"}[failure]
    argv = python(f"import os, sys, runpy\nif os.path.exists({str(flag)!r}):\n    {fail}\n"
                  f"runpy.run_module({MODULE!r}, run_name='__main__')")
    stats = Stats()
    guard = guard_for(root, stats=stats, child_argv=argv)
    try:
        with caplog.at_level(logging.WARNING, logger="gds_kv_connector.maintenance.capacity"):
            for i in range(3):
                assert guard.check_now(timeout=60)
                put(pool, key(100 + i))  # a save while eviction fails
                guard.note_saved(FILE)
            assert guard.last_reports == [] and guard.failed_runs == 3
            assert stats.snapshot()["evict_child_failed"] == 3 and "evict_runs" not in stats.snapshot()
            assert len(present(root)) == N_BLOCKS + 3
            failures = [r for r in caplog.records if "eviction run failed" in r.message]
            assert len(failures) == 1
            flag.unlink()
            assert guard.check_now(timeout=60)
        assert guard.failed_runs == 0 and guard.last_reports[0].evicted_blocks == 10
        assert any("work again, after 3 failed" in r.message for r in caplog.records)
    finally:
        guard.close()


def test_a_child_that_cannot_be_started_fails_only_its_run(tmp_path):
    root = str(tmp_path)
    filled(root)
    stats = Stats()
    guard = guard_for(root, stats=stats, child_argv=[str(tmp_path / "no-such-python")])
    try:
        assert guard.check_now(timeout=60)
        assert guard.failed_runs == 1 and stats.snapshot()["evict_child_failed"] == 1
        assert len(present(root)) == N_BLOCKS
    finally:
        guard.close()


def test_a_hung_child_is_killed_at_its_limit_and_its_lock_dies_with_it(tmp_path):
    """The child takes the pool's eviction lock and hangs: killed at the 2 s limit, the lock is free
    again, and saves went on meanwhile without waiting for it."""
    root = str(tmp_path)
    pool = filled(root)
    pid_file = tmp_path / "child.pid"
    argv = python("import os, sys, time\nfrom gds_kv_connector.maintenance.eviction import EvictLock\n"
                  f"assert EvictLock({root!r}).acquire()\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                  "time.sleep(120)")
    guard = guard_for(root, child_argv=argv, time_limit_s=2.0)
    done = threading.Event()
    try:
        runner = threading.Thread(target=lambda: done.set() if guard.check_now(timeout=60) else None)
        t0 = time.monotonic()
        runner.start()
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() - t0 < 30, "the child never started"
            time.sleep(0.05)
        assert not EvictLock(root).acquire()  # the child holds it
        t_save = time.monotonic()
        put(pool, key(200))  # saves do not wait for the evictor
        guard.note_saved(FILE)
        assert time.monotonic() - t_save < 1.0
        runner.join(60)
        elapsed = time.monotonic() - t0
        assert done.is_set() and 2.0 <= elapsed < 30
        assert guard.failed_runs == 1 and guard.last_reports == []
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)  # killed and reaped
        lock = EvictLock(root)
        assert lock.acquire()
        lock.release()
    finally:
        guard.close()


def test_close_kills_a_child_run_it_does_not_wait_for(tmp_path):
    root = str(tmp_path)
    filled(root)
    pid_file = tmp_path / "child.pid"
    argv = python(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)")
    guard = guard_for(root, child_argv=argv)
    guard.note_saved(10 * FILE)  # a run starts
    t0 = time.monotonic()
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() - t0 < 30, "the child never started"
        time.sleep(0.05)
    t0 = time.monotonic()
    guard.close(timeout=0.2)
    assert time.monotonic() - t0 < 10
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def _failing_log_writes(monkeypatch) -> None:
    """This process's access-log writes fail as on a full disk (the child's are its own)."""
    def pwrite(fd: int, data: bytes, offset: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(recency, "pwrite_all", pwrite)


def test_promises_this_process_could_not_write_keep_their_blocks(tmp_path, monkeypatch):
    """The disk is full: no log holds this owner's promises.  One made before the run goes to the child
    with the run; one made while the child runs (it waits a second before starting) follows on its
    stdin.  Both blocks stay; the rest go down to the budget."""
    root = str(tmp_path)
    filled(root)
    argv = python(f"import time, runpy\ntime.sleep(1.0)\nrunpy.run_module({MODULE!r}, run_name='__main__')")
    rl = RecencyLog(root, "own", flush_interval_s=0)
    guard = CapacityGuard([root], quota_bytes=4 * FILE, low_watermark=0.5, min_free_bytes=0, grace_s=600,
                          recency=rl, check_interval_s=3600, runner="process", child_argv=argv)
    try:
        _failing_log_writes(monkeypatch)
        rl.promise([key(0)])  # the oldest: all are as old, the first a run would remove
        runner = threading.Thread(target=guard.check_now, args=(60,))
        runner.start()
        time.sleep(0.4)  # the child is started, not yet running
        rl.promise([key(1)])
        rl.flush()  # fails: stays queued
        runner.join(60)
        assert rl.failing and load_recency(root) == {}
        rep = guard.last_reports[0]
        assert rep.protected_blocks >= 2 and rep.evicted_blocks == N_BLOCKS - 2
        assert present(root) == {key(0), key(1)}
    finally:
        guard.close()
        rl.close()

"""Which temporary files are left over: the connector's start-up clean-up and gc's tidy step must
never take a live writer's, even one whose pid they cannot see (another pid namespace on a host of
the same name), and must not be stopped by a name they cannot parse."""

from __future__ import annotations

import errno
import os
import time

import pytest

from gds_kv_connector.eviction import evict
from gds_kv_connector.pool import (HOST_TAG, STALE_FOREIGN_TMP_S, TMP_PREFIX, TMP_YOUNG_S, BlockPool,
                                   _pid_alive, _tmp_is_stale)
from gds_kv_connector.pool_format import ZERO_KEY, BlockHeader

FP = b"\x33" * 32
PAYLOAD = 4096
KEY = b"\x44" * 32
OTHER_PID = 4_000_000  # a pid of another pid namespace: os.kill is made to answer "no such process"


@pytest.fixture
def pool(tmp_path) -> BlockPool:
    return BlockPool((str(tmp_path),), FP, PAYLOAD, 4, geometry_note="test")


def _tmp(pool: BlockPool, host: str = HOST_TAG, pid: str = str(OTHER_PID)) -> str:
    d = pool.dir_for(KEY)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{TMP_PREFIX}{KEY.hex()}-{host}-{pid}-abcd1234")
    open(path, "wb").close()
    return path


@pytest.fixture
def invisible_pids(monkeypatch):
    """kill(pid, 0) as a process in another pid namespace answers for a live writer: ESRCH."""
    real = os.kill

    def kill(pid: int, sig: int) -> None:
        if sig == 0 and pid != os.getpid():
            raise ProcessLookupError(errno.ESRCH, "No such process")
        real(pid, sig)

    monkeypatch.setattr(os, "kill", kill)


def test_young_tmp_of_an_invisible_pid_is_kept(pool, invisible_pids):
    path = _tmp(pool)
    assert not _tmp_is_stale(os.path.basename(path), path, time.time())
    assert pool.cleanup_stale_tmp() == 0
    assert evict(pool.roots[0], 0, 0.5, 0, 1).tmp_removed == 0
    assert os.path.exists(path)


def test_backdated_mtime_does_not_make_a_tmp_old(pool, invisible_pids):
    """ctime cannot be set back: a file whose mtime says two hours changed just now."""
    path = _tmp(pool)
    old = time.time() - 2 * STALE_FOREIGN_TMP_S
    os.utime(path, (old, old))
    assert pool.cleanup_stale_tmp() == 0 and os.path.exists(path)


def test_gc_in_another_pid_namespace_does_not_break_a_live_save(pool, monkeypatch):
    """review-ops/r8: gc under ``unshare --pid`` unlinked the writer's temporary file and link(2)
    then failed.  Here the checker has another pid and sees none of the writer's processes."""
    fd, tmp = pool.create_tmp(KEY, BlockHeader(FP, KEY, PAYLOAD, 0, 1, 4, 1, ZERO_KEY))
    os.pwrite(fd, b"\x5a" * PAYLOAD, 4096)
    with monkeypatch.context() as m:
        real_pid = os.getpid()
        m.setattr(os, "getpid", lambda: real_pid + 1)
        m.setattr(os, "kill", lambda pid, sig: (_ for _ in ()).throw(ProcessLookupError(errno.ESRCH, "")))
        assert evict(pool.roots[0], 0, 0.5, 0, 1).tmp_removed == 0
        assert BlockPool(pool.roots, FP, PAYLOAD, 4).cleanup_stale_tmp() == 0
    assert pool.publish(fd, tmp, KEY)
    assert pool.contains(KEY)


def test_dead_local_writer_tmp_goes_once_past_the_young_age(pool, invisible_pids):
    path = _tmp(pool)
    later = time.time() + TMP_YOUNG_S + 5
    assert _tmp_is_stale(os.path.basename(path), path, later)
    assert evict(pool.roots[0], 0, 0.5, 0, 1, now=later).tmp_removed == 1
    assert not os.path.exists(path)
    path = _tmp(pool)
    assert pool.cleanup_stale_tmp(now=later) == 1 and not os.path.exists(path)


def test_live_local_writer_tmp_goes_after_the_foreign_age(pool):
    path = _tmp(pool, pid=str(os.getpid()))
    name = os.path.basename(path)
    assert not _tmp_is_stale(name, path, time.time() + TMP_YOUNG_S + 5)
    assert _tmp_is_stale(name, path, time.time() + STALE_FOREIGN_TMP_S + 5)


def test_foreign_host_tmp_goes_after_the_foreign_age(pool):
    path = _tmp(pool, host="otherhost")
    name = os.path.basename(path)
    assert not _tmp_is_stale(name, path, time.time() + TMP_YOUNG_S + 5)
    assert _tmp_is_stale(name, path, time.time() + STALE_FOREIGN_TMP_S + 5)


@pytest.mark.parametrize("pid", ["99999999999999999999", str(2**31), "\u00b2", "\u0663", "0", "007", "-1", ""])
def test_odd_pid_in_a_name_is_a_foreign_file_not_a_crash(pool, pid):
    """review-ops/r7 (b): a 20-digit pid made os.kill raise OverflowError, which stopped gc and
    every connector starting on the host (cleanup_stale_tmp)."""
    path = _tmp(pool, pid=pid)
    name = os.path.basename(path)
    assert pool.cleanup_stale_tmp() == 0
    assert evict(pool.roots[0], 0, 0.5, 0, 1).tmp_removed == 0
    assert not _tmp_is_stale(name, path, time.time() + TMP_YOUNG_S + 5)
    assert _tmp_is_stale(name, path, time.time() + STALE_FOREIGN_TMP_S + 5)
    assert pool.cleanup_stale_tmp(now=time.time() + STALE_FOREIGN_TMP_S + 5) == 1


def test_pid_alive_answers_for_numbers_no_process_can_have():
    """The eviction lock's holder pid comes from a JSON file: any int, never an OverflowError."""
    assert _pid_alive(os.getpid())
    for pid in (10**30, 2**31, 0, -1):
        assert not _pid_alive(pid)


def test_tmp_that_cannot_be_examined_is_kept(pool, monkeypatch):
    path = _tmp(pool)
    real = os.stat

    def stat(p, *a, **kw):
        if os.fspath(p) == path:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(p, *a, **kw)

    monkeypatch.setattr(os, "stat", stat)
    assert not _tmp_is_stale(os.path.basename(path), path, time.time() + 10 * STALE_FOREIGN_TMP_S)

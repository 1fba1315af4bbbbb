"""Which temporary files are left over: the connector's start-up clean-up and gc's tidy step must
never take a live writer's, even one whose pid they cannot see (another pid namespace on a host of
the same name), and must not be stopped by a name they cannot parse.  Those of a writer of this host
that was killed go at the next owner's start, not ten minutes later (its writer mark says it is dead)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import REPO

from gds_kv_connector.util import atomic_file
from gds_kv_connector.maintenance.capacity import CapacityGuard
from gds_kv_connector.maintenance.eviction import evict
from gds_kv_connector.store.pool import STALE_FOREIGN_TMP_S, TMP_YOUNG_S, BlockPool, tmp_is_stale
from gds_kv_connector.util.host import HOST_TAG, pid_alive
from gds_kv_connector.format.layout import TMP_PREFIX
from gds_kv_connector.format.records import ZERO_KEY, BlockHeader
from gds_kv_connector.maintenance.pool_scan import owners_dir
from gds_kv_connector.config.settings import Settings

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
    assert not tmp_is_stale(os.path.basename(path), path, time.time())
    assert evict(pool.roots[0], 0, 0.5, 0, 1).tmp_removed == 0
    assert os.path.exists(path)


def test_backdated_mtime_does_not_make_a_tmp_old(pool, invisible_pids):
    """ctime cannot be set back: a file whose mtime says two hours changed just now."""
    path = _tmp(pool)
    old = time.time() - 2 * STALE_FOREIGN_TMP_S
    os.utime(path, (old, old))
    assert evict(pool.roots[0], 0, 0.5, 0, 1).tmp_removed == 0 and os.path.exists(path)


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
    assert pool.publish(fd, tmp, KEY)
    assert pool.contains(KEY)


def test_dead_local_writer_tmp_goes_once_past_the_young_age(pool, invisible_pids):
    path = _tmp(pool)
    later = time.time() + TMP_YOUNG_S + 5
    assert tmp_is_stale(os.path.basename(path), path, later)
    assert evict(pool.roots[0], 0, 0.5, 0, 1, now=later).tmp_removed == 1
    assert not os.path.exists(path)
    path = _tmp(pool)
    assert evict(pool.roots[0], 0, 0.5, 0, 1, now=later).tmp_removed == 1 and not os.path.exists(path)


def test_live_local_writer_tmp_goes_after_the_foreign_age(pool):
    path = _tmp(pool, pid=str(os.getpid()))
    name = os.path.basename(path)
    assert not tmp_is_stale(name, path, time.time() + TMP_YOUNG_S + 5)
    assert tmp_is_stale(name, path, time.time() + STALE_FOREIGN_TMP_S + 5)


def test_foreign_host_tmp_goes_after_the_foreign_age(pool):
    path = _tmp(pool, host="otherhost")
    name = os.path.basename(path)
    assert not tmp_is_stale(name, path, time.time() + TMP_YOUNG_S + 5)
    assert tmp_is_stale(name, path, time.time() + STALE_FOREIGN_TMP_S + 5)


@pytest.mark.parametrize("pid", ["99999999999999999999", str(2**31), "\u00b2", "\u0663", "0", "007", "-1", ""])
def test_odd_pid_in_a_name_is_a_foreign_file_not_a_crash(pool, pid):
    """review-ops/r7 (b): a 20-digit pid made os.kill raise OverflowError, which stopped gc and
    every connector starting on the host (it then listed the pool's temporary files at start)."""
    path = _tmp(pool, pid=pid)
    name = os.path.basename(path)
    assert evict(pool.roots[0], 0, 0.5, 0, 1).tmp_removed == 0
    assert not tmp_is_stale(name, path, time.time() + TMP_YOUNG_S + 5)
    assert tmp_is_stale(name, path, time.time() + STALE_FOREIGN_TMP_S + 5)
    assert evict(pool.roots[0], 0, 0.5, 0, 1, now=time.time() + STALE_FOREIGN_TMP_S + 5).tmp_removed == 1


def test_pid_alive_answers_for_numbers_no_process_can_have():
    """The eviction lock's holder pid comes from a JSON file: any int, never an OverflowError."""
    assert pid_alive(os.getpid())
    for pid in (10**30, 2**31, 0, -1):
        assert not pid_alive(pid)


def test_tmp_that_cannot_be_examined_is_kept(pool, monkeypatch):
    path = _tmp(pool)
    real = os.stat

    def stat(p, *a, **kw):
        if os.fspath(p) == path:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(p, *a, **kw)

    monkeypatch.setattr(os, "stat", stat)
    assert not tmp_is_stale(os.path.basename(path), path, time.time() + 10 * STALE_FOREIGN_TMP_S)


# -- dead writers of this host, at an owner's start -----------------------------------------------
# A writer process: marks itself as an owner does at start (CapacityGuard), creates a block's
# temporary file and a replacement's in the owners directory, says so and waits.  With a pid
# argument it marks itself under that pid instead: a writer of another pid namespace whose pid
# there is the number given.
WRITER = r"""
import os, sys, time
from gds_kv_connector.maintenance.capacity import CapacityGuard
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.util.host import HOST_TAG
from gds_kv_connector.format.records import ZERO_KEY, BlockHeader
from gds_kv_connector.maintenance.pool_scan import owners_dir
root, key = sys.argv[1], bytes.fromhex(sys.argv[2])
if len(sys.argv) > 3:
    from gds_kv_connector.util.atomic_file import WriterMark
    os.getpid = lambda: int(sys.argv[3])
    WriterMark([owners_dir(root)])
    print("ready", flush=True)
    time.sleep(3600)
guard = CapacityGuard([root], quota_bytes=0, low_watermark=0.9, min_free_bytes=0, grace_s=300)
pool = BlockPool((root,), b"\x33" * 32, 4096, 4)
fd, tmp = pool.create_tmp(key, BlockHeader(pool.fingerprint, key, 4096, 0, 1, 4, 1, ZERO_KEY))
os.pwrite(fd, b"\x5a" * 4096, 4096)
stats_tmp = f"owner.1.stats.json.tmp-{HOST_TAG}-{os.getpid()}-abcd0123"  # as atomic_write names it
open(os.path.join(owners_dir(root), stats_tmp), "wb").write(b"{")
print("ready", flush=True)
time.sleep(3600)
"""


def _writer(root: str, k: bytes, *pid: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, root, k.hex(), *map(str, pid)],
                            cwd=REPO,
                            env={n: v for n, v in os.environ.items() if not n.startswith("TLLM_GDS_KV_")},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _tmp_files_of(root: str, pid: int) -> list[str]:
    """The temporary files that name ``pid`` as their writer, anywhere in the pool."""
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names
                  if ".tmp-" in n and f"-{pid}-" in n)


def _owner_starts(root: str) -> None:
    """What a serving owner does at start about the pool's space (CapacityGuard.from_settings)."""
    settings = Settings.load_from({"TLLM_GDS_KV_ROOT": root})
    CapacityGuard.from_settings(settings).close()


def test_an_owner_start_removes_a_killed_writers_tmp_files_at_once(pool):
    """Issue 38: temporary files of a process killed with SIGKILL stayed ten minutes (TMP_YOUNG_S,
    or an hour in the owners directory); a live writer's and another host's must stay."""
    root = pool.roots[0]
    dead, live = _writer(root, b"\x01" * 32), _writer(root, b"\x02" * 32)
    try:
        _kill9(dead)
        foreign = _tmp(pool, host="otherhost_0badcafe", pid=str(dead.pid))  # same pid, another node
        left_by_dead, of_live = _tmp_files_of(root, dead.pid), _tmp_files_of(root, live.pid)
        t0 = time.monotonic()
        _owner_starts(root)
        took = time.monotonic() - t0
        gone = [p for p in left_by_dead if not os.path.exists(p)]
        print(f"owner start in {took:.2f} s: removed {len(gone)} of the {len(left_by_dead)} temporary files "
              f"(foreign one included) the killed writer's pid names; kept {sum(map(os.path.exists, of_live))} "
              f"of the live writer's {len(of_live)}")
        assert len(left_by_dead) == 3 and len(of_live) == 2  # a block's and a stats file's each, and foreign
        assert set(gone) == set(left_by_dead) - {foreign}
        assert all(map(os.path.exists, of_live)) and os.path.exists(foreign)
        marks = [n for n in os.listdir(owners_dir(root)) if n.endswith(atomic_file.WRITER_SUFFIX)]
        assert marks == [m for m in marks if f"-{live.pid}-" in m] and len(marks) == 1  # the dead one's went
    finally:
        _kill9(live)


def test_a_live_writer_of_another_pid_namespace_keeps_a_dead_pids_tmp_files(pool):
    """A pid names another process in another pid namespace: while a live writer there holds a mark
    under the dead writer's pid, the files that pid names may be its own, and stay."""
    root = pool.roots[0]
    dead = _writer(root, b"\x03" * 32)
    _kill9(dead)
    twin = _writer(root, b"\x04" * 32, dead.pid)
    try:
        files = _tmp_files_of(root, dead.pid)
        _owner_starts(root)
        kept = sum(map(os.path.exists, files))
        print(f"owner start kept {kept} of {len(files)} temporary files of pid {dead.pid}, a live mark names it")
        assert len(files) == 2 and kept == 2
    finally:
        _kill9(twin)
    _owner_starts(root)  # the twin is gone too: now the pid's files go
    assert not any(map(os.path.exists, files))

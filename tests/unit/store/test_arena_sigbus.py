"""A slab truncated under its mappings, or that a full tmpfs cannot back, kills no process (issue 38).

Each owner or reader runs in a child process (arena_helpers.py run as a script) on a real tmpfs,
so a SIGBUS shows as the child dying with -SIGBUS; this process truncates the slab files with
os.truncate, as any process that may write them can.  The child must exit 0 having logged a clear
line, and every block it loaded must be byte for byte the one saved: a truncated slab's blocks are
misses or counted failures.  An arena larger than the free space must refuse to start, in one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.arena_helpers import CHILD_FP, PAYLOAD, START_FAILED, TOUCHES, keys, payload_of
from gds_kv_connector.store.arena import SlotArena
from gds_kv_connector.store.base import open_store
from gds_kv_connector.engines.posix import PosixEngine
from gds_kv_connector.util.mounts import fs_type
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.records import ZERO_KEY

from tests.support import REPO  # noqa: E402

HELPERS = "tests.support.arena_helpers"  # run as a module from the checkout's root
DROPPED = "dropping slab"  # the arena's line for a slab it stops using
MiB = 1 << 20


@pytest.fixture
def shm_root():
    if not os.path.isdir("/dev/shm") or fs_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm: these tests need a real one")
    d = os.path.join("/dev/shm", f"gdskv-sigbus-{os.getpid()}-{time.time_ns()}")
    os.makedirs(d)
    yield d
    import shutil
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MiB tmpfs of its own, mounted here (root only)."""
    d = tmp_path / "small"
    d.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(d)], capture_output=True, text=True)
    if got.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip() or got.returncode}")
    try:
        yield str(d)
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _ended(rc: int, err: str) -> str:
    """How a child ended, for an assertion's message."""
    how = "killed by SIGBUS" if rc == -signal.SIGBUS else f"exit status {rc}"
    return f"child {how}; its stderr:\n{err[-3000:]}"


def _run(*args: object) -> subprocess.CompletedProcess:
    """arena_helpers.py run to its end, with no test step in between."""
    return subprocess.run([sys.executable, "-m", HELPERS, *map(str, args)], capture_output=True, text=True, timeout=120,
                          cwd=REPO)


class Child:
    """arena_helpers.py run as a child: its JSON lines read one at a time, stdin to let it go on."""

    def __init__(self, *args: object) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", HELPERS, *map(str, args)], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def said(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, self.fail_text()
        return json.loads(line)

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self) -> tuple[dict, str]:
        """Its summary and its log, once it exited 0."""
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, self.fail_text(err)
        return json.loads(out.strip().splitlines()[-1]), err

    def fail_text(self, err: str | None = None) -> str:
        if err is None:
            self.proc.kill()
            _, err = self.proc.communicate()
        return _ended(self.proc.wait(), err)


def _truncations(slab_size: int) -> dict[str, int]:
    return {"to 0": 0, "page-unaligned": 4096 + 1, "to half": slab_size // 2}  # half: 4 of its 8 slots whole


@pytest.mark.parametrize("cut", ["to 0", "page-unaligned", "to half"])
def test_an_owner_survives_its_slab_truncated_and_loads_only_whole_blocks(shm_root, cut):
    child = Child("owner", shm_root, 8, 2)
    ready = child.said()
    assert ready["published"] == 16
    slab = ready["slabs"][0]
    os.truncate(slab, _truncations(os.path.getsize(slab))[cut])
    child.go()
    counts, log = child.finish()
    # the truncated slab's 8 blocks fail (the whole slab is dropped, its intact slots too); the
    # other 8 and the 16 saved after it (into the other slab, a replacement or block files) load whole
    assert (counts["torn"], counts["failed"], counts["ok"]) == (0, 8, 24), counts
    assert counts["published"] + counts["save_failed"] == 32, counts
    assert DROPPED in log and "truncated by another process" in log, log


def test_a_reader_survives_another_owner_s_slab_truncated(shm_root):
    pool = BlockPool((shm_root,), CHILD_FP, PAYLOAD, 16, refs=True)
    engine = PosixEngine(io_threads=2)
    pool.arena = SlotArena(pool, engine, 8 * pool.file_size, 8 * pool.file_size, 0.0, mapped=True)
    pool.arena.start(background=False)
    try:
        shared = keys(8, b"shared")
        assert open_store(pool, engine).save(shared, [ZERO_KEY] * 8, list(map(payload_of, shared))).published == 8
        (slab,) = (os.path.join(pool.arena.dir, n) for n in os.listdir(pool.arena.dir))
        child = Child("reader", shm_root, 8)
        assert child.said() == {"published": 0, "save_failed": 0, "ok": 8, "torn": 0, "failed": 0}
        os.truncate(slab, 0)
        child.go()
        counts, log = child.finish()
        assert counts["torn"] == 0 and counts["ok"] == 0 and counts["failed"] == 8, counts
        assert DROPPED in log, log
    finally:
        pool.arena.close()
        engine.close()


def test_an_owner_saving_and_loading_survives_truncations_at_any_moment(shm_root):
    child = Child("loop", shm_root, 1.2)
    slabs = child.said()["slabs"]
    time.sleep(0.3)
    os.truncate(slabs[0], os.path.getsize(slabs[0]) // 2)
    time.sleep(0.3)
    os.truncate(slabs[1], 0)
    counts, log = child.finish()
    assert counts["torn"] == 0 and counts["ok"] > 0, counts
    assert DROPPED in log, log


def test_every_cpu_access_to_a_truncated_slab_completes_and_its_blocks_fail(shm_root):
    """The accesses the checks before a batch cannot cover: a slab truncated after its check, at
    the access itself.  Each way a CPU reaches a mapping meets a fault on a slab of its own."""
    child = Child("touch", shm_root)
    for slab in child.said()["slabs"]:
        os.truncate(slab, 0)
    child.go()
    counts, log = child.finish()
    assert counts["lost"] == list(TOUCHES), counts
    assert (counts["torn"], counts["failed"], counts["ok"]) == (0, len(TOUCHES), 0), counts
    assert log.count("taken away under its mapping") == len(TOUCHES), log


def _fill(root: str, leave: int) -> None:
    """Take all but ``leave`` bytes of ``root``'s filesystem with one file."""
    st = os.statvfs(root)
    fd = os.open(os.path.join(root, "filler"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, os.fstat(fd).st_size, st.f_bavail * st.f_frsize - leave)
    finally:
        os.close(fd)


def test_an_arena_larger_than_the_free_space_fails_at_start_in_one_line(small_tmpfs):
    _fill(small_tmpfs, 2 * MiB)
    child = _run("start", small_tmpfs, 4 * MiB, MiB)
    assert child.returncode == START_FAILED, "not refused at start: " + _ended(child.returncode, child.stderr)
    lines = child.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not fit" in lines[0], child.stderr


def test_a_slab_that_cannot_be_replaced_stops_the_growth_in_one_line(small_tmpfs):
    child = Child("regrow", small_tmpfs, 64)  # two slabs of 64 slots (about 1 MiB each)
    (slab, _) = child.said()["slabs"]
    os.truncate(slab, 0)
    _fill(small_tmpfs, 0)  # the space the truncation freed is gone before the owner can replace the slab
    child.go()
    counts, log = child.finish()
    assert counts["torn"] == 0, counts
    assert log.count(DROPPED) == 1 and log.count("building slabs in") == 1, log
    assert counts["published"] + counts["save_failed"] == 64 * 5, counts


def test_a_sparse_slab_a_full_tmpfs_cannot_back_is_not_adopted(small_tmpfs):
    """A dead owner's slab made by an older version (ftruncate, then MAP_POPULATE, which a full tmpfs
    stops short without a word) has pages missing; the adopter must back it before mapping it, and
    where it cannot, leave it alone: its saves then fall back to block files (here failing, the
    tmpfs being full), and nothing faults."""
    pool = BlockPool((small_tmpfs,), CHILD_FP, PAYLOAD, 16, refs=True)
    engine = PosixEngine(io_threads=1)
    pool.arena = SlotArena(pool, engine, 16 * pool.file_size, 16 * pool.file_size, 0.0, mapped=True)
    pool.arena.start(background=False)
    pool.arena.close()
    engine.close()
    (dead,) = (os.path.join(pool.arena.dir, n) for n in os.listdir(pool.arena.dir))
    size = os.path.getsize(dead)
    os.truncate(dead, 0)
    os.truncate(dead, size)  # every page missing, as a populate stopped at the first
    _fill(small_tmpfs, 0)
    child = _run("start", small_tmpfs, size, size)
    assert child.returncode == 0, _ended(child.returncode, child.stderr)
    counts = json.loads(child.stdout.strip().splitlines()[-1])
    assert counts["ok"] == counts["torn"] == 0 and counts["save_failed"] == 16, counts
    assert f"not adopting slab {os.path.basename(dead)}: " in child.stderr and "cannot back a slab" in child.stderr

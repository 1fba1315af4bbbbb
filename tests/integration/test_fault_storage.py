"""Storage failures seen through TransferManager: stalls, EIO, full and read-only disks, short I/O.

A promised load that cannot complete must become a ConnectorFailure (TensorRT-LLM then fails the
process deliberately) naming the request and the file, within the deadline plus the poll interval;
a save that cannot complete is dropped, counted and logged once per cause, and its request is still
reported finished, with no temporary file left behind.  Faults come from FaultyFileOps, shared by
the pool and the POSIX engine exactly as the worker wires them.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time

import pytest
import torch

pytest.register_assert_rewrite("tests.support.fault_helpers")
from tests.support import fault_helpers as fh  # noqa: E402
from gds_kv_connector.store.base import LoadFailure, open_store  # noqa: E402
from gds_kv_connector.engines.posix import PosixEngine  # noqa: E402
from tests.support.faults import FaultyFileOps  # noqa: E402
from gds_kv_connector.transfer.jobs import LoadOp, SaveOp  # noqa: E402
from gds_kv_connector.store.pool import BlockPool  # noqa: E402
from gds_kv_connector.format.layout import LAYOUT_DIR, QUARANTINE_DIR  # noqa: E402
from gds_kv_connector.format.records import PAGE, is_ref_size  # noqa: E402
from gds_kv_connector.config.settings import Settings  # noqa: E402
from gds_kv_connector.util.counters import Stats  # noqa: E402
from gds_kv_connector.transfer.manager import ConnectorFailure, TransferManager  # noqa: E402

pytest_plugins = ["tests.support.fault_helpers"]
DEADLINE = 0.5
POLL = 0.01


class Rig:
    """A TransferManager over a fresh pool with every file operation going through FaultyFileOps."""

    def __init__(self, root: str, num_blocks: int = 16, **env: str) -> None:
        self.ops = FaultyFileOps(seed=7)
        base = {"TLLM_GDS_KV_DEADLINE_S": str(DEADLINE), "TLLM_GDS_KV_CONTROL_GRACE_S": "0.5",
                "TLLM_GDS_KV_READ_RETRIES": "2", "TLLM_GDS_KV_TRANSFER_THREADS": "2"}
        base.update(env)
        self.settings = Settings.load_from(env=base, require_root=False, root=root)
        self.pool = fh.make_pool(root, ops=self.ops, index_ttl_s=0.0, fsync=self.settings.fsync)
        self.engine = PosixEngine(io_threads=2, ops=self.ops)
        self.kv = fh.make_kv(num_blocks)
        self.stats = Stats()
        self.tm = TransferManager(self.pool, self.engine, self.kv, self.settings, self.stats)

    def preload(self, keys):
        """Publish keys directly (no faults apply: rules are added after)."""
        views = [fh.fill(self.kv, i, k) for i, k in enumerate(keys)]
        assert open_store(self.pool, self.engine).save(keys, [b""] * len(keys), views).published == len(keys)
        for i in range(len(keys)):
            self.kv.block_view(i).numpy()[:] = 0

    def save_op(self, rid, keys, first_block=0):
        for i, k in enumerate(keys):
            fh.fill(self.kv, first_block + i, k)
        return SaveOp(rid, tuple(keys), tuple([b""] * len(keys)), tuple(range(first_block, first_block + len(keys))))

    def poll_until(self, finished=(), loading=(), want_saved=(), want_loaded=(), timeout=5.0):
        """Poll like get_finished every POLL s until the wanted ids are reported; returns elapsed."""
        t0 = time.monotonic()
        saved, loaded = set(), set()
        first = True
        while not (set(want_saved) <= saved and set(want_loaded) <= loaded):
            assert time.monotonic() - t0 < timeout, f"not reported within {timeout}s: saved={saved} loaded={loaded}"
            s, l = self.tm.poll(list(finished) if first else [], list(loading) if first else [])
            first = False
            saved |= set(s)
            loaded |= set(l)
            time.sleep(POLL)
        return time.monotonic() - t0

    def close(self):
        self.ops.release()
        self.tm.shutdown()


@pytest.fixture
def rig(tmp_path):
    made = []

    def make(num_blocks=16, **env):
        r = Rig(str(tmp_path / f"pool{len(made)}"), num_blocks, **env)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


def test_stalled_load_fails_at_deadline_naming_request_and_file(rig):
    r = rig()
    keys = [fh.key_of("stall", i) for i in range(2)]
    r.preload(keys)
    r.ops.add("preadv", "stall", stall_s=30.0)
    t0 = time.monotonic()  # before submission: the deadline runs from acceptance
    r.tm.submit_load(LoadOp(41, tuple(keys), (3, 4), True), None)
    with pytest.raises(ConnectorFailure) as info:
        r.poll_until(loading=[41], want_loaded=[41], timeout=DEADLINE + 3)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "request 41" in msg and r.pool.path_for(keys[0]) in msg and "deadline" in msg
    assert DEADLINE <= elapsed <= DEADLINE + 0.75, f"reported after {elapsed:.2f}s"
    assert r.ops.stalls_active >= 1, "the failure must come while the read is still stalled"
    fh.record("storage", trials=1, injected=r.ops.total_injected(), detected=1)


def test_transient_eio_on_read_is_retried(rig):
    r = rig()
    keys = [fh.key_of("eio-once", i) for i in range(3)]
    r.preload(keys)
    r.ops.add("preadv", "eio", count=2)  # within read_retries=2
    r.tm.submit_load(LoadOp(7, tuple(keys), (5, 6, 7), True), None)
    r.poll_until(loading=[7], want_loaded=[7])
    for i, k in enumerate(keys):
        assert r.kv.block_view(5 + i).numpy().tobytes() == fh.expected_payload(k)
    assert r.ops.total_injected("preadv", "eio") == 2
    assert r.stats.snapshot().get("loads_async") == 1
    fh.record("storage", trials=1, injected=2, detected=2)


def test_transient_eio_on_header_read_is_retried(rig):
    r = rig()
    key = fh.key_of("eio-header")
    r.preload([key])
    r.ops.add("preadv", "eio", count=1, path_contains=key.hex())
    pins = open_store(r.pool).pin([key])
    try:
        open_store(r.pool, r.engine).load(pins, [r.kv.block_view(9)], verify=True, retries=1,
                    deadline=time.monotonic() + 5)
    finally:
        r.pool.unpin(pins[0])
    assert r.kv.block_view(9).numpy().tobytes() == fh.expected_payload(key)
    assert r.ops.total_injected() == 1


class _EioUntil(FaultyFileOps):
    """Every read fails with EIO until ``until`` (time.monotonic()): a storage hiccup that long."""

    until = 0.0

    def preadv(self, fd, buf, offset):
        if time.monotonic() < self.until:
            raise OSError(errno.EIO, "Input/output error (injected hiccup)")
        return super().preadv(fd, buf, offset)


def test_a_brief_eio_hiccup_is_outlasted_by_the_paused_retries(tmp_path):
    """Two retries pause 10 then 20 ms: a 15 ms hiccup is over by the last one, with no load failing."""
    pool = fh.make_pool(str(tmp_path), index_ttl_s=0.0)
    kv = fh.make_kv(2)
    key = fh.key_of("hiccup")
    assert open_store(pool, PosixEngine(1)).save([key], [b""], [fh.fill(kv, 0, key)]).published == 1
    ops = _EioUntil()
    pins = open_store(pool).pin([key])
    ops.until = time.monotonic() + 0.015
    try:
        open_store(pool, PosixEngine(1, ops=ops)).load(pins, [kv.block_view(1)], verify=True, retries=2,
                    deadline=time.monotonic() + 30)
    finally:
        pool.unpin_all(pins)
    assert kv.block_view(1).numpy().tobytes() == fh.expected_payload(key)


def test_retry_pauses_end_at_the_deadline(rig):
    r = rig()
    key = fh.key_of("eio-until-deadline")
    r.preload([key])
    r.ops.add("preadv", "eio")
    pins = open_store(r.pool).pin([key])
    t0 = time.monotonic()
    try:
        with pytest.raises(LoadFailure):
            open_store(r.pool, r.engine).load(pins, [r.kv.block_view(2)], verify=True, retries=20, deadline=t0 + 0.1)
    finally:
        r.pool.unpin_all(pins)
    elapsed = time.monotonic() - t0
    assert 0.1 <= elapsed < 0.3, f"failed after {elapsed:.3f}s"  # paused up to the deadline, never past it
    assert 2 < r.ops.total_injected("preadv", "eio") < 21  # retried, with pauses between, not 20 times at once


def test_persistent_eio_is_a_load_failure(rig):
    r = rig()
    key = fh.key_of("eio-always")
    r.preload([key])
    r.ops.add("preadv", "eio")
    r.tm.submit_load(LoadOp(8, (key,), (2,), True), None)
    with pytest.raises(ConnectorFailure, match=f"request 8 failed: key {key.hex()}"):
        r.poll_until(loading=[8], want_loaded=[8])
    assert r.ops.total_injected("preadv", "eio") == 3  # first try + read_retries
    # a block that still fails after its retries is quarantined before the failure is raised, so a
    # restarted server never promises it again (it would fail the same way, a crash loop)
    assert not r.pool.contains(key)
    qdir = os.path.join(r.pool.roots[0], LAYOUT_DIR, QUARANTINE_DIR)
    assert any(name.startswith(key.hex()) for name in os.listdir(qdir))
    fh.record("storage", trials=1, injected=r.ops.total_injected(), detected=1)


@pytest.mark.parametrize("kind,op", [("enospc", "pwrite"), ("erofs", "open"), ("enospc", "link"),
                                     ("eio", "fsync")])
def test_failed_saves_are_dropped_counted_logged_once(rig, caplog, kind, op):
    r = rig(TLLM_GDS_KV_FSYNC="1")
    r.ops.add(op, kind, path_contains=".tmp-" if op == "open" else None)
    cause = kind.upper()
    ops = [r.save_op(100 + n, [fh.key_of(kind, op, n, j) for j in range(3)], first_block=3 * n)
           for n in range(4)]
    with caplog.at_level(logging.WARNING, logger="gds_kv_connector.transfer.manager"):
        for o in ops:
            r.tm.submit_save(o, None)
        r.poll_until(finished=[o.request_id for o in ops], want_saved=[o.request_id for o in ops])
    stats = r.stats.snapshot()
    assert stats.get(f"save_failed_{cause}") == 12, stats
    assert stats.get("blocks_saved", 0) == 0
    msgs = [rec.getMessage() for rec in caplog.records if cause in rec.getMessage()]
    assert len(msgs) == 1, f"expected one log line for {cause}, got {msgs}"
    assert fh.tmp_files(r.pool) == [] and fh.block_files(r.pool) == []
    for o in ops:
        assert r.pool.count_present(list(o.keys)) == 0
    fh.record("storage", trials=12, injected=r.ops.total_injected(), detected=12)


@pytest.mark.parametrize("op", ["pwrite", "preadv"])
def test_short_transfers_are_completed_by_the_loops(rig, op):
    r = rig()
    keys = [fh.key_of("short", op, i) for i in range(4)]
    r.ops.add(op, "short", short_fraction=0.3)
    if op == "pwrite":
        r.tm.submit_save(r.save_op(1, keys), None)
        r.poll_until(finished=[1], want_saved=[1])
        assert r.stats.snapshot().get("blocks_saved") == 4
    else:
        r.preload(keys)
        r.tm.submit_load(LoadOp(2, tuple(keys), (8, 9, 10, 11), True), None)
        r.poll_until(loading=[2], want_loaded=[2])
        for i, k in enumerate(keys):
            assert r.kv.block_view(8 + i).numpy().tobytes() == fh.expected_payload(k)
    assert r.ops.total_injected(op, "short") >= 4
    for p in fh.block_files(r.pool):
        fh.verify_file(p)
    fh.record("storage", trials=4, injected=r.ops.total_injected(), detected=0)


@pytest.mark.parametrize("then", ["eio", "truncate"])
def test_short_write_then_error_never_publishes(rig, then):
    r = rig()
    key = fh.key_of("short-then", then)
    r.ops.add("pwrite", "short", count=1, skip=1)  # skip the header write; the payload goes short
    r.ops.add("pwrite", then)  # then the rest of the payload fails (or writes nothing)
    r.tm.submit_save(r.save_op(5, [key]), None)
    r.poll_until(finished=[5], want_saved=[5])
    assert not r.pool.contains(key) and fh.block_files(r.pool) == [] and fh.tmp_files(r.pool) == []
    assert r.stats.snapshot().get("save_failed_EIO") == 1
    fh.record("storage", trials=1, injected=r.ops.total_injected(), detected=1)


def test_short_header_read_is_not_corruption(rig):
    r = rig()
    key = fh.key_of("short-header")
    r.preload([key])
    r.ops.add("preadv", "short", count=1, short_fraction=0.1)
    r.tm.submit_load(LoadOp(3, (key,), (1,), True), None)
    r.poll_until(loading=[3], want_loaded=[3])
    assert r.pool.contains(key) and r.kv.block_view(1).numpy().tobytes() == fh.expected_payload(key)


def test_a_block_file_truncated_under_pin_is_a_load_failure_and_quarantined(tmp_path):
    """With blocks of one page a block file is also of a reference file's size, so pin() reads its
    magic; a file ending there (truncated under the reader) is a LoadFailure naming the key, and is
    quarantined like any other bad file."""
    ops = FaultyFileOps(seed=0)
    pool = BlockPool((str(tmp_path),), fh.FINGERPRINT, PAGE, fh.TOKENS_PER_BLOCK, ops=ops, index_ttl_s=0.0)
    assert is_ref_size(pool.file_size)
    key = fh.key_of("truncated-under-pin")
    assert open_store(pool, PosixEngine(1)).save([key], [b""], [torch.ones(PAGE, dtype=torch.uint8)]).published == 1
    ops.add("preadv", "truncate", count=1)
    with pytest.raises(LoadFailure) as info:
        open_store(pool).pin([key])
    assert info.value.key == key and info.value.path == pool.path_for(key) and "ended" in info.value.reason
    assert not pool.contains(key)
    assert [n.split(".")[0] for n in os.listdir(os.path.join(str(tmp_path), LAYOUT_DIR, QUARANTINE_DIR))] == [key.hex()]


def test_pool_directory_removed_under_an_in_flight_save(rig):
    """rm -rf of the fingerprint directory while a save's bytes are moving: that save fails cleanly
    (ENOENT at publication, counted, logged), no crash, and the next saves recreate the directory."""
    r = rig()
    r.ops.add("pwrite", "stall", stall_s=30.0, count=1, skip=1)  # hold the first payload write
    held = fh.key_of("held")
    r.tm.submit_save(r.save_op(1, [held]), None)
    assert r.ops.stall_started.wait(5)
    shutil.rmtree(r.pool.fp_dirs[0])
    r.ops.release()
    r.poll_until(finished=[1], want_saved=[1])
    assert r.stats.snapshot().get("save_failed_ENOENT") == 1
    assert not r.pool.contains(held)
    keys = [fh.key_of("after", i) for i in range(3)]
    r.tm.submit_save(r.save_op(2, keys, first_block=1), None)
    r.poll_until(finished=[2], want_saved=[2])
    assert r.pool.count_present(keys) == 3 and fh.tmp_files(r.pool) == []
    fh.load_and_compare(r.pool, r.engine, r.kv, keys, first_block=8)
    fh.record("storage", trials=4, injected=2, detected=1)


@fh.timeout(60)
def test_pool_directory_wiped_repeatedly_during_saves(rig):
    """A wiper removing the fingerprint directory every 2 ms while 40 saves run: every request is
    still reported finished, every block is either published or counted failed, nothing raises."""
    r = rig(num_blocks=80, TLLM_GDS_KV_TRANSFER_THREADS="4")  # a page per block: pages stay held until reported
    stop = threading.Event()

    def wiper():
        while not stop.is_set():
            shutil.rmtree(r.pool.fp_dirs[0], ignore_errors=True)
            stop.wait(0.002)

    t = threading.Thread(target=wiper, daemon=True)
    t.start()
    rids, done = [], set()
    try:
        for n in range(40):
            rid = 1000 + n
            r.tm.submit_save(r.save_op(rid, [fh.key_of("wipe", n, j) for j in range(2)],
                                       first_block=2 * n), None)
            rids.append(rid)
            done |= set(r.tm.poll([rid], [])[0])
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive()
    t0 = time.monotonic()
    while len(done) < len(rids):
        assert time.monotonic() - t0 < 10, f"requests never reported: {sorted(set(rids) - done)}"
        done |= set(r.tm.poll([], [])[0])
        time.sleep(POLL)
    assert done == set(rids)
    stats = r.stats.snapshot()
    failed = sum(v for k, v in stats.items() if k.startswith("save_failed_"))
    assert stats.get("blocks_saved", 0) + failed + stats.get("save_lost_race", 0) == 80, stats
    assert fh.tmp_files(r.pool) == []
    for p in fh.block_files(r.pool):
        fh.verify_file(p)
    print(f"wiped pool: {stats}")
    fh.record("storage", trials=80, injected=failed, detected=failed)

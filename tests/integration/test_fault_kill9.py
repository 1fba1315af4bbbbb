"""kill -9 of a writer at random points never leaves a visible partial or corrupt block.

Publication is write-to-temporary + link(2): the final name appears only after every byte is
written, so killing the writer at any instant may leave a temporary file but never a bad ``.blk``.
Each trial forks one writer, waits until it is working, SIGKILLs it after a random 0-30 ms and
then checks the pool from outside with an independent verifier.  ``fork`` is fine here: no CUDA or
kvikio is involved, and it keeps 200+ trials within seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import select
import signal
import time

import pytest

from gds_kv_connector.maintenance.eviction import evict

pytest.register_assert_rewrite("tests.support.fault_helpers")
from tests.support import fault_helpers as fh  # noqa: E402
from gds_kv_connector.engines.posix import PosixEngine  # noqa: E402
from gds_kv_connector.store.pool import TMP_YOUNG_S  # noqa: E402

pytest_plugins = ["tests.support.fault_helpers"]

TRIALS = int(os.environ.get("TLLM_GDS_KV_TEST_KILL9_TRIALS", "200"))


def _read_line(fd: int, timeout: float) -> bytes:
    buf = b""
    end = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError("child did not report ready in time")
        chunk = os.read(fd, 1)
        if not chunk:
            raise AssertionError("child exited before it was ready")
        buf += chunk
    return buf


def _drain(fd: int, timeout: float) -> bytes:
    """Everything the (dead) child wrote; EOF comes once its write end is gone."""
    out = b""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        assert left > 0, "pipe of a killed child never reached EOF"
        if not select.select([fd], [], [], left)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return out
        out += chunk


def _live_tmp_holder(root: str, wfd: int, rfd: int) -> None:
    """A live writer holding a temporary file open, as an evictor listing its shard will find it."""
    pool = fh.make_pool(root)
    key = fh.key_of("live-writer")
    from gds_kv_connector.format.records import BlockHeader
    fd, tmp = pool.create_tmp(key, BlockHeader(fh.FINGERPRINT, key, fh.PAYLOAD_LEN, 0, 1, fh.TOKENS_PER_BLOCK, 0))
    os.write(wfd, (tmp + "\n").encode())
    select.select([rfd], [], [], 30)  # until the parent says done (or 30 s)
    pool.discard_tmp(fd, tmp)


@fh.timeout(120)
def test_kill9_writers_leave_no_partial_block(tmp_path):
    ctx = mp.get_context("fork")
    root = str(tmp_path / "pool")
    pool = fh.make_pool(root, index_ttl_s=0.0)
    engine = PosixEngine(io_threads=2)
    kv = fh.make_kv(8)
    rng = random.Random(20240601)
    verified: set[str] = set()
    published_all: list[bytes] = []
    tmp_left_trials = 0
    reported = 0
    tmp_before = 0
    t0 = time.monotonic()
    try:
        for trial in range(TRIALS):
            r, w = os.pipe()
            old = published_all[-64:]
            proc = ctx.Process(target=fh.kill9_child, args=(root, trial, w, old), daemon=True)
            proc.start()
            os.close(w)
            try:
                assert _read_line(r, 10.0) == b"R\n"
                time.sleep(rng.uniform(0.0, 0.030))  # the random kill point, not synchronisation
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(10.0)
                assert proc.exitcode == -signal.SIGKILL, f"trial {trial}: child exit code {proc.exitcode}"
                lines = _drain(r, 10.0).decode().splitlines()
            finally:
                os.close(r)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5.0)
            failures = [ln for ln in lines if ln.startswith("F ")]
            assert not failures, f"trial {trial}: the writer saw save failures: {failures[:3]}"
            keys = [bytes.fromhex(ln[2:]) for ln in lines if ln.startswith("P ")]
            reported += len(keys)
            # No visible partial or corrupt block: every new file verifies completely.
            for path in fh.block_files(pool):
                if path not in verified:
                    fh.verify_file(path)
                    verified.add(path)
            # Every block reported as published survives the kill and loads byte-exact.
            for k in keys:
                assert pool.contains(k), f"trial {trial}: published block {k.hex()} is gone"
            for i in range(0, len(keys), 8):
                fh.load_and_compare(pool, engine, kv, keys[i:i + 8])
            published_all.extend(keys)
            n_tmp = len(fh.tmp_files(pool))
            tmp_left_trials += n_tmp > tmp_before  # this kill landed between create_tmp and publish
            tmp_before = n_tmp
        kill_elapsed = time.monotonic() - t0

        # Nothing written earlier was damaged by a later writer: a full, independent re-check.
        files = fh.block_files(pool)
        for path in files:
            fh.verify_file(path)
        assert len(files) == len(verified)
        assert reported >= TRIALS // 2, f"writers published only {reported} blocks: the kills landed too early"
        assert tmp_left_trials > 0, "no kill ever landed mid-write; the test does not exercise what it claims"

        # The evictor's shard listings remove the dead writers' temporary files, not a live writer's.
        dead_tmps = fh.tmp_files(pool)
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        live = ctx.Process(target=_live_tmp_holder, args=(root, w1, r2), daemon=True)
        live.start()
        try:
            live_tmp = _read_line(r1, 10.0).decode().strip()
            assert evict(root, 0, 0.5, 0, 1).tmp_removed == 0  # all young: pids prove nothing yet
            removed = evict(root, 0, 0.5, 0, 1, now=time.time() + TMP_YOUNG_S + 5).tmp_removed
            assert os.path.exists(live_tmp), "cleanup removed a live writer's temporary file"
            assert removed == len(dead_tmps)
            assert fh.tmp_files(pool) == [live_tmp]
        finally:
            os.write(w2, b"x")
            live.join(10.0)
            if live.is_alive():
                live.kill()
                live.join(5.0)
            for fd in (r1, w1, r2, w2):
                os.close(fd)
        assert live.exitcode == 0
        assert fh.tmp_files(pool) == []
    finally:
        engine.close()
    print(f"kill9: {TRIALS} trials in {kill_elapsed:.1f}s, {len(files)} blocks verified, "
          f"{reported} reported published, {tmp_left_trials} trials left temporaries, {removed} removed")
    fh.record("kill9", trials=TRIALS, injected=TRIALS, detected=0, lost=0, blocks_verified=len(files),
              tmp_removed=removed, tmp_left_trials=tmp_left_trials)

"""Shared pieces of the fault-injection suite (tests/test_fault_*.py), and its pytest plugin.

Every fault test module says ``pytest_plugins = ["tests.support.fault_helpers"]``, which registers this module
as a plugin.  That gives three things without touching tests/conftest.py:

* :func:`timeout`: this test's time limit, pytest-timeout's marker (the suite's default is in
  pyproject.toml).  A fault test that hangs (a stalled read nobody releases, a child that never
  exits) then fails by name with its stack, and the run goes on to its summary.  Tests also bound
  each of their own waits, so that an ordinary failure is an assertion, not this last resort.
* :func:`record`: tests register what they did (trials, injected faults, detected, lost).
* :func:`print_fault_summary`: prints the totals at the end of the run (``pytest_terminal_summary``
  below; printed once even if tests/conftest.py calls it too).

The rest are helpers the tests and their child processes share: deterministic block content from a
key, pool construction, and a strict on-disk verifier.  Child-process entry points live here (not
in the test modules) so ``spawn`` children import only this module and the package.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections import defaultdict

import numpy as np
import pytest
import torch

from gds_kv_connector.store.base import open_store
from gds_kv_connector.format.checksum import checksum_bytes
from gds_kv_connector.engines.posix import PosixEngine
from gds_kv_connector.engines.kv_layout import pool_from_tensor
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.layout import BLOCK_SUFFIX, TMP_PREFIX
from gds_kv_connector.format.records import HEADER_SIZE, parse_header

FINGERPRINT = hashlib.sha256(b"gds-kv fault suite fingerprint").digest()
TOKENS_PER_BLOCK = 16
# [num_blocks, layers, kv, elems] uint8: 12000-byte blocks, deliberately not a multiple of 4096 so
# the zero padding of the file format is exercised.
BLOCK_SHAPE = (2, 2, 3000)
PAYLOAD_LEN = int(np.prod(BLOCK_SHAPE))

# -- counts and summary -------------------------------------------------------------------------
_COUNTS: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_COUNTS_LOCK = threading.Lock()
_PRINTED = False


def record(area: str, **counts: int) -> None:
    """Add counts (trials, injected, detected, lost, ...) under a test area for the summary."""
    with _COUNTS_LOCK:
        for name, n in counts.items():
            _COUNTS[area][name] += int(n)


def counts() -> dict[str, dict[str, int]]:
    with _COUNTS_LOCK:
        return {a: dict(c) for a, c in _COUNTS.items()}


def print_fault_summary(terminalreporter) -> None:
    """Write the fault-suite totals (once per run) to pytest's terminal, also under -q."""
    global _PRINTED
    if _PRINTED or not _COUNTS:
        return
    _PRINTED = True
    snap = counts()
    tr = terminalreporter
    tr.write_sep("=", "gds-kv fault-injection summary")
    total = defaultdict(int)
    for area in sorted(snap):
        items = snap[area]
        for k in ("trials", "injected", "detected", "lost"):
            total[k] += items.get(k, 0)
        tr.write_line(f"{area:<12} " + "  ".join(f"{k}={v}" for k, v in sorted(items.items())))
    tr.write_line("TOTAL        " + "  ".join(f"{k}={total[k]}" for k in ("trials", "injected", "detected", "lost")))


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001 - pytest hook
    print_fault_summary(terminalreporter)


def timeout(seconds: float) -> pytest.MarkDecorator:
    """This test's time limit in seconds, in place of the suite's default (pytest-timeout)."""
    return pytest.mark.timeout(seconds)


# -- content and pools --------------------------------------------------------------------------
def count_writes(engine) -> list[int]:
    """Wrap a POSIX engine's per-item write so ``[n]`` counts the items written so far: an
    ``in_time`` reading it stops a batch after a chosen number of writes, whatever the timing."""
    written = [0]
    write_one = engine._write_one

    def counted(item) -> None:
        write_one(item)
        written[0] += 1
    engine._write_one = counted
    return written


def expected_payload(key: bytes, n: int = PAYLOAD_LEN) -> bytes:
    """The bytes every writer of ``key`` stores: a pure function of the key (so any reader can check)."""
    return hashlib.shake_128(b"payload:" + key).digest(n)


def make_kv(num_blocks: int):
    """A host KV pool.  Built and filled with numpy only: a torch kernel in a child forked from a
    parent that already ran one can deadlock in the OpenMP runtime."""
    return pool_from_tensor(torch.from_numpy(np.zeros((num_blocks, *BLOCK_SHAPE), dtype=np.uint8)))


def make_pool(root: str, ops=None, **kw) -> BlockPool:
    return BlockPool((root,), FINGERPRINT, PAYLOAD_LEN, TOKENS_PER_BLOCK, ops=ops, **kw)


def fill(kv, block_id: int, key: bytes) -> torch.Tensor:
    view = kv.block_view(block_id)
    view.numpy()[:] = np.frombuffer(expected_payload(key), dtype=np.uint8)
    return view


def key_of(*parts) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def block_files(pool: BlockPool) -> list[str]:
    out = []
    for fp_dir in pool.fp_dirs:
        for sub in _ls(fp_dir):
            d = os.path.join(fp_dir, sub)
            if os.path.isdir(d) and not os.path.islink(d):
                out.extend(os.path.join(d, n) for n in _ls(d) if n.endswith(BLOCK_SUFFIX))
    return out


def tmp_files(pool: BlockPool) -> list[str]:
    out = []
    for fp_dir in pool.fp_dirs:
        for sub in _ls(fp_dir):
            d = os.path.join(fp_dir, sub)
            if os.path.isdir(d):
                out.extend(os.path.join(d, n) for n in _ls(d) if n.startswith(TMP_PREFIX))
    return out


def _ls(d: str) -> list[str]:
    try:
        return sorted(os.listdir(d))
    except (FileNotFoundError, NotADirectoryError):
        return []


def verify_file(path: str) -> bytes:
    """Check one published file completely; return its key.  Raises AssertionError on any defect.

    Independent of the loader: it parses the header with the file's real size, checks the name
    matches the key inside, the payload checksum, the zero padding, and the deterministic content.
    """
    with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as fh:
        data = fh.read()
    key = bytes.fromhex(os.path.basename(path)[:-len(BLOCK_SUFFIX)])
    hdr = parse_header(data[:HEADER_SIZE], fingerprint=FINGERPRINT, key=key, payload_len=PAYLOAD_LEN,
                       file_size=len(data))
    payload = data[HEADER_SIZE:HEADER_SIZE + PAYLOAD_LEN]
    assert checksum_bytes(payload) == hdr.checksum, f"{path}: payload checksum mismatch"
    assert payload == expected_payload(key), f"{path}: content differs from the key's deterministic bytes"
    assert not any(data[HEADER_SIZE + PAYLOAD_LEN:]), f"{path}: non-zero padding"
    return key


def load_and_compare(pool: BlockPool, engine, kv, keys: list[bytes], first_block: int = 0) -> None:
    """Load ``keys`` through the connector's own path and require byte-exact content."""
    pins = open_store(pool).pin(keys)
    try:
        views = [kv.block_view(first_block + i) for i in range(len(keys))]
        for v in views:
            v.numpy()[:] = 0xA5
        open_store(pool, engine).load(pins, views, verify=True, retries=2, deadline=time.monotonic() + 30)
    finally:
        for p in pins:
            pool.unpin(p)
    for i, key in enumerate(keys):
        got = kv.block_view(first_block + i).numpy().tobytes()
        assert got == expected_payload(key), f"block {key.hex()} loaded with wrong bytes"


# -- child processes ----------------------------------------------------------------------------
def kill9_child(root: str, trial: int, wfd: int, old_keys: list[bytes]) -> None:
    """Writer killed by the kill -9 test: saves (and reads) blocks until SIGKILL arrives.

    Writes ``R\\n`` once ready, then one ``P <key hex>\\n`` line per block after publish returned
    (a write below PIPE_BUF is atomic, so a kill never leaves half a line).
    """
    rng = random.Random(trial)
    pool = make_pool(root)
    engine = PosixEngine(io_threads=2)
    kv = make_kv(8)
    os.write(wfd, b"R\n")
    i = 0
    while True:
        if old_keys and rng.random() < 0.3:  # a reader killed mid-read must not hurt anyone
            k = rng.choice(old_keys)
            pins = open_store(pool).pin([k])
            try:
                open_store(pool, engine).load(pins, [kv.block_view(7)], verify=True, retries=0,
                            deadline=time.monotonic() + 10)
            finally:
                pool.unpin(pins[0])
            continue
        n = rng.randint(1, 4)
        keys = [key_of("kill9", trial, i + j) for j in range(n)]
        if old_keys and rng.random() < 0.2:
            keys[0] = rng.choice(old_keys)  # an already-published key: skipped, never rewritten
        i += n
        views = [fill(kv, j, k) for j, k in enumerate(keys)]
        before = {k for k in keys if pool.contains(k)}
        out = open_store(pool, engine).save(keys, [b""] * n, views)
        if out.failed:
            os.write(wfd, f"F {out.failed!r}\n".encode()[:400])
        lines = [f"P {k.hex()}\n" for k in keys if k not in before and pool.contains(k)]
        if lines:
            os.write(wfd, "".join(lines).encode())


# save_blocks reports counts, not which keys won; the soak needs the keys to prove "one winner per
# key", so its children use a pool that notes each publish() this process won.
_WON: list[str] = []


class RecordingPool(BlockPool):
    """A BlockPool noting every key whose publish() this process won (for the soak's checks)."""

    def publish(self, fd: int, tmp: str, key: bytes) -> bool:
        won = super().publish(fd, tmp, key)
        if won:
            _WON.append(key.hex())
        return won


def soak_child(root: str, idx: int, duration_s: float, start_at: float, result_path: str, ready) -> None:
    """One owner of the concurrency soak: mixed save/load over overlapping prefixes until the end.

    Writes a JSON result file: counters, the keys whose publication it won, and any error seen.
    """
    import json

    from gds_kv_connector.store.base import LoadFailure
    from gds_kv_connector.format.keys import block_keys

    rng = random.Random(1000 + idx)
    # index_ttl_s=0: every lookup goes to the file system, so races with the other owners are real.
    pool = RecordingPool((root,), FINGERPRINT, PAYLOAD_LEN, TOKENS_PER_BLOCK, index_ttl_s=0.0)
    engine = PosixEngine(io_threads=2)
    kv = make_kv(16)
    shared = [[(p * 7919 + t * 31) % 50000 for t in range(TOKENS_PER_BLOCK * 6)] for p in range(6)]
    variants = [[50000 + v * 100 + t for t in range(TOKENS_PER_BLOCK)] for v in range(4)]
    c: dict[str, int] = defaultdict(int)
    errors: list[str] = []
    ready.set()
    while time.time() < start_at:
        time.sleep(0.002)
    end = start_at + duration_s
    while time.time() < end:
        prefix = rng.choice(shared)[:TOKENS_PER_BLOCK * rng.randint(1, 6)]
        # Suffix blocks come from a few variants, so the key space is bounded and owners keep
        # racing on the same keys (and the final verification stays small).
        suffix = [t for _ in range(rng.randint(0, 3)) for t in variants[rng.randrange(4)]]
        if rng.random() < 0.5:  # half the time a partial last block, which is never saved
            suffix += [1] * rng.randint(1, TOKENS_PER_BLOCK - 1)
        keys = block_keys(FINGERPRINT, None, prefix + suffix, TOKENS_PER_BLOCK)[:16]
        hit = pool.count_present(keys)
        if hit:
            try:
                load_and_compare(pool, engine, kv, keys[:hit])
                c["loads"] += 1
                c["blocks_loaded"] += hit
            except (LoadFailure, AssertionError) as exc:
                errors.append(f"load: {exc}")
        rest = keys[hit:]
        if rest:
            views = [fill(kv, j, k) for j, k in enumerate(rest)]
            parents = [keys[hit - 1] if hit else b""] + rest[:-1]
            try:
                out = open_store(pool, engine).save(rest, parents, views)
            except Exception as exc:  # noqa: BLE001 - any raise from a lost race is a finding
                errors.append(f"save raised: {exc!r}")
                continue
            c["saves"] += 1
            c["published"] += out.published
            c["lost_race"] += out.lost_race
            c["already_present"] += out.already_present
            c["save_failed"] += len(out.failed)
            errors.extend(f"save {key.hex()}: {cause}" for key, cause in out.failed)
        c["iterations"] += 1
    engine.close()
    with open(result_path + ".part", "w") as fh:
        json.dump({"counts": c, "won": list(_WON), "errors": errors[:50]}, fh)
    os.rename(result_path + ".part", result_path)

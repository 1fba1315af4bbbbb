"""Blocks for the arena tests: keys, payloads and a verified load through a pool's pins.

Run as a script it is the child process of the truncation tests (test_arena_sigbus.py): an owner
or reader whose arena lives on a real tmpfs, so that a SIGBUS kills it (the test sees -SIGBUS)
instead of the test process.  It talks in JSON lines: one on stdout when it is ready for the test
to truncate a slab, then, after a line on stdin, a summary of what it saved and loaded; logs go to
stderr.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time

import numpy as np
import torch

from gds_kv_connector.format import native
from gds_kv_connector.store.arena import ArenaError, Slab, SlotArena
from gds_kv_connector.format.layout import SLAB_SUFFIX
from gds_kv_connector.store.base import LoadFailure, open_store
from gds_kv_connector.engines.posix import PosixEngine
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.records import HEADER_SIZE, ZERO_KEY

PAYLOAD = 3 * 4096 + 512  # not page-aligned: slots still start on pages
CHILD_FP = hashlib.sha256(b"arena-sigbus-test").digest()
START_FAILED = 3  # the child's exit status when its arena refused to start


def keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [hashlib.sha256(tag + bytes([i])).digest() for i in range(n)]


def data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, PAYLOAD), dtype=torch.uint8, generator=g)


def load(pool: BlockPool, engine, block_keys: list[bytes]) -> torch.Tensor:
    """The blocks of ``block_keys``, checksums verified, their pins released afterwards."""
    out = torch.zeros((len(block_keys), PAYLOAD), dtype=torch.uint8)
    pins = open_store(pool).pin(block_keys)
    try:
        open_store(pool, engine).load(pins, [out[i] for i in range(len(block_keys))], verify=True, retries=0,
                    deadline=time.monotonic() + 10)
    finally:
        pool.unpin_all(pins)
    return out


# -- the child process of test_arena_sigbus.py ------------------------------------------------------
def payload_of(key: bytes) -> torch.Tensor:
    """A block's bytes, known from its key alone, so a load is checked byte for byte."""
    raw = hashlib.sha256(b"payload" + key).digest() * (PAYLOAD // 32 + 1)
    return torch.frombuffer(bytearray(raw[:PAYLOAD]), dtype=torch.uint8)


def child_pool(root: str, slots: int, per_slab: int) -> BlockPool:
    """A pool on ``root`` whose mapped arena of ``slots`` slots has not started yet."""
    pool = BlockPool((root,), CHILD_FP, PAYLOAD, 16, refs=True)
    pool.arena = SlotArena(pool, PosixEngine(io_threads=2), slots * pool.file_size, per_slab * pool.file_size, 0.0,
                           mapped=True)
    return pool


class Tally:
    """What a child saved and loaded: a loaded block is ``ok`` or ``torn`` (not its bytes)."""

    def __init__(self) -> None:
        self.counts = {"published": 0, "save_failed": 0, "ok": 0, "torn": 0, "failed": 0}

    def save(self, pool: BlockPool, engine, block_keys: list[bytes]) -> None:
        out = open_store(pool, engine).save(block_keys, [ZERO_KEY] * len(block_keys), list(map(payload_of, block_keys)))
        self.counts["published"] += out.published
        self.counts["save_failed"] += len(out.failed)

    def load(self, pool: BlockPool, engine, key: bytes) -> None:
        """One block, unverified (a torn one must be caught without the checksum), then compared."""
        view = torch.zeros(PAYLOAD, dtype=torch.uint8)
        try:
            pins = open_store(pool).pin([key])
            try:
                open_store(pool, engine).load(pins, [view], verify=False, retries=0, deadline=time.monotonic() + 10)
            finally:
                pool.unpin_all(pins)
        except LoadFailure:
            self.counts["failed"] += 1
            return
        self.counts["ok" if torch.equal(view, payload_of(key)) else "torn"] += 1


def _say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def _slab_paths(pool: BlockPool) -> list[str]:
    arena = pool.arena
    return sorted(os.path.join(arena.dir, name) for name in os.listdir(arena.dir) if name.endswith(SLAB_SUFFIX))


def run_owner(root: str, per_slab: int, slabs: int) -> None:
    """Fill every slot, say so (with the slab paths), wait, then load every block and save and
    load as many new ones: the slab the test truncated meanwhile is met by both."""
    pool = child_pool(root, per_slab * slabs, per_slab)
    pool.arena.start(background=False)
    engine, tally = pool.arena.mapper, Tally()
    before, after = keys(per_slab * slabs, b"before"), keys(per_slab * slabs, b"after")
    for i in range(0, len(before), per_slab):
        tally.save(pool, engine, before[i:i + per_slab])
    _say({"slabs": _slab_paths(pool), "published": tally.counts["published"]})
    sys.stdin.readline()
    for key in before:
        tally.load(pool, engine, key)
    for i in range(0, len(after), per_slab):
        tally.save(pool, engine, after[i:i + per_slab])
    for key in after:
        tally.load(pool, engine, key)
    _say(tally.counts)


def run_reader(root: str, n: int) -> None:
    """Load the ``n`` blocks the test process saved (keys(n, b"shared")) through its own arena,
    say so, wait, then load them again."""
    pool = child_pool(root, 2, 2)
    pool.arena.start(background=False)
    engine, first, again = pool.arena.mapper, Tally(), Tally()
    shared = keys(n, b"shared")
    for key in shared:
        first.load(pool, engine, key)
    _say(first.counts)
    sys.stdin.readline()
    for key in shared:
        again.load(pool, engine, key)
    _say(again.counts)


def run_loop(root: str, seconds: float) -> None:
    """Save and load new blocks, and load older ones, for ``seconds``: the arena is full after two
    rounds, so every slot is evicted and reused while the test truncates slabs under it."""
    pool = child_pool(root, 8, 4)
    pool.arena.start(background=False)
    engine, tally = pool.arena.mapper, Tally()
    _say({"slabs": _slab_paths(pool)})
    end, round_ = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        batch = keys(4, b"loop%d" % round_)
        tally.save(pool, engine, batch)
        for key in batch + keys(4, b"loop%d" % max(0, round_ - 1)):
            tally.load(pool, engine, key)
        round_ += 1
    _say(tally.counts)


def run_start(root: str, capacity_bytes: int, slab_bytes: int) -> None:
    """Start an arena of ``capacity_bytes``; when it refuses, its one line on stderr and exit
    START_FAILED.  When it starts, fill every slot and load it back."""
    pool = BlockPool((root,), CHILD_FP, PAYLOAD, 16, refs=True)
    pool.arena = SlotArena(pool, PosixEngine(io_threads=2), capacity_bytes, slab_bytes, 0.0, mapped=True)
    try:
        pool.arena.start(background=False)
    except ArenaError as exc:
        print(f"ArenaError: {exc}", file=sys.stderr, flush=True)
        sys.exit(START_FAILED)
    engine, tally = pool.arena.mapper, Tally()
    every = keys(pool.arena.capacity_slots, b"start")
    tally.save(pool, engine, every)
    for key in every:
        tally.load(pool, engine, key)
    _say(tally.counts)


def run_regrow(root: str, per_slab: int) -> None:
    """Two slabs, one filled; say so; after the test truncated it (and took the space a new slab
    would need), save and load more blocks, then wait for the regrowth to give up."""
    pool = child_pool(root, 2 * per_slab, per_slab)
    pool.arena.start(background=False)
    engine, tally = pool.arena.mapper, Tally()
    first = keys(per_slab, b"first")
    tally.save(pool, engine, first)
    _say({"slabs": _slab_paths(pool)})
    sys.stdin.readline()
    for round_ in range(4):
        batch = keys(per_slab, b"more%d" % round_)
        tally.save(pool, engine, batch)
        for key in batch + first:
            tally.load(pool, engine, key)
    deadline = time.monotonic() + 30
    while not pool.arena.usage().get("build_errors") and time.monotonic() < deadline:
        time.sleep(0.05)
    _say(tally.counts)


def _with_python_loops(fn):
    """``fn`` run with native's Python fallback (ctypes) instead of its C loops."""
    def run(*args):
        lib, native._lib = native._lib, None
        try:
            return fn(*args)
        finally:
            native._lib = lib
    return run


def _payload_view(slab: Slab) -> tuple[int, torch.Tensor]:
    return slab.base + HEADER_SIZE, torch.zeros(PAYLOAD, dtype=torch.uint8)


# Every way a CPU reaches a slab mapping: the header loops (C and Python), the POSIX engine's
# copies, mmap slicing, numpy and torch views.  Each gets a slab of its own, so each meets a fault.
TOUCHES = {
    "C header check": lambda slab, engine: native.check_headers([slab.base], CHILD_FP, [ZERO_KEY], [0], PAYLOAD),
    "Python header check": _with_python_loops(
        lambda slab, engine: native.check_headers([slab.base], CHILD_FP, [ZERO_KEY], [0], PAYLOAD)),
    "C header clear": lambda slab, engine: native.clear_headers([slab.base]),
    "Python header clear": _with_python_loops(lambda slab, engine: native.clear_headers([slab.base])),
    "engine copy out": lambda slab, engine: engine.copy_from_host([_payload_view(slab)], 0),
    "engine copy in": lambda slab, engine: engine.copy_to_host([_payload_view(slab)], 0),
    "mmap slice": lambda slab, engine: bytes(slab.mm[:HEADER_SIZE]),
    "numpy view": lambda slab, engine: int(np.frombuffer(slab.mm, dtype=np.uint8).sum()),
    "torch view": lambda slab, engine: int(torch.frombuffer(slab.mm, dtype=torch.uint8).sum()),
}


def run_touch(root: str) -> None:
    """One slab of one block per way in TOUCHES; say so; once the test truncated them all, reach
    each slab's pages that way before any batch could check it, then load every block."""
    pool = child_pool(root, len(TOUCHES), 1)
    pool.arena.start(background=False)
    engine, tally = pool.arena.mapper, Tally()
    every = keys(len(TOUCHES), b"touch")
    for key in every:
        tally.save(pool, engine, [key])
    _say({"slabs": _slab_paths(pool)})
    sys.stdin.readline()
    lost = []
    for (way, touch), slab in zip(TOUCHES.items(), list(pool.arena._slabs.values())):
        touch(slab, engine)
        if native.mapping_lost(slab.base):
            lost.append(way)
    for key in every:
        tally.load(pool, engine, key)
    _say({"lost": lost, **tally.counts})


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    mode, root, *rest = argv
    runs = {"owner": lambda: run_owner(root, int(rest[0]), int(rest[1])),
            "reader": lambda: run_reader(root, int(rest[0])),
            "loop": lambda: run_loop(root, float(rest[0])),
            "start": lambda: run_start(root, int(rest[0]), int(rest[1])),
            "regrow": lambda: run_regrow(root, int(rest[0])),
            "touch": lambda: run_touch(root)}
    runs[mode]()


if __name__ == "__main__":
    main(sys.argv[1:])

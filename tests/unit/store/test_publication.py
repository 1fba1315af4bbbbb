"""Atomic publication: a reader never sees a partial file; concurrent writers of one key are safe."""

import multiprocessing as mp
import os
import re
from pathlib import Path

import pytest

from tests.support import REPO
import torch

from gds_kv_connector.store.base import open_store
from gds_kv_connector.engines.posix import PosixEngine
from tests.support.faults import FaultyFileOps
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.layout import quarantine_name
from gds_kv_connector.format.records import SlotRef

FP = b"\x11" * 32
NBYTES = 64 << 10


def _writer(root: str, key: bytes, fill: int, start, out) -> None:
    pool = BlockPool((root,), FP, NBYTES, 16)
    eng = PosixEngine(2)
    view = torch.full((NBYTES,), fill, dtype=torch.uint8)
    start.wait()
    res = open_store(pool, eng).save([key], [b"\0" * 32], [view])
    out.put((res.published, res.lost_race + res.already_present, len(res.failed)))


def test_concurrent_publication_of_one_key_first_wins(tmp_path):
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    key = os.urandom(32)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), key, i + 1, start, out)) for i in range(6)]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sum(r[0] for r in results) == 1, results  # exactly one publication
    assert sum(r[1] for r in results) == 5 and not any(r[2] for r in results)  # lost or saw it first
    pool = BlockPool((str(tmp_path),), FP, NBYTES, 16)
    d = os.path.dirname(pool.path_for(key))
    assert os.listdir(d) == [os.path.basename(pool.path_for(key))]  # no temporary files left
    view = torch.empty(NBYTES, dtype=torch.uint8)
    pins = open_store(pool).pin([key])
    open_store(pool, PosixEngine(1)).load(pins, [view], verify=True, retries=0, deadline=1e18)
    assert len(set(view.tolist())) == 1  # one writer's bytes, whole, never a mix


def test_saved_block_round_trips_and_parent_recorded(tmp_path):
    pool, eng = BlockPool((str(tmp_path),), FP, NBYTES, 16), PosixEngine(2)
    keys = [os.urandom(32) for _ in range(3)]
    views = [torch.randint(0, 256, (NBYTES,), dtype=torch.uint8) for _ in keys]
    out = open_store(pool, eng).save(keys, [b"\0" * 32] + keys[:-1], views)
    assert out.published == 3 and out.bytes_written == 3 * NBYTES
    assert open_store(pool, eng).save(keys, [b"\0" * 32] + keys[:-1], views).already_present == 3
    dst = [torch.empty(NBYTES, dtype=torch.uint8) for _ in keys]
    pins = open_store(pool).pin(keys)
    assert pool.check_header(pins[2], os.pread(pins[2].fd, 4096, 0)).parent_key == keys[1]
    open_store(pool, eng).load(pins, dst, verify=True, retries=0, deadline=1e18)
    assert all(torch.equal(a, b) for a, b in zip(views, dst))
    assert oct(os.stat(pool.path_for(keys[0])).st_mode & 0o777) == "0o600"


def test_not_indexed_lists_keys_absent_or_expired_in_order(tmp_path):
    """The save path's one pass over the index: positions of keys not seen published within the TTL."""
    import time

    pool = BlockPool((str(tmp_path),), b"\x05" * 32, 4096, 16)
    keys = [bytes([i]) * 32 for i in range(5)]
    now = time.monotonic()
    pool._index.update({keys[1]: now + 60, keys[2]: now - 1, keys[4]: now + 60})  # 2 has expired
    assert pool.not_indexed(keys) == [0, 2, 3]
    assert pool.not_indexed([]) == []


def test_count_present_stats_what_another_process_saved(native_impl, tmp_path):
    """A pool object that saw nothing published (another process's view) counts saved blocks by
    their files, up to the first that is missing or of the wrong size, and indexes what it found."""
    writer, eng = BlockPool((str(tmp_path),), FP, NBYTES, 16), PosixEngine(2)
    keys = [os.urandom(32) for _ in range(12)]
    views = [torch.zeros(NBYTES, dtype=torch.uint8) for _ in keys]
    assert open_store(writer, eng).save(keys[:10], [b"\0" * 32] + keys[:9], views[:10]).published == 10
    reader = BlockPool((str(tmp_path),), FP, NBYTES, 16)
    assert reader.count_present(keys) == 10 and reader.count_present(keys, 4) == 6
    assert reader.not_indexed(keys) == [10, 11]  # the ten found are indexed
    os.truncate(reader.path_for(keys[6]), 100)  # not a block file of this pool any more
    fresh = BlockPool((str(tmp_path),), FP, NBYTES, 16)
    assert fresh.count_present(keys) == 6 and fresh.not_indexed(keys[:7]) == [6]
    assert reader.count_present(keys) == 10  # the reader trusts its index within index_ttl_s
    assert fresh.count_present(keys, 7) == 3 and fresh.count_present(keys, 10) == 0


def test_match_chain_keys_and_counts_a_prompt_as_chain_then_count_present(native_impl, tmp_path, monkeypatch):
    """A long prompt whose first block is not indexed is keyed and stat'ed in one call
    (native.chain_present where built); the keys and the count are those of chain_from_tokens then
    count_present, on every path: a gap, a file of the wrong size, the first block indexed, a
    FileOps whose stat is overridden, a short prompt."""
    import random

    from gds_kv_connector.format import native
    from gds_kv_connector.engines.fileops import FileOps
    from gds_kv_connector.format.keys import chain_from_tokens
    from gds_kv_connector.store.pool import CHAIN_PRESENT_MIN_BLOCKS

    fused = []
    real = native.chain_present

    def spy(*args):
        got = real(*args)
        fused.append(got is not None)
        return got

    monkeypatch.setattr(native, "chain_present", spy)
    blocks, tpb, seed = CHAIN_PRESENT_MIN_BLOCKS + 40, 4, os.urandom(32)
    rng = random.Random(5)
    tokens = [rng.randrange(32000) for _ in range(blocks * tpb + 1)]
    keys = chain_from_tokens(seed, tokens, 0, tpb, blocks)
    writer = BlockPool((str(tmp_path),), FP, 4096, tpb)
    for k in keys[:blocks - 20]:  # a gap at blocks - 20
        os.makedirs(writer.dir_for(k), exist_ok=True)
        with open(writer.path_for(k), "wb") as f:
            f.truncate(writer.file_size)

    def fresh(ops=None):
        return BlockPool((str(tmp_path),), FP, 4096, tpb, ops=ops)

    reader = fresh()
    assert reader.match_chain(seed, tokens, tpb, blocks) == (keys, blocks - 20)
    assert reader.not_indexed(keys) == list(range(blocks - 20, blocks))  # what it found is indexed
    assert fused == [native_impl == "c"]
    os.truncate(writer.path_for(keys[300]), 100)  # not a block file of this pool
    assert fresh().match_chain(seed, tokens, tpb, blocks) == (keys, 300)
    assert reader.match_chain(seed, tokens, tpb, blocks) == (keys, blocks - 20)  # first block indexed: its index
    assert len(fused) == 2  # the indexed reader keyed, then counted

    class Counting(FileOps):
        calls = 0

        def stat(self, path):
            Counting.calls += 1
            return super().stat(path)

    counting = fresh(Counting())
    Counting.calls = 0
    assert counting.match_chain(seed, tokens, tpb, blocks) == (keys, 300)
    assert Counting.calls == blocks - 19 and len(fused) == 2  # every stat (up to the gap) through the override
    short = CHAIN_PRESENT_MIN_BLOCKS - 1
    assert fresh().match_chain(seed, tokens, tpb, short) == (keys[:short], 300)
    assert len(fused) == 2


class _CloseFailsAfterRelease(FaultyFileOps):
    """close() of a temporary file releases the descriptor, then reports EIO (a deferred NFS write
    error); before it returns, another thread opens ``other`` and is given the freed number."""

    def __init__(self, other: str) -> None:
        super().__init__(seed=0)
        self.other, self.freed, self.other_fd = other, -1, -1
        self.add("close", "eio", count=1, path_contains=".tmp-")

    def close(self, fd: int) -> None:
        try:
            super().close(fd)
        except OSError:
            self.freed, self.other_fd = fd, os.open(self.other, os.O_RDONLY)
            raise


@pytest.mark.parametrize("via", ["publish", "publish_refs"])
def test_a_close_error_at_publication_never_closes_the_number_again(tmp_path, via):
    other = tmp_path / "other"
    other.write_bytes(b"another thread's file")
    ops = _CloseFailsAfterRelease(str(other))
    pool = BlockPool((str(tmp_path / "pool"),), FP, NBYTES, 16, ops=ops)
    key = os.urandom(32)
    if via == "publish":
        out = open_store(pool, PosixEngine(1)).save([key], [b"\0" * 32], [torch.zeros(NBYTES, dtype=torch.uint8)])
        assert out.failed == [(key, "EIO")]
    else:
        assert isinstance(pool.publish_refs("slab-a", [SlotRef(key, "slab-a", 0, 1)])[0], OSError)
    assert ops.other_fd == ops.freed >= 0  # the lowest free number: the one close released
    try:
        os.fstat(ops.other_fd)
    except OSError as exc:
        pytest.fail(f"the released descriptor was closed again, under another thread's file: {exc}")
    os.close(ops.other_fd)
    assert not pool.contains(key) and os.listdir(pool.dir_for(key)) == []  # nor a temporary file left


def test_format_doc_names_quarantine_entries_as_the_pool_does():
    """docs/format.md's quarantine entry name has the fields quarantine_name writes, in its order."""
    doc = (Path(REPO) / "docs" / "format.md").read_text()
    fields = re.findall(r"<([a-z-]+)>", re.search(r"quarantine/(<[a-z-]+>(?:\.<[a-z-]+>)*)", doc).group(1))
    parts = quarantine_name("ab" * 32, "checksum mismatch", now_ns=123).split(".")
    assert len(parts) == len(fields), (fields, parts)
    named = dict(zip(fields, parts))
    assert named["key"] == "ab" * 32 and named["ns"] == "123" and named["reason"] == "checksum_mismatch"
    assert re.fullmatch(r"[0-9a-f]{4}", named["rand"])

"""Edges of one save or load batch that the common path does not meet: a key repeated in a batch
(two requests of one prompt merged), an engine that raises instead of reporting per-block errors,
a reference whose slab is gone, key directories removed while an owner serves, and two hosts whose
names share a long prefix.  Arena tests run with mapped slabs (host-memory pools) and on disk."""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from gds_kv_connector.maintenance.eviction import evict

from tests.support import REPO
import torch

from tests.support.arena_helpers import PAYLOAD, data as _data, keys as _keys, load as _load
from gds_kv_connector.store import files as block_files
from gds_kv_connector.store import pool as pool_mod
from gds_kv_connector.store.arena import SlotArena
from gds_kv_connector.store.base import LoadFailure, open_store
from gds_kv_connector.engines.posix import PosixEngine
from gds_kv_connector.store.pool import STALE_FOREIGN_TMP_S, TMP_YOUNG_S, BlockPool, tmp_is_stale
from gds_kv_connector.util.host import HOST, host_tag
from gds_kv_connector.format.layout import TMP_PREFIX
from gds_kv_connector.format.records import (REF_ENTRY_SIZE, REF_HEADER_SIZE, ZERO_KEY, SlotRef, pack_refs,
                                          parse_refs)

FP = hashlib.sha256(b"save-batch-edges").digest()


@pytest.fixture
def shm_root(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = os.path.join(base, f"gdskv-edges-test-{os.getpid()}-{time.time_ns()}")
    os.makedirs(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["mapped", "disk"])
def mapped(request) -> bool:
    return request.param == "mapped"


@pytest.fixture
def engine():
    e = PosixEngine(io_threads=2)
    yield e
    e.close()


@pytest.fixture
def owners():
    """``make(root, engine, slots, mapped) -> BlockPool`` with a started arena, closed at the end."""
    made: list[BlockPool] = []

    def make(root: str, engine, slots: int, mapped: bool) -> BlockPool:
        pool = BlockPool((root,), FP, PAYLOAD, 16, refs=True)
        pool.arena = SlotArena(pool, engine, slots * pool.file_size, slots * pool.file_size, 0.0, mapped=mapped)
        pool.arena.start(background=False)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.arena.close()


def _as_another_owner(pool: BlockPool, keys: list[bytes]) -> None:
    """Forget what this process knows, so the next load resolves ``keys`` from the pool's files."""
    for k in keys:
        pool.forget(k)
    pool.arena.drop_caches()


def _quarantined(root: str) -> list[str]:
    return os.listdir(os.path.join(root, pool_mod.LAYOUT_DIR, pool_mod.QUARANTINE_DIR))


# -- a key repeated in one save batch --------------------------------------------------------------
def test_a_key_repeated_in_a_batch_is_saved_once(shm_root, engine, owners, mapped):
    """Two requests of one prompt merged into one batch: the repeat is counted present, takes no
    slot, and the reference file lists the key once, naming the slot its owner keeps."""
    a = owners(shm_root, engine, 8, mapped)
    k, d = _keys(2), _data(2, 1)
    out = open_store(a, engine).save([k[0], k[1], k[0]], [ZERO_KEY, k[0], ZERO_KEY], [d[0], d[1], d[0]])
    assert (out.published, out.already_present, out.lost_race, out.failed) == (2, 1, 0, [])
    raw = open(a.path_for(k[0]), "rb").read()
    assert len(raw) == REF_HEADER_SIZE + 2 * REF_ENTRY_SIZE
    assert parse_refs(raw, fingerprint=FP, slot_bytes=a.file_size)[k[0]] == a.arena.cached_ref(k[0])
    assert a.arena.usage()["used_slots"] == 2


def test_a_key_repeated_in_a_batch_of_block_files_is_written_once(tmp_path, engine):
    pool = BlockPool((str(tmp_path),), FP, PAYLOAD, 16)
    k, d = _keys(2), _data(2, 1)
    out = open_store(pool, engine).save([k[0], k[1], k[0]], [ZERO_KEY, k[0], ZERO_KEY], [d[0], d[1], d[0]])
    assert (out.published, out.already_present, out.lost_race, out.failed) == (2, 1, 0, [])
    assert torch.equal(_load(pool, engine, [k[0], k[1]]), d)


def test_a_reference_listing_a_key_twice_sends_readers_to_the_first_entry(shm_root, engine, owners, mapped,
                                                                          monkeypatch):
    """Files written before repeats were dropped list the key twice: its name was linked for the
    first entry, and the second entry's slot was freed at once and is reused by the next save."""
    monkeypatch.setattr(block_files, "_first_of_each_key", lambda keys, todo: todo)  # the older writer
    a = owners(shm_root, engine, 8, mapped)
    k, d = _keys(2), _data(2, 1)
    open_store(a, engine).save([k[0], k[1], k[0]], [ZERO_KEY, k[0], ZERO_KEY], [d[0], d[1], d[0]])
    nxt, dn = _keys(1, b"next"), _data(1, 9)
    open_store(a, engine).save(nxt, [ZERO_KEY], [dn[0]])  # takes the freed slot
    b = owners(shm_root, engine, 4, mapped)
    assert torch.equal(_load(b, engine, [k[0]])[0], d[0])
    assert _quarantined(shm_root) == []


def test_parse_refs_takes_a_repeated_key_s_first_entry():
    key, other = _keys(2)
    refs = [SlotRef(key, "h-1-abcd.slab", 0, 5), SlotRef(other, "h-1-abcd.slab", 1, 5),
            SlotRef(key, "h-1-abcd.slab", 2, 5)]
    got = parse_refs(pack_refs(FP, 8192, "h-1-abcd.slab", refs), fingerprint=FP, slot_bytes=8192)
    assert got == {key: refs[0], other: refs[1]}
    assert list(got) == [key, other]


# -- an engine that raises on a disk slab write ------------------------------------------------------
class _RaisingEngine(PosixEngine):
    """Raises from write, as an engine does when it cannot register a staging buffer."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(io_threads=2)
        self.exc: BaseException | None = exc

    def write(self, items, in_time=None, views_read=None):
        if self.exc is not None:
            exc, self.exc = self.exc, None
            raise exc
        return super().write(items, in_time, views_read)


def test_a_disk_slab_write_that_raises_frees_its_slots(shm_root, owners):
    eng = _RaisingEngine(RuntimeError("cudaErrorMemoryAllocation"))
    try:
        a = owners(shm_root, eng, 8, False)
        k, d = _keys(8), _data(8, 1)
        out = open_store(a, eng).save(k[:4], [ZERO_KEY] * 4, [d[i] for i in range(4)])
        assert (out.published, [cause for _, cause in out.failed]) == (0, ["RuntimeError"] * 4)
        assert [key for key, _ in out.failed] == k[:4]
        assert a.arena.usage()["free_slots"] == 8
        out = open_store(a, eng).save(k, [ZERO_KEY] * 8, [d[i] for i in range(8)])
        assert (out.published, out.arena_fallback) == (8, 0)
        assert torch.equal(_load(a, eng, k), d)
    finally:
        eng.close()


def test_an_interrupt_in_a_disk_slab_write_frees_its_slots_and_propagates(shm_root, owners):
    eng = _RaisingEngine(KeyboardInterrupt())
    try:
        a = owners(shm_root, eng, 4, False)
        k, d = _keys(4), _data(4, 1)
        with pytest.raises(KeyboardInterrupt):
            open_store(a, eng).save(k, [ZERO_KEY] * 4, [d[i] for i in range(4)])
        assert a.arena.usage()["free_slots"] == 4
    finally:
        eng.close()


# -- a reference whose slab is gone ------------------------------------------------------------------
def test_a_reference_whose_slab_is_gone_is_quarantined(shm_root, engine, owners, mapped):
    """The slab was removed (pool wipe, rm): the load fails, but the key must stop matching, or
    every owner that promises it fails again."""
    a = owners(shm_root, engine, 2, mapped)
    k, d = _keys(2), _data(2, 1)
    open_store(a, engine).save(k, [ZERO_KEY] * 2, [d[0], d[1]])
    a.arena.close()
    for name in os.listdir(a.arena.dir):
        os.unlink(os.path.join(a.arena.dir, name))
    b = owners(shm_root, engine, 2, mapped)
    assert b.count_present(k) == 2
    with pytest.raises(LoadFailure):
        _load(b, engine, k)
    _as_another_owner(b, k)
    assert b.count_present(k) == 0
    assert len(_quarantined(shm_root)) == 1
    assert os.path.exists(b.path_for(k[1]))  # the batch's other names go with eviction, unmatched


def test_a_slab_that_cannot_be_opened_for_now_leaves_its_reference(shm_root, engine, owners, monkeypatch):
    """Only a slab that is gone condemns the reference; EMFILE or EIO may pass."""
    a = owners(shm_root, engine, 2, False)
    k, d = _keys(2), _data(2, 1)
    open_store(a, engine).save(k, [ZERO_KEY] * 2, [d[0], d[1]])
    b = owners(shm_root, engine, 2, False)

    def slab_fd(name):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(b.arena, "slab_fd", slab_fd)
    with pytest.raises(LoadFailure):
        _load(b, engine, k)
    monkeypatch.undo()
    _as_another_owner(b, k)
    assert b.count_present(k) == 2 and _quarantined(shm_root) == []
    assert torch.equal(_load(b, engine, k), d)


def test_a_reference_to_a_slot_its_slab_does_not_have_is_quarantined(shm_root, engine, owners):
    """A disk slab shorter than the slot its reference names (cut short by hand, a damaged copy):
    that reference can never load again, so it must stop matching, as a mapped slab's does."""
    a = owners(shm_root, engine, 2, False)
    k, d = _keys(2), _data(2, 1)
    open_store(a, engine).save(k, [ZERO_KEY] * 2, [d[0], d[1]])
    slot_bytes = a.arena.slot_bytes
    a.arena.close()
    (slab,) = os.listdir(a.arena.dir)
    os.truncate(os.path.join(a.arena.dir, slab), slot_bytes)  # slot 0 stays, slot 1 is gone
    b = owners(shm_root, engine, 2, False)
    loads = []
    for key in k:
        _as_another_owner(b, k)
        try:
            _load(b, engine, [key])
            loads.append(True)
        except LoadFailure:
            loads.append(False)
    assert sorted(loads) == [False, True]
    _as_another_owner(b, k)
    assert len(_quarantined(shm_root)) == 1
    assert sum(b.count_present([key]) for key in k) == 1


# -- key directories removed while an owner serves ---------------------------------------------------
def _keys_in_dirs(first_bytes: int, per_dir: int) -> list[list[bytes]]:
    """``per_dir`` keys for each of ``first_bytes`` different first bytes (key directories)."""
    by_byte: dict[int, list[bytes]] = {}
    for i in range(100_000):
        k = hashlib.sha256(b"dir%d" % i).digest()
        got = by_byte.setdefault(k[0], [])
        if len(got) < per_dir:
            got.append(k)
        full = [v for v in by_byte.values() if len(v) == per_dir]
        if len(full) == first_bytes:
            return full
    raise AssertionError("not enough keys")


def test_arena_saves_go_on_after_the_key_directories_are_removed(shm_root, engine, owners, mapped):
    """The temporary reference file's own directory is gone: its open fails with ENOENT."""
    a = owners(shm_root, engine, 8, mapped)
    (k,) = _keys_in_dirs(1, 4)
    d = _data(4, 1)
    assert open_store(a, engine).save(k[:1], [ZERO_KEY], [d[0]]).published == 1
    for kk in glob.glob(os.path.join(a.fp_dirs[0], "[0-9a-f][0-9a-f]")):
        shutil.rmtree(kk)
    for i in range(1, 4):
        out = open_store(a, engine).save(k[i:i + 1], [ZERO_KEY], [d[i]])
        assert (out.published, out.failed) == (1, [])
    assert torch.equal(_load(a, engine, k[1:]), d[1:])


def test_arena_saves_link_into_a_key_directory_removed_meanwhile(shm_root, engine, owners, mapped):
    """The temporary file's directory is there, another key's is gone: link(2) fails with ENOENT."""
    a = owners(shm_root, engine, 8, mapped)
    first, second = _keys_in_dirs(2, 2)
    d = _data(4, 1)
    assert open_store(a, engine).save([first[0], second[0]], [ZERO_KEY] * 2, [d[0], d[1]]).published == 2
    shutil.rmtree(a.dir_for(second[0]))
    out = open_store(a, engine).save([first[1], second[1]], [ZERO_KEY] * 2, [d[2], d[3]])
    assert (out.published, out.failed) == (2, [])
    _as_another_owner(a, [first[1], second[1]])
    assert torch.equal(_load(a, engine, [first[1], second[1]]), d[2:])


# -- host names that share a long prefix -------------------------------------------------------------
NODE_A = "trtllm-llama3-70b-instruct-statefulset-worker-0"  # 47 characters: equal in the first 46
NODE_B = "trtllm-llama3-70b-instruct-statefulset-worker-1"
TAG_A, TAG_B = (host_tag(node.replace("-", "_")) for node in (NODE_A, NODE_B))


def test_host_tag_is_a_readable_prefix_and_a_hash_of_the_whole_name():
    a = NODE_A.replace("-", "_")
    assert host_tag(a) == f"trtllm_llama3_70b_instru_{hashlib.sha256(a.encode()).hexdigest()[:8]}"
    for name in (NODE_A, "", "a.b-c", ".hidden", "h/\u00e9\udcff x"):
        assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._]{0,23}_[0-9a-f]{8}", host_tag(name)), name


def test_this_host_s_tag_covers_its_whole_name():
    """Each node computes its own tag at import: run as two nodes whose names share 46 characters."""
    probe = ("import socket, sys; socket.gethostname = lambda: sys.argv[1]; "
             "from gds_kv_connector.util import host; print(host.HOST, host.HOST_TAG)")
    env = {**os.environ, "PYTHONPATH": REPO}
    seen = [subprocess.run([sys.executable, "-c", probe, node], env=env, capture_output=True, text=True,
                           check=True, timeout=120).stdout.split() for node in (NODE_A, NODE_B)]
    assert seen == [[NODE_A.replace("-", "_"), TAG_A], [NODE_B.replace("-", "_"), TAG_B]]
    assert TAG_A != TAG_B


def test_a_node_never_takes_another_node_s_temporary_file_for_its_own(tmp_path, monkeypatch):
    """Node B's clean-up removes its own dead writers' temporary files past TMP_YOUNG_S, but a file of
    node A, whose name shares B's first 46 characters, waits for the foreign age."""
    pool = BlockPool((str(tmp_path),), FP, PAYLOAD, 16)
    key = _keys(1)[0]
    monkeypatch.setattr(pool_mod, "HOST_TAG", TAG_A)
    fd, a_tmp = pool.create_tmp(key, None)
    os.close(fd)
    monkeypatch.setattr(pool_mod, "HOST_TAG", TAG_B)
    fd, b_tmp = pool.create_tmp(key, None)
    os.close(fd)
    dead = "4194305"  # above PID_MAX_LIMIT: no process runs with it
    a_dead, b_dead = (os.path.join(os.path.dirname(p), os.path.basename(p).replace(f"-{os.getpid()}-", f"-{dead}-"))
                      for p in (a_tmp, b_tmp))
    os.rename(a_tmp, a_dead)
    os.rename(b_tmp, b_dead)
    assert f"-{TAG_B}-{dead}-" in os.path.basename(b_dead)
    assert evict(pool.roots[0], 0, 0.5, 0, 1, now=time.time() + TMP_YOUNG_S + 5).tmp_removed == 1
    assert os.path.exists(a_dead) and not os.path.exists(b_dead)
    assert evict(pool.roots[0], 0, 0.5, 0, 1, now=time.time() + STALE_FOREIGN_TMP_S + 5).tmp_removed == 1
    assert not os.path.exists(a_dead)


def test_a_temporary_file_named_before_host_tags_waits_for_the_foreign_age(tmp_path):
    """Its host part (the host name cut to 40 characters) may be another host's."""
    pool = BlockPool((str(tmp_path),), FP, PAYLOAD, 16)
    key = _keys(1)[0]
    os.makedirs(pool.dir_for(key), exist_ok=True)
    path = os.path.join(pool.dir_for(key), f"{TMP_PREFIX}{key.hex()}-{HOST}-4194305-abcd1234")
    open(path, "wb").close()
    name = os.path.basename(path)
    assert not tmp_is_stale(name, path, time.time() + TMP_YOUNG_S + 5)
    assert tmp_is_stale(name, path, time.time() + STALE_FOREIGN_TMP_S + 5)


# -- views_read: the pages are free once the last write that reads them has them ---------------------
class _SpyEngine(PosixEngine):
    """Records each write's item count and whether it was given ``views_read``."""

    def __init__(self) -> None:
        super().__init__(io_threads=2)
        self.calls: list[tuple[int, bool]] = []

    def write(self, items, in_time=None, views_read=None):
        self.calls.append((len(items), views_read is not None))
        return super().write(items, in_time, views_read)


def test_only_a_save_s_last_write_says_its_views_are_read(shm_root, owners, mapped):
    """A disk arena with fewer free slots than the batch writes slab slots, then block files for the
    rest, which read the views again: only that second write may say they are read, once; a mapped
    arena copies without the engine's write, and the call comes as the save returns."""
    eng = _SpyEngine()
    try:
        pool = owners(shm_root, eng, 8, mapped)
        k, d = _keys(12), _data(12, 1)
        said: list[int] = []
        out = open_store(pool, eng).save(k, [ZERO_KEY] * 12, [d[i] for i in range(12)],
                          views_read=lambda: said.append(len(eng.calls)))
        assert out.published == 12 and out.arena_fallback == 4
        assert eng.calls == ([(4, True)] if mapped else [(8, False), (4, True)])
        assert said == [len(eng.calls)]
    finally:
        eng.close()

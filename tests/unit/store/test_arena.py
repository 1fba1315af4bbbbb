"""The slot arena: save, load, share, evict and reuse, adopt, detect reuse; every test that does not
look into a mapping runs with mapped slabs (host-memory pools) and with slabs moved by reads and
writes (disk pools)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
import zlib

import pytest
import torch

from tests.support.arena_helpers import PAYLOAD, data as _data, keys as _keys, load as _load
from gds_kv_connector.store import arena as arena_mod
from gds_kv_connector.store.arena import SlotArena, start_arena
from gds_kv_connector.store.base import LoadFailure, open_store
from gds_kv_connector.engines.host_dma import coalesce
from gds_kv_connector.engines.posix import PosixEngine
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.records import (REF_HEADER_SIZE, ZERO_KEY, FormatError, SlotRef, pack_refs,
                                          parse_ref, parse_refs)
from gds_kv_connector.config.settings import Settings, SettingsError

pytest.register_assert_rewrite("tests.support.fault_helpers")
from tests.support import fault_helpers as fh  # noqa: E402  (after the register, so its asserts are rewritten)

FP = hashlib.sha256(b"arena-test").digest()


@pytest.fixture
def shm_root(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = os.path.join(base, f"gdskv-arena-test-{os.getpid()}-{time.time_ns()}")
    os.makedirs(d)
    yield d
    import shutil
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def header_loops(native_impl):
    """Every arena test runs with the C header loops (where built) and with their Python fallback."""
    return native_impl


_MODE = {"mapped": True}


@pytest.fixture(autouse=True, params=["mapped", "disk"])
def slab_mode(request):
    """Which kind of slab ``_pool`` and ``_arena`` build; tests that read a mapping skip the disk kind."""
    if request.param == "disk" and request.node.get_closest_marker("mapped_only"):
        pytest.skip("looks into a slab mapping")
    _MODE["mapped"] = request.param == "mapped"
    yield request.param
    _MODE["mapped"] = True


def _arena(pool: BlockPool, engine, slots: int, per_slab: int, delay: float, clock=time.monotonic) -> SlotArena:
    return SlotArena(pool, engine, slots * pool.file_size, per_slab * pool.file_size, delay, clock=clock,
                     mapped=_MODE["mapped"])


def _flip(arena: SlotArena, ref: SlotRef, offset: int) -> None:
    """Damage one byte of a slot (``offset`` from the slot's start), through the mapping or the file."""
    slab = arena._slabs[ref.slab]
    off = ref.slot * arena.slot_bytes + offset
    if slab.mm is not None:
        slab.mm[off] = slab.mm[off] ^ 0xFF
    else:
        os.pwrite(slab.fd, bytes([os.pread(slab.fd, 1, off)[0] ^ 0xFF]), off)


@pytest.fixture
def engine():
    e = PosixEngine(io_threads=2)
    yield e
    e.close()


def _pool(root: str, engine, slots: int, delay: float = 0.0, clock=time.monotonic, per_slab: int = 2) -> BlockPool:
    pool = BlockPool((root,), FP, PAYLOAD, 16, refs=True)
    pool.arena = _arena(pool, engine, slots, per_slab, delay, clock)
    pool.arena.start(background=False)
    return pool


def test_save_load_and_share_between_owners(shm_root, engine):
    a = _pool(shm_root, engine, 8, per_slab=8)
    keys, data = _keys(5), _data(5, 1)
    out = open_store(a, engine).save(keys, [ZERO_KEY] * 5, [data[i] for i in range(5)])
    assert (out.published, out.arena_fallback, out.failed) == (5, 0, [])
    # one reference file for the batch, hard-linked under every key; no block files
    sts = [os.stat(a.path_for(k)) for k in keys]
    assert len({s.st_ino for s in sts}) == 1 and sts[0].st_nlink == 5
    assert sts[0].st_size == REF_HEADER_SIZE + 5 * 48
    assert torch.equal(_load(a, engine, keys), data)
    # a second owner (own arena, own slabs) resolves the references and maps a's slab to read it
    b = _pool(shm_root, engine, 4)
    assert b.count_present(keys) == 5
    assert torch.equal(_load(b, engine, keys), data)
    assert b.arena.usage()["slabs_created"] == 2 and b.arena.usage()["slabs_mapped"] == 1  # a's, on first read
    # a pool without refs enabled does not match reference files
    plain = BlockPool((shm_root,), FP, PAYLOAD, 16)
    assert plain.count_present(keys) == 0
    a.arena.close(), b.arena.close()


def test_pin_all_pins_remembered_slots_as_pin_does_and_stops_at_a_missing_key(shm_root, engine):
    a, b = _pool(shm_root, engine, 8, per_slab=8), _pool(shm_root, engine, 8, per_slab=8)
    mine, theirs, missing = _keys(3, b"mine"), _keys(2, b"theirs"), _keys(1, b"gone")[0]
    data = _data(5, 7)
    assert open_store(a, engine).save(mine, [ZERO_KEY] * 3, [data[i] for i in range(3)]).published == 3
    assert open_store(b, engine).save(theirs, [ZERO_KEY] * 2, [data[i] for i in range(3, 5)]).published == 2
    assert all(a.arena.cached_ref(k) is not None for k in mine) and a.arena.cached_ref(theirs[0]) is None
    out: list = []
    with pytest.raises(FileNotFoundError):
        a.pin_all(mine[:2] + theirs + [missing] + mine[2:], out)
    # the pins made before the missing key, each the one pin() makes; b's slots resolved through its file
    assert [p.key for p in out] == mine[:2] + theirs
    fields = lambda p: (p.key, p.key_dir, p.fd, p.slot)  # noqa: E731 (ino: the file's on first resolution)
    assert list(map(fields, out)) == [fields(a.pin(k)) for k in mine[:2] + theirs]
    assert [p.slot for p in out] == [a.arena.cached_ref(k) for k in mine[:2] + theirs]
    assert all(p.fd == -1 and p.slot.slab for p in out)
    with pytest.raises(LoadFailure) as failed:
        open_store(a).pin(theirs + [missing])
    assert failed.value.key == missing and failed.value.reason == "file vanished before it could be opened"
    assert torch.equal(_load(a, engine, mine + theirs), data)
    a.arena.close(), b.arena.close()


def test_lost_race_releases_the_slot(shm_root, engine):
    a, b = _pool(shm_root, engine, 4), _pool(shm_root, engine, 4)
    k, d = _keys(1), _data(1, 2)
    assert open_store(a, engine).save(k, [ZERO_KEY], [d[0]]).published == 1
    # b checks only its in-memory index before saving, so it writes the slot and loses at link(2)
    out = open_store(b, engine).save(k, [ZERO_KEY], [_data(1, 3)[0]])
    assert (out.published, out.already_present, out.failed) == (0, 1, [])
    assert b.arena.usage()["used_slots"] == 0 and b.arena.usage()["ready_slots"] == 4
    assert torch.equal(_load(b, engine, k), d)  # the winner's bytes
    a.arena.close(), b.arena.close()


def test_full_arena_evicts_oldest_and_reuses_after_delay(shm_root, engine):
    now = [1000.0]
    a = _pool(shm_root, engine, 4, delay=5.0, clock=lambda: now[0])
    old, new = _keys(4, b"old"), _keys(4, b"new")
    d_old, d_new = _data(4, 4), _data(4, 5)
    assert open_store(a, engine).save(old, [ZERO_KEY] * 4, [d_old[i] for i in range(4)]).published == 4
    stale = open_store(a).pin(old[:1])  # a reader resolved the slot just before it is evicted
    out = open_store(a, engine).save(new[:2], [ZERO_KEY] * 2, [d_new[i] for i in range(2)])
    # eviction freed the oldest slots, but they cool for 5 s: the blocks went to block files instead
    assert out.published == 2 and out.arena_fallback == 2
    assert a.arena.usage()["evicted"] >= 2
    for k in old[:2]:
        a.forget(k)
        assert not a.contains(k)
    now[0] += 6
    out = open_store(a, engine).save(new[2:], [ZERO_KEY] * 2, [d_new[i] for i in range(2, 4)])
    assert out.published == 2 and out.arena_fallback == 0
    assert torch.equal(_load(a, engine, new), d_new)
    assert torch.equal(_load(a, engine, old[2:]), d_old[2:])
    # the stale reader's slot now holds another block: it fails, never returns the wrong bytes
    view = torch.zeros(PAYLOAD, dtype=torch.uint8)
    with pytest.raises(LoadFailure):
        open_store(a, engine).load(stale, [view], verify=True, retries=0, deadline=time.monotonic() + 5)
    a.arena.close()


def test_saves_while_freed_slots_cool_evict_no_more_than_they_need(shm_root, engine):
    """Slots evicted for one save cool for the reuse delay; later saves within it count them
    instead of evicting another batch each (which bled a whole arena in 32 one-block saves)."""
    now = [1000.0]
    a = _pool(shm_root, engine, 64, delay=5.0, clock=lambda: now[0], per_slab=64)
    old, d = _keys(64, b"old"), _data(64, 13)
    assert open_store(a, engine).save(old, [ZERO_KEY] * 64, [d[i] for i in range(64)]).published == 64
    new, dn = _keys(10, b"new"), _data(10, 14)
    for i in range(8):  # one block each, all within the delay: block files
        out = open_store(a, engine).save(new[i:i + 1], [ZERO_KEY], [dn[i]])
        assert out.published == 1 and out.arena_fallback == 1
    u = a.arena.usage()
    assert (u["evicted"], u["used_slots"], u["free_slots"]) == (2, 62, 2)  # one batch: capacity/32
    now[0] += 6
    out = open_store(a, engine).save(new[8:], [ZERO_KEY] * 2, [dn[i] for i in range(8, 10)])
    assert out.published == 2 and out.arena_fallback == 0
    assert torch.equal(_load(a, engine, new[8:] + old[2:]), torch.cat([dn[8:], d[2:]]))
    a.arena.close()


def test_concurrent_reclaims_never_free_a_slot_reused_meanwhile(shm_root, engine, monkeypatch):
    """Thread 2 judges a slot free and is descheduled; thread 1 frees it, reuses it for D and
    publishes D.  Thread 2 must not then free the position: it holds D now."""
    import threading

    a = _pool(shm_root, engine, 2, per_slab=2)
    A, B, C, D = (_keys(1, tag)[0] for tag in (b"A", b"B", b"C", b"D"))
    d = _data(4, 15)
    assert open_store(a, engine).save([A, B], [ZERO_KEY] * 2, [d[0], d[1]]).published == 2
    os.unlink(a.path_for(A))  # evicted by another owner: its slot is free to reclaim
    read_ref, judged, d_published = a.read_ref, threading.Event(), threading.Event()

    def paused_read_ref(key):
        ref = read_ref(key)
        if threading.current_thread().name == "t2" and key == A and not judged.is_set():
            judged.set()
            d_published.wait(10)
        return ref

    monkeypatch.setattr(a, "read_ref", paused_read_ref)
    saved_c = []
    t2 = threading.Thread(target=lambda: saved_c.append(open_store(a, engine).save([C], [ZERO_KEY], [d[2]])), name="t2")
    t2.start()
    try:
        assert judged.wait(10)
        out = open_store(a, engine).save([D], [ZERO_KEY], [d[3]])
        assert out.published == 1 and out.arena_fallback == 0  # into A's old slot
    finally:
        d_published.set()
        t2.join(10)
    assert not t2.is_alive() and saved_c[0].published == 1 and saved_c[0].arena_fallback == 1
    assert a.arena.usage()["used_slots"] == 2 and a.arena.usage()["free_slots"] == 0
    assert torch.equal(_load(a, engine, [D, B]), d[[3, 1]])
    a.arena.close()


def test_a_reference_that_cannot_be_read_keeps_its_slot(shm_root, engine):
    """EMFILE or EIO reading a key's reference does not mean it is gone: reclaim and adoption keep
    the slot in use (it may still be named), and eviction frees no slot it could not unpublish."""
    import errno

    from tests.support.faults import FaultyFileOps

    ops = FaultyFileOps()
    pool = BlockPool((shm_root,), FP, PAYLOAD, 16, refs=True, ops=ops)
    pool.arena = _arena(pool, engine, 2, 2, 0.0)
    pool.arena.start(background=False)
    A, B, C = (_keys(1, tag)[0] for tag in (b"A", b"B", b"C"))
    d = _data(3, 16)
    assert open_store(pool, engine).save([A, B], [ZERO_KEY] * 2, [d[0], d[1]]).published == 2
    ops.add("open", "errno", errno=errno.EMFILE, count=1, path_contains=A.hex())  # reclaim's check of A
    ops.add("open", "eio", count=1, skip=1, path_contains=B.hex())  # B's eviction (after its check)
    out = open_store(pool, engine).save([C], [ZERO_KEY], [d[2]])
    assert out.published == 1 and out.arena_fallback == 1
    u = pool.arena.usage()
    assert (u["used_slots"], u["free_slots"], u["reclaim_errors"], u.get("evicted", 0)) == (2, 0, 2, 0)
    assert ops.total_injected("open") == 2
    pool.arena.close()
    # a restarted owner adopts the slab while A's reference cannot be read: A's slot stays in use
    ops = FaultyFileOps()
    b = BlockPool((shm_root,), FP, PAYLOAD, 16, refs=True, ops=ops)
    b.arena = _arena(b, engine, 2, 2, 0.0)
    ops.add("open", "errno", errno=errno.EMFILE, count=1, path_contains=A.hex())
    b.arena.start(background=False)
    assert ops.total_injected("open") == 1
    assert b.arena.usage()["slabs_adopted"] == 1 and b.arena.usage()["used_slots"] == 2
    assert torch.equal(_load(b, engine, [A, B]), d[:2])
    b.arena.close()


def test_damaged_slot_payload_is_detected(shm_root, engine):
    a = _pool(shm_root, engine, 2)
    k, d = _keys(1), _data(1, 6)
    open_store(a, engine).save(k, [ZERO_KEY], [d[0]])
    _flip(a.arena, a.arena.cached_ref(k[0]), 4096 + 100)
    with pytest.raises(LoadFailure, match="checksum"):
        _load(a, engine, k)
    a.arena.close()


def test_a_new_owner_adopts_the_slabs_of_a_finished_one(shm_root, engine):
    a = _pool(shm_root, engine, 4)
    keys, d = _keys(3), _data(3, 7)
    open_store(a, engine).save(keys, [ZERO_KEY] * 3, [d[i] for i in range(3)])
    os.unlink(a.path_for(keys[1]))  # evicted by some other owner meanwhile
    a.arena.close()  # the owner exits: its flock is released, its slabs stay
    b = _pool(shm_root, engine, 4)
    u = b.arena.usage()
    assert u["slabs_adopted"] == 2 and u.get("slabs_created", 0) == 0
    assert u["used_slots"] == 2 and u["free_slots"] == 2
    assert torch.equal(_load(b, engine, [keys[0], keys[2]]), d[[0, 2]])
    # new saves only take the free slots, never the live ones
    more, dm = _keys(2, b"more"), _data(2, 8)
    assert open_store(b, engine).save(more, [ZERO_KEY] * 2, [dm[i] for i in range(2)]).arena_fallback == 0
    assert torch.equal(_load(b, engine, [keys[0], keys[2]] + more), torch.cat([d[[0, 2]], dm]))
    b.arena.close()


def test_adoption_takes_over_a_slab_a_load_mapped_first(shm_root, engine):
    """A restarted owner serves loads while its builder adopts slabs: a slab a load mapped first must
    stay mapped (same addresses), or a copy in flight would read unmapped memory and crash."""
    a = _pool(shm_root, engine, 2, per_slab=2)
    keys, d = _keys(2), _data(2, 9)
    open_store(a, engine).save(keys, [ZERO_KEY] * 2, [d[i] for i in range(2)])
    a.arena.close()
    b = BlockPool((shm_root,), FP, PAYLOAD, 16, refs=True)
    b.arena = _arena(b, engine, 2, 2, 0.0)
    assert torch.equal(_load(b, engine, keys), d)  # maps the slab for reading, before the builder runs
    (name, mapped), = b.arena._slabs.items()
    fd, ino = mapped.fd, os.fstat(mapped.fd).st_ino
    b.arena.start(background=False)
    assert b.arena._slabs[name] is mapped and b.arena.usage()["slabs_adopted"] == 1
    # a read that looked the descriptor up before the adoption still reads the slab through it ...
    assert mapped.fd == fd and os.fstat(fd).st_ino == ino
    assert os.get_inheritable(fd) is False
    other = os.open(os.path.join(b.arena.dir, name), os.O_RDONLY)
    try:  # ... and the owner's lock is held through that number
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(other)
    assert b.arena.usage()["used_slots"] == 2
    assert torch.equal(_load(b, engine, keys), d)
    b.arena.close()


def test_an_adopted_slab_s_free_slots_cool_before_reuse(shm_root, engine):
    """A slot of a dead owner whose reference was evicted just before may still be read by a
    reader that resolved it: the adopter waits out the reuse delay, as the owner would have."""
    now = [1000.0]
    a = _pool(shm_root, engine, 1, delay=5.0, clock=lambda: now[0], per_slab=1)
    reader = _pool(shm_root, engine, 1, delay=5.0, clock=lambda: now[0], per_slab=1)
    k, n = _keys(1, b"K"), _keys(2, b"N")
    d, dn = _data(1, 17), _data(2, 18)
    assert open_store(a, engine).save(k, [ZERO_KEY], [d[0]]).published == 1
    a.arena.close()  # the owner dies
    pins = open_store(reader).pin(k)
    os.unlink(reader.path_for(k[0]))  # evicted just after the reader resolved it
    b = _pool(shm_root, engine, 1, delay=5.0, clock=lambda: now[0], per_slab=1)
    u = b.arena.usage()
    assert (u["slabs_adopted"], u["used_slots"], u["free_slots"], u["ready_slots"]) == (1, 0, 1, 0)
    assert open_store(b, engine).save(n[:1], [ZERO_KEY], [dn[0]]).arena_fallback == 1
    view = torch.zeros(PAYLOAD, dtype=torch.uint8)
    open_store(reader, engine).load(pins, [view], verify=True, retries=0, deadline=time.monotonic() + 5)
    assert torch.equal(view, d[0])
    now[0] += 6
    assert open_store(b, engine).save(n[1:], [ZERO_KEY], [dn[1]]).arena_fallback == 0
    b.arena.close(), reader.arena.close()


def test_reference_format_is_strict():
    refs = [SlotRef(k, "h-1-abc.slab", i, 10 + i) for i, k in enumerate(_keys(3))]
    raw = pack_refs(FP, 8192, "h-1-abc.slab", refs)
    assert parse_ref(raw, key=refs[1].key, fingerprint=FP, slot_bytes=8192) == refs[1]
    with pytest.raises(FormatError, match="no entry"):
        parse_ref(raw, key=_keys(1, b"x")[0], fingerprint=FP, slot_bytes=8192)
    with pytest.raises(FormatError, match="slot size"):
        parse_ref(raw, key=refs[0].key, fingerprint=FP, slot_bytes=4096)
    bad = bytearray(raw)
    bad[REF_HEADER_SIZE + 40] ^= 1
    with pytest.raises(FormatError, match="checksum"):
        parse_ref(bytes(bad), key=refs[0].key, fingerprint=FP, slot_bytes=8192)
    with pytest.raises(FormatError, match="slab name"):
        pack_refs(FP, 8192, "../x", refs)
    every = parse_refs(raw, fingerprint=FP, slot_bytes=8192)
    assert every == {r.key: r for r in refs} and {type(r) for r in every.values()} == {SlotRef}
    # a set reserved field of the second entry, under a valid checksum, is refused too
    bad = bytearray(raw)
    bad[REF_HEADER_SIZE + 48 + 36] = 1
    fixed = REF_HEADER_SIZE - 4  # the CRC-32 is the header's last 4 bytes
    bad[fixed:REF_HEADER_SIZE] = zlib.crc32(bad[REF_HEADER_SIZE:], zlib.crc32(bad[:fixed])).to_bytes(4, "little")
    with pytest.raises(FormatError, match="reserved reference entry"):
        parse_refs(bytes(bad), fingerprint=FP, slot_bytes=8192)


def test_coalesce_joins_consecutive_slots_only():
    w, slot = 1000, 5096
    items = [(10_000 + i * slot, (1 << 20) + i * w, w) for i in (3, 0, 1, 2)]  # shuffled
    items.append((900_000, (1 << 20) + 7 * w, w))  # device gap: a new run
    items.append((900_000 + slot, (1 << 20) + 8 * w, w))
    assert coalesce(items, slot) == [(10_000, 1 << 20, w, slot, 4), (900_000, (1 << 20) + 7 * w, w, slot, 2)]
    # slots not consecutive (a larger stride) stay separate copies
    assert len(coalesce([(0, 0, w), (2 * slot, w, w), (4 * slot, 2 * w, w)], slot)) == 3


def test_start_arena_maps_slabs_on_host_memory_only(shm_root, engine, monkeypatch, slab_mode):
    if slab_mode == "disk":
        pytest.skip("start_arena picks the kind itself")
    s = Settings.load_from({"TLLM_GDS_KV_ROOT": shm_root, "TLLM_GDS_KV_ARENA_BYTES": "1MiB",
                            "TLLM_GDS_KV_ARENA_SLAB_BYTES": "1MiB"})
    for fs, mapped in (("tmpfs", True), ("ext4", False)):
        monkeypatch.setattr(arena_mod, "fs_type", lambda p, _fs=fs: _fs)
        pool = BlockPool((shm_root,), FP, PAYLOAD, 16, refs=True)
        pool.arena = start_arena(pool, engine, s)
        assert pool.arena.wait_ready(10) and pool.arena.mapped is mapped
        slab = next(iter(pool.arena._slabs.values()))
        assert (slab.mm is not None) is mapped
        keys, d = _keys(3, fs.encode()), _data(3, 21)
        assert open_store(pool, engine).save(keys, [ZERO_KEY] * 3, [d[i] for i in range(3)]).published == 3
        assert torch.equal(_load(pool, engine, keys), d)
        pool.arena.close()
    with pytest.raises(SettingsError, match="one pool root"):
        Settings.load_from({"TLLM_GDS_KV_ROOT": "/a:/b", "TLLM_GDS_KV_ARENA_BYTES": "1MiB"})


def test_disk_slots_are_preallocated_and_loads_verify_without_verify(shm_root, engine, slab_mode):
    """Slabs on disk: blocks reserved at creation (no allocating write per slot), and a load checks
    the payload against the header read with it even with verify off, since one write's pages
    reach the disk in no promised order (a reader racing a reuse may see the old header)."""
    if slab_mode == "mapped":
        pytest.skip("disk slabs only")
    a = _pool(shm_root, engine, 4, per_slab=4)
    slab = next(iter(a.arena._slabs.values()))
    st = os.fstat(slab.fd)
    assert st.st_size == 4 * a.file_size and st.st_blocks * 512 >= st.st_size
    keys, d = _keys(2), _data(2, 22)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 2, [d[i] for i in range(2)]).published == 2
    _flip(a.arena, a.arena.cached_ref(keys[1]), 4096 + 5)
    views = torch.zeros((2, PAYLOAD), dtype=torch.uint8)
    pins = open_store(a).pin(keys)
    with pytest.raises(LoadFailure, match="checksum mismatch"):
        open_store(a, engine).load(pins, [views[0], views[1]], verify=False, retries=0, deadline=time.monotonic() + 5)
    a.arena.close()


def _unwritten_extents(fd: int) -> int | None:
    """Extents of the file that are allocated but never written (FIEMAP_EXTENT_UNWRITTEN); None
    where the filesystem has no FIEMAP (tmpfs)."""
    import fcntl
    import struct

    count = 256
    req = bytearray(struct.pack("QQIIII", 0, (1 << 64) - 1, 0, 0, count, 0) + bytes(56 * count))
    try:
        fcntl.ioctl(fd, 0xC020660B, req)  # FS_IOC_FIEMAP
    except OSError:
        return None
    mapped = struct.unpack_from("I", req, 20)[0]
    return sum(1 for i in range(mapped) if struct.unpack_from("I", req, 32 + 56 * i + 40)[0] & 0x800)


def test_new_disk_slabs_hold_no_unwritten_extents(tmp_path, engine, slab_mode):
    """A new disk slab is written once at creation, so a slot's first save is an overwrite; a
    file only fallocated (the control) shows the unwritten extents that this check looks for."""
    if slab_mode == "mapped":
        pytest.skip("disk slabs only")
    control = os.open(tmp_path / "control", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(control, 0, 1 << 20)
        if not _unwritten_extents(control):
            pytest.skip(f"{tmp_path} reports no unwritten extents (no FIEMAP, or no fallocate)")
    finally:
        os.close(control)
    a = _pool(str(tmp_path), engine, 4, per_slab=4)
    slab = next(iter(a.arena._slabs.values()))
    assert _unwritten_extents(slab.fd) == 0
    assert os.pread(slab.fd, 4096, 4096) == bytes(4096)
    keys, d = _keys(2), _data(2, 24)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 2, [d[i] for i in range(2)]).published == 2
    assert torch.equal(_load(a, engine, keys), d)
    a.arena.close()


def test_a_remembered_disk_slot_that_moved_is_resolved_again(shm_root, engine, slab_mode):
    """A location this owner remembered no longer matches the slot's header (the block was
    evicted and saved again elsewhere, the slot reused): the load resolves the key afresh from
    the pool instead of failing; a reference read from the pool that does not match fails."""
    if slab_mode == "mapped":
        pytest.skip("disk slabs only (the mapped path has its own: _check_slots)")
    a, c = _pool(shm_root, engine, 4, per_slab=4), _pool(shm_root, engine, 4, per_slab=4)
    keys, d = _keys(2), _data(2, 23)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 2, [d[i] for i in range(2)]).published == 2
    good = [a.read_ref(k) for k in keys]
    for ref in good:
        c.arena.remember(ref._replace(created_ns=ref.created_ns + 1))  # out of date
    assert torch.equal(_load(c, engine, keys), d)
    assert [c.arena.cached_ref(k) for k in keys] == good
    a.arena.close(), c.arena.close()


def test_connector_round_trip_with_arena_and_restart(pool_env, monkeypatch, shm_root):
    from tests.support.connector_helpers import rand_tokens, serve
    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    from gds_kv_connector.simulator import ExecutorConfig, ModelShape, ReferenceExecutor, fake_llm_args

    monkeypatch.setenv("TLLM_GDS_KV_ROOT", shm_root)
    monkeypatch.setenv("TLLM_GDS_KV_ARENA_BYTES", "8MiB")
    shape = ModelShape(num_layers=2, kv_factor=2, block_elems=1024, tokens_per_block=16)
    prompts = [rand_tokens(200, 1) + rand_tokens(40, 10 + i) for i in range(4)]

    def executor():
        llm_args = fake_llm_args(16)
        return ReferenceExecutor(GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args),
                                 ExecutorConfig(shape=shape, num_blocks=128, device="cpu", chunk_size=64))

    ex1 = executor()
    ex1.worker.pool.arena.wait_ready(30)
    serve(ex1, prompts)
    saved = ex1.worker._snapshot()
    ex1.worker.shutdown()
    assert saved.get("blocks_saved", 0) > 0 and not saved.get("save_arena_fallback")
    assert saved["arena_used_slots"] == saved["blocks_saved"] and saved["arena_slabs_created"] >= 1
    ex2 = executor()
    ex2.worker.pool.arena.wait_ready(30)
    assert ex2.worker.pool.arena.usage().get("slabs_adopted", 0) >= 1
    st = serve(ex2, prompts)
    assert st.loaded_tokens == sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert st.blocks_verified >= st.loaded_tokens // 16
    for i in range(len(prompts)):
        assert ex2.output_tokens(i) == ex1.output_tokens(i)
    ex2.worker.shutdown()


def test_verify_checks_arena_slots_through_their_references(shm_root, engine):
    from gds_kv_connector.maintenance.verify import verify

    a = _pool(shm_root, engine, 8, per_slab=8)
    keys, d = _keys(4), _data(4, 9)
    open_store(a, engine).save(keys, [ZERO_KEY] * 4, [d[i] for i in range(4)])
    r = verify(shm_root, workers=2, progress=False)
    assert (r["checked"], r["ok"], r["bad"]) == (4, 4, 0)
    _flip(a.arena, a.arena.cached_ref(keys[2]), 4096 + 7)
    r = verify(shm_root, workers=2, progress=False)
    assert (r["ok"], r["reasons"], r["quarantined"]) == (3, {"checksum": 1}, 1)
    assert not os.path.exists(a.path_for(keys[2])) and os.path.exists(a.path_for(keys[1]))
    _flip(a.arena, a.arena.cached_ref(keys[0]), 3)  # the slot's header magic
    r = verify(shm_root, workers=2, progress=False)
    assert (r["ok"], r["reasons"]) == (2, {"header": 1})
    (bad,) = r["bad_files"]
    assert bad["detail"].startswith("slot ") and "#" in bad["detail"] and not os.path.exists(a.path_for(keys[0]))
    slab = a.arena.cached_ref(keys[1]).slab
    os.unlink(os.path.join(a.arena.dir, slab))
    r = verify(shm_root, workers=2, progress=False)
    assert (r["ok"], r["reasons"]) == (0, {"header": 2})
    assert all(f["detail"] == f"slab {slab} is missing" for f in r["bad_files"])
    a.arena.close()


def test_slab_names_fit_the_reference_field_with_a_long_hostname(shm_root, engine, monkeypatch):
    import gds_kv_connector.util.host as pool_mod

    monkeypatch.setattr(pool_mod, "HOST", "h" * 40)  # the longest host part util.host produces
    monkeypatch.setattr(os, "getpid", lambda: 4194303)  # and the longest Linux pid (pid_max 2**22)
    a = _pool(shm_root, engine, 2)
    assert a.arena.usage()["slabs_created"] == 1 and not a.arena.usage().get("build_errors")
    keys, d = _keys(2), _data(2, 11)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 2, [d[i] for i in range(2)]).published == 2
    assert torch.equal(_load(a, engine, keys), d)
    a.arena.close()


def test_slots_whose_writes_start_after_the_deadline_are_freed_and_counted_expired(shm_root, slab_mode):
    """A save past its deadline stops between blocks: on disk slabs the slots left unwritten go back
    to the arena and count as expired, not failed; mapped slots are a memory copy, never stopped."""
    engine = PosixEngine(io_threads=1)  # one write at a time: the deadline passes after the second
    written_so_far = fh.count_writes(engine)
    pool = BlockPool((shm_root,), FP, PAYLOAD, 16, refs=True)
    pool.arena = _arena(pool, engine, 8, 8, 0.0)
    pool.arena.start(background=False)
    keys, d = _keys(5), _data(5, 13)
    out = open_store(pool, engine).save(keys, [ZERO_KEY] * 5, [d[i] for i in range(5)], lambda: written_so_far[0] < 2)
    written = 5 if slab_mode == "mapped" else 2
    assert (out.published, out.expired, out.failed) == (written, 5 - written, [])
    present = [k for k in keys if pool.contains(k)]
    assert len(present) == written
    u = pool.arena.usage()
    assert u["used_slots"] == written and u["ready_slots"] == 8 - written
    assert torch.equal(_load(pool, engine, present), d[[keys.index(k) for k in present]])
    pool.arena.close()
    engine.close()


def test_a_failed_link_fails_only_its_block_and_frees_its_slot(shm_root, engine):
    from tests.support.faults import FaultyFileOps

    ops = FaultyFileOps(seed=3)
    pool = BlockPool((shm_root,), FP, PAYLOAD, 16, refs=True, ops=ops)
    pool.arena = _arena(pool, engine, 4, 4, 0.0)
    pool.arena.start(background=False)
    keys, d = _keys(3), _data(3, 12)
    ops.add("link", "eio", count=1, skip=1)  # the second key's link fails
    out = open_store(pool, engine).save(keys, [ZERO_KEY] * 3, [d[i] for i in range(3)])
    assert out.published == 2 and [cause for _, cause in out.failed] == ["EIO"]
    failed = out.failed[0][0]
    assert failed == keys[1] and not os.path.exists(pool.path_for(failed))
    u = pool.arena.usage()
    assert u["used_slots"] == 2 and u["ready_slots"] == 2  # the failed block's slot is free again
    ok = [k for k in keys if k != failed]
    assert torch.equal(_load(pool, engine, ok), d[[0, 2]])
    pool.arena.close()


def test_free_slots_are_taken_in_runs_and_come_back_in_runs(shm_root, engine):
    now = [50.0]
    a = _pool(shm_root, engine, 6, delay=2.0, clock=lambda: now[0], per_slab=4)  # slabs of 4 and 2 slots
    first = a.arena.alloc(3)
    assert len(first) == 3 and len({slab for slab, _ in first}) == 1
    assert [slot for _, slot in first] == [0, 1, 2]
    rest = a.arena.alloc(5)  # what is left: the first slab's last slot, then the second slab
    assert len(rest) == 3 and set(first).isdisjoint(rest)
    assert a.arena.usage()["alloc_short"] == 2 and a.arena.usage()["free_slots"] == 0
    a.arena.release(*first[1])  # a slot never published: ready again at once, first in line
    assert a.arena.alloc(1) == [first[1]]
    for s in rest:
        a.arena.release(*s)
    got = a.arena.alloc(6)
    assert sorted(got) == sorted(rest) and a.arena.usage()["free_slots"] == 0
    a.arena.close()


def test_second_alloc_pass_fills_the_whole_request(shm_root, engine):
    # 4 slots ready, 4 published and evictable: a request for 6 takes the 4, then reclaims and takes 2 more
    a = _pool(shm_root, engine, 8, per_slab=8)
    keys, d = _keys(4), _data(4, 7)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 4, [d[i] for i in range(4)]).published == 4
    got = a.arena.alloc(6)
    assert len(got) == 6 and len(set(got)) == 6
    a.arena.close()


def test_runs_groups_consecutive_slots():
    assert arena_mod._runs([5, 1, 2, 3, 9, 8]) == [(1, 3), (5, 1), (8, 2)]
    assert arena_mod._runs([]) == []


@pytest.mark.mapped_only
def test_check_records_stops_at_a_slot_outside_its_slab_or_an_unknown_slab(shm_root, engine):
    a = _pool(shm_root, engine, 4, per_slab=4)
    keys, d = _keys(3), _data(3, 8)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 3, [d[i] for i in range(3)]).published == 3
    good = [a.read_ref(k) for k in keys]
    addrs, _, sums, bad, err = a.arena.check_records(good)
    assert bad == -1 and err is None and len(addrs) == len(sums) == 3
    outside = good[1]._replace(slot=4)
    addrs, _, _, bad, err = a.arena.check_records([good[0], outside, good[2]])
    assert bad == 1 and len(addrs) == 1 and isinstance(err, FormatError) and "outside slab" in str(err)
    unknown = good[2]._replace(slab="nobody-1-000000000000.slab")
    addrs, _, _, bad, err = a.arena.check_records([good[0], good[1], unknown])
    assert bad == 2 and len(addrs) == 2 and isinstance(err, OSError)
    a.arena.close()


def test_coalesce_lists_matches_coalesce_on_runs_and_on_scattered_blocks():
    from gds_kv_connector.engines.host_dma import coalesce_lists
    w, slot = 8192, 8192 + 4096
    one_run = ([10_000 + i * slot for i in range(5)], [(1 << 20) + i * w for i in range(5)], [w] * 5)
    assert coalesce_lists(*one_run, slot) == [(10_000, 1 << 20, w, slot, 5)]
    hosts, devs = [900_000, 10_000, 10_000 + slot, 50_000], [(1 << 20) + 9 * w, 1 << 20, (1 << 20) + w, 0]
    assert coalesce_lists(hosts, devs, [w] * 4, slot) == coalesce(list(zip(hosts, devs, [w] * 4)), slot)
    assert len(coalesce_lists(hosts, devs, [w] * 4, slot)) == 3
    # equal strides but unequal widths are not one run
    assert len(coalesce_lists([0, slot], [0, w], [w, w - 512], slot)) == 2
    assert coalesce_lists([], [], [], slot) == []


def test_a_loaded_block_is_evicted_after_the_ones_not_used_since(shm_root, engine):
    a = _pool(shm_root, engine, 4, per_slab=4)
    keys, d = _keys(4), _data(4, 9)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 4, [d[i] for i in range(4)]).published == 4
    assert torch.equal(_load(a, engine, keys[:1]), d[:1])  # keys[0] becomes the most recently used
    new = _keys(1, b"new")
    assert open_store(a, engine).save(new, [ZERO_KEY], [_data(1, 10)[0]]).published == 1
    assert a.arena.usage()["evicted"] == 1
    for k in keys:
        a.forget(k)
    assert a.contains(keys[0]) and not a.contains(keys[1])  # the oldest untouched one went
    assert a.contains(keys[2]) and a.contains(keys[3]) and a.contains(new[0])
    a.arena.close()


def test_a_saved_block_leaves_one_object_for_the_cyclic_gc_in_the_arena(shm_root, engine):
    """Positions are ints (untracked by the cyclic GC) and the LRU's values are the SlotRefs that
    _where holds: a save batch of 256 blocks no longer leaves 768 tracked objects behind."""
    import gc

    a = _pool(shm_root, engine, 8, per_slab=4)
    keys, d = _keys(6), _data(6, 12)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 6, [d[i] for i in range(6)]).published == 6
    used = a.arena._used
    assert len(used) == 6 and len({ref.slab for ref in used.values()}) == 2  # the batch spanned two slabs
    for pos, ref in used.items():
        assert type(pos) is int and not gc.is_tracked(pos)
        assert a.arena._where[ref.key] is ref
        assert pos & 0xFFFFFFFF == ref.slot and pos >> 32 == a.arena._slabs[ref.slab].sid
    a.arena.close()


def test_disk_slabs_are_fsynced_once_each_before_their_references(shm_root, engine, slab_mode):
    """TLLM_GDS_KV_FSYNC with slabs on disk: one fsync per slab written in the batch, before the
    reference file; a failed fsync fails that slab's blocks and frees their slots."""
    if slab_mode == "mapped":
        pytest.skip("disk slabs only")
    from gds_kv_connector.engines.fileops import FileOps

    class _Syncs(FileOps):
        def __init__(self):
            self.fds: list[int] = []
            self.fail = False

        def fsync(self, fd):
            self.fds.append(fd)
            if self.fail:
                raise OSError(5, "fsync failed")
            super().fsync(fd)

    ops = _Syncs()
    pool = BlockPool((shm_root,), FP, PAYLOAD, 16, refs=True, fsync=True, ops=ops)
    pool.arena = _arena(pool, engine, 4, 2, 0.0)  # two slabs of two slots
    pool.arena.start(background=False)
    keys, d = _keys(3), _data(3, 24)
    out = open_store(pool, engine).save(keys, [ZERO_KEY] * 3, [d[i] for i in range(3)])
    assert out.published == 3 and len(ops.fds) == 2 and len(set(ops.fds)) == 2
    assert torch.equal(_load(pool, engine, keys), d)
    ops.fail = True
    more = _keys(1, b"more")
    out = open_store(pool, engine).save(more, [ZERO_KEY], [_data(1, 25)[0]])
    assert out.published == 0 and [cause for _, cause in out.failed] == ["EIO"]
    assert not os.path.exists(pool.path_for(more[0]))
    assert pool.arena.usage()["used_slots"] == 3 and pool.arena.usage()["ready_slots"] == 1
    pool.arena.close()


def test_a_slab_removed_under_its_references_fails_the_load_cleanly(shm_root, engine, slab_mode):
    a = _pool(shm_root, engine, 2, per_slab=2)
    keys, d = _keys(2), _data(2, 26)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 2, [d[i] for i in range(2)]).published == 2
    a.arena.close()
    for name in os.listdir(a.arena.dir):
        os.unlink(os.path.join(a.arena.dir, name))
    b = _pool(shm_root, engine, 2, per_slab=2)
    with pytest.raises(LoadFailure, match="slab"):
        _load(b, engine, keys)
    b.arena.close()


def test_gc_removes_slabs_no_owner_holds_and_no_reference_names(shm_root, engine, slab_mode):
    from gds_kv_connector.maintenance.operations import format_gc, gc

    a = _pool(shm_root, engine, 4, per_slab=2)  # two slabs; the batch below fills only the first
    keys, d = _keys(2), _data(2, 27)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 2, [d[i] for i in range(2)]).published == 2
    used = a.arena.cached_ref(keys[0]).slab
    slabs = sorted(os.listdir(a.arena.dir))
    assert len(slabs) == 2
    later = time.time() + 120  # past the age under which a slab may still be being created
    # the owner is alive: its slabs are held, nothing goes
    r = gc(shm_root, 0, 0.9, now=later)
    assert (r["slabs_removed"], r["slabs_held_by_owners"]) == (0, 2)
    a.arena.close()
    # a fresh slab (ctime within the last minute) is left alone: its creator locks it after creating it
    assert gc(shm_root, 0, 0.9)["slabs_removed"] == 0
    r = gc(shm_root, 0, 0.9, dry_run=True, now=later)
    assert (r["slabs_removed"], r["slabs_kept_referenced"]) == (1, 1) and len(os.listdir(a.arena.dir)) == 2
    r = gc(shm_root, 0, 0.9, now=later)
    assert (r["slabs_removed"], r["slabs_kept_referenced"]) == (1, 1)
    assert r["slab_bytes_removed"] == 2 * a.file_size and "arena slabs no owner holds" in format_gc(r)
    assert os.listdir(a.arena.dir) == [used]
    b = _pool(shm_root, engine, 2, per_slab=2)  # adopts the slab that is left, serves its blocks
    assert b.arena.usage()["slabs_adopted"] == 1
    assert torch.equal(_load(b, engine, keys), d)
    b.arena.close()
    for k in keys:  # once no reference names it, it goes too
        os.unlink(b.path_for(k))
    assert gc(shm_root, 0, 0.9, now=later)["slabs_removed"] == 1 and os.listdir(a.arena.dir) == []


def test_stats_counts_arena_slabs_per_fingerprint(shm_root, engine, slab_mode):
    from gds_kv_connector.maintenance.operations import format_stats, stats

    a = _pool(shm_root, engine, 4, per_slab=2)
    keys, d = _keys(3), _data(3, 28)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 3, [d[i] for i in range(3)]).published == 3
    r = stats(shm_root)
    (entry,) = r["fingerprints"].values()
    assert entry["blocks"] == 3 and entry["slabs"] == 2 and entry["slab_bytes"] == 4 * a.file_size
    assert "2 arena slabs" in format_stats(r)
    a.arena.close()


def test_slabs_of_another_host_are_read_but_never_adopted_or_collected(shm_root, engine, monkeypatch):
    """A flock may be per node on a shared filesystem: a free lock seen from another host does not
    prove the owner is gone, so only the host that created a slab adopts or removes it."""
    import gds_kv_connector.util.host as pool_mod
    from gds_kv_connector.maintenance.operations import gc

    monkeypatch.setattr(pool_mod, "HOST", "nodea")
    a = _pool(shm_root, engine, 2, per_slab=2)
    keys, d = _keys(2), _data(2, 29)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 2, [d[i] for i in range(2)]).published == 2
    a.arena.close()
    (slab,) = os.listdir(a.arena.dir)
    assert slab.startswith(f"{pool_mod.host_tag('nodea')}-")
    monkeypatch.setattr(pool_mod, "HOST", "nodeb")
    b = _pool(shm_root, engine, 2, per_slab=2)
    assert b.arena.usage().get("slabs_adopted", 0) == 0 and b.arena.usage()["slabs_created"] == 1
    assert torch.equal(_load(b, engine, keys), d)  # reading another host's slab is fine
    b.arena.close()
    for k in keys:
        os.unlink(b.path_for(k))  # unreferenced now, but still not nodeb's to remove
    r = gc(shm_root, 0, 0.9, now=time.time() + 120)  # nodeb removes its own unused slab only
    assert (r["slabs_removed"], r["slabs_of_other_hosts"]) == (1, 1) and os.listdir(a.arena.dir) == [slab]
    monkeypatch.setattr(pool_mod, "HOST", "nodea")
    r = gc(shm_root, 0, 0.9, now=time.time() + 120)
    assert (r["slabs_removed"], r["slabs_of_other_hosts"]) == (1, 0) and os.listdir(a.arena.dir) == []


def test_the_key_directory_pass_stops_once_every_key_directory_exists(shm_root, engine, monkeypatch):
    """publish_refs makes the directories of a batch's keys until all 256 exist, then skips that
    pass; forgetting a removed directory brings it back."""
    a = _pool(shm_root, engine, 300, per_slab=300)
    calls: list[str] = []
    makedirs = a.makedirs
    monkeypatch.setattr(a, "makedirs", lambda d, depth=0: (calls.append(d), makedirs(d, depth))[1])
    key_dirs = set(a._key_dirs)

    def save(keys, seed):
        calls.clear()
        assert open_store(a, engine).save(keys, [ZERO_KEY] * len(keys), [v for v in _data(len(keys), seed)]).published \
            == len(keys)
        return [d for d in calls if d in key_dirs]

    # each save also makes (or finds made) the directory of its reference file: its first key's
    first = [bytes([b]) + hashlib.sha256(bytes([b])).digest()[1:] for b in range(128)]
    assert len(set(save(first, 3))) == 128
    second = [bytes([b]) + hashlib.sha256(bytes([b])).digest()[1:] for b in range(128, 256)]
    assert len(set(save(second, 4))) == 128  # the pass ran: half the directories were still missing
    later = bytes([7]) + hashlib.sha256(b"later").digest()[1:]
    assert save([later], 5) == [a.dir_for(later)]  # all 256 exist: the pass is skipped
    a._forget_dirs(a.dir_for(first[0]))
    again = [bytes([9]) + hashlib.sha256(b"again").digest()[1:], bytes([0]) + hashlib.sha256(b"again").digest()[1:]]
    d9, d0 = a.dir_for(again[0]), a.dir_for(again[1])
    assert sorted(save(again, 6)) == sorted([d9, d9, d0])  # the reference file's directory, then the pass
    after = bytes([9]) + hashlib.sha256(b"after").digest()[1:]
    assert save([after], 7) == [a.dir_for(after)]
    a.arena.close()


class _Patched:
    """A stand-in for a module in arena's namespace with some functions replaced."""

    def __init__(self, module, **overrides) -> None:
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._module, name)


def test_a_slab_gc_removes_between_an_adopter_s_open_and_its_lock_is_not_adopted(shm_root, engine, monkeypatch):
    """gc may lock, unlink and close a dead owner's slab between an adopter's open and its flock: the
    adopter's lock is then on an inode no name leads to, and slots saved there could never be read."""
    from gds_kv_connector.maintenance.slab_gc import remove_orphan_slabs

    a = _pool(shm_root, engine, 2, per_slab=2)
    a.arena.close()  # a dead owner's slab, free and named by no reference
    (dead,) = os.listdir(a.arena.dir)
    dead_ino = os.stat(os.path.join(a.arena.dir, dead)).st_ino
    real_flock, removed, in_gc = fcntl.flock, [], []

    def flock(fd, op):
        # the adopter has opened the dead slab (gc's own lock goes through arena's helper too)
        if not removed and not in_gc and os.fstat(fd).st_ino == dead_ino:
            in_gc.append(True)
            removed.extend(remove_orphan_slabs(shm_root, now=time.time() + 120).removed)
        return real_flock(fd, op)

    with monkeypatch.context() as m:  # (undo() would also undo the native_impl fixture's patch)
        m.setattr(arena_mod, "fcntl", _Patched(fcntl, flock=flock))  # arena's calls only, not gc's
        b = _pool(shm_root, engine, 2, per_slab=2)
    assert [os.path.basename(p) for p in removed] == [dead]
    usage = b.arena.usage()
    assert usage.get("slabs_adopted", 0) == 0 and usage["slabs_created"] == 1 and usage["owned_slots"] == 2
    assert sorted(os.listdir(b.arena.dir)) == sorted(b.arena._slabs) != [dead]
    b.arena.close()


class _Watched:
    """A stand-in for a module in arena's namespace that runs ``check`` after every call into it."""

    def __init__(self, module, check) -> None:
        self._module, self._check = module, check

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if not callable(value) or isinstance(value, type):
            return value

        def call(*args, **kwargs):
            try:
                return value(*args, **kwargs)
            finally:
                self._check()
        return call


def test_a_new_slab_is_never_visible_under_its_name_unlocked(shm_root, engine, monkeypatch):
    """A slab another process can open under its final name but not yet lock would be adopted by
    that process, and its creator's failed flock then unlinked the adopted slab: a creator makes the
    name appear only once the slab is locked (and sized)."""
    pool = BlockPool((shm_root,), FP, PAYLOAD, 16, refs=True)
    pool.arena = _arena(pool, engine, 4, 2, 0.0)
    d = pool.arena.dir
    seen_locked: set[str] = set()
    unlocked: list[str] = []

    def check() -> None:  # what another process's _try_adopt would find right now
        for name in os.listdir(d):
            if not name.endswith(arena_mod.SLAB_SUFFIX) or name.startswith("."):
                continue
            try:
                fd = os.open(os.path.join(d, name), os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                seen_locked.add(name)
            else:
                unlocked.append(name)
            finally:
                os.close(fd)

    with monkeypatch.context() as m:
        m.setattr(arena_mod, "os", _Watched(os, check))
        m.setattr(arena_mod, "fcntl", _Watched(fcntl, check))
        pool.arena.start(background=False)
    assert unlocked == []
    assert seen_locked == set(pool.arena._slabs) and len(seen_locked) == 2
    assert sorted(os.listdir(d)) == sorted(pool.arena._slabs)  # no temporary name left behind
    assert pool.arena.usage()["owned_slots"] == 4
    pool.arena.close()


def _unfinished_slabs(a: BlockPool, slab: str) -> tuple[str, str, int]:
    """Two full-size temporary slabs beside ``slab``: one a dead creator left, one a live creator
    holds (its lock held by the descriptor returned, which the caller closes)."""
    dead, held = (os.path.join(a.arena.dir, arena_mod.slab_tmp_name(slab.replace(".slab", f"{i}.slab")))
                  for i in range(2))
    for path in (dead, held):
        with open(path, "wb") as fh:
            fh.truncate(2 * a.file_size)
    holder = os.open(held, os.O_RDWR | os.O_CLOEXEC)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return dead, held, holder


def test_gc_removes_a_stale_temporary_slab_but_not_a_fresh_or_locked_one(shm_root, engine):
    """A creator that died before its slab got its name leaves a hidden temporary file; gc removes it
    once its lock is free and it is older than FRESH_S, and never one a creator still holds."""
    from gds_kv_connector.maintenance.operations import format_gc, gc

    a = _pool(shm_root, engine, 2, per_slab=2)
    (slab,) = os.listdir(a.arena.dir)
    stale, held, holder = _unfinished_slabs(a, slab)
    try:
        later = time.time() + 120
        r = gc(shm_root, 0, 0.9)  # both fresh: a creator may not have locked it yet
        assert (r["slab_temps_removed"], r["slabs_removed"]) == (0, 0)
        r = gc(shm_root, 0, 0.9, dry_run=True, now=later)
        assert (r["slab_temps_removed"], r["slabs_removed"]) == (1, 0) and os.path.exists(stale)
        r = gc(shm_root, 0, 0.9, now=later)
        assert (r["slab_temps_removed"], r["slabs_removed"], r["slabs_held_by_owners"]) == (1, 0, 2)
        assert r["slab_bytes_removed"] == 2 * a.file_size
        assert "removed 0 and 1 left unfinished by a creator that died" in format_gc(r)
        assert sorted(os.listdir(a.arena.dir)) == sorted([slab, os.path.basename(held)])
        # the arena and `gds-kv stats` see neither temporary name as a slab
        from gds_kv_connector.maintenance.operations import stats
        (entry,) = stats(shm_root)["fingerprints"].values()
        assert entry["slabs"] == 1
    finally:
        os.close(holder)
        a.arena.close()


def test_a_starting_arena_removes_slabs_its_host_s_dead_creators_left_unfinished(shm_root, engine, monkeypatch):
    """A start killed while it preallocated a slab leaves the temporary file at full size; the next
    arena on that host removes it (nothing else would use it), but not one a live creator holds."""
    a = _pool(shm_root, engine, 2, per_slab=2)
    (slab,) = os.listdir(a.arena.dir)
    a.arena.close()
    _, held, holder = _unfinished_slabs(a, slab)
    monkeypatch.setattr(arena_mod, "FRESH_S", -1.0)  # both files count as old
    try:
        b = _pool(shm_root, engine, 2, per_slab=2)
        assert b.arena.stats["slab_temps_removed"] == 1 and b.arena.stats["slabs_adopted"] == 1
        assert sorted(os.listdir(b.arena.dir)) == sorted([slab, os.path.basename(held)])
        b.arena.close()
    finally:
        os.close(holder)


def test_a_slab_that_fails_while_created_leaves_no_file(shm_root, engine, monkeypatch):
    """A creator that fails before its slab has its name removes the temporary file itself."""
    import errno

    def ftruncate(fd, n):
        raise OSError(errno.ENOSPC, "no space")

    pool = BlockPool((shm_root,), FP, PAYLOAD, 16, refs=True)
    pool.arena = _arena(pool, engine, 2, 2, 0.0)
    with monkeypatch.context() as m:
        m.setattr(arena_mod, "os", _Patched(os, ftruncate=ftruncate))
        pool.arena.start(background=False)
    assert pool.arena.usage()["build_errors"] == 1 and pool.arena.owned_slots == 0
    assert os.listdir(pool.arena.dir) == []
    pool.arena.close()

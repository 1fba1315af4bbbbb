"""Arena slabs across owners and hosts: a slab that fails to adopt is let go, other owners' slabs
gc removed are let go, hosts whose names share a long prefix keep to their own slabs, and slabs
that lost pages or do not fit are dropped or refused."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import time

import pytest
import torch

import gds_kv_connector.store.pool as pool_mod
import gds_kv_connector.util.host as host_mod
from tests.support.arena_helpers import PAYLOAD, data as _data, keys as _keys, load as _load
from gds_kv_connector.store import arena as arena_mod
from gds_kv_connector.format import native
from gds_kv_connector.store.arena import SlotArena
from gds_kv_connector.format.layout import slab_host_is_this
from gds_kv_connector.store.base import LoadFailure, open_store
from gds_kv_connector.engines.posix import PosixEngine
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.records import ZERO_KEY
from gds_kv_connector.maintenance.slab_gc import remove_orphan_slabs

FP = hashlib.sha256(b"arena-robustness-test").digest()
LATER = 120.0  # seconds past the age under which gc leaves a slab alone (arena.FRESH_S)


@pytest.fixture
def shm_root(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = os.path.join(base, f"gdskv-arena-robust-{os.getpid()}-{time.time_ns()}")
    os.makedirs(d)
    yield d
    import shutil
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def engine():
    e = PosixEngine(io_threads=2)
    yield e
    e.close()


@pytest.fixture(params=["mapped", "disk"])
def mapped(request) -> bool:
    return request.param == "mapped"


class _Mapper:
    """The engine's host registration, failing the next ``fail`` registrations with ``exc``."""

    def __init__(self, exc: BaseException | None = None, fail: int = 0) -> None:
        self.exc, self.fail = exc, fail

    def register_host(self, addr: int, nbytes: int, read_only: bool) -> None:
        if self.fail:
            self.fail -= 1
            raise self.exc  # type: ignore[misc]

    def unregister_host(self, addr: int) -> None:
        pass


def _pool(root: str, mapper, slots: int, mapped: bool = True, per_slab: int = 2, clock=time.monotonic,
          start: bool = True) -> BlockPool:
    pool = BlockPool((root,), FP, PAYLOAD, 16, refs=True)
    pool.arena = SlotArena(pool, mapper, slots * pool.file_size, per_slab * pool.file_size, 0.0, clock=clock,
                           mapped=mapped)
    if start:
        pool.arena.start(background=False)
    return pool


def _save(pool: BlockPool, engine, keys: list[bytes], seed: int) -> torch.Tensor:
    d = _data(len(keys), seed)
    assert open_store(pool, engine).save(keys, [ZERO_KEY] * len(keys), [d[i] for i in range(len(keys))]).published \
        == len(keys)
    return d


def _lock_is_free(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _open_files_named(path: str) -> int:
    """Descriptors of this process on ``path``, also once it was unlinked ("... (deleted)")."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target in (path, f"{path} (deleted)")
    return n


# -- adopting --------------------------------------------------------------------------------------
def test_a_registration_error_skips_that_slab_and_lets_go_of_its_lock(shm_root, engine):
    """cudaHostRegister fails with cupy's RuntimeError, not an OSError: the descriptor holding the
    dead owner's lock is closed (or no adopter or gc could ever take the slab while this process
    lives), and the build goes on with the other slabs and new ones."""
    a = _pool(shm_root, engine, 4)  # two slabs
    a.arena.close()
    dead = sorted(os.path.join(a.arena.dir, n) for n in os.listdir(a.arena.dir))
    b = _pool(shm_root, _Mapper(RuntimeError("cudaErrorMemoryAllocation"), fail=1), 4)
    u = b.arena.usage()
    assert u.get("build_errors", 0) == 0 and u["adopt_errors"] == 1
    assert (u["slabs_adopted"], u["slabs_created"], u["owned_slots"]) == (1, 1, 4)
    skipped = [p for p in dead if os.path.basename(p) not in b.arena._slabs]
    assert len(skipped) == 1 and _lock_is_free(skipped[0]) and _open_files_named(skipped[0]) == 0
    r = remove_orphan_slabs(shm_root, now=time.time() + LATER)  # gc can take it now
    assert r.removed == skipped
    b.arena.close()


def test_an_interrupt_while_adopting_still_lets_go_of_the_lock(shm_root, engine):
    a = _pool(shm_root, engine, 2)
    a.arena.close()
    (dead,) = (os.path.join(a.arena.dir, n) for n in os.listdir(a.arena.dir))
    b = _pool(shm_root, _Mapper(KeyboardInterrupt(), fail=1), 2, start=False)
    with pytest.raises(KeyboardInterrupt):
        b.arena.start(background=False)
    assert _lock_is_free(dead) and _open_files_named(dead) == 0
    b.arena.close()


# -- other owners' slabs gc removed ----------------------------------------------------------------
def _reader_of_a_removed_slab(root: str, engine, mapped: bool, now: list[float]) -> tuple[BlockPool, str]:
    """A reader (its clock ``now``) that loaded from a dead owner's slab, which gc then removed."""
    a = _pool(root, engine, 2, mapped=mapped)
    keys = _keys(2)
    d = _save(a, engine, keys, 1)
    (slab,) = a.arena._slabs
    b = _pool(root, engine, 2, mapped=mapped, clock=lambda: now[0])
    assert torch.equal(_load(b, engine, keys), d)  # b maps (or opens) a's slab
    a.arena.close()
    for k in keys:
        os.unlink(a.path_for(k))  # evicted: nothing names the slab any more
    path = os.path.join(a.arena.dir, slab)
    assert remove_orphan_slabs(root, now=time.time() + LATER).removed == [path]
    return b, path


def test_a_slab_gc_removed_is_let_go_after_a_grace_for_copies_in_flight(shm_root, engine, mapped):
    now = [1000.0]
    b, path = _reader_of_a_removed_slab(shm_root, engine, mapped, now)
    name = os.path.basename(path)
    slab = b.arena._slabs[name]
    held = _open_files_named(path)  # a mapping holds a descriptor of its own
    assert held > 0
    now[0] += arena_mod.SWEEP_S
    u = b.arena.usage()
    # no longer looked up, but kept while a load that took it just before may still copy from it
    assert name not in b.arena._slabs and u["mapped_slabs"] == 2 and u.get("slabs_released", 0) == 0
    assert _open_files_named(path) == held
    if slab.mm is not None:
        assert not slab.mm.closed and slab.registered
    with pytest.raises(FileNotFoundError):  # a later lookup fails as for any missing slab
        b.arena.slab_fd(name)
    now[0] += arena_mod.RELEASE_GRACE_S
    u = b.arena.usage()
    assert (u["mapped_slabs"], u["slabs_released"]) == (1, 1) and _open_files_named(path) == 0
    assert set(b.arena._slabs) == {n for n in os.listdir(b.arena.dir)}  # its own slab stays
    b.arena.close()


def _owner_and_reader(root: str, engine, now: list[float]) -> tuple[BlockPool, list[bytes], list, BlockPool]:
    """An owner that saved two blocks, the references to their slots, and a reader on clock ``now``."""
    a = _pool(root, engine, 2)
    keys = _keys(2)
    _save(a, engine, keys, 2)
    return a, keys, [a.arena.cached_ref(k) for k in keys], _pool(root, engine, 2, clock=lambda: now[0])


def test_a_copy_that_took_a_removed_slab_s_addresses_still_reads_them(shm_root, engine):
    """The addresses check_records handed out before the slab left the cache stay mapped, with the
    slot bytes they had, through the grace (an unmapped range would crash the copy)."""
    now = [1000.0]
    a, keys, refs, b = _owner_and_reader(shm_root, engine, now)
    addrs, fields, _, bad, _ = b.arena.check_records(refs)  # a load took the addresses ...
    assert bad == -1
    a.arena.close()
    for k in keys:
        os.unlink(a.path_for(k))
    assert len(remove_orphan_slabs(shm_root, now=time.time() + LATER).removed) == 1
    now[0] += arena_mod.SWEEP_S
    b.arena.alloc(0)  # ... and another transfer sees the slab gone
    assert refs[0].slab not in b.arena._slabs
    assert native.first_changed(addrs, fields) == -1  # the copy's after-check reads the same headers
    b.arena.close()


def test_each_sweep_checks_a_bounded_share_of_the_slabs_in_turn(shm_root, engine, monkeypatch):
    monkeypatch.setattr(arena_mod, "SWEEP_SLABS", 2)
    now = [1000.0]
    a = _pool(shm_root, engine, 5, per_slab=1)  # five one-slot slabs
    keys = _keys(5)
    d = _save(a, engine, keys, 5)
    b = _pool(shm_root, engine, 1, clock=lambda: now[0])
    assert torch.equal(_load(b, engine, keys), d)
    a.arena.close()
    for k in keys:
        os.unlink(a.path_for(k))
    assert len(remove_orphan_slabs(shm_root, now=time.time() + LATER).removed) == 5
    left = []
    for _ in range(3):
        now[0] += arena_mod.SWEEP_S
        b.arena.usage()
        left.append(sum(not s.owned for s in b.arena._slabs.values()))
    assert left == [3, 1, 0]
    b.arena.close()


def test_slabs_still_named_stay_cached(shm_root, engine, mapped):
    now = [1000.0]
    a = _pool(shm_root, engine, 2, mapped=mapped)
    keys = _keys(2)
    d = _save(a, engine, keys, 3)
    b = _pool(shm_root, engine, 2, mapped=mapped, clock=lambda: now[0])
    for _ in range(3):
        now[0] += arena_mod.SWEEP_S + arena_mod.RELEASE_GRACE_S
        assert torch.equal(_load(b, engine, keys), d)  # a live owner's slab: kept, never re-mapped
    assert b.arena.stats["slabs_mapped"] == 1 and b.arena.stats.get("slabs_released", 0) == 0
    a.arena.close()
    b.arena.close()


# -- host tags in slab names -----------------------------------------------------------------------
def _host(name: str) -> str:
    """pool.HOST for a machine called ``name``."""
    return name.replace("-", "_")[:40] or "host"


NODE_A, NODE_B = "trtllm-llama3-70b-instruct-worker-0", "trtllm-llama3-70b-instruct-worker-1"  # 32 shared


def test_hosts_sharing_a_long_prefix_keep_to_their_own_slabs(shm_root, engine, mapped, monkeypatch):
    monkeypatch.setattr(host_mod, "HOST", _host(NODE_A))
    a = _pool(shm_root, engine, 2, mapped=mapped)
    keys = _keys(2)
    d = _save(a, engine, keys, 4)
    (slab,) = a.arena._slabs
    assert re.fullmatch(r"trtllm_llama3_70b_instru_[0-9a-f]{8}-\d+-[0-9a-f]{12}\.slab", slab)
    a.arena.close()  # on a filesystem with per-node flocks, all node B sees of a live owner too
    monkeypatch.setattr(host_mod, "HOST", _host(NODE_B))
    assert not slab_host_is_this(slab)
    b = _pool(shm_root, engine, 2, mapped=mapped)
    u = b.arena.usage()
    assert u.get("slabs_adopted", 0) == 0 and u["slabs_created"] == 1
    assert torch.equal(_load(b, engine, keys), d)
    b.arena.close()
    for k in keys:
        os.unlink(b.path_for(k))
    r = remove_orphan_slabs(shm_root, now=time.time() + LATER)  # node B removes its own slab only
    assert (len(r.removed), r.other_hosts) == (1, 1) and os.listdir(a.arena.dir) == [slab]
    monkeypatch.setattr(host_mod, "HOST", _host(NODE_A))
    c = _pool(shm_root, engine, 2, mapped=mapped)
    assert c.arena.usage()["slabs_adopted"] == 1
    c.arena.close()


def _old_format_slab(root: str, engine, mapped: bool, monkeypatch) -> str:
    """A dead owner's slab named as before host tags (``HOST[:32]``), no reference naming it."""
    from gds_kv_connector.util.host import HOST

    with monkeypatch.context() as m:
        m.setattr(arena_mod, "slab_tag", lambda: HOST[:32])
        a = _pool(root, engine, 2, mapped=mapped)
    a.arena.close()
    (slab,) = os.listdir(a.arena.dir)
    assert slab.startswith(f"{HOST[:32]}-")
    return slab


def test_an_old_slab_name_of_a_host_name_not_cut_is_this_host_s(shm_root, engine, mapped, monkeypatch):
    monkeypatch.setattr(host_mod, "HOST", _host("gpu-node-7"))
    slab = _old_format_slab(shm_root, engine, mapped, monkeypatch)
    assert slab_host_is_this(slab)
    b = _pool(shm_root, engine, 2, mapped=mapped)
    assert b.arena.usage()["slabs_adopted"] == 1 and slab in b.arena._slabs
    b.arena.close()


def test_an_old_slab_name_cut_at_32_is_never_taken_for_this_host_s(shm_root, engine, mapped, monkeypatch):
    """Node B cut to 32 characters reads like node A: its old slabs may be a live owner's there."""
    monkeypatch.setattr(host_mod, "HOST", _host(NODE_A))
    slab = _old_format_slab(shm_root, engine, mapped, monkeypatch)
    for node in (NODE_A, NODE_B):  # from the name alone, not even its creator can tell
        monkeypatch.setattr(host_mod, "HOST", _host(node))
        assert not slab_host_is_this(slab)
        b = _pool(shm_root, engine, 2, mapped=mapped)
        assert b.arena.usage().get("slabs_adopted", 0) == 0
        b.arena.close()
        r = remove_orphan_slabs(shm_root, now=time.time() + LATER)
        assert r.legacy_skipped == 1 and slab in os.listdir(b.arena.dir)  # counted, so gc can say so


def test_gc_removes_old_slabs_of_a_long_host_name_only_when_told(shm_root, engine, mapped, monkeypatch):
    """Otherwise nothing ever would: no host takes them for its own after the upgrade, and on tmpfs
    they hold host memory."""
    from gds_kv_connector.maintenance.operations import format_gc, gc

    monkeypatch.setattr(host_mod, "HOST", _host(NODE_A))
    slab = _old_format_slab(shm_root, engine, mapped, monkeypatch)
    slab_dir = os.path.join(shm_root, pool_mod.LAYOUT_DIR, FP.hex()[:16], "slabs")
    later = time.time() + LATER
    kept = gc(shm_root, 0, 0.9, now=later)
    assert kept["legacy_slabs_skipped"] == 1 and kept["slabs_removed"] == 0 and os.listdir(slab_dir) == [slab]
    assert "gds-kv gc --legacy-slabs" in format_gc(kept)
    monkeypatch.setattr(host_mod, "HOST", _host("other-node-sharing-nothing"))
    assert gc(shm_root, 0, 0.9, now=later, legacy_slabs=True)["slabs_removed"] == 0  # another host's all the same
    monkeypatch.setattr(host_mod, "HOST", _host(NODE_B))
    removed = gc(shm_root, 0, 0.9, now=later, legacy_slabs=True)
    assert removed["slabs_removed"] == 1 and removed["legacy_slabs_skipped"] == 0 and os.listdir(slab_dir) == []


def test_a_host_tag_of_the_longest_host_keeps_slab_names_within_their_field(shm_root, engine, monkeypatch):
    monkeypatch.setattr(host_mod, "HOST", "h" * 40)
    monkeypatch.setattr(os, "getpid", lambda: 4194303)
    tag = arena_mod.slab_tag()
    assert re.fullmatch(r"h{24}_[0-9a-f]{8}", tag)
    a = _pool(shm_root, engine, 2)
    (slab,) = a.arena._slabs
    assert slab.startswith(f"{tag}-4194303-") and len(slab) <= 64 and slab_host_is_this(slab)
    a.arena.close()


def test_loads_never_sweep_and_the_grace_outlasts_a_load_s_deadline(shm_root, engine, monkeypatch):
    """A sweep stats up to SWEEP_SLABS slabs (round trips on a shared filesystem): not on a load's
    path, where a synchronous load holds up the forward.  And a removed slab stays mapped for twice
    the configured deadline, since a load may copy from it that long."""
    from gds_kv_connector.config.settings import Settings

    now = [1000.0]
    a, _, refs, b = _owner_and_reader(shm_root, engine, now)
    swept = []
    monkeypatch.setattr(b.arena, "_sweep", lambda: swept.append(now[0]))
    now[0] += arena_mod.SWEEP_S
    assert b.arena.check_records(refs)[3] == -1
    b.arena.slab_fd(refs[0].slab)
    assert swept == []
    b.arena.usage()
    assert swept == [now[0]]
    b.arena.close()
    a.arena.close()
    monkeypatch.setenv("TLLM_GDS_KV_ROOT", shm_root)
    monkeypatch.setenv("TLLM_GDS_KV_ARENA_BYTES", str(4 * a.file_size))
    monkeypatch.setenv("TLLM_GDS_KV_DEADLINE_S", "300")
    c = arena_mod.start_arena(BlockPool((shm_root,), FP, PAYLOAD, 16, refs=True), engine, Settings.load_from())
    assert c.release_grace_s == 600
    c.close()


# -- slabs truncated or not backed (test_arena_sigbus.py runs the ones that could fault) -----------
def test_a_slab_truncated_and_extended_again_is_dropped_unlinked_and_replaced(shm_root, engine):
    """Its size is back but its pages are new (those registered with CUDA would be the old ones):
    its blocks become misses, and the owner makes a new slab in its place."""
    a = _pool(shm_root, engine, 2)
    keys = _keys(2)
    _save(a, engine, keys, 6)
    (name,) = a.arena._slabs
    path = os.path.join(a.arena.dir, name)
    size = os.path.getsize(path)
    os.truncate(path, 0)
    os.truncate(path, size)  # no page is missing, so nothing can fault: safe in this process
    with pytest.raises(LoadFailure):
        _load(a, engine, keys[:1])
    a.arena._builder.join()  # the replacement
    assert a.arena.stats["slabs_dropped"] == 1 and not os.path.exists(path)
    assert a.arena.owned_slots == 2 and len(os.listdir(a.arena.dir)) == 1
    d = _save(a, engine, _keys(2, b"again"), 7)
    assert torch.equal(_load(a, engine, _keys(2, b"again")), d)
    a.arena.close()


def test_a_start_that_does_not_fit_fails_in_one_line_and_lets_go_of_the_slabs_it_claimed(shm_root, engine, mapped):
    a = _pool(shm_root, engine, 2, mapped=mapped)
    a.arena.close()
    (dead,) = (os.path.join(a.arena.dir, n) for n in os.listdir(a.arena.dir))
    pool = BlockPool((shm_root,), FP, PAYLOAD, 16, refs=True)
    st = os.statvfs(shm_root)
    too_big = st.f_bavail * st.f_frsize + 4 * pool.file_size  # more than the dead slab's 2 slots make up
    pool.arena = SlotArena(pool, engine, too_big, 2 * pool.file_size, 0.0, mapped=mapped)
    with pytest.raises(arena_mod.ArenaError, match="does not fit") as err:
        pool.arena.start(background=False)
    assert "\n" not in str(err.value)
    assert _lock_is_free(dead) and _open_files_named(dead) == 0 and os.listdir(a.arena.dir) == [os.path.basename(dead)]
    pool.arena.close()


"""Slot arena: a pool's blocks in long-lived slab files, one fixed slot per block.

On a host-memory filesystem (/dev/shm) the bytes of a block file are ordinary pages, so the GPU
can DMA straight into them, but only once they are mapped and registered with CUDA
(``cudaHostRegister``), and registering is slow: one file per block, registered in the loop,
moves 0.7 GB/s (256 KiB) to 1.5 GB/s (4 MiB), where a mapping registered once takes DMA at the
PCIe limit (about 55 GB/s).  So each owner preallocates slab files,
maps and registers them once, and writes block records (the v1 block file bytes: header page and
payload) into fixed slots.  A key is published by a small reference file at the key's usual
name, one file per save batch hard-linked under every key of the batch (docs/format.md, "Arena").

On a disk pool (``mapped`` False) the slabs are not mapped: slots are written and read with
O_DIRECT at ``slot * slot_bytes`` through the engine, and slots saved together sit end to end so
the engine moves them as a few large I/Os.  What this saves against one block file per block is
the file: its create, its allocating first write and its directory entry, which bound 256 KiB
disk saves at about half the disk's write rate.

Rules that keep readers safe without a lock shared between processes:

* Only the slab's owner writes it.  The owner holds ``flock(LOCK_EX)`` on the slab for its whole
  life; a later process on the same host that obtains the lock knows the owner is gone and adopts
  the slab (only the same host: some shared filesystems keep flocks per node).  A slab is created
  under a hidden temporary name and gets its own only once locked, and an adopter checks, once it
  holds the lock, that the name still leads to the inode it locked (gc may remove a free slab
  between an adopter's open and its flock).
* A slot is reused only after no reference points at it (evicted by anyone, or by the owner when
  the arena is full) and a further ``reuse_delay_s`` has passed.
* Mapped slabs: the owner clears a slot's header before it overwrites the payload and writes the
  new header last; a reader checks the header (key, creation time) before and after its copy.
  Slabs on disk: a slot's header and payload are written in one I/O and read in one; the reader
  checks the header it read and always verifies the payload against it (one write's pages reach
  the disk in no promised order, so there is no "header last").  Either way a reader racing a
  reuse fails cleanly instead of loading wrong bytes.

A slab's size is not in its owner's hands: any process that may write the file (the same user,
or one of a shared group) can truncate it, to any size, at any time, and on a full tmpfs a page
of a slab may not exist.  A CPU access to such a page through a mapping raises SIGBUS, which
kills the process however it was made (the header loops, the POSIX engine's copies, numpy or
torch over the mapping), so no rule about who writes is enough.  Three things keep every
process alive and every load whole:

* Slabs are backed for real before they are mapped: ``posix_fallocate`` (on tmpfs it reserves
  every page), for a new slab and for one adopted, so a slab that does not fit fails there with
  ENOSPC, not at a later access.  :meth:`SlotArena.start` fails at once (ArenaError, one line)
  when the slabs it still has to create do not fit in the free space; a slab that cannot be
  created later stops the growth, logged once, and saves that find no slot are written as block
  files.
* Every mapping is guarded (native.guard_mapping, csrc/native.c): a SIGBUS at an address inside
  one is survived by mapping anonymous memory over the whole slab and marking it lost, so the
  access completes on pages that are not the slab's.  This covers every CPU access wherever it is
  made, which a check before each access could not (the file can shrink between the check and
  the access).  DMA into pages registered with CUDA never faults: they stay pinned.  Without the
  C extension nothing can guard a mapping, so :func:`start_arena` then moves slabs with reads
  and writes, which see a truncated file as a short read.
* Before each batch's first access (a save's slots, a load's headers) each slab it uses is
  checked: not lost, the size it was mapped at, and no fewer pages (a slab truncated and
  extended again has the size but new pages, while the pages registered with CUDA are the old
  ones).  A damaged slab is dropped: its blocks are misses from then on, its mapping stays for
  ``release_grace_s`` (a copy may run through it), and an owned one is unlinked (references to it
  then fail as references to a removed slab do) and replaced in the background.  A slab that
  breaks during a batch is caught after it: a load's headers, read after its copy, are zeros or
  another record, and it fails; a save's records written after the fault went to memory that is
  not the slab's, so loads through its references to them fail (the file is short, zero or gone
  there).  Slabs on disk are not mapped: a truncated one gives short reads, which fail the load.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import itertools
import logging
import mmap
import operator
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol

import numpy as np

from gds_kv_connector.format import native
from gds_kv_connector.util.atomic_file import still_named
from gds_kv_connector.util.mounts import fs_type, is_shared_fs
from gds_kv_connector.format.layout import (SLAB_SUFFIX, SLABS_DIR, slab_host_is_this, slab_of_tmp_name, slab_tag,
                                            slab_tmp_name)
from gds_kv_connector.format.records import HEADER_SIZE, PAGE, FormatError, SlotRef, check_slab_name, parse_header

if TYPE_CHECKING:
    from gds_kv_connector.store.pool import BlockPool
    from gds_kv_connector.config.settings import Settings

log = logging.getLogger(__name__)

FRESH_S = 60.0  # a slab file changed this recently may be one whose creator has not locked it yet
SWEEP_S = 5.0  # how often the other owners' slabs this process holds are checked for removal by gc
# Slabs checked per sweep, in turn: two stats each, on a transfer thread, and a reader may hold
# thousands of slabs on a shared filesystem where a stat is a round trip.
SWEEP_SLABS = 64
# How long a removed slab stays mapped (or open) after this process saw it go, at least: a load that
# took its addresses or descriptor just before copies for one batch, bounded by TLLM_GDS_KV_DEADLINE_S
# (60 s by default; start_arena gives twice a longer one), and unmapping under a copy crashes the process.
RELEASE_GRACE_S = 120.0
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
HOST_FS_TYPES = ("tmpfs", "ramfs", "hugetlbfs")
# SlotRef fields read by C iterators (map) in the per-batch bookkeeping, not by Python loops
_KEY, _CREATED = operator.attrgetter("key"), operator.attrgetter("created_ns")
_SLAB, _SLOT = operator.attrgetter("slab"), operator.attrgetter("slot")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_CLAIMED_SLOTS = operator.itemgetter(2)  # of a claimed slab (name, fd, slots)
_COUNT = operator.itemgetter(3)  # of a _free run
_REF_FILE_CACHE = 8192  # parsed reference files kept (each covers one save batch)
_WHERE_CACHE = 1 << 20  # remembered key locations (about 200 bytes each)
_FILL_CHUNK = 8 << 20  # one O_DIRECT write of a new disk slab's zeros


class HostMapper(Protocol):
    """What the arena needs from an engine: making a mapped range DMA-able and back."""

    def register_host(self, addr: int, nbytes: int, read_only: bool) -> None: ...

    def unregister_host(self, addr: int) -> None: ...


@dataclass
class Slab:
    name: str
    fd: int
    mm: mmap.mmap | None  # None for a slab on disk (file mode)
    array: np.ndarray | None  # keeps the buffer exported so ``base`` stays valid
    base: int
    nslots: int
    registered: bool
    writable: bool
    owned: bool = False  # created or adopted by this process (it holds the slab's flock)
    sid: int = -1  # this process's number for the slab: the high bits of its slots' positions in _used
    blocks: int = 0  # st_blocks of the file when it was mapped: fewer later means pages were taken away


class ArenaError(RuntimeError):
    """The arena cannot be used as configured (not a host-memory filesystem, registration failed, its
    slabs do not fit in the free space)."""


class SlotArena:
    """One process's slabs in one pool directory, plus the other owners' slabs it reads from."""

    def __init__(self, pool: BlockPool, mapper: HostMapper, capacity_bytes: int, slab_bytes: int,
                 reuse_delay_s: float, clock: Callable[[], float] = time.monotonic, mapped: bool = True,
                 release_grace_s: float = RELEASE_GRACE_S) -> None:
        """``mapped``: slabs are mapped and registered for DMA (a host-memory pool); else they are
        files moved with the engine's reads and writes (a disk pool).  ``release_grace_s``: how long a
        slab gc removed stays mapped for loads that took it (:meth:`_sweep`)."""
        self.release_grace_s = release_grace_s
        if len(pool.fp_dirs) != 1:
            raise ArenaError("the slot arena serves a pool with exactly one root")
        self.pool = pool
        self.mapper = mapper
        self.mapped = mapped
        self.slot_bytes = pool.file_size
        self.slots_per_slab = max(1, slab_bytes // self.slot_bytes)
        self.capacity_slots = capacity_bytes // self.slot_bytes
        if self.capacity_slots < 1:
            raise ArenaError(f"arena of {capacity_bytes} bytes holds no slot of {self.slot_bytes} bytes")
        self.reuse_delay_s = reuse_delay_s
        self.clock = clock
        # Which of the keys given some owner has promised or used within the eviction grace (set by the
        # owner's worker from the access logs): a full arena never evicts those, as no remover may.
        self.promised: Callable[[list[bytes]], list[bool]] | None = None
        self.dir = os.path.join(pool.fp_dirs[0], SLABS_DIR)
        pool.makedirs(self.dir)
        self._lock = threading.Lock()
        self._slabs: dict[str, Slab] = {}
        # other owners' slabs gc removed, dropped from _slabs and closed once the time given passes
        self._retired: list[tuple[float, Slab]] = []
        self._sweep_at = 0.0
        self._sweeping = False
        self._sweep_next = 0  # where in the other owners' slabs the next sweep starts
        # Runs of free slots, (ready at, slab, first slot, count): a batch of 256 slots is taken in one
        # or two steps instead of 256 deque pops on a transfer thread holding the GIL.
        self._free: collections.deque[tuple[float, str, int, int]] = collections.deque()
        # position -> SlotRef of published slots, least recently used first: a plain dict
        # (insertion-ordered; a touch re-inserts), cheaper per block to update than an OrderedDict.
        # A position is an int (slab.sid << 32 | slot), so the only object a saved block leaves
        # behind is its SlotRef, shared with _where: the (slab, slot) and (key, created) tuples
        # this held before were two more objects per block for Python's cyclic GC to count, and
        # the bench's 256 KiB save phases spent 6-15% of their time in collections it triggered.
        self._used: dict[int, SlotRef] = {}
        self._sids = itertools.count()
        self._where: dict[bytes, SlotRef] = {}  # keys this process published or resolved
        self._ref_files: dict[tuple[int, int, int], dict[bytes, SlotRef]] = {}
        self.owned_slots = 0
        self.stats = collections.Counter()
        self._ready = threading.Event()
        self._closed = False
        self._builder: threading.Thread | None = None  # the start-up build, or a later regrowth
        if mapped and not native.GUARDS:
            log.warning("gds-kv arena: the C extension is not built, so nothing guards slab mappings: a slab "
                        "truncated by another process kills this process with SIGBUS")

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        """Claim the slabs of this host's dead owners and check that the slabs still to create fit
        in the free space (ArenaError, one line, if not: an arena that cannot be backed would fail
        every save), then adopt the claimed slabs and create the rest; saves that find no free
        slot meanwhile are written as block files, so start-up never blocks serving."""
        claimed = self._claim_dead_owners()
        try:
            self._check_fits(sum(map(_CLAIMED_SLOTS, claimed)))
        except BaseException:
            for _, fd, _ in claimed:
                os.close(fd)
            raise
        if background:
            self._builder = threading.Thread(target=self._build, args=(claimed,), name="gdskv-arena", daemon=True)
            self._builder.start()
        else:
            self._build(claimed)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def _claim_dead_owners(self) -> list[tuple[str, int, int]]:
        """(name, locked descriptor, slots) of this host's slabs whose owner is gone, up to the
        capacity; this host's temporary slabs whose creator died are removed (they hold space)."""
        claimed: list[tuple[str, int, int]] = []
        room = self.capacity_slots - self.owned_slots
        for name in sorted(os.listdir(self.dir)):
            tmp_of = slab_of_tmp_name(name)
            if tmp_of is not None:
                if slab_host_is_this(tmp_of):
                    self._remove_dead_temp(name)
                continue
            known = self._slabs.get(name)
            if (room > 0 and name.endswith(SLAB_SUFFIX) and slab_host_is_this(name)
                    and (known is None or not known.owned)):
                got = self._claim(name, room)
                if got is not None:
                    claimed.append((name, *got))
                    room -= got[1]
        return claimed

    def _check_fits(self, claimed_slots: int) -> None:
        """ArenaError when the slabs still to create need more bytes than the pool's filesystem has
        free.  Another process may take the space before they are created: then the growth stops
        (:meth:`_grow`)."""
        need = (self.capacity_slots - self.owned_slots - claimed_slots) * self.slot_bytes
        free = _free_bytes(self.dir)
        if need > free:
            raise ArenaError(f"arena of {self.capacity_slots * self.slot_bytes} bytes does not fit in {self.dir}: its "
                             f"new slabs need {need} bytes and {free} are free (lower TLLM_GDS_KV_ARENA_BYTES or free "
                             "space)")

    def _build(self, claimed: list[tuple[str, int, int]]) -> None:
        t0 = time.monotonic()
        try:
            for name, fd, nslots in claimed:
                if self._closed:
                    os.close(fd)  # let go unadopted
                else:
                    self._adopt(name, fd, nslots)
            self._grow()
        finally:
            self._ready.set()
        # a disk arena writes every new slab once: tens of seconds for tens of GiB, worth a line
        log.info("gds-kv arena: %d slots ready in %s after %.1f s (%d slabs created, %d adopted)", self.owned_slots,
                 self.dir, time.monotonic() - t0, self.stats["slabs_created"], self.stats["slabs_adopted"])

    def _grow(self) -> None:
        """Create slabs up to the capacity.  A slab that cannot be created (its space was taken)
        stops the growth, logged once: the arena keeps what it has, and saves that find no slot
        are written as block files."""
        try:
            while self.owned_slots < self.capacity_slots and not self._closed:
                self._create_slab(min(self.slots_per_slab, self.capacity_slots - self.owned_slots))
        except Exception as exc:  # noqa: BLE001 - the arena shrinks to what was built; saves fall back
            log.error("gds-kv arena: building slabs in %s stopped: %s (%d slots usable)", self.dir, exc,
                      self.owned_slots)
            self.stats["build_errors"] += 1

    def _regrow(self) -> None:
        """Replace dropped slabs in the background, unless a build is running (it grows to the
        capacity itself) or the arena is closed."""
        with self._lock:
            if self._closed or (self._builder is not None and self._builder.is_alive()):
                return
            self._builder = threading.Thread(target=self._grow, name="gdskv-arena", daemon=True)
            self._builder.start()

    def close(self) -> None:
        """Unregister and unmap every slab; owned slabs stay on disk for readers and adopters."""
        with self._lock:  # no regrowth starts after this
            self._closed = True
            builder = self._builder
        if builder is not None:
            builder.join()
        with self._lock:
            for slab in [*self._slabs.values(), *map(_SECOND, self._retired)]:
                self._unmap(slab)
            self._slabs.clear()
            self._retired.clear()
            self._free.clear()
            self._used.clear()
            self._where.clear()
            self._ref_files.clear()

    # -- slabs ------------------------------------------------------------------------------------
    def _create_slab(self, nslots: int) -> None:
        """A new slab, locked and sized under a hidden temporary name before it gets its own: a slab
        under its name with a free lock looks like a dead owner's, and another process would adopt
        it (the creator's flock then failed, and its clean-up unlinked the slab just adopted)."""
        # host tag (<= 33) + pid (<= 7 digits) + 12 hex digits + suffix stays within the 64-byte name field
        name = check_slab_name(f"{slab_tag()}-{os.getpid()}-{secrets.token_hex(6)}{SLAB_SUFFIX}")
        path, tmp = os.path.join(self.dir, name), os.path.join(self.dir, slab_tmp_name(name))
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, self.pool.file_mode)
        slab: Slab | None = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # gc leaves a fresh temporary file alone
            if self.pool.file_mode & 0o077:
                os.fchmod(fd, self.pool.file_mode)
            os.ftruncate(fd, nslots * self.slot_bytes)
            if self.mapped:
                _back(fd, nslots * self.slot_bytes, self.dir)
            else:
                _preallocate(fd, nslots * self.slot_bytes)
            slab = self._map(name, fd, nslots, writable=True)
            # rename replaces a file of that name; O_EXCL on the temporary name and this check keep
            # two creators that drew one name (pids repeat across containers) from sharing a slab
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, "slab name taken", path)
            os.rename(tmp, path)  # the lock stays with the inode
        except BaseException:
            _unlink_quietly(tmp)  # still locked: no one else ever held it
            if slab is not None:
                self._unmap(slab)  # closes fd
            else:
                os.close(fd)
            raise
        slab.owned = True
        now = self.clock()
        with self._lock:
            self._slabs[name] = slab
            self._free.append((now, name, 0, nslots))
            self.owned_slots += nslots
        self.stats["slabs_created"] += 1

    def _remove_dead_temp(self, name: str) -> None:
        """Remove a slab whose creator on this host died before naming it (a start killed while it
        preallocated a disk slab leaves one at full size, which nothing would ever use)."""
        path = os.path.join(self.dir, name)
        fd = lock_if_unowned(path, time.time())
        if fd is None:
            return  # its creator is alive, or just began
        try:
            _unlink_quietly(path)
            self.stats["slab_temps_removed"] += 1
            log.info("gds-kv arena: removed %s, a slab its creator did not finish", name)
        finally:
            os.close(fd)

    def _claim(self, name: str, room: int) -> tuple[int, int] | None:
        """(descriptor holding its lock, slots) of a slab whose owner died (its lock is free), at
        most ``room`` slots; None when it is not to be adopted."""
        path = os.path.join(self.dir, name)
        try:
            check_slab_name(name)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (OSError, FormatError):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live owner holds it
            return None
        try:
            if not still_named(path, fd):
                # gc locked, unlinked and closed it between the open and the flock: slots saved into
                # this inode would be named by references no process can follow
                raise ArenaError("removed before it was locked")
            nslots = self._slot_count(fd, name)
            if nslots > room:
                raise ArenaError("over capacity")
        except (OSError, ArenaError, FormatError) as exc:
            log.info("gds-kv arena: not adopting slab %s: %s", name, exc)
            os.close(fd)
            return None
        return fd, nslots

    def _adopt(self, name: str, fd: int, nslots: int) -> None:
        """Take over a claimed slab (:meth:`_claim`), backed first (:func:`_back`: one made by an
        older version may be sparse).  Slots whose record is still referenced stay in use; the rest
        become free."""
        if self.mapped:
            try:
                _back(fd, nslots * self.slot_bytes, self.dir)
            except OSError as exc:
                log.info("gds-kv arena: not adopting slab %s: %s", name, exc)
                os.close(fd)
                return
        # Under the lock: a load may have mapped this slab for reading meanwhile, and replacing that
        # mapping would unmap it under the addresses a transfer thread is copying from (a crash, not
        # an error, once the header checks run in C).  Such a mapping is taken over instead.
        with self._lock:
            try:
                slab = self._slabs.get(name)
                if slab is None:
                    slab = self._slabs[name] = self._map(name, fd, nslots, writable=True)
                elif not slab.writable:
                    raise ArenaError("mapped read-only by this process")
                else:
                    # The locked descriptor takes the number the load mapped it with, in one step:
                    # closing that number instead would let a file opened meanwhile (a block file
                    # being written) take it, and a read that looked it up just before would read
                    # that file (seen as a short slab read during a restart).
                    os.dup2(fd, slab.fd, inheritable=False)
                    os.close(fd)
                slab.owned = True
                nslots = slab.nslots
            except BaseException as exc:
                # Any failure, a registration error (cupy raises RuntimeError) included: the
                # descriptor holds the dead owner's lock, and leaking it would keep every adopter
                # and gc away from the slab for this process's life.  One slab that cannot be
                # adopted costs only its slots, not the rest of the build.
                os.close(fd)
                if not isinstance(exc, Exception):
                    raise
                if not isinstance(exc, (OSError, ArenaError, FormatError)):
                    self.stats["adopt_errors"] += 1
                    log.warning("gds-kv arena: not adopting slab %s: %r", name, exc)
                else:
                    log.info("gds-kv arena: not adopting slab %s: %s", name, exc)
                return
        used, free = [], []
        for slot in range(nslots):
            ref = self._record_at(slab, slot)
            try:
                live = ref is not None and self.pool.read_ref(ref.key) == ref
            except OSError:  # cannot tell (EMFILE, EIO): kept in use, a later reclaim looks again
                live = True
            if live:
                used.append((slot, ref))
            else:
                free.append(slot)
        # the dead owner may have evicted a slot just before it died, with a reader still on its way
        ready = self.clock() + self.reuse_delay_s
        with self._lock:
            for slot, ref in used:
                self._used[slab.sid << 32 | slot] = ref
                self.remember(ref)
            self._free.extend((ready, name, first, count) for first, count in _runs(free))
            self.owned_slots += nslots
        self.stats["slabs_adopted"] += 1
        log.info("gds-kv arena: adopted slab %s of a finished owner (%d live blocks, %d free slots)",
                 name, len(used), len(free))

    def _map(self, name: str, fd: int, nslots: int, writable: bool) -> Slab:
        if not self.mapped:  # a slab on disk: its descriptor is all the engine needs
            return Slab(name, fd, None, None, 0, nslots, False, writable, sid=next(self._sids))
        size = nslots * self.slot_bytes
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        # MAP_POPULATE maps every page now, not at the first DMA (an own slab's pages exist: _back)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=prot)
        array = np.frombuffer(mm, dtype=np.uint8)
        base = array.__array_interface__["data"][0]
        slab = Slab(name, fd, mm, array, base, nslots, False, writable, sid=next(self._sids),
                    blocks=os.fstat(fd).st_blocks)
        del array
        try:
            native.guard_mapping(base, size, writable)  # before anything reads or writes the pages
            self.mapper.register_host(base, size, not writable)
        except BaseException:
            native.unguard_mapping(base)
            slab.array = None  # type: ignore[assignment]
            mm.close()
            raise
        slab.registered = True
        return slab

    def _unmap(self, slab: Slab) -> None:
        if slab.registered:
            try:
                self.mapper.unregister_host(slab.base)
            except Exception as exc:  # noqa: BLE001 - shutting down
                log.debug("unregistering slab %s failed: %s", slab.name, exc)
            slab.registered = False
        slab.array = None
        if slab.mm is not None:
            native.unguard_mapping(slab.base)
            try:
                slab.mm.close()
            except BufferError:
                native.guard_mapping(slab.base, slab.nslots * self.slot_bytes, slab.writable)  # still mapped
                log.debug("slab %s still exported; left mapped", slab.name)
        os.close(slab.fd)  # releases the owner lock

    def _slab(self, name: str) -> Slab:
        """A mapping of any slab in this pool, mapped and registered on first use."""
        slab = self._slabs.get(name)
        if slab is not None:
            return slab
        with self._lock:
            slab = self._slabs.get(name)
            if slab is not None:
                return slab
            path = os.path.join(self.dir, check_slab_name(name))
            writable = True
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            except PermissionError:  # another user's slab in a shared-group pool
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
                writable = False
            try:
                slab = self._map(name, fd, self._slot_count(fd, name), writable=writable)
            except BaseException:
                os.close(fd)
                raise
            self._slabs[name] = slab
            self.stats["slabs_mapped"] += 1
            return slab

    def _sweep(self) -> None:
        """Let go of other owners' slabs that gc removed.  A cached mapping or descriptor keeps a
        removed slab's host memory or disk space allocated for as long as it is held, and owners
        come and go for the life of a reader.  A slab no name leads to any more leaves the cache at
        once (a later lookup fails cleanly, as for any missing slab) and is closed release_grace_s
        later, since a load may be copying through the address or descriptor it took just before.
        Runs at most every SWEEP_S, from calls the arena sees anyway, never per block and never on a
        load's path (a stat on a shared filesystem is a round trip, and a synchronous load holds up
        the forward): from saves' slot allocation and from :meth:`usage`, which the stats publisher
        calls every interval.  Checks up to SWEEP_SLABS slabs each time."""
        with self._lock:
            now = self.clock()
            if self._sweeping or now < self._sweep_at:
                return
            self._sweeping, self._sweep_at = True, now + SWEEP_S
            foreign = [slab for slab in self._slabs.values() if not slab.owned]
            start = self._sweep_next % len(foreign) if foreign else 0
            foreign = (foreign[start:] + foreign[:start])[:SWEEP_SLABS]
            self._sweep_next = start + len(foreign)
            due = [slab for at, slab in self._retired if at <= now]
            self._retired = [(at, slab) for at, slab in self._retired if at > now]
        try:
            if self.mapped:
                native.rearm_guard()
            gone = [slab for slab in foreign if not still_named(os.path.join(self.dir, slab.name), slab.fd)]
            with self._lock:
                for slab in gone:
                    if self._slabs.get(slab.name) is slab and not slab.owned:  # not adopted meanwhile
                        del self._slabs[slab.name]
                        self._retired.append((now + self.release_grace_s, slab))
            for slab in due:
                self._unmap(slab)
                self.stats["slabs_released"] += 1
        finally:
            self._sweeping = False

    def _slot_count(self, fd: int, name: str) -> int:
        """Slots in an existing slab; a size that is not a whole number of slots is a bad slab."""
        size = os.fstat(fd).st_size
        if size == 0 or size % self.slot_bytes:
            raise FormatError(f"slab {name} is {size} bytes, not a multiple of the slot size")
        return size // self.slot_bytes

    def _damage(self, slab: Slab) -> str | None:
        """Why a mapped slab can no longer be used (see the module doc), or None: a fault replaced
        its mapping, its file is not the size it was mapped at, or it has fewer pages than then
        (truncated and extended again: the pages registered with CUDA are no longer the file's)."""
        if native.mapping_lost(slab.base):
            return "a page of it was taken away under its mapping (the file was truncated, or its filesystem is full)"
        st = os.fstat(slab.fd)
        size = slab.nslots * self.slot_bytes
        if st.st_size != size:
            return f"the file is {st.st_size} bytes, not {size}: truncated by another process"
        if st.st_blocks < slab.blocks:
            return "the file lost pages: truncated and extended again by another process"
        return None

    def _drop_damaged(self, names: Iterable[str]) -> bool:
        """Drop the damaged mapped slabs among ``names`` (:meth:`_damage`); whether there was one.
        Once per batch, before its first access: a lost-flag check and an fstat per slab, which
        tmpfs answers from memory."""
        dropped = False
        for name in names:
            slab = self._slabs.get(name)
            why = None if slab is None or slab.mm is None else self._damage(slab)
            if why is not None:
                self._drop(slab, why)  # type: ignore[arg-type]
                dropped = True
        return dropped

    def _drop(self, slab: Slab, why: str) -> None:
        """Stop using a damaged slab: its blocks are misses from now on.  Its mapping stays for
        release_grace_s (a copy may be running through it).  An owned slab is also unlinked, so no
        process maps it again and references to it fail as references to a removed slab do, and
        replaced in the background."""
        with self._lock:
            if self._slabs.get(slab.name) is not slab:
                return  # dropped by another thread
            del self._slabs[slab.name]
            self._retired.append((self.clock() + self.release_grace_s, slab))
            if slab.owned:
                self.owned_slots -= slab.nslots
                for pos in [pos for pos in self._used if pos >> 32 == slab.sid]:
                    del self._used[pos]
                kept = [run for run in self._free if run[1] != slab.name]
                self._free.clear()
                self._free.extend(kept)
        self.stats["slabs_dropped"] += 1
        log.warning("gds-kv arena: dropping slab %s: %s; its blocks are misses from now on", slab.name, why)
        if slab.owned:
            path = os.path.join(self.dir, slab.name)
            if still_named(path, slab.fd):  # this process holds its lock: no one else removes or adopts it
                _unlink_quietly(path)
            self._regrow()

    def _record_at(self, slab: Slab, slot: int) -> SlotRef | None:
        off = slot * self.slot_bytes
        try:
            raw = (bytes(slab.mm[off:off + HEADER_SIZE]) if slab.mm is not None
                   else os.pread(slab.fd, HEADER_SIZE, off))
            h = parse_header(raw, fingerprint=self.pool.fingerprint, payload_len=self.pool.payload_len)
        except (FormatError, OSError):
            return None
        return SlotRef(h.key, slab.name, slot, h.created_ns)

    # -- writing (owner) --------------------------------------------------------------------------
    def alloc(self, n: int) -> list[tuple[str, int]]:
        """Up to ``n`` free slots, (slab, slot); fewer when the arena is full or still building."""
        if self.clock() >= self._sweep_at:
            self._sweep()
        out: list[tuple[str, int]] = []
        with self._lock:
            self._take_ready(n, out)
        if len(out) < n and self._ready.is_set():
            self._reclaim(n - len(out))
            with self._lock:
                self._take_ready(n - len(out), out)
        if out and self.mapped and self._drop_damaged(set(map(_FIRST, out))):
            out = [slot for slot in out if slot[0] in self._slabs]  # a dropped slab's slots went with it
        if len(out) < n:
            self.stats["alloc_short"] += n - len(out)
        return out

    def _take_ready(self, need: int, out: list[tuple[str, int]]) -> None:
        """Append up to ``need`` ready slots to ``out``; runs of a dropped slab (given back by a save
        that was using it) are discarded."""
        now, free, slabs = self.clock(), self._free, self._slabs
        while need > 0 and free and free[0][0] <= now:
            ready, name, first, count = free.popleft()
            if name not in slabs:
                continue
            take = min(count, need)
            out.extend(zip(itertools.repeat(name, take), range(first, first + take)))
            if take < count:
                free.appendleft((ready, name, first + take, count - take))
            need -= take

    def slab_fd(self, name: str) -> tuple[int, int]:
        """(descriptor, slot count) of any slab in this pool, opened on first use (file mode)."""
        slab = self._slab(name)
        return slab.fd, slab.nslots

    def payload_addr(self, slab: str, slot: int) -> int:
        return self._slabs[slab].base + slot * self.slot_bytes + HEADER_SIZE

    def payload_offset(self, slot: int) -> int:
        """Where a slot's payload starts in its slab file (its header page before it): the
        O_DIRECT offset disk slabs are written and read at."""
        return slot * self.slot_bytes + HEADER_SIZE

    def slot_addrs(self, slots: list[tuple[str, int]]) -> list[int]:
        """Start addresses of this owner's slots (their headers), for native.write_headers."""
        slabs, sb = self._slabs, self.slot_bytes
        names = set(map(_FIRST, slots))
        if not names <= slabs.keys():  # a slab dropped since alloc: its mapping stays for the grace
            slabs = {**{slab.name: slab for _, slab in self._retired}, **slabs}
        if len(names) == 1:  # one slab, the common batch: C iterators, not a Python loop
            return list(map(slabs[names.pop()].base.__add__, map(sb.__mul__, map(_SECOND, slots))))
        return [slabs[name].base + slot * sb for name, slot in slots]

    def published(self, refs: list[SlotRef]) -> None:
        """Slots of this owner's slabs that a reference file now names."""
        positions = self._positions(refs)
        with self._lock:
            if -1 in positions:  # a slab dropped meanwhile: not this owner's any more
                self._used.update((pos, ref) for pos, ref in zip(positions, refs) if pos >= 0)
            else:
                self._used.update(zip(positions, refs))
        self.remember_all(refs)

    def _positions(self, refs: list[SlotRef]) -> list[int]:
        """Each ref's key in ``_used``; -1 for a slab this process has not mapped.  A batch's refs
        nearly always share one slab: then C iterators build the list, not a Python loop."""
        slabs = self._slabs
        names = set(map(_SLAB, refs))
        if len(names) == 1:
            slab = slabs.get(names.pop())
            if slab is None:
                return [-1] * len(refs)
            return list(map((slab.sid << 32).__or__, map(_SLOT, refs)))
        high = {name: -1 if slabs.get(name) is None else slabs[name].sid << 32 for name in names}
        return list(map(int.__or__, map(high.__getitem__, map(_SLAB, refs)), map(_SLOT, refs)))  # -1 | slot == -1

    def release(self, slab: str, slot: int) -> None:
        """A slot that was never published (lost race, failed copy): free at once."""
        with self._lock:
            self._free.appendleft((self.clock(), slab, slot, 1))

    def _not_promised(self, candidates: list[tuple[int, SlotRef]], want: int) -> list[tuple[int, SlotRef]]:
        """The first ``want`` candidates no owner promised or used within the grace: a block another
        owner matched must stay until its load pins it, and the least recently used order of this
        owner's own slots does not know of other owners' accesses.  None left: the save falls back to
        block files, which cost speed, never a promise."""
        keep = self.promised([r.key for _, r in candidates])  # type: ignore[misc]
        victims = [c for c, kept in zip(candidates, keep) if not kept][:want]
        skipped = sum(keep)
        if skipped:
            self.stats["evict_skipped_promised"] += skipped
        return victims

    def _reclaim(self, need: int) -> None:
        """Free slots whose reference is gone; if those and the slots still cooling are not enough,
        evict this owner's least recently used blocks (up to a batch of capacity/32 cooling, ahead
        of need, since freed slots cool for reuse_delay_s)."""
        with self._lock:
            candidates = list(itertools.islice(self._used.items(), max(4 * need, 64)))
        # (position, entry): the entry is freed only if it is still the one there, since another
        # transfer thread may have freed, reused and republished the position meanwhile
        freed: list[tuple[int, SlotRef]] = []
        judged: set[int] = set()  # freed here, or unreadable now: not evicted blind either
        for pos, mine in candidates:
            try:
                ref = self.pool.read_ref(mine.key)
            except OSError:  # EMFILE, EIO, ESTALE: the reference may still name the slot; keep it
                self.stats["reclaim_errors"] += 1
                judged.add(pos)
                continue
            if ref is None or (ref.slab, ref.slot, ref.created_ns) != (mine.slab, mine.slot, mine.created_ns):
                freed.append((pos, mine))
                judged.add(pos)
        victims: list[tuple[int, SlotRef]] = []
        if len(freed) < need:
            with self._lock:
                # slots freed before and still cooling count too: evicting a batch for them again on
                # every save within reuse_delay_s would bleed the arena a batch per save
                have = len(freed) + sum(map(_COUNT, self._free))
                if have < need:
                    want = max(need, self.capacity_slots // 32) - have
                    scan = 4 * want if self.promised is not None else want
                    victims = list(itertools.islice(((p, r) for p, r in self._used.items() if p not in judged), scan))
            if victims and self.promised is not None:
                victims = self._not_promised(victims, want)
        evicted = 0
        for pos, mine in victims:
            try:
                self.pool.unpublish_ref(mine.key, mine)  # False: no longer named by its key either way
            except OSError:  # cannot tell whether the reference is gone: the slot stays in use
                self.stats["reclaim_errors"] += 1
                continue
            freed.append((pos, mine))
            evicted += 1
        self.stats["evicted"] += evicted
        ready = self.clock() + self.reuse_delay_s
        with self._lock:
            by_slab: dict[str, list[int]] = {}
            for pos, mine in freed:
                if self._used.get(pos) is not mine:
                    continue
                del self._used[pos]
                where = self._where.get(mine.key)
                if where is not None and (where.slab, where.slot) == (mine.slab, mine.slot):
                    del self._where[mine.key]
                by_slab.setdefault(mine.slab, []).append(mine.slot)
            for name, slots in by_slab.items():
                self._free.extend((ready, name, first, count) for first, count in _runs(slots))
        self.stats["reclaimed"] += sum(map(len, by_slab.values()))

    # -- reading ----------------------------------------------------------------------------------
    def note_ref_file(self, ident: tuple[int, int, int], entries: dict[bytes, SlotRef]) -> None:
        """Remember a parsed reference file; they are never rewritten, so (inode, size, ctime) names
        its content (a link or unlink changes the ctime, which only costs a re-read).  Its entries
        are remembered as locations too: blocks saved in one batch are usually loaded together, and
        a remembered location is checked against the slot's header before every copy anyway."""
        if len(self._ref_files) >= _REF_FILE_CACHE:
            self._ref_files.clear()
        self._ref_files[ident] = entries
        self.remember_all(list(entries.values()))

    def ref_file_entry(self, ident: tuple[int, int, int], key: bytes) -> SlotRef | None:
        entries = self._ref_files.get(ident)
        return None if entries is None else entries.get(key)

    def cached_ref(self, key: bytes) -> SlotRef | None:
        return self._where.get(key)

    def remembered(self) -> Mapping[bytes, SlotRef]:
        """The remembered locations by key, for lookups of a whole batch; never to be changed."""
        return self._where

    def remember(self, ref: SlotRef) -> None:
        self.remember_all((ref,))

    def remember_all(self, refs: tuple[SlotRef, ...] | list[SlotRef]) -> None:
        where = self._where
        if len(where) + len(refs) > _WHERE_CACHE:  # drop the oldest eighth; forgetting only costs a lookup
            for key in list(itertools.islice(where, max(_WHERE_CACHE // 8, len(refs)))):
                where.pop(key, None)
        where.update(zip(map(_KEY, refs), refs))

    def forget(self, key: bytes) -> None:
        self._where.pop(key, None)

    def drop_caches(self) -> None:
        """Forget every remembered location and reference file (the benchmark uses it to load as an
        owner that did not save the blocks would)."""
        self._where.clear()
        self._ref_files.clear()

    def check_records(self, refs: list[SlotRef]) -> tuple[list[int], bytes, list[int], int, Exception | None]:
        """Check slot headers before a copy out of them, stopping at the first that fails.

        Returns (slot addresses, header field bytes and payload checksums of the slots that passed,
        index of the failing one or -1, its error: FormatError when the slot was reused or is
        damaged, OSError when its slab cannot be mapped).  Each header must be a valid block
        header naming the reference's key and creation time (native.check_headers)."""
        addrs: list[int] = []
        err: Exception | None = None
        sb = self.slot_bytes
        names, slots = list(map(_SLAB, refs)), list(map(_SLOT, refs))
        distinct = set(names)
        if self.mapped:
            self._drop_damaged(distinct)  # then looked up afresh below, and found short or gone
        mapped_slabs = [self._slabs.get(name) for name in distinct]
        if refs and None not in mapped_slabs and 0 <= min(slots) and \
                max(slots) < min(slab.nslots for slab in mapped_slabs):  # type: ignore[union-attr]
            # the common batch: slabs mapped already, every slot inside them; no per-ref method calls
            base = {slab.name: slab.base for slab in mapped_slabs}  # type: ignore[union-attr]
            addrs = [base[name] + slot * sb for name, slot in zip(names, slots)]
        else:
            for ref in refs:
                try:
                    slab = self._slab(ref.slab)
                except (OSError, FormatError, ValueError) as exc:
                    err = exc
                    break
                if not 0 <= ref.slot < slab.nslots:
                    err = FormatError(f"slot {ref.slot} outside slab {ref.slab} of {slab.nslots} slots")
                    break
                addrs.append(slab.base + ref.slot * sb)
        mapped = refs[:len(addrs)]
        fields, sums, bad, why = native.check_headers(addrs, self.pool.fingerprint, list(map(_KEY, mapped)),
                                                      list(map(_CREATED, mapped)), self.pool.payload_len)
        if bad >= 0:
            return addrs[:bad], fields, sums, bad, FormatError(why)
        if err is not None:
            return addrs, fields, sums, len(addrs), err
        return addrs, fields, sums, -1, None

    def touch(self, refs: list[SlotRef]) -> None:
        """Loaded from this owner's slots: they become the most recently used."""
        with self._lock:
            used = self._used
            for pos in self._positions(refs):
                entry = used.pop(pos, None)
                if entry is not None:
                    used[pos] = entry  # re-inserted: now the most recently used

    def usage(self) -> dict[str, int]:
        """Slot and slab counts.  Also the sweep (:meth:`_sweep`) of a process that neither saves nor
        loads: the worker's stats publisher asks for these every stats interval."""
        if self.clock() >= self._sweep_at:
            self._sweep()
        with self._lock:
            now = self.clock()
            ready = sum(count for t, _, _, count in self._free if t <= now)
            free = sum(count for _, _, _, count in self._free)
            return {"owned_slots": self.owned_slots, "used_slots": len(self._used), "free_slots": free,
                    "ready_slots": ready, "mapped_slabs": len(self._slabs) + len(self._retired), **self.stats}


def maps_slabs(root: str) -> bool:
    """Whether an arena on ``root`` maps its slabs: on a host-memory filesystem; on any other they
    are moved by O_DIRECT reads and writes (a mapped slab on a disk filesystem would pin page cache
    and still be written back at disk speed)."""
    return fs_type(root) in HOST_FS_TYPES


def slab_kind(mapped: bool) -> str:
    """How an arena's slabs move, in the words of the worker's start-up line and ``gds-kv doctor``."""
    return "mapped slabs" if mapped else "slabs moved with O_DIRECT"


def start_arena(pool: BlockPool, mapper: HostMapper, settings: Settings) -> SlotArena:
    """The worker's arena, its slab kind chosen by :func:`maps_slabs`; slabs are mapped only where
    the C extension guards mappings (native.GUARDS): a truncated slab must not kill the process.
    Raises ArenaError (one line) when its slabs do not fit."""
    # another node's client caches file data of its own: a slab it rewrites is read back stale here
    kind = fs_type(pool.roots[0])
    if is_shared_fs(pool.roots[0]) and not settings.arena_on_shared_fs:
        raise ArenaError(f"TLLM_GDS_KV_ARENA_BYTES on {pool.roots[0]} ({kind}): another node's client would read "
                         "slots through its own page cache and fail promised loads; leave the arena off on a "
                         "shared filesystem, or set TLLM_GDS_KV_ARENA_ON_SHARED_FS=true where its clients keep no "
                         "data cache (docs/deployment.md)")
    # a load holding a removed slab's addresses runs within its deadline: twice that, at least the default
    mapped = maps_slabs(pool.roots[0]) and native.GUARDS
    arena = SlotArena(pool, mapper, settings.arena_bytes, settings.arena_slab_bytes, settings.arena_reuse_delay_s,
                      mapped=mapped, release_grace_s=max(RELEASE_GRACE_S, 2 * settings.deadline_s))
    arena.start()
    return arena


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """Slot numbers as (first, count) runs of consecutive numbers, in ascending order."""
    out: list[list[int]] = []
    for slot in sorted(slots):
        if out and out[-1][0] + out[-1][1] == slot:
            out[-1][1] += 1
        else:
            out.append([slot, 1])
    return [(first, count) for first, count in out]



def lock_if_unowned(path: str, now: float) -> int | None:
    """A descriptor holding the owner lock of the slab (or temporary slab) at ``path``, or None when
    a live owner holds it, it changed in the last FRESH_S (its creator may not have locked it yet),
    or it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if now - os.fstat(fd).st_ctime >= FRESH_S:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
    except OSError:
        pass
    os.close(fd)
    return None



def _back(fd: int, nbytes: int, where: str) -> None:
    """Give a mapped slab a page for each of its ``nbytes`` now (``posix_fallocate``; on tmpfs it
    reserves them): mapped without, a slab a full filesystem cannot back maps without complaint
    (MAP_POPULATE stops short silently) and faults at the first use of a missing page."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot back a slab of {nbytes} bytes in {where} ({_free_bytes(where)} bytes "
                                 f"free): {exc.strerror}") from None


def _free_bytes(path: str) -> int:
    """Bytes an unprivileged process may still allocate on ``path``'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _preallocate(fd: int, nbytes: int) -> None:
    """Reserve a disk slab's blocks and write them once, so that every later slot write is an
    overwrite.  ``fallocate`` alone leaves unwritten extents (ext4, XFS) that each first write
    converts in the filesystem's journal: on ext4, 4 MiB O_DIRECT writes into fallocated space
    run at 55-85% of the rate of writes into space already written; through the whole save path
    the gain is within a disk's spread at 256 KiB and up to a sixth at 1 MiB.
    A slab is written once in its life (restarts adopt it), on the arena's start-up thread."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            raise
    zeros = mmap.mmap(-1, min(nbytes, _FILL_CHUNK) or PAGE)  # page-aligned, as O_DIRECT needs
    try:
        dfd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            zeros.close()
            raise
        dfd = -1  # no O_DIRECT here: the page cache takes the zeros, fdatasync sends them
    try:
        with memoryview(zeros) as view:
            at = 0
            while at < nbytes:
                n = os.pwrite(fd if dfd < 0 else dfd, view[:min(len(view), nbytes - at)], at)
                if n <= 0:
                    raise OSError(errno.EIO, f"writing a new slab stopped at byte {at} of {nbytes}")
                at += n
        os.fdatasync(fd)
    finally:
        if dfd >= 0:
            os.close(dfd)
        zeros.close()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.debug("could not remove %s: %s", path, exc)

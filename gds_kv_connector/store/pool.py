"""The shared pool directory: where a key's file lives, atomic publication, pins, quarantine.

Layout (docs/format.md): ``<root>/gdskv-v1/<fingerprint hex[:16]>/<key hex[:2]>/<key hex>.blk``.
A block is written to a temporary file in its final directory and published with ``link(2)``,
which fails if the name exists: a reader never sees a partial file and the first writer of a
key wins.  A load holds an open descriptor from promise to completion (a *pin*), so a file
evicted or replaced meanwhile still reads as the bytes that were promised.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import operator
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from gds_kv_connector.engines.fileops import FileOps, read_exact, write_all
from gds_kv_connector.format.trust import why_untrusted
from gds_kv_connector.format.layout import (BLOCK_SUFFIX, LAYOUT_DIR, OWNERS_DIR, QUARANTINE_DIR, TMP_PREFIX,
                                            evicted_path, quarantine_name)
from gds_kv_connector.format.keys import chain_from_tokens
from gds_kv_connector.util.host import HOST_TAG, parse_pid, pid_alive
from gds_kv_connector.util.mounts import is_shared_fs
from gds_kv_connector.format.records import (MAX_REF_ENTRIES, PAGE, REF_MAGIC, BlockHeader, FormatError,
                          SlotRef, file_size_for, is_ref_size, pack_refs, parse_header, parse_refs)

if TYPE_CHECKING:
    from gds_kv_connector.store.arena import SlotArena

log = logging.getLogger(__name__)

STALE_FOREIGN_TMP_S = 3600.0
# A temporary file changed this recently is never stale, whatever its pid says: a pid in the name
# means nothing outside the writer's pid namespace (a sidecar, ``kubectl exec``, a hostNetwork pod or
# the node itself shares the host name but not the pids), so ``kill(pid, 0)`` there fails for a live
# writer.  A writer holds its temporary file for one transfer batch, bounded by the connector's
# deadline (TLLM_GDS_KV_DEADLINE_S, 60 s by default), and every write renews the mtime: ten times
# that default leaves room for slow storage and for clock differences between a node and its
# file server.
TMP_YOUNG_S = 600.0
# How long a network filesystem's client may show an inode's attributes as they were (NFS acregmax is
# 60 s at most by default, GlusterFS and FUSE caches about a second): a block file younger than this
# whose size looks wrong is not taken for junk (:meth:`BlockPool._clear_junk`).
STALE_ATTR_S = 60.0
KEY_LEN = 32
# From this many blocks a prompt is keyed and stat'ed in one call (match_chain): the length from
# which chain_keys already hashes on a second thread (CHAIN_PIPELINE_BLOCKS in csrc/native.c).
CHAIN_PRESENT_MIN_BLOCKS = 512
_REF_KEY = operator.attrgetter("key")



# Errors opening or reading a block file that come from the file, not from this process (descriptor
# limits, memory): they stay for every owner that meets the file, so a load that gets one (after its
# retries) moves the file out of the key's name first, or each restarted owner would die on it in turn.
FILE_FAULT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EIO})
_FIRST_BYTE = operator.itemgetter(0)


@dataclass(frozen=True)
class PoolTrust:
    """Who may write a pool (docs/format.md, "Trust"): what a file or directory's lstat or fstat
    must show for its content to be believed.

    ``uids``: root (it bypasses every permission, so distrusting its files protects nothing), this
    process's uid and the owner of each pool root.  ``gids``: each root's group where this process
    belongs to it and the pool is shared (the share group: the setgid directories hand it to every
    pool file, and only its members can create files carrying it in them); else none.
    """

    uids: frozenset[int]
    gids: frozenset[int]

    @classmethod
    def of_roots(cls, roots: Sequence[str], share_group: bool) -> PoolTrust:
        """``share_group``: TLLM_GDS_KV_SHARE_GROUP; a root whose pool an owner made with it counts as
        shared anyway (:func:`_made_for_sharing`), so an owner or ``gds-kv verify`` run without the
        setting does not take the other owners' blocks for a stranger's."""
        mine = {os.getegid(), *os.getgroups()}
        owners = [os.stat(r) for r in roots]
        gids = {st.st_gid for r, st in zip(roots, owners)
                if st.st_gid in mine and (share_group or _made_for_sharing(r, st.st_gid))}
        return cls(frozenset({0, os.geteuid(), *(st.st_uid for st in owners)}), frozenset(gids))

    def why_not(self, st: os.stat_result) -> str | None:
        """Why a writer outside the pool's could have made or changed what ``st`` describes; None
        when only trusted writers could (:func:`~gds_kv_connector.format.trust.why_untrusted`)."""
        return why_untrusted(self.uids, self.gids, st)


def _made_for_sharing(root: str, gid: int) -> bool:
    """Whether the pool's layout directory under ``root`` is as an owner with TLLM_GDS_KV_SHARE_GROUP
    makes it: setgid and group-writable, of the root's group ``gid`` (a group only its members, or
    the setgid root of that group, can give a directory)."""
    try:
        st = os.lstat(os.path.join(root, LAYOUT_DIR))
    except OSError:
        return False
    shared = stat.S_ISGID | stat.S_IWGRP
    return stat.S_ISDIR(st.st_mode) and st.st_mode & shared == shared and st.st_gid == gid


def file_kind(mode: int) -> str:
    """What an entry is, in words, for the reason a block name's entry is rejected."""
    for test, kind in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return kind
    return "device"


@dataclass(slots=True)
class Pin:
    """An open read-only descriptor on a published block file, or (``fd`` -1) the arena slot a
    reference file named; a slot's record is checked again around the copy, not held open."""

    key: bytes
    key_dir: str  # the key's directory: the file's path is only spelled out when an error names it
    fd: int
    ino: int
    slot: SlotRef | None = None

    @property
    def path(self) -> str:
        return f"{self.key_dir}/{self.key.hex()}{BLOCK_SUFFIX}"


class PoolError(RuntimeError):
    """The pool root cannot be used as configured."""


class BlockPool:
    """One fingerprint's view of one or more pool roots."""

    def __init__(self, roots: tuple[str, ...], fingerprint: bytes, payload_len: int, tokens_per_block: int, *,
                 share_group: bool = False, fsync: bool = False, index_ttl_s: float = 5.0,
                 geometry_note: str = "", ops: FileOps | None = None, refs: bool = False) -> None:
        """``refs``: arena reference files count as present (every owner of the pool runs an arena)."""
        if not roots:
            raise PoolError("no pool root configured")
        self.fingerprint = fingerprint
        self.payload_len = payload_len
        self.file_size = file_size_for(payload_len)
        self.tokens_per_block = tokens_per_block
        self.fsync = fsync
        self.index_ttl_s = index_ttl_s
        self.ops = ops or FileOps()
        self.file_mode = 0o640 if share_group else 0o600
        self.dir_mode = 0o2770 if share_group else 0o700
        self.roots = tuple(os.path.abspath(r) for r in roots)
        self.fp_dirs = tuple(os.path.join(r, LAYOUT_DIR, fingerprint.hex()[:16]) for r in self.roots)
        # the directory of every first key byte: root key[0] mod n, then the byte as two hex digits
        self._key_dirs = tuple(os.path.join(self.fp_dirs[b % len(self.roots)], f"{b:02x}") for b in range(256))
        self._index: dict[bytes, float] = {}
        self.arena: SlotArena | None = None  # set by the worker for a host-memory pool (arena.py)
        self.refs = refs
        self._made_dirs: set[str] = set()
        self._lock = threading.Lock()
        # first key bytes whose key directory was found trusted (never looked at again: only a
        # writer of the trusted fingerprint directory can replace it), and those found untrusted,
        # with when to look again (an operator may fix the directory while this owner serves)
        self._trusted_dirs: set[int] = set()
        self._untrusted_dirs: dict[int, float] = {}
        # where evictors keep what they remove for a while, and loads look for it (:meth:`_open_block`)
        self.keeps_evicted = any(map(is_shared_fs, self.roots))
        for root, fp_dir in zip(self.roots, self.fp_dirs):
            self._check_root(root)
            self.makedirs(fp_dir)
            self.makedirs(os.path.join(root, LAYOUT_DIR, QUARANTINE_DIR))
            self.makedirs(os.path.join(root, LAYOUT_DIR, OWNERS_DIR))
            self._write_geometry(fp_dir, geometry_note)
        self.trust = PoolTrust.of_roots(self.roots, share_group)
        # the same writers as the stat loops take them: a file none of them made is a miss at match time
        self._trust = (tuple(sorted(self.trust.uids)), tuple(sorted(self.trust.gids)))
        for d in (*(os.path.join(r, LAYOUT_DIR) for r in self.roots), *self.fp_dirs):
            self._require_trusted(d)

    # -- naming -----------------------------------------------------------------------------------
    def root_of(self, key: bytes) -> int:
        _check_key(key)
        return key[0] % len(self.roots)

    def dir_for(self, key: bytes) -> str:
        if type(key) is not bytes or len(key) != KEY_LEN:
            _check_key(key)
        return self._key_dirs[key[0]]

    def path_for(self, key: bytes) -> str:
        """Called per block on every transfer path, so it is one table lookup and one format."""
        if type(key) is not bytes or len(key) != KEY_LEN:
            _check_key(key)
        return f"{self._key_dirs[key[0]]}/{key.hex()}{BLOCK_SUFFIX}"

    # -- lookup -----------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        """True if a published file that could load exists (trusted for index_ttl_s): a regular
        file of this pool's size, by a trusted writer, in a trusted key directory."""
        _check_key(key)
        now = time.monotonic()
        expires = self._index.get(key)
        if expires is not None and expires > now:
            return True
        try:
            st = self.ops.stat(self.path_for(key))
        except OSError:
            self._index.pop(key, None)
            return False
        if self._unusable(st, self.refs) is not None or not self._key_dir_trusted(key[0]):
            self._index.pop(key, None)
            return False
        self._index[key] = now + self.index_ttl_s
        return True

    def _size_ok(self, size: int) -> bool:
        """A block file's size, or an arena reference file's where this pool publishes those."""
        return size == self.file_size or (self.refs and is_ref_size(size))

    def _unusable(self, st: os.stat_result, refs: bool) -> str | None:
        """Why the entry ``st`` describes at a block name can never load here, or None: not a
        regular file, a size neither a block's nor (with ``refs``) a reference file's, or made or
        changeable by a writer the pool does not trust (:class:`PoolTrust`)."""
        if not stat.S_ISREG(st.st_mode):
            return f"a {file_kind(st.st_mode)}"
        if st.st_size != self.file_size and not (refs and is_ref_size(st.st_size)):
            return f"{st.st_size} bytes, not {self.file_size}"
        return self.trust.why_not(st)

    def _key_dir_trusted(self, b: int) -> bool:
        """Whether the key directory of first key byte ``b`` is one only trusted writers can change:
        a name in it was linked by one of them (``link(2)`` and ``rename(2)`` need write access to
        the directory), so the match, whose stats return sizes only, believes what it finds there."""
        if b in self._trusted_dirs:
            return True
        now = time.monotonic()
        again = self._untrusted_dirs.get(b)
        if again is not None and again > now:
            return False
        try:
            st = os.lstat(self._key_dirs[b])
        except OSError:
            return False  # gone meanwhile: nothing in it can be matched
        why = self.trust.why_not(st) if stat.S_ISDIR(st.st_mode) else f"a {file_kind(st.st_mode)}"
        if why is None:
            self._trusted_dirs.add(b)
            return True
        if again is None:
            log.warning("key directory %s is %s: its blocks are never matched (docs/format.md, \"Trust\")",
                        self._key_dirs[b], why)
        self._untrusted_dirs[b] = now + self.index_ttl_s
        return False

    def _trusted_run(self, keys: list[bytes], n: int, m: int) -> int:
        """How many of ``keys[n:n + m]``, from the first, lie in trusted key directories
        (:meth:`_key_dir_trusted`): one C-level set check while every one was found trusted before."""
        if self._trusted_dirs.issuperset(map(_FIRST_BYTE, itertools.islice(keys, n, n + m))):
            return m
        for i in range(n, n + m):
            if not self._key_dir_trusted(keys[i][0]):
                return i - n
        return m

    def _require_trusted(self, d: str) -> None:
        """Refuse a pool whose layout or fingerprint directory an untrusted writer could change: it
        could replace a key directory after this owner found it trusted."""
        why = self.trust.why_not(os.lstat(d))
        if why is not None:
            raise PoolError(f"{d} is {why}: the pool cannot be trusted (docs/format.md, \"Trust\")")

    def not_indexed(self, keys: list[bytes]) -> list[int]:
        """Positions of the keys this process did not see published within index_ttl_s (no system
        call; one pass per save batch)."""
        expiries = map(self._index.get, keys, itertools.repeat(0.0))
        return list(itertools.compress(itertools.count(), map(time.monotonic().__ge__, expiries)))

    def count_present(self, keys: list[bytes], start: int = 0) -> int:
        """How many consecutive keys from ``start`` are in the pool.

        A 128k-token prompt asks this of 4096 keys on the executor thread, so keys still in the
        index are counted in one tight loop; from the first that is not, the files are stat'ed in
        one call (``FileOps.present_run``) and checked as :meth:`contains` checks one.
        """
        now = time.monotonic()
        index_get = self._index.get
        n = start
        total = len(keys)
        while n < total:
            expires = index_get(keys[n])
            if expires is not None and expires > now:
                n += 1
                continue
            n = self._accept_run(keys, n, self.ops.present_run(self._key_dirs, keys, n, BLOCK_SUFFIX, self._trust),
                                 now)
            break
        return n - start

    def absent(self, key: bytes) -> bool:
        """True if ``key`` is neither in the index nor a block file of this pool.  Indexes nothing:
        a present key is left for :meth:`match_chain` to find with the rest of its prompt (an
        indexed first key would send a long prompt past the one call that stats behind the hashing)."""
        if self._index.get(key, 0.0) > time.monotonic():
            return False
        sizes = self.ops.present_run(self._key_dirs, [key], 0, BLOCK_SUFFIX, self._trust)
        return not (sizes and self._size_ok(sizes[0]) and self._key_dir_trusted(key[0]))

    def match_chain(self, prev: bytes, tokens: list[int], tokens_per_block: int,
                    num_blocks: int) -> tuple[list[bytes], int]:
        """The keys of the first ``num_blocks`` blocks of ``tokens`` (``prev``: the chain seed) and
        how many of them, from the first, are in the pool (:meth:`count_present`).

        A prompt of CHAIN_PRESENT_MIN_BLOCKS blocks or more whose first block is not in the index
        (another process or node saved it, or nobody did) is keyed and stat'ed in one call
        (``FileOps.chain_present``), the stats following the hashing on other threads instead of
        waiting for the whole chain; other prompts are keyed, then counted.
        """
        if num_blocks < CHAIN_PRESENT_MIN_BLOCKS:
            keys = chain_from_tokens(prev, tokens, 0, tokens_per_block, num_blocks)
            return keys, self.count_present(keys)
        keys = chain_from_tokens(prev, tokens, 0, tokens_per_block, 1)  # the first block decides
        now = time.monotonic()
        if self._index.get(keys[0], 0.0) <= now:
            got = self.ops.chain_present(prev, tokens, tokens_per_block, num_blocks, self._key_dirs, BLOCK_SUFFIX,
                                         self._trust)
            if got is not None:
                return got[0], self._accept_run(got[0], 0, got[1], now)
        keys += chain_from_tokens(keys[0], tokens, tokens_per_block, tokens_per_block, num_blocks - 1)
        return keys, self.count_present(keys)

    def _accept_run(self, keys: list[bytes], n: int, sizes: list[int], now: float) -> int:
        """Index ``keys[n:]`` whose files were found with ``sizes``, up to the first whose size is
        not one of this pool's or whose key directory is not trusted, and forget the key where the
        run ends: the position it ends at."""
        index = self._index
        if sizes and len(self._trusted_dirs) < 256:
            sizes = sizes[:self._trusted_run(keys, n, len(sizes))]
        if sizes:  # none is the usual answer for a new prompt: its first block is not there
            until = now + self.index_ttl_s
            if all(map(self._size_ok, set(sizes))):  # the usual case: one size, checked once
                index.update(dict.fromkeys(keys[n:n + len(sizes)], until))
                n += len(sizes)
            else:
                for size in sizes:
                    if not self._size_ok(size):
                        break
                    index[keys[n]] = until
                    n += 1
        if n < len(keys):  # keys[n] is missing, or not a block file of this pool
            index.pop(keys[n], None)
        return n

    def forget(self, key: bytes) -> None:
        self._index.pop(key, None)

    # -- reading ----------------------------------------------------------------------------------
    def pin_all(self, keys: Sequence[bytes], out: list[Pin]) -> None:
        """Append a pin of each key to ``out`` in order, as :meth:`pin` makes it; on an error ``out``
        holds the pins made before it (``keys[len(out)]`` failed), for the caller to release.

        A key whose arena slot this process remembers (it saved the block, or read the reference
        file of its save batch) is pinned in one dict lookup here, not a call of :meth:`pin`: a
        transfer thread pins with the GIL held, and at 256 KiB a block's Python competes with
        about 5 us of DMA.
        """
        where = self.arena.remembered() if self.arena is not None else {}
        dirs, pin, append = self._key_dirs, self.pin, out.append
        for key in keys:
            ref = where.get(key)
            if ref is None:
                append(pin(key))
            else:
                key = ref.key  # the pool's own bytes object, equal to the caller's
                append(Pin(key, dirs[key[0]], -1, 0, ref))

    def pin(self, key: bytes) -> Pin:
        """Open the block for reading; raises FileNotFoundError, FormatError, EOFError or OSError.

        A file that is not a regular file of the pool's size, that a writer the pool does not trust
        made or could change (:class:`PoolTrust`, from the fstat the pin makes anyway), that ends
        before the bytes its size promised (EOFError), or that cannot be opened or read for a
        reason of its own (FILE_FAULT_ERRNOS: EACCES, EIO), is quarantined before the error is
        raised, so no owner matches it again.  A symbolic link at the key's name is never followed
        (O_NOFOLLOW; it could point at another key's block or outside the pool) and is quarantined
        the same way.  O_NONBLOCK keeps a FIFO planted at the name from blocking the transfer
        thread in open(2); it has no effect on regular files.
        """
        d = self.dir_for(key)
        if self.arena is not None:
            ref = self.arena.cached_ref(key)
            if ref is not None:  # the common arena load: no system call and no path string
                return Pin(key, d, -1, 0, ref)
        path = f"{d}/{key.hex()}{BLOCK_SUFFIX}"
        if self.arena is not None:
            # A reference file read before (one per save batch) is known by inode, size and ctime: one
            # lstat instead of open, read, parse and close for each of its keys.
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISREG(st.st_mode):
                ref = self.arena.ref_file_entry((st.st_ino, st.st_size, st.st_ctime_ns), key)
                if ref is not None:
                    self.arena.remember(ref)
                    return Pin(key, d, -1, st.st_ino, ref)
        try:
            fd = self._open_block(key, path)
        except OSError as exc:
            if exc.errno in FILE_FAULT_ERRNOS:
                self.quarantine(key, f"open {errno.errorcode[exc.errno]}")
                raise
            if exc.errno != errno.ELOOP:
                raise
            try:
                lst = os.lstat(path)
            except OSError:
                lst = None
            if lst is not None and stat.S_ISLNK(lst.st_mode):
                self.quarantine(key, "symlink", lst.st_ino)
            raise FormatError("a symbolic link sits at the block's name (never followed)") from None
        ino = None
        try:
            st = self.ops.fstat(fd)
            ino = st.st_ino
            if not stat.S_ISREG(st.st_mode):
                raise FormatError("not a regular file")
            untrusted = self.trust.why_not(st)
            if untrusted is not None:
                raise FormatError(f"untrusted file: {untrusted}")
            ref = None
            if is_ref_size(st.st_size) and (st.st_size != self.file_size or self._peek_magic(fd) == REF_MAGIC):
                if self.arena is None:
                    raise OSError(errno.ENOTSUP, "an arena reference file, but this process has no arena "
                                  "(set TLLM_GDS_KV_ARENA_BYTES on every owner of a host-memory pool)")
                ref = self._parse_ref_fd(fd, key, st.st_size)
            elif st.st_size != self.file_size:
                raise FormatError(f"file is {st.st_size} bytes, expected {self.file_size}")
        except (FormatError, EOFError) as exc:  # EOFError: a file shrunk under the reader is as bad
            self.ops.close(fd)
            self.quarantine(key, str(exc), ino)
            raise
        except OSError as exc:
            self.ops.close(fd)
            if exc.errno in FILE_FAULT_ERRNOS:
                self.quarantine(key, f"read {errno.errorcode[exc.errno]}", ino)
            raise
        except BaseException:
            self.ops.close(fd)
            raise
        if ref is not None:
            self.ops.close(fd)
            self.arena.remember(ref)
            return Pin(key, d, -1, st.st_ino, ref)
        return Pin(key, d, fd, st.st_ino)

    def _open_block(self, key: bytes, path: str) -> int:
        """Open the block at ``path``; on a shared filesystem, a block its evictor just took out of the
        lookup path is opened where it keeps it (:data:`EVICTED_DIR`), and the name's error is raised
        only when it is not there either.

        A client of a shared filesystem answers a match's stats from its name and attribute caches
        (GlusterFS and FUSE about a second, NFS up to a minute), so an owner can promise a block
        another node's evictor removed within that time; its load would fail at this open (ENOENT
        after a fresh lookup, ESTALE through a cached handle) and the failure of a promised load
        fails the process.  Evictors on such a filesystem therefore rename a block into the evicted
        directory and remove it only after :data:`EVICTED_KEEP_S`: a cached handle still opens the
        same inode, and a fresh lookup finds the block here.  A file met here is checked like one at
        its name (its size, its writer, then its header and checksum as it loads)."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            return self.ops.open(path, flags)
        except OSError as exc:
            if not self.keeps_evicted or exc.errno not in (errno.ENOENT, errno.ESTALE):
                raise
            try:
                return self.ops.open(evicted_path(self.fp_dirs[self.root_of(key)], key), flags)
            except OSError:
                raise exc from None

    def _peek_magic(self, fd: int) -> bytes:
        raw = bytearray(8)
        read_exact(self.ops, fd, raw, 0)
        return bytes(raw)

    def _parse_ref_fd(self, fd: int, key: bytes, size: int) -> SlotRef:
        raw = bytearray(size)
        read_exact(self.ops, fd, raw, 0)
        entries = parse_refs(bytes(raw), fingerprint=self.fingerprint, slot_bytes=self.file_size)
        if self.arena is not None:  # None only while the arena adopts slabs, before it is attached
            st = self.ops.fstat(fd)
            self.arena.note_ref_file((st.st_ino, st.st_size, st.st_ctime_ns), entries)
        ref = entries.get(key)
        if ref is None:
            raise FormatError("reference file has no entry for its key")
        return ref

    def read_ref(self, key: bytes) -> SlotRef | None:
        """The slot the key's reference file names now, or None when none does (no file, a block
        file, a symbolic link, not a valid reference).  Raises OSError when the name could not be
        read (EMFILE, EIO, ESTALE): the reference may still be there, and an owner that took that
        for "gone" would reuse a slot readers are still sent to."""
        try:
            fd = self.ops.open(self.path_for(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP):  # ELOOP: a symbolic link, never followed
                return None
            raise
        try:
            size = self.ops.fstat(fd).st_size
            if not is_ref_size(size):
                return None
            return self._parse_ref_fd(fd, key, size)
        except (FormatError, EOFError):
            return None
        finally:
            self.ops.close(fd)

    def unpublish_ref(self, key: bytes, expected: SlotRef) -> bool:
        """Remove the key's name if it still refers to ``expected`` (arena eviction)."""
        self.forget(key)
        if self.read_ref(key) != expected:
            return False
        try:
            self.ops.unlink(self.path_for(key))
            return True
        except FileNotFoundError:
            return False

    def publish_refs(self, slab: str, refs: list[SlotRef]) -> list[bool | Exception]:
        """Write one reference file for slots of ``slab`` and link it under each key.  Per key: True
        if this writer won, False if the name existed (link(2) fails on it, as for block files), or
        the error that kept it from being published; never raises, so the caller knows exactly
        which slots are referenced."""
        out: list[bool | Exception] = []
        for lo in range(0, len(refs), MAX_REF_ENTRIES):
            chunk = refs[lo:lo + MAX_REF_ENTRIES]
            fd, tmp = -1, ""
            try:
                data = pack_refs(self.fingerprint, self.file_size, slab, chunk)
                d = self.dir_for(chunk[0].key)
                fd, tmp = self._create_tmp_file(d, chunk[0].key)
                if self.file_mode & 0o077:
                    self.ops.fchmod(fd, self.file_mode)
                write_all(self.ops, fd, data, 0)
                # Forgotten before close: close(2) releases the descriptor even when it reports an
                # error (a deferred NFS write error), and the number may be another thread's by then.
                fd, closing = -1, fd
                self.ops.close(closing)
            except (OSError, PoolError) as exc:
                self.discard_tmp(fd, tmp)
                out.extend(exc for _ in chunk)
                continue
            try:
                keys = list(map(_REF_KEY, chunk))
                no_dir: dict[int, Exception] = {}  # by the key's first byte, which names its directory
                # once every key directory is made (one C-level set check, about 1.5 us), the
                # Python pass over the batch's first key bytes is skipped
                if not self._made_dirs.issuperset(self._key_dirs):
                    for b in {k[0] for k in keys}:
                        try:
                            self.makedirs(self._key_dirs[b])
                        except (OSError, PoolError) as exc:
                            no_dir[b] = exc
                linking = [k for k in keys if k[0] not in no_dir] if no_dir else keys
                results = self.ops.link_keys(tmp, self._key_dirs, linking, BLOCK_SUFFIX)
                deadline = time.monotonic() + self.index_ttl_s
                if any(results):
                    results = self._relink_into_removed_dirs(tmp, linking, results)
                    results = self._relink_over_junk(tmp, linking, results)
                elif not no_dir:  # all linked: the common case, without a Python loop
                    self._index.update(dict.fromkeys(keys, deadline))
                    out.extend(itertools.repeat(True, len(keys)))
                    continue
                linked = iter(results)
                index, append = self._index, out.append
                for k in keys:
                    failed = no_dir[k[0]] if no_dir and k[0] in no_dir else next(linked)
                    if failed is None:
                        index[k] = deadline
                        append(True)
                    else:
                        append(False if isinstance(failed, FileExistsError) else failed)
            finally:
                self.discard_tmp(-1, tmp)
        return out

    def check_header(self, pin: Pin, raw: bytes | bytearray) -> BlockHeader:
        """Parse a pinned block's header bytes (read with its payload) and check them against the
        pool and the key; raises FormatError."""
        return parse_header(bytes(raw), fingerprint=self.fingerprint, key=pin.key, payload_len=self.payload_len)

    def unpin(self, pin: Pin) -> None:
        """Close the pin's descriptor.  A close that fails (ESTALE from a shared filesystem whose file
        another node removed) released the descriptor all the same, and a read-only one has nothing
        to flush: it is logged, never raised, so it cannot turn a load's outcome into a failure."""
        if pin.fd >= 0:
            try:
                self.ops.close(pin.fd)
            except OSError as exc:
                log.debug("closing %s: %s", self.path_for(pin.key), exc)
            finally:
                pin.fd = -1

    def unpin_all(self, pins: Sequence[Pin]) -> None:
        """Release every pin; an arena slot holds no descriptor, so only block files cost a call."""
        for pin in pins:
            if pin.fd >= 0:
                self.unpin(pin)

    def quarantine(self, key: bytes, reason: str, ino: int | None = None) -> str | None:
        """Move a bad file out of the lookup path so no owner matches it again.

        ``ino`` guards against moving a good file that replaced the bad one meanwhile.
        Returns the quarantine path, or None if the file was already gone or replaced.
        Never raises OSError: it runs inside the handling of another failure, which must stay the
        one reported.  If the file cannot be moved (quarantine directory gone, read-only pool) it is
        unlinked instead, so the key stops matching either way.
        """
        self.forget(key)
        path = self.path_for(key)
        try:
            st = self.ops.stat(path)
        except OSError:
            return None
        if ino is not None and st.st_ino != ino:
            return None
        qdir = os.path.join(self.roots[self.root_of(key)], LAYOUT_DIR, QUARANTINE_DIR)
        dest = os.path.join(qdir, quarantine_name(key.hex(), reason))
        for attempt in (0, 1):
            try:
                self.ops.rename(path, dest)
                log.warning("quarantined block %s (%s) -> %s", key.hex(), reason, dest)
                return dest
            except FileNotFoundError:
                if attempt or not os.path.lexists(path):
                    break
                self._made_dirs.discard(qdir)
                try:
                    self.makedirs(qdir)
                except (OSError, PoolError):
                    break
            except OSError as exc:
                log.warning("could not quarantine block %s (%s): %s", key.hex(), reason, exc)
                break
        try:
            self.ops.unlink(path)
            log.warning("removed bad block %s (%s); it could not be quarantined", key.hex(), reason)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("bad block %s (%s) can be neither quarantined nor removed: %s", key.hex(), reason, exc)
        return None

    # -- writing ----------------------------------------------------------------------------------
    def create_tmp(self, key: bytes, header: BlockHeader | None) -> tuple[int, str]:
        """Create the temporary file of a block and write its header; payload follows at HEADER_SIZE.

        ``header=None`` leaves the header page to the caller, who writes it with the payload
        (``TransferItem.header``) in one I/O."""
        fd, tmp = self._create_tmp_file(self.dir_for(key), key)
        try:
            if self.file_mode & 0o077:
                self.ops.fchmod(fd, self.file_mode)  # the umask must not take the group bits away
            if header is not None:
                write_all(self.ops, fd, header.pack(), 0)
            if self.payload_len % PAGE:
                self.ops.ftruncate(fd, self.file_size)  # the zero padding readers expect
        except BaseException:
            self.discard_tmp(fd, tmp)
            raise
        return fd, tmp

    def _create_tmp_file(self, d: str, key: bytes) -> tuple[int, str]:
        """(descriptor, path) of a new temporary file for ``key`` in its directory ``d``; block files
        and reference files share it, so both recover from a directory removed under them."""
        self.makedirs(d)
        tmp = os.path.join(d, f"{TMP_PREFIX}{key.hex()}-{HOST_TAG}-{os.getpid()}-{secrets.token_hex(4)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            return self.ops.open(tmp, flags, self.file_mode), tmp
        except FileNotFoundError:
            # The directory vanished under us (pool wiped while serving): recreate it once.
            self._forget_dirs(d)
            self.makedirs(d)
            return self.ops.open(tmp, flags, self.file_mode), tmp

    def _relink_into_removed_dirs(self, tmp: str, keys: list[bytes],
                                  results: list[OSError | None]) -> list[OSError | None]:
        """``results`` of linking ``tmp`` under ``keys``, with the keys that failed for a missing
        directory linked once more after it is made again: a directory removed since it was cached
        (pool wiped while serving) would otherwise fail every later save into it."""
        again = [n for n, err in enumerate(results) if isinstance(err, FileNotFoundError)]
        if not again:
            return results
        for b in {keys[n][0] for n in again}:
            self._forget_dirs(self._key_dirs[b])
            try:
                self.makedirs(self._key_dirs[b])
            except (OSError, PoolError):
                pass  # the link below fails again and reports it
        return self._relink(tmp, keys, results, again)

    def _relink_over_junk(self, tmp: str, keys: list[bytes],
                          results: list[OSError | None]) -> list[OSError | None]:
        """``results`` with the keys whose names held junk (:meth:`_clear_junk`) linked once more."""
        again = [n for n, err in enumerate(results) if isinstance(err, FileExistsError) and self._clear_junk(keys[n])]
        return self._relink(tmp, keys, results, again) if again else results

    def _relink(self, tmp: str, keys: list[bytes], results: list[OSError | None],
                again: list[int]) -> list[OSError | None]:
        """``results`` with ``keys[n]`` for n in ``again`` linked once more."""
        results = list(results)
        for n, err in zip(again, self.ops.link_keys(tmp, self._key_dirs, [keys[n] for n in again], BLOCK_SUFFIX)):
            results[n] = err
        return results

    def publish(self, fd: int, tmp: str, key: bytes) -> bool:
        """Make the temporary file visible under its key; False if another writer won."""
        try:
            if self.fsync:
                self.ops.fsync(fd)
            fd, closing = -1, fd  # released even when close reports an error: never closed twice
            self.ops.close(closing)
            final = self.path_for(key)
            try:
                self.ops.link(tmp, final)
                won = True
            except FileExistsError:
                won = self._clear_junk(key) and self._link_again(tmp, final)
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                won = self._publish_by_rename(tmp, key)
                tmp = ""
            if won:
                self._index[key] = time.monotonic() + self.index_ttl_s
            return won
        finally:
            self.discard_tmp(fd, tmp)

    def _link_again(self, tmp: str, final: str) -> bool:
        """link(2) once more after junk was moved from the name; False if a writer took it first."""
        try:
            self.ops.link(tmp, final)
            return True
        except FileExistsError:
            return False

    def _publish_by_rename(self, tmp: str, key: bytes) -> bool:
        """For filesystems without hard links: rename, which replaces an equal-keyed block, once the
        name is free (junk at it moved aside first, :meth:`_clear_junk`)."""
        final = self.path_for(key)
        for attempt in (0, 1):
            try:
                self.ops.stat(final)
            except FileNotFoundError:
                self.ops.rename(tmp, final)
                return True
            if attempt or not self._clear_junk(key):
                break
        self.ops.unlink(tmp)
        return False

    def _clear_junk(self, key: bytes) -> bool:
        """Move what holds ``key``'s name to the quarantine if it can never load (a directory, FIFO,
        symbolic link or socket, a size no block or reference file has, an untrusted writer's file:
        :meth:`_unusable`); True when the name may now be free.  Else every later save of the key
        would lose to it and its prefix would never be saved again.  Only the name is examined
        (lstat) and renamed: a link is never followed, a FIFO never opened, a directory renamed
        whole into the quarantine directory."""
        try:
            st = self.ops.stat(self.path_for(key))
        except FileNotFoundError:
            return True  # removed meanwhile (evicted): link again
        except OSError:
            return False
        why = self._unusable(st, refs=True)  # another owner's reference file is no junk
        if why is None:
            return False  # a block another writer published: a lost race
        if stat.S_ISREG(st.st_mode) and self.trust.why_not(st) is None and _age_of(st) < STALE_ATTR_S:
            # A regular file of a trusted writer that changed a moment ago and whose size looks wrong may
            # be another node's block just published, seen through this client's attribute cache, which
            # still holds the size its temporary file had (a hard link is the same inode): a lost race
            # for now; the name is judged again once no client cache can still be that old.
            return False
        self.quarantine(key, f"junk: {why}", st.st_ino)
        return True

    def discard_tmp(self, fd: int, tmp: str) -> None:
        if fd >= 0:
            try:
                self.ops.close(fd)
            except OSError:
                pass
        if tmp:
            try:
                self.ops.unlink(tmp)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove temporary file %s: %s", tmp, exc)

    # -- internals --------------------------------------------------------------------------------
    def _check_root(self, root: str) -> None:
        if not os.path.isdir(root):
            try:
                os.makedirs(root, mode=self.dir_mode, exist_ok=True)
            except OSError as exc:
                raise PoolError(f"pool root {root} does not exist and cannot be created: {exc.strerror}") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise PoolError(f"pool root {root} is not writable by this process")

    def makedirs(self, d: str, depth: int = 0) -> None:
        """Create ``d`` (and missing parents below the root) with exactly the pool's directory mode."""
        if d in self._made_dirs:
            return
        try:
            os.mkdir(d, self.dir_mode)
            os.chmod(d, self.dir_mode)
        except FileExistsError:
            pass
        except FileNotFoundError:
            parent = os.path.dirname(d)
            if depth > 8 or parent == d:
                raise
            self._made_dirs.discard(parent)  # cached, but removed since
            self.makedirs(parent, depth + 1)
            return self.makedirs(d, depth + 1)
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            return  # removed again meanwhile (pool wiped); not cached, so the next use retries
        if not stat.S_ISDIR(st.st_mode):  # a symlink or a file planted where a directory belongs
            raise PoolError(f"{d} exists and is not a directory")
        with self._lock:
            self._made_dirs.add(d)

    def _forget_dirs(self, d: str) -> None:
        """Drop ``d`` and its parents from the made-directories cache (they were removed)."""
        with self._lock:
            while d and d not in self.roots and d != os.path.dirname(d):
                self._made_dirs.discard(d)
                d = os.path.dirname(d)

    def _write_geometry(self, fp_dir: str, note: str) -> None:
        path = os.path.join(fp_dir, "fingerprint.json")
        if os.path.exists(path) or not note:
            return
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
        with open(tmp, "w") as fh:
            json.dump({"fingerprint": self.fingerprint.hex(), "geometry": note,
                       "payload_len": self.payload_len, "tokens_per_block": self.tokens_per_block}, fh)
        os.chmod(tmp, self.file_mode)
        os.replace(tmp, path)


def _check_key(key: bytes) -> None:
    """Keys name files: exactly 32 bytes, shown as 64 hex digits, so no path can leave the pool."""
    if not isinstance(key, bytes) or len(key) != KEY_LEN:
        raise ValueError(f"a block key must be {KEY_LEN} bytes, got {type(key).__name__} of length "
                         f"{len(key) if hasattr(key, '__len__') else '?'}")



def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []


def tmp_is_stale(name: str, path: str, now: float) -> bool:
    """True if the temporary file ``name`` (at ``path``) is left over: ``.tmp-<key>-<host tag>-<pid>-<rand>``.

    Never while it is young (TMP_YOUNG_S): its pid cannot be checked from another pid namespace on
    the same host, and nothing in the name says which namespace wrote it, so only age protects a
    live writer there.  Past that, a file whose host part is exactly this host's tag (:func:`host_tag`)
    and whose pid is not running here is from a dead writer (or a writer of another pid namespace
    stuck beyond every deadline); any other file, a foreign host's, a name that does not parse or
    one named before host tags (its host part cut short, possibly another host's), goes after
    STALE_FOREIGN_TMP_S.
    """
    age = _age(path, now)
    if age is None or age <= TMP_YOUNG_S:
        return False
    if age > STALE_FOREIGN_TMP_S:
        return True
    parts = name[len(TMP_PREFIX):].split("-")
    if len(parts) != 4 or parts[1] != HOST_TAG:
        return False
    pid = parse_pid(parts[2])
    # A live pid may be a reused one; no writer holds a temporary file for an hour either way.
    return pid is not None and not pid_alive(pid)


def _age_of(st: os.stat_result) -> float:
    """Seconds since the entry ``st`` describes last changed (the newer of mtime and ctime)."""
    return time.time() - max(st.st_mtime, st.st_ctime)


def _age(path: str, now: float) -> float | None:
    """Seconds since the file last changed (the newer of mtime and ctime: a write renews the one, a
    chmod or link the other, and ctime cannot be set back); None if it is gone.  Any other error
    reads as age 0, so a file that cannot be examined is left alone."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError:
        return 0.0
    return now - max(st.st_mtime, st.st_ctime)



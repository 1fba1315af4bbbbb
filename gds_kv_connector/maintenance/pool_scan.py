"""Walking a pool root without a BlockPool: what eviction and the operator commands see.

A BlockPool is one fingerprint's view and creates directories; maintenance must see every
fingerprint, create nothing, and survive files that appear, vanish or are garbage while it
walks, because other owners keep serving from the same directory.
"""

from __future__ import annotations

import errno
import json
import operator
import os
import stat
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from gds_kv_connector.format.layout import SLABS_DIR
from gds_kv_connector.format.layout import BLOCK_SUFFIX, LAYOUT_DIR, OWNERS_DIR, QUARANTINE_DIR, TMP_PREFIX, quarantine_name
from gds_kv_connector.format.records import (HEADER_SIZE, REF_MAGIC, BlockHeader, FormatError, SlotRef, is_ref_size, parse_header,
                          parse_refs)

_HEX = frozenset("0123456789abcdef")
_FP_DIR_LEN = 16
_KEY_HEX_LEN = 64
_NS_DIGITS = 19  # time.time_ns() has 19 digits from 2001 to 2286


@dataclass(frozen=True)
class BlockFile:
    """A published block as seen by one directory walk."""

    fp: str  # fingerprint directory name (fingerprint hex[:16])
    key: bytes
    path: str
    size: int
    ino: int
    mtime_ns: int
    ctime_ns: int

    def same_file(self, st: os.stat_result) -> bool:
        """True if ``st`` is still the file scanned: inode numbers are reused at once, ctime is not."""
        return st.st_ino == self.ino and st.st_ctime_ns == self.ctime_ns

    @property
    def file_id(self) -> tuple[int, int, int]:
        """(inode, mtime, size): what every name of one file shows alike.  An arena reference file is
        hard-linked under every key of its save batch, and each link or unlink of one of its names
        changes the ctime all of them show; its mtime never changes once it is published (it is
        written in full before its first link), and a new file at a reused inode number was written at another time."""
        return (self.ino, self.mtime_ns, self.size)

    def same_reference(self, st: os.stat_result) -> bool:
        """:meth:`same_file` for a reference file: true while ``st`` is the file scanned, whatever
        happened to its other names since."""
        return (st.st_ino, st.st_mtime_ns, st.st_size) == self.file_id


@dataclass
class PoolScan:
    blocks: list[BlockFile] = field(default_factory=list)
    tmp: list[str] = field(default_factory=list)  # temporary files of writers, live or dead
    foreign: int = 0  # entries that are neither blocks nor temporary files
    # entries at block names that are not regular files (a directory, FIFO, symbolic link, socket):
    # counted in ``foreign`` too; never loaded, they only keep their key from being saved
    junk: list[BlockFile] = field(default_factory=list)
    # directories that could not be listed and entries that could not be lstat'ed (permissions: an
    # owner without the share group's modes made them; I/O errors): what is in them was not seen
    unreadable: int = 0

    @property
    def block_bytes(self) -> int:
        """Bytes of the files under block names, each file once (:func:`unique_bytes`)."""
        return unique_bytes(self.blocks)

    def bytes_by_fp(self) -> dict[str, int]:
        """:attr:`block_bytes` per fingerprint directory (a reference file's names are all in one)."""
        by_fp: dict[str, list[BlockFile]] = {}
        for b in self.blocks:
            by_fp.setdefault(b.fp, []).append(b)
        return {fp: unique_bytes(blocks) for fp, blocks in by_fp.items()}


_SIZE = operator.attrgetter("size")
_FILE_ID = operator.attrgetter("ino", "mtime_ns", "size")  # BlockFile.file_id, made in C


def unique_bytes(blocks: Iterable[BlockFile]) -> int:
    """Bytes of ``blocks`` on disk: an arena reference file, one per save batch hard-linked under every
    key of the batch, counts once however many of its names are listed (by :attr:`BlockFile.file_id`);
    a block file, never linked twice, counts its size.  A pool without names of a reference file's
    size is summed as before; C iterators otherwise (stats and every eviction run sum the pool)."""
    blocks = blocks if isinstance(blocks, list) else list(blocks)
    total = sum(map(_SIZE, blocks))
    ref_sizes = {size for size in set(map(_SIZE, blocks)) if is_ref_size(size)}
    if not ref_sizes:
        return total
    ids = Counter(map(_FILE_ID, blocks))
    if len(ids) == len(blocks):  # no file listed twice
        return total
    return total - sum(size * (n - 1) for (_, _, size), n in ids.items() if n > 1 and size in ref_sizes)


def layout_dir(root: str) -> str:
    return os.path.join(os.path.abspath(root), LAYOUT_DIR)


def quarantine_dir(root: str) -> str:
    return os.path.join(layout_dir(root), QUARANTINE_DIR)


def owners_dir(root: str) -> str:
    return os.path.join(layout_dir(root), OWNERS_DIR)


def fingerprint_dirs(root: str) -> list[str]:
    """Names of the fingerprint directories (16 hex digits); other entries are not blocks."""
    return fp_names(list_dir(layout_dir(root)))


def is_key_stem(name: str) -> bool:
    """Whether ``name`` is lower-case hex digits only (a key's name, or its shard's)."""
    return set(name) <= _HEX


def mkdir_like_parent(d: str) -> None:
    """Create ``d`` with its parent's mode so a group-shared pool stays group-shared."""
    try:
        mode = os.stat(os.path.dirname(d)).st_mode & 0o7777
        os.mkdir(d, mode)
        os.chmod(d, mode)
    except FileExistsError:
        pass


def fp_names(names: list[str]) -> list[str]:
    return sorted(n for n in names if len(n) == _FP_DIR_LEN and set(n) <= _HEX)


def scan_pool(root: str) -> PoolScan:
    """lstat every entry below the fingerprint directories (no file is opened).

    A directory or entry that cannot be read is counted in ``unreadable`` and skipped, never
    raised: one key directory made without the share group's permissions must not keep stats,
    verify and gc (or an owner's evictor) from the rest of the pool.
    """
    out = PoolScan()
    base = layout_dir(root)
    for fp in fp_names(list_counted(base, out)):
        fp_dir = os.path.join(base, fp)
        for sub in list_counted(fp_dir, out):
            if len(sub) != 2 or not set(sub) <= _HEX:
                continue
            try:
                with os.scandir(os.path.join(fp_dir, sub)) as it:
                    for entry in it:
                        classify_entry(out, fp, sub, entry)
            except (FileNotFoundError, NotADirectoryError):
                continue  # removed meanwhile (another owner, an operator), or not a directory
            except OSError:  # unreadable, or a read error part way: what was listed is kept
                out.unreadable += 1
    return out


def list_counted(d: str, out: PoolScan) -> list[str]:
    """:func:`list_dir`, counting a directory that exists but cannot be listed in ``out``."""
    try:
        return os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError:
        out.unreadable += 1
        return []


def classify_entry(out: PoolScan, fp: str, sub: str, entry: os.DirEntry) -> None:
    name = entry.name
    if name.startswith(TMP_PREFIX):
        out.tmp.append(entry.path)
        return
    stem = name[:-len(BLOCK_SUFFIX)]
    if not name.endswith(BLOCK_SUFFIX) or len(stem) != _KEY_HEX_LEN or not set(stem) <= _HEX \
            or stem[:2] != sub:
        out.foreign += 1
        return
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError:  # a directory listable but not searchable (r without x), an I/O error
        out.unreadable += 1
        return
    found = BlockFile(fp, bytes.fromhex(stem), entry.path, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    if not stat.S_ISREG(st.st_mode):
        out.foreign += 1
        out.junk.append(found)
        return
    out.blocks.append(found)


class NotRegularFile(OSError):
    """A name that should be a regular file is something else (a FIFO, a device, a directory)."""


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o640) -> tuple[int, os.stat_result]:
    """A descriptor on ``path`` (read-only unless ``flags`` say otherwise) and its fstat, if it is
    a regular file; raises OSError (:class:`NotRegularFile` for anything else).  O_NONBLOCK:
    open(2) of a FIFO planted at the name (or swapped in after a scan) waits for the other end for
    ever without it, hanging stats, verify, gc, an evictor holding the pool's lock or a log's
    flusher; it changes nothing for regular files.  O_NOFOLLOW: a link could lead out of the pool."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class BadReference(FormatError):
    """A file with a reference file's size and magic that fails its other checks."""


@dataclass(frozen=True)
class RefFile:
    """An arena reference file (docs/format.md, "Arena"), parsed and checked against the
    fingerprint directory it was found in."""

    fingerprint: bytes
    slot_bytes: int
    slab: str  # every entry of a reference file names this slab
    entries: dict[bytes, SlotRef]

    def entry(self, key: bytes) -> SlotRef:
        ref = self.entries.get(key)
        if ref is None:
            raise FormatError("reference file has no entry for its key")
        return ref

    def slab_path(self, block: BlockFile) -> str:
        """The slab this reference names, for a reference found at ``block``."""
        return os.path.join(os.path.dirname(os.path.dirname(block.path)), SLABS_DIR, self.slab)

    def slot_header(self, slab_fd: int, slab_size: int, key: bytes) -> tuple[SlotRef, BlockHeader]:
        """``key``'s entry and the header of the slot it names in the open slab (``slab_size`` bytes),
        checked: a valid block header of this fingerprint, key and slot size, of the record the entry
        names (its ``created``).  Raises FormatError or OSError."""
        ref = self.entry(key)
        off = ref.slot * self.slot_bytes
        raw = os.pread(slab_fd, HEADER_SIZE, off) if off + self.slot_bytes <= slab_size else b""
        header = parse_header(raw, fingerprint=self.fingerprint, key=key, file_size=self.slot_bytes)
        if header.created_ns != ref.created_ns:
            raise FormatError("slot holds another record than its reference names")
        return ref, header


def parse_ref_file(block: BlockFile, raw: bytes) -> RefFile:
    """Parse the reference file ``raw`` found at ``block``; its fingerprint must be its directory's.
    Raises :class:`BadReference`."""
    fingerprint, slot_bytes = raw[16:48], int.from_bytes(raw[48:56], "little")
    try:
        if fingerprint.hex()[:len(block.fp)] != block.fp:
            raise FormatError("fingerprint differs from its directory")
        entries = parse_refs(raw, fingerprint=fingerprint, slot_bytes=slot_bytes)
    except FormatError as exc:
        raise BadReference(str(exc)) from None
    return RefFile(fingerprint, slot_bytes, next(iter(entries.values())).slab, entries)


def read_published(block: BlockFile) -> tuple[os.stat_result, BlockHeader | RefFile]:
    """What the name of a scanned block holds now, in one open: the header of a block file, checked
    against its name and size, or an arena reference file (one whose size could be a reference's and
    which starts with its magic), checked by :func:`parse_ref_file`.  Raises OSError, FormatError
    (:class:`BadReference` for a damaged reference)."""
    fd, st = open_regular(block.path)
    try:
        ref_size = is_ref_size(st.st_size)
        raw = os.pread(fd, st.st_size if ref_size else HEADER_SIZE, 0)
    finally:
        os.close(fd)
    if ref_size and raw[:len(REF_MAGIC)] == REF_MAGIC:
        return st, parse_ref_file(block, raw)
    return st, parse_header(raw[:HEADER_SIZE], key=block.key, file_size=st.st_size)


def read_geometry(root: str, fp: str) -> dict | None:
    """The fingerprint.json an owner wrote for this fingerprint, or None if absent, not a regular
    file, unreadable or garbage."""
    try:
        fd, _ = open_regular(os.path.join(layout_dir(root), fp, "fingerprint.json"))
        with os.fdopen(fd, "rb") as fh:
            data = json.loads(fh.read(1 << 16))
    except (OSError, ValueError):  # absent, unreadable or not a regular file; not JSON
        return None
    return data if isinstance(data, dict) else None


def quarantine_destination(root: str, key_hex: str, reason: str, now_ns: int | None = None) -> str:
    """Where a bad file goes: the naming BlockPool.quarantine uses (pool.quarantine_name)."""
    return os.path.join(quarantine_dir(root), quarantine_name(key_hex, reason, now_ns))


def quarantined_at_ns(path: str) -> int:
    """When a quarantine entry was made, from its name, else its ctime (rename updates ctime).

    The name's time counts only as quarantine_name writes it: ASCII digits (``str.isdigit`` also
    accepts '²', which ``int`` rejects) and at most 19 of them (``time.time_ns()`` until 2286), so
    a stray file in the directory can neither abort gc nor, named with a time centuries ahead,
    stay for ever.
    """
    parts = os.path.basename(path).split(".")
    if len(parts) >= 2 and 0 < len(parts[1]) <= _NS_DIGITS and parts[1].isascii() and parts[1].isdigit():
        return int(parts[1])
    return os.stat(path, follow_symlinks=False).st_ctime_ns


def list_dir(d: str) -> list[str]:
    """Names in ``d``; none when it is gone or not a directory (another owner may remove it)."""
    try:
        return os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []

"""Walking a pool root without a BlockPool: what eviction and the operator commands see.

A BlockPool is one fingerprint's view and creates directories; maintenance must see every
fingerprint, create nothing, and survive files that appear, vanish or are garbage while it
walks, because other owners keep serving from the same directory.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field

from .pool import BLOCK_SUFFIX, LAYOUT_DIR, OWNERS_DIR, QUARANTINE_DIR, TMP_PREFIX, quarantine_name
from .pool_format import HEADER_SIZE, BlockHeader, FormatError, parse_header

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


@dataclass
class PoolScan:
    blocks: list[BlockFile] = field(default_factory=list)
    tmp: list[str] = field(default_factory=list)  # temporary files of writers, live or dead
    foreign: int = 0  # entries that are neither blocks nor temporary files
    # directories that could not be listed and entries that could not be lstat'ed (permissions: an
    # owner without the share group's modes made them; I/O errors): what is in them was not seen
    unreadable: int = 0

    @property
    def block_bytes(self) -> int:
        return sum(b.size for b in self.blocks)


def layout_dir(root: str) -> str:
    return os.path.join(os.path.abspath(root), LAYOUT_DIR)


def quarantine_dir(root: str) -> str:
    return os.path.join(layout_dir(root), QUARANTINE_DIR)


def owners_dir(root: str) -> str:
    return os.path.join(layout_dir(root), OWNERS_DIR)


def fingerprint_dirs(root: str) -> list[str]:
    """Names of the fingerprint directories (16 hex digits); other entries are not blocks."""
    return _fp_names(list_dir(layout_dir(root)))


def _fp_names(names: list[str]) -> list[str]:
    return sorted(n for n in names if len(n) == _FP_DIR_LEN and set(n) <= _HEX)


def scan_pool(root: str) -> PoolScan:
    """lstat every entry below the fingerprint directories (no file is opened).

    A directory or entry that cannot be read is counted in ``unreadable`` and skipped, never
    raised: one key directory made without the share group's permissions must not keep stats,
    verify and gc (or an owner's evictor) from the rest of the pool.
    """
    out = PoolScan()
    base = layout_dir(root)
    for fp in _fp_names(_list_counted(base, out)):
        fp_dir = os.path.join(base, fp)
        for sub in _list_counted(fp_dir, out):
            if len(sub) != 2 or not set(sub) <= _HEX:
                continue
            try:
                with os.scandir(os.path.join(fp_dir, sub)) as it:
                    for entry in it:
                        _classify(out, fp, sub, entry)
            except (FileNotFoundError, NotADirectoryError):
                continue  # removed meanwhile (another owner, an operator), or not a directory
            except OSError:  # unreadable, or a read error part way: what was listed is kept
                out.unreadable += 1
    return out


def _list_counted(d: str, out: PoolScan) -> list[str]:
    """:func:`list_dir`, counting a directory that exists but cannot be listed in ``out``."""
    try:
        return os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError:
        out.unreadable += 1
        return []


def _classify(out: PoolScan, fp: str, sub: str, entry: os.DirEntry) -> None:
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
    if not stat.S_ISREG(st.st_mode):
        out.foreign += 1
        return
    out.blocks.append(BlockFile(fp, bytes.fromhex(stem), entry.path, st.st_size, st.st_ino, st.st_mtime_ns,
                                st.st_ctime_ns))


def open_regular(path: str) -> int:
    """A read-only descriptor on ``path`` if it is a regular file; raises OSError, or FormatError
    for anything else.  O_NONBLOCK: open(2) of a FIFO planted at the name (or swapped in after a
    scan) waits for a writer for ever without it, hanging stats, verify or gc; it changes nothing
    for regular files.  O_NOFOLLOW: a link could lead out of the pool."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FormatError("not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_header(block: BlockFile) -> BlockHeader:
    """Parse the header of a scanned block against its name; raises OSError or FormatError."""
    fd = open_regular(block.path)
    try:
        raw = os.pread(fd, HEADER_SIZE, 0)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return parse_header(raw, key=block.key, file_size=size)


def read_geometry(root: str, fp: str) -> dict | None:
    """The fingerprint.json an owner wrote for this fingerprint, or None if absent, not a regular
    file, unreadable or garbage."""
    try:
        fd = open_regular(os.path.join(layout_dir(root), fp, "fingerprint.json"))
        with os.fdopen(fd, "rb") as fh:
            data = json.loads(fh.read(1 << 16))
    except (OSError, ValueError):  # FormatError is a ValueError
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

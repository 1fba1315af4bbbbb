"""Byte layout of one pool file, version 1 (specified in docs/format.md; keep the two in step).

A file is a 4096-byte header followed by the payload, zero-padded to a multiple of 4096 bytes,
so the payload starts page-aligned and O_DIRECT or GDS can read it straight into a KV block.
Files come from a shared directory and are untrusted: :func:`parse_header` checks every field
against fixed bounds and the expected identity and raises :class:`FormatError` naming the field.
"""

from __future__ import annotations

import functools
import itertools
import operator
import struct
import zlib
from dataclasses import dataclass
from typing import NamedTuple

MAGIC = b"GDSKVBLK"
FORMAT_VERSION = 1
HEADER_SIZE = 4096
PAGE = 4096
MAX_PAYLOAD = 1 << 32  # 4 GiB: far above any KV block, small enough to reject garbage lengths
_FIXED = struct.Struct("<8sII32s32sQQIIQII32s")  # fields up to and excluding header_crc
_CRC = struct.Struct("<I")
CRC_OFFSET = _FIXED.size  # 152
ZERO_KEY = b"\0" * 32
HEADER_FIELDS_SIZE = CRC_OFFSET + _CRC.size  # 156: every non-zero byte a valid header can have
_ZERO_TAIL = bytes(HEADER_SIZE - HEADER_FIELDS_SIZE)


class FormatError(ValueError):
    """A pool file is not a valid block of the expected identity."""


@dataclass(frozen=True)
class BlockHeader:
    fingerprint: bytes
    key: bytes
    payload_len: int
    checksum: int
    checksum_algo: int
    tokens_per_block: int
    created_ns: int
    parent_key: bytes = ZERO_KEY

    def pack(self) -> bytes:
        return self.pack_fields() + _ZERO_TAIL

    def pack_fields(self) -> bytes:
        """The header up to and including its CRC; the rest of the 4096 bytes is zero."""
        fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, self.fingerprint, self.key,
                            self.payload_len, self.checksum, self.checksum_algo, self.tokens_per_block,
                            self.created_ns, 0, 0, self.parent_key)
        return fixed + _CRC.pack(zlib.crc32(fixed))


def file_size_for(payload_len: int) -> int:
    return HEADER_SIZE + align_up(payload_len, PAGE)


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def parse_header(raw: bytes, *, fingerprint: bytes | None = None, key: bytes | None = None,
                 payload_len: int | None = None, file_size: int | None = None) -> BlockHeader:
    """Parse and check a header; the keyword arguments are what the caller expects."""
    if len(raw) != HEADER_SIZE:
        raise FormatError(f"header is {len(raw)} bytes, expected {HEADER_SIZE}")
    (magic, version, header_size, fp, k, plen, csum, algo, tpb, created, flags, reserved,
     parent) = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise FormatError(f"unsupported format version {version}")
    if header_size != HEADER_SIZE:
        raise FormatError(f"bad header_size {header_size}")
    (crc,) = _CRC.unpack_from(raw, CRC_OFFSET)
    if crc != zlib.crc32(raw[:CRC_OFFSET]):
        raise FormatError("header checksum mismatch")
    if raw[HEADER_FIELDS_SIZE:] != _ZERO_TAIL:  # a memcmp; any() would walk 3940 ints
        raise FormatError("non-zero bytes in the reserved header tail")
    if flags != 0 or reserved != 0:
        raise FormatError(f"unknown flags {flags:#x} / reserved {reserved:#x}")
    if algo != 1:
        raise FormatError(f"unknown checksum algorithm {algo}")
    if not 0 < plen <= MAX_PAYLOAD:
        raise FormatError(f"payload_len {plen} out of bounds")
    if not 0 < tpb <= 1 << 20:
        raise FormatError(f"tokens_per_block {tpb} out of bounds")
    if fingerprint is not None and fp != fingerprint:
        raise FormatError("fingerprint differs from this pool's")
    if key is not None and k != key:
        raise FormatError("key in header differs from the file name")
    if payload_len is not None and plen != payload_len:
        raise FormatError(f"payload_len {plen} differs from the block size {payload_len}")
    if file_size is not None and file_size != file_size_for(plen):
        raise FormatError(f"file is {file_size} bytes, expected {file_size_for(plen)}")
    return BlockHeader(fp, k, plen, csum, algo, tpb, created, parent)


# -- slot references (arena pools, docs/format.md "Arena") ------------------------------------------
REF_MAGIC = b"GDSKVREF"
REF_VERSION = 1
REF_HEADER_SIZE = 128
REF_ENTRY_SIZE = 48
MAX_REF_ENTRIES = 1024
SLAB_NAME_LEN = 64
_REF_FIXED = struct.Struct("<8sII32sQ64sI")  # up to and excluding the CRC at offset 124
_REF_ENTRY = struct.Struct("<32sIIQ")
_ENTRY_KEY, _ENTRY_SLOT, _ENTRY_CREATED = (operator.attrgetter(f) for f in ("key", "slot", "created_ns"))
_ROW_KEY, _ROW_SLOT, _ROW_RESERVED, _ROW_CREATED = (operator.itemgetter(i) for i in range(4))  # _REF_ENTRY's
_SLAB_NAME_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class SlotRef(NamedTuple):
    """Where one key's block record lives: slot ``slot`` of slab file ``slab``, written at ``created_ns``.

    A named tuple, not a frozen dataclass: one is made per block saved or resolved, and a frozen
    dataclass's ``__init__`` costs several times a tuple's on a transfer thread."""

    key: bytes
    slab: str
    slot: int
    created_ns: int


# a SlotRef from a (key, slab, slot, created_ns) tuple, made in C (the named tuple's __new__ is Python)
_new_slot_ref = functools.partial(tuple.__new__, SlotRef)


def is_ref_size(size: int) -> bool:
    n, rem = divmod(size - REF_HEADER_SIZE, REF_ENTRY_SIZE)
    return rem == 0 and 1 <= n <= MAX_REF_ENTRIES


def check_slab_name(name: str) -> str:
    raw = name.encode("ascii", "replace")
    if not 0 < len(raw) <= SLAB_NAME_LEN or not set(raw) <= _SLAB_NAME_CHARS or name.startswith("."):
        raise FormatError(f"bad slab name {name!r}")
    return name


def pack_refs(fingerprint: bytes, slot_bytes: int, slab: str, entries: list[SlotRef]) -> bytes:
    """One reference file for a batch of blocks saved into one slab; hard-linked under every key."""
    if not 1 <= len(entries) <= MAX_REF_ENTRIES:
        raise ValueError(f"a reference file holds 1..{MAX_REF_ENTRIES} entries, not {len(entries)}")
    body = b"".join(map(_REF_ENTRY.pack, map(_ENTRY_KEY, entries), map(_ENTRY_SLOT, entries), itertools.repeat(0),
                        map(_ENTRY_CREATED, entries)))  # C iterators: this runs per saved block
    fixed = _REF_FIXED.pack(REF_MAGIC, REF_VERSION, len(entries), fingerprint, slot_bytes,
                            check_slab_name(slab).encode("ascii"), 0)
    return fixed + _CRC.pack(zlib.crc32(body, zlib.crc32(fixed))) + body


def parse_ref(raw: bytes, *, key: bytes, fingerprint: bytes, slot_bytes: int) -> SlotRef:
    """The entry of ``key`` in a reference file, after checking every field of the file."""
    ref = parse_refs(raw, fingerprint=fingerprint, slot_bytes=slot_bytes).get(key)
    if ref is None:
        raise FormatError("reference file has no entry for its key")
    return ref


def ref_slab_name(raw: bytes) -> str | None:
    """The slab name in a reference file's fixed part, with only the magic checked; None when
    ``raw`` is no reference.  For ``gds-kv gc``, where a damaged reference must still keep the
    slab it names."""
    if len(raw) < _REF_FIXED.size or raw[:len(REF_MAGIC)] != REF_MAGIC:
        return None
    slab_raw = _REF_FIXED.unpack_from(raw)[5]
    return slab_raw.rstrip(b"\0").decode("ascii", "replace")


def parse_refs(raw: bytes, *, fingerprint: bytes, slot_bytes: int) -> dict[bytes, SlotRef]:
    """Every entry of a reference file by key (a key's first entry), after checking every field of the file."""
    if len(raw) < REF_HEADER_SIZE or not is_ref_size(len(raw)):
        raise FormatError(f"reference file is {len(raw)} bytes, not a valid size")
    magic, version, count, fp, sbytes, slab_raw, reserved = _REF_FIXED.unpack_from(raw)
    if magic != REF_MAGIC:
        raise FormatError(f"bad reference magic {magic!r}")
    if version != REF_VERSION:
        raise FormatError(f"unsupported reference version {version}")
    if len(raw) != REF_HEADER_SIZE + count * REF_ENTRY_SIZE:
        raise FormatError(f"reference file holds {count} entries but is {len(raw)} bytes")
    (crc,) = _CRC.unpack_from(raw, _REF_FIXED.size)
    if crc != zlib.crc32(raw[REF_HEADER_SIZE:], zlib.crc32(raw[:_REF_FIXED.size])):
        raise FormatError("reference checksum mismatch")
    if reserved != 0:
        raise FormatError(f"reserved reference field is {reserved:#x}")
    if fp != fingerprint:
        raise FormatError("reference fingerprint differs from this pool's")
    if sbytes != slot_bytes:
        raise FormatError(f"reference slot size {sbytes} differs from this pool's {slot_bytes}")
    slab = slab_raw.rstrip(b"\0")
    if b"\0" in slab:
        raise FormatError("slab name has embedded NUL bytes")
    name = check_slab_name(slab.decode("ascii", "replace"))
    # C iterators, no Python loop: a load through reference files (a block another owner saved)
    # parses one per save batch on a transfer thread, with the GIL held
    rows = list(_REF_ENTRY.iter_unpack(memoryview(raw)[REF_HEADER_SIZE:]))
    if any(map(_ROW_RESERVED, rows)):
        raise FormatError("reserved reference entry field is not zero")
    keys = list(map(_ROW_KEY, rows))
    refs = list(map(_new_slot_ref, zip(keys, itertools.repeat(name), map(_ROW_SLOT, rows), map(_ROW_CREATED, rows))))
    by_key = dict(zip(keys, refs))
    if len(by_key) < len(refs):
        # A key listed twice (written by versions that saved a batch's repeated key twice): its name
        # was linked for the first entry, whose slot the writer kept; the other's it freed at once.
        by_key = {}
        for ref in refs:
            by_key.setdefault(ref.key, ref)
    return by_key

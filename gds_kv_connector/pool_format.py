"""Byte layout of one pool file, version 1 (specified in docs/format.md; keep the two in step).

A file is a 4096-byte header followed by the payload, zero-padded to a multiple of 4096 bytes,
so the payload starts page-aligned and O_DIRECT or GDS can read it straight into a KV block.
Files come from a shared directory and are untrusted: :func:`parse_header` checks every field
against fixed bounds and the expected identity and raises :class:`FormatError` naming the field.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"GDSKVBLK"
FORMAT_VERSION = 1
HEADER_SIZE = 4096
PAGE = 4096
MAX_PAYLOAD = 1 << 32  # 4 GiB: far above any KV block, small enough to reject garbage lengths
_FIXED = struct.Struct("<8sII32s32sQQIIQII32s")  # fields up to and excluding header_crc
_CRC = struct.Struct("<I")
CRC_OFFSET = _FIXED.size  # 152
ZERO_KEY = b"\0" * 32


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
        fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, self.fingerprint, self.key,
                            self.payload_len, self.checksum, self.checksum_algo, self.tokens_per_block,
                            self.created_ns, 0, 0, self.parent_key)
        crc = zlib.crc32(fixed)
        return fixed + _CRC.pack(crc) + b"\0" * (HEADER_SIZE - CRC_OFFSET - _CRC.size)


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
    if any(raw[CRC_OFFSET + _CRC.size:]):
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

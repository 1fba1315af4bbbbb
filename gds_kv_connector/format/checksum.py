"""Payload checksum shared by the GPU kernel (csrc/checksum.cu) and this CPU implementation.

Definition (version 1, ``CHECKSUM_ALGO``): pad the payload with zero bytes to a multiple of 8,
read it as little-endian uint64 words ``w[0..n)``, and with all arithmetic modulo 2**64::

    fmix(x)  = x ^= x >> 33; x *= 0xFF51AFD7ED558CCD; x ^= x >> 33; x *= 0xC4CEB9FE1A85EC53; x ^= x >> 33
    S        = sum over i of fmix(w[i] ^ ((i + 1) * 0x9E3779B97F4A7C15))
    checksum = fmix(S ^ (len_bytes * 0xC2B2AE3D27D4EB4F))

Every term depends on its word and its position only, so the GPU reduces them in any order and
gets the same bits as this sequential version; ``fmix`` is a bijection, so any change confined
to one word always changes the checksum, and a word moved to another position does too.
"""

from __future__ import annotations

import numpy as np

CHECKSUM_ALGO = 1
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
LEN_MIX = 0xC2B2AE3D27D4EB4F
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_MASK = (1 << 64) - 1
_CHUNK_WORDS = 1 << 17  # 1 MiB of words per numpy pass keeps temporaries in cache


def _fmix_array(x: np.ndarray) -> np.ndarray:
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


def fmix64(x: int) -> int:
    x &= _MASK
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK
    x ^= x >> 33
    return x


def checksum_bytes(data) -> int:
    """Checksum of a bytes-like object or a host array (any dtype, C-contiguous)."""
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    n_bytes = buf.size
    full = n_bytes // 8
    words = buf[:full * 8].view("<u8")
    total = 0
    with np.errstate(over="ignore"):
        for start in range(0, full, _CHUNK_WORDS):
            w = words[start:start + _CHUNK_WORDS]
            idx = np.arange(start + 1, start + 1 + w.size, dtype=np.uint64)
            idx *= GOLDEN
            idx ^= w
            total += int(_fmix_array(idx).sum(dtype=np.uint64))
    if n_bytes % 8:
        tail = bytes(buf[full * 8:]) + b"\0" * (8 - n_bytes % 8)
        total += fmix64(int.from_bytes(tail, "little") ^ (((full + 1) * int(GOLDEN)) & _MASK))
    return fmix64((total & _MASK) ^ ((n_bytes * LEN_MIX) & _MASK))

"""The per-block loops of the hot paths, in C where the extension (csrc/native.c) was built.

Keying a 128k-token prompt is 4096 SHA-256 calls and a 128k-int conversion on the executor
thread; saving or loading a batch of arena slots packs or checks one header per block on a
transfer thread.  In Python each of those costs about a microsecond per block while holding the
GIL, as much as a 256 KiB DMA takes.  The C versions run a whole batch per call with the GIL
released.  Where the extension is missing (no compiler or OpenSSL headers at install time) the
same loops run in Python, byte for byte alike; ``BUILT`` says which is in use and ``gds-kv
doctor`` reports it.  Addresses passed here are slot starts inside the arena's own mappings.

The extension also guards those mappings (:func:`guard_mapping`): a slab truncated by another
process, or a page a full tmpfs cannot give, must not kill the process with SIGBUS at the next
CPU access (csrc/native.c says how).  That has no Python twin, so it stays where the tests swap
the loops for their fallback; ``GUARDS`` says whether this process has it.
"""

from __future__ import annotations

import ctypes
from array import array
from typing import Sequence

from gds_kv_connector.format.records import HEADER_FIELDS_SIZE, HEADER_SIZE, BlockHeader, FormatError, parse_header

try:
    import gds_kv_connector._native as _lib  # type: ignore[import-not-found]
except ImportError:
    _lib = None

BUILT = _lib is not None
# the guard's module: not swapped with _lib, since the guard is not a loop with a Python twin
_guard = _lib
GUARDS = _guard is not None


def chain_keys(prev: bytes, tokens: list[int] | tuple[int, ...], start: int, tokens_per_block: int,
               num_blocks: int) -> list[bytes] | None:
    """Keys of ``num_blocks`` blocks whose tokens begin at ``tokens[start]`` (keys.extend_chain's
    definition), or None where the extension is missing, so the caller takes its numpy path."""
    if _lib is None:
        return None
    return _lib.chain_keys(prev, tokens, start, tokens_per_block, num_blocks)


def link_keys(src: str, dirs: tuple[str, ...], keys: list[bytes], suffix: str) -> list[int] | None:
    """link(2) ``src`` under ``f"{dirs[key[0]]}/{key.hex()}{suffix}"`` for each key (symbolic links
    never followed), the names formatted in C: errno per key, 0 where linked; None where the
    extension is missing (FileOps.link_keys then loops)."""
    if _lib is None:
        return None
    return _lib.link_keys(src, dirs, keys, suffix)


Trust = tuple[tuple[int, ...], tuple[int, ...]]  # (uids, gids) whose files a pool believes


def present_run(dirs: tuple[str, ...], keys: list[bytes], start: int, suffix: str,
                trust: Trust | None = None) -> list[int] | None:
    """lstat(2) of ``f"{dirs[key[0]]}/{key.hex()}{suffix}"`` for ``keys[start:]`` up to the first
    that is missing, not a regular file or (with ``trust``) made by no trusted writer: the sizes
    before it; None where the extension is missing (FileOps.present_run then loops)."""
    if _lib is None:
        return None
    return _lib.present_run(dirs, keys, start, suffix, trust)


def chain_present(prev: bytes, tokens: list[int] | tuple[int, ...], start: int, tokens_per_block: int,
                  num_blocks: int, dirs: tuple[str, ...], suffix: str,
                  trust: Trust | None = None) -> tuple[list[bytes], list[int]] | None:
    """:func:`chain_keys` and :func:`present_run` from the first key, in one C call whose stats
    follow the hashing on other threads: (keys, sizes); None where the extension is missing."""
    if _lib is None:
        return None
    return _lib.chain_present(prev, tokens, start, tokens_per_block, num_blocks, dirs, suffix, trust)


def clear_headers(addrs: Sequence[int]) -> None:
    """Zero each slot's magic, so no reader accepts it while its payload is rewritten."""
    if _lib is not None:
        _lib.clear_headers(array("Q", addrs))
        return
    for a in addrs:
        ctypes.memset(a, 0, 8)


def write_headers(addrs: Sequence[int], fingerprint: bytes, keys: list[bytes], parents: list[bytes],
                  sums: list[int], payload_len: int, checksum_algo: int, tokens_per_block: int,
                  created_ns: int) -> None:
    """Write each slot's header fields (BlockHeader.pack_fields), the magic last; the zero tail is
    left as it is."""
    if _lib is not None:
        _lib.write_headers(array("Q", addrs), fingerprint, b"".join(keys), b"".join(parents), array("Q", sums),
                           payload_len, checksum_algo, tokens_per_block, created_ns)
        return
    for a, k, p, s in zip(addrs, keys, parents, sums):
        fields = BlockHeader(fingerprint, k, payload_len, s, checksum_algo, tokens_per_block, created_ns, p).pack_fields()
        ctypes.memmove(a + 8, fields[8:], HEADER_FIELDS_SIZE - 8)  # the magic last, as the C loop says why
        ctypes.memmove(a, fields, 8)


def check_headers(addrs: Sequence[int], fingerprint: bytes, keys: list[bytes], created_ns: list[int],
                  payload_len: int) -> tuple[bytes, list[int], int, str | None]:
    """Check slot headers in order, as parse_header does, plus that slot ``i`` holds ``keys[i]``
    written at ``created_ns[i]``; stop at the first that fails.

    Returns (header field bytes of the slots that passed, their payload checksums, index of the
    failing slot or -1, why it failed or None).
    """
    if _lib is not None:
        fields, sums, bad, why = _lib.check_headers(array("Q", addrs), fingerprint, b"".join(keys),
                                                    array("Q", created_ns), payload_len)
        return fields, list(memoryview(sums).cast("Q")), bad, why
    out: list[bytes] = []
    got: list[int] = []
    for i, (a, k, c) in enumerate(zip(addrs, keys, created_ns)):
        magic = ctypes.string_at(a, 8)  # first: write_headers writes it last (see the C loop)
        raw = magic + ctypes.string_at(a + 8, HEADER_SIZE - 8)
        try:
            h = parse_header(raw, fingerprint=fingerprint, payload_len=payload_len)
        except FormatError as exc:
            return b"".join(out), got, i, str(exc)
        if h.key != k:
            return b"".join(out), got, i, "slot holds another key's record than its reference names (reused)"
        if h.created_ns != c:
            return b"".join(out), got, i, "slot holds a newer record of this key than its reference (reused)"
        out.append(raw[:HEADER_FIELDS_SIZE])  # the bytes checked, not a second read
        got.append(h.checksum)
    return b"".join(out), got, -1, None


def first_changed(addrs: Sequence[int], fields: bytes) -> int:
    """Index of the first slot whose header fields are no longer ``fields[i]`` (reused while it was
    being copied), or -1."""
    if _lib is not None:
        return _lib.first_changed(array("Q", addrs), fields)
    for i, a in enumerate(addrs):
        was = fields[i * HEADER_FIELDS_SIZE:(i + 1) * HEADER_FIELDS_SIZE]
        if ctypes.string_at(a, 8) != was[:8] or ctypes.string_at(a + 8, HEADER_FIELDS_SIZE - 8) != was[8:]:
            return i
    return -1


def guard_mapping(addr: int, nbytes: int, writable: bool) -> None:
    """From now on a SIGBUS at a CPU access in ``[addr, addr + nbytes)`` (a slab mapping) is
    survived: the range is replaced by anonymous memory and :func:`mapping_lost` says so.  Nothing
    where the extension is missing (``GUARDS`` False); OSError when its table is full."""
    if _guard is not None:
        _guard.guard(addr, nbytes, writable)


def unguard_mapping(addr: int) -> None:
    """The guarded range starting at ``addr`` is about to be unmapped."""
    if _guard is not None:
        _guard.unguard(addr)


def mapping_lost(addr: int) -> bool:
    """Whether a fault replaced the guarded range starting at ``addr`` (its slab's pages were taken
    away): what is there now is not the slab's, and nothing written there reaches it."""
    return _guard is not None and _guard.guard_lost(addr)


def rearm_guard() -> None:
    """Install the SIGBUS handler again if another replaced it since a range was guarded
    (``faulthandler.enable()`` called later would otherwise see every slab fault first)."""
    if _guard is not None:
        _guard.arm_guard()

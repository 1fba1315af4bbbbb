"""Pools of tiny block files written directly, for maintenance tests that need thousands of blocks."""

from __future__ import annotations

import os

from gds_kv_connector.format.records import ZERO_KEY, BlockHeader
from gds_kv_connector.store.pool import BlockPool

PAYLOAD = 4096
FILE = 8192  # the header page and one payload page, the latter a hole


def make_pool(*roots) -> BlockPool:
    return BlockPool(tuple(str(r) for r in roots), b"\x22" * 32, PAYLOAD, 4, geometry_note="test")


def put(pool: BlockPool, k: bytes, t_ns: int, parent: bytes = ZERO_KEY) -> None:
    """A block file written directly (sparse payload), created and published at ``t_ns``."""
    path = pool.path_for(k)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, BlockHeader(pool.fingerprint, k, PAYLOAD, 0, 1, 4, t_ns, parent).pack())
        os.ftruncate(fd, FILE)
    finally:
        os.close(fd)
    os.utime(path, ns=(t_ns, t_ns))

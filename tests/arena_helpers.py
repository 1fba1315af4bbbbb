"""Blocks for the arena tests: keys, payloads and a verified load through a pool's pins."""

from __future__ import annotations

import hashlib
import time

import torch

from gds_kv_connector.block_io import load_blocks, pin_blocks
from gds_kv_connector.pool import BlockPool

PAYLOAD = 3 * 4096 + 512  # not page-aligned: slots still start on pages


def keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [hashlib.sha256(tag + bytes([i])).digest() for i in range(n)]


def data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, PAYLOAD), dtype=torch.uint8, generator=g)


def load(pool: BlockPool, engine, block_keys: list[bytes]) -> torch.Tensor:
    """The blocks of ``block_keys``, checksums verified, their pins released afterwards."""
    out = torch.zeros((len(block_keys), PAYLOAD), dtype=torch.uint8)
    pins = pin_blocks(pool, block_keys)
    try:
        load_blocks(pool, engine, pins, [out[i] for i in range(len(block_keys))], verify=True, retries=0,
                    deadline=time.monotonic() + 10)
    finally:
        pool.unpin_all(pins)
    return out

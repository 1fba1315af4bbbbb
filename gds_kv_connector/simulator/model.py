"""A deterministic stand-in for a transformer: KV bytes that prove where they came from.

The KV of token position ``p`` is derived from a hash of the *complete* prefix ``tokens[:p+1]``
and from the layer and K/V plane, so a block loaded under a wrong key, from a wrong offset,
torn, or stale differs from what this model expects, byte for byte.  The next token is a
function of the same hash, so any process can replay a conversation without the others.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

_SEED = b"gds-kv-reference-model/v1"


@dataclass(frozen=True)
class ModelShape:
    num_layers: int = 4
    kv_factor: int = 2
    block_elems: int = 2048  # elements per (layer, kv) plane of one block
    tokens_per_block: int = 16
    dtype: torch.dtype = torch.bfloat16
    vocab: int = 32000

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token inside one (layer, kv) plane of a block."""
        plane = self.block_elems * self.itemsize
        if plane % self.tokens_per_block or (plane // self.tokens_per_block) % 32:
            raise ValueError("block_elems * itemsize must split into tokens_per_block slots of 32-byte multiples")
        return plane // self.tokens_per_block

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.kv_factor * self.block_elems * self.itemsize


class PrefixHashes:
    """Incremental per-token prefix hashes of one sequence."""

    def __init__(self) -> None:
        self.hashes: list[bytes] = []

    def extend_to(self, tokens: list[int], n: int) -> None:
        prev = self.hashes[-1] if self.hashes else _SEED
        for p in range(len(self.hashes), n):
            prev = hashlib.sha256(prev + int(tokens[p]).to_bytes(8, "little", signed=True)).digest()
            self.hashes.append(prev)


class ReferenceModel:
    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape
        self._slot = shape.slot_bytes
        planes = shape.num_layers * shape.kv_factor
        self._plane_tag = np.arange(1, planes + 1, dtype=np.uint8).reshape(planes, 1)

    def token_kv(self, prefix_hash: bytes) -> np.ndarray:
        """[num_layers * kv_factor, slot_bytes] uint8 KV of one token."""
        base = np.frombuffer(prefix_hash, dtype=np.uint8)
        row = np.tile(base, self._slot // 32)
        return row[None, :] ^ self._plane_tag

    def next_token(self, prefix_hash: bytes) -> int:
        return int.from_bytes(prefix_hash[:4], "little") % self.shape.vocab

    def expected_block(self, hashes: list[bytes], block_index: int) -> np.ndarray:
        """[layers*kv, plane_bytes] uint8 content of a full block."""
        tpb = self.shape.tokens_per_block
        parts = [self.token_kv(hashes[block_index * tpb + s]) for s in range(tpb)]
        return np.concatenate(parts, axis=1)

    def write_tokens(self, pool_bytes: torch.Tensor, block_ids: list[int], hashes: list[bytes],
                     start: int, end: int, layer: int | None = None) -> None:
        """Write the KV of positions [start, end) into the pool (one layer, or all)."""
        s = self.shape
        tpb, slot = s.tokens_per_block, self._slot
        planes = s.num_layers * s.kv_factor
        view = pool_bytes.view(pool_bytes.shape[0], planes, -1)
        rows = slice(None) if layer is None else slice(layer * s.kv_factor, (layer + 1) * s.kv_factor)
        p = start
        while p < end:
            b = p // tpb
            stop = min(end, (b + 1) * tpb)
            chunk = np.concatenate([self.token_kv(hashes[q])[rows] for q in range(p, stop)], axis=1)
            lo = (p % tpb) * slot
            view[block_ids[b], rows, lo:lo + chunk.shape[1]] = torch.from_numpy(chunk).to(view.device,
                                                                                          non_blocking=False)
            p = stop

    def block_matches(self, pool_bytes: torch.Tensor, block_id: int, hashes: list[bytes], block_index: int) -> bool:
        s = self.shape
        expected = torch.from_numpy(self.expected_block(hashes, block_index))
        got = pool_bytes[block_id].view(s.num_layers * s.kv_factor, -1)
        return bool(torch.equal(got.cpu(), expected))

"""Content keys: a SHA-256 chain over the complete token prefix of every full block.

Two blocks share a key only if everything that decides their bytes is equal: the pool
fingerprint (model, KV dtype and geometry, format version, TP degree), the request's
``cache_salt``, its LoRA adapter and multimodal inputs (:func:`inputs_seed`), and every token from
position 0 to the end of the block.  Chaining makes key
``i`` cover the whole prefix at the cost of hashing one block of tokens.  The ADP rank never
enters a key: owners of one model share blocks.  The TP shard is not in the key either; it
selects the shard's directory (see :func:`shard_fingerprint`), so one key travels in the
metadata for every rank.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from dataclasses import dataclass
from itertools import islice
from typing import Sequence, Union

import numpy as np

from gds_kv_connector.format import native
from gds_kv_connector.format.records import FORMAT_VERSION

KEY_BYTES = 32
Buffer = Union[bytes, bytearray, memoryview, np.ndarray]
_DOMAIN_FP = b"gds-kv-connector/fingerprint/v1\0"
_DOMAIN_SEED = b"gds-kv-connector/chain-seed/v1\0"
_DOMAIN_INPUTS = b"gds-kv-connector/request-inputs/v1\0"


@dataclass(frozen=True)
class PoolGeometry:
    """What makes two pools' block bytes interchangeable."""

    model_id: str
    kv_dtype: str
    num_layers: int
    kv_factor: int
    block_bytes: int
    tokens_per_block: int
    tp_size: int = 1

    def describe(self) -> str:
        return (f"model={self.model_id} dtype={self.kv_dtype} layers={self.num_layers} kv={self.kv_factor} "
                f"block_bytes={self.block_bytes} tokens_per_block={self.tokens_per_block} tp={self.tp_size} "
                f"format=v{FORMAT_VERSION}")


def base_fingerprint(geom: PoolGeometry) -> bytes:
    """Fingerprint of the unsharded identity; seeds every key chain."""
    text = geom.describe().encode()
    return hashlib.sha256(_DOMAIN_FP + struct.pack("<I", len(text)) + text).digest()


def shard_fingerprint(geom: PoolGeometry, tp_rank: int) -> bytes:
    """Fingerprint written in headers and naming the directory of one TP shard's files.

    With ``tp_size == 1`` (including every attention-DP owner, which holds unsharded KV) it is
    the base fingerprint, so all owners of a model read and write the same files.
    """
    base = base_fingerprint(geom)
    if geom.tp_size == 1:
        return base
    if not 0 <= tp_rank < geom.tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside tp_size {geom.tp_size}")
    return hashlib.sha256(_DOMAIN_FP + base + struct.pack("<I", tp_rank)).digest()


def chain_seed(fingerprint: bytes, cache_salt: str | int | None) -> bytes:
    """Seed of one request's chain; ``None`` and ``""`` are distinct salts from any other, and an
    integer (a request's ``cache_salt_id``) from every string, ``"7"`` or ``"id:7"`` included."""
    if cache_salt is None:
        salt = b"\xff"
    elif isinstance(cache_salt, int):
        salt = b"\x02" + str(int(cache_salt)).encode()
    else:  # surrogatepass: any str the runtime hands over is a salt, a lone surrogate too
        salt = b"\x01" + cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.sha256(_DOMAIN_SEED + fingerprint + struct.pack("<I", len(salt)) + salt).digest()


def inputs_seed(salt_seed: bytes, lora_task_id: int | None, mm_hashes: Sequence[int]) -> bytes:
    """The chain seed of a request whose KV depends on more than its tokens and salt: a LoRA
    adapter's (its task id: adapters of attention projections change K and V) or multimodal inputs'
    (TensorRT-LLM's content hashes of them: other images behind the same placeholder tokens give
    other KV).  ``salt_seed`` is :func:`chain_seed`'s; a request with neither keeps it unchanged."""
    lora = b"\x00" if lora_task_id is None else b"\x01" + struct.pack("<Q", lora_task_id & 0xFFFFFFFFFFFFFFFF)
    mm = struct.pack(f"<I{len(mm_hashes)}Q", len(mm_hashes), *(h & 0xFFFFFFFFFFFFFFFF for h in mm_hashes))
    return hashlib.sha256(_DOMAIN_INPUTS + salt_seed + lora + mm).digest()


def token_array(tokens: Sequence[int], start: int = 0, stop: int | None = None) -> np.ndarray:
    """Tokens ``[start, stop)`` as a C-contiguous little-endian int64 array (the hashed bytes).

    A list (what the runtime hands over) goes through ``np.fromiter`` with a known count, which
    skips ``np.asarray``'s type-discovery pass and, with ``start`` 0, any slice copy: this is on
    the executor thread for every prompt, 128k tokens at a time.  Other sequences (arrays,
    tensors) keep ``np.asarray``'s vectorised path.
    """
    if stop is None:
        stop = len(tokens)
    if isinstance(tokens, (list, tuple)):
        it = tokens if start == 0 else islice(tokens, start, stop)
        # operator.index: a float or a string is refused, as the C conversion refuses it, not truncated
        return np.fromiter(map(operator.index, it), dtype="<i8", count=max(stop - start, 0))
    arr = np.asarray(tokens[start:stop])
    if arr.dtype.kind not in "iu" or (arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 1 << 63):
        raise TypeError(f"token ids must be integers within int64, got an array of {arr.dtype}")
    return np.ascontiguousarray(arr, dtype="<i8")


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int64, the byte form hashed into keys."""
    return token_array(tokens).tobytes()


def extend_chain(prev: bytes, token_bytes: Buffer, tokens_per_block: int, first_block: int,
                 num_blocks: int) -> list[bytes]:
    """Keys of blocks ``first_block .. first_block+num_blocks-1``.

    ``prev`` is the key of block ``first_block-1`` (or the chain seed when ``first_block`` is 0),
    and ``token_bytes`` holds at least the tokens of those blocks as :func:`tokens_to_bytes`
    (any C-contiguous buffer, e.g. a :func:`token_array`).  Blocks are hashed through a
    memoryview, so no chunk is copied before it is hashed.
    """
    width = tokens_per_block * 8
    buf = memoryview(token_bytes)
    if buf.format != "B":
        buf = buf.cast("B")
    start, end = first_block * width, (first_block + num_blocks) * width
    if len(buf) < end:
        b = max(first_block, len(buf) // width)
        have = max(len(buf) - b * width, 0) // 8
        raise ValueError(f"block {b} is not full: {have} of {tokens_per_block} tokens")
    sha = hashlib.sha256
    keys: list[bytes] = []
    append = keys.append
    for off in range(start, end, width):
        prev = sha(prev + buf[off:off + width]).digest()
        append(prev)
    return keys


def chain_from_tokens(prev: bytes, tokens: Sequence[int], start: int, tokens_per_block: int,
                      num_blocks: int) -> list[bytes]:
    """Keys of the ``num_blocks`` blocks whose tokens begin at ``tokens[start]``, ``prev`` being
    the key before them: :func:`extend_chain` over :func:`token_array`, in one C loop where the
    extension is built and ``tokens`` is a list (what the runtime hands over)."""
    if isinstance(tokens, (list, tuple)):
        keys = native.chain_keys(prev, tokens, start, tokens_per_block, num_blocks)
        if keys is not None:
            return keys
    stop = start + num_blocks * tokens_per_block
    return extend_chain(prev, token_array(tokens, start, stop), tokens_per_block, 0, num_blocks)


def block_keys(fingerprint: bytes, cache_salt: str | int | None, tokens: Sequence[int],
               tokens_per_block: int) -> list[bytes]:
    """Keys of every full block of ``tokens``."""
    return chain_from_tokens(chain_seed(fingerprint, cache_salt), tokens, 0, tokens_per_block,
                             len(tokens) // tokens_per_block)

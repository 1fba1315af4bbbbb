"""Keys name files on disk: the fast paths must give the bytes of the plain definition."""

import hashlib
import random

import numpy as np
import pytest

from gds_kv_connector.format.keys import block_keys, chain_seed, extend_chain, token_array, tokens_to_bytes

FP = bytes(range(32))


def plain_keys(salt, tokens, tpb):
    """The definition: SHA-256(previous key + the block's tokens as little-endian int64)."""
    data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)
    prev, keys = chain_seed(FP, salt), []
    for b in range(len(tokens) // tpb):
        prev = hashlib.sha256(prev + data[b * tpb * 8:(b + 1) * tpb * 8]).digest()
        keys.append(prev)
    return keys


@pytest.mark.parametrize("seed", range(6))
def test_block_keys_match_the_definition_for_every_sequence_type(seed):
    rng = random.Random(seed)
    toks = [rng.randrange(-2**63, 2**63) if rng.random() < 0.1 else rng.randrange(100_000)
            for _ in range(rng.randrange(0, 400))]
    tpb = rng.choice([1, 3, 16, 32])
    want = plain_keys("s", toks, tpb)
    for seq in (toks, tuple(toks), np.array(toks, dtype=np.int64)):
        assert block_keys(FP, "s", seq, tpb) == want
    assert tokens_to_bytes(toks) == np.asarray(toks, dtype="<i8").tobytes()


def test_token_array_ranges_and_chain_resumption():
    toks = list(range(1000, 1000 + 16 * 7))
    assert token_array(toks, 16, 48).tobytes() == tokens_to_bytes(toks[16:48])
    assert token_array(np.array(toks), 16, 48).tobytes() == tokens_to_bytes(toks[16:48])
    full = plain_keys(None, toks, 16)
    head = extend_chain(chain_seed(FP, None), token_array(toks, 0, 32), 16, 0, 2)
    tail = extend_chain(head[-1], token_array(toks, 32, 16 * 7), 16, 0, 5)  # a buffer starting at block 2
    assert head + tail == full
    assert extend_chain(head[-1], tokens_to_bytes(toks), 16, 2, 5) == full[2:]


def test_a_short_buffer_names_the_first_partial_block():
    tb = tokens_to_bytes(list(range(40)))
    with pytest.raises(ValueError, match="block 2 is not full: 8 of 16 tokens"):
        extend_chain(chain_seed(FP, None), tb, 16, 1, 2)
    with pytest.raises(ValueError, match="block 5 is not full: 0 of 16 tokens"):
        extend_chain(chain_seed(FP, None), tb, 16, 5, 1)

from gds_kv_connector.format.keys import (PoolGeometry, base_fingerprint, block_keys, chain_seed, extend_chain,
                                   shard_fingerprint, tokens_to_bytes)

GEOM = PoolGeometry("m", "bfloat16", 32, 2, 1 << 20, 32)
FP = base_fingerprint(GEOM)


def test_same_prefix_same_keys_and_stable_bytes():
    toks = list(range(100))
    a, b = block_keys(FP, None, toks, 32), block_keys(FP, None, list(toks), 32)
    assert a == b and len(a) == 3 and all(len(k) == 32 for k in a)
    assert a[0] == block_keys(FP, None, toks[:32], 32)[0]  # block 0's key ignores later tokens


def test_prefix_chaining_separates_equal_blocks_after_different_prefixes():
    x, y = list(range(64)), [7] * 32 + list(range(32, 64))
    kx, ky = block_keys(FP, None, x, 32), block_keys(FP, None, y, 32)
    assert kx[0] != ky[0] and kx[1] != ky[1]  # block 1 has equal tokens but a different prefix


def test_salt_separates_and_none_differs_from_empty():
    toks = list(range(64))
    keys = {tuple(block_keys(FP, s, toks, 32)) for s in (None, "", "a", "b")}
    assert len(keys) == 4


def test_a_salt_id_never_shares_a_seed_with_a_string_salt_and_any_string_is_a_salt():
    seeds = [chain_seed(FP, s) for s in (7, "7", "id:7", 8, None, "")]
    assert len(set(seeds)) == len(seeds)
    assert chain_seed(FP, "\ud800") != chain_seed(FP, "\ufffd")  # a lone surrogate is keyed, not an error


def test_fingerprint_covers_geometry_but_not_adp_rank():
    variants = [PoolGeometry("m2", "bfloat16", 32, 2, 1 << 20, 32), PoolGeometry("m", "float8", 32, 2, 1 << 20, 32),
                PoolGeometry("m", "bfloat16", 16, 2, 1 << 20, 32), PoolGeometry("m", "bfloat16", 32, 1, 1 << 20, 32),
                PoolGeometry("m", "bfloat16", 32, 2, 1 << 19, 32), PoolGeometry("m", "bfloat16", 32, 2, 1 << 20, 16),
                PoolGeometry("m", "bfloat16", 32, 2, 1 << 20, 32, tp_size=2)]
    fps = {base_fingerprint(g) for g in variants} | {FP}
    assert len(fps) == len(variants) + 1
    assert shard_fingerprint(GEOM, 0) == FP  # unsharded (incl. every ADP owner): one shared directory
    tp2 = variants[-1]
    assert shard_fingerprint(tp2, 0) != shard_fingerprint(tp2, 1)


def test_incremental_chain_equals_full():
    toks = list(range(32 * 5))
    full = block_keys(FP, "s", toks, 32)
    tb = tokens_to_bytes(toks)
    first = extend_chain(chain_seed(FP, "s"), tb, 32, 0, 2)
    rest = extend_chain(first[-1], tb, 32, 2, 3)
    assert first + rest == full


def test_tokens_that_are_not_int64_integers_are_refused_on_every_path():
    """A float token would otherwise be truncated (1.7 keyed as 1) and a uint64 id above int64 wrapped,
    giving keys that differ from the C conversion's, which refuses both."""
    import numpy as np
    import pytest

    from gds_kv_connector.format import native
    from gds_kv_connector.format.keys import chain_from_tokens, token_array

    seed = chain_seed(b"\0" * 32, None)
    for bad in ([1.7, 2], ["5", 2]):
        with pytest.raises(TypeError):
            token_array(bad)
        if native.BUILT:
            with pytest.raises(TypeError):
                chain_from_tokens(seed, bad, 0, 2, 1)
    for bad in (np.array([1.7, 2.0]), np.array([2**64 - 1, 0], dtype=np.uint64)):
        with pytest.raises(TypeError, match="integers within int64"):
            token_array(bad)
    assert token_array(np.array([5, 2**63 - 1], dtype=np.uint64)).tolist() == [5, 2**63 - 1]
    assert token_array([True, 3]).tolist() == [1, 3]  # a bool is an int, in C too


def test_a_token_list_that_shrinks_while_converted_is_an_index_error():
    """A token object whose ``__index__`` shrinks the list mid-conversion: the C loop holds the token
    for the call and reports the shrunk list as an IndexError (it was a SystemError, and the token
    could be freed while being read)."""
    import pytest

    from gds_kv_connector.format import native
    from gds_kv_connector.format.keys import chain_from_tokens

    if not native.BUILT:
        pytest.skip("the C extension is not built")
    tokens: list = list(range(64))

    class Shrinks:
        def __index__(self) -> int:
            del tokens[10:]
            return 5

    tokens[3] = Shrinks()
    with pytest.raises(IndexError):
        chain_from_tokens(chain_seed(b"\0" * 32, None), tokens, 0, 32, 2)

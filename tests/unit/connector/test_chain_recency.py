"""A finished request logs an access of its whole chain, head first, so that least-recently-used
eviction, which looks only at the oldest blocks of the pool, removes a chain's tail before its head.

The connector's evictor plans from per-shard lists sorted by recency and never walks the whole chain
graph: a parent must therefore be at least as recent as its descendants in the logs themselves.
"""

from gds_kv_connector.format.records import ZERO_KEY
from gds_kv_connector.maintenance.pool_scan import read_published, scan_pool
from gds_kv_connector.maintenance.recency import RecencyIndex
from tests.support.connector_helpers import make_executor, rand_tokens, serve


def _chains(root) -> list[list[bytes]]:
    """Every chain of the pool, head first, from the parent keys in the block headers."""
    child_of: dict[bytes, list[bytes]] = {}
    for b in scan_pool(str(root)).blocks:
        _, header = read_published(b)
        child_of.setdefault(header.parent_key, []).append(b.key)
    chains, todo = [], [[k] for k in child_of.get(ZERO_KEY, [])]
    while todo:
        chain = todo.pop()
        kids = child_of.get(chain[-1], [])
        if not kids:
            chains.append(chain)
        todo.extend(chain + [k] for k in kids)
    return chains


def test_a_finished_request_stamps_its_chain_newest_at_the_head(pool_env):
    shared = rand_tokens(16 * 3, 1)
    prompts = [shared + rand_tokens(16 * 4 + 3, 10 + i) for i in range(3)]
    ex = make_executor()
    serve(ex, prompts, max_new_tokens=4)
    ex.worker.shutdown()  # flushes the access log
    logged = RecencyIndex(str(pool_env)).refresh()
    chains = _chains(pool_env)
    assert len(chains) == 3 and all(len(c) == 7 for c in chains)
    for chain in chains:
        stamps = [logged[k] for k in chain]
        assert all(a > b for a, b in zip(stamps, stamps[1:])), stamps

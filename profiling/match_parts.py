"""What one short prompt's match costs, piece by piece, in a warm loop: the floor under the
executor figure's admission (64 of these per admission iteration in the bench).

    python profiling/match_parts.py [--tokens 133] [--reps 20000]

Times, each the best of five loops: the request's ``get_tokens`` (the reference executor converts
tokens as TensorRT-LLM's binding does), the C key chain of the prompt's full blocks, the stat of
the first block's file when it is absent (``present_run``), ``count_present`` and ``match_chain``
around them, a new request's state, and the whole ``get_num_new_matched_tokens`` of a new request
whose blocks are not in the pool.  What the whole costs beyond the pieces is the Python that a C
scheduler core could remove.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_executor  # noqa: E402
from gds_kv_connector import native  # noqa: E402
from gds_kv_connector.pool import BLOCK_SUFFIX  # noqa: E402
from gds_kv_connector.reference import SimRequest  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=133, help="prompt tokens (the bench's 4 blocks of 32 and 5)")
    ap.add_argument("--reps", type=int, default=20000, help="calls per timed loop")
    a = ap.parse_args()
    tpb = 32
    rng = random.Random(1)

    def request(rid: int) -> SimRequest:
        r = SimRequest(rid, [rng.randrange(32000) for _ in range(a.tokens)], max_new_tokens=16)
        r.tokens = list(r.prompt)
        r.hold_tokens()
        return r

    def best_us(fn, n: int = a.reps) -> float:
        return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6

    with bench_executor.cpu_connector("match-parts", tpb, 4096) as (sched, _):
        sched._connect()
        pool = sched._lookup_pools[0]
        r = request(0)
        tokens = r.get_tokens(0)
        blocks = (len(tokens) - 1) // tpb
        seed = bytes(32)
        keys = native.chain_keys(seed, tokens, 0, tpb, blocks)
        rows = [("get_tokens", best_us(lambda: r.get_tokens(0))),
                (f"C key chain, {blocks} blocks", best_us(lambda: native.chain_keys(seed, tokens, 0, tpb, blocks))),
                ("present_run, first file absent", best_us(lambda: native.present_run(pool._key_dirs, keys, 0,
                                                                                       BLOCK_SUFFIX))),
                ("count_present (index miss + the stat)", best_us(lambda: pool.count_present(keys))),
                ("match_chain (chain + count)", best_us(lambda: pool.match_chain(seed, tokens, tpb, blocks)))]
        next_id = [1_000_000]

        def new_state() -> None:
            next_id[0] += 1
            sched._state(next_id[0])
        rows.append(("a new request's state", best_us(new_state, 5000)))
        fresh = [request(2_000_000 + i) for i in range(5 * 2000)]
        it = iter(fresh)

        def whole() -> None:
            sched.get_num_new_matched_tokens(next(it), 0)
        rows.append(("get_num_new_matched_tokens, new prompt, absent", best_us(whole, 2000)))
    for name, us in rows:
        print(f"  {name:48s} {us:7.2f} us")


if __name__ == "__main__":
    main()

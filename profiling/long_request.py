"""One long request's scheduler callbacks, each timed on its own: what a long prompt costs the executor
thread outside the match (which the bench times as its 128k-token match goal).

    python profiling/long_request.py [--tree DIR] [--blocks 4096] [--requests 7] [--generated 3]
        [--convert]

For each of ``--requests`` new prompts of ``--blocks`` blocks of 32 tokens plus one token, none of them
in the pool: ``get_num_new_matched_tokens`` (the cold match), ``update_state_after_alloc``,
``build_connector_meta`` with the request's first report (the whole prompt, every block due for saving),
``--generated`` decode reports of one token (their sum is printed as well), and ``request_finished``.
Prints each callback's median in microseconds.  ``--convert`` uses a request whose ``get_tokens``
builds a new int per token from an int32 array and which offers ``get_token``, as TensorRT-LLM's
binding does: the reference's own request does so since b6ca524, so the option makes older trees
comparable.  Imports the package from ``--tree`` (default: this checkout), so two trees can be
alternated in the shell.  No GPU: a CPU KV cache and a host-memory pool under /dev/shm.
"""

from __future__ import annotations

import argparse
import array
import collections
import random
import statistics
import time
from typing import Any, Callable

from tree_checkout import add_tree_argument, use_tree

TPB = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_tree_argument(ap)
    ap.add_argument("--blocks", type=int, default=4096, help="full blocks of 32 tokens in each prompt")
    ap.add_argument("--requests", type=int, default=7, help="prompts timed, each new")
    ap.add_argument("--convert", action="store_true", help="get_tokens converts every token, as TensorRT-LLM's "
                    "binding does (the reference executor's copies a list)")
    ap.add_argument("--generated", type=int, default=3, help="decode reports of one token before the request "
                    "finishes (32 or more complete a generated block)")
    a = ap.parse_args()
    if a.blocks < 1 or a.requests < 1 or a.generated < 1:
        raise SystemExit("long_request.py: --blocks, --requests and --generated must be 1 or more")
    # the package from the tree; the rig (bench_executor.cpu_connector) from this checkout, so an older
    # tree can be timed by the same code
    tree = use_tree(a.tree, "long_request.py")
    from bench_executor import cpu_connector
    from gds_kv_connector.reference import SimRequest
    from gds_kv_connector.trtllm_api import RequestData, SchedulerOutput

    class Converting(SimRequest):
        """Tokens kept as C ints; each read makes Python ints of them, as a bound C++ vector does."""

        def get_tokens(self, beam: int = 0) -> list[int]:
            return self._arr.tolist()

        def get_token(self, beam: int, pos: int) -> int:
            return self._arr[pos]

    def make_request(rid: int, prompt: list[int]) -> Any:
        if not a.convert:
            return SimRequest(rid, prompt, tokens=list(prompt))
        req = Converting(rid, prompt, tokens=list(prompt))
        req._arr = array.array("i", prompt)
        return req

    n_tokens = a.blocks * TPB + 1
    pages = list(range(a.blocks + 1))
    rng = random.Random(3)
    times: dict[str, list[float]] = collections.defaultdict(list)

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter_ns()
        out = fn()
        times[name].append((time.perf_counter_ns() - t0) / 1e3)
        return out

    def report(rid: int, tokens: list[int], ids: list[int], computed: int, scheduled: int, first: bool):
        out = SchedulerOutput()
        rd = RequestData(request_id=rid, new_tokens=tokens, new_block_ids=ids, computed_position=computed,
                         num_scheduled_tokens=scheduled)
        (out.new_requests if first else out.cached_requests).append(rd)
        return out

    with cpu_connector("long-request", TPB, 8) as (sched, _):
        for rid in range(1, a.requests + 1):
            prompt = [rng.randrange(32000) for _ in range(n_tokens)]
            req = make_request(rid, prompt)
            timed("get_num_new_matched_tokens (cold)", lambda: sched.get_num_new_matched_tokens(req, 0))
            timed("update_state_after_alloc", lambda: sched.update_state_after_alloc(req, pages))
            first = report(rid, list(prompt), pages, 0, n_tokens, True)
            meta = timed("build_connector_meta, first report", lambda: sched.build_connector_meta(first))
            if sum(len(op.keys) for op in meta.saves) != a.blocks:
                raise SystemExit(f"long_request.py: the first report made {len(meta.saves)} saves, not "
                                 f"one of {a.blocks} blocks")
            decode_us = 0.0
            for k in range(a.generated):
                req.tokens.append(5)
                if a.convert:
                    req._arr.append(5)
                step = report(rid, [5], [a.blocks + 1 + k // TPB] if (n_tokens + k) % TPB == 0 else [],
                              n_tokens + k, 1, False)
                timed("build_connector_meta, a decode report", lambda: sched.build_connector_meta(step))
                decode_us += times["build_connector_meta, a decode report"][-1]
            times["build_connector_meta, all decode reports"].append(decode_us)
            ids = pages + list(range(a.blocks + 1, a.blocks + 1 + (a.generated + TPB - 1) // TPB))
            timed("request_finished", lambda: sched.request_finished(req, ids))
    print(f"{tree}: {a.requests} requests of {n_tokens} tokens, median us per call")
    for name, xs in times.items():
        print(f"  {name:40s} {statistics.median(xs):9.1f}")


if __name__ == "__main__":
    main()

"""The executor thread's whole match of a fully cached 128k-token prompt, through the scheduler, with
its blocks in the index and with the index emptied (every block file stat'ed).

    PYTHONPATH=<checkout> python profiling/match_probe.py [--calls 20] [--dir /dev/shm]

The bench's match phase (``bench_executor.match_time``) times the same call once per run; this probe
runs nothing else, so two checkouts compare in one sitting (``PYTHONPATH`` picks the tree; the line
printed names it).  It saves the prompt's 4096 blocks (one per 32 tokens) into a temporary
host-memory pool through the worker, then alternates indexed and unindexed calls of
``get_num_new_matched_tokens`` for new requests over the same prompt, each call's ``get_tokens``
returning a new list as TensorRT-LLM's does, and prints each kind's median and minimum in ms.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:  # the package of PYTHONPATH or the install; a source checkout's own otherwise
    import gds_kv_connector
except ImportError:
    sys.path.append(os.path.dirname(HERE))
    import gds_kv_connector
from bench_common import MATCH_BLOCKS, MATCH_BLOCK_ELEMS, TOKENS_PER_BLOCK  # noqa: E402
from bench_executor import connector_env, save_chain  # noqa: E402
from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker  # noqa: E402
from gds_kv_connector.keys import base_fingerprint, block_keys  # noqa: E402
from gds_kv_connector.local_peer import lookup  # noqa: E402
from gds_kv_connector.reference import SimRequest, fake_llm_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20, help="calls of each kind (indexed, unindexed)")
    ap.add_argument("--dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    a = ap.parse_args()
    if a.calls < 1:
        raise SystemExit("match_probe.py: --calls must be positive")
    root = tempfile.mkdtemp(prefix="gdskv-matchprobe-", dir=a.dir)
    rng = random.Random(99)
    prompt = [rng.randrange(32000) for _ in range(MATCH_BLOCKS * TOKENS_PER_BLOCK + 1)]
    try:
        with connector_env(root):
            llm_args = fake_llm_args(TOKENS_PER_BLOCK, model="gdskv-match-probe")
            sched, worker = GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args)
            try:
                worker.register_kv_caches(torch.zeros((8, 1, 2, MATCH_BLOCK_ELEMS), dtype=torch.bfloat16))
                sched.wait_for_initialization()
                keys = block_keys(base_fingerprint(lookup(llm_args).geometry), None, prompt,
                                  TOKENS_PER_BLOCK)[:MATCH_BLOCKS]
                save_chain(worker, keys, torch.zeros((MATCH_BLOCKS, worker.pool.payload_len), dtype=torch.uint8))
                times: dict[str, list[float]] = {"indexed": [], "unindexed": []}
                rid = 100
                for _ in range(a.calls):
                    for label, got in times.items():
                        if label == "unindexed":
                            for pool in sched._lookup_pools:
                                pool._index.clear()
                        req = SimRequest(rid, prompt, tokens=list(prompt))
                        rid += 1
                        t0 = time.perf_counter()
                        matched, _ = sched.get_num_new_matched_tokens(req, 0)
                        got.append(time.perf_counter() - t0)
                        sched.request_reset(req)
                        if matched != MATCH_BLOCKS * TOKENS_PER_BLOCK:
                            raise SystemExit(f"match_probe.py: the cached prompt matched {matched} tokens ({label})")
            finally:
                worker.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tree = os.path.dirname(os.path.dirname(os.path.abspath(gds_kv_connector.__file__)))
    print(tree, "  ".join(f"{k} median {statistics.median(v) * 1e3:.3f} min {min(v) * 1e3:.3f} ms"
                          for k, v in times.items()))


if __name__ == "__main__":
    main()

"""How long finished requests' pages stay held by their saves, with the pages released once the engine
has staged them and, in the same run, released only once the bytes are written (as before).

    python profiling/save_release.py [--block 2MiB] [--requests 64] [--blocks-per-request 4]
                                     [--transfer-threads 4] [--stage-ahead 4] [--io-threads 4]
                                     [--rounds 2] [--dir /tmp]

TensorRT-LLM frees a finished request's pages only once ``get_finished`` reports it.  This submits
``--requests`` finished requests' saves together (as one iteration's finished requests arrive),
through the connector's TransferManager and engine into a pool under ``--dir``, and polls as
``get_finished`` does: each request's time from submission to its report is how long its pages
were held; the time until every batch has settled is how long the storage took.  An untimed first
round allocates the transfer threads' stages (runs before 15ce3f5 had none: their first leg paid
it, about 250 ms), and the leg that runs first rotates from round to round (before 6eaf78e the
early leg always ran first).  Each round runs three ways, in turn: ``stage ahead`` (the connector's
behaviour: pages free once staged, and up to ``--stage-ahead`` batches staged beyond the transfer
threads while writes run), ``early`` (pages free once staged, no batch beyond the transfer threads:
TLLM_GDS_KV_STAGE_AHEAD=0, the connector from 0da930d to 5b9d58f) and ``at write end`` (the report
waits for the batch's writes, as before 0da930d; ``early``'s manager with the engine's
``views_read`` signal ignored).  One JSON line: per way, the medians over rounds of each request's
hold time (median, p90, max) and of the writes' end; ``early`` / ``at write end`` of the median
holds, and ``stage ahead`` / ``early`` of each figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import close_tool  # noqa: E402

from gds_kv_connector import transfers  # noqa: E402
from gds_kv_connector.engines import make_engine  # noqa: E402
from gds_kv_connector.kv_layout import pool_from_tensor  # noqa: E402
from gds_kv_connector.metadata import SaveOp  # noqa: E402
from gds_kv_connector.pool import BlockPool  # noqa: E402
from gds_kv_connector.pool_format import ZERO_KEY  # noqa: E402
from gds_kv_connector.settings import Settings, parse_size  # noqa: E402
from gds_kv_connector.stats import Stats  # noqa: E402


def _round(tm: transfers.TransferManager, ops: list[SaveOp]) -> tuple[list[float], float]:
    """Submit the saves, poll until every request is reported and every batch settled: each
    request's hold time and the time the writes took, in ms."""
    rids = [op.request_id for op in ops]
    t0 = time.perf_counter()
    tm.submit_saves(ops, None)
    held: dict[int, float] = {}
    finished = rids
    end = time.monotonic() + 300
    while len(held) < len(rids) or tm._inflight:
        done, _ = tm.poll(finished, [])
        finished = []
        now = time.perf_counter()
        for rid in done:
            held[rid] = 1e3 * (now - t0)
        if time.monotonic() > end:
            raise TimeoutError("the saves did not settle within 300 s")
        time.sleep(0.001)  # about how often TensorRT-LLM's executor polls while idle
    return [held[r] for r in rids], 1e3 * (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", default="2MiB")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--blocks-per-request", type=int, default=4)
    ap.add_argument("--transfer-threads", type=int, default=4)
    ap.add_argument("--stage-ahead", type=int, default=4)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    size = parse_size(a.block)
    if min(a.requests, a.blocks_per_request, a.rounds, a.stage_ahead) < 1:
        ap.error("--requests, --blocks-per-request, --rounds and --stage-ahead must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = tempfile.mkdtemp(prefix="gdskv-save-release-", dir=a.dir)
    n = a.requests * a.blocks_per_request
    managers: list[transfers.TransferManager] = []
    real_views_done = transfers._views_done
    try:
        pool = BlockPool((root,), hashlib.sha256(root.encode()).digest(), size, 32, index_ttl_s=600)
        kv = pool_from_tensor(torch.randint(0, 256, (n, size), dtype=torch.uint8, device=device))

        def manager(ahead: int) -> transfers.TransferManager:
            env = {"TLLM_GDS_KV_DEADLINE_S": "300", "TLLM_GDS_KV_IO_THREADS": str(a.io_threads),
                   "TLLM_GDS_KV_TRANSFER_THREADS": str(a.transfer_threads), "TLLM_GDS_KV_STAGE_AHEAD": str(ahead),
                   "TLLM_GDS_KV_MAX_QUEUED_SAVE_BYTES": "0"}
            engine = make_engine("auto", device, a.io_threads)  # each its own stages
            try:
                tm = transfers.TransferManager(pool, engine, kv, Settings.load_from(env=env, require_root=False,
                                                                                    root=root), Stats())
            except BaseException:
                engine.close()
                raise
            managers.append(tm)
            return tm
        ahead, plain = manager(a.stage_ahead), manager(0)
        rid = 0

        def fresh_ops() -> list[SaveOp]:
            nonlocal rid
            ops = []
            for r in range(a.requests):
                rid += 1
                keys = tuple(os.urandom(32) for _ in range(a.blocks_per_request))
                first = r * a.blocks_per_request
                ops.append(SaveOp(rid, keys, (ZERO_KEY,) * len(keys), tuple(range(first, first + len(keys)))))
            return ops
        for tm in (ahead, ahead, plain):  # untimed: every transfer thread's stage is allocated and registered
            _round(tm, fresh_ops())
        legs = [("stage ahead", ahead, real_views_done), ("early", plain, real_views_done),
                ("at write end", plain, lambda batch: lambda: None)]
        ways: dict[str, dict[str, list[float]]] = {way: {} for way, _, _ in legs}
        for r in range(a.rounds):
            for way, tm, views_done in legs[r % 3:] + legs[:r % 3]:  # which runs first rotates
                transfers._views_done = views_done
                holds, writes = _round(tm, fresh_ops())
                ordered = sorted(holds)
                got = ways[way]
                for name, value in (("hold_median_ms", statistics.median(ordered)),
                                    ("hold_p90_ms", ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]),
                                    ("hold_max_ms", ordered[-1]), ("writes_ms", writes)):
                    got.setdefault(name, []).append(round(value, 1))
        summary = {way: {name: round(statistics.median(values), 1) for name, values in got.items()}
                   for way, got in ways.items()}

        def ratio(way: str, base: str, name: str) -> float:
            return round(summary[way][name] / summary[base][name], 3)
        print(json.dumps({
            "data_path": ahead.engine.data_path(), "block": size, "requests": a.requests,
            "blocks_per_request": a.blocks_per_request, "transfer_threads": a.transfer_threads,
            "stage_ahead": a.stage_ahead, "io_threads": a.io_threads, "runs": ways, "median_of_rounds": summary,
            "hold_median_ratio": ratio("early", "at write end", "hold_median_ms"),
            "stage_ahead_vs_early": {name: ratio("stage ahead", "early", name)
                                     for name in ("hold_median_ms", "hold_p90_ms", "hold_max_ms", "writes_ms")}}))
    finally:
        transfers._views_done = real_views_done
        for tm in managers[1:]:
            tm.shutdown()  # and its engine
        close_tool(managers[0] if managers else None, None, root)


if __name__ == "__main__":
    main()

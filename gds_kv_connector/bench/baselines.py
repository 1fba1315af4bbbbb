"""Baselines on the same blocks: the TensorRT-LLM example's per-block torch.save / torch.load, and naive
KvikIO (one CuFile per block, library defaults).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any

import torch

from gds_kv_connector.bench.common import Budget, KvikioDefaults, Tracer, sync_device, drop_caches, gbps, syncfs
from gds_kv_connector.bench.connector import save_timing


def baseline_trtllm(kv: torch.Tensor, n: int, bdir: str, budget: Budget, is_memory: bool, global_drop: bool,
                    tracer: Tracer, label: str) -> tuple[dict, dict]:
    """TensorRT-LLM's example connector: one torch.save file per block, torch.load + copy_ back."""
    os.makedirs(bdir, exist_ok=True)
    cuda = kv.device.type == "cuda"
    payload = kv.shape[1]
    done = 0
    sync_device(kv.device)
    deadline = time.monotonic() + budget.cap()
    with tracer.rf(f"bench/baseline_trtllm/{label}/save"):
        t0 = time.perf_counter()
        for i in range(n):
            if time.monotonic() >= deadline:
                break
            # .cpu() of a CUDA block copies it; of a CPU view it would be the view, and torch.save
            # would serialize the whole pool storage, so a host pool gets clone() instead.
            blk = kv[i].cpu() if cuda else kv[i].clone()
            torch.save(blk, os.path.join(bdir, f"{i}.pt"))
            done += 1
        secs = time.perf_counter() - t0
        t1 = time.perf_counter()
        syncfs(bdir)
        sync_s = time.perf_counter() - t1
    budget.phases_left -= 1
    save = {"method": "trtllm_example", "direction": "save", "blocks": done,
            **save_timing(done * payload, secs, sync_s), "capped_by_time": done < n}
    if not is_memory:
        drop_caches([bdir], global_drop)
    loaded = 0
    deadline = time.monotonic() + budget.cap()
    with tracer.rf(f"bench/baseline_trtllm/{label}/load"):
        t0 = time.perf_counter()
        for i in range(done):
            if time.monotonic() >= deadline:
                break
            t = torch.load(os.path.join(bdir, f"{i}.pt"), map_location="cpu", weights_only=True)
            kv[i].copy_(t)
            loaded += 1
        sync_device(kv.device)
        secs = time.perf_counter() - t0
    budget.phases_left -= 1
    load = {"method": "trtllm_example", "direction": "load", "blocks": loaded, "bytes": loaded * payload,
            "seconds": round(secs, 4), "GBps": round(gbps(loaded * payload, secs), 3),
            "capped_by_time": loaded < done, "cold_cache": not is_memory}
    shutil.rmtree(bdir, ignore_errors=True)
    return save, load


def baseline_naive_kvikio(kv: torch.Tensor, n: int, bdir: str, budget: Budget, is_memory: bool,
                          global_drop: bool, kvd: KvikioDefaults, tracer: Tracer, label: str) -> tuple[dict, dict]:
    """One kvikio.CuFile per block with KvikIO's own defaults, sequential pwrite/pread(...).get()."""
    kvikio = kvd.kv
    kvd.restore()
    os.makedirs(bdir, exist_ok=True)
    payload = kv.shape[1]
    result: dict[str, Any] = {}

    def run(direction: str, count: int, cap: float) -> None:
        deadline = time.monotonic() + cap
        k = 0
        t0 = time.perf_counter()
        for i in range(count):
            if time.monotonic() >= deadline:
                break
            path = os.path.join(bdir, f"{i}.bin")
            f = kvikio.CuFile(path, "w" if direction == "save" else "r")
            try:
                (f.pwrite(kv[i]) if direction == "save" else f.pread(kv[i])).get()
            finally:
                f.close()
            k += 1
        sync_device(kv.device)
        result[direction] = (k, time.perf_counter() - t0)

    def guarded(direction: str, count: int) -> tuple[int, float, str | None]:
        cap = budget.cap()
        err: list[BaseException] = []

        def body() -> None:
            try:
                run(direction, count, cap)
            except BaseException as exc:  # noqa: BLE001 - reported in the row
                err.append(exc)
        th = threading.Thread(target=body, daemon=True, name=f"bench-naive-kvikio-{direction}")
        th.start()
        th.join(cap + 60)
        if th.is_alive():
            return 0, 0.0, f"did not finish within {cap + 60:.0f} s (left running)"
        if err:
            return 0, 0.0, f"{type(err[0]).__name__}: {err[0]}"
        k, secs = result[direction]
        return k, secs, None

    sync_device(kv.device)
    with tracer.rf(f"bench/baseline_naive_kvikio/{label}/save"):
        done, secs, error = guarded("save", n)
        t1 = time.perf_counter()
        syncfs(bdir)
        sync_s = time.perf_counter() - t1
    budget.phases_left -= 1
    save = {"method": "naive_kvikio", "direction": "save", "blocks": done, **save_timing(done * payload, secs, sync_s),
            "capped_by_time": done < n, "error": error, "kvikio_defaults": kvd.describe()}
    if not is_memory:
        drop_caches([bdir], global_drop)
    with tracer.rf(f"bench/baseline_naive_kvikio/{label}/load"):
        loaded, secs, error = guarded("load", done) if done else (0, 0.0, "nothing saved")
    budget.phases_left -= 1
    load = {"method": "naive_kvikio", "direction": "load", "blocks": loaded, "bytes": loaded * payload,
            "seconds": round(secs, 4), "GBps": round(gbps(loaded * payload, secs), 3),
            "capped_by_time": loaded < done, "cold_cache": not is_memory, "error": error}
    shutil.rmtree(bdir, ignore_errors=True)
    return save, load

"""``gds-kv demo``: shared-prefix conversations served by 2 attention-DP owners, then a restart.

Phase 1 runs two owner processes over one pool directory; conversations move between owners
from round to round, so each owner loads prefixes the other saved.  Phase 2 is a fresh process
(a restart) over the same pool, which must hit the blocks phase 1 published.  Every answer is
checked against the deterministic model and every loaded block is verified byte for byte by the
reference executor before use, on top of the connector's own checksum.

Phase 1 is named by what it found: a cold pool where its first round loaded nothing, a warm one
where an earlier run had left the blocks.  An owner's failure (a bad setting included) ends the demo
with one line naming it; progress bars are drawn only on a terminal.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import sys
import time
from dataclasses import asdict
from typing import Any

import torch
from tqdm import tqdm

from gds_kv_connector.simulator.executor import ExecutorConfig
from gds_kv_connector.simulator.model import ModelShape
from gds_kv_connector.simulator.workload import PEER_FAILED, Workload, owner_process


class DemoFailed(RuntimeError):
    """An owner process failed or died: the demo ends with this one line (exit 1)."""


def run_phase(name: str, owners: int, workload: Workload, cfg: ExecutorConfig, env: dict[str, str],
              progress: bool = True) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(owners)
    procs = [ctx.Process(target=owner_process, args=(o, owners, workload, cfg, env, barrier, results),
                         name=f"{name}-owner{o}") for o in range(owners)]
    for p in procs:
        p.start()
    bar = _progress_bar(owners * workload.rounds, f"{name} ({owners} owner{'s' if owners > 1 else ''})", progress)
    reports: list[dict[str, Any]] = []
    try:
        while len(reports) < owners:
            try:
                kind, payload = results.get(timeout=5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise DemoFailed(f"{dead[0].name} died with exit code {dead[0].exitcode}") from None
                continue
            if kind == "round":
                bar.update(1)
            else:
                reports.append(payload)
    finally:
        bar.close()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    failed = [r for r in reports if r["error"]]
    first = [r for r in failed if r["error"] != PEER_FAILED] or failed
    if first:
        raise DemoFailed("; ".join(f"owner {r['owner']}: {r['error']}" for r in first))
    return sorted(reports, key=lambda r: r["owner"])


def summarize(name: str, reports: list[dict[str, Any]], block_bytes: int) -> dict[str, Any]:
    rounds = max(len(r["rounds"]) for r in reports)
    rows = []
    for i in range(rounds):
        rs = [r["rounds"][i] for r in reports if i < len(r["rounds"])]
        tot = {k: sum(x[k] for x in rs) for k in ("requests", "prompt_tokens", "loaded_tokens", "computed_tokens",
                                                   "blocks_verified", "bytes_loaded", "bytes_saved", "blocks_saved")}
        tot["wall_s"] = max(x["wall_s"] for x in rs)
        tot["round"] = i + 1
        tot["hit_rate"] = tot["loaded_tokens"] / max(tot["prompt_tokens"], 1)
        rows.append(tot)
    conn: dict[str, int] = {}
    for r in reports:
        for k, v in r["connector"].items():
            conn[k] = conn.get(k, 0) + v
    return {"phase": name, "owners": len(reports), "rounds": rows, "connector": conn,
            "data_path": reports[0]["data_path"], "block_bytes": block_bytes}


def print_summary(s: dict[str, Any]) -> None:
    print(f"\n== {s['phase']}: {s['owners']} owner(s), data path: {s['data_path']}")
    print(f"{'round':>5} {'reqs':>5} {'hit rate':>9} {'loaded tok':>11} {'computed tok':>13} "
          f"{'loaded MiB':>11} {'saved MiB':>10} {'load MB/s':>10} {'wall s':>7}")
    for r in s["rounds"]:
        mbps = r["bytes_loaded"] / 1e6 / r["wall_s"] if r["wall_s"] else 0.0
        print(f"{r['round']:>5} {r['requests']:>5} {r['hit_rate']:>8.1%} {r['loaded_tokens']:>11} "
              f"{r['computed_tokens']:>13} {r['bytes_loaded'] / 2**20:>11.2f} {r['bytes_saved'] / 2**20:>10.2f} "
              f"{mbps:>10.1f} {r['wall_s']:>7.2f}")
    c = s["connector"]
    print(f"   connector: {c.get('blocks_saved', 0)} blocks published, {c.get('save_lost_race', 0)} lost races "
          f"(discarded duplicates), {c.get('loads_sync', 0)} sync + {c.get('loads_async', 0)} async loads, "
          f"{c.get('load_failures', 0)} load failures")


def phase1_name(reports: list[dict[str, Any]]) -> str:
    """Phase 1 by what it met: a cold pool where its first round loaded nothing, else a warm one."""
    warm = any(r["rounds"] and r["rounds"][0]["loaded_tokens"] for r in reports)
    return "phase 1: warm pool (blocks an earlier run left)" if warm else "phase 1: cold pool"


def main(root: str, device: str = "auto", owners: int = 2, conversations: int = 6, rounds: int = 3,
         json_out: str | None = None, progress: bool = True, block_elems: int = 8192) -> int:
    """Run the demo over ``root`` (one or several roots, ':'-separated); 0 when every answer matched
    and the restart hit, 1 when not or when an owner failed (its one line on stderr)."""
    try:
        return _run(root, device, owners, conversations, rounds, json_out, progress, block_elems)
    except DemoFailed as exc:
        print(f"gds-kv demo: {exc}", file=sys.stderr)
        return 1


def _run(root: str, device: str, owners: int, conversations: int, rounds: int, json_out: str | None,
         progress: bool, block_elems: int) -> int:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here; use --device cpu (or auto)")
    root = ":".join(os.path.abspath(r) for r in root.split(":") if r)
    for r in root.split(":"):
        os.makedirs(r, exist_ok=True)
    env = {"TLLM_GDS_KV_ROOT": root, "TLLM_GDS_KV_ASYNC_LOAD_BYTES": "256KiB"}
    if device == "cuda":
        env.setdefault("KVIKIO_COMPAT_MODE", os.environ.get("KVIKIO_COMPAT_MODE", "AUTO"))
    shape = ModelShape(num_layers=4, kv_factor=2, block_elems=block_elems, tokens_per_block=16)
    cfg = ExecutorConfig(shape=shape, num_blocks=1024, max_batch=8, chunk_size=256, device=device)
    workload = Workload(conversations=conversations, rounds=rounds)
    print(f"gds-kv demo: pool {root}, device {device}, {owners} ADP owners, {conversations} conversations x "
          f"{rounds} rounds sharing a {workload.system_tokens}-token system prompt; block = "
          f"{shape.tokens_per_block} tokens = {shape.block_bytes / 2**10:.0f} KiB")
    t0 = time.perf_counter()
    first = run_phase("phase1", owners, workload, cfg, env, progress)
    phases = [summarize(phase1_name(first), first, shape.block_bytes),
              summarize("phase 2: restart (fresh process, same pool)", run_phase("phase2", 1, workload, cfg, env,
                                                                                 progress), shape.block_bytes)]
    for s in phases:
        print_summary(s)
    verified = sum(r["blocks_verified"] for s in phases for r in s["rounds"])
    loaded = sum(r["loaded_tokens"] for s in phases for r in s["rounds"]) // shape.tokens_per_block
    failures = sum(s["connector"].get("load_failures", 0) for s in phases)
    restart_first = phases[1]["rounds"][0]["hit_rate"]
    ok = failures == 0 and restart_first > 0
    if json_out:
        with open(json_out, "w") as fh:
            json.dump({"phases": phases, "device": device, "root": root, "ok": ok,
                       "config": {"workload": asdict(workload), "block_bytes": shape.block_bytes}}, fh, indent=1)
    print(f"\n{loaded} loaded blocks and {verified} blocks in total verified byte-exact against the reference model; "
          f"every answer matched; restart hit rate on round 1: {restart_first:.1%}; "
          f"{time.perf_counter() - t0:.1f}s. {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def _progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    """A bar on stderr only where it is a terminal: redrawn with carriage returns, it would litter a
    log file with every state it passed through."""
    return tqdm(total=total, desc=desc, unit="owner-round", disable=not (enabled and sys.stderr.isatty()),
                file=sys.stderr)

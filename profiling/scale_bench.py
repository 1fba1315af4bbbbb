"""Maintenance at scale: each operation's time, peak RSS and file-system calls on pools of millions of blocks.

    python profiling/scale_bench.py --blocks 1M,10M --dir /var/tmp/scale --json out.json
    python profiling/scale_bench.py --quick                      # 20k and 100k blocks, about two minutes

For each size it builds a pool of valid blocks (profiling/scale_pool.py: chains sharing prefixes, creation
times over hours, several owners' access logs) and runs, each in a fresh process through the public entry
points, whatever the tree holds when it runs:

  summaries    an eviction run without a budget: it builds the shard summaries that are missing or stale
               (all of them on a pool just built, which is what later runs and ``gds-kv stats`` read)
  stats        ``gds-kv stats``
  gc_dry_run   ``gds-kv gc --dry-run --quota Q`` (Q and the low watermark set so that a pass frees ``target``
               blocks, 10,000 or a tenth of a smaller pool)
  verify       ``gds-kv verify --no-quarantine``, stopped at ``--verify-limit-s``: the rest is estimated
               from its read rate over the last half of that window (rchar of /proc/<pid>/io), and says so
  startup      a worker and scheduler registered on the pool (TLLM_GDS_KV_ROOT), to ready
  match        a fresh process's first match of a cached 4096-block chain (``get_num_new_matched_tokens``)
  gc_max_age   ``gds-kv gc --max-age-s A`` with A reaching back to the oldest ``target`` blocks
  gc_quota     ``gds-kv gc --quota Q``
  evict        ``maintenance.eviction.evict_pool`` with Q and the low watermark as above

The last three remove blocks: the pool builder writes the removed ones back after each (``restore``), so the
next operation and a later ``--reuse`` see the pool as built.  Before each of them, and before the dry run
(whose quota, one block below usage, is within the stale shards' estimate of it), the pool is *settled*
(untimed, ``scale_pool.settle``): every shard summary brought up to date, then every shard directory changed,
as writers in service leave them.  So each remover starts from the same state, the one it meets in service
(every summary stale: its run pays the budgeted rebuilds and the count of stale shards), and restored blocks,
written with their old times, are in the summaries as the blocks they replace were.

A child imports what it needs, reports ready, and is timed from the parent's go: the seconds exclude the
interpreter and imports, peak RSS (VmHWM) includes them, and its RSS at ready is reported beside it.
``--cache cold`` drops the page cache (``/proc/sys/vm/drop_caches``, as root) between ready and go; ``warm``
runs the operation on whatever the cache holds after the build and earlier operations.  A third pass runs
each operation under ``strace -f -c`` attached at go, for its file-system calls: stat (stat, lstat, fstat,
newfstatat, statx), open, read, getdents, unlink, write and rename/link, summed into ``fs ops``, and that
sum times 0.5 ms and 1 ms modelled as the time on a network filesystem where each call is a round trip
(an upper bound: NFS caches attributes and batches directory reads).  Strace slows a run, so its times are
not the ones reported.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale_pool  # noqa: E402  (a sibling file, not a package)

OPS = ("summaries", "stats", "gc_dry_run", "verify", "startup", "match", "gc_max_age", "gc_quota", "evict")
DESTRUCTIVE = {"gc_max_age", "gc_quota", "evict"}
SETTLED = DESTRUCTIVE | {"gc_dry_run"}  # run on a settled pool (scale_pool.settle)
SYSCALL_GROUPS = {
    "stat": {"stat", "lstat", "fstat", "newfstatat", "statx", "fstatat64", "stat64", "lstat64", "fstat64"},
    "open": {"open", "openat", "openat2", "creat"},
    "read": {"read", "pread64", "readv", "preadv", "preadv2"},
    "getdents": {"getdents", "getdents64"},
    "unlink": {"unlink", "unlinkat"},
    "write": {"write", "pwrite64", "writev", "pwritev", "pwritev2"},
    "rename_link": {"rename", "renameat", "renameat2", "link", "linkat"},
}
NFS_LATENCIES_S = (0.0005, 0.001)
QUICK_BLOCKS = "20k,100k"
_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9}


# -- children: one operation each --------------------------------------------------------------------
def _child(op: str, meta_path: str, params: dict[str, Any]) -> None:
    """Set up ``op``, say READY, wait for go on stdin, run it and say RESULT (the protocol of :func:`run_op`)."""
    meta = scale_pool.load_meta(os.path.dirname(meta_path))
    if meta is None:
        raise SystemExit(f"scale_bench: no pool description in {meta_path}")
    run = _prepare(op, meta, params)
    out = sys.__stdout__
    out.write(f"READY {json.dumps({'rss_kb': _proc_status('VmRSS')})}\n")
    out.flush()
    sys.stdin.readline()
    captured = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(captured):
        detail = run()
    seconds = time.perf_counter() - t0
    out.write("RESULT " + json.dumps({"seconds": seconds, "peak_rss_kb": _proc_status("VmHWM"),
                                      "detail": detail}, default=str) + "\n")
    out.flush()


def _prepare(op: str, meta: scale_pool.PoolMeta, params: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """The operation, with every import and set-up it needs done before the clock starts."""
    root = meta.root
    if op in ("startup", "match"):
        import torch  # noqa: F401  (imported here: the clock starts after it)

        from gds_kv_connector.connector import scheduler, worker  # noqa: F401
        from gds_kv_connector.simulator import SimRequest
    if op == "startup":
        def startup() -> dict[str, Any]:
            _, w = scale_pool.open_connector(root)
            started.append(w)
            return {}
        started: list[Any] = []
        return _then(startup, lambda: [w.shutdown() for w in started])
    if op == "match":
        sched, w = scale_pool.open_connector(root)
        prompt = scale_pool.match_tokens(meta.seed)
        req = SimRequest(1, prompt, tokens=list(prompt))  # as the executor submits one: tokens are the prompt

        def match() -> dict[str, Any]:
            matched, is_async = sched.get_num_new_matched_tokens(req, 0)
            return {"matched_blocks": matched // scale_pool.TOKENS_PER_BLOCK, "async": bool(is_async)}
        return _then(match, w.shutdown)
    if op == "summaries":
        from gds_kv_connector.maintenance.eviction import DEFAULT_GRACE_S, evict_pool

        def summaries() -> dict[str, Any]:
            (report,) = evict_pool([root], 0, 0.9, 0, DEFAULT_GRACE_S)  # no budget: lists and summarises only
            return {"names_listed": report.names_listed, "summaries_stale": report.summaries_stale}
        return summaries
    if op == "evict":
        from gds_kv_connector.maintenance.eviction import DEFAULT_GRACE_S, evict_pool

        def evict() -> dict[str, Any]:
            reports = evict_pool([root], params["quota"], params["low_watermark"], 0, DEFAULT_GRACE_S)
            return {"evicted_blocks": sum(r.evicted_blocks for r in reports),
                    "scanned_blocks": sum(r.scanned_blocks for r in reports)}
        return evict
    from gds_kv_connector.cli import main as cli
    from gds_kv_connector.maintenance import eviction, operations  # noqa: F401  (the commands import them lazily)
    argv = {"stats": ["stats"], "verify": ["verify", "--no-quarantine"],
            "gc_dry_run": ["gc", "--dry-run", "--quota", str(params.get("quota"))],
            "gc_quota": ["gc", "--quota", str(params.get("quota"))],
            "gc_max_age": ["gc", "--max-age-s", str(params.get("max_age_s"))]}[op]

    def command() -> dict[str, Any]:
        code = cli.main([*argv, "--root", root, "--json"])
        return {"exit_code": code, **_summary(op, sys.stdout.getvalue())}
    return command


def _then(fn: Callable[[], dict[str, Any]], after: Callable[[], Any]) -> Callable[[], dict[str, Any]]:
    """``fn`` timed, ``after`` (a shutdown) run once the result is reported, outside the clock."""
    import atexit
    atexit.register(after)
    return fn


def _summary(op: str, text: str) -> dict[str, Any]:
    """The few numbers of a command's JSON that the table shows."""
    try:
        res = json.loads(text)
    except ValueError:
        return {"output": text[-400:]}
    if op == "stats":
        return {"blocks": res.get("blocks")}
    if op == "verify":
        return {k: res.get(k) for k in ("checked", "ok", "bad")}
    return {"evicted_blocks": res.get("evicted_blocks"),
            "scanned_blocks": max((r.get("scanned_blocks", 0) for r in res.get("runs", [])), default=None)}


def _proc_status(field: str, pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _rchar(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/io") as fh:
            for line in fh:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# -- the parent: one child per operation ------------------------------------------------------------
def drop_caches() -> bool:
    """Empty the page cache, dentries and inodes (root only); False where not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def run_op(op: str, meta_path: str, params: dict[str, Any], limit_s: float, *, cold: bool = False,
           strace: bool = False, file_size: int = 8192) -> dict[str, Any]:
    """One operation in a fresh child: time, peak RSS and (``strace``) system-call counts; a child that
    runs past ``limit_s`` is killed and reported as timed out (verify: with an estimate of the rest)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")}
    env |= {"TLLM_GDS_KV_ROOT": params["root"], "PYTHONUNBUFFERED": "1"}
    if "low_watermark" in params:
        env["TLLM_GDS_KV_LOW_WATERMARK"] = repr(params["low_watermark"])
    out: dict[str, Any] = {"op": op, "cache": "strace" if strace else "cold" if cold else "warm"}
    with tempfile.TemporaryDirectory(prefix="scale-bench-") as tmp:
        err_path = os.path.join(tmp, "stderr")
        with open(err_path, "w") as err:
            child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_child", op, meta_path,
                                      json.dumps(params)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=err, env=env, text=True, start_new_session=True)
        started = time.monotonic()
        ready = _read_line(child, "READY", started + limit_s)
        if ready is None:
            why = f"no READY within {limit_s:.0f} s" if child.poll() is None else f"exit code {child.returncode} before READY"
            return out | _failed(child, err_path, why)
        out["ready_rss_mb"] = round(json.loads(ready)["rss_kb"] / 1024, 1)
        if cold:
            out["cache_dropped"] = drop_caches()
        tracer = _attach_strace(child.pid, os.path.join(tmp, "strace")) if strace else None
        rchar0 = _rchar(child.pid)
        go = time.monotonic()
        child.stdin.write("go\n")
        child.stdin.flush()
        deadline = go + (params.get("verify_limit_s", limit_s) if op == "verify" else limit_s)
        samples, hwm = [(0.0, 0)], 0
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            hwm = max(hwm, _proc_status("VmHWM", child.pid))
            samples.append((time.monotonic() - go, _rchar(child.pid) - rchar0))
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            out |= {"timed_out": True, "seconds": round(time.monotonic() - go, 3), "peak_rss_mb": round(hwm / 1024, 1)}
            if op == "verify":
                out |= _verify_estimate(samples, params["blocks"], file_size)
        else:
            result = _read_line(child, "RESULT", time.monotonic() + 60)
            child.wait()
            if result is None:
                return out | _failed(child, err_path, f"exit code {child.returncode} without a result")
            res = json.loads(result)
            out |= {"timed_out": False, "seconds": round(res["seconds"], 3),
                    "peak_rss_mb": round(res["peak_rss_kb"] / 1024, 1), "detail": res["detail"]}
        out["wall_s"] = round(time.monotonic() - started, 3)
        if tracer is not None:
            out["syscalls"] = _strace_counts(tracer, os.path.join(tmp, "strace"))
            out |= _fs_cost(out["syscalls"])
    return out


def _read_line(child: subprocess.Popen, tag: str, deadline: float) -> str | None:
    """The payload of the child's next ``tag`` line, None when it did not come by ``deadline``."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([child.stdout], [], [], left)[0]:
            return None
        line = child.stdout.readline()
        if not line:
            return None
        if line.startswith(tag + " "):
            return line[len(tag) + 1:]


def _failed(child: subprocess.Popen, err_path: str, why: str) -> dict[str, Any]:
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    with open(err_path) as fh:
        tail = fh.read()[-800:]
    return {"error": f"{why}: {tail.strip()}"}


def _verify_estimate(samples: list[tuple[float, int]], blocks: int, file_size: int) -> dict[str, Any]:
    """Verify stopped at its cap: the blocks read so far (bytes read / file size) and the time the rest
    would take at the read rate of the last half of the window."""
    t_end, r_end = samples[-1]
    t_mid, r_mid = next((t, r) for t, r in samples if t >= t_end / 2)
    done = r_end // file_size
    rate = (r_end - r_mid) / file_size / max(t_end - t_mid, 1e-9)
    est = t_end + (blocks - done) / rate if rate > 0 else None
    return {"estimated": True, "verified_blocks": int(done),
            "estimated_total_s": None if est is None else round(est, 1)}


def _attach_strace(pid: int, path: str) -> subprocess.Popen:
    """strace -f -c attached to every thread of ``pid``; returns once it is attached."""
    tids = ",".join(os.listdir(f"/proc/{pid}/task"))
    tracer = subprocess.Popen(["strace", "-f", "-c", "-o", path, "-p", tids], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if select.select([tracer.stderr], [], [], 0.5)[0] and "attached" in tracer.stderr.readline():
            break
    time.sleep(0.2)  # every thread's attach line follows the first
    return tracer


def _strace_counts(tracer: subprocess.Popen, path: str) -> dict[str, int]:
    tracer.wait(timeout=60)
    counts: dict[str, int] = {}
    with open(path) as fh:
        for line in fh:
            fields = line.split()
            if len(fields) >= 5 and re.fullmatch(r"[0-9.]+", fields[0]) and fields[-1] != "total":
                counts[fields[-1]] = int(fields[3])
    return counts


def _fs_cost(calls: dict[str, int]) -> dict[str, Any]:
    groups = {g: sum(calls.get(n, 0) for n in names) for g, names in SYSCALL_GROUPS.items()}
    total = sum(groups.values())
    return {"fs_calls": groups, "fs_ops": total,
            **{f"nfs_{int(lat * 1e4) / 10:g}ms_s": round(total * lat, 1) for lat in NFS_LATENCIES_S}}


# -- one pool size -----------------------------------------------------------------------------------
def removal_params(meta: scale_pool.PoolMeta, usage: int | None = None) -> dict[str, Any]:
    """Quota and low watermark under which one pass frees ``meta.target`` blocks' bytes: the pool (of
    ``usage`` bytes, by default as built) is just over the quota, and the watermark is what is left after
    the target."""
    usage = meta.bytes if usage is None else usage
    quota = usage - meta.file_size
    return {"quota": quota, "low_watermark": (usage - meta.target * meta.file_size) / quota}


def bench_size(directory: str, blocks: int, args: argparse.Namespace, log: Callable[[str], None],
               save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Build (or reuse) the pool of ``blocks`` blocks and run every pass over it; ``save`` gets the size's
    results after each operation, so a run stopped midway keeps what it measured."""
    meta = scale_pool.load_meta(directory) if args.reuse else None
    if meta is not None and meta.blocks != blocks:
        meta = None
    if meta is None:
        log(f"building a pool of {blocks:,} blocks in {directory} ({args.processes} processes)")
        meta = scale_pool.build(directory, blocks, processes=args.processes, progress=log)
        log(f"built in {meta.build_s:.1f} s, {meta.build_rate:,.0f} blocks/s")
        built = True
    else:
        log(f"reusing the pool of {blocks:,} blocks in {directory}")
        built = False
    size = {"blocks": blocks, "dir": directory, "built": built, "build_s": meta.build_s,
            "build_rate": meta.build_rate, "build_processes": meta.processes, "target": meta.target,
            "disk_used_mb": _disk_used_mb(meta.root), "runs": [], "restores": [], "settles": []}
    passes = {"warm": [("warm", False, False)], "cold": [("cold", True, False)],
              "both": [("warm", False, False), ("cold", True, False)]}[args.cache]
    if args.strace:
        passes.append(("strace", False, True))
    base = {"root": meta.root, "blocks": blocks, "verify_limit_s": args.verify_limit_s, **removal_params(meta)}
    for label, cold, strace in passes:
        for op in args.ops:
            params = dict(base)
            if op in SETTLED:  # and the quota set from the pool as it is, should a block be missing
                settled = scale_pool.settle(meta)
                size["settles"].append({"before": f"{op} ({label})", **settled})
                params.update(removal_params(meta, settled["usage_bytes"]))
            if op == "gc_max_age":
                params["max_age_s"] = round((time.time_ns() - meta.expire_cutoff_ns) / 1e9, 3)
            res = run_op(op, os.path.join(directory, scale_pool.META_NAME), params, args.limit_s, cold=cold,
                         strace=strace, file_size=meta.file_size)
            _per_unit(res, blocks)
            size["runs"].append(res)
            log("  " + _one_line(res))
            if op in DESTRUCTIVE:
                t0 = time.monotonic()
                n = scale_pool.restore(meta)
                size["restores"].append({"after": f"{op} ({label})", "blocks": n, "s": round(time.monotonic() - t0, 2)})
            save(size)
    return size


def _per_unit(res: dict[str, Any], blocks: int) -> None:
    """fs ops per evicted block (removers) or per pool block (stats, verify, dry run)."""
    if "fs_ops" not in res:
        return
    detail = res.get("detail", {})
    if res["op"] in DESTRUCTIVE and detail.get("evicted_blocks"):
        res["fs_ops_per_evicted_block"] = round(res["fs_ops"] / detail["evicted_blocks"], 2)
    elif res["op"] == "verify" and res.get("estimated"):
        res["fs_ops_per_block"] = round(res["fs_ops"] / max(res["verified_blocks"], 1), 2)
    elif res["op"] in ("stats", "verify", "gc_dry_run"):
        res["fs_ops_per_block"] = round(res["fs_ops"] / blocks, 3)


def _disk_used_mb(path: str) -> float | None:
    try:
        out = subprocess.run(["du", "-sm", path], capture_output=True, text=True, timeout=600).stdout
        return float(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _one_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['op']:<11} {r['cache']:<6} FAILED {r['error'][:300]}"
    t = f"timed out after {r['seconds']:.0f} s" if r.get("timed_out") else f"{r['seconds']:.3f} s"
    if r.get("estimated"):
        t += f" ({r['verified_blocks']:,} blocks read; whole pool estimated {r['estimated_total_s']} s)"
    extra = f" fs ops {r['fs_ops']:,}" if "fs_ops" in r else ""
    return f"{r['op']:<11} {r['cache']:<6} {t}  peak RSS {r.get('peak_rss_mb')} MB{extra}  {r.get('detail', '')}"


# -- report ------------------------------------------------------------------------------------------
def table(sizes: list[dict[str, Any]]) -> str:
    """Per size: time and RSS per operation and cache state, fs ops and the NFS model from the strace
    pass, and the growth of time against the previous size in the same run."""
    lines: list[str] = []
    prev: dict[tuple[str, str], dict[str, Any]] = {}
    for s in sizes:
        traced = {r["op"]: r for r in s["runs"] if r["cache"] == "strace"}
        lines.append(f"\n{s['blocks']:,} blocks ({s['disk_used_mb']} MB on disk; built in {s['build_s']} s at "
                     f"{s['build_rate']:,} blocks/s by {s['build_processes']} processes"
                     f"{'' if s['built'] else ', reused'}); removers target {s['target']:,} blocks")
        lines.append(f"{'operation':<12}{'cache':<7}{'seconds':>12}{'x prev':>8}{'peak RSS MB':>13}{'fs ops':>12}"
                     f"{'ops/unit':>10}{'NFS 0.5ms s':>13}{'NFS 1ms s':>11}  detail")
        cur: dict[tuple[str, str], dict[str, Any]] = {}
        for r in s["runs"]:
            if r["cache"] == "strace":
                continue
            cur[(r["op"], r["cache"])] = r
            tr = traced.get(r["op"], {})
            secs = "error" if "error" in r else (f">{r['seconds']:.0f}" if r.get("timed_out") else f"{r['seconds']:.3f}")
            p = prev.get((r["op"], r["cache"]))
            growth = (f"{r['seconds'] / p['seconds']:.1f}" if p and r.get("seconds") and p.get("seconds")
                      and not r.get("timed_out") and not p.get("timed_out") else "")
            unit = tr.get("fs_ops_per_evicted_block", tr.get("fs_ops_per_block", ""))
            detail = r.get("detail", r.get("error", ""))
            if r.get("estimated"):
                detail = f"{r['verified_blocks']:,} read in the cap; whole pool ~{r['estimated_total_s']} s (estimated)"
            lines.append(f"{r['op']:<12}{r['cache']:<7}{secs:>12}{growth:>8}{r.get('peak_rss_mb', ''):>13}"
                         f"{tr.get('fs_ops', ''):>12}{unit:>10}{tr.get('nfs_0.5ms_s', ''):>13}"
                         f"{tr.get('nfs_1ms_s', ''):>11}  {detail}")
        for op, tr in traced.items():
            if "fs_calls" in tr:
                lines.append(f"  {op:<11} calls: " + ", ".join(f"{k} {v:,}" for k, v in tr["fs_calls"].items())
                             + (" (partial: verify cap)" if tr.get("timed_out") else ""))
        prev = cur
    return "\n".join(lines)


def parse_count(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"a block count such as 20000, 100k or 1M, not {text!r}")
    return int(float(m[1]) * _SUFFIX.get(m[2].lower(), 1))


def _label(blocks: int) -> str:
    for suffix, mult in (("M", 10**6), ("k", 10**3)):
        if blocks % mult == 0:
            return f"{blocks // mult}{suffix}"
    return str(blocks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", default="1M,10M", help="pool sizes, comma-separated (20000, 100k, 1M)")
    p.add_argument("--dir", default="/var/tmp/scale", help="where pools are built: one folder per size")
    p.add_argument("--json", help="write every measurement here")
    p.add_argument("--ops", default=",".join(OPS), help=f"operations, comma-separated, of {', '.join(OPS)}")
    p.add_argument("--limit-s", type=float, default=900.0, help="time limit of one operation")
    p.add_argument("--verify-limit-s", type=float, default=120.0, help="verify's cap: the rest is estimated")
    p.add_argument("--cache", choices=("warm", "cold", "both"), default="both",
                   help="page cache before each operation (cold: dropped, needs root)")
    p.add_argument("--no-strace", dest="strace", action="store_false", help="no file-system call counts")
    p.add_argument("--reuse", action="store_true", help="use a pool built before at the same size, and keep it")
    p.add_argument("--keep", action="store_true", help="keep the pools built (default: delete each once measured)")
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="pool builder processes")
    p.add_argument("--quick", action="store_true", help=f"--blocks {QUICK_BLOCKS} --cache warm --verify-limit-s 30")
    args = p.parse_args(argv)
    if args.quick:
        args.blocks, args.cache, args.verify_limit_s = QUICK_BLOCKS, "warm", min(args.verify_limit_s, 30.0)
    try:
        sizes = [parse_count(b) for b in args.blocks.split(",") if b.strip()]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in args.ops if o not in OPS]
    if unknown:
        p.error(f"unknown operation(s) {', '.join(unknown)}; choose from {', '.join(OPS)}")
    if args.strace and shutil.which("strace") is None:
        print("scale_bench: strace not found: no file-system call counts (apt-get install -y strace)", file=sys.stderr)
        args.strace = False
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    report: dict[str, Any] = {"argv": sys.argv[1:], "commit": _commit(), "cpus": os.cpu_count(), "sizes": []}
    def save(size: dict[str, Any]) -> None:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(report | {"sizes": [*report["sizes"], size]}, fh, indent=1)

    for blocks in sizes:
        directory = os.path.join(args.dir, _label(blocks))
        report["sizes"].append(bench_size(directory, blocks, args, log, save))
        if not (args.keep or args.reuse):
            shutil.rmtree(directory, ignore_errors=True)
    print(f"commit: {report['commit']}")
    print(table(report["sizes"]))
    return 0


def _commit() -> str:
    """The commit measured: GDS_KV_COMMIT where set (a tree unpacked from ``git archive``), else the
    package's checkout, marked when its package files differ from that commit."""
    if os.environ.get("GDS_KV_COMMIT"):
        return os.environ["GDS_KV_COMMIT"]
    import gds_kv_connector
    where = os.path.dirname(os.path.abspath(gds_kv_connector.__file__))
    try:
        head = subprocess.run(["git", "log", "-1", "--oneline"], capture_output=True, text=True, timeout=10,
                              cwd=where).stdout.strip()[:100]
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], capture_output=True, text=True,
                               timeout=30, cwd=where).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{head} + uncommitted changes" if dirty else head


if __name__ == "__main__":
    if sys.argv[1:2] == ["_child"]:
        _child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    else:
        sys.exit(main())

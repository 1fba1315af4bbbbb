#!/usr/bin/env python
"""gds-kv-connector benchmark: ceilings, baselines, the connector's own paths, executor cost, overlap.

One command, one machine, one run; every ratio it prints is between numbers measured in this run.

Phases (each bounded in bytes and in time; the whole run shares a time budget, --budget-s):

* ceilings   pinned host<->device copy bandwidth (CUDA only) and raw storage bandwidth of every
             target directory (O_DIRECT with page-aligned mmap buffers where the filesystem allows
             it; best over 1,2,4,8,16 parallel streams of 4 MiB pwrite/pread, page cache dropped
             before reads; writes both into new files and again in place, which ext4 takes faster);
* baselines  the TensorRT-LLM example's per-block ``torch.save(block.cpu())`` / ``torch.load`` +
             ``copy_``, and naive KvikIO (one ``kvikio.CuFile`` per block, library defaults,
             sequential ``pwrite``/``pread(...).get()``; CUDA + KvikIO only);
* connector  the store's ``save`` and ``pin`` + ``load`` (``store.base.open_store``, checksums on) with the
             engine the connector would choose (``make_engine("auto", ...)``), per block size and
             target, disk loads from a cold page cache;
* executor   connector callback time on the executor thread through the reference executor
             (64-request batch, 32 layers), and the match time of a fully cached 128k-token prompt;
* overlap    (CUDA only) slowdown of a bf16 matmul loop while saves and loads run concurrently.

Usage: ``gds-kv bench [--quick] [--json FILE] [--trace FILE] ...``.  What each figure means:
docs/performance.md; running it on a GPU host: profiling/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from typing import Any, Callable

from gds_kv_connector.bench.common import (  # noqa: E402
    Budget, DEFAULT_SIZES, KvikioDefaults, MiB, QUICK_SIZES, Tracer, opt_version, rand_bytes, fmt_size,
    git_commit)

import torch  # noqa: E402

from gds_kv_connector.store.arena import HOST_FS_TYPES  # noqa: E402
from gds_kv_connector.util.mounts import fs_type  # noqa: E402
from gds_kv_connector.format.records import ZERO_KEY, file_size_for  # noqa: E402
from gds_kv_connector.config import trace_ranges  # noqa: E402
from gds_kv_connector.config.settings import parse_size  # noqa: E402
from gds_kv_connector.bench.ceilings import best_pinned, pinned_copy_ceiling, raw_beside, raw_phases, raw_storage_ceiling  # noqa: E402
from gds_kv_connector.bench.connector import ConnectorRig, median_run, connector_phase  # noqa: E402
from gds_kv_connector.bench.baselines import baseline_naive_kvikio, baseline_trtllm  # noqa: E402
from gds_kv_connector.bench.executor import (executor_cost, match_time, median_executor_run, null_connector_us,  # noqa: E402
                            python_reference_us)
from gds_kv_connector.bench.overlap import overlap  # noqa: E402
from gds_kv_connector.bench.report import pool_modes, compute_ratios, evaluate_goals, plot, render_table  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gds-kv bench", description=__doc__.splitlines()[0])
    p.add_argument("--ttft", action="store_true", help="time to first token instead: prefill computed against "
                   "loaded from host memory and cold disk, and the load policy (gds-kv bench --ttft --help)")
    p.add_argument("--quick", action="store_true", help="small run for CPU tests: ~64 MiB per phase, 2 sizes")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the KV pool lives")
    p.add_argument("--sizes", help=f"block sizes (default {DEFAULT_SIZES}; --quick {QUICK_SIZES})")
    p.add_argument("--total-mib", type=float, help="bytes per connector phase per size (default 1536 on GPU, "
                   "256 on CPU, 64 with --quick)")
    p.add_argument("--baseline-mib", type=float, help="bytes per baseline phase (default 512, 32 with --quick)")
    p.add_argument("--raw-mib", type=float, help="bytes per raw-storage test (default 1024, 32 with --quick)")
    p.add_argument("--streams", help="parallel streams of the raw-storage tests (default 1,2,4,8,16; --quick 1,2,4)")
    p.add_argument("--shm-dir", help="host-memory target directory (default /dev/shm/gdskv-bench-PID, or a tmp dir)")
    p.add_argument("--disk-dir", help="disk target directory (default ./bench-pool)")
    p.add_argument("--targets", default="shm,disk", help="which targets to run: shm, disk or both")
    p.add_argument("--io-threads", type=int, default=16, help="engine I/O threads (TLLM_GDS_KV_IO_THREADS default)")
    p.add_argument("--transfer-threads", type=int, default=4, help="concurrent batches, like the connector's "
                   "transfer threads (TLLM_GDS_KV_TRANSFER_THREADS default)")
    p.add_argument("--batch-mib", type=float, help="bytes per save/load batch, one block at least (default 64, "
                   "8 with --quick so several transfer threads take part)")
    p.add_argument("--phase-s", type=float, help="time cap per phase (default 10 s, 6 s with --quick)")
    p.add_argument("--budget-s", type=float, help="time budget of the whole run (default 420 s, 150 s with --quick)")
    p.add_argument("--overlap-s", type=float, default=1.5, help="duration of the compute loop (CUDA only)")
    p.add_argument("--repeat", type=int, default=3, help="connector save/load runs per size and target (fresh "
                   "keys each) and executor-cost runs (a fresh pool each); the median run is reported (default 3; "
                   "1 with --quick)")
    p.add_argument("--shm-files", action="store_true", help="host-memory target as one file per block, "
                   "without the slot arena (TLLM_GDS_KV_ARENA_BYTES unset)")
    p.add_argument("--disk-pool", choices=("files", "arena", "both"), default="files",
                   help="how the disk target keeps blocks: one file per block (the connector's default), the slot "
                   "arena on disk (TLLM_GDS_KV_ARENA_BYTES: preallocated slabs, O_DIRECT at slot offsets; rows "
                   "noted 'arena on disk'), or both, one after the other at each size")
    p.add_argument("--gc-gen0", type=int, default=20000, help="Python GC generation-0 threshold for the run; "
                   "the default is what TensorRT-LLM's PyExecutor sets around its loop "
                   "(TorchLlmArgs.garbage_collection_gen0_threshold); 0 keeps Python's own (700)")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--no-executor", action="store_true")
    p.add_argument("--exec-new-tokens", type=int, default=16, help="tokens each of the executor phase's 64 "
                   "requests generates: its rounds run about this many iterations, one of which admits all 64 "
                   "requests, so the average per iteration spreads admission over this many")
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--no-drop-caches", action="store_true", help="never write /proc/sys/vm/drop_caches "
                   "(posix_fadvise DONTNEED is still used on the files read)")
    p.add_argument("--json", help="result file (default ./gds-kv-bench-<host>.json)")
    p.add_argument("--png", help="plot file (default: the JSON path with .png)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace of the run (torch.profiler) to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (on a terminal) or progress lines "
                   "(otherwise)")
    p.add_argument("--keep", action="store_true", help="keep the target directories' bench files")
    return p


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        argv = list(argv)
        if argv[:1] == ["--"]:  # `gds-kv bench -- --quick ...` forwards the separator too
            argv = argv[1:]
    given = argv if argv is not None else sys.argv[1:]
    if "--ttft" in given:  # a bench of its own, with its own options
        from gds_kv_connector.bench.ttft import main as ttft_main
        return ttft_main([a for a in given if a != "--ttft"])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.exec_new_tokens < 1:
        parser.error(f"--exec-new-tokens must be at least 1, got {args.exec_new_tokens}")
    if args.trace and trace_ranges.MODE != "torch":
        # The connector's ranges are settled when the package is imported, which this process has
        # done: run this file again with the options parsed here and the ranges going to
        # torch.profiler, so the trace holds them (the process's own command line may not be the
        # bench's, when main() is called with argv).
        print("gds-kv bench: --trace: starting again with TLLM_GDS_KV_TRACE=torch (the connector's ranges "
              "in the trace)", file=sys.stderr, flush=True)
        os.environ["TLLM_GDS_KV_TRACE"] = "torch"
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__),
                                  *(argv if argv is not None else sys.argv[1:])])
    if args.device == "auto":
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    elif args.device == "cuda":
        if not torch.cuda.is_available():
            print("gds-kv bench: --device cuda but CUDA is not available", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    cuda = device.type == "cuda"
    quick = args.quick
    if quick and "--repeat" not in (argv if argv is not None else sys.argv):
        args.repeat = 1
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if quick else DEFAULT_SIZES)).split(",") if s]
    total = int((args.total_mib or (64 if quick else (1536 if cuda else 256))) * MiB)
    base_total = int((args.baseline_mib or (32 if quick else 512)) * MiB)
    raw_total = int((args.raw_mib or (32 if quick else 1024)) * MiB)
    batch_bytes = int((args.batch_mib or (8 if quick else 64)) * MiB)
    streams = [int(s) for s in (args.streams or ("1,2,4" if quick else "1,2,4,8,16")).split(",") if s]
    budget = Budget(args.budget_s or (150 if quick else 420), args.phase_s or (6 if quick else 10))
    global_drop = not args.no_drop_caches
    host = socket.gethostname()
    json_path = args.json or f"gds-kv-bench-{host}.json"
    png_path = args.png or (os.path.splitext(json_path)[0] + ".png")
    want = [t.strip() for t in args.targets.split(",") if t.strip()]

    # target directories
    made: list[str] = []
    targets: dict[str, dict] = {}
    # Every target gets a fresh subdirectory of its own, removed at the end; the given directories
    # themselves are never removed (only their bench-pool default, when this run created it).
    if "shm" in want:
        if args.shm_dir:
            base = os.path.abspath(args.shm_dir)
        elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
            base = "/dev/shm"
        else:
            base = tempfile.gettempdir()
        targets["shm"] = {"dir": os.path.join(base, f"gdskv-bench-{os.getpid()}"), "memory": True}
    if "disk" in want:
        base = os.path.abspath(args.disk_dir or "bench-pool")
        targets["disk"] = {"dir": os.path.join(base, f"gdskv-bench-{os.getpid()}"), "memory": False,
                           "parent": base if not args.disk_dir else None, "parent_existed": os.path.isdir(base)}
    for t, info in targets.items():
        os.makedirs(info["dir"], exist_ok=True)
        made.append(info["dir"])
        info["fs"] = fs_type(info["dir"])
        if info["memory"] and info["fs"] not in ("tmpfs", "ramfs"):
            info["note"] = f"host-memory target is on {info['fs']}, not tmpfs"

    kvd = KvikioDefaults()
    versions = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                "numpy": opt_version("numpy"), "kvikio": opt_version("kvikio"), "cupy": opt_version("cupy"),
                "nvtx": opt_version("nvtx"), "matplotlib": opt_version("matplotlib")}
    res: dict[str, Any] = {
        "meta": {"hostname": host, "git": git_commit(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "device": torch.cuda.get_device_name(device) if cuda else "cpu", "pool_device": str(device),
                 "cpu_count": os.cpu_count(), "kernel": platform.release(), "versions": versions,
                 "kvikio_defaults_at_start": kvd.describe(), "argv": list(argv) if argv is not None else sys.argv[1:],
                 "env": {k: v for k, v in os.environ.items() if k.startswith(("KVIKIO_", "CUFILE_", "TLLM_GDS_KV_"))}},
        "config": {"quick": quick, "sizes": sizes, "bytes_per_connector_phase": total,
                   "bytes_per_baseline_phase": base_total, "bytes_per_raw_test": raw_total, "streams": streams,
                   "io_threads": args.io_threads, "transfer_threads": args.transfer_threads,
                   "batch_bytes": batch_bytes, "phase_cap_s": budget.phase_cap,
                   "budget_s": budget.total, "checksums": True, "drop_caches_global": global_drop,
                   "gc_threshold": list(gc.get_threshold()) if args.gc_gen0 <= 0 else
                   [args.gc_gen0, *gc.get_threshold()[1:]]},
        "units": {"GBps": "1e9 bytes per second", "seconds": "wall-clock seconds", "bytes": "bytes",
                  "us": "microseconds", "ms": "milliseconds", "pct": "percent"},
        "targets_info": targets, "ceilings": {"pinned_copy": None, "storage": {}}, "baselines": [], "connector": [],
        "executor": None, "match": None, "overlap": None, "errors": [], "notes": [],
    }

    has_kvikio = cuda and kvd.kv is not None
    n_methods = (0 if args.no_baselines else 1 + int(has_kvikio))
    modes = {t: pool_modes(info, args) for t, info in targets.items()}  # use the arena or not, in turn
    budget.phases_left = (2 + len(targets) * raw_phases(streams)
                          + sum(2 * (args.repeat * len(modes[t]) + n_methods) for t in targets) * len(sizes)
                          + sum(2 * len(modes[t]) for t, info in targets.items() if not info["memory"]) * len(sizes)
                          + (0 if args.no_executor else 2) + (1 if cuda and not args.no_overlap else 0))
    steps = (2 * int(cuda) + len(targets) + len(targets) * len(sizes) + (0 if args.no_executor else 2)
             + (1 if cuda and not args.no_overlap else 0))
    bar = None
    if not args.no_progress and sys.stderr.isatty():  # a log (e.g. a remote run) gets plain lines instead
        try:
            from tqdm import tqdm
            bar = tqdm(total=steps, desc="bench", unit="phase", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            bar = None

    marks: list[tuple[str, float]] = []

    def progress(msg: str) -> None:
        marks.append((msg, time.monotonic()))
        if bar is not None:
            bar.set_postfix_str(msg[:40], refresh=True)
        elif not args.no_progress:
            print(f"[bench {time.monotonic() - budget.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def step_done() -> None:
        if bar is not None:
            bar.update(1)

    def guarded(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - one failed phase must not lose the others
            import traceback
            res["errors"].append(f"{what}: {type(exc).__name__}: {exc}")
            traceback.print_exc(file=sys.stderr)
            return None

    rc = 0
    gc_default = gc.get_threshold()
    if args.gc_gen0 > 0:
        gc.set_threshold(args.gc_gen0)
    try:
        with Tracer(args.trace, cuda) as tracer:
            # -- ceilings
            if cuda:
                progress("pinned copy ceiling")
                res["ceilings"]["pinned_copy"] = guarded("pinned copy", lambda: pinned_copy_ceiling(device, quick, tracer))
                budget.phases_left -= 1
                step_done()
            for t, info in targets.items():
                r = guarded(f"raw storage {t}", lambda: raw_storage_ceiling(
                    t, info["dir"], streams, raw_total, budget, global_drop, info["memory"], tracer, progress))
                res["ceilings"]["storage"][t] = r or {"io": "failed", "write": {}, "read": {}}
                step_done()

            # -- connector and baselines, per target and size
            for t, info in targets.items():
                for size in sizes:
                    label = f"{t}/{fmt_size(size)}"
                    progress(f"connector {label}")
                    fsize = file_size_for(size)
                    n = max(4, total // size)
                    free = shutil.disk_usage(info["dir"]).free
                    if n * fsize > 0.45 * free:
                        n2 = max(2, int(0.45 * free) // fsize)
                        res["notes"].append(f"{label}: {n} blocks do not fit in {free >> 20} MiB free; using {n2}")
                        n = n2
                    nb = max(4, min(n, base_total // size))

                    def one_size() -> None:
                        kv = rand_bytes((n, size), device, size)
                        for use_arena in modes[t]:
                            connector_rows(kv, use_arena)
                        baselines(kv)

                    def connector_rows(kv: torch.Tensor, use_arena: bool) -> None:
                        arena = args.repeat * (n + 2) * fsize + (256 << 20) if use_arena else 0
                        rig = ConnectorRig(os.path.join(info["dir"], f"pool-{fmt_size(size)}"), size, device,
                                           args.io_threads, label, kvd, arena_bytes=arena,
                                           transfer_threads=args.transfer_threads)
                        try:
                            rig.warm_up()
                            info["engine_data_path"] = rig.engine.data_path()
                            batch = max(1, batch_bytes // size)
                            runs = []
                            for rep in range(args.repeat):  # fresh keys and fresh random bytes each time
                                if rep:
                                    kv.random_(0, 256)
                                keys = [hashlib.sha256(f"{label}/{time.time_ns()}/{rep}/{i}".encode()).digest()
                                        for i in range(n)]
                                parents = [ZERO_KEY] + keys[:-1]
                                runs.append(connector_phase(rig, kv, keys, parents, batch,
                                                            budget, info["memory"], global_drop, tracer, label))
                            save, load = (median_run([r[k] for r in runs]) for k in (0, 1))
                            sweep = res["ceilings"]["storage"].get(t) or {}
                            if not info["memory"] and sweep.get("o_direct"):
                                beside = guarded(f"raw beside {label}", lambda: raw_beside(
                                    info["dir"], sweep, budget, global_drop, tracer, label)) or {}
                                save["raw_beside_GBps"] = beside.get("write_GBps")
                                load["raw_beside_GBps"] = beside.get("read_GBps")
                            for row in (save, load):
                                row.update({"target": t, "block_bytes": size, "engine": rig.engine.data_path(),
                                            "pool_mode": rig.mode, "arena_setup_s": rig.arena_setup_s,
                                            "batch_blocks": batch, "transfer_threads": args.transfer_threads,
                                            "io_threads": args.io_threads, "checksums": True})
                                res["connector"].append(row)
                        finally:
                            rig.close()
                            if not args.keep:
                                shutil.rmtree(rig.root, ignore_errors=True)

                    def baselines(kv: torch.Tensor) -> None:
                        if not args.no_baselines:
                            progress(f"trtllm example {label}")
                            rows = guarded(f"trtllm baseline {label}", lambda: baseline_trtllm(
                                kv, nb, os.path.join(info["dir"], "baseline-trtllm"), budget, info["memory"],
                                global_drop, tracer, label))
                            for row in rows or ():
                                row.update({"target": t, "block_bytes": size})
                                res["baselines"].append(row)
                            if has_kvikio:
                                progress(f"naive kvikio {label}")
                                rows = guarded(f"naive kvikio baseline {label}", lambda: baseline_naive_kvikio(
                                    kv, nb, os.path.join(info["dir"], "baseline-kvikio"), budget, info["memory"],
                                    global_drop, kvd, tracer, label))
                                for row in rows or ():
                                    row.update({"target": t, "block_bytes": size})
                                    res["baselines"].append(row)

                    guarded(f"connector {label}", one_size)
                    if cuda:
                        torch.cuda.empty_cache()
                    step_done()
            if not has_kvikio and not args.no_baselines:
                res["notes"].append("naive KvikIO baseline skipped: " + ("no CUDA" if not cuda else "kvikio not importable"))
            if cuda:  # once more, warm: a first measurement can come out a sixth low (a cold GPU or host)
                progress("pinned copy ceiling, again")
                again = guarded("pinned copy again", lambda: pinned_copy_ceiling(device, quick, tracer))
                res["ceilings"]["pinned_copy"] = best_pinned(res["ceilings"]["pinned_copy"], again)
                budget.phases_left -= 1
                step_done()

            # -- executor thread
            exec_root = targets.get("shm", next(iter(targets.values()), {"dir": tempfile.mkdtemp()}))["dir"]
            exec_arena = (512 << 20 if "shm" in targets and targets["shm"].get("fs") in HOST_FS_TYPES
                          and not args.shm_files else 0)
            if not args.no_executor:
                progress("executor cost")
                with tracer.rf("bench/executor"):
                    runs = [guarded("executor cost", lambda rep=rep: executor_cost(
                        os.path.join(exec_root, f"exec-pool-{rep}"), device, kvd, tracer, arena_bytes=exec_arena,
                        new_tokens=args.exec_new_tokens)) for rep in range(args.repeat)]
                    res["executor"] = median_executor_run([r for r in runs if r]) or {"error": "failed"}
                    ex = res["executor"]
                    if "error" not in ex:
                        ex["python_reference_us"] = python_reference_us(ex["requests_per_batch"])
                        ex["null_connector_us_per_iteration"] = guarded("null connector", lambda: null_connector_us(
                            device, ex["requests_per_batch"], ex["num_layers"], args.exec_new_tokens))
                budget.phases_left -= 1
                step_done()
                progress("128k match")
                with tracer.rf("bench/match"):
                    res["match"] = guarded("match time", lambda: match_time(
                        os.path.join(exec_root, "match-pool"), device, args.io_threads, kvd, tracer,
                        budget.cap(5.0), arena_bytes=exec_arena)) or {"error": "failed"}
                budget.phases_left -= 1
                step_done()
                for d in [f"exec-pool-{rep}" for rep in range(args.repeat)] + ["match-pool"]:
                    shutil.rmtree(os.path.join(exec_root, d), ignore_errors=True)

            # -- overlap
            if cuda and not args.no_overlap:
                progress("overlap")
                blk = min(sizes, key=lambda s: abs(s - 2.25 * MiB))
                with tracer.rf("bench/overlap"):
                    res["overlap"] = guarded("overlap", lambda: overlap(
                        exec_root, device, args.io_threads, args.transfer_threads, blk, kvd,
                        min(args.overlap_s, max(0.5, budget.left() / 4)), tracer)) or {"error": "failed"}
                budget.phases_left -= 1
                step_done()
            else:
                res["overlap"] = {"skipped": "no CUDA device" if not cuda else "--no-overlap"}
    finally:
        gc.set_threshold(*gc_default)
        if bar is not None:
            bar.close()
        if not args.keep:
            for t, info in targets.items():
                shutil.rmtree(info["dir"], ignore_errors=True)
                parent = info.get("parent")
                if parent and not info.get("parent_existed"):
                    with contextlib.suppress(OSError):
                        os.rmdir(parent)

    res["meta"]["wall_s"] = round(time.monotonic() - budget.t0, 2)
    ends = [t for _, t in marks[1:]] + [time.monotonic()]
    res["meta"]["phase_seconds"] = [[m, round(e - t, 3)] for (m, t), e in zip(marks, ends)]
    compute_ratios(res)
    res["goals"] = evaluate_goals(res)
    if args.trace:
        res["meta"]["trace"] = os.path.abspath(args.trace)
        res["notes"].append("measured with torch.profiler tracing on: numbers include its overhead")
    res["meta"]["plot"] = plot(res, png_path)
    os.makedirs(os.path.dirname(os.path.abspath(json_path)) or ".", exist_ok=True)
    with open(json_path, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(render_table(res))
    for note in res["notes"]:
        print(f"note: {note}")
    print(f"\nJSON: {os.path.abspath(json_path)}")
    print(f"plot: {res['meta']['plot']}")
    if args.trace:
        print(f"trace: {os.path.abspath(args.trace)}")
    print(f"wall: {res['meta']['wall_s']} s")
    if res["errors"]:
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())

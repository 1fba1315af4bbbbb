"""The report: ratios, goal lines, the table and the plot."""

from __future__ import annotations

import argparse
import os

from gds_kv_connector.store.arena import HOST_FS_TYPES
from gds_kv_connector.bench.common import GOALS, MiB, fmt_size


def ceiling_for(res: dict, target: str, direction: str) -> tuple[float | None, str]:
    pinned = res["ceilings"].get("pinned_copy")
    raw = res["ceilings"]["storage"].get(target) or {}
    rw = "write" if direction == "save" else "read"
    raw_bw = (raw.get(rw) or {}).get("best_GBps")
    if res["targets_info"][target]["memory"]:
        if pinned:
            key = "d2h_GBps" if direction == "save" else "h2d_GBps"
            return pinned.get(key), f"pinned {key[:3].upper()}"
        return raw_bw, f"host {rw} ({raw.get('io', '?')})"
    return raw_bw, f"raw {rw} ({'O_DIRECT' if raw.get('o_direct') else 'buffered'})"


def _find(rows: list[dict], **kw) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def compute_ratios(res: dict) -> None:
    for row in res["connector"]:
        ceil, what = ceiling_for(res, row["target"], row["direction"])
        row["ceiling_GBps"], row["ceiling"] = ceil, what
        row["ratio_to_ceiling"] = round(row["GBps"] / ceil, 4) if ceil else None
        beside = row.get("raw_beside_GBps")
        row["ratio_to_raw_beside"] = round(row["GBps"] / beside, 4) if beside else None
        for method in ("trtllm_example", "naive_kvikio"):
            b = _find(res["baselines"], method=method, target=row["target"], block_bytes=row["block_bytes"],
                      direction=row["direction"])
            row[f"x_{method}"] = round(row["GBps"] / b["GBps"], 3) if b and b.get("GBps") else None


def pool_modes(info: dict, args: argparse.Namespace) -> tuple[bool, ...]:
    """Whether each connector pass at one size uses the slot arena: a host-memory target runs it
    unless --shm-files; a disk target as --disk-pool says."""
    if info.get("fs") in HOST_FS_TYPES or info.get("memory"):
        return (info.get("fs") in HOST_FS_TYPES and not args.shm_files,)
    return {"files": (False,), "arena": (True,), "both": (False, True)}[args.disk_pool]


def evaluate_goals(res: dict) -> list[dict]:
    goals: list[dict] = []

    def add(name: str, goal: str, measured: str, ok: bool | None, why: str = "") -> None:
        goals.append({"goal": name, "target": goal, "measured": measured,
                      "status": "n/a" if ok is None else ("PASS" if ok else "MISS"), "note": why})

    conn = res["connector"]
    mem = [t for t, info in res["targets_info"].items() if info["memory"]]
    disk = [t for t, info in res["targets_info"].items() if not info["memory"]]
    pinned = res["ceilings"].get("pinned_copy")
    ceil_note = "" if pinned else "no CUDA: ceiling is host-memory bandwidth of the tmpfs target"

    def worst(rows: list[dict], key: str) -> tuple[dict | None, float | None]:
        rows = [r for r in rows if r.get(key) is not None]
        if not rows:
            return None, None
        r = min(rows, key=lambda r: r[key])
        return r, r[key]

    def label(r: dict) -> str:
        return f"{r['target']} {r['direction']} {fmt_size(r['block_bytes'])}"

    for name, lo, hi, g in (("host-memory pool >=1MiB vs pinned-copy ceiling", MiB, None, GOALS["host_ge1m_vs_pinned"]),
                            ("host-memory pool 256KiB vs pinned-copy ceiling", 0, MiB, GOALS["host_256k_vs_pinned"])):
        rows = [r for r in conn if r["target"] in mem and r["block_bytes"] >= lo and (hi is None or r["block_bytes"] < hi)]
        r, v = worst(rows, "ratio_to_ceiling")
        add(name, f">= {g:.0%} both directions", f"worst {v:.0%} ({label(r)})" if r else "not measured",
            None if r is None else v >= g, ceil_note)
    disk_rows = [x for x in conn if x["target"] in disk]
    for mode in sorted({x.get("pool_mode", "block files") for x in disk_rows}) or ["block files"]:
        rows = [x for x in disk_rows if x.get("pool_mode", "block files") == mode]
        r, v = worst(rows, "ratio_to_ceiling")
        rb, vb = worst(rows, "ratio_to_raw_beside")
        beside_note = (f"; against the raw legs re-measured beside each row, worst {vb:.0%} ({label(rb)})"
                       if rb else "")
        add("disk pool vs raw O_DIRECT ceiling" + ("" if mode == "block files" else f" ({mode})"),
            f">= {GOALS['disk_vs_raw']:.0%} both directions, every size",
            f"worst {v:.0%} ({label(r)})" if r else "not measured", None if r is None else v >= GOALS["disk_vs_raw"],
            "saves counted until syncfs returns (bytes on the device)" + beside_note)
    trt_rows = [x for x in conn if x["target"] in mem]
    r, v = worst(trt_rows, "x_trtllm_example")
    add("vs TensorRT-LLM example path (host-memory pool)", f">= {GOALS['host_vs_trtllm_x']:g}x every size",
        f"worst {v:.1f}x ({label(r)})" if r else "not measured",
        None if r is None else v >= GOALS["host_vs_trtllm_x"], _trtllm_bound_note(trt_rows, GOALS["host_vs_trtllm_x"]))
    r, v = worst(conn, "x_naive_kvikio")
    add("vs naive KvikIO", "> 1x every size, target and direction",
        f"worst {v:.2f}x ({label(r)})" if r else "not measured", None if r is None else v > 1.0,
        "" if r else "needs CUDA and KvikIO")
    ex = res.get("executor") or {}
    if ex.get("callback_us_per_iteration") is not None:
        cb, hook = ex["callback_us_per_iteration"], ex["layer_hook_us_per_call"]
        own = ex.get("layer_hook_us_per_call_excl_sync_load_wait", hook)
        per_round = "; ".join(f"round {i}: {x['callback_us_per_iteration']:.1f} us/iter, "
                              f"{x['layer_hook_us_per_call']:.2f} us/hook" for i, x in enumerate(ex["rounds"]))
        runs = ex.get("callback_us_per_iteration_runs") or [cb]
        of_runs = f"median of {len(runs)} runs ({min(runs):.1f}-{max(runs):.1f}); " if len(runs) > 1 else ""
        add("executor callbacks per iteration", f"<= {GOALS['exec_callback_us_per_iter']:g} us avg",
            f"{cb:.1f} us ({of_runs}{per_round})", cb <= GOALS["exec_callback_us_per_iter"],
            f"{ex['requests_per_batch']} requests of {ex['prompt_tokens']} prompt tokens, {ex['max_new_tokens']} new "
            f"tokens each: admission is spread over that many iterations{_null_connector(ex)}{_python_reference(ex)}")
        add("executor per layer hook", f"<= {GOALS['exec_layer_hook_us']:g} us",
            f"{own:.2f} us ({hook:.2f} us with the {1e3 * ex.get('sync_load_wait_s', 0):.1f} ms that layer 0's hooks "
            f"waited for synchronous loads' bytes)", own <= GOALS["exec_layer_hook_us"],
            "the goal is read as the hooks' own cost; the wait is the loads' transfer time")
    else:
        add("executor callbacks", "<= 100 us/iter, <= 5 us/hook", "not measured", None)
    m = res.get("match") or {}
    if m.get("warm_median_ms") is not None:
        add("128k-token prompt match (warm index)", f"<= {GOALS['match_128k_ms']:g} ms",
            f"median {m['warm_median_ms']:.2f} ms (min {m['warm_min_ms']:.2f}, first {m['first_call_ms']:.1f})",
            m["warm_median_ms"] <= GOALS["match_128k_ms"],
            "the request's get_tokens makes a new int per token, as TensorRT-LLM's binding does")
    if m.get("unindexed_median_ms") is not None:
        add("128k-token prompt match (unindexed: saved elsewhere)", f"<= {GOALS['match_128k_ms']:g} ms",
            f"median {m['unindexed_median_ms']:.2f} ms (min {m['unindexed_min_ms']:.2f})",
            m["unindexed_median_ms"] <= GOALS["match_128k_ms"],
            "every block file stat'ed, as a process that did not save the prompt finds it")
    else:
        add("128k-token prompt match", "<= 5 ms", "not measured", None)
    ov = res.get("overlap") or {}
    if ov.get("slowdown_pct") is not None:
        add("compute slowdown with transfers", f"<= {GOALS['overlap_slowdown_pct']:g}%",
            f"{ov['slowdown_pct']:.1f}% wall ({ov['slowdown_gpu_pct']:.1f}% GPU time) at "
            f"{ov['transfer_GBps_during_compute']:.1f} GB/s", ov["slowdown_pct"] <= GOALS["overlap_slowdown_pct"])
    else:
        add("compute slowdown with transfers", "<= 5%", ov.get("skipped", "not measured"), None)
    return goals


def _null_connector(ex: dict) -> str:
    null = ex.get("null_connector_us_per_iteration")
    return "" if null is None else (f"; a connector that does nothing costs {null:.1f} us/iter in the same executor "
                                    "(the calls themselves)")


def _python_reference(ex: dict) -> str:
    ref = ex.get("python_reference_us")
    return "" if ref is None else (f"; this host reads {ex['requests_per_batch']} reports' fields in {ref:.2f} us "
                                   "(host Python reference)")


def _trtllm_bound_note(rows: list[dict], goal_x: float) -> str:
    """Rows where the goal multiple of the example's own speed is above the ceiling: no connector could
    reach it there, and the note says so with the figures (ceiling = GB/s / ratio to it)."""
    bounded, room = [], []
    for r in rows:
        x, ratio = r.get("x_trtllm_example"), r.get("ratio_to_ceiling")
        if not x or not ratio or x >= goal_x:
            continue
        base, ceiling = r["GBps"] / x, r["GBps"] / ratio
        where = f"{r['direction']} {fmt_size(r['block_bytes'])}"
        if goal_x * base > ceiling:
            bounded.append(f"{where}: {goal_x:g}x its {base:.2f} GB/s is {goal_x * base:.0f} GB/s, above the "
                           f"{ceiling:.1f} GB/s ceiling (at most {ceiling / base:.1f}x)")
        else:
            room.append(f"{where} {x:.1f}x")
    parts = (["bounded by the ceiling: " + "; ".join(bounded)] if bounded else []) + \
        (["below the goal with the ceiling above it: " + ", ".join(room)] if room else [])
    return "; ".join(parts)


def _raw_leg(d: dict) -> str:
    """Which raw leg gave a direction's ceiling: ``x4`` (files of their own) or ``x4 one file``."""
    s, layout = d.get("best_streams", "?"), d.get("best_layout", "files")
    return f"x{s}" if layout == "files" else f"x{s} {layout}"


def render_table(res: dict) -> str:
    L: list[str] = []
    meta = res["meta"]
    L.append(f"gds-kv-connector bench  host={meta['hostname']}  commit={(meta['git']['commit'] or '?')[:12]}"
             f"{' (dirty)' if meta['git'].get('dirty') else ''}  device={meta['device']}  "
             f"torch={meta['versions']['torch']}  kvikio={meta['versions']['kvikio']}  cupy={meta['versions']['cupy']}")
    for t, info in res["targets_info"].items():
        L.append(f"  target {t}: {info['dir']} ({info['fs']}); engine: {info.get('engine_data_path', '?')}")
    gct = res["config"].get("gc_threshold")
    if gct:
        L.append(f"  Python GC thresholds {tuple(gct)} (--gc-gen0; TensorRT-LLM's executor runs with 20000)")
    L.append("")
    L.append("Ceilings (GB/s = 1e9 B/s)")
    p = res["ceilings"].get("pinned_copy")
    if p:
        line = f"  pinned copy          H2D {p['h2d_GBps']:8.2f}   D2H {p['d2h_GBps']:8.2f}"
        if p.get("h2d_GBps_runs"):
            line += (f"   (best of before and after the phases: H2D {' / '.join(f'{v:.2f}' for v in p['h2d_GBps_runs'])}, "
                     f"D2H {' / '.join(f'{v:.2f}' for v in p['d2h_GBps_runs'])})")
        if "h2d_GBps_4_streams" in p:
            line += (f"; one stream / 4 MiB on 4 streams: H2D {p['h2d_GBps_one_stream']:.2f} / "
                     f"{p['h2d_GBps_4_streams']:.2f}, D2H {p['d2h_GBps_one_stream']:.2f} / {p['d2h_GBps_4_streams']:.2f}")
        L.append(line)
    else:
        L.append("  pinned copy          (no CUDA)")
    for t, r in res["ceilings"]["storage"].items():
        w, rd = r.get("write", {}), r.get("read", {})
        L.append(f"  raw {t:<6} {r['io'][:30]:<30} write {w.get('best_GBps', 0):7.2f} ({_raw_leg(w)})"
                 f"   read {rd.get('best_GBps', 0):7.2f} ({_raw_leg(rd)})")
    L.append("")
    hdr = (f"  {'target':<6} {'dir':<4} {'block':>6} {'conn':>8} {'ceiling':>8} {'%ceil':>6} "
           f"{'trtllm':>8} {'x':>7} {'kvikio':>8} {'x':>6}  notes")
    L.append("Connector (the pool's store + make_engine('auto'), checksums on) vs ceiling and baselines, GB/s")
    L.append(hdr)
    for r in res["connector"]:
        trt = _find(res["baselines"], method="trtllm_example", target=r["target"], block_bytes=r["block_bytes"],
                    direction=r["direction"])
        kvi = _find(res["baselines"], method="naive_kvikio", target=r["target"], block_bytes=r["block_bytes"],
                    direction=r["direction"])
        notes = [] if r.get("pool_mode") in (None, "block files", "arena") else [r["pool_mode"]]
        runs = r.get("GBps_runs") or []
        if len(runs) > 1:  # the median is reported; the spread says how far one run can be trusted
            notes.append(f"runs {min(runs):.1f}-{max(runs):.1f}")
        if r["direction"] == "save" and r.get("returned_GBps"):
            notes.append(f"returned {r['returned_GBps']:.2f}")
        if r.get("capped_by_time"):
            notes.append("time-capped")
        if r.get("cold_cache"):
            notes.append("cold")
        if r.get("raw_beside_GBps"):
            notes.append(f"raw beside {r['raw_beside_GBps']:.2f} ({100 * r['ratio_to_raw_beside']:.0f}%)")
        gcr = r.get("gc") or {}
        if gcr.get("collections", [0, 0, 0])[2]:
            notes.append(f"full GC x{gcr['collections'][2]} ({gcr['ms']:.0f} ms)")
        ceil = r.get("ceiling_GBps")
        L.append(f"  {r['target']:<6} {r['direction']:<4} {fmt_size(r['block_bytes']):>6} {r['GBps']:8.2f} "
                 f"{ceil if ceil is not None else float('nan'):8.2f} "
                 f"{(100 * r['ratio_to_ceiling']) if r.get('ratio_to_ceiling') is not None else float('nan'):5.0f}% "
                 f"{trt['GBps'] if trt else float('nan'):8.3f} "
                 f"{r['x_trtllm_example'] if r.get('x_trtllm_example') is not None else float('nan'):7.1f} "
                 f"{kvi['GBps'] if kvi else float('nan'):8.3f} "
                 f"{r['x_naive_kvikio'] if r.get('x_naive_kvikio') is not None else float('nan'):6.2f}  "
                 f"{', '.join(notes)}")
    L.append("  (save GB/s counts until syncfs returns; 'returned' = when the store's save returned, data maybe "
             "still in the page cache)")
    ex = res.get("executor") or {}
    L.append("")
    if ex.get("callback_us_per_iteration") is not None:
        runs = ex.get("callback_us_per_iteration_runs") or []
        if len(runs) > 1:
            L.append(f"Executor thread: {len(runs)} runs, us/iteration {', '.join(f'{r:.1f}' for r in runs)}; the "
                     f"median run:")
            for k, d in enumerate(ex.get("runs_detail") or []):
                firsts = " / ".join("-" if f is None else f"{f / 1e3:.1f}" for f in d["first_iteration_us"])
                L.append(f"  run {k + 1}: {d['callback_us_per_iteration']:.1f} us/iteration, admission iterations "
                         f"{firsts} ms, cyclic GC {d['gc_ms']:.1f} ms ({sum(d['gc_collections'])} collections, "
                         f"{d['gc_collections'][2]} full)")
        if ex.get("null_connector_us_per_iteration") is not None:
            L.append(f"Baseline: a connector that does nothing, same executor and workload: "
                     f"{ex['null_connector_us_per_iteration']:.1f} us/iteration of callbacks")
        if ex.get("python_reference_us") is not None:
            L.append(f"Host Python reference: reading {ex['requests_per_batch']} decode reports' fields takes "
                     f"{ex['python_reference_us']:.2f} us (min of 300), for comparing the executor figure between hosts")
        L.append(f"Executor thread ({ex['requests_per_batch']}-request batch, {ex['num_layers']} layers): "
                 f"{ex['callback_us_per_iteration']:.1f} us/iteration over {ex['iterations']} iterations "
                 f"({ex['callback_us_per_busy_iteration']:.1f} us per busy iteration), "
                 f"{ex['layer_hook_us_per_call']:.2f} us per layer hook ({ex['layer_hook_calls']} calls)")
        for i, x in enumerate(ex["rounds"]):
            it = x.get("iteration_us") or {}
            L.append(f"  round {i} ({x['what']}): {x['callback_us_per_iteration']:.1f} us/iter, "
                     f"{x['layer_hook_us_per_call']:.2f} us/hook, {x['iterations']} iterations "
                     f"({x['idle_iterations']} idle), loaded {x['loaded_tokens']} tokens")
            if it:
                L.append(f"    first iteration (admits {ex['requests_per_batch']} requests) {it['first']:.0f} us; the "
                         f"others median {it['rest_median']:.0f} us, max {it['rest_max']:.0f} us; hooks "
                         f"{x['layer_hook_us_per_call_excl_sync_load_wait']:.2f} us/call without the "
                         f"{1e3 * x['sync_load_wait_s']:.1f} ms waited for synchronous loads")
            top = list(x.get("by_callback", {}).items())[:4]
            if top:
                L.append("    " + ", ".join(f"{n} {v['us_per_iteration']:.0f} us/iter ({v['us_per_call']:.1f} us/call)"
                                            for n, v in top))
    else:
        L.append(f"Executor thread: {ex.get('error', 'not measured')}")
    m = res.get("match") or {}
    if m.get("warm_median_ms") is not None:
        L.append(f"Match of a fully cached {m['prompt_tokens']}-token prompt ({m['blocks']} blocks): "
                 f"median {m['warm_median_ms']:.2f} ms warm (min {m['warm_min_ms']:.2f}, max {m['warm_max_ms']:.2f}, "
                 f"{m['warm_calls']} calls); first call {m['first_call_ms']:.1f} ms")
        if m.get("unindexed_median_ms") is not None:
            L.append(f"  unindexed (every block file stat'ed, as a process that did not save it): median "
                     f"{m['unindexed_median_ms']:.2f} ms (min {m['unindexed_min_ms']:.2f}, {m['unindexed_calls']} calls)")
        c = m.get("components") or {}
        if c:
            L.append(f"  parts: key chain {c['key_chain_ms']:.2f} ms ({'C extension' if c['native'] else 'Python'}; "
                     f"the Python definition {c['key_chain_python_ms']:.2f} ms), index lookups "
                     f"{c['count_present_warm_ms']:.2f} ms")
    else:
        L.append(f"Match: {m.get('error', 'not measured')}")
    ov = res.get("overlap") or {}
    if ov.get("slowdown_pct") is not None:
        L.append(f"Overlap: {ov['matmul']} x{ov['iterations']}: alone {ov['alone_s']:.3f} s, with transfers "
                 f"{ov['with_transfers_s']:.3f} s -> slowdown {ov['slowdown_pct']:.1f}% "
                 f"(GPU time {ov['slowdown_gpu_pct']:.1f}%), transfers {ov['transfer_GBps_during_compute']:.2f} GB/s")
    else:
        L.append(f"Overlap: {ov.get('skipped') or ov.get('error') or 'not measured'}")
    L.append("")
    L.append("Goals (reported, never asserted)")
    for g in res["goals"]:
        L.append(f"  [{g['status']:>4}] {g['goal']}: {g['measured']}  (goal {g['target']})"
                 f"{'  - ' + g['note'] if g['note'] else ''}")
    if res["errors"]:
        L.append("")
        L.append("Errors")
        for e in res["errors"]:
            L.append(f"  {e}")
    return "\n".join(L)


def plot(res: dict, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - optional
        return f"plot skipped: matplotlib not importable ({type(exc).__name__})"
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=False)
    colors = {}
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for ax, direction in zip(axes, ("save", "load")):
        for t in res["targets_info"]:
            col = colors.setdefault(t, palette[len(colors) % len(palette)])
            rows = sorted((r for r in res["connector"] if r["target"] == t and r["direction"] == direction),
                          key=lambda r: r["block_bytes"])
            if rows:
                ax.plot([r["block_bytes"] / MiB for r in rows], [r["GBps"] for r in rows], "o-", color=col,
                        label=f"connector {t}")
            for method, style in (("trtllm_example", "s--"), ("naive_kvikio", "^:")):
                b = sorted((r for r in res["baselines"] if r["target"] == t and r["direction"] == direction
                            and r["method"] == method and r.get("GBps")), key=lambda r: r["block_bytes"])
                if b:
                    ax.plot([r["block_bytes"] / MiB for r in b], [r["GBps"] for r in b], style, color=col,
                            alpha=0.7, label=f"{method} {t}")
            ceil, what = ceiling_for(res, t, direction)
            if ceil:
                ax.axhline(ceil, color=col, lw=0.8, ls="-.", alpha=0.6, label=f"ceiling {t}: {what}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        sizes = sorted({r["block_bytes"] for r in res["connector"]})
        if sizes:
            ax.set_xticks([b / MiB for b in sizes], [fmt_size(b) for b in sizes])
            ax.minorticks_off()
        ax.set_xlabel("block size (MiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{direction} ({res['meta']['device']})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"gds-kv-connector bench, {res['meta']['hostname']}, {(res['meta']['git']['commit'] or '?')[:12]}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

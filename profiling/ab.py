"""Two checkouts' bench figures, legs alternated in one sitting, side by side.

    python profiling/ab.py --base DIR [--pairs 2] [--budget-s S] [--out DIR] [--label NAME] -- BENCH_ARGS...

Runs ``gds-kv bench BENCH_ARGS`` alternately in this checkout and in ``--base`` (another checkout
with its own built extension: each leg imports the package of the tree it runs in, which is
checked before the first leg), ``--pairs`` times, this tree first, and prints every connector row
(target, pool, direction, block) with each leg's GB/s and its percent of that leg's ceilings, both
trees' means and their ratio, each leg's ceilings, plus the executor's microseconds per iteration
and the match time when the bench measured them.  One device session's figures move 5-10% from
leg to leg (and machines differ more), so a change is shown by
pairs in one command, never by runs of separate sessions; the spread of each tree's legs is
printed so a gap can be read against it.  Each leg's JSON and log, and ``ab.json`` (the table),
go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(tree: str, label: str) -> dict[str, str]:
    """The leg's environment: its tree first on the path; its label as the commit the JSON records."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["GDS_KV_COMMIT"] = label
    return env


def _check_import(tree: str, env: dict[str, str]) -> None:
    """Refuse to run when a tree would import another checkout's package (a stale PYTHONPATH or an
    editable install ahead of it): its legs would silently measure the wrong code."""
    code = "import gds_kv_connector, os; print(os.path.realpath(gds_kv_connector.__file__))"
    got = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True,
                         timeout=120)
    where = got.stdout.strip()
    if got.returncode != 0 or not where.startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"ab.py: in {tree} the package imports from {where or got.stderr.strip()[-300:]}, "
                         f"not from that tree")


def _label(tree: str) -> str:
    """The tree's own git commit, else its directory's name.  A tree without a ``.git`` of its own
    (an exported commit inside another checkout) is not named after the checkout around it."""
    if not os.path.exists(os.path.join(tree, ".git")):
        return os.path.basename(os.path.normpath(tree))
    got = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return got.stdout.strip() if got.returncode == 0 else os.path.basename(os.path.normpath(tree))


def _size(nbytes: int) -> str:
    mib = 1 << 20
    return f"{nbytes / mib:g}M" if nbytes >= mib else f"{nbytes >> 10}K"


def _rows(res: dict) -> dict[str, float]:
    """Figures of one leg keyed by what they measure."""
    out = {}
    ceilings = res.get("ceilings") or {}
    pinned = ceilings.get("pinned_copy") or {}
    for way in ("h2d", "d2h"):
        if pinned.get(f"{way}_GBps") is not None:
            out[f"ceiling pinned copy {way.upper()} GB/s"] = pinned[f"{way}_GBps"]
    for target, info in sorted((ceilings.get("storage") or {}).items()):
        for way in ("write", "read"):
            best = (info.get(way) or {}).get("best_GBps")
            if best is not None:  # the ceiling each row's % is taken against: a leg's % moves with it
                out[f"ceiling {target} raw {way} GB/s"] = best
    for r in res.get("connector", []):
        if r.get("GBps") is None:
            continue
        size = _size(r["block_bytes"])
        name = f"{r['target']} {r.get('pool_mode', '')} {r['direction']} {size}"
        out[f"{name} GB/s"] = r["GBps"]
        if r.get("ratio_to_ceiling") is not None:
            out[f"{name} % of the leg's ceiling"] = round(100 * r["ratio_to_ceiling"], 1)
        if r.get("ratio_to_raw_beside") is not None:
            out[f"{name} % of the raw leg beside it"] = round(100 * r["ratio_to_raw_beside"], 1)
        gc_runs = [g for g in r.get("gc_runs") or () if g]
        if gc_runs:  # Python's cyclic GC pauses every thread: a gap in GB/s may be a collection moved
            out[f"{name} GC ms, all runs (lower is better)"] = round(sum(g["ms"] for g in gc_runs), 2)
    ex = res.get("executor") or {}
    if ex.get("callback_us_per_iteration") is not None:
        out["executor us/iteration (lower is better)"] = ex["callback_us_per_iteration"]
    match = res.get("match") or {}
    if match.get("warm_median_ms") is not None:
        out["128k-token match ms (lower is better)"] = match["warm_median_ms"]
    return out


def summarize(legs: list[tuple[str, dict[str, float]]], this: str, base: str) -> list[dict]:
    """One entry per figure: each tree's values in leg order, their means and this/base."""
    names: list[str] = []
    for _, figures in legs:
        names += [n for n in figures if n not in names]
    table = []
    for name in names:
        a = [f[name] for t, f in legs if t == this and name in f]
        b = [f[name] for t, f in legs if t == base and name in f]
        mean_a = sum(a) / len(a) if a else None
        mean_b = sum(b) / len(b) if b else None
        ratio = mean_a / mean_b if mean_a is not None and mean_b else None
        table.append({"figure": name, this: a, base: b, "mean_" + this: mean_a, "mean_" + base: mean_b,
                      "ratio": ratio})
    return table


def _fmt(vals: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in vals) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the other checkout (its extension built in place)")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--out", default="ab-out")
    ap.add_argument("--label", help="the base tree's name in the table (default: its git commit or directory)")
    ap.add_argument("--leg-timeout-s", type=float, default=600.0)
    ap.add_argument("--budget-s", type=float, help="start no pair that the slowest pair so far says would end "
                    "past this many seconds from the start; the table holds the pairs done")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the arguments for gds-kv bench")
    a = ap.parse_args()
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    if a.pairs < 1:
        raise SystemExit("ab.py: --pairs must be at least 1")
    base = os.path.abspath(a.base)
    # a copy of this checkout whose .git lags its files (a device's working-tree copy) would be named
    # after the wrong commit: GDS_KV_COMMIT, which the bench records too, names it when set
    this_label, base_label = os.environ.get("GDS_KV_COMMIT") or _label(HERE), a.label or _label(base)
    if this_label == base_label:
        base_label += "-base"
    os.makedirs(a.out, exist_ok=True)
    trees = [(HERE, this_label), (base, base_label)]
    for tree, label in trees:
        _check_import(tree, _env(tree, label))
    legs: list[tuple[str, dict[str, float]]] = []
    start, slowest = time.monotonic(), 0.0
    for pair in range(a.pairs):
        if a.budget_s is not None and time.monotonic() - start + slowest > a.budget_s:
            print(f"ab.py: {pair} of {a.pairs} pairs in the budget ({a.budget_s:g} s)", flush=True)
            break
        began = time.monotonic()
        for tree, label in trees:
            stem = os.path.join(os.path.abspath(a.out), f"{label}-{pair}")
            cmd = [sys.executable, "-m", "gds_kv_connector.cli", "bench", *bench_args, "--json", stem + ".json",
                   "--no-progress"]
            t0 = time.monotonic()
            with open(stem + ".log", "w") as log:
                rc = subprocess.run(cmd, cwd=tree, env=_env(tree, label), stdout=log, stderr=subprocess.STDOUT,
                                    timeout=a.leg_timeout_s).returncode
            print(f"leg {pair + 1}/{a.pairs} {label}: rc {rc}, {time.monotonic() - t0:.0f} s", flush=True)
            if rc != 0 or not os.path.exists(stem + ".json"):
                raise SystemExit(f"ab.py: the bench failed in {tree} (rc {rc}); see {stem}.log")
            with open(stem + ".json") as fh:
                legs.append((label, _rows(json.load(fh))))
        slowest = max(slowest, time.monotonic() - began)
    table = summarize(legs, this_label, base_label)
    with open(os.path.join(a.out, "ab.json"), "w") as fh:
        json.dump({"this": this_label, "base": base_label, "pairs": len(legs) // 2, "bench_args": bench_args,
                   "table": table}, fh, indent=1)
    width = max(len(t["figure"]) for t in table) if table else 10
    print(f"{'figure':<{width}}  {this_label + ' (legs)':<22} {base_label + ' (legs)':<22} ratio")
    for t in table:
        ratio = f"{t['ratio']:.3f}" if t["ratio"] is not None else "-"
        print(f"{t['figure']:<{width}}  {_fmt(t[this_label]):<22} {_fmt(t[base_label]):<22} {ratio}")


if __name__ == "__main__":
    main()

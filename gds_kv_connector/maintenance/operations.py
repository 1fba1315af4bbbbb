"""What ``gds-kv stats`` and ``gds-kv gc`` do (``gds-kv verify``: :mod:`.verify`), separate from argument parsing.

Each command returns a plain dict (printed as is with ``--json``, so scripts and monitoring
can consume it) and has a ``format_*`` function for people.  They are safe to run against a
pool that owners are serving from: nothing here holds a file open longer than one read, and
whatever is removed goes through the same rules as online eviction.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gds_kv_connector.util.counters import split_histograms
from gds_kv_connector.util.atomic_file import WriterMark
from gds_kv_connector.maintenance.eviction import DEFAULT_GRACE_S, EvictionReport, evict_pool, expire_pool
from gds_kv_connector.maintenance.owner_stats import live, read_owner_stats
from gds_kv_connector.format.layout import SLAB_SUFFIX, SLABS_DIR, slab_of_tmp_name
from gds_kv_connector.maintenance.pool_scan import (fingerprint_dirs, layout_dir, list_dir, owners_dir, quarantine_dir,
                                                    read_geometry, scan_pool)
from gds_kv_connector.maintenance.recency import ACCESS_SUFFIX
from gds_kv_connector.maintenance.shard_summary import usage
from gds_kv_connector.maintenance.slab_gc import remove_orphan_slabs
from gds_kv_connector.maintenance.retired_owners import RETIRED_NAME, RetiredOwners, read_retired

EXIT_OK = 0
EXIT_PROBLEMS = 1  # verify found bad files, or gc could not bring the pool within its budget
EXIT_USAGE = 2  # bad arguments or configuration


class UsageError(ValueError):
    """The command cannot run as asked (exit code :data:`EXIT_USAGE`)."""


def require_pool(root: str) -> None:
    if not os.path.isdir(layout_dir(root)):
        raise UsageError(f"{root} holds no pool (no {layout_dir(root)} directory)")


# -- several roots --------------------------------------------------------------------------------
def pool_roots(root: str | Sequence[str]) -> list[str]:
    """The roots of a pool: one path, a ``:``-separated list (as ``TLLM_GDS_KV_ROOT``), or a
    sequence; each once, in order.  A pool of several roots is one pool: every command covers
    all of them."""
    parts = root.split(":") if isinstance(root, str) else list(root)
    out: list[str] = []
    for r in parts:
        if r and os.path.abspath(r) not in map(os.path.abspath, out):
            out.append(r)
    if not out:
        raise UsageError("no pool root given")
    return out


def over_roots(results: list[dict[str, Any]], totals: dict[str, Any]) -> dict[str, Any]:
    """A result over several roots: the single-root shape holding the totals (``root`` names
    them all), and each root's own result under ``roots``."""
    return {"root": ":".join(r["root"] for r in results), **totals, "roots": results,
            "exit_code": max(r["exit_code"] for r in results)}


def format_over_roots(result: dict[str, Any], fmt: Callable[[dict[str, Any]], list[str]],
                       total: str) -> list[str]:
    """One root's lines as ``fmt`` gives them; for several, each root's lines after its first
    (``pool <root>: ...``) name their root too, and ``total`` follows."""
    if len(result["roots"]) == 1:
        return fmt(result["roots"][0])
    lines = []
    for r in result["roots"]:
        own = fmt(r)
        lines += own[:1] + [f"  {r['root']}: {line.lstrip()}" for line in own[1:]]
    return lines + [f"total over {len(result['roots'])} roots: {total}"]


# -- stats ----------------------------------------------------------------------------------------
def stats(root: str | Sequence[str], now: float | None = None, *, exact: bool = False) -> dict[str, Any]:
    """Usage per fingerprint, leftovers, and every owner's last published numbers, over every
    root of the pool: each root's own result under ``roots``, their sums at the top.

    Blocks, bytes, temporary files and foreign entries come from the shard summaries' headers
    (:func:`~.shard_summary.usage`: a read per shard, no listing), as current as the evictor keeps
    them: ``summaries`` says how many shards' summaries are stale and the oldest one's build time.
    A shard without a summary is listed (in memory).  ``exact`` lists and lstats every block instead.

    Owners publish into every root, so their files are merged across roots, not summed: per
    process start, the newest file.  Counters are summed over every process that published
    (what exited processes did still happened), gauges only over the live ones.  The counters of
    processes whose files gc retired come from each root's archive (:mod:`.retired_owners`); each root's
    archive holds the same processes, one root's gc maybe behind another's, so the pool's are
    the largest of the roots' (per counter: never a process twice, and exact once a root has
    retired every process another has), and a file that any root's archive names is counted
    there only.
    """
    roots = pool_roots(root)
    for r in roots:
        require_pool(r)
    now = time.time() if now is None else now
    archives = [read_retired(r) for r in roots]
    results = [_stats_root(r, now, a, exact) for r, a in zip(roots, archives)]
    folded = {stem for a in archives if a is not None for stem in a.folded}
    owners: dict[str, dict[str, Any]] = {}
    for res in results:
        for name, o in res["owners"].items():
            if name in folded:
                continue
            if name not in owners or (o["updated_ns"] or 0) > (owners[name]["updated_ns"] or 0):
                owners[name] = o
    owners = dict(sorted(owners.items()))
    fps: dict[str, dict[str, Any]] = {}
    for res in results:
        for fp, e in res["fingerprints"].items():
            if fp not in fps:
                fps[fp] = dict(e)
                continue
            t = fps[fp]
            for k in ("blocks", "bytes", "slabs", "slab_bytes"):
                t[k] += e[k]
            for k in ("geometry", "payload_len", "tokens_per_block"):
                t[k] = t[k] if t[k] is not None else e[k]
            t["tokens"] = t["blocks"] * t["tokens_per_block"] if isinstance(t["tokens_per_block"], int) else None
    totals = {"blocks": _sum(results, "blocks"), "bytes": _sum(results, "bytes"), "fingerprints": fps,
              **{k: {"files": _sum(results, k, "files"), "bytes": _sum(results, k, "bytes")}
                 for k in ("quarantine", "tmp", "slab_tmp", "access_logs")},
              "foreign_entries": _sum(results, "foreign_entries"),
              "unreadable_entries": _sum(results, "unreadable_entries"), "filesystem": _filesystems(roots),
              "summaries": _summaries_total([r["summaries"] for r in results]),
              **_owner_totals(owners, _retired(archives))}
    return over_roots(results, totals)


def _stats_root(root: str, now: float, archive: RetiredOwners | None, exact: bool) -> dict[str, Any]:
    unreadable = [0]  # what this function cannot read: reported, not counted
    if exact:
        scan = scan_pool(root)
        fp_blocks = Counter(b.fp for b in scan.blocks)
        fp_bytes = scan.bytes_by_fp()  # a reference file linked under many keys counts once
        tmp_sizes = _sizes(scan.tmp, unreadable)
        tmp = {"files": len(scan.tmp), "bytes": sum(tmp_sizes)}
        foreign, summaries = scan.foreign, None
        unreadable[0] += scan.unreadable
    else:
        view = usage(root, now)
        fp_blocks, fp_bytes = view.blocks_by_fp, view.bytes_by_fp
        tmp = {"files": view.tmp_files, "bytes": view.tmp_bytes}
        foreign = view.foreign
        summaries = {"shards": view.shards, "stale": view.stale, "listed": view.listed,
                     "oldest_built_ns": view.oldest_built_ns}
        unreadable[0] += view.unreadable
    per_fp: dict[str, dict[str, Any]] = {}
    for fp in sorted(set(fingerprint_dirs(root)) | set(fp_blocks)):
        geometry = read_geometry(root, fp) or {}
        tpb = geometry.get("tokens_per_block")
        blocks = fp_blocks.get(fp, 0)
        per_fp[fp] = {"blocks": blocks, "bytes": fp_bytes.get(fp, 0), "geometry": geometry.get("geometry"),
                      "payload_len": geometry.get("payload_len"), "tokens_per_block": tpb,
                      "tokens": blocks * tpb if isinstance(tpb, int) else None}
    slab_tmp: list[int] = []
    for fp, entry in per_fp.items():  # arena slabs: where an arena pool's block bytes are
        slab_dir = os.path.join(layout_dir(root), fp, SLABS_DIR)
        names = _names(slab_dir, unreadable)
        sizes = _sizes((os.path.join(slab_dir, n) for n in names if n.endswith(SLAB_SUFFIX) and n[0] != "."),
                       unreadable)
        entry["slabs"], entry["slab_bytes"] = len(sizes), sum(sizes)
        # a slab being created, or left so by a creator that died (gc removes those): a whole
        # slab's bytes each, on disk or in host memory, under no slab name
        slab_tmp += _sizes((os.path.join(slab_dir, n) for n in names if slab_of_tmp_name(n) is not None), unreadable)
    now_ns = int(now * 1e9)
    owners = {}
    folded = archive.folded if archive is not None else {}
    for name, data in sorted(read_owner_stats(root).items()):
        if name in folded:  # folded into the archive, not unlinked yet
            continue
        updated = data["updated_ns"]
        owners[name] = {**data, "age_s": round(now - updated / 1e9, 1) if updated is not None else None,
                        "live": live(data, now_ns)}
    qfiles = _files_with_sizes(quarantine_dir(root), "", unreadable)
    logs = _files_with_sizes(owners_dir(root), ACCESS_SUFFIX, unreadable)
    return {"root": os.path.abspath(root), "blocks": sum(fp_blocks.values()), "bytes": sum(fp_bytes.values()),
            "fingerprints": per_fp,
            "quarantine": {"files": len(qfiles), "bytes": sum(qfiles)},
            "tmp": tmp,
            "slab_tmp": {"files": len(slab_tmp), "bytes": sum(slab_tmp)},
            "foreign_entries": foreign, "unreadable_entries": unreadable[0], "summaries": summaries,
            "access_logs": {"files": len(logs), "bytes": sum(logs)},
            "filesystem": _filesystems([root]), **_owner_totals(owners, _retired([archive])),
            "exit_code": EXIT_OK}


def _summaries_total(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The summaries of every root at once (None for an exact count, which reads none)."""
    if any(p is None for p in parts):
        return None
    built = [p["oldest_built_ns"] for p in parts if p["oldest_built_ns"] is not None]  # type: ignore[index]
    return {**{k: sum(p[k] for p in parts) for k in ("shards", "stale", "listed")},  # type: ignore[index]
            "oldest_built_ns": min(built) if built else None}


def _owner_totals(owners: dict[str, dict[str, Any]], retired: dict[str, Any]) -> dict[str, Any]:
    """Counters summed over every owner process that published, retired ones included, gauges
    over the live ones."""
    counters: Counter[str] = Counter(retired["counters"])
    gauges: Counter[str] = Counter()
    for o in owners.values():
        counters.update(o["counters"])
        if o["live"]:
            gauges.update(o["gauges"])
    return {"owners": owners, "owners_live": sum(o["live"] for o in owners.values()), "retired": retired,
            "counters_total": dict(sorted(counters.items())), "gauges_total": dict(sorted(gauges.items()))}


def _retired(archives: Sequence[RetiredOwners | None]) -> dict[str, Any]:
    """What the archives of retired owners of one pool's roots hold (:func:`stats` says why the
    largest): ``unreadable`` if one could not be read, which then counts nothing."""
    counters: dict[str, int] = {}
    for a in archives:
        for k, v in (a.counters if a is not None else {}).items():
            counters[k] = max(counters.get(k, 0), v)
    return {"owners": max(a.retired if a is not None else 0 for a in archives),
            "counters": dict(sorted(counters.items())), "unreadable": any(a is None for a in archives)}


def _filesystems(roots: Sequence[str]) -> dict[str, int | None]:
    """Free and total bytes of the filesystems holding ``roots``, each filesystem once."""
    seen: set[int] = set()
    free = total = 0
    for root in roots:
        try:
            dev = os.stat(root).st_dev
            vfs = os.statvfs(root)
        except OSError:
            return {"free_bytes": None, "total_bytes": None}
        if dev not in seen:
            seen.add(dev)
            free += vfs.f_bavail * vfs.f_frsize
            total += vfs.f_blocks * vfs.f_frsize
    return {"free_bytes": free, "total_bytes": total}


def format_stats(result: dict[str, Any]) -> str:
    total = f"{result['blocks']} blocks, {_human(result['bytes'])}"
    lines = format_over_roots(result, _stats_lines, total)
    for owner, o in result["owners"].items():
        state = "final" if o["final"] else "live" if o["live"] else "not heard from"
        gauges = f"; now {_pairs(o['gauges'])}" if o["gauges"] else ""
        invalid = f"; ignored invalid {', '.join(o['invalid'])}" if o["invalid"] else ""
        lines.append(f"owner {owner} (updated {o['age_s']} s ago, {state}): {_pairs(o['counters'])}"
                     + gauges + invalid)
    retired = result["retired"]["owners"]
    if result["owners"] or retired:
        of_retired = f" (with {retired} retired owner process(es))" if retired else ""
        lines.append(f"owners' counters summed{of_retired}: {_pairs(result['counters_total'])}")
        lines.append(f"gauges of the {result['owners_live']} live owner(s) summed: {_pairs(result['gauges_total'])}")
    return "\n".join(lines)


def _stats_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"pool {result['root']}: {result['blocks']} blocks, {_human(result['bytes'])}"]
    for fp, e in result["fingerprints"].items():
        tokens = f", {e['tokens']} tokens" if e["tokens"] is not None else ""
        lines.append(f"  {fp}  {e['blocks']:>9} blocks {_human(e['bytes']):>10}{tokens}  {e['geometry'] or '?'}")
        if e["slabs"]:
            lines.append(f"  {'':16}  {e['slabs']:>9} arena slabs {_human(e['slab_bytes'])} (blocks in slots; "
                         "their names above are reference files)")
    fs = result["filesystem"]
    if fs["free_bytes"] is not None:
        lines.append(f"filesystem: {_human(fs['free_bytes'])} free of {_human(fs['total_bytes'])}")
    lines.append(f"quarantine: {result['quarantine']['files']} files ({_human(result['quarantine']['bytes'])}); "
                 f"temporary: {result['tmp']['files']} files; access logs: {result['access_logs']['files']} "
                 f"({_human(result['access_logs']['bytes'])})"
                 + (f"; temporary arena slabs: {result['slab_tmp']['files']} files "
                    f"({_human(result['slab_tmp']['bytes'])})" if result["slab_tmp"]["files"] else ""))
    sums = result["summaries"]
    if sums is not None and (sums["stale"] or sums["listed"] or sums["oldest_built_ns"] is not None):
        age = "" if sums["oldest_built_ns"] is None else \
            f", the oldest built {max(0.0, time.time() - sums['oldest_built_ns'] / 1e9):.0f} s ago"
        lines.append(f"counts from shard summaries: {sums['stale']} of {sums['shards']} stale (they lag), "
                     f"{sums['listed']} without one listed now{age}; --exact lists every block")
    if result["foreign_entries"]:
        lines.append(f"unexpected entries in block directories: {result['foreign_entries']}")
    if result["unreadable_entries"]:
        lines.append(f"directories or entries this process cannot read (not counted): {result['unreadable_entries']}")
    if result["retired"]["unreadable"]:
        lines.append(f"{RETIRED_NAME} cannot be read: retired owners' counters not counted (gc keeps stats files "
                     "until it can be)")
    return lines


# -- gc -------------------------------------------------------------------------------------------
def gc(root: str | Sequence[str], quota_bytes: int, low_watermark: float, max_age_s: float = 0.0, *,
       min_free_bytes: int = 0, grace_s: float = DEFAULT_GRACE_S, dry_run: bool = False,
       now: float | None = None, legacy_slabs: bool = False) -> dict[str, Any]:
    """Expire blocks older than ``max_age_s`` (0: keep), then evict every root of the pool down to
    its budget (``quota_bytes`` and ``min_free_bytes`` apply to each root, as in the connector).

    Neither step, nor a dry run of it, takes a block accessed within ``grace_s`` (the owners' grace,
    which ``gds-kv gc`` reads as they do): an access may be a promise whose load has not begun.
    A dry run's quota step plans on the whole pool, blocks the expiry step would remove
    included; it is corrected here (:func:`_after_expiry`) so that no block counts twice.  A dry
    run removes and creates nothing (it takes no eviction lock); a real one marks this process as a
    writer of the pool while it runs (:class:`~.atomic_file.WriterMark`), since it replaces files in
    the owners directory.
    """
    roots = pool_roots(root)
    for r in roots:
        require_pool(r)
    if quota_bytes < 0 or min_free_bytes < 0 or max_age_s < 0 or grace_s < 0:
        raise UsageError("quota, min_free, max_age and grace must not be negative")
    if not 0.0 < low_watermark < 1.0:
        raise UsageError(f"low_watermark must be between 0 and 1 (exclusive), got {low_watermark}")
    mark = None if dry_run else WriterMark([owners_dir(r) for r in roots])
    try:
        steps, estimated = _gc_steps(roots, quota_bytes, low_watermark, max_age_s, min_free_bytes, grace_s,
                                     dry_run, now)
        slabs = [remove_orphan_slabs(r, dry_run, now, legacy_slabs).to_dict() for r in roots]
    finally:
        if mark is not None:
            mark.close()
    results = [_gc_result([step[i] for step in steps], estimated[i], slabs[i], dry_run, quota_bytes)
               for i in range(len(roots))]
    totals = {"dry_run": dry_run, "skipped": any(r["skipped"] for r in results),
              **{k: _sum(results, k) for k in slabs[0]},
              "within_budget": all(r["within_budget"] for r in results),
              "runs": [run for r in results for run in r["runs"]],
              **{k: _sum(results, k) for k in ("evicted_blocks", "evicted_bytes", "usage_after",
                                               "unreadable_entries")},
              "quota_bytes": quota_bytes}
    return over_roots(results, totals)


def _gc_steps(roots: list[str], quota_bytes: int, low_watermark: float, max_age_s: float, min_free_bytes: int,
              grace_s: float, dry_run: bool, now: float | None) -> tuple[list[list[EvictionReport]], list[bool]]:
    """gc's expiry and quota steps: per step one report per root, and per root whether its last
    report's figures are derived (:func:`_after_expiry`)."""
    steps: list[list[EvictionReport]] = []
    estimated = [False] * len(roots)
    if max_age_s:
        steps.append(expire_pool(roots, max_age_s, now, grace_s=grace_s, dry_run=dry_run))
    expired = steps[0] if steps else None
    if expired is None or not any(r.skipped for r in expired):
        if dry_run and expired is not None:
            still_over = [_over_budget(e, quota_bytes, min_free_bytes) for e in expired]
            quota: Sequence[EvictionReport | None] = [None] * len(roots)
            if any(still_over):
                quota = evict_pool(roots, quota_bytes, low_watermark, min_free_bytes, grace_s, now, dry_run=True)
            after = [_after_expiry(q, e, over) for q, e, over in zip(quota, expired, still_over)]
            steps.append([report for report, _ in after])
            estimated = [est for _, est in after]
        else:
            steps.append(evict_pool(roots, quota_bytes, low_watermark, min_free_bytes, grace_s, now,
                                    dry_run=dry_run))
    return steps, estimated


def _gc_result(reports: list[EvictionReport], estimated: bool, slabs: dict[str, int], dry_run: bool,
               quota_bytes: int) -> dict[str, Any]:
    """One root's gc result; ``estimated``: its last report's figures are derived, not planned."""
    skipped = any(r.skipped for r in reports)
    last = reports[-1]
    # a pool not read whole may be over its budget with blocks the scan did not see
    within = not skipped and last.reached_target and not last.unreadable_entries
    runs = [r.to_dict() | {"estimated": False} for r in reports]
    runs[-1]["estimated"] = estimated
    return {"root": last.root, "dry_run": dry_run, "skipped": skipped, **slabs,
            "within_budget": within, "runs": runs,
            "evicted_blocks": sum(r.evicted_blocks for r in reports),
            "evicted_bytes": sum(r.evicted_bytes for r in reports),
            "usage_after": last.usage_after, "quota_bytes": quota_bytes,
            "unreadable_entries": last.unreadable_entries,
            "exit_code": EXIT_OK if within else EXIT_PROBLEMS}


def _over_budget(expired: EvictionReport, quota_bytes: int, min_free_bytes: int) -> bool:
    """Whether a root would still be over its budget once the expiry step removed its blocks (the
    quota step's plan, with the space the expiry frees taken as freed)."""
    usage = expired.scanned_bytes - expired.evicted_bytes
    free = expired.free_bytes + expired.evicted_bytes if expired.free_bytes >= 0 else -1
    return bool(quota_bytes and usage > quota_bytes) or bool(min_free_bytes and 0 <= free < min_free_bytes)


def _after_expiry(quota: EvictionReport | None, expired: EvictionReport,
                  over: bool) -> tuple[EvictionReport, bool]:
    """A dry run's quota step as it would run after the expiry step, from its plan on the whole pool.

    Within budget once expired blocks are gone, the step finds nothing to do: exact.  Still over,
    its plan on the whole pool took the oldest blocks first, which are those the expiry removes,
    so what it would remove after them is estimated as its plan less the expiry's (exact for a
    pool whose cut-off chains fit in the target and whose grace is within the expiry age); the
    report says so (the second value).  An exact plan needs eviction to plan both steps on one scan.
    """
    base = {"root": expired.root, "dry_run": True,
            "scanned_blocks": expired.scanned_blocks - expired.evicted_blocks,
            "scanned_bytes": expired.scanned_bytes - expired.evicted_bytes,
            "free_bytes": expired.free_bytes + expired.evicted_bytes if expired.free_bytes >= 0 else -1,
            "unreadable_entries": expired.unreadable_entries}
    if quota is None or not over:
        return EvictionReport(**base), False
    return EvictionReport(**base, skipped=quota.skipped, reason=quota.reason,
                          target_bytes=max(0, quota.target_bytes - expired.evicted_bytes),
                          evicted_blocks=max(0, quota.evicted_blocks - expired.evicted_blocks),
                          evicted_bytes=max(0, quota.evicted_bytes - expired.evicted_bytes),
                          protected_blocks=quota.protected_blocks, unreadable_headers=quota.unreadable_headers,
                          duration_s=quota.duration_s), True


def format_gc(result: dict[str, Any]) -> str:
    verb = "would remove" if result["dry_run"] else "removed"
    total = (f"{verb} {result['evicted_blocks']} blocks ({_human(result['evicted_bytes'])}); usage now "
             f"{_human(result['usage_after'])}")
    return "\n".join(format_over_roots(result, _gc_lines, total))


def _gc_lines(result: dict[str, Any]) -> list[str]:
    if result["skipped"]:
        return [f"pool {result['root']}: another owner is evicting right now; nothing done"]
    verb = "would remove" if result["dry_run"] else "removed"
    lines = [f"pool {result['root']}: {verb} {result['evicted_blocks']} blocks "
             f"({_human(result['evicted_bytes'])}); usage now {_human(result['usage_after'])}"
             + (f" of a {_human(result['quota_bytes'])} quota" if result["quota_bytes"] else "")]
    for r in result["runs"]:
        if r["reason"]:
            about = "about " if r.get("estimated") else ""
            lines.append(f"  {r['reason']}: target {_human(r['target_bytes'])}, {about}{r['evicted_blocks']} blocks, "
                         f"{r['protected_blocks']} too recent to remove, {r['failed']} failed"
                         + (" (estimated: the expiry step's blocks taken out of the plan)" if about else ""))
        if r["tmp_removed"] or r["quarantine_removed"] or r["logs_folded"]:
            lines.append(f"  tidied {r['tmp_removed']} stale temporary files, {r['quarantine_removed']} old "
                         f"quarantined files, {r['logs_folded']} idle access logs")
    if result["slabs_removed"] or result["slabs_kept_referenced"] or result["slab_temps_removed"]:
        lines.append(f"  arena slabs no owner holds: {verb} {result['slabs_removed']} and "
                     f"{result['slab_temps_removed']} left unfinished by a creator that died "
                     f"({_human(result['slab_bytes_removed'])}), kept {result['slabs_kept_referenced']} that "
                     "references still name")
    if result["legacy_slabs_skipped"]:
        lines.append(f"  {result['legacy_slabs_skipped']} arena slabs named before host tags by this host or one "
                     "sharing its first 32 characters were left: once no older version runs on such a host, "
                     "`gds-kv gc --legacy-slabs` removes those no owner holds and no reference names")
    if result["unreadable_entries"]:
        lines.append(f"  {result['unreadable_entries']} directories or entries could not be read: usage counts "
                     "only what was read, and the budget is not known to be met")
    elif not result["within_budget"]:
        lines.append("  the pool is still over its budget: blocks within the grace period or failures "
                     "kept it there")
    return lines


# -- verify ---------------------------------------------------------------------------------------
def _files_with_sizes(d: str, suffix: str, unreadable: list[int]) -> list[int]:
    return _sizes((os.path.join(d, n) for n in _names(d, unreadable) if n.endswith(suffix)), unreadable)


def _names(d: str, unreadable: list[int]) -> list[str]:
    """Names in ``d``; none where it is gone, and where it cannot be read (an owner's directory
    without ``TLLM_GDS_KV_SHARE_GROUP``) one more in ``unreadable[0]``: stats says so, not crashes."""
    try:
        return list_dir(d)
    except OSError:
        unreadable[0] += 1
        return []


def _sizes(paths: Iterable[str], unreadable: list[int]) -> list[int]:
    out = []
    for p in paths:
        try:
            out.append(os.stat(p, follow_symlinks=False).st_size)
        except FileNotFoundError:
            pass
        except OSError:
            unreadable[0] += 1
    return out


def _sum(results: list[dict[str, Any]], key: str, sub: str | None = None) -> int:
    return sum(r[key] if sub is None else r[key][sub] for r in results)


def _pairs(values: dict[str, int]) -> str:
    """Counters as ``name=value``; a latency histogram as one ``name=count x mean`` (its bucket counts
    are for ``gds-kv metrics``, not for reading)."""
    plain, hists = split_histograms(values)
    items = [f"{k}={v}" for k, v in sorted(plain.items())]
    items += [f"{name}={h.count}x{h.total / h.count / 1e3:.2f}ms" if h.count else f"{name}=0"
              for name, h in sorted(hists.items())]
    return ", ".join(sorted(items)) or "-"


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"

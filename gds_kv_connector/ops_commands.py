"""What ``gds-kv stats``, ``gds-kv gc`` and ``gds-kv verify`` do, separate from argument parsing.

Each command returns a plain dict (printed as is with ``--json``, so scripts and monitoring
can consume it) and has a ``format_*`` function for people.  They are safe to run against a
pool that owners are serving from: nothing here holds a file open longer than one read, and
whatever is removed goes through the same rules as online eviction.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .checksum import checksum_bytes
from .eviction import EvictionReport, evict, expire
from .metrics import read_owner_stats
from .arena import SLAB_SUFFIX, SLABS_DIR
from .pool_format import HEADER_SIZE, REF_MAGIC, FormatError, is_ref_size, parse_header, parse_ref
from .pool_scan import (BlockFile, fingerprint_dirs, layout_dir, owners_dir, quarantine_destination,
                        quarantine_dir, read_geometry, scan_pool)
from .recency import ACCESS_SUFFIX
from .slab_gc import remove_orphan_slabs

EXIT_OK = 0
EXIT_PROBLEMS = 1  # verify found bad files, or gc could not bring the pool within its budget
EXIT_USAGE = 2  # bad arguments or configuration
MAX_LISTED_BAD = 1000  # bad files listed individually in a verify result; the rest only counted


class UsageError(ValueError):
    """The command cannot run as asked (exit code :data:`EXIT_USAGE`)."""


def _require_pool(root: str) -> None:
    if not os.path.isdir(layout_dir(root)):
        raise UsageError(f"{root} holds no pool (no {layout_dir(root)} directory)")


# -- stats ----------------------------------------------------------------------------------------
def stats(root: str, now: float | None = None) -> dict[str, Any]:
    """Usage per fingerprint, leftovers, and every owner's last published counters."""
    _require_pool(root)
    now = time.time() if now is None else now
    scan = scan_pool(root)
    per_fp: dict[str, dict[str, Any]] = {}
    for fp in fingerprint_dirs(root):
        geometry = read_geometry(root, fp) or {}
        per_fp[fp] = {"blocks": 0, "bytes": 0, "geometry": geometry.get("geometry"),
                      "payload_len": geometry.get("payload_len"), "tokens_per_block": geometry.get("tokens_per_block")}
    for b in scan.blocks:
        entry = per_fp.setdefault(b.fp, {"blocks": 0, "bytes": 0, "geometry": None, "payload_len": None,
                                         "tokens_per_block": None})
        entry["blocks"] += 1
        entry["bytes"] += b.size
    for entry in per_fp.values():
        tpb = entry["tokens_per_block"]
        entry["tokens"] = entry["blocks"] * tpb if isinstance(tpb, int) else None
    for fp, entry in per_fp.items():  # arena slabs: where an arena pool's block bytes are
        sizes = _files_with_sizes(os.path.join(layout_dir(root), fp, SLABS_DIR), SLAB_SUFFIX)
        entry["slabs"], entry["slab_bytes"] = len(sizes), sum(sizes)
    owners = {}
    totals: Counter[str] = Counter()
    for owner, data in sorted(read_owner_stats(root).items()):
        updated = data.get("updated_ns")
        owners[owner] = {"host": data.get("host"), "pid": data.get("pid"),
                         "age_s": round(now - updated / 1e9, 1) if isinstance(updated, int) else None,
                         "counters": data["counters"]}
        totals.update(data["counters"])
    qfiles = _files_with_sizes(quarantine_dir(root))
    logs = _files_with_sizes(owners_dir(root), ACCESS_SUFFIX)
    try:
        vfs = os.statvfs(root)
        filesystem = {"free_bytes": vfs.f_bavail * vfs.f_frsize, "total_bytes": vfs.f_blocks * vfs.f_frsize}
    except OSError:
        filesystem = {"free_bytes": None, "total_bytes": None}
    return {"root": os.path.abspath(root), "blocks": len(scan.blocks), "bytes": scan.block_bytes,
            "fingerprints": per_fp,
            "quarantine": {"files": len(qfiles), "bytes": sum(qfiles)},
            "tmp": {"files": len(scan.tmp), "bytes": sum(_sizes(scan.tmp))},
            "foreign_entries": scan.foreign,
            "access_logs": {"files": len(logs), "bytes": sum(logs)},
            "filesystem": filesystem, "owners": owners, "counters_total": dict(sorted(totals.items()))}


def format_stats(result: dict[str, Any]) -> str:
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
                 f"({_human(result['access_logs']['bytes'])})")
    if result["foreign_entries"]:
        lines.append(f"unexpected entries in block directories: {result['foreign_entries']}")
    for owner, o in result["owners"].items():
        lines.append(f"owner {owner} (updated {o['age_s']} s ago): "
                     + ", ".join(f"{k}={v}" for k, v in sorted(o["counters"].items())))
    return "\n".join(lines)


# -- gc -------------------------------------------------------------------------------------------
def gc(root: str, quota_bytes: int, low_watermark: float, max_age_s: float = 0.0, *, min_free_bytes: int = 0,
       grace_s: float = 300.0, dry_run: bool = False, now: float | None = None) -> dict[str, Any]:
    """Expire blocks older than ``max_age_s`` (0: keep), then evict down to the budget."""
    _require_pool(root)
    if quota_bytes < 0 or min_free_bytes < 0 or max_age_s < 0 or grace_s < 0:
        raise UsageError("quota, min_free, max_age and grace must not be negative")
    if not 0.0 < low_watermark < 1.0:
        raise UsageError(f"low_watermark must be between 0 and 1 (exclusive), got {low_watermark}")
    reports: list[EvictionReport] = []
    if max_age_s:
        reports.append(expire(root, max_age_s, now, dry_run=dry_run))
    if not (reports and reports[0].skipped):
        reports.append(evict(root, quota_bytes, low_watermark, min_free_bytes, grace_s, now, dry_run=dry_run))
    skipped = any(r.skipped for r in reports)
    slabs = remove_orphan_slabs(root, dry_run, now)
    last = reports[-1]
    within = not skipped and last.reached_target
    return {"root": os.path.abspath(root), "dry_run": dry_run, "skipped": skipped, **slabs.to_dict(),
            "within_budget": within, "runs": [r.to_dict() for r in reports],
            "evicted_blocks": sum(r.evicted_blocks for r in reports),
            "evicted_bytes": sum(r.evicted_bytes for r in reports),
            "usage_after": last.usage_after, "quota_bytes": quota_bytes,
            "exit_code": EXIT_OK if within else EXIT_PROBLEMS}


def format_gc(result: dict[str, Any]) -> str:
    if result["skipped"]:
        return f"pool {result['root']}: another owner is evicting right now; nothing done"
    verb = "would remove" if result["dry_run"] else "removed"
    lines = [f"pool {result['root']}: {verb} {result['evicted_blocks']} blocks "
             f"({_human(result['evicted_bytes'])}); usage now {_human(result['usage_after'])}"
             + (f" of a {_human(result['quota_bytes'])} quota" if result["quota_bytes"] else "")]
    for r in result["runs"]:
        if r["reason"]:
            lines.append(f"  {r['reason']}: target {_human(r['target_bytes'])}, {r['evicted_blocks']} blocks, "
                         f"{r['protected_blocks']} too recent to remove, {r['failed']} failed")
        if r["tmp_removed"] or r["quarantine_removed"] or r["logs_folded"]:
            lines.append(f"  tidied {r['tmp_removed']} stale temporary files, {r['quarantine_removed']} old "
                         f"quarantined files, {r['logs_folded']} idle access logs")
    if result["slabs_removed"] or result["slabs_kept_referenced"] or result["slab_temps_removed"]:
        lines.append(f"  arena slabs no owner holds: {verb} {result['slabs_removed']} and "
                     f"{result['slab_temps_removed']} left unfinished by a creator that died "
                     f"({_human(result['slab_bytes_removed'])}), kept {result['slabs_kept_referenced']} that "
                     "references still name")
    if not result["within_budget"]:
        lines.append("  the pool is still over its budget: blocks within the grace period or failures "
                     "kept it there")
    return "\n".join(lines)


# -- verify ---------------------------------------------------------------------------------------
def verify(root: str, workers: int = 8, progress: bool = True, quarantine: bool = True) -> dict[str, Any]:
    """Re-check every block's header and payload checksum; move bad ones to quarantine."""
    _require_pool(root)
    if workers < 1:
        raise UsageError(f"workers must be >= 1, got {workers}")
    t0 = time.monotonic()
    blocks = scan_pool(root).blocks
    reasons: Counter[str] = Counter()
    bad_files: list[dict[str, Any]] = []
    checked = ok = vanished = quarantined = 0
    nbytes = 0
    tick = _progress(len(blocks), progress)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gdskv-verify") as ex:
        for block, outcome in _map_bounded(ex, lambda b: _verify_one(root, b, quarantine), blocks, workers * 64):
            tick()
            kind, detail, size, moved = outcome
            nbytes += size
            if kind == "vanished":
                vanished += 1
                continue
            checked += 1
            if kind == "ok":
                ok += 1
                continue
            reasons[kind] += 1
            quarantined += moved is not None
            if len(bad_files) < MAX_LISTED_BAD:
                bad_files.append({"path": block.path, "reason": kind, "detail": detail, "quarantined_to": moved})
    tick(done=True)
    bad = sum(reasons.values())
    return {"root": os.path.abspath(root), "checked": checked, "ok": ok, "bad": bad, "vanished": vanished,
            "quarantined": quarantined, "reasons": dict(reasons), "bad_files": bad_files,
            "bytes_read": nbytes, "duration_s": round(time.monotonic() - t0, 3),
            "exit_code": EXIT_PROBLEMS if bad else EXIT_OK}


def format_verify(result: dict[str, Any]) -> str:
    lines = [f"pool {result['root']}: {result['checked']} blocks checked, {result['ok']} ok, {result['bad']} bad "
             f"({result['quarantined']} quarantined) in {result['duration_s']:.1f} s"]
    for reason, n in sorted(result["reasons"].items()):
        lines.append(f"  {reason}: {n}")
    for f in result["bad_files"]:
        lines.append(f"  {f['path']}: {f['reason']}: {f['detail']}")
    if result["bad"] > len(result["bad_files"]):
        lines.append(f"  ... and {result['bad'] - len(result['bad_files'])} more")
    return "\n".join(lines)


def _map_bounded(ex: ThreadPoolExecutor, fn: Callable[[BlockFile], Any], items: list[BlockFile],
                 window: int) -> Iterator[tuple[BlockFile, Any]]:
    """``ex.map`` in windows, so a pool of millions of blocks never has millions of futures."""
    for start in range(0, len(items), window):
        chunk = items[start:start + window]
        yield from zip(chunk, ex.map(fn, chunk))


def _verify_one(root: str, block: BlockFile, quarantine: bool) -> tuple[str, str, int, str | None]:
    """(kind, detail, bytes read, quarantine path); kind is ok, vanished, header, checksum or io."""
    try:
        fd = os.open(block.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return "vanished", "", 0, None  # evicted while we walked
    except OSError as exc:
        return "io", f"open failed: {exc.strerror}", 0, None
    try:
        st = os.fstat(fd)
        raw = os.pread(fd, HEADER_SIZE, 0)
        if raw[:len(REF_MAGIC)] == REF_MAGIC and is_ref_size(st.st_size):
            return _verify_ref(root, block, fd, st, quarantine)
        try:
            header = parse_header(raw, key=block.key, file_size=st.st_size)
            if header.fingerprint.hex()[:len(block.fp)] != block.fp:
                raise FormatError("fingerprint differs from its directory")
        except FormatError as exc:
            return "header", str(exc), len(raw), _quarantine(root, block, st.st_ino, "bad header", quarantine)
        payload = _pread_exact(fd, header.payload_len, HEADER_SIZE)
        got = checksum_bytes(payload)
        if got != header.checksum:
            return ("checksum", f"header {header.checksum:#018x}, data {got:#018x}", len(raw) + len(payload),
                    _quarantine(root, block, st.st_ino, "checksum mismatch", quarantine))
        return "ok", "", len(raw) + len(payload), None
    except OSError as exc:
        return "io", f"read failed: {exc.strerror or exc}", 0, None
    finally:
        os.close(fd)


def _verify_ref(root: str, block: BlockFile, fd: int, st: os.stat_result,
                quarantine: bool) -> tuple[str, str, int, str | None]:
    """An arena reference: check it, then the slab slot it names, like a block file."""
    raw = _pread_exact(fd, st.st_size, 0)
    fingerprint, slot_bytes = raw[16:48], int.from_bytes(raw[48:56], "little")
    try:
        if fingerprint.hex()[:len(block.fp)] != block.fp:
            raise FormatError("fingerprint differs from its directory")
        ref = parse_ref(raw, key=block.key, fingerprint=fingerprint, slot_bytes=slot_bytes)
    except FormatError as exc:
        return "header", f"reference: {exc}", len(raw), _quarantine(root, block, st.st_ino, "bad reference", quarantine)
    slab_path = os.path.join(os.path.dirname(os.path.dirname(block.path)), SLABS_DIR, ref.slab)
    try:
        sfd = os.open(slab_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return "header", f"slab {ref.slab} is missing", len(raw), _quarantine(
            root, block, st.st_ino, "missing slab", quarantine)
    try:
        off = ref.slot * slot_bytes
        head = _pread_exact(sfd, HEADER_SIZE, off) if off + slot_bytes <= os.fstat(sfd).st_size else b""
        try:
            header = parse_header(head, fingerprint=fingerprint, key=block.key, file_size=slot_bytes)
            if header.created_ns != ref.created_ns:
                raise FormatError("slot holds another record than its reference names")
        except FormatError as exc:
            return "header", f"slot {ref.slab}#{ref.slot}: {exc}", len(raw) + len(head), _quarantine(
                root, block, st.st_ino, "bad slot", quarantine)
        payload = _pread_exact(sfd, header.payload_len, off + HEADER_SIZE)
        got = checksum_bytes(payload)
        if got != header.checksum:
            return ("checksum", f"slot {ref.slab}#{ref.slot}: header {header.checksum:#018x}, data {got:#018x}",
                    len(raw) + len(head) + len(payload), _quarantine(root, block, st.st_ino, "checksum mismatch",
                                                                     quarantine))
        return "ok", "", len(raw) + len(head) + len(payload), None
    finally:
        os.close(sfd)


def _quarantine(root: str, block: BlockFile, ino: int, reason: str, enabled: bool) -> str | None:
    """Move the file we checked (same inode) out of the lookup path; None if not moved."""
    if not enabled:
        return None
    try:
        if os.stat(block.path, follow_symlinks=False).st_ino != ino:
            return None
        dest = quarantine_destination(root, block.key.hex(), reason)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.rename(block.path, dest)
    except FileNotFoundError:
        return None
    return dest


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    done = 0
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(errno.EIO, f"file ended {n - done} bytes short")
        done += got
    return bytes(buf)


def _progress(total: int, enabled: bool) -> Callable[..., None]:
    """A tick function drawing tqdm if installed, else a counter on stderr at most twice a second."""
    if not enabled or total == 0:
        return lambda done=False: None
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, unit="blk", file=sys.stderr, desc="verify")

        def tick(done: bool = False) -> None:
            if done:
                bar.close()
            else:
                bar.update(1)
        return tick
    state = {"n": 0, "last": 0.0}

    def tick(done: bool = False) -> None:
        if not done:
            state["n"] += 1
        now = time.monotonic()
        if done or now - state["last"] >= 0.5:
            state["last"] = now
            sys.stderr.write(f"\rverify: {state['n']}/{total}" + ("\n" if done else ""))
            sys.stderr.flush()
    return tick


def _files_with_sizes(d: str, suffix: str = "") -> list[int]:
    try:
        names = [n for n in os.listdir(d) if n.endswith(suffix)]
    except FileNotFoundError:
        return []
    return list(_sizes(os.path.join(d, n) for n in names))


def _sizes(paths: Iterable[str]) -> list[int]:
    out = []
    for p in paths:
        try:
            out.append(os.stat(p, follow_symlinks=False).st_size)
        except FileNotFoundError:
            pass
    return out


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

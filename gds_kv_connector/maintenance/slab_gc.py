"""Removing arena slabs that no owner holds and no reference names (``gds-kv gc``).

A slab outlives its owner so the next process can adopt it (arena.py).  When fewer owners come
back than left, their slabs stay: on tmpfs that is host memory, on a disk pool disk space, held
until someone adopts them.  A slab can go once three things hold together:

* it was created on this host (some shared filesystems keep ``flock`` per node, so a free lock
  seen from another node proves nothing; run gc on each node);
* its ``flock`` is free, and this process takes it (``LOCK_EX|LOCK_NB``) and keeps it while it
  decides, so no owner can adopt the slab meanwhile and start publishing into it;
* no reference file in the slab's fingerprint directory names it.  Only a slab's owner links
  references to it, and there is none while the lock is held here, so none can appear.

A slab is created under a hidden temporary name (arena.slab_tmp_name) and renamed once locked and
sized; a creator that died before the rename leaves that file.  No reference can name it (its
owner never published into it), so it goes once its lock is free and it is older than FRESH_S.

Reference files are recognised by their magic and size only, and any that names the slab keeps
it: a damaged or foreign reference errs towards keeping bytes, never towards removing a slab
that a valid reference still needs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from gds_kv_connector.store.arena import lock_if_unowned

from gds_kv_connector.format.layout import SLAB_SUFFIX, SLABS_DIR, slab_host_is_legacy_prefix, slab_host_is_this, slab_of_tmp_name
from gds_kv_connector.format.records import REF_HEADER_SIZE, is_ref_size, ref_slab_name
from gds_kv_connector.maintenance.pool_scan import BlockFile, fingerprint_dirs, layout_dir, list_dir, scan_pool



@dataclass
class SlabReport:
    removed: list[str] = field(default_factory=list)  # paths
    removed_bytes: int = 0  # of the slabs and temporary files removed
    temps_removed: list[str] = field(default_factory=list)  # paths of slabs whose creator died creating them
    kept_referenced: int = 0  # free slabs some reference still names
    held: int = 0  # slabs (or temporary files) a live owner holds, or changed in the last FRESH_S
    other_hosts: int = 0  # slabs created on another host: left to a gc run there
    legacy_skipped: int = 0  # named before host tags with this host's first 32 characters: not taken

    def to_dict(self) -> dict[str, int]:
        return {"slabs_removed": len(self.removed), "slab_bytes_removed": self.removed_bytes,
                "slabs_kept_referenced": self.kept_referenced, "slabs_held_by_owners": self.held,
                "slabs_of_other_hosts": self.other_hosts, "slab_temps_removed": len(self.temps_removed),
                "legacy_slabs_skipped": self.legacy_skipped}


def remove_orphan_slabs(root: str, dry_run: bool = False, now: float | None = None,
                        legacy: bool = False) -> SlabReport:
    """Remove (or with ``dry_run`` only count) every slab below ``root`` that is unowned and unnamed.
    Stale temporary files of creators that died go too.  A file changed in the last ``FRESH_S`` is
    left alone: its creator opens it before it locks it (under the slab's own name, before versions
    that create slabs under a temporary name).  With ``legacy``, slabs named before host tags with
    this host's first 32 characters (:func:`~.arena.slab_host_is_legacy_prefix`) are taken for this
    host's; without it they are counted (``legacy_slabs_skipped``), since after an upgrade on a host
    whose name is longer nothing else would ever remove them."""
    report = SlabReport()
    now = time.time() if now is None else now
    base = layout_dir(root)
    locked: dict[str, int] = {}  # slab path -> descriptor holding its lock
    temps: dict[str, int] = {}  # temporary file path -> descriptor holding its lock
    try:
        for fp in fingerprint_dirs(root):
            slab_dir = os.path.join(base, fp, SLABS_DIR)
            for name in sorted(list_dir(slab_dir)):
                slab = slab_of_tmp_name(name)
                if slab is None and (not name.endswith(SLAB_SUFFIX) or name.startswith(".")):
                    continue
                if not slab_host_is_this(slab or name):
                    if not slab_host_is_legacy_prefix(slab or name):
                        report.other_hosts += 1
                        continue
                    if not legacy:
                        report.legacy_skipped += 1
                        continue
                path = os.path.join(slab_dir, name)
                fd = lock_if_unowned(path, now)
                if fd is None:
                    report.held += 1
                else:
                    (locked if slab is None else temps)[path] = fd
        for path, fd in temps.items():
            size = _remove(path, fd, dry_run)
            if size is not None:
                report.temps_removed.append(path)
                report.removed_bytes += size
        if not locked:
            return report
        # Walked only now, with the locks held: a reference its owner linked before it died, after
        # any earlier walk, is seen.
        scan = scan_pool(root)
        if scan.unreadable:  # a reference in a directory this process cannot read may name any of them
            report.kept_referenced += len(locked)
            return report
        named = _referenced_slabs([b for b in scan.blocks if is_ref_size(b.size)])
        for path, fd in locked.items():
            fp = os.path.basename(os.path.dirname(os.path.dirname(path)))
            if (fp, os.path.basename(path)) in named:
                report.kept_referenced += 1
                continue
            size = _remove(path, fd, dry_run)
            if size is not None:
                report.removed.append(path)
                report.removed_bytes += size
    finally:
        for fd in [*locked.values(), *temps.values()]:
            os.close(fd)
    return report


def _remove(path: str, fd: int, dry_run: bool) -> int | None:
    """Unlink (unless ``dry_run``) a file this process holds the lock of; its size, or None when
    it was gone already."""
    size = os.fstat(fd).st_size
    if not dry_run:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None
    return size


def _referenced_slabs(refs: list[BlockFile]) -> set[tuple[str, str]]:
    """(fingerprint directory, slab name) of every slab the reference files in ``refs`` name; one
    read per inode (a batch's reference is hard-linked under every key of the batch)."""
    named: set[tuple[str, str]] = set()
    seen: set[int] = set()
    for ref in refs:
        if ref.ino in seen:
            continue
        seen.add(ref.ino)
        try:
            fd = os.open(ref.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            raw = os.pread(fd, REF_HEADER_SIZE, 0)
        except OSError:
            continue
        finally:
            os.close(fd)
        slab = ref_slab_name(raw) if len(raw) == REF_HEADER_SIZE else None
        if slab is not None:
            named.add((ref.fp, slab))
    return named

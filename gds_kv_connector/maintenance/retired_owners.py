"""The counters of owners gone for good.

An owner's stats file holds what its process did, and ``gds-kv stats`` sums those files; gc
removes a file a week after its owner last wrote it, which would take that process's work out of
the totals.  So before it goes, its counters are added to
its root's archive, ``owners/retired-owners.json`` (:func:`fold_retired_owners`), which
``gds-kv stats`` adds back.  Gauges say what a process holds now, and a gone one holds nothing:
they are not kept.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from gds_kv_connector.util.atomic_file import atomic_write, warn_once
from gds_kv_connector.maintenance.owner_stats import STATS_SUFFIX, good_int, good_name, load_json, read_owner_stats
from gds_kv_connector.maintenance.pool_scan import owners_dir

log = logging.getLogger(__name__)

RETIRED_NAME = "retired-owners.json"
RETIRED_VERSION = 1
# How long a folded file's name is kept in the archive: long enough for every gc run to have
# unlinked a file that was folded but left (a crash between the two) and, in a pool of several
# roots, for the copies the same owner wrote to the other roots to have been folded there too.
FOLDED_KEEP_S = 7 * 86_400.0


@dataclass(frozen=True)
class RetiredOwners:
    """One root's archive of retired owners' counters."""

    retired: int = 0  # stats files folded in, ever
    counters: dict[str, int] = field(default_factory=dict)  # their counters, summed
    # file names (less the suffix) folded in the last FOLDED_KEEP_S, and when: such a file still
    # present is counted here, not again
    folded: dict[str, int] = field(default_factory=dict)


def retired_path(root: str) -> str:
    return os.path.join(owners_dir(root), RETIRED_NAME)


def read_retired(root: str) -> RetiredOwners | None:
    """The root's archive, empty if there is none; None if there is one that cannot be read or
    fails a check, since a sum half understood is not one to add to or to report."""
    path = retired_path(root)
    if not os.path.lexists(path):
        return RetiredOwners()
    data = load_json(path)
    if not isinstance(data, dict) or data.get("version") != RETIRED_VERSION or not good_int(data.get("retired")):
        return None
    counters, folded = data.get("counters"), data.get("folded")
    if not (_good_numbers(counters) and _good_numbers(folded)):
        return None
    return RetiredOwners(data["retired"], counters, folded)


def fold_retired_owners(root: str, names: Sequence[str], now: float) -> list[str]:
    """Add the counters of the stats files ``names`` in the root's owners directory, of owners gone
    for good, to its archive; returns those of ``names`` that may now be unlinked.

    The archive is written before any file goes, so a crash loses no counters, and it records the
    names it folded, so a file folded but not unlinked (a crash in between, a second evictor) is
    never folded twice.  Callers hold the root's eviction lock, so no two folds read and replace
    the archive at once (two evictors that both broke a stale O_EXCL lock could, and the later
    write would drop the earlier one's fold).  A file that cannot be read as stats is not counted
    by ``gds-kv stats`` either, and goes with nothing folded.  While the archive cannot be read or
    written, nothing goes: the files keep their counters counted.
    """
    archive = read_retired(root)
    if archive is None:
        warn_once(retired_path(root), "%s cannot be read; stats files of retired owners are kept", retired_path(root))
        return []
    now_ns = int(now * 1e9)
    folded = {stem: t for stem, t in archive.folded.items() if now_ns - t <= FOLDED_KEEP_S * 1e9}
    counters = Counter(archive.counters)
    retired = archive.retired
    entries = read_owner_stats(root)
    for name in names:
        stem = name[:-len(STATS_SUFFIX)]
        if stem in folded or stem not in entries:
            continue
        counters.update(entries[stem]["counters"])
        folded[stem] = now_ns
        retired += 1
    if folded != archive.folded:
        body = {"version": RETIRED_VERSION, "retired": retired, "counters": dict(sorted(counters.items())),
                "folded": dict(sorted(folded.items()))}
        try:
            atomic_write(retired_path(root), json.dumps(body).encode())
        except OSError as exc:
            log.warning("cannot write %s: %s; stats files of retired owners are kept", retired_path(root), exc)
            return []
    return list(names)


def _good_numbers(values: object) -> bool:
    return isinstance(values, dict) and all(good_name(k) and good_int(v) for k, v in values.items())

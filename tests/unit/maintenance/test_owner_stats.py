"""Owners' stats files: counters summed over every process that published, gauges over live ones."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

from gds_kv_connector.maintenance.owner_stats import Snapshot, StatsPublisher, read_owner_stats
from gds_kv_connector.maintenance.operations import format_stats, gc, stats
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.maintenance.pool_scan import owners_dir
from gds_kv_connector.util.counters import Stats


def pool_root(tmp_path) -> str:
    root = str(tmp_path)
    BlockPool((root,), b"\x01" * 32, 4096, 16, geometry_note="t")
    return root


def test_gauges_count_for_live_owners_only_and_counters_for_every_owner(tmp_path):
    root = pool_root(tmp_path)
    # owner A (an arena of 1000 slots, 800 used) exits; owner B on the same host adopts its slabs
    a = StatsPublisher([root], "node1-100", lambda: Snapshot(
        {"blocks_saved": 500, "arena_slabs_created": 4}, {"arena_owned_slots": 1000, "arena_used_slots": 800}),
        interval_s=3600)
    a.close()
    b = StatsPublisher([root], "node1-200", lambda: Snapshot(
        {"blocks_saved": 20, "arena_slabs_adopted": 4}, {"arena_owned_slots": 1000, "arena_used_slots": 800}),
        interval_s=3600)
    b.publish()
    result = stats(root)
    assert result["counters_total"] == {"arena_slabs_adopted": 4, "arena_slabs_created": 4, "blocks_saved": 520}
    assert result["gauges_total"] == {"arena_owned_slots": 1000, "arena_used_slots": 800}
    assert result["owners_live"] == 1
    assert [(o["owner"], o["final"], o["live"]) for o in result["owners"].values()] == [
        ("node1-100", True, False), ("node1-200", False, True)]
    assert "final" in format_stats(result) and "gauges of the 1 live owner(s) summed" in format_stats(result)
    # B stops publishing without a final file (killed): after a few intervals it is taken for gone
    later = stats(root, now=time.time() + 4 * 3600)
    assert later["gauges_total"] == {} and later["owners_live"] == 0
    assert later["counters_total"] == result["counters_total"]
    b.close()
    with open(a.paths()[0]) as fh:
        body = json.load(fh)
    assert body["final"] and body["interval_s"] == 3600 and body["started_ns"] == a.started_ns
    assert body["gauges"] == {"arena_owned_slots": 1000, "arena_used_slots": 800}
    assert body["counters"] == {"arena_slabs_created": 4, "blocks_saved": 500}


def test_a_restarted_owner_keeps_the_previous_process_counters(tmp_path):
    """A container restart often brings the same host name and pid, so the same owner id."""
    root = pool_root(tmp_path)
    first = StatsPublisher([root], "pod_7-42", lambda: {"blocks_saved": 10_000}, interval_s=3600)
    first.close()
    second = StatsPublisher([root], "pod_7-42", lambda: {"blocks_saved": 3}, interval_s=3600)
    second.publish()
    assert stats(root)["counters_total"] == {"blocks_saved": 10_003}
    second.close()
    assert len(read_owner_stats(root)) == 2


def test_stats_files_of_earlier_versions_stay_readable(tmp_path):
    root = pool_root(tmp_path)
    with open(os.path.join(owners_dir(root), "old_host-7.stats.json"), "w") as fh:
        json.dump({"owner": "old_host-7", "host": "old_host", "pid": 7, "updated_ns": time.time_ns(),
                   "counters": {"blocks_saved": 7}}, fh)
    o = stats(root)["owners"]["old_host-7"]
    assert o["counters"] == {"blocks_saved": 7} and o["gauges"] == {} and not o["final"] and o["live"]
    assert o["invalid"] == []


def test_out_of_range_owner_fields_are_dropped_and_named(tmp_path):
    root = pool_root(tmp_path)
    d = owners_dir(root)
    with open(os.path.join(d, "x.stats.json"), "w") as fh:
        fh.write('{"owner": "x\\ny", "pid": "abc", "updated_ns": 1' + "0" * 400 + ', "interval_s": NaN, '
                 '"final": "yes", "counters": {"ok": 5, "huge": 1' + "0" * 30 + ', "neg": -1, "flag": true, '
                 '"f": 1.5}, "gauges": [1]}')
    result = stats(root)
    assert list(result["owners"]) == ["x"]
    o = result["owners"]["x"]
    assert o["owner"] == "x" and o["counters"] == {"ok": 5} and o["gauges"] == {}
    assert o["updated_ns"] is None and o["age_s"] is None and o["pid"] is None and not o["final"] and not o["live"]
    assert o["invalid"] == ["counters.f", "counters.flag", "counters.huge", "counters.neg", "final", "gauges",
                            "interval_s", "owner", "pid", "updated_ns"]
    assert result["counters_total"] == {"ok": 5}
    json.dumps(result, allow_nan=False)
    assert "ignored invalid counters.f" in format_stats(result)
    with open(os.path.join(d, "deep.stats.json"), "w") as fh:
        fh.write("[" * 200_000)  # json recursion, not a ValueError
    assert list(stats(root)["owners"]) == ["x"]


def test_worker_snapshot_publishes_arena_holdings_as_gauges():
    from gds_kv_connector.connector.worker import GdsKvConnectorWorker
    usage = {"owned_slots": 10, "used_slots": 4, "free_slots": 6, "ready_slots": 5, "mapped_slabs": 1,
             "slabs_created": 1, "slabs_adopted": 2}
    counters = Stats()
    counters.add("blocks_saved", 3)
    worker = SimpleNamespace(stats=counters, pool=SimpleNamespace(arena=SimpleNamespace(usage=lambda: usage)))
    snap = GdsKvConnectorWorker._snapshot(worker)
    assert snap.gauges == {"arena_owned_slots": 10, "arena_used_slots": 4, "arena_free_slots": 6,
                           "arena_ready_slots": 5, "arena_mapped_slabs": 1}
    assert snap.counters == {"blocks_saved": 3, "arena_slabs_created": 1, "arena_slabs_adopted": 2}
    assert snap["arena_used_slots"] == 4 and snap["blocks_saved"] == 3  # still one mapping to read


def test_a_failed_stats_write_keeps_the_last_good_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    """A short write (a nearly full disk) used to replace an owner's good stats file with half a
    JSON document, and the owner vanished from `gds-kv stats`."""
    import errno

    import pytest

    from gds_kv_connector.util import atomic_file
    from gds_kv_connector.maintenance.owner_stats import write_owner_stats

    root = str(tmp_path)
    path = write_owner_stats(root, "me", {"save_blocks": 1}, started_ns=1)
    good = open(path, "rb").read()
    calls = []

    def short_then_full(fd, data, offset):
        calls.append(len(data))
        if len(calls) == 1:
            return os.write(fd, bytes(data[:5]))  # a short write: the loop carries on
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic_file.os, "pwrite", short_then_full)
    with pytest.raises(OSError):
        write_owner_stats(root, "me", {"save_blocks": 2}, started_ns=1)
    assert len(calls) == 2
    assert open(path, "rb").read() == good
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]


WEEK_S = 7 * 86_400
RETIRED_NAME = "retired-owners.json"  # docs/format.md, README "Metrics"


def _owners_one_gone_for_a_week(roots: list[str]) -> tuple[StatsPublisher, StatsPublisher]:
    """Owner 100 (with gauges) exited over a week ago; owner 200 exited just now; both published into
    every root."""
    gone = StatsPublisher(roots, "node1-100", lambda: Snapshot({"blocks_saved": 500, "bytes_saved": 5000},
                                                               {"arena_owned_slots": 8}), interval_s=3600)
    gone.close()
    recent = StatsPublisher(roots, "node1-200", lambda: {"blocks_saved": 20}, interval_s=3600)
    recent.close()
    old = time.time() - WEEK_S - 3600
    for path in gone.paths():
        os.utime(path, (old, old))
    return gone, recent


def _stem(path: str) -> str:
    return os.path.basename(path)[:-len(".stats.json")]


def test_gc_keeps_the_counters_of_owners_whose_stats_files_it_removes(tmp_path):
    """gc removes an owner's stats file a week after its last update; its counters used to leave the
    pool's totals with it."""
    root = pool_root(tmp_path)
    gone, recent = _owners_one_gone_for_a_week([root])
    before = stats(root)["counters_total"]
    assert before == {"blocks_saved": 520, "bytes_saved": 5000}
    gc(root, 0, 0.9)
    assert not os.path.exists(gone.paths()[0]) and os.path.exists(recent.paths()[0])
    after = stats(root)
    assert after["counters_total"] == before and list(after["owners"]) == [_stem(recent.paths()[0])]
    # gauges describe a live process: a retired one's are not kept
    assert after["retired"] == {"owners": 1, "counters": {"blocks_saved": 500, "bytes_saved": 5000},
                                "unreadable": False}
    assert after["roots"][0]["retired"] == after["retired"]
    assert "owners' counters summed (with 1 retired owner process(es)): blocks_saved=520" in format_stats(after)
    with open(os.path.join(owners_dir(root), RETIRED_NAME)) as fh:
        archive = json.load(fh)
    assert archive["version"] == 1 and archive["retired"] == 1 and list(archive["folded"]) == [_stem(gone.paths()[0])]
    gc(root, 0, 0.9)  # nothing more to retire: nothing counted again
    assert stats(root)["counters_total"] == before
    # a week on, the other owner retires too; the first one's name has served its purpose
    gc(root, 0, 0.9, now=time.time() + WEEK_S + 3600)
    later = stats(root)
    assert later["counters_total"] == before and later["owners"] == {} and later["retired"]["owners"] == 2
    with open(os.path.join(owners_dir(root), RETIRED_NAME)) as fh:
        assert list(json.load(fh)["folded"]) == [_stem(recent.paths()[0])]
    assert "owners' counters summed (with 2 retired owner process(es)): blocks_saved=520" in format_stats(later)


def test_a_retired_stats_file_left_behind_is_neither_counted_nor_folded_twice(tmp_path, monkeypatch):
    """An evictor that dies between writing the archive and unlinking the file leaves both."""
    from gds_kv_connector.maintenance import eviction

    root = pool_root(tmp_path)
    gone, recent = _owners_one_gone_for_a_week([root])
    with monkeypatch.context() as m:
        m.setattr(eviction, "_unlink_quiet", lambda path: False)
        gc(root, 0, 0.9)
    assert os.path.exists(gone.paths()[0])
    result = stats(root)
    assert result["counters_total"] == {"blocks_saved": 520, "bytes_saved": 5000}
    assert list(result["owners"]) == [_stem(recent.paths()[0])]
    gc(root, 0, 0.9)
    assert not os.path.exists(gone.paths()[0])
    result = stats(root)
    assert result["counters_total"] == {"blocks_saved": 520, "bytes_saved": 5000}
    assert result["retired"]["owners"] == 1


def test_retired_counters_count_once_over_several_roots(tmp_path):
    """Owners publish into every root, so every root's archive holds the same owners; one root's gc
    may retire a file before another's does."""
    a, b = pool_root(tmp_path / "a"), pool_root(tmp_path / "b")
    gone, _ = _owners_one_gone_for_a_week([a, b])
    total = {"blocks_saved": 520, "bytes_saved": 5000}
    gc(a, 0, 0.9)  # retired in a, still a stats file in b
    assert [os.path.exists(p) for p in gone.paths()] == [False, True]
    result = stats(f"{a}:{b}")
    assert result["counters_total"] == total and _stem(gone.paths()[0]) not in result["owners"]
    assert [r["counters_total"] for r in result["roots"]] == [total, total]
    gc(f"{a}:{b}", 0, 0.9)
    result = stats(f"{a}:{b}")
    assert result["counters_total"] == total and result["retired"]["owners"] == 1
    assert [r["retired"]["owners"] for r in result["roots"]] == [1, 1]


def test_an_archive_that_cannot_be_read_is_kept_and_so_are_the_stats_files(tmp_path):
    """Folding into an archive read as empty would replace every retired owner's counters."""
    root = pool_root(tmp_path)
    gone, _ = _owners_one_gone_for_a_week([root])
    path = os.path.join(owners_dir(root), RETIRED_NAME)
    with open(path, "w") as fh:
        fh.write('{"version": 1, "retired": 3, "counters": {"blocks_saved": -1}, "folded": {}}')
    gc(root, 0, 0.9)
    assert os.path.exists(gone.paths()[0])
    with open(path) as fh:
        assert json.load(fh)["retired"] == 3
    result = stats(root)
    assert result["counters_total"] == {"blocks_saved": 520, "bytes_saved": 5000}
    assert result["retired"] == {"owners": 0, "counters": {}, "unreadable": True}
    assert f"{RETIRED_NAME} cannot be read" in format_stats(result)

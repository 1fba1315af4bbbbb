"""Settings that parse but cannot work, misspelt names, and files that are not settings files all
fail at start-up in one line naming the setting: none may hang start-up, spin a core, drop every
save, or reach the serving process as a bare exception."""

import json
import os
import re
import time

import pytest

from gds_kv_connector.util.host import host_tag
from gds_kv_connector.config.settings import Settings, SettingsError, parse_size

ROOT = {"TLLM_GDS_KV_ROOT": "/x"}


def _error(env: dict, **kw) -> str:
    with pytest.raises(SettingsError) as exc:
        Settings.load_from(env=env, **kw)
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("name,value,allowed", [
    ("STATS_INTERVAL_S", "1e-300", "must be 0 (off) or 0.1s..1e+09s"),  # a refresh loop spinning idle
    ("DEADLINE_S", "1e-300", "must be 0.1s..1e+09s"),  # every save dropped, every load failing
    ("CONTROL_GRACE_S", "0.001", "must be 0.01s..1e+09s"),
    ("ARENA_SLAB_BYTES", "4KiB", "must be 1MiB..1EiB"),
    ("QUOTA_BYTES", "2EiB", "must be 0..1EiB"),
    ("ASYNC_LOAD_BYTES", "1e99", "must be 0..1EiB"),
    ("ADMISSION", "seen:\u00b9", "seen:N with N 1..1000000"),  # isdigit() took it, then int() raised
    ("ADMISSION", "seen:10000000", "seen:N with N 1..1000000"),
    ("IO_THREADS", "1e99", "expected a whole number"),  # was int()'s own message
    ("IO_THREADS", "\u0661\u0666", "expected a whole number"),  # Arabic-Indic digits, which int() takes
    ("READ_RETRIES", "9" * 5000, "expected a whole number"),  # past int()'s digit limit
    ("DEADLINE_S", "1_0", "expected a number"),
    ("LOW_WATERMARK", "nan", "expected a number"),
])
def test_a_number_out_of_its_range_or_malformed_is_one_line_saying_what_is_allowed(name, value, allowed):
    msg = _error({**ROOT, f"TLLM_GDS_KV_{name}": value})
    assert msg.startswith(f"TLLM_GDS_KV_{name}") and allowed in msg, msg


def test_values_at_the_bounds_are_taken_exactly():
    s = Settings.load_from(env={**ROOT, "TLLM_GDS_KV_DEADLINE_S": "0.1", "TLLM_GDS_KV_STATS_INTERVAL_S": "0",
                                "TLLM_GDS_KV_CONTROL_GRACE_S": "0.01", "TLLM_GDS_KV_ADMISSION": "seen:1000000",
                                "TLLM_GDS_KV_IO_THREADS": " 8 ", "TLLM_GDS_KV_ARENA_SLAB_BYTES": "1MiB",
                                "TLLM_GDS_KV_QUOTA_BYTES": "9007199254740993"})
    assert (s.deadline_s, s.stats_interval_s, s.io_threads, s.arena_slab_bytes) == (0.1, 0.0, 8, 1 << 20)
    assert s.quota_bytes == 9007199254740993  # a float would have rounded it
    assert parse_size("1EiB") == 1 << 60 and parse_size("1.5G") == 3 << 29 and parse_size("1e3k") == 1000 << 10


@pytest.mark.parametrize("name,value,allowed", [("deadline_s", 1e-300, "0.1s.."),
                                                ("deadline_s", 10**400, "0.1s.."),
                                                ("stats_interval_s", float("inf"), "0 (off) or 0.1s.."),
                                                ("quota_bytes", 10**400, "0..1EiB"), ("io_threads", -1, "1..256")])
def test_a_config_file_number_out_of_range_is_one_line(tmp_path, name, value, allowed):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"root": "/x", name: value}))
    msg = _error({"TLLM_GDS_KV_CONFIG": str(cfg)})
    assert name in msg and allowed in msg, msg


def test_a_misspelt_name_is_answered_with_the_likely_one_in_a_short_line(tmp_path):
    msg = _error({**ROOT, "TLLM_GDS_KV_QUOTA": "1GiB"})
    assert "TLLM_GDS_KV_QUOTA (did you mean TLLM_GDS_KV_QUOTA_BYTES?)" in msg and len(msg) < 200, msg
    assert "TLLM_GDS_KV_TRACE" not in msg  # no list of every setting
    assert "did you mean TLLM_GDS_KV_VERIFY?" in _error({**ROOT, "TLLM_GDS_KV_verify": "0"})
    assert "did you mean TLLM_GDS_KV_CONFIG?" in _error({**ROOT, "TLLM_GDS_KV_CONFG": "/c.json"})
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"root": "/x", "quota": 1}))
    assert "quota (did you mean quota_bytes?)" in _error({"TLLM_GDS_KV_CONFIG": str(cfg)})
    assert "quota (did you mean quota_bytes?)" in _error(ROOT, quota=1)


def test_an_evict_grace_below_the_index_ttl_is_refused_where_the_owner_evicts():
    """An owner promises a block from its index for INDEX_TTL_S after it published or promised it,
    without looking at the file; eviction spares it only EVICT_GRACE_S after that."""
    msg = _error({**ROOT, "TLLM_GDS_KV_QUOTA_BYTES": "1GiB", "TLLM_GDS_KV_EVICT_GRACE_S": "1"})
    assert "TLLM_GDS_KV_EVICT_GRACE_S=1 is below TLLM_GDS_KV_INDEX_TTL_S=5" in msg and ">= INDEX_TTL_S" in msg
    _error({**ROOT, "TLLM_GDS_KV_MIN_FREE_BYTES": "1GiB", "TLLM_GDS_KV_EVICT_GRACE_S": "30",
            "TLLM_GDS_KV_INDEX_TTL_S": "60"})
    Settings.load_from(env={**ROOT, "TLLM_GDS_KV_QUOTA_BYTES": "1GiB", "TLLM_GDS_KV_EVICT_GRACE_S": "5"})
    # no eviction here: `gds-kv gc` takes its quota as an argument, with a grace of its own
    Settings.load_from(env={**ROOT, "TLLM_GDS_KV_EVICT_GRACE_S": "0"})


# -- the config file ----------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_a_fifo_named_as_the_config_file_is_refused_at_once(tmp_path):
    fifo = tmp_path / "c.json"
    os.mkfifo(fifo)  # opening it for reading waits for a writer for ever
    t0 = time.monotonic()
    msg = _error({"TLLM_GDS_KV_CONFIG": str(fifo)})
    assert msg.startswith("TLLM_GDS_KV_CONFIG=") and "not a regular file" in msg
    assert time.monotonic() - t0 < 5


def test_a_device_named_as_the_config_file_is_refused_unread():
    msg = _error({"TLLM_GDS_KV_CONFIG": "/dev/zero"})  # read to its end, it would fill memory
    assert msg.startswith("TLLM_GDS_KV_CONFIG=") and "not a regular file" in msg


def test_a_config_file_over_a_mebibyte_is_refused(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"root": "/x", "model_id": "m" * (2 << 20)}))  # valid JSON, 2 MiB
    msg = _error({"TLLM_GDS_KV_CONFIG": str(cfg)})
    assert msg.startswith("TLLM_GDS_KV_CONFIG=") and "larger than 1MiB" in msg


@pytest.mark.parametrize("suffix,text", [(".json", "[" * 100000 + "]" * 100000),
                                         (".toml", "a = " + "[" * 100000 + "]" * 100000)])
def test_a_config_file_nested_too_deeply_is_one_line(tmp_path, suffix, text):
    cfg = tmp_path / f"c{suffix}"
    cfg.write_text(text)  # the parsers recurse per level: RecursionError
    msg = _error({"TLLM_GDS_KV_CONFIG": str(cfg)})
    assert msg.startswith("TLLM_GDS_KV_CONFIG=") and "nested too deeply" in msg


# -- the arena against the free space -----------------------------------------------------------
def _free(path) -> int:
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize


def test_an_arena_larger_than_the_free_space_is_refused_with_both_numbers(tmp_path):
    root = tmp_path / "pool"  # not made yet: the nearest existing parent's filesystem counts
    want = _free(tmp_path) + (1 << 40)
    env = {"TLLM_GDS_KV_ROOT": str(root), "TLLM_GDS_KV_ARENA_BYTES": str(want)}
    msg = _error(env)
    free = int(re.search(r"(\d+) free", msg)[1])
    assert msg.startswith("TLLM_GDS_KV_ARENA_BYTES=") and f"{want} bytes wanted" in msg
    assert abs(free - _free(tmp_path)) < 1 << 30
    Settings.load_from(env={**env, "TLLM_GDS_KV_ARENA_BYTES": "1MiB"})
    # the ops commands read settings to look at or clean a pool, and must run on a full disk
    Settings.load_from(env=env, require_root=False)


def test_a_restarted_owner_counts_its_own_hosts_slabs_as_room(tmp_path):
    """A restart adopts the slabs its predecessor on this host left, which the free space no longer
    shows; another host's slabs are not this owner's to adopt."""
    slabs = tmp_path / "gdskv-v1" / ("ab" * 8) / "slabs"
    slabs.mkdir(parents=True)
    slab_bytes = 4 << 40  # sparse: takes no space

    def slab(host: str) -> None:
        with open(slabs / f"{host}-123-{'a' * 12}.slab", "wb") as fh:
            fh.truncate(slab_bytes)
    env = {"TLLM_GDS_KV_ROOT": str(tmp_path), "TLLM_GDS_KV_ARENA_BYTES": str(_free(tmp_path) + (2 << 40))}
    slab("otherhost")
    assert "does not fit" in _error(env)
    slab(host_tag())
    assert Settings.load_from(env=env).arena_bytes == int(env["TLLM_GDS_KV_ARENA_BYTES"])


def test_a_filesystem_that_reports_no_size_is_not_judged(tmp_path, monkeypatch):
    """Some FUSE and network mounts report 0 blocks and 0 free, which says nothing of their room."""
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((4096, 4096, 0, 0, 0, 0, 0, 0, 0, 255)))
    assert Settings.load_from(env={"TLLM_GDS_KV_ROOT": str(tmp_path), "TLLM_GDS_KV_ARENA_BYTES": "1TiB"}).arena_bytes

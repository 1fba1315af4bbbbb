"""``gds-kv verify`` in parts and in several runs: ``--shard I/N`` processes verify every name of the
pool once between them, a run stopped (a real SIGTERM, or the ``stop`` event) resumes from its state
to the totals of a run never stopped, another run's state is refused, and a run into a log shows
progress lines."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from gds_kv_connector.cli import main as cli
from gds_kv_connector.format.checksum import CHECKSUM_ALGO, checksum_bytes
from gds_kv_connector.format.records import HEADER_SIZE, BlockHeader
from gds_kv_connector.maintenance import verify as verify_mod
from gds_kv_connector.maintenance.operations import UsageError
from gds_kv_connector.maintenance.pool_scan import quarantine_dir
from gds_kv_connector.maintenance.verify import VerifyInterrupted, format_verify, verify
from gds_kv_connector.maintenance.verify_progress import VerifyProgress
from gds_kv_connector.maintenance.verify_state import Shard, default_state_path, load_state
from gds_kv_connector.store.pool import BlockPool
from tests.support import REPO

CLI = [sys.executable, "-m", "gds_kv_connector.cli"]
PAYLOAD = 512  # the smallest file a block can be: one header page and one payload page
COUNTS = ("checked", "ok", "bad", "vanished", "quarantined", "bytes_read", "unreadable_entries")


def write_pool(roots: list[str], fp: bytes, n: int, first_bytes: range | None = None) -> list[str]:
    """``n`` valid block files of fingerprint ``fp`` over ``roots``, written in the format directly
    (a pool of thousands in a second); keys are hashes, or start with a byte of ``first_bytes``.
    Returns their paths."""
    pool = BlockPool(tuple(roots), fp, PAYLOAD, 16, geometry_note="verify test")
    paths = []
    for i in range(n):
        key = hashlib.sha256(fp + i.to_bytes(8, "little")).digest()
        if first_bytes is not None:
            key = bytes([first_bytes[i % len(first_bytes)]]) + key[1:]
        payload = key * (PAYLOAD // len(key))
        header = BlockHeader(fp, key, PAYLOAD, checksum_bytes(payload), CHECKSUM_ALGO, 16, time.time_ns()).pack()
        os.makedirs(pool.dir_for(key), 0o700, exist_ok=True)
        with open(pool.path_for(key), "wb") as fh:
            fh.write(header + payload + bytes(pool.file_size - HEADER_SIZE - PAYLOAD))
        paths.append(pool.path_for(key))
    return paths


def corrupt(paths: list[str]) -> None:
    """Flip a payload byte of each file: its checksum no longer matches."""
    for p in paths:
        with open(p, "r+b") as fh:
            fh.seek(HEADER_SIZE + 7)
            byte = fh.read(1)
            fh.seek(HEADER_SIZE + 7)
            fh.write(bytes([byte[0] ^ 0x40]))


def totals(result: dict) -> dict:
    return {k: result[k] for k in (*COUNTS, "reasons")}


@pytest.fixture
def two_roots(tmp_path):
    """Two roots, two fingerprints, 400 blocks, 9 of them bad, and a directory at a block name."""
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    paths = write_pool(roots, b"\x41" * 32, 250) + write_pool(roots, b"\x42" * 32, 150)
    bad = paths[::45]
    corrupt(bad)
    shard = os.path.join(roots[0xab % 2], "gdskv-v1", "41" * 8, "ab")
    os.makedirs(shard, exist_ok=True)
    junk = os.path.join(shard, "ab" * 32 + ".blk")
    os.mkdir(junk)
    return roots, paths, bad, junk


@pytest.mark.parametrize("n", [1, 3, 8])
def test_shards_partition_the_pool(two_roots, monkeypatch, n):
    roots, paths, bad, junk = two_roots
    seen: list[str] = []
    lock = threading.Lock()
    real_one, real_junk = verify_mod._verify_one, verify_mod._verify_junk

    def one(root, block, *a):
        with lock:
            seen.append(block.path)
        return real_one(root, block, *a)

    def junk_one(root, entry, *a):
        with lock:
            seen.append(entry.path)
        return real_junk(root, entry, *a)

    monkeypatch.setattr(verify_mod, "_verify_one", one)
    monkeypatch.setattr(verify_mod, "_verify_junk", junk_one)
    results = [verify(roots, workers=2, progress=False, shard=Shard(i, n)) for i in range(n)]
    assert Counter(seen) == Counter(paths + [junk])  # every name once, over the n processes
    assert sum(r["checked"] for r in results) == len(paths) + 1
    assert sum(r["ok"] for r in results) == len(paths) - len(bad)
    found = [f for r in results for f in r["bad_files"]]
    assert sorted(f["path"] for f in found if f["reason"] == "checksum") == sorted(bad)
    assert [f["path"] for f in found if f["reason"] == "junk"] == [junk]
    assert all(not os.path.exists(p) for p in bad) and os.listdir(quarantine_dir(roots[0]))
    assert sum(r["bad"] for r in results) == len(bad) + 1 == sum(r["quarantined"] for r in results)
    if n > 1:  # every process did a part
        assert all(0 < r["checked"] < len(paths) for r in results)
        assert f"shard {n - 1}/{n}: only the shard directories" in format_verify(results[-1])


def test_shard_option_is_checked():
    for text in ("3/3", "1", "-1/2", "0/257", "a/b", "0/0"):
        with pytest.raises(ValueError, match="must be I/N with 0 <= I < N <= 256"):
            Shard.parse(text)
    assert Shard.parse(" 2/8 ") == Shard(2, 8) and Shard(2, 8).owns("0a") and not Shard(2, 8).owns("0b")


class StopAfter(threading.Event):
    """A stop asked for at the ``n``-th look: a run stopped at a chosen point, deterministically."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def is_set(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_stopped_runs_resume_to_the_totals_of_one_run(tmp_path):
    """Stopped every few chunks, mid-directory too (names of a directory go in sorted order), with
    quarantine on: the last run's totals are those of a run on a copy never stopped."""
    roots = [str(tmp_path / "pool")]
    paths = write_pool(roots, b"\x43" * 32, 600, first_bytes=range(0x10, 0x14))  # 150 names a directory
    corrupt(paths[5::37])
    shutil.copytree(roots[0], tmp_path / "copy", symlinks=True)
    whole = verify(str(tmp_path / "copy"), workers=1, progress=False)
    assert whole["bad"] == len(paths[5::37]) and whole["checked"] == 600
    state = str(tmp_path / "verify.state")
    stops = 0
    while True:
        try:
            result = verify(roots, workers=1, progress=False, state_path=state, stop=StopAfter(2))
            break
        except VerifyInterrupted as stopped:
            stops += 1
            assert stopped.state_path == state and stopped.shards_total == 4
            saved = load_state(state, roots, Shard(), True)
            assert saved is not None and saved.totals[0]["checked"] <= 600
    assert stops >= 4 and result["resumed"]
    assert totals(result) == {**totals(whole), "bytes_read": whole["bytes_read"]}
    assert sorted(f["path"] for f in result["bad_files"]) == sorted(paths[5::37])
    assert not os.path.exists(state)  # a finished run leaves no state behind


def test_a_real_sigterm_saves_the_state_and_the_same_command_resumes(tmp_path):
    """SIGTERM to ``gds-kv verify`` mid-run (its first progress line read): it saves its state in
    the default place and says how to resume; the same command again ends with the totals of the
    whole pool, counted once."""
    root = str(tmp_path / "pool")
    paths = write_pool([root], b"\x44" * 32, 20000)
    bad = paths[::997]
    corrupt(bad)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")}
    argv = [*CLI, "verify", "--root", root, "--workers", "1", "--json"]
    proc = subprocess.Popen([*argv, "--progress-every", "0"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert first.startswith("verify: ") and " blocks/s" in first
    assert proc.returncode == 128 + 15 and out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("gds-kv verify: interrupted by SIGTERM") and "run the same command again to resume" in last
    state = default_state_path([root], Shard())
    assert state in last and os.path.exists(state)
    saved = json.load(open(state))
    done = saved["totals"][0]["checked"]
    assert 0 < done < len(paths), "the signal came after the run ended: make the pool bigger"
    again = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    result = json.loads(again.stdout)
    assert again.returncode == 1 and "resuming from " + state in again.stderr
    assert (result["checked"], result["ok"], result["bad"], result["quarantined"]) == \
        (len(paths), len(paths) - len(bad), len(bad), len(bad))
    assert result["reasons"] == {"checksum": len(bad)} and result["resumed"] and not os.path.exists(state)


def test_another_runs_state_is_a_one_line_error(tmp_path, capsys):
    root = str(tmp_path / "pool")
    write_pool([root], b"\x45" * 32, 300)
    other = str(tmp_path / "other")
    write_pool([other], b"\x45" * 32, 1)
    state = str(tmp_path / "s.json")
    with pytest.raises(VerifyInterrupted):
        verify(root, workers=1, progress=False, shard=Shard(0, 2), state_path=state, stop=StopAfter(0))

    def run(*argv: str) -> tuple[int, str]:
        rc = cli.main(["verify", "--root", root, "--state", state, *argv])
        return rc, capsys.readouterr().err

    for argv, message in ((["--shard", "1/2"], "is of --shard 0/2, not 1/2"),
                          (["--shard", "0/2", "--no-quarantine"], "is of a run without --no-quarantine"),
                          (["--shard", "0/2", "--root", other], f"is of pool root(s) {root}, not {other}")):
        rc, err = run(*argv)
        assert rc == 2 and err.count("\n") == 1 and message in err and "--restart to start over" in err
    with open(state, "r+b") as fh:  # not a state any more
        fh.seek(3)
        fh.write(b"}")
    rc, err = run("--shard", "0/2")
    assert rc == 2 and err.count("\n") == 1 and "cannot be resumed from" in err
    rc, err = run("--shard", "1/2", "--restart")
    assert rc == 0 and not os.path.exists(state)
    with pytest.raises(UsageError, match="is of --shard"):  # the same rule for the function
        verify(root, progress=False, state_path=_stopped_state(root, tmp_path), shard=Shard(1, 3))


def _stopped_state(root: str, tmp_path) -> str:
    state = str(tmp_path / "t.json")
    with pytest.raises(VerifyInterrupted):
        verify(root, workers=1, progress=False, state_path=state, stop=StopAfter(0))
    return state


def test_progress_lines_into_a_log(tmp_path):
    """Not a terminal: whole lines (no carriage return), the total an estimate until every shard
    directory is listed, and counts that only grow."""
    root = str(tmp_path / "pool")
    write_pool([root], b"\x46" * 32, 3000)
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.run([*CLI, "verify", "--root", root, "--workers", "1", "--progress-every", "0"],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, timeout=120)
    text = (tmp_path / "log").read_text()
    lines = [line for line in text.splitlines() if line.startswith("verify: ")]
    assert proc.returncode == 0 and "\r" not in text and len(lines) > 5
    done = [int(line.split()[1].split("/")[0]) for line in lines]
    assert done == sorted(done) and done[-1] == 3000
    assert "/~" in lines[0] and "(total estimated from the shard directories listed so far)" in lines[0]
    assert "3000/3000 blocks (100.0%)" in lines[-1]


def test_progress_bar_on_a_terminal():
    class Terminal(list):
        def write(self, s: str) -> None:
            self.append(s)

        def flush(self) -> None:
            pass

    out = Terminal()
    bar = VerifyProgress(out, bar=True)
    bar.update(0, 1000, True)
    bar.update(1000, 1000, False, final=True)
    assert out[-1].startswith("\rverify: [" + "#" * 24 + "] 1000/1000 blocks (100.0%)") and out[-1].endswith("\n")
    assert "250/~1000 blocks (25.0%), 25 blocks/s, ETA 0:00:30" in bar.line(250, 1000, True, 10.0)


def test_a_directory_that_cannot_be_listed_is_counted_once_over_resumed_runs(tmp_path, monkeypatch):
    """Listing failures are this run's (a later run lists again), not saved totals counted twice."""
    root = str(tmp_path / "pool")
    write_pool([root], b"\x47" * 32, 200)
    write_pool([root], b"\x48" * 32, 5)
    hidden = os.path.join(root, "gdskv-v1", "48" * 8)
    real = os.listdir

    def listdir(path="."):
        if os.fspath(path) == hidden:
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    state = str(tmp_path / "s.json")
    with pytest.raises(VerifyInterrupted):
        verify(root, workers=1, progress=False, state_path=state, stop=StopAfter(3))
    result = verify(root, workers=1, progress=False, state_path=state)
    assert result["resumed"] and (result["checked"], result["unreadable_entries"], result["exit_code"]) == (200, 1, 1)

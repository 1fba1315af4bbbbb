"""gds-kv bench --ttft --quick on CPU: every cell runs end to end through the connector, its JSON holds
the times, ratios and break-even bandwidths, and a loaded prefix is the computed one byte for byte."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from gds_kv_connector.bench import ttft
from tests.support import REPO

QUICK_LENGTHS = [64, 128, 256, 512]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a GPU machine
    return env


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ttft")
    out = tmp / "ttft.json"
    proc = subprocess.run(
        [sys.executable, "-m", "gds_kv_connector.bench.main", "--ttft", "--quick", "--device", "cpu",
         "--json", str(out), "--disk-dir", str(tmp / "disk"), "--no-drop-caches", "--no-progress"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"rc {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    with open(out) as fh:
        return json.load(fh), proc.stdout, tmp


def test_every_cell_has_its_times_ratios_and_break_even(quick_run):
    res, stdout, _ = quick_run
    assert res["errors"] == [] and res["skipped"] == []
    assert {(r["prompt_tokens"], r["source"]) for r in res["rows"]} == {
        (n, s) for n in QUICK_LENGTHS for s in ("shm", "disk")}
    for r in res["rows"]:
        assert r["model"] == "tiny" and r["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 2
        assert min(r["ttft_compute_s"], r["ttft_load_s"], r["ttft_policy_s"]) > 0
        assert r["ratio"] == pytest.approx(r["ttft_load_s"] / r["ttft_compute_s"], rel=0.02)
        assert r["policy_vs_best"] == pytest.approx(
            r["ttft_policy_s"] / min(r["ttft_load_s"], r["ttft_compute_s"]), rel=0.02)
        # every full block but the one holding the last prompt token (always computed) was loaded
        assert r["loaded_tokens"] == (r["prompt_tokens"] - 1) // 32 * 32
        assert r["break_even_GBps"] == pytest.approx(
            r["kv_bytes_per_token"] * r["prompt_tokens"] / r["ttft_compute_s"] / 1e9, rel=0.01, abs=1e-3)
        # a cell run once (--quick) serves its prompt's load and policy pair twice, once each way round
        assert len(r["runs"]["compute_s"]) == 1
        assert len(r["policy_loaded"]) == len(r["runs"]["policy_s"]) == len(r["runs"]["load_s"]) == 2
        assert r["policy_first"] == [False, True]
        # where each run's time went, in order (these loads are synchronous: no parked phase)
        phases = r["phases_ms"]
        assert [len(phases[k]) for k in ("compute", "load", "policy")] == [1, 2, 2]
        for run in phases["compute"] + phases["load"] + phases["policy"]:
            assert list(run) == ["admitted", "forward", "first_token"], run
            assert list(run.values()) == sorted(run.values()), run
        assert set(r["spans_ms"]["load"]) == {"to_admitted", "to_forward", "forward"}  # never parked
        assert sum(r["spans_ms"]["compute"].values()) == pytest.approx(phases["compute"][0]["first_token"], abs=1e-2)
        assert [run["first_token"] for run in phases["load"]] == pytest.approx(
            [1e3 * s for s in r["runs"]["load_s"]], rel=1e-3, abs=1e-3)
        assert set(r["policy_estimate"]) == {"load_GBps", "load_s", "load_fixed_s", "after_load_s", "compute_s",
                                               "compute_fit"}
    disk = [r for r in res["rows"] if r["source"] == "disk"]
    assert all(r["cold"]["method"] == "posix_fadvise(DONTNEED)" and r["cold"]["fadvise_files"] > 0 for r in disk)
    assert [t["pass"] for t in res["targets"]][0] is None  # the 8B target is not run at --quick
    assert "ratio = load TTFT / recompute TTFT" in stdout and "JSON:" in stdout


def test_loaded_blocks_equal_the_computed_ones_byte_for_byte(quick_run):
    res, _, _ = quick_run
    assert all(r["verified"] for r in res["rows"])


def test_a_load_that_writes_nothing_fails_the_comparison(tmp_path, monkeypatch):
    """The loaded pages are filled with another byte first, so only a load that wrote them passes."""
    from gds_kv_connector.transfer.manager import TransferManager

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(TransferManager, "_run_load",
                        lambda self, op, event, deadline, in_time: len(op.keys) * self.pool.payload_len)
    out = tmp_path / "ttft.json"
    rc = ttft.main(["--quick", "--device", "cpu", "--lengths", "64", "--sources", "disk", "--json", str(out),
                    "--disk-dir", str(tmp_path / "disk"), "--no-drop-caches", "--no-progress"])
    res = json.loads(out.read_text())
    assert rc == 0 and [r["verified"] for r in res["rows"]] == [False]


def test_a_parked_load_is_stamped_when_its_report_comes(tmp_path, monkeypatch):
    """A load above the asynchronous threshold parks its request: the run's phases say when
    get_finished reported it, between its admission and its first forward."""
    import contextlib

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    bench_env = ttft.connector_env

    @contextlib.contextmanager
    def small_async_loads(*a, **kw):  # the bench sets the connector's environment; this one setting added
        with bench_env(*a, **kw):
            os.environ["TLLM_GDS_KV_ASYNC_LOAD_BYTES"] = "4096"
            yield
    monkeypatch.setattr(ttft, "connector_env", small_async_loads)
    out = tmp_path / "ttft.json"
    rc = ttft.main(["--quick", "--device", "cpu", "--lengths", "256", "--sources", "shm", "--json", str(out),
                    "--shm-dir", str(tmp_path / "shm"), "--no-progress"])
    row = json.loads(out.read_text())["rows"][0]
    assert rc == 0 and row["loaded_tokens"] > 0
    for run in row["phases_ms"]["load"]:
        assert list(run) == ["admitted", "loaded", "forward", "first_token"], run
        assert list(run.values()) == sorted(run.values()), run
    spans, runs = row["spans_ms"]["load"], row["phases_ms"]["load"]
    assert spans["parked"] == pytest.approx(
        sum(run["loaded"] - run["admitted"] for run in runs) / len(runs), abs=2e-3)  # two runs: their mean


def _row(model, tokens, compute_ms, load_ms, policy_ms, loaded):
    return {"model": model, "prompt_tokens": tokens, "source": "shm", "ratio": load_ms / compute_ms,
            "ttft_compute_s": compute_ms / 1e3, "ttft_load_s": load_ms / 1e3, "ttft_policy_s": policy_ms / 1e3,
            "policy_vs_best": policy_ms / min(load_ms, compute_ms), "policy_loaded": loaded}


def test_a_choice_is_judged_by_its_paths_median_apart_from_the_spread_of_its_run():
    """A policy run that loaded where loading's median is the better path counts as a right choice
    even when that run was slow; one that loaded where loading is over 10% slower does not."""
    rows = [_row("llama-3.1-8b", 1024, 27.0, 38.0, 39.0, [True, True, False]),   # loading is the slower path
            _row("llama-3.1-8b", 2048, 50.0, 33.0, 39.0, [True, True, True]),    # right choice, slow runs
            _row("llama-3.1-8b", 32768, 1300.0, 125.0, 124.0, [True])]
    assert [ttft.choices_ok(r) for r in rows] == [[False, False, True], [True, True, True], [True]]
    host, policy, choices = ttft.evaluate_targets(rows)
    assert host["pass"] is True and policy["name"].startswith("policy TTFT / min(load, recompute)")
    assert policy["pass"] is False and policy["where"] == "llama-3.1-8b 1024 shm"
    assert choices["name"].startswith("policy runs that chose a path")
    assert choices["value"] == "5 of 7" and choices["where"] == "llama-3.1-8b 1024 shm" and choices["pass"] is False
    assert ttft.evaluate_targets(rows[1:])[2]["pass"] is True


def test_lengths_take_k_for_1024():
    assert ttft.parse_lengths("1k,2k,512,128k") == [1024, 2048, 512, 131072]


def test_a_prompt_computed_once_serves_pairs_while_they_are_cheap_beside_its_compute():
    args = argparse.Namespace(repeat=5, tokens_per_block=32)
    geo = ttft.GEOMETRIES["tiny"]
    long = ttft.Cell(geo, None, ttft.REPEAT_MAX_TOKENS + 1, "shm", "", args)
    short = ttft.Cell(geo, None, ttft.REPEAT_MAX_TOKENS, "shm", "", args)
    assert [short.more_pairs(k, 0.0, 1.0) for k in range(2)] == [True, False]  # one per prompt: 5 prompts

    def served(pair_s: float, compute_s: float) -> int:
        done = 0
        while long.more_pairs(done, done * pair_s, compute_s):
            done += 1
        return done
    assert served(13.0, 9.0) == 2  # a cold disk's load and a recompute per pair: each order once, no more
    assert served(0.2, 0.67) == 6  # host-memory loads beside a long compute: up to MAX_PAIRS
    assert served(0.4, 1.0) == 4  # four take 1.6 s, six would take 2.4 s: past twice the compute
    assert all(served(t, 1.0) % 2 == 0 for t in (0.1, 0.3, 0.45, 0.6, 2.0))  # each order equally often


def test_each_repeated_length_is_warmed_up_before_its_cells(tmp_path, monkeypatch):
    """A shape's first forward is slower (kernel plans): each length of up to REPEAT_MAX_TOKENS runs its
    forwards outside any connector before its cells, so the policy's first samples are not cold."""
    warmed: list[int] = []
    original = ttft.Decoder.warm_up
    monkeypatch.setattr(ttft.Decoder, "warm_up", lambda self, tokens, tpb: (warmed.append(tokens),
                                                                           original(self, tokens, tpb)))
    monkeypatch.setattr(ttft, "REPEAT_MAX_TOKENS", 100)
    out = tmp_path / "ttft.json"
    rc = ttft.main(["--quick", "--device", "cpu", "--lengths", "64,96,128", "--sources", "shm", "--json", str(out),
                    "--no-progress"])
    assert rc == 0 and len(json.loads(out.read_text())["rows"]) == 3
    assert warmed == [128, 64, 96]  # the model's warm-up (its longest length), then 64 and 96, not 128

"""GPU checksum kernel against the CPU definition, on a CUDA device with CuPy."""

from __future__ import annotations

import importlib.util
import time
import warnings

import pytest
import torch

from gds_kv_connector.format.checksum import checksum_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                       reason="needs a CUDA device and CuPy"),
]

LENGTHS = [1, 7, 8, 9, 4095, 4096, 65543, 1 << 20, 4 << 20, 10 << 20, (10 << 20) + 5]


def _random(shape, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=gen)


def _cpu_sums(views) -> list[int]:
    return [checksum_bytes(v.cpu().numpy()) for v in views]


@pytest.mark.parametrize("length", LENGTHS)
def test_matches_cpu_definition(length):
    from gds_kv_connector.engines.gpu_checksum import checksums_device

    n = 3 if length >= 4 << 20 else 17
    rows = _random((n, length), length)  # odd lengths put rows at every alignment
    views = [rows[i] for i in range(n)]
    torch.cuda.synchronize()
    assert checksums_device(views) == _cpu_sums(views)


def test_many_blocks_in_one_launch():
    from gds_kv_connector.engines.gpu_checksum import checksums_device

    pool = _random((1024, 64 << 10), 1)
    views = [pool[i] for i in range(pool.shape[0])]
    torch.cuda.synchronize()
    sums = checksums_device(views)
    assert sums == _cpu_sums(views)
    assert len(set(sums)) == len(sums)


@pytest.mark.parametrize("misalign", [1, 4, 8, 12])
def test_misaligned_views(misalign):
    from gds_kv_connector.engines.gpu_checksum import checksums_device

    flat = _random((8 * 40_000 + 64,), misalign)
    views = [flat[misalign + i * 40_000: misalign + (i + 1) * 40_000] for i in range(8)]
    torch.cuda.synchronize()
    assert checksums_device(views) == _cpu_sums(views)


def test_mixed_lengths_keep_order_and_bf16_views():
    from gds_kv_connector.engines.gpu_checksum import checksums_device

    a, b = _random((3, 4096), 5), _random((2, 12_345), 6)
    bf = torch.randn(2, 4, 2, 1024, dtype=torch.bfloat16, device="cuda")
    views = [a[0], b[0], a[1], bf[0], b[1], a[2], bf[1]]
    torch.cuda.synchronize()
    expected = [checksum_bytes(v.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for v in views]
    assert checksums_device(views) == expected


def test_caller_stream_and_empty_batch():
    from gds_kv_connector.engines.gpu_checksum import checksums_device

    assert checksums_device([]) == []
    views = list(_random((4, 100_000), 9))
    expected = _cpu_sums(views)
    for v in views:
        v.zero_()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    source = torch.stack(list(_random((4, 100_000), 9)))
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the bytes land long after the launch is queued
        for v, s in zip(views, source):
            v.copy_(s)
    # Launched on the caller's stream, the sums see the copies; on any other stream they would not.
    # The deprecation of CuPy's ExternalStream is an error here: the stream goes through the protocol.
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert checksums_device(views, stream=stream) == expected


def test_throughput_report(capsys):
    """Printed, not asserted: how far the checksum is from HBM speed for typical batches."""
    from gds_kv_connector.engines.gpu_checksum import checksums_device

    lines = []
    for n_blocks, block in [(64, 1 << 20), (256, 256 << 10), (8, 4 << 20), (1, 10 << 20), (512, 2 << 20)]:
        data = _random((n_blocks, block), n_blocks)
        views = [data[i] for i in range(n_blocks)]
        torch.cuda.synchronize()
        checksums_device(views)  # compile and warm up
        reps = 20
        started = time.perf_counter()
        for _ in range(reps):
            checksums_device(views)
        elapsed = (time.perf_counter() - started) / reps
        mib = n_blocks * block / (1 << 20)
        lines.append(f"{n_blocks:4d} x {block >> 10:6d} KiB: {elapsed * 1e6:9.1f} us/batch, "
                     f"{elapsed * 1e6 / mib:7.2f} us/MiB, {n_blocks * block / elapsed / 1e9:7.1f} GB/s "
                     "(including launch and the D2H copy)")
    with capsys.disabled():
        print(f"\nGPU checksum on {torch.cuda.get_device_name()}:")
        print("\n".join(lines))

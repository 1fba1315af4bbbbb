"""CPU-side checks of the GPU checksum: the shipped kernel source, its compilation for the target
architectures, and its per-thread arithmetic built as host C++ against checksum.py.

The kernel's work split (chunks per block, a thread stride, three alignment paths, the padded
tail word) is where a GPU checksum would silently diverge from the CPU one; emulating every
thread on the host checks that split without a GPU.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gds_kv_connector.engines import gpu_checksum
from gds_kv_connector.format.checksum import checksum_bytes
from tests.support import REPO as _REPO

REPO = Path(_REPO)
SOURCE = REPO / "csrc" / "checksum.cu"

_HARNESS = r"""
#include "checksum.cu"
extern "C" unsigned long long emulate(const unsigned char* base, unsigned long long len,
                                      unsigned int chunks, unsigned int threads)
{
    unsigned long long begin, end, sum = 0;
    for (unsigned int c = 0; c < chunks; ++c) {
        gdskv_chunk_range((len + 7) / 8, chunks, c, &begin, &end);
        for (unsigned int t = 0; t < threads; ++t) {
            sum += gdskv_thread_sum(base, len, begin, end, t, threads);
        }
    }
    return gdskv_finish(sum, len);
}
"""


def test_a_built_package_ships_the_kernel_source(tmp_path):
    """A wheel's package holds ``_csrc/checksum.cu`` (its workers have no checkout to read), copied
    from csrc/ by setup.py's build_py: the checkout tracks one copy."""
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "gds_kv_connector" / "_csrc" / "checksum.cu").read_bytes() == SOURCE.read_bytes()
    assert not (REPO / "gds_kv_connector" / "_csrc" / "checksum.cu").exists()


def test_source_path_finds_the_kernel():
    assert gpu_checksum.source_path().read_bytes() == SOURCE.read_bytes()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_kernel_compiles_for_sm90_and_sm100():
    proc = subprocess.run(["bash", str(REPO / "csrc" / "check_compile.sh")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def emulate(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    work = tmp_path_factory.mktemp("checksum_host")
    (work / "harness.cpp").write_text(_HARNESS)
    lib = work / "libchecksum_host.so"
    subprocess.run([cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-fno-strict-aliasing",
                    "-D__device__=", "-D__forceinline__=inline", f"-I{SOURCE.parent}",
                    str(work / "harness.cpp"), "-o", str(lib)], check=True, timeout=120)
    fn = ctypes.CDLL(str(lib)).emulate
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint, ctypes.c_uint]
    return fn


def _placed(data: bytes, misalign: int) -> tuple[np.ndarray, int]:
    """A copy of ``data`` whose address is ``misalign`` bytes past a 16-byte boundary."""
    backing = np.zeros(len(data) + 32, dtype=np.uint8)
    start = (-backing.ctypes.data) % 16 + misalign
    backing[start:start + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return backing, backing.ctypes.data + start


@pytest.mark.parametrize("misalign", [0, 8, 4, 1])
@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 15, 16, 17, 24, 40, 4095, 4096, 65543])
def test_host_emulation_matches_cpu_definition(emulate, length, misalign):
    data = np.random.default_rng(length * 31 + misalign).integers(0, 256, length, dtype=np.uint8).tobytes()
    backing, address = _placed(data, misalign)
    expected = checksum_bytes(data)
    for chunks in (1, 2, 3, 7):
        for threads in (1, 32, 256):
            assert emulate(address, length, chunks, threads) == expected, (chunks, threads)
    del backing


def test_host_emulation_large_block_many_chunks(emulate):
    data = np.random.default_rng(7).integers(0, 256, (1 << 20) + 3, dtype=np.uint8).tobytes()
    backing, address = _placed(data, 0)
    expected = checksum_bytes(data)
    for chunks in (1, 5, 16, 1024):
        assert emulate(address, len(data), chunks, 256) == expected, chunks
    del backing


def test_chunk_plan_fills_the_gpu_without_tiny_chunks():
    sms = 132
    assert gpu_checksum._chunks_per_block(64, 4096, sms) == 1
    assert gpu_checksum._chunks_per_block(10_000, 1 << 20, sms) == 1
    one_big = gpu_checksum._chunks_per_block(1, 10 << 20, sms)
    assert 1 < one_big <= gpu_checksum._MAX_CHUNKS
    assert (10 << 20) / one_big >= gpu_checksum._MIN_CHUNK_BYTES
    assert gpu_checksum._chunks_per_block(8, 16 << 20, sms) * 8 >= gpu_checksum._CTAS_PER_SM * sms


def test_package_import_loads_neither_kvikio_nor_cupy():
    code = ("import sys, gds_kv_connector, gds_kv_connector.engines.gpu_checksum, gds_kv_connector.cli.doctor, "
            "gds_kv_connector.engines.kvikio_engine; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kvikio', 'cupy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert out.stdout.strip() == "[]"

"""Payload checksums of CUDA KV blocks computed where the bytes are, in one kernel launch per batch.

Copying every saved or loaded block to the host only to checksum it would double the PCIe
traffic the connector exists to avoid, so the checksum of :mod:`gds_kv_connector.format.checksum` is
computed on the GPU by ``csrc/checksum.cu`` (compiled at first use with NVRTC through CuPy) and
only one uint64 per block crosses back.  CuPy is imported on first use, never at package import,
so CPU-only installs and the scheduler process never load it.

The caller must hand over bytes that are complete: blocks being saved after their producing
stream was synchronized, blocks being loaded after their reads reported completion.  The kernels
run on a stream of their own per thread and device, so they neither wait for nor delay the
model's streams.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_SOURCE_NAME = "checksum.cu"
_THREADS = 256                # threads per CTA; the kernel reduces any multiple of 32 up to 1024
_FINISH_THREADS = 128
_CTAS_PER_SM = 4              # enough 16-byte loads in flight per SM to cover HBM latency
_MIN_CHUNK_BYTES = 64 << 10   # below this a CTA spends more time starting than loading
_MAX_CHUNKS = 1024            # gridDim.y limit is 65535; more chunks than this buy nothing


def source_path() -> Path:
    """The kernel source: the checkout's ``csrc/`` first (edits take effect without reinstalling),
    else the copy shipped inside the package for wheel installs."""
    pkg = Path(__file__).resolve().parent.parent  # the package's root folder
    for candidate in (pkg.parent / "csrc" / _SOURCE_NAME, pkg / "_csrc" / _SOURCE_NAME):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{_SOURCE_NAME} is neither in {pkg.parent / 'csrc'} nor in {pkg / '_csrc'}")


@dataclass
class _Kernels:
    partial: Any
    finish: Any
    sm_count: int


_compile_lock = threading.Lock()
_kernels_by_device: dict[int, _Kernels] = {}
_local = threading.local()


def _kernels(device: int) -> _Kernels:
    """Compile once per process and load once per device (a CUDA module belongs to one context)."""
    with _compile_lock:
        kernels = _kernels_by_device.get(device)
        if kernels is None:
            import cupy

            dev = cupy.cuda.Device(device)
            with dev:
                module = cupy.RawModule(code=source_path().read_text(), options=("-std=c++17",))
                kernels = _Kernels(module.get_function("gdskv_checksum_partial"),
                                   module.get_function("gdskv_checksum_finish"),
                                   int(dev.attributes["MultiProcessorCount"]))
            _kernels_by_device[device] = kernels
        return kernels


def _own_stream(device: int):
    """A non-blocking stream per (thread, device): concurrent transfer threads never wait on each
    other's checksums, and the legacy default stream never serializes them."""
    import cupy

    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    stream = streams.get(device)
    if stream is None:
        with cupy.cuda.Device(device):
            stream = streams[device] = cupy.cuda.Stream(non_blocking=True)
    return stream


def _chunks_per_block(n_blocks: int, length: int, sm_count: int) -> int:
    """Split blocks into chunks until the grid fills every SM, but never below _MIN_CHUNK_BYTES."""
    by_size = max(1, -(-length // _MIN_CHUNK_BYTES))
    by_fill = max(1, -(-(_CTAS_PER_SM * sm_count) // n_blocks))
    return min(by_size, by_fill, _MAX_CHUNKS)


@dataclass
class _Staging:
    """Pinned host memory the kernels read block addresses from and write sums to directly."""

    memory: Any
    bases: np.ndarray
    sums: np.ndarray


def _staging(device: int, n: int) -> _Staging:
    """Per (thread, device).  The kernels reach it through unified addressing, so a checksum moves
    no bytes through the copy engines: a small cudaMemcpy there would queue behind the bulk block
    DMA of other transfer threads and serialize them."""
    import cupy

    table = getattr(_local, "staging", None)
    if table is None:
        table = _local.staging = {}
    st = table.get(device)
    if st is None or st.bases.size < n:
        cap = max(n, 1024)
        with cupy.cuda.Device(device):
            memory = cupy.cuda.alloc_pinned_memory(16 * cap)
        st = table[device] = _Staging(memory, np.frombuffer(memory, np.uint64, cap, 0),
                                      np.frombuffer(memory, np.uint64, cap, 8 * cap))
    return st


class _StreamHandle:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol, which is how CuPy 14 adopts a stream
    it does not own (``Stream.from_external``; its ``ExternalStream`` warns as deprecated)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _foreign_stream(handle: int, device: int):
    """CuPy's view of a caller's stream; called with ``device`` current (from_external takes the
    current device, ExternalStream, CuPy 13's only way, takes it as an argument)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(handle, device)
    return from_external(_StreamHandle(handle))


def _launch(device: int, length: int, pointers: list[int], stream: torch.cuda.Stream | None) -> list[int]:
    import cupy

    kernels = _kernels(device)
    n_blocks = len(pointers)
    chunks = _chunks_per_block(n_blocks, length, kernels.sm_count)
    st = _staging(device, n_blocks)
    st.bases[:n_blocks] = pointers
    bases, sums = np.uint64(st.bases.ctypes.data), np.uint64(st.sums.ctypes.data)
    with cupy.cuda.Device(device):
        cp_stream = _own_stream(device) if stream is None else _foreign_stream(stream.cuda_stream, device)
        with cp_stream:
            if chunks == 1:
                kernels.partial((n_blocks, 1), (_THREADS,), (bases, np.uint64(length), sums))
            else:
                partials = cupy.empty(n_blocks * chunks, dtype=cupy.uint64)
                kernels.partial((n_blocks, chunks), (_THREADS,), (bases, np.uint64(length), partials))
                kernels.finish((-(-n_blocks // _FINISH_THREADS),), (_FINISH_THREADS,),
                               (partials, np.uint32(chunks), np.uint32(n_blocks), np.uint64(length), sums))
        cp_stream.synchronize()  # this stream only; the sums are in host memory then
    return st.sums[:n_blocks].tolist()


def checksums_device(views: list[torch.Tensor], stream: torch.cuda.Stream | None = None) -> list[int]:
    """Checksums (checksum.py's definition) of contiguous CUDA tensors, in the order given.

    Views of one device and byte length share a launch, so a batch of equal KV blocks costs one
    kernel (two when blocks are split across CTAs); addresses and sums go through pinned host
    memory the kernels access directly, not through copies.  ``stream``, if given, must belong
    to the views' device.
    """
    if not views:
        return []
    # The common batch: equal blocks of one KV pool, contiguous, on one device; one pass, one launch.
    first = views[0]
    length, device = first.nbytes, first.get_device()
    if device >= 0 and (stream is None or stream.device.index == device) and all(
            v.nbytes == length and v.get_device() == device and v.is_contiguous() for v in views):
        return _launch(device, length, [v.data_ptr() for v in views], stream)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, v in enumerate(views):
        if v.device.type != "cuda":
            raise ValueError(f"view {i} is on {v.device}; GPU checksums need CUDA tensors")
        if not v.is_contiguous():
            raise ValueError(f"view {i} is not contiguous")
        groups.setdefault((v.device.index, v.numel() * v.element_size()), []).append(i)
    results = [0] * len(views)
    for (device, length), members in groups.items():
        if stream is not None and stream.device.index != device:
            raise ValueError(f"stream is on {stream.device}, views on cuda:{device}")
        sums = _launch(device, length, [views[i].data_ptr() for i in members], stream)
        for i, s in zip(members, sums):
            results[i] = s
    return results

"""DMA between CUDA KV blocks and registered host mappings (arena slabs), with copies coalesced.

A run of blocks that sit at a constant stride on both sides (consecutive KV block ids into
consecutive slots: the common case for one request's prefix) becomes one ``cudaMemcpy2DAsync``
whose rows are the payloads and whose pitches skip the 4 KiB slot headers: that moves 256 KiB
blocks at the PCIe limit, where one copy call per block reaches about two thirds of it (each call
pays its launch).  Runs are split over a few streams per thread so both
directions keep more than one DMA in flight.  CuPy is imported when the first copy is made.

These copies are the GPU's DMA into pages that ``cudaHostRegister`` pinned, so they never fault,
not even when another process truncates a slab under its mapping (the pinned pages outlive the
file's): unlike CPU accesses to a mapping they need no SIGBUS guard, and what a truncation does to
their bytes is caught by the arena's checks of the slab before a batch and of the slot headers
after it (arena.py).
"""

from __future__ import annotations

import operator
import threading
from typing import Any

import torch

_STREAMS_PER_THREAD = 4
_SPLIT_MIN_BYTES = 8 << 20  # a run below this is not worth splitting across streams
_REGISTER_PORTABLE = 0x01
_REGISTER_READ_ONLY = 0x08
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_NBYTES, _IS_CUDA = operator.attrgetter("nbytes"), operator.attrgetter("is_cuda")


class CudaHostDma:
    def __init__(self, device: torch.device) -> None:
        import cupy

        self._cupy = cupy
        self._rt = cupy.cuda.runtime
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._local = threading.local()

    def register(self, addr: int, nbytes: int, read_only: bool) -> None:
        flags = _REGISTER_PORTABLE | (_REGISTER_READ_ONLY if read_only else 0)
        with self._cupy.cuda.Device(self._index):
            self._rt.hostRegister(addr, nbytes, flags)

    def unregister(self, addr: int) -> None:
        with self._cupy.cuda.Device(self._index):
            self._rt.hostUnregister(addr)

    def copy(self, pairs: list[tuple[int, torch.Tensor]], pitch: int, to_host: bool) -> None:
        if not pairs:
            return
        hosts, views = list(map(_FIRST, pairs)), list(map(_SECOND, pairs))
        runs = coalesce_lists(hosts, _device_ptrs(views), list(map(_NBYTES, views)), pitch)
        streams = self._streams()
        kind = self._rt.memcpyDeviceToHost if to_host else self._rt.memcpyHostToDevice
        with self._cupy.cuda.Device(self._index):
            k = 0
            try:
                for host, dev, width, hpitch, rows in _split(runs, len(streams)):
                    s = streams[k % len(streams)].ptr
                    k += 1
                    if rows == 1:
                        if to_host:
                            self._rt.memcpyAsync(host, dev, width, kind, s)
                        else:
                            self._rt.memcpyAsync(dev, host, width, kind, s)
                    elif to_host:
                        self._rt.memcpy2DAsync(host, hpitch, dev, width, width, rows, kind, s)
                    else:
                        self._rt.memcpy2DAsync(dev, width, host, hpitch, width, rows, kind, s)
            finally:  # a launch that raised leaves the ones before it queued: they end before this returns,
                for stream in streams[:k]:  # or the pages (and the stage) would be freed under them
                    stream.synchronize()

    def _streams(self) -> list[Any]:
        streams = getattr(self._local, "streams", None)
        if streams is None:
            with self._cupy.cuda.Device(self._index):
                streams = [self._cupy.cuda.Stream(non_blocking=True) for _ in range(_STREAMS_PER_THREAD)]
            self._local.streams = streams
        return streams


def coalesce(items: list[tuple[int, int, int]], pitch: int) -> list[tuple[int, int, int, int, int]]:
    """(host, device, width) copies -> runs (host, device, width, pitch, rows).

    Consecutive items (by device address) join a run when the device side is contiguous
    (stride == width) and the host side is the next slot (stride == ``pitch``, the slot size).
    Pure arithmetic, so the CPU tests cover it.
    """
    runs: list[list[int]] = []
    for host, dev, width in sorted(items, key=lambda t: t[1]):
        if runs:
            r = runs[-1]
            r_host, r_dev, r_width, _, r_rows = r
            if width == r_width and dev == r_dev + r_rows * width and host == r_host + r_rows * pitch:
                r[4] = r_rows + 1
                continue
        runs.append([host, dev, width, max(pitch, width), 1])
    return [tuple(r) for r in runs]  # type: ignore[misc]


def coalesce_lists(hosts: list[int], devs: list[int], widths: list[int], pitch: int) -> list[tuple[int, int, int, int, int]]:
    """:func:`coalesce` of parallel lists, with the batch that is one run already (consecutive
    KV blocks into consecutive slots) recognised by list comparisons in C instead of a loop."""
    n = len(hosts)
    if n == 0:
        return []
    w = widths[0]
    if widths.count(w) == n and devs == list(range(devs[0], devs[0] + n * w, w)) and \
            hosts == list(range(hosts[0], hosts[0] + n * pitch, pitch)):
        return [(hosts[0], devs[0], w, max(pitch, w), n)]
    return coalesce(list(zip(hosts, devs, widths)), pitch)


def _split(runs: list[tuple[int, int, int, int, int]], parts: int) -> list[tuple[int, int, int, int, int]]:
    """Cut long runs into up to ``parts`` pieces so several streams share them."""
    out = []
    for host, dev, width, pitch, rows in runs:
        pieces = min(parts, rows, max(1, rows * width // _SPLIT_MIN_BYTES))
        per = -(-rows // pieces)
        for lo in range(0, rows, per):
            n = min(per, rows - lo)
            out.append((host + lo * pitch, dev + lo * width, width, pitch, n))
    return out


def _device_ptrs(views: list[torch.Tensor]) -> list[int]:
    if not all(map(_IS_CUDA, views)):
        bad = next(v for v in views if not v.is_cuda)
        raise ValueError(f"host DMA moves CUDA blocks only, not {bad.device}")
    if not all(map(torch.Tensor.is_contiguous, views)):
        raise ValueError("block views must be contiguous")
    return list(map(torch.Tensor.data_ptr, views))

"""The registered KV pool as byte-addressable blocks.

TensorRT-LLM hands the worker either one tensor ``[num_blocks, num_layers, kv_factor,
block_elems]`` (V1, and V2's ``as_single_pool_tensor``) or a ``KvCacheLayout`` (V2).  The
connector needs each block as one contiguous byte range (it is one file payload); anything a
single pool tensor cannot describe is refused at start-up with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch


class LayoutError(ValueError):
    """The KV cache layout is one this connector cannot serve."""


@dataclass(frozen=True)
class KvPool:
    tensor: torch.Tensor  # [num_blocks, ...]; each block contiguous
    num_blocks: int
    num_layers: int
    kv_factor: int
    block_bytes: int
    dtype_name: str

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    _bytes: torch.Tensor = field(init=False, repr=False, compare=False)
    _views: list[torch.Tensor | None] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # [num_blocks, block_bytes] uint8 view, made once: every transfer indexes it per block
        object.__setattr__(self, "_bytes", self.tensor.view(self.tensor.shape[0], -1).view(torch.uint8))
        object.__setattr__(self, "_views", [None] * self.num_blocks)

    def block_view(self, block_id: int) -> torch.Tensor:
        """The block's bytes as a contiguous uint8 vector (a view, no copy)."""
        return self.block_views((block_id,))[0]

    def block_views(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """:meth:`block_view` of each id.  Each view is made on first use and kept (a list slot per
        block, a tensor object per block used): making a view costs 1-2 us of GIL-held time, and
        transfer threads would pay it for every block of every transfer."""
        cache, out = self._views, []
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"block id {b} outside the pool's {self.num_blocks} blocks")
            v = cache[b]
            if v is None:
                v = cache[b] = self._bytes[b]
            out.append(v)
        return out


def pool_from_tensor(t: Any) -> KvPool:
    if not isinstance(t, torch.Tensor):
        raise LayoutError(f"register_kv_caches expects a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 2:
        raise LayoutError(f"KV pool tensor must be [num_blocks, ...], got shape {tuple(t.shape)}")
    if not t[0].is_contiguous() or (t.shape[0] > 1 and t.stride(0) < t[0].numel()):
        raise LayoutError(f"each KV block must be contiguous in memory (shape {tuple(t.shape)}, "
                          f"strides {t.stride()})")
    if not t.is_contiguous():
        raise LayoutError("the KV pool tensor must be contiguous so blocks can be viewed as bytes")
    num_layers = t.shape[1] if t.dim() >= 4 else 1
    kv_factor = t.shape[2] if t.dim() >= 4 else 1
    block_bytes = t[0].numel() * t.element_size()
    if block_bytes == 0:
        raise LayoutError("KV blocks are empty")
    return KvPool(t, t.shape[0], num_layers, kv_factor, block_bytes, str(t.dtype).replace("torch.", ""))


def pool_from_layout(layout: Any) -> KvPool:
    """A V2 ``KvCacheLayout`` with one layer group holding one region and no replicas."""
    groups = tuple(getattr(layout, "groups", ()))
    if len(groups) != 1:
        raise LayoutError(f"the KV cache has {len(groups)} layer groups; gds-kv-connector supports one "
                          "(models with sliding-window or mixed layers are not supported yet)")
    group = groups[0]
    if len(getattr(group, "regions", ())) != 1 or getattr(group, "replicated_regions", ()):
        raise LayoutError(f"layer group {getattr(group, 'layer_group_id', 0)} has "
                          f"{len(getattr(group, 'regions', ()))} regions and "
                          f"{len(getattr(group, 'replicated_regions', ()))} replicated regions; "
                          "one pool tensor cannot describe it")
    tensor = layout.as_single_pool_tensor() if hasattr(layout, "as_single_pool_tensor") else None
    if tensor is None:
        raise LayoutError("KvCacheLayout.as_single_pool_tensor() returned None: the layout is not a single "
                          "[num_blocks, num_layers, kv_factor, block_elems] pool")
    kv = pool_from_tensor(tensor)
    # Some versions type the layout (``KvCacheLayout.dtype``) while handing out a byte tensor: the
    # declared dtype is the KV's, and it enters the pool fingerprint.
    declared = getattr(layout, "dtype", None)
    if kv.dtype_name == "uint8" and isinstance(declared, torch.dtype) and declared != torch.uint8:
        kv = replace(kv, dtype_name=str(declared).replace("torch.", ""))
    return kv

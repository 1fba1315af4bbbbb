"""Choose the engine from where the KV pool lives, or as forced by TLLM_GDS_KV_ENGINE."""

from __future__ import annotations

import torch

from gds_kv_connector.engines.fileops import FileOps
from gds_kv_connector.engines.base import IoEngine


def make_engine(kind: str, device: torch.device, io_threads: int, ops: FileOps | None = None,
                probe_dir: str | None = None, compat_io: str = "staged") -> IoEngine:
    """``kind`` is auto, posix or kvikio; auto picks kvikio for a CUDA pool and posix otherwise.

    ``probe_dir`` (the pool root) is where the kvikio engine checks at start-up that cuFile accepts
    files, so a fallback and its reason are known before the first transfer.  ``compat_io`` is
    TLLM_GDS_KV_COMPAT_IO: who moves a CUDA pool's files when GDS is not in use.
    """
    if kind == "auto":
        kind = "kvikio" if device.type == "cuda" else "posix"
    if kind == "posix":
        if device.type != "cpu":
            raise ValueError(f"TLLM_GDS_KV_ENGINE=posix needs a host-memory KV pool, but it is on {device}")
        from gds_kv_connector.engines.posix import PosixEngine
        return PosixEngine(io_threads=io_threads, ops=ops)
    if kind == "kvikio":
        if device.type != "cuda":
            raise ValueError(f"TLLM_GDS_KV_ENGINE=kvikio needs a CUDA KV pool, but it is on {device}")
        from gds_kv_connector.engines.kvikio_engine import KvikioEngine
        return KvikioEngine(io_threads=io_threads, device=device, probe_dir=probe_dir, compat_io=compat_io)
    raise ValueError(f"unknown engine {kind!r}")

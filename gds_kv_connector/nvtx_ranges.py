"""NVTX ranges named ``gdskv/<what>`` so an Nsight Systems timeline shows where the executor
waits and where bytes move; free when nvtx is not installed."""

from __future__ import annotations

import contextlib

try:
    import nvtx as _nvtx

    def nvtx_range(name: str, color: str = "blue"):
        return _nvtx.annotate(f"gdskv/{name}", color=color, domain="gds-kv-connector")
except ImportError:  # nvtx is a core dependency, but a bare source checkout still runs
    def nvtx_range(name: str, color: str = "blue"):
        return contextlib.nullcontext()

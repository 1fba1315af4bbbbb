"""Ranges named ``gdskv/<what>`` so a timeline shows where the executor waits and where bytes move:
NVTX ranges for Nsight Systems, or with ``TLLM_GDS_KV_TRACE=torch`` torch.profiler ranges, for a
Chrome/Perfetto trace taken without Nsight (TensorRT-LLM's ``TLLM_TORCH_PROFILE_TRACE``, or
``gds-kv bench --trace``).

Outside a profile they cost nothing: the mode and whether an NVTX tool receives ranges are settled
once, at import (nvtx hands out a dummy domain when none is attached; the callbacks are decorated
then), and without a recorder :func:`traced` returns the callback itself and :func:`trace_range` a
shared null context.  Entering a range that records nothing still costs 0.3-0.5 us per executor
callback, paid by every request's match, allocation and finish.  In torch mode the
callbacks stay wrapped and each asks whether a profiler is running (about 0.3 us), so it is a
setting for profiling runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, ContextManager, TypeVar

from gds_kv_connector.config.settings import import_time_value

_DOMAIN = "gds-kv-connector"
_NULL = contextlib.nullcontext()
F = TypeVar("F", bound=Callable[..., Any])

MODE: str = import_time_value("trace")
_nvtx: Any = None
_torch_range: Any = None
_torch_profiler: Any = None
if MODE == "torch":
    from torch.autograd import profiler as _torch_profiler
    from torch.profiler import record_function as _torch_range
else:
    try:
        import nvtx as _nvtx
    except ImportError:  # nvtx is a core dependency, but a bare source checkout still runs
        pass
TRACING: bool = _torch_range is not None or (
    _nvtx is not None and isinstance(_nvtx.get_domain(_DOMAIN), _nvtx.Domain))


def trace_range(name: str, color: str = "blue", *args: object) -> ContextManager[Any]:
    """A new range named ``gdskv/`` + ``name.format(*args)`` (formatted only while tracing); enter it
    once (a torch range cannot be entered again)."""
    if not TRACING:
        return _NULL
    if _torch_range is None:
        return _nvtx.annotate(f"gdskv/{name.format(*args) if args else name}", color=color, domain=_DOMAIN)
    # A torch range costs about 6 us even when nothing records it: entered only while a
    # profiler runs (torch's own flag, set for every thread; absent in some torch: always entered).
    if not getattr(_torch_profiler, "_is_profiler_enabled", True):
        return _NULL
    return _torch_range(f"gdskv/{name.format(*args) if args else name}")


def traced(name: str, color: str = "blue") -> Callable[[F], F]:
    """Decorator: the function runs inside the range ``gdskv/<name>`` while tracing; otherwise it is
    returned as it is."""
    def wrap(fn: F) -> F:
        if not TRACING:
            return fn

        @functools.wraps(fn)
        def inner(*a: Any, **kw: Any) -> Any:
            with trace_range(name, color):
                return fn(*a, **kw)
        return inner  # type: ignore[return-value]
    return wrap


def check_mode(configured: str) -> None:
    """Warn when the connector starts with a trace mode other than the one its callbacks were
    decorated for at import (the setting was changed in between): it takes effect in a new process."""
    if configured != MODE:
        logging.getLogger(__name__).warning(
            "TLLM_GDS_KV_TRACE=%s is not in effect: gds_kv_connector was imported under %s, and the "
            "ranges are settled at import; set it before the process starts", configured, MODE)

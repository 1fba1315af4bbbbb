"""NVTX ranges named ``gdskv/<what>`` so an Nsight Systems timeline shows where the executor
waits and where bytes move.

Outside a profile they cost nothing: whether a tool receives the ranges is asked once, at import
(nvtx hands out a dummy domain when none is attached), and without one :func:`traced` returns the
callback itself and :func:`nvtx_range` a shared null context.  Entering a range that records
nothing still cost 0.3-0.5 us per executor callback on the CI VM, paid by every request's match,
allocation and finish.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, TypeVar

_DOMAIN = "gds-kv-connector"
_NULL = contextlib.nullcontext()
F = TypeVar("F", bound=Callable[..., Any])

try:
    import nvtx as _nvtx

    TRACING: bool = isinstance(_nvtx.get_domain(_DOMAIN), _nvtx.Domain)
except ImportError:  # nvtx is a core dependency, but a bare source checkout still runs
    _nvtx, TRACING = None, False


def nvtx_range(name: str, color: str = "blue", *args: object) -> ContextManager[Any]:
    """A range named ``gdskv/`` + ``name.format(*args)``; the name is formatted only while tracing."""
    if not TRACING:
        return _NULL
    return _nvtx.annotate(f"gdskv/{name.format(*args) if args else name}", color=color, domain=_DOMAIN)


def traced(name: str, color: str = "blue") -> Callable[[F], F]:
    """Decorator: the function runs inside the range ``gdskv/<name>`` while tracing; otherwise it is
    returned as it is."""
    def wrap(fn: F) -> F:
        if not TRACING:
            return fn
        rng = nvtx_range(name, color)

        @functools.wraps(fn)
        def inner(*a: Any, **kw: Any) -> Any:
            with rng:
                return fn(*a, **kw)
        return inner  # type: ignore[return-value]
    return wrap

"""I/O engines: move block payloads between a KV pool tensor and open files."""

from .base import IoEngine, TransferItem
from .select import make_engine

__all__ = ["IoEngine", "TransferItem", "make_engine"]

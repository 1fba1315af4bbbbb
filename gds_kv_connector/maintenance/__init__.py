"""Keeping a shared pool healthy: recency, eviction, capacity, slab and owner records,
and the operator commands' work (stats, gc, verify)."""

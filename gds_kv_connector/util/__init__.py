"""Leaf helpers every layer may use: host identity, files replaced whole, mounts, counters."""

"""The settings reference, docs/configuration.md, written from ``settings.SPECS``: the table is the
one source, so the page cannot drift from what the connector validates (a test compares them)."""

from __future__ import annotations

from gds_kv_connector.config.settings import CONFIG_ENV, SPECS, settings_table

HEADER = f"""# Configuration

Every setting is an environment variable named `TLLM_GDS_KV_<NAME>` (only `TLLM*` variables reach
TensorRT-LLM's MPI-spawned workers). `{CONFIG_ENV}` may name a JSON or TOML file (a regular file of at
most 1 MiB) holding the same settings by lower-case name (`root = "/mnt/nvme/kv"`); the environment
wins over the file. Every value is validated when the connector starts, and `gds-kv settings --check`
validates the current environment: a bad value fails with one line naming the variable and what is
allowed, a misspelt name with a suggestion.

Sizes take `KiB`/`MiB`/`GiB`/`TiB` (or `K`/`M`/`G`/`T`) suffixes; durations are seconds.

This page is generated from the settings table (`gds-kv settings --markdown > docs/configuration.md`).

| variable | default | meaning |
|---|---|---|
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """docs/configuration.md as it must read for this version."""
    rows = [f"| `{env}` | {_cell(default)} | {_cell(meaning)} |" for env, default, meaning in settings_table()]
    assert len(rows) == len(SPECS)
    return HEADER + "\n".join(rows) + "\n"

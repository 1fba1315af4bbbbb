"""``gds-kv``: the command line, the doctor and the demo."""

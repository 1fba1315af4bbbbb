"""``gds-kv bench``: ceilings, baselines and the connector end to end, with ratios."""

"""The pool's on-disk format as code (docs/format.md): names, records, keys, checksums."""

"""The `sloserve` command line: serve, generate, bench, info."""

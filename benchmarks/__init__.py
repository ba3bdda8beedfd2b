"""The benchmark scripts, run from the repository root as `python -m benchmarks.NAME` (see
docs/benchmarks.md); they write to benchmarks/out/ unless told otherwise."""

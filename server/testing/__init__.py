"""Support shared by tests/ and benchmarks/ (never imported by the server itself)."""

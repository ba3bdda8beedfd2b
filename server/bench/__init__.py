"""Load generation and measurement: workloads, a gRPC client, statistics and reports."""

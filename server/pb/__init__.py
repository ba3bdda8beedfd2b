"""Generated protobuf and gRPC stubs for sloserve.v1 (see generate.py; never edit by hand)."""

"""Attacks on the gRPC edge, one test each, asserting the bound that stops it (loopback, bounded)."""

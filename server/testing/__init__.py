"""The support layer shared by tests/ and benchmarks/ (never imported by the server itself).

ports.free_port, server_process.ServerProcess (a live server in a child process), clock.Clock
(a manual monotonic clock) and tokenizer.ByteTokenizer (one token per byte). Import the module
you need: this package imports nothing, so a light helper never pulls in gRPC.
"""

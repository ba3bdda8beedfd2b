"""The support layer shared by tests/ and benchmarks/ (never imported by the server itself).

- ports.free_port
- server_process.ServerProcess: a live server in a child process (its logs, readiness, Info)
- procfs: a process tree, CPU time and memory, read from /proc
- pki: throwaway TLS certificates (self-signed, or a CA signing server and client certificates)
- quantile.quantile: the one latency quantile (linear interpolation)
- clock.Clock: a manual monotonic clock
- tokenizer.ByteTokenizer: one token per byte
- fake_engine.FakeEngine: an asyncio engine with the AsyncEngine contract
- live_server: a SloserveServer in this process, and a Stream client's helpers
- fake_server: a FakeEngine served by a process of its own (`python -m sloserve.testing.fake_server`)
- faults: fault injection, a core factory wrapping the engine core and its runner (WithFaults)
- serve_faults: `sloserve` whose `serve` takes --inject-faults (`python -m sloserve.testing.serve_faults`)

Import the module you need: this package imports nothing, so a light helper never pulls in gRPC.
"""

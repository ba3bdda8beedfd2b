"""gRPC vs HTTP on the same server and workload: closed loop at concurrency 1 and 16.

One `sloserve serve` (both edges on one front end and engine) is started; for each
concurrency the same fixed workload is sent over the bidirectional gRPC Stream and over the
OpenAI-compatible HTTP API (streamed /v1/completions), alternating protocols over --rounds
rounds so that drift on a shared machine hits both alike; the median round is reported.
Goal (issue 13): HTTP's TTFT p50 and output throughput within 10% of gRPC's. At concurrency 1 it
also times HTTP with a bare asyncio client, to tell the server's share of HTTP's TTFT from the
load generator's (aiohttp).

    python -m benchmarks.protocols [--model default] [--workload fixed:64,32] [--requests 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import orjson
from sloserve.bench import http_client
from sloserve.bench.client import LoadSpec, connect, run_load, wait_ready
from sloserve.bench.stats import summarise
from sloserve.bench.workloads import load_workload

from benchmarks.harness import ServerProcess, free_port, machine, save


async def _grpc(target: str, items, spec: LoadSpec) -> dict:
    channel = await connect(target)
    try:
        await wait_ready(channel, 120)
        result = await run_load(channel, items, spec, id_prefix=f"g{time.monotonic_ns()}")
    finally:
        await channel.close()
    return summarise(result.records, result.duration_s, None, None)


async def _http(url: str, items, spec: LoadSpec) -> dict:
    async with http_client.open_client(url, None) as client:
        await http_client.wait_ready(client, 120)
        model = (await http_client.fetch_info(client)).get("model")
        result = await http_client.run_load(
            client, items, spec, id_prefix=f"h{time.monotonic_ns()}", model=model
        )
    return summarise(result.records, result.duration_s, None, None)


async def _bare_http(port: int, items) -> float:
    """TTFT p50 (ms) of `items` sent one at a time over one keep-alive connection by a bare
    asyncio client (no aiohttp): the server's own share of HTTP's TTFT at concurrency 1."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    ttfts = []
    try:
        for item in items:
            body = orjson.dumps(
                {
                    "prompt": item.prompt,
                    "max_tokens": item.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
            )
            head = (
                f"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n"
            )
            sent, first, seen = time.perf_counter(), None, b""
            writer.write(head.encode() + body)
            # the SSE body is chunked: its last chunk is empty
            while not seen.endswith(b"0\r\n\r\n"):
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("the server closed the connection mid-response")
                seen += data
                if not seen.startswith(b"HTTP/1.1 200") and len(seen) >= 12:
                    status = seen.split(b"\r\n", 1)[0].decode(errors="replace")
                    raise RuntimeError(f"the server answered {status!r}")
                if first is None and b"data: {" in seen:
                    first = time.perf_counter() - sent
            ttfts.append(first)
    finally:
        writer.close()
    return statistics.median(ttfts) * 1e3


def _figures(run: dict) -> dict:
    if not run["completed"]:
        raise RuntimeError(f"no request completed: {run['refusals']}")
    return {
        "ttft_p50_ms": run["ttft_s"]["p50"] * 1e3,
        "tpot_p50_ms": (run["tpot_s"]["p50"] or 0) * 1e3,
        "output_tok_s": run["output_token_throughput"],
        "req_s": run["request_throughput"],
        "completed": run["completed"],
        "requests": run["requests"],
    }


def _median(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--workload",
        default="fixed:64,32",
        help="fixed:PROMPT_TOKENS,OUTPUT_TOKENS or any bench workload",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=64,
        help="requests per run at concurrency 16 (a quarter at 1)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    grpc_port, http_port = free_port(), free_port()
    server = ServerProcess(
        [
            "serve",
            "--model",
            args.model,
            "--device",
            args.device,
            "--port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--metrics-port",
            "off",
            "--log-format",
            "json",
        ],
        port=grpc_port,
    )
    target, url = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
    results: dict = {}
    try:
        for concurrency in (1, 16):
            n = args.requests if concurrency > 1 else max(8, args.requests // 4)
            items = load_workload(args.workload, seed=0, num_requests=n)
            spec = LoadSpec(concurrency=concurrency, num_requests=n, streams=1, ignore_eos=True)
            asyncio.run(_grpc(target, items, spec))  # warm-up: compile, caches, connections
            asyncio.run(_http(url, items, spec))
            runs: dict[str, list[dict]] = {"grpc": [], "http": []}
            bare: list[float] = []
            for _ in range(args.rounds):
                runs["grpc"].append(_figures(asyncio.run(_grpc(target, items, spec))))
                runs["http"].append(_figures(asyncio.run(_http(url, items, spec))))
                if concurrency == 1:
                    bare.append(asyncio.run(_bare_http(http_port, items)))
            grpc_m, http_m = _median(runs["grpc"]), _median(runs["http"])
            ratio = {
                "ttft_p50": http_m["ttft_p50_ms"] / grpc_m["ttft_p50_ms"],
                "output_tok_s": http_m["output_tok_s"] / grpc_m["output_tok_s"],
            }
            results[f"c{concurrency}"] = {
                "grpc": grpc_m,
                "http": http_m,
                "http_over_grpc": ratio,
                "rounds": runs,
            }
            spread = {
                p: {
                    k: (min(r[k] for r in runs[p]), max(r[k] for r in runs[p]))
                    for k in ("ttft_p50_ms", "output_tok_s")
                }
                for p in runs
            }
            results[f"c{concurrency}"]["spread"] = spread
            if bare:
                results[f"c{concurrency}"]["bare_http_ttft_p50_ms"] = {
                    "median": statistics.median(bare),
                    "rounds": bare,
                }
            print(
                f"concurrency {concurrency:>2}: TTFT p50 gRPC {grpc_m['ttft_p50_ms']:.1f} ms, HTTP "
                f"{http_m['ttft_p50_ms']:.1f} ms (x{ratio['ttft_p50']:.2f}); output tok/s gRPC "
                f"{grpc_m['output_tok_s']:.0f}, HTTP {http_m['output_tok_s']:.0f} (x{ratio['output_tok_s']:.2f}); "
                f"TPOT p50 gRPC {grpc_m['tpot_p50_ms']:.1f} ms, HTTP {http_m['tpot_p50_ms']:.1f} ms",
                flush=True,
            )
            print(
                "    rounds' range: "
                + "; ".join(
                    f"{p} TTFT p50 {lo:.1f}-{hi:.1f} ms, tok/s {tlo:.0f}-{thi:.0f}"
                    for p, ((lo, hi), (tlo, thi)) in (
                        (p, (v["ttft_p50_ms"], v["output_tok_s"])) for p, v in spread.items()
                    )
                ),
                flush=True,
            )
            if bare:
                print(
                    f"    HTTP TTFT p50 with a bare asyncio client instead of aiohttp: "
                    f"{statistics.median(bare):.1f} ms "
                    f"(x{statistics.median(bare) / grpc_m['ttft_p50_ms']:.2f} of gRPC)",
                    flush=True,
                )
    finally:
        server.stop()
    path = save(
        "protocols",
        {
            "machine": machine(),
            "model": args.model,
            "workload": args.workload,
            "goal": "HTTP TTFT p50 and output throughput within 10% of gRPC",
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

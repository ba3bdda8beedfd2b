"""Does a request at the stop-string limit slow an unrelated request? Side by side, on one server.

A probe request (no stop strings) is sent again and again, one at a time, in three arms that
alternate within every round: `alone`; beside a `plain` companion (a long request with no stop
strings, so the probe shares each step with one other request); beside a `hostile` companion
(the same request with --stops stop strings of --stop-chars characters each, none of which
occurs). The figure is the probe's median end-to-end latency hostile / plain (goal: <= x1.5);
plain / alone shows what sharing a step costs anyway. The server runs with its stop-string limits
raised to the companion's, so `--stops 100000 --stop-chars 12` replays issue 44's 1.2 MB request.

    python -m benchmarks.stop_strings [--rounds 5] [--probes 8] [--stops 16] [--stop-chars 256]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time

from sloserve.bench.client import connect, wait_ready
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc

from benchmarks.harness import ServerProcess, free_port, machine, save

ARMS = ("alone", "plain", "hostile")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--probes", type=int, default=8, help="probe requests per arm and round")
    p.add_argument("--probe-tokens", type=int, default=32)
    p.add_argument("--stops", type=int, default=16, help="the hostile companion's stop strings")
    p.add_argument("--stop-chars", type=int, default=256, help="characters in each of them")
    p.add_argument("--companion-tokens", type=int, default=128)
    args = p.parse_args(argv)
    if (
        min(
            args.rounds,
            args.probes,
            args.probe_tokens,
            args.stops,
            args.stop_chars,
            args.companion_tokens,
        )
        < 1
    ):
        p.error("every count must be >= 1")
    return args


def hostile_stops(n: int, chars: int) -> list[str]:
    """n distinct strings of CJK characters, which a byte-level English model does not write."""
    rng = random.Random(0)
    return [
        f"{i:x}" + "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(chars - len(f"{i:x}")))
        for i in range(n)
    ]


async def generate(stub: pb_grpc.SloserveStub, rid: str, max_tokens: int, stop: list[str]) -> float:
    """One request to its end; its end-to-end seconds."""
    req = pb.GenerateRequest(
        request_id=rid,
        text=f"probe {rid}: the quick brown fox",
        max_tokens=max_tokens,
        sampling=pb.SamplingParams(stop=stop, ignore_eos=True, temperature=0.0),
    )
    started = time.perf_counter()
    async for msg in stub.Generate(req, timeout=300):
        if msg.WhichOneof("kind") == "error":
            raise RuntimeError(f"request {rid} failed: {msg.error.message}")
    return time.perf_counter() - started


async def companion(stub: pb_grpc.SloserveStub, args, stop: list[str]) -> None:
    """Keep one long companion request in flight until cancelled."""
    i = 0
    while True:
        await generate(stub, f"companion{i}", args.companion_tokens, stop)
        i += 1


async def measure(target: str, args) -> dict[str, list[float]]:
    channel = await connect(target, timeout_s=300)
    latencies: dict[str, list[float]] = {arm: [] for arm in ARMS}
    stops = hostile_stops(args.stops, args.stop_chars)
    try:
        await wait_ready(channel, 300)
        stub = pb_grpc.SloserveStub(channel)
        for i in range(3):  # warm: connection, tokenizer, first steps
            await generate(stub, f"warm{i}", args.probe_tokens, [])
        for rnd in range(args.rounds):
            order = ARMS if rnd % 2 == 0 else ARMS[::-1]
            for arm in order:
                background = None
                if arm != "alone":
                    background = asyncio.create_task(
                        companion(stub, args, stops if arm == "hostile" else [])
                    )
                    await asyncio.sleep(0.1)  # the companion is admitted and decoding
                for j in range(args.probes):
                    latencies[arm].append(
                        await generate(stub, f"{arm}{rnd}.{j}", args.probe_tokens, [])
                    )
                if background is not None:
                    background.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await background
    finally:
        await channel.close()
    return latencies


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    port = free_port()
    cmd = [
        "serve",
        "--model",
        args.model,
        "--device",
        "cpu",
        "--port",
        str(port),
        "--metrics-port",
        "off",
        "--http-port",
        "off",
        "--max-model-len",
        "512",
        "--max-stop-strings",
        str(args.stops),
        "--max-stop-string-chars",
        str(args.stop_chars),
        "--grace",
        "1",
    ]
    server = ServerProcess(cmd, port=port, env={"OMP_WAIT_POLICY": "PASSIVE"})
    try:
        latencies = asyncio.run(measure(server.target, args))
    finally:
        server.stop(60)
    medians = {arm: statistics.median(v) for arm, v in latencies.items()}
    for arm in ARMS:
        print(
            f"{arm:8} probe e2e median {medians[arm] * 1e3:8.1f} ms  p90 "
            f"{statistics.quantiles(latencies[arm], n=10)[-1] * 1e3 if len(latencies[arm]) > 1 else 0:8.1f} ms"
        )
    ratio = medians["hostile"] / medians["plain"]
    print(
        f"hostile / plain x{ratio:.2f} (goal <= x1.5); plain / alone x{medians['plain'] / medians['alone']:.2f} "
        f"({args.stops} stop strings of {args.stop_chars} chars)"
    )
    save(
        "stop_strings",
        {
            "machine": machine(),
            "args": vars(args),
            "latencies_s": latencies,
            "medians_s": medians,
            "hostile_over_plain": ratio,
        },
    )


if __name__ == "__main__":
    main()

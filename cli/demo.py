"""`make demo`: start `sloserve serve` on the built-in model, stream a short burst, stop it with SIGTERM.

Steps: pick free ports, start the server as a subprocess, wait for its readiness health check,
show several requests multiplexed on ONE bidirectional stream (small ARC puzzles, answered with
greedy decoding until end-of-sequence, and one cancelled mid-way), run a short `sloserve bench`
burst, print a few Prometheus counters, send SIGTERM and check the server drains and exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import click
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sloserve.bench.local_server import free_port, sloserve_argv
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc

SERVICE = "sloserve.v1.Sloserve"


def _task(*grids: str) -> str:
    """An ARC prompt in the workload's format from 'rows/rows' grids: (input, output) pairs, then a test input."""

    def text(grid: str) -> str:
        return "".join(row + "\n" for row in grid.split("/"))

    *pairs, test = grids
    shots = "".join(
        f"Input:\n{text(i)}Output:\n{text(o)}\n"
        for i, o in zip(pairs[::2], pairs[1::2], strict=True)
    )
    return f"{shots}Input:\n{text(test)}Output:\n"


PROMPTS = {  # small ARC-style puzzles, one token per digit with the default model's byte tokenizer
    "mirror": _task("120/300", "021/003", "4005/0600", "5004/0060", "780/090/001"),
    "recolor": _task("110/010", "220/020", "0101/1100", "0202/2200", "1001/0110/1000"),
    "copy": _task("35/00", "35/00", "060/606", "060/606", "0770/7007/0770"),
    "cancel-me": _task("123456789", "987654321", "123456789"),
}


def _relay(stream, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        click.echo(f"{prefix}{line.rstrip()}")


async def wait_serving(address: str, timeout_s: float, proc: subprocess.Popen) -> None:
    """Poll grpc.health.v1 until the readiness service says SERVING."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise click.ClickException(f"the server exited early with status {proc.returncode}")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
    raise click.ClickException(f"the server was not ready after {timeout_s:g} s")


async def multiplexed(address: str, max_tokens: int) -> None:
    """Send every prompt on one stream, cancel one after its first tokens, print what arrives.

    The puzzles decode greedily until end-of-sequence (or max_tokens); the cancelled one ignores EOS.
    """
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.SloserveStub(channel).Stream()
        start = time.monotonic()
        for rid, text in PROMPTS.items():
            cancel = rid == "cancel-me"
            await call.write(
                pb.ClientMessage(
                    generate=pb.GenerateRequest(
                        request_id=rid,
                        text=text,
                        max_tokens=max_tokens * (16 if cancel else 4),
                        sampling=pb.SamplingParams(ignore_eos=cancel),
                        slo=pb.Slo(ttft_s=5.0),
                    )
                )
            )
        pending, order, cancelled = set(PROMPTS), [], False
        tokens = dict.fromkeys(PROMPTS, 0)
        texts = dict.fromkeys(PROMPTS, "")
        while pending:
            msg = await call.read()
            kind = msg.WhichOneof("kind")
            body = getattr(msg, kind)
            if kind == "chunk":
                tokens[body.request_id] += len(body.token_ids)
                texts[body.request_id] += body.text
                if not order or order[-1] != body.request_id:
                    order.append(body.request_id)
                if body.request_id == "cancel-me" and not cancelled:
                    await call.write(
                        pb.ClientMessage(cancel=pb.CancelRequest(request_id="cancel-me"))
                    )
                    cancelled = True
                continue
            pending.discard(body.request_id)
            if kind == "final":
                reason = (
                    pb.FinishReason.Name(body.finish_reason).removeprefix("FINISH_REASON_").lower()
                )
                click.echo(
                    f"  {body.request_id:<10} {reason:<9} prompt {body.prompt_tokens:>3} tok  "
                    f"output {body.completion_tokens:>3} tok  ttft {body.ttft_s * 1000:7.1f} ms  "
                    f"e2e {body.e2e_s * 1000:7.1f} ms"
                )
            else:
                click.echo(f"  {body.request_id:<10} error {body.code}: {body.message}")
        await call.done_writing()
        click.echo(
            f"  {len(PROMPTS)} requests on one stream in {time.monotonic() - start:.2f} s; the "
            f"stream switched between requests {len(order) - 1} times (interleaved chunks)"
        )
    for rid in PROMPTS:
        if rid != "cancel-me":
            show_answer(rid, PROMPTS[rid], texts[rid])


def show_answer(rid: str, prompt: str, answer: str) -> None:
    """The puzzle's test input beside the model's answer, one grid row per line."""
    test = prompt.rsplit("Input:\n", 1)[1].removesuffix("Output:\n").splitlines()
    rows = answer.splitlines() or [""]
    width = max(len(row) for row in test)
    click.echo(f"\n  {rid}: test input -> model's answer")
    for k in range(max(len(test), len(rows))):
        left = test[k] if k < len(test) else ""
        right = repr(rows[k])[1:-1] if k < len(rows) else ""
        click.echo(f"    {left:<{width}}   {'->' if k == 0 else '  '}   {right}")


async def drain_under_load(address: str, proc: subprocess.Popen, max_tokens: int) -> None:
    """Start three requests, SIGTERM the server once all stream, then collect their endings."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.SloserveStub(channel).Stream()
        ids = ["drain-1", "drain-2", "drain-3"]
        for rid in ids:
            await call.write(
                pb.ClientMessage(
                    generate=pb.GenerateRequest(
                        request_id=rid,
                        text=PROMPTS["mirror"],
                        max_tokens=max_tokens,
                        sampling=pb.SamplingParams(ignore_eos=True),
                    )
                )
            )
        streaming: set[str] = set()
        endings: dict[str, str] = {}
        sent_late = False
        while len(endings) < len(ids) + 1:
            msg = await call.read()
            kind = msg.WhichOneof("kind")
            body = getattr(msg, kind)
            if kind == "chunk":
                streaming.add(body.request_id)
                if streaming == set(ids) and not sent_late:
                    proc.send_signal(signal.SIGTERM)
                    await asyncio.sleep(0.3)
                    await call.write(
                        pb.ClientMessage(generate=pb.GenerateRequest(request_id="late", text="0"))
                    )
                    sent_late = True
            elif kind == "final":
                endings[body.request_id] = f"finished, {body.completion_tokens} tokens"
            else:
                endings[body.request_id] = f"{_status_name(body.code)}: {body.message}"
        for rid in [*ids, "late"]:
            click.echo(f"  {rid:<8} {endings[rid]}")


def _status_name(number: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == number), str(number))


def metrics_summary(port: int) -> list[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    keep = (
        "sloserve_requests_total",
        "sloserve_ttft_seconds_count",
        "sloserve_kv_blocks_total",
        "sloserve_prefix_hit_rate",
        "sloserve_preemptions_total",
        "sloserve_generated_tokens_total",
    )
    return [line for line in text.splitlines() if line.startswith(keep)]


@click.command()
@click.option("--model", default="default", show_default=True, help="Model to serve.")
@click.option(
    "--requests", "num_requests", default=16, show_default=True, type=int, help="Bench burst size."
)
@click.option("--workload", default="fixed:64,32", show_default=True, help="Bench workload spec.")
@click.option(
    "--max-tokens", default=16, show_default=True, type=int, help="Tokens per multiplexed request."
)
@click.option(
    "--ready-timeout",
    default=600.0,
    show_default=True,
    type=float,
    help="Seconds to wait for the model to load (the default model is built on first use).",
)
def demo(
    model: str, num_requests: int, workload: str, max_tokens: int, ready_timeout: float
) -> None:
    """Start a server, stream requests over one bidirectional stream, run a short bench, stop it."""
    port, metrics_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    command = sloserve_argv(
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--http-port",
        "off",
        "--grace",
        "30",
    )
    click.echo(f"$ sloserve serve --model {model} --port {port} --metrics-port {metrics_port}")
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    relay = threading.Thread(target=_relay, args=(proc.stderr, "  [server] "), daemon=True)
    relay.start()
    try:
        started = time.monotonic()
        asyncio.run(wait_serving(address, ready_timeout, proc))
        click.echo(f"server ready (health SERVING) after {time.monotonic() - started:.1f} s\n")
        click.echo(
            "1) several requests multiplexed on one bidirectional stream, one cancelled mid-way:"
        )
        asyncio.run(multiplexed(address, max_tokens))
        click.echo(
            f"\n2) a load burst: sloserve bench --workload {workload} --num-requests {num_requests}"
        )
        bench = subprocess.run(
            sloserve_argv(
                "bench",
                "--server",
                address,
                "--workload",
                workload,
                "--num-requests",
                str(num_requests),
                "--streams",
                "2",
            ),
            text=True,
            capture_output=True,
        )
        click.echo(bench.stdout.rstrip())
        if bench.returncode != 0:
            click.echo(f"  bench exited with {bench.returncode}: {bench.stderr.strip()}")
        click.echo("\n3) Prometheus metrics (excerpt):")
        for line in metrics_summary(metrics_port):
            click.echo(f"  {line}")
        click.echo(
            "\n4) SIGTERM with requests in flight: they finish, new ones get UNAVAILABLE, exit 0"
        )
        asyncio.run(drain_under_load(address, proc, max_tokens))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        relay.join(5)
    click.echo(f"server exited with status {proc.returncode}")
    if proc.returncode != 0:
        sys.exit(1)


if __name__ == "__main__":
    demo()

"""Structured output with two tensor-parallel ranks: rank 0 masks, and the answers obey the grammar."""

from __future__ import annotations

import re

import pytest
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.server_process import ServerProcess

from tests.reliability.client import generate

pytestmark = pytest.mark.timeout(300)


def test_regex_answers_over_two_ranks_match(tiny_llama):
    server = ServerProcess.cli(tiny_llama, "--max-model-len", "256", "--tensor-parallel-size", "2")
    try:
        server.wait_ready()
        with server.sync_channel() as channel:
            stub = pb_grpc.SloserveStub(channel)
            texts = []
            for i in range(4):
                req = generate(
                    f"re{i}", text=f"prompt {i}", max_tokens=20, ignore_eos=False
                ).generate
                req.sampling.temperature, req.sampling.seed = 1.0, i
                req.sampling.structured.regex = r"[0-9]{2}-[a-f]{3}"
                texts.append(
                    "".join(
                        m.chunk.text
                        for m in stub.Generate(req, timeout=60)
                        if m.WhichOneof("kind") == "chunk"
                    )
                )
        assert all(re.fullmatch(r"[0-9]{2}-[a-f]{3}", t) for t in texts), texts
    finally:
        server.stop()

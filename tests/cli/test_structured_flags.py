"""--arc-grid-grammar: generate writes one grid in process and sends the grammar to a server; bench sends it."""

from __future__ import annotations

import orjson
import pytest
from click.testing import CliRunner
from sloserve.bench import client, http_client
from sloserve.bench.arc import parse_grid_text
from sloserve.bench.workloads import WorkloadItem
from sloserve.cli.main import cli
from sloserve.structured import arc_grid_lark

pytestmark = pytest.mark.timeout(120)


def test_generate_in_process_writes_one_grid_and_stops():
    result = CliRunner().invoke(
        cli,
        [
            "generate",
            "Input:\n12\n34\nOutput:\n",
            "--device",
            "cpu",
            "--json",
            "--arc-grid-grammar",
            "--max-tokens",
            "931",
            "--temperature",
            "1",
            "--seed",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    out = orjson.loads(result.output.strip().splitlines()[-1])
    assert out["finish_reason"] == "stop" and parse_grid_text(out["text"]) is not None, out["text"]


def test_generate_sends_the_grammar_to_a_server(fake_server):
    result = CliRunner().invoke(
        cli,
        [
            "generate",
            "abc",
            "--server",
            fake_server.address,
            "--max-tokens",
            "3",
            "--arc-grid-grammar",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output


def test_bench_requests_carry_the_grammar_over_grpc_and_http():
    item = WorkloadItem("Input:\n1\nOutput:\n", 931)
    spec = client.LoadSpec(grammar=arc_grid_lark())
    assert (
        client.build_request("r", item, spec, None).sampling.structured.grammar == arc_grid_lark()
    )
    _, body, _ = http_client.build_request("r", item, spec, None)
    assert body["structured_outputs"] == {"grammar": arc_grid_lark()}
    assert not client.build_request("r", item, client.LoadSpec(), None).sampling.HasField(
        "structured"
    )


def test_grammar_cache_reaches_the_model_config_and_a_bad_one_names_its_flag():
    import click
    from sloserve.cli.options import build_config, engine_options

    seen = {}

    @click.command()
    @engine_options
    def command(**kwargs) -> None:
        seen["config"] = build_config(kwargs)

    assert CliRunner().invoke(command, ["--grammar-cache", "8"]).exit_code == 0
    assert seen["config"].model.grammar_cache == 8
    result = CliRunner().invoke(command, ["--grammar-cache", "0"])
    assert (
        result.exit_code != 0
        and "--grammar-cache: grammar cache must be >= 1, got 0" in result.output
    )

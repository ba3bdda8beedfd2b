"""Flags from SLOSERVE_* environment variables, --api-key, and `sloserve bench` without its extra."""

from __future__ import annotations

import sys

from click.testing import CliRunner
from sloserve.cli.main import cli


def test_every_flag_reads_its_environment_variable():
    result = CliRunner().invoke(cli, ["serve"], env={"SLOSERVE_SERVE_MODEL": "/no/env/folder"})
    assert result.exit_code == 2 and "model folder '/no/env/folder' does not exist" in result.output
    flag_wins = CliRunner().invoke(
        cli, ["serve", "--model", "/no/flag/folder"], env={"SLOSERVE_SERVE_MODEL": "/no/env/folder"}
    )
    assert "'/no/flag/folder'" in flag_wins.output
    # a variable that happens to be named like the group's --version does not print the version
    quiet = CliRunner().invoke(
        cli, ["serve"], env={"SLOSERVE_VERSION": "1", "SLOSERVE_SERVE_MODEL": "/no/x"}
    )
    assert "version" not in quiet.output


def test_api_key_is_the_auth_token_flag_of_every_command():
    for command in ("serve", "generate", "info", "bench"):
        (option,) = [p for p in cli.commands[command].params if p.name == "auth_token"]
        assert (
            option.opts == ["--auth-token", "--api-key"] and option.envvar == "SLOSERVE_AUTH_TOKEN"
        ), command


def test_bench_names_the_extra_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # as if not installed
    result = CliRunner().invoke(
        cli, ["bench", "--url", "http://127.0.0.1:9", "--num-requests", "1"]
    )
    assert result.exit_code == 2
    assert (
        "needs aiohttp (for --url)" in result.output
        and "pip install 'sloserve[bench]'" in result.output
    )

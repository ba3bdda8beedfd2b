"""`sloserve serve`'s HTTP flags: one-line errors (exit 2) for bad values."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from sloserve.cli.main import cli


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--http-port", "nine"], "--http-port must be a port in 1..65535, 'auto' or 'off' (or 0)"),
        (["--http-port", "70000"], "--http-port must be a port in 1..65535"),
        (
            ["--chat-template", "/no/template.jinja"],
            "--chat-template '/no/template.jinja' is not a readable file",
        ),
    ],
)
def test_bad_http_flags_are_one_line_errors(args, needle):
    result = CliRunner().invoke(cli, ["serve", *args])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and needle in errors[0], result.stderr

"""`sloserve serve` refuses unsafe or impossible edge settings with one line naming the flag (exit 2):
HTTP limits, mTLS without TLS, an empty metrics token, a multi-line token file, and fault injection
that a test did not explicitly allow (any client could trigger it through its request id)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from sloserve.cli.main import cli
from sloserve.testing.serve_faults import cli as cli_with_faults

CASES = [
    (["--http-max-connections", "0"], "--http-max-connections must be >= 1"),
    (["--http-header-timeout", "0"], "--http-header-timeout must be in (0, 3600] seconds"),
    (["--http-body-timeout", "nan"], "--http-body-timeout must be in (0, 3600] seconds"),
    (["--http-keep-alive", "-1"], "--http-keep-alive must be in (0, 3600] seconds"),
    (
        ["--http-stream-stall-timeout", "1e9"],
        "--http-stream-stall-timeout must be in (0, 3600] seconds",
    ),
    (["--http-max-body-size", "lots"], "--http-max-body-size: cannot read size 'lots'"),
    (["--http-max-header-size", "100"], "--http-max-header-size must be >= 1KiB"),
    (["--tls-ca", "{file}"], "--tls-ca: tls ca (client certificates) needs TLS on"),
    (["--tls-ca", "/no/ca.pem"], "--tls-ca '/no/ca.pem' is not a readable file"),
    (["--metrics-token", " "], "--metrics-token: metrics token must not be empty"),
    (["--auth-token-file", "{two_lines}"], "has 2 non-empty lines: a token is one line"),
    (["--inject-faults", "slow-step:x=0.1"], "--inject-faults is for tests only"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "needle"), CASES, ids=[" ".join(a)[:40] for a, _ in CASES])
def test_serve_refuses_with_one_line(args, needle, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    two_lines = tmp_path / "token"
    two_lines.write_text("first-token\n\nsecond-token\n")
    fill = {"file": str(a_file), "two_lines": str(two_lines)}
    runner = CliRunner(env={"SLOSERVE_ALLOW_FAULT_INJECTION": None, "SLOSERVE_INJECT_FAULTS": None})
    # NOTE: the product has no fault switch (below): --inject-faults is the test entry point's
    result = runner.invoke(
        cli_with_faults if "--inject-faults" in args else cli,
        [
            "serve",
            "--port",
            "0",
            "--http-port",
            "auto",
            "--metrics-port",
            "off",
            *(a.format(**fill) for a in args),
        ],
    )
    assert result.exit_code == 2, (result.output, result.exception)
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and needle in errors[0], result.stderr
    assert "Traceback" not in result.output


def test_the_product_has_no_fault_switch():
    result = CliRunner().invoke(cli, ["serve", "--inject-faults", "slow-step:x=0.1"])
    assert result.exit_code == 2 and "No such option '--inject-faults'" in result.output

"""`sloserve` with fault injection, for tests only: ``python -m sloserve.testing.serve_faults serve
--inject-faults SPEC ...`` (or SLOSERVE_INJECT_FAULTS).

The product's own commands, `serve` with --inject-faults added: its engine core is built by
`WithFaults(SPEC)` (sloserve.testing.faults). Refused unless SLOSERVE_ALLOW_FAULT_INJECTION=1,
since any client can trigger a fault through its request id.
"""

from __future__ import annotations

import click
from sloserve.cli.common import CliError, OneLineCommand
from sloserve.cli.main import cli as product_cli
from sloserve.cli.main import serve as product_serve
from sloserve.testing.faults import FaultPlan, WithFaults

_FAULT_OPTIONS = [
    click.Option(
        ["--inject-faults"],
        envvar="SLOSERVE_INJECT_FAULTS",
        default="",
        metavar="SPEC",
        help="FOR TESTS ONLY: fault rules such as 'fail-forward:poison,slow-step:slow=0.05' "
        "(see sloserve.testing.faults) [default: off]. Refused unless --allow-fault-injection.",
    ),
    click.Option(
        ["--allow-fault-injection"],
        envvar="SLOSERVE_ALLOW_FAULT_INJECTION",
        is_flag=True,
        hidden=True,
        help="Tests only: let --inject-faults act (clients trigger faults by request id).",
    ),
]


def _serve(inject_faults: str, allow_fault_injection: bool, **kwargs) -> None:
    try:
        plan = FaultPlan.parse(inject_faults)
    except ValueError as exc:
        raise CliError(f"--inject-faults: {exc}") from None
    if plan:
        if not allow_fault_injection:
            raise CliError(
                "--inject-faults is for tests only (any client can trigger a fault through its request "
                "id); a test that means it sets SLOSERVE_ALLOW_FAULT_INJECTION=1"
            )
        click.echo(
            f"WARNING: fault injection is ON ({inject_faults}): any client can fail or stall requests "
            "through its request id. Never run this in production.",
            err=True,
        )
    product_serve.callback(make_core=WithFaults(inject_faults) if plan else None, **kwargs)


serve = OneLineCommand(
    "serve",
    callback=_serve,
    params=[*product_serve.params, *_FAULT_OPTIONS],
    help=product_serve.help,
)
cli = click.Group(
    "sloserve",
    commands={**product_cli.commands, "serve": serve},
    callback=product_cli.callback,
    params=product_cli.params,
    context_settings=product_cli.context_settings,
    help=product_cli.help,
)

if __name__ == "__main__":
    cli()

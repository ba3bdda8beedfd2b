"""Click options made from the config's own fields (their `flag` metadata), and the config built back.

A knob is declared once, as a field with `sloserve.config.flag(default, "--flag", help)`: its
option, its parsing and the flag named in its errors all come from there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import Field, fields
from typing import Any

import click
from sloserve.cli.common import CliError
from sloserve.config import (
    CacheConfig,
    ConfigError,
    Flag,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SloserveConfig,
    parse_size,
)

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _flags(cls: type) -> dict[str, Flag]:
    """Field name -> Flag, for the fields of `cls` that a flag sets."""
    return {f.name: f.metadata["flag"] for f in fields(cls) if "flag" in f.metadata}


def _param(flag: Flag) -> str:
    """The option's parameter name, from its flag as click makes it (--max-wait -> max_wait)."""
    return flag.name.split("/")[0].lstrip("-").replace("-", "_")


def _option(f: Field, flag: Flag) -> Callable:
    kind = _TYPES[str(f.type).split(" | ")[0]]
    names = [flag.name, *flag.aliases]
    if kind is bool and "/" not in flag.name:
        names[0] = f"{flag.name}/--no-{flag.name[2:]}"
    default, shown = f.default, f.default is not None
    if flag.parse is not None:  # text; None (not given) leaves the field's default
        default, kind, shown = None, str, flag.shown or (shown and str(f.default))
    metavar = "SECONDS" if f.name.endswith("_s") else "SIZE" if flag.parse is parse_size else None
    return click.option(
        *names,
        _param(flag),
        default=default,
        show_default=shown,
        type=click.Choice(flag.choices) if flag.choices else kind,
        envvar=flag.envvar,
        metavar=flag.metavar or metavar,
        help=flag.help,
    )


def config_options(*classes: type) -> Callable[[Callable], Callable]:
    """A decorator adding one option per flagged field of `classes`, in field order."""
    options = [
        _option(f, f.metadata["flag"]) for c in classes for f in fields(c) if "flag" in f.metadata
    ]
    return lambda fn: functools.reduce(lambda g, option: option(g), reversed(options), fn)


def _say(flag: Flag, message: str) -> str:
    """'--flag must ...' for a message said of the field itself, else '--flag: message'."""
    name = flag.name.split("/")[0]
    return f"{name} {message}" if message.startswith("must") else f"{name}: {message}"


def pop_config(kwargs: dict[str, Any], cls: type, **fixed: Any) -> Any:
    """`cls` from its flags' values, popped from a command's kwargs, and `fixed` fields; a refused
    value is a CliError naming its flag."""
    flags = _flags(cls)
    values = dict(fixed)
    for name, flag in flags.items():
        raw = kwargs.pop(_param(flag))
        try:
            if raw is not None:
                values[name] = flag.parse(raw) if flag.parse else raw
        except ValueError as exc:
            raise CliError(_say(flag, str(exc))) from None
    try:
        return cls(**values)
    except ConfigError as exc:
        flag = flags.get(exc.field)
        raise CliError(str(exc) if flag is None else _say(flag, exc.message)) from None


def build_config(kwargs: dict[str, Any]) -> SloserveConfig:
    """SloserveConfig from a command's kwargs: each section whose flags the command has is popped
    from them (the others keep their defaults)."""
    sections = {}
    for f in fields(SloserveConfig):
        flags = _flags(f.default_factory)
        if flags and _param(next(iter(flags.values()))) in kwargs:
            sections[f.name] = pop_config(kwargs, f.default_factory)
    return SloserveConfig(**sections)


engine_options = config_options(
    ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoraConfig
)


async def with_engine(config: SloserveConfig, body: Callable[[Any], Any]) -> Any:
    """Start an in-process engine, run `await body(engine)`, stop it; load errors become CliErrors."""
    from sloserve.engine import AsyncEngine  # imports torch: only when a command needs a model

    engine = AsyncEngine(config)
    try:
        try:
            await engine.start()
        except ValueError as exc:  # CheckpointError, a pool too small for the model, ...
            raise CliError(f"cannot load model {config.model.path!r}: {exc}") from None
        return await body(engine)
    finally:
        await engine.stop()

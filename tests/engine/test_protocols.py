"""The two typed seams: every engine client (real or fake) against EngineClient, every runner
(real or fake) against Runner, member by member with signatures, so a fake that drifts fails here."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.engine.async_engine import AsyncEngine
from sloserve.engine.client import EngineClient
from sloserve.engine.mp_client import MPEngineClient
from sloserve.engine.runner import Runner
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.faults import FaultPlan, FaultyRunner

from tests.engine.fakes import FakeRunner
from tests.frontend.test_clock_and_state import TimedEngine
from tests.frontend.test_frontend import _ErrorEngine
from tests.frontend.test_tokenizing import RecordingEngine
from tests.grpc.test_real_engine import BlockingRunner, SlowRunner
from tests.sched.test_admission_policy import _TimedRunner


def _members(protocol: type) -> dict[str, object]:
    """The protocol's own members: annotated attributes (None), properties and methods."""
    members: dict[str, object] = dict.fromkeys(protocol.__annotations__)
    for name, value in vars(protocol).items():
        if not name.startswith("_") and (callable(value) or isinstance(value, property)):
            members[name] = value
    return members


def _accepts(impl: inspect.Signature, wanted: inspect.Signature) -> list[str]:
    """Why `impl` cannot be called as `wanted` is (empty: it can). Extra parameters need defaults."""
    problems = []
    params = impl.parameters
    variadic = {p.kind for p in params.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    for name, want in wanted.parameters.items():
        have = params.get(name)
        if have is None:
            if inspect.Parameter.VAR_KEYWORD not in variadic:
                problems.append(f"no parameter {name!r}")
            continue
        if have.kind != want.kind and not (
            want.kind == want.KEYWORD_ONLY and have.kind == have.POSITIONAL_OR_KEYWORD
        ):
            problems.append(f"{name!r} is {have.kind.description}, not {want.kind.description}")
        if want.default is not want.empty and have.default is have.empty:
            problems.append(f"{name!r} has no default")
    for name, have in params.items():
        if (
            name not in wanted.parameters
            and have.default is have.empty
            and have.kind not in (have.VAR_POSITIONAL, have.VAR_KEYWORD)
        ):
            problems.append(f"extra parameter {name!r} without a default")
    return problems


def drift(obj: object, protocol: type) -> dict[str, str]:
    """Each protocol member `obj` lacks or gets wrong, with the reason."""
    problems = {}
    for name, spec in _members(protocol).items():
        if not hasattr(obj, name):
            problems[name] = "missing"
            continue
        if not callable(spec) or isinstance(spec, property):
            continue  # an attribute or a property: present is what a caller needs
        impl = getattr(obj, name)
        if not callable(impl):
            problems[name] = "not callable"
            continue
        if inspect.iscoroutinefunction(spec) != inspect.iscoroutinefunction(impl):
            problems[name] = "async" if inspect.iscoroutinefunction(spec) else "must not be async"
            continue
        wanted = inspect.signature(spec)
        wanted = wanted.replace(parameters=list(wanted.parameters.values())[1:])  # self
        why = _accepts(inspect.signature(impl), wanted)
        if why:
            problems[name] = "; ".join(why)
    return problems


def _config(**sched) -> SloserveConfig:
    return SloserveConfig(
        cache=CacheConfig(block_size=4), scheduler=SchedulerConfig(admission_control=False, **sched)
    )


ENGINE_CLIENTS = {
    "MPEngineClient": lambda: MPEngineClient(_config()),
    "AsyncEngine": lambda: AsyncEngine(_config(), runner=FakeRunner()),
    "FakeEngine": FakeEngine,
    "TimedEngine": TimedEngine,
    "RecordingEngine": RecordingEngine,
    "_ErrorEngine": lambda: _ErrorEngine(None),
}

RUNNERS = {
    "FakeRunner": FakeRunner,
    "SlowRunner": SlowRunner,
    "BlockingRunner": BlockingRunner,
    "_TimedRunner": _TimedRunner,
    "FaultyRunner": lambda: FaultyRunner(FakeRunner(), FaultPlan.parse("fail-forward:x")),
}


@pytest.mark.parametrize("name", list(ENGINE_CLIENTS))
def test_every_engine_client_implements_the_protocol(name):
    client = ENGINE_CLIENTS[name]()
    assert drift(client, EngineClient) == {}
    assert isinstance(client, EngineClient)


@pytest.mark.parametrize("name", list(RUNNERS))
def test_every_fake_runner_implements_the_protocol(name):
    runner = RUNNERS[name]()
    assert drift(runner, Runner) == {}
    assert isinstance(runner, Runner)


def test_the_model_runner_implements_the_protocol(tiny_llama: Path):
    from sloserve.executor import ModelRunner

    config = SloserveConfig(
        model=ModelConfig(path=str(tiny_llama), device="cpu", max_model_len=64),
        cache=CacheConfig(block_size=4, kv_pool_bytes=2**20),
        scheduler=SchedulerConfig(max_batch=4, max_batched_tokens=64),
    )
    runner = ModelRunner(config)
    assert drift(runner, Runner) == {}
    assert isinstance(runner, Runner)


def test_the_check_catches_a_drifting_fake():
    class Drifted(FakeEngine):
        def add_request(self, request_id, prompt, params):  # loose arguments, not one NewRequest
            raise NotImplementedError

        async def abort(self, request_id):  # became async
            return False

    problems = drift(Drifted(), EngineClient)
    assert set(problems) == {"add_request", "abort"}
    assert (
        "no parameter 'new'" in problems["add_request"]
        and "extra parameter 'prompt' without a default" in problems["add_request"]
    )
    assert problems["abort"] == "must not be async"

"""The messages between a front end and an engine process: plain data, msgpack-framed by msgspec.

No torch object crosses. Inputs are batched per event-loop turn, outputs per engine step: one
`StepOutputs` carries every request's new tokens of that step (never one message per token).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from sloserve.engine.outputs import EngineStats, RequestOutput
from sloserve.new_request import NewRequest


@dataclass(frozen=True, slots=True)
class EngineLink:
    """Where front end `index` meets the engine process: its two sockets in `folder`."""

    folder: str
    index: int

    @property
    def inputs(self) -> str:
        return f"ipc://{self.folder}/inputs-{self.index}"

    @property
    def outputs(self) -> str:
        return f"ipc://{self.folder}/outputs-{self.index}"


class AdapterOp(msgspec.Struct, array_like=True):
    """Front end -> engine: load LoRA adapter `name` from `path` (under --lora-dir), or unload it
    (path None); answered by one AdapterDone with the same op_id."""

    op_id: int
    name: str
    path: str | None = None
    in_flight: str = "refuse"  # an unload's: engine/adapters.py IN_FLIGHT


class Inputs(msgspec.Struct, tag="inputs", array_like=True):
    """Front end -> engine: new requests and aborts gathered in one event-loop turn."""

    adds: list[NewRequest] = []  # each with its arrival_time: the client stamps it
    aborts: list[str] = []
    shutdown: bool = False  # abort what is left, send the final outputs, then exit
    delivery_lag_s: float | None = None  # the front end's latest first-token delivery lag, if new
    frontend: int = 0  # which front end sent it (--frontends): its requests' outputs go back there
    adapter_ops: list[AdapterOp] = []  # applied before `adds`


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """Engine -> front end: the model is loaded and warmed up."""

    model_info: dict
    stats: EngineStats
    pid: int = 0  # the engine process: a front end that did not start it watches it by pid


class StartFailed(msgspec.Struct, tag="start_failed", array_like=True):
    """Engine -> front end: the model could not be loaded (user_error: a ValueError, e.g. a bad checkpoint)."""

    message: str
    user_error: bool


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """Engine -> front end: one step's outputs (possibly none) and the stats after it."""

    outputs: list[RequestOutput]
    stats: EngineStats
    final: bool = False  # the engine is shutting down; nothing follows


class Died(msgspec.Struct, tag="died", array_like=True):
    """Engine -> front end: the loop itself failed (the process exits right after)."""

    reason: str


class AdapterDone(msgspec.Struct, tag="adapter_done", array_like=True):
    """Engine -> the front end that sent an AdapterOp: done, or why not, and the adapters now loaded."""

    op_id: int
    adapters: list[str]
    error: str | None = None
    # with error: 'invalid' (AdapterError), 'not_found' (UnknownAdapterError), 'busy' (AdapterBusyError)
    error_kind: str | None = None


FromEngine = Ready | StartFailed | StepOutputs | Died | AdapterDone

_encoder = msgspec.msgpack.Encoder()
_inputs_decoder = msgspec.msgpack.Decoder(Inputs)
_from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: Inputs | Ready | StartFailed | StepOutputs | Died | AdapterDone) -> bytes:
    return _encoder.encode(msg)


def decode_inputs(data: bytes) -> Inputs:
    return _inputs_decoder.decode(data)


def decode_from_engine(data: bytes) -> Ready | StartFailed | StepOutputs | Died | AdapterDone:
    return _from_engine_decoder.decode(data)

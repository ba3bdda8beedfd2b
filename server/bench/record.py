"""What a load-generating client saw of one request (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sloserve.sampling_params import SLO


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request (times are client time.perf_counter() values)."""

    request_id: str
    send_time: float
    max_tokens: int = 0
    expected_output: str | None = None
    slo: SLO | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    text: str = ""
    end_time: float | None = None
    # 'ok' (a Final arrived), 'refused' (a RequestError), 'failed' (stream lost)
    status: str = "pending"
    finish_reason: str | None = None
    error_code: str | None = None  # gRPC status name of a RequestError or a lost stream
    error_reason: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    slo_class: str = ""  # the report's class; "": named after its objectives by summarise()

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        ttft, e2e = self.ttft, self.e2e
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

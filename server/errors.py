"""Exceptions that cross layer boundaries; the service maps each to one gRPC status."""


class SloserveError(Exception):
    """Base class of every error sloserve raises on purpose."""


class InvalidRequestError(SloserveError, ValueError):
    """The request itself is wrong (empty prompt, bad sampling values, too long): INVALID_ARGUMENT."""


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit the context (the model's, or --max-prompt-tokens): INVALID_ARGUMENT.

    Its message holds OpenAI's phrase "This model's maximum context length is N tokens", which
    clients (LiteLLM, LangChain) look for to trim a conversation's history.
    """


class RequestRefusedError(SloserveError):
    """Admission control refused the request: RESOURCE_EXHAUSTED.

    `reason` is a short machine-readable label (``queue_full``, ``deadline_passed``,
    ``slo_unattainable``, ``draining``, ``queue_timeout``) used for metrics.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EngineDeadError(SloserveError):
    """The engine loop has died; no request can make progress: UNAVAILABLE."""


class CheckpointError(SloserveError, ValueError):
    """A model folder cannot be loaded; the message names the file or architecture."""


class AdapterError(InvalidRequestError):
    """A LoRA adapter cannot be loaded (malformed, mismatched, too large, outside --lora-dir)."""


class UnknownAdapterError(InvalidRequestError):
    """A request names an adapter that is not loaded: NOT_FOUND (HTTP 404 model_not_found)."""

    def __init__(self, name: str, message: str | None = None) -> None:
        super().__init__(
            message
            or f"model {name!r} is not served here: it is neither the served model nor a "
            "loaded LoRA adapter (see GET /v1/models)"
        )
        self.name = name


class AdapterBusyError(SloserveError):
    """An adapter cannot be unloaded while requests of it are running: HTTP 409 (they finish first)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name

"""Logging set-up for the server: readable lines, or JSON lines (orjson) for log collectors."""

from __future__ import annotations

import logging
import math
import sys
import time
from datetime import UTC, datetime

import orjson

_TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (+ exc when there is a traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Route the root logger to stderr in `text` or `json` format (replacing earlier handlers)."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT_FORMAT)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


class Throttled:
    """At most one line per `interval_s` for each kind of event; the next line says how many were held back.

    For events a hostile client can repeat at will (timeouts, refusals): the log stays readable
    and cheap under a flood. Kinds are a small fixed set, so the table stays bounded.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        # kind -> (when last logged, how many held back since)
        self._last: dict[str, tuple[float, int]] = {}

    def admit(self, kind: str) -> int | None:
        """None while `kind` was logged less than `interval_s` ago (one more held back); else how many were."""
        now = time.monotonic()
        last, held = self._last.get(kind, (-math.inf, 0))
        if now - last < self._interval_s:
            self._last[kind] = (last, held + 1)
            return None
        self._last[kind] = (now, 0)
        return held

    def log(self, level: int, kind: str, message: str, *args: object) -> None:
        held = self.admit(kind)
        if held is None:
            return
        if held:
            message += f" (and {held} more like it in the last {self._interval_s:g} s)"
        self._logger.log(level, message, *args)

    def warning(self, kind: str, message: str, *args: object) -> None:
        self.log(logging.WARNING, kind, message, *args)


class ThrottleWarnings(logging.Filter):
    """A filter for a library's logger (uvicorn's): its warnings, which any client can provoke (a
    malformed request, a refused upgrade), pass at most once per 10 s per message."""

    MAX_KINDS = 64  # past this many distinct messages, the rest pass unthrottled

    def __init__(self, interval_s: float = 10.0) -> None:
        super().__init__()
        self._throttle = Throttled(logging.getLogger(__name__), interval_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        kind = str(record.msg)[:200]
        if kind not in self._throttle._last and len(self._throttle._last) >= self.MAX_KINDS:
            return True
        held = self._throttle.admit(kind)
        if held:
            record.msg = f"{record.msg} (and {held} more like it in the last {self._throttle._interval_s:g} s)"
        return held is not None

"""Structured (JSON lines) logging with the service name and the current trace id."""

from __future__ import annotations

import json
import logging
import sys
import time

from opentelemetry import trace
from typing_extensions import override


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message, trace id."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    @override
    def format(self, record: logging.LogRecord) -> str:
        span = trace.get_current_span().get_span_context()
        doc = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if span.is_valid:
            doc["trace_id"] = format(span.trace_id, "032x")
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure(service: str, level: str = "INFO", as_json: bool = True) -> None:
    """Send the process's logs to stderr, JSON by default."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if as_json else logging.Formatter(
        f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("nats").setLevel(logging.WARNING)

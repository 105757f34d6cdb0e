"""Typed service configuration from the environment (pydantic-settings).

Each service subclasses ``ServiceSettings`` with its own prefix, e.g.
``FLEETPILOT_POLICY_METRICS_PORT``. ``FLEETPILOT_NATS_URL`` is shared by every service
unless a service overrides it with its own prefixed variable.
"""

from __future__ import annotations

import os
import socket

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _shared(name: str, default: str | None) -> str | None:
    return os.environ.get(name, default)


class ServiceSettings(BaseSettings):
    """Settings every service has."""

    model_config = SettingsConfigDict(extra="ignore")

    nats_url: str = Field(default_factory=lambda: _shared("FLEETPILOT_NATS_URL", "nats://127.0.0.1:4222"))
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=0, description="Port of /metrics and /healthz; 0 picks a free one, -1 disables.")
    log_level: str = Field(default_factory=lambda: _shared("FLEETPILOT_LOG_LEVEL", "INFO") or "INFO")
    log_json: bool = True
    otlp_endpoint: str | None = Field(default_factory=lambda: _shared("OTEL_EXPORTER_OTLP_ENDPOINT", None))
    replica: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    state_dir: str = Field(default_factory=lambda: _shared("FLEETPILOT_STATE_DIR", ".fleetpilot") or ".fleetpilot")

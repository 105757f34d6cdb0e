"""Typed service configuration from the environment (pydantic-settings).

Each service subclasses ``ServiceSettings`` with its own prefix, e.g.
``FLEETPILOT_POLICY_METRICS_PORT``. ``FLEETPILOT_NATS_URL`` is shared by every service
unless a service overrides it with its own prefixed variable.

A service reads its settings with ``from_environment``, which is strict where pydantic is
lenient: a variable under the service's prefix that names no setting is an error, not
ignored, because ``FLEETPILOT_EXECUTOR_BAKEND=process`` would otherwise run the simulated
backend on a real node without a word.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import socket
from typing import Self

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError


def _shared(name: str, default: str | None) -> str | None:
    return os.environ.get(name, default)


STARTUP_TIMEOUT_VARIABLE = "FLEETPILOT_STARTUP_TIMEOUT_S"
"""The start-up limit every service shares unless it sets its own prefixed one."""

QUEUE_AGING_VARIABLE = "FLEETPILOT_QUEUE_AGING"
"""The queue's aging (``backfill.completion_order``), shared by the policy, which orders its
queue by it, and the SLA negotiator, which estimates a request's wait by the same order:
set once here, they cannot disagree (each may still set its own prefixed one)."""


def queue_aging_default() -> str:
    """The default of a service's ``queue_aging``: :data:`QUEUE_AGING_VARIABLE`, else 1."""
    return _shared(QUEUE_AGING_VARIABLE, "1") or "1"


_SHARED_VARIABLES = {"startup_timeout_s": STARTUP_TIMEOUT_VARIABLE, "log_level": "FLEETPILOT_LOG_LEVEL",
                     "queue_aging": QUEUE_AGING_VARIABLE}
"""Settings validated from a shared variable: a bad value there is named by that variable."""


class BadSettings(ValueError):
    """The environment sets a service's settings wrong; the message names each variable at
    fault and what is wrong with it, on one line."""


class ServiceSettings(BaseSettings):
    """Settings every service has."""

    model_config = SettingsConfigDict(extra="ignore")

    nats_url: str = Field(default_factory=lambda: _shared("FLEETPILOT_NATS_URL", "nats://127.0.0.1:4222"))
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=0, ge=-1, le=65535,
                              description="Port of /metrics and /healthz; 0 picks a free one, -1 disables.")
    # Validated here, the shared default too: logging refuses an unknown level only when the
    # service starts, with a traceback.
    log_level: str = Field(default_factory=lambda: _shared("FLEETPILOT_LOG_LEVEL", "INFO") or "INFO",
                           validate_default=True)
    log_json: bool = True
    otlp_endpoint: str | None = Field(default_factory=lambda: _shared("OTEL_EXPORTER_OTLP_ENDPOINT", None))
    replica: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    state_dir: str = Field(default_factory=lambda: _shared("FLEETPILOT_STATE_DIR", ".fleetpilot") or ".fleetpilot")
    # Read as text and validated like a prefixed value (validate_default), so that a bad shared
    # value is the one-line BadSettings error rather than a traceback from the default factory.
    startup_timeout_s: float = Field(
        default_factory=lambda: _shared(STARTUP_TIMEOUT_VARIABLE, "120"), validate_default=True, gt=0,
        description="How long start-up (topology, start-up hooks, consumers, endpoints) keeps retrying "
                    "while the NATS server it connected to is unreachable, before the service gives up.")

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if not isinstance(logging.getLevelName(value.upper()), int):
            raise ValueError("not a log level (DEBUG, INFO, WARNING, ERROR or CRITICAL)")
        return value

    @classmethod
    def from_environment(cls) -> Self:
        """The settings the environment gives this service. Raises ``BadSettings`` naming
        every variable under the service's prefix that is no setting (with the closest
        setting's name) or whose value does not parse."""
        prefix = (cls.model_config.get("env_prefix") or "").upper()
        known = {prefix + name.upper() for name in cls.model_fields}
        problems = [f"{var} is not a setting" + _closest(var, prefix, known)
                    for var in sorted(v.upper() for v in os.environ)
                    if prefix and var.startswith(prefix) and var not in known]
        try:
            settings = cls()
        except ValidationError as exc:
            problems += [f"{_variable_of(str(e['loc'][0]), prefix)}={_shown(e.get('input'))!r}: {e['msg']}" if e["loc"]
                         else f"{prefix}*: {e['msg']}" for e in exc.errors()]
        except SettingsError as exc:
            # A list or dict setting is parsed as JSON before validation, and pydantic-settings
            # raises this instead of a ValidationError: uncaught, a malformed value stopped
            # the service with a traceback rather than one line.
            problems.append(_unparsable(exc, prefix))
        else:
            if not problems:
                return settings
        raise BadSettings("; ".join(problems))


def _variable_of(field: str, prefix: str) -> str:
    """The variable a setting's bad value came from: its own prefixed one, else the shared one
    it defaults to (naming the prefixed variable would send the operator to one never set)."""
    own = prefix + field.upper()
    shared = _SHARED_VARIABLES.get(field)
    present = {name.upper() for name in os.environ}
    return shared if shared and own not in present and shared in present else own


def _unparsable(exc: SettingsError, prefix: str) -> str:
    """One line for a value pydantic-settings could not parse: the variable, its value and why."""
    cause = exc.__cause__ or exc
    field = re.search(r'field "([^"]+)"', str(exc))
    if field is None:
        return f"{prefix}*: {cause}"
    var = prefix + field.group(1).upper()
    value = next((v for k, v in os.environ.items() if k.upper() == var), None)
    return f"{var}={_shown(value)!r}: {cause}".replace("\n", " ")


_URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^@/\s]+@")


def _shown(value: object) -> object:
    """``value`` as an error may show it: a URL's password (``scheme://user:secret@host``, a
    database DSN, a NATS URL) masked, since the line goes to the logs."""
    return _URL_PASSWORD.sub(r"\1***@", value) if isinstance(value, str) else value


def _closest(var: str, prefix: str, known: set[str]) -> str:
    # Compared without the prefix every candidate shares, which would make any two names alike.
    match = difflib.get_close_matches(var.removeprefix(prefix), [k.removeprefix(prefix) for k in known], n=1)
    return f" (did you mean {prefix}{match[0]}?)" if match else ""

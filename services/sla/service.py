"""The SLA negotiator service.

Every ``task.submitted`` must carry ``Authorization: Bearer <jwt>``; the tenant comes from
the verified token, never from the payload. A submission without a valid token gets
``task.rejected`` (code ``unauthenticated``) and nothing else happens. A valid one is
negotiated against the live fleet: admitted as asked (``task.admitted``), answered with a
counter-offer (``sla.offer.<task>``), or rejected with the reason.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
from prometheus_client import Counter
from pydantic_settings import SettingsConfigDict

from fleetpilot.auth import AuthError, TokenVerifier, load_jwks
from fleetpilot.contracts import Contract, Event, TaskAdmitted, TaskRejected, TaskSubmitted, now
from fleetpilot.runtime import Delivery, ServiceHost, ServiceSettings

log = logging.getLogger("fleetpilot.sla")


class SlaSettings(ServiceSettings):
    """``FLEETPILOT_SLA_*``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_SLA_", extra="ignore")

    jwks_path: str = ""
    audience: str = "fleetpilot"
    issuer: str = "fleetpilot-local"
    algorithms: list[str] = ["EdDSA", "ES256", "RS256"]
    offer_validity_s: float = 30.0


def bearer_token(headers: dict[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer ...`` header (any header-name case)."""
    for name, value in headers.items():
        if name.lower() == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
    return None


def load_verifier(settings: SlaSettings) -> TokenVerifier:
    """The token verifier over the published key set (``<state_dir>/jwks.json`` by default)."""
    path = Path(settings.jwks_path or Path(settings.state_dir) / "jwks.json")
    if not path.exists():
        raise FileNotFoundError(f"no JWKS at {path}: run `fleetpilot token --init` or set FLEETPILOT_SLA_JWKS_PATH")
    return TokenVerifier(load_jwks(path), audience=settings.audience, issuer=settings.issuer,
                         algorithms=settings.algorithms)


def build(settings: SlaSettings | None = None) -> ServiceHost:
    """Wire the negotiator."""
    settings = settings or SlaSettings()
    host = ServiceHost("sla", settings)
    verifier = load_verifier(settings)
    jwks_path = Path(settings.jwks_path or Path(settings.state_dir) / "jwks.json")
    jwks_seen = {"mtime": jwks_path.stat().st_mtime}
    rejected = Counter("fleetpilot_sla_unauthenticated_total", "Submissions rejected for their token",
                       ["reason"], registry=host.metrics.registry)

    def refresh_keys() -> None:
        # Keys rotate weekly: pick up a rewritten key set without a restart.
        mtime = jwks_path.stat().st_mtime
        if mtime != jwks_seen["mtime"]:
            verifier.update_jwks(load_jwks(jwks_path))
            jwks_seen["mtime"] = mtime

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def on_submitted(task: TaskSubmitted, delivery: Delivery) -> Event:
        token = bearer_token(delivery.headers)
        try:
            if token is None:
                raise AuthError("malformed", "no bearer token in the Authorization header")
            refresh_keys()
            claims = verifier.verify(token)
        except AuthError as exc:
            rejected.labels(exc.reason).inc()
            log.warning("rejected %s: %s", task.task_id, exc)
            return TaskRejected(task_id=task.task_id, code="unauthenticated", reason=str(exc), rejected_at=now())
        task = msgspec.structs.replace(task, tenant=claims.tenant)
        return admit_as_asked(task)

    return host


def admit_as_asked(task: TaskSubmitted) -> TaskAdmitted:
    """Admit with the contract the submitter asked for."""
    sla = task.sla
    contract = Contract(tier=sla.tier, max_queue_s=sla.max_queue_s, warmup_ms=sla.warmup_ms,
                        p95_latency_ms=sla.p95_latency_ms, deadline=sla.deadline,
                        cost_ceiling_per_hour=sla.cost_ceiling_per_hour, gpu_models=list(task.gpu_models))
    return TaskAdmitted(task=task, contract=contract, tenant=task.tenant, admitted_at=now())


def main() -> None:
    """Console entry point ``fleetpilot-sla``."""
    try:
        host = build()
    except FileNotFoundError as exc:
        raise SystemExit(f"fleetpilot-sla: {exc}") from None
    host.main()

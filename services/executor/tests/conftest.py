"""Fixtures of the executor service tests: a raw NATS client that watches what the service
stores, a stand-in for the simulated fleet, and the fleet's KV entries."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest
from fleetpilot.contracts import (
    GpuInfo,
    GpuSample,
    NodeLedger,
    NodeTelemetry,
    NodeTopology,
    SimAck,
    SimCommand,
    decode,
    encode,
)
from fleetpilot.maintenance.faults import gpu_reading


class Observer:
    """A plain nats-py client: reads what the streams stored and the KV buckets hold."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.js = nc.jetstream()

    async def stored(self, subject: str, event_type: type, settle_s: float = 0.3) -> list:
        """Every message the streams kept on ``subject`` (duplicates were dropped there)."""
        sub = await self.js.subscribe(subject, ordered_consumer=True)
        out = []
        try:
            while True:
                msg = await sub.next_msg(timeout=settle_s)
                out.append(decode(msg.data, event_type))
        except nats.errors.TimeoutError:
            pass
        finally:
            await sub.unsubscribe()
        return out

    async def wait_stored(self, subject: str, event_type: type, count: int, timeout_s: float = 10.0) -> list:
        """Wait until ``count`` messages are stored on ``subject``, then let stragglers in
        and return them all (so a test sees a duplicate that arrives late)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            out = await self.stored(subject, event_type, settle_s=0.1)
            if len(out) >= count or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        return await self.stored(subject, event_type)

    async def kv_get(self, bucket: str, key: str) -> bytes | None:
        """A key's value, or ``None`` when absent or deleted."""
        kv = await self.js.key_value(bucket)
        try:
            return (await kv.get(key)).value
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None

    async def kv_put(self, bucket: str, key: str, value: bytes) -> None:
        """Write a key as another service would."""
        kv = await self.js.key_value(bucket)
        await kv.put(key, value)

    async def ledger(self, node: str) -> NodeLedger | None:
        """The ledger entry of one node."""
        value = await self.kv_get("ledger", node)
        return msgspec.json.decode(value, type=NodeLedger) if value else None

    async def topology(self, node: str) -> NodeTopology | None:
        """The topology entry of one node."""
        value = await self.kv_get("topology", node)
        return msgspec.json.decode(value, type=NodeTopology) if value else None


@pytest.fixture
def observer(nats_client):
    """An :class:`Observer` on the test's server, with the catalogued streams and buckets."""
    return Observer(nats_client)


class FakeSimFleet:
    """Answers ``sim.control`` as the collector's simulated fleet would, and counts commands."""

    def __init__(self) -> None:
        self.commands: list[SimCommand] = []

    def verbs(self, verb: str) -> list[SimCommand]:
        """The commands received with ``verb``."""
        return [c for c in self.commands if c.verb == verb]


@pytest.fixture
async def sim_fleet(observer):
    """A :class:`FakeSimFleet` serving on the test's server."""
    fleet = FakeSimFleet()

    async def answer(msg) -> None:
        fleet.commands.append(decode(msg.data, SimCommand))
        await msg.respond(encode(SimAck(ok=True)))

    sub = await observer.nc.subscribe("sim.control", cb=answer)
    yield fleet
    await sub.unsubscribe()


def node_topology(node: str, gpus: int = 2, model: str = "H100") -> NodeTopology:
    """A node with ``gpus`` GPUs, as the topology service would store it."""
    return NodeTopology(node=node, gpus=[GpuInfo(index=i, model=model, memory_mb=81920) for i in range(gpus)])


def gpu_sample(node: str, gpu: int, at: float, temperature_c: float = 60.0, **counters: int) -> GpuSample:
    """One GPU reading; ``counters`` set the ECC / XID / remap fields."""
    return gpu_reading(node, gpu, at, temperature_c=temperature_c, **counters)


async def publish_telemetry(observer: Observer, node: str, samples: list[GpuSample]) -> None:
    """Publish one node's batch on core NATS, as the collector does."""
    batch = NodeTelemetry(node=node, at=samples[0].at, source="sim", gpus=samples)
    await observer.nc.publish(f"telemetry.gpu.{node}", encode(batch))
    await observer.nc.flush()

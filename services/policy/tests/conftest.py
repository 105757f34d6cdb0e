"""Fixtures of the policy service tests: a raw NATS client that sets the fleet up, publishes
admitted tasks and collects every decision the DECISIONS stream stored."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import msgspec
import nats
import pytest
from fleetpilot.contracts import (
    Contract,
    DecisionMade,
    Fingerprint,
    GpuInfo,
    NodeLedger,
    NodeTopology,
    TaskAdmitted,
    TaskFingerprinted,
    TaskRejected,
    TaskSubmitted,
    decode,
    encode,
    msg_id_for,
    now,
)
from fleetpilot.ledger.store import FleetView, LedgerStore, node_key
from fleetpilot.runtime.nats_bus import bucket_subject_keys
from fleetpilot_services.policy.metrics import PolicyMetrics
from fleetpilot_services.policy.policy_set import ActivePolicies, PolicyConfig
from fleetpilot_services.policy.service import PolicyState
from fleetpilot_services.policy.settings import PolicySettings
from prometheus_client import CollectorRegistry


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0,
                   what: str | Callable[[], str] = "condition") -> None:
    """Poll ``predicate`` until it holds; fail the test when it does not in time, saying
    ``what`` (called then, when it is a function: what was seen by the end)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what() if callable(what) else what} not met in {timeout_s} s")
        await asyncio.sleep(0.02)


def settings(nats_url: str, tmp_path: Path, replica: str = "a", **overrides) -> PolicySettings:
    """Test settings: no metrics port, slow periodic jobs unless a test speeds one up."""
    base = dict(
        nats_url=nats_url,
        metrics_port=-1,
        replica=replica,
        state_dir=str(tmp_path),
        hostname="test-host",
        rebalance_s=3600.0,
        stats_refresh_s=3600.0,
        stats_timeout_s=0.2,
        plugin_poll_s=0.1,
        breaker={"time_budget_s": 2.0},
    )
    base.update(overrides)
    return PolicySettings(**base)


def policy_state(tmp_path: Path, **overrides) -> PolicyState:
    """A replica's state over in-memory mirrors, no bus (feed them with ``_apply`` as their
    watch would); ``overrides`` are settings."""
    return PolicyState(FleetView(None), LedgerStore(None), settings("nats://unused", tmp_path, **overrides),  # type: ignore[arg-type]
                       ActivePolicies(PolicyConfig(profile="bestfit")), PolicyMetrics(CollectorRegistry()))


def admitted(
    task_id: str,
    kind: str = "train",
    size_gb: float = 1.0,
    gpu_milli: int = 100,
    gpus: int = 1,
    gpu_memory_mb: int = 0,
    **fields,
) -> TaskAdmitted:
    """A task the SLA service let in."""
    task = TaskSubmitted(
        task_id=task_id,
        kind=kind,
        size_gb=size_gb,
        gpus=gpus,
        gpu_milli=gpu_milli,
        gpu_memory_mb=gpu_memory_mb,
        **fields,
    )
    return TaskAdmitted(task=task, contract=Contract(), tenant="t", admitted_at=now())


def node(
    name: str,
    gpus: int = 2,
    model: str = "H100",
    memory_mb: int = 81920,
    labels: dict[int, dict[str, str]] | None = None,
    site: str = "default",
) -> NodeTopology:
    """A node as the topology service stores it."""
    labels = labels or {}
    return NodeTopology(
        node=name,
        site=site,
        cpu_milli=64000,
        memory_mb=512000,
        gpus=[
            GpuInfo(index=i, model=model, memory_mb=memory_mb, labels=labels.get(i, {})) for i in range(gpus)
        ],
    )


class Observer:
    """A plain nats-py client playing every other service."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.decisions: list[DecisionMade] = []
        self._sub = None

    async def follow_decisions(self) -> None:
        """Collect what the DECISIONS stream stores (duplicates by Nats-Msg-Id are dropped
        there, so a decision published twice shows up once, as a consumer would see it)."""

        async def on_msg(msg) -> None:
            self.decisions.append(decode(msg.data, DecisionMade))

        self._sub = await self.js.subscribe("decision.made", ordered_consumer=True, cb=on_msg)

    async def follow_rejections(self) -> list[TaskRejected]:
        """The ``task.rejected`` events published from now on, collected as they come."""
        rejected: list[TaskRejected] = []

        async def on_msg(msg) -> None:
            rejected.append(decode(msg.data, TaskRejected))

        await self.nc.subscribe("task.rejected", cb=on_msg)
        return rejected

    async def put_fleet(self, nodes: list[NodeTopology]) -> None:
        """Write the topology bucket as the topology service would."""
        kv = await self.js.key_value("topology")
        await asyncio.gather(*(kv.put(node_key(n.node), encode(n)) for n in nodes))

    async def kv_put(self, bucket: str, key: str, value: bytes) -> None:
        """Write a key as another service (or an operator) would."""
        kv = await self.js.key_value(bucket)
        await kv.put(key, value)

    async def admit(self, adm: TaskAdmitted) -> None:
        """Publish a ``task.admitted`` as the SLA service does."""
        await self.js.publish(
            "task.admitted", encode(adm), headers={"Nats-Msg-Id": msg_id_for(adm)}
        )

    async def live_keys(self, bucket: str) -> list[str]:
        """The keys of ``bucket`` that hold a value now."""
        kv = await self.js.key_value(bucket)
        live = []
        for key in await bucket_subject_keys(self.js, bucket):
            try:
                await kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                continue
            live.append(key)
        return live

    async def ledgers(self) -> dict[str, NodeLedger]:
        """Every node's ledger."""
        kv = await self.js.key_value("ledger")
        out = {}
        # Not kv.keys(): nats-py's listing can hang while replicas are still writing.
        for key in await bucket_subject_keys(self.js, "ledger"):
            try:
                entry = await kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                continue
            if entry.value:
                out[key] = msgspec.json.decode(entry.value, type=NodeLedger)
        return out

    def by_task(self) -> dict[str, list[DecisionMade]]:
        """The decisions collected so far, per task."""
        out: dict[str, list[DecisionMade]] = {}
        for d in self.decisions:
            out.setdefault(d.task_id, []).append(d)
        return out


@pytest.fixture
async def observer(nats_client):
    """An :class:`Observer` on the test's server, with the catalogued streams and buckets."""
    obs = Observer(nats_client)
    await obs.follow_decisions()
    return obs


def write_module(directory: Path, name: str, source: str) -> None:
    """Replace a policy module atomically (write, then rename), as the README asks, and make
    sure its mtime differs from the previous version's even on a coarse clock."""
    target = directory / name
    tmp = directory / f".{name}.tmp"
    tmp.write_text(source)
    if target.exists():
        st = target.stat()
        os.utime(tmp, ns=(st.st_atime_ns, max(st.st_mtime_ns + 1_000_000, tmp.stat().st_mtime_ns)))
    os.replace(tmp, target)


async def fingerprinted(observer, fps: dict[str, Fingerprint], replica: str = "a") -> None:
    """Publish the tasks' fingerprints and wait until the policy replica (its own consumer)
    has taken them, so that an admission published next is decided with them."""
    last = 0
    for task_id, fp in fps.items():
        ack = await observer.js.publish(
            "task.fingerprinted",
            encode(TaskFingerprinted(task_id=task_id, fingerprint=fp, source="signature", at=now())),
        )
        last = ack.seq
    await fingerprints_taken(observer, last, replica)


async def fingerprints_taken(observer, last_seq: int, replica: str = "a") -> None:
    """Wait until the policy replica has taken every fingerprint up to stream sequence ``last_seq``."""
    for _ in range(250):
        info = await observer.js.consumer_info("TASKS", f"policy-fingerprints-{replica}")
        if info.ack_floor.stream_seq >= last_seq:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the policy did not take the fingerprints")

"""Set-up on a three-node NATS cluster, the production shape (deploy/k8s/nats.yaml)."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess

import nats.errors
import pytest
from fleetpilot.contracts import STREAMS
from fleetpilot.runtime.embedded import free_port, nats_server_binary
from fleetpilot.runtime.nats_bus import NatsBus


@pytest.fixture
def cluster_url(tmp_path):
    """The client URL of one node of a fresh three-node JetStream cluster."""
    ports = [(free_port(), free_port()) for _ in range(3)]
    routes = ", ".join(f"nats://127.0.0.1:{route}" for _, route in ports)
    nodes = []
    for i, (client, route) in enumerate(ports):
        conf = tmp_path / f"n{i}.conf"
        conf.write_text(f'server_name: n{i}\nlisten: "127.0.0.1:{client}"\n'
                        f'jetstream {{ store_dir: "{tmp_path / f"store{i}"}" }}\n'
                        f'cluster {{ name: test, listen: "127.0.0.1:{route}", routes: [{routes}] }}\n')
        nodes.append(subprocess.Popen([nats_server_binary(), "-c", str(conf), "-l", str(tmp_path / f"n{i}.log")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    yield f"nats://127.0.0.1:{ports[0][0]}"
    for node in nodes:
        node.terminate()
    for node in nodes:
        node.wait(10)


async def _set_up(bus: NatsBus, timeout_s: float = 10.0) -> None:
    """The catalogued streams and buckets, once the cluster has elected its meta leader."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    js = bus._nc.jetstream(timeout=0.25)  # asked often: a request before the election goes unanswered
    while True:
        try:
            await js.account_info()
            break
        except Exception as exc:
            if not bus.unreachable(exc) or loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)
    # Idempotent, and asked again as a service starting would: a cluster loaded by the rest of
    # the suite (two workers on two cores) left a stream's creation unanswered for 5 s.
    await _patiently(bus.ensure_topology)


async def test_set_up_keeps_the_replica_count_an_operator_gave_a_stream(cluster_url):
    # deploy/README.md has the operator raise each stream to R3 with `nats stream edit
    # --replicas 3`; the next start of any service updated the stream to the catalog's config,
    # which says nothing of replicas, and so took it back to R1: one node lost, and its streams
    # were gone with it.
    bus = await NatsBus.connect(cluster_url, "service")
    try:
        await _set_up(bus)
        tasks = next(spec for spec in STREAMS if spec.name == "TASKS")
        made = (await bus._js.stream_info("TASKS")).config
        # The operator's edit; the byte limit is the catalog's to set, and it is set back.
        await bus._js.update_stream(dataclasses.replace(made, num_replicas=3, max_bytes=tasks.max_bytes // 2))
        await _patiently(bus.ensure_topology)  # the next service that starts
        now = (await bus._js.stream_info("TASKS")).config
        assert (now.num_replicas, now.max_bytes) == (3, tasks.max_bytes)
    finally:
        await bus.drain()


async def _patiently(call, timeout_s: float = 30.0):
    """``call()`` again while a loaded cluster leaves its requests unanswered (each waits 5 s),
    up to ``timeout_s``; any other failure is raised at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await call()
        except (TimeoutError, nats.errors.TimeoutError):
            if loop.time() > deadline:
                raise


async def _settled(bus: NatsBus, streams: list[str], timeout_s: float = 20.0) -> None:
    """Until each of ``streams`` has its two other replicas current (a request while the
    cluster still moves them can go unanswered)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    js = bus._nc.jetstream(timeout=0.5)
    for name in streams:
        while True:
            try:
                info = await js.stream_info(name)
                peers = info.cluster.replicas if info.cluster is not None else None
                if peers is not None and len(peers) == 2 and all(p.current for p in peers):
                    break
            except Exception as exc:
                if not bus.unreachable(exc):
                    raise
            if loop.time() > deadline:
                raise TimeoutError(f"{name}'s replicas did not settle in {timeout_s:g} s")
            await asyncio.sleep(0.1)


async def test_set_up_of_streams_an_operator_raised_to_r3_asks_no_update(cluster_url):
    # A stream the operator raised to R3, as the catalog has it otherwise: the create sent with
    # one replica was refused, and the update that followed was one the executor's NATS user may
    # not make (contracts.permissions: its pod runs user code), so it could not start at all.
    bus = await NatsBus.connect(cluster_url, "service")
    try:
        await _set_up(bus)
        for spec in STREAMS:
            made = (await bus._js.stream_info(spec.name)).config
            await _patiently(lambda made=made: bus._js.update_stream(dataclasses.replace(made, num_replicas=3)))
        await _settled(bus, [spec.name for spec in STREAMS])

        async def refused(*args, **kwargs):
            raise AssertionError("a stream update was asked")

        bus._js.update_stream = refused  # the executor's user: no STREAM.UPDATE
        await _patiently(bus.ensure_topology)
        assert {(await bus._js.stream_info(spec.name)).config.num_replicas for spec in STREAMS} == {3}
    finally:
        await bus.drain()

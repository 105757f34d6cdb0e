"""A service keeps consuming across a NATS server restart: reconnect, then re-bind; and a KV
watch (what the policy's ledger, fleet and configuration views follow) keeps following."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from fleetpilot.contracts import TaskSubmitted
from fleetpilot.runtime import ServiceHost, ServiceSettings
from fleetpilot.runtime.embedded import EmbeddedNats, free_port
from fleetpilot.runtime.nats_bus import NatsBus, inbox_prefix_of
from fleetpilot.runtime.testing import eventually as wait_for


async def test_consumer_survives_a_server_restart(tmp_path):
    server = EmbeddedNats(tmp_path / "nats").start()
    host = ServiceHost("sla", ServiceSettings(nats_url=server.url, metrics_port=-1))
    seen: list[str] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def record(task: TaskSubmitted) -> None:
        seen.append(task.task_id)

    await host.start()
    client = await NatsBus.connect(server.url, "client")
    try:
        await client.publish(TaskSubmitted(task_id="before", submitted_at=1.0))
        await wait_for(lambda: seen == ["before"])

        server.kill()  # no goodbye: the way a crashed server goes
        await wait_for(lambda: not host.bus.connected)
        server.start()  # same port, same JetStream store
        await wait_for(lambda: host.bus.connected and client.connected)

        await client.publish(TaskSubmitted(task_id="after", submitted_at=2.0))
        await wait_for(lambda: "after" in seen)
        assert seen == ["before", "after"]
        assert host.health()["ok"]
    finally:
        await client.drain()
        await host.stop()
        server.stop()


async def test_consumer_rebinds_when_a_fresh_server_lost_its_state(tmp_path):
    server = EmbeddedNats(tmp_path / "nats-a").start()
    port = server.port
    host = ServiceHost("sla", ServiceSettings(nats_url=server.url, metrics_port=-1))
    seen: list[str] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def record(task: TaskSubmitted) -> None:
        seen.append(task.task_id)

    await host.start()
    server.kill()
    # A replacement server with an empty store: streams and consumers must be re-created.
    fresh = EmbeddedNats(tmp_path / "nats-b", port=port).start()
    client = None
    try:
        await wait_for(lambda: host.bus.connected)
        client = await NatsBus.connect(fresh.url, "client")
        await client.ensure_topology()
        await client.publish(TaskSubmitted(task_id="on-fresh-server", submitted_at=1.0))
        await wait_for(lambda: seen == ["on-fresh-server"], timeout_s=30)
    finally:
        if client is not None:
            await client.drain()
        await host.stop()
        fresh.stop()


@contextlib.asynccontextmanager
async def _watching_the_ledger(url: str):
    """A bus at ``url`` watching the ``ledger`` bucket, node-a written and seen; yields the
    (key, value) pairs the watch delivers, in order."""
    bus = await NatsBus.connect(url, "watcher")
    await bus.ensure_topology()
    kv = await bus.kv("ledger")
    seen: list[tuple[str, bytes | None]] = []

    async def follow() -> None:
        async for entry in kv.watch(">"):
            seen.append((entry.key, entry.value))

    task = asyncio.create_task(follow())
    try:
        await kv.put("node-a", b"held")
        await wait_for(lambda: ("node-a", b"held") in seen)
        yield bus, seen
    finally:
        task.cancel()
        await bus.drain()


async def _written_after_restart(url: str, key: str, value: bytes) -> None:
    writer = await NatsBus.connect(url, "writer")
    try:
        await wait_for(_topology_made(writer), what="JetStream serving again")
        await (await writer.kv("ledger")).put(key, value)
    finally:
        await writer.drain()


def _topology_made(bus: NatsBus):
    async def attempt() -> bool:
        try:
            await bus.ensure_topology()
        except Exception:  # noqa: BLE001 - JetStream is not up yet right after a restart
            return False
        return True
    return attempt


async def test_a_kv_watch_follows_the_bucket_across_a_server_restart(tmp_path):
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        async with _watching_the_ledger(server.url) as (bus, seen):
            server.kill()
            server.start()  # same port, same store
            await wait_for(lambda: bus.connected)
            await _written_after_restart(server.url, "node-b", b"held")
            # nats-py's own watch takes about 20 s to notice; ours starts again at the reconnect.
            await wait_for(lambda: ("node-b", b"held") in seen, timeout_s=8, what="a write after the restart")
            assert ("node-a", None) not in seen  # the store kept it: nothing to report deleted
    finally:
        server.stop()


async def test_a_kv_watch_on_a_server_that_lost_its_store_reports_what_went_with_it(tmp_path):
    server = EmbeddedNats(tmp_path / "nats-a").start()
    fresh = None
    try:
        async with _watching_the_ledger(server.url) as (bus, seen):
            server.kill()
            fresh = EmbeddedNats(tmp_path / "nats-b", port=server.port).start()  # an empty store
            await wait_for(lambda: bus.connected)
            await _written_after_restart(fresh.url, "node-b", b"held")
            await wait_for(lambda: ("node-b", b"held") in seen, timeout_s=30, what="a write on the fresh server")
            # A view built from the watch must not keep node-a's holds: the server has none now.
            await wait_for(lambda: ("node-a", None) in seen, timeout_s=10, what="node-a reported gone")
    finally:
        (fresh or server).stop()


async def test_a_replica_s_own_consumer_goes_on_from_where_it_was_when_the_replica_starts_again(tmp_path):
    # A per-instance consumer (an executor's node, a fingerprinter's partition) is made the
    # first time some seconds back; started again on the same server, it must bind to what
    # it was, not be refused for a start time that cannot be updated, nor replay.
    server = EmbeddedNats(tmp_path / "nats").start()
    seen: list[str] = []

    def replica() -> ServiceHost:
        host = ServiceHost("sla", ServiceSettings(nats_url=server.url, metrics_port=-1))

        @host.on(TaskSubmitted, consumer="sla-submitted", instance="node-a", instance_start_s_ago=60.0)
        async def record(task: TaskSubmitted) -> None:
            seen.append(task.task_id)
        return host

    client = await NatsBus.connect(server.url, "client")
    await client.ensure_topology()
    try:
        await client.publish(TaskSubmitted(task_id="before-first-start", submitted_at=1.0))
        first = replica()
        await first.start()
        await wait_for(lambda: seen == ["before-first-start"])  # within its 60 s back
        await first.stop()
        await client.publish(TaskSubmitted(task_id="while-stopped", submitted_at=2.0))
        again = replica()
        await again.start()
        await client.publish(TaskSubmitted(task_id="after", submitted_at=3.0))
        await wait_for(lambda: "after" in seen)
        await again.stop()
        assert seen == ["before-first-start", "while-stopped", "after"]
    finally:
        await client.drain()
        server.stop()


async def test_a_per_run_consumer_starts_afresh_at_each_start_and_goes_at_a_clean_stop_while_a_node_s_resumes(
    tmp_path,
):
    # A per-run consumer (the policy's fingerprints, held in memory only) under the same
    # instance name across a restart: it must read the recent past again, not go on past what
    # the last run read and lost; a clean stop removes it, and one left by a crash goes after
    # minutes. A node's own (the executor's decisions) must keep its place across the restart,
    # and its week.
    from fleetpilot.contracts import (
        CONSUMERS,
        DecisionMade,
        Fingerprint,
        PolicyRef,
        TaskFingerprinted,
        catalog,
    )
    from fleetpilot.contracts.catalog import INSTANCE_IDLE_LIMIT_S

    run_idle_limit_s = getattr(catalog, "RUN_IDLE_LIMIT_S", None)  # minutes (none: the week before)

    server = EmbeddedNats(tmp_path / "nats").start()
    fingerprints: list[str] = []
    decisions: list[str] = []
    fp = Fingerprint(signature="s", pattern="flat", pattern_confidence=0.9, growth_rate_mb_per_s=0.0,
                     predicted_peak_mb=1000, peak_low_mb=900, peak_high_mb=1100, samples=5)
    per_run = CONSUMERS["policy-fingerprints"].for_instance("policy-0", 60.0).durable
    node = CONSUMERS["executor-decisions"].for_instance("node-a", 60.0).durable

    def replica() -> ServiceHost:
        host = ServiceHost("both", ServiceSettings(nats_url=server.url, metrics_port=-1))

        @host.on(TaskFingerprinted, consumer="policy-fingerprints", instance="policy-0", instance_start_s_ago=60.0)
        async def fingerprinted(event: TaskFingerprinted) -> None:
            fingerprints.append(event.task_id)

        @host.on(DecisionMade, consumer="executor-decisions", instance="node-a", instance_start_s_ago=60.0)
        async def decided(event: DecisionMade) -> None:
            decisions.append(event.task_id)
        return host

    def decision(task_id: str) -> DecisionMade:
        return DecisionMade(decision_id=f"{task_id}.assign", task_id=task_id, action="assign", confidence=0.9,
                            policy=PolicyRef(name="p"), decided_at=1.0)

    async def consumers() -> dict[str, float | None]:
        return {info.name: info.config.inactive_threshold
                for stream in ("TASKS", "DECISIONS") for info in await client._js.consumers_info(stream)}

    client = await NatsBus.connect(server.url, "client")
    await client.ensure_topology()
    try:
        await client.publish(TaskFingerprinted(task_id="before", fingerprint=fp, source="observed", at=1.0))
        await client.publish(decision("before"))
        first = replica()
        await first.start()
        await wait_for(lambda: fingerprints == ["before"] and decisions == ["before"])
        assert await consumers() == {per_run: run_idle_limit_s, node: INSTANCE_IDLE_LIMIT_S}
        assert run_idle_limit_s <= 10 * 60
        await first.stop()
        assert await consumers() == {node: INSTANCE_IDLE_LIMIT_S}

        await client.publish(TaskFingerprinted(task_id="while-stopped", fingerprint=fp, source="observed", at=2.0))
        await client.publish(decision("while-stopped"))
        again = replica()
        await again.start()
        await wait_for(lambda: "while-stopped" in fingerprints and "while-stopped" in decisions)
        await asyncio.sleep(0.3)  # anything more would be a redelivery
        await again.stop()
        assert fingerprints == ["before", "before", "while-stopped"]  # read again: its memory was new
        assert decisions == ["before", "while-stopped"]  # went on from where it was
        assert await consumers() == {node: INSTANCE_IDLE_LIMIT_S}
    finally:
        await client.drain()
        server.stop()


async def test_a_first_connection_that_never_comes_says_why():
    # A refused first connection is retried until the timeout; the error names the refusal,
    # not the timeout that ended the tries.
    url = f"nats://127.0.0.1:{free_port()}"  # free: nothing listens there
    with pytest.raises(ConnectionError) as raised:
        await NatsBus.connect(url, "client", connect_timeout_s=0.5)
    message = str(raised.value)
    assert message.startswith(f"cannot connect to NATS at {url}: ")
    assert "Connect call failed" in message and "\n" not in message


def test_a_nats_server_that_exits_at_start_says_why_as_an_os_error(tmp_path):
    """A server that cannot start (here: its port taken by another listener) is a
    ``ChildProcessError`` carrying the server's own last log line, which commands tell in one
    line (they catch OSError). Before, the other listener's accepting a connection counted as
    this server started; and a server that exited was a RuntimeError, a traceback out of
    `fleetpilot up`."""
    import socket

    from fleetpilot.runtime.embedded import EmbeddedNats

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedNats(tmp_path / "nats", port=taken.getsockname()[1])
        with pytest.raises(ChildProcessError, match="nats-server exited with 1: .*address already in use"):
            server.start()


async def test_a_replica_s_own_consumer_takes_the_catalog_s_new_settings_and_keeps_its_place(nats_url):
    # Bound as first made, an instance consumer (an executor's node) kept an ack wait or a
    # filter the catalog had since changed, for as long as the server kept it (a week idle):
    # a crashed node's decision waited out the old ack wait, the dispatcher's in-progress
    # beats followed the new one, and the new filter's subjects never reached the instance.
    import dataclasses

    from fleetpilot.contracts import CONSUMERS

    bus = await NatsBus.connect(nats_url, "replica")
    await bus.ensure_topology()
    first = CONSUMERS["sla-submitted"].for_instance("node-a", 60.0)
    changed = dataclasses.replace(first, ack_wait_s=120.0, max_ack_pending=7, filter_subject="task.>")
    try:
        await bus.publish(TaskSubmitted(task_id="before", submitted_at=1.0))
        sub = await bus._bind(first)
        [msg] = await sub.fetch(1, timeout=5)
        await msg.ack()
        made = await bus._js.consumer_info(first.stream, first.durable)
        await bus._bind(changed)
        now = await bus._js.consumer_info(first.stream, first.durable)
        assert (now.config.ack_wait, now.config.max_ack_pending, now.config.filter_subject) == (120.0, 7, "task.>")
        # Where it starts and how far it got are its own: a start time cannot be updated.
        assert now.config.opt_start_time == made.config.opt_start_time
        assert now.delivered.stream_seq == made.delivered.stream_seq == 1
    finally:
        await bus.drain()


@pytest.mark.parametrize(("secret", "shown"), [
    ("fleetpilot:s3cret-pass@", "fleetpilot:***@"),
    ("s3cret-token@", "***@"),
])
async def test_a_first_connection_that_never_comes_keeps_the_url_s_credentials_out_of_the_error(secret, shown):
    # The line goes to standard error (`cannot start: ...`) and from there to the logs: a
    # password or token in FLEETPILOT_NATS_URL was printed with it.
    port = free_port()
    with pytest.raises(ConnectionError) as raised:
        await NatsBus.connect(f"nats://{secret}127.0.0.1:{port}", "client", connect_timeout_s=0.5)
    message = str(raised.value)
    assert "s3cret" not in message
    assert message.startswith(f"cannot connect to NATS at nats://{shown}127.0.0.1:{port}: ")


@pytest.mark.parametrize(("url", "prefix"), [
    ("nats://policy:s3cret@nats:4222", "_INBOX_policy"),
    ("policy:s3cret@nats:4222", "_INBOX_policy"),  # nats-py takes a URL without its scheme
    ("nats://s3cret-token@nats:4222", "_INBOX"),  # a token names no user
    ("nats://127.0.0.1:4222", "_INBOX"),  # local runs and tests: nats-py's own
    ("nats://[::1", "_INBOX"),  # left to nats-py to refuse in one line
])
def test_a_connection_that_names_a_user_takes_its_answers_on_that_user_s_inbox(url, prefix):
    # The generated permissions let a user subscribe to `_INBOX_<user>.>` only: on `_INBOX.>`
    # every client saw the answers sent to every service.
    assert inbox_prefix_of(url) == prefix


async def test_health_says_so_while_jetstream_serves_none_of_its_consumers(tmp_path, monkeypatch):
    # A server back without JetStream (a cluster without quorum): the service is connected,
    # and takes no work; /healthz said ok all along.
    from fleetpilot.runtime import host as host_module

    monkeypatch.setattr(host_module, "CONSUMER_FAILING_LIMIT_S", 0.5, raising=False)  # (absent before the fix)
    store = tmp_path / "nats"
    server = EmbeddedNats(store).start()
    host = ServiceHost("sla", ServiceSettings(nats_url=server.url, metrics_port=-1))

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def record(task: TaskSubmitted) -> None:
        pass

    await host.start()
    try:
        assert host.health()["ok"]
        server.kill()
        await wait_for(lambda: not host.bus.connected)
        server = EmbeddedNats(store, port=server.port, jetstream=False).start()
        health = await wait_for(lambda: host.bus.connected and not host.health()["ok"] and host.health(),
                                timeout_s=10, what="health to say the consumer fails")
        assert health["consumers_failing"] == ["sla-submitted"]
        server.kill()
        server = EmbeddedNats(store, port=server.port).start()  # JetStream back
        await wait_for(lambda: host.health()["ok"], timeout_s=10, what="health to come back")
    finally:
        await host.stop()
        server.stop()


@pytest.mark.parametrize("url", ["nats://127.0.0.1:4222x", "nats://127.0.0.1:99999", ""])
async def test_a_nats_url_that_cannot_be_a_server_s_is_one_line(url):
    # nats-py refuses it before trying with its own ``nats.errors.Error``, which is no
    # OSError: `main` and the commands, which tell OSErrors in one line, let a typo in
    # FLEETPILOT_NATS_URL stop a service with a traceback instead.
    with pytest.raises(ConnectionError) as raised:
        await NatsBus.connect(url, "client", connect_timeout_s=0.5)
    message = str(raised.value)
    assert message.startswith(f"cannot connect to NATS at {url}: nats: invalid")
    assert "\n" not in message


async def test_health_says_so_when_the_server_stops_answering_without_closing_the_connection(tmp_path, monkeypatch):
    # A server frozen or cut off by a partition that drops packets closes nothing: the client
    # heard of it only from its pings, nats-py's default one every 2 minutes and 2 unanswered,
    # so /healthz said ok for 6 minutes while no message came and no publish went out (an idle
    # fetch times out as it does on a quiet stream). The bus pings often enough to notice.
    import os
    import signal

    from fleetpilot.runtime import nats_bus

    monkeypatch.setattr(nats_bus, "PING_INTERVAL_S", 0.5, raising=False)  # (absent before the fix)
    server = EmbeddedNats(tmp_path / "nats").start()
    host = ServiceHost("sla", ServiceSettings(nats_url=server.url, metrics_port=-1))

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def record(task: TaskSubmitted) -> None:
        pass

    await host.start()
    pid = server.process.pid
    try:
        assert host.health()["ok"]
        os.kill(pid, signal.SIGSTOP)
        await wait_for(lambda: not host.health()["ok"], timeout_s=15, what="health to say the bus is gone")
        os.kill(pid, signal.SIGCONT)
        await wait_for(lambda: host.health()["ok"], timeout_s=15, what="health to come back")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        await host.stop()
        server.stop()

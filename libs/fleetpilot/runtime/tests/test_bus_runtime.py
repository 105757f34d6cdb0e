"""The runtime's delivery semantics, the same tests on the in-memory bus and a real nats-server."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats.js.errors
import pytest
from fleetpilot.contracts import (
    CONSUMERS,
    DeadLetter,
    TaskAdmitted,
    TaskRejected,
    TaskSubmitted,
    TaskTelemetry,
    decode,
    encode,
)
from fleetpilot.contracts import Contract as TaskContract
from fleetpilot.runtime import CasConflict, Delivery, InMemoryBus, Reject, Retry, ServiceHost, ServiceSettings
from fleetpilot.runtime.bus import subject_matches
from fleetpilot.runtime.host import next_tick
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually as wait_for


def settings() -> ServiceSettings:
    return ServiceSettings(metrics_port=-1, nats_url="unused")


def submitted(task_id: str) -> TaskSubmitted:
    return TaskSubmitted(task_id=task_id, tenant="t", submitted_at=1.0)


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("task.submitted", "task.submitted", True),
        ("task.*", "task.submitted", True),
        ("task.*", "task.lifecycle.a", False),
        ("task.>", "task.lifecycle.a", True),
        ("task.>", "task", False),
        ("sla.offer.*", "sla.offer.t1", True),
        ("sla.offer.*", "sla.reply.t1", False),
    ],
)
def test_subject_matching(pattern, subject, expected):
    assert subject_matches(pattern, subject) is expected


async def test_handler_output_is_published_and_typed(bus):
    host = ServiceHost("sla", settings())
    admitted: list[TaskAdmitted] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def admit(task: TaskSubmitted) -> TaskAdmitted:
        return TaskAdmitted(task=task, contract=TaskContract(), tenant=task.tenant, admitted_at=2.0)

    watcher = ServiceHost("policy", settings())

    @watcher.on(TaskAdmitted, consumer="policy-admitted")
    async def seen(event: TaskAdmitted) -> None:
        admitted.append(event)

    await host.start(bus)
    await watcher.start(bus)
    for i in range(5):
        await bus.publish(submitted(f"t{i}"))
    await wait_for(lambda: len(admitted) == 5)
    assert sorted(a.task.task_id for a in admitted) == [f"t{i}" for i in range(5)]


async def test_duplicate_publish_is_deduplicated(bus):
    host = ServiceHost("sla", settings())
    seen: list[str] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def count(task: TaskSubmitted) -> None:
        seen.append(task.task_id)

    await host.start(bus)
    for _ in range(3):
        await bus.publish(submitted("same"))
    await bus.publish(submitted("other"))
    # "other" was published last: once it is handled, a copy of "same" that got through
    # would have been handled before it (one consumer, stream order), whatever the load.
    await wait_for(lambda: "other" in seen)
    await asyncio.sleep(0.3)
    assert sorted(seen) == ["other", "same"]


@pytest.mark.parametrize("payload", [b"{not json", b'{"type":"task.submitted.v1","task_id":7}',
                                     b'{"type":"task.exploded.v9","task_id":"x"}'])
async def test_malformed_message_goes_to_dlq_and_service_keeps_serving(bus, payload):
    host = ServiceHost("sla", settings())
    handled: list[str] = []
    letters: list[DeadLetter] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def ok(task: TaskSubmitted) -> None:
        handled.append(task.task_id)

    async def on_dlq(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await host.start(bus)
    await bus.subscribe("dlq.>", on_dlq)
    await bus.publish_raw("task.submitted", payload, headers={"Nats-Msg-Id": "bad-1"})
    await bus.publish(submitted("good"))
    await wait_for(lambda: letters and handled)
    assert handled == ["good"]
    assert letters[0].subject == "task.submitted"
    assert letters[0].reason == "undecodable"
    assert letters[0].data == payload
    assert letters[0].error


async def test_failing_handler_is_retried_then_dead_lettered(bus):
    host = ServiceHost("sla", settings())
    attempts: list[int] = []
    letters: list[DeadLetter] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def flaky(task: TaskSubmitted, delivery: Delivery) -> None:
        attempts.append(delivery.deliveries)
        if task.task_id == "heals" and delivery.deliveries >= 2:
            return
        raise Retry("not yet", delay_s=0.05)

    async def on_dlq(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await host.start(bus)
    await bus.subscribe("dlq.>", on_dlq)
    await bus.publish(submitted("heals"))
    await bus.publish(submitted("never"))
    await wait_for(lambda: letters, timeout_s=15)
    max_deliver = CONSUMERS["sla-submitted"].max_deliver
    assert len(letters) == 1 and letters[0].reason == "max_deliver"
    assert decode(letters[0].data, TaskSubmitted).task_id == "never"
    assert max(attempts) == max_deliver


async def test_reject_dead_letters_at_once(bus):
    host = ServiceHost("sla", settings())
    letters: list[DeadLetter] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def refuse(task: TaskSubmitted) -> None:
        raise Reject("never valid")

    async def on_dlq(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await host.start(bus)
    await bus.subscribe("dlq.>", on_dlq)
    await bus.publish(submitted("x"))
    await wait_for(lambda: letters)
    assert letters[0].reason == "rejected" and letters[0].deliveries == 1


async def test_a_core_message_whose_handler_fails_is_dead_lettered_at_once(bus):
    # Nothing delivers a core message (telemetry) again, so a nak would lose it.
    host = ServiceHost("fingerprinter", settings())
    letters: list[DeadLetter] = []
    calls: list[str] = []

    @host.on_core("telemetry.task.>", TaskTelemetry)
    async def broken(sample: TaskTelemetry) -> None:
        calls.append(sample.task_id)
        raise RuntimeError("KV write timed out")

    async def on_dlq(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await host.start(bus)
    await bus.subscribe("dlq.>", on_dlq)
    await bus.publish(TaskTelemetry(task_id="t1", node="n0", gpus=[0], at=1.0, memory_used_mb=512.0))
    await wait_for(lambda: letters)
    assert calls == ["t1"]
    assert (letters[0].subject, letters[0].reason) == ("telemetry.task.t1", "failed")
    assert "KV write timed out" in letters[0].error
    assert decode(letters[0].data, TaskTelemetry).memory_used_mb == 512.0


async def test_trace_context_flows_to_outputs(bus):
    host = ServiceHost("sla", settings())
    headers_seen: list[dict] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def admit(task: TaskSubmitted) -> TaskAdmitted:
        return TaskAdmitted(task=task, contract=TaskContract(), tenant="t", admitted_at=1.0)

    async def on_admitted(msg) -> None:
        headers_seen.append(msg.headers)

    await host.start(bus)
    await bus.subscribe("task.admitted", on_admitted)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    await bus.publish(submitted("traced"), headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    await wait_for(lambda: headers_seen)
    assert headers_seen[0]["traceparent"].split("-")[1] == trace_id
    assert headers_seen[0]["Nats-Msg-Id"] == "admit:traced:1.0"


async def test_kv_compare_and_set(bus):
    kv = await bus.kv("ledger")
    rev = await kv.create("node.a", b"1")
    with pytest.raises(CasConflict):
        await kv.create("node.a", b"2")
    rev2 = await kv.update("node.a", b"2", rev)
    with pytest.raises(CasConflict):
        await kv.update("node.a", b"3", rev)
    entry = await kv.get("node.a")
    assert entry is not None and entry.value == b"2" and entry.revision == rev2
    assert await kv.keys() == ["node.a"]
    with pytest.raises(CasConflict):
        await kv.delete("node.a", revision=rev)  # no longer at it: the value stays
    assert (await kv.get("node.a")).value == b"2"
    await kv.delete("node.a", revision=rev2)
    assert await kv.get("node.a") is None
    await kv.put("node.a", b"4")
    await kv.delete("node.a")
    assert await kv.get("node.a") is None


async def test_kv_put_many_writes_every_key_in_order(bus):
    # The collector writes every GPU's sample this way each second (6,212 on openb).
    kv = await bus.kv("gpu_state")
    items = [(f"node-{i // 8}.{i % 8}", f"v{i}".encode()) for i in range(400)]
    await kv.put_many([*items, ("node-0.0", b"again")])
    assert sorted(await kv.keys()) == sorted(key for key, _ in items)
    assert (await kv.get("node-0.0")).value == b"again"  # the later write of a key wins
    assert (await kv.get("node-49.7")).value == b"v399"
    await kv.put_many([])  # nothing to write is no error


async def test_kv_put_many_tells_a_bucket_that_is_gone(nats_server):
    # Its writes but the last are not acknowledged one by one: the last one's ack still says
    # that the bucket is gone, so the collector logs that the cache is not written.
    bus = await NatsBus.connect(nats_server.url, "test")
    try:
        await bus.ensure_topology()
        kv = await bus.kv("gpu_state")
        await bus._js.delete_key_value("gpu_state")
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await kv.put_many([("node-0.0", b"1"), ("node-0.1", b"2")])
    finally:
        await bus.drain()


async def test_request_reply_endpoint(bus):
    host = ServiceHost("sla", settings())

    @host.endpoint("echo", "test.echo", TaskSubmitted)
    async def echo(task: TaskSubmitted) -> TaskSubmitted:
        return msgspec.structs.replace(task, tenant="answered")

    await host.start(bus)
    reply = decode(await bus.request("test.echo", encode(submitted("q"))), TaskSubmitted)
    assert reply.tenant == "answered"
    bad = msgspec.json.decode(await bus.request("test.echo", b"garbage"))
    assert "invalid request" in bad["error"]


async def test_request_says_whether_nobody_answered_or_the_handler_failed(bus):
    host = ServiceHost("sla", settings())

    @host.endpoint("broken", "test.broken", TaskSubmitted)
    async def broken(task: TaskSubmitted) -> TaskSubmitted:
        raise ValueError(f"cannot quote {task.task_id}")

    await host.start(bus)
    with pytest.raises(RuntimeError, match="test.broken failed.*cannot quote q"):
        await bus.request("test.broken", encode(submitted("q")), timeout_s=5)
    with pytest.raises(TimeoutError, match="no responder on test.nobody"):
        await bus.request("test.nobody", encode(submitted("q")), timeout_s=5)
    await host.stop()


async def test_an_endpoint_that_fails_is_logged_and_counted_by_the_service(bus, caplog):
    # nats.micro answers a failed request with a 500 and says nothing: the service's logs and
    # /metrics showed an endpoint that failed every negotiation as a healthy one.
    host = ServiceHost("sla", settings())

    @host.endpoint("broken", "test.broken", TaskSubmitted)
    async def broken(task: TaskSubmitted) -> TaskSubmitted:
        raise ValueError(f"cannot quote {task.task_id}")

    await host.start(bus)
    with pytest.raises(RuntimeError):
        await bus.request("test.broken", encode(submitted("q")), timeout_s=5)
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "endpoint broken failed: ValueError: cannot quote q"]
    counted = host.metrics.registry.get_sample_value
    assert counted("fleetpilot_handler_errors_total", {"service": "sla", "handler": "broken"}) == 1
    assert counted("fleetpilot_messages_total", {"service": "sla", "handler": "broken"}) == 1
    await host.stop()


async def test_an_endpoint_answers_a_request_sent_the_moment_it_is_served(nats_server):
    # nats-py's flush could return before the server had the endpoint's subscription: about
    # one request in forty sent right after serve() got "no responders".
    serving = await NatsBus.connect(nats_server.url, "serving")
    asking = await NatsBus.connect(nats_server.url, "asking")

    async def echo(data: bytes, headers: dict[str, str]) -> bytes:
        return data

    try:
        for i in range(300):
            await serving.serve("race", f"e{i}", f"race.{i}", echo)
            assert await asking.request(f"race.{i}", b"ping", timeout_s=5) == b"ping"
    finally:
        await asking.drain()
        await serving.drain()


async def test_the_time_a_stream_last_stored_a_subject(bus):
    # What the topology service tells a node's silence by: the last report its stream keeps.
    assert await bus.last_stored_at("topology.report.n1") is None
    before = time.time()
    for _ in range(2):
        await bus.publish_raw("topology.report.n1", b"{}")
        await asyncio.sleep(0.05)
    await bus.publish_raw("topology.report.n2", b"{}")
    last = await bus.last_stored_at("topology.report.n1")
    assert last is not None and before - 1.0 <= last <= time.time() + 1.0
    assert last < await bus.last_stored_at("topology.report.n2")
    assert await bus.last_stored_at("telemetry.task.none") is None  # a stream keeps it, but nothing came
    assert await bus.last_stored_at("sim.control") is None  # no stream keeps it
    # How far back the stream sees: its oldest message, whatever its subject.
    first = await bus.first_stored_at("topology.report.n9")
    assert first is not None and before - 1.0 <= first <= last
    assert await bus.first_stored_at("sim.control") is None and await bus.first_stored_at("dlq.x") is None


async def test_a_background_job_that_dies_or_ends_is_started_again_and_health_counts_it(bus):
    host = ServiceHost("policy", settings())
    await host.start(bus)
    runs: list[int] = []

    async def follow_a_view() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise RuntimeError("the watch was lost")
        if len(runs) == 2:
            return  # a watch that ends: the view would stop changing just the same
        await asyncio.Event().wait()

    try:
        host.background(follow_a_view, "ledger-watch")
        await wait_for(lambda: len(runs) == 3, timeout_s=10, what="the third start")
        health = host.health()
        assert health["background_restarts"] == {"ledger-watch": 2}
    finally:
        await host.stop()


def test_a_per_run_consumer_is_refused_without_an_instance():
    # Made afresh at each start and removed at each stop, a shared consumer would take the
    # other replicas' place away whenever one of them started or stopped.
    host = ServiceHost("policy", settings())
    with pytest.raises(ValueError, match="per run"):
        host.on(TaskAdmitted, consumer="policy-fingerprints")
    host.on(TaskAdmitted, consumer="policy-fingerprints", instance="a", instance_start_s_ago=60.0)


async def test_set_up_removes_the_consumers_earlier_versions_made_and_keeps_the_rest(nats_url):
    """An upgraded server still holds the policy's old shared fingerprint consumer: set-up
    removes it, and leaves a replica's own (``policy-fingerprints-<replica>``) alone."""
    import nats as nats_client
    from fleetpilot.contracts.catalog import RETIRED_CONSUMERS
    from fleetpilot.runtime.nats_bus import NatsBus
    from nats.js import api

    bus = await NatsBus.connect(nats_url, "setup")
    await bus.ensure_topology()
    nc = await nats_client.connect(nats_url)
    js = nc.jetstream()
    for durable in ("policy-fingerprints", "policy-fingerprints-a"):
        await js.add_consumer("TASKS", api.ConsumerConfig(durable_name=durable, filter_subject="task.fingerprinted",
                                                          ack_policy=api.AckPolicy.EXPLICIT))
    try:
        await bus.ensure_topology()
        await bus.ensure_topology()  # again, with nothing left to remove
        names = {c.name for c in await js.consumers_info("TASKS")}
    finally:
        await nc.close()
        await bus.drain()
    assert ("TASKS", "policy-fingerprints") in RETIRED_CONSUMERS
    assert "policy-fingerprints" not in names and "policy-fingerprints-a" in names


class RefusesOnce(InMemoryBus):
    """A bus whose ``refuse_at``-th publish fails, as one does while the server fails over."""

    def __init__(self, refuse_at: int) -> None:
        super().__init__()
        self.publishes, self.refuse_at = 0, refuse_at

    async def publish(self, event, *, headers=None) -> None:
        self.publishes += 1
        if self.publishes == self.refuse_at:
            raise TimeoutError("nats: timeout")
        await super().publish(event, headers=headers)


async def test_a_periodic_job_s_events_the_bus_refused_go_out_on_the_next_tick_in_order():
    # The rest of a job's list was given up at its first failed publish: the executor's
    # "evicted" of the tasks of a node it had given up (their holds released) never went
    # out, and the policy placed them nowhere again.
    bus = RefusesOnce(refuse_at=2)
    host = ServiceHost("sla", settings())
    runs: list[int] = []

    @host.every(0.05)
    async def reject_three() -> list[TaskRejected]:
        runs.append(len(runs))
        if len(runs) > 1:
            return []
        return [TaskRejected(task_id=f"t{i}", code="invalid", reason="test", rejected_at=1.0) for i in range(3)]

    await host.start(bus)
    try:
        await wait_for(lambda: len(runs) >= 3)
    finally:
        await host.stop()
    assert [decode(data, TaskRejected).task_id for _, data in bus.stored("TASKS")] == ["t0", "t1", "t2"]


@pytest.mark.parametrize(("due", "now", "expected"), [
    (10.0, 10.0, 11.0),   # woke on time: one period on, whatever the run takes
    (10.0, 10.3, 11.0),   # woke late: the period is kept from when it was due
    (10.0, 12.5, 12.5),   # a run that overran its period: the next at once, no burst of missed ones
])
def test_a_periodic_job_keeps_its_period(due, now, expected):
    assert next_tick(due, 1.0, now) == expected


async def test_a_handler_is_told_its_message_s_stream_sequence_and_stored_time(bus):
    """The place and time the stream stored a message, the same at every delivery (what a
    handler orders late or redelivered messages by); a core message has neither."""
    host = ServiceHost("sla", settings())
    seen: list[tuple[str, int, int | None, float | None]] = []
    core: list[tuple[int | None, float | None]] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def once_more(task: TaskSubmitted, delivery: Delivery) -> None:
        seen.append((task.task_id, delivery.deliveries, delivery.stream_seq, delivery.stored_at))
        if task.task_id == "first" and delivery.deliveries == 1:
            raise Retry("again", delay_s=1.2)  # the next delivery's own time is past any rounding

    @host.on_core("telemetry.task.>", TaskTelemetry)
    async def sample(event: TaskTelemetry, delivery: Delivery) -> None:
        core.append((delivery.stream_seq, delivery.stored_at))

    await host.start(bus)
    before = time.time()
    await bus.publish(submitted("first"))
    await asyncio.sleep(0.05)
    await bus.publish(submitted("second"))
    await bus.publish(TaskTelemetry(task_id="t1", node="n0", gpus=[0], at=1.0, memory_used_mb=1.0))
    after = time.time()
    await wait_for(lambda: len(seen) == 3 and core, timeout_s=10)
    by = {(task_id, n): (seq, at) for task_id, n, seq, at in seen}
    (seq1, at1), (again_seq, again_at), (seq2, at2) = by["first", 1], by["first", 2], by["second", 1]
    assert isinstance(seq1, int) and isinstance(seq2, int) and seq1 < seq2
    assert (again_seq, again_at) == (seq1, at1)  # redelivered: stored once, where and when it was
    assert before - 1.0 <= at1 < at2 <= after + 1.0 and at2 - at1 >= 0.04
    assert core == [(None, None)]

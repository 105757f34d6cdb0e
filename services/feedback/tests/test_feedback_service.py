"""The feedback service over a real nats-server, on SQLite and on PostgreSQL: one record
per action (redeliveries stored and announced once), statistics that match the records."""

from __future__ import annotations

import asyncio
import random
import uuid

import msgspec
import pytest
from fleetpilot.contracts import (
    ActionExecuted,
    ActionFailed,
    DeadLetter,
    FeedbackRecorded,
    FeedbackStats,
    Measured,
    Placement,
    PolicyRef,
    StatsQuery,
    TaskLifecycle,
    decode,
    encode,
)
from fleetpilot.feedback import PostgresFeedbackStore
from fleetpilot.feedback.synthetic import feedback_event
from fleetpilot.fleet.catalogue import gpu_model
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually as wait_for
from fleetpilot_services.feedback.service import FeedbackSettings, build, open_store


@pytest.fixture(params=["sqlite", "postgres"])
def store_dsn(request) -> str:
    """``""`` (SQLite, the default) or the test PostgreSQL's DSN. A plain fixture: the shared
    ``pg_dsn`` probe runs its own event loop."""
    return "" if request.param == "sqlite" else request.getfixturevalue("pg_dsn")


@pytest.fixture
async def feedback_settings(store_dsn, nats_url, tmp_path):
    """Settings for SQLite in the test's state dir, or PostgreSQL in a schema of its own."""
    base = dict(nats_url=nats_url, metrics_port=-1, state_dir=str(tmp_path / "state"))
    if not store_dsn:
        yield FeedbackSettings(**base)
        return
    dsn = store_dsn
    settings = FeedbackSettings(**base, store_dsn=dsn, store_schema=f"fp_svc_{uuid.uuid4().hex[:12]}")
    yield settings
    store = await PostgresFeedbackStore.open(dsn, schema=settings.store_schema)
    await store.drop_schema()
    await store.close()


def executed(decision_id: str, action: str, policy: str, task_kind: str = "train") -> ActionExecuted:
    return ActionExecuted(
        action_id=f"act-{decision_id}",
        decision_id=decision_id,
        task_id=f"t-{decision_id}",
        action=action,
        backend="sim",
        latency_ms=12.0,
        policy=PolicyRef(name=policy),
        confidence=0.7,
        task_kind=task_kind,
        gpu_model="H100",
        executed_at=1.0,
    )


def failed(decision_id: str, policy: str) -> ActionFailed:
    return ActionFailed(
        action_id=f"act-{decision_id}",
        decision_id=decision_id,
        task_id=f"t-{decision_id}",
        action="assign",
        backend="sim",
        error="backend down",
        policy=PolicyRef(name=policy),
        confidence=0.6,
        task_kind="train",
        gpu_model="H100",
        failed_at=1.0,
    )


def ended(decision_id: str, state: str, policy: str, task_kind: str = "train", *, task_id: str = "",
          replaces: str = "", detail: str = "") -> TaskLifecycle:
    return TaskLifecycle(
        task_id=task_id or f"t-{decision_id}",
        state=state,
        decision_id=decision_id,
        replaces_decision_id=replaces,
        detail=detail,
        policy=policy,
        policy_version="1",
        confidence=0.7,
        task_kind=task_kind,
        gpu_model="H100",
        node="n1",
        gpus=[0],
        at=2.0,
    )


def samples(host, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """The values of the series ``name`` the host serves, summed by the values of ``labels``,
    leaving out the ones never incremented."""
    out: dict[tuple[str, ...], float] = {}
    for family in host.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and sample.value:
                key = tuple(sample.labels[label] for label in labels)
                out[key] = out.get(key, 0.0) + sample.value
    return out


@pytest.fixture
async def announced(nats_client) -> list[FeedbackRecorded]:
    """Every ``feedback.recorded`` published, in order. A core subscription sees every
    publish, duplicates included: the stream's de-duplication cannot hide one from it."""
    seen: list[FeedbackRecorded] = []

    async def on_feedback(msg) -> None:
        seen.append(decode(msg.data, FeedbackRecorded))

    await nats_client.subscribe("feedback.recorded", cb=on_feedback)
    return seen


async def test_every_action_gets_exactly_one_feedback_record(feedback_settings, nats_client, announced):
    js = nats_client.jetstream()
    host = build(feedback_settings)
    await host.start()
    try:
        # d1 fails, and the failure is delivered twice (different Nats-Msg-Id: a redelivery).
        for msg_id in ("one", "two"):
            await js.publish("action.failed", encode(failed("d1", "fgd")), headers={"Nats-Msg-Id": msg_id})
        await js.publish("action.executed", encode(executed("d2", "resize", "best-fit")))
        await js.publish("action.executed", encode(executed("d3", "assign", "best-fit")))
        await js.publish("task.lifecycle.t-d3", encode(ended("d3", "started", "best-fit")))
        await js.publish("task.lifecycle.t-d3", encode(ended("d3", "finished", "best-fit")))
        await js.publish("action.executed", encode(executed("d4", "assign", "best-fit", task_kind="infer")))
        await js.publish(
            "task.lifecycle.t-d4", encode(ended("d4", "oom_killed", "best-fit", task_kind="infer"))
        )
        # d3's end is delivered again later; it was judged already.
        await js.publish(
            "task.lifecycle.t-d3",
            encode(ended("d3", "finished", "best-fit")),
            headers={"Nats-Msg-Id": "again"},
        )
        await wait_for(lambda: len(announced) >= 4)
        await asyncio.sleep(0.5)  # room for a duplicate announcement to arrive
        reply = await nats_client.request("feedback.stats", encode(StatsQuery(by=["policy"])), timeout=5)
        by_kind = await nats_client.request(
            "feedback.stats", encode(StatsQuery(by=["policy", "task_kind"])), timeout=5
        )
    finally:
        await host.stop()

    outcomes = sorted((f.action_id, f.outcome) for f in announced)
    assert outcomes == [
        ("act-d1", "failure"),
        ("act-d2", "success"),
        ("act-d3", "success"),
        ("act-d4", "oom"),
    ]
    store = await open_store(feedback_settings)
    try:
        stored = [r async for r in store.raw()]
    finally:
        await store.close()
    assert sorted((r.action_id, r.outcome) for r in stored) == outcomes

    groups = {g.key["policy"]: g for g in decode(reply.data, FeedbackStats).groups}
    assert {p: (g.count, g.successes) for p, g in groups.items()} == {"best-fit@1": (3, 2), "fgd@1": (1, 0)}
    assert groups["best-fit@1"].success_rate == pytest.approx(2 / 3)
    kinds = {
        (g.key["policy"], g.key["task_kind"]): g.count for g in decode(by_kind.data, FeedbackStats).groups
    }
    assert kinds == {("best-fit@1", "train"): 2, ("best-fit@1", "infer"): 1, ("fgd@1", "train"): 1}

    # The service's series count each stored record once: the failure delivered twice and
    # the end delivered again add nothing. (An end handled before its result files its record
    # under the action the lifecycle names, which these ends do not: summed over actions.)
    assert samples(host, "fleetpilot_feedback_records_total", "policy", "outcome") == {
        ("fgd", "failure"): 1, ("best-fit", "success"): 2, ("best-fit", "oom"): 1,
    }
    assert samples(host, "fleetpilot_feedback_expected_successes_total", "policy") == pytest.approx(
        {("fgd",): 0.6, ("best-fit",): 0.7 * 3})


async def test_an_assign_is_judged_by_the_end_of_its_task_even_when_the_end_comes_first(
    feedback_settings, nats_client
):
    js = nats_client.jetstream()
    host = build(feedback_settings)
    await host.start()
    try:
        await js.publish("task.lifecycle.t-d7", encode(ended("d7", "failed", "fgd")))
        store_has = await _wait_records(feedback_settings, 1)  # judged before the result exists
        await js.publish("action.executed", encode(executed("d7", "assign", "fgd")))
        # The late result finds the end judged: it does not wait for an end that came already.
        async def nothing_open() -> bool:
            return await _open_placements(feedback_settings) == []

        await wait_for(nothing_open, what="the late result to be dropped")
    finally:
        await host.stop()
    [record] = store_has
    assert (record.action_id, record.outcome, record.policy.name) == ("act-d7", "failure", "fgd")
    # The executor's latency was not known yet when the end was judged: marked untrustworthy.
    assert record.latency_ms.uncertainty_score == 1.0


async def test_a_result_that_comes_after_its_end_was_judged_gives_the_record_its_latency(
    feedback_settings, nats_client, announced
):
    """The end came first and was judged from the lifecycle, the latency unknown. The late
    result was dropped with its latency: the record kept weight 0 in every latency figure."""
    js = nats_client.jetstream()
    host = build(feedback_settings)
    await host.start()
    try:
        await js.publish("task.lifecycle.t-d7", encode(ended("d7", "failed", "fgd")))
        [blind] = await _wait_records(feedback_settings, 1)
        await js.publish("action.executed", encode(executed("d7", "assign", "fgd")))
        record = await _wait_measured(feedback_settings, "act-d7")
        await wait_for(_nothing_open(feedback_settings), what="the late result's marker cleared")
        reply = await nats_client.request("feedback.stats", encode(StatsQuery(by=["policy"])), timeout=5)
        await asyncio.sleep(0.3)  # room for another announcement to arrive
    finally:
        await host.stop()
    assert blind.latency_ms == Measured(value=0.0, uncertainty_score=1.0)
    # Only the latency changed: the outcome is the end's, the key the record was filed under.
    assert record == msgspec.structs.replace(blind, latency_ms=Measured(value=12.0, uncertainty_score=0.05))
    [group] = decode(reply.data, FeedbackStats).groups
    assert (group.count, group.measured, group.p95_latency_ms) == (1, 1, 12.0)
    assert [(f.action_id, f.latency_ms.uncertainty_score) for f in announced] == [("act-d7", 1.0)]
    # Counted when judged; its latency observed once the late result brought it.
    assert samples(host, "fleetpilot_feedback_records_total", "action", "policy", "outcome") == {
        ("unknown", "fgd", "failure"): 1}
    assert samples(host, "fleetpilot_feedback_action_latency_seconds_sum") == {(): pytest.approx(0.012)}


async def test_a_late_result_of_a_shared_gpu_success_gives_the_record_the_memory_it_left_free(
    feedback_settings, nats_client
):
    """The end says the task finished, but not what share of its GPU it held: judged from
    the end alone, the record saved nothing. The late result names the share (half an H100,
    20 GB of it), so the record and its key's sums gain what was left to other work."""
    js = nats_client.jetstream()
    host = build(feedback_settings)
    await host.start()
    share = Placement(node="n1", gpu=0, milli=500, memory_mb=20_000)
    try:
        await js.publish("task.lifecycle.t-d8", encode(ended("d8", "finished", "fgd")))
        [blind] = await _wait_records(feedback_settings, 1)
        result = msgspec.structs.replace(executed("d8", "assign", "fgd"), placement=[share])
        await js.publish("action.executed", encode(result))
        record = await _wait_measured(feedback_settings, "act-d8")
        await wait_for(_nothing_open(feedback_settings), what="the late result's marker cleared")
        reply = await nats_client.request("feedback.stats", encode(StatsQuery(by=["policy"])), timeout=5)
    finally:
        await host.stop()
    left_free = float(gpu_model("H100").memory_mb - share.memory_mb)
    assert (blind.outcome, blind.resource_saving_mb) == ("success", 0.0)
    assert record == msgspec.structs.replace(blind, latency_ms=Measured(value=12.0, uncertainty_score=0.05),
                                             resource_saving_mb=left_free)
    [group] = decode(reply.data, FeedbackStats).groups
    assert (group.count, group.mean_resource_saving_mb) == (1, pytest.approx(left_free))


async def test_a_late_result_delivered_again_gives_its_latency_once(feedback_settings, nats_client, monkeypatch):
    """The first handling of the late result stops after the store gave the record its
    latency (a timeout on the way back): delivered again, it adds nothing and clears the
    marker."""
    import fleetpilot_services.feedback.service as feedback_service

    stores, amended = [], []
    real_open_store = feedback_service.open_store

    async def store_failing_after_the_first_amendment(settings):
        store = await real_open_store(settings)
        real_amend = store.amend_late_result

        async def amend_late_result(action_id, latency, saving):
            amended.append(await real_amend(action_id, latency, saving))
            if len(amended) == 1:
                raise TimeoutError("the reply was lost after the commit")
            return amended[-1]

        store.amend_late_result = amend_late_result
        stores.append(store)
        return store

    monkeypatch.setattr(feedback_service, "open_store", store_failing_after_the_first_amendment)
    js = nats_client.jetstream()
    host = build(feedback_settings)
    await host.start()
    try:
        await js.publish("task.lifecycle.t-d7", encode(ended("d7", "evicted", "fgd")))
        await _wait_records(feedback_settings, 1)
        await js.publish("action.executed", encode(executed("d7", "assign", "fgd")))
        await wait_for(lambda: len(amended) >= 2, timeout_s=10, what="the result delivered again")
        await wait_for(_nothing_open(feedback_settings), what="the marker cleared")
        [group] = await stores[0].aggregates(("policy",))
    finally:
        await host.stop()
    assert [a is not None for a in amended] == [True, False]
    # Observed at most once (the handling whose reply was lost could not count it).
    assert sum(samples(host, "fleetpilot_feedback_action_latency_seconds_count").values()) <= 1
    assert (group.count, group.measured, group.weighted_mean_latency_ms) == (1, 1, 12.0)


async def test_a_result_that_finds_the_end_marked_but_not_yet_stored_comes_back_for_it(
    feedback_settings, nats_client, monkeypatch, announced
):
    """The lifecycle's handler marks the end judged, then writes its record: a result handled
    between the two found no record to give its latency to. Delivered again, it amends the
    record the end's handler stored and announced, and announces nothing itself."""
    import fleetpilot_services.feedback.service as feedback_service

    real_open_store = feedback_service.open_store
    release = asyncio.Event()

    async def store_holding_the_end_s_record(settings):
        store = await real_open_store(settings)
        real_record = store.record

        async def record(event):
            await release.wait()  # the end's record, held until the result was handled once
            return await real_record(event)

        store.record = record
        return store

    monkeypatch.setattr(feedback_service, "open_store", store_holding_the_end_s_record)
    js = nats_client.jetstream()
    host = build(feedback_settings)
    await host.start()
    try:
        await js.publish("task.lifecycle.t-d7", encode(ended("d7", "oom_killed", "fgd")))
        await _wait_open(feedback_settings, "d7")  # the JUDGED marker, the record held back
        await js.publish("action.executed", encode(executed("d7", "assign", "fgd")))
        await asyncio.sleep(0.3)
        release.set()
        record = await _wait_measured(feedback_settings, "act-d7", timeout_s=20)
        await wait_for(_nothing_open(feedback_settings), what="the marker cleared")
        await asyncio.sleep(0.3)  # room for another announcement to arrive
    finally:
        await host.stop()
    assert (record.outcome, record.latency_ms) == ("oom", Measured(value=12.0, uncertainty_score=0.05))
    assert [f.action_id for f in announced] == ["act-d7"]


def _nothing_open(settings: FeedbackSettings):
    async def nothing_open() -> bool:
        return await _open_placements(settings) == []

    return nothing_open


async def _wait_measured(settings: FeedbackSettings, action_id: str, timeout_s: float = 10) -> FeedbackRecorded:
    """The record of ``action_id`` once it has a measured latency."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        store = await open_store(settings)
        try:
            record = await store.get(action_id)
        finally:
            await store.close()
        if record is not None and record.latency_ms.uncertainty_score < 1.0:
            return record
        assert asyncio.get_running_loop().time() < deadline, f"{action_id}: {record}"
        await asyncio.sleep(0.1)


async def test_a_placement_judged_by_its_end_alone_is_filed_under_its_policy_s_version_and_action(
    feedback_settings, nats_client
):
    """The end came first: the record is built from the lifecycle. It carried the policy's
    name only, and the record was filed under version 1 (a real, older version of a learned
    policy) with no action (out of the assign's calibration)."""
    js = nats_client.jetstream()
    host = build(feedback_settings)
    await host.start()
    try:
        life = msgspec.structs.replace(ended("d8", "finished", "learned"), policy_version="7", decision_action="assign")
        await js.publish("task.lifecycle.t-d8", encode(life))
        [record] = await _wait_records(feedback_settings, 1)
        old = msgspec.structs.replace(ended("d9", "finished", "learned"), policy_version="")
        await js.publish("task.lifecycle.t-d9", encode(old))  # from an executor that does not say
        records = await _wait_records(feedback_settings, 2)
    finally:
        await host.stop()
    assert (record.policy, record.action, record.outcome) == (PolicyRef(name="learned", version="7"), "assign", "success")
    unknown = next(r for r in records if r.action_id == "act-d9")
    assert (unknown.policy, unknown.action) == (PolicyRef(name="learned", version="unknown"), "")


async def test_a_placement_is_judged_when_it_ends_and_a_migration_ends_the_one_it_left(
    feedback_settings, nats_client
):
    js = nats_client.jetstream()
    host = build(feedback_settings)
    await host.start()
    try:
        # t-a: placed by a1, moved by m1 (alive: a1 met its goal), then OOM-killed under m1.
        await js.publish("action.executed", encode(executed("a1", "assign", "fleetpilot")))
        await js.publish("task.lifecycle.t-a1", encode(ended("a1", "started", "fleetpilot")))
        await js.publish("action.executed", encode(executed("m1", "migrate", "fleetpilot")))
        await js.publish("task.lifecycle.t-a1", encode(ended("m1", "migrated", "fleetpilot", task_id="t-a1",
                                                             replaces="a1")))
        await _wait_open(feedback_settings, "m1")  # the move's result is in before its end
        await js.publish("task.lifecycle.t-a1", encode(ended("m1", "oom_killed", "fleetpilot", task_id="t-a1",
                                                             detail="a neighbour grew")))
        # t-e: placed by e1, then evicted (preempted): the placement did not run its course.
        await js.publish("action.executed", encode(executed("e1", "assign", "fleetpilot")))
        await _wait_open(feedback_settings, "e1")
        await js.publish("task.lifecycle.t-e1", encode(ended("e1", "evicted", "fleetpilot")))
        # t-x: the move away from x1 is seen before x1's own result: x1 is judged when it comes.
        await js.publish("task.lifecycle.t-x1", encode(ended("x2", "migrated", "fleetpilot", task_id="t-x1",
                                                             replaces="x1")))
        await _wait_open(feedback_settings, "x1")
        await js.publish("action.executed", encode(executed("x1", "assign", "fleetpilot")))
        records = await _wait_records(feedback_settings, 4)
        # Nothing of the three waits any more: every placement was judged.
        placements = await _open_placements(feedback_settings)
    finally:
        await host.stop()
    judged = {r.action_id: (r.outcome, r.unexpected_side_effect, r.latency_ms.uncertainty_score) for r in records}
    assert judged == {
        "act-a1": ("success", [], 0.05),
        "act-m1": ("oom", ["oom_neighbour"], 0.05),
        "act-e1": ("partial", [], 0.05),
        "act-x1": ("success", [], 0.05),
    }
    assert placements == []


async def test_a_record_whose_announcement_failed_is_announced_on_redelivery(feedback_settings, nats_client,
                                                                               announced):
    js = nats_client.jetstream()
    host = build(feedback_settings)
    await host.start()
    publish = host.bus.publish
    failed_once: set[str] = set()

    async def publish_failing_once(event, **kwargs) -> None:
        # The bus fails the first announcement of each record after the store committed it
        # (a JetStream publish timeout): the message is redelivered.
        if isinstance(event, FeedbackRecorded) and event.action_id not in failed_once:
            failed_once.add(event.action_id)
            raise TimeoutError("nats: timeout")
        await publish(event, **kwargs)

    host.bus.publish = publish_failing_once
    try:
        await js.publish("action.failed", encode(failed("f1", "fgd")))
        await js.publish("action.executed", encode(executed("f2", "assign", "fgd")))
        await _wait_open(feedback_settings, "f2")
        await js.publish("task.lifecycle.t-f2", encode(ended("f2", "finished", "fgd")))
        await wait_for(lambda: len(announced) >= 2, what="both records announced")
        placements = await _open_placements(feedback_settings)
    finally:
        await host.stop()
    judged = sorted((f.action_id, f.outcome, f.latency_ms.uncertainty_score, f.action) for f in announced)
    # The records as stored: f2 judged with its result, not rebuilt from the redelivered end.
    assert judged == [("act-f1", "failure", 0.05, "assign"), ("act-f2", "success", 0.05, "assign")]
    assert placements == []  # the redelivered end leaves no marker behind


async def _wait_open(settings: FeedbackSettings, decision_id: str) -> None:
    async def is_open() -> bool:
        return decision_id in await _open_placements(settings)

    await wait_for(is_open, what=f"{decision_id} in open_placements")


async def _open_placements(settings: FeedbackSettings) -> list[str]:
    bus = await NatsBus.connect(settings.nats_url, "test-open-placements")
    try:
        return [k for k in await (await bus.kv("open_placements")).keys()]
    finally:
        await bus.drain()


async def _wait_records(settings: FeedbackSettings, count: int) -> list[FeedbackRecorded]:
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        store = await open_store(settings)
        try:
            records = [r async for r in store.raw()]
        finally:
            await store.close()
        if len(records) >= count:
            return records
        assert asyncio.get_running_loop().time() < deadline, f"only {len(records)} records stored"
        await asyncio.sleep(0.1)


async def test_a_start_up_run_again_after_an_outage_opens_one_store(feedback_settings, nats_client, monkeypatch):
    """The start-up hook opens the store, then the bucket; when the server goes away between
    the two, the host runs the hook again once it is back. Before, that opened a second store
    and left the first open (a PostgreSQL pool nobody closes)."""
    import fleetpilot_services.feedback.service as feedback_service

    opened = []
    real_open_store, real_kv = feedback_service.open_store, NatsBus.kv
    failed = {"n": 0}

    async def counted_open_store(settings):
        opened.append(await real_open_store(settings))
        return opened[-1]

    async def kv_with_one_outage(self, bucket):
        if bucket == "open_placements" and not failed["n"]:
            failed["n"] += 1
            raise TimeoutError("nats: timeout")  # the server went away under the call
        return await real_kv(self, bucket)

    monkeypatch.setattr(feedback_service, "open_store", counted_open_store)
    monkeypatch.setattr(NatsBus, "kv", kv_with_one_outage)
    host = build(feedback_settings)
    await host.start()
    try:
        assert failed["n"] == 1
        assert len(opened) == 1
    finally:
        await host.stop()


@pytest.mark.parametrize("by", [["nonsense"], ["policy", "policy"]])
async def test_a_stats_query_with_a_bad_grouping_gets_an_error_that_names_it(feedback_settings, nats_client, by):
    # The store's ValueError escaped the handler: nats.micro answered an empty body with a
    # 500 header, so a client decoding the reply got a decode error that said nothing.
    host = build(feedback_settings)
    await host.start()
    try:
        reply = await nats_client.request("feedback.stats", encode(StatsQuery(by=by)), timeout=5)
        good = await nats_client.request("feedback.stats", encode(StatsQuery(by=["policy"])), timeout=5)
    finally:
        await host.stop()
    error = msgspec.json.decode(reply.data)["error"]
    assert "group by a subset of" in error and repr(tuple(by)) in error
    assert decode(good.data, FeedbackStats).groups == []  # the endpoint still serves


async def test_a_record_no_store_can_keep_is_dead_lettered_at_once_with_its_reason(feedback_settings, nats_client,
                                                                                  announced):
    # A NUL in a key: PostgreSQL failed the write on every delivery until max_deliver, and
    # SQLite stored what PostgreSQL could not; now the store refuses it and the service
    # dead-letters it on its first delivery, saying why.
    letters: list[DeadLetter] = []

    async def on_letter(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await nats_client.subscribe("dlq.>", cb=on_letter)
    js = nats_client.jetstream()
    host = build(feedback_settings)
    await host.start()
    try:
        bad = msgspec.structs.replace(failed("d-nul", "fgd"), task_kind="tr\x00in")
        await js.publish("action.failed", encode(bad))
        await js.publish("action.failed", encode(failed("d-ok", "fgd")))
        await wait_for(lambda: letters and announced, timeout_s=10, what="a dead letter and a record")
    finally:
        await host.stop()
    [letter] = letters
    assert (letter.subject, letter.reason, letter.deliveries) == ("action.failed", "rejected", 1)
    assert "NUL character in task_kind" in letter.error
    assert decode(letter.data, ActionFailed) == bad  # the original bytes are kept
    assert [f.action_id for f in announced] == ["act-d-ok"]


async def test_a_huge_bad_grouping_still_gets_an_error_reply(feedback_settings, nats_client):
    # The error echoed the whole grouping: for a request near the 1 MB payload limit the
    # reply went over it, could not be sent, and the client got an empty 500 again.
    host = build(feedback_settings)
    await host.start()
    try:
        reply = await nats_client.request("feedback.stats", encode(StatsQuery(by=["xx"] * 190_000)), timeout=5)
    finally:
        await host.stop()
    error = msgspec.json.decode(reply.data)["error"]
    assert error.startswith("group by a subset of") and len(error) < 1000


def synthetic_event(action_id: str) -> FeedbackRecorded:
    """A plausible record for ``action_id``, the same on every run."""
    return feedback_event(action_id, random.Random(action_id))


async def test_statistics_too_large_for_one_message_get_an_error_reply_not_silence(feedback_settings, nats_client):
    # 4,000 groups by every key field make a reply of some 1.3 MB, over the 1 MB a NATS
    # message can carry: nats.micro could not send it and the client got an empty 500
    # ("feedback.stats failed") that said nothing of why or what to ask instead.
    store = await open_store(feedback_settings)
    try:
        for i in range(4_000):
            record = msgspec.structs.replace(
                synthetic_event(f"big-{i:05d}"),
                policy=PolicyRef(name="learned", version=str(i // 100)),
                task_kind=f"kind-{i // 10 % 10}", gpu_model=f"gpu-{i % 10}", shard_id="primary", action="assign")
            assert await store.record(record)
    finally:
        await store.close()
    host = build(feedback_settings)
    await host.start()
    try:
        everything = ["policy", "shard_id", "task_kind", "gpu_model", "action"]
        too_big = await nats_client.request("feedback.stats", encode(StatsQuery(by=everything)), timeout=30)
        fits = await nats_client.request("feedback.stats", encode(StatsQuery(by=["policy"])), timeout=30)
    finally:
        await host.stop()
    assert "Nats-Service-Error" not in (too_big.headers or {})
    error = msgspec.json.decode(too_big.data)["error"]
    assert "4000 groups" in error and "group by fewer fields" in error
    assert len(decode(fits.data, FeedbackStats).groups) == 40  # the endpoint still serves


@pytest.mark.parametrize("dsn", ["postgresql+asyncpg://postgres@127.0.0.1:5432/test", "sqlite://feedback.db"])
async def test_a_store_dsn_of_another_scheme_is_refused_not_taken_for_a_sqlite_path(tmp_path, monkeypatch, dsn):
    # FLEETPILOT_FEEDBACK_STORE_DSN=postgresql+asyncpg://... (SQLAlchemy's spelling) started
    # the service on a SQLite file named after the DSN, in the working directory: every
    # record went to the container's disk while the operator believed them in PostgreSQL.
    from fleetpilot.runtime.config import BadSettings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLEETPILOT_FEEDBACK_STORE_DSN", dsn)
    with pytest.raises(BadSettings) as refused:  # one line naming the variable, before any connection
        FeedbackSettings.from_environment()
    assert "FLEETPILOT_FEEDBACK_STORE_DSN" in str(refused.value) and "scheme" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert list(tmp_path.iterdir()) == []

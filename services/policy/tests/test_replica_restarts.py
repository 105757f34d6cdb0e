"""What a policy replica leaves behind when it restarts, over a real nats-server: replicas
that restart often (a crash loop, a rolling update, `fleetpilot up` started again) must not
pile up consumers or files, and one that comes back under the same id (a StatefulSet pod,
a container restarted in its pod: same hostname, pid 1) must still decide by every recent
fingerprint, though what it had read was lost with the process."""

from __future__ import annotations

import asyncio
import json

import msgspec
from fleetpilot.contracts import Fingerprint
from fleetpilot.contracts import catalog as catalog_module
from fleetpilot.policy import Snapshot
from fleetpilot_services.policy.service import build

from .conftest import admitted, fingerprinted, fingerprints_taken, node, settings, wait_for

PEAK_MB = 60_000


def flat(peak_mb: float) -> Fingerprint:
    """A flat run that peaks at ``peak_mb``."""
    return Fingerprint(signature="sig-grow", pattern="flat", pattern_confidence=0.9, growth_rate_mb_per_s=0.0,
                       predicted_peak_mb=peak_mb, peak_low_mb=peak_mb - 500, peak_high_mb=peak_mb + 500, samples=50)


async def fingerprint_consumers(observer) -> dict[str, float | None]:
    """The policy replicas' own consumers on ``TASKS``, with the idle time after which the
    server removes each (seconds; ``None``: never)."""
    out = {}
    for info in await observer.js.consumers_info("TASKS"):
        if info.name.startswith("policy-fingerprints"):
            out[info.name] = info.config.inactive_threshold
    return out


async def test_replicas_that_restart_leave_no_consumer_and_no_file_of_their_own_behind(observer, nats_url, tmp_path):
    """Three runs, one after the other, each under a new id as the default one (host and pid)
    is, each recording its decision inputs into the same state directory. Before, each run
    left its consumer on ``TASKS`` for a week and its own ``policy-states-<replica>.jsonl``
    for ever: a replica in a crash loop added one of each per restart."""
    await observer.put_fleet([node("n1", gpus=2)])
    state_dir = tmp_path / "state"
    for run, replica in enumerate(("host-101", "host-102", "host-103")):
        host = build(settings(nats_url, state_dir, replica=replica, profile="bestfit", record_every=1))
        await host.start()
        try:
            assert list(await fingerprint_consumers(observer)) == [f"policy-fingerprints-{replica}"]
            await observer.admit(admitted(f"t{run}", gpu_milli=100))
            await wait_for(lambda run=run: len(observer.decisions) == run + 1, what=f"t{run}'s decision")
        finally:
            await host.stop()
    assert await fingerprint_consumers(observer) == {}
    # One replay record, every run's inputs in it, in order.
    assert sorted(p.name for p in state_dir.iterdir()) == ["policy-states.jsonl"]
    lines = (state_dir / "policy-states.jsonl").read_bytes().splitlines()
    assert [msgspec.json.decode(line, type=Snapshot).task.task_id for line in lines] == ["t0", "t1", "t2"]


async def test_a_replica_that_crashed_leaves_its_consumer_for_minutes_not_a_week(
    observer, nats_url, tmp_path, monkeypatch
):
    """Two replicas run; one stops cleanly, the other dies without a word. The first's
    consumer goes at once; the dead one's is removed by the server once idle for
    ``RUN_IDLE_LIMIT_S`` (shortened here to 1 s), not after ``INSTANCE_IDLE_LIMIT_S`` (a
    week), which the executor's nodes keep."""
    run_limit = getattr(catalog_module, "RUN_IDLE_LIMIT_S", None)
    limits = {}
    a = build(settings(nats_url, tmp_path / "a", replica="a", profile="bestfit"))
    monkeypatch.setattr(catalog_module, "RUN_IDLE_LIMIT_S", 1.0, raising=False)
    b = build(settings(nats_url, tmp_path / "b", replica="b", profile="bestfit"))
    await a.start()
    await b.start()
    try:
        limits = await fingerprint_consumers(observer)
        assert sorted(limits) == ["policy-fingerprints-a", "policy-fingerprints-b"]
        await a.stop()
        a = None
        assert list(await fingerprint_consumers(observer)) == ["policy-fingerprints-b"]
        await b.bus._nc.close()  # type: ignore[union-attr] - the way a killed process goes
        for _ in range(150):
            if not await fingerprint_consumers(observer):
                break
            await asyncio.sleep(0.1)
        assert await fingerprint_consumers(observer) == {}
    finally:
        for host in (a, b):
            if host is not None:
                await host.stop()
    # Each made with the short idle limit in force when its replica was built: minutes.
    assert run_limit is not None and limits["policy-fingerprints-a"] == run_limit <= 10 * 60
    assert limits["policy-fingerprints-b"] == 1.0


async def test_a_replica_back_under_the_same_id_decides_by_the_fingerprints_read_before_it_stopped(
    observer, nats_url, tmp_path
):
    """Replica ``policy-0`` reads ``grow``'s fingerprint (a 60 GB peak, asking 20 GB) and
    restarts under the same id, as a StatefulSet pod or a container restarted in its pod
    (same hostname, pid 1) does. Before, its consumer went on from where it was, past the
    fingerprint, while the process had lost what it read: the task was held for its ask,
    20 GB, on the 40 GB GPU, to be OOM-killed at its peak. Its consumer now starts afresh
    at each start, two days back."""
    await observer.put_fleet([node("big", gpus=1), node("small", gpus=1, model="A100-40GB", memory_mb=40_960)])
    host = build(settings(nats_url, tmp_path, replica="policy-0", profile="bestfit"))
    await host.start()
    try:
        await fingerprinted(observer, {"grow": flat(PEAK_MB)}, replica="policy-0")
    finally:
        await host.stop()
    last = (await observer.js.stream_info("TASKS")).state.last_seq
    host = build(settings(nats_url, tmp_path, replica="policy-0", profile="bestfit"))
    await host.start()
    try:
        await fingerprints_taken(observer, last, replica="policy-0")
        await observer.admit(admitted("grow", gpu_milli=1000, gpu_memory_mb=20_000))
        await wait_for(lambda: observer.decisions, what="grow's decision")
    finally:
        await host.stop()
    decision = observer.decisions[0]
    assert decision.action == "assign", decision.reason
    assert [(p.node, p.memory_mb >= PEAK_MB) for p in decision.placement] == [("big", True)], decision.reason


async def test_two_replicas_append_to_one_record_without_mixing_lines(observer, nats_url, tmp_path):
    """Two replicas on one state directory record every decision input into the one file:
    each line whole (appended under a lock), none lost."""
    await observer.put_fleet([node(f"n{i}", gpus=8) for i in range(4)])
    hosts = [build(settings(nats_url, tmp_path, replica=r, profile="bestfit", record_every=1)) for r in "ab"]
    for host in hosts:
        await host.start()
    try:
        await asyncio.gather(*(observer.admit(admitted(f"t{i}", gpu_milli=100)) for i in range(40)))
        await wait_for(lambda: len(observer.decisions) == 40, what="40 decisions")
    finally:
        for host in hosts:
            await host.stop()
    lines = (tmp_path / "policy-states.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["task"]["task_id"] for line in lines) == sorted(f"t{i}" for i in range(40))


async def test_a_task_admitted_while_a_started_replica_reads_back_the_fingerprints_waits_for_its_own(
    observer, nats_url, tmp_path
):
    """A replica that starts reads the last two days of fingerprints again, thousands on a
    busy fleet; an admission handled meanwhile was placed before the task's own fingerprint,
    at the end of that backlog, was read: held for its 20 GB ask on the 40 GB GPU, to be
    OOM-killed at its 60 GB peak. It is queued until the replica has read them, then placed."""
    from fleetpilot.contracts import TaskFingerprinted, encode, now

    await observer.put_fleet([node("big", gpus=1), node("small", gpus=1, model="A100-40GB", memory_mb=40_960)])
    others = msgspec.structs.replace(flat(10_000), signature="sig-other")
    for i in range(6000):
        await observer.js.publish("task.fingerprinted", encode(TaskFingerprinted(
            task_id=f"old-{i}", fingerprint=others, source="signature", at=now())))
    await observer.js.publish("task.fingerprinted", encode(TaskFingerprinted(
        task_id="grow", fingerprint=flat(PEAK_MB), source="signature", at=now())))
    host = build(settings(nats_url, tmp_path, replica="policy-0", profile="bestfit", pending_retry_s=0.2))
    await host.start()
    try:
        await observer.admit(admitted("grow", gpu_milli=1000, gpu_memory_mb=20_000))
        await wait_for(lambda: any(d.action == "assign" for d in observer.decisions), timeout_s=30,
                       what="grow placed")
    finally:
        await host.stop()
    placed = next(d for d in observer.decisions if d.action == "assign")
    assert [(p.node, p.memory_mb >= PEAK_MB) for p in placed.placement] == [("big", True)], placed.reason

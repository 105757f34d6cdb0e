"""The fingerprinter over a real nats-server: observed fingerprints from task telemetry,
the signature remembered when a task ends, and predicted at once for the next submission."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math

import msgspec
import numpy as np
import pytest
from fleetpilot.contracts import (
    BUCKETS,
    DeadLetter,
    TaskFingerprinted,
    TaskLifecycle,
    TaskRejected,
    TaskSubmitted,
    TaskTelemetry,
    decode,
    encode,
    now,
    subject_for,
)
from fleetpilot.fingerprint.online import OnlineFingerprinter
from fleetpilot.fingerprint.signature import SignatureStats, borrowed, predict, task_signature
from fleetpilot.runtime import BadSettings, Partition, partition_of
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually as wait_for
from fleetpilot.workload import MemoryGrowth
from fleetpilot_services.fingerprinter.service import FingerprinterSettings, build


def task(task_id: str) -> TaskSubmitted:
    return TaskSubmitted(task_id=task_id, kind="finetune", image="clip:1", command=["python", "train.py"],
                         labels={"model": "clip-vit-l"}, gpu_memory_mb=40_000, expected_duration_s=1_000,
                         submitted_at=now())


@contextlib.asynccontextmanager
async def replicas(nats_url: str, *partitions: Partition, **settings):
    """A fingerprinter replica per partition, running (``settings`` beyond the defaults); a
    bus to talk to them, and every ``task.fingerprinted`` seen."""
    hosts = [build(FingerprinterSettings(nats_url=nats_url, metrics_port=-1, end_grace_s=0.5,
                                         partitions=p.count, partition=p.index, **settings)) for p in partitions]
    for host in hosts:
        await host.start()
    bus = await NatsBus.connect(nats_url, "test")
    seen: list[TaskFingerprinted] = []

    async def on_fp(msg) -> None:
        seen.append(decode(msg.data, TaskFingerprinted))

    await bus.subscribe("task.fingerprinted", on_fp)
    try:
        yield bus, seen
    finally:
        await bus.drain()
        for host in hosts:
            await host.stop()


@pytest.fixture
async def fingerprinter(nats_server):
    """One fingerprinter, the whole (``replicas``)."""
    async with replicas(nats_server.url, Partition()) as running:
        yield running


async def remembered(bus: NatsBus, signature: str) -> SignatureStats:
    """The signature's stats once the service has written them."""
    kv = await bus.kv("fingerprints")

    async def stats() -> SignatureStats | None:
        entry = await kv.get(signature)
        return msgspec.json.decode(entry.value, type=SignatureStats) if entry is not None else None

    return await wait_for(stats, what=f"signature {signature} remembered")


async def samples_taken(bus: NatsBus, seen: list[TaskFingerprinted], marker: str) -> None:
    """Return once the service has taken every sample published so far: the samples of all
    tasks reach it in order on one core subscription, so once a level series published after
    them, under the fresh task id ``marker``, has been fingerprinted (a steady climb: read
    with confidence), they have all been fed.
    A terminal ``task.lifecycle`` (JetStream, its own consumer) can overtake samples still
    queued; the service waits ``end_grace_s`` for them, and this makes the test independent
    of that wait."""
    start = now()
    for t in np.arange(0, 400, 10.0):
        await bus.publish(TaskTelemetry(task_id=marker, node="n1", gpus=[0], at=start + float(t),
                                        memory_used_mb=4_000.0 + 20.0 * float(t)))
    await wait_for(lambda: [f for f in seen if f.task_id == marker], what=f"{marker} fingerprinted")


async def run_for(bus: NatsBus, submitted: TaskSubmitted, seconds: float, used_mb, gpus: list[int] | None = None):
    """Submit a task, then publish a sample of ``used_mb(t)`` (summed over ``gpus``) every
    10 s of its first ``seconds``, and give the service the time to take them."""
    await bus.publish(submitted)
    await asyncio.sleep(0.5)  # the task is placed before its processes report memory
    start = now()
    for t in np.arange(0, seconds, 10.0):
        await bus.publish(TaskTelemetry(task_id=submitted.task_id, node="n1", gpus=gpus or [0], at=start + float(t),
                                        memory_used_mb=float(used_mb(float(t)))))
    await asyncio.sleep(0.5)


async def test_observed_then_remembered_then_predicted(fingerprinter):
    bus, seen = fingerprinter
    first = task("clip-1")
    await bus.publish(first)
    await asyncio.sleep(0.5)  # the task is placed before its processes report memory
    # A stepwise-growing fine-tune, sampled every 10 s for its whole life.
    growth = MemoryGrowth(pattern="steps", base_mb=8_000, peak_mb=32_000, duration_s=1_000, n_steps=4)
    start = now()
    for t in np.arange(0, 1_000, 10.0):
        used = float(growth.memory_at(t))
        await bus.publish(TaskTelemetry(task_id="clip-1", node="n1", gpus=[0], at=start + float(t),
                                        memory_used_mb=used, utilization_gpu_pct=80.0))
    # Early predictions are rough; the refined ones must converge on the true peak.
    def close_to_truth():
        return [f.fingerprint for f in seen if f.task_id == "clip-1" and f.source == "observed"
                and f.fingerprint.pattern == "steps" and abs(f.fingerprint.predicted_peak_mb - 32_000) < 3_200]

    latest = (await wait_for(close_to_truth))[-1]
    assert latest.peak_low_mb <= 32_000 <= latest.peak_high_mb

    await samples_taken(bus, seen, "sync-clip-1")
    await bus.publish(TaskLifecycle(task_id="clip-1", state="finished", at=now()))
    stats = await remembered(bus, task_signature(first))
    assert stats.count == 1
    # Its envelope: the first level for its first quarter, each step by its time, the peak last.
    envelope = stats.envelope_mb
    assert len(envelope) == 20 and list(envelope) == sorted(envelope)
    assert abs(envelope[3] - 14_000) < 500 and abs(envelope[-1] - 32_000) < 500
    assert abs(envelope[9] - 26_000) < 500  # by half its life: the third level, which it took at 500 s

    await bus.publish(task("clip-2"))  # same kind, image, command and model
    predicted = await wait_for(lambda: [f for f in seen if f.task_id == "clip-2"])
    assert predicted[0].source == "signature"
    assert predicted[0].fingerprint.pattern == "steps"
    assert predicted[0].fingerprint.envelope_mb == envelope
    assert abs(predicted[0].fingerprint.predicted_peak_mb - latest.predicted_peak_mb) < 0.15 * 32_000


async def test_an_oom_killed_run_teaches_a_floor_not_its_truncated_peak_and_its_restart_is_told_it(fingerprinter):
    bus, seen = fingerprinter
    first = task("leak-1")
    # A leak killed at 38 GB, a third of the way through its declared life.
    await run_for(bus, first, 340, lambda t: 8_000 + 30_000 * (t / 330.0) ** 2)
    await samples_taken(bus, seen, "sync-leak-1")
    await bus.publish(TaskLifecycle(task_id="leak-1", state="oom_killed", at=now()))
    stats = await remembered(bus, task_signature(first))
    assert stats.count == 0 and stats.oom_floor_mb == 38_000  # not a fingerprint: a floor
    assert stats.run_peaks_mb == (38_000,)  # one run known, that needed more than it held
    # The policy starts leak-1 over: it is told its signature's floor, as a waiting task is.
    told = (await wait_for(lambda: [f for f in seen if f.task_id == "leak-1" and f.source == "signature"]))[0]
    assert told.fingerprint.predicted_peak_mb >= 38_000
    await bus.publish(task("leak-2"))
    predicted = (await wait_for(lambda: [f for f in seen if f.task_id == "leak-2"]))[0]
    assert predicted.source == "signature" and predicted.fingerprint.predicted_peak_mb >= 38_000
    assert predicted.fingerprint.pattern_confidence == 0.0  # the pattern is not known


async def test_a_multi_gpu_task_is_fingerprinted_per_gpu(fingerprinter):
    bus, seen = fingerprinter
    first = task("wide-1")
    # Two GPUs holding 16 GB each for the task's whole life: the samples sum them (32 GB), as
    # NVML's per-process figures summed over the task's GPUs do.
    await run_for(bus, first, 1_000, lambda t: 2 * (16_000.0 + 50.0 * math.sin(t)), gpus=[0, 1])
    await samples_taken(bus, seen, "sync-wide-1")
    await bus.publish(TaskLifecycle(task_id="wide-1", state="finished", at=now()))
    await remembered(bus, task_signature(first))
    await bus.publish(task("wide-2"))
    predicted = (await wait_for(lambda: [f for f in seen if f.task_id == "wide-2"]))[0]
    assert predicted.fingerprint.pattern == "flat"
    assert abs(predicted.fingerprint.predicted_peak_mb - 16_000) < 1_600  # per GPU, not the 32 GB sum


async def test_a_migrated_task_s_series_starts_again(fingerprinter):
    bus, seen = fingerprinter
    first = task("moved-1")
    await run_for(bus, first, 400, lambda t: 8_000 + 30.0 * t)
    before = [f.fingerprint for f in seen if f.task_id == "moved-1"]
    assert before and before[-1].samples >= 30
    published = len(seen)
    await bus.publish(TaskLifecycle(task_id="moved-1", state="migrated", at=now()))
    await asyncio.sleep(0.3)
    # Restored on its new GPU, it grows from its start again.
    start = now() + 400
    for t in np.arange(0, 100, 10.0):
        await bus.publish(TaskTelemetry(task_id="moved-1", node="n2", gpus=[0], at=start + float(t),
                                        memory_used_mb=8_000 + 30.0 * float(t)))
    after = await wait_for(lambda: [f.fingerprint for f in seen[published:] if f.task_id == "moved-1"])
    assert after[-1].samples <= 10  # the ten samples since the move, not the forty before it too


async def test_an_evicted_task_teaches_nothing_until_its_run_again_ends(fingerprinter):
    bus, seen = fingerprinter
    first = task("evicted-1")
    # 10 GB for the first 300 s of its 1,000 s: a level that may still step up.
    await run_for(bus, first, 300, lambda t: 10_000.0 + 20.0 * math.sin(t))
    await bus.publish(TaskLifecycle(task_id="evicted-1", state="evicted", at=now()))
    await asyncio.sleep(0.3)
    # Placed again, it runs its whole life at 10 GB and finishes.
    start = now() + 300
    for t in np.arange(0, 1_000, 10.0):
        await bus.publish(TaskTelemetry(task_id="evicted-1", node="n2", gpus=[0], at=start + float(t),
                                        memory_used_mb=10_000.0 + 20.0 * math.sin(float(t))))
    await asyncio.sleep(0.5)
    await samples_taken(bus, seen, "sync-evicted-1")
    await bus.publish(TaskLifecycle(task_id="evicted-1", state="finished", at=now()))
    stats = await remembered(bus, task_signature(first))
    # One run, the whole one: not the partial run's guess (a first level read as a step
    # schedule's, about twice as high), and not two runs.
    assert stats.count == 1 and abs(stats.mean_peak_mb - 10_000) < 1_000, stats
    assert stats.envelope_mb == ()  # its times ran from the restore, not from its start


async def test_statistics_in_the_units_of_before_per_gpu_memory_are_replaced_not_used(fingerprinter):
    bus, seen = fingerprinter
    first = task("old-1")
    signature = task_signature(first)
    # What the fingerprinter wrote for a 4-GPU signature before memory was per GPU: the sum
    # of four 16 GB GPUs, and no "memory" field.
    legacy = msgspec.to_builtins(SignatureStats(signature=signature, count=5, votes={"flat": 4.5},
                                                mean_peak_mb=64_000, min_peak_mb=63_000, max_peak_mb=65_000))
    del legacy["memory"]
    kv = await bus.kv("fingerprints")
    await kv.put(signature, msgspec.json.encode(legacy))
    await run_for(bus, first, 1_000, lambda t: 4 * (16_000.0 + 50.0 * math.sin(t)), gpus=[0, 1, 2, 3])
    assert not [f for f in seen if f.task_id == "old-1" and f.source == "signature"]  # nothing from old units
    await samples_taken(bus, seen, "sync-old-1")
    await bus.publish(TaskLifecycle(task_id="old-1", state="finished", at=now()))

    async def replaced() -> SignatureStats | None:
        stats = await remembered(bus, signature)
        return stats if stats.count == 1 else None  # started afresh: the five old runs are gone

    stats = await wait_for(replaced, what="statistics started afresh")
    assert abs(stats.mean_peak_mb - 16_000) < 1_600
    await bus.publish(task("old-2"))
    predicted = (await wait_for(lambda: [f for f in seen if f.task_id == "old-2"]))[0]
    assert predicted.source == "signature" and abs(predicted.fingerprint.predicted_peak_mb - 16_000) < 1_600


async def test_a_short_flat_run_is_remembered_at_its_level_and_no_guess_goes_out(fingerprinter):
    bus, seen = fingerprinter
    # An inference task declared at 90 s that loaded before its first sample: eight samples
    # at 9.3 GB. Mid-life that reads as a step schedule's first level (twice as high).
    first = msgspec.structs.replace(task("serve-1"), kind="infer", expected_duration_s=90.0)
    await run_for(bus, first, 80, lambda t: 9_300.0 + 30.0 * math.sin(t))
    await samples_taken(bus, seen, "sync-serve-1")
    await bus.publish(TaskLifecycle(task_id="serve-1", state="finished", at=now()))
    stats = await remembered(bus, task_signature(first))
    assert abs(stats.mean_peak_mb - 9_300) < 500, stats  # its level, not the ~18.5 GB guess
    assert not [f for f in seen if f.task_id == "serve-1"]  # the untrusted guess never went out
    await bus.publish(msgspec.structs.replace(first, task_id="serve-2"))
    predicted = (await wait_for(lambda: [f for f in seen if f.task_id == "serve-2"]))[0]
    assert predicted.source == "signature" and abs(predicted.fingerprint.predicted_peak_mb - 9_300) < 500


async def test_a_run_that_ends_before_its_declared_end_is_remembered_at_what_it_reached(fingerprinter):
    bus, seen = fingerprinter
    # Declared an hour; it grew 30 MB/s for 300 s and ended now (samples and the lifecycle on
    # one clock, as on a real node). Carried to the declared hour, its line would reach 116 GB.
    first = msgspec.structs.replace(task("early-1"), expected_duration_s=3_600.0)
    await bus.publish(first)
    await asyncio.sleep(0.5)
    start = now() - 305.0
    for t in np.arange(0, 300, 10.0):
        await bus.publish(TaskTelemetry(task_id="early-1", node="n1", gpus=[0], at=start + float(t),
                                        memory_used_mb=8_000.0 + 30.0 * float(t) + 20.0 * math.sin(t)))
    await asyncio.sleep(0.5)
    await samples_taken(bus, seen, "sync-early-1")
    await bus.publish(TaskLifecycle(task_id="early-1", state="finished", at=now()))
    stats = await remembered(bus, task_signature(first))
    assert abs(stats.mean_peak_mb - (8_000 + 30.0 * 305)) < 500, stats


async def stop_and_restore(bus: NatsBus, task_id: str, state: str, before, after) -> None:
    """A task's samples every 10 s, ``before(t)`` for 300 s; then it is stopped (``state``:
    ``evicted`` or ``migrated``) and runs again, sampled at ``after(t)`` for 100 s."""
    start = now()
    for t in np.arange(0, 300, 10.0):
        await bus.publish(TaskTelemetry(task_id=task_id, node="n1", gpus=[0], at=start + float(t),
                                        memory_used_mb=float(before(float(t)))))
    await asyncio.sleep(0.3)
    await bus.publish(TaskLifecycle(task_id=task_id, state=state, at=start + 300))
    await asyncio.sleep(0.3)
    for t in np.arange(400, 500, 10.0):
        await bus.publish(TaskTelemetry(task_id=task_id, node="n2", gpus=[0], at=start + float(t),
                                        memory_used_mb=float(after(float(t)))))


async def restores_seen(bus: NatsBus, signature: str, count: int) -> SignatureStats:
    """The signature's stats once ``count`` restores of it are counted."""

    async def counted() -> SignatureStats | None:
        stats = await remembered(bus, signature)
        return stats if stats.restores_kept + stats.restores_reset >= count else None

    return await wait_for(counted, what=f"{count} restore(s) of {signature} counted")


async def test_a_leak_restored_low_after_its_checkpoint_teaches_that_its_signature_starts_over(fingerprinter):
    bus, _ = fingerprinter
    first = task("leak-1")
    await bus.publish(first)
    await asyncio.sleep(0.3)
    # 8 GB growing to 38 GB, checkpointed, and restored as a new process at 9 GB.
    await stop_and_restore(bus, "leak-1", "evicted", lambda t: 8_000 + 100.0 * t, lambda t: 9_000 + 100.0 * (t - 400))
    stats = await restores_seen(bus, task_signature(first), 1)
    assert (stats.restores_kept, stats.restores_reset, stats.count) == (0, 1, 0)


async def test_a_long_runs_step_fit_is_held_to_what_its_programs_runs_reached(fingerprinter):
    """Three runs of the program ended at 21-22 GB. A run declared ten times as long steps
    8 -> 14 -> 20 GB in its first 300 s: its fit carries those steps through its life, and it
    was published far above what any run of its program held (and stopped for that OOM)."""
    bus, seen = fingerprinter
    long = msgspec.structs.replace(task("long-1"), expected_duration_s=10_000)
    signature = task_signature(long)
    known = SignatureStats(signature=signature, count=3, votes={"steps": 3.0}, mean_peak_mb=21_500,
                           min_peak_mb=21_000, max_peak_mb=22_000, run_peaks_mb=(21_000.0, 21_500.0, 22_000.0))
    kv = await bus.kv("fingerprints")
    await kv.put(signature, msgspec.json.encode(known))
    await run_for(bus, long, 300, lambda t: [8_000, 14_000, 20_000][min(int(t // 100), 2)])
    steps = await wait_for(lambda: [f.fingerprint for f in seen if f.task_id == "long-1" and f.source == "observed"
                                    and f.fingerprint.pattern == "steps"], what="a step fit of the long run")
    assert max(f.predicted_peak_mb for f in steps) == pytest.approx(22_000 * 1.05)
    assert all(f.peak_high_mb <= 22_000 * 1.05 + 1e-6 for f in steps)


async def test_a_step_schedule_moved_on_its_level_comes_back_where_it_was_and_an_early_stop_tells_nothing(
    fingerprinter,
):
    bus, _ = fingerprinter
    early, steps = task("steps-1"), task("steps-2")  # one program
    for submitted in (early, steps):
        await bus.publish(submitted)
    await asyncio.sleep(0.3)
    # Stopped at 24 GB having started at 20: started over or not, it comes back near 20 GB.
    await stop_and_restore(bus, "steps-1", "evicted", lambda t: 20_000 + 4_000 * (t >= 150), lambda t: 8_000)
    # 8 GB, then 16, then 30 (its third level), moved, and back on 30 GB where it runs next.
    await stop_and_restore(bus, "steps-2", "migrated", lambda t: [8_000, 16_000, 30_000][int(t // 100)],
                           lambda t: 30_000)
    stats = await restores_seen(bus, task_signature(steps), 1)
    await asyncio.sleep(0.5)  # the later samples of the run restored do not count it again
    stats = await remembered(bus, task_signature(steps))
    assert (stats.restores_kept, stats.restores_reset) == (1, 0)


async def redelivered(bus: NatsBus, event: TaskLifecycle) -> None:
    """``event`` once more, as JetStream redelivers it (an ack lost to a reconnect): the same
    message past the publish's de-duplication."""
    await bus.publish_raw(subject_for(event), encode(event), headers={"Nats-Msg-Id": f"again:{event.task_id}"})


async def test_a_stop_redelivered_after_the_restore_is_not_counted_again(fingerprinter):
    bus, _ = fingerprinter
    first = task("again-1")
    await bus.publish(first)
    await asyncio.sleep(0.3)
    # A leak: 8 GB growing to 37 GB, evicted, restored at 9 GB and growing to 18 GB.
    start = now()
    await stop_and_restore(bus, "again-1", "evicted", lambda t: 8_000 + 100.0 * t, lambda t: 9_000 + 100.0 * (t - 400))
    signature = task_signature(first)
    await restores_seen(bus, signature, 1)
    # The eviction comes again; the restored run goes on where it was.
    await redelivered(bus, TaskLifecycle(task_id="again-1", state="evicted", at=start + 300))
    await asyncio.sleep(0.3)
    for t in np.arange(500, 600, 10.0):
        await bus.publish(TaskTelemetry(task_id="again-1", node="n2", gpus=[0], at=start + float(t),
                                        memory_used_mb=9_000 + 100.0 * (float(t) - 400)))
    await asyncio.sleep(0.5)
    stats = await remembered(bus, signature)
    assert (stats.restores_kept, stats.restores_reset) == (0, 1)


async def test_a_submission_read_after_its_run_was_learnt_leaves_no_task_waiting(fingerprinter):
    bus, seen = fingerprinter
    done, other = task("done-1"), task("done-2")  # one program
    await run_for(bus, done, 400, lambda t: 10_000.0 + 30.0 * t)
    await samples_taken(bus, seen, "sync-done-1")
    await bus.publish(TaskLifecycle(task_id="done-1", state="finished", at=now()))
    await remembered(bus, task_signature(done))
    ended = len(seen)
    # Its submission comes again (redelivered, or read by a consumer behind the lifecycle's):
    # the task is not waiting to start, and is told nothing, now or when the next run ends.
    await bus.publish_raw(subject_for(done), encode(done), headers={"Nats-Msg-Id": "again:done-1"})
    await asyncio.sleep(0.5)
    await run_for(bus, other, 400, lambda t: 20_000.0 + 60.0 * t)
    await samples_taken(bus, seen, "sync-done-2")
    await bus.publish(TaskLifecycle(task_id="done-2", state="finished", at=now()))
    kv = await bus.kv("fingerprints")

    async def both_learnt() -> bool:
        entry = await kv.get(task_signature(done))
        return entry is not None and msgspec.json.decode(entry.value, type=SignatureStats).count == 2

    await wait_for(both_learnt, what="the second run learnt")
    await asyncio.sleep(0.5)
    assert [f for f in seen[ended:] if f.task_id == "done-1"] == []


async def test_a_sample_of_negative_memory_is_dead_lettered_with_its_reason_not_fitted(fingerprinter):
    bus, seen = fingerprinter
    letters: list[DeadLetter] = []

    async def on_letter(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await bus.subscribe("dlq.telemetry.task.>", on_letter)
    start = now()
    for t in np.arange(0, 400, 10.0):
        await bus.publish(TaskTelemetry(task_id="garbled-1", node="n1", gpus=[0], at=start + float(t),
                                        memory_used_mb=-4_000.0))
    letters_in = await wait_for(lambda: len(letters) == 40 and letters, what="every garbled sample dead-lettered")
    assert {(d.subject, d.reason) for d in letters_in} == {("telemetry.task.garbled-1", "rejected")}
    assert "negative" in letters_in[0].error
    await samples_taken(bus, seen, "sync-garbled-1")
    assert [f for f in seen if f.task_id == "garbled-1"] == []


async def test_a_run_that_failed_partway_teaches_no_envelope(fingerprinter):
    bus, seen = fingerprinter
    first = task("crash-1")
    # A step schedule (8 GB, then 20 GB from 250 s of its 1,000) that crashes at 400 s: its
    # series would read as 20 GB to the end of its life.
    await run_for(bus, first, 400, lambda t: 8_000.0 if t < 250 else 20_000.0)
    await samples_taken(bus, seen, "sync-crash-1")
    await bus.publish(TaskLifecycle(task_id="crash-1", state="failed", at=now()))
    stats = await remembered(bus, task_signature(first))
    assert stats.count == 1 and stats.envelope_mb == ()


async def test_samples_that_arrive_after_the_run_s_end_are_learnt_and_none_taken_after_it(fingerprinter):
    bus, seen = fingerprinter
    first = task("late-1")
    await bus.publish(first)
    await asyncio.sleep(0.5)
    # Its end (JetStream) overtakes its samples (core NATS): all of them arrive after it. One
    # sample is stamped after the end: the collector read a process that had exited.
    start = now() - 1_010.0
    await bus.publish(TaskLifecycle(task_id="late-1", state="finished", at=start + 1_000.0))
    growth = MemoryGrowth(pattern="steps", base_mb=8_000, peak_mb=32_000, duration_s=1_000, n_steps=4)
    for t in np.arange(0, 1_000, 10.0):
        await bus.publish(TaskTelemetry(task_id="late-1", node="n1", gpus=[0], at=start + float(t),
                                        memory_used_mb=float(growth.memory_at(t))))
    await bus.publish(TaskTelemetry(task_id="late-1", node="n1", gpus=[0], at=start + 1_005.0,
                                    memory_used_mb=90_000.0))
    stats = await remembered(bus, task_signature(first))
    assert stats.count == 1
    assert abs(stats.envelope_mb[-1] - 32_000) < 500 and abs(stats.mean_peak_mb - 32_000) < 500, stats


async def test_a_completed_run_s_peak_spans_its_moves_and_joins_what_its_signature_knows(fingerprinter):
    bus, seen = fingerprinter
    first = task("spread-1")
    signature = task_signature(first)
    # 39 runs known: 38 held at most 30 GB, one 34 GB.
    known = SignatureStats(signature=signature, count=39, votes={"flat": 30.0}, mean_peak_mb=30_100,
                           min_peak_mb=29_000, max_peak_mb=34_000, run_peaks_mb=(30_000.0,) * 38 + (34_000.0,))
    kv = await bus.kv("fingerprints")
    await kv.put(signature, msgspec.json.encode(known))
    # This run holds 31 GB until it is moved, and 20 GB where it goes, to its end.
    await run_for(bus, first, 300, lambda t: 31_000.0)
    await bus.publish(TaskLifecycle(task_id="spread-1", state="migrated", at=now()))
    await asyncio.sleep(0.3)
    start = now() + 300
    for t in np.arange(0, 700, 10.0):
        await bus.publish(TaskTelemetry(task_id="spread-1", node="n2", gpus=[0], at=start + float(t),
                                        memory_used_mb=20_000.0))
    await samples_taken(bus, seen, "sync-spread-1")
    await bus.publish(TaskLifecycle(task_id="spread-1", state="finished", at=now()))

    async def forty_runs() -> SignatureStats | None:
        entry = await kv.get(signature)
        stats = msgspec.json.decode(entry.value, type=SignatureStats)
        return stats if len(stats.run_peaks_mb) == 40 else None

    stats = await wait_for(forty_runs, what="the run's peak remembered")
    assert stats.run_peaks_mb[-1] == 31_000  # before its move, not the 20 GB after it
    await bus.publish(task("spread-2"))
    predicted = (await wait_for(lambda: [f for f in seen if f.task_id == "spread-2"]))[0]
    # Forty runs: all but one held at most 31 GB (the 34 GB one is within the 2.5% share).
    assert predicted.fingerprint.fit_peak_mb == 31_000


async def test_a_task_waiting_to_start_is_told_what_a_run_that_ended_taught_its_signature(fingerprinter):
    bus, seen = fingerprinter
    first = task("teach-1")
    signature = task_signature(first)
    # 19 runs known, at 30 GB: one short of telling their spread.
    known = SignatureStats(signature=signature, count=19, votes={"flat": 19.0}, mean_peak_mb=30_000,
                           min_peak_mb=30_000, max_peak_mb=30_000, run_peaks_mb=(30_000.0,) * 19)
    await (await bus.kv("fingerprints")).put(signature, msgspec.json.encode(known))
    for waiter in ("queued-1", "placed-1"):
        await bus.publish(task(waiter))
    given = await wait_for(lambda: [f for f in seen if f.task_id in ("queued-1", "placed-1")] or None)
    assert {f.fingerprint.fit_peak_mb for f in given} == {0.0}
    await bus.publish(TaskLifecycle(task_id="placed-1", state="started", at=now()))
    # The twentieth run ends, having held 31 GB.
    await run_for(bus, first, 1_000, lambda t: 31_000.0)
    await samples_taken(bus, seen, "sync-teach-1")
    await bus.publish(TaskLifecycle(task_id="teach-1", state="finished", at=now()))
    told = await wait_for(lambda: [f for f in seen if f.task_id == "queued-1" and f.fingerprint.fit_peak_mb > 0],
                          what="the waiting task told its signature's spread")
    assert told[0].source == "signature" and told[0].fingerprint.fit_peak_mb == 31_000
    await asyncio.sleep(0.5)
    # The task that has started is not: its own samples tell what it holds.
    assert [f.fingerprint.fit_peak_mb for f in seen if f.task_id == "placed-1"] == [0.0]


async def test_until_a_run_ends_its_signature_s_tasks_are_told_what_a_run_in_progress_shows(fingerprinter):
    bus, seen = fingerprinter
    first = task("live-1")
    await bus.publish(task("live-queued"))  # before anything is known of the program
    await asyncio.sleep(0.3)
    assert not [f for f in seen if f.task_id == "live-queued"]
    # The program's first run climbs steadily (400 s of its declared 1,000 seen): its trusted
    # fingerprint predicts more than the 40 GB its user asked.
    await run_for(bus, first, 400, lambda t: 10_000.0 + 40.0 * t)
    await samples_taken(bus, seen, "sync-live-1")
    observed = [f.fingerprint for f in seen if f.task_id == "live-1" and f.source == "observed"]
    assert observed and observed[-1].predicted_peak_mb > 40_000
    told = await wait_for(lambda: [f for f in seen if f.task_id == "live-queued"],
                          what="the waiting task told what the run in progress shows")
    assert told[-1].source == "signature" and told[-1].fingerprint == borrowed(observed[-1])
    await bus.publish(task("live-next"))  # submitted while the run goes on: told at once
    given = await wait_for(lambda: [f for f in seen if f.task_id == "live-next"])
    assert given[0].fingerprint == borrowed(observed[-1])

    # Once the run has ended, its signature's statistics say what the next task expects: they
    # hold the run's envelope, which no run in progress has.
    await bus.publish(TaskLifecycle(task_id="live-1", state="finished", at=now()))
    stats = await remembered(bus, task_signature(first))
    await bus.publish(task("live-after"))
    after = await wait_for(lambda: [f for f in seen if f.task_id == "live-after"])
    assert given[0].fingerprint.envelope_mb == ()
    assert stats.envelope_mb and after[0].fingerprint.envelope_mb == stats.envelope_mb


@pytest.fixture
async def partitioned(nats_server):
    """Two fingerprinter replicas sharing the tasks: partitions 0 and 1 of 2 (``replicas``)."""
    async with replicas(nats_server.url, Partition(0, 2), Partition(1, 2)) as running:
        yield running


def owned_by(partition: int, name: str) -> str:
    """A task id starting with ``name`` that ``partition`` of 2 owns."""
    return next(f"{name}-{n}" for n in itertools.count() if partition_of(f"{name}-{n}", 2) == partition)


async def test_partitioned_replicas_each_fit_the_whole_series_of_the_tasks_they_own(partitioned):
    bus, seen = partitioned
    growth = {owned_by(0, "mine"): lambda t: 10_000.0 + 40.0 * t, owned_by(1, "yours"): lambda t: 6_000.0 + 60.0 * t}
    for task_id in growth:
        await bus.publish(task(task_id))
    await asyncio.sleep(0.5)  # the tasks are placed before their processes report memory
    start, times = now(), np.arange(0, 600, 10.0)
    for t in times:
        for task_id, used_mb in growth.items():
            await bus.publish(TaskTelemetry(task_id=task_id, node="n1", gpus=[0], at=start + float(t),
                                            memory_used_mb=used_mb(float(t))))
    for partition in (0, 1):
        await samples_taken(bus, seen, owned_by(partition, "sync"))
    for task_id, used_mb in growth.items():
        # What one model fed every sample of the task publishes: in a queue group, each
        # replica would have fitted about half of them, and both published.
        model = OnlineFingerprinter(task_signature(task(task_id)), expected_duration_s=1_000, only_trusted=True,
                                    from_start=True)
        expected = [fp for t in times if (fp := model.add(start + float(t), used_mb(float(t)))) is not None]
        assert expected
        assert [f.fingerprint for f in seen if f.task_id == task_id and f.source == "observed"] == expected


async def test_a_partition_s_waiting_tasks_are_told_what_the_other_partition_s_runs_show(partitioned):
    bus, seen = partitioned
    first, queued, later = task(owned_by(0, "run")), owned_by(1, "queued"), owned_by(1, "later")
    await bus.publish(task(queued))
    await asyncio.sleep(0.3)
    # The program's first run, on partition 0, climbs past the 40 GB its user asked.
    await run_for(bus, first, 400, lambda t: 10_000.0 + 40.0 * t)
    await samples_taken(bus, seen, owned_by(0, "sync"))
    observed = [f.fingerprint for f in seen if f.task_id == first.task_id and f.source == "observed"]
    assert observed and observed[-1].predicted_peak_mb > 40_000
    shows = borrowed(observed[-1])
    await wait_for(lambda: [f for f in seen if f.task_id == queued and f.fingerprint == shows],
                   what="partition 1's waiting task told what partition 0's run in progress shows")
    await bus.publish(task(later))
    await wait_for(lambda: [f for f in seen if f.task_id == later])
    await asyncio.sleep(0.5)
    # Answered once, by its own partition's replica.
    assert [(f.source, f.fingerprint) for f in seen if f.task_id == later] == [("signature", shows)]

    # The run ends on partition 0; partition 1's waiting task is told what it taught.
    await bus.publish(TaskLifecycle(task_id=first.task_id, state="finished", at=now()))
    stats = await remembered(bus, task_signature(first))
    told = await wait_for(lambda: [f for f in seen if f.task_id == queued and f.fingerprint.envelope_mb] or None,
                          what="partition 1's waiting task told what the ended run taught")
    assert told[-1].source == "signature" and told[-1].fingerprint == predict(stats)


def test_a_partition_beyond_the_count_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("FLEETPILOT_FINGERPRINTER_PARTITIONS", "2")
    monkeypatch.setenv("FLEETPILOT_FINGERPRINTER_PARTITION", "2")
    with pytest.raises(BadSettings, match="PARTITION=2 must be below PARTITIONS=2") as raised:
        FingerprinterSettings.from_environment()
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("variable,value", [
    ("MAX_TRACKED_TASKS", "0"),     # every sample's handler popped a model from an empty table
    ("MAX_TRACKED_TASKS", "-5"),
    ("END_GRACE_S", "-1"),
    ("END_GRACE_S", "nan"),         # a periodic job every NaN seconds
    ("END_GRACE_S", "inf"),         # no run's end ever learnt
    ("CHECKPOINT_S", "inf"),        # checkpoints "on" that are never written
    ("RECOVER_S", "inf"),           # a start time before any date: the recovery job failed at each start
    ("RECOVER_S", "1e12"),
    ("SILENT_FORGET_S", "inf"),     # no run forgotten, yet each restored one dropped by the bucket's TTL
])
def test_a_setting_that_is_nonsense_is_a_one_line_error(monkeypatch, variable, value):
    monkeypatch.setenv(f"FLEETPILOT_FINGERPRINTER_{variable}", value)
    with pytest.raises(BadSettings, match=f"FLEETPILOT_FINGERPRINTER_{variable}") as raised:
        FingerprinterSettings.from_environment()
    assert "\n" not in str(raised.value)


async def test_a_partition_s_replica_holds_only_its_own_tasks_and_says_which_partition_it_is(nats_server):
    host = build(FingerprinterSettings(nats_url=nats_server.url, metrics_port=-1, partitions=2, partition=1))
    await host.start()
    bus = await NatsBus.connect(nats_server.url, "test")
    registry = host.metrics.registry

    def held(state: str) -> float | None:
        return registry.get_sample_value("fleetpilot_fingerprinter_tasks", {"state": state})

    try:
        assert registry.get_sample_value("fleetpilot_fingerprinter_partition", {"partition": "1"}) == 1
        assert registry.get_sample_value("fleetpilot_fingerprinter_partitions") == 2
        mine, theirs = owned_by(1, "mine"), owned_by(0, "theirs")
        for task_id in (mine, theirs):
            await bus.publish(task(task_id))
        await wait_for(lambda: held("waiting") == 1, what="its own task waiting")
        for task_id in (mine, theirs):
            await bus.publish(TaskTelemetry(task_id=task_id, node="n1", gpus=[0], at=now(), memory_used_mb=4_000.0))
        await wait_for(lambda: held("waiting") == 0, what="its own task started")
        await asyncio.sleep(0.3)
        assert held("modelled") == 1  # the other partition's task is not modelled here
    finally:
        await bus.drain()
        await host.stop()


async def test_past_its_cap_the_model_forgotten_is_the_one_least_recently_fed_not_a_running_task_s(nats_server):
    # Room for three models: a run sampled all along, and waiting tasks submitted after it.
    async with replicas(nats_server.url, Partition(), max_tracked_tasks=3) as (bus, seen):
        first = task("busy-1")
        start = now()

        async def samples(since: float, until: float) -> None:
            for t in np.arange(since, until, 10.0):
                await bus.publish(TaskTelemetry(task_id="busy-1", node="n1", gpus=[0], at=start + float(t),
                                                memory_used_mb=10_000.0 + 20.0 * float(t)))
            await asyncio.sleep(0.3)

        await bus.publish(first)
        await asyncio.sleep(0.3)
        await samples(0, 200)
        for waiter in ("queued-a", "queued-b"):
            await bus.publish(task(waiter))
        await asyncio.sleep(0.3)
        await samples(200, 400)
        await bus.publish(task("queued-c"))  # a fourth task: one model goes, not the running one's
        await asyncio.sleep(0.3)
        await samples(400, 600)
        # A fifth (the marker that says every sample was taken): again a waiting model goes.
        await samples_taken(bus, seen, "sync-busy-1")
        await bus.publish(TaskLifecycle(task_id="busy-1", state="finished", at=start + 600))
        stats = await remembered(bus, task_signature(first))
        assert stats.count == 1 and abs(stats.mean_peak_mb - (10_000 + 20.0 * 590)) < 1_000, stats


async def run_with_one_garbled_sample(fingerprinter, task_id: str, garbled: dict) -> tuple[DeadLetter, object]:
    """A run of 10 GB at 80% for 1,000 s, sampled every 10 s, whose sample at 500 s carries
    the ``garbled`` fields instead: its one dead letter, and what its signature learnt."""
    bus, seen = fingerprinter
    letters: list[DeadLetter] = []

    async def on_letter(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await bus.subscribe("dlq.telemetry.task.>", on_letter)
    first = task(task_id)
    await bus.publish(first)
    await asyncio.sleep(0.3)
    start = now() - 1_005.0
    for t in np.arange(0, 1_000, 10.0):
        fields = {"at": start + float(t), "memory_used_mb": 10_000.0 + 20.0 * math.sin(t), "utilization_gpu_pct": 80.0}
        await bus.publish(TaskTelemetry(task_id=task_id, node="n1", gpus=[0],
                                        **(fields | garbled if t == 500 else fields)))
    letter = (await wait_for(lambda: letters, what="the garbled sample dead-lettered"))[0]
    await samples_taken(bus, seen, f"sync-{task_id}")
    await bus.publish(TaskLifecycle(task_id=task_id, state="finished", at=start + 1_000))
    stats = await remembered(bus, task_signature(first))
    assert len(letters) == 1
    assert (letter.subject, letter.reason) == (f"telemetry.task.{task_id}", "rejected")
    assert "\n" not in letter.error
    return letter, stats


async def test_a_sample_beyond_any_gpu_is_dead_lettered_with_its_reason_and_the_run_learnt_without_it(
    fingerprinter,
):
    # One sample read its bytes as MB (10 GB is 1.07e10 bytes).
    letter, stats = await run_with_one_garbled_sample(fingerprinter, "bytes-1",
                                                      {"memory_used_mb": 10_000.0 * 1024 * 1024})
    assert "more than any GPU holds" in letter.error
    assert stats.max_peak_mb < 11_000 and stats.run_peaks_mb == (pytest.approx(10_020, abs=20),), stats


async def test_a_step_run_whose_every_sample_came_twice_is_remembered_at_what_it_held(fingerprinter):
    bus, seen = fingerprinter
    first = task("twice-1")
    await bus.publish(first)
    await asyncio.sleep(0.3)
    # 8 GB, then 20 GB from 250 s of its 1,000, to its end; each sample delivered twice (a
    # collector that sends again what it is not sure went out). Fitted twice, the series reads
    # as sampled at no interval: its last level as a schedule's first, 44 GB.
    start = now() - 1_005.0
    for t in np.arange(0, 1_000, 10.0):
        sample = TaskTelemetry(task_id="twice-1", node="n1", gpus=[0], at=start + float(t),
                               memory_used_mb=8_000.0 if t < 250 else 20_000.0)
        for _ in range(2):
            await bus.publish(sample)
    await samples_taken(bus, seen, "sync-twice-1")
    await bus.publish(TaskLifecycle(task_id="twice-1", state="finished", at=start + 1_000.0))
    stats = await remembered(bus, task_signature(first))
    assert abs(stats.mean_peak_mb - 20_000) < 500, stats
    observed = [f.fingerprint for f in seen if f.task_id == "twice-1"]
    assert observed and max(f.samples for f in observed) <= 100  # each sample fitted once


async def test_a_sample_overtaken_by_a_later_one_is_not_what_a_stopped_run_is_judged_by(fingerprinter):
    bus, _ = fingerprinter
    steps = task("overtaken-1")
    await bus.publish(steps)
    await asyncio.sleep(0.3)
    # 8 GB, then 16, then 30 (its third level); a sample of its first level, held up on the
    # way, arrives after the others and before it is moved. Back on 30 GB where it runs next:
    # it came back where it was, which the stray sample, taken as the last, would hide.
    start = now()
    for t in np.arange(0, 300, 10.0):
        await bus.publish(TaskTelemetry(task_id="overtaken-1", node="n1", gpus=[0], at=start + float(t),
                                        memory_used_mb=[8_000.0, 16_000.0, 30_000.0][int(t // 100)]))
    await bus.publish(TaskTelemetry(task_id="overtaken-1", node="n1", gpus=[0], at=start + 55.0,
                                    memory_used_mb=8_000.0))
    await asyncio.sleep(0.3)
    await bus.publish(TaskLifecycle(task_id="overtaken-1", state="migrated", at=start + 300))
    await asyncio.sleep(0.3)
    for t in np.arange(400, 500, 10.0):
        await bus.publish(TaskTelemetry(task_id="overtaken-1", node="n2", gpus=[0], at=start + float(t),
                                        memory_used_mb=30_000.0))
    stats = await restores_seen(bus, task_signature(steps), 1)
    assert (stats.restores_kept, stats.restores_reset) == (1, 0)


def registry_of(host):
    """``state`` -> how many tasks ``host``'s replica holds in it (``fleetpilot_fingerprinter_tasks``)."""
    return lambda state: host.metrics.registry.get_sample_value("fleetpilot_fingerprinter_tasks", {"state": state})


@contextlib.asynccontextmanager
async def one_replica(nats_url: str, **settings):
    """One fingerprinter, the whole, itself at hand (``settings`` beyond the defaults); a bus
    to talk to it, every ``task.fingerprinted`` seen, and what it holds (``registry_of``)."""
    host = build(FingerprinterSettings(nats_url=nats_url, metrics_port=-1, **{"end_grace_s": 0.5, **settings}))
    await host.start()
    bus = await NatsBus.connect(nats_url, "test")
    seen: list[TaskFingerprinted] = []

    async def on_fp(msg) -> None:
        seen.append(decode(msg.data, TaskFingerprinted))

    await bus.subscribe("task.fingerprinted", on_fp)
    try:
        yield host, bus, seen
    finally:
        await bus.drain()
        await host.stop()


async def test_a_waiting_task_that_starts_while_its_signature_s_tasks_are_told_is_passed_over(nats_server):
    async with one_replica(nats_server.url) as (host, bus, seen):
        held = registry_of(host)
        letters: list[DeadLetter] = []

        async def on_letter(msg) -> None:
            letters.append(decode(msg.data, DeadLetter))

        await bus.subscribe("dlq.>", on_letter)
        for waiter in ("told-a", "told-b"):
            await bus.publish(task(waiter))
        await wait_for(lambda: held("waiting") == 2, what="both tasks waiting")
        # While the first waiting task is told what a run in progress shows (a publish, a
        # round trip), the second starts.
        publish = host.bus.publish

        async def told_while_one_starts(event, **kwargs) -> None:
            if isinstance(event, TaskFingerprinted) and event.task_id == "told-a" and held("waiting") == 2:
                await bus.publish(TaskLifecycle(task_id="told-b", state="started", at=now()))
                await wait_for(lambda: held("waiting") == 1, what="told-b started")
            await publish(event, **kwargs)

        host.bus.publish = told_while_one_starts
        await run_for(bus, task("told-run"), 400, lambda t: 10_000.0 + 40.0 * t)
        await wait_for(lambda: [f for f in seen if f.task_id == "told-a"], what="told-a told")
        await samples_taken(bus, seen, "sync-told")
        # The run's fingerprint went out, and its sample was not lost to the task gone.
        assert [f for f in seen if f.task_id == "told-run" and f.source == "observed"]
        assert letters == []
        assert not [f for f in seen if f.task_id == "told-b"]


async def test_a_rejected_task_is_no_longer_held_nor_told_its_signature_s_predictions(nats_server):
    async with one_replica(nats_server.url) as (host, bus, seen):
        held = registry_of(host)
        await bus.publish(task("turned-down-1"))
        await wait_for(lambda: held("waiting") == 1, what="the task waiting")
        await bus.publish(TaskRejected(task_id="turned-down-1", code="infeasible", reason="fits no GPU",
                                       rejected_at=now()))
        await wait_for(lambda: held("waiting") == 0 and held("modelled") == 0, what="the rejected task forgotten")
        # A rejection heard before the submission is read (its consumer behind): not waiting either.
        submitted = task("turned-down-2")
        await bus.publish(TaskRejected(task_id="turned-down-2", code="infeasible", reason="fits no GPU",
                                       rejected_at=now()))
        await asyncio.sleep(0.2)
        await bus.publish(submitted)
        await bus.publish(task("sync-rejected"))  # read after it, on the same consumer
        await wait_for(lambda: held("waiting") == 1, what="the next submission read")
        # The program's first run in progress is told to the task waiting, not to the rejected.
        await run_for(bus, task("turned-down-run"), 400, lambda t: 10_000.0 + 40.0 * t)
        await wait_for(lambda: [f for f in seen if f.task_id == "sync-rejected" and f.source == "signature"],
                       what="the waiting task told what the run shows")
        assert not [f for f in seen if f.task_id.startswith("turned-down-") and f.task_id != "turned-down-run"]


async def test_a_run_gone_silent_is_forgotten_and_one_of_a_known_task_still_teaches_when_it_reports_again(
    nats_server,
):
    async with one_replica(nats_server.url, silent_forget_s=1.0) as (host, bus, seen):
        held = registry_of(host)
        first = task("quiet-1")
        # A known task holds 31 GB; a process the collector knows no task of holds 6 GB. Both
        # go silent (the first's collector restarting, the second's end never told).
        await run_for(bus, first, 300, lambda t: 31_000.0)
        start = now()
        for t in np.arange(0, 100, 10.0):
            await bus.publish(TaskTelemetry(task_id="pid-4242", node="n1", gpus=[0], at=start + float(t),
                                            memory_used_mb=6_000.0))
        await wait_for(lambda: held("modelled") == 2, what="both modelled")
        await wait_for(lambda: held("modelled") == 1, what="the silent process forgotten")
        # The known task reports again, at 20 GB to its end.
        start = now() + 600
        for t in np.arange(0, 700, 10.0):
            await bus.publish(TaskTelemetry(task_id="quiet-1", node="n1", gpus=[0], at=start + float(t),
                                            memory_used_mb=20_000.0))
        await samples_taken(bus, seen, "sync-quiet-1")
        await bus.publish(TaskLifecycle(task_id="quiet-1", state="finished", at=start + 700))
        stats = await remembered(bus, task_signature(first))
        assert stats.count == 1 and stats.run_peaks_mb == (31_000,)  # its peak spans the silence
        assert stats.envelope_mb == ()  # its series since does not start with its run


async def test_a_retried_run_teaches_and_the_first_run_s_end_delivered_again_does_not_cut_it(fingerprinter):
    bus, seen = fingerprinter
    first = task("retry-1")
    signature = task_signature(first)
    # Its first run holds 10 GB for 400 s and fails.
    start = now() - 2_000.0
    await bus.publish(first)
    await asyncio.sleep(0.3)
    for t in np.arange(0, 400, 10.0):
        await bus.publish(TaskTelemetry(task_id="retry-1", node="n1", gpus=[0], at=start + float(t),
                                        memory_used_mb=10_000.0))
    await samples_taken(bus, seen, "sync-retry-1")
    failed = TaskLifecycle(task_id="retry-1", state="failed", at=start + 400)
    await bus.publish(failed)
    await remembered(bus, signature)
    # Retried, it holds 10 GB for 300 s, then 20 GB to its end; meanwhile the first run's end
    # comes again (an ack lost to a reconnect).
    await bus.publish(TaskLifecycle(task_id="retry-1", state="started", at=start + 500))
    await asyncio.sleep(0.3)
    for t in np.arange(0, 1_000, 10.0):
        if t == 300:
            await samples_taken(bus, seen, "sync-retry-2")
            await redelivered(bus, failed)
            await asyncio.sleep(1.0)  # past its grace
        await bus.publish(TaskTelemetry(task_id="retry-1", node="n2", gpus=[0], at=start + 500 + float(t),
                                        memory_used_mb=10_000.0 if t < 300 else 20_000.0))
    await samples_taken(bus, seen, "sync-retry-3")
    await bus.publish(TaskLifecycle(task_id="retry-1", state="finished", at=start + 1_500))
    kv = await bus.kv("fingerprints")

    async def both_runs() -> SignatureStats | None:
        stats = msgspec.json.decode((await kv.get(signature)).value, type=SignatureStats)
        return stats if stats.count == 2 else None

    stats = await wait_for(both_runs, what="the retry's run learnt")
    # The retry completed holding 20 GB: its whole run, not its first 300 s.
    assert stats.run_peaks_mb == (20_000,) and stats.max_peak_mb >= 19_500, stats


async def test_an_oom_after_a_move_teaches_at_least_what_the_run_held_before_it(fingerprinter):
    bus, seen = fingerprinter
    first = task("oom-moved-1")
    # 31 GB until it is checkpointed; restored at 12 GB (a cache started over), killed by an
    # OOM at 14 GB on a smaller GPU.
    await run_for(bus, first, 300, lambda t: 31_000.0)
    await bus.publish(TaskLifecycle(task_id="oom-moved-1", state="evicted", at=now()))
    await asyncio.sleep(0.3)
    start = now() + 300
    for t in np.arange(0, 100, 10.0):
        await bus.publish(TaskTelemetry(task_id="oom-moved-1", node="n2", gpus=[0], at=start + float(t),
                                        memory_used_mb=12_000.0 + 20.0 * float(t)))
    await samples_taken(bus, seen, "sync-oom-moved-1")
    await bus.publish(TaskLifecycle(task_id="oom-moved-1", state="oom_killed", at=start + 100))

    async def floor_learnt() -> SignatureStats | None:
        stats = await remembered(bus, task_signature(first))
        return stats if stats.oom_floor_mb > 0 else None

    stats = await wait_for(floor_learnt, what="the OOM floor learnt")
    assert stats.oom_floor_mb == 31_000 and stats.run_peaks_mb == (31_000,)


async def test_fits_run_off_the_event_loop(fingerprinter, monkeypatch):
    import threading

    import fleetpilot.fingerprint.online as online

    loop_thread = threading.get_ident()
    fitted_on: list[int] = []
    analyse = online.analyse_series

    def recorded(*args, **kwargs):
        fitted_on.append(threading.get_ident())
        return analyse(*args, **kwargs)

    monkeypatch.setattr(online, "analyse_series", recorded)
    bus, seen = fingerprinter
    first = task("fitted-1")
    await run_for(bus, first, 400, lambda t: 10_000.0 + 40.0 * t)
    await samples_taken(bus, seen, "sync-fitted-1")
    refits = len(fitted_on)
    await bus.publish(TaskLifecycle(task_id="fitted-1", state="finished", at=now()))
    await remembered(bus, task_signature(first))
    assert refits > 5 and len(fitted_on) > refits  # while it ran, and its end
    assert loop_thread not in fitted_on


async def test_a_start_delivered_again_after_its_run_was_learnt_does_not_reopen_it(nats_server):
    async with one_replica(nats_server.url) as (host, bus, seen):
        held = registry_of(host)
        first = task("reopened-1")
        start = now() - 500.0
        started = TaskLifecycle(task_id="reopened-1", state="started", at=start)
        await bus.publish(started)
        await run_for(bus, first, 300, lambda t: 10_000.0 + 20.0 * math.sin(t))
        await bus.publish(TaskLifecycle(task_id="reopened-1", state="finished", at=now()))
        await remembered(bus, task_signature(first))
        # Its start, then its submission, come again (acks lost to a reconnect): the run was
        # learnt, and the task is not waiting to start.
        await redelivered(bus, started)
        await asyncio.sleep(0.5)
        await bus.publish_raw(subject_for(first), encode(first), headers={"Nats-Msg-Id": "again-submitted:reopened-1"})
        await bus.publish(task("reopened-next"))  # read after it, on the same consumer
        await wait_for(lambda: [f for f in seen if f.task_id == "reopened-next"], what="the next submission read")
        assert held("waiting") == 1  # the next one alone


async def test_a_run_whose_end_is_learnt_while_the_server_is_away_is_written_once_it_is_back(
    nats_server, caplog,
):
    async with one_replica(nats_server.url, end_grace_s=1.5) as (host, bus, seen):
        first = task("outage-1")
        await run_for(bus, first, 400, lambda t: 10_000.0 + 30.0 * t)
        await samples_taken(bus, seen, "sync-outage-1")
        await bus.publish(TaskLifecycle(task_id="outage-1", state="finished", at=now()))
        # Its end taken (acked) and waiting out its grace when the server goes away.
        consumer = bus._js.consumer_info  # noqa: SLF001 - what the server says it has delivered

        async def end_taken() -> bool:
            info = await consumer("TASKS", "fingerprinter-lifecycle")
            return info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.consumer_seq >= 1

        await wait_for(end_taken, what="the run's end taken")
        nats_server.kill()
        caplog.set_level("WARNING")
        await wait_for(lambda: [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")
                                and ("statistics of" in r.getMessage() or "periodic job" in r.getMessage())],
                       what="the fold tried while the server is away")
        nats_server.start()  # same port, same store
        stats = await remembered(bus, task_signature(first))
        assert stats.count == 1 and stats.run_peaks_mb == (21_700,), stats


async def test_a_run_in_progress_across_a_restart_still_teaches_its_signature(nats_server):
    # The replica started again resumed its consumers past the submission it had read: the
    # run's samples made a model with no signature, and when the run ended it taught nothing.
    submitted = task("across-1")
    start = now()
    async with replicas(nats_server.url, Partition()) as (bus, seen):
        await bus.publish(submitted)
        await asyncio.sleep(0.5)
        for t in np.arange(0, 300, 10.0):
            await bus.publish(TaskTelemetry(task_id="across-1", node="n1", gpus=[0], at=start + float(t),
                                            memory_used_mb=8_000.0 + 20.0 * float(t)))
        await samples_taken(bus, seen, "sync-before")
    async with replicas(nats_server.url, Partition()) as (bus, seen):
        for t in np.arange(300, 1_000, 10.0):
            await bus.publish(TaskTelemetry(task_id="across-1", node="n1", gpus=[0], at=start + float(t),
                                            memory_used_mb=8_000.0 + 20.0 * float(t)))
        await samples_taken(bus, seen, "sync-after")
        await bus.publish(TaskLifecycle(task_id="across-1", state="finished", at=start + 1_000.0))
        stats = await remembered(bus, task_signature(submitted))
    assert stats.count == 1
    assert 20_000 <= stats.run_peaks_mb[-1] <= 28_000  # what the run after the restart reached (27,800 MB)


async def test_a_sample_of_the_stopped_process_that_arrives_after_its_stop_is_not_fitted_into_the_restored_run(
    fingerprinter,
):
    bus, seen = fingerprinter
    first = task("stale-1")
    await bus.publish(first)
    await asyncio.sleep(0.3)
    # A leak from 8 GB, evicted at 300 s; its sample of 295 s, held up on the way (core NATS),
    # arrives after the eviction (JetStream). Restored at 9 GB, it grows again to its end.
    start = now() - 1_005.0
    for t in np.arange(0, 300, 10.0):
        await bus.publish(TaskTelemetry(task_id="stale-1", node="n1", gpus=[0], at=start + float(t),
                                        memory_used_mb=8_000.0 + 100.0 * float(t)))
    await asyncio.sleep(0.3)
    await bus.publish(TaskLifecycle(task_id="stale-1", state="evicted", at=start + 300.0))
    await asyncio.sleep(0.3)
    await bus.publish(TaskTelemetry(task_id="stale-1", node="n1", gpus=[0], at=start + 295.0,
                                    memory_used_mb=8_000.0 + 100.0 * 295.0))
    for t in np.arange(400, 1_000, 10.0):
        await bus.publish(TaskTelemetry(task_id="stale-1", node="n2", gpus=[0], at=start + float(t),
                                        memory_used_mb=9_000.0 + 100.0 * (float(t) - 400.0)))
    await samples_taken(bus, seen, "sync-stale-1")
    await bus.publish(TaskLifecycle(task_id="stale-1", state="finished", at=start + 1_000.0))
    signature = task_signature(first)

    async def learnt() -> SignatureStats | None:
        stats = await remembered(bus, signature)
        return stats if stats.count else None

    stats = await wait_for(learnt, what="the run learnt")
    # The restored run climbs from 9 GB without a drop: the old process's last sample first
    # would read as a sawtooth's tooth, and teach its signature so.
    assert stats.count == 1 and "sawtooth" not in stats.votes, stats
    assert [f for f in seen if f.task_id == "stale-1" and f.fingerprint.pattern == "sawtooth"] == []
    # Its run's peak still spans the move, the stray sample included.
    assert stats.run_peaks_mb == (pytest.approx(68_000.0),), stats


async def test_a_sample_of_garbled_utilisation_is_dead_lettered_with_its_reason_and_the_run_learnt_without_it(
    fingerprinter,
):
    # One sample's utilisation garbled at its source: a burstiness of NaN for the whole run.
    letter, stats = await run_with_one_garbled_sample(fingerprinter, "util-1", {"utilization_gpu_pct": 1e300})
    assert "utilization_gpu_pct" in letter.error
    assert stats.count == 1 and 0.0 <= stats.mean_burstiness < 0.01, stats



async def test_a_sample_stamped_far_in_the_future_is_dead_lettered_and_the_samples_after_it_still_fitted(
    fingerprinter,
):
    # One sample's time in milliseconds: taken, every later sample was stamped before it and
    # dropped as overtaken, and the series' curve stretched over 50,000 years.
    letter, stats = await run_with_one_garbled_sample(fingerprinter, "future-1", {"at": now() * 1_000.0})
    assert "ahead of the latest sample of node 'n1'" in letter.error
    assert stats.count == 1 and stats.run_peaks_mb == (pytest.approx(10_020, abs=20),), stats


async def test_an_end_stamped_far_in_the_future_is_taken_as_at_its_node_s_latest_sample(fingerprinter):
    # A linear run's end garbled far ahead: its growth was carried to that time, and its
    # signature taught a peak no GPU holds, for every later task of it.
    bus, seen = fingerprinter
    first = task("future-end-1")
    await run_for(bus, first, 1_000, lambda t: 10_000.0 + 20.0 * t)
    await samples_taken(bus, seen, "sync-future-end-1")
    await bus.publish(TaskLifecycle(task_id="future-end-1", state="finished", node="n1", at=now() * 1_000.0))
    stats = await remembered(bus, task_signature(first))
    assert stats.count == 1 and 29_000 <= stats.mean_peak_mb <= 31_000, stats


async def test_a_stop_stamped_far_in_the_future_does_not_keep_the_restored_run_s_samples_out(fingerprinter):
    # Taken at its word, every sample of the restored process read as the stopped one's.
    bus, seen = fingerprinter
    first = task("future-stop-1")
    await run_for(bus, first, 300, lambda t: 10_000.0 + 20.0 * t)
    await samples_taken(bus, seen, "sync-future-stop-1a")
    await bus.publish(TaskLifecycle(task_id="future-stop-1", state="evicted", node="n1", at=now() * 1_000.0))
    await asyncio.sleep(0.5)
    start = now()
    for t in np.arange(400, 1_000, 10.0):  # after the samples that told the test its first ones were taken
        await bus.publish(TaskTelemetry(task_id="future-stop-1", node="n1", gpus=[0], at=start + float(t),
                                        memory_used_mb=10_000.0 + 20.0 * float(t)))
    await samples_taken(bus, seen, "sync-future-stop-1b")
    await bus.publish(TaskLifecycle(task_id="future-stop-1", state="finished", node="n1", at=start + 1_000.0))

    async def learnt() -> SignatureStats | None:
        stats = await remembered(bus, task_signature(first))  # its restore is written first
        return stats if stats.count else None

    stats = await wait_for(learnt, what="the run learnt")
    assert stats.count == 1 and 29_000 <= stats.mean_peak_mb <= 31_000, stats


async def test_a_run_whose_end_was_taken_by_a_replica_that_crashed_within_its_grace_is_learnt_once(nats_server):
    submitted = task("crashed-1")
    async with one_replica(nats_server.url, end_grace_s=60.0) as (host, bus, seen):
        await run_for(bus, submitted, 200, lambda t: 10_000.0 + 20.0 * t)
        await samples_taken(bus, seen, "sync-crashed-1")
        await bus.publish(TaskLifecycle(task_id="crashed-1", state="finished", at=now()))
        consumer = bus._js.consumer_info  # noqa: SLF001 - what the server says it has delivered

        async def end_taken() -> bool:
            info = await consumer("TASKS", "fingerprinter-lifecycle")
            return info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.consumer_seq >= 1

        await wait_for(end_taken, what="the run's end taken")
        # It crashes: what a clean stop does first (learn what has ended) is not done.
        host._stopping_hooks.clear()  # noqa: SLF001
    async with one_replica(nats_server.url) as (host, bus, seen):
        stats = await remembered(bus, task_signature(submitted))
        assert stats.count == 1 and stats.run_peaks_mb == (13_800.0,), stats
        revision = (await (await bus.kv("fingerprints")).get(task_signature(submitted))).revision
    # Started again, a replica reads the run's end again, and learns it no second time.
    async with one_replica(nats_server.url) as (host, bus, seen):
        await asyncio.sleep(2.0)
        entry = await (await bus.kv("fingerprints")).get(task_signature(submitted))
        assert entry.revision == revision and msgspec.json.decode(entry.value, type=SignatureStats).count == 1


def stepping(t: float) -> float:
    """A step schedule over a declared 1,000 s: 10 GB, and 4 GB more at each quarter."""
    return 10_000.0 + 4_000.0 * min(int(t // 250.0), 3) + 30.0 * math.sin(t / 13.0)


async def feed(bus: NatsBus, task_id: str, start: float, times) -> None:
    for t in times:
        await bus.publish(TaskTelemetry(task_id=task_id, node="n1", gpus=[0], at=start + float(t),
                                        memory_used_mb=stepping(float(t)), utilization_gpu_pct=60.0 + float(t) % 7))


async def checkpointed(bus: NatsBus, task_id: str, samples: int) -> None:
    """Return once the ``fingerprint_series`` bucket holds ``task_id``'s run with ``samples`` samples."""
    kv = await bus.kv("fingerprint_series")

    async def held() -> bool:
        entry = await kv.get(task_id)
        return entry is not None and msgspec.json.decode(entry.value)["samples"] == samples

    await wait_for(held, what=f"{task_id}'s run checkpointed with {samples} samples")


@pytest.mark.parametrize("stop", ["clean", "crash"])
async def test_a_run_in_progress_across_a_restart_of_its_replica_teaches_what_it_would_have_uninterrupted(
    nats_server, stop,
):
    # A replica restarted (a rollout, a crash) began every run in progress afresh at its next
    # sample: a series that did not begin with its run, which taught no envelope, and a fit
    # of its end alone. Its checkpoint now carries the run across, whichever way it stopped.
    start = now()
    times = np.arange(0.0, 1_000.0, 10.0)
    cut = 40  # into the second level
    uninterrupted = msgspec.structs.replace(task("whole-1"), labels={"model": "reference"})
    async with one_replica(nats_server.url) as (_, bus, seen):
        await bus.publish(uninterrupted)
        await asyncio.sleep(0.5)
        await feed(bus, "whole-1", start, times)
        await samples_taken(bus, seen, "sync-whole-1")
        await bus.publish(TaskLifecycle(task_id="whole-1", state="finished", at=start + 1_000.0))
        reference = await remembered(bus, task_signature(uninterrupted))

    interrupted = task("resumed-1")
    async with one_replica(nats_server.url, checkpoint_s=0.2 if stop == "crash" else 60.0) as (host, bus, seen):
        await bus.publish(interrupted)
        await asyncio.sleep(0.5)
        await feed(bus, "resumed-1", start, times[:cut])
        await samples_taken(bus, seen, "sync-resumed-1a")
        if stop == "crash":
            await checkpointed(bus, "resumed-1", cut)
            host._stopping_hooks.clear()  # noqa: SLF001 - killed: what a clean stop writes is not written
    async with one_replica(nats_server.url) as (_, bus, seen):
        await feed(bus, "resumed-1", start, times[cut:])
        await samples_taken(bus, seen, "sync-resumed-1b")
        await bus.publish(TaskLifecycle(task_id="resumed-1", state="finished", at=start + 1_000.0))
        taught = await remembered(bus, task_signature(interrupted))
        # Learnt, its run's checkpoint is gone.
        assert await wait_for(lambda: _gone(bus, "resumed-1"), what="the learnt run's checkpoint deleted")

    assert len(reference.envelope_mb) == 20 and reference.envelope_mb[-1] >= 22_000, reference
    assert msgspec.structs.replace(taught, signature="", learnt_runs=()) == msgspec.structs.replace(
        reference, signature="", learnt_runs=())


async def _gone(bus: NatsBus, key: str) -> bool:
    return await (await bus.kv("fingerprint_series")).get(key) is None


async def test_a_run_whose_end_a_crashed_replica_had_taken_is_learnt_from_its_checkpoint_with_its_envelope(
    nats_server,
):
    # Learnt from the samples the server keeps (its last 5 minutes), the run was a series that
    # did not begin with it: no envelope. Its checkpoint holds the series from its start.
    submitted = task("crashed-2")
    start = now()
    async with one_replica(nats_server.url, end_grace_s=60.0, checkpoint_s=0.2) as (host, bus, seen):
        await bus.publish(submitted)
        await asyncio.sleep(0.5)
        await feed(bus, "crashed-2", start, np.arange(0.0, 1_000.0, 10.0))
        await samples_taken(bus, seen, "sync-crashed-2")
        await checkpointed(bus, "crashed-2", 100)
        await bus.publish(TaskLifecycle(task_id="crashed-2", state="finished", at=start + 1_000.0))
        consumer = bus._js.consumer_info  # noqa: SLF001 - what the server says it has delivered

        async def end_taken() -> bool:
            info = await consumer("TASKS", "fingerprinter-lifecycle")
            return info.num_pending == 0 and info.num_ack_pending == 0

        await wait_for(end_taken, what="the run's end taken")
        host._stopping_hooks.clear()  # noqa: SLF001 - it crashes within the run's grace
    async with one_replica(nats_server.url) as (host, bus, seen):
        stats = await remembered(bus, task_signature(submitted))
        assert stats.count == 1 and len(stats.envelope_mb) == 20, stats
        assert stats.envelope_mb[0] < 11_000 and stats.envelope_mb[-1] > 22_000, stats
        assert await wait_for(lambda: _gone(bus, "crashed-2"), what="the learnt run's checkpoint deleted")


async def test_a_run_silent_past_the_forget_limit_is_not_restored_and_its_checkpoint_goes(nats_server):
    start = now()
    async with one_replica(nats_server.url) as (host, bus, seen):
        await bus.publish(task("quiet-1"))
        await asyncio.sleep(0.5)
        await feed(bus, "quiet-1", start, np.arange(0.0, 400.0, 10.0))
        await samples_taken(bus, seen, "sync-quiet-1")
    probe = await NatsBus.connect(nats_server.url, "probe")
    assert not await _gone(probe, "quiet-1")  # written when its replica stopped
    await probe.drain()
    await asyncio.sleep(1.5)
    # Started again after longer than its runs may stay silent: they would be forgotten at once.
    async with one_replica(nats_server.url, silent_forget_s=1.0) as (host, bus, seen):
        assert registry_of(host)("modelled") == 0
        assert await wait_for(lambda: _gone(bus, "quiet-1"), what="the silent run's checkpoint deleted")


def test_a_run_s_checkpoint_outlives_the_default_silence_after_which_it_would_not_be_restored():
    # A checkpoint is written only when its run changed: one that expired while its run was
    # silent, but not yet forgotten, would be lost to a restart in between.
    ttl_s = next(bucket.ttl_s for bucket in BUCKETS if bucket.name == "fingerprint_series")
    defaults = FingerprinterSettings.model_fields
    assert ttl_s >= defaults["silent_forget_s"].default + defaults["checkpoint_s"].default


async def test_a_replica_restores_the_runs_of_the_tasks_it_owns_whatever_count_wrote_them(nats_server):
    # Rescaled from one replica to two: each new one takes on its own share of the runs.
    start = now()
    tasks = [f"share-{i}" for i in range(8)]
    async with one_replica(nats_server.url) as (_, bus, seen):
        for task_id in tasks:
            await bus.publish(task(task_id))
        await asyncio.sleep(0.5)
        for task_id in tasks:
            await feed(bus, task_id, start, np.arange(0.0, 100.0, 10.0))
        await samples_taken(bus, seen, "sync-share")
    probe = await NatsBus.connect(nats_server.url, "probe")
    kv = await probe.kv("fingerprint_series")
    written = {msgspec.json.decode((await kv.get(key)).value)["task_id"] for key in await kv.keys()}
    await probe.drain()
    assert set(tasks) <= written
    mine = {task_id for task_id in written if partition_of(task_id, 2) == 1}
    assert 0 < len(mine & set(tasks)) < len(tasks)  # the test shares them out
    async with one_replica(nats_server.url, partitions=2, partition=1) as (host, bus, seen):
        assert registry_of(host)("modelled") == len(mine)


async def test_a_run_stopped_to_be_restored_keeps_across_a_restart_of_its_replica_what_it_held_before(nats_server):
    # Evicted, a run's model starts afresh with no sample; only beside it are what it held
    # before and when it stopped. Its checkpoint was deleted as a run with no series, so a
    # replica restarted while the task waited to be restored (hours, for eight big GPUs) lost
    # both: the run taught the peak of its restored process alone (a leak that starts over
    # lower: half what it needed), and its restore went uncounted.
    submitted = task("moved-1")
    start = now() - 1_000.0
    async with one_replica(nats_server.url) as (host, bus, seen):
        await bus.publish(submitted)
        await asyncio.sleep(0.5)
        for t in np.arange(0.0, 300.0, 10.0):  # 5 GB to 30 GB
            await bus.publish(TaskTelemetry(task_id="moved-1", node="n1", gpus=[0], at=start + float(t),
                                            memory_used_mb=5_000.0 + 25_000.0 * float(t) / 290.0))
        await samples_taken(bus, seen, "sync-moved-1a")
        await bus.publish(TaskLifecycle(task_id="moved-1", state="evicted", node="n1", at=start + 300.0))
        await asyncio.sleep(1.0)  # the eviction handled (JetStream, its own consumer)
    # Stopped cleanly: its runs in progress written; then started again, restored from them.
    async with one_replica(nats_server.url) as (host, bus, seen):
        for t in np.arange(400.0, 700.0, 10.0):  # restored lower: 5 GB to 15 GB
            await bus.publish(TaskTelemetry(task_id="moved-1", node="n2", gpus=[0], at=start + float(t),
                                            memory_used_mb=5_000.0 + 10_000.0 * (float(t) - 400.0) / 290.0))
        await samples_taken(bus, seen, "sync-moved-1b")
        await bus.publish(TaskLifecycle(task_id="moved-1", state="finished", node="n2", at=start + 700.0))
        kv = await bus.kv("fingerprints")

        async def learnt() -> SignatureStats | None:
            entry = await kv.get(task_signature(submitted))
            stats = msgspec.json.decode(entry.value, type=SignatureStats) if entry is not None else None
            return stats if stats is not None and stats.count else None  # its restore is written first

        stats = await wait_for(learnt, what="the run learnt")
    assert stats.run_peaks_mb == (30_000.0,)
    assert (stats.restores_kept, stats.restores_reset) == (0, 1)

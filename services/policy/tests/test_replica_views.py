"""What every policy replica must see for itself, over a real nats-server: each one places
by every task's fingerprint, not only by the ones the shared consumer happened to hand it."""

from __future__ import annotations

from fleetpilot.contracts import Fingerprint, TaskFingerprinted, encode, now
from fleetpilot_services.policy.service import build

from .conftest import admitted, fingerprinted, fingerprints_taken, node, settings, wait_for

PEAK_MB = 60_000


def flat(peak_mb: float) -> Fingerprint:
    """``grow``'s fingerprint: a flat run that peaks at ``peak_mb``."""
    return Fingerprint(signature="sig-grow", pattern="flat", pattern_confidence=0.9, growth_rate_mb_per_s=0.0,
                       predicted_peak_mb=peak_mb, peak_low_mb=peak_mb - 500, peak_high_mb=peak_mb + 500, samples=50)


async def test_a_replica_started_after_a_fingerprint_was_published_places_by_it(observer, nats_url, tmp_path):
    """Replica ``a`` takes ``grow``'s fingerprint (a 60 GB peak, asking 20 GB); then ``b``
    starts and ``a`` stops, and ``b`` decides the admission. The fingerprints went to one
    replica of the shared consumer, so ``b`` held 20 GB for the task (the 40 GB GPU was as
    good a place as any), and it would be OOM-killed wherever its neighbours filled the rest;
    every replica now reads every fingerprint (its own consumer, replaying the recent past
    when first made)."""
    await observer.put_fleet([node("big", gpus=1), node("small", gpus=1, model="A100-40GB", memory_mb=40_960)])
    fp = flat(PEAK_MB)
    a = build(settings(nats_url, tmp_path / "a", replica="a", profile="bestfit"))
    await a.start()
    b = None
    try:
        await fingerprinted(observer, {"grow": fp}, replica="a")
        b = build(settings(nats_url, tmp_path / "b", replica="b", profile="bestfit"))
        await b.start()
        await a.stop()
        a = None
        await observer.js.publish("task.admitted", encode(admitted("grow", gpu_milli=1000, gpu_memory_mb=20_000)))
        await wait_for(lambda: observer.decisions, what="grow's decision")
    finally:
        for host in (a, b):
            if host is not None:
                await host.stop()
    decision = observer.decisions[0]
    # Held for its predicted peak (the ask was 20 GB), on the only GPU that holds it.
    assert decision.action == "assign", decision.reason
    assert [(p.node, p.memory_mb >= PEAK_MB) for p in decision.placement] == [("big", True)], decision.reason


async def test_an_older_fingerprint_delivered_late_does_not_replace_a_newer_one(observer, nats_url, tmp_path):
    """``grow`` was fingerprinted at 60 GB; a copy of an earlier fingerprint (10 GB) comes
    after it, as a redelivery does. The newer one must stand: the task is held for 60 GB."""
    await observer.put_fleet([node("big", gpus=1), node("small", gpus=1, model="A100-40GB", memory_mb=40_960)])
    policy = build(settings(nats_url, tmp_path, profile="bestfit"))
    await policy.start()
    try:
        newer = now()
        for peak, at in ((PEAK_MB, newer), (10_000, newer - 60)):
            ack = await observer.js.publish("task.fingerprinted", encode(
                TaskFingerprinted(task_id="grow", fingerprint=flat(peak), source="observed", at=at)))
        await fingerprints_taken(observer, ack.seq)
        await observer.js.publish("task.admitted", encode(admitted("grow", gpu_milli=1000, gpu_memory_mb=20_000)))
        await wait_for(lambda: observer.decisions, what="grow's decision")
    finally:
        await policy.stop()
    assert [p.memory_mb >= PEAK_MB for p in observer.decisions[0].placement] == [True], observer.decisions[0].reason

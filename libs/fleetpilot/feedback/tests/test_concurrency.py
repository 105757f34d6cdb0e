"""The concurrency proof: 8 writers x 1,000 records with overlapping keys and shared ids.

Every record must be stored exactly once and every incrementally maintained aggregate must
equal a recomputation from the raw rows, and from the ground truth we generated.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
from fleetpilot.contracts import FeedbackRecorded, Measured
from fleetpilot.feedback import (
    KEY_FIELDS,
    PostgresFeedbackStore,
    SqliteFeedbackStore,
    recompute,
    row_from_event,
)
from fleetpilot.feedback.store import FeedbackStore
from fleetpilot.feedback.synthetic import writer_stream

WRITERS = 8
PER_WRITER = 1_000
GROUPINGS = [KEY_FIELDS, ("policy", "shard_id"), ("task_kind", "gpu_model"), ()]


async def _prove(store: FeedbackStore) -> dict[str, float]:
    streams = [writer_stream(w, PER_WRITER, seed=42, shared_every=10) for w in range(WRITERS)]
    # Writers run shared ids in different orders so they genuinely race on them.
    for w, stream in enumerate(streams):
        if w % 2:
            stream.reverse()

    async def write(stream: list) -> int:
        return sum([await store.record(e) for e in stream])

    started = time.perf_counter()
    inserted = await asyncio.gather(*(write(s) for s in streams))
    elapsed = time.perf_counter() - started

    truth = {e.action_id: e for s in streams for e in s}
    assert sum(inserted) == len(truth)  # each shared id accepted by exactly one writer
    assert len(truth) == WRITERS * PER_WRITER - (WRITERS - 1) * (PER_WRITER // 10)

    stored = [e async for e in store.raw()]
    assert len(stored) == len(truth)
    assert {e.action_id: e for e in stored} == truth

    raw_rows = [row_from_event(e) for e in stored]
    truth_rows = [row_from_event(e) for e in truth.values()]
    for by in GROUPINGS:
        incremental = await store.aggregates(by)
        assert incremental == recompute(raw_rows, by), by
        assert incremental == recompute(truth_rows, by), by
    assert len(await store.aggregates()) > 50  # many keys, each written by many writers
    return {"seconds": elapsed, "records_per_s": WRITERS * PER_WRITER / elapsed}


def late_latency(action_id: str) -> Measured:
    """The latency a late result brings for ``action_id`` (the same for every writer)."""
    return Measured(value=1.0 + sum(action_id.encode()) % 997 / 7, uncertainty_score=0.05)


def late_saving(action_id: str) -> float:
    """The GPU memory a late result says its placement left to other work, if it succeeded."""
    return float(sum(action_id.encode()) % 40_000)


def unmeasured(event: FeedbackRecorded) -> bool:
    """Whether ``event`` was stored with its latency unknown (weight 0): amendable."""
    return row_from_event(event).weight_units == 0


async def _prove_amendments(store: FeedbackStore) -> int:
    """As ``_prove``, each writer amending every record it just stored with its latency
    unknown: amendments race with records of the same keys and, for the shared ids, with
    the seven other writers' amendments of the same row. Returns how many were amended."""
    streams = [writer_stream(w, PER_WRITER // 2, seed=43, shared_every=10) for w in range(WRITERS)]
    for w, stream in enumerate(streams):
        if w % 2:
            stream.reverse()

    async def write(stream: list) -> int:
        amended = 0
        for event in stream:
            await store.record(event)  # stored by now, by this writer or another
            if unmeasured(event):
                amended += await store.amend_late_result(event.action_id, late_latency(event.action_id),
                                                         late_saving(event.action_id)) is not None
        return amended

    amended = await asyncio.gather(*(write(s) for s in streams))

    truth = {e.action_id: e for s in streams for e in s}
    blind = [a for a, e in truth.items() if unmeasured(e)]
    assert sum(amended) == len(blind) > 100  # each row amended exactly once
    truth = {a: msgspec.structs.replace(e, latency_ms=late_latency(a),
                                        resource_saving_mb=late_saving(a) if e.outcome == "success"
                                        else e.resource_saving_mb) if a in blind else e
             for a, e in truth.items()}
    stored = {e.action_id: e async for e in store.raw()}
    assert stored == truth
    raw_rows = [row_from_event(e) for e in stored.values()]
    truth_rows = [row_from_event(e) for e in truth.values()]
    for by in GROUPINGS:
        incremental = await store.aggregates(by)
        assert incremental == recompute(raw_rows, by), by
        assert incremental == recompute(truth_rows, by), by
    return len(blind)


async def test_postgres_concurrent_writers(pg_store: PostgresFeedbackStore) -> None:
    figures = await _prove(pg_store)
    print(f"postgres: {figures}, serialization retries: {pg_store.retries}")
    assert pg_store.retries > 0, "writers never conflicted: the proof did not exercise SERIALIZABLE retries"


async def test_postgres_concurrent_amendments(pg_store: PostgresFeedbackStore) -> None:
    amended = await _prove_amendments(pg_store)
    print(f"postgres: {amended} amended, serialization retries: {pg_store.retries}")
    assert pg_store.retries > 0


async def test_sqlite_concurrent_writers(tmp_path: Path) -> None:
    # Two store objects on one file: two connections, as two replicas would have.
    first, second = SqliteFeedbackStore(tmp_path / "c.db"), SqliteFeedbackStore(tmp_path / "c.db")

    class Alternating:
        """Sends each writer's records through one of the two connections."""

        def __init__(self) -> None:
            self.n = 0

        async def record(self, event) -> bool:  # type: ignore[no-untyped-def]
            self.n += 1
            return await (first if self.n % 2 else second).record(event)

        async def amend_late_result(self, action_id, latency, saving):  # type: ignore[no-untyped-def]
            self.n += 1
            return await (first if self.n % 2 else second).amend_late_result(action_id, latency, saving)

        def raw(self):  # type: ignore[no-untyped-def]
            return first.raw()

        async def aggregates(self, by=KEY_FIELDS):  # type: ignore[no-untyped-def]
            return await second.aggregates(by)

        async def close(self) -> None:
            await first.close()
            await second.close()

    store = Alternating()
    try:
        figures = await _prove(store)  # type: ignore[arg-type]
        print(f"sqlite: {figures}")
    finally:
        await store.close()


async def test_sqlite_concurrent_amendments(tmp_path: Path) -> None:
    # Two connections on one file, as in the records' proof.
    first, second = SqliteFeedbackStore(tmp_path / "a.db"), SqliteFeedbackStore(tmp_path / "a.db")
    turn = iter(range(10**9))

    class Alternating:
        """Sends each call through one of the two connections in turn."""

        async def record(self, event) -> bool:  # type: ignore[no-untyped-def]
            return await (first if next(turn) % 2 else second).record(event)

        async def amend_late_result(self, action_id, latency, saving):  # type: ignore[no-untyped-def]
            return await (first if next(turn) % 2 else second).amend_late_result(action_id, latency, saving)

        def raw(self):  # type: ignore[no-untyped-def]
            return first.raw()

        async def aggregates(self, by=KEY_FIELDS):  # type: ignore[no-untyped-def]
            return await second.aggregates(by)

    try:
        print(f"sqlite: {await _prove_amendments(Alternating())} amended")  # type: ignore[arg-type]
    finally:
        await first.close()
        await second.close()


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-s"])

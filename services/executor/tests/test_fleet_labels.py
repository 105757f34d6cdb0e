"""The executor's GPU labels in the ``topology`` bucket change the labels and nothing else of
a node's entry: members it does not own (the topology service's ``applied_report``, a field
of a newer contract) stay."""

from __future__ import annotations

import asyncio

import msgspec
from fleetpilot.contracts import NodeTopology
from fleetpilot.runtime.memory import InMemoryBus
from fleetpilot_services.executor.fleet_labels import FleetLabels

# The member the topology service keeps in each entry: the place of the report that wrote it
# (its stream sequence and the server's time), which keeps a late report from overwriting a
# newer one. Written here as it lies in the bucket: the executor does not import the service.
PLACE = {"sequence": 41, "stored_at": 1_700_000_123.25}


def stored_entry(*, labels: dict[str, str] | None = None, place: dict = PLACE) -> dict:
    """n1's entry as the topology service writes it, with a member of a newer contract on
    the node and on a GPU besides its ``applied_report``."""
    return {
        "node": "n1",
        "site": "west",
        "gpus": [
            {"index": 0, "model": "H100", "uuid": "GPU-a", "memory_mb": 81920, "labels": {}, "ecc_mode": "on"},
            {"index": 1, "model": "H100", "uuid": "GPU-b", "memory_mb": 81920, "labels": labels or {}},
        ],
        "labels": {"rack": "r7"},
        "power_domain": "pdu-3",
        "applied_report": place,
    }


async def test_a_label_write_keeps_the_members_of_the_entry_it_does_not_own() -> None:
    kv = await InMemoryBus().kv("topology")
    await kv.put("n1", msgspec.json.encode(stored_entry()))
    labels = FleetLabels(kv)
    await labels.load()

    assert await labels.set("n1", 1, {"cordoned": "true"}, uuid="GPU-b")

    written = msgspec.json.decode((await kv.get("n1")).value)
    # Re-encoded from the decoded NodeTopology, the write dropped applied_report: until the
    # node's next changed report, a late report could overwrite a newer one.
    assert written == stored_entry(labels={"cordoned": "true"})
    assert written["applied_report"] == PLACE
    topo = msgspec.json.decode((await kv.get("n1")).value, type=NodeTopology)
    assert [(g.uuid, g.labels) for g in topo.gpus] == [("GPU-a", {}), ("GPU-b", {"cordoned": "true"})]
    assert labels.labels_of("n1", 1, uuid="GPU-b") == {"cordoned": "true"}


async def test_labels_put_back_after_a_rewrite_keep_the_rewrite_s_report_place() -> None:
    """The topology service rewrites the entry from a newer report, dropping the labels; the
    replica puts them back, and the entry still says which report wrote it."""
    kv = await InMemoryBus().kv("topology")
    await kv.put("n1", msgspec.json.encode(stored_entry()))
    labels = FleetLabels(kv)
    await labels.load()
    assert await labels.set("n1", 1, {"cordoned": "true"}, uuid="GPU-b")
    follower = asyncio.create_task(labels.follow())
    try:
        newer = {"sequence": 97, "stored_at": 1_700_000_400.5}
        await kv.put("n1", msgspec.json.encode(stored_entry(place=newer)))  # the labels dropped
        deadline = asyncio.get_running_loop().time() + 5
        while True:
            written = msgspec.json.decode((await kv.get("n1")).value)
            if written["gpus"][1]["labels"]:
                break
            assert asyncio.get_running_loop().time() < deadline, "the labels were never put back"
            await asyncio.sleep(0.01)
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
    assert written == stored_entry(labels={"cordoned": "true"}, place=newer)

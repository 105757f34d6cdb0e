"""``fleetpilot queue`` over a real nats-server: the tasks in the policy's ``pending`` bucket,
longest waiting first, with what kept them off every node."""

from __future__ import annotations

import asyncio
import io
import json
import time
from types import SimpleNamespace

from fleetpilot.cli.main import main as cli_main
from fleetpilot.cli.queue_cmd import main
from fleetpilot.contracts import Contract, TaskAdmitted, TaskSubmitted
from fleetpilot.policy.preempt import NoRoom, Requeue, claim_pending, encode_pending, with_no_room


def admission(task_id: str, waited_s: float, *, tier: str = "standard", gpu_milli: int = 1000,
              gpus: int = 1) -> TaskAdmitted:
    return TaskAdmitted(task=TaskSubmitted(task_id=task_id, gpus=gpus, gpu_milli=gpu_milli),
                        contract=Contract(tier=tier), tenant="acme", admitted_at=time.time() - waited_s)


def show(nats_url: str, *, as_json: bool = False) -> str:
    out = io.StringIO()
    assert main(SimpleNamespace(nats_url=nats_url, state_dir=None, json=as_json), out=out) == 0
    return out.getvalue()


async def test_the_waiting_tasks_longest_first_with_what_kept_them_off_every_node(nats_client, nats_url):
    kv = await nats_client.jetstream().key_value("pending")
    refused = NoRoom(shortfall="0 of 3 nodes: 2 lack free GPUs, 1 lack free GPU memory", at=time.time() - 20)
    await kv.put("big", with_no_room(encode_pending(admission("big", 300, gpus=2)), refused))
    # Checkpointed 90 s ago and queued again, being placed by a replica right now.
    note = Requeue(decision_id="ckpt.assign.2", reason="checkpoint: predicted OOM in place", at=time.time() - 90)
    await kv.put("ckpt", claim_pending(encode_pending(admission("ckpt", 4000, tier="best_effort", gpu_milli=500), note),
                                       time.time()))
    # Not tried by the latest round: "big", which asks no more, found no node in it.
    like_big = NoRoom(shortfall=refused.shortfall, at=time.time() - 3, like="big")
    await kv.put("fresh", with_no_room(encode_pending(admission("fresh", 5)), like_big))
    await kv.put("junk", b"{not json")
    await kv.put("gone", encode_pending(admission("gone", 9000)))
    await kv.delete("gone")  # placed: its entry deleted

    lines = (await asyncio.to_thread(show, nats_url)).splitlines()
    assert lines[0] == "4 tasks waiting, longest first"
    assert lines[1].startswith("big (acme, standard, 2 GPUs): waiting 5 min 0 s, queued on admission"), lines[1]
    assert lines[2] == ("  no room at the latest try, 20 s ago: 0 of 3 nodes: 2 lack free GPUs, "
                        "1 lack free GPU memory")
    # Its wait counts from when it was queued again, not from its admission.
    assert lines[3] == ("ckpt (acme, best_effort, 500m of a GPU): waiting 1 min 30 s, queued again: checkpoint: "
                        "predicted OOM in place; a policy replica is placing it now")
    assert lines[4] == "  no refusal recorded since it was queued"
    assert lines[5].startswith("fresh (acme, standard, 1 GPU): waiting 5 s")
    assert lines[6] == ("  no room at the latest look, 3 s ago (not tried: big, which asks no more, found none): "
                        "0 of 3 nodes: 2 lack free GPUs, 1 lack free GPU memory")
    assert lines[7].startswith("junk: unreadable entry:")

    rows = json.loads(await asyncio.to_thread(show, nats_url, as_json=True))["waiting"]
    assert [r.get("task_id", r.get("key")) for r in rows] == ["big", "ckpt", "fresh", "junk"]
    assert rows[0]["no_room"] == refused.shortfall and 19 <= rows[0]["no_room_age_s"] <= 30
    assert rows[1]["placing"] and rows[1]["queued_again"] == note.reason
    assert (rows[0]["no_room_like"], rows[2]["no_room_like"]) == (None, "big")


async def test_an_empty_queue_and_a_fleet_with_no_queue_yet_say_so(nats_client, nats_url):
    assert await asyncio.to_thread(show, nats_url) == "no task is waiting\n"
    await nats_client.jetstream().delete_key_value("pending")
    assert await asyncio.to_thread(show, nats_url) == "no task is waiting\n"


def test_no_bus_is_one_line(capsys):
    assert cli_main(["queue", "--nats-url", "nats://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fleetpilot queue: cannot connect to NATS at nats://127.0.0.1:1") and "Traceback" not in err

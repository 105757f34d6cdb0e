"""A refused message too large to dead-letter whole (its bytes, base64 in the letter, pass the
server's max payload) is still dead-lettered and settled, not redelivered for ever."""

from __future__ import annotations

import asyncio

from fleetpilot.contracts import DeadLetter, TaskSubmitted, decode
from fleetpilot.runtime import ServiceHost, ServiceSettings
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually as wait_for


async def test_a_message_too_large_for_a_whole_dead_letter_is_dead_lettered_cut_and_settled(nats_server):
    # 900 KB fit the server's 1 MB; as a letter (base64, 1.2 MB) they did not: the letter's
    # publish failed at every delivery, the message stayed unsettled and came back after each
    # ack wait, for ever, with a traceback in the log each time.
    host = ServiceHost("sla", ServiceSettings(nats_url=nats_server.url, metrics_port=-1))
    handled: list[str] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def admit(task: TaskSubmitted) -> None:
        handled.append(task.task_id)

    client = await NatsBus.connect(nats_server.url, "client")
    letters: list[DeadLetter] = []

    async def on_letter(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await host.start()
    try:
        await client.subscribe("dlq.>", on_letter)
        original = b"{" + b"x" * 900_000  # never JSON
        await client.publish_raw("task.submitted", original, headers={"Nats-Msg-Id": "big-1", "origin": "test"})
        await wait_for(lambda: letters, timeout_s=10, what="the large message dead-lettered")
        js = client._js
        info = await js.consumer_info("TASKS", "sla-submitted")
        stored = await js.get_msg("TASKS", seq=1)
        await asyncio.sleep(0.5)
    finally:
        await host.stop()
        await client.drain()
    [letter] = letters
    assert (letter.subject, letter.reason, letter.deliveries) == ("task.submitted", "undecodable", 1)
    assert letter.headers["origin"] == "test"
    assert 0 < len(letter.data) < len(original) and original.startswith(letter.data)
    assert "900001 bytes" in letter.error and "stream TASKS at sequence 1" in letter.error
    assert (letter.truncated, letter.original_at) == (True, "TASKS:1")
    assert info.num_ack_pending == 0 and info.num_redelivered == 0  # settled, not left to come back
    assert stored.data == original  # the whole is where the letter says
    assert handled == []

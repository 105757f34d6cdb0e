"""``fleetpilot dead-letters``: list what the services refused, and send it back once."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

import pytest
from fleetpilot.cli.main import main
from fleetpilot.contracts import DeadLetter, TaskSubmitted, encode
from fleetpilot.contracts.catalog import dlq_subject, stream_of
from fleetpilot.runtime.nats_bus import NatsBus

TASK = encode(TaskSubmitted(task_id="t1", gpus=1, gpu_memory_mb=8000, submitted_at=1.0))


async def _put_letters(url: str) -> None:
    bus = await NatsBus.connect(url, "dead-letters-test")
    await bus.ensure_topology()
    letters = [
        DeadLetter(subject="task.submitted", reason="rejected", error="sizes must be >= 0", service="sla",
                   headers={"Nats-Msg-Id": "orig-1", "traceparent": "00-abc-def-01"}, data=TASK, at=1.0),
        # Of a subject no stream keeps (a plugin's own, say): sent back, nothing would hold it.
        DeadLetter(subject="plugin.audit.t9", reason="failed", error="timeout", service="policy",
                   deliveries=5, data=b'{"type": "plugin.audit.v1"}', at=2.0),
    ]
    for letter in letters:
        await bus.publish_raw(dlq_subject(letter.subject), encode(letter))
    await bus.publish_raw("dlq.decision.made", b"\xff not a dead letter")
    await bus.drain()


async def _stored(url: str, stream: str, subject: str) -> list:
    bus = await NatsBus.connect(url, "dead-letters-test")
    try:
        return [m async for m in bus.stream_messages(stream, subject)]
    finally:
        await bus.drain()


def run(argv: list[str]) -> tuple[int, str, str]:
    """``fleetpilot ARGV`` in-process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exit_:
            rc = exit_.code
    return rc, out.getvalue(), err.getvalue()


def test_dead_letters_are_listed_with_their_reason_and_filtered(nats_url) -> None:
    asyncio.run(_put_letters(nats_url))
    rc, out, err = run(["dead-letters", "--nats-url", nats_url])
    lines = out.splitlines()
    assert rc == 0 and err == "3 dead letters\n"
    assert lines[0].endswith("#1  sla  task.submitted  rejected: sizes must be >= 0")
    assert lines[1].endswith("#2  policy  plugin.audit.t9  failed: timeout  (5 deliveries)")
    assert lines[2].endswith("#3  (not a dead letter: cannot be read or sent back)")
    rc, out, _ = run(["dead-letters", "--nats-url", nats_url, "--service", "sla", "--json"])
    (shown,) = [json.loads(line) for line in out.splitlines()]
    assert (shown["subject"], shown["data"]["task_id"]) == ("task.submitted", "t1")
    rc, out, _ = run(["dead-letters", "plugin.>", "--nats-url", nats_url, "--limit", "1"])
    assert [line.split("  ")[1] for line in out.splitlines()] == ["#2"]
    rc, out, _ = run(["dead-letters", "--nats-url", nats_url, "--limit", "2"])
    assert [line.split("  ")[1] for line in out.splitlines()] == ["#2", "#3"]  # the latest two
    rc, out, err = run(["dead-letters", "--nats-url", nats_url, "--since", "1h"])
    assert len(out.splitlines()) == 3  # stored just now
    for span in ("60000000d", "1e20d"):  # back past 1970: all kept (was a traceback, or exit 2)
        rc, out, err = run(["dead-letters", "--nats-url", nats_url, "--since", span])
        assert (rc, len(out.splitlines()), err) == (0, 3, "3 dead letters\n"), err


def test_redrive_sends_each_original_back_once_and_keeps_what_no_stream_takes(nats_url) -> None:
    asyncio.run(_put_letters(nats_url))
    rc, _, err = run(["dead-letters", "--nats-url", nats_url, "--redrive"])
    assert rc == 1, err  # two could not be sent back, and it says so
    assert "#2: not sent back: no stream takes plugin.audit.t9" in err
    assert "#3: not sent back: not a dead letter" in err
    assert err.endswith("sent back 1, left 2\n")
    tasks = asyncio.run(_stored(nats_url, stream_of("task.submitted"), "task.submitted"))
    assert [(m.data, m.headers.get("traceparent"), m.headers.get("Nats-Msg-Id")) for m in tasks] == [
        (TASK, "00-abc-def-01", "redrive-dlq-1")]  # the original bytes; not its old id, inside the window
    left = asyncio.run(_stored(nats_url, "DLQ", "dlq.>"))
    assert [m.sequence for m in left] == [2, 3]
    rc, _, err = run(["dead-letters", "--nats-url", nats_url, "--redrive"])  # again: nothing twice
    assert err.endswith("sent back 0, left 2\n")
    assert len(asyncio.run(_stored(nats_url, stream_of("task.submitted"), "task.submitted"))) == 1


def test_a_letter_two_patterns_match_is_shown_once_and_the_limit_keeps_the_newest(nats_url) -> None:
    asyncio.run(_put_letters(nats_url))
    # #1 is task.submitted, #2 plugin.audit.t9: both patterns match #1. It was listed and
    # counted twice; and --limit 1 kept the last pattern's letter, #1, not the newest, #2.
    rc, out, err = run(["dead-letters", "plugin.>", "task.submitted", ">", "--nats-url", nats_url])
    assert rc == 0 and [line.split("  ")[1] for line in out.splitlines()] == ["#1", "#2", "#3"]
    assert err == "3 dead letters\n"
    rc, out, _ = run(["dead-letters", "plugin.>", "task.submitted", "--nats-url", nats_url, "--limit", "1"])
    assert [line.split("  ")[1] for line in out.splitlines()] == ["#2"]


def test_a_bus_no_service_has_run_on_has_no_dead_letters_in_one_line(nats_url) -> None:
    # A JetStream server without the DLQ stream: was a traceback (NotFoundError), exit 1.
    for argv in ([], ["--redrive"], ["--json"]):
        rc, out, err = run(["dead-letters", *argv, "--nats-url", nats_url])
        assert (rc, out) == (0, "") and err == f"no dead letters at {nats_url}: it has no DLQ stream " \
                                              "(no Fleetpilot service has run there)\n", err


@pytest.mark.parametrize("since", ["5x", "0m", "-1h", "nanh", "h"])
def test_a_bad_span_is_one_line(since) -> None:
    rc, out, err = run(["dead-letters", "--since", since])
    assert rc == 2 and out == "" and err.count("\n") == 1 and "--since" in err, err


async def _dead_letter_a_large_message(url: str, original: bytes) -> None:
    """A service refuses ``original`` (too large for a whole letter) and dead-letters it cut."""
    from fleetpilot.runtime import ServiceHost, ServiceSettings
    from fleetpilot.runtime.testing import eventually

    host = ServiceHost("sla", ServiceSettings(nats_url=url, metrics_port=-1))

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def admit(task: TaskSubmitted) -> None:
        raise AssertionError("never decodes")

    await host.start()
    bus = await NatsBus.connect(url, "dead-letters-test")
    try:
        await bus.publish_raw("task.submitted", original, headers={"Nats-Msg-Id": "big-1", "origin": "test"})

        async def letters() -> list:
            return [m async for m in bus.stream_messages("DLQ", "dlq.>")]

        await eventually(letters, timeout_s=10, what="the large message dead-lettered")
    finally:
        await host.stop()
        await bus.drain()


def test_a_letter_holding_only_its_original_s_start_is_sent_back_whole_from_its_stream(nats_url) -> None:
    # A message too large for a whole dead letter keeps only its start in the letter. Sent back
    # as the letter held it, it was refused again as cut short: the whole is sent from where
    # its stream keeps it, with its own headers.
    original = b"{" + b"x" * 900_000  # never JSON: refused as undecodable
    asyncio.run(_dead_letter_a_large_message(nats_url, original))
    rc, out, _ = run(["dead-letters", "--nats-url", nats_url, "--json"])
    (shown,) = [json.loads(line) for line in out.splitlines()]
    assert "900001 bytes" in shown["error"]
    rc, _, err = run(["dead-letters", "--nats-url", nats_url, "--redrive"])
    assert (rc, err) == (0, "sent back 1, left 0\n"), err
    tasks = asyncio.run(_stored(nats_url, "TASKS", "task.submitted"))
    assert [(m.data, m.headers.get("origin"), m.headers.get("Nats-Msg-Id")) for m in tasks] == [
        (original, "test", "big-1"), (original, "test", "redrive-TASKS:1")]  # by its original's place


def test_a_cut_letter_whose_original_is_gone_is_not_sent_back_and_says_why(nats_url) -> None:
    async def put() -> None:
        bus = await NatsBus.connect(nats_url, "dead-letters-test")
        await bus.ensure_topology()
        letter = DeadLetter(subject="task.submitted", reason="undecodable", service="sla", data=b"{xx",
                            at=1.0, truncated=True, original_at="TASKS:41")
        await bus.publish_raw(dlq_subject(letter.subject), encode(letter))
        await bus.drain()

    asyncio.run(put())
    rc, _, err = run(["dead-letters", "--nats-url", nats_url, "--redrive"])
    assert rc == 1
    assert ("#1: not sent back: the letter holds only the start of its original, and stream TASKS no longer "
            "holds sequence 41") in err
    assert asyncio.run(_stored(nats_url, "TASKS", "task.submitted")) == []

"""``fleetpilot dead-letters``: what the services could not take, and sending it back.

Every message a service refuses (malformed, rejected, or failing past its deliveries) is
kept whole on ``dlq.<subject>`` for 30 days, with the reason. This lists them, newest last,
and with ``--redrive`` publishes each one's original bytes and headers to its subject again
(once the cause is fixed: a producer's bug, a consumer's), then removes it from the
dead letters. A message that several services refused (``task.submitted`` has two
consumers) has a letter from each, and is sent back once: its subject takes it to every one
of them again, and the letters of all of them are removed. A redriven message is
de-duplicated by its place in its stream (else by its dead letter's sequence), so a redrive
cut short and run again publishes nothing twice. A message no stream takes (core NATS
telemetry, whose moment has passed) is left where it is.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec

from fleetpilot.contracts import DeadLetter, decode
from fleetpilot.contracts.catalog import DLQ_PREFIX
from fleetpilot.runtime.bus import StoredMessage
from fleetpilot.runtime.nats_bus import NatsBus

from . import event_loop
from .arguments import add_bus_arguments, duration, non_negative_int, subject_pattern
from .local import local_nats_url, no_jetstream

DLQ_STREAM = "DLQ"


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot dead-letters``."""
    parser.add_argument("subjects", nargs="*", type=subject_pattern, default=[">"],
                        help="original subjects to show (wildcards allowed; default: all)")
    parser.add_argument("--since", type=duration, default=None,
                        help="only those dead-lettered within this span (90s, 30m, 2h, 7d; default: all kept)")
    parser.add_argument("--service", default="", help="only those a given service refused (sla, policy, ...)")
    parser.add_argument("--limit", type=non_negative_int, default=100,
                        help="the latest this many (default 100; 0: all)")
    parser.add_argument("--json", action="store_true", help="one JSON object per dead letter")
    parser.add_argument("--redrive", action="store_true",
                        help="publish each one shown to its subject again, then remove it from the dead letters")
    add_bus_arguments(parser)


@dataclass(frozen=True)
class Kept:
    """One stored dead letter: where it is in the ``DLQ`` stream, and what it says (``None``
    when its bytes are no dead letter, which nothing can send back)."""

    sequence: int
    stored_at: float
    letter: DeadLetter | None
    original: str = ""
    """``<stream>:<sequence>`` of the message it is a letter of ("" when not known: a core
    message, a letter put there by hand): every service that refused one message left a
    letter with the same ``original``."""


def original_place(headers: dict[str, str]) -> str:
    """Where the original of a stored letter is, ``<stream>:<sequence>``, from the id the
    runtime gives the letter (``dlq:<stream>:<consumer>:<sequence>``); "" when it has none."""
    msg_id = headers.get("Nats-Msg-Id", "")
    if not msg_id.startswith("dlq:"):
        return ""
    parts = msg_id.removeprefix("dlq:").split(":")
    return f"{parts[0]}:{parts[-1]}" if len(parts) >= 3 and parts[0] and parts[-1].isdigit() else ""


def kept(message: StoredMessage) -> Kept:
    """The dead letter a ``DLQ`` message holds."""
    try:
        letter = decode(message.data, DeadLetter)
    except (msgspec.DecodeError, msgspec.ValidationError):
        letter = None
    return Kept(message.sequence, message.at, letter, original_place(message.headers))


def redrive_headers(letter: DeadLetter) -> dict[str, str]:
    """The original headers to publish again, without NATS's own (``Nats-*``): the original
    message id would be taken for a duplicate inside the stream's window, and an expected
    stream or sequence would no longer hold."""
    return {k: v for k, v in letter.headers.items() if not k.lower().startswith("nats-")}


def as_text(item: Kept) -> str:
    """One line for a person: when, which, who refused it, why."""
    stamp = datetime.fromtimestamp(item.stored_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    letter = item.letter
    if letter is None:
        return f"{stamp}  #{item.sequence}  (not a dead letter: cannot be read or sent back)"
    error = " ".join(letter.error.split())[:200]
    deliveries = f"  ({letter.deliveries} deliveries)" if letter.deliveries > 1 else ""
    return (f"{stamp}  #{item.sequence}  {letter.service or '?'}  {letter.subject}  "
            f"{letter.reason}{': ' + error if error else ''}{deliveries}")


def as_json(item: Kept) -> str:
    """One JSON object: the dead letter, its original message decoded when it is JSON."""
    letter = item.letter
    if letter is None:
        return json.dumps({"sequence": item.sequence, "at": item.stored_at, "readable": False})
    try:
        original = msgspec.json.decode(letter.data)
    except msgspec.DecodeError:
        original = letter.data.decode("utf-8", "replace")
    return json.dumps({"sequence": item.sequence, "at": item.stored_at, "subject": letter.subject,
                       "service": letter.service, "reason": letter.reason, "error": letter.error,
                       "deliveries": letter.deliveries, "data": original})


async def dead_letters(args, out=None, err=None) -> int:
    """List (and with ``--redrive`` send back) the dead letters asked for, to ``out`` (and
    what was done to ``err``; standard output and error by default); 1 when some of those
    to send back could not be."""
    import nats.js.errors

    out, err = out or sys.stdout, err or sys.stderr
    url = args.nats_url or local_nats_url(args.state_dir)
    bus = await NatsBus.connect(url, "fleetpilot-dead-letters", connect_timeout_s=2)
    try:
        since = time.time() - args.since if args.since is not None else None
        if since is not None and since <= 0:
            # A span reaching back past 1970 (``--since 1e20d``) asks for all kept: as a start
            # time it was a traceback (OverflowError) or "year -162248 is out of range".
            since = None
        # One by sequence: two patterns can match one letter (``task.submitted 'task.>'``),
        # which was listed, counted and redriven twice. The latest ``--limit`` of each
        # pattern, merged, hold the latest overall; one deque over all patterns kept the last
        # pattern's letters, not the newest.
        found: dict[int, Kept] = {}
        # Every letter read, shown or not, by the message it is of: sent back once, a message
        # reaches each service on its subject, so each one's letter of it goes (one kept, the
        # message was sent back again by the next redrive, to every service once more).
        letters_of: dict[str, set[int]] = {}
        try:
            for pattern in dict.fromkeys(args.subjects):
                latest: deque[Kept] = deque(maxlen=args.limit or None)
                async for message in bus.stream_messages(DLQ_STREAM, DLQ_PREFIX + pattern, since=since):
                    item = kept(message)
                    if item.original:
                        letters_of.setdefault(item.original, set()).add(item.sequence)
                    if args.service and (item.letter is None or item.letter.service != args.service):
                        continue
                    latest.append(item)
                found.update((item.sequence, item) for item in latest)
        except nats.js.errors.ServiceUnavailableError:
            raise no_jetstream(url) from None
        except nats.js.errors.NotFoundError:
            # No DLQ stream: no service of Fleetpilot has run on this bus, so none refused anything.
            print(f"no dead letters at {url}: it has no {DLQ_STREAM} stream (no Fleetpilot service has run there)",
                  file=err)
            return 0
        items = sorted(found.values(), key=lambda i: i.sequence)[-args.limit if args.limit else 0:]
        for item in items:
            print(as_json(item) if args.json else as_text(item), file=out, flush=True)
        if not args.redrive:
            print(f"{len(items)} dead letter{'s' * (len(items) != 1)}", file=err)
            return 0
        return await redrive(bus, items, err, letters_of)
    finally:
        await bus.drain()


async def redrive(bus: NatsBus, items: list[Kept], err, letters_of: dict[str, set[int]] | None = None) -> int:
    """Publish each dead letter's original to its subject, once however many services left
    a letter of it, and remove its letters (``letters_of``: by original, the letters' sequences)
    once the stream has it; say what was sent back and what was not, and why."""
    sent, left, removed = 0, 0, 0
    sent_back: set[str] = set()
    for item in items:
        if item.original in sent_back:
            continue  # another service's letter of a message sent back above, and removed with it
        letter = item.letter
        if letter is None:
            left += 1
            print(f"#{item.sequence}: not sent back: not a dead letter", file=err)
            continue
        data, headers = letter.data, redrive_headers(letter)
        if letter.truncated:
            # The letter holds only the original's start: sent back, it would be refused again
            # as cut short. The whole is sent from where it stays, while its stream keeps it.
            whole = await original_of(bus, letter)
            if whole is None:
                left += 1
                stream, _, sequence = letter.original_at.partition(":")
                where = f"stream {stream} no longer holds sequence {sequence}" if stream else "no stream kept it"
                print(f"#{item.sequence}: not sent back: the letter holds only the start of its original, and "
                      f"{where}", file=err)
                continue
            data = whole.data
            headers = redrive_headers(msgspec.structs.replace(letter, headers=whole.headers))
        try:
            # An id of the original's (else of the letter's): a redrive cut short after the
            # publish, run again, finds the stream holding it already and only removes letters.
            msg_id = f"redrive-{item.original}" if item.original else f"redrive-dlq-{item.sequence}"
            await bus.publish_stored(letter.subject, data, headers, msg_id=msg_id)
        except LookupError as exc:
            left += 1
            print(f"#{item.sequence}: not sent back: {exc}", file=err)
            continue
        letters = (letters_of or {}).get(item.original, set()) | {item.sequence}
        for sequence in sorted(letters):
            await bus.delete_stored(DLQ_STREAM, sequence)
        removed += len(letters)
        sent += 1
        if item.original:
            sent_back.add(item.original)
    more = (f" ({removed} letters: a message several services refused is sent back once, to each of them)"
            if removed > sent else "")
    print(f"sent back {sent}, left {left}{more}", file=err)
    return 1 if left else 0


async def original_of(bus: NatsBus, letter: DeadLetter) -> StoredMessage | None:
    """The whole original of a ``truncated`` letter, from where it stays (``original_at``);
    ``None`` when nothing says where, or its stream no longer holds it."""
    stream, _, sequence = letter.original_at.partition(":")
    if not stream or not sequence.isdigit():
        return None
    found = await bus.stored(stream, int(sequence))
    return found if found is not None and found.subject == letter.subject else None


def main(args) -> int:
    """Entry of the subcommand."""
    return event_loop.run(dead_letters(args))

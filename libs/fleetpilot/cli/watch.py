"""``fleetpilot watch``: follow subjects (``decision.made`` by default) as JSON lines."""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import signal
import sys

import msgspec

from fleetpilot.contracts import subject_matches
from fleetpilot.runtime.nats_bus import NatsBus

from . import event_loop
from .arguments import add_bus_arguments, non_negative_int, subject_pattern
from .local import local_nats_url


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot watch``."""
    # Checked by the parser: nats-py refuses a malformed subject with a traceback mid-command.
    parser.add_argument("subjects", nargs="*", type=subject_pattern, default=["decision.made"],
                        help="subjects (wildcards allowed; default decision.made)")
    parser.add_argument("--count", type=non_negative_int, default=0,
                        help="exit after this many messages (default 0: follow until Ctrl-C)")
    add_bus_arguments(parser)


async def watch(args, out=sys.stdout) -> int:
    """Print each message as one JSON line with its subject."""
    bus = await NatsBus.connect(args.nats_url or local_nats_url(args.state_dir), "fleetpilot-watch", connect_timeout_s=2)
    done = asyncio.Event()
    seen = 0
    reader_gone = False

    async def on_msg(earlier: list[str], msg) -> None:
        nonlocal seen, reader_gone
        if done.is_set():
            return  # messages already on their way when the count was reached, or the reader left
        if any(subject_matches(pattern, msg.subject) for pattern in earlier):
            # A message comes once per subscription it matches: the first pattern it matches
            # shows it. It was printed, and counted, once per pattern (`decision.made 'decision.*'`).
            return
        try:
            payload = msgspec.json.decode(msg.data)
        except msgspec.DecodeError:
            payload = msg.data.decode("utf-8", "replace")
        try:
            print(json.dumps({"subject": msg.subject, "data": payload}), file=out, flush=True)
        except BrokenPipeError:
            # The reader went away (`fleetpilot watch | head -3`): nothing can be shown any more.
            # Raised here, it was logged with a traceback per message and watch followed forever.
            reader_gone = True
            done.set()
            return
        seen += 1
        if args.count and seen >= args.count:
            done.set()

    patterns = list(dict.fromkeys(args.subjects))
    for index, pattern in enumerate(patterns):
        await bus.subscribe(pattern, functools.partial(on_msg, patterns[:index]))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    await bus.drain()
    if reader_gone:
        raise BrokenPipeError(errno.EPIPE, "the reader of the output went away")  # main ends quietly
    return 0


def main(args) -> int:
    """Entry of the subcommand."""
    return event_loop.run(watch(args))

"""A reader that goes away (``fleetpilot watch | head -3``) ends a command quietly, with the
exit code of a filter killed by SIGPIPE: no traceback, no "Broken pipe" error, no hang."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

CLOSED_PIPE_EXIT = 128 + signal.SIGPIPE


def closed_pipe() -> int:
    """The writing end of a pipe whose reader is already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


def test_a_command_whose_reader_went_away_ends_quietly() -> None:
    # Before: "fleetpilot fleet: [Errno 32] Broken pipe" and exit 2 when the output filled the
    # pipe, or "Exception ignored ... BrokenPipeError" and exit 120 when it was written at exit.
    for argv in (["fleet"], ["fleet", "--json"]):
        out = closed_pipe()
        try:
            done = subprocess.run([sys.executable, "-m", "fleetpilot.cli.main", *argv], stdout=out,
                                  stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, timeout=60)
        finally:
            os.close(out)
        assert (done.returncode, done.stderr) == (CLOSED_PIPE_EXIT, ""), argv


async def test_watch_stops_when_its_reader_goes_away(nats_url) -> None:
    # Before, each message raised BrokenPipeError in the handler, logged with a traceback, and
    # watch followed the subject forever.
    import nats  # noqa: PLC0415 - only this test publishes

    out = closed_pipe()
    try:
        watcher = subprocess.Popen([sys.executable, "-m", "fleetpilot.cli.main", "watch", "decision.made",
                                    "--nats-url", nats_url], stdout=out, stderr=subprocess.PIPE,
                                   stdin=subprocess.DEVNULL, text=True)
    finally:
        os.close(out)
    nc = await nats.connect(nats_url)
    try:
        # `watch` says nothing once subscribed: publish until it has had one to print.
        deadline = time.monotonic() + 30
        while watcher.poll() is None and time.monotonic() < deadline:
            await nc.publish("decision.made", b'{"task_id": "t1"}')
            await asyncio.sleep(0.1)
    finally:
        await nc.close()
        if watcher.poll() is None:
            watcher.kill()
        _, err = watcher.communicate(timeout=10)
    assert (watcher.returncode, err) == (CLOSED_PIPE_EXIT, "")

"""What an operator sees from the command line when part of a running fleet fails: a dead
letter several services refused, sent back; the bus or a service of `fleetpilot up` killed;
a counter-offer that nobody is at the terminal to answer."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fleetpilot.contracts import DeadLetter, decode


def cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """The real command line in its own process, with nothing at its standard input."""
    return subprocess.run([sys.executable, "-m", "fleetpilot.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


async def test_a_message_two_services_refused_is_sent_back_once(fleet):
    # task.submitted has two consumers (the SLA service and the fingerprinter): one bad
    # submission makes two dead letters of one message. Sent back once per letter, it was
    # published twice, each copy refused by both again: four letters, eight at the next redrive.
    payload = b'{"type": "task.submitted.v1", "task_id": "bad-gpus", "gpus": "many"}'
    await fleet.nc.jetstream().publish("task.submitted", payload)

    async def letters() -> list[DeadLetter]:
        found = [decode(m.data, DeadLetter) for m in await fleet.stream("DLQ", "dlq.task.submitted", idle_s=0.3)]
        return [d for d in found if d.data == payload]

    async def settle(count: int) -> list[DeadLetter]:
        deadline = time.monotonic() + 30
        while len(await letters()) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.3)
        await asyncio.sleep(2)  # any copy still on its way comes meanwhile
        return await letters()

    assert {d.service for d in await settle(2)} == {"sla", "fingerprinter"}
    done = await asyncio.to_thread(cli, "dead-letters", "--redrive", "--nats-url", fleet.server.url)
    assert done.returncode == 0, done.stderr
    again = await settle(2)
    submitted = [m for m in await fleet.stream("TASKS", "task.submitted", idle_s=0.3) if m.data == payload]
    assert len(submitted) == 2, f"the original and {len(submitted) - 1} copies sent back; {done.stderr}"
    assert sorted(d.service for d in again) == ["fingerprinter", "sla"], done.stderr
    assert "sent back 1, left 0" in done.stderr

    # Sent back for one service's sake, the message reaches the other too: its letter goes
    # with it, or the next redrive sent the message to both once more.
    done = await asyncio.to_thread(cli, "dead-letters", "--redrive", "--service", "sla", "--nats-url",
                                   fleet.server.url)
    assert done.returncode == 0, done.stderr
    again = await settle(2)
    submitted = [m for m in await fleet.stream("TASKS", "task.submitted", idle_s=0.3) if m.data == payload]
    assert len(submitted) == 3 and sorted(d.service for d in again) == ["fingerprinter", "sla"], done.stderr


async def test_a_counter_offer_declined_for_want_of_a_terminal_says_so(fleet):
    # A script without --accept-offer declines every counter-offer: it said only that "the
    # client declined every option", which this user never did.
    done = await asyncio.to_thread(cli, "submit", "--nats-url", fleet.server.url, "--state-dir", str(fleet.state),
                                   "--task-id", "no-tty-1", "--kind", "infer", "--gpu-milli", "500",
                                   "--gpu-memory-mb", "4000", "--warmup-ms", "5", "--size-gb", "40")
    assert done.returncode == 1, done.stderr
    assert "rejected (offer_declined)" in done.stdout
    assert "standard input is not a terminal" in done.stderr and "--accept-offer" in done.stderr


async def test_watch_shows_each_message_once_whatever_patterns_overlap(fleet):
    # Subscribed once per pattern, a decision matching two printed twice (three times for
    # `decision.made decision.made 'decision.*'`), and --count counted each copy.
    watcher = asyncio.create_task(asyncio.to_thread(
        cli, "watch", "decision.made", "decision.*", "decision.made", "--count", "2", "--nats-url", fleet.server.url))
    submitted: list[str] = []
    while not watcher.done() and len(submitted) < 10:
        await asyncio.sleep(1)
        submitted.append(f"watched-once-{len(submitted)}")
        await asyncio.to_thread(cli, "submit", "--nats-url", fleet.server.url, "--state-dir", str(fleet.state),
                                "--task-id", submitted[-1], "--kind", "infer", "--gpu-milli", "250")
    watched = await watcher
    assert watched.returncode == 0, watched.stderr
    ids = [json.loads(line)["data"]["decision_id"] for line in watched.stdout.splitlines()]
    assert len(ids) == 2 and len(set(ids)) == 2, watched.stdout


def children_of(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``, by pid, with their command name."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(rest[1]) == pid:
            found[int(entry.name)] = name
    return found


def start_up(tmp_path: Path) -> tuple[subprocess.Popen, Path, dict[str, int]]:
    """`fleetpilot up` in a state directory of its own, once it has said where its services
    run: the process, its output file, and each service's pid."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETPILOT_")}
    said = tmp_path / "up.out"
    with said.open("w") as out:
        up = subprocess.Popen([sys.executable, "-m", "fleetpilot.cli.main", "up", "--duration", "240", "--quiet",
                               "--metrics-port-base", "0", "--state-dir", str(tmp_path / "state")],
                              env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while "services: " not in said.read_text() and up.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    line = next((line for line in said.read_text().splitlines() if line.startswith("services: ")), None)
    assert line is not None, f"up (exit {up.poll()}) did not start its services: {said.read_text()}"
    pids = {name: int(pid) for name, pid in re.findall(r"(\S+) \(pid (\d+)\)", line)}
    logs = tmp_path / "state" / "logs"
    # Each service set up (a service that loses the bus while it starts is another matter).
    while (any(": started (" not in (logs / f"{name}.log").read_text(errors="replace") for name in pids)
           and up.poll() is None and time.monotonic() < deadline):
        time.sleep(0.2)
    return up, said, pids


def ended(up: subprocess.Popen, said: Path, within_s: float) -> str:
    """Up's output once it has ended by itself within ``within_s``; fails when it runs on."""
    try:
        up.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
        pytest.fail(f"up ran on for {within_s:.0f}s: {said.read_text()}")
    return said.read_text()


def test_up_whose_nats_server_is_killed_says_so_and_stops(tmp_path) -> None:
    # Before, up said "fleetpilot-up: disconnected from NATS" (nats-py's line) and ran on with
    # every service cut off, until Ctrl-C, which then ended it with exit 0 and a report of nothing.
    up, said, _ = start_up(tmp_path)
    try:
        server = next(pid for pid, name in children_of(up.pid).items() if name == "nats-server")
        os.kill(server, signal.SIGKILL)
        out = ended(up, said, 30)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 1, out
    assert "fleetpilot up: the NATS server exited (killed by SIGKILL); see " in out


def test_up_names_the_signal_that_killed_a_service(tmp_path) -> None:
    # Before, up gave the killed service's last log line as its last words (an info line about
    # its policies, say), as though that said why it ended.
    up, said, pids = start_up(tmp_path)
    try:
        os.kill(pids["policy"], signal.SIGKILL)
        out = ended(up, said, 30)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 1, out
    assert "fleetpilot up: service(s) exited: policy" in out
    assert "  policy: killed by SIGKILL" in out.splitlines()

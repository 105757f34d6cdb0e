"""The user's commands against a running fleet: submit (assign, counter-offer accepted or
declined), watch, and one-line errors."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import pytest

from .fleet_harness import Fleet


async def fleetpilot(fleet: Fleet, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """Run the real command line in its own process, as a user would."""
    cmd = [sys.executable, "-m", "fleetpilot.cli.main", *args]
    if args[0] in ("submit", "watch"):
        cmd += ["--nats-url", fleet.server.url]
    if args[0] == "submit":
        cmd += ["--state-dir", str(fleet.state)]
    return await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=timeout_s,
                                   stdin=subprocess.DEVNULL)


def decision_in(stdout: str) -> dict:
    start = stdout.index("{")
    return json.JSONDecoder().raw_decode(stdout[start:])[0]


async def test_submit_prints_the_assignment(fleet):
    done = await fleetpilot(fleet, "submit", "--task-id", "cli-1", "--kind", "infer", "--gpu-milli", "250",
                            "--gpu-memory-mb", "4000")
    assert done.returncode == 0, done.stderr
    decision = decision_in(done.stdout)
    assert decision["task_id"] == "cli-1" and decision["action"] == "assign"
    assert decision["placement"][0]["milli"] == 250 and 0 <= decision["confidence"] <= 1
    assert done.stderr == ""


async def test_counter_offer_accepted_then_declined(fleet):
    impossible = ["--kind", "infer", "--gpu-milli", "500", "--gpu-memory-mb", "4000", "--warmup-ms", "5",
                  "--size-gb", "40"]
    accepted = await fleetpilot(fleet, "submit", "--task-id", "cli-offer-1", *impossible, "--accept-offer")
    assert accepted.returncode == 0, accepted.stderr
    assert "counter-offer for cli-offer-1" in accepted.stdout and "accepting option 1" in accepted.stdout
    assert decision_in(accepted.stdout[accepted.stdout.index("accepting"):])["action"] == "assign"

    declined = await fleetpilot(fleet, "submit", "--task-id", "cli-offer-2", *impossible, "--decline-offer")
    assert declined.returncode == 1
    assert "rejected (offer_declined)" in declined.stdout


async def test_watch_follows_decisions(fleet):
    watcher = asyncio.create_task(fleetpilot(fleet, "watch", "decision.made", "--count", "1"))
    # `watch` says nothing once subscribed: a single submit two seconds on was missed on a
    # loaded machine and the watcher waited out its timeout. Submit until it has seen one.
    submitted: list[str] = []
    while not watcher.done() and len(submitted) < 10:
        await asyncio.sleep(1)
        submitted.append(f"cli-watched-{len(submitted)}")
        await fleetpilot(fleet, "submit", "--task-id", submitted[-1], "--gpu-milli", "250", "--kind", "infer")
    watched = await watcher
    assert watched.returncode == 0, watched.stderr
    line = json.loads(watched.stdout.splitlines()[0])
    assert line["subject"] == "decision.made" and line["data"]["task_id"] in submitted


@pytest.mark.parametrize("args,message", [
    (["submit", "--gpus", "two"], "invalid int value"),
    (["submit", "--gpu-milli", "4000"], "gpu_milli must be in 1..1000"),
    (["submit", "--max-queue-s", "-5"], "sla.max_queue_s must be a finite number >= 0"),
    (["up", "--demo", "-5"], "argument --demo: must be 0 or more"),
    (["submit", "--file", "/no/such/task.yaml"], "no such file"),
    (["watch", "--nats-url", "nats://127.0.0.1:1"], "cannot connect to NATS"),
    (["watch", "task lifecycle"], "not a NATS subject"),
    (["submit", "--kind", "infer", "--task-id", "my task"], "must be one subject token"),
    (["submit", "--kind", "infer", "--timeout", "0"], "argument --timeout: must be more than 0"),
])
def test_bad_input_is_one_line_without_traceback(args, message):
    assert_one_line_error(args, message)


def test_submitting_where_fleetpilot_does_not_run_is_one_line(nats_url):
    # A bare NATS server (JetStream on, no Fleetpilot streams): the publish finds no stream.
    assert_one_line_error(["submit", "--nats-url", nats_url, "--timeout", "5"], "no Fleetpilot stream takes")


def assert_one_line_error(args: list[str], message: str) -> None:
    """``fleetpilot ARGS`` exits 2 with ``message`` on one stderr line and no traceback."""
    done = subprocess.run([sys.executable, "-m", "fleetpilot.cli.main", *args], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_submit_and_fleet_find_the_bus_that_fleetpilot_up_runs(tmp_path) -> None:
    """The README's flow: `fleetpilot up` in one terminal, `fleetpilot submit` and `fleetpilot
    fleet` in another from the same directory, no URL given: up's embedded server takes a
    free port and says where."""
    import os  # noqa: PLC0415 - only this test needs the environment
    import time  # noqa: PLC0415

    env = {k: v for k, v in os.environ.items() if k not in ("FLEETPILOT_NATS_URL", "FLEETPILOT_STATE_DIR")}
    said = tmp_path / "up.out"
    # Free /metrics ports: on the default ones, any other `fleetpilot up` on the machine
    # (`make run`) makes this one refuse to start, which the test read as no announcement.
    with said.open("w") as out:
        up = subprocess.Popen([sys.executable, "-m", "fleetpilot.cli.main", "up", "--duration", "120", "--quiet",
                               "--metrics-port-base", "0"], cwd=tmp_path, env=env, stdout=out,
                              stderr=subprocess.STDOUT, text=True)
    announced = tmp_path / ".fleetpilot" / "nats.url"
    try:
        # Waited for as a script waits: up's first line, printed once nats.url holds the URL.
        # It comes before any service starts: after the command loads (about 1 s of CPU), its
        # key, and its nats-server's readiness, which up gives 10 s before it exits saying why;
        # 1.4 s on an idle machine. So the wait is for that line or up's exit, and the deadline
        # only stops a hang. Before, the test polled for the file and read it at once (a file
        # just created and not yet written reads empty), and an up that had exited, or had not
        # said in time, failed with FileNotFoundError and none of up's output.
        deadline = time.monotonic() + 30
        while "fleetpilot up: NATS at " not in said.read_text() and up.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        line = next((line for line in said.read_text().splitlines() if line.startswith("fleetpilot up: NATS at ")),
                    None)
        assert line is not None, f"up (exit {up.poll()}) did not say where its bus is: {said.read_text()}"
        url = line.removeprefix("fleetpilot up: NATS at ").split(",")[0]
        assert url.startswith("nats://127.0.0.1:") and announced.read_text() == url + "\n"
        submit = subprocess.run([sys.executable, "-m", "fleetpilot.cli.main", "submit", "--kind", "infer",
                                 "--gpu-milli", "250", "--gpu-memory-mb", "8000", "--timeout", "40"],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert submit.returncode == 0, submit.stderr
        assert decision_in(submit.stdout)["action"] in ("assign", "queue")
        shown = subprocess.run([sys.executable, "-m", "fleetpilot.cli.main", "fleet", "--json"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["live"]["nats_url"] == announced.read_text().strip()
        up.send_signal(signal.SIGINT)  # Ctrl-C: up stops its services and prints its report
        up.wait(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    out = said.read_text()
    assert up.returncode == 0, out
    assert "over 1 tasks" in out or "no task assigned" in out
    assert not announced.exists()  # a stopped fleet leaves no stale pointer behind


def test_up_names_a_service_that_stopped_at_start_and_why(tmp_path) -> None:
    """A misspelt variable stops the executor at start; `fleetpilot up` stops the rest and
    shows the executor's one line, so nobody has to open its log to learn what to fix."""
    import os  # noqa: PLC0415 - only this test needs the environment

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETPILOT_")}
    env["FLEETPILOT_EXECUTOR_BAKEND"] = "process"
    up = subprocess.run([sys.executable, "-m", "fleetpilot.cli.main", "up", "--duration", "90", "--quiet",
                         "--metrics-port-base", "0"], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=120)
    assert up.returncode == 1, up.stderr
    assert "fleetpilot up: service(s) exited: executor" in up.stderr
    assert ("  executor: fleetpilot-executor: FLEETPILOT_EXECUTOR_BAKEND is not a setting "
            "(did you mean FLEETPILOT_EXECUTOR_BACKEND?)") in up.stderr.splitlines()

"""How ``fleetpilot up`` starts and stops: what it refuses before anything starts, what it
leaves behind when stopped, and what it says of a service that failed. The services are
stood in for by small processes (each in a session of its own, as the real ones run), so
that no test runs the fleet."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fleetpilot.cli import up
from fleetpilot.cli.main import main as cli_main
from fleetpilot.cli.up import ServiceProcesses
from fleetpilot.learner import STORE_FILE

STAND_IN = textwrap.dedent('''
    """Runs `fleetpilot up` with stand-ins for its services, writing the pid of every process
    it starts (the nats-server too) to argv[1], one a line. argv[2] is the state directory;
    with argv[3] == "term-while-starting", up is sent SIGTERM while it starts its services;
    with "real-start", up starts the stand-ins itself, and only the nats-server's pid is written."""
    import os, signal, subprocess, sys
    from fleetpilot.cli import up
    from fleetpilot.cli.main import main

    pids = open(sys.argv[1], "w")

    def start(self, name):
        self.procs[name] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True)
        pids.write(f"{self.procs[name].pid}\\n")
        pids.flush()

    real_start_all, real_nats_start = up.ServiceProcesses.start_all, up.EmbeddedNats.start

    def start_all(self):
        real_start_all(self)
        if sys.argv[3] == "term-while-starting":
            os.kill(os.getpid(), signal.SIGTERM)

    def nats_start(self, *args, **kwargs):
        started = real_nats_start(self, *args, **kwargs)
        pids.write(f"{self.process.pid}\\n")
        pids.flush()
        return started

    up.ServiceProcesses.start_all, up.EmbeddedNats.start = start_all, nats_start
    if sys.argv[3] == "real-start":  # up's own start, of a stand-in command
        up.ServiceProcesses.command = lambda self, name: [sys.executable, "-c", "import time; time.sleep(120)"]
    else:
        up.ServiceProcesses.start = start
    sys.exit(main(["up", "--state-dir", sys.argv[2], "--duration", "120", "--quiet", "--metrics-port-base", "0"]))
''')


def running(pids: list[int]) -> list[int]:
    """The processes of ``pids`` still running (a zombie has ended)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def started(pids_file: Path) -> list[int]:
    """The pids the stand-in ``up`` wrote."""
    return [int(line) for line in pids_file.read_text().split()] if pids_file.exists() else []


def kill_all(pids: list[int]) -> None:
    """Kill what a failed test left running."""
    for pid in running(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stand_in_up(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    """``fleetpilot up`` with stand-in services, in a process of its own; and its pid file."""
    pids = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(pids), str(tmp_path / "state"), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    return proc, pids


def wait_started(proc: subprocess.Popen) -> None:
    """Return once ``up`` in ``proc`` has started its services (it names their pids)."""
    said = ""
    while not said.startswith("services:"):
        said = proc.stdout.readline()  # type: ignore[union-attr]
        assert said, proc.stderr.read()  # type: ignore[union-attr]  # it ended instead


def test_closing_up_s_terminal_stops_the_nats_server_and_every_service(tmp_path) -> None:
    # SIGHUP (the terminal or the ssh session closed) ended up at once, and the nats-server and
    # the services, each in a session of its own and so not told, ran on.
    proc, pids_file = stand_in_up(tmp_path, "run")
    try:
        wait_started(proc)
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=90)
        assert running(started(pids_file)) == []
        assert proc.returncode == 0 and "=== Fleetpilot closing report ===" in out, err
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_all(started(pids_file))


def test_up_killed_outright_takes_the_nats_server_and_every_service_with_it(tmp_path) -> None:
    # SIGKILL (or the OOM killer) gives up no chance to stop anything: the nats-server and
    # the services, each in a session of its own, ran on, the executor's tasks with them.
    proc, pids_file = stand_in_up(tmp_path, "real-start")
    pids: list[int] = []
    try:
        said = ""
        while not said.startswith("services:"):
            said = proc.stdout.readline()  # type: ignore[union-attr]
            assert said, proc.stderr.read()  # type: ignore[union-attr]
        pids = started(pids_file) + [int(p) for p in re.findall(r"\(pid (\d+)\)", said)]
        assert len(pids) == 1 + len(up.SERVICES)
        assert len(running(pids)) == len(pids)
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 20
        while running(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_all(pids)


def test_a_sigterm_while_up_starts_stops_the_nats_server_and_every_service(tmp_path) -> None:
    # Before, SIGTERM's own action ended up at once, and the nats-server and the eight
    # services, each in a session of its own, ran on with nobody to stop them.
    proc, pids_file = stand_in_up(tmp_path, "term-while-starting")
    try:
        _, err = proc.communicate(timeout=90)
        pids = started(pids_file)
        assert len(pids) == 1 + len(up.SERVICES)
        assert running(pids) == []
        # Given up while starting (or, had nats-py swallowed the cancel, stopped just after).
        assert proc.returncode in (128 + signal.SIGTERM, 0), err
        assert not (tmp_path / "state" / "nats.url").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_all(started(pids_file))


def test_a_second_up_on_a_running_one_s_state_directory_is_refused_and_takes_nothing(tmp_path, capsys,
                                                                                     monkeypatch) -> None:
    # Before, the second emptied the state directory's bus store and the learner's file (a
    # simulated fleet starts on an empty bus) from under the fleet that ran there.
    first, pids_file = stand_in_up(tmp_path, "run")
    state = tmp_path / "state"
    try:
        wait_started(first)
        learnt = state / STORE_FILE
        learnt.write_bytes(b"the running fleet's outcomes")
        monkeypatch.setattr(up, "EmbeddedNats", NoServer)
        rc = cli_main(["up", "--state-dir", str(state), "--duration", "1", "--metrics-port-base", "0"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1
        assert f"another `fleetpilot up` (pid {first.pid}) runs from {state}" in err
        assert (state / "nats" / "jetstream").is_dir() and learnt.read_bytes() == b"the running fleet's outcomes"
    finally:
        first.send_signal(signal.SIGTERM)
        try:
            first.communicate(timeout=60)
        finally:
            if first.poll() is None:
                first.kill()
            pids = started(pids_file)
            kill_all(pids)
    assert first.returncode == 0 and pids and running(pids) == []


class NoServer:
    """Stands in for ``EmbeddedNats`` where a run must be refused before any server starts."""

    def __init__(self, *args, **kwargs) -> None:
        """Take what ``EmbeddedNats`` takes."""

    def start(self) -> NoServer:
        """Fail the test: the run was to be refused first."""
        raise AssertionError("a nats-server was started for a run that should have been refused")


def test_a_metrics_port_in_use_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch) -> None:
    # Before, the service on that port stopped at start ("address already in use" in its log);
    # a run shorter than its start-up ended with exit 0 and no word of it.
    import socket  # noqa: PLC0415

    monkeypatch.setattr(up, "EmbeddedNats", NoServer)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = cli_main(["up", "--metrics-port-base", str(port), "--state-dir", str(tmp_path), "--duration", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert f"the collector service cannot serve /metrics on 127.0.0.1:{port}: address already in use" in err


def test_metrics_ports_past_65535_are_refused_before_anything_starts(tmp_path, capsys, monkeypatch) -> None:
    # The flag took 65530, and the services from the sixth on could not bind their ports.
    monkeypatch.setattr(up, "EmbeddedNats", NoServer)
    rc = cli_main(["up", "--metrics-port-base", "65530", "--state-dir", str(tmp_path), "--duration", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err == ("fleetpilot up: --metrics-port-base 65530 leaves too few ports: the 8 services take "
                               "65530..65537, past 65535\n")


def stand_ins(monkeypatch, scripts: dict[str, str]) -> None:
    """Start each service as ``python -c`` of its script in ``scripts`` (else one that sleeps),
    logging where the real one would, and return once a script has said ``ready``."""
    def start(self, name: str) -> None:
        log_path = self.state / "logs" / f"{name}.log"
        script = scripts.get(name, "import time; time.sleep(120)")
        with log_path.open("ab") as log:
            self.procs[name] = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=log,
                                                start_new_session=True)
        deadline = time.monotonic() + 30
        while "ready" in script and b"ready" not in log_path.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.02)

    monkeypatch.setattr(ServiceProcesses, "start", start)


def test_a_service_that_exits_while_the_demo_waits_for_the_fleet_ends_the_run_at_once(
        nats_client, nats_url, tmp_path, monkeypatch, capsys) -> None:
    # Before, up waited a minute for the simulated fleet to answer (deaf to Ctrl-C meanwhile),
    # said it was "submitting anyway", and only then noticed the collector had stopped.
    stand_ins(monkeypatch, {"collector": "import sys; print('fleetpilot-collector: no GPU source'); sys.exit(3)"})
    rc = cli_main(["up", "--nats-url", nats_url, "--demo", "3", "--duration", "120", "--quiet",
                   "--state-dir", str(tmp_path), "--metrics-port-base", "0"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "fleetpilot up: service(s) exited: collector" in err
    assert "  collector: fleetpilot-collector: no GPU source" in err.splitlines()
    assert "submitting anyway" not in err


def test_a_service_that_fails_as_it_stops_fails_the_run(nats_client, nats_url, tmp_path, monkeypatch,
                                                        capsys) -> None:
    # A service that failed after up last looked (a short --duration) ended the run with exit 0.
    stand_ins(monkeypatch, {"policy": textwrap.dedent("""
        import signal, sys, time
        def stop(*_):
            print("fleetpilot-policy: lost its ledger", flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, stop)
        print("ready", flush=True)
        time.sleep(120)
    """)})
    rc = cli_main(["up", "--nats-url", nats_url, "--duration", "0.2", "--quiet", "--state-dir", str(tmp_path),
                   "--metrics-port-base", "0"])
    err = capsys.readouterr().err
    assert rc == 1, err
    # The others drained (or were stopped before they could start): no word of them.
    assert [line for line in err.splitlines() if line.startswith("  ")] == [
        "  policy (exit 3): fleetpilot-policy: lost its ledger"]


class Draining:
    """A service process that drains for as long as it is given: what it was given is kept."""

    def __init__(self) -> None:
        """Running, and given nothing yet."""
        self.given: list[float | None] = []
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Still running until waited for."""
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """SIGTERM: it starts draining."""

    def wait(self, timeout: float | None = None) -> int:
        """Drained within any time given."""
        self.given.append(timeout)
        self.returncode = 0
        return 0

    def kill(self) -> None:
        """Never reached: it drains in time."""
        self.returncode = -signal.SIGKILL


@pytest.mark.parametrize("grace", ["40", "10"])
def test_the_executor_has_its_tasks_grace_to_stop_before_it_is_killed(grace, tmp_path, monkeypatch) -> None:
    # The executor stops its tasks with FLEETPILOT_EXECUTOR_GRACE_S before it exits; killed at
    # 15 s while it did, it left them running, each in a session of its own.
    monkeypatch.setenv("FLEETPILOT_EXECUTOR_GRACE_S", grace)
    processes = ServiceProcesses(tmp_path, "nats://127.0.0.1:4222", None)
    executor = Draining()
    processes.procs["executor"] = executor  # type: ignore[assignment]
    processes.stop_all()
    assert executor.given[0] is not None and executor.given[0] > float(grace) + 10


def test_when_up_says_where_its_bus_is_the_state_directory_already_says_it_too(nats_url, tmp_path, monkeypatch,
                                                                              capsys) -> None:
    # Scripts read up's first line for the bus ("scripts read it"), then run `fleetpilot
    # submit` from the same directory. Before, that line came before nats.url was written:
    # a submit started on it could find no nats.url and try NATS's default port instead.
    stand_ins(monkeypatch, {})
    announced = tmp_path / "nats.url"
    seen_when_said: list[str | None] = []

    def said(*args, **kwargs) -> None:
        if args and str(args[0]).startswith("fleetpilot up: NATS at "):
            seen_when_said.append(announced.read_text() if announced.exists() else None)
        print(*args, **kwargs)

    monkeypatch.setattr(up, "print", said, raising=False)
    rc = cli_main(["up", "--nats-url", nats_url, "--duration", "0.2", "--quiet", "--state-dir", str(tmp_path),
                   "--metrics-port-base", "0"])
    assert rc == 0, capsys.readouterr().err
    assert seen_when_said == [nats_url + "\n"]
    assert not announced.exists()

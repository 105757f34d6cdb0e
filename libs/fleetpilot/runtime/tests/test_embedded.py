"""The embedded nats-server starts on a port of its own even when the one it picked is taken."""

from __future__ import annotations

import socket

from fleetpilot.runtime import embedded
from fleetpilot.runtime.embedded import EmbeddedNats


def test_a_server_whose_picked_port_was_taken_meanwhile_starts_on_another(tmp_path, monkeypatch):
    # The port is free when picked and bound by the server a moment later; anything may take
    # it between (another run's server, a client's outgoing connection). The server then
    # exited with "address already in use" and the run, or the test, failed at random.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = iter([taken.getsockname()[1]])
        real = embedded.free_port
        monkeypatch.setattr(embedded, "free_port", lambda: next(picks, None) or real())
        server = EmbeddedNats(tmp_path / "nats").start()
        try:
            assert server.port != taken.getsockname()[1]
            assert server.process is not None and server.process.poll() is None
        finally:
            server.stop()

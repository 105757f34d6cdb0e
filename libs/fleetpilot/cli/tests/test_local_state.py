"""Where the CLI finds the bus: the environment, a running ``fleetpilot up``, NATS's default."""

from __future__ import annotations

from fleetpilot.cli.local import DEFAULT_NATS_URL, NATS_URL_FILE, local_nats_url


def test_the_environment_wins_then_what_fleetpilot_up_announced_then_the_default(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("FLEETPILOT_NATS_URL", raising=False)
    monkeypatch.setenv("FLEETPILOT_STATE_DIR", str(tmp_path))
    assert local_nats_url() == DEFAULT_NATS_URL
    (tmp_path / NATS_URL_FILE).write_text("nats://127.0.0.1:41234\n")
    assert local_nats_url() == "nats://127.0.0.1:41234"
    other = tmp_path / "other"
    other.mkdir()
    assert local_nats_url(str(other)) == DEFAULT_NATS_URL  # --state-dir names another directory
    monkeypatch.setenv("FLEETPILOT_NATS_URL", "nats://bus.internal:4222")
    assert local_nats_url() == "nats://bus.internal:4222"

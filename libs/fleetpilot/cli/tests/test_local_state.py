"""The CLI's local state: where it finds the bus (the environment, a running ``fleetpilot
up``, NATS's default) and the key ring that ``submit`` and ``up`` mint their tokens from."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

from fleetpilot.auth import KeyRing, TokenVerifier, load_jwks
from fleetpilot.cli.local import (
    AUDIENCE,
    DEFAULT_NATS_URL,
    ISSUER,
    NATS_URL_FILE,
    announced_nats_url,
    local_nats_url,
    local_token,
)
from fleetpilot.cli.up import announce, hold_state_dir

FORK = multiprocessing.get_context("fork")


def test_the_environment_wins_then_what_fleetpilot_up_announced_then_the_default(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("FLEETPILOT_NATS_URL", raising=False)
    monkeypatch.setenv("FLEETPILOT_STATE_DIR", str(tmp_path))
    assert local_nats_url() == DEFAULT_NATS_URL
    with hold_state_dir(tmp_path):  # as a running `fleetpilot up` holds it
        announce(tmp_path / NATS_URL_FILE, "nats://127.0.0.1:41234")
        assert local_nats_url() == "nats://127.0.0.1:41234"
        other = tmp_path / "other"
        other.mkdir()
        assert local_nats_url(str(other)) == DEFAULT_NATS_URL  # --state-dir names another directory
        monkeypatch.setenv("FLEETPILOT_NATS_URL", "nats://bus.internal:4222")
        assert local_nats_url() == "nats://bus.internal:4222"


def _up_killed_before_it_could_clean_up(state: Path, announced) -> None:
    with hold_state_dir(state):
        announce(state / NATS_URL_FILE, "nats://127.0.0.1:41234")
        announced.set()
        time.sleep(60)


def test_the_url_an_up_killed_outright_left_behind_is_not_taken_for_a_running_fleet(tmp_path, monkeypatch) -> None:
    # Before, `fleetpilot fleet` after a `kill -9` of `up` said "cannot connect to
    # nats://127.0.0.1:41234" and `submit` sent its task there, to a bus nobody runs.
    monkeypatch.delenv("FLEETPILOT_NATS_URL", raising=False)
    announced = FORK.Event()
    up = FORK.Process(target=_up_killed_before_it_could_clean_up, args=(tmp_path, announced))
    up.start()
    try:
        assert announced.wait(30)
        assert announced_nats_url(str(tmp_path)) == "nats://127.0.0.1:41234"
    finally:
        os.kill(up.pid, signal.SIGKILL)
        up.join(30)
    assert (tmp_path / NATS_URL_FILE).read_text() == "nats://127.0.0.1:41234\n"  # left behind, as after a crash
    assert announced_nats_url(str(tmp_path)) is None
    assert local_nats_url(str(tmp_path)) == DEFAULT_NATS_URL


def _first_use(state: Path, start, queue) -> None:
    start.wait(30)
    queue.put(local_token(state, "acme"))


def test_first_uses_of_an_empty_state_directory_all_mint_tokens_the_key_set_verifies(tmp_path) -> None:
    # Every ``submit`` started on a fresh machine creates the ring. Each read it, made a key
    # and wrote ring and key set with nothing held in between: one process's key set could
    # land over another's, whose token the SLA service then refused as unknown_kid.
    state, processes = tmp_path / "state", 6
    start, queue = FORK.Barrier(processes), FORK.Queue()
    children = [FORK.Process(target=_first_use, args=(state, start, queue)) for _ in range(processes)]
    for child in children:
        child.start()
    tokens = [queue.get(timeout=60) for _ in children]
    for child in children:
        child.join(30)
        assert child.exitcode == 0
    verifier = TokenVerifier(load_jwks(state / "jwks.json"), audience=AUDIENCE, issuer=ISSUER)
    assert {verifier.verify(t).tenant for t in tokens} == {"acme"}
    assert len(KeyRing.load(state / "keyring.json").keys) == 1  # the first made it; the others used it

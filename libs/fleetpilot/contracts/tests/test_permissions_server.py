"""The generated NATS users on a real nats-server: the eight services start and place a task
under their own users without one permission violation, and the users that must not
(a submitter, an executor) cannot publish a decision, touch what is not theirs or read the
answers sent to another user."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import time
from argparse import Namespace
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from fleetpilot.cli.fleet_cmd import read_live
from fleetpilot.cli.local import local_keyring, local_token
from fleetpilot.cli.up import ServiceProcesses
from fleetpilot.contracts import DecisionMade, TaskSubmitted, decode, encode, msg_id_for
from fleetpilot.contracts.permissions import ROLES, nats_conf, password_variable
from fleetpilot.runtime.embedded import free_port, nats_server_binary
from fleetpilot.runtime.nats_bus import NatsBus, bucket_subject_keys, inbox_prefix_of


class SecuredNats:
    """A nats-server with JetStream whose only users are the generated ones, each with a
    random password given to the server through its environment, as in production."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.passwords = {name: secrets.token_hex(16) for name in ROLES}
        self.log = root / "nats-server.log"
        root.mkdir(parents=True, exist_ok=True)
        conf = root / "nats.conf"
        conf.write_text(f"listen: 127.0.0.1:{self.port}\n"
                        f"jetstream {{ store_dir: {str(root / 'js')!r} }}\n" + nats_conf())
        env = {**os.environ, **{password_variable(n): p for n, p in self.passwords.items()}}
        self.process = subprocess.Popen([nats_server_binary(), "-c", str(conf), "-l", str(self.log)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 15
        while "Server is ready" not in self.log_text():
            assert self.process.poll() is None, f"nats-server exited: {self.log_text()[-2000:]}"
            assert time.monotonic() < deadline, "nats-server not ready in 15 s"
            time.sleep(0.05)

    def url(self, role: str) -> str:
        """The URL of ``role``'s user."""
        return f"nats://{role}:{self.passwords[role]}@127.0.0.1:{self.port}"

    def log_text(self) -> str:
        """The server's log so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def violations(self) -> list[str]:
        """Every permission violation the server logged."""
        return [line for line in self.log_text().splitlines() if "Violation" in line]

    def stop(self) -> None:
        """Stop the server."""
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ServicesAsTheirUsers(ServiceProcesses):
    """``fleetpilot up``'s services, each connecting as its own user."""

    def __init__(self, state: Path, server: SecuredNats) -> None:
        super().__init__(state, "", Namespace(metrics_port_base=0, speed=1.0, fleet=""))
        self.server = server

    def env_for(self, name: str) -> dict[str, str]:
        """The service's environment, its NATS URL its own user's."""
        return {**super().env_for(name), "FLEETPILOT_NATS_URL": self.server.url(name.partition("-")[0]),
                "FLEETPILOT_STARTUP_TIMEOUT_S": "60"}


@pytest.fixture
def server(tmp_path):
    s = SecuredNats(tmp_path / "nats")
    yield s
    s.stop()


async def connect(server: SecuredNats, role: str, errors: list[str] | None = None):
    """A plain nats-py client as ``role``, with its own inbox as a client of its user must
    have it; the server's asynchronous errors (permission violations) go to ``errors``."""
    async def on_error(exc: Exception) -> None:
        if errors is not None:
            errors.append(str(exc))
    url = server.url(role)
    return await nats.connect(url, inbox_prefix=inbox_prefix_of(url), error_cb=on_error, max_reconnect_attempts=0)


def task(task_id: str) -> TaskSubmitted:
    return TaskSubmitted(task_id=task_id, kind="infer", gpus=1, gpu_milli=250, gpu_memory_mb=4_000,
                         cpu_milli=500, memory_mb=2_048, expected_duration_s=3_600, submitted_at=time.time())


async def until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate() if asyncio.iscoroutinefunction(predicate) else predicate()
        if value:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def test_every_service_starts_and_places_a_task_as_its_own_user_without_a_violation(server, tmp_path):
    state = tmp_path / "state"
    local_keyring(state)
    token = local_token(state, "acme")
    procs = ServicesAsTheirUsers(state, server)
    procs.start_all()
    try:
        def started() -> bool:
            assert server.violations() == []
            assert not procs.dead(), {n: procs.last_words(n) for n in procs.dead()}
            return all(": started (" in (state / "logs" / f"{n}.log").read_text(errors="replace")
                       for n in procs.names() if (state / "logs" / f"{n}.log").exists())
        await until(started, 90, "every service to start")

        nc = await connect(server, "submitter")
        decisions: asyncio.Queue = asyncio.Queue()
        await nc.subscribe("decision.made", cb=decisions.put)
        lifecycle: asyncio.Queue = asyncio.Queue()
        await nc.subscribe("task.lifecycle.*", cb=lifecycle.put)
        submitted = task("perm-0001")
        await nc.jetstream().publish("task.submitted", encode(submitted), headers={
            "Authorization": f"Bearer {token}", "Nats-Msg-Id": msg_id_for(submitted)})
        decision = decode((await asyncio.wait_for(decisions.get(), 60)).data, DecisionMade)
        assert (decision.task_id, decision.action) == ("perm-0001", "assign")
        started_msg = await asyncio.wait_for(lifecycle.get(), 60)
        assert started_msg.subject == "task.lifecycle.perm-0001"
        await nc.close()

        # The operator reads what the fleet wrote (buckets, streams) as `fleetpilot` does.
        op = await connect(server, "operator")
        js = op.jetstream()
        assert server.violations() == []
        keys = await bucket_subject_keys(js, "ledger")
        assert keys and (await (await js.key_value("ledger")).get(keys[0])).value
        assert (await js.get_last_msg("DECISIONS", "decision.made")).data
        await op.close()
        # And through the command's own connection (`fleetpilot fleet`).
        live = await read_live(server.url("operator"))
        assert any(ledger.allocations for ledger in live.ledgers) and live.nodes

        await asyncio.sleep(3)  # periodic jobs and watches run a round more
        assert not procs.dead(), {n: procs.last_words(n) for n in procs.dead()}
        assert server.violations() == []
    finally:
        procs.stop_all(timeout_s=10)
    # Stopping (per-run consumers removed, endpoints drained) is within the rights too.
    assert server.violations() == []


async def stored(server: SecuredNats, stream: str, subject: str) -> int:
    """How many messages ``stream`` holds on ``subject`` (read as the operator)."""
    nc = await connect(server, "operator")
    try:
        info = await nc.jetstream().stream_info(stream, subjects_filter=subject)
        return sum((info.state.subjects or {}).values())
    finally:
        await nc.close()


async def set_up(server: SecuredNats) -> None:
    """Streams and buckets made, as a service's start makes them."""
    bus = await NatsBus.connect(server.url("policy"), "setup")
    await bus.ensure_topology()
    await bus.drain()


async def test_a_submitter_publishes_tasks_but_no_decision_and_cannot_read_the_ledger(server):
    await set_up(server)
    errors: list[str] = []
    nc = await connect(server, "submitter", errors)
    js = nc.jetstream(timeout=1.0)
    ack = await js.publish("task.submitted", encode(task("mine")))
    assert ack.stream == "TASKS"

    forged = b'{"type":"decision.made.v1","decision_id":"d1","task_id":"x","action":"assign"}'
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await js.publish("decision.made", forged)
    await nc.publish("decision.made", forged)  # core: refused by the server, not stored
    await nc.flush()
    assert await stored(server, "DECISIONS", "decision.made") == 0

    with pytest.raises(nats.errors.TimeoutError):
        await js.key_value("ledger")
    with pytest.raises(nats.errors.TimeoutError):
        await js.get_msg("KV_ledger", subject="$KV.ledger.node-1", direct=True)
    with pytest.raises(nats.errors.TimeoutError):
        await js.add_consumer("KV_ledger")  # a watch of the ledger
    await nc.subscribe("$KV.ledger.>")
    await nc.publish("$KV.ledger.node-1", b"{}")
    await nc.flush()
    # Waited for by name: the refused publishes above are errors too, and may be all there is yet.
    await until(lambda: any("subscription" in e.lower() and "$kv.ledger.>" in e.lower() for e in errors), 5,
                "the server's refusal of the subscription")
    assert await stored(server, "KV_ledger", "$KV.ledger.>") == 0
    await nc.close()


async def test_an_executor_publishes_no_task_nor_decision_and_cannot_rewire_a_stream(server):
    await set_up(server)
    nc = await connect(server, "executor")
    js = nc.jetstream(timeout=1.0)
    for subject in ("task.submitted", "decision.made", "$KV.contracts.x", "$KV.pending.x"):
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await js.publish(subject, b"{}")
    assert await stored(server, "TASKS", "task.submitted") == 0
    assert await stored(server, "DECISIONS", "decision.made") == 0
    # A stream update could give DECISIONS a source whose subjects it transforms into
    # decision.made: refused, where a create of the existing stream is not.
    info = await js.stream_info("DECISIONS")
    with pytest.raises(nats.errors.TimeoutError):
        await js.update_stream(info.config)
    ack = await js.publish("action.executed", b"{}")
    assert ack.stream == "ACTIONS"
    await nc.close()


@pytest.mark.parametrize("inbox", ["_INBOX.>", "_INBOX_policy.>", ">"])
async def test_a_submitter_cannot_listen_to_the_answers_sent_to_a_service(server, inbox):
    # With `_INBOX.>` allowed to every user, a client saw the services' answers: the ledger's
    # entries as the policy read them, JetStream's replies, the requests' replies.
    await set_up(server)
    errors: list[str] = []
    spy = await connect(server, "submitter", errors)
    overheard: asyncio.Queue = asyncio.Queue()
    await spy.subscribe(inbox, cb=overheard.put)
    await spy.flush()

    policy = await NatsBus.connect(server.url("policy"), "policy")
    ledger = await policy.kv("ledger")
    await ledger.put("node-1", b'{"secret": "allocations"}')
    assert (await ledger.get("node-1")).value == b'{"secret": "allocations"}'
    await policy.drain()

    await until(lambda: errors, 5, "the server's refusal")
    assert any("subscription" in e.lower() and inbox.lower() in e.lower() for e in errors), errors
    await asyncio.sleep(0.2)
    assert overheard.empty()
    await spy.close()
    assert not [v for v in server.violations() if "user:policy" in v]  # the policy itself read unhindered

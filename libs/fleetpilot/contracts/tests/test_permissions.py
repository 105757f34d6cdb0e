"""The NATS users derived from the catalog: every consumer, route and bucket has its user,
what each service's code binds is within its role, and the rights that reopen the hole
(publishing decisions, rewiring streams) stay with the roles that need them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from fleetpilot.contracts import BUCKETS, CONSUMERS, ROUTES
from fleetpilot.contracts.catalog import subject_matches
from fleetpilot.contracts.deadletter import DeadLetter
from fleetpilot.contracts.permissions import (
    ROLES,
    SERVICE_ROLES,
    inbox_prefix,
    nats_conf,
    password_variable,
    permissions,
    wildcard,
)

SERVICES = Path(__file__).resolve().parents[4] / "services"


def allowed(patterns: tuple[str, ...], subject: str) -> bool:
    return any(subject_matches(p, subject) or p == subject for p in patterns)


def test_every_catalogued_consumer_is_bound_by_a_role():
    bound = {d for r in ROLES.values() for d in (*r.consumers, *r.instance_consumers)}
    assert set(CONSUMERS) == bound


def test_every_route_has_a_publisher_and_every_bucket_a_writer():
    published = {e for r in ROLES.values() for e in r.publishes}
    served = {route.event for r in ROLES.values() for route in r.serves}
    assert {r.event for r in ROUTES if r.event is not DeadLetter} <= published | served
    assert {b.name for b in BUCKETS} - {"gpu_state"} <= {b for r in ROLES.values() for b in r.writes} - {"gpu_state"}
    assert {b for r in ROLES.values() for b in (*r.reads, *r.writes)} <= {b.name for b in BUCKETS}


def test_route_templates_become_one_token_wildcards():
    assert wildcard("topology.report.{node.node}") == "topology.report.*"
    assert wildcard("task.lifecycle.{task_id}") == "task.lifecycle.*"
    assert wildcard("task.submitted") == "task.submitted"


def test_only_the_policy_and_the_operator_publish_decisions():
    may = {name for name, role in ROLES.items() if allowed(permissions(role).publish, "decision.made")}
    assert may == {"policy", "operator"}


def test_only_trusted_roles_may_change_a_stream():
    may = {name for name, role in ROLES.items() if allowed(permissions(role).publish, "$JS.API.STREAM.UPDATE.DECISIONS")}
    assert "executor" not in may and "submitter" not in may
    assert allowed(permissions(ROLES["executor"]).publish, "$JS.API.STREAM.CREATE.DECISIONS")


def test_the_submitter_reaches_no_bucket_and_no_consumer_but_its_own_answers():
    p = permissions(ROLES["submitter"])
    assert allowed(p.publish, "task.submitted") and allowed(p.publish, "sla.reply.t1")
    assert not any(s.startswith(("$KV", "$JS")) for s in (*p.publish, *p.subscribe))
    assert not allowed(p.subscribe, "$KV.ledger.node-1")
    assert not p.allow_responses


def test_each_role_takes_answers_on_its_own_inbox_only():
    # `_INBOX.>` let any user (a submitter) read the answers sent to every other one: the
    # services' ledger reads, JetStream's replies, the requests' replies.
    for name, role in ROLES.items():
        p = permissions(role)
        assert allowed(p.subscribe, f"_INBOX_{name}.abc.1"), name
        assert not allowed(p.subscribe, "_INBOX.abc.1"), name
        others = [other for other in ROLES if other != name]
        assert not any(allowed(p.subscribe, f"_INBOX_{other}.abc.1") for other in others), name
        assert not any(s.startswith("_INBOX") for s in p.publish), name


@pytest.mark.parametrize("user", ["a.b", "a*", ">", "a b", ""])
def test_a_user_that_is_not_one_subject_token_names_no_inbox(user):
    with pytest.raises(ValueError) as raised:
        inbox_prefix(user)
    assert "\n" not in str(raised.value) and "one subject token" in str(raised.value)


def test_the_executor_writes_no_admitted_task_and_no_submission():
    p = permissions(ROLES["executor"])
    for subject in ("task.submitted", "task.admitted", "$KV.contracts.x", "$KV.pending.x", "$KV.config.x"):
        assert not allowed(p.publish, subject), subject


def _source(service: str) -> str:
    return "\n".join(path.read_text() for path in (SERVICES / service).glob("*.py"))


@pytest.mark.parametrize("service", SERVICE_ROLES)
def test_what_a_service_binds_in_its_code_is_within_its_role(service):
    # The real-server test runs the services; this one reads them, so that a bucket, a
    # consumer or a core subscription added to a service without its right fails at once.
    role, source = ROLES[service], _source(service)
    buckets = set(re.findall(r"\.kv\(\"([a-z_]+)\"\)", source))
    assert buckets <= {*role.reads, *role.writes}, buckets
    consumers = set(re.findall(r"consumer=\"([a-z-]+)\"", source))
    assert consumers <= {*role.consumers, *role.instance_consumers}, consumers
    for subject in re.findall(r"on_core\(f?\"([^\"]+)\"", source):
        subject = re.sub(r"\{[^}]*\}", "*", subject)
        assert subject in role.listens, subject


def test_the_nats_conf_names_every_role_with_a_password_from_the_environment():
    conf = nats_conf()
    for name in ROLES:
        assert f'user: "{name}"' in conf
        assert f"password: ${password_variable(name)}" in conf
    assert password_variable("sla") == "FLEETPILOT_NATS_PASSWORD_SLA"


def test_the_command_prints_the_block_and_refuses_an_unknown_role_in_one_line():
    run = [sys.executable, "-m", "fleetpilot.contracts.permissions", "--nats-conf"]
    out = subprocess.run([*run, "--role", "executor"], capture_output=True, text=True, check=True).stdout
    assert out == nats_conf(["executor"])
    bad = subprocess.run([*run, "--role", "nobody"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "invalid choice" in bad.stderr

"""Who may publish and subscribe to what on the bus: one NATS user per service, plus the
``submitter`` (a client submitting tasks) and the ``operator`` (the ``fleetpilot`` command's
reads and redrives), each with allow lists derived from the catalog.

Without them any client that reached NATS could publish ``decision.made``, and the executor's
``process`` backend runs a decision's task command on a GPU node. Each role here names what it
does in the catalog's terms (the events it publishes, the durable consumers it binds, the core
subjects it listens to, the endpoints it serves and asks, the buckets it reads and writes, the
streams it reads directly); ``permissions`` turns that into the subjects, JetStream API calls
included, scoped as tightly as the API allows:

- a durable consumer: ``$JS.API.CONSUMER.{DURABLE.CREATE,INFO,MSG.NEXT}.<stream>.<durable>`` and
  its acknowledgements, ``$JS.ACK.<stream>.<durable>.>`` (an instance's consumer,
  ``<durable>-<instance>``, is one token the server cannot match by prefix: ``*`` on its stream);
- a bucket read: its stream's info, direct gets, and the ordered consumer of a watch
  (``$JS.API.CONSUMER.CREATE.KV_<bucket>``, its flow control ``$JS.FC.KV_<bucket>.>``); written:
  ``$KV.<bucket>.>`` besides;
- a stream read directly (``Bus.stream_messages``, ``last_stored_at``): an ephemeral consumer
  whose filter is in the request's subject, ``$JS.API.CONSUMER.CREATE.<stream>.*.<filter>``, and
  ``$JS.API.STREAM.MSG.GET.<stream>`` (whose subject names no filter);
- set-up (``Bus.ensure_topology``, run by every service at each start and after a server lost
  its store): ``$JS.API.STREAM.{CREATE,INFO}`` of every catalogued stream and bucket. A create
  cannot change a stream that exists (the server refuses another configuration), so only
  ``STREAM.UPDATE`` can rewire one, and it is withheld from the executor, whose pod runs user
  code: an update can give ``DECISIONS`` a source with a subject transform, which is publishing
  ``decision.made`` by another road.

Every role subscribes to its own inbox, ``_INBOX_<role>.>`` (JetStream's and the requests'
answers), never to ``_INBOX.>``, where it would see the answers sent to every other user (a
service's ledger reads among them): a connection whose URL names a user takes that prefix
(``NatsBus.connect``; a client of another language sets it as its NATS library allows,
``inbox_prefix`` / ``CustomInboxPrefix`` / ``nats --inbox-prefix``). Endpoint servers answer
with ``allow_responses`` (a reply to a request they received), never with a right to publish
on an inbox.

``python -m fleetpilot.contracts.permissions --nats-conf`` prints the ``authorization`` block
of a nats-server configuration; each password is a reference to an environment variable of
the server (``$FLEETPILOT_NATS_PASSWORD_<ROLE>``), never a secret in the file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from .action import ActionExecuted, ActionFailed
from .base import Event
from .catalog import (
    BUCKETS,
    CONSUMERS,
    DLQ_PREFIX,
    RETIRED_CONSUMERS,
    ROUTES,
    SLA_NEGOTIATE,
    STREAMS,
    Route,
    route_for,
    stream_of,
)
from .deadletter import DeadLetter
from .decision import DecisionMade
from .feedback import FeedbackRecorded, StatsQuery
from .fingerprint import TaskFingerprinted
from .handover import HandOver
from .model import ModelPublished
from .sim import SimCommand, SimEvent
from .sla import SlaOffer, SlaReply
from .task import TaskAdmitted, TaskLifecycle, TaskRejected, TaskSubmitted
from .telemetry import NodeTelemetry, TaskTelemetry
from .topology import TopologyReport, TopologyUpdated

DEFAULT_INBOX_PREFIX = "_INBOX"
"""nats-py's inbox prefix, kept by a connection that names no user (local runs, tests)."""

PASSWORD_VARIABLE_PREFIX = "FLEETPILOT_NATS_PASSWORD_"
"""``<prefix><ROLE>``: the nats-server's environment variable holding a role's password."""


@dataclass(frozen=True)
class Role:
    """What one NATS user does, in the catalog's terms.

    ``publishes``: the event types it publishes (their routes' subjects, a template's fields
    as ``*``). ``consumers``: catalogued durable consumers it binds as they are;
    ``instance_consumers``: those it binds per instance (``ConsumerSpec.for_instance``).
    ``listens``: core subjects it subscribes to. ``serves`` / ``asks``: request endpoints it
    answers / calls. ``reads`` / ``writes``: KV buckets (a write includes reading). ``scans``:
    ``(stream, filter)`` it reads directly. ``sets_up``: runs ``Bus.ensure_topology``;
    ``updates_streams``: may change a catalogued stream's configuration. ``redrives``: may
    publish on every durable subject and remove dead letters (the operator's
    ``dead-letters --redrive``), and list and edit streams (``nats stream edit --replicas``).
    ``service``: a service on the runtime, which dead-letters what it cannot take."""

    name: str
    description: str
    publishes: tuple[type[Event], ...] = ()
    consumers: tuple[str, ...] = ()
    instance_consumers: tuple[str, ...] = ()
    listens: tuple[str, ...] = ()
    serves: tuple[Route, ...] = ()
    asks: tuple[Route, ...] = ()
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    scans: tuple[tuple[str, str], ...] = ()
    sets_up: bool = True
    updates_streams: bool = True
    redrives: bool = False
    service: bool = True


@dataclass(frozen=True)
class Permissions:
    """One user's allow lists, as nats-server takes them."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool


def wildcard(template: str) -> str:
    """A route's subject template as a subscription pattern: each ``{field}`` token a ``*``
    (``task.lifecycle.{task_id}`` -> ``task.lifecycle.*``)."""
    # A field may be a dotted path (``{node.node}``), still one token of the subject.
    return ".".join("*" if "{" in token else token for token in re.sub(r"\{[^}]*\}", "{}", template).split("."))


def _scan(subject: str) -> tuple[str, str]:
    """``(stream, subject)`` for a direct read of ``subject`` (a pattern) from its stream."""
    stream = stream_of(subject.replace("*", "x").replace(">", "x"))
    if stream is None:
        raise LookupError(f"no catalogued stream keeps {subject}")
    return stream, subject


ROLES: dict[str, Role] = {role.name: role for role in (
    Role("collector", "reads the GPUs; hosts the simulated fleet and answers sim.control",
         publishes=(NodeTelemetry, TaskTelemetry, TopologyReport, SimEvent),
         serves=(route_for(SimCommand),), writes=("gpu_state",)),
    Role("topology", "merges the nodes' reports into the topology bucket",
         publishes=(TopologyUpdated,), consumers=("topology-reports",),
         reads=("ledger",), writes=("topology", "executors"),
         scans=(_scan("topology.report.*"),)),
    Role("fingerprinter", "fits each task's memory growth",
         publishes=(TaskFingerprinted,),
         consumers=("fingerprinter-submitted", "fingerprinter-lifecycle"),
         instance_consumers=("fingerprinter-submitted", "fingerprinter-lifecycle"),
         listens=("telemetry.task.*", "task.rejected", "task.fingerprinted"),
         writes=("fingerprints", "fingerprint_series"),
         scans=(_scan("task.submitted"), _scan("task.lifecycle.>"), _scan("telemetry.task.*"))),
    Role("sla", "negotiates each submission",
         publishes=(TaskAdmitted, TaskRejected, SlaOffer),
         consumers=("sla-submitted", "sla-replies", "sla-lifecycle", "sla-rejected"),
         listens=("topology.updated",), serves=(SLA_NEGOTIATE,),
         reads=("topology", "ledger", "fingerprints"), writes=("contracts", "rejections")),
    Role("policy", "decides; the only publisher of decision.made",
         publishes=(DecisionMade, TaskRejected, ActionFailed),
         consumers=("policy-admitted", "policy-lifecycle", "policy-failed"),
         instance_consumers=("policy-fingerprints",), listens=("telemetry.task.*",),
         asks=(route_for(StatsQuery),),
         reads=("topology", "executions", "fingerprints", "contracts", "models", "executors"),
         writes=("ledger", "pending", "config", "placement_failures"),
         scans=(_scan("decision.made"), _scan("task.fingerprinted"))),
    Role("executor", "carries out its node's decisions; its pod runs user code",
         publishes=(ActionExecuted, ActionFailed, TaskLifecycle),
         consumers=("executor-decisions",), instance_consumers=("executor-decisions",),
         listens=("sim.event.*", "telemetry.gpu.*"),
         serves=(route_for(HandOver),), asks=(route_for(HandOver), route_for(SimCommand)),
         writes=("ledger", "topology", "executions", "hook_locks", "executors"),
         updates_streams=False),
    Role("feedback", "records each action's outcome",
         publishes=(FeedbackRecorded,), consumers=("feedback-executed", "feedback-lifecycle"),
         serves=(route_for(StatsQuery),), writes=("open_placements",)),
    Role("learner", "learns the outcome model",
         publishes=(ModelPublished,), instance_consumers=("learner-decisions", "learner-feedback"),
         writes=("models",)),
    Role("submitter", "a client: submits tasks, answers offers, watches its tasks",
         publishes=(TaskSubmitted, SlaReply),
         listens=("decision.made", "task.admitted", "task.rejected", "task.lifecycle.*", "sla.offer.*"),
         asks=(SLA_NEGOTIATE,), sets_up=False, updates_streams=False, service=False),
    Role("operator", "the fleetpilot command: fleet, model, watch, dead-letters and their redrive",
         listens=tuple(sorted({wildcard(r.subject) for r in ROUTES if r.event is not DeadLetter})) + ("dlq.>",),
         asks=(route_for(StatsQuery),),
         reads=tuple(b.name for b in BUCKETS if b.name not in ("topology", "executors")),
         writes=("topology", "executors"),
         scans=tuple((s.name, subject) for s in STREAMS for subject in s.subjects),
         redrives=True, service=False),
)}
"""Every NATS user Fleetpilot needs, by name."""

SERVICE_ROLES = ("collector", "topology", "fingerprinter", "sla", "policy", "executor", "feedback", "learner")
"""The roles that are services (``services/<name>``), in ``fleetpilot up``'s order."""


def inbox_prefix(user: str) -> str:
    """``user``'s inbox prefix, ``_INBOX_<user>``: where its connection takes its answers
    (JetStream's API and acknowledgements, requests' replies, KV watches), and the only inbox
    its permissions let it subscribe to. ``ValueError`` in one line when ``user`` is not one
    subject token (a ``.``, ``*``, ``>`` or space in it)."""
    if not re.fullmatch(r"[^.*>\s]+", user):
        raise ValueError(f"NATS user {user!r} cannot name an inbox: a user name must be one subject token "
                         "(no '.', '*', '>' or space)")
    return f"{DEFAULT_INBOX_PREFIX}_{user}"


def _dedup(subjects: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(subjects))


def _dead_letter_subjects(role: Role) -> list[str]:
    """Where this role's runtime dead-letters: ``dlq.`` + the subject of a message it took."""
    taken = [CONSUMERS[d].filter_subject for d in (*role.consumers, *role.instance_consumers)]
    return [DLQ_PREFIX + subject for subject in (*taken, *role.listens)]


def permissions(role: Role) -> Permissions:
    """The publish and subscribe allow lists of ``role``."""
    api = "$JS.API"
    pub: list[str] = [wildcard(route_for(event).subject) for event in role.publishes]
    pub += [wildcard(route.subject) for route in role.asks]
    sub: list[str] = [f"{inbox_prefix(role.name)}.>", *role.listens]
    if role.service:
        pub += _dead_letter_subjects(role)
    if role.sets_up:
        for name in [s.name for s in STREAMS] + [f"KV_{b.name}" for b in BUCKETS]:
            pub += [f"{api}.STREAM.CREATE.{name}", f"{api}.STREAM.INFO.{name}"]
        if role.updates_streams:
            pub += [f"{api}.STREAM.UPDATE.{s.name}" for s in STREAMS]
        pub += [f"{api}.CONSUMER.DELETE.{stream}.{durable}" for stream, durable in RETIRED_CONSUMERS]
    for durables, instance in ((role.consumers, False), (role.instance_consumers, True)):
        for durable in durables:
            spec = CONSUMERS[durable]
            name = "*" if instance else durable
            pub += [f"{api}.CONSUMER.DURABLE.CREATE.{spec.stream}.{name}",
                    f"{api}.CONSUMER.INFO.{spec.stream}.{name}",
                    f"{api}.CONSUMER.MSG.NEXT.{spec.stream}.{name}",
                    f"$JS.ACK.{spec.stream}.{name}.>"]
            if spec.per_run or instance:
                # A per-run consumer is made afresh at each start and removed at each stop.
                pub.append(f"{api}.CONSUMER.DELETE.{spec.stream}.{name}")
    for bucket in (*role.reads, *role.writes):
        stream = f"KV_{bucket}"
        pub += [f"{api}.STREAM.INFO.{stream}", f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.>",
                f"{api}.STREAM.MSG.GET.{stream}",
                # A watch: an ordered push consumer, named by the server, made again on a gap.
                f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.DELETE.{stream}.*",
                f"{api}.CONSUMER.INFO.{stream}.*", f"$JS.FC.{stream}.>"]
    pub += [f"$KV.{bucket}.>" for bucket in role.writes]
    for stream, subject in role.scans:
        pub += [f"{api}.STREAM.INFO.{stream}", f"{api}.STREAM.MSG.GET.{stream}",
                f"{api}.CONSUMER.CREATE.{stream}.*.{subject}", f"{api}.CONSUMER.MSG.NEXT.{stream}.*",
                f"{api}.CONSUMER.DELETE.{stream}.*"]
    for route in role.serves:
        sub.append(wildcard(route.subject))
    if role.serves:
        # nats.micro's discovery: $SRV.PING|INFO|STATS, alone, by service name, and by id.
        service = f"fleetpilot-{role.name}"
        sub += ["$SRV.PING", "$SRV.INFO", "$SRV.STATS", f"$SRV.*.{service}", f"$SRV.*.{service}.*"]
    if role.redrives:
        pub += sorted({wildcard(r.subject) for r in ROUTES if r.durable and r.event is not DeadLetter})
        pub += [f"{api}.STREAM.MSG.DELETE.{stream_of(DLQ_PREFIX + 'x')}",
                f"{api}.INFO", f"{api}.STREAM.NAMES", f"{api}.STREAM.LIST"]
        # Raising every stream's replicas, the buckets' included (deploy/README.md).
        pub += [f"{api}.STREAM.{verb}.KV_{b.name}" for b in BUCKETS for verb in ("INFO", "UPDATE")]
    return Permissions(publish=_dedup(pub), subscribe=_dedup(sub), allow_responses=bool(role.serves))


def password_variable(role: str) -> str:
    """The nats-server environment variable that holds ``role``'s password."""
    return PASSWORD_VARIABLE_PREFIX + re.sub(r"[^A-Z0-9]", "_", role.upper())


def _quoted(values: Iterable[str]) -> str:
    return ", ".join(json.dumps(v) for v in values)


def nats_conf(roles: Iterable[str] | None = None) -> str:
    """The ``authorization { users = [...] }`` block of a nats-server configuration for
    ``roles`` (default: all). Each password is ``$FLEETPILOT_NATS_PASSWORD_<ROLE>``, which the
    server reads from its environment when it starts (and refuses to start without)."""
    names = list(roles) if roles is not None else list(ROLES)
    unknown = [name for name in names if name not in ROLES]
    if unknown:
        raise ValueError(f"unknown role {unknown[0]!r}; the roles are {', '.join(ROLES)}")
    lines = ["# Generated by `python -m fleetpilot.contracts.permissions --nats-conf`; do not edit.",
             "authorization {", "  users = ["]
    for name in names:
        p = permissions(ROLES[name])
        lines += ["    {",
                  f"      # {ROLES[name].description}",
                  f"      user: {json.dumps(name)}",
                  f"      password: ${password_variable(name)}",
                  "      permissions: {",
                  f"        publish: {{ allow: [{_quoted(p.publish)}] }}",
                  f"        subscribe: {{ allow: [{_quoted(p.subscribe)}] }}"]
        if p.allow_responses:
            lines.append("        allow_responses: true")
        lines += ["      }", "    }"]
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m fleetpilot.contracts.permissions --nats-conf [--role NAME ...]``."""
    parser = argparse.ArgumentParser(prog="python -m fleetpilot.contracts.permissions",
                                     description="NATS users and permissions derived from the contract catalog")
    parser.add_argument("--nats-conf", action="store_true", required=True,
                        help="print the nats-server `authorization` block")
    parser.add_argument("--role", action="append", choices=list(ROLES),
                        help="only this role (repeatable; default: every role)")
    args = parser.parse_args(argv)
    sys.stdout.write(nats_conf(args.role))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

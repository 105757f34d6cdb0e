"""Every subject, stream, durable consumer and KV bucket, declared as data in one place.

The runtime creates streams, consumers and buckets from these tables idempotently at
start-up, and routes each outgoing event to its subject with ``subject_for`` and its
de-duplication id with ``msg_id_for``: handlers only ever return events.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from .action import ActionExecuted, ActionFailed
from .base import Event
from .deadletter import DeadLetter
from .decision import DecisionMade
from .feedback import FeedbackRecorded, FeedbackStats, StatsQuery
from .fingerprint import TaskFingerprinted
from .handover import HandedOver, HandOver
from .model import ModelPublished
from .sim import SimAck, SimCommand, SimEvent
from .sla import SlaOffer, SlaReply
from .task import TaskAdmitted, TaskLifecycle, TaskRejected, TaskSubmitted
from .telemetry import NodeTelemetry, TaskTelemetry
from .topology import TopologyReport, TopologyUpdated


@dataclass(frozen=True)
class Route:
    """Where an event type is published: a subject template and an idempotency-key template,
    both filled from the event's fields, and a one-line description for the docs.

    The idempotency key names one event, so that retries of its publication (and a stored
    answer given again) are dropped by the stream, and nothing else is: for a task's
    submission, admission and rejection it carries the event's own time, since a task may be
    refused, resubmitted and answered again within the stream's 2-minute duplicate window,
    and keys from the task id alone dropped the second submission and answer unseen.

    ``replies`` makes the subject a request/reply endpoint and names every type its answer
    may have (the requester gets exactly one of them on its reply inbox).

    ``traced=False`` marks a sample stream: a message of it that carries no trace context
    starts no trace where it is handled. One trace per sample per service was the most of a
    consumer's cost per message (the executor reads every node's GPUs each second), and sent
    thousands of one-span traces a second to the collector; a sample that does carry a
    ``traceparent`` still continues its trace."""

    event: type[Event]
    subject: str
    msg_id: str | None
    description: str
    durable: bool = True
    replies: tuple[type[Event], ...] = ()
    traced: bool = True


ROUTES: tuple[Route, ...] = (
    Route(TaskSubmitted, "task.submitted", "submit:{task_id}:{submitted_at}", "A user asks to run a task."),
    Route(TaskAdmitted, "task.admitted", "admit:{task.task_id}:{admitted_at}", "The SLA negotiator accepted a task with a contract."),
    Route(TaskRejected, "task.rejected", "reject:{task_id}:{code}:{rejected_at}", "A task will not run, with the reason."),
    Route(TaskLifecycle, "task.lifecycle.{task_id}", "life:{task_id}:{state}:{at}", "A running task started, finished, was OOM-killed..."),
    Route(TaskFingerprinted, "task.fingerprinted", None, "A task's memory-growth fingerprint, new or changed."),
    Route(SlaOffer, "sla.offer.{task_id}", "offer:{offer_id}", "A counter-offer for a task that cannot be met as asked."),
    Route(SlaReply, "sla.reply.{task_id}", "reply:{offer_id}:{accept}:{option_id}:{replied_at}", "The client accepts one option of an offer or declines it."),
    Route(DecisionMade, "decision.made", "decision:{decision_id}", "A policy decided an action for a task."),
    Route(ActionExecuted, "action.executed", "executed:{action_id}", "The executor carried out a decision."),
    Route(ActionFailed, "action.failed", "failed:{action_id}", "The executor could not carry out a decision."),
    Route(FeedbackRecorded, "feedback.recorded", "feedback:{action_id}", "An action's outcome was stored."),
    Route(ModelPublished, "model.published", "model:{name}:{version}:{withdrawn}",
          "The learner trained a model, stored it in the models bucket, and says whether it is promoted."),
    Route(NodeTelemetry, "telemetry.gpu.{node}", None, "Per-GPU samples of one node (core NATS, high rate).", durable=False,
          traced=False),
    Route(TaskTelemetry, "telemetry.task.{task_id}", None, "Memory samples of one task's processes (core NATS).", durable=False,
          traced=False),
    Route(TopologyReport, "topology.report.{node.node}", "topo:{node.node}:{at}", "A collector's raw view of one node's topology."),
    Route(TopologyUpdated, "topology.updated", "topo-rev:{revision}", "The merged fleet topology changed."),
    Route(DeadLetter, "dlq.{subject}", None, "A message no handler could take, with its reason and original bytes."),
    Route(StatsQuery, "feedback.stats", None, "Request: feedback statistics per policy, shard, kind, GPU model.",
          durable=False, replies=(FeedbackStats,)),
    Route(SimCommand, "sim.control", None, "Request: start/stop/move a task on the simulated fleet.", durable=False,
          replies=(SimAck,)),
    Route(SimEvent, "sim.event.{node}", None, "The simulated hardware finished or killed a task, or failed.",
          durable=False),
    Route(HandOver, "executor.handover.{node}", None,
          "Request: the executor of the node a task moves to asks the one it runs on to checkpoint and stop it.",
          durable=False, replies=(HandedOver,)),
)

SLA_NEGOTIATE = Route(
    TaskSubmitted, "sla.negotiate", None,
    "Request: a quote for a task (a `task.submitted` body with its Authorization header); "
    "nothing is published or stored.",
    durable=False, replies=(SlaOffer, TaskAdmitted, TaskRejected))
"""The SLA service's quote endpoint: the negotiation of a submission without its effects."""

# Request/reply endpoints whose request type already has its route in ROUTES (where that
# type is published): a type has one route, so these stay out of ``route_for`` and are only
# documented in the generated contract. An endpoint whose request type is used nowhere else
# (feedback.stats, sim.control) is simply its type's route in ROUTES.
ENDPOINTS: tuple[Route, ...] = (SLA_NEGOTIATE,)

_ROUTE_BY_TYPE: dict[type, Route] = {route.event: route for route in ROUTES}


def route_for(event_type: type[Event]) -> Route:
    """The route of an event type; a type without one is a programming error."""
    try:
        return _ROUTE_BY_TYPE[event_type]
    except KeyError:
        raise LookupError(f"no route declared for {event_type.__name__}") from None


def _fill(template: str, event: Event) -> str:
    def lookup(path: str) -> str:
        value: object = event
        for part in path.split("."):
            value = getattr(value, part)
        return str(value)

    out, rest = [], template
    while "{" in rest:
        head, _, tail = rest.partition("{")
        name, _, rest = tail.partition("}")
        out.append(head)
        out.append(lookup(name))
    out.append(rest)
    return "".join(out)


def subject_for(event: Event) -> str:
    """The subject an event is published on, e.g. ``sla.offer.<task_id>``."""
    return _fill(route_for(type(event)).subject, event)


def msg_id_for(event: Event) -> str | None:
    """The ``Nats-Msg-Id`` that makes publishing this event idempotent, if it has one."""
    template = route_for(type(event)).msg_id
    return _fill(template, event) if template else None


@dataclass(frozen=True)
class StreamSpec:
    """A JetStream stream. ``max_age_s = 0`` keeps messages until limits apply."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float = 7 * 24 * 3600
    duplicate_window_s: float = 120
    max_bytes: int = 1 << 30
    memory: bool = False


INSTANCE_IDLE_LIMIT_S = 7 * 24 * 3600.0
"""An instance's own consumer that nobody has pulled from for this long is removed by the
server: its instance is gone (a node taken out of the fleet, a Deployment's pod), and a
consumer kept for it would pile up messages for nobody. Long, because such a consumer is
resumed: a node's executor back after an outage of days goes on from where it was."""

RUN_IDLE_LIMIT_S = 5 * 60.0
"""A per-run consumer (``ConsumerSpec.per_run``) that nobody has pulled from for this long
is removed by the server: the run that made it crashed (a clean stop removes it at once).
Nothing is lost by removing it early, since it is never resumed: a run cut off from the
server for longer makes it again, and reads the recent past again. Before, these consumers
had the week of ``INSTANCE_IDLE_LIMIT_S``, and a policy replica whose name changes with
every start (host and pid) left one behind per restart."""


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer shared by every replica of one service.

    ``start_s_ago`` is where a consumer starts when the server first makes it: ``None`` at
    the stream's first message, else that many seconds back (see ``for_instance``).
    ``idle_limit_s``: the server removes the consumer after this long without a pull
    (``None``: never).

    ``per_run``: each instance's consumer belongs to one run of its process, for a service
    that keeps what it reads in memory only (the policy's fingerprints) and so must read
    the recent past again whenever it starts. It is made afresh at every start, even under
    a name the last run used (a StatefulSet pod, a container restarted in its pod: the same
    hostname, pid 1), rather than resumed past what that run read and lost; removed when
    the run stops cleanly, and by the server after ``RUN_IDLE_LIMIT_S`` without a pull when
    it did not. Only an instance's consumer can be per run (``for_instance``): a shared one
    made afresh would lose the other replicas' place.

    ``handler_limit_s``: how long one delivery's handling may take. Past it the handler is
    cancelled and the delivery counts as failed (delivered again on ``backoff_s``, then
    dead-lettered): a handler that hung (a lock nobody releases, a server behind a
    partition) kept its message in progress for ever, and its replica's consumer took
    nothing else. Well above the longest wait any handler is built for (the SLA's two
    minutes for a fleet to report, an executor's hand-over)."""

    durable: str
    stream: str
    filter_subject: str
    ack_wait_s: float = 30
    max_deliver: int = 5
    max_ack_pending: int = 1000
    backoff_s: tuple[float, ...] = field(default=(0.5, 2, 5, 10))
    handler_limit_s: float = 900.0
    start_s_ago: float | None = None
    idle_limit_s: float | None = None
    per_run: bool = False

    def for_instance(self, instance: str, start_s_ago: float) -> ConsumerSpec:
        """This consumer for one instance of a service (the executor of one node), not
        shared with the other instances: its own durable, ``<durable>-<instance>`` (with
        characters a durable name cannot hold as ``_``), that gets every message.

        An instance may join long after the stream began (a node added to the fleet, or
        back after its consumer was removed), so it starts ``start_s_ago`` back rather than
        at the stream's first message, which may be days of other instances' history. One
        idle for ``INSTANCE_IDLE_LIMIT_S`` is removed (a node back after that starts afresh,
        ``start_s_ago`` back); a ``per_run`` one, idle for ``RUN_IDLE_LIMIT_S``."""
        return replace(self, durable=f"{self.durable}-{re.sub(r'[^A-Za-z0-9_-]', '_', instance)}",
                       start_s_ago=start_s_ago,
                       idle_limit_s=RUN_IDLE_LIMIT_S if self.per_run else INSTANCE_IDLE_LIMIT_S)


@dataclass(frozen=True)
class BucketSpec:
    """A JetStream key-value bucket."""

    name: str
    history: int = 1
    ttl_s: float = 0
    description: str = ""


STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec("TASKS", ("task.>",)),
    StreamSpec("SLA", ("sla.offer.*", "sla.reply.*")),
    StreamSpec("DECISIONS", ("decision.>",)),
    StreamSpec("ACTIONS", ("action.>",)),
    StreamSpec("FEEDBACK", ("feedback.recorded",)),
    StreamSpec("MODELS", ("model.>",), max_age_s=30 * 24 * 3600),
    StreamSpec("TOPOLOGY", ("topology.>",), max_age_s=24 * 3600),
    # High-rate telemetry travels on core NATS; this short-lived stream serves late joiners.
    StreamSpec("TELEMETRY", ("telemetry.>",), max_age_s=300, max_bytes=256 << 20, memory=True),
    StreamSpec("DLQ", ("dlq.>",), max_age_s=30 * 24 * 3600),
)

CONSUMERS: dict[str, ConsumerSpec] = {
    spec.durable: spec
    for spec in (
        ConsumerSpec("sla-submitted", "TASKS", "task.submitted"),
        ConsumerSpec("sla-replies", "SLA", "sla.reply.*"),
        ConsumerSpec("sla-lifecycle", "TASKS", "task.lifecycle.>"),
        # A task given up after admission (the policy: refused by the executor again and
        # again) ends there: its contract goes, as when it ends.
        ConsumerSpec("sla-rejected", "TASKS", "task.rejected"),
        ConsumerSpec("fingerprinter-submitted", "TASKS", "task.submitted"),
        ConsumerSpec("policy-admitted", "TASKS", "task.admitted", ack_wait_s=10),
        ConsumerSpec("policy-lifecycle", "TASKS", "task.lifecycle.>"),
        # An assign the executor could not carry out for a passing reason is placed again.
        ConsumerSpec("policy-failed", "ACTIONS", "action.failed"),
        # The latest fingerprint per task feeds admission OOM risk and OOM-driven migration:
        # an instance consumer per replica, for each replica decides by every task's. Per
        # run: a replica keeps them in memory, so it reads the recent ones again at each start.
        ConsumerSpec("policy-fingerprints", "TASKS", "task.fingerprinted", per_run=True),
        ConsumerSpec("executor-decisions", "DECISIONS", "decision.made"),
        ConsumerSpec("feedback-executed", "ACTIONS", "action.>"),
        ConsumerSpec("feedback-lifecycle", "TASKS", "task.lifecycle.>"),
        ConsumerSpec("fingerprinter-lifecycle", "TASKS", "task.lifecycle.>"),
        ConsumerSpec("topology-reports", "TOPOLOGY", "topology.report.>"),
        # The learner joins each placement to its outcome; every replica sees every message
        # (an instance consumer per replica), so each learns from all of them.
        ConsumerSpec("learner-decisions", "DECISIONS", "decision.made"),
        ConsumerSpec("learner-feedback", "FEEDBACK", "feedback.recorded"),
    )
}

RETIRED_CONSUMERS: tuple[tuple[str, str], ...] = (
    # Shared by the policy's replicas until each got an instance consumer of its own
    # (``policy-fingerprints-<replica>``); left on an upgraded server, it would keep its
    # position and state for ever, bound by nobody.
    ("TASKS", "policy-fingerprints"),
)
"""``(stream, durable)`` of consumers that earlier versions made and this one no longer
binds: set-up removes them (``Bus.ensure_topology``)."""

BUCKETS: tuple[BucketSpec, ...] = (
    BucketSpec("ledger", history=5, description="Allocation ledger: one key per node, CAS writes."),
    BucketSpec("topology", description="Fleet topology: one key per node."),
    BucketSpec("gpu_state", ttl_s=120, description="Latest sample per GPU, for late joiners."),
    BucketSpec("fingerprints", history=3,
               description="Statistics by task signature: fingerprints, OOM floors, restores."),
    # Rewritten every minute while a run reports, and every half hour while a stopped run
    # waits for its restore; a key left behind (its run ended while no replica ran, its task
    # forgotten) goes after an hour, twice the default silent-forget limit past which no
    # replica restores a run that reports.
    BucketSpec("fingerprint_series", ttl_s=3600,
               description="Each run in progress's memory series by task, for the fingerprinter replica that "
                           "takes it on after a restart."),
    BucketSpec("config", history=10, description="Policy profiles and shaping rules per host."),
    BucketSpec("contracts", description="Agreed SLA contracts and open offers by task."),
    # As long as a submission may still be redelivered (an outage included), not for ever.
    BucketSpec("rejections", ttl_s=24 * 3600,
               description="The rejection each negotiated submission got, for its redeliveries."),
    BucketSpec("hook_locks", ttl_s=35 * 60, description="Locks with a time-to-live for lifecycle hooks."),
    BucketSpec("executions", ttl_s=24 * 3600, description="Executed decision ids (idempotency)."),
    BucketSpec("executors", description="Each node's executor, rewriting its node's key while it runs."),
    BucketSpec("pending", description="Admitted tasks waiting for capacity, by task id."),
    BucketSpec("open_placements", ttl_s=14 * 24 * 3600,
               description="Executed assigns and migrations awaiting the end of their placement, by decision id."),
    # As long as an admitted task may still be placed again; a finished task's key is deleted.
    BucketSpec("placement_failures", ttl_s=14 * 24 * 3600,
               description="The placements an OOM killed and the assigns the executor refused, by task: "
                           "what the restart limits count."),
    BucketSpec("models", history=5, description="Learned models by name (msgspec JSON); the revision is the version."),
)

DLQ_PREFIX = "dlq."

SUBJECT_MAX_BYTES = 2048
"""The longest subject (UTF-8) Fleetpilot publishes on or subscribes to. nats-server closes
the connection of a client whose command line (verb, subject, reply inbox, sizes) passes
its ``max_control_line``, 4096 bytes by default: half of it leaves room for the rest."""

TASK_ID_MAX_BYTES = 1024
"""The longest task id (UTF-8): one token of ``task.lifecycle.<task>`` and the like, whose
dead-letter subjects stay within ``SUBJECT_MAX_BYTES``."""


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: ``*`` is one token, ``>`` one or more trailing tokens."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def stream_of(subject: str) -> str | None:
    """The name of the stream that keeps ``subject`` (a literal subject), ``None`` for a
    subject no stream keeps."""
    for stream in STREAMS:
        if any(subject_matches(p, subject) for p in stream.subjects):
            return stream.name
    return None


def dlq_subject(subject: str) -> str:
    """The dead-letter subject for a message that arrived on ``subject``."""
    return DLQ_PREFIX + subject


def subject_problem(subject: str, *, wildcards: bool = True) -> str | None:
    """What makes ``subject`` one that nats-py refuses to subscribe to (it raises
    ``BadSubjectError`` mid-command), in a few words; ``None`` when nothing does.
    Without ``wildcards``, ``*`` and ``>`` are refused too (a subject to publish on)."""
    if not subject:
        return "is empty"
    if len(subject.encode()) > SUBJECT_MAX_BYTES:
        return f"is longer than {SUBJECT_MAX_BYTES} bytes"
    if any(c.isspace() for c in subject):
        return "has white space"
    tokens = subject.split(".")
    if "" in tokens:
        return "has an empty token (a leading, trailing or doubled dot)"
    for i, token in enumerate(tokens):
        if "*" not in token and ">" not in token:
            continue
        if not wildcards:
            return "has a wildcard (* or >)"
        if token not in ("*", ">"):
            return f"has a wildcard inside a token ({token!r})"
        if token == ">" and i != len(tokens) - 1:
            return "has > before its last token"
    return None


def task_id_problem(task_id: str) -> str | None:
    """Why ``task_id`` cannot be a task's id, ``None`` when it can: the id is one token of
    the subjects that carry the task (``sla.offer.<task>``, ``task.lifecycle.<task>``), at
    most ``TASK_ID_MAX_BYTES`` long."""
    if "." in task_id:
        return "has a dot"
    if len(task_id.encode()) > TASK_ID_MAX_BYTES:
        return f"is longer than {TASK_ID_MAX_BYTES} bytes"
    return subject_problem(task_id, wildcards=False)

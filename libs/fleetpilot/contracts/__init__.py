"""The wire language of Fleetpilot: every event, every subject, one codec.

Import events from here: ``from fleetpilot.contracts import TaskSubmitted, DecisionMade``.
"""

from .action import ActionExecuted, ActionFailed
from .base import Event, Record, now
from .catalog import (
    BUCKETS,
    CONSUMERS,
    ROUTES,
    STREAMS,
    BucketSpec,
    ConsumerSpec,
    Route,
    StreamSpec,
    dlq_subject,
    msg_id_for,
    route_for,
    subject_for,
    subject_matches,
)
from .codec import decode, decoder_for, encode
from .deadletter import DeadLetter
from .decision import ActionKind, DecisionMade, Placement, PolicyRef
from .feedback import FeedbackRecorded, FeedbackStats, Measured, Outcome, StatsGroup, StatsQuery
from .fingerprint import Fingerprint, GrowthPattern, TaskFingerprinted
from .ledger import Allocation, NodeLedger
from .sim import SimAck, SimCommand, SimEvent
from .sla import OfferOption, SlaOffer, SlaReply
from .task import (
    Contract,
    LifecycleState,
    RejectCode,
    SlaRequest,
    SlaTier,
    TaskAdmitted,
    TaskKind,
    TaskLifecycle,
    TaskRejected,
    TaskSubmitted,
)
from .telemetry import GpuSample, NicPortRate, NodeTelemetry, ProcessMemory, Reading, TaskTelemetry
from .topology import (
    GPU_LABEL_CORDONED,
    GPU_LABEL_DECOMMISSIONED,
    GPU_LABEL_MAINTENANCE_PENDING,
    GPU_LABEL_MAINTENANCE_RISK,
    OPERATIONAL_GPU_LABELS,
    BandwidthEstimate,
    GpuInfo,
    Link,
    LinkKind,
    NicInfo,
    NicPort,
    NodeTopology,
    TopologyReport,
    TopologyUpdated,
)

ALL_EVENTS: tuple[type[Event], ...] = tuple(route.event for route in ROUTES) + tuple(
    route.reply for route in ROUTES if route.reply is not None)

__all__ = [
    "ALL_EVENTS",
    "ActionExecuted",
    "ActionFailed",
    "ActionKind",
    "Allocation",
    "BUCKETS",
    "BandwidthEstimate",
    "BucketSpec",
    "CONSUMERS",
    "ConsumerSpec",
    "Contract",
    "DeadLetter",
    "DecisionMade",
    "Event",
    "FeedbackRecorded",
    "FeedbackStats",
    "Fingerprint",
    "GPU_LABEL_CORDONED",
    "GPU_LABEL_DECOMMISSIONED",
    "GPU_LABEL_MAINTENANCE_PENDING",
    "GPU_LABEL_MAINTENANCE_RISK",
    "GpuInfo",
    "GpuSample",
    "GrowthPattern",
    "LifecycleState",
    "Link",
    "LinkKind",
    "Measured",
    "NicInfo",
    "NicPort",
    "NicPortRate",
    "NodeLedger",
    "NodeTelemetry",
    "NodeTopology",
    "OPERATIONAL_GPU_LABELS",
    "OfferOption",
    "Outcome",
    "Placement",
    "PolicyRef",
    "ProcessMemory",
    "ROUTES",
    "Reading",
    "Record",
    "RejectCode",
    "Route",
    "STREAMS",
    "SimAck",
    "SimCommand",
    "SimEvent",
    "SlaOffer",
    "SlaReply",
    "SlaRequest",
    "SlaTier",
    "StatsGroup",
    "StatsQuery",
    "StreamSpec",
    "TaskAdmitted",
    "TaskFingerprinted",
    "TaskKind",
    "TaskLifecycle",
    "TaskRejected",
    "TaskSubmitted",
    "TaskTelemetry",
    "TopologyReport",
    "TopologyUpdated",
    "decode",
    "decoder_for",
    "dlq_subject",
    "encode",
    "msg_id_for",
    "now",
    "route_for",
    "subject_for",
    "subject_matches",
]

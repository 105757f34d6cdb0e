"""Contract tests: every event survives the wire, tolerates the future and names itself.

Instances are built from the types themselves (``msgspec.inspect``), so a new event or a
new field is covered without touching this file.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from fleetpilot.contracts import (
    ALL_EVENTS,
    CONSUMERS,
    ENDPOINTS,
    ROUTES,
    Contract,
    DeadLetter,
    DecisionMade,
    ModelPublished,
    NodeTelemetry,
    SlaOffer,
    SlaReply,
    TaskAdmitted,
    TaskLifecycle,
    TaskRejected,
    TaskSubmitted,
    TaskTelemetry,
    TopologyReport,
    decode,
    dlq_subject,
    encode,
    msg_id_for,
    route_for,
    subject_for,
)
from fleetpilot.contracts.base import Event

TAG_PATTERN = re.compile(r"^[a-z][a-z_]*\.[a-z][a-z_]*\.v[1-9][0-9]*$")
# Tags that predate the `<family>.<name>.v<N>` rule; renaming one is a breaking change
# (a new tag), so each is listed here on purpose and the test below insists it still exists.
TAGS_WITHOUT_NAME: set[str] = set()


def _value(t: mi.Type, full: bool, token: str) -> Any:
    """A valid value of type ``t``; ``full`` also fills optional fields and prefers non-None."""
    if isinstance(t, mi.Metadata):  # ``Annotated`` with schema-only metadata (``INT_KEYS``)
        return _value(t.type, full, token)
    if isinstance(t, mi.StrType):
        return token
    if isinstance(t, mi.BoolType):
        return True
    if isinstance(t, mi.IntType):
        return 3
    if isinstance(t, mi.FloatType):
        # Within a bounded field's range (a probability is at most 1), away from its edges.
        return 1.5 if t.le is None or t.le >= 1.5 else t.le / 2
    if isinstance(t, mi.BytesType):
        return b"\x00raw bytes\xff"
    if isinstance(t, mi.NoneType):
        return None
    if isinstance(t, mi.LiteralType):
        return t.values[-1] if full else t.values[0]
    if isinstance(t, mi.ListType):
        return [_value(t.item_type, full, token)] if full else []
    if isinstance(t, mi.VarTupleType):
        return (_value(t.item_type, full, token),) if full else ()
    if isinstance(t, mi.DictType):
        key = "k" if isinstance(t.key_type, mi.StrType) else _value(t.key_type, full, token)
        return {key: _value(t.value_type, full, token)} if full else {}
    if isinstance(t, mi.UnionType):
        members = [m for m in t.types if not isinstance(m, mi.NoneType)]
        return _value(members[0], full, token)
    if isinstance(t, mi.StructType):
        return _build(t, full, token)
    raise NotImplementedError(f"no sample value for {t!r}; extend _value")


def _build(info: mi.StructType, full: bool, token: str) -> Any:
    # A flag that defaults to true (``TaskSubmitted.resumable``) is set to false when full.
    kwargs = {f.name: (not f.default if full and isinstance(f.default, bool) else _value(f.type, full, token))
              for f in info.fields if f.required or full}
    return info.cls(**kwargs)


def minimal(event_type: type[Event], token: str = "t1") -> Any:
    """An instance with only the required fields set."""
    return _build(mi.type_info(event_type), full=False, token=token)


def full(event_type: type[Event], token: str = "t1") -> Any:
    """An instance with every field set to a non-default value where the type allows."""
    return _build(mi.type_info(event_type), full=True, token=token)


EVENT_IDS = [e.__name__ for e in ALL_EVENTS]


@pytest.mark.parametrize("event_type", ALL_EVENTS, ids=EVENT_IDS)
@pytest.mark.parametrize("builder", [minimal, full], ids=["minimal", "full"])
def test_round_trip_through_own_and_union_decoder(event_type, builder):
    event = builder(event_type)
    data = encode(event)
    assert decode(data, event_type) == event
    # The runtime decodes a stream's subjects with a union decoder; the tag must pick the type.
    back = decode(data, *ALL_EVENTS)
    assert type(back) is event_type and back == event


@pytest.mark.parametrize("event_type", ALL_EVENTS, ids=EVENT_IDS)
def test_full_instance_sets_every_field_so_round_trip_is_meaningful(event_type):
    # Guard against the builder silently producing defaults (which would make the round trip
    # above pass for an encoder that drops fields).
    event, info = full(event_type), mi.type_info(event_type)
    wire = msgspec.json.decode(encode(event))
    for f in info.fields:
        assert f.encode_name in wire, f"{event_type.__name__}.{f.name} missing on the wire"
        if not f.required and not isinstance(f.type, mi.LiteralType):
            assert getattr(event, f.name) != f.default, f"{event_type.__name__}.{f.name} left at default"


@pytest.mark.parametrize("event_type", ALL_EVENTS, ids=EVENT_IDS)
def test_unknown_fields_are_tolerated_at_top_level_and_nested(event_type):
    event = full(event_type)
    wire = msgspec.json.decode(encode(event))
    wire["added_in_v1_1"] = {"anything": [1, 2, 3]}
    nested = [f.encode_name for f in mi.type_info(event_type).fields if isinstance(f.type, mi.StructType)]
    for name in nested:
        wire[name]["nested_future_field"] = "x"
    assert decode(msgspec.json.encode(wire), event_type) == event


def test_unknown_fields_inside_a_nested_record_are_tolerated():
    # Guards the loop above against finding no nested record at all.
    wire = msgspec.json.decode(encode(TaskSubmitted(task_id="j")))
    wire["sla"]["max_queue_s_v2"] = 5
    assert decode(msgspec.json.encode(wire), TaskSubmitted) == TaskSubmitted(task_id="j")


def test_tags_are_versioned_unique_and_in_the_type_field():
    tags = [e.__struct_config__.tag for e in ALL_EVENTS]
    assert len(tags) == len(set(tags)), "two events share a tag"
    for event_type, tag in zip(ALL_EVENTS, tags, strict=True):
        assert event_type.__struct_config__.tag_field == "type"
        assert isinstance(tag, str) and re.search(r"\.v[1-9][0-9]*$", tag), tag
        if tag not in TAGS_WITHOUT_NAME:
            assert TAG_PATTERN.match(tag), f"{tag} is not <family>.<name>.v<N>"
        assert msgspec.json.decode(encode(minimal(event_type)))["type"] == tag


def test_every_event_has_exactly_one_route():
    # Replies of request/reply endpoints travel on the requester's inbox, not a route; some
    # (``task.admitted``, an answer of ``sla.negotiate``) are published events as well.
    replies = {reply for r in ROUTES + ENDPOINTS for reply in r.replies}
    routed = {r.event for r in ROUTES}
    assert len(routed) == len(ROUTES) == len(ALL_EVENTS) - len(replies - routed)
    assert len(set(ALL_EVENTS)) == len(ALL_EVENTS)
    for event_type in ALL_EVENTS:
        assert issubclass(event_type, Event)
        if event_type in routed:
            assert route_for(event_type).event is event_type
        else:
            assert event_type in replies


def test_endpoints_on_routed_types_stay_out_of_routing():
    # ``sla.negotiate`` takes a ``task.submitted`` body, yet a TaskSubmitted is still
    # published on ``task.submitted``.
    assert route_for(TaskSubmitted).subject == "task.submitted"
    assert subject_for(TaskSubmitted(task_id="t1")) == "task.submitted"
    assert msg_id_for(TaskSubmitted(task_id="t1", submitted_at=7.5)) == "submit:t1:7.5"
    for endpoint in ENDPOINTS:
        assert endpoint not in ROUTES and route_for(endpoint.event) is not endpoint
        assert endpoint.replies and set(endpoint.replies) <= set(ALL_EVENTS)
        assert not endpoint.durable and endpoint.msg_id is None


def test_route_for_unrouted_type_is_an_error():
    class Stray(Event, frozen=True, kw_only=True, tag="stray.thing.v1"):
        x: int = 0

    with pytest.raises(LookupError, match="Stray"):
        route_for(Stray)


@pytest.mark.parametrize("event_type", [r.event for r in ROUTES], ids=[r.event.__name__ for r in ROUTES])
def test_every_route_template_fills_from_a_valid_event(event_type):
    # Placeholders are filled with the builder's token, so a subject never keeps a brace.
    event = minimal(event_type, token="tok")
    subject = subject_for(event)
    assert "{" not in subject and "}" not in subject
    msg_id = msg_id_for(event)
    assert msg_id is None or ("{" not in msg_id and msg_id)


# --------------------------------------------------------------------------- decode failures


def _submitted_wire() -> dict[str, Any]:
    return msgspec.json.decode(encode(TaskSubmitted(task_id="job-1")))


def test_unknown_tag_is_rejected():
    wire = _submitted_wire() | {"type": "task.submitted.v99"}
    with pytest.raises(msgspec.ValidationError, match="unknown event type 'task.submitted.v99'"):
        decode(msgspec.json.encode(wire), *ALL_EVENTS)


def test_a_newer_version_is_refused_as_an_unknown_type_naming_what_is_taken():
    # Its dead letter must say what happened (a producer ahead of this consumer), not only
    # msgspec's "Invalid value ... at $.type", which reads like a malformed field.
    wire = _submitted_wire() | {"type": "task.submitted.v2", "new_in_v2": [1]}
    for consumer in [(TaskSubmitted,), (TaskSubmitted, TaskLifecycle)]:
        with pytest.raises(msgspec.ValidationError) as info:
            decode(msgspec.json.encode(wire), *consumer)
        message = str(info.value)
        assert message.startswith("unknown event type 'task.submitted.v2' (this consumer takes task.submitted.v1")
        assert "\n" not in message and "newer version" in message
        assert ("task.lifecycle.v1" in message) == (TaskLifecycle in consumer)


def test_a_wrong_field_of_a_known_type_keeps_msgspecs_own_message():
    wire = _submitted_wire() | {"gpus": "two"}
    with pytest.raises(msgspec.ValidationError, match=r"at `\$.gpus`"):
        decode(msgspec.json.encode(wire), TaskSubmitted)


def test_the_single_type_placeholder_tag_is_not_an_event():
    # A one-type decoder is a union with a placeholder (so that the tag is required); a
    # payload with the placeholder's tag handed its empty instance to a typed handler.
    with pytest.raises(msgspec.ValidationError, match="unknown event type '_'"):
        decode(b'{"type": "_", "task_id": "j"}', TaskSubmitted)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"confidence": 1.2}, "$.confidence"),
        ({"confidence": -0.1}, "$.confidence"),
        ({"prior_confidence": 7}, "$.prior_confidence"),
        ({"placement": [{"node": "n", "gpu": -2, "milli": 500}]}, "$.placement[0].gpu"),
        ({"placement": [{"node": "n", "gpu": 0, "milli": -500}]}, "$.placement[0].milli"),
        ({"source": [{"node": "n", "gpu": 0, "milli": 500, "memory_mb": -1}]}, "$.source[0].memory_mb"),
    ],
)
def test_a_decision_outside_its_bounds_is_refused_naming_the_field(change, field):
    # Every consumer (executor, ledger, learner, users) used to take these as they came.
    wire = msgspec.json.decode(encode(full(DecisionMade))) | change
    with pytest.raises(msgspec.ValidationError) as info:
        decode(msgspec.json.encode(wire), DecisionMade)
    assert f"at `{field}`" in str(info.value)


def test_a_decision_at_its_bounds_is_taken():
    wire = msgspec.json.decode(encode(full(DecisionMade))) | {
        "confidence": 1.0, "prior_confidence": 0.0,
        "placement": [{"node": "n", "gpu": -1, "milli": 0, "memory_mb": 0}]}
    decision = decode(msgspec.json.encode(wire), DecisionMade)
    assert (decision.confidence, decision.prior_confidence, decision.placement[0].gpu) == (1.0, 0.0, -1)


def test_tag_of_another_event_is_rejected_by_a_narrow_decoder():
    data = encode(TaskSubmitted(task_id="job-1"))
    with pytest.raises(msgspec.ValidationError):
        decode(data, DecisionMade)


def test_missing_tag_is_rejected_by_a_union_decoder():
    wire = _submitted_wire()
    del wire["type"]
    with pytest.raises(msgspec.ValidationError, match="missing required field `type`"):
        decode(msgspec.json.encode(wire), *ALL_EVENTS)


def test_missing_tag_is_rejected_by_a_single_type_decoder():
    # The tag is what makes a payload an event of a version: without it, nothing says
    # which contract the producer meant, so it is refused as proto/ requires.
    wire = _submitted_wire()
    del wire["type"]
    with pytest.raises(msgspec.ValidationError, match="missing required field `type`"):
        decode(msgspec.json.encode(wire), TaskSubmitted)


@pytest.mark.parametrize(
    ("field", "bad"),
    [("task_id", 42), ("gpus", "two"), ("kind", "mine"), ("sla", []), ("labels", {"a": 1})],
)
def test_wrong_type_is_rejected(field, bad):
    wire = _submitted_wire() | {field: bad}
    with pytest.raises(msgspec.ValidationError, match=field):
        decode(msgspec.json.encode(wire), TaskSubmitted)


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b'{"type": "task.submitted.v1", "task_id": }', b"\xff\xfe", b"nul", b'{"task_id": "a"\x00}'],
)
def test_bad_json_is_a_decode_error(data):
    with pytest.raises(msgspec.DecodeError) as info:
        decode(data, TaskSubmitted)
    # A structural error (ValidationError) would mean the bytes parsed: these must not.
    assert not isinstance(info.value, msgspec.ValidationError)


# --------------------------------------------------------------------------- subjects and ids


def test_sla_offer_subject_carries_the_task():
    offer = full(SlaOffer)
    offer = msgspec.structs.replace(offer, task_id="job-7", offer_id="of-3")
    assert subject_for(offer) == "sla.offer.job-7"
    assert msg_id_for(offer) == "offer:of-3"


def test_a_models_withdrawal_is_not_taken_for_a_duplicate_of_its_publication():
    # Both name the same model and version; the stream de-duplicates by message id for two
    # minutes, and a withdrawal can follow a promotion within seconds.
    published = msgspec.structs.replace(full(ModelPublished), name="outcome", version=4, withdrawn=False)
    withdrawn = msgspec.structs.replace(published, withdrawn=True)
    assert msg_id_for(published) != msg_id_for(withdrawn)
    assert msg_id_for(published) == msg_id_for(msgspec.structs.replace(published, reason="again"))


def test_node_telemetry_subject_carries_the_node_and_has_no_dedup_id():
    sample = msgspec.structs.replace(full(NodeTelemetry), node="dgx-a100-03")
    assert subject_for(sample) == "telemetry.gpu.dgx-a100-03"
    # High-rate core NATS samples are never de-duplicated.
    assert msg_id_for(sample) is None


def test_dead_letter_subject_prefixes_the_original_subject():
    dead = DeadLetter(subject="task.submitted", reason="decode", data=b"{", at=1.0)
    assert subject_for(dead) == "dlq.task.submitted" == dlq_subject("task.submitted")
    assert msg_id_for(dead) is None
    nested = msgspec.structs.replace(dead, subject="sla.reply.job-9")
    assert subject_for(nested) == "dlq.sla.reply.job-9"


def test_dead_letter_keeps_original_bytes_exactly():
    raw = b'\x00{"not": json\xff'
    dead = DeadLetter(subject="decision.made", reason="bad json", data=raw, at=2.0)
    assert decode(encode(dead), DeadLetter).data == raw


def test_msg_ids_follow_nested_and_multi_field_templates():
    submitted = TaskSubmitted(task_id="job-1", submitted_at=3.0)
    assert msg_id_for(submitted) == "submit:job-1:3.0"
    # A task's answers are told apart by their time: a refusal, then another after the
    # task was submitted again, are two events (one id from the task alone dropped the second).
    refusals = [TaskRejected(task_id="job-1", code=code, reason="", rejected_at=at)
                for code, at in (("offer_expired", 4.0), ("offer_expired", 9.0), ("infeasible", 9.0))]
    assert len({msg_id_for(r) for r in refusals}) == 3
    assert msg_id_for(refusals[0]) == msg_id_for(msgspec.structs.replace(refusals[0], reason="again"))
    admitted = TaskAdmitted(task=submitted, contract=Contract(), tenant="acme", admitted_at=5.0)
    assert msg_id_for(admitted) == "admit:job-1:5.0"
    life = TaskLifecycle(task_id="job-1", state="oom_killed", at=12.5)
    assert subject_for(life) == "task.lifecycle.job-1"
    assert msg_id_for(life) == "life:job-1:oom_killed:12.5"
    report = full(TopologyReport, token="node-4")
    assert subject_for(report) == "topology.report.node-4"
    assert msg_id_for(report) == f"topo:node-4:{report.at}"
    decision = msgspec.structs.replace(full(DecisionMade), decision_id="d-1")
    assert (subject_for(decision), msg_id_for(decision)) == ("decision.made", "decision:d-1")


def test_same_event_gives_same_msg_id_so_retries_dedupe():
    a, b = full(DecisionMade), full(DecisionMade)
    assert a == b and msg_id_for(a) == msg_id_for(b)
    other = msgspec.structs.replace(a, decision_id="other")
    assert msg_id_for(other) != msg_id_for(a)


def test_a_consumer_for_one_instance_has_a_durable_name_of_its_own() -> None:
    shared = CONSUMERS["executor-decisions"]
    mine = shared.for_instance("ip-10-0-3-7.ec2.internal/gpu pool*>", start_s_ago=600)
    # Dots, slashes, spaces and wildcards cannot be in a durable's name.
    assert mine.durable == "executor-decisions-ip-10-0-3-7_ec2_internal_gpu_pool__"
    assert (mine.stream, mine.filter_subject, mine.start_s_ago) == (shared.stream, shared.filter_subject, 600)
    assert shared.start_s_ago is None  # the shared one still starts at the stream's first message


def test_a_per_run_consumer_is_removed_after_minutes_idle_and_a_node_s_after_a_week() -> None:
    from fleetpilot.contracts.catalog import INSTANCE_IDLE_LIMIT_S, RUN_IDLE_LIMIT_S

    # The policy's replicas read the fingerprints again at each start: a consumer left by a
    # replica that died serves nobody. Before, it stayed a week, one per restart.
    fingerprints = CONSUMERS["policy-fingerprints"].for_instance("host-4242", start_s_ago=600)
    assert fingerprints.per_run and fingerprints.idle_limit_s == RUN_IDLE_LIMIT_S <= 10 * 60
    # A node's executor goes on from where it was, after an outage of days too.
    node = CONSUMERS["executor-decisions"].for_instance("node-a", start_s_ago=600)
    assert not node.per_run and node.idle_limit_s == INSTANCE_IDLE_LIMIT_S
    assert [name for name, spec in CONSUMERS.items() if spec.per_run] == ["policy-fingerprints"]


# --------------------------------------------------------------------------- streams and the README


def test_streams_do_not_overlap_and_keep_every_durable_route():
    from fleetpilot.contracts import STREAMS
    from fleetpilot.contracts.catalog import stream_of

    # JetStream refuses a second stream over a subject another one holds, and a durable
    # route no stream keeps is published into nothing (its consumers wait for ever).
    def sample(template: str) -> str:
        return re.sub(r"\{[^}]+\}", "x", template)

    every = [p for s in STREAMS for p in s.subjects]
    concrete = [sample(r.subject) for r in ROUTES] + [p.replace(">", "x.y").replace("*", "x") for p in every]
    for subject in concrete:
        holders = [s.name for s in STREAMS if any(_matches(p, subject) for p in s.subjects)]
        assert len(holders) <= 1, (subject, holders)
    for route in ROUTES:
        held = stream_of(sample(route.subject))
        if route.durable:
            assert held is not None, route.subject
        if route.replies:
            # A stream over a request subject answers the request with its publish ack.
            assert held is None, route.subject
    for endpoint in ENDPOINTS:
        assert stream_of(sample(endpoint.subject)) is None, endpoint.subject
    for spec in CONSUMERS.values():
        [stream] = [s for s in STREAMS if s.name == spec.stream]
        filtered = spec.filter_subject.replace(">", "x.y").replace("*", "x")
        assert any(_matches(p, filtered) for p in stream.subjects), spec.durable


def _matches(pattern: str, subject: str) -> bool:
    from fleetpilot.contracts import subject_matches

    return subject_matches(pattern, subject)


def test_readme_subjects_table_names_every_route_with_its_tag():
    from pathlib import Path

    readme = Path(__file__).resolve().parents[4] / "README.md"
    table = readme.read_text().split("## Subjects", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for subject in re.findall(r"`([^`]+)`", cells[0]):
            rows[subject] = set(re.findall(r"`([^`]+)`", cells[1]))
    addresses = {re.sub(r"\{(?:[a-z_]+\.)*([a-z]+)(?:_id)?\}", r"<\1>", r.subject) for r in ROUTES + ENDPOINTS}
    assert set(rows) == addresses, set(rows) ^ addresses
    for route in ROUTES + ENDPOINTS:
        # The README writes ``{task_id}`` as ``<task>``, ``{node.node}`` as ``<node>``.
        address = re.sub(r"\{(?:[a-z_]+\.)*([a-z]+)(?:_id)?\}", r"<\1>", route.subject)
        assert address in rows, f"README Subjects table lacks {address}"
        assert route.event.__struct_config__.tag in rows[address], address
        for reply in route.replies:
            assert reply.__struct_config__.tag in rows[address], (address, reply.__name__)


# --------------------------------------------------------------------------- subject tokens


def test_a_task_id_too_long_for_the_servers_control_line_is_refused():
    # The id is a token of ``sla.offer.<task>``, ``task.lifecycle.<task>`` and
    # ``telemetry.task.<task>``: nats-server closes the connection of a client whose
    # publish names a subject past its control line (4096 bytes by default), so one
    # submission with a 5000-character id cut off, again and again, the SLA service, the
    # executor and the collector that published for it.
    from fleetpilot.contracts.catalog import SUBJECT_MAX_BYTES, TASK_ID_MAX_BYTES, task_id_problem

    assert task_id_problem("a" * TASK_ID_MAX_BYTES) is None
    for too_long in ("a" * 5000, "a" * (TASK_ID_MAX_BYTES + 1), "é" * (TASK_ID_MAX_BYTES // 2 + 1)):
        why = task_id_problem(too_long)
        assert why is not None and f"{TASK_ID_MAX_BYTES} bytes" in why and "\n" not in why
    # The longest id taken still fits every subject that carries it, dead-lettered too.
    longest = "é" * (TASK_ID_MAX_BYTES // 2)
    for event_type in (TaskLifecycle, SlaOffer, TaskTelemetry, SlaReply):
        event = msgspec.structs.replace(full(event_type), task_id=longest)
        assert len(dlq_subject(subject_for(event)).encode()) <= SUBJECT_MAX_BYTES < 4096
    # A client learns the bound from proto/.
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[4] / "proto" / "README.md").read_text().split())
    assert f"at most {TASK_ID_MAX_BYTES} bytes" in readme


def test_a_subject_past_the_limit_is_refused():
    from fleetpilot.contracts.catalog import SUBJECT_MAX_BYTES, subject_problem

    assert subject_problem("dlq." + "a" * (SUBJECT_MAX_BYTES - 4)) is None
    assert f"{SUBJECT_MAX_BYTES} bytes" in (subject_problem("dlq." + "a" * (SUBJECT_MAX_BYTES - 3)) or "")

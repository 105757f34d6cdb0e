"""``proto/`` is generated from the code, committed, and must never drift from it.

Also checks that the AsyncAPI document describes the whole bus: every route, header,
stream, durable consumer and bucket, with every ``$ref`` resolvable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from fleetpilot.contracts import (
    ALL_EVENTS,
    BUCKETS,
    CONSUMERS,
    ENDPOINTS,
    ROUTES,
    STREAMS,
    DeadLetter,
    schema,
)

PROTO = Path(__file__).resolve().parents[4] / "proto"


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"non-local $ref {ref}"
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _all_refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _all_refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _all_refs(v)]
    return []


def test_committed_proto_matches_the_code():
    assert PROTO.is_dir(), "proto/ is missing"
    drifted = schema.drift(PROTO)
    assert drifted == [], f"run `python -m fleetpilot.contracts.schema --write`; drifted: {drifted}"


def test_rendering_is_deterministic():
    # Twice in one process proves nothing about set or dict order that changes with the hash
    # seed: the committed files must come out the same from another process, another seed.
    rendered = [
        subprocess.run([sys.executable, "-c", RENDER_AS_JSON], env={**os.environ, "PYTHONHASHSEED": seed},
                       capture_output=True, text=True, timeout=120, check=True).stdout
        for seed in ("1", "2")
    ]
    assert rendered[0] == rendered[1] == json.dumps(schema.render())


RENDER_AS_JSON = "import json; from fleetpilot.contracts import schema; print(json.dumps(schema.render()), end='')"


def test_check_reports_drift_in_one_line_and_write_repairs_it(tmp_path, capsys):
    proto = tmp_path / "proto"
    assert schema.main(["--write", "--proto-dir", str(proto)]) == 0
    assert schema.main(["--check", "--proto-dir", str(proto)]) == 0

    edited = proto / "jsonschema" / "task.submitted.v1.json"
    edited.write_text(edited.read_text() + " ")
    (proto / "asyncapi.yaml").unlink()
    (proto / "jsonschema" / "task.removed.v1.json").write_text("{}")
    capsys.readouterr()
    assert schema.main(["--check", "--proto-dir", str(proto)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for name in ("asyncapi.yaml", "jsonschema/task.submitted.v1.json", "jsonschema/task.removed.v1.json"):
        assert name in err

    assert schema.main(["--write", "--proto-dir", str(proto)]) == 0
    assert schema.drift(proto) == []
    assert not (proto / "jsonschema" / "task.removed.v1.json").exists()


def test_check_passes_on_a_copy_of_the_committed_proto(tmp_path):
    shutil.copytree(PROTO, tmp_path / "proto")
    assert schema.main(["--check", "--proto-dir", str(tmp_path / "proto")]) == 0


# --------------------------------------------------------------------------- JSON Schema


def test_one_self_contained_schema_per_event():
    files = {p.name for p in (PROTO / "jsonschema").glob("*.json")}
    tags = {schema.tag_of(e) for e in ALL_EVENTS}
    assert files == {f"{t}.json" for t in tags} | {"all.json"}
    for tag in tags:
        doc = json.loads((PROTO / "jsonschema" / f"{tag}.json").read_text())
        assert doc["$schema"] == schema.JSON_SCHEMA_DIALECT
        root = _resolve(doc, doc["$ref"])
        assert root["properties"]["type"] == {"enum": [tag]}
        assert "type" in root["required"]
        # Unknown fields must stay allowed for forward compatibility.
        assert root.get("additionalProperties", True) is not False
        for ref in _all_refs(doc):
            _resolve(doc, ref)


def test_all_json_covers_every_event():
    doc = json.loads((PROTO / "jsonschema" / "all.json").read_text())
    names = [_resolve(doc, branch["$ref"])["title"] for branch in doc["oneOf"]]
    assert names == [e.__name__ for e in ALL_EVENTS]


# --------------------------------------------------------------------------- AsyncAPI


@pytest.fixture(scope="module")
def asyncapi() -> dict[str, Any]:
    return yaml.safe_load((PROTO / "asyncapi.yaml").read_text())


def test_asyncapi_basics(asyncapi):
    assert asyncapi["asyncapi"] == "3.0.0"
    assert asyncapi["servers"]["nats"]["protocol"] == "nats"
    assert asyncapi["defaultContentType"] == "application/json"
    assert "`type`" in asyncapi["info"]["description"]
    assert "&id" not in (PROTO / "asyncapi.yaml").read_text()
    for ref in _all_refs(asyncapi):
        _resolve(asyncapi, ref)


def test_every_route_has_a_channel_message_and_operations(asyncapi):
    by_address = {c["address"]: (cid, c) for cid, c in asyncapi["channels"].items()}
    assert len(by_address) == len(asyncapi["channels"]) == len(ROUTES) + len(ENDPOINTS)
    for route in ROUTES:
        address = route.subject.replace("{node.node}", "{node}")
        cid, channel = by_address[address]
        name = route.event.__name__
        for param in channel.get("parameters", {}):
            assert "{" + param + "}" in address and channel["parameters"][param]["description"]
        assert ("{" in address) == bool(channel.get("parameters"))
        message = asyncapi["components"]["messages"][name]
        assert message["name"] == schema.tag_of(route.event)
        assert message["payload"] == {"$ref": f"#/components/schemas/{name}"}
        headers = message["headers"]["properties"]
        assert "traceparent" in headers
        # A dead letter's id is not made from its payload: the runtime gives it its own.
        assert ("Nats-Msg-Id" in headers) == (route.msg_id is not None or route.event is DeadLetter)
        actions = {
            op["action"]
            for op in asyncapi["operations"].values()
            if op["channel"]["$ref"] == f"#/channels/{cid}"
        }
        assert actions == {"send", "receive"}


# Every request/reply endpoint a service serves (``host.endpoint``): address -> request
# message, possible replies. A client generated from proto/ must be able to call each.
SERVED_ENDPOINTS: dict[str, tuple[str, set[str]]] = {
    "feedback.stats": ("StatsQuery", {"FeedbackStats"}),
    "sim.control": ("SimCommand", {"SimAck"}),
    "executor.handover.{node}": ("HandOver", {"HandedOver"}),
    "sla.negotiate": ("TaskSubmitted", {"SlaOffer", "TaskAdmitted", "TaskRejected"}),
}


@pytest.mark.parametrize("address", sorted(SERVED_ENDPOINTS))
def test_every_served_endpoint_is_documented_with_its_replies(asyncapi, address):
    request, replies = SERVED_ENDPOINTS[address]
    [(cid, channel)] = [(cid, c) for cid, c in asyncapi["channels"].items() if c["address"] == address]
    assert set(channel["messages"]) == {request} | replies
    assert channel["x-fleetpilot"]["transport"] == "core" and "deadLetter" not in channel["x-fleetpilot"]
    ops = [op for op in asyncapi["operations"].values() if op["channel"]["$ref"] == f"#/channels/{cid}"]
    assert sorted(op["action"] for op in ops) == ["receive", "send"]
    for op in ops:
        assert op["messages"] == [{"$ref": f"#/channels/{cid}/messages/{request}"}]
        assert {m["$ref"] for m in op["reply"]["messages"]} == {f"#/channels/{cid}/messages/{r}" for r in replies}
        for ref in [op["messages"][0]["$ref"]] + [m["$ref"] for m in op["reply"]["messages"]]:
            message = _resolve(asyncapi, _resolve(asyncapi, ref)["$ref"])
            assert message["payload"]["$ref"].endswith("/" + message["title"])


@pytest.mark.parametrize("address", sorted(SERVED_ENDPOINTS))
def test_every_endpoint_says_how_it_answers_what_it_cannot_serve(asyncapi, address):
    # A request the service refuses (``feedback.stats`` by a field it cannot group by) is
    # answered ``{"error": ...}`` too, and a failure of the service's own with an empty body
    # and nats.micro's error headers: the contract named only the request that does not
    # decode, and a client generated from it decoded an empty body as an answer.
    [cid] = [cid for cid, c in asyncapi["channels"].items() if c["address"] == address]
    how = " ".join(asyncapi["operations"][f"receive_{cid}"]["summary"].split())
    for said in ('`{"error": ...}`', "refuses", "empty body", "`Nats-Service-Error`", "`Nats-Service-Error-Code`"):
        assert said in how, (said, how)


def test_sla_negotiate_request_keeps_its_auth_header(asyncapi):
    channel = asyncapi["channels"]["sla_negotiate"]
    request = _resolve(asyncapi, channel["messages"]["TaskSubmitted"]["$ref"])
    assert "Authorization" in request["headers"]["properties"]
    assert "nothing is published or stored" in channel["description"]


def test_task_submitted_documents_auth_and_idempotency(asyncapi):
    headers = asyncapi["components"]["messages"]["TaskSubmitted"]["headers"]["properties"]
    assert "Bearer" in headers["Authorization"]["description"]
    assert "submit:{task_id}:{submitted_at}" in headers["Nats-Msg-Id"]["description"]


def test_a_dead_letters_id_is_documented(asyncapi):
    # The runtime stores each dead letter under ``Nats-Msg-Id: dlq:<origin>`` (the original's
    # place in its stream), so that one original makes one letter whatever the retries; the
    # contract said a dead letter had no id, and a client that moves or copies letters could
    # not keep that guarantee.
    headers = asyncapi["components"]["messages"]["DeadLetter"]["headers"]["properties"]
    described = headers["Nats-Msg-Id"]["description"]
    assert "`dlq:<stream>:<consumer>:<sequence>`" in described and "core NATS" in described


def test_dead_letter_channel_is_documented(asyncapi):
    dlq = asyncapi["channels"]["dlq_dead_letter"]
    assert dlq["address"] == "dlq.{subject}"
    assert "dlq.>" in dlq["parameters"]["subject"]["description"]
    assert asyncapi["channels"]["decision_made"]["x-fleetpilot"]["deadLetter"] == "dlq.decision.made"
    assert "dlq." in asyncapi["x-fleetpilot"]["deadLetter"]


def test_bus_layout_extension_mirrors_the_catalog(asyncapi):
    layout = asyncapi["x-fleetpilot"]
    assert [s["name"] for s in layout["streams"]] == [s.name for s in STREAMS]
    assert {c["durable"] for c in layout["consumers"]} == set(CONSUMERS)
    assert [b["name"] for b in layout["buckets"]] == [b.name for b in BUCKETS]
    for channel in asyncapi["channels"].values():
        if channel["x-fleetpilot"]["transport"] == "jetstream":
            assert channel["x-fleetpilot"]["stream"] in {s.name for s in STREAMS}
        else:  # core subjects (telemetry, request/reply) may have a short-lived stream or none
            assert channel["x-fleetpilot"].get("stream") in {s.name for s in STREAMS} | {None}
    consumers = {
        c for ch in asyncapi["channels"].values() for c in ch["x-fleetpilot"].get("durableConsumers", [])
    }
    # Every durable consumer reads at least one documented channel.
    assert consumers == set(CONSUMERS)


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("task.>", "task.submitted", True),
        ("task.>", "task", False),
        ("sla.reply.*", "sla.reply.job", True),
        ("sla.reply.*", "sla.reply.job.x", False),
        ("action.>", "action.failed", True),
        ("decision.made", "decision.made", True),
        ("decision.made", "decision.made.x", False),
        ("telemetry.*", "telemetry.gpu.n1", False),
    ],
)
def test_subject_matching(pattern, subject, expected):
    assert schema.subject_matches(pattern, subject) is expected


def _struct_fields() -> list[tuple[str, Any]]:
    """``(struct name, inspect field)`` of every struct an event is made of."""
    return [(info.cls.__name__, f) for info in sorted(schema._structs(), key=lambda i: i.cls.__name__)
            for f in info.fields]


def test_every_map_with_integer_keys_says_so_in_the_schema():
    import msgspec.inspect as mi

    components = json.loads((PROTO / "jsonschema" / "all.json").read_text())["$defs"]
    keyed = 0
    for name, f in _struct_fields():
        t = f.type.type if isinstance(f.type, mi.Metadata) else f.type
        if isinstance(t, mi.DictType) and not isinstance(t.key_type, mi.StrType):
            keyed += 1
            assert "propertyNames" in components[name]["properties"][f.encode_name], f"{name}.{f.name}"
    assert keyed  # GpuSample.xid_codes at least


def test_every_field_a_client_may_leave_out_shows_the_value_it_then_takes():
    # A field with a default made by a factory got no ``default`` from msgspec: a Go or Rust
    # client could not tell that a ``feedback.stats`` query without ``by`` groups by policy,
    # shard, kind and GPU model, nor that a sample without its context-switch reading is
    # taken as no information (``uncertainty_score`` 1).
    import msgspec
    import msgspec.inspect as mi

    components = json.loads((PROTO / "jsonschema" / "all.json").read_text())["$defs"]
    for name, f in _struct_fields():
        if f.required or f.default is f.default_factory is mi.NODEFAULT:
            continue  # an UNSET field (inspect shows no default): left out of the wire, not filled in
        default = f.default if f.default is not mi.NODEFAULT else f.default_factory()
        shown = components[name]["properties"][f.encode_name]
        assert "default" in shown, f"{name}.{f.name} shows no default"
        assert shown["default"] == msgspec.json.decode(msgspec.json.encode(default)), f"{name}.{f.name}"

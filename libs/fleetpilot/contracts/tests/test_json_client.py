"""A client that knows only ``proto/``: hand-written JSON, checked against the committed
JSON Schema with a tiny validator, must decode with Fleetpilot's own decoder.

The validator is deliberately small (the keywords msgspec emits) so the project needs no
``jsonschema`` dependency; it is itself tested to reject bad documents.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fleetpilot.contracts import ALL_EVENTS, DecisionMade, NodeTelemetry, TaskSubmitted, decode

PROTO = Path(__file__).resolve().parents[4] / "proto"

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def validate(instance: Any, node: dict[str, Any], root: dict[str, Any], path: str = "$") -> list[str]:
    """Errors of ``instance`` against ``node`` (a subset of JSON Schema 2020-12)."""
    if "$ref" in node:
        target: Any = root
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return validate(instance, target, root, path)
    if "anyOf" in node:
        if any(not validate(instance, branch, root, path) for branch in node["anyOf"]):
            return []
        return [f"{path}: matches no anyOf branch"]
    errors: list[str] = []
    if "enum" in node and instance not in node["enum"]:
        errors.append(f"{path}: {instance!r} not in {node['enum']}")
    if "type" in node:
        allowed = _JSON_TYPES[node["type"]]
        # JSON booleans are not numbers, though Python's bool is an int.
        if (isinstance(instance, bool) and bool not in allowed) or not isinstance(instance, allowed):
            return errors + [f"{path}: expected {node['type']}, got {type(instance).__name__}"]
    if isinstance(instance, int | float) and not isinstance(instance, bool):
        if "minimum" in node and instance < node["minimum"]:
            errors.append(f"{path}: {instance!r} below minimum {node['minimum']}")
        if "maximum" in node and instance > node["maximum"]:
            errors.append(f"{path}: {instance!r} above maximum {node['maximum']}")
    if isinstance(instance, str) and "pattern" in node and re.search(node["pattern"], instance) is None:
        errors.append(f"{path}: {instance!r} does not match {node['pattern']!r}")
    if isinstance(instance, dict):
        for key in instance:
            if "propertyNames" in node:
                errors += validate(key, node["propertyNames"], root, f"{path}[{key!r}]")
        for name in node.get("required", []):
            if name not in instance:
                errors.append(f"{path}: missing required {name!r}")
        properties = node.get("properties", {})
        extra = node.get("additionalProperties", True)
        for key, value in instance.items():
            if key in properties:
                errors += validate(value, properties[key], root, f"{path}.{key}")
            elif isinstance(extra, dict):
                errors += validate(value, extra, root, f"{path}.{key}")
            elif extra is False:
                errors.append(f"{path}: unexpected {key!r}")
    if isinstance(instance, list) and "items" in node:
        for i, item in enumerate(instance):
            errors += validate(item, node["items"], root, f"{path}[{i}]")
    return errors


def load_schema(tag: str) -> dict[str, Any]:
    """The committed JSON Schema of one event tag (only ``proto/`` is read)."""
    return json.loads((PROTO / "jsonschema" / f"{tag}.json").read_text())


HAND_WRITTEN_SUBMISSION = """
{
  "type": "task.submitted.v1",
  "task_id": "go-client-0001",
  "kind": "train",
  "gpus": 2,
  "gpu_memory_mb": 40000,
  "gpu_models": ["A100-80GB", "H100-80GB"],
  "sla": {"tier": "vip", "max_queue_s": 120, "deadline": 1893456000},
  "labels": {"team": "vision"},
  "image": "ghcr.io/acme/trainer:1.4",
  "command": ["python", "train.py"],
  "expected_duration_s": 3600.5,
  "client_version": "go/1.2.0"
}
"""


def test_hand_written_task_submitted_validates_and_decodes():
    schema = load_schema("task.submitted.v1")
    doc = json.loads(HAND_WRITTEN_SUBMISSION)
    assert validate(doc, schema, schema) == []
    task = decode(HAND_WRITTEN_SUBMISSION.encode(), TaskSubmitted)
    assert isinstance(task, TaskSubmitted)
    assert (task.task_id, task.gpus, task.sla.tier, task.sla.max_queue_s) == ("go-client-0001", 2, "vip", 120)
    # The same bytes also decode through the all-events union a consumer would use.
    assert decode(HAND_WRITTEN_SUBMISSION.encode(), *ALL_EVENTS) == task


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda d: d.pop("task_id"), "missing required 'task_id'"),
        (lambda d: d.pop("type"), "missing required 'type'"),
        (lambda d: d.update(type="task.submitted.v2"), "not in"),
        (lambda d: d.update(gpus="2"), "expected integer"),
        (lambda d: d.update(gpus=True), "expected integer"),
        (lambda d: d.update(kind="gaming"), "not in"),
        (lambda d: d["sla"].update(tier="gold"), "$.sla.tier"),
        (lambda d: d["labels"].update(team=7), "$.labels.team"),
        (lambda d: d.update(command="python train.py"), "$.command"),
    ],
)
def test_schema_and_decoder_agree_on_invalid_submissions(mutate, error):
    schema = load_schema("task.submitted.v1")
    doc = json.loads(HAND_WRITTEN_SUBMISSION)
    mutate(doc)
    errors = validate(doc, schema, schema)
    assert any(error in e for e in errors), errors
    if "type" in doc:
        # Everything the schema rejects, the service rejects too (a missing tag is the one
        # case only the schema catches; see test_contracts).
        with pytest.raises(msgspec.ValidationError):
            decode(json.dumps(doc).encode(), TaskSubmitted)


README_DECISION = {"type": "decision.made.v1", "decision_id": "d-1", "task_id": "go-1", "action": "assign",
                   "placement": [{"node": "n1", "gpu": 0, "milli": 1000}], "confidence": 0.9,
                   "policy": {"name": "fgd"}, "decided_at": 1767225601.25}


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda d: d.update(confidence=1.5), "above maximum"),
        (lambda d: d.update(prior_confidence=-0.5), "matches no anyOf"),
        (lambda d: d["placement"][0].update(milli=-1), "below minimum"),
        (lambda d: d["placement"][0].update(gpu=-2), "below minimum"),
    ],
)
def test_schema_and_decoder_agree_on_decisions_out_of_bounds(mutate, error):
    # A Go policy or replay tool validating against proto/ refuses what Fleetpilot refuses.
    schema = load_schema("decision.made.v1")
    doc = json.loads(json.dumps(README_DECISION))
    assert validate(doc, schema, schema) == []
    mutate(doc)
    assert any(error in e for e in validate(doc, schema, schema)), validate(doc, schema, schema)
    with pytest.raises(msgspec.ValidationError):
        decode(json.dumps(doc).encode(), DecisionMade)


def _readme_examples() -> list[dict[str, Any]]:
    text = (PROTO / "README.md").read_text()
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", text, flags=re.S)]


def test_readme_examples_validate_against_proto_and_decode():
    examples = _readme_examples()
    tags = [e["type"] for e in examples]
    assert "task.submitted.v1" in tags and "decision.made.v1" in tags
    for example in examples:
        schema = load_schema(example["type"])
        assert validate(example, schema, schema) == [], example["type"]
        event = decode(json.dumps(example).encode(), *ALL_EVENTS)
        assert event.__struct_config__.tag == example["type"]
        # Decoded, it carries every value the README shows (a decoder dropping or renaming a
        # field would still give the right type).
        assert _carries(msgspec.json.decode(msgspec.json.encode(event)), example), example["type"]
    decision = next(e for e in examples if e["type"] == "decision.made.v1")
    decoded = decode(json.dumps(decision).encode(), DecisionMade)
    assert (decoded.decision_id, decoded.task_id, decoded.action) == (
        decision["decision_id"], decision["task_id"], decision["action"])


def test_every_tag_the_readme_names_is_a_real_one():
    # A client switches on ``type``; a tag the README names that no event carries (it said
    # ``dlq.v1`` for ``dlq.dead_letter.v1``) is a switch case that never matches.
    text = (PROTO / "README.md").read_text()
    named = set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)*\.v[0-9]+)`", text))
    tags = {e.__struct_config__.tag for e in ALL_EVENTS}
    assert {"task.submitted.v1", "decision.made.v1"} <= named
    assert named <= tags, sorted(named - tags)


def _carries(got: Any, shown: Any) -> bool:
    """Whether ``got`` holds every key and value of ``shown`` (extra defaults allowed)."""
    if isinstance(shown, dict):
        return isinstance(got, dict) and all(k in got and _carries(got[k], v) for k, v in shown.items())
    if isinstance(shown, list):
        return isinstance(got, list) and len(got) == len(shown) and all(map(_carries, got, shown))
    return got == shown


GPU_SAMPLE = {"node": "n1", "gpu": 0, "uuid": "GPU-0", "model": "H100", "at": 1767225600.0,
              "utilization_gpu_pct": 50, "utilization_memory_pct": 20, "memory_total_mb": 81559,
              "memory_used_mb": 1000, "memory_free_mb": 80559, "temperature_c": 60, "power_w": 300,
              "power_limit_w": 700, "sm_clock_mhz": 1980, "pcie_tx_kbps": 1, "pcie_rx_kbps": 2}


@pytest.mark.parametrize(("codes", "taken"), [
    ({"48": 1, "45": 3}, True), ({"-1": 1}, True),
    ({"xid48": 1}, False), ({"48.0": 1}, False), ({"048": 1}, False), ({"+48": 1}, False), ({"": 1}, False),
])
def test_schema_and_decoder_agree_on_the_keys_of_a_map_keyed_by_integers(codes, taken):
    # ``xid_codes`` is ``dict[int, int]``: JSON keys are strings, and msgspec takes only a
    # decimal integer's. The schema said only "object of integers", so a Go collector that
    # validated against it had its telemetry dead-lettered; a generator made it map[string]int.
    schema = load_schema("telemetry.gpu.v1")
    doc = {"type": "telemetry.gpu.v1", "node": "n1", "at": 1767225600.0, "source": "nvml",
           "gpus": [GPU_SAMPLE | {"xid_codes": codes}]}
    errors = validate(doc, schema, schema)
    assert (errors == []) == taken, errors
    if taken:
        assert decode(json.dumps(doc).encode(), NodeTelemetry).gpus[0].xid_codes == {int(k): v for k, v in codes.items()}
    else:
        assert any("$.gpus[0].xid_codes[" in e for e in errors), errors
        with pytest.raises(msgspec.ValidationError, match="xid_codes"):
            decode(json.dumps(doc).encode(), NodeTelemetry)


def test_the_validator_checks_patterns_and_property_names():
    node = {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"}}
    assert validate({"12": 1}, node, node) == []
    assert validate({"a": 1}, node, node) == ["$['a']: 'a' does not match '^[0-9]+$'"]


def test_an_integer_written_with_a_fraction_is_refused_and_proto_says_so():
    # JSON Schema's ``integer`` takes ``2.0`` (a number whose fraction is zero), so a client
    # that validates against proto/ finds it good; msgspec refuses it, and the event was
    # dead-lettered with nothing in proto/ to say why.
    doc = json.loads(HAND_WRITTEN_SUBMISSION) | {"gpus": 2.0}
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int`, got `float` - at `\$.gpus`"):
        decode(json.dumps(doc).encode(), TaskSubmitted)
    everything = json.loads((PROTO / "jsonschema" / "all.json").read_text())
    asyncapi = (PROTO / "asyncapi.yaml").read_text()
    for text in (everything["description"], " ".join(asyncapi.replace("\n", " ").split())):
        assert "`integer` fields take a JSON integer written without a fraction or an exponent" in " ".join(text.split())

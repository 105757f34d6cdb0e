"""Generate the language-neutral contract in ``proto/`` from the Python contracts.

``proto/`` is what a Go or Rust team reads instead of this package: one JSON Schema per
event (``proto/jsonschema/<tag>.json``), all of them together (``proto/jsonschema/all.json``)
and an AsyncAPI 3.0 document (``proto/asyncapi.yaml``) with every subject, header, stream,
durable consumer and KV bucket. Everything is derived from ``catalog`` and the event
Structs, so the code stays the single source of truth and ``--check`` catches drift::

    python -m fleetpilot.contracts.schema --write   # regenerate proto/
    python -m fleetpilot.contracts.schema --check   # exit 1 if proto/ differs from the code

Output is deterministic (fixed key order, sorted ``$defs``, no timestamps) so that the
committed files only change when the contracts do.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import yaml

from . import ALL_EVENTS
from .base import Event
from .catalog import (
    BUCKETS,
    CONSUMERS,
    DLQ_PREFIX,
    ENDPOINTS,
    ROUTES,
    STREAMS,
    TASK_ID_MAX_BYTES,
    Route,
    StreamSpec,
    subject_matches,
)
from .deadletter import DeadLetter

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
ASYNCAPI_VERSION = "3.0.0"
# Bumped by hand when the shape of the generated documents (not the events) changes.
CONTRACT_DOC_VERSION = "1.1.0"

ASYNCAPI_FILE = "asyncapi.yaml"
JSONSCHEMA_DIR = "jsonschema"
ALL_SCHEMA_FILE = f"{JSONSCHEMA_DIR}/all.json"

# Human descriptions of subject-template parameters; the payload location is added
# automatically. A parameter missing here still gets a generic description.
PARAMETER_DESCRIPTIONS: dict[str, str] = {
    "task_id": ("The client-chosen task id (one subject token: no dots, spaces, `*` or `>`; at most "
                f"{TASK_ID_MAX_BYTES} bytes in UTF-8). The SLA service rejects any other with code `invalid`."),
    "node": "The node name as reported by its collector (one subject token).",
    "subject": (
        "The full subject the dead message originally arrived on; it may span several "
        "tokens, so subscribe to `dlq.>` (or e.g. `dlq.task.>`)."
    ),
}

# Routes that clients outside Fleetpilot publish to; only these carry the tenant's token.
CLIENT_PUBLISHED: frozenset[str] = frozenset({"task.submitted.v1", "sla.reply.v1"})

PAYLOAD_NOTE = (
    "Every payload is a UTF-8 JSON object with a `type` field holding a versioned tag "
    "`<family>.<name>.v<N>` (e.g. `task.submitted.v1`). Consumers ignore fields they do "
    "not know, so producers may add fields with defaults; a breaking change gets a new "
    "tag (`.v2`) and both tags live side by side for a while. `bytes` fields are base64 "
    "strings; times are seconds since the Unix epoch as JSON numbers. `integer` fields take "
    "a JSON integer written without a fraction or an exponent (`2`, not `2.0` or `2e0`, "
    "which JSON Schema's `integer` allows and Fleetpilot refuses)."
)


# --------------------------------------------------------------------------- helpers


def tag_of(event_type: type[Event]) -> str:
    """The versioned wire tag of an event type (``"task.submitted.v1"``)."""
    tag = event_type.__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"{event_type.__name__} has no string tag")
    return tag


def _channel_id(route: Route) -> str:
    # AsyncAPI keys must match ^[A-Za-z0-9_\-]+$; the tag without its version is stable
    # across versions, so a v2 message can join the same channel later. An endpoint of
    # ENDPOINTS shares its request type with a route, so its subject names it instead.
    if route in ENDPOINTS:
        return re.sub(r"[^A-Za-z0-9_-]", "_", _address(route.subject))
    family_name, _, _ = tag_of(route.event).rpartition(".")
    return family_name.replace(".", "_")


def _placeholders(template: str) -> list[str]:
    """The ``{field.path}`` placeholders of a subject template, in order."""
    names, rest = [], template
    while "{" in rest:
        _, _, tail = rest.partition("{")
        name, _, rest = tail.partition("}")
        names.append(name)
    return names


def _param_name(path: str) -> str:
    # ``node.node`` is not a legal AsyncAPI parameter name; the last segment reads best.
    return path.rsplit(".", 1)[-1]


def _address(template: str) -> str:
    for path in _placeholders(template):
        template = template.replace("{" + path + "}", "{" + _param_name(path) + "}")
    return template


def _concrete(template: str) -> str:
    """The template with every placeholder replaced by one literal token, for matching."""
    for path in _placeholders(template):
        template = template.replace("{" + path + "}", "_")
    return template


def _stream_for(route: Route) -> StreamSpec | None:
    subject = _concrete(route.subject)
    for stream in STREAMS:
        if any(subject_matches(pattern, subject) for pattern in stream.subjects):
            return stream
    return None


def _consumers_for(route: Route) -> list[str]:
    subject = _concrete(route.subject)
    return sorted(name for name, spec in CONSUMERS.items() if subject_matches(spec.filter_subject, subject))


def _strip_none(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def _refs(node: Any) -> Iterable[str]:
    """Every ``$ref`` target name in a schema tree."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield ref.rsplit("/", 1)[-1]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _closure(root: str, components: dict[str, Any]) -> list[str]:
    """The component names reachable from ``root`` (itself included), sorted."""
    seen: set[str] = set()
    todo = [root]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(_refs(components[name]))
    return sorted(seen)


def _structs() -> list[Any]:
    """``msgspec.inspect.StructType`` of every struct the events are made of, events first."""
    found: dict[type, Any] = {}

    def walk(t: Any) -> None:
        if isinstance(t, mi.Metadata):
            walk(t.type)
        elif isinstance(t, mi.StructType):
            if t.cls not in found:
                found[t.cls] = t
                for f in t.fields:
                    walk(f.type)
        elif isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
            walk(t.item_type)
        elif isinstance(t, mi.DictType):
            walk(t.key_type)
            walk(t.value_type)
        elif isinstance(t, mi.UnionType):
            for member in t.types:
                walk(member)

    for info in mi.multi_type_info(ALL_EVENTS):
        walk(info)
    return list(found.values())


def _components(ref_template: str) -> dict[str, Any]:
    """msgspec's schema of every struct the events are made of, by name, with the default of
    each field whose default a factory makes: msgspec shows only plain ones (and empty lists
    and dicts), and a client that leaves such a field out must know what it then gets
    (``StatsQuery.by``, a ``GpuSample``'s readings). A field left ``UNSET`` has none: it is
    left out of the wire, not filled in."""
    _, components = msgspec.json.schema_components(ALL_EVENTS, ref_template=ref_template)
    for info in _structs():
        for f in info.fields:
            if f.default_factory is not mi.NODEFAULT:
                shown = components[info.cls.__name__]["properties"][f.encode_name]
                shown.setdefault("default", msgspec.json.decode(msgspec.json.encode(f.default_factory())))
    return components


# --------------------------------------------------------------------------- JSON Schema


def json_schemas() -> dict[str, dict[str, Any]]:
    """Every JSON Schema document, keyed by its path relative to ``proto/``.

    Each per-event file is self-contained (it carries only the ``$defs`` it needs), so a
    client can validate one message type with one file.
    """
    components = _components("#/$defs/{name}")
    docs: dict[str, dict[str, Any]] = {}
    # One file per type, so a type with several roles (``task.admitted`` is published and
    # answers ``sla.negotiate``) names all of them in its one description.
    roles: dict[type[Event], list[str]] = {event: [] for event in ALL_EVENTS}
    for route in ROUTES:
        roles[route.event].append(f"{route.description} Subject: `{_address(route.subject)}`.")
    for route in ENDPOINTS:
        roles[route.event].append(f"Also the request of `{_address(route.subject)}`.")
    for route in ROUTES + ENDPOINTS:
        for reply in route.replies:
            roles[reply].append(f"Reply to `{_address(route.subject)}` requests.")
    for event in ALL_EVENTS:
        name, tag = event.__name__, tag_of(event)
        docs[f"{JSONSCHEMA_DIR}/{tag}.json"] = {
            "$schema": JSON_SCHEMA_DIALECT,
            "$id": f"{tag}.json",
            "title": name,
            "description": " ".join(roles[event]),
            "$ref": f"#/$defs/{name}",
            "$defs": {key: components[key] for key in _closure(name, components)},
        }
    docs[ALL_SCHEMA_FILE] = {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": "all.json",
        "title": "FleetpilotEvent",
        "description": "Any Fleetpilot event; the `type` field tells which. " + PAYLOAD_NOTE,
        "oneOf": [{"$ref": f"#/$defs/{event.__name__}"} for event in ALL_EVENTS],
        "$defs": {key: components[key] for key in sorted(components)},
    }
    return docs


# --------------------------------------------------------------------------- AsyncAPI


def _headers_schema(route: Route) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    if route.msg_id:
        properties["Nats-Msg-Id"] = {
            "type": "string",
            "description": (
                "Idempotency key: JetStream drops a second message with the same id inside "
                "the stream's duplicate window. Built from the payload as "
                f"`{route.msg_id}`; publish retries must reuse it."
            ),
            "x-fleetpilot-template": route.msg_id,
        }
    elif route.event is DeadLetter:
        # Not made from the payload: the runtime (``runtime.dispatch``) names the original.
        properties["Nats-Msg-Id"] = {
            "type": "string",
            "description": (
                "`dlq:<stream>:<consumer>:<sequence>`: where the original was when it was "
                "dead-lettered, so that one original makes one dead letter, however often its "
                "handling is retried; absent for a message that came on core NATS."
            ),
        }
    properties["traceparent"] = {
        "type": "string",
        "description": "W3C Trace Context parent (`00-<trace-id>-<span-id>-<flags>`); optional.",
        "pattern": "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
    }
    properties["tracestate"] = {"type": "string", "description": "W3C Trace Context vendor state; optional."}
    if tag_of(route.event) in CLIENT_PUBLISHED:
        properties["Authorization"] = {
            "type": "string",
            "description": (
                "`Bearer <jwt>`: the tenant's token. The SLA service takes the tenant from "
                "it and rejects the task with code `unauthenticated` when it is missing or "
                "invalid."
            ),
            "pattern": "^Bearer .+$",
        }
    return {"type": "object", "properties": properties}


def _message(route: Route) -> dict[str, Any]:
    name, tag = route.event.__name__, tag_of(route.event)
    doc = route.event.__doc__ or ""
    return _strip_none(
        {
            "name": tag,
            "title": name,
            "summary": route.description,
            "description": " ".join(doc.split()) or None,
            "contentType": "application/json",
            "headers": _headers_schema(route),
            "correlationId": {
                "description": "The W3C trace the message belongs to.",
                "location": "$message.header#/traceparent",
            },
            "payload": {"$ref": f"#/components/schemas/{name}"},
        }
    )


def _channel(route: Route) -> dict[str, Any]:
    name, tag = route.event.__name__, tag_of(route.event)
    stream = _stream_for(route)
    parameters = {
        _param_name(path): {
            "description": PARAMETER_DESCRIPTIONS.get(
                _param_name(path), f"Filled from the payload field `{path}`."
            ),
            "location": "$message.payload#/" + path.replace(".", "/"),
        }
        for path in _placeholders(route.subject)
    }
    transport = "jetstream" if route.durable else "core"
    return _strip_none(
        {
            "address": _address(route.subject),
            "title": tag,
            "description": route.description
            + (
                " Durable on JetStream (at-least-once)."
                if route.durable
                else " Published on core NATS (at-most-once); the stream only serves late joiners."
                if stream is not None
                else " Published on core NATS (at-most-once); no stream keeps it."
            ),
            "parameters": parameters or None,
            "messages": {n: {"$ref": f"#/components/messages/{n}"}
                         for n in [name] + [reply.__name__ for reply in route.replies]},
            "x-fleetpilot": _strip_none(
                {
                    "transport": transport,
                    "stream": stream.name if stream else None,
                    "msgIdTemplate": route.msg_id,
                    "durableConsumers": _consumers_for(route) or None,
                    # A sample stream: its consumers start no trace for it (``Route.traced``).
                    "traced": None if route.traced else False,
                    # An endpoint answers a bad request with an error body instead.
                    "deadLetter": None
                    if route.subject.startswith(DLQ_PREFIX) or route.replies
                    else f"{DLQ_PREFIX}{_address(route.subject)}",
                }
            ),
        }
    )


def _operations(route: Route) -> dict[str, dict[str, Any]]:
    cid, name, tag = _channel_id(route), route.event.__name__, tag_of(route.event)
    channel_ref = {"$ref": f"#/channels/{cid}"}
    message_ref = [{"$ref": f"#/channels/{cid}/messages/{name}"}]
    consumers = _consumers_for(route)
    # Both sides of a request/reply endpoint name its possible answers: the requester's
    # send gets one of them back, the service's receive answers with one of them.
    reply = {"messages": [{"$ref": f"#/channels/{cid}/messages/{r.__name__}"} for r in route.replies]} \
        if route.replies else None
    if route.replies:
        # As ``runtime.dispatch.reply_handler`` answers.
        how = ("Served as a `nats.micro` endpoint (one replica answers): the answer goes to the "
               "request's reply subject. A request that does not decode, or that the service "
               "refuses, is answered `{\"error\": ...}` (one line, no `type`) and is not "
               "dead-lettered; a failure of the service's own is answered with an empty body and "
               "the `Nats-Service-Error` and `Nats-Service-Error-Code` headers.")
    elif consumers:
        how = "Through the durable pull consumer(s) " + ", ".join(f"`{c}`" for c in consumers) + "."
    elif route.durable:
        how = "With an ephemeral or client-owned consumer on the stream."
    else:
        how = "With a plain core NATS subscription."
    return {
        f"send_{cid}": _strip_none({
            "action": "send",
            "channel": channel_ref,
            "title": f"{'Request' if route.replies else 'Publish'} {tag}",
            "summary": route.description,
            "messages": message_ref,
            "reply": reply,
        }),
        f"receive_{cid}": _strip_none(
            {
                "action": "receive",
                "channel": channel_ref,
                "title": f"{'Answer' if route.replies else 'Consume'} {tag}",
                "summary": how,
                "messages": message_ref,
                "reply": reply,
                "x-fleetpilot-consumers": consumers or None,
            }
        ),
    }


def _bus_layout() -> dict[str, Any]:
    return {
        "payloadFormat": PAYLOAD_NOTE,
        "deadLetter": (
            f"A message no handler can take is republished on `{DLQ_PREFIX}<original subject>` "
            "as a `dlq.dead_letter.v1` event carrying the reason, the original headers and the original "
            "bytes (base64); it is never lost and never crashes a service."
        ),
        "streams": [
            {
                "name": s.name,
                "subjects": list(s.subjects),
                "storage": "memory" if s.memory else "file",
                "maxAgeSeconds": s.max_age_s,
                "maxBytes": s.max_bytes,
                "duplicateWindowSeconds": s.duplicate_window_s,
            }
            for s in STREAMS
        ],
        "consumers": [
            {
                "durable": c.durable,
                "stream": c.stream,
                "filterSubject": c.filter_subject,
                "ackWaitSeconds": c.ack_wait_s,
                "maxDeliver": c.max_deliver,
                "maxAckPending": c.max_ack_pending,
                "backoffSeconds": list(c.backoff_s),
                "handlerLimitSeconds": c.handler_limit_s,
            }
            for c in sorted(CONSUMERS.values(), key=lambda c: c.durable)
        ],
        "buckets": [
            {"name": b.name, "history": b.history, "ttlSeconds": b.ttl_s, "description": b.description}
            for b in BUCKETS
        ],
    }


def asyncapi_document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of the whole bus, as plain data in a fixed order."""
    components = _components("#/components/schemas/{name}")
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for route in ROUTES + ENDPOINTS:
        channels[_channel_id(route)] = _channel(route)
        operations.update(_operations(route))
        if route in ROUTES:  # an endpoint's request type has its message from its route
            messages[route.event.__name__] = _message(route)
        for reply in route.replies:
            # A reply that is also published (``task.admitted``) keeps its published
            # message, set here or by its route later; the payload is the same.
            messages.setdefault(reply.__name__, {
                "name": tag_of(reply), "title": reply.__name__,
                "summary": " ".join((reply.__doc__ or "").split()), "contentType": "application/json",
                "payload": {"$ref": f"#/components/schemas/{reply.__name__}"}})
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "Fleetpilot event bus",
            "version": CONTRACT_DOC_VERSION,
            "description": (
                "Every subject Fleetpilot publishes or consumes. Users publish `task.submitted` "
                "and subscribe to `decision.made`; everything else is internal but public. "
                + PAYLOAD_NOTE
                + " Generated from `fleetpilot.contracts`; do not edit by hand."
            ),
        },
        "defaultContentType": "application/json",
        "servers": {
            "nats": {
                "host": "nats:4222",
                "protocol": "nats",
                "description": (
                    "NATS with JetStream: `nats:4222` inside docker compose and the "
                    "`fleetpilot` Kubernetes namespace, `localhost:4222` for `fleetpilot up`."
                ),
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {
            "messages": messages,
            "schemas": {key: components[key] for key in sorted(components)},
        },
        "x-fleetpilot": _bus_layout(),
    }


# --------------------------------------------------------------------------- rendering


def _dump_json(doc: Any) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


class _PlainDumper(yaml.SafeDumper):
    """A safe dumper that writes shared sub-trees out in full: ``&id001`` anchors would
    make the document harder to read and would change whenever dict identity does."""

    def ignore_aliases(self, data: Any) -> bool:
        """Never emit an alias, whatever the object."""
        return True


def _dump_yaml(doc: Any) -> str:
    header = "# Generated by `python -m fleetpilot.contracts.schema --write`; do not edit.\n"
    body = yaml.dump(
        doc, Dumper=_PlainDumper, sort_keys=False, allow_unicode=True, width=100, default_flow_style=False
    )
    return header + body


def render() -> dict[str, str]:
    """Every generated file's text, keyed by its path relative to ``proto/`` (sorted)."""
    files = {path: _dump_json(doc) for path, doc in json_schemas().items()}
    files[ASYNCAPI_FILE] = _dump_yaml(asyncapi_document())
    return dict(sorted(files.items()))


def drift(proto_dir: Path) -> list[str]:
    """Generated files that are missing, differ, or are stale leftovers in ``proto_dir``."""
    expected = render()
    drifted = [
        path
        for path, text in expected.items()
        if not (proto_dir / path).is_file() or (proto_dir / path).read_text(encoding="utf-8") != text
    ]
    # A schema left behind by a removed event would mislead clients: it is drift too.
    schema_dir = proto_dir / JSONSCHEMA_DIR
    if schema_dir.is_dir():
        for file in sorted(schema_dir.glob("*.json")):
            rel = f"{JSONSCHEMA_DIR}/{file.name}"
            if rel not in expected:
                drifted.append(rel)
    return sorted(drifted)


def write(proto_dir: Path) -> list[str]:
    """Write every generated file under ``proto_dir``, remove stale schemas; return what changed."""
    changed = drift(proto_dir)
    expected = render()
    for rel in changed:
        path = proto_dir / rel
        if rel in expected:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(expected[rel], encoding="utf-8")
        else:
            path.unlink()
    return changed


def default_proto_dir() -> Path:
    """``proto/`` of the source checkout this module lives in, else ``./proto``."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file() and (parent / "proto").is_dir():
            return parent / "proto"
    return Path.cwd() / "proto"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``--write`` regenerates ``proto/``, ``--check`` reports drift (exit 1)."""
    parser = argparse.ArgumentParser(
        prog="python -m fleetpilot.contracts.schema", description=__doc__.splitlines()[0]
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the files under proto/")
    mode.add_argument("--check", action="store_true", help="exit 1 if proto/ differs from the code")
    parser.add_argument("--proto-dir", type=Path, default=None, help="default: proto/ of this checkout")
    args = parser.parse_args(argv)
    proto_dir: Path = args.proto_dir or default_proto_dir()

    if args.write:
        changed = write(proto_dir)
        print(
            f"wrote {len(changed)} file(s) under {proto_dir}" + (": " + ", ".join(changed) if changed else "")
        )
        return 0
    drifted = drift(proto_dir)
    if drifted:
        print(
            f"proto/ is out of date with fleetpilot.contracts ({len(drifted)} file(s)): "
            + ", ".join(drifted)
            + " -- run `python -m fleetpilot.contracts.schema --write`",
            file=sys.stderr,
        )
        return 1
    print(f"proto/ matches fleetpilot.contracts ({len(render())} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``fleetpilot submit``: publish one task and print what Fleetpilot decided.

The task comes from flags or from a JSON/YAML file. The command waits for the task's
``decision.made`` (or ``task.rejected``); when the SLA negotiator answers with a
counter-offer it shows the options and asks which to accept (``--accept-offer`` takes the
first one without asking, for scripts).
"""

from __future__ import annotations

import asyncio
import difflib
import json
import os
import sys
import time
import uuid
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
import yaml

from fleetpilot.contracts import (
    DecisionMade,
    SlaOffer,
    SlaReply,
    SlaRequest,
    TaskRejected,
    TaskSubmitted,
    decode,
    encode,
    msg_id_for,
)
from fleetpilot.runtime import tracing
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.sla import task_problem

from . import event_loop
from .arguments import model_names, nats_url, path_text, positive_float
from .local import local_nats_url, local_token, state_dir


class UsageError(ValueError):
    """Bad input from the user: printed as one line, never a traceback."""


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot submit``."""
    parser.add_argument("--file", "-f", type=path_text, help="task as JSON or YAML (flags override its fields)")
    parser.add_argument("--task-id", default=None,
                        help="the task's id, one subject token: no dots, spaces, * or > (default: a new one)")
    parser.add_argument("--tenant", default="local", help="tenant of the local token (ignored with --token or $FLEETPILOT_TOKEN)")
    parser.add_argument("--kind", choices=["train", "finetune", "infer", "encode", "batch"])
    parser.add_argument("--gpus", type=int)
    parser.add_argument("--gpu-milli", type=int)
    parser.add_argument("--gpu-memory-mb", type=int)
    parser.add_argument("--gpu-models", type=model_names, help="comma-separated acceptable models")
    parser.add_argument("--cpu-milli", type=int)
    parser.add_argument("--memory-mb", type=int)
    parser.add_argument("--size-gb", type=float)
    parser.add_argument("--tier", choices=["vip", "standard", "best_effort"])
    parser.add_argument("--max-queue-s", type=float)
    parser.add_argument("--warmup-ms", type=float)
    parser.add_argument("--p95-latency-ms", type=float)
    parser.add_argument("--duration-s", type=float, dest="expected_duration_s")
    parser.add_argument("--command", nargs="+", default=None, help="command to run (process backend)")
    parser.add_argument("--not-resumable", dest="resumable", action="store_false", default=None,
                        help="the task does not go on from a checkpoint when started again: it is never "
                             "moved to make room for others, only off a GPU going away")
    # Both at once would silently decline: the parser refuses the pair instead.
    answer = parser.add_mutually_exclusive_group()
    answer.add_argument("--accept-offer", action="store_true", help="accept the first counter-option without asking")
    answer.add_argument("--decline-offer", action="store_true", help="decline any counter-offer without asking")
    # Checked by the parser: a timeout of 0 or less would publish the task, then give up at once.
    parser.add_argument("--timeout", type=positive_float, default=30.0,
                        help="seconds to wait for the decision (default 30)")
    parser.add_argument("--nats-url", type=nats_url, default=None,
                        help="the bus (default: $FLEETPILOT_NATS_URL, else the one `fleetpilot up` runs, else :4222)")
    parser.add_argument("--token", default=os.environ.get("FLEETPILOT_TOKEN"),
                        help="bearer JWT (default: $FLEETPILOT_TOKEN, else one for --tenant from the local key)")
    parser.add_argument("--state-dir", type=path_text, default=None)


TASK_FIELDS = frozenset(f.encode_name for f in msgspec.structs.fields(TaskSubmitted))
SLA_FIELDS = frozenset(f.encode_name for f in msgspec.structs.fields(SlaRequest))


def _unknown_field(path: str, name: str, known: frozenset[str], prefix: str = "") -> UsageError:
    """The error for a field the task has not, with the closest one it has: msgspec ignores
    it, and a misspelt ``gpu_memroy_mb`` went out as a task that asks for no GPU memory."""
    close = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
    return UsageError(f"{path}: unknown field {prefix + name!r}{hint}")


def _load_file(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"no such file: {path}")
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text file") from None
    try:
        doc = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise UsageError(f"{path}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                         f"{str(exc).splitlines()[0]}") from None
    except RecursionError:
        # Both parsers recurse once per level: thousands of brackets were a traceback.
        raise UsageError(f"{path}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: nested too deep") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: expected a mapping of task fields, got {type(doc).__name__}")
    doc.pop("type", None)  # the event's tag, in a file saved from the bus
    for name in doc:
        if name not in TASK_FIELDS:
            raise _unknown_field(path, str(name), TASK_FIELDS)
    sla = doc.get("sla")
    if sla is not None and not isinstance(sla, dict):
        # dict() of it raised a TypeError (a traceback) for a number, and said "dictionary
        # update sequence element #0 has length 1" for a word.
        raise UsageError(f"{path}: sla must be a mapping of SLA fields ({', '.join(sorted(SLA_FIELDS))}), "
                         f"got {type(sla).__name__}")
    for name in sla or {}:
        if name not in SLA_FIELDS:
            raise _unknown_field(path, str(name), SLA_FIELDS, prefix="sla.")
    return doc


def build_task(args) -> TaskSubmitted:
    """The task from the file and flags, validated against the contract."""
    doc = _load_file(args.file) if args.file is not None else {}
    sla = dict(doc.get("sla") or {})
    for flag in ("kind", "gpus", "gpu_milli", "gpu_memory_mb", "cpu_milli", "memory_mb", "size_gb",
                 "expected_duration_s", "command", "resumable"):
        value = getattr(args, flag)
        if value is not None:
            doc[flag] = value
    if args.gpu_models is not None:
        doc["gpu_models"] = [m.strip() for m in args.gpu_models.split(",") if m.strip()]
    for flag, field in (("tier", "tier"), ("max_queue_s", "max_queue_s"), ("warmup_ms", "warmup_ms"),
                        ("p95_latency_ms", "p95_latency_ms")):
        value = getattr(args, flag)
        if value is not None:
            sla[field] = value
    doc["sla"] = sla
    # An empty --task-id is the user's (refused below, as an empty one in a file is), not a
    # call for a new one: it took a new id without a word.
    doc.setdefault("task_id", f"task-{uuid.uuid4().hex[:10]}" if args.task_id is None else args.task_id)
    if args.task_id is not None:
        doc["task_id"] = args.task_id
    doc["submitted_at"] = time.time()
    try:
        task = msgspec.convert(doc, TaskSubmitted)
        msgspec.convert(sla, SlaRequest)
    except msgspec.ValidationError as exc:
        raise UsageError(f"invalid task: {exc}") from None
    # What the SLA service would reject it for, said before publishing: a bad id among it,
    # which would also break the subjects that carry the task here (nats-py refuses to listen
    # on ``sla.offer.<id>`` with a traceback, or a wildcard id listens to other tasks' offers).
    problem = task_problem(task)
    if problem is not None:
        raise UsageError(f"invalid task: {problem}")
    return task


async def submit(task: TaskSubmitted, args, out=sys.stdout) -> int:
    """Publish and wait for the outcome; returns the exit code (0 placed, or queued when the wait
    ends first; 1 rejected, by the SLA service or by a policy's ``reject`` decision)."""
    token = args.token or local_token(state_dir(args.state_dir), args.tenant)
    args.nats_url = args.nats_url or local_nats_url(args.state_dir)
    bus = await NatsBus.connect(args.nats_url, "fleetpilot-submit", connect_timeout_s=2)
    answers: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg) -> None:
        await answers.put(msg)

    # Known to the server before the task goes out, so no answer can come before we listen.
    for subject in ("decision.made", "task.rejected", f"sla.offer.{task.task_id}"):
        await bus.subscribe(subject, on_msg)
    try:
        with tracing.producer_span("fleetpilot.submit") as trace_headers:
            try:
                await bus.publish_raw("task.submitted", encode(task), headers={
                    **trace_headers, "Authorization": f"Bearer {token}", "Nats-Msg-Id": msg_id_for(task)})
            except (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError):
                # NATS is up but no stream takes the subject: Fleetpilot is not running there.
                raise ConnectionError(f"no Fleetpilot stream takes task.submitted at {args.nats_url} "
                                      "(start it with `fleetpilot up`, or point --nats-url at it)") from None
        print(f"submitted {task.task_id}", file=out, flush=True)
        deadline = time.monotonic() + args.timeout
        queued = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if queued:
                    # Decided: the fleet holds the task and places it when capacity frees up.
                    print(f"{task.task_id} is still queued after {args.timeout:.0f}s "
                          "(`fleetpilot watch` shows its placement)", file=sys.stderr)
                    return 0
                print(f"no decision for {task.task_id} within {args.timeout:.0f}s", file=sys.stderr)
                return 2
            try:
                msg = await asyncio.wait_for(answers.get(), remaining)
            except TimeoutError:
                continue
            # Every other task's decisions and rejections come here too, and whatever anyone
            # publishes on those subjects: one that does not decode is not this task's answer.
            # It ended the wait with exit 2 while the task went on being decided.
            if msg.subject == "decision.made":
                decision = _decoded(msg.data, DecisionMade)
                if decision is None or decision.task_id != task.task_id:
                    continue
                print(json.dumps(msgspec.to_builtins(decision_summary(decision)), indent=2), file=out)
                if decision.action == "reject":  # a profile's ``no_fit_action``: as final as task.rejected
                    return 1
                if decision.action != "queue":
                    return 0
                queued = True
            elif msg.subject == "task.rejected":
                rejected = _decoded(msg.data, TaskRejected)
                if rejected is not None and rejected.task_id == task.task_id:
                    print(f"rejected ({rejected.code}): {rejected.reason}", file=out)
                    return 1
            else:
                offer = _decoded(msg.data, SlaOffer)
                if offer is None:
                    print(f"fleetpilot submit: ignored a counter-offer on {msg.subject} that does not decode",
                          file=sys.stderr)
                    continue
                reply = msgspec.structs.replace(await answer_offer(offer, args, out), replied_at=time.time())
                await bus.publish(reply, headers={"Authorization": f"Bearer {token}"})
    finally:
        await bus.drain()


def _decoded(data: bytes, event_type: type):
    """``data`` as ``event_type``, or ``None`` when it is not one."""
    try:
        return decode(data, event_type)
    except msgspec.DecodeError:  # ValidationError is one
        return None


def decision_summary(decision: DecisionMade) -> dict:
    """The fields of a decision a user wants to see."""
    return {"task_id": decision.task_id, "action": decision.action, "decision_id": decision.decision_id,
            "placement": [msgspec.to_builtins(p) for p in decision.placement],
            "confidence": round(decision.confidence, 3), "policy": f"{decision.policy.name}@{decision.policy.version}",
            "shard_id": decision.shard_id, "fallback": decision.fallback, "reason": decision.reason}


async def read_line(prompt: str, out) -> str:
    """One line typed at the terminal after ``prompt``, stripped; "" at end of input (Ctrl-D).

    Read when the event loop says standard input is ready, not with ``input()``: that held the
    loop, so Ctrl-C at the prompt did nothing until Enter (a second one ended the command with
    nats-py's traceback), and the bus connection went unserved meanwhile."""
    print(prompt, end="", file=out, flush=True)
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = sys.stdin.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)
    return os.read(fd, 4096).decode("utf-8", "replace").strip()  # a terminal hands over one line


async def answer_offer(offer: SlaOffer, args, out) -> SlaReply:
    """Show a counter-offer and ask (or use ``--accept-offer`` / ``--decline-offer``)."""
    print(f"counter-offer for {offer.task_id}: {offer.reason}", file=out)
    for i, option in enumerate(offer.options, 1):
        print(f"  [{i}] {option.why}", file=out)
    if args.decline_offer or not offer.options:
        return SlaReply(offer_id=offer.offer_id, task_id=offer.task_id, accept=False)
    if args.accept_offer:
        choice = 1
    elif sys.stdin.isatty():
        while True:
            raw = await read_line(f"accept which option (1-{len(offer.options)}, empty = decline)? ", out)
            if not raw:  # Enter, or Ctrl-D
                return SlaReply(offer_id=offer.offer_id, task_id=offer.task_id, accept=False)
            if raw.isascii() and raw.isdigit() and 1 <= int(raw) <= len(offer.options):
                break
            # Asked again: ending here left the offer unanswered, and the task was rejected
            # when it expired, for a typo.
            print(f"not an option: {raw!r}", file=out)
        choice = int(raw)
    else:
        # Nobody to ask: declined, and said so. The rejection that follows says only that "the
        # client declined every option", which a script's user never did.
        print("fleetpilot submit: standard input is not a terminal: the counter-offer is declined "
              "(--accept-offer accepts its first option)", file=sys.stderr)
        return SlaReply(offer_id=offer.offer_id, task_id=offer.task_id, accept=False)
    option = offer.options[choice - 1]
    print(f"accepting option {choice}", file=out)
    return SlaReply(offer_id=offer.offer_id, task_id=offer.task_id, accept=True, option_id=option.option_id)


def main(args) -> int:
    """Entry of the subcommand."""
    task = build_task(args)
    return event_loop.run(submit(task, args))

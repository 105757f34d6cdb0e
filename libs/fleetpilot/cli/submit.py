"""``fleetpilot submit``: publish one task and print what Fleetpilot decided.

The task comes from flags or from a JSON/YAML file. The command waits for the task's
``decision.made`` (or ``task.rejected``); when the SLA negotiator answers with a
counter-offer it shows the options and asks which to accept (``--accept-offer`` takes the
first one without asking, for scripts).
"""

from __future__ import annotations

import asyncio
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
)
from fleetpilot.runtime import tracing
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.sla import task_problem

from .arguments import positive_float, task_id_problem
from .local import local_nats_url, local_token, state_dir


class UsageError(ValueError):
    """Bad input from the user: printed as one line, never a traceback."""


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot submit``."""
    parser.add_argument("--file", "-f", help="task as JSON or YAML (flags override its fields)")
    parser.add_argument("--task-id", default=None,
                        help="the task's id, one subject token: no dots, spaces, * or > (default: a new one)")
    parser.add_argument("--tenant", default="local", help="tenant of the local token")
    parser.add_argument("--kind", choices=["train", "finetune", "infer", "encode", "batch"])
    parser.add_argument("--gpus", type=int)
    parser.add_argument("--gpu-milli", type=int)
    parser.add_argument("--gpu-memory-mb", type=int)
    parser.add_argument("--gpu-models", help="comma-separated acceptable models")
    parser.add_argument("--cpu-milli", type=int)
    parser.add_argument("--memory-mb", type=int)
    parser.add_argument("--size-gb", type=float)
    parser.add_argument("--tier", choices=["vip", "standard", "best_effort"])
    parser.add_argument("--max-queue-s", type=float)
    parser.add_argument("--warmup-ms", type=float)
    parser.add_argument("--p95-latency-ms", type=float)
    parser.add_argument("--duration-s", type=float, dest="expected_duration_s")
    parser.add_argument("--command", nargs="+", default=None, help="command to run (process backend)")
    # Both at once would silently decline: the parser refuses the pair instead.
    answer = parser.add_mutually_exclusive_group()
    answer.add_argument("--accept-offer", action="store_true", help="accept the first counter-option without asking")
    answer.add_argument("--decline-offer", action="store_true", help="decline any counter-offer without asking")
    # Checked by the parser: a timeout of 0 or less would publish the task, then give up at once.
    parser.add_argument("--timeout", type=positive_float, default=30.0,
                        help="seconds to wait for the decision (default 30)")
    parser.add_argument("--nats-url", default=None,
                        help="the bus (default: $FLEETPILOT_NATS_URL, else the one `fleetpilot up` runs, else :4222)")
    parser.add_argument("--token", default=os.environ.get("FLEETPILOT_TOKEN"), help="bearer JWT (default: local key)")
    parser.add_argument("--state-dir", default=None)


def _load_file(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"no such file: {path}")
    text = p.read_text()
    try:
        doc = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise UsageError(f"{path}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                         f"{str(exc).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: expected a mapping of task fields, got {type(doc).__name__}")
    return doc


def build_task(args) -> TaskSubmitted:
    """The task from the file and flags, validated against the contract."""
    doc = _load_file(args.file) if args.file else {}
    doc.pop("type", None)
    sla = dict(doc.get("sla") or {})
    for flag in ("kind", "gpus", "gpu_milli", "gpu_memory_mb", "cpu_milli", "memory_mb", "size_gb",
                 "expected_duration_s", "command"):
        value = getattr(args, flag)
        if value is not None:
            doc[flag] = value
    if args.gpu_models:
        doc["gpu_models"] = [m.strip() for m in args.gpu_models.split(",") if m.strip()]
    for flag, field in (("tier", "tier"), ("max_queue_s", "max_queue_s"), ("warmup_ms", "warmup_ms"),
                        ("p95_latency_ms", "p95_latency_ms")):
        value = getattr(args, flag)
        if value is not None:
            sla[field] = value
    doc["sla"] = sla
    doc.setdefault("task_id", args.task_id or f"task-{uuid.uuid4().hex[:10]}")
    if args.task_id:
        doc["task_id"] = args.task_id
    doc["submitted_at"] = time.time()
    try:
        task = msgspec.convert(doc, TaskSubmitted)
        msgspec.convert(sla, SlaRequest)
    except msgspec.ValidationError as exc:
        raise UsageError(f"invalid task: {exc}") from None
    problem = task_problem(task)  # what the SLA service would reject it for, said before publishing
    if problem is None and (why := task_id_problem(task.task_id)) is not None:
        # A bad id breaks the subjects that carry the task: nats-py refuses to listen on
        # ``sla.offer.<id>`` with a traceback, or a wildcard id listens to other tasks' offers.
        problem = f"task_id {task.task_id!r} {why}: it must be one subject token (no dots, spaces, * or >)"
    if problem is not None:
        raise UsageError(f"invalid task: {problem}")
    return task


async def submit(task: TaskSubmitted, args, out=sys.stdout) -> int:
    """Publish and wait for the outcome; returns the exit code (0 assigned/queued, 1 rejected)."""
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
                    **trace_headers, "Authorization": f"Bearer {token}", "Nats-Msg-Id": f"submit:{task.task_id}"})
            except (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError):
                # NATS is up but no stream takes the subject: Fleetpilot is not running there.
                raise ConnectionError(f"no Fleetpilot stream takes task.submitted at {args.nats_url} "
                                      "(start it with `fleetpilot up`, or point --nats-url at it)") from None
        print(f"submitted {task.task_id}", file=out, flush=True)
        deadline = time.monotonic() + args.timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                print(f"no decision for {task.task_id} within {args.timeout:.0f}s", file=sys.stderr)
                return 2
            try:
                msg = await asyncio.wait_for(answers.get(), remaining)
            except TimeoutError:
                continue
            if msg.subject == "decision.made":
                decision = decode(msg.data, DecisionMade)
                if decision.task_id != task.task_id:
                    continue
                print(json.dumps(msgspec.to_builtins(decision_summary(decision)), indent=2), file=out)
                if decision.action != "queue":
                    return 0
            elif msg.subject == "task.rejected":
                rejected = decode(msg.data, TaskRejected)
                if rejected.task_id == task.task_id:
                    print(f"rejected ({rejected.code}): {rejected.reason}", file=out)
                    return 1
            else:
                offer = decode(msg.data, SlaOffer)
                reply = answer_offer(offer, args, out)
                await bus.publish(reply, headers={"Authorization": f"Bearer {token}"})
    finally:
        await bus.drain()


def decision_summary(decision: DecisionMade) -> dict:
    """The fields of a decision a user wants to see."""
    return {"task_id": decision.task_id, "action": decision.action, "decision_id": decision.decision_id,
            "placement": [msgspec.to_builtins(p) for p in decision.placement],
            "confidence": round(decision.confidence, 3), "policy": f"{decision.policy.name}@{decision.policy.version}",
            "shard_id": decision.shard_id, "fallback": decision.fallback, "reason": decision.reason}


def answer_offer(offer: SlaOffer, args, out) -> SlaReply:
    """Show a counter-offer and ask (or use ``--accept-offer`` / ``--decline-offer``)."""
    print(f"counter-offer for {offer.task_id}: {offer.reason}", file=out)
    for i, option in enumerate(offer.options, 1):
        print(f"  [{i}] {option.why}", file=out)
    if args.decline_offer or not offer.options:
        return SlaReply(offer_id=offer.offer_id, task_id=offer.task_id, accept=False)
    if args.accept_offer:
        choice = 1
    elif sys.stdin.isatty():
        try:
            raw = input(f"accept which option (1-{len(offer.options)}, empty = decline)? ").strip()
        except EOFError:  # Ctrl-D at the prompt: an answer of nothing, not a traceback
            raw = ""
        if not raw:
            return SlaReply(offer_id=offer.offer_id, task_id=offer.task_id, accept=False)
        if not raw.isdigit() or not 1 <= int(raw) <= len(offer.options):
            raise UsageError(f"not an option: {raw!r}")
        choice = int(raw)
    else:
        return SlaReply(offer_id=offer.offer_id, task_id=offer.task_id, accept=False)
    option = offer.options[choice - 1]
    print(f"accepting option {choice}", file=out)
    return SlaReply(offer_id=offer.offer_id, task_id=offer.task_id, accept=True, option_id=option.option_id)


def main(args) -> int:
    """Entry of the subcommand."""
    task = build_task(args)
    return asyncio.run(submit(task, args))

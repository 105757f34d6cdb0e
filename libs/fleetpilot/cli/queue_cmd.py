"""``fleetpilot queue``: the tasks waiting for a place on a running fleet, and why.

Reads the policy's ``pending`` bucket, where every waiting task has an entry: one never placed
yet, or one evicted, checkpointed or failed and waiting to be placed again (its ``requeue``
note says why it came back). For each: how long it has waited, whether a policy replica is
placing it right now (the entry is claimed), and what kept it off every node at the policy's
latest try (``preempt.NoRoom``: ``0 of N nodes: 16 lack free GPUs, ...``, as the policy
counted it with the GPUs it keeps for a reserved task). Longest waiting first. The retry
round does not try a task when one asking no more found no node in the same round; such a
task is told that task's reason instead (``NoRoom.like``), at most every
``no_room_refresh_s``, so either reason is as old as it says.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import msgspec

from fleetpilot.policy.preempt import claim_of, decode_pending, no_room_of, waiting_since
from fleetpilot.runtime.nats_bus import bucket_subject_keys

from . import event_loop
from .arguments import add_bus_arguments
from .local import connect_once, local_nats_url, no_jetstream

READS_IN_FLIGHT = 256
"""How many ``pending`` entries are read at once."""


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot queue``."""
    add_bus_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def entry_row(key: str, value: bytes, at: float) -> dict[str, Any]:
    """One ``pending`` entry as the command shows it, read at ``at``; an entry that does not
    read is shown as such (the policy logs and skips it too), not dropped."""
    claim = claim_of(value)
    placing = claim is not None
    if claim is not None:
        value = claim[1]
    if not value:
        return {"key": key, "placing": placing, "error": "the entry holds nothing to place (an old claim)"}
    try:
        adm, requeue = decode_pending(value)
        no_room = no_room_of(value)
    except msgspec.DecodeError as exc:  # ValidationError is one
        return {"key": key, "placing": placing, "error": f"unreadable entry: {exc}"}
    since = waiting_since(adm, requeue)
    task = adm.task
    return {
        "task_id": task.task_id,
        "tenant": adm.tenant,
        "tier": adm.contract.tier,
        "gpus": task.gpus,
        "gpu_milli": task.gpu_milli,
        "waiting_s": max(at - since, 0.0),
        "placing": placing,
        "queued_again": requeue.reason if requeue is not None else None,
        "no_room": no_room.shortfall if no_room is not None else None,
        "no_room_age_s": max(at - no_room.at, 0.0) if no_room is not None else None,
        # Not tried itself: the task asking no more whose refusal it is (``NoRoom.like``).
        "no_room_like": (no_room.like or None) if no_room is not None else None,
    }


async def read_queue(url: str) -> list[dict[str, Any]]:
    """Every entry of the ``pending`` bucket (``entry_row``), longest waiting first; none when
    the bucket does not exist yet (no policy has queued anything)."""
    import nats.js.errors

    nc = await connect_once(url, "fleetpilot-queue")
    try:
        js = nc.jetstream()
        try:
            kv = await js.key_value("pending")
            # Not ``kv.keys()``, which can hang while a policy replica writes the bucket.
            keys = await bucket_subject_keys(js, "pending")
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            return []
        at = time.time()

        async def row(key: str) -> dict[str, Any] | None:
            try:
                entry = await kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                return None  # placed (its entry deleted) before or since the listing
            return entry_row(key, entry.value or b"", at)

        # A few hundred reads in flight at a time: a queue of thousands in a second or two,
        # not one round trip after another.
        rows = []
        for start in range(0, len(keys), READS_IN_FLIGHT):
            read = await asyncio.gather(*(row(key) for key in keys[start:start + READS_IN_FLIGHT]))
            rows.extend(r for r in read if r is not None)
    except nats.js.errors.ServiceUnavailableError:
        raise no_jetstream(url) from None
    finally:
        await nc.close()
    return sorted(rows, key=lambda r: (-r.get("waiting_s", 0.0), r.get("task_id", r.get("key", ""))))


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def render(rows: list[dict[str, Any]], out) -> None:
    """The queue, a task a line or three."""
    if not rows:
        print("no task is waiting", file=out)
        return
    print(f"{len(rows)} task{'s' if len(rows) != 1 else ''} waiting, longest first", file=out)
    for r in rows:
        if "error" in r:
            print(f"{r['key']}: {r['error']}", file=out)
            continue
        ask = f"{r['gpus']} GPU{'s' if r['gpus'] != 1 else ''}" if r["gpu_milli"] >= 1000 else \
            f"{r['gpu_milli']}m of a GPU"
        how = f"queued again: {r['queued_again']}" if r["queued_again"] else "queued on admission"
        placing = "; a policy replica is placing it now" if r["placing"] else ""
        print(f"{r['task_id']} ({r['tenant'] or 'no tenant'}, {r['tier']}, {ask}): waiting {_duration(r['waiting_s'])}, "
              f"{how}{placing}", file=out)
        if r["no_room"] is not None and r.get("no_room_like"):
            print(f"  no room at the latest look, {_duration(r['no_room_age_s'])} ago (not tried: {r['no_room_like']}, "
                  f"which asks no more, found none): {r['no_room']}", file=out)
        elif r["no_room"] is not None:
            print(f"  no room at the latest try, {_duration(r['no_room_age_s'])} ago: {r['no_room']}", file=out)
        else:
            print("  no refusal recorded since it was queued", file=out)


def main(args, out=None) -> int:
    """Print the tasks waiting for a place."""
    out = out or sys.stdout
    rows = event_loop.run(read_queue(args.nats_url or local_nats_url(args.state_dir)))
    if args.json:
        print(json.dumps({"waiting": rows}, indent=2), file=out)
    else:
        render(rows, out)
    return 0

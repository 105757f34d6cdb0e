"""``fleetpilot feedback``: what the feedback store says of the actions the fleet took.

Asks the feedback service's ``feedback.stats`` endpoint for its statistics, grouped by the
fields ``--by`` names (policy and action by default; any of ``policy``, ``shard_id``,
``task_kind``, ``gpu_model``, ``action``). Per group: how many actions were judged, how many
met their goal (and the share weighted by how sure each outcome is), the p95 latency of
those whose latency was measured, the successes their decisions' confidence expected against
those met, the Brier score of that confidence, and the GPU memory their placements left to
other work against whole GPUs. It is every record the store holds, across runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from fleetpilot.contracts import FeedbackStats, StatsGroup, StatsQuery, decode, encode
from fleetpilot.feedback.aggregates import validate_by

from . import event_loop
from .arguments import add_bus_arguments, positive_float
from .local import connect_once, local_nats_url

DEFAULT_BY = ("policy", "action")
"""The grouping the command asks for unless told another: each policy's actions, each with
its own goal and so its own calibration."""


def grouping(text: str) -> tuple[str, ...]:
    """``--by``: comma-separated key fields, none repeated."""
    try:
        return validate_by(tuple(field.strip() for field in text.split(",") if field.strip()))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot feedback``."""
    add_bus_arguments(parser)
    parser.add_argument("--by", type=grouping, default=DEFAULT_BY, metavar="FIELDS",
                        help="group by these comma-separated fields of policy, shard_id, task_kind, gpu_model, "
                             "action (default: policy,action; an empty string: every record together)")
    parser.add_argument("--timeout", type=positive_float, default=5.0, metavar="SECONDS",
                        help="how long to wait for the feedback service's answer (default 5)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


async def read_stats(url: str, by: tuple[str, ...], timeout_s: float) -> FeedbackStats:
    """The feedback service's statistics by ``by``; ``ConnectionError`` when no feedback
    service answers, ``TimeoutError`` when it does not in time, ``ValueError`` with the
    service's reason when it refuses the question."""
    import nats.errors

    nc = await connect_once(url, "fleetpilot-feedback")
    try:
        msg = await nc.request("feedback.stats", encode(StatsQuery(by=list(by))), timeout=timeout_s)
    except nats.errors.NoRespondersError:
        raise ConnectionError(f"no feedback service answers feedback.stats on {url}") from None
    except nats.errors.TimeoutError:
        raise TimeoutError(f"the feedback service did not answer within {timeout_s:g} s (--timeout)") from None
    finally:
        await nc.close()
    try:
        return decode(msg.data, FeedbackStats)
    except msgspec.DecodeError:
        # A question it refuses (statistics too large for one message) is answered with
        # {"error": ...} instead of statistics.
        try:
            error = msgspec.json.decode(msg.data).get("error")
        except (msgspec.DecodeError, AttributeError):
            error = None
        raise ValueError(f"the feedback service answered: {error or msg.data[:200]!r}") from None


def figures(group: StatsGroup) -> str:
    """One group's figures in a line: records, success, latency, calibration, saving."""
    weighted = "" if group.weighted_success_rate is None else f" (weighted {group.weighted_success_rate:.2f})"
    latency = ("no latency measured" if group.p95_latency_ms is None
               else f"p95 latency {group.p95_latency_ms:.0f} ms over {group.measured} measured")
    saving = (f", {group.mean_resource_saving_mb / 1024:.1f} GB of GPU memory left free per record against whole GPUs"
              if group.mean_resource_saving_mb > 0 else "")
    return (f"{group.count} record{'s' * (group.count != 1)}, success {group.success_rate:.2f}{weighted}, {latency}, "
            f"{group.expected_successes:.1f} successes expected, {group.successes} met, "
            f"Brier {group.brier_score:.3f}{saving}")


def key_of(group: StatsGroup, by: tuple[str, ...]) -> str:
    """A group's key as the command shows it: its values in ``by``'s order (an empty action
    is a record judged from its task's end, the action's result not known)."""
    shown = [group.key.get(field, "") or ("(judged without its result)" if field == "action" else "-")
             for field in by]
    return " ".join(shown) or "every record"


def render(stats: FeedbackStats, by: tuple[str, ...], out) -> None:
    """The statistics, a group a line."""
    if not stats.groups:
        print("the feedback store holds no record yet", file=out)
        return
    total = sum(g.count for g in stats.groups)
    print(f"{total} record{'s' * (total != 1)} in the feedback store, by {', '.join(by) or 'nothing'}:", file=out)
    for group in stats.groups:
        print(f"  {key_of(group, by)}: {figures(group)}", file=out)


def main(args, out=None) -> int:
    """Print what the feedback store says of the actions taken."""
    out = out or sys.stdout
    stats = event_loop.run(read_stats(args.nats_url or local_nats_url(args.state_dir), args.by, args.timeout))
    if args.json:
        document: dict[str, Any] = {"by": list(args.by), "groups": msgspec.to_builtins(stats.groups)}
        print(json.dumps(document, indent=2), file=out)
    else:
        render(stats, args.by, out)
    return 0

"""``fleetpilot model``: the learner's outcome models on a running fleet.

What the policies use (the promoted model under ``outcome`` in the ``models`` bucket), the
latest candidate that was not promoted (``outcome-candidate``), and for each the figures the
learner announced with it (``model.published``): how many outcomes it learnt from, how it
and the policy's own confidence did on the latest ones, which it was not trained on, and
why it was or was not promoted.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any

import msgspec

from fleetpilot.contracts import ModelPublished, decode
from fleetpilot.learner import CANDIDATE_KEY, PROMOTED_KEY, OutcomeModel

from . import event_loop
from .arguments import add_bus_arguments
from .local import connect_once, local_nats_url, no_jetstream

SCANNED_EVENTS = 500
"""How many of the latest ``model.published`` events are searched for each model's figures."""
ROLES = {PROMOTED_KEY: "what the policies use", CANDIDATE_KEY: "the latest model not promoted"}


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot model``."""
    add_bus_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


async def _stored(js, key: str) -> tuple[int, OutcomeModel | str] | None:
    """``(revision, model)`` under ``key`` (the model as a one-line error when it does not
    read), ``None`` when the key holds nothing."""
    import nats.js.errors

    try:
        kv = await js.key_value("models")
        entry = await kv.get(key)
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return None
    if not entry.value:
        return None
    try:
        model: OutcomeModel | str = OutcomeModel.from_bytes(entry.value)
    except ValueError as exc:
        model = f"unreadable: {exc}"
    return entry.revision, model


async def _announcements(js, wanted: dict[str, int]) -> tuple[dict[str, ModelPublished], ModelPublished | None]:
    """The ``model.published`` of each wanted ``(name, version)``, from the latest events back;
    and, when no promoted model is wanted, the latest word on it if that was its withdrawal."""
    import nats.js.errors

    found: dict[str, ModelPublished] = {}
    latest_on_promoted: ModelPublished | None = None
    try:
        last = await js.get_last_msg("MODELS", "model.published")
    except nats.js.errors.NotFoundError:
        return found, None
    seq = last.seq
    for _ in range(SCANNED_EVENTS):
        settled = PROMOTED_KEY in wanted or latest_on_promoted is not None
        if seq < 1 or (len(found) == len(wanted) and settled):
            break
        try:
            msg = await js.get_msg("MODELS", seq)
        except nats.js.errors.NotFoundError:
            break  # older events are gone (the stream keeps 30 days)
        seq -= 1
        try:
            event = decode(msg.data, ModelPublished)
        except msgspec.DecodeError:
            continue
        if event.name == PROMOTED_KEY and latest_on_promoted is None:
            latest_on_promoted = event
        if wanted.get(event.name) == event.version and event.name not in found and not event.withdrawn:
            found[event.name] = event
    withdrawal = latest_on_promoted if latest_on_promoted is not None and latest_on_promoted.withdrawn else None
    return found, (withdrawal if PROMOTED_KEY not in wanted else None)


async def read_models(url: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Each stored outcome model with what the learner said of it; and the withdrawal of the
    last promoted one, when that is why none is promoted now."""
    import nats.js.errors

    nc = await connect_once(url, "fleetpilot-model")
    try:
        js = nc.jetstream()
        stored = {key: got for key in ROLES if (got := await _stored(js, key)) is not None}
        said, withdrawal = await _announcements(js, {key: revision for key, (revision, _) in stored.items()})
    except nats.js.errors.ServiceUnavailableError:
        raise no_jetstream(url) from None
    finally:
        await nc.close()
    out = []
    for key, (revision, model) in stored.items():
        row: dict[str, Any] = {"key": key, "role": ROLES[key], "version": revision}
        if isinstance(model, str):
            row["error"] = model
        else:
            row["inputs"] = model.features.width()
            row["gpu_models"] = list(model.features.gpu_models)
        event = said.get(key)
        if event is not None:
            row["figures"] = msgspec.to_builtins(event.figures)
            row["published_at"] = event.published_at
            row["promoted"] = event.promoted
            row["reason"] = event.reason
        out.append(row)
    gone = None if withdrawal is None else {"version": withdrawal.version, "published_at": withdrawal.published_at,
                                            "reason": withdrawal.reason}
    return out, gone


def _when(at: float) -> str:
    try:
        return f"{datetime.fromtimestamp(at, UTC):%Y-%m-%d %H:%M:%S} UTC"
    except (OverflowError, ValueError, OSError):
        # A time no calendar holds (a producer's milliseconds, a garbage value): one event's
        # bad stamp ended the whole report with a traceback (OverflowError).
        return f"at {at:g} (not a time)"


def render(rows: list[dict[str, Any]], out, withdrawn: dict[str, Any] | None = None) -> None:
    """The models as a few lines each."""
    if not any(r["key"] == PROMOTED_KEY for r in rows):
        print("no promoted outcome model: the policies publish their own confidence", file=out)
        if withdrawn is not None:
            print(f"  version {withdrawn['version']} was withdrawn ({_when(withdrawn['published_at'])}): "
                  f"{withdrawn['reason']}", file=out)
    for r in rows:
        when = f", published {_when(r['published_at'])}" if r.get("published_at") else ""
        print(f"{r['key']} ({r['role']}): version {r['version']}{when}", file=out)
        if "error" in r:
            print(f"  {r['error']}", file=out)
        else:
            models = ", ".join(r["gpu_models"]) or "none"
            print(f"  {r['inputs']} inputs; GPU models it knows: {models}", file=out)
        f = r.get("figures")
        if f is None:
            print("  (its model.published is no longer in the stream)", file=out)
            continue
        print(f"  learnt from {f['examples']} judged placements; on the latest {f['held_out']}, which it was not "
              f"trained on: Brier {f['brier_model']:.4f} against the policy's {f['brier_prior']:.4f}, mean "
              f"{f['mean_predicted']:.3f} predicted, {f['mean_prior']:.3f} by the policy, {f['observed']:.3f} met",
              file=out)
        print(f"  {'promoted' if r['promoted'] else 'not promoted'}: {r['reason']}", file=out)


def main(args, out=None) -> int:
    """Print the fleet's outcome models."""
    out = out or sys.stdout
    rows, withdrawn = event_loop.run(read_models(args.nats_url or local_nats_url(args.state_dir)))
    if args.json:
        print(json.dumps({"models": rows, "withdrawn": withdrawn}, indent=2), file=out)
    else:
        render(rows, out, withdrawn)
    return 0

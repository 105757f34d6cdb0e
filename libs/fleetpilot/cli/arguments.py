"""Argument types for the CLI's flags: a value out of range, or a NATS subject the server
would refuse, is refused by the parser with a one-line message naming the flag
(``argument --rate: must be more than 0, got 0``), before anything starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from fleetpilot.contracts.catalog import subject_problem


def _number(parse: Callable[[str], float], what: str, text: str) -> float:
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def positive_int(text: str) -> int:
    """A whole number of at least 1."""
    value = int(_number(int, "a whole number", text))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """A whole number of at least 0."""
    value = int(_number(int, "a whole number", text))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0."""
    value = _number(float, "a number", text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of at least 0."""
    value = _number(float, "a number", text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def port_base(text: str) -> int:
    """A first TCP port: 0 (pick free ones) or 1..65535."""
    value = int(_number(int, "a whole number", text))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0 (free ports) or a port 1..65535, got {value}")
    return value


def existing_file(text: str) -> str:
    """The absolute path of a file that exists (services started elsewhere read it too)."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return str(path.resolve())


def subject_pattern(text: str) -> str:
    """A subject to subscribe to, wildcards allowed (``task.lifecycle.>``)."""
    problem = subject_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"not a NATS subject: {text!r} {problem}")
    return text


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(text: str) -> float:
    """A span of time as seconds: a number with a unit, ``90s``, ``30m``, ``2h``, ``7d``."""
    unit = _DURATION_UNITS.get(text[-1:].lower())
    try:
        value = float(text[:-1])
    except ValueError:
        unit = None
    if unit is None or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number and a unit (s, m, h or d), like 30m, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    return value * unit


def path_text(text: str) -> str:
    """A path as given, refused when empty: ``-f "$TASK"`` with the variable unset read as the
    flag left out, and the command went on with its default (the shipped fleet, another state
    directory, a task without its file)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return text


def nats_url(text: str) -> str:
    """A NATS server URL, refused when empty: an empty ``--nats-url`` fell back to the default
    bus (``$FLEETPILOT_NATS_URL``, the running ``up``'s, else :4222), another fleet's perhaps."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty URL (leave the flag out for the default bus)")
    return text


def add_bus_arguments(parser) -> None:
    """``--nats-url`` and ``--state-dir``: how a command that reads a running fleet finds its
    bus (the flag, else ``$FLEETPILOT_NATS_URL``, else the one ``fleetpilot up`` runs from the
    state directory, else :4222: ``local.local_nats_url``)."""
    parser.add_argument("--nats-url", type=nats_url, default=None,
                        help="the bus (default: $FLEETPILOT_NATS_URL, else the one `fleetpilot up` runs from "
                             "--state-dir, else :4222)")
    parser.add_argument("--state-dir", type=path_text, default=None, help="where a running `fleetpilot up` keeps its state")


def model_names(text: str) -> str:
    """Comma-separated GPU models, at least one named (``A100,H100``): ``,,`` asked for no model,
    which reads as any GPU."""
    if not any(name.strip() for name in text.split(",")):
        raise argparse.ArgumentTypeError(f"names no GPU model, got {text!r}")
    return text


def probe_interval(text: str) -> float:
    """Seconds between two readings: 0 to a day. Longer is no probe anyone waits for, and over
    about 9.2e9 s (292 years) ``time.sleep`` refuses it with an ``OverflowError`` after the first reading."""
    value = non_negative_float(text)
    if value > 86400:
        raise argparse.ArgumentTypeError(f"must be at most 86400 (a day), got {text}")
    return value

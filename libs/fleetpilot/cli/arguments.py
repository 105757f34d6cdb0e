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

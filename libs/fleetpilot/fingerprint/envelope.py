"""The memory envelope of a program: how much its runs hold by each point of their life.

A fingerprint's peak says how much a run will need; it does not say when. A step schedule
(batch size, resolution) that asks 28 GB and ends at 45 GB may hold no more than 30 GB for
the first half of its life, which a 32 GB GPU serves. The envelope says so: for each
twentieth of the duration a run declared, the most it held per GPU up to then
(``run_envelope``), and over the runs of one signature the largest of those (``merge_envelopes``,
so the earliest step seen is the one planned for: the declared duration is what a new run
is known by, and runs overrun or underrun it). ``envelope_at`` reads it at a point of a run:
the most the run can be expected to hold by then.

Only a run observed from its start teaches an envelope: a run restored from a checkpoint
is sampled from the middle of its life, and its times are not the program's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

ENVELOPE_POINTS = 20
"""Points of an envelope: one per twentieth of the declared duration."""


def run_envelope(t_s: Sequence[float], used_mb: Sequence[float], declared_s: float) -> tuple[float, ...]:
    """The envelope of one run sampled at ``t_s`` (seconds since its start) holding ``used_mb``
    per GPU, for the duration it declared: point k (1-based) is the most it may have held by
    ``k / ENVELOPE_POINTS`` of ``declared_s``; the last point is the most it held at all (a run
    that overran its declaration held that by its end). Empty without samples or a duration;
    points before the first sample hold the first sample.

    A sample stands for the whole gap since the sample before it: a step seen at one sample
    may have been taken just after the previous one, so it counts from there."""
    if not len(t_s) or not declared_s > 0:  # NaN too: no twentieth of it is a time
        return ()
    out: list[float] = []
    i, most = 0, float(used_mb[0])
    for k in range(1, ENVELOPE_POINTS + 1):
        until = k / ENVELOPE_POINTS * declared_s
        while i < len(t_s) and (t_s[max(i - 1, 0)] <= until or k == ENVELOPE_POINTS):
            most = max(most, float(used_mb[i]))
            i += 1
        out.append(most)
    return tuple(out)


def merge_envelopes(a: Sequence[float], b: Sequence[float]) -> tuple[float, ...]:
    """The envelope that covers both (pointwise the larger); either alone when the other is
    empty."""
    if not a or not b:
        return tuple(a or b)
    return tuple(max(x, y) for x, y in zip(a, b, strict=True))


def envelope_at(envelope: Sequence[float], at_s: float, declared_s: float) -> float:
    """The most a run is expected to hold by ``at_s`` seconds into a run declared at
    ``declared_s``: the envelope's point that covers that instant (its last beyond the
    declared end); 0 for an empty envelope."""
    if not envelope:
        return 0.0
    if not declared_s > 0:  # NaN too (its twentieths are no index)
        return float(envelope[-1])
    k = math.ceil(max(at_s, 0.0) / declared_s * ENVELOPE_POINTS)
    return float(envelope[min(max(k, 1), len(envelope)) - 1])

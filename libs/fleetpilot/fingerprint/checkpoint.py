"""A run's series in progress, kept outside the process that fits it.

The fingerprinter holds each running task's series in memory alone: a replica that restarts
(a rollout, a crash, a rescale) would begin every run in progress afresh at its next sample,
a series that did not begin with its run, which teaches no envelope and only the end of the
fit. A replica therefore writes, every so often and when it stops, a ``SeriesCheckpoint`` of
each run it fits (``checkpoint_of``, bounded by ``bounded``), and the replica that owns the
task next restores it (``restore``) before it takes a sample: the run goes on as one series
that began with it.

What a checkpoint keeps, and why:

- the samples the fits read (seconds since the run's start, MB per GPU), the utilisation and
  co-location readings, the run's start on the samples' clock (a sample after the restore is
  placed on the same axis), and how many samples were added in all (a fingerprint counts them,
  and replicas prefer the run seen for the most samples);
- the signature and declared duration (the run teaches its signature; the envelope is cut in
  twentieths of the declared duration), and whether the series began with the run
  (``from_start``: only then is an envelope taught);
- the latest sample's time (a sample delivered again or overtaken is dropped, as before the
  restart), when the replica last heard of the task (a run silent for the silent-forget limit
  is not restored), and the fit schedule and the fingerprint last published (the restored
  model refits and publishes as the uninterrupted one would, nothing again);
- what the service keeps beside the series: the most the run held before its moves (its
  peak spans them), its latest stop and start (an earlier stop or end delivered again is not
  handled again), and what it held when last stopped, until its restore is counted.

Bounded: a series of up to ``CHECKPOINT_SAMPLES`` samples is kept whole, and a restored model
is then the very model that was written. A longer one (a run sampled every second for hours)
is thinned as the model thins itself, each pair of samples to the one that held more (peaks
survive, and a fit leans to the safe side), except the samples that its envelope and its
restore are read from: the first and the latest, for each twentieth of the declared duration
the sample that held the most by then and the last one counted by then (so every sample kept
is counted by the same twentieths as before, and the envelope is exactly the one of the whole
series), which is also where the run's peak is. Utilisation and co-location are decimated
(every other reading kept), which keeps their spread (a burstiness), where averaging pairs
would narrow it.
"""

from __future__ import annotations

import math
import time

import msgspec

from fleetpilot.contracts import Fingerprint

from .envelope import ENVELOPE_POINTS
from .online import MAX_HELD_SAMPLES, HeldSeries, OnlineFingerprinter

CHECKPOINT_SAMPLES = 2_000
"""The most samples a checkpoint keeps (about 50 kB as JSON): every in-progress run of a
replica's share is written at each checkpoint round, and all of them are read at each start."""


class TaskSeries(OnlineFingerprinter):
    """One task's online model, with what the fingerprinter service keeps of the samples that
    fed it: the latest one's time (``latest_at``, on the samples' clock) and when the replica
    last heard of the task (``heard_at``, on its own monotonic clock)."""

    def __init__(self, *args, latest_at: float = -math.inf, heard_at: float | None = None, **kwargs) -> None:
        """``OnlineFingerprinter``'s arguments; ``latest_at``: the series goes on from a sample
        at that time (a series started again on the same process); ``heard_at``: when the task
        was last heard of (default: now)."""
        super().__init__(*args, **kwargs)
        self.latest_at = latest_at
        self.heard_at = time.monotonic() if heard_at is None else heard_at


class SeriesCheckpoint(msgspec.Struct, kw_only=True, frozen=True, tag_field="checkpoint", tag="series.v1"):
    """One task's run in progress as the ``fingerprint_series`` bucket keeps it (what it holds
    and why: the module's documentation). Times named ``..._wall`` are on the writing
    replica's wall clock (seconds since the epoch); the others on the samples' clock."""

    task_id: str
    written_wall: float
    heard_wall: float
    signature: str = ""
    expected_duration_s: float | None = None
    from_start: bool = False
    started_at: float | None = None
    latest_at: float | None = None
    samples: int = 0
    t_s: tuple[float, ...] = ()
    used_mb: tuple[float, ...] = ()
    utilisation: tuple[float, ...] = ()
    colocated: tuple[float | None, ...] = ()
    """Co-located process counts, aligned with ``utilisation`` (``None``: not reported);
    empty when none was."""
    fitted_at: int = 0
    published: Fingerprint | None = None
    peak_before_mb: float = 0.0
    last_stop: float | None = None
    last_start: float | None = None
    stopped_mb: float | None = None
    """What the run held when it was last stopped, until its restore is counted."""
    stopped_at: float | None = None


_DECODER = msgspec.json.Decoder(SeriesCheckpoint)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def checkpoint_of(task_id: str, model: TaskSeries, *, now_wall: float, now_monotonic: float,
                  peak_before_mb: float = 0.0, last_stop: float | None = None, last_start: float | None = None,
                  stopped: tuple[float, float] | None = None) -> SeriesCheckpoint:
    """``model``'s run as a checkpoint written at ``now_wall`` (the replica's monotonic clock
    reading ``now_monotonic`` then), whole: copies of its series, so that the model may go on
    taking samples while the copy is bounded (``bounded``) and encoded elsewhere. ``stopped``:
    (MB per GPU held when last stopped, when), while its restore is not counted yet."""
    held = model.held_series()
    coloc = held.colocated
    return SeriesCheckpoint(
        task_id=task_id, written_wall=now_wall, heard_wall=now_wall - max(now_monotonic - model.heard_at, 0.0),
        signature=model.signature, expected_duration_s=model.expected_duration_s, from_start=model.from_start,
        started_at=held.started_at, latest_at=_finite(model.latest_at), samples=held.added,
        t_s=held.t_s, used_mb=held.used_mb, utilisation=held.utilisation,
        colocated=tuple(None if math.isnan(c) else c for c in coloc) if any(not math.isnan(c) for c in coloc)
        else (),
        fitted_at=held.fitted_at, published=held.published,
        peak_before_mb=peak_before_mb, last_stop=last_stop, last_start=last_start,
        stopped_mb=stopped[0] if stopped else None, stopped_at=stopped[1] if stopped else None)


def envelope_anchors(t_s: tuple[float, ...], used_mb: tuple[float, ...], declared_s: float | None) -> set[int]:
    """The samples the run's envelope is read from (``run_envelope``), for each twentieth of
    ``declared_s``: the last sample counted by it (a sample counts from the one before it) and
    the one that held the most of those counted. Kept with every sample between them thinned,
    each sample kept is counted by the same twentieths as before and each twentieth's most is
    kept: the envelope is unchanged. Empty without a declared duration."""
    if not t_s or not declared_s or declared_s <= 0:
        return set()
    anchors: set[int] = set()
    i, best = 0, 0
    for k in range(1, ENVELOPE_POINTS + 1):
        until = k / ENVELOPE_POINTS * declared_s
        while i < len(t_s) and (t_s[max(i - 1, 0)] <= until or k == ENVELOPE_POINTS):
            if used_mb[i] > used_mb[best]:
                best = i
            i += 1
        if i:
            anchors.update((i - 1, best))
    return anchors


def _halve(kept: list[int], mb: tuple[float, ...], fixed: set[int]) -> list[int]:
    """``kept`` (indices, ascending) with each pair of consecutive indices not ``fixed`` cut to
    the one that held more; ``fixed`` ones stay and break the pairing."""
    out: list[int] = []
    pending: int | None = None
    for i in kept:
        if i in fixed:
            if pending is not None:
                out.append(pending)
                pending = None
            out.append(i)
        elif pending is None:
            pending = i
        else:
            out.append(pending if mb[pending] >= mb[i] else i)
            pending = None
    if pending is not None:
        out.append(pending)
    return out


def bounded(checkpoint: SeriesCheckpoint, max_samples: int = CHECKPOINT_SAMPLES) -> SeriesCheckpoint:
    """``checkpoint`` with at most ``max_samples`` samples (at least 128, room for the
    samples always kept and one between each two of them): itself when it holds
    no more; else thinned, its envelope, first, latest and peak sample kept (the module's
    documentation says how). The count of samples added stays what it was."""
    limit = max(max_samples, 128)
    t, mb = checkpoint.t_s, checkpoint.used_mb
    if len(t) <= limit and len(checkpoint.utilisation) <= limit:
        return checkpoint
    fixed = {0, len(t) - 1} if t else set()
    if checkpoint.from_start:
        fixed |= envelope_anchors(t, mb, checkpoint.expected_duration_s)
    kept = list(range(len(t)))
    while len(kept) > limit:
        thinner = _halve(kept, mb, fixed)
        if len(thinner) == len(kept):
            break  # nothing left to pair: the fixed samples and one between each two (under 128)
        kept = thinner
    util, coloc = list(checkpoint.utilisation), list(checkpoint.colocated)
    while len(util) > limit:
        util, coloc = util[::2], coloc[::2]
    return msgspec.structs.replace(
        checkpoint, t_s=tuple(t[i] for i in kept), used_mb=tuple(mb[i] for i in kept), utilisation=tuple(util),
        colocated=tuple(coloc), fitted_at=min(checkpoint.fitted_at, len(kept)))


def encode_checkpoint(checkpoint: SeriesCheckpoint, max_samples: int = CHECKPOINT_SAMPLES) -> bytes:
    """The bucket's value for ``checkpoint``, bounded first (``bounded``)."""
    return msgspec.json.encode(bounded(checkpoint, max_samples))


def decode_checkpoint(raw: bytes) -> SeriesCheckpoint:
    """A checkpoint read from the bucket; ``msgspec.DecodeError`` / ``ValidationError`` for a
    value that is not one (a later version's tag included: not restored, rather than misread)."""
    return _DECODER.decode(raw)


def restore(checkpoint: SeriesCheckpoint, *, now_wall: float, now_monotonic: float) -> TaskSeries:
    """The model ``checkpoint`` was written from, as the service fits it (``only_trusted``),
    to go on with the run's next sample; its ``heard_at`` on this replica's monotonic clock
    (``now_monotonic`` when the wall clock read ``now_wall``). ``ValueError`` for a checkpoint
    whose series cannot be a model's (lengths that disagree, a reading not a finite number)."""
    t, mb, util = checkpoint.t_s, checkpoint.used_mb, checkpoint.utilisation
    coloc = checkpoint.colocated or (None,) * len(util)
    if len(t) != len(mb) or len(coloc) != len(util) or len(t) > checkpoint.samples:
        raise ValueError(f"checkpoint of {checkpoint.task_id}: {len(t)} times, {len(mb)} readings, "
                         f"{len(util)} utilisations and {len(coloc)} co-locations, of {checkpoint.samples} samples")
    if not all(math.isfinite(v) for v in (*t, *mb, *util)):
        raise ValueError(f"checkpoint of {checkpoint.task_id}: a reading that is not a finite number")
    model = TaskSeries(checkpoint.signature, expected_duration_s=checkpoint.expected_duration_s,
                       started_at=checkpoint.started_at, only_trusted=True, from_start=checkpoint.from_start,
                       max_samples=MAX_HELD_SAMPLES,
                       latest_at=checkpoint.latest_at if checkpoint.latest_at is not None else -math.inf,
                       heard_at=now_monotonic - max(now_wall - checkpoint.heard_wall, 0.0))
    model.resume(HeldSeries(checkpoint.started_at, t, mb, util,
                             tuple(math.nan if c is None else float(c) for c in coloc),
                             checkpoint.samples, checkpoint.fitted_at, checkpoint.published))
    return model

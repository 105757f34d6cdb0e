"""Fingerprinting while a task runs: a first guess after a few samples, refined as it grows."""

from __future__ import annotations

import math
from typing import NamedTuple

import msgspec
import numpy as np

from fleetpilot.contracts import Fingerprint

from .analysis import MIN_SAMPLES, LevelPrior, SeriesAnalysis, analyse_series, declared_life
from .envelope import run_envelope

# Defaults of :func:`changed_materially`: a peak that moved more than 10%, or an interval
# that widened or narrowed by more than 25%, is news worth a ``task.fingerprinted`` event.
PEAK_TOLERANCE = 0.10
WIDTH_TOLERANCE = 0.25

# A fingerprint worth acting on has this many samples and this pattern confidence: a
# handful of samples in a warm-up reads as a steep line, and a level that has not stepped
# yet as the first level of a step schedule (twice as high, ``LevelPrior``). The fleet
# benchmark acts on nothing less, and the fingerprinter service publishes nothing less.
TRUST_SAMPLES = 10
TRUST_CONFIDENCE = 0.6

# The most samples one task's series keeps for its fits. The collector samples every second,
# so a service that runs for a week would otherwise hold 600,000 samples (about 80 MB in
# Python lists) and refit on all of them; past this, pairs of samples are thinned to the
# higher of the two (peaks survive, and a fit leans to the safe side).
MAX_HELD_SAMPLES = 20_000


class HeldSeries(NamedTuple):
    """What an :class:`OnlineFingerprinter` holds of its run (copies), for another to go on
    with it (:meth:`OnlineFingerprinter.resume`): the run's start on the samples' clock, the
    samples its fits read (seconds since that start, MB), the utilisation and co-location
    readings (NaN: not reported), how many samples were added in all, at how many held
    samples it last fitted, and the fingerprint it last returned."""

    started_at: float | None
    t_s: tuple[float, ...]
    used_mb: tuple[float, ...]
    utilisation: tuple[float, ...]
    colocated: tuple[float, ...]
    added: int
    fitted_at: int
    published: Fingerprint | None


def trusted(fp: Fingerprint) -> bool:
    """Whether an observed fingerprint is worth acting on (``TRUST_SAMPLES``, ``TRUST_CONFIDENCE``)."""
    return fp.samples >= TRUST_SAMPLES and fp.pattern_confidence >= TRUST_CONFIDENCE


def changed_materially(old: Fingerprint | None, new: Fingerprint, *,
                       peak_tolerance: float = PEAK_TOLERANCE,
                       width_tolerance: float = WIDTH_TOLERANCE) -> bool:
    """Whether ``new`` differs from ``old`` enough to publish it.

    Material: no previous fingerprint, a different pattern, a predicted peak that moved by
    more than ``peak_tolerance`` of the old peak, or an interval whose width changed by
    more than ``width_tolerance`` of the old width. Anything smaller is refinement noise
    that consumers (the policy) should not react to.
    """
    if old is None or old.pattern != new.pattern:
        return True
    if abs(new.predicted_peak_mb - old.predicted_peak_mb) > peak_tolerance * max(abs(old.predicted_peak_mb), 1e-9):
        return True
    old_width = old.peak_high_mb - old.peak_low_mb
    new_width = new.peak_high_mb - new.peak_low_mb
    return abs(new_width - old_width) > width_tolerance * max(old_width, 1e-9)


class OnlineFingerprinter:
    """Accumulates one task's samples and refits its fingerprint as they arrive.

    ``add`` returns a fingerprint only when it changed materially (the first one counts),
    so a service can publish whatever it returns. Refits happen on a geometric schedule —
    after ``min_samples`` samples, then whenever the series grew by ``refit_growth`` (10%)
    since the last fit — so the total cost over a task's life stays near-linear. ``prior``
    (for instance from :class:`~fleetpilot.fingerprint.signature.SignatureMemory`) is
    what :attr:`current` answers before the first fit. A series past ``max_samples`` is
    thinned (``_thin``): memory and the cost of a refit stay bounded however long it runs.
    """

    def __init__(self, signature: str = "", *, expected_duration_s: float | None = None,
                 started_at: float | None = None, min_samples: int = MIN_SAMPLES,
                 refit_growth: float = 0.10, prior: Fingerprint | None = None,
                 level_prior: LevelPrior | None = None, only_trusted: bool = False,
                 from_start: bool = True, max_samples: int = MAX_HELD_SAMPLES) -> None:
        """``started_at`` is the task's start on the samples' clock (default: first sample).
        ``from_start`` says the series begins with the run (not at a restore from a
        checkpoint, in the middle of its life): only then does ``finish`` give an envelope.
        With ``only_trusted``, ``add`` and ``refit`` return only fingerprints that are
        ``trusted``, and one is news against the last they returned (a guess that was never
        returned does not hide the trusted fingerprint that follows it)."""
        self.signature = signature
        self.only_trusted = only_trusted
        self.from_start = from_start
        self.expected_duration_s = expected_duration_s
        self._start = started_at
        self._min = max(min_samples, 2)
        self._growth = refit_growth
        self._level_prior = level_prior
        self._t: list[float] = []
        self._mb: list[float] = []
        self._util: list[float] = []
        self._coloc: list[float] = []
        self._max_samples = max(max_samples, 16)
        self._added = 0
        self._fitted_at = 0
        self._published: Fingerprint | None = None
        self._current: Fingerprint | None = prior
        self._analysis: SeriesAnalysis | None = None
        self._ended = False  # ``finish`` was called: the series is the run's whole life

    @property
    def expected_duration_s(self) -> float | None:
        """The life the task declared, ``None`` when unknown or not a life (``declared_life``:
        a NaN one would cut the run's envelope at no time, an infinite one break every fit)."""
        return self._declared

    @expected_duration_s.setter
    def expected_duration_s(self, value: float | None) -> None:
        self._declared = declared_life(value)

    @property
    def current(self) -> Fingerprint | None:
        """The latest fingerprint (fitted, or the prior before the first fit)."""
        return self._current

    @property
    def analysis(self) -> SeriesAnalysis | None:
        """The latest full analysis, with notes; ``None`` before the first fit."""
        return self._analysis

    @property
    def samples(self) -> int:
        """How many memory samples have been added."""
        return self._added

    @property
    def held_samples(self) -> int:
        """How many samples the fits read now (all of them until the series is thinned)."""
        return len(self._t)

    @property
    def peak_so_far_mb(self) -> float:
        """The most memory any sample showed (0 before the first)."""
        return max(self._mb, default=0.0)

    @property
    def first_mb(self) -> float:
        """What the first sample showed (0 before it)."""
        return self._mb[0] if self._mb else 0.0

    @property
    def last_mb(self) -> float:
        """What the latest sample showed (0 before the first)."""
        return self._mb[-1] if self._mb else 0.0

    def held_series(self) -> HeldSeries:
        """A copy of the run as this model holds it: it may go on taking samples meanwhile."""
        return HeldSeries(self._start, tuple(self._t), tuple(self._mb), tuple(self._util), tuple(self._coloc),
                          self._added, self._fitted_at, self._published)

    def resume(self, held: HeldSeries) -> None:
        """Go on with the run ``held`` describes (another model's, or a checkpoint's), as that
        model would: its next sample, refit and publication are the ones it would have made."""
        self._start = held.started_at
        self._t, self._mb = list(held.t_s), list(held.used_mb)
        self._util, self._coloc = list(held.utilisation), list(held.colocated)
        self._added = held.added
        self._fitted_at = min(held.fitted_at, len(self._t))
        self._published = self._current = held.published

    def refits_or_thins_on_next_add(self) -> bool:
        """Whether the next :meth:`add` refits or thins the series (milliseconds to tens of
        them) rather than only appending: a service may then run it off its event loop."""
        n = len(self._t) + 1
        return n > self._max_samples or (n >= self._min and n >= self._fitted_at * (1.0 + self._growth))

    def add(self, at: float, used_mb: float, *, utilisation: float | None = None,
            colocated: int | None = None) -> Fingerprint | None:
        """Add one sample; returns the refitted fingerprint when it changed materially.

        Raises ``ValueError``, adding nothing, for a time, memory or utilisation that is not a
        finite number."""
        if not (math.isfinite(at) and math.isfinite(used_mb)
                and (utilisation is None or math.isfinite(utilisation))):
            # Added, it would make every later fit of the series NaN, for the rest of the run.
            raise ValueError(f"sample at {at:g} of {used_mb:g} MB (utilisation {utilisation}) is not a number")
        if self._start is None:
            self._start = at
        self._t.append(at - self._start)
        self._mb.append(used_mb)
        self._added += 1
        if utilisation is not None:
            self._util.append(utilisation)
            self._coloc.append(float(colocated) if colocated is not None else np.nan)
        if len(self._t) > self._max_samples:
            self._thin()
        n = len(self._t)
        if n < self._min or n < self._fitted_at * (1.0 + self._growth):
            return None
        return self.refit()

    def _thin(self) -> None:
        """Halve the series: the first and the latest sample stay (a restore is judged by
        them), and of each pair between them the one that held more memory. Utilisation is
        averaged by pairs and co-location kept at its most. The refit schedule restarts from
        the halved count."""
        t, mb = self._t, self._mb
        last = len(t) - 1
        kept = [0] + [i if mb[i] >= mb[i + 1] else i + 1 for i in range(1, last - 1, 2)]
        if last % 2 == 0:
            kept.append(last - 1)  # the one left unpaired before the latest
        kept.append(last)
        self._t, self._mb = [t[i] for i in kept], [mb[i] for i in kept]
        util, coloc = self._util, self._coloc
        self._util = [(util[i] + util[i + 1]) / 2.0 for i in range(0, len(util) - 1, 2)] + util[len(util) // 2 * 2:]
        self._coloc = [float(np.fmax(coloc[i], coloc[i + 1])) if not (np.isnan(coloc[i]) or np.isnan(coloc[i + 1]))
                       else np.nan for i in range(0, len(coloc) - 1, 2)] + coloc[len(coloc) // 2 * 2:]
        self._fitted_at = min(self._fitted_at, len(self._t))

    def refit(self) -> Fingerprint | None:
        """Refit now on every sample so far; returns the fingerprint if it changed materially."""
        if not self._t:
            return None
        coloc = np.asarray(self._coloc)
        use_coloc = bool(self._coloc) and not np.isnan(coloc).any()
        self._analysis = analyse_series(
            self._t, self._mb, signature=self.signature, expected_duration_s=self.expected_duration_s,
            utilisation=self._util or None, colocated=coloc if use_coloc else None,
            prior=self._level_prior, ended=self._ended)
        self._fitted_at = len(self._t)
        self._current = self._analysis.fingerprint
        if self._current.samples != self._added:
            # Thinned: the fingerprint still counts every sample seen (replicas prefer the
            # run in progress seen for the most samples).
            self._current = msgspec.structs.replace(self._current, samples=self._added)
        if self.only_trusted and not trusted(self._current):
            return None
        if changed_materially(self._published, self._current):
            self._published = self._current
            return self._current
        return None

    def finish(self, ended_at: float | None = None) -> Fingerprint | None:
        """The fingerprint of a run that has ended, refit on all its samples: a level it
        held from its first sample to its last is its peak (flat), not the first level of a
        step schedule, which the same series reads as while the run may still step up.

        ``ended_at`` is when the run ended, on the samples' clock: growth is carried to it
        instead of the declared end, so a run that stopped early is not extrapolated to the
        end it declared (and one that overran is carried to its real end). An ``ended_at``
        before the last sample is a clock that disagrees (a simulator running ahead of the
        wall clock) and is not used: the last samples may still be on their way, so growth
        is carried to the declared end, as without ``ended_at``. ``None`` before any sample."""
        if not self._t:
            return None
        declared = self.expected_duration_s
        if ended_at is not None and self._start is not None and ended_at - self._start >= self._t[-1]:
            self.expected_duration_s = max(ended_at - self._start, 1e-6)
        self._ended = True
        self.refit()
        if self._current is not None and declared:
            self._current = msgspec.structs.replace(self._current, envelope_mb=self.envelope(declared))
        return self._current

    def envelope(self, declared_s: float) -> tuple[float, ...]:
        """The run's memory envelope for the duration it declared (``run_envelope``); empty
        when the series did not begin with the run (``from_start``)."""
        return run_envelope(self._t, self._mb, declared_s) if self.from_start else ()

"""Task signatures, and what the fleet remembers about tasks that share one.

A signature is what makes two submissions "the same program": the task kind, the
container image, the command line and the model label (``labels["model"]``). Tenant,
sizes, SLA and the task id are left out on purpose, so a nightly re-run of the same
fine-tune is recognised even when it asks for a different GPU count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
from collections.abc import Callable

import msgspec

from fleetpilot.contracts import Fingerprint, GrowthPattern, TaskSubmitted

from .envelope import merge_envelopes
from .online import changed_materially

log = logging.getLogger("fleetpilot.fingerprint")

# The label that names the model a task trains or serves.
MODEL_LABEL = "model"

RESTORE_KEPT_SHARE = 0.75
"""A restored run that holds at least this share of what it held when stopped came back
where it was; one below it started over."""

RUN_PEAKS_KEPT = 200
"""How many of a signature's latest runs it keeps the peak of (``run_peaks_mb``)."""
FIT_MIN_RUNS = 20
"""Runs a signature must have ended before its runs' spread is trusted (``fit_peak``): fewer
say little about the few runs in a hundred that go higher."""
FIT_MISS_SHARE = 0.025
"""The share of a signature's known runs that a GPU sized by ``fit_peak`` may be too small
for: the OOM risk a task takes to run on a GPU that holds nearly all of its program's runs,
rather than wait for one that holds its mean with a margin."""
LEARNT_RUNS_KEPT = 256
"""How many of a signature's latest runs folded into its statistics it keeps the key of
(``learnt_runs``): enough for the runs a fingerprinter started again reads back from the
streams (those of its last minutes), few enough to keep the statistics small."""


def task_signature(task: TaskSubmitted) -> str:
    """Stable signature ``"sig-" + 16 hex digits`` of kind, image, command and model label.

    The hash is SHA-256 over canonical JSON (sorted keys, no spaces) of those four fields,
    so it is identical across processes, machines and Python versions.
    """
    payload = {
        "kind": task.kind,
        "image": task.image or "",
        "command": list(task.command or []),
        "model": task.labels.get(MODEL_LABEL, ""),
    }
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return "sig-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


class SignatureStats(msgspec.Struct, kw_only=True, tag_field="memory", tag="per_gpu"):
    """Running statistics of the fingerprints of one signature (serialisable for a KV bucket).

    Memory is per GPU, as every request, hold and GPU a fingerprint is compared with; every
    encoding says so (``"memory": "per_gpu"``), and ``load_stats`` reads nothing else.
    """

    signature: str
    count: int = 0
    votes: dict[str, float] = msgspec.field(default_factory=dict)
    mean_peak_mb: float = 0.0
    m2_peak: float = 0.0
    min_peak_mb: float = 0.0
    max_peak_mb: float = 0.0
    mean_growth_mb_per_s: float = 0.0
    mean_warmup_s: float = 0.0
    mean_time_to_peak_s: float | None = None
    mean_burstiness: float = 0.0
    mean_sensitivity: float = 0.0
    oom_floor_mb: float = 0.0  # the most a run held when it died of OOM: the peak is above it
    # Runs stopped and restored (a checkpoint, a move): how many came back holding what they
    # held when stopped, and how many started over lower (``fingerprint.restores``).
    restores_kept: int = 0
    restores_reset: int = 0
    # The most its runs held by each twentieth of their declared duration (``envelope``).
    envelope_mb: tuple[float, ...] = ()
    # Per GPU, what each of its latest ``RUN_PEAKS_KEPT`` runs needed, oldest first: the most
    # a completed run held, or the floor a run killed by an OOM taught (``fit_peak``).
    run_peaks_mb: tuple[float, ...] = ()
    # The keys of its latest ``LEARNT_RUNS_KEPT`` runs folded in (``run_key``), oldest first:
    # a run's end read again (a fingerprinter started again within its grace, a replica of
    # an old partition count beside a new one) is folded once.
    learnt_runs: tuple[str, ...] = ()


def run_key(task_id: str, ended_at: float) -> str:
    """The key a run is folded under (``learnt_runs``): its task and its end's time (a retry of
    the task is another run), hashed to 16 hex digits so that a signature's record stays small."""
    return hashlib.sha256(f"{task_id}\0{ended_at!r}".encode()).hexdigest()[:16]


def learnt(stats: SignatureStats, key: str) -> bool:
    """Whether the run of ``key`` (``run_key``) has been folded into ``stats`` already."""
    return key in stats.learnt_runs


def mark_learnt(stats: SignatureStats, key: str) -> SignatureStats:
    """``stats`` having folded in the run of ``key``; the oldest beyond ``LEARNT_RUNS_KEPT``
    is dropped. The input is not modified."""
    return msgspec.structs.replace(stats, learnt_runs=(*stats.learnt_runs, key)[-LEARNT_RUNS_KEPT:])


def keep_signature_knowledge(new: Fingerprint, old: Fingerprint | None) -> Fingerprint:
    """``new``, with what ``old`` knew from the signature's past runs and ``new`` does not: a
    fingerprint observed on a running task tells its pattern and peak, not when its program
    grows (the envelope) nor how far its runs spread (``fit_peak_mb``, ``run_peaks_mb``);
    those its signature predicted still hold."""
    if old is None:
        return new
    envelope = new.envelope_mb or old.envelope_mb
    fit = new.fit_peak_mb or old.fit_peak_mb
    peaks = new.run_peaks_mb or old.run_peaks_mb
    if envelope == new.envelope_mb and fit == new.fit_peak_mb and peaks == new.run_peaks_mb:
        return new
    return msgspec.structs.replace(new, envelope_mb=envelope, fit_peak_mb=fit, run_peaks_mb=peaks)


STEP_PEAK_MIN_RUNS = 3
"""Ended runs of a program, their peaks known, before they bound a run's own step fit."""
STEP_PEAK_MARGIN = 0.05
"""How far above the highest of those peaks a run of the program may still be heading."""


def within_its_programs_runs(fp: Fingerprint, stats: SignatureStats | None, held_mb: float) -> Fingerprint:
    """``fp``, a running task's own fingerprint, with a step schedule's predicted peak held to
    what its program's ended runs reached (the highest of their known peaks plus
    ``STEP_PEAK_MARGIN``, once ``STEP_PEAK_MIN_RUNS`` are known), and never below ``held_mb``,
    what the run holds now.

    A step fit carries the steps it has seen through the run's declared life: a few steps
    early in a long run read as many more to come. But a step schedule's top is the
    program's (its model, its batches), not the run length's: runs of the same program that
    peaked at 34-36 GB were read at 40-42 GB and stopped for an OOM that could not come,
    moved onto the largest GPUs ahead of the work only those hold. A line or a leak is left as
    it is: its peak does grow with the run's length."""
    peaks = stats.run_peaks_mb if stats is not None else ()
    if fp.pattern != "steps" or len(peaks) < STEP_PEAK_MIN_RUNS:
        return fp
    top = max(max(peaks) * (1.0 + STEP_PEAK_MARGIN), held_mb)
    if fp.predicted_peak_mb <= top:
        return fp
    return msgspec.structs.replace(fp, predicted_peak_mb=top, peak_high_mb=min(fp.peak_high_mb, top),
                                   peak_low_mb=min(fp.peak_low_mb, top))


def borrowed(fp: Fingerprint) -> Fingerprint:
    """``fp``, the fingerprint of a run in progress, as the prediction another task of its
    signature is given while no run of it has ended: none of that task's own samples are in
    it (``samples`` 0, as in a signature's prediction), so that task's own first trusted
    fingerprint takes its place once it runs."""
    return msgspec.structs.replace(fp, samples=0)


def prediction_changed(old: Fingerprint | None, new: Fingerprint | None) -> bool:
    """Whether ``new``, a signature's prediction once it has learnt from one more run, should
    replace ``old``, the one a task still waiting to start was given: there is one now where
    there was none, it changed materially (``changed_materially``), or the runs' spread says
    something else (``fit_peak_mb``: a small move may cross a GPU's size)."""
    if new is None:
        return False
    return old is None or new.fit_peak_mb != old.fit_peak_mb or changed_materially(old, new)


def load_stats(raw: bytes) -> SignatureStats | None:
    """The statistics stored as ``raw``, or ``None`` when they are not in today's units.

    Statistics written before fingerprints were per GPU (2026-11-30) summed the memory of a
    task's GPUs: a known 4-GPU signature looked four times too big. They carry no
    ``"memory": "per_gpu"`` and are not read: the signature predicts nothing until a run of it
    ends, and the writer then starts its statistics afresh. Raises ``msgspec.DecodeError`` or
    ``ValidationError`` for what is not statistics at all.
    """
    doc = msgspec.json.decode(raw)
    if not isinstance(doc, dict) or "signature" not in doc:
        raise msgspec.ValidationError("not signature statistics")
    if doc.get("memory") != "per_gpu":
        return None
    return msgspec.convert(doc, SignatureStats)


def stored_stats(signature: str, raw: bytes | None) -> SignatureStats | None:
    """The statistics the ``fingerprints`` bucket holds for ``signature`` as ``raw``, ``None``
    when there are none a reader can use: none yet, some in the units of before 2026-11-30
    (``load_stats``), or a value that is not statistics at all (logged). Every reader (the
    fingerprinter, the SLA negotiator, the policy) treats the three as nothing known; the
    fingerprinter writes over them when a run of the signature ends."""
    if not raw:
        return None
    try:
        stats = load_stats(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("unreadable statistics for %s (%s): nothing known of it until a run of it ends", signature, exc)
        return None
    if stats is None:
        log.info("statistics for %s predate per-GPU memory: nothing known of it until a run of it ends", signature)
    return stats


def merge(stats: SignatureStats, fp: Fingerprint) -> SignatureStats:
    """``stats`` with one more observed fingerprint folded in (Welford's running moments).

    A fingerprint votes for its pattern with its confidence, so a confident end-of-life
    fingerprint outweighs an early guess. The input is not modified.
    """
    n = stats.count + 1
    delta = fp.predicted_peak_mb - stats.mean_peak_mb
    mean = stats.mean_peak_mb + delta / n
    votes = dict(stats.votes)
    votes[fp.pattern] = votes.get(fp.pattern, 0.0) + max(fp.pattern_confidence, 0.05)
    ttp = stats.mean_time_to_peak_s
    if fp.time_to_peak_s is not None:
        ttp = fp.time_to_peak_s if ttp is None else ttp + (fp.time_to_peak_s - ttp) / n

    def running(old: float, new: float) -> float:
        return old + (new - old) / n

    return SignatureStats(
        signature=stats.signature, count=n, votes=votes, mean_peak_mb=mean,
        m2_peak=stats.m2_peak + delta * (fp.predicted_peak_mb - mean),
        min_peak_mb=fp.predicted_peak_mb if stats.count == 0 else min(stats.min_peak_mb, fp.predicted_peak_mb),
        max_peak_mb=max(stats.max_peak_mb, fp.predicted_peak_mb),
        mean_growth_mb_per_s=running(stats.mean_growth_mb_per_s, fp.growth_rate_mb_per_s),
        mean_warmup_s=running(stats.mean_warmup_s, fp.warmup_s),
        mean_time_to_peak_s=ttp,
        mean_burstiness=running(stats.mean_burstiness, fp.burstiness),
        mean_sensitivity=running(stats.mean_sensitivity, fp.context_switch_sensitivity),
        oom_floor_mb=stats.oom_floor_mb,
        restores_kept=stats.restores_kept,
        restores_reset=stats.restores_reset,
        envelope_mb=merge_envelopes(stats.envelope_mb, fp.envelope_mb),
        run_peaks_mb=stats.run_peaks_mb,
        learnt_runs=stats.learnt_runs,
    )


def merge_run_peak(stats: SignatureStats, peak_mb: float) -> SignatureStats:
    """``stats`` after a run completed having held at most ``peak_mb`` per GPU: one more run
    its spread is known by (``fit_peak``); the oldest beyond ``RUN_PEAKS_KEPT`` is dropped, so
    a program that changed is soon judged by its new runs. The input is not modified."""
    peaks = (*stats.run_peaks_mb, float(peak_mb))[-RUN_PEAKS_KEPT:]
    return msgspec.structs.replace(stats, run_peaks_mb=peaks)


def known_run_peaks(stats: SignatureStats) -> tuple[float, ...]:
    """The signature's known runs' peaks in ascending order, once ``FIT_MIN_RUNS`` are known
    (what ``fit_peak`` reads; a policy may read the whole spread); empty before."""
    if len(stats.run_peaks_mb) < FIT_MIN_RUNS:
        return ()
    return tuple(sorted(stats.run_peaks_mb))


def fit_peak(stats: SignatureStats) -> float:
    """The least memory per GPU that held all but ``FIT_MISS_SHARE`` of the signature's known
    runs (a run killed by an OOM counts at its floor, as one that needed more); 0 until
    ``FIT_MIN_RUNS`` are known.

    Unlike the predicted peak (the runs' mean), it says how many runs a GPU would have been
    too small for: a program whose runs nearly all stay under a GPU's size may ask that GPU
    even when its mean plus a margin is just above it.
    """
    return _fit_peak_of(known_run_peaks(stats))


def _fit_peak_of(peaks: tuple[float, ...]) -> float:
    """``fit_peak`` of ``known_run_peaks``' answer (sorted once, read by both fields of a prediction)."""
    if not peaks:
        return 0.0
    # The k-th smallest, k the fewest runs of which the rest are at most the share allowed.
    k = math.ceil((1.0 - FIT_MISS_SHARE) * len(peaks) - 1e-9)
    return peaks[max(k, 1) - 1]


def merge_oom(stats: SignatureStats, held_mb: float) -> SignatureStats:
    """``stats`` after a run was killed for want of memory while holding ``held_mb``.

    The run's series stops before its peak, so its fingerprint would teach too small a
    peak; what it does teach is a floor: the signature needs more than that. Predictions
    never go below the floor; the run counts among the signature's runs at ``held_mb``
    (``fit_peak``). The input is not modified.
    """
    return msgspec.structs.replace(merge_run_peak(stats, held_mb), oom_floor_mb=max(stats.oom_floor_mb, float(held_mb)))


def merge_restore(stats: SignatureStats, stopped_mb: float, restored_mb: float) -> SignatureStats:
    """``stats`` after a run that held ``stopped_mb`` per GPU when it was stopped (checkpointed,
    moved) held ``restored_mb`` in its first sample once restored: one more restore that came
    back where it was (at least ``RESTORE_KEPT_SHARE`` of it), or one that started over. Only
    restores that can tell the two apart should be counted (``restore_tells``). The input is
    not modified."""
    if restored_mb >= RESTORE_KEPT_SHARE * stopped_mb:
        return msgspec.structs.replace(stats, restores_kept=stats.restores_kept + 1)
    return msgspec.structs.replace(stats, restores_reset=stats.restores_reset + 1)


def restore_tells(started_mb: float, stopped_mb: float) -> bool:
    """Whether the restore of a run that held ``started_mb`` per GPU in its first sample and
    ``stopped_mb`` when stopped can tell a run that starts over from one that comes back where
    it was: not when it was stopped before it had grown well past where it started."""
    return RESTORE_KEPT_SHARE * stopped_mb > started_mb


def restores_start_over(stats: SignatureStats | None) -> bool:
    """Whether the restored runs of a signature have mostly started over lower than they were
    stopped (a leak, the caching allocator, a cache), rather than come back where they were (a
    step schedule of batch size or resolution). A tie, or nothing known, says they come back."""
    return stats is not None and stats.restores_reset > stats.restores_kept


def predicts_nothing(stats: SignatureStats | None) -> bool:
    """Whether ``predict`` says nothing of these statistics: no run of the signature has
    ended (fingerprinted or not) and no OOM has set it a floor."""
    return stats is None or (stats.count == 0 and stats.oom_floor_mb <= 0 and not stats.run_peaks_mb)


def predict(stats: SignatureStats) -> Fingerprint | None:
    """The fingerprint a new submission of this signature should expect; ``None`` if unseen.

    Pattern: the vote winner, with confidence its vote share shrunk towards 0.5 for few
    observations (``share * n / (n + 1)``). Peak: the running mean; the interval spans the
    observed extremes and the mean +- 2 standard deviations, whichever is wider. The runs'
    spread: ``fit_peak``.
    """
    if predicts_nothing(stats):
        return None
    floor = stats.oom_floor_mb
    peaks = known_run_peaks(stats)
    if stats.count == 0:
        # No run was fingerprinted to its end (each was moved or restored, its series begun
        # mid-run), but the peaks of the runs that ended say how high it goes, and an OOM that
        # it needs more than its floor; its pattern is not known.
        ran = stats.run_peaks_mb
        mean = statistics.fmean(ran) if ran else 0.0
        sd = statistics.stdev(ran) if len(ran) > 1 else 0.0  # one peak (an OOM's alone: the floor) is all it says
        return Fingerprint(signature=stats.signature, pattern="unknown", pattern_confidence=0.0,
                           growth_rate_mb_per_s=0.0, predicted_peak_mb=max(mean, floor),
                           peak_low_mb=max(min(min(ran, default=0.0), mean - 2 * sd), floor, 0.0),
                           peak_high_mb=max(max(ran, default=0.0), mean + 2 * sd, floor),
                           samples=0, fit_peak_mb=_fit_peak_of(peaks), run_peaks_mb=peaks)
    total = sum(stats.votes.values()) or 1.0
    pattern, vote = max(stats.votes.items(), key=lambda kv: kv[1])
    n = stats.count
    sd = math.sqrt(stats.m2_peak / (n - 1)) if n > 1 else 0.25 * stats.mean_peak_mb
    growth_pattern: GrowthPattern = pattern  # type: ignore[assignment]
    return Fingerprint(
        signature=stats.signature,
        pattern=growth_pattern,
        pattern_confidence=round(vote / total * n / (n + 1), 4),
        growth_rate_mb_per_s=stats.mean_growth_mb_per_s,
        predicted_peak_mb=max(stats.mean_peak_mb, floor),
        peak_low_mb=max(min(stats.min_peak_mb, stats.mean_peak_mb - 2 * sd), floor, 0.0),
        peak_high_mb=max(stats.max_peak_mb, stats.mean_peak_mb + 2 * sd, floor),
        time_to_peak_s=stats.mean_time_to_peak_s,
        warmup_s=stats.mean_warmup_s,
        burstiness=stats.mean_burstiness,
        context_switch_sensitivity=stats.mean_sensitivity,
        samples=0,
        envelope_mb=stats.envelope_mb,
        fit_peak_mb=_fit_peak_of(peaks),
        run_peaks_mb=peaks,
    )


class SignatureMemory:
    """In-memory map of signature -> :class:`SignatureStats`; no I/O (the service persists it).

    Record end-of-life fingerprints with :meth:`observe`; ask :meth:`predict` when a task
    with a known signature is submitted.
    """

    def __init__(self, stats: dict[str, SignatureStats] | None = None) -> None:
        """Start empty, or from previously exported stats."""
        self._stats: dict[str, SignatureStats] = dict(stats or {})

    def _fold(self, signature: str, fold: Callable[[SignatureStats], SignatureStats]) -> SignatureStats:
        """Apply ``fold`` to the signature's statistics (fresh ones when it is new); return them."""
        self._stats[signature] = fold(self._stats.get(signature, SignatureStats(signature=signature)))
        return self._stats[signature]

    def observe(self, fp: Fingerprint) -> SignatureStats:
        """Fold ``fp`` into its signature's statistics and return them."""
        if not fp.signature:
            raise ValueError("fingerprint has no signature")
        return self._fold(fp.signature, lambda old: merge(old, fp))

    def observe_run_peak(self, signature: str, peak_mb: float) -> SignatureStats:
        """Record that a run of ``signature`` completed holding at most ``peak_mb`` per GPU
        (``merge_run_peak``)."""
        return self._fold(signature, lambda old: merge_run_peak(old, peak_mb))

    def observe_oom(self, signature: str, held_mb: float) -> SignatureStats:
        """Record that a run of ``signature`` died of OOM holding ``held_mb`` (``merge_oom``)."""
        return self._fold(signature, lambda old: merge_oom(old, held_mb))

    def observe_restore(self, signature: str, stopped_mb: float, restored_mb: float) -> SignatureStats:
        """Record one restore of a run of ``signature`` (``merge_restore``)."""
        return self._fold(signature, lambda old: merge_restore(old, stopped_mb, restored_mb))

    def predict(self, signature: str) -> Fingerprint | None:
        """The expected fingerprint of ``signature``, or ``None`` if it was never observed."""
        stats = self._stats.get(signature)
        return predict(stats) if stats is not None else None

    def stats(self, signature: str) -> SignatureStats | None:
        """The raw statistics of ``signature`` (for persisting one KV entry)."""
        return self._stats.get(signature)

    def __len__(self) -> int:
        """Number of known signatures."""
        return len(self._stats)

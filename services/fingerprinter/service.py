"""The fingerprinter service.

- ``task.submitted``: computes the task's signature; when the ``fingerprints`` bucket knows
  it, publishes a predicted ``task.fingerprinted`` (source ``signature``) at once.
- ``telemetry.task.<task>``: feeds the task's online model (memory per GPU) and publishes
  ``task.fingerprinted`` (source ``observed``) whenever the prediction changes materially.
- ``task.lifecycle``: a migrated or evicted task's series starts again (it runs on as a new
  process where it is restored); when a task ends, its last fingerprint is merged into its
  signature's statistics in the bucket (compare-and-set), for the next submission. A task
  killed by an OOM is not: its series stops before its peak; the most it held becomes the
  signature's floor instead (``merge_oom``), under which no prediction goes. A completed run's
  peak (the most any of its samples held, across its moves) joins its signature's known runs
  (``merge_run_peak``), by which the runs' spread is told (``fit_peak``). The end is
  learnt ``end_grace_s`` after its event: samples come on core NATS and the event on
  JetStream (a consumer of its own), so the run's last samples can arrive after it; a sample
  of a run already learnt, or taken after its end, is dropped.
- Tasks waiting to start: a task submitted that has not run yet (no sample, no ``started``)
  is told its signature's new prediction (``task.fingerprinted``, source ``signature``) when a
  run of the signature ends and changes it (``prediction_changed``): a queue that waits hours
  behind a program's first runs is placed by what they taught, not by what was known when
  it was submitted. Until a run of a signature has ended, its tasks are told the trusted
  fingerprint of a run of it still in progress (the one seen longest) instead: a program's
  second wide task is not placed by its user's guess while its first already shows more.
- Restores: the first sample of a migrated or evicted task once it runs again, against what
  it held when it stopped, says whether its signature comes back from a checkpoint where it
  was (a step schedule) or starts over lower (a leak, a cache); counted in the signature's
  statistics (``merge_restore``), where the policy reads it before it bridges a checkpointed
  run again onto the room it outgrew.
- Bad and stray input: a sample of negative memory, or of more per GPU than any GPU holds
  (``MOST_MB_PER_GPU``), or of a utilisation that is not a percentage, is dead-lettered with
  its reason; one stamped at or before the latest of its task's series (delivered twice, or
  overtaken) or its latest stop (the process stopped, not the one restored) is dropped; one
  stamped far ahead of its node's clock (``NodeClocks``) is dead-lettered, and a lifecycle event
  so stamped is taken as at its node's latest sample. A task rejected
  (``task.rejected``) is forgotten; a run silent for ``silent_forget_s`` loses its series
  (keeping its signature and peak, as after a move); a retry (``started`` after an end) is
  fitted with its signature, and an earlier run's end or start delivered again is ignored.
  Fits run on one thread off the event loop; a fold the bucket cannot take while the server
  is away is written again once it is back. A run is folded once (``learnt_runs``); the runs
  that ended in the last minutes and that no replica learnt (this one crashed within their
  grace) are learnt at start from what the streams keep (``recover_ended_runs``).
- Restarts: every ``checkpoint_s`` and when it stops, a replica writes each run in progress
  that changed to the ``fingerprint_series`` bucket (``fleetpilot.fingerprint.checkpoint``);
  one that starts restores its tasks' runs before it takes a sample, and each goes on as one
  series that began with its run (its end still teaches an envelope); so does a run stopped
  that waits for its restore (what it held before, when it stopped). A run's key is deleted
  when it is learnt, and at the next round when it is forgotten or rejected.
- Partitions: with ``partitions`` above 1, each replica owns the tasks whose id hashes to its
  ``partition`` and takes every message on consumers of its own, keeping its tasks'; a task's
  samples all reach its one model. What another partition's runs show reaches this one's
  waiting tasks through the observed ``task.fingerprinted`` it hears and the ``fingerprints``
  bucket it watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import msgspec
from fleetpilot.contracts import (
    Fingerprint,
    TaskFingerprinted,
    TaskLifecycle,
    TaskRejected,
    TaskSubmitted,
    TaskTelemetry,
    decode,
    encode,
    now,
)
from fleetpilot.contracts.catalog import BUCKETS, STREAMS, stream_of
from fleetpilot.fingerprint import (
    SeriesCheckpoint,
    SignatureStats,
    TaskSeries,
    borrowed,
    checkpoint_of,
    decode_checkpoint,
    encode_checkpoint,
    learnt,
    mark_learnt,
    merge,
    merge_oom,
    merge_restore,
    merge_run_peak,
    predict,
    prediction_changed,
    predicts_nothing,
    restore,
    restore_tells,
    run_key,
    stored_stats,
    task_signature,
    within_its_programs_runs,
)
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import CasConflict, KvEntry, Partition, Reject, ServiceHost, ServiceSettings, serve
from prometheus_client import Gauge
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

log = logging.getLogger("fleetpilot.fingerprinter")

STREAM_OF_SUBMISSIONS = stream_of("task.submitted")
STREAM_OF_LIFECYCLE = stream_of("task.lifecycle.x")
STREAM_OF_SAMPLES = stream_of("telemetry.task.x")
SAMPLES_KEPT_S = next(stream.max_age_s for stream in STREAMS if stream.name == STREAM_OF_SAMPLES)
"""How long the server keeps the task samples (a short-lived stream, for late joiners): how
far back a replica started again looks for the runs that ended while it was away."""
TERMINAL_STATES = ("finished", "oom_killed", "failed")

FAR_AHEAD_S = 86_400.0
FASTEST_CLOCK = 1_000.0
"""A sample may lead its node's latest sample by at most ``FAR_AHEAD_S`` plus ``FASTEST_CLOCK``
times the seconds since that sample arrived (``NodeClocks``): a simulated fleet runs its clock
ahead of the wall clock (``--speed``), and a recorded series may be replayed at once, but a
time beyond that is garbled (milliseconds read as seconds, a clock set to another year)."""

PARTITION_REPLAY_S = 60.0
"""How far back a partition's own consumers start when first made (the fingerprinter
partitioned anew, or scaled out): the submissions and lifecycle events of the moments its
tasks had no replica, while the replicas of the old count were replaced by the new."""

CHECKPOINT_REFRESH_S = next(bucket.ttl_s for bucket in BUCKETS if bucket.name == "fingerprint_series") / 2
"""How long a run's checkpoint may go unwritten while its run is unchanged (a run stopped that
waits for its restore): half the bucket's time-to-live, which would otherwise take it."""

MOST_MB_PER_GPU = 1_048_576.0
"""More memory per GPU than any GPU holds (1 TiB; the largest hold under 300 GB): a sample
above it is garbled at its source (bytes read as MB, say), and fitted it would teach its
signature a peak no GPU holds, so that every later task of it is placed nowhere."""


class NodeClocks:
    """Each node's clock as its samples read it: the latest sample's time and when this replica
    heard it, by which a time far ahead of it is told apart from one a node's clock can have
    reached (``FAR_AHEAD_S``, ``FASTEST_CLOCK``). Not the replica's own clock: a simulated
    fleet's runs ahead of it without end. A node not heard of yet is judged against the
    replica's clock when it started. ``cap`` nodes are kept, the least recently heard dropped."""

    def __init__(self, cap: int) -> None:
        """Hear of no node yet."""
        self._latest: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._started = (now(), time.monotonic())
        self._cap = cap

    def latest(self, node: str) -> float:
        """The latest time ``node``'s samples read (this replica's start for a node unheard of)."""
        return self._latest.get(node, self._started)[0]

    def reach(self, node: str) -> float:
        """The furthest time ``node``'s clock can read now."""
        at, heard = self._latest.get(node, self._started)
        return at + FAR_AHEAD_S + FASTEST_CLOCK * (time.monotonic() - heard)

    def saw(self, node: str, at: float) -> bool:
        """Whether a sample of ``node`` at ``at`` is within its reach; one that is moves it on."""
        if at > self.reach(node):
            return False
        if at > self.latest(node):
            self._latest[node] = (at, time.monotonic())
            self._latest.move_to_end(node)
            while len(self._latest) > self._cap:
                self._latest.popitem(last=False)
        return True


def refusal(sample: TaskTelemetry) -> str | None:
    """Why ``sample`` cannot be fitted as it came (``None``: it can), in one line: a reading
    that is not a number, of negative memory, of a utilisation that is not a percentage, or of
    more per GPU than any GPU holds (``MOST_MB_PER_GPU``)."""
    if not (math.isfinite(sample.memory_used_mb) and math.isfinite(sample.at)):
        return f"memory_used_mb {sample.memory_used_mb:g} at {sample.at:g}: not a number"
    if sample.memory_used_mb < 0:
        # Garbled at its source: fitted, it would teach the signature a negative peak.
        return f"memory_used_mb {sample.memory_used_mb:g} is negative"
    if not 0.0 <= sample.utilization_gpu_pct <= 100.0:
        # A percentage garbled at its source: fitted, one such reading makes the task's
        # burstiness not a number (or out of its range) in every fingerprint after it,
        # which cannot be published nor folded into its signature's statistics.
        return f"utilization_gpu_pct {sample.utilization_gpu_pct:g} is not a percentage (0 to 100)"
    # A sample sums the task's GPUs; a fingerprint is per GPU, as every request, hold and
    # GPU it is compared with (a 3-GPU task's peak is not three times a GPU's).
    per_gpu = sample.memory_used_mb / max(len(sample.gpus), 1)
    if per_gpu > MOST_MB_PER_GPU:
        return (f"memory_used_mb {sample.memory_used_mb:g} on {max(len(sample.gpus), 1)} GPU(s) is "
                f"{per_gpu:g} MB per GPU, more than any GPU holds ({MOST_MB_PER_GPU:g} MB)")
    return None


class FingerprinterSettings(ServiceSettings):
    """``FLEETPILOT_FINGERPRINTER_*``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_FINGERPRINTER_", extra="ignore")

    # Bounded, and finite where a time: 0 tasks made every sample's handler pop a model from an
    # empty table, and an infinite time made a job that never runs (no end learnt, no checkpoint
    # written) or one that fails at every start (a recovery from before any date).
    max_tracked_tasks: int = Field(default=100_000, ge=1)
    end_grace_s: float = Field(default=2.0, ge=0, allow_inf_nan=False)
    """How long after a run's terminal ``task.lifecycle`` its end is learnt: its last samples
    (core NATS) may still be on their way when the event (JetStream) arrives."""
    silent_forget_s: float = Field(default=1800.0, gt=0, allow_inf_nan=False)
    """How long a run's samples may stop, with no lifecycle event, before its series is
    forgotten: its node is gone, or its end was never told (a process the collector names
    ``pid-<pid>`` has none), and kept it would hold up to 20,000 samples until the task cap.
    A run of a known task keeps its signature and the most it held, as after a move."""
    recover_s: float = Field(default=86_400.0, ge=0, le=366 * 86_400.0, allow_inf_nan=False)
    """How far back, at start, the submissions kept in the ``TASKS`` stream are read again for
    the signatures of the runs in progress (0: not at all). A replica started again (a
    rolling update, a crash) resumes its consumers past the submissions it had read, and
    the runs it then hears of by their samples alone had no signature: long runs in progress
    across a restart taught nothing when they ended."""
    checkpoint_s: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    """How often each run in progress that changed since is written to the
    ``fingerprint_series`` bucket (and once more when the replica stops cleanly), from which
    the replica that owns its task next restores it at start: a restart (a rollout, a crash, a
    rescale) costs a run the samples of at most this long, not its series so far (which, begun
    again mid-run, taught no envelope). 0: no checkpoint written nor restored."""
    partitions: int = Field(default=1, ge=1)
    """How many replicas share the tasks, each owning the tasks whose id hashes to its
    partition (``fleetpilot.runtime.partition``); every replica is given the same count."""
    partition: int = Field(default=0, ge=0)
    """The partition this replica owns, below ``partitions`` (a StatefulSet's pod index)."""

    @model_validator(mode="after")
    def _partition_is_one_of_them(self) -> FingerprinterSettings:
        if self.partition >= self.partitions:
            raise ValueError(f"PARTITION={self.partition} must be below PARTITIONS={self.partitions}")
        return self

    @property
    def owned(self) -> Partition:
        """The share of the tasks this replica fingerprints."""
        return Partition(self.partition, self.partitions)


def build(settings: FingerprinterSettings | None = None) -> ServiceHost:
    """Wire the fingerprinter."""
    settings = settings or FingerprinterSettings.from_environment()
    host = ServiceHost("fingerprinter", settings)
    owned = settings.owned
    # Partitioned, each replica takes every message on consumers of its own and keeps its
    # tasks'; whole, the one replica takes them on the shared consumers, as before.
    instance = "" if owned.whole else owned.name
    # Least recently fed first: past the cap the model forgotten is one that has gone longest
    # without a sample or submission (a task long queued, or one gone silently), not a run
    # still reporting, whose model, made again from a sample, would have lost its signature
    # and so teach nothing when it ends.
    models: OrderedDict[str, TaskSeries] = OrderedDict()
    # Tasks stopped to run again (moved, checkpointed, preempted) whose restore can tell
    # whether their signature comes back where it was: (signature, MB per GPU held when
    # stopped, when), until their first sample since.
    stopped: OrderedDict[str, tuple[str, float, float]] = OrderedDict()
    # Runs that ended, waiting ``end_grace_s`` for their last samples: task -> (the terminal
    # event, when it arrived on this clock). Then the runs learnt: a late sample of one is
    # dropped instead of starting a model of a run that is over. Each keeps its signature and
    # declared duration, which a retry's run (``started`` again) is fitted with: its model,
    # made on its first sample, would have none, and its run would teach nothing.
    ending: OrderedDict[str, tuple[TaskLifecycle, float]] = OrderedDict()
    ended: OrderedDict[str, tuple[str, float | None]] = OrderedDict()
    # Per task moved or stopped and restored, the most its series held before (its run's peak
    # spans every series since it started).
    peak_before: OrderedDict[str, float] = OrderedDict()
    # Per task stopped and not ended, when its latest stop was: that stop delivered again (an
    # ack lost to a reconnect), or an earlier one, would cut the series of the run restored
    # since and count its restore a second time.
    last_stop: OrderedDict[str, float] = OrderedDict()
    # Per task, when its latest run started: the end of an earlier run delivered again (an
    # ack lost to a reconnect) after a retry started would learn the retry's first minutes
    # as a whole run, and drop the rest of it.
    last_start: OrderedDict[str, float] = OrderedDict()
    # Tasks that will not run (``task.rejected``: by the SLA negotiator, or given up by the
    # policy), by when: a submission read after its rejection must not leave them waiting.
    rejected: OrderedDict[str, float] = OrderedDict()
    # Statistics folds the bucket could not take (the server away): written again each round.
    unwritten: deque[tuple[str, Callable[[SignatureStats], SignatureStats]]] = deque()
    # Refits (milliseconds each, tens on a long series) run here, off the event loop, so that
    # acks, the bucket's watch and the other consumers are not held up by them; one thread,
    # so one model is never fitted by two at once.
    fits = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fingerprinter-fit")
    # Tasks whose series a sample is being added to on that thread (a refit, a thinning): a
    # checkpoint copies a series on the event loop, and one copied meanwhile could be torn.
    fitting: set[str] = set()

    async def off_loop(call: Callable, *args, **kwargs):
        """``call(*args, **kwargs)`` on the fitting thread."""
        return await asyncio.get_running_loop().run_in_executor(fits, partial(call, *args, **kwargs))

    async def add_sample(task_id: str, model: TaskSeries, at: float, used_mb: float,
                         utilisation: float) -> Fingerprint | None:
        """``model.add`` of one sample: on the fitting thread when it refits or thins (the task
        is in ``fitting`` meanwhile, so that no checkpoint copies a series being changed)."""
        if not model.refits_or_thins_on_next_add():
            return model.add(at, used_mb, utilisation=utilisation)
        fitting.add(task_id)
        try:
            return await off_loop(model.add, at, used_mb, utilisation=utilisation)
        finally:
            fitting.discard(task_id)

    def keep_newest(cache: OrderedDict, key: str, value) -> None:
        """``value`` as the newest entry of ``cache``, the oldest dropped past the task cap."""
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > settings.max_tracked_tasks:
            cache.popitem(last=False)
    clocks = NodeClocks(settings.max_tracked_tasks)
    # Tasks submitted that have not run yet: task -> (signature, the prediction it was last
    # given, ``None`` for none), and the tasks by signature.
    waiting: OrderedDict[str, tuple[str, Fingerprint | None]] = OrderedDict()
    waiting_of: dict[str, set[str]] = {}
    # Per signature whose statistics predict nothing yet: the latest trusted fingerprint of
    # the run of it in progress seen longest, which its tasks are told meanwhile.
    live: OrderedDict[str, Fingerprint] = OrderedDict()

    # What an operator watches across partitions: each owned by one replica, and the tasks
    # shared out evenly (deploy/prometheus/alerts.yaml).
    Gauge("fleetpilot_fingerprinter_partition", "The partition this replica owns (1, labelled by its index)",
          ["partition"], registry=host.metrics.registry).labels(str(owned.index)).set(1)
    Gauge("fleetpilot_fingerprinter_partitions", "How many partitions share the tasks",
          registry=host.metrics.registry).set(owned.count)
    tasks = Gauge("fleetpilot_fingerprinter_tasks", "Tasks this replica holds: modelled (a series being fitted), "
                  "waiting (submitted, not started)", ["state"], registry=host.metrics.registry)
    tasks.labels("modelled").set_function(lambda: len(models))
    tasks.labels("waiting").set_function(lambda: len(waiting))

    def now_waiting(task_id: str, signature: str, given: Fingerprint | None) -> None:
        # Kept to tell whether a later prediction changes it (``prediction_changed``), which
        # does not read the runs' peaks: not kept, as they would be once per waiting task.
        waiting[task_id] = (signature, given and msgspec.structs.replace(given, run_peaks_mb=()))
        waiting_of.setdefault(signature, set()).add(task_id)
        while len(waiting) > settings.max_tracked_tasks:
            stop_waiting(next(iter(waiting)))

    def stop_waiting(task_id: str) -> None:
        signature, _ = waiting.pop(task_id, ("", None))
        if signature:
            tasks = waiting_of[signature]
            tasks.discard(task_id)
            if not tasks:
                del waiting_of[signature]

    async def stored(signature: str) -> SignatureStats | None:
        entry = await (await host.bus.kv("fingerprints")).get(signature)  # type: ignore[union-attr]
        return stored_stats(signature, entry.value if entry is not None else None)

    def lent(signature: str) -> Fingerprint | None:
        """What a run of ``signature`` in progress shows, as its other tasks are given it."""
        fp = live.get(signature)
        return borrowed(fp) if fp is not None else None

    async def learn_live(signature: str, fp: Fingerprint, stats: SignatureStats | None) -> None:
        """Keep ``fp``, a trusted fingerprint of a run in progress, as what the signature's
        tasks expect while its statistics (``stats``, as stored) predict nothing (no run of it
        has ended), and tell its waiting tasks. A run seen for fewer samples than the one kept
        does not replace it."""
        known = live.get(signature)
        if known is not None and fp.samples < known.samples:
            return
        if not predicts_nothing(stats):
            live.pop(signature, None)
            return
        keep_newest(live, signature, fp)
        await tell_waiting(signature, borrowed(fp))

    async def tell_waiting(signature: str, predicted: Fingerprint | None) -> None:
        """Publish ``predicted``, the signature's new prediction, to each of its tasks waiting
        to start whose own it changes (``prediction_changed``)."""
        tasks = waiting_of.get(signature)
        for task_id in sorted(tasks or ()):
            given = waiting.get(task_id)
            if given is None:
                continue  # it started (or was rejected) while an earlier one was being told
            if prediction_changed(given[1], predicted):
                waiting[task_id] = (signature, predicted)  # one object for all the signature's tasks
                await host.bus.publish(TaskFingerprinted(task_id=task_id, fingerprint=predicted,  # type: ignore[arg-type,union-attr]
                                                         source="signature", at=now()))

    async def statistics_changed(signature: str, stats: SignatureStats | None) -> None:
        """What the signature's statistics now say replaces a run in progress once a run has
        ended, and is told to its tasks waiting here."""
        if not predicts_nothing(stats):
            live.pop(signature, None)
        if signature in waiting_of:
            await tell_waiting(signature, (predict(stats) if stats is not None else None) or lent(signature))

    async def write_fold(signature: str, fold: Callable[[SignatureStats], SignatureStats]) -> SignatureStats | None:
        """Apply ``fold`` to the signature's statistics in the bucket (compare-and-set); the
        statistics written, ``None`` when ten writes in a row lost the race or ``fold`` returned
        them unchanged (the very object)."""
        kv = await host.bus.kv("fingerprints")  # type: ignore[union-attr]
        for _ in range(10):
            entry = await kv.get(signature)
            # Statistics in old units, or unreadable, are started afresh (``stored_stats``).
            stats = stored_stats(signature, entry.value if entry else None) or SignatureStats(signature=signature)
            folded = fold(stats)
            if folded is stats:
                return None  # nothing to write (a run learnt already, read again)
            body = encode(folded)
            try:
                if entry is None:
                    await kv.create(signature, body)  # type: ignore[union-attr]
                else:
                    await kv.update(signature, body, entry.revision)  # type: ignore[union-attr]
            except CasConflict:
                continue
            return folded
        log.warning("statistics of %s not updated: ten writes in a row lost the race", signature)
        return None

    async def fold_into(signature: str, fold: Callable[[SignatureStats], SignatureStats]) -> None:
        """Apply ``fold`` to the signature's statistics in the bucket (``write_fold``) and tell
        what they now say. A fold the bus cannot take now (the server away) is kept and
        written again (``write_unwritten``): the run it learns is over, and its series gone."""
        try:
            folded = await write_fold(signature, fold)
        except Exception as exc:
            if host.bus is None or not host.bus.unreachable(exc):
                raise
            log.warning("statistics of %s not written now (%s: %s): written again once the NATS server is back",
                        signature, type(exc).__name__, exc)
            unwritten.append((signature, fold))
            while len(unwritten) > settings.max_tracked_tasks:
                dropped, _ = unwritten.popleft()
                log.error("statistics of %s not written: more folds waited for the NATS server than tasks are "
                          "tracked", dropped)
            return
        if folded is not None:
            await statistics_changed(signature, folded)

    async def write_unwritten() -> None:
        """Write the folds kept while the server was away, oldest first, until one still fails."""
        while unwritten:
            signature, fold = unwritten[0]
            try:
                folded = await write_fold(signature, fold)
            except Exception as exc:
                if host.bus is not None and host.bus.unreachable(exc):
                    return  # still away: the next round tries again
                unwritten.popleft()
                log.error("statistics of %s not written: %s: %s", signature, type(exc).__name__, exc)
                continue
            unwritten.popleft()
            if folded is not None:
                await statistics_changed(signature, folded)

    # The signature and declared duration of tasks submitted before this replica started
    # (``recover_s``), read again from the stream: a run heard of by its samples alone gets
    # them. Kept apart from ``models`` so that the tasks long ended take no model.
    recovered: OrderedDict[str, tuple[str, float | None]] = OrderedDict()

    def model_for(task_id: str, signature: str = "", duration: float | None = None, *,
                  submitted: bool = False) -> TaskSeries:
        if not signature and task_id in recovered:
            signature, duration = recovered[task_id]
        if task_id not in models:
            if len(models) >= settings.max_tracked_tasks:
                models.popitem(last=False)  # forget the least recently fed rather than grow without bound
            # Only trusted fingerprints go out: an early guess (a warm-up read as a steep line,
            # a level read as a step schedule's first) would override a signature's prediction.
            # A model made on the submission sees the run from its start and may teach its
            # envelope; one made on a sample may have come in mid-run (this service started
            # again, or the sample overtook the submission), so its times are not the run's.
            models[task_id] = TaskSeries(signature, expected_duration_s=duration, only_trusted=True,
                                         from_start=submitted)
        model = models[task_id]
        models.move_to_end(task_id)
        model.heard_at = time.monotonic()
        # Telemetry (core NATS) can overtake the submission (JetStream): fill in what the
        # submission tells as soon as it arrives, so later refits know the task's life.
        if signature and not model.signature:
            model.signature = signature
        if duration is not None and model.expected_duration_s is None:
            model.expected_duration_s = duration
        return model

    @host.on(TaskSubmitted, consumer="fingerprinter-submitted", instance=instance,
             instance_start_s_ago=PARTITION_REPLAY_S)
    async def on_submitted(task: TaskSubmitted) -> TaskFingerprinted | None:
        if not owned.owns(task.task_id) or task.task_id in ended:
            # Its run was learnt already: the submission comes again (redelivered, or read by
            # this consumer behind the lifecycle's), and a model or a waiting entry made now
            # would never end.
            return None
        if task.submitted_at <= rejected.get(task.task_id, -math.inf):
            # Rejected already (the rejection, on core NATS, overtook this consumer): waiting,
            # it would be told its signature's predictions for ever. A submission made after
            # the rejection is the task submitted again, and handled.
            return None
        signature = task_signature(task)
        model = model_for(task.task_id, signature, task.expected_duration_s, submitted=True)
        if task.task_id in ending:
            return None  # it has run: its run, learnt shortly, needed only the signature given above
        stats = await stored(signature)
        predicted = (predict(stats) if stats is not None else None) or lent(signature)
        if model.samples == 0:
            now_waiting(task.task_id, signature, predicted)
        if predicted is None:
            return None
        return TaskFingerprinted(task_id=task.task_id, fingerprint=predicted, source="signature", at=now())

    @host.on_core("telemetry.task.*", TaskTelemetry, queue=f"fingerprinter-{instance}" if instance else "fingerprinter")
    async def on_sample(sample: TaskTelemetry) -> TaskFingerprinted | None:
        # Every replica's samples tell it each node's clock, its own tasks' or not.
        within_reach = clocks.saw(sample.node, sample.at)
        if not owned.owns(sample.task_id):
            return None
        # Its owner alone dead-letters a bad sample (every replica decodes every sample).
        reason = refusal(sample)
        if reason is not None:
            raise Reject(reason)
        if not within_reach:
            # Refused, not clamped: a sample's time is all that places it in its series. Taken,
            # it stretched the series' curve over the gap, and every later sample, stamped
            # before it, was dropped as overtaken: the run was fitted on its samples up to it.
            raise Reject(f"at {sample.at:g} is {sample.at - clocks.latest(sample.node):.0f} s ahead of the latest "
                         f"sample of node {sample.node!r}: a clock that is wrong, or a garbled time")
        per_gpu = sample.memory_used_mb / max(len(sample.gpus), 1)
        end = ending.get(sample.task_id)
        if sample.task_id in ended or (end is not None and sample.at > end[0].at):
            return None  # the run is over (a sample after its end belongs to nothing)
        if sample.at <= last_stop.get(sample.task_id, -math.inf):
            # Taken by the process stopped (held up on core NATS while the stop came on
            # JetStream), not by the one restored since: first in the restored run's series it
            # would read as a drop, a sawtooth's tooth. It still counts to the run's peak.
            keep_newest(peak_before, sample.task_id, max(peak_before.get(sample.task_id, 0.0), per_gpu))
            return None
        series = models.get(sample.task_id)
        if series is not None and sample.at <= series.latest_at:
            # Delivered twice, or overtaken by a later one: a series that holds a sample twice
            # reads as sampled at no interval, and a step run ended on its level is then taken
            # for a schedule that would step again (its peak twice what it held); one out of
            # order is what the series ends on when it is stopped, and in its envelope.
            return None
        stop_waiting(sample.task_id)
        restored = stopped.get(sample.task_id)
        if restored is not None and sample.at > restored[2]:
            del stopped[sample.task_id]
            signature, stopped_mb, _ = restored
            await fold_into(signature, lambda stats: merge_restore(stats, stopped_mb, per_gpu))
        model = model_for(sample.task_id)
        model.latest_at = max(model.latest_at, sample.at)
        fp = await add_sample(sample.task_id, model, sample.at, per_gpu, sample.utilization_gpu_pct)
        if fp is None:
            return None
        if model.signature:
            # One read of the signature's statistics serves both: a step fit carried through a
            # long run's life is held to what its program's ended runs reached
            # (``within_its_programs_runs``: read as it is, it stopped runs for an OOM that
            # could not come), and the run in progress is kept while they predict nothing.
            stats = await stored(model.signature)
            fp = within_its_programs_runs(fp, stats, per_gpu)
            await learn_live(model.signature, fp, stats)
        return TaskFingerprinted(task_id=sample.task_id, fingerprint=fp, source="observed", at=now())

    @host.on(TaskLifecycle, consumer="fingerprinter-lifecycle", instance=instance,
             instance_start_s_ago=PARTITION_REPLAY_S)
    async def on_lifecycle(life: TaskLifecycle) -> None:
        if not owned.owns(life.task_id):
            return
        if life.at > clocks.reach(life.node):
            # Clamped, not refused: the event tells that the task started, moved or ended,
            # which must not be lost; only its time is wrong. Taken at its word, a start or a
            # stop far ahead had every later end of the task ignored and every later sample
            # taken for the stopped process's, and an end had the run's growth carried to it.
            # Its node's latest sample is the latest time known to be right.
            log.warning("task.lifecycle %s of %s stamped %.0f s ahead of node %r's clock: taken as at its latest "
                        "sample", life.state, life.task_id, life.at - clocks.latest(life.node), life.node)
            life = msgspec.structs.replace(life, at=clocks.latest(life.node))
        stop_waiting(life.task_id)  # it runs, or has run: its own samples tell the rest
        if life.state in ("migrated", "evicted"):
            # Moved, or stopped to be placed again (preempted, checkpointed, its GPU gone):
            # the task runs on as a new process where it is restored, and its life is not
            # over, so no fingerprint is learnt yet. A series spanning the gap would read the
            # drop as a sawtooth; merged now, a partial series would teach a guess as a peak.
            # What it held when stopped waits for its first sample once restored.
            if life.at <= last_stop.get(life.task_id, -math.inf):
                return  # handled already: the model now is the run restored since
            keep_newest(last_stop, life.task_id, life.at)
            old = models.get(life.task_id)
            if old is not None and old.signature and restore_tells(old.first_mb, old.last_mb):
                stopped[life.task_id] = (old.signature, old.last_mb, life.at)
                while len(stopped) > settings.max_tracked_tasks:
                    stopped.popitem(last=False)
            if old is not None:
                peak_before[life.task_id] = max(peak_before.get(life.task_id, 0.0), old.peak_so_far_mb)
                while len(peak_before) > settings.max_tracked_tasks:
                    peak_before.popitem(last=False)
                # A new process, maybe on another node and its clock: its series starts afresh.
                models[life.task_id] = TaskSeries(old.signature, expected_duration_s=old.expected_duration_s,
                                                  only_trusted=True, from_start=False)
            return
        if life.state == "started":
            if life.at <= last_start.get(life.task_id, -math.inf):
                return  # a start handled already, delivered again: it must not reopen a run learnt since
            keep_newest(last_start, life.task_id, life.at)
            # Placed again after its run ended (a retry): the old run is learnt now, and the
            # new one's samples are its own.
            if life.task_id in ending:
                await learn_end(ending.pop(life.task_id)[0])
            signature, duration = ended.pop(life.task_id, ("", None))
            if signature:
                # Not from its start as far as its envelope goes: a retry may resume from a checkpoint.
                model_for(life.task_id, signature, duration)
            return
        if life.state not in TERMINAL_STATES:
            return
        if life.at < last_start.get(life.task_id, -math.inf):
            return  # the end of a run before the latest start, delivered again: that run was learnt
        ending[life.task_id] = (life, time.monotonic())

    async def learn_ended(grace_s: float) -> None:
        """Learn the runs whose end arrived at least ``grace_s`` ago, oldest first."""
        while ending:
            task_id, (life, arrived) = next(iter(ending.items()))
            if time.monotonic() - arrived < grace_s:
                return
            del ending[task_id]  # before the fold: a stop cutting it short must not fold it twice
            await learn_end(life)

    @host.every(max(settings.end_grace_s / 2, 0.05))
    async def learn_runs_past_their_grace() -> None:
        """Write what the bucket could not take before, then learn the runs whose grace has
        passed since their end arrived; while the server is still away, those wait (their
        series kept) rather than be learnt into folds that wait too."""
        await write_unwritten()
        if not unwritten:
            await learn_ended(settings.end_grace_s)

    @host.on_stopping
    async def learn_all_ended() -> None:
        """A service that stops learns what has ended rather than forget it."""
        await write_unwritten()
        await learn_ended(0.0)
        for signature, _ in unwritten:
            log.error("statistics of %s not written: the service stopped while the NATS server was away", signature)

    @host.on_shutdown
    async def stop_fitting() -> None:
        """Let the fitting thread go once nothing is left to fit."""
        fits.shutdown(wait=False, cancel_futures=True)

    def forget_silent(cutoff: float) -> None:
        """Forget the series of the runs not heard of since ``cutoff`` (``silent_forget_s``):
        one of a known task keeps its signature and the most it held, as after a move, so
        that if it reports again its run still teaches; one of no known task goes whole."""
        for task_id, model in list(models.items()):
            if not model.samples or model.heard_at >= cutoff or task_id in ending:
                continue  # waiting to start, or to be restored (no series held), or ended and learnt soon
            if not model.signature:
                del models[task_id]
                continue
            keep_newest(peak_before, task_id, max(peak_before.get(task_id, 0.0), model.peak_so_far_mb))
            quiet = TaskSeries(model.signature, expected_duration_s=model.expected_duration_s, only_trusted=True,
                               from_start=False, latest_at=model.latest_at)
            quiet.heard_at = model.heard_at
            models[task_id] = quiet

    @host.every(min(max(settings.silent_forget_s / 4, 0.05), 60.0))
    async def forget_silent_runs() -> None:
        """Forget the series of the runs gone silent (``forget_silent``)."""
        forget_silent(time.monotonic() - settings.silent_forget_s)

    # Runs in progress kept across a restart of this replica (``fleetpilot.fingerprint.checkpoint``):
    # per task whose checkpoint this replica wrote or restored, what its run was then
    # (``checkpoint_token``), so that a round writes only the runs that changed since and
    # deletes the keys of the runs that are no longer in progress here. ``resumed``: the tasks
    # whose run was restored at start, which ``recover_ended_runs`` learns from their series
    # when their end was taken by the replica before this one.
    written: dict[str, tuple] = {}
    resumed: set[str] = set()
    # When each was last written (monotonic): an unchanged one is written again before the
    # bucket's time-to-live takes it (a run stopped that waits hours for its restore).
    written_at: dict[str, float] = {}

    def in_progress(task_id: str, model: TaskSeries) -> bool:
        """Whether ``task_id``'s run is in progress here, to be checkpointed: a series held, or
        a run stopped (moved, evicted) that waits for its restore with no sample since, whose
        model holds nothing but beside it what it held before and when it stopped. Deleted as
        a run with no series, a restart while it waited lost them: it taught the peak of its
        restored process alone (a leak started over lower), and its restore went uncounted."""
        return bool(model.samples) or task_id in last_stop

    def checkpoint_token(task_id: str, model: TaskSeries) -> tuple:
        return (id(model), model.samples, model.latest_at, model.signature, model.expected_duration_s,
                peak_before.get(task_id), last_stop.get(task_id), last_start.get(task_id), stopped.get(task_id))

    def checkpoint(task_id: str, model: TaskSeries) -> SeriesCheckpoint:
        held = stopped.get(task_id)
        return checkpoint_of(task_id, model, now_wall=time.time(), now_monotonic=time.monotonic(),
                             peak_before_mb=peak_before.get(task_id, 0.0), last_stop=last_stop.get(task_id),
                             last_start=last_start.get(task_id), stopped=(held[1], held[2]) if held else None)

    async def checkpoint_runs() -> None:
        """Write the runs in progress that changed since their last checkpoint, and delete the
        checkpoints of the runs no longer in progress here (learnt, forgotten, rejected,
        dropped past the task cap). While the server is away (or the bucket is refused), the
        next round tries again: what it writes is each run as it is then."""
        try:
            kv = await host.bus.kv("fingerprint_series")  # type: ignore[union-attr]
            for task_id in [t for t in written if not (t in models and in_progress(t, models[t]))]:
                await kv.delete(node_key(task_id))
                written.pop(task_id, None)
                written_at.pop(task_id, None)
            for task_id, model in [(t, m) for t, m in models.items() if in_progress(t, m)]:
                token = checkpoint_token(task_id, model)
                fresh = time.monotonic() - written_at.get(task_id, -math.inf) < CHECKPOINT_REFRESH_S
                if (written.get(task_id) == token and fresh) or models.get(task_id) is not model or task_id in fitting:
                    continue  # unchanged, gone meanwhile, or being added to on the fitting thread (a
                    # copy now could be torn): the next round writes it
                whole = checkpoint(task_id, model)  # copies, taken here: the model goes on taking samples
                body = await off_loop(encode_checkpoint, whole)  # bounded (thinned) and encoded off the loop
                if models.get(task_id) is not model:
                    continue  # learnt or forgotten meanwhile: its key is deleted, not written again
                await kv.put(node_key(task_id), body)
                written[task_id] = token
                written_at[task_id] = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - the runs stay in memory; the next round writes them
            log.warning("runs in progress not checkpointed now (%s: %s)", type(exc).__name__, exc)

    async def drop_checkpoint(task_id: str) -> None:
        """Delete the checkpoint of ``task_id``'s run, which is over here (learnt); one left
        behind (the server away) goes with the bucket's time-to-live, and restored it would
        be learnt no second time (``learnt_runs``)."""
        resumed.discard(task_id)
        written_at.pop(task_id, None)
        if written.pop(task_id, None) is None:
            return
        try:
            await (await host.bus.kv("fingerprint_series")).delete(node_key(task_id))  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001
            log.warning("checkpoint of %s not deleted (%s: %s): it expires with the bucket's time-to-live",
                        task_id, type(exc).__name__, exc)

    if settings.checkpoint_s > 0:

        @host.every(settings.checkpoint_s)
        async def checkpoint_runs_in_progress() -> None:
            """Checkpoint the runs in progress (``checkpoint_runs``)."""
            await checkpoint_runs()

        @host.on_stopping
        async def checkpoint_at_stop() -> None:
            """A replica that stops writes its runs in progress as they are, after the runs that
            ended were learnt (their checkpoints deleted), for the replica that takes them on."""
            await checkpoint_runs()

        @host.on_startup
        async def restore_runs(bus) -> None:
            """Restore, before any sample is taken, the runs in progress of the tasks this
            replica owns from their checkpoints, as the replica before it left them: each goes
            on as one series that began with its run. A run not heard of for
            ``silent_forget_s`` is not (it would be forgotten at once) and its key is deleted.
            Run again whole after an outage cut it (a start-up hook), it restores the same."""
            try:
                kv = await bus.kv("fingerprint_series")
                found: list[tuple[str, SeriesCheckpoint]] = []
                for key in await kv.keys():
                    entry = await kv.get(key)
                    if entry is None or entry.value is None:
                        continue
                    try:
                        kept = decode_checkpoint(entry.value)
                    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                        log.warning("checkpoint %s unreadable (%s): not restored", key, exc)
                        continue
                    if node_key(kept.task_id) == key and owned.owns(kept.task_id):
                        found.append((key, kept))
            except Exception as exc:
                if bus.unreachable(exc) and not bus.connected:
                    raise  # the start-up waits for the server, and runs this again
                # Refused (a user without the bucket's rights gets no answer: a timeout while
                # connected), or unreadable: the replica starts all the same, as it did before
                # checkpoints, rather than wait out its start-up limit for what it may not read.
                log.error("runs in progress not restored (%s: %s): each starts a series afresh at its next "
                          "sample", type(exc).__name__, exc)
                return
            now_wall, now_mono = time.time(), time.monotonic()
            silent = 0
            # Least recently heard first, as ``models`` keeps them.
            for key, kept in sorted(found, key=lambda found: found[1].heard_wall):
                task_id = kept.task_id
                # A run stopped that waits for its restore reports nothing, and is not silent:
                # kept in memory for as long, it is restored however long it has waited.
                if kept.samples and now_wall - kept.heard_wall > settings.silent_forget_s:
                    silent += 1
                    with contextlib.suppress(Exception):
                        await kv.delete(key)
                    continue
                try:
                    model = restore(kept, now_wall=now_wall, now_monotonic=now_mono)
                except ValueError as exc:
                    log.warning("%s: not restored", exc)
                    continue
                models.pop(task_id, None)
                if len(models) >= settings.max_tracked_tasks:
                    models.popitem(last=False)
                models[task_id] = model
                for held, value in ((peak_before, kept.peak_before_mb or None), (last_stop, kept.last_stop),
                                    (last_start, kept.last_start)):
                    if value is not None:
                        keep_newest(held, task_id, value)
                if kept.stopped_mb is not None and kept.stopped_at is not None and model.signature:
                    keep_newest(stopped, task_id, (model.signature, kept.stopped_mb, kept.stopped_at))
                written[task_id] = checkpoint_token(task_id, model)
                written_at[task_id] = now_mono - max(now_wall - kept.written_wall, 0.0)
                resumed.add(task_id)
            log.info("restored %d runs in progress from their checkpoints (%d silent for over %.0f s dropped)",
                     len(resumed), silent, settings.silent_forget_s)

    @host.on_core("task.rejected", TaskRejected)
    async def on_rejected(rejection: TaskRejected) -> None:
        """Forget a task that will not run (rejected at submission, or given up by the policy):
        waiting, it would be held and told its signature's predictions until the task cap.
        A core subscription: the fingerprinter keeps no consumer of ``task.rejected``, and a
        rejection missed while it restarted concerns a task its restart forgot anyway."""
        task_id = rejection.task_id
        if not owned.owns(task_id):
            return
        keep_newest(rejected, task_id, max(rejection.rejected_at, rejected.get(task_id, -math.inf)))
        stop_waiting(task_id)
        model = models.get(task_id)
        if model is not None and model.samples:
            return  # it runs after all: its samples and its lifecycle tell the rest
        models.pop(task_id, None)
        for held in (stopped, peak_before, last_stop):
            held.pop(task_id, None)

    async def learn_end(life: TaskLifecycle) -> None:
        """Fold a run that ended into its signature's statistics."""
        model = models.pop(life.task_id, None)
        await drop_checkpoint(life.task_id)  # the run is over: no replica is to go on with it
        # Its end delivered again finds no model: what the first learnt of it stays.
        keep_newest(ended, life.task_id, (model.signature, model.expected_duration_s) if model
                    else ended.get(life.task_id, ("", None)))
        stopped.pop(life.task_id, None)
        last_stop.pop(life.task_id, None)
        before = peak_before.pop(life.task_id, 0.0)
        if model is None or not model.signature:
            return
        if life.state == "oom_killed":
            # It needed more than it held when it died, and at least what it held before a
            # move: restored lower (a leak started over), it may die below its earlier peak.
            held = max(model.peak_so_far_mb, before)
            if held <= 0:
                return
            # The policy starts it over (``oom_restarts``): waiting again, it is told what its
            # signature says once this kill is folded in, so its restart is judged by that
            # floor, not by the prediction it outgrew. Its next start, first sample or give-up
            # (``task.rejected``) ends the wait.
            now_waiting(life.task_id, model.signature, None)

            def fold_run(stats: SignatureStats) -> SignatureStats:
                return merge_oom(stats, held)
        else:
            if model.samples < 3:
                return
            # On every sample of the whole life, published or not, and to its real end when the
            # event's time says it: a level held to the end is the run's peak (``finish``).
            final = await off_loop(model.finish, ended_at=life.at)
            if final is None:
                return
            if life.state == "failed" and final.envelope_mb:
                # A run that failed partway held its last level to the end of its envelope:
                # that would teach that the program never steps past where it died.
                final = msgspec.structs.replace(final, envelope_mb=())
            # Only a completed run tells what its program needs: one that failed stopped short.
            peak = max(model.peak_so_far_mb, before) if life.state == "finished" else 0.0

            def fold_run(stats: SignatureStats) -> SignatureStats:
                merged = merge(stats, final)
                return merge_run_peak(merged, peak) if peak > 0 else merged
        key = run_key(life.task_id, life.at)

        def fold(stats: SignatureStats) -> SignatureStats:
            # Once per run, in the same compare-and-set write: its end may be learnt again by a
            # replica started again (``recover_ended_runs``), or by two owners in a rescale.
            return stats if learnt(stats, key) else mark_learnt(fold_run(stats), key)
        await fold_into(model.signature, fold)

    if not owned.whole:
        # What the other partitions' tasks show reaches this one's waiting tasks over the
        # bus: their runs in progress by the fingerprints published of them, their runs'
        # ends by the statistics they fold into the bucket.

        @host.on_core("task.fingerprinted", TaskFingerprinted)
        async def on_peer_fingerprint(event: TaskFingerprinted) -> None:
            """Keep what another partition's run in progress shows (``learn_live``)."""
            fp = event.fingerprint
            if event.source == "observed" and fp.signature and not owned.owns(event.task_id):
                await learn_live(fp.signature, fp, await stored(fp.signature))

        async def learnt_elsewhere(entry: KvEntry) -> None:
            """Tell this replica's waiting tasks of ``entry``'s signature what a run's end
            taught it, whichever replica learnt it (its own fold told them already, and
            ``prediction_changed`` tells nobody twice)."""
            if entry.key in waiting_of or entry.key in live:  # the watch starts with every signature
                await statistics_changed(entry.key, stored_stats(entry.key, entry.value))

        async def follow_statistics() -> None:
            """Watch the ``fingerprints`` bucket (kept running by ``host.background``)."""
            kv = await host.bus.kv("fingerprints")  # type: ignore[union-attr]
            async for entry in kv.watch():
                await learnt_elsewhere(entry)

        @host.on_startup
        async def watch_statistics(_bus: object) -> None:
            """Start the bucket's watch once the bus is up."""
            host.background(follow_statistics, "fingerprints-watch")

    async def recover_signatures() -> None:
        """Read the submissions of the last ``recover_s`` again (``recovered``), and give the
        runs already heard of without a signature theirs; then rest until the service stops
        (``host.background`` would start a job that ends again)."""
        if not recovery["done"]:
            since = now() - settings.recover_s
            read = 0
            async for message in host.bus.stream_messages(  # type: ignore[union-attr]
                    STREAM_OF_SUBMISSIONS, "task.submitted", since=since):
                try:
                    task = decode(message.data, TaskSubmitted)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue  # dead-lettered by the consumer when it was first read
                if not owned.owns(task.task_id) or task.task_id in ended:
                    continue
                read += 1
                keep_newest(recovered, task.task_id, (task_signature(task), task.expected_duration_s))
                model = models.get(task.task_id)
                if model is not None and not model.signature:
                    model.signature, model.expected_duration_s = recovered[task.task_id]
                await asyncio.sleep(0)  # a long read must not hold up the samples
            log.info("read the signatures of %d tasks submitted in the last %.0f s", read, settings.recover_s)
            await recover_ended_runs()
            recovery["done"] = True
        await asyncio.Event().wait()

    async def recover_ended_runs() -> None:
        """Learn the runs that ended in the last ``SAMPLES_KEPT_S`` and that no replica learnt
        (the signature's ``learnt_runs`` says), their series read again from the samples the
        server keeps. A replica that stops at the end of a run's grace, or crashes within it,
        had taken (acked) its end and held its series in memory alone: started again, it read
        neither again, and the run was never learnt. Such a run is learnt on the series restored
        from its checkpoint (``restore_runs``), topped up with the samples the server kept since;
        without one, as a series that did not begin with it (no envelope): the server keeps its
        last minutes of samples."""
        latest: dict[str, tuple[TaskLifecycle, float]] = {}  # task -> its latest event, when stored
        async for message in host.bus.stream_messages(  # type: ignore[union-attr]
                STREAM_OF_LIFECYCLE, "task.lifecycle.>", since=now() - SAMPLES_KEPT_S):
            try:
                life = decode(message.data, TaskLifecycle)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # dead-lettered by the consumer when it was first read
            if owned.owns(life.task_id):
                latest[life.task_id] = (life, message.at)
            await asyncio.sleep(0)
        learnt_here = 0
        for task_id, (life, stored_at) in latest.items():
            signature, duration = recovered.get(task_id, ("", None))
            model = models.get(task_id)
            # Its run restored from its checkpoint (``restore_runs``): learnt on that series, which
            # began with the run, topped up with the samples the server kept since it was written.
            goes_on = (task_id in resumed and model is not None and model.samples > 0
                       and life.at >= last_start.get(task_id, -math.inf))
            if goes_on and model is not None:
                signature = signature or model.signature
            if (life.state not in TERMINAL_STATES or not signature or ended.get(task_id, ("",))[0]
                    or (model is not None and model.samples and not goes_on)):
                continue  # not over, of no known program, or learnt (or being learnt) by this replica
            stats = await stored(signature)
            if stats is not None and learnt(stats, run_key(task_id, life.at)):
                continue
            series = model if goes_on and model is not None else TaskSeries(
                signature, expected_duration_s=duration, only_trusted=True, from_start=False)
            if not series.signature:
                series.signature = signature
            async for message in host.bus.stream_messages(  # type: ignore[union-attr]
                    STREAM_OF_SAMPLES, f"telemetry.task.{task_id}", since=now() - SAMPLES_KEPT_S):
                try:
                    sample = decode(message.data, TaskTelemetry)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                # As when taken live: a sample stored after the end and stamped after it belongs to nothing.
                after_end = message.at > stored_at and sample.at > life.at
                if refusal(sample) is None and series.latest_at < sample.at and not after_end:
                    series.latest_at = sample.at
                    reading = (sample.at, sample.memory_used_mb / max(len(sample.gpus), 1))
                    await add_sample(task_id, series, *reading, sample.utilization_gpu_pct)
            if ended.get(task_id, ("",))[0] or (task_id in models and models[task_id].samples
                                                 and models[task_id] is not series):
                continue  # learnt by this replica meanwhile
            models[task_id] = series
            learnt_here += 1
            if task_id not in ending:  # else its end, delivered again meanwhile, learns this series
                await learn_end(life)
        log.info("%d runs that ended in the last %.0f s read again to be learnt", learnt_here, SAMPLES_KEPT_S)

    recovery = {"done": settings.recover_s <= 0, "started": False}

    @host.on_startup
    async def start_recovery(_bus: object) -> None:
        """Read the earlier submissions in the background, once the bus is up (once: a
        start-up run again after an outage finds the job running, and it reads again itself
        if the outage cut its read)."""
        if not recovery["done"] and not recovery["started"]:
            recovery["started"] = True
            host.background(recover_signatures, "signature-recovery")

    return host


def main() -> None:
    """Console entry point ``fleetpilot-fingerprinter``."""
    serve("fingerprinter", build)

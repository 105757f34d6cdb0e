"""Fleetpilot's memory loop in the fleet benchmark: fingerprints learnt and told, rebalancing
(moves up, resizes, checkpoints), and maintenance."""

from __future__ import annotations

import math
from collections import deque

import msgspec
import numpy as np

from fleetpilot.contracts import Fingerprint
from fleetpilot.fingerprint import (
    TRUST_SAMPLES,
    borrowed,
    changed_materially,
    keep_signature_knowledge,
    prediction_changed,
    predicts_nothing,
    restore_tells,
    restores_start_over,
    trusted,
    within_its_programs_runs,
)
from fleetpilot.fleet.simulator import CONTEXT_MB
from fleetpilot.policy.backfill import Move, hidden
from fleetpilot.policy.rebalance import (
    GROWTH_LOOKAHEAD_S,
    OVERFLOW_FILL,
    bridge_watches,
    envelope_level_mb,
    measured_rate_mb_per_s,
    resize_target_mb,
)
from fleetpilot.policy.restores import bridge_floor_mb
from fleetpilot.workload.growth import MemoryGrowth

from .fleet_job import HEALTH_WINDOW, MIGRATION_BASE_S, MIGRATION_S_PER_GB, Job


class FleetMemory:
    """What Fleetpilot learns of each program's memory and how it acts on it: fingerprints,
    rebalancing and the health model (``FleetRun`` mixes it in and holds the state it reads)."""

    def _remember(self, job: Job, now: float) -> None:
        """Fold a completed run's fingerprint into the signature memory. The run is over, so
        its length is known: the fit is told the real duration instead of the declared one
        (no extrapolation past the end). Killed runs are not remembered: their series stops
        before the peak (an OOM teaches a floor instead, ``_learn_from_oom``)."""
        fp = job.fingerprinter
        if fp is None or fp.samples < 6:
            return
        envelope = fp.envelope(job.task.declared_duration_s)
        fp.expected_duration_s = max(now - job.seg_start - job.seg_pause, 1.0)
        fp.refit()
        if fp.current is not None and fp.current.samples > 0:
            self.memory.observe(msgspec.structs.replace(fp.current, envelope_mb=envelope))
            self.learnt.add(job.signature)

    def _learn_from_oom(self, job: Job, held_mb: float) -> None:
        """A task killed while alone on its GPUs needed more than the GPU: a floor for its
        signature, known even when the run was too short to fingerprint."""
        if not self.smart:
            return
        alone = all(self.on_gpu.get((job.row, g), set()) <= {job.task.task_id} for g in job.gpus)
        if alone:
            total = float(self.state.gpu_mem_total[job.row, job.gpus[0]])
            floor = max(total, held_mb + CONTEXT_MB) * 1.05
            self.memory.observe_oom(job.signature, floor)
            self.learnt.add(job.signature)
            job.died_alone = True

    def _predict(self, signature: str) -> Fingerprint | None:
        """What a task of ``signature`` should expect: what its ended runs taught, else the
        trusted fingerprint of a run of it still in progress (``_lent``)."""
        return self.memory.predict(signature) or self._lent(signature)

    def _lent(self, signature: str) -> Fingerprint | None:
        """What a run of ``signature`` in progress shows (``_learn_live``), as its other tasks
        are given it."""
        live = self.live.get(signature)
        return borrowed(live) if live is not None else None

    def _learn_live(self, signature: str, current: Fingerprint) -> None:
        """Keep ``current``, a trusted fingerprint of a run in progress, for the tasks of its
        signature while its statistics predict nothing (no run of it has ended), when it
        changed materially and no run seen longer is kept; its waiting tasks are told
        (``_tell_waiting``), as the fingerprinter service keeps and tells it."""
        known = self.live.get(signature)
        if known is not None and (current.samples < known.samples or not changed_materially(known, current)):
            return
        if not predicts_nothing(self.memory.stats(signature)):
            self.live.pop(signature, None)
            return
        self.live[signature] = current
        self.learnt.add(signature)

    def _tell_waiting(self) -> None:
        """Give each task still waiting for its first start its signature's new prediction,
        when what the runs that ended this cycle taught changes it (``prediction_changed``),
        as the fingerprinter service tells its waiting tasks."""
        if not self.learnt:
            return  # most cycles: no run ended, so no waiting task has anything new to learn
        learnt, self.learnt = self.learnt, set()
        fresh: dict[str, Fingerprint | None] = {}
        for job in self.pending:
            if job.attempts or job.signature not in learnt:
                continue
            if job.signature not in fresh:
                fresh[job.signature] = self._predict(job.signature)
            if prediction_changed(job.prediction, fresh[job.signature]):
                job.prediction = fresh[job.signature]

    def _observe_tasks(self, now: float) -> None:
        # Sorted: the order samples are read in decides the order of moves, and a run must
        # not depend on Python's string hashing.
        watched_nodes = sorted({self.state.node_names[j.row] for j in self.jobs
                                if j.state == "running" and j.fingerprinter is not None})
        changed: dict[str, float] = {}
        bridging: list[Job] = []
        for node in watched_nodes:
            for s in self.sim.task_samples(node):
                job = self.by_id.get(s.task_id)
                if job is None or job.fingerprinter is None or job.state != "running":
                    continue
                online = job.fingerprinter
                held = s.memory_used_mb / max(len(s.gpus), 1)
                self._keep_usage(job, s.at, held)
                fresh = online.add(s.at, held)
                if job.bridged and job.history is not None and self._by_rate(job):
                    job.history.append((s.at, held))
                    if self._outgrowing(job):
                        bridging.append(job)
                        continue
                current = online.current
                # A handful of samples in a warm-up reads as a steep line: act on the online
                # fingerprint only once it is ``trusted`` (samples and a clear pattern).
                if current is None or not trusted(current):
                    continue
                if fresh is not None or job.prediction is None or job.prediction.samples < TRUST_SAMPLES:
                    # As the fingerprinter service publishes it: a step fit held to its program's runs.
                    own = within_its_programs_runs(current, self.memory.stats(job.signature), held)
                    job.prediction = keep_signature_knowledge(own, job.prediction)
                    changed[job.task.task_id] = s.memory_used_mb / max(len(s.gpus), 1)
                self._learn_live(job.signature, current)
        bridging.extend(j for j in self._enveloped(now) if j not in bridging)
        for job in bridging:
            # Past the rounds' budget, a bridge still outgrowing is seen again next cycle.
            if job.state == "running" and self.decisions_left > 0 and not self._migrate(job, now, reason="bridge"):
                self._checkpoint(job, now, outgrown=True)
        # As the service's rebalance round looks at every run each round: a hold that could not
        # grow when its fingerprint changed grows once a neighbour's leaving gives it the room.
        for job in self.jobs:
            self._reserve_again(job)  # a job not running is left
        # As the service's rebalance round checks every run each round: a climb held back
        # last cycle is looked at again whether or not its fingerprint changed.
        looked_at = [*changed.items(), *((t, self.usage[t][-1][1]) for t in sorted(self.climbing - changed.keys()))]
        self.climbing.clear()
        for task_id, held in looked_at:
            job = self.by_id[task_id]
            if job.state == "running" and not job.bridged and self._heading_for_oom(job, held):
                if self._climbs_within_its_gpu(job) or self.decisions_left <= 0:
                    self.climbing.add(task_id)  # looked at again next cycle
                    continue
                self._rebalance(job, now)

    def _keep_usage(self, job: Job, at: float, held_mb: float) -> None:
        """Keep a running task's memory sample (per GPU), and only those of the last
        ``GROWTH_LOOKAHEAD_S``, as the policy service keeps them (``Replica.observe``)."""
        kept = self.usage.setdefault(job.task.task_id, deque())
        kept.append((at, held_mb))
        while kept[0][0] < at - GROWTH_LOOKAHEAD_S:
            kept.popleft()

    def _climbs_within_its_gpu(self, job: Job) -> bool:
        """A run whose fingerprint names a steady climb stays where it is, though its predicted
        peak would not fit there, while its measured rate carried ``GROWTH_LOOKAHEAD_S`` ahead
        still fits its room (the policy service's ``rebalance.climbs_within_its_gpu``): a line
        fitted to a long run's first minutes cannot tell a warm-up ramp from a climb."""
        kept = self.usage.get(job.task.task_id, ())
        rate = measured_rate_mb_per_s(kept)
        if job.prediction is None or job.prediction.pattern != "linear" or rate is None:
            return False
        return kept[-1][1] + rate * GROWTH_LOOKAHEAD_S <= OVERFLOW_FILL * self._room_in_place(job)

    def _enveloped(self, now: float) -> list[Job]:
        """Runs bridged by their envelope (``_envelope_ask``) that it, read
        ``GROWTH_LOOKAHEAD_S`` ahead of their progress, says will outgrow their GPUs (what the
        other tenants hold now, as NVML reports it, plus what the run will hold then)."""
        out = []
        g = self.sim.gpu
        for task_id in sorted(self.bridged_ids):
            job = self.by_id[task_id]
            if job.state != "running" or not job.bridged:
                self.bridged_ids.discard(task_id)  # moved up, stopped or ended: no longer bridged
                continue
            p = job.prediction
            if p is None or not self._by_envelope(job):
                continue
            # Its progress as the policy service reads it: the time since its run began.
            ahead = envelope_level_mb(p, now - job.run_at + GROWTH_LOOKAHEAD_S, job.task.declared_duration_s)
            glob = self.offset[job.row] + np.asarray(job.gpus)
            own = self._held(job, now) + CONTEXT_MB
            if bool(np.any(g.memory_used_mb[glob] - own + ahead > OVERFLOW_FILL * g.memory_total_mb[glob])):
                out.append(job)
        return out

    def _by_envelope(self, job: Job) -> bool:
        """Whether the running job's bridge is watched by its signature's envelope: a run from
        its start of a program with one, whatever pattern its fingerprint names (a schedule of
        a few steps can be voted a line; ``rebalance.bridge_watches``)."""
        return bridge_watches(job.prediction, job.from_start)[0]

    def _by_rate(self, job: Job) -> bool:
        """Whether the running job's bridge is watched by its measured rate (``bridge_watches``)."""
        return bridge_watches(job.prediction, job.from_start)[1]

    def _outgrowing(self, job: Job) -> bool:
        """A bridged task whose recent growth, carried on for ``GROWTH_LOOKAHEAD_S``, would
        overflow its GPU (what the GPU holds now, as NVML reports it, plus that growth)."""
        h = job.history
        if h is None or len(h) < 2:
            return False
        slope = measured_rate_mb_per_s(h) or 0.0
        glob = self.offset[job.row] + np.asarray(job.gpus)
        g = self.sim.gpu
        return bool(np.any(g.memory_used_mb[glob] + slope * GROWTH_LOOKAHEAD_S
                           > OVERFLOW_FILL * g.memory_total_mb[glob]))

    def _reserve_again(self, job: Job) -> None:
        """Grow the job's ledger hold as the policy service's rebalance round resizes it: to the
        top of its new predicted peak's interval plus a margin, when that peak passes the hold
        with probability ``OOM_MIGRATE_RISK`` or more (``rebalance.resize_target_mb``) and every
        GPU of the job has that much free (``resize_plan``); never down, and not on a GPU going
        out of service. Where it cannot grow, the predicted-OOM check decides (a move, or the
        run stays), and the next cycle tries again. Not the hold of a job stopped this cycle
        (moved up or checkpointed off its bridge): its holds went back with the stop."""
        if self.knows_peaks or job.state != "running" or any(self.excluded[self.offset[job.row] + g] for g in job.gpus):
            return  # told its true peak, a run holds it from its start
        target = resize_target_mb(job.prediction, job.reserved_mb)
        idx = np.asarray(job.gpus)
        if (target is None or self.decisions_left <= 0
                or int(self.state.gpu_mem_free[job.row, idx].min()) < target - job.reserved_mb):
            return
        self.state.gpu_mem_free[job.row, idx] -= target - job.reserved_mb
        self.state.version[job.row] += 1
        job.reserved_mb = target
        self.decisions_left -= 1

    def _heading_for_oom(self, job: Job, held_mb: float) -> bool:
        """True when what the job's GPUs hold now (as NVML reports it) plus the growth still
        ahead of the job (its predicted peak minus what it holds) exceeds one of them.

        Neighbours are taken at their current use: a growing neighbour is judged when its
        own fingerprint moves, and one placed with a known signature was placed by its
        predicted peak. Summing every tenant's peak instead would move tasks whose peaks
        never coincide."""
        if job.prediction is None:
            return False
        ahead = max(job.prediction.predicted_peak_mb * 1.02 - held_mb, 0.0)
        glob = self.offset[job.row] + np.asarray(job.gpus)
        g = self.sim.gpu
        return bool(np.any(g.memory_used_mb[glob] + ahead > g.memory_total_mb[glob]))

    def _rebalance(self, job: Job, now: float) -> None:
        # Move whoever on the GPU outgrew its plan the most: that is the allocation that fails.
        tenants = {tid for g in job.gpus for tid in self.on_gpu.get((job.row, g), set())}
        # One that cannot resume is not moved for memory: it would lose its run for sure, where
        # the OOM takes it only if it comes (the policy service's ``rebalance_round``).
        movable = (j for j in map(self.by_id.__getitem__, tenants) if j.task.resumable)
        victims = sorted(movable, key=lambda j: (j.planned_mb - j.reserved_mb, j.seq))
        for victim in victims[:1]:
            # Queued again, a run that has the most room any GPU it accepts gives would come
            # back to no more: it runs on (the policy service's ``checkpoint``).
            if not self._migrate(victim, now, reason="oom") and \
                    self._room_in_place(victim) < self._largest(victim.task.gpu_models):
                self._checkpoint(victim, now, outgrown=True)

    def _room_in_place(self, job: Job) -> float:
        """The memory ``job`` can have on its GPUs: the smallest of them less what the other
        tasks on it hold (``rebalance.room_in_place``)."""
        return min(float(self.state.gpu_mem_total[job.row, g])
                   - sum(self.by_id[t].reserved_mb for t in self.on_gpu.get((job.row, g), set()) if t != job.task.task_id)
                   for g in job.gpus)

    def _migrate(self, job: Job, now: float, *, reason: str, target: Move | None = None,
                 bridge: bool = False) -> bool:
        """Move a running job to ``target``, else to wherever the policy places it now (never
        onto GPUs reserved for a task it would delay); False if nowhere else. ``bridge``: it
        holds less than its peak there (moved down), watched as a bridge."""
        t = job.task
        self._stop(job)
        if target is not None:
            row, gpus, milli, found = target.row, list(target.gpus), target.milli, True
        else:
            held = self.reservation
            ends_in = max(self._expected_end(job) - now, 0.0)
            with hidden(self.state, held if held is not None and held.delayed_by(t.task_id, ends_in, now) else None):
                decision = self.policy.decide(self.state, self._request(job))
            row, gpus = decision.node_row, [p.gpu for p in decision.placement if p.gpu >= 0]
            found = decision.action == "assign" and bool(decision.placement)
            milli = decision.placement[0].milli if found else 0
        if not found or (row == job.row and sorted(gpus) == sorted(job.gpus)):
            self.state.allocate(job.row, job.gpus, job.milli, cpu_milli=t.cpu_milli, memory_mb=t.memory_mb,
                                gpu_memory_mb=job.reserved_mb)
            for g in job.gpus:
                self.on_gpu.setdefault((job.row, g), set()).add(t.task_id)
            self.counts["migrations_no_target"] += 1
            return False
        growth, pause = self._resumed(job, now)
        # The task's work stalls for its checkpoint and restore as it would waiting: the user
        # sees the same delay, so it counts as queue time.
        job.queue_s += pause
        job.bridged = bridge
        if bridge:
            self.bridged_ids.add(t.task_id)
        job.history = None
        self._take_off(job)
        # The restored task replays its curve: a series spanning the move would mislead the fit.
        job.fingerprinter = None
        job.migrations += 1
        self.counts["migrations_" + reason] += 1
        self.decisions_left -= 1
        self._start(job, row, gpus, milli, now, growth=growth, pause=pause)
        if not t.resumable:
            # Its run begins again there (the policy service's target holds say so).
            job.from_start, job.run_at = True, now
        return True

    def _pause(self, job: Job, now: float) -> float:
        """Seconds a checkpoint and restore of ``job`` would take now (``_resumed``)."""
        return MIGRATION_BASE_S + MIGRATION_S_PER_GB * self._held(job, now) / 1024.0

    def _held(self, job: Job, now: float) -> float:
        """GPU memory per GPU a running job holds now (its CUDA context aside), as NVML reads it."""
        return float((job.curve or job.task.growth).memory_at(now - job.seg_start))

    def _resumed(self, job: Job, now: float) -> tuple[MemoryGrowth, float]:
        """The memory curve and pause of a task restored from a checkpoint taken now.

        Restored, the task plays what is left of its memory curve (``MemoryGrowth.restored``):
        a step schedule comes back at the level it reached, other growth starts over with the
        process; the true peak is the same, so a move never makes a task look smaller. The
        pause is the checkpoint and restore time (``MIGRATION_BASE_S`` plus
        ``MIGRATION_S_PER_GB`` per GB held). A task that cannot resume starts over: its whole
        curve, after a pause as long (its stop and its start, loading what it loads).
        """
        t = job.task
        pause = self._pause(job, now)
        if not t.resumable:
            job.progress_s = 0.0
            return msgspec.structs.replace(t.growth, duration_s=t.duration_s + pause), pause
        job.progress_s = job.useful_until(now)
        remaining = max(t.duration_s - job.progress_s, 1.0)
        return t.growth.restored(job.progress_s, remaining + pause), pause

    def _checkpoint(self, job: Job, now: float, *, outgrown: bool = False, by_round: bool = True) -> None:
        """No GPU can take the task's predicted peak now: checkpoint it and queue it again
        (progress kept) rather than let it run into the OOM that would lose everything.

        Restored, it may come back with what it holds now (a step schedule does): until it
        starts again, it asks no less (``stopped_at_mb``, as NVML read it). Stopped because it
        was outgrowing its GPUs, it is bridged again only onto GPUs with more than they have
        (``bridge_floor_mb``): on no more room it would be stopped again at once, or, a step
        away from the end, die of OOM. A signature whose restores have come back low
        (``restores_start_over``), as a leak's do, needs neither, though a run of it that
        outgrew its GPUs sooner than ``GROWTH_LOOKAHEAD_S`` after being placed there is still bridged
        only onto more room. ``by_round``: a rebalance round's decision, drawn on
        ``decisions_left`` (a vip's eviction is the queue round's)."""
        self._stop(job)
        held = self._held(job, now)
        started = float((job.curve or job.task.growth).memory_at(0.0))  # what NVML showed as it started
        job.restored_from = held if restore_tells(started, held) else None
        stats = self.memory.stats(job.signature)
        if not restores_start_over(stats):
            job.stopped_at_mb = int(math.ceil(held + CONTEXT_MB))
        if outgrown:
            gpus_mb = float(self.state.gpu_mem_total[job.row, np.asarray(job.gpus)].min())
            job.bridge_floor_mb = bridge_floor_mb(stats, gpus_mb, now - job.seg_start, GROWTH_LOOKAHEAD_S)
        job.resume = self._resumed(job, now)
        job.bridged = False
        job.history = None
        self._take_off(job)
        job.fingerprinter = None
        self.counts["checkpointed"] += 1
        if by_round:
            self.decisions_left -= 1
        self._enqueue(job, now)

    def _watch_health(self, now: float) -> None:
        g = self.sim.gpu
        signal = ((g.ecc_corrected > 0) | (g.remapped_rows > 0) | (g.retired_pages > 0) | (g.pcie_replays > 0)
                  | (g.xid_count > 0) | (g.pcie_link_width < g.pcie_link_width_max) | (g.temperature_c > 85.0))
        suspects = [int(i) for i in np.flatnonzero(signal & ~self.excluded)]
        for gi in suspects:
            # A GPU with no hardware signal scores the model's bias alone: only suspects are sampled.
            row, local = self._gpu_slot(gi)
            sample = self.sim.sample(self.state.node_names[row])[local]
            window = self.windows.setdefault(gi, deque(maxlen=HEALTH_WINDOW))
            window.append(sample)
            if len(window) < 3:
                continue
            a = self.health.assess(list(window))
            if a.maintenance_pending and gi not in self.pending_maintenance:
                self.pending_maintenance[gi] = now
                self.excluded[gi] = True
                self.state.set_condition(row, [local], maintenance=True)
                for task_id in sorted(self.on_gpu.get((row, local), set())):
                    job = self.by_id[task_id]
                    if not self._migrate(job, now, reason="maintenance"):
                        self._checkpoint(job, now)

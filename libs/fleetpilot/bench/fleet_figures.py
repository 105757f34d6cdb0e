"""What one mode of the fleet benchmark measured: its figures, queue splits and the learner's
examples."""

from __future__ import annotations

import math

import numpy as np

from fleetpilot.contracts import DecisionMade, Placement, PolicyRef
from fleetpilot.fleet.simulator import CONTEXT_MB
from fleetpilot.learner import Example

from .fleet_job import STUCK_S, Job
from .fleet_report import RunResult


class FleetFigures:
    """The figures of a finished run (``RunResult``) and what the learner would learn from it
    (``FleetRun`` mixes it in and holds the state it reads)."""

    def _result(self, now: float, times: list[float], utils: list[float], queue: list[int], wall: float) -> RunResult:
        w = self.workload
        missed = stuck = never = 0
        useful_h = 0.0
        self.waits_by_task.clear()
        for j in self.jobs:
            wait = j.queue_s + (now - j.queued_since if j.state == "pending" else 0.0)
            self.waits_by_task[j.task.task_id] = wait
            if j.state == "pending" and j.attempts == 0:
                never += 1
            stuck += wait > STUCK_S
            late = j.task.deadline_s is not None and (
                (j.finished_at is not None and j.finished_at > j.task.deadline_s)
                or (j.finished_at is None and now > j.task.deadline_s))
            missed += j.state in ("failed", "rejected") or wait > j.task.max_queue_s or late
            useful_h += j.task.gpu_work * j.useful_until(now) / 3600.0
        in_window = np.asarray(times) <= w.span_s / 3600.0
        util = np.asarray(utils)
        cost = self.price_per_h * now / 3600.0
        c = self.counts
        interventions = c["oom_restarts"] + c["backoff_failed"] + stuck + c["gpu_failure_kills"]
        utilisation = float(util[in_window].mean()) if in_window.any() else 0.0
        killed = self._killed_share(np.asarray(times) * 3600.0, in_window)
        figures = {
            "utilisation": utilisation,
            "useful_utilisation": utilisation - killed,
            **self.queue_figures(left_out=self.rejected_ids()),
            "oom_events": float(c["oom_events"]),
            "sla_missed": float(missed),
            "cost_per_useful_gpu_hour": cost / useful_h if useful_h > 0 else math.inf,
            "interventions": float(interventions),
        }
        seen, lead = self._maintenance_leads()
        predicted, observed, brier, judged, _, _ = self._judged()
        breakdown = {
            "utilisation_whole_run": float(util.mean()) if util.size else 0.0,
            "utilisation_of_killed_runs": killed,
            "useful_gpu_hours": useful_h,
            "fleet_cost_usd": cost,
            "completed": float(sum(j.state == "done" for j in self.jobs)),
            "never_started": float(never),
            "stuck_over_1h": float(stuck),
            "max_queue_length": float(max(queue, default=0)),
            "failures_seen_coming": float(seen),
            "failures": float(len(self.failed_gpus)),
            "median_warning_h": lead,
            "false_alarms": float(self._false_alarms()),
            "confidence_predicted": predicted,
            "confidence_observed": observed,
            "confidence_brier": brier,
            "confidence_judged": float(judged),
            **{k: float(v) for k, v in c.items()},
        }
        return RunResult(mode=self.mode, figures=figures, breakdown=breakdown, times_h=times, utilisation=utils,
                         queue_length=queue, wall_s=wall)

    def rejected_ids(self) -> frozenset[str]:
        """The tasks this run's negotiator rejected (none under ``k8s-default``)."""
        return frozenset(j.task.task_id for j in self.jobs if j.state == "rejected")

    def queue_figures(self, left_out: frozenset[str] = frozenset()) -> dict[str, float]:
        """Mean and p95 queue time of the finished run over its tasks but ``left_out``.

        A rejected task waited nothing: counted, it would lower the mean of the run that
        rejected it, and its wait in the other run would raise that one's. Both runs' figures
        leave out the tasks either rejected, so that they compare the same tasks."""
        waits = np.asarray([w for t, w in self.waits_by_task.items() if t not in left_out])
        if waits.size == 0:
            return {"mean_queue_s": 0.0, "p95_queue_s": 0.0}
        return {"mean_queue_s": float(waits.mean()), "p95_queue_s": float(np.percentile(waits, 95))}

    def queue_split(self, only_largest: frozenset[str], left_out: frozenset[str] = frozenset()) -> dict[str, float]:
        """The mean queue of the runs only the fleet's largest GPUs can hold (``only_largest``,
        from ``fleet_workload.only_largest_hold``) apart from the rest's, and how many of the
        former completed, over the tasks but ``left_out``. Where those GPUs are loaded past
        what they give, a run that holds such work back until one is free queues it, and one
        that starts it on smaller GPUs, where it is killed at its peak, does not."""
        tasks = frozenset(self.waits_by_task)
        largest = self.queue_figures(left_out=left_out | (tasks - only_largest))
        rest = self.queue_figures(left_out=left_out | only_largest)
        done = sum(j.state == "done" for j in self.jobs
                   if j.task.task_id in only_largest and j.task.task_id not in left_out)
        return {"mean_queue_s_only_largest": largest["mean_queue_s"], "mean_queue_s_rest": rest["mean_queue_s"],
                "completed_only_largest": float(done)}

    def _judged(self) -> tuple[float, float, float, int, float, float]:
        """How honest the confidence of first placements was so far: its mean, the share of
        those placements that met their goal (the task ran to completion without being
        killed), the Brier score, how many were judged (a task still running is not), and
        the two totals the feedback store would hold (sum of confidences, goals met)."""
        pairs = [(j.confidence, j.state == "done" and j.attempts == 1) for j in self.jobs
                 if j.confidence is not None and (j.state in ("done", "failed") or j.attempts > 1)]
        if not pairs:
            return 0.0, 0.0, 0.0, 0, 0.0, 0.0
        conf = np.array([p for p, _ in pairs])
        met = np.array([float(ok) for _, ok in pairs])
        return (float(conf.mean()), float(met.mean()), float(((conf - met) ** 2).mean()), len(pairs),
                float(conf.sum()), float(met.sum()))

    def _first_placement(self, job: Job, row: int, gpus: list[int], milli: int, reserve_mb: int,
                         now: float) -> None:
        """Keep a task's first placement as a ``decision.made`` (its hold: what the loop
        reserved, or the whole GPU the device plugin gives)."""
        node = self.state.node_names[row]
        model = int(self.state.node_model[row])
        self.first_placements[job.task.task_id] = (DecisionMade(
            decision_id=f"{job.task.task_id}.assign", task_id=job.task.task_id, action="assign",
            placement=[Placement(node=node, gpu=g, milli=milli,
                                 memory_mb=reserve_mb or int(self.state.gpu_mem_total[row, g])) for g in gpus],
            confidence=job.confidence if job.confidence is not None else 0.5, policy=PolicyRef(name=self.mode),
            decided_at=now, task=job.submitted), self.state.models[model] if model >= 0 else "")

    def outcome_examples(self) -> list[Example]:
        """The judged first placements (as ``_judged`` judges them) as the learner's examples,
        each recorded when it was decided, every record fully trusted (the loop measures exactly)."""
        out = []
        for j in self.jobs:
            placed = self.first_placements.get(j.task.task_id)
            if placed is None or not (j.state in ("done", "failed") or j.attempts > 1):
                continue
            decision, model = placed
            out.append(Example(decision, model, j.state == "done" and j.attempts == 1, 1.0, decision.decided_at))
        return out

    def _killed_share(self, times_s: np.ndarray, in_window: np.ndarray) -> float:
        """The part of the window's utilisation held by runs that were later killed (OOM or a
        failed GPU): memory used, but by work thrown away."""
        denominators = np.asarray(self.denominators)[in_window]
        if denominators.size == 0:
            return 0.0
        ticks = times_s[in_window]
        held = 0.0
        for start, end, curve, gpus in self.killed_runs:
            alive = ticks[(ticks > start) & (ticks <= end)]
            if alive.size:
                held += gpus * float((curve.memory_at(alive - start) + CONTEXT_MB).sum())
        return held / float(denominators.sum())

    def _maintenance_leads(self) -> tuple[int, float]:
        """Failed GPUs flagged ``maintenance_pending`` before they failed, and the median warning
        (h)."""
        leads = [(self.failed_gpus[gi] - at) / 3600.0 for gi, at in self.pending_maintenance.items()
                 if gi in self.failed_gpus and at < self.failed_gpus[gi]]
        return len(leads), float(np.median(leads)) if leads else 0.0

    def _false_alarms(self) -> int:
        """GPUs flagged ``maintenance_pending`` that the workload never made fail: healthy GPUs
        taken out of service (they also leave the utilisation's denominator, so each one
        flatters it). A GPU planned to fail after the run ends is a warning, not an alarm."""
        planned = {(f.node, f.gpu) for f in self.workload.faults}
        flagged = {(self.state.node_names[row], local) for row, local in map(self._gpu_slot, self.pending_maintenance)}
        return len(flagged - planned)

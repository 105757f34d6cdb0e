"""What the fleet benchmark shows: one mode's figures (``RunResult``), both modes side by
side on one workload (``Comparison``: ratios, target verdicts, ``--json``), the printed table
(``report``) and the PNG plots of utilisation and queue length over time (``plot``).

Kept apart from the run itself (``fleet_run.FleetRun``) so that what is measured and how it is
shown can be read, and changed, one without the other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .fleet_workload import LargestGpuLoad
from .outputs import describe_environment

TARGETS = {"utilisation": 1.75, "mean_queue_s": 0.20, "oom_events": 0.10}
"""Targets as ratios Fleetpilot / baseline: at least +75%, at most -80%, at most -90%."""


@dataclass
class RunResult:
    """What one mode measured (figures, time series, counters)."""

    mode: str
    figures: dict[str, float]
    breakdown: dict[str, float]
    times_h: list[float]
    utilisation: list[float]
    queue_length: list[int]
    wall_s: float


@dataclass
class Comparison:
    """Both runs on one workload."""

    fleet: str
    seed: int
    workload: str
    baseline: RunResult
    fleetpilot: RunResult
    span_h: float = 0.0
    sharing_bound: float = 1.0
    sm_use_bound: float = 1.0
    largest_load: LargestGpuLoad | None = None
    peaks_known: RunResult | None = None  # Fleetpilot told each run's true peak (``--peaks-known``)
    code: str = ""  # the digest of the code that ran (``outputs.code_digest``)
    environment: dict[str, str] = field(default_factory=dict)  # ``outputs.run_environment``
    queue_aging: float = 1.0  # Fleetpilot's queue order (``backfill.completion_order``, ``--queue-aging``)
    baseline_preempts: bool = True  # the baseline's PriorityClasses preempt (not: ``--baseline-never-preempts``)
    vip_evicts_standard: bool = False  # Fleetpilot's vips may evict standard work (``--vip-evicts-standard``)

    def ratios(self, run: RunResult | None = None) -> dict[str, float]:
        """Fleetpilot (or ``run``) / baseline per figure (inf when the baseline is 0 and the
        other is not)."""
        out = {}
        for k, b in self.baseline.figures.items():
            f = (run or self.fleetpilot).figures[k]
            out[k] = f / b if b else (1.0 if f == 0 else math.inf)
        return out

    def queue_by_work(self) -> dict[str, float]:
        """Fleetpilot / baseline of the mean queue of the runs only the largest GPUs can hold
        (``only_largest``) and of the rest (``FleetRun.queue_split``): a breakdown of the mean
        queue's ratio, never a target of its own. A group with no queue in either run is 1."""
        out = {}
        for name in ("only_largest", "rest"):
            key = f"mean_queue_s_{name}"
            b, f = self.baseline.breakdown.get(key), self.fleetpilot.breakdown.get(key)
            if b is not None and f is not None:
                out[name] = f / b if b else (1.0 if f == 0 else math.inf)
        return out

    def targets(self) -> dict[str, bool]:
        """Whether each target (``TARGETS``) is met."""
        r = self.ratios()
        return {"utilisation": r["utilisation"] >= TARGETS["utilisation"],
                "mean_queue_s": r["mean_queue_s"] <= TARGETS["mean_queue_s"],
                "oom_events": r["oom_events"] <= TARGETS["oom_events"]}

    def to_json(self) -> dict:
        """Everything the report shows, as plain data."""
        return {"fleet": self.fleet, "seed": self.seed, "workload": self.workload, "code_digest": self.code,
                "environment": self.environment, "queue_aging": self.queue_aging,
                "baseline_preempts": self.baseline_preempts, "vip_evicts_standard": self.vip_evicts_standard,
                "arrival_window_h": self.span_h, "utilisation_bound_from_sharing": self.sharing_bound,
                "utilisation_bound_from_sm_use": self.sm_use_bound,
                "largest_gpu_load": asdict(self.largest_load) if self.largest_load else None,
                "baseline": {"policy": self.baseline.mode, **self.baseline.figures, "details": self.baseline.breakdown,
                             "wall_s": self.baseline.wall_s},
                "fleetpilot": {**self.fleetpilot.figures, "details": self.fleetpilot.breakdown,
                               "wall_s": self.fleetpilot.wall_s},
                "ratio": self.ratios(), "queue_by_work": self.queue_by_work(),
                "targets": {"wanted": TARGETS, "met": self.targets()},
                **({"peaks_known": {**self.peaks_known.figures, "details": self.peaks_known.breakdown,
                                    "ratio": self.ratios(self.peaks_known)}} if self.peaks_known else {})}


_LABELS = {
    "utilisation": ("GPU memory utilisation (arrival window)", lambda v: f"{v:.1%}"),
    "useful_utilisation": ("  of it by runs not killed later", lambda v: f"{v:.1%}"),
    "mean_queue_s": ("mean queue time", lambda v: f"{v / 60:.1f} min"),
    "p95_queue_s": ("p95 queue time", lambda v: f"{v / 60:.1f} min"),
    "oom_events": ("OOM events", lambda v: f"{v:.0f}"),
    "sla_missed": ("tasks that missed their SLA", lambda v: f"{v:.0f}"),
    "cost_per_useful_gpu_hour": ("cost per useful GPU-hour", lambda v: f"${v:.2f}"),
    "interventions": ("interventions", lambda v: f"{v:.0f}"),
}


def report(c: Comparison) -> str:
    """The side-by-side table with ratios and the target verdicts."""
    r = c.ratios()
    aging = "" if c.queue_aging == 1.0 else f"; Fleetpilot's queue aging {c.queue_aging:g}"
    preempts = "" if c.baseline_preempts else "; the baseline's PriorityClasses never preempt"
    vips = "; Fleetpilot's vips may evict standard work its contract spares" if c.vip_evicts_standard else ""
    base = c.baseline.mode
    lines = [f"fleet benchmark: fleet {c.fleet}, seed {c.seed}{aging}{preempts}{vips}", f"workload: {c.workload}",
             f"(packing shares can raise utilisation at most x{c.sharing_bound:.2f} when both are saturated; "
             f"packing every task by the SM time it really uses, at full speed, at most x{c.sm_use_bound:.2f})",
             *([c.largest_load.describe()] if c.largest_load else []),
             *_queue_by_work_lines(c),
             f"{'figure':<40} {base:>14} {'fleetpilot':>14} {'ratio':>8}"]
    for k, (label, fmt) in _LABELS.items():
        lines.append(f"{label:<40} {fmt(c.baseline.figures[k]):>14} {fmt(c.fleetpilot.figures[k]):>14} {r[k]:>8.2f}")
    b, f = c.baseline.breakdown, c.fleetpilot.breakdown
    lines.append(f"interventions: {base} {b['oom_restarts']:.0f} OOM restarts, {b['stuck_over_1h']:.0f} stuck > 1 h, "
                 f"{b['gpu_failure_kills']:.0f} lost to failed GPUs, {b['backoff_failed']:.0f} hit the backoff limit; "
                 f"fleetpilot {f['oom_restarts']:.0f}, {f['stuck_over_1h']:.0f}, {f['gpu_failure_kills']:.0f}, "
                 f"{f['backoff_failed']:.0f}")
    lines.append(f"fleetpilot loop: {f['admitted']:.0f} admitted, {f['counter_offers']:.0f} counter-offers, "
                 f"{f['rejected']:.0f} rejected; {f['migrations_oom']:.0f} migrations before an OOM, "
                 f"{f['bridged']:.0f} started on a smaller GPU and {f['migrations_bridge']:.0f} moved up in time, "
                 f"{f['migrations_maintenance']:.0f} off GPUs pending maintenance, "
                 f"{f['clearings']:.0f} clearings for a blocked whole-GPU task ({f['migrations_clearing']:.0f} moves), "
                 f"{f['migrations_down']:.0f} moved down to make room for one, "
                 f"{f['made_way']:.0f} checkpointed to make way for a shorter one, "
                 f"{f['made_room']:.0f} to make room for a shorter share of a GPU, "
                 f"{f['migrations_no_target']:.0f} without a target ({f['checkpointed']:.0f} checkpointed and requeued "
                 f"in all); "
                 f"failures seen coming "
                 f"{f['failures_seen_coming']:.0f} of {f['failures']:.0f} (median warning {f['median_warning_h']:.2f} h), "
                 f"{f['false_alarms']:.0f} false alarms")
    lines.append(f"completed: {base} {b['completed']:.0f}, fleetpilot {f['completed']:.0f}; never started "
                 f"{b['never_started']:.0f} / {f['never_started']:.0f}; max queue length {b['max_queue_length']:.0f} / "
                 f"{f['max_queue_length']:.0f}")
    lines.append(f"confidence of first placements (predicted vs met, Brier): {base} "
                 f"{b['confidence_predicted']:.3f} vs {b['confidence_observed']:.3f} ({b['confidence_brier']:.3f}), "
                 f"fleetpilot {f['confidence_predicted']:.3f} vs {f['confidence_observed']:.3f} "
                 f"({f['confidence_brier']:.3f})")
    verdict = c.targets()
    lines.append(f"targets vs {base}: " + ", ".join(
        f"{name} {'met' if ok else 'MISSED'} ({_target_text(name, r[name])})" for name, ok in verdict.items()))
    if c.peaks_known is not None:
        k = c.ratios(c.peaks_known)
        lines.append(f"told each run's true peak (a bound on better memory prediction, not a scheduler): mean queue "
                     f"{_target_text('mean_queue_s', k['mean_queue_s'])}, OOM events "
                     f"{c.peaks_known.figures['oom_events']:.0f} ({_target_text('oom_events', k['oom_events'])}), "
                     f"p95 queue {(k['p95_queue_s'] - 1) * 100:+.0f}%")
    lines.append(f"wall time: {base} {c.baseline.wall_s:.1f} s, fleetpilot {c.fleetpilot.wall_s:.1f} s; "
                 f"code {c.code or 'unknown'} on {describe_environment(c.environment) or 'an unnamed machine'}")
    return "\n".join(lines)


def _queue_by_work_lines(c: Comparison) -> list[str]:
    """The mean queue of the runs only the largest GPUs can hold and of the rest, each run's
    and their ratio, with how many of the former completed (none when no run needs them)."""
    split = c.queue_by_work()
    if not (c.largest_load and c.largest_load.tasks and "rest" in split):
        return []
    b, f, base = c.baseline.breakdown, c.fleetpilot.breakdown, c.baseline.mode
    return [f"  their mean queue: {base} {b['mean_queue_s_only_largest'] / 60:.1f} min, fleetpilot "
            f"{f['mean_queue_s_only_largest'] / 60:.1f} min (ratio {split['only_largest']:.2f}); completed: "
            f"{base} {b['completed_only_largest']:.0f}, fleetpilot {f['completed_only_largest']:.0f}",
            f"  the other runs' mean queue: {base} {b['mean_queue_s_rest'] / 60:.1f} min, fleetpilot "
            f"{f['mean_queue_s_rest'] / 60:.1f} min (ratio {split['rest']:.2f})"]


def _target_text(name: str, ratio: float) -> str:
    change = (ratio - 1.0) * 100
    want = {"utilisation": ">= +75%", "mean_queue_s": "<= -80%", "oom_events": "<= -90%"}[name]
    return f"{change:+.1f}%, want {want}"  # a tenth: -79.8% printed "-80%" beside MISSED


def plot(c: Comparison, out_dir: Path) -> list[Path]:
    """PNG plots of utilisation and queue length over time, both runs on each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for what, ylabel in (("utilisation", "GPU memory utilisation"), ("queue_length", "tasks waiting")):
        fig, ax = plt.subplots(figsize=(8, 4))
        for run in (c.baseline, c.fleetpilot):
            ax.plot(run.times_h, getattr(run, what), label=run.mode, linewidth=1.2)
        ax.axvline(c.span_h, color="grey", linestyle=":", linewidth=1, label="arrivals end")
        ax.set_xlabel("virtual time (h)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{c.fleet}, seed {c.seed}: {ylabel}")
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"fleet-{c.fleet}-seed{c.seed}-{what.replace('_', '-')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths

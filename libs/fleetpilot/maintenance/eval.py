"""Evaluation of the health model over injected fault scenarios.

The model is run as it would be in production: every ``every_s`` it assesses each GPU from
the samples of the last ``window_s``. For each GPU we note the first time it crossed the
maintenance threshold. A failing GPU is *seen coming* when that happens at least
``min_lead_s`` (10 minutes: time to migrate its tasks) before its failure; the lead time is
how much before. An alarm later than that is *late* and counts as a miss; an alarm on a GPU that never fails is a *false
alarm*. ``python -m fleetpilot.maintenance.eval`` prints the figures.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
from collections.abc import Sequence

import msgspec

from .faults import FaultScenario, generate_fleet
from .health import HealthModel


class ScenarioResult(msgspec.Struct, frozen=True, kw_only=True):
    """What the model did on one GPU."""

    uuid: str
    kind: str
    mode: str | None
    fails_at: float | None
    first_alarm_at: float | None
    peak_probability: float
    min_lead_s: float = 600.0

    @property
    def lead_s(self) -> float | None:
        """How long before the failure the first alarm came (``None``: not seen in time)."""
        if self.fails_at is None or self.first_alarm_at is None:
            return None
        lead = self.fails_at - self.first_alarm_at
        return lead if lead >= self.min_lead_s else None


class EvalReport(msgspec.Struct, frozen=True, kw_only=True):
    """The headline figures of an evaluation run."""

    gpus: int
    failures: int
    seen_coming: int
    missed: list[str]
    late: int
    lead_times_s: list[float]
    false_alarms: int
    non_failing: int
    by_mode: dict[str, tuple[int, int]]
    results: list[ScenarioResult]

    @property
    def recall(self) -> float:
        """Share of failures seen coming."""
        return self.seen_coming / self.failures if self.failures else 1.0

    @property
    def false_alarm_rate(self) -> float:
        """Share of non-failing GPUs that were flagged at least once."""
        return self.false_alarms / self.non_failing if self.non_failing else 0.0


def run_scenario(
    scenario: FaultScenario, model: HealthModel, *, window_s: float, every_s: float, min_lead_s: float = 600.0
) -> ScenarioResult:
    """Assess one GPU every ``every_s`` over a sliding window; note the first alarm."""
    times = [s.at for s in scenario.samples]
    first_alarm = None
    peak = 0.0
    t = every_s
    end = times[-1] if times else 0.0
    while t <= end + 1e-9:
        lo, hi = bisect.bisect_left(times, t - window_s), bisect.bisect_right(times, t)
        if hi > lo:
            assessment = model.assess(scenario.samples[lo:hi])
            peak = max(peak, assessment.failure_probability)
            if assessment.maintenance_pending and first_alarm is None:
                first_alarm = t
        t += every_s
    return ScenarioResult(
        uuid=scenario.uuid,
        kind=scenario.kind,
        mode=scenario.mode,
        fails_at=scenario.fails_at,
        first_alarm_at=first_alarm,
        peak_probability=peak,
        min_lead_s=min_lead_s,
    )


def evaluate(
    scenarios: Sequence[FaultScenario],
    model: HealthModel | None = None,
    *,
    window_s: float = 2 * 3600.0,
    every_s: float = 600.0,
    min_lead_s: float = 600.0,
) -> EvalReport:
    """Run the model over every scenario and sum up detections, lead times, false alarms."""
    model = model or HealthModel()
    results = [
        run_scenario(s, model, window_s=window_s, every_s=every_s, min_lead_s=min_lead_s) for s in scenarios
    ]
    failing = [r for r in results if r.fails_at is not None]
    others = [r for r in results if r.fails_at is None]
    by_mode: dict[str, tuple[int, int]] = {}
    for r in failing:
        seen, total = by_mode.get(r.mode or "?", (0, 0))
        by_mode[r.mode or "?"] = (seen + (r.lead_s is not None), total + 1)
    return EvalReport(
        gpus=len(results),
        failures=len(failing),
        seen_coming=sum(r.lead_s is not None for r in failing),
        missed=[r.uuid for r in failing if r.lead_s is None],
        late=sum(r.lead_s is None and r.first_alarm_at is not None for r in failing),
        lead_times_s=sorted(r.lead_s for r in failing if r.lead_s is not None),
        false_alarms=sum(r.first_alarm_at is not None for r in others),
        non_failing=len(others),
        by_mode=by_mode,
        results=results,
    )


def format_report(report: EvalReport) -> str:
    """The report as the lines ``main`` prints."""
    leads_h = [x / 3600.0 for x in report.lead_times_s]
    lines = [
        f"GPUs evaluated            {report.gpus}",
        f"failures                  {report.failures}",
        f"seen coming               {report.seen_coming} ({report.recall:.0%})",
        f"missed                    {len(report.missed)} ({report.late} flagged too late: under 10 min)",
    ]
    if leads_h:
        lines.append(
            f"lead time (h)             median {statistics.median(leads_h):.2f}, min {min(leads_h):.2f}, "
            f"max {max(leads_h):.2f}"
        )
    lines.append(
        f"false alarms              {report.false_alarms} of {report.non_failing} non-failing GPUs "
        f"({report.false_alarm_rate:.0%})"
    )
    for mode, (seen, total) in sorted(report.by_mode.items()):
        lines.append(f"  mode {mode:<10}          {seen}/{total} seen coming")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Generate a fleet (default 40 healthy, 20 noisy, 20 failing GPUs), evaluate, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--healthy", type=int, default=40)
    parser.add_argument("--noisy", type=int, default=20)
    parser.add_argument("--degrading", type=int, default=20)
    parser.add_argument("--window-h", type=float, default=2.0)
    args = parser.parse_args(argv)
    fleet = generate_fleet(healthy=args.healthy, noisy=args.noisy, degrading=args.degrading, seed=args.seed)
    print(
        f"health model, threshold {HealthModel().threshold}, window {args.window_h:g} h, assessed every 10 min"
    )
    print(format_report(evaluate(fleet, window_s=args.window_h * 3600.0)))


if __name__ == "__main__":
    main()

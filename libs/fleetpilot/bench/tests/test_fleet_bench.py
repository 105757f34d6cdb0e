"""The fleet benchmark on tiny fleets and hand-made workloads (the full runs live in ``make bench``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from fleetpilot.bench import fleet as bench
from fleetpilot.bench import fleet_run
from fleetpilot.bench import fleet_workload as bench_workload
from fleetpilot.bench.default_preemption import TERMINATION_GRACE_S
from fleetpilot.bench.fleet import compare, main, workload_sharing_bound, workload_sm_use_bound
from fleetpilot.bench.fleet_job import BACKOFF_LIMIT, MIGRATION_BASE_S, TICK_S
from fleetpilot.bench.fleet_report import RunResult
from fleetpilot.bench.fleet_run import FleetRun
from fleetpilot.bench.fleet_workload import BenchTask, FaultPlan, Workload, generate_workload
from fleetpilot.bench.outputs import code_digest
from fleetpilot.contracts import Fingerprint
from fleetpilot.fingerprint import restores_start_over, run_envelope
from fleetpilot.fleet.inventory import Fleet, build_fleet, load_fleet_spec
from fleetpilot.fleet.simulator import CONTEXT_MB
from fleetpilot.policy.backfill import Move
from fleetpilot.policy.rebalance import GROWTH_LOOKAHEAD_S
from fleetpilot.workload.growth import MemoryGrowth


def tiny_fleet(gpus: int = 1, nodes: int = 1, model: str = "A100-40GB") -> Fleet:
    """``nodes`` nodes of ``gpus`` GPUs each, plenty of CPU and memory."""
    shape = {"gpu_model": model, "gpus": gpus, "cpu_milli": 64000, "memory_mb": 262144}
    return build_fleet({"name": "tiny", "sites": [{"name": "s", "groups": [{"prefix": "n", "count": nodes, "shape": shape}]}]})


def task(i: int, *, pattern: str = "flat", peak: float = 8000.0, request: float | None = None, duration: float = 600.0,
         gpus: int = 1, milli: int = 1000, arrival: float = 0.0, tier: str = "standard",
         program: str | None = None) -> BenchTask:
    """A task with a noiseless curve (so the simulator's OOM timing is exact)."""
    growth = MemoryGrowth(pattern=pattern, base_mb=peak * 0.5, peak_mb=peak, duration_s=duration,  # type: ignore[arg-type]
                          warmup_s=30.0)
    return BenchTask(task_id=f"t{i}", program=program or f"p-{pattern}", kind="finetune", gpus=gpus, gpu_milli=milli,
                     request_mb=request if request is not None else peak, cpu_milli=1000, memory_mb=1024,
                     gpu_models=("A100-40GB",), growth=growth, util=50.0, arrival_s=arrival, tier=tier,
                     max_queue_s=300.0, deadline_s=None, declared_duration_s=duration)


def workload(*tasks: BenchTask, hours: float = 1.0, faults: tuple[FaultPlan, ...] = ()) -> Workload:
    """Tasks played over ``hours`` (arrival window = run length)."""
    return Workload(tasks=tuple(tasks), faults=faults, span_s=hours * 3600.0, horizon_s=hours * 3600.0, load=1.0,
                    source="test", programs=len({t.program for t in tasks}))


def test_baseline_counts_an_oom_for_a_leaking_task_and_restarts_it() -> None:
    # 45 GB at the end of a 10-minute leak on a 40 GB GPU: every attempt dies, up to the backoff limit.
    leaking = task(0, pattern="leak", peak=45_000.0, request=30_000.0)
    result = FleetRun(tiny_fleet(), workload(leaking, hours=3.0), "k8s-default", seed=1).run()
    assert result.figures["oom_events"] == BACKOFF_LIMIT + 1
    assert result.breakdown["oom_restarts"] == BACKOFF_LIMIT
    assert result.breakdown["backoff_failed"] == 1
    assert result.figures["interventions"] >= BACKOFF_LIMIT + 1
    assert result.figures["sla_missed"] == 1


def test_a_task_that_fits_its_gpu_never_ooms() -> None:
    result = FleetRun(tiny_fleet(), workload(task(0, pattern="linear", peak=30_000.0)), "k8s-default", seed=1).run()
    assert result.figures["oom_events"] == 0
    assert result.breakdown["completed"] == 1


def test_the_confidence_of_first_placements_is_judged_against_how_they_ended() -> None:
    # Two placements judged: the leak (killed by its OOM: not met) and the fitting task
    # (completed: met); the third task is still running when the run ends: not judged.
    tasks = (task(0, pattern="leak", peak=45_000.0, request=30_000.0), task(1, pattern="flat", peak=8_000.0),
             task(2, pattern="flat", peak=8_000.0, duration=10 * 3600.0))
    result = FleetRun(tiny_fleet(gpus=3), workload(*tasks, hours=1.0), "k8s-default", seed=1).run()
    b = result.breakdown
    assert b["confidence_judged"] == 2
    assert b["confidence_observed"] == 0.5
    assert b["confidence_predicted"] == pytest.approx(0.9)  # the prior: k8s-default knows no memory
    assert b["confidence_brier"] == pytest.approx((0.9**2 + 0.1**2) / 2)


@pytest.mark.parametrize("mode", ["k8s-default", "fleetpilot"])
def test_the_learner_is_given_the_judged_first_placements_as_the_policy_service_would_publish_them(mode: str) -> None:
    tasks = (task(0, pattern="leak", peak=45_000.0, request=30_000.0), task(1, pattern="flat", peak=8_000.0),
             task(2, pattern="flat", peak=8_000.0, duration=10 * 3600.0))
    run = FleetRun(tiny_fleet(gpus=3), workload(*tasks, hours=1.0), mode, seed=1)
    b = run.run().breakdown
    examples = {e.decision.task_id: e for e in run.outcome_examples()}
    assert len(examples) == b["confidence_judged"]  # the one still running is not judged
    assert sum(e.success for e in examples.values()) == b["confidence_observed"] * b["confidence_judged"]
    assert sum(e.decision.confidence for e in examples.values()) == pytest.approx(
        b["confidence_predicted"] * b["confidence_judged"])
    fitting = examples["t1"].decision
    assert fitting.action == "assign" and fitting.task is not None and fitting.task.gpu_memory_mb > 0
    assert examples["t1"].gpu_model == "A100-40GB"
    # The device plugin gives the whole GPU; Fleetpilot holds what it reserved for the run.
    held = fitting.placement[0].memory_mb
    assert held == 40_960 if mode == "k8s-default" else 8_000 < held < 40_960


def test_queue_times_follow_the_clock() -> None:
    # One GPU, two whole-GPU tasks of 600 s arriving at 0: the first starts as it arrives,
    # the second at the cycle that sees the first end (600 s).
    run = FleetRun(tiny_fleet(), workload(task(0), task(1)), "k8s-default", seed=1)
    result = run.run()
    waits = sorted(j.queue_s for j in run.jobs)
    assert waits == [0.0, 600.0]
    assert result.figures["mean_queue_s"] == pytest.approx(300.0)
    assert result.figures["p95_queue_s"] == pytest.approx(0.95 * 600.0)
    assert max(result.queue_length) == 1


@pytest.mark.parametrize("mode", ["k8s-default", "fleetpilot"])
def test_a_task_is_decided_the_instant_it_arrives_and_waits_for_a_cycle_only_when_nothing_fits(mode: str) -> None:
    # One GPU; a task arriving between two cycles (at 30 s) starts then, not at the next
    # cycle; one arriving at 45 s finds the GPU taken and starts at the first cycle after
    # the first task's end (630 s -> the cycle at 660 s).
    run = FleetRun(tiny_fleet(), workload(task(0, arrival=30.0), task(1, arrival=45.0)), mode, seed=1)
    run.run()
    first, second = run.jobs
    assert first.queue_s == 0.0 and first.finished_at == pytest.approx(660.0)
    assert second.queue_s == pytest.approx(660.0 - 45.0)


def test_a_task_that_never_starts_counts_its_wait_until_the_end() -> None:
    # Two whole GPUs asked on a one-GPU fleet: it waits for the whole hour.
    run = FleetRun(tiny_fleet(), workload(task(0, gpus=2)), "k8s-default", seed=1)
    result = run.run()
    assert result.figures["mean_queue_s"] == pytest.approx(3600.0)
    assert result.breakdown["never_started"] == 1


def test_a_task_the_negotiator_rejects_is_left_out_of_both_runs_queue_figures() -> None:
    # One GPU: t0 runs 600 s; t1, a vip that must end by 100 s, cannot: Fleetpilot's
    # negotiator rejects it, and the baseline makes it wait for t0 (600 s; its PriorityClasses
    # non-preempting, or t1 would evict t0).
    impossible = dataclasses.replace(task(1, tier="vip"), deadline_s=100.0)
    both = compare(tiny_fleet(), workload(task(0), impossible), fleet_name="tiny", seed=1, baseline_preempts=False)
    assert both.fleetpilot.breakdown["rejected"] == 1
    assert both.fleetpilot.figures["sla_missed"] == 1  # rejected: missed, whatever the queue says
    # Only t0 is compared: it waited for nothing in either run.
    assert both.baseline.figures["mean_queue_s"] == 0.0
    assert both.fleetpilot.figures["mean_queue_s"] == 0.0
    # Alone, the baseline's run still counts the wait it made t1 sit through.
    alone = FleetRun(tiny_fleet(), workload(task(0), impossible), "k8s-default", seed=1, preempts=False).run()
    assert alone.figures["mean_queue_s"] == pytest.approx(300.0)


def test_shares_hold_a_whole_gpu_in_the_baseline_and_a_fraction_in_fleetpilot() -> None:
    pair = workload(task(0, milli=500, peak=6000.0), task(1, milli=500, peak=6000.0))
    base = FleetRun(tiny_fleet(), pair, "k8s-default", seed=1).run()
    ours = FleetRun(tiny_fleet(), pair, "fleetpilot", seed=1).run()
    # The baseline's second task waits for the whole GPU the first holds; both shares start at once.
    assert base.figures["mean_queue_s"] == pytest.approx(300.0)
    assert ours.figures["mean_queue_s"] == 0.0
    # Over the whole hour both did the same work; while both tasks ran together the GPU held twice the memory.
    assert ours.figures["utilisation"] == pytest.approx(base.figures["utilisation"], rel=0.05)
    assert max(ours.utilisation) > 1.8 * max(base.utilisation)


def test_fleetpilot_does_not_restart_an_oom_on_the_same_small_gpu() -> None:
    # A 40 GB and an 80 GB node; the task's ask fits the A100 but its leak does not. The
    # baseline keeps landing it wherever LeastAllocated says; Fleetpilot learns a floor from
    # the first OOM and restarts it on the H100.
    spec = {"name": "two", "sites": [{"name": "s", "groups": [
        {"prefix": "a", "count": 1, "shape": {"gpu_model": "A100-40GB", "gpus": 1, "cpu_milli": 64000, "memory_mb": 262144}},
        {"prefix": "h", "count": 1, "shape": {"gpu_model": "H100", "gpus": 1, "cpu_milli": 32000, "memory_mb": 131072}},
    ]}]}
    leaking = task(0, pattern="leak", peak=50_000.0, request=30_000.0)
    leaking = BenchTask(**{**leaking.__dict__, "gpu_models": ("A100-40GB", "H100")})
    ours = FleetRun(build_fleet(spec), workload(leaking, hours=2.0), "fleetpilot", seed=1).run()
    assert ours.figures["oom_events"] <= 1
    assert ours.breakdown["completed"] == 1


def test_both_runs_play_the_identical_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    w = generate_workload(tiny_fleet(gpus=4, nodes=2), seed=3, n_tasks=30, span_s=1800.0, n_faults=0)
    seen: list[tuple[str, tuple[BenchTask, ...]]] = []
    original = FleetRun.run

    def spy(self: FleetRun) -> RunResult:
        seen.append((self.mode, tuple(j.task for j in self.jobs)))
        return original(self)

    monkeypatch.setattr(FleetRun, "run", spy)
    result = compare(tiny_fleet(gpus=4, nodes=2), w, fleet_name="tiny", seed=3)
    assert [mode for mode, _ in seen] == ["k8s-default", "fleetpilot"]
    assert seen[0][1] == seen[1][1] == w.tasks
    assert result.baseline.times_h == result.fleetpilot.times_h


def test_the_workload_is_a_function_of_the_seed() -> None:
    fleet = load_fleet_spec()
    a = generate_workload(fleet, seed=5, n_tasks=200, load=1.3, span_s=3600.0)
    b = generate_workload(fleet, seed=5, n_tasks=200, load=1.3, span_s=3600.0)
    c = generate_workload(fleet, seed=6, n_tasks=200, load=1.3, span_s=3600.0)
    assert a == b
    assert a.tasks != c.tasks
    # The whole-GPU load is what was asked (durations are scaled to it, then clipped).
    gpu_seconds = sum(t.gpus * t.duration_s for t in a.tasks)
    assert gpu_seconds / (fleet.gpu_count * a.span_s) == pytest.approx(1.3, rel=0.05)
    # Growing patterns often end above the ask; every peak fits some acceptable GPU.
    growing = [t for t in a.tasks if t.growth.pattern in ("linear", "steps", "leak")]
    assert sum(t.growth.peak_mb > t.request_mb for t in growing) > len(growing) / 2
    assert {f.kind for f in a.faults} == {"degrading", "sudden"}


def test_the_default_load_is_the_packed_demand_at_95_percent() -> None:
    fleet = load_fleet_spec()
    w = generate_workload(fleet, seed=5, n_tasks=300, span_s=3600.0)
    bound = workload_sharing_bound(w)
    assert bound > 1.0
    assert w.load == pytest.approx(0.95 * bound, rel=0.02)
    with pytest.raises(ValueError, match="cannot make a whole-GPU load"):
        generate_workload(fleet, seed=5, n_tasks=3, load=1.3, span_s=3600.0)


def test_a_spread_of_estimates_changes_the_declared_durations_and_deadlines_only() -> None:
    fleet = load_fleet_spec()
    exact = generate_workload(fleet, seed=5, n_tasks=400, load=1.3, span_s=3600.0)
    loose = generate_workload(fleet, seed=5, n_tasks=400, load=1.3, span_s=3600.0, estimate_spread=1.0)
    assert loose == generate_workload(fleet, seed=5, n_tasks=400, load=1.3, span_s=3600.0, estimate_spread=1.0)
    assert exact.faults == loose.faults
    unchanged = ("task_id", "program", "gpus", "gpu_milli", "request_mb", "growth", "arrival_s", "tier",
                 "duration_s", "gpu_models")
    for a, b in zip(exact.tasks, loose.tasks, strict=True):
        assert all(getattr(a, f) == getattr(b, f) for f in unchanged)
    ratios = np.array([t.declared_duration_s / t.duration_s for t in loose.tasks])
    assert not np.all((ratios >= 0.9) & (ratios <= 1.3))  # no longer within x0.9-1.3
    assert np.median(ratios) == pytest.approx(bench_workload.ESTIMATE_BIAS, rel=0.15)
    assert np.mean(ratios < 1.0) > 0.3 and np.mean(ratios > 2.6 * 1.1) > 0.1  # off both ways, often far
    # A guaranteed tier's deadline follows what its user believes the run takes.
    vip = next(t for t in loose.tasks if t.tier == "vip")
    assert vip.deadline_s == pytest.approx(vip.arrival_s + bench_workload.MAX_QUEUE_S["vip"]
                                           + bench_workload.DEADLINE_SLACK["vip"] * vip.declared_duration_s)
    assert "sigma 1" in loose.describe() and "x0.9-1.3" in exact.describe()


def test_a_spread_of_peaks_changes_the_peaks_only_and_every_run_still_fits_a_gpu_it_accepts() -> None:
    fleet = load_fleet_spec()
    tight = generate_workload(fleet, seed=5, n_tasks=400, load=1.3, span_s=3600.0)
    loose = generate_workload(fleet, seed=5, n_tasks=400, load=1.3, span_s=3600.0, peak_spread=0.3)
    assert loose == generate_workload(fleet, seed=5, n_tasks=400, load=1.3, span_s=3600.0, peak_spread=0.3)
    assert tight.faults == loose.faults
    for a, b in zip(tight.tasks, loose.tasks, strict=True):
        assert (a.program, a.arrival_s, a.duration_s, a.declared_duration_s, a.request_mb, a.growth.pattern) == (
            b.program, b.arrival_s, b.duration_s, b.declared_duration_s, b.request_mb, b.growth.pattern)
    memory = {g.model: g.memory_mb for n in fleet.nodes for g in n.gpus}

    def spread(w: Workload) -> float:
        by_program: dict[str, list[float]] = {}
        for t in w.tasks:
            by_program.setdefault(t.program, []).append(t.growth.peak_mb)
        return max(max(p) / min(p) for p in by_program.values())

    assert spread(tight) <= 1.05 / 0.95 + 1e-9 < 1.3 < spread(loose)
    assert all(t.growth.peak_mb + CONTEXT_MB <= max(memory[m] for m in t.gpu_models) for t in loose.tasks)
    assert "within 30%" in loose.describe() and "within 5%" in tight.describe()


@pytest.mark.parametrize("spread", [0.0, -1.0, 1.0, float("nan")])
def test_a_spread_of_peaks_that_is_no_spread_is_refused(spread: float) -> None:
    with pytest.raises(ValueError, match="spread"):
        generate_workload(tiny_fleet(), seed=1, n_tasks=5, span_s=3600.0, peak_spread=spread)


@pytest.mark.parametrize("spread", [0.0, -1.0, float("nan"), float("inf")])
def test_a_spread_of_estimates_that_is_no_spread_is_refused(spread: float) -> None:
    with pytest.raises(ValueError, match="spread"):
        generate_workload(tiny_fleet(), seed=1, n_tasks=5, span_s=3600.0, estimate_spread=spread)


def test_sharing_bound() -> None:
    # Half the whole-GPU time is quarter shares: at most 1 / (1 - 0.5 * 0.75) = 1.6x.
    w = workload(task(0, milli=250), task(1))
    assert workload_sharing_bound(w) == pytest.approx(1.6)


def test_largest_gpu_load_counts_the_runs_nothing_smaller_holds() -> None:
    shape = {"gpus": 2, "cpu_milli": 64000, "memory_mb": 262144}
    fleet = build_fleet({"name": "two", "sites": [{"name": "s", "groups": [
        {"prefix": "small", "count": 1, "shape": {**shape, "gpu_model": "A100-40GB"}},
        {"prefix": "large", "count": 1, "shape": {**shape, "gpu_model": "A100-80GB"}}]}]})
    both = ("A100-40GB", "A100-80GB")

    def accepting(t: BenchTask, models: tuple[str, ...]) -> BenchTask:
        return dataclasses.replace(t, gpu_models=models)

    tasks = [
        accepting(task(0, peak=60_000.0, duration=3600.0), both),  # 1 GPU-h only the 80 GB can hold
        accepting(task(1, peak=30_000.0, duration=3600.0), both),  # fits the 40 GB: not counted
        accepting(task(2, peak=60_000.0, duration=1800.0, gpus=2), both),  # 2 GPUs x 0.5 h
        accepting(task(3, peak=30_000.0, duration=1800.0), ("A100-80GB",)),  # accepts nothing smaller
        accepting(task(4, peak=40_960.0 - CONTEXT_MB + 1.0, duration=3600.0), both),  # a MB over with its context
    ]
    load = bench.largest_gpu_load(fleet, tasks, span_s=3600.0)
    assert load.models == ("A100-80GB",) and load.gpus == 2
    assert load.work_gpu_h == pytest.approx(3.5)
    assert load.load == pytest.approx(3.5 / 2.0)
    assert load.tasks == 4
    # Flat after a 30 s warm-up: above the 40 GB within seconds, and task 3 all its run.
    assert 3.4 < load.above_smaller_gpu_h < 3.5
    assert "4 runs, 4 GPU-h, x1.75 what their 2 GPUs give over the arrival window (3 GPU-h above" in load.describe()


def test_the_hours_above_a_smaller_gpu_are_those_the_curve_spends_over_its_room() -> None:
    # A line from 30 GB to 60 GB over an hour is over a 40 GB room, its context included, for
    # the last (60 - (40 - context)) / 30 of it; a sawtooth that goes over at all counts whole.
    line = task(0, pattern="linear", peak=60_000.0, duration=3600.0)
    room = 40_000.0
    share = (60_000.0 - (room - CONTEXT_MB)) / 30_000.0
    assert bench_workload.hours_above(line, room) == pytest.approx(share, abs=1e-3)
    assert bench_workload.hours_above(line, 61_000.0 + CONTEXT_MB) == 0.0
    saw = task(1, pattern="sawtooth", peak=60_000.0, duration=3600.0, gpus=2)
    assert bench_workload.hours_above(saw, room) == 2.0


def two_sizes() -> Fleet:
    """One node of a 40 GB GPU and one of an 80 GB GPU."""
    shape = {"gpus": 1, "cpu_milli": 64000, "memory_mb": 262144}
    return build_fleet({"name": "two", "sites": [{"name": "s", "groups": [
        {"prefix": "small", "count": 1, "shape": {**shape, "gpu_model": "A100-40GB"}},
        {"prefix": "large", "count": 1, "shape": {**shape, "gpu_model": "A100-80GB"}}]}]})


def test_the_queue_is_split_between_the_runs_only_the_largest_gpus_hold_and_the_rest() -> None:
    both = ("A100-40GB", "A100-80GB")
    tasks = [dataclasses.replace(task(0, peak=60_000.0, duration=3600.0), gpu_models=both),
             dataclasses.replace(task(1, peak=60_000.0, duration=600.0), gpu_models=both),
             dataclasses.replace(task(2, peak=30_000.0, duration=600.0), gpu_models=both)]
    fleet, w = two_sizes(), workload(*tasks, hours=3.0)
    assert bench_workload.only_largest_hold(fleet, tasks) == (("A100-80GB",), frozenset({"t0", "t1"}))
    run = FleetRun(fleet, w, "fleetpilot", seed=1)
    run.run()
    waits = run.waits_by_task
    # The two 60 GB runs take the 80 GB GPU one after the other; the 30 GB run never waits for it.
    assert waits["t2"] == 0.0 and max(waits["t0"], waits["t1"]) >= 600.0
    split = run.queue_split(frozenset({"t0", "t1"}))
    assert split == {"mean_queue_s_only_largest": pytest.approx((waits["t0"] + waits["t1"]) / 2),
                     "mean_queue_s_rest": 0.0, "completed_only_largest": 2.0}
    # Left out, a task counts in neither group.
    assert run.queue_split(frozenset({"t0", "t1"}), left_out=frozenset({"t1"}))["mean_queue_s_only_largest"] == (
        pytest.approx(waits["t0"]))
    result = compare(fleet, w, fleet_name="two", seed=1)
    assert result.fleetpilot.breakdown["mean_queue_s_only_largest"] == pytest.approx(split["mean_queue_s_only_largest"])
    base = result.baseline.breakdown
    by_work = result.queue_by_work()
    assert by_work["rest"] == (0.0 if base["mean_queue_s_rest"] else 1.0)
    assert by_work["only_largest"] == pytest.approx(split["mean_queue_s_only_largest"] / base["mean_queue_s_only_largest"])
    assert result.to_json()["queue_by_work"] == by_work
    text = bench.report(result)
    assert "their mean queue: k8s-default" in text
    assert (f"completed: k8s-default {base['completed_only_largest']:.0f}, fleetpilot 2\n"
            "  the other runs' mean queue: k8s-default") in text


def test_sm_use_bound() -> None:
    # Two 1-GPU tasks of equal length at 50% SM (``task``'s util): whole-GPU time 2, used 1.
    w = workload(task(0), task(1, milli=250))
    assert workload_sm_use_bound(w) == pytest.approx(2.0)
    # A 2-GPU task at 50% for twice as long weighs four times as much: (4 + 1) / (2 + 0.5).
    w = workload(task(0, gpus=2, duration=1200.0), task(1))
    assert workload_sm_use_bound(w) == pytest.approx(2.0)
    assert workload_sm_use_bound(w) >= workload_sharing_bound(w)


def test_a_failed_gpu_loses_the_baselines_tasks_and_fleetpilot_moves_them_first() -> None:
    fault = FaultPlan(node="n00", gpu=0, kind="degrading", onset_s=600.0, fails_s=600.0 + 2.5 * 3600)
    long_task = task(0, duration=4 * 3600.0, peak=8000.0)
    w = workload(long_task, hours=4.5, faults=(fault,))
    base = FleetRun(tiny_fleet(gpus=2), w, "k8s-default", seed=1).run()
    ours = FleetRun(tiny_fleet(gpus=2), w, "fleetpilot", seed=1).run()
    assert base.breakdown["gpu_failure_kills"] == 1
    assert ours.breakdown["failures_seen_coming"] == 1
    assert ours.breakdown["migrations_maintenance"] == 1
    assert ours.breakdown["gpu_failure_kills"] == 0
    assert ours.breakdown["false_alarms"] == 0


def test_a_gpu_flagged_that_never_fails_is_a_false_alarm() -> None:
    # GPU 1 shows the same rising error counters as a dying GPU but the workload never fails it.
    fault = FaultPlan(node="n00", gpu=0, kind="degrading", onset_s=600.0, fails_s=600.0 + 2.5 * 3600)
    run = FleetRun(tiny_fleet(gpus=2), workload(task(0, duration=4 * 3600.0), hours=4.5, faults=(fault,)),
                   "fleetpilot", seed=1)
    run.sim.degrade("n00", 1, "ecc_corrected", rate_per_h=5.0, accel_per_h2=100.0)
    run.sim.degrade("n00", 1, "remapped_rows", rate_per_h=0.2, accel_per_h2=2.0)
    run.sim.degrade("n00", 1, "pcie_replays", rate_per_h=5.0, accel_per_h2=50.0)
    result = run.run()
    assert result.breakdown["failures_seen_coming"] == 1
    assert result.breakdown["false_alarms"] == 1


def test_main_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fleet.json"
    assert main(["--fleet", "three-site", "--seed", "3", "--tasks", "150", "--hours", "0.5", "--arrivals", "generated",
                 "--json", str(out), "--plot-dir", str(tmp_path / "plots")]) == 0
    data = json.loads(out.read_text())
    assert data["seed"] == 3 and data["fleet"] == "three-site"
    assert data["code_digest"] == code_digest()  # the code that ran, so the figures can be traced to it
    assert data["queue_aging"] == 1.0  # and the queue order it ran with
    assert data["baseline_preempts"] is True  # and whether the baseline's PriorityClasses preempt
    for key in ("utilisation", "useful_utilisation", "mean_queue_s", "p95_queue_s", "oom_events", "sla_missed", "cost_per_useful_gpu_hour",
                "interventions"):
        assert key in data["baseline"] and key in data["fleetpilot"] and key in data["ratio"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "fleet-three-site-seed3-queue-length.png", "fleet-three-site-seed3-utilisation.png"]
    printed = capsys.readouterr().out
    assert "seed 3" in printed and "ratio" in printed
    moved_down = data["fleetpilot"]["details"]["migrations_down"]
    assert f"{moved_down:.0f} moved down to make room for one" in printed


@pytest.mark.parametrize("argv", [["--fleet", "moon"], ["--tasks", "0"], ["--seed", "x"],
                                  ["--trace", "/nonexistent.csv"], ["--queue-aging", "0"]])
def test_bad_arguments_exit_with_one_line(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(argv)
    message = str(err.value)
    assert message.startswith("fleet bench:") and "\n" not in message


@pytest.mark.parametrize("argv", [["--hours", "nan"], ["--hours", "inf"], ["--load", "nan"], ["--load", "inf"],
                                  ["--queue-aging", "nan"], ["--queue-aging", "inf"], ["--estimate-spread", "nan"],
                                  ["--estimate-spread", "0"], ["--estimate-spread", "inf"], ["--peak-spread", "1"],
                                  ["--peak-spread", "nan"]])
def test_numbers_that_are_no_amount_are_refused_before_anything_runs(argv: list[str]) -> None:
    # Every comparison with NaN is false: a check written as "refuse if <= 0" let it through.
    with pytest.raises(SystemExit) as err:
        main(["--tasks", "5", *argv])
    assert "must be" in str(err.value) and "\n" not in str(err.value)


def test_without_the_openb_data_the_trace_runs_say_where_it_is_looked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no shared/data/openb above it
    monkeypatch.delenv("FLEETPILOT_DATA", raising=False)
    for argv in (["--fleet", "openb", "--arrivals", "generated"], ["--fleet", "three-site"]):
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert str(err.value) == ("fleet bench: no shared/data/openb found (set FLEETPILOT_DATA, or pass --trace "
                                  "and --nodes)")


@pytest.mark.parametrize("flag", ["--json", "--plot-dir"])
def test_an_unwritable_output_fails_before_the_run(tmp_path: Path, flag: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as err:
        main(["--tasks", "150", "--hours", "0.5", "--arrivals", "generated", flag, str(tmp_path / "a-file" / "out")])
    assert str(err.value).startswith("fleet bench: cannot write") and "\n" not in str(err.value)
    assert capsys.readouterr().out == ""  # nothing ran


A100_AND_H100 = {"name": "two", "sites": [{"name": "s", "groups": [
    {"prefix": "a", "count": 1, "shape": {"gpu_model": "A100-40GB", "gpus": 1, "cpu_milli": 64000, "memory_mb": 262144}},
    {"prefix": "h", "count": 1, "shape": {"gpu_model": "H100", "gpus": 1, "cpu_milli": 64000, "memory_mb": 262144}},
]}]}


def grower_behind_a_busy_h100(pattern: str, peak: float, request: float, duration: float,
                              busy_s: float) -> tuple[BenchTask, BenchTask]:
    """A task holding the H100 for ``busy_s``, and a grower that accepts the A100 or the H100
    and may wait for the H100: admitted on it, with the A100 (which holds its ask) among its
    contract's models, so the policy may start it sooner there. (Unable to wait, it is
    counter-offered the H100 and, accepting, held to it, as the sla service holds it.)"""
    busy = BenchTask(**{**task(0, duration=busy_s).__dict__, "gpu_models": ("H100",)})
    grower = BenchTask(**{**task(1, pattern=pattern, peak=peak, request=request, duration=duration).__dict__,
                          "gpu_models": ("A100-40GB", "H100"), "max_queue_s": busy_s + 600.0})
    return busy, grower


def known(run: FleetRun, pattern: str, peak: float, envelope: tuple[float, ...] = ()) -> FleetRun:
    """``run`` with the grower's signature already fingerprinted (``pattern``, ``peak``, and
    the ``envelope`` of its earlier runs)."""
    run.memory.observe(Fingerprint(signature=run.jobs[1].signature, pattern=pattern, pattern_confidence=1.0,
                                   growth_rate_mb_per_s=10.0, predicted_peak_mb=peak, peak_low_mb=peak - 300.0,
                                   peak_high_mb=peak + 300.0, samples=40, envelope_mb=envelope))
    return run


def test_a_known_leak_starts_on_a_small_gpu_and_moves_up_before_it_overflows() -> None:
    # The H100 is busy for 20 minutes; the leak (50 GB at the end, 40 GB reached at 77% of
    # its 40 minutes) starts on the A100 and moves to the H100 once that is free, before the OOM.
    spec = A100_AND_H100
    busy, leak = grower_behind_a_busy_h100("leak", 50_000.0, 30_000.0, 2400.0, busy_s=1200.0)
    run = known(FleetRun(build_fleet(spec), workload(busy, leak, hours=1.5), "fleetpilot", seed=1), "leak", 50_300.0)
    result = run.run()
    assert result.breakdown["bridged"] == 1
    assert result.breakdown["migrations_bridge"] == 1
    assert result.figures["oom_events"] == 0
    assert result.breakdown["completed"] == 2
    # The same task on the baseline: it lands on the A100 (the H100 is busy) and dies there.
    base = FleetRun(build_fleet(spec), workload(busy, leak, hours=1.5), "k8s-default", seed=1).run()
    assert base.figures["oom_events"] >= 1


def test_a_checkpointed_grower_is_not_bridged_again_onto_a_gpu_it_outgrew() -> None:
    # The H100 is busy for 40 minutes. A known linear grower (30 GB rising to 60 GB) starts on
    # the A100 and is checkpointed before it overflows it. Bridged onto the A100 again, it would
    # outgrow it again (and a step schedule, which comes back where it was, at once): it waits.
    busy, grower = grower_behind_a_busy_h100("linear", 60_000.0, 20_000.0, 3000.0, busy_s=2400.0)
    run = known(FleetRun(build_fleet(A100_AND_H100), workload(busy, grower, hours=2.0), "fleetpilot", seed=1),
                "linear", 60_000.0)
    result = run.run()
    assert result.breakdown["bridged"] == 1
    assert result.breakdown["checkpointed"] == 1
    assert result.figures["oom_events"] == 0
    assert result.breakdown["completed"] == 2


def test_a_leak_comes_back_low_from_its_checkpoint_and_may_then_be_bridged_onto_the_same_room() -> None:
    # Checkpointed on the A100 (the H100 busy for 45 minutes), the leak is restored on the H100
    # once it frees, and starts over there: its signature is learnt to start over.
    busy, leak = grower_behind_a_busy_h100("leak", 50_000.0, 20_000.0, 3000.0, busy_s=2700.0)
    run = known(FleetRun(build_fleet(A100_AND_H100), workload(busy, leak, hours=2.0), "fleetpilot", seed=1),
                "leak", 50_000.0)
    result = run.run()
    assert (result.breakdown["bridged"], result.breakdown["checkpointed"]) == (1, 1)
    assert result.figures["oom_events"] == 0
    job = run.jobs[1]
    assert restores_start_over(run.memory.stats(job.signature))
    # The next checkpoint of that signature leaves it free to start again on an A100.
    run._enqueue(job, 0.0)
    run._start(job, 0, [0], 1000, 0.0)
    run._checkpoint(job, 1000.0, outgrown=True)
    assert (job.bridge_floor_mb, job.stopped_at_mb) == (0, 0)
    # One that outgrew the A100 sooner than a lookahead would only be stopped there again as soon.
    run._enqueue(job, 1000.0)
    run._start(job, 0, [0], 1000, 1000.0)
    run._checkpoint(job, 1000.0 + GROWTH_LOOKAHEAD_S - TICK_S, outgrown=True)
    assert job.bridge_floor_mb == int(run.state.gpu_mem_total[0, 0]) + 1


def test_a_checkpointed_run_asks_no_less_than_it_held_until_it_starts_again() -> None:
    # A step schedule comes back from its checkpoint at the level it had reached (26 GB of a
    # 14 GB ask): placed on a GPU that holds only its ask, it would die of OOM at once.
    growth = MemoryGrowth(pattern="steps", base_mb=8_000.0, peak_mb=32_000.0, duration_s=3600.0, n_steps=4)
    stepper = BenchTask(**{**task(0, duration=3600.0).__dict__, "growth": growth, "request_mb": 14_000.0})
    run = FleetRun(tiny_fleet(), workload(stepper), "fleetpilot", seed=1)
    job = run.jobs[0]
    run._enqueue(job, 0.0)
    run._start(job, 0, [0], 1000, 0.0)
    run._checkpoint(job, 2000.0)  # on its third level
    assert run._request(job).gpu_memory_mb >= 26_000 + CONTEXT_MB
    assert run._request(job, bridge=True).gpu_memory_mb >= 26_000 + CONTEXT_MB
    run._start(job, 0, [0], 1000, 2100.0)  # restored: its own samples speak from now on
    assert run._request(job).gpu_memory_mb == int(14_000 + CONTEXT_MB)


def test_a_run_is_a_function_of_its_seed_not_of_string_hashing(tmp_path: Path) -> None:
    # Python salts str hashes per process: a set of task ids or node names iterated while
    # deciding moves made two processes with the same seed disagree (this run did, before).
    salts = ("0", "1")
    # Both at once: each is one process on one core, and the suite's other core is idle here.
    runs = [subprocess.Popen([sys.executable, "-m", "fleetpilot.bench.fleet", "--fleet", "three-site", "--seed", "11",
                              "--json", str(tmp_path / f"run-{salt}.json")],
                             env={**os.environ, "PYTHONHASHSEED": salt},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for salt in salts]
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
    figures = []
    for salt in salts:
        data = json.loads((tmp_path / f"run-{salt}.json").read_text())
        figures.append({mode: {k: v for k, v in data[mode].items() if k != "wall_s"} for mode in ("baseline", "fleetpilot")})
    assert figures[0] == figures[1]


def test_fleetpilot_queues_short_work_before_long_work_and_the_baseline_first_come_first_served() -> None:
    # One GPU busy for 600 s; then a 2-hour task (arrived first) and a 5-minute one wait.
    tasks = (task(0, duration=600.0), task(1, duration=7200.0, arrival=10.0), task(2, duration=300.0, arrival=20.0))
    for mode, first in (("k8s-default", "t1"), ("fleetpilot", "t2")):
        run = FleetRun(tiny_fleet(), workload(*tasks, hours=3.0), mode, seed=1)
        run.run()
        started = sorted((j.task.task_id for j in run.jobs[1:]), key=lambda t: run.by_id[t].queue_s)
        assert started[0] == first, mode


@pytest.mark.parametrize(("aging", "first"), [(1.0, "t1"), (0.25, "t2")])
def test_fleetpilots_queue_aging_decides_whether_later_shorter_work_goes_first(aging: float, first: str) -> None:
    # One GPU busy for 2,000 s; a 1-hour task waits from 10 s, one 10 minutes shorter from 1,210 s.
    tasks = (task(0, duration=2000.0), task(1, duration=3600.0, arrival=10.0), task(2, duration=3000.0, arrival=1210.0))
    run = FleetRun(tiny_fleet(), workload(*tasks, hours=4.0), "fleetpilot", seed=1, queue_aging=aging)
    run.run()
    started = sorted((j.task.task_id for j in run.jobs[1:]), key=lambda t: run.by_id[t].task.arrival_s + run.by_id[t].queue_s)
    assert started[0] == first


def test_fleetpilot_clears_a_node_for_a_wide_task_when_its_tenants_fit_elsewhere() -> None:
    # Three 4-GPU nodes, two long single-GPU tasks on each: a 4-GPU task would wait ten
    # hours for a node to empty; moving two tenants costs a checkpoint each.
    singles = [task(i, duration=10 * 3600.0) for i in range(6)]
    wide = task(6, gpus=4, duration=1800.0, arrival=60.0)
    run = FleetRun(tiny_fleet(gpus=4, nodes=3), workload(*singles, wide, hours=12.0), "fleetpilot", seed=1)
    for i, job in enumerate(run.jobs[:6]):
        job.state = "pending"
        run._start(job, i // 2, [i % 2], 1000, 0.0)
    job = run.by_id["t6"]
    run._enqueue(job, 60.0)
    # No node has four free GPUs: the reservation is ten hours away, clearing one is cheaper.
    run._schedule(60.0)
    assert job.state == "running" and run.counts["clearings"] == 1 and run.counts["migrations_clearing"] == 2
    tenants = {t for g in range(4) for t in run.on_gpu.get((job.row, g), set())}
    assert tenants == {"t6"}
    # It waits for the longest checkpoint of the moved tasks (8 GB: 30 s + 2 s per GB).
    assert MIGRATION_BASE_S <= job.queue_s <= MIGRATION_BASE_S + 60.0
    # Each moved tenant stalls for its own checkpoint and restore, counted as its waiting.
    moved = [j for j in run.jobs[:6] if j.migrations == 1]
    assert len(moved) == 2
    assert all(MIGRATION_BASE_S <= j.queue_s <= MIGRATION_BASE_S + 60.0 for j in moved)


def test_fleetpilot_never_clears_a_node_by_pausing_a_task_past_its_deadline() -> None:
    # The scene of the test above, but the singles must end within 10 s of their declared
    # end: a checkpoint pause would make them late.
    singles = [task(i, duration=10 * 3600.0) for i in range(6)]
    singles = [BenchTask(**{**t.__dict__, "deadline_s": 10 * 3600.0 + 10.0}) for t in singles]
    wide = task(6, gpus=4, duration=1800.0, arrival=60.0)
    run = FleetRun(tiny_fleet(gpus=4, nodes=3), workload(*singles, wide, hours=12.0), "fleetpilot", seed=1)
    for i, job in enumerate(run.jobs[:6]):
        job.state = "pending"
        run._start(job, i // 2, [i % 2], 1000, 0.0)
    run._enqueue(run.by_id["t6"], 60.0)
    run._schedule(60.0)
    assert run.by_id["t6"].state == "pending" and run.counts["clearings"] == 0


def two_sites() -> Fleet:
    """Sites ``a`` and ``b``, one node of one A100 each."""
    shape = {"gpu_model": "A100-40GB", "gpus": 1, "cpu_milli": 64000, "memory_mb": 262144}
    return build_fleet({"name": "two", "sites": [
        {"name": name, "groups": [{"prefix": f"{name}n", "count": 1, "shape": shape}]} for name in ("a", "b")]})


def test_a_task_bound_to_sites_starts_at_any_of_them_and_nowhere_else() -> None:
    # Site a's GPU is taken (by a task whose deadline allows no pause to make way): a task
    # whose contract lists a and b starts at b; one bound to a alone waits for a, though b is free.
    busy = dataclasses.replace(task(0, duration=3600.0), deadline_s=3600.0 + 10.0)
    run = FleetRun(two_sites(), workload(busy, task(1), task(2), hours=2.0), "fleetpilot", seed=1)
    first, either, only_a = run.jobs
    at_a = run.node_site.index("a")
    first.state = "pending"
    run._start(first, at_a, [0], 1000, 0.0)
    run._bind(either, either.task.gpu_models, ("a", "b"))
    run._bind(only_a, only_a.task.gpu_models, ("a",))
    run._enqueue(only_a, 0.0)
    run._enqueue(either, 0.0)
    run._schedule(60.0)
    assert either.state == "running" and run.node_site[either.row] == "b"
    assert only_a.state == "pending"


def test_a_known_step_schedule_starts_on_a_small_gpu_by_its_envelope_and_leaves_it_before_its_step() -> None:
    # 31 GB, then 37.5 GB from 15 minutes, 44 GB from 30, 50 GB from 45 of its hour. The H100
    # is busy for 40 minutes: by its envelope, the run holds 38 GB for its first half hour,
    # which the A100 serves; it is checkpointed before the third step (no H100 yet) and
    # finishes on the H100 from where it was stopped.
    busy, steps = grower_behind_a_busy_h100("steps", 50_000.0, 30_000.0, 3600.0, busy_s=2400.0)
    t = np.arange(0.0, 3600.0, 60.0)
    envelope = run_envelope(t, steps.growth.memory_at(t) + CONTEXT_MB, 3600.0)

    def play(with_envelope: bool):
        run = known(FleetRun(build_fleet(A100_AND_H100), workload(busy, steps, hours=3.0), "fleetpilot", seed=1),
                    "steps", 50_300.0, envelope=envelope if with_envelope else ())
        return run, run.run()

    run, result = play(with_envelope=True)
    assert (result.breakdown["bridged"], result.breakdown["checkpointed"]) == (1, 1)
    assert result.figures["oom_events"] == 0
    assert result.breakdown["completed"] == 2
    job = run.jobs[1]
    assert 1200.0 < job.progress_s < 1800.0  # stopped before the step at 30 minutes, after its stay
    # Without the envelope it waits for the H100, and ends later.
    late, without = play(with_envelope=False)
    assert without.breakdown["bridged"] == 0 and without.figures["oom_events"] == 0
    assert job.finished_at is not None and late.jobs[1].finished_at is not None
    assert job.finished_at < late.jobs[1].finished_at - 600.0


def test_a_step_schedule_in_its_low_phase_moves_down_for_a_task_only_its_gpu_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A known step schedule (31 GB, then 37.5, 44 and 50 GB at each quarter of its hour) holds
    # the H100 from the start. Five minutes in, a 60 GB task that only the H100 holds arrives:
    # by its envelope the schedule fits the A100 for the next quarter hour, so it moves down,
    # and the waiter starts once its checkpoint is taken. The waiter ends before the schedule's
    # third step, and the schedule moves back up before it.
    steps = BenchTask(**{**task(0, pattern="steps", peak=50_000.0, request=30_000.0, duration=3600.0).__dict__,
                         "gpu_models": ("A100-40GB", "H100")})
    waiter = BenchTask(**{**task(1, peak=60_000.0, duration=900.0, arrival=300.0).__dict__, "gpu_models": ("H100",)})
    t = np.arange(0.0, 3600.0, 60.0)
    envelope = run_envelope(t, steps.growth.memory_at(t) + CONTEXT_MB, 3600.0)

    def play(with_envelope: bool) -> tuple[FleetRun, RunResult]:
        run = FleetRun(build_fleet(A100_AND_H100), workload(steps, waiter, hours=2.0), "fleetpilot", seed=1)
        run.memory.observe(Fingerprint(signature=run.jobs[0].signature, pattern="steps", pattern_confidence=1.0,
                                       growth_rate_mb_per_s=0.0, predicted_peak_mb=50_300.0, peak_low_mb=50_000.0,
                                       peak_high_mb=50_600.0, samples=40,
                                       envelope_mb=envelope if with_envelope else ()))
        return run, run.run()

    run, result = play(with_envelope=True)
    assert result.breakdown["migrations_down"] == 1 and result.breakdown["made_way"] == 0
    assert result.breakdown["migrations_bridge"] == 1  # back up to the H100 before its step
    assert result.figures["oom_events"] == 0 and result.breakdown["completed"] == 2
    # The waiter waited for the schedule's checkpoint (30 s + 2 s per GB) and a cycle, not its hour.
    assert run.jobs[1].queue_s < 240.0
    # Without the envelope nothing says where the schedule stands: it is not moved down, but
    # checkpointed to make way (its 55 minutes left are over three times the waiter's 15 and
    # the pause); and without making way either, the waiter waits for its end.
    late, _ = play(with_envelope=False)
    assert late.counts["migrations_down"] == 0 and late.counts["made_way"] == 1 and late.jobs[1].queue_s < 240.0
    monkeypatch.setattr(fleet_run, "MAKE_WAY_PER_ROUND", 0)
    later, _ = play(with_envelope=False)
    assert later.counts["migrations_down"] == 0 and later.jobs[1].queue_s > 3000.0


def test_a_run_moved_down_keeps_its_progress_but_teaches_no_envelope_from_where_it_went() -> None:
    # Moved at 10 minutes, the run's envelope is still read at its progress (its hold carries
    # when it began), but the series sampled after the move does not begin with the run: were
    # it learnt as one, every level would be taught ten minutes early.
    steps = BenchTask(**{**task(0, pattern="steps", peak=30_000.0, duration=3600.0).__dict__,
                         "gpu_models": ("A100-40GB", "H100")})
    run = FleetRun(build_fleet(A100_AND_H100), workload(steps, hours=2.0), "fleetpilot", seed=1)
    job = run.jobs[0]
    job.state = "pending"
    h100 = run.node_model.index("H100")
    run._start(job, h100, [0], 1000, 0.0)
    assert job.from_start and job.run_at == 0.0
    a100 = run.node_model.index("A100-40GB")
    assert run._migrate(job, 600.0, reason="down", target=Move(task_id="t0", row=a100, gpus=(0,), milli=1000),
                        bridge=True)
    assert job.bridged and job.from_start and job.run_at == 0.0
    assert job.fingerprinter is not None and not job.fingerprinter.from_start


def test_a_run_with_hours_left_makes_way_for_a_short_task_and_goes_on_from_its_checkpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Five hours of run hold the only GPU when a ten-minute task arrives: the run is
    # checkpointed, the task runs after the pause, and the run goes on from where it stood.
    long, short = task(0, duration=5 * 3600.0), task(1, duration=600.0, arrival=600.0)

    def play() -> tuple[FleetRun, RunResult]:
        run = FleetRun(tiny_fleet(), workload(long, short, hours=8.0), "fleetpilot", seed=1)
        return run, run.run()

    run, result = play()
    assert result.breakdown["made_way"] == 1 and result.breakdown["completed"] == 2
    assert result.figures["oom_events"] == 0
    first, waiter = run.jobs
    assert waiter.queue_s < 240.0  # the checkpoint pause (30 s + 2 s per GB) and a cycle
    # Its run begins once that pause is over, not when it was decided.
    assert waiter.finished_at is not None and waiter.finished_at >= short.arrival_s + waiter.queue_s + short.duration_s
    assert 500.0 <= first.progress_s <= 720.0  # kept: checkpointed at about ten minutes in
    assert first.finished_at is not None and first.finished_at < 5 * 3600.0 + 1800.0
    # Without making way the task waits for the run's five hours.
    monkeypatch.setattr(fleet_run, "MAKE_WAY_PER_ROUND", 0)
    late, without = play()
    assert without.breakdown["made_way"] == 0 and late.jobs[1].queue_s > 4 * 3600.0


def test_a_run_with_hours_left_makes_room_on_its_gpu_for_a_short_share(monkeypatch: pytest.MonkeyPatch) -> None:
    # A five-hour run holds the only GPU when a ten-minute task asking for half a GPU arrives:
    # the run is checkpointed, the share runs after the pause, and the run goes on from where
    # it stood. (The share bounds its wait loosely: the negotiator does not count on room
    # being made, and would refuse five minutes.)
    long = task(0, duration=5 * 3600.0)
    short = dataclasses.replace(task(1, duration=600.0, arrival=600.0, milli=500), max_queue_s=6 * 3600.0)

    def play() -> tuple[FleetRun, RunResult]:
        run = FleetRun(tiny_fleet(), workload(long, short, hours=8.0), "fleetpilot", seed=1)
        return run, run.run()

    run, result = play()
    assert result.breakdown["made_room"] == 1 and result.breakdown["made_way"] == 0
    assert result.breakdown["completed"] == 2 and result.figures["oom_events"] == 0
    first, waiter = run.jobs
    assert waiter.queue_s < 240.0
    assert 500.0 <= first.progress_s <= 720.0
    monkeypatch.setattr(fleet_run, "MAKE_WAY_PER_ROUND", 0)
    late, without = play()
    assert without.breakdown["made_room"] == 0 and late.jobs[1].queue_s > 4 * 3600.0


def test_the_negotiator_counts_a_gpu_held_by_shares_as_freeing_when_its_last_share_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A run of 700 thousandths holds the only GPU for five hours when a task of half a GPU
    # that may wait six arrives. As the sla service's view has it, the GPU frees when the run
    # ends: the task is admitted and waits for it (not refused as if the GPU never freed).
    long = task(0, duration=5 * 3600.0, milli=700)
    patient = dataclasses.replace(task(1, duration=600.0, arrival=600.0, milli=500), max_queue_s=6 * 3600.0)
    monkeypatch.setattr(fleet_run, "MAKE_WAY_PER_ROUND", 0)  # no room made: it waits for the run's end
    run = FleetRun(tiny_fleet(), workload(long, patient, hours=8.0), "fleetpilot", seed=1)
    result = run.run()
    assert result.breakdown["rejected"] == 0 and result.breakdown["admitted"] == 2
    assert run.jobs[1].state == "done" and run.jobs[1].queue_s > 4 * 3600.0


def test_the_negotiators_view_keeps_the_services_headroom_and_counts_preemptible_gpus() -> None:
    # Four GPUs on one node: a best_effort run on one, a standard run on another. As the sla
    # service's view has it: two free, one of them headroom for guaranteed tiers, one
    # preemptible, three a vip could clear on the node, and both busy GPUs freeing.
    runs = (task(0, duration=3600.0, tier="best_effort"), task(1, duration=7200.0))
    run = FleetRun(tiny_fleet(gpus=4), workload(*runs, hours=3.0), "fleetpilot", seed=1)
    for gpu, job in enumerate(run.jobs):
        job.state = "pending"
        run._start(job, 0, [gpu], 1000, 0.0)
    (pool,) = run._fleet_view(60.0, ahead_of=(0, 0.0)).pools
    assert (pool.free_gpus, pool.reserved_gpus, pool.preemptible_gpus, pool.most_clearable_on_a_node) == (2, 1, 1, 3)
    assert sorted(in_s for in_s, _ in pool.completions) == pytest.approx([3540.0, 7140.0])


@pytest.mark.parametrize(("asks", "stopped"), [(700, None), (500, "t1")])
def test_room_is_made_only_where_a_tenants_going_leaves_enough(asks: int, stopped: str | None) -> None:
    # Two runs of 500 thousandths share the GPU, the second with more left. A waiting share
    # of 700 would not fit with either gone: neither is stopped. One of 500 would: the run
    # with the most left makes room, and the share starts on the GPU.
    first, second = task(0, duration=2 * 3600.0, milli=500), task(1, duration=5 * 3600.0, milli=500)
    waiter = task(2, duration=600.0, milli=asks)
    run = FleetRun(tiny_fleet(), workload(first, second, waiter, hours=8.0), "fleetpilot", seed=1)
    tenants, share = run.jobs[:2], run.jobs[2]
    for job in tenants:
        job.state = "pending"
        run._start(job, 0, [0], 500, 0.0)
    run._enqueue(share, 600.0)
    run.blocked_shares = {share.task.task_id}
    run._make_room(600.0, None)
    assert [j.task.task_id for j in run.jobs if j.state == "pending"] == ([share.task.task_id] if stopped is None
                                                                          else [stopped])
    assert run.counts["made_room"] == (stopped is not None)
    assert (share.state == "running") == (stopped is not None)


def test_a_program_whose_runs_nearly_all_fit_a_gpu_runs_there_and_a_run_that_outgrew_it_does_not_again() -> None:
    # The H100 is busy for 40 minutes. The program's mean peak, 40 GB with its context, plus 5%
    # is more than the A100's 40,960 MB, but its 40 known runs held at most 40.6 GB.
    def runs(peak: float, *, spread: bool = True) -> FleetRun:
        busy = BenchTask(**{**task(0, duration=2400.0).__dict__, "gpu_models": ("H100",)})
        mine = BenchTask(**{**task(1, peak=peak, request=20_000.0, program="ft").__dict__,
                            "gpu_models": ("A100-40GB", "H100")})
        run = known(FleetRun(build_fleet(A100_AND_H100), workload(busy, mine, hours=1.5), "fleetpilot", seed=1),
                    "flat", 40_000.0)
        for k in range(40 if spread else 1):
            run.memory.observe_run_peak(run.jobs[1].signature, 39_400.0 + 30.0 * k)
        return run

    fits = runs(39_800.0)
    result = fits.run()
    assert fits.jobs[1].queue_s == 0.0  # it started on the A100 as it arrived
    assert (result.figures["oom_events"], result.breakdown["completed"], result.breakdown["checkpointed"]) == (0, 2, 0)
    # Without the runs known, it waits for the H100: the busy task makes way for it.
    unknown = runs(39_800.0, spread=False)
    result = unknown.run()
    assert unknown.jobs[1].queue_s > 0.0 and result.breakdown["checkpointed"] == 1
    assert result.figures["oom_events"] == 0
    # A run of it that goes higher dies on the A100 once; then it asks by its peak again (one
    # run above the A100 in 41 known is still within the spread's share: the spread alone
    # would send it back to the A100).
    outgrew = runs(41_500.0)
    result = outgrew.run()
    assert (result.figures["oom_events"], result.breakdown["completed"]) == (1, 2)


def test_a_task_waiting_for_its_first_start_is_given_what_a_run_that_ended_meanwhile_taught() -> None:
    # The H100 is busy for 25 minutes (too little left to make way). A run of the program that
    # only accepts the A100 ends after 10 minutes: its program's 20th known run, whose spread
    # now says the A100 holds them all. The same program's task that waits for the H100 (its
    # mean peak plus 5% is more than the A100) is given that at the next cycle.
    busy = BenchTask(**{**task(0, duration=1500.0).__dict__, "gpu_models": ("H100",)})
    teacher = BenchTask(**{**task(1, peak=39_800.0, request=20_000.0, program="ft").__dict__,
                           "gpu_models": ("A100-40GB",)})
    waiter = BenchTask(**{**task(2, peak=39_800.0, request=20_000.0, program="ft", arrival=60.0).__dict__,
                          "gpu_models": ("A100-40GB", "H100")})
    run = known(FleetRun(build_fleet(A100_AND_H100), workload(busy, teacher, waiter, hours=1.0), "fleetpilot", seed=1),
                "flat", 40_000.0)
    for k in range(19):
        run.memory.observe_run_peak(run.jobs[1].signature, 39_400.0 + 30.0 * k)
    result = run.run()
    job = run.jobs[2]
    assert job.prediction is not None and job.prediction.fit_peak_mb == 39_800.0 + CONTEXT_MB
    assert 540.0 <= job.queue_s <= 660.0  # started the cycle after the teacher ended, not at 1,500 s
    assert (result.figures["oom_events"], result.breakdown["completed"], result.breakdown["checkpointed"]) == (0, 3, 0)


def test_told_each_runs_true_peak_the_loop_asks_the_gpu_that_holds_it() -> None:
    # A program never seen before asks 10 GB but holds 45 GB within its first minute. Asked
    # for what it said, it starts on the A100 and dies there; told its true peak (the
    # analysis run of ``--peaks-known``), it starts on the H100 and completes.
    liar = task(0, pattern="flat", peak=45_000.0, request=10_000.0)
    liar = BenchTask(**{**liar.__dict__, "gpu_models": ("A100-40GB", "H100")})
    fleet = build_fleet(A100_AND_H100)
    ours = FleetRun(fleet, workload(liar), "fleetpilot", seed=1).run()
    told = FleetRun(fleet, workload(liar), "fleetpilot", seed=1, knows_peaks=True).run()
    assert ours.figures["oom_events"] >= 1
    assert told.figures["oom_events"] == 0 and told.breakdown["completed"] == 1
    with pytest.raises(ValueError, match="true peak"):
        FleetRun(fleet, workload(liar), "k8s-default", seed=1, knows_peaks=True)


def test_peaks_known_is_reported_beside_the_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fleet.json"
    assert main(["--fleet", "three-site", "--seed", "5", "--tasks", "150", "--hours", "0.5", "--arrivals", "generated",
                 "--peaks-known", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    known = data["peaks_known"]
    assert known["ratio"]["mean_queue_s"] == pytest.approx(known["mean_queue_s"] / data["baseline"]["mean_queue_s"])
    assert f"OOM events {known['oom_events']:.0f} (" in capsys.readouterr().out


def test_after_a_long_wait_for_the_h100_a_program_most_of_whose_runs_fit_the_a100_starts_there() -> None:
    # The H100 is busy for 40 minutes; a task bound to it waits all that while, then holds it
    # for 40 more. A program whose spread asks the H100 (6 of its 40 known runs, 15%, went
    # above the A100) arrives meanwhile: against a 40-minute wait for a 10-minute run that
    # share is worth risking (``policy.spread``), so it starts on the A100 at once.
    def runs(*, waited: bool) -> FleetRun:
        busy = BenchTask(**{**task(0, duration=2400.0).__dict__, "gpu_models": ("H100",)})
        # Its SLA lets it wait the 40 minutes (not, refused that, move to an A100 offered it).
        bound = BenchTask(**{**task(1, duration=2400.0).__dict__, "gpu_models": ("H100",), "max_queue_s": 3000.0})
        # Its SLA may wait for the H100: admitted on it, the A100 among its contract's models.
        mine = BenchTask(**{**task(2, peak=39_000.0, request=20_000.0, program="ft",
                                   arrival=2460.0 if waited else 60.0).__dict__, "gpu_models": ("A100-40GB", "H100"),
                            "max_queue_s": 6000.0})
        run = FleetRun(build_fleet(A100_AND_H100), workload(busy, bound, mine, hours=2.0), "fleetpilot", seed=1)
        run.memory.observe(Fingerprint(signature=run.jobs[2].signature, pattern="flat", pattern_confidence=1.0,
                                       growth_rate_mb_per_s=0.0, predicted_peak_mb=40_000.0, peak_low_mb=39_000.0,
                                       peak_high_mb=41_000.0, samples=40))
        for k in range(40):
            run.memory.observe_run_peak(run.jobs[2].signature, 41_500.0 if k % 7 == 0 else 39_000.0)
        return run

    run = runs(waited=True)
    result = run.run()
    assert run.waits.for_at_least(81_559.0) >= 2400.0 / 2  # the bound task's 40 minutes, with busy's 0
    assert run.jobs[2].queue_s == 0.0 and result.figures["oom_events"] == 0
    # Arrived before anyone had waited for the H100, it asks the H100 and waits for it.
    early = runs(waited=False)
    early.run()
    assert early.jobs[2].queue_s > 0.0


def test_while_no_run_of_a_program_has_ended_its_next_task_asks_what_a_run_in_progress_shows() -> None:
    # A program never seen before asks 20 GB; its runs grow steadily from 22.5 GB to 45 GB.
    # Its first run holds the H100 for an hour; a second, of ten minutes, arrives 15 minutes
    # in and accepts the A100 too. By its user's 20 GB it starts on the A100 and dies there
    # before its own series is trusted; by the first run's trusted fingerprint it knows it
    # grows past the A100, starts there as a bridge and is stopped before it overflows.
    first = BenchTask(**{**task(0, pattern="linear", peak=45_000.0, request=20_000.0, duration=3600.0,
                                program="ft").__dict__, "gpu_models": ("H100",)})
    second = BenchTask(**{**task(1, pattern="linear", peak=45_000.0, request=20_000.0, arrival=900.0,
                                 program="ft").__dict__, "gpu_models": ("A100-40GB", "H100")})
    run = FleetRun(build_fleet(A100_AND_H100), workload(first, second, hours=1.5), "fleetpilot", seed=1)
    result = run.run()
    given = run.live[run.jobs[1].signature]
    assert given.pattern == "linear" and abs(given.predicted_peak_mb - (45_000.0 + CONTEXT_MB)) < 2_000.0
    assert (result.figures["oom_events"], result.breakdown["completed"]) == (0, 2)


@pytest.mark.parametrize(("name", "ratio", "shown"), [
    ("mean_queue_s", 0.2016, "-79.8%"),  # a miss: never printed as "-80%" beside MISSED
    ("mean_queue_s", 0.1995, "-80.0%"),
    ("utilisation", 1.07, "+7.0%"),
])
def test_a_target_s_figure_is_printed_to_a_tenth_of_a_percent(name, ratio, shown):
    from fleetpilot.bench.fleet_report import _target_text  # noqa: PLC0415

    assert _target_text(name, ratio).startswith(shown + ",")


@pytest.mark.parametrize("preempts", [None, False])
def test_the_baselines_priority_classes_preempt_unless_told_not_to_a_vip_pod_starts_at_once_and_its_victim_from_scratch(
        preempts: bool | None) -> None:
    # One GPU, a 2-hour best_effort job on it; a 10-minute vip pod arrives at 600 s.
    tasks = (task(0, duration=7200.0, tier="best_effort"), task(1, duration=600.0, arrival=600.0, tier="vip"))
    run = FleetRun(tiny_fleet(), workload(*tasks, hours=5.0), "k8s-default", seed=1, preempts=preempts)
    result = run.run()
    evicted, vip = run.jobs
    assert evicted.state == vip.state == "done"
    if preempts is None:
        # It waits only for its victim's grace period; the victim's Job starts it again from
        # scratch once the vip pod is done: its first 600 s are lost, and the attempt counts.
        assert vip.queue_s == TERMINATION_GRACE_S
        assert evicted.attempts == 2 and evicted.finished_at >= 600.0 + TERMINATION_GRACE_S + 600.0 + 7200.0
        assert result.breakdown["preempted"] == 1
    else:
        assert vip.queue_s >= 7200.0 - 600.0
        assert evicted.attempts == 1 and result.breakdown["preempted"] == 0


def test_only_the_baseline_plays_kube_schedulers_preemption() -> None:
    with pytest.raises(ValueError, match="DefaultPreemption"):
        FleetRun(tiny_fleet(), workload(task(0)), "fleetpilot", seed=1, preempts=True)


@pytest.mark.parametrize(("tenant_tier", "resumes"), [("best_effort", True), ("best_effort", False),
                                                      ("standard", True)])
def test_fleetpilots_vip_evicts_best_effort_work_only_and_the_eviction_counts_toward_no_backoff_limit(
        tenant_tier: str, resumes: bool) -> None:
    # One GPU, a 2-hour task on it; a 10-minute vip task arrives at 600 s. As the policy
    # service does, the vip evicts a best-effort tenant and waits only for its grace period;
    # the tenant goes on from the checkpoint it takes on the SIGTERM once the vip is done (a
    # program that does not resume starts over). A standard tenant it does not evict (it is
    # checkpointed to make way for the vip at a later cycle: its work is kept).
    tenant_task = task(0, duration=7200.0, tier=tenant_tier)
    tasks = (tenant_task if resumes else not_resumable(tenant_task), task(1, duration=600.0, arrival=600.0, tier="vip"))
    run = FleetRun(tiny_fleet(), workload(*tasks, hours=5.0), "fleetpilot", seed=1)
    result = run.run()
    tenant, vip = run.jobs
    assert tenant.state == vip.state == "done"
    if tenant_tier == "best_effort":
        assert vip.queue_s == TERMINATION_GRACE_S
        over = 600.0 + TERMINATION_GRACE_S + 600.0 + 7200.0  # the vip's end, then the whole run again
        if resumes:
            # Its first 600 s are kept: it ends 600 s sooner than over, give or take its pause.
            assert over - 600.0 <= tenant.finished_at < over - 300.0
        else:
            assert tenant.finished_at >= over
        assert tenant.evictions == 1
        assert result.breakdown["preempted"] == 1 and result.breakdown["backoff_failed"] == 0
    else:
        assert vip.queue_s > TERMINATION_GRACE_S
        assert tenant.evictions == 0 and result.breakdown["preempted"] == 0
        assert tenant.finished_at < 600.0 + vip.queue_s + 600.0 + 7200.0  # it went on where it was stopped


@pytest.mark.parametrize("older_resumes", [False, True])
def test_fleetpilots_vip_evicts_the_best_effort_task_that_loses_the_least_work(older_resumes: bool) -> None:
    # Two one-GPU nodes, each running a 2-hour best-effort task that starts over, one started
    # 5 minutes after the other; the vip arriving at 10 minutes evicts the younger
    # (``policy.preempt``: the work thrown away plus a restart), and the older runs on
    # untouched. An older one that resumes from its checkpoint loses its restart only: it is
    # the one evicted.
    older = task(0, duration=7200.0, tier="best_effort")
    tasks = (older if older_resumes else not_resumable(older),
             not_resumable(task(1, duration=7200.0, arrival=300.0, tier="best_effort")),
             task(2, duration=600.0, arrival=600.0, tier="vip"))
    run = FleetRun(tiny_fleet(nodes=2), workload(*tasks, hours=5.0), "fleetpilot", seed=1)
    run.run()
    first, second, vip = run.jobs
    assert (first.evictions, second.evictions) == ((1, 0) if older_resumes else (0, 1))
    assert vip.queue_s == TERMINATION_GRACE_S
    if not older_resumes:
        assert first.finished_at < second.finished_at


@pytest.mark.parametrize(("allowed", "deadline", "resumes", "evicted"), [
    (True, 20000.0, True, True),  # its deadline holds through the pause and a whole 300-s wait
    (False, 20000.0, True, False),  # the operator keeps standard work from vips (the default)
    (True, 7400.0, True, False),  # its run ends by 7200 s, but not with a pause and a wait on top
    (True, None, True, False),  # no deadline: nothing says an eviction spares it
    (True, 20000.0, False, False),  # it would start over
])
def test_fleetpilots_vip_evicts_standard_work_only_when_allowed_and_its_contract_spares_it(
        allowed: bool, deadline: float | None, resumes: bool, evicted: bool) -> None:
    # One GPU, a 2-hour standard task on it; a 10-minute vip task arrives at 600 s.
    tenant = dataclasses.replace(task(0, duration=7200.0), deadline_s=deadline)
    tasks = (tenant if resumes else not_resumable(tenant), task(1, duration=600.0, arrival=600.0, tier="vip"))
    run = FleetRun(tiny_fleet(), workload(*tasks, hours=5.0), "fleetpilot", seed=1, vip_evicts_standard=allowed)
    result = run.run()
    standard, vip = run.jobs
    assert standard.state == vip.state == "done"
    assert (standard.evictions, result.breakdown["preempted"]) == ((1, 1) if evicted else (0, 0))
    if evicted:
        assert vip.queue_s == TERMINATION_GRACE_S
        assert standard.finished_at <= deadline  # the contract it was evicted under still holds
    else:
        assert vip.queue_s > TERMINATION_GRACE_S


def test_fleetpilots_vip_evicts_best_effort_work_before_standard_work_its_contract_spares() -> None:
    # Two one-GPU nodes: a 2-hour standard task whose deadline spares an eviction, a 1-hour
    # best-effort one; both resume, so either loses only a restart, and among equals the one
    # with the most run left would go (``Preemption.rank``). The best-effort one goes first.
    standard = dataclasses.replace(task(0, duration=7200.0), deadline_s=20000.0)
    tasks = (standard, task(1, duration=3600.0, tier="best_effort"), task(2, duration=600.0, arrival=600.0, tier="vip"))
    run = FleetRun(tiny_fleet(nodes=2), workload(*tasks, hours=5.0), "fleetpilot", seed=1, vip_evicts_standard=True)
    run.run()
    standard_job, best_effort, vip = run.jobs
    assert (standard_job.evictions, best_effort.evictions) == (0, 1)
    assert vip.queue_s == TERMINATION_GRACE_S


def test_only_fleetpilots_vips_may_evict_standard_work() -> None:
    with pytest.raises(ValueError, match="standard work"):
        FleetRun(tiny_fleet(), workload(task(0)), "k8s-default", seed=1, vip_evicts_standard=True)


def not_resumable(t: BenchTask) -> BenchTask:
    """``t`` of a program that does not go on from a checkpoint."""
    return BenchTask(**{**t.__dict__, "resumable": False})


def test_a_run_that_cannot_resume_does_not_make_way_and_the_short_task_waits_for_it() -> None:
    long, short = task(0, duration=5 * 3600.0), task(1, duration=600.0, arrival=600.0)
    run = FleetRun(tiny_fleet(), workload(not_resumable(long), short, hours=8.0), "fleetpilot", seed=1)
    result = run.run()
    assert result.breakdown["made_way"] == 0 and result.breakdown["completed"] == 2
    assert run.jobs[1].queue_s > 4 * 3600.0


def test_a_leak_that_cannot_resume_is_not_bridged_and_waits_for_the_gpu_that_holds_its_peak() -> None:
    # The run of ``test_a_known_leak_starts_on_a_small_gpu_and_moves_up_before_it_overflows``:
    # moved up, it would start over, so it waits for the H100 instead of starting on the A100.
    busy, leak = grower_behind_a_busy_h100("leak", 50_000.0, 30_000.0, 2400.0, busy_s=1200.0)
    run = known(FleetRun(build_fleet(A100_AND_H100), workload(busy, not_resumable(leak), hours=1.5), "fleetpilot",
                         seed=1), "leak", 50_300.0)
    result = run.run()
    assert result.breakdown["bridged"] == 0 and result.breakdown["migrations_bridge"] == 0
    assert result.figures["oom_events"] == 0 and result.breakdown["completed"] == 2
    assert run.jobs[1].queue_s >= 1200.0 - 60.0


def test_a_run_that_cannot_resume_is_moved_off_a_failing_gpu_and_starts_over() -> None:
    fault = FaultPlan(node="n00", gpu=0, kind="degrading", onset_s=600.0, fails_s=600.0 + 2.5 * 3600)
    spans = {}
    for resumable in (True, False):
        long_task = task(0, duration=4 * 3600.0, peak=8000.0)
        run = FleetRun(tiny_fleet(gpus=2), workload(long_task if resumable else not_resumable(long_task), hours=6.0,
                                                    faults=(fault,)), "fleetpilot", seed=1)
        result = run.run()
        assert result.breakdown["migrations_maintenance"] == 1 and result.breakdown["gpu_failure_kills"] == 0
        [job] = run.jobs
        assert job.finished_at is not None
        spans[resumable] = job.finished_at
    # Started over where it was moved, it ends later by about the run it had done.
    moved_at = spans[True] - 4 * 3600.0  # the resumable run lost only its pause
    assert spans[False] - spans[True] > 0.5 * moved_at


def test_a_share_of_resumable_programs_changes_that_flag_only_program_by_program() -> None:
    fleet = load_fleet_spec()
    every = generate_workload(fleet, seed=5, n_tasks=400, load=1.3, span_s=3600.0)
    half = generate_workload(fleet, seed=5, n_tasks=400, load=1.3, span_s=3600.0, resumable_share=0.5)
    assert half == generate_workload(fleet, seed=5, n_tasks=400, load=1.3, span_s=3600.0, resumable_share=0.5)
    assert all(t.resumable for t in every.tasks)
    for a, b in zip(every.tasks, half.tasks, strict=True):
        assert BenchTask(**{**b.__dict__, "resumable": True}) == a
    by_program = {}
    for t in half.tasks:
        assert by_program.setdefault(t.program, t.resumable) == t.resumable  # a program resumes or not, every run
    assert 0.2 < np.mean(list(by_program.values())) < 0.8
    assert "50% of the programs resuming" in half.describe() and "resuming" not in every.describe()
    with pytest.raises(ValueError, match="resumable share"):
        generate_workload(fleet, seed=5, n_tasks=400, load=1.3, span_s=3600.0, resumable_share=1.5)


def test_a_task_stopped_in_the_cycle_its_fingerprint_changed_leaves_no_hold_behind() -> None:
    """A bridged run checkpointed off its GPUs in the cycle its fingerprint changed: its
    holds went back with the stop, and its hold moved again after it (to the new peak) left
    a phantom on the GPUs it had left, which no task held and none could use."""
    run = FleetRun(tiny_fleet(gpus=2), workload(task(0, pattern="linear", peak=20_000.0, duration=3600.0)),
                   "fleetpilot", seed=1)
    run._arrivals_until(deque(run.jobs), 60.0)
    (job,) = run.jobs
    assert job.state == "running"
    run._checkpoint(job, 60.0)
    free = run.state.gpu_mem_free.copy()
    job.prediction = Fingerprint(signature=job.signature, pattern="linear", pattern_confidence=0.9,
                                 growth_rate_mb_per_s=5.0, predicted_peak_mb=30_000.0, peak_low_mb=28_000.0,
                                 peak_high_mb=32_000.0)
    run._reserve_again(job)
    assert (run.state.gpu_mem_free == run.state.gpu_mem_total).all()
    assert (run.state.gpu_mem_free == free).all()


@pytest.mark.parametrize(("models", "checkpointed"), [(("A100-40GB", "H100"), True), (("A100-40GB",), False)])
def test_a_run_heading_past_its_gpu_is_checkpointed_only_when_a_bigger_gpu_it_accepts_exists(
        models: tuple[str, ...], checkpointed: bool) -> None:
    # Alone on a whole A100 (the H100 busy), a run predicted to pass 40 GB is checkpointed to
    # wait for the H100 it accepts; one that accepts only A100s would come back to no more
    # room than it has, and runs on (the policy service's ``checkpoint``).
    grower = BenchTask(**{**task(0, peak=30_000.0, duration=3600.0).__dict__, "gpu_models": models})
    blocker = BenchTask(**{**task(1, duration=7200.0).__dict__, "gpu_models": ("H100",)})
    run = FleetRun(build_fleet(A100_AND_H100), workload(grower, blocker, hours=2.0), "fleetpilot", seed=1)
    job, busy = run.jobs
    for j, model in ((busy, "H100"), (job, "A100-40GB")):
        j.state = "pending"
        run._start(j, run.node_model.index(model), [0], 1000, 0.0)
    job.prediction = Fingerprint(signature=job.signature, pattern="flat", pattern_confidence=0.9,
                                 growth_rate_mb_per_s=0.0, predicted_peak_mb=45_000.0, peak_low_mb=44_000.0,
                                 peak_high_mb=46_000.0)
    run._rebalance(job, 600.0)
    assert (job.state, run.counts["checkpointed"]) == (("pending", 1) if checkpointed else ("running", 0))


def _run_alone_on_the_a100(pattern: str, samples: list[tuple[float, float]]) -> tuple[FleetRun, object]:
    """A run alone on the A100-40GB, the H100 free, predicted (``pattern``) at 45 GB, with the
    memory ``samples`` the service would have kept of it; not watched by a fingerprinter, so
    that a cycle reads no sample of the simulator's."""
    ramp = BenchTask(**{**task(0, peak=4_000.0, duration=10_000.0).__dict__, "gpu_models": ("A100-40GB", "H100")})
    run = FleetRun(build_fleet(A100_AND_H100), workload(ramp, hours=3.0), "fleetpilot", seed=1)
    (job,) = run.jobs
    job.state = "pending"
    run._start(job, run.node_model.index("A100-40GB"), [0], 1000, 0.0)
    job.fingerprinter = None
    job.prediction = Fingerprint(signature=job.signature, pattern=pattern, pattern_confidence=0.9,
                                 growth_rate_mb_per_s=4.0, predicted_peak_mb=45_000.0, peak_low_mb=43_000.0,
                                 peak_high_mb=47_000.0, time_to_peak_s=9_000.0)
    for at, held in samples:
        run._keep_usage(job, at, held)
    return run, job


LEVELLED_OFF = [(300.0 + 60.0 * k, 4_000.0) for k in range(5)]  # a warm-up ramp that levelled off at 4 GB


@pytest.mark.parametrize(("pattern", "samples", "stays"), [
    ("linear", LEVELLED_OFF, True),   # its rate, carried 240 s ahead, fits: the 45-GB line is not believed yet
    ("leak", LEVELLED_OFF, False),    # an accelerating leak outruns its average rate: moved on its prediction
    ("linear", LEVELLED_OFF[:1], False),  # one sample measures no rate
])
def test_a_line_is_moved_up_for_its_predicted_peak_only_once_its_measured_rate_says_so(pattern, samples, stays):
    # As the policy service's ``rebalance.climbs_within_its_gpu``: a line fitted to a long run's
    # first minutes reads a warm-up ramp as a climb to 45 GB; the run stays on its A100 while
    # its measured rate fits there, and is looked at again every cycle.
    run, job = _run_alone_on_the_a100(pattern, samples)
    run.climbing = {job.task.task_id}
    run._observe_tasks(540.0)
    on = run.node_model[job.row]
    assert (on, run.counts["migrations_oom"]) == (("A100-40GB", 0) if stays else ("H100", 1))
    assert (job.task.task_id in run.climbing) is stays


def test_a_line_whose_measured_rate_outruns_its_gpu_is_not_held_back() -> None:
    # 50 MB/s from 20 GB, at 32 GB now: within 240 s it would pass 98% of the A100's 40 GB.
    climbing = [(300.0 + 60.0 * k, 20_000.0 + 3_000.0 * k) for k in range(5)]
    run, job = _run_alone_on_the_a100("linear", climbing)
    assert not run._climbs_within_its_gpu(job)
    run, job = _run_alone_on_the_a100("linear", LEVELLED_OFF)
    assert run._climbs_within_its_gpu(job)


def test_a_sample_older_than_the_lookahead_is_not_kept() -> None:
    run, job = _run_alone_on_the_a100("linear", [(0.0, 1_000.0), (100.0, 2_000.0), (400.0, 4_000.0)])
    assert list(run.usage[job.task.task_id]) == [(400.0, 4_000.0)]


@pytest.mark.parametrize(("peak", "held_after"), [
    (20_000.0, 21_012),  # grows to the interval's top plus the margin: the GPU has room
    (5_000.0, 10_000),   # a prediction that falls leaves the hold: the service never shrinks one
    (60_000.0, 10_000),  # more than its A100 has free: not grown, the predicted-OOM check decides
])
def test_a_running_task_s_hold_moves_as_the_service_resizes_it(peak: float, held_after: int) -> None:
    run = FleetRun(tiny_fleet(gpus=1), workload(task(0, peak=8_000.0, duration=3600.0)), "fleetpilot", seed=1)
    (job,) = run.jobs
    job.state = "pending"
    run._start(job, 0, [0], 1000, 0.0)
    total = int(run.state.gpu_mem_total[0, 0])
    run.state.gpu_mem_free[0, 0] += job.reserved_mb - 10_000  # held at 10 GB, whatever its ask was
    job.reserved_mb = 10_000
    job.prediction = Fingerprint(signature=job.signature, pattern="flat", pattern_confidence=0.9,
                                 growth_rate_mb_per_s=0.0, predicted_peak_mb=peak, peak_low_mb=peak - 500.0,
                                 peak_high_mb=peak + 500.0)
    run._reserve_again(job)
    assert job.reserved_mb == held_after
    assert int(run.state.gpu_mem_free[0, 0]) == total - held_after


def test_a_hold_that_found_no_room_grows_in_a_later_cycle_once_room_frees() -> None:
    # The service's rebalance round looks at every run each round, not only at runs whose
    # fingerprint changed: a neighbour's hold given back lets the resize through.
    run = FleetRun(tiny_fleet(gpus=1), workload(task(0, peak=8_000.0, duration=3600.0)), "fleetpilot", seed=1)
    (job,) = run.jobs
    job.state = "pending"
    run._start(job, 0, [0], 1000, 0.0)
    run.state.gpu_mem_free[0, 0] += job.reserved_mb - 10_000
    job.reserved_mb = 10_000
    job.prediction = Fingerprint(signature=job.signature, pattern="flat", pattern_confidence=0.9,
                                 growth_rate_mb_per_s=0.0, predicted_peak_mb=20_000.0, peak_low_mb=19_500.0,
                                 peak_high_mb=20_500.0)
    neighbour = int(run.state.gpu_mem_free[0, 0]) - 5_000  # what another tenant holds: 5 GB left free
    run.state.gpu_mem_free[0, 0] -= neighbour
    run._observe_tasks(60.0)
    assert job.reserved_mb == 10_000  # 11 GB more does not fit in 5 GB
    run.state.gpu_mem_free[0, 0] += neighbour  # the neighbour ended
    run._observe_tasks(120.0)
    assert job.reserved_mb == 21_012


def test_a_resize_and_making_way_draw_on_one_budget_of_the_cycle_s_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    # As the service's round stops at ``max_migrations_per_round`` decisions of every kind: at
    # two decisions a cycle, a resize leaves room to make way for one waiting task, not two.
    monkeypatch.setattr(fleet_run, "DECISIONS_PER_CYCLE", 2)
    runs = [task(k, duration=5 * 3600.0) for k in range(3)]
    waiters = [task(3 + k, duration=600.0, arrival=600.0) for k in range(2)]
    run = FleetRun(tiny_fleet(gpus=3), workload(*runs, *waiters, hours=8.0), "fleetpilot", seed=1)
    for gpu, job in enumerate(run.jobs[:3]):
        job.state = "pending"
        run._start(job, 0, [gpu], 1000, 0.0)
    grows = run.jobs[0]
    run.state.gpu_mem_free[0, 0] += grows.reserved_mb - 10_000
    grows.reserved_mb = 10_000
    grows.prediction = Fingerprint(signature=grows.signature, pattern="flat", pattern_confidence=0.9,
                                   growth_rate_mb_per_s=0.0, predicted_peak_mb=20_000.0, peak_low_mb=19_500.0,
                                   peak_high_mb=20_500.0)
    for job in run.jobs[3:]:
        run._enqueue(job, 600.0)
    run._new_cycle()
    run._observe_tasks(600.0)
    run._schedule(600.0)
    assert grows.reserved_mb == 21_012
    assert run.counts["made_way"] == 1
    assert [j.state for j in run.jobs[3:]] == ["running", "pending"]
    run._new_cycle()  # the next cycle has its budget again
    run._schedule(660.0)
    assert [j.state for j in run.jobs[3:]] == ["running", "running"]


def test_making_way_and_making_room_share_the_cycle_s_two_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three five-hour runs hold the node's three GPUs when three ten-minute tasks and a
    # ten-minute share wait. At one checkpoint a round, the cycle's two rounds make way for
    # two of them; the third task and the share wait for the next cycle.
    monkeypatch.setattr(fleet_run, "MAKE_WAY_PER_ROUND", 1)
    runs = [task(k, duration=5 * 3600.0) for k in range(3)]
    waiters = [task(3 + k, duration=600.0, arrival=600.0) for k in range(3)]
    share = dataclasses.replace(task(6, duration=600.0, arrival=600.0, milli=500), max_queue_s=6 * 3600.0)
    run = FleetRun(tiny_fleet(gpus=3), workload(*runs, *waiters, share, hours=8.0), "fleetpilot", seed=1)
    for gpu, job in enumerate(run.jobs[:3]):
        job.state = "pending"
        run._start(job, 0, [gpu], 1000, 0.0)
    for job in run.jobs[3:]:
        run._enqueue(job, 600.0)
    run._schedule(600.0)
    assert (run.counts["made_way"], run.counts["made_room"]) == (2, 0)
    assert [j.state for j in run.jobs[3:]] == ["running", "running", "pending", "pending"]


def test_the_sharing_baseline_puts_shares_on_one_gpu_by_their_declared_memory_where_k8s_default_gives_each_a_gpu():
    # Two GPUs. A share leaking from 5 to 30 GB that declared 10, and a flat 15 GB share:
    # k8s-default gives each a whole GPU (nothing dies); kai-share binpacks them on one GPU by
    # what they declared (10 + 15 GB and their contexts), and the leak outgrows it.
    tasks = (task(0, pattern="leak", peak=30_000.0, request=10_000.0, milli=500, duration=1800.0),
             task(1, peak=15_000.0, milli=500, duration=1800.0))
    whole = FleetRun(tiny_fleet(gpus=2), workload(*tasks), "k8s-default", seed=1)
    shared = FleetRun(tiny_fleet(gpus=2), workload(*tasks), "kai-share", seed=1)
    whole_result, shared_result = whole.run(), shared.run()
    assert [j.gpus for j in whole.jobs] == [[0], [1]] and whole_result.figures["oom_events"] == 0
    first_gpus = {t: [p.gpu for p in d.placement] for t, (d, _) in shared.first_placements.items()}
    assert first_gpus["t0"] == first_gpus["t1"]
    held = {t: [p.memory_mb for p in d.placement] for t, (d, _) in shared.first_placements.items()}
    assert held == {"t0": [10_000 + CONTEXT_MB], "t1": [15_000 + CONTEXT_MB]}
    assert shared_result.figures["oom_events"] >= 1 and shared.jobs[0].attempts >= 2  # the leak, started again


def test_the_sharing_baseline_holds_what_a_share_declared_and_its_report_names_it() -> None:
    # Four shares of 250 milli declaring 8 GB on one GPU: all four run at once (4 x (8 GB +
    # context) fits 40 GB); under k8s-default three of them wait for the GPU.
    tasks = tuple(task(i, peak=8_000.0, milli=250, duration=600.0) for i in range(4))
    both = compare(tiny_fleet(), workload(*tasks), fleet_name="tiny", seed=1, baseline="kai-share")
    assert both.baseline.mode == "kai-share" and both.baseline.figures["mean_queue_s"] == 0.0
    assert both.to_json()["baseline"]["policy"] == "kai-share"
    table = bench.report(both)
    assert "targets vs kai-share:" in table and "k8s-default" not in table
    header = next(line for line in table.splitlines() if line.startswith("figure"))
    assert header.split() == ["figure", "kai-share", "fleetpilot", "ratio"]
    whole = FleetRun(tiny_fleet(), workload(*tasks), "k8s-default", seed=1).run()
    assert whole.figures["mean_queue_s"] > 0.0

"""The outcome model on workloads it has never seen (``make bench``).

For each scheduler (``k8s-default`` and Fleetpilot's loop) the fleet benchmark plays the
training workloads (seeds ``--train``); the learner learns from their judged first
placements exactly as the learner service does (``fleetpilot.learner.learn``: its own gate
on the latest quarter included). The model is then scored on the placements of other
workloads (seeds ``--test``, a different arrival sample, task mix and fault plan), against
the confidence the scheduler itself gave them: the Brier score of each (lower is better),
their ratio, and the mean of each against the share of placements that met their goal.

The baseline is the scheduler's own confidence on the same placements, in the same run: the
calibrated one for Fleetpilot, the device-plugin model's prior for k8s-default.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

from fleetpilot.learner import Example, OutcomeModel, learn
from fleetpilot.learner.promotion import held_out_figures

from .fleet import DEFAULT_FRACTION, DEFAULT_HOURS, DEFAULT_TASKS, load_bench_fleet
from .fleet_run import FleetRun
from .fleet_sweep import parse_seeds
from .fleet_workload import generate_workload, load_trace
from .openb import NODES_FILE, TRACES, find_data_dir

MODES = ("k8s-default", "fleetpilot")


def seeds(text: str) -> list[int]:
    """``"1-3"``, ``"1,2,5"`` or ``"1,11-13"`` as a list of seeds (``fleet_sweep.parse_seeds``)."""
    try:
        return list(parse_seeds(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (e.g. 1-4 or 1,2,5)") from None


def examples_of(fleet_name: str, seed: int, mode: str, *, nodes_csv, trace) -> list[Example]:
    """The judged first placements of one scheduler on one workload."""
    fleet = load_bench_fleet(fleet_name, nodes_csv, fraction=DEFAULT_FRACTION[fleet_name], seed=seed)
    workload = generate_workload(fleet, seed, n_tasks=DEFAULT_TASKS[fleet_name],
                                 span_s=DEFAULT_HOURS[fleet_name] * 3600.0, trace=trace,
                                 use_trace_shapes=fleet_name == "openb" and trace is not None)
    run = FleetRun(fleet, workload, mode, seed)
    run.run()
    return run.outcome_examples()


def score(model: OutcomeModel, examples: list[Example]) -> dict[str, float]:
    """Brier scores of the model and of the scheduler's own confidence on ``examples``."""
    f = held_out_figures(model, examples)
    return {"brier_model": f.brier_model, "brier_prior": f.brier_prior, "mean_model": f.mean_predicted,
            "mean_prior": f.mean_prior, "observed": f.observed, "placements": float(f.held_out)}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise SystemExit(f"learner bench: {message}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the evaluation and print its figures; bad arguments raise ``SystemExit`` with one line."""
    p = _Parser(prog="python -m fleetpilot.bench.learner_eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--fleet", choices=("three-site", "openb"), default="three-site")
    p.add_argument("--train", type=seeds, default=seeds("1-3"), help="seeds of the training workloads (1-3)")
    p.add_argument("--test", type=seeds, default=seeds("11-13"), help="seeds of the unseen workloads (11-13)")
    args = p.parse_args(argv)
    if set(args.train) & set(args.test):
        raise SystemExit("learner bench: --train and --test share a seed; the test must be unseen")
    if not args.train or not args.test:
        raise SystemExit("learner bench: --train and --test need at least one seed each")
    data = find_data_dir()
    if data is None:
        raise SystemExit("learner bench: no shared/data/openb found (set FLEETPILOT_DATA)")
    trace = load_trace(data / TRACES["default"])
    nodes_csv = data / NODES_FILE
    print(f"learner benchmark: fleet {args.fleet}, trained on seeds {args.train}, scored on seeds {args.test}",
          flush=True)
    print(f"{'scheduler':<12} {'trained on':>10} {'gate':>9} {'scored on':>9} {'Brier own':>10} "
          f"{'Brier model':>12} {'ratio':>6}  mean own / model / met")
    for mode in MODES:
        started = time.perf_counter()
        train = [e for s in args.train for e in examples_of(args.fleet, s, mode, nodes_csv=nodes_csv, trace=trace)]
        test = [e for s in args.test for e in examples_of(args.fleet, s, mode, nodes_csv=nodes_csv, trace=trace)]
        assessment = learn(train, seed=0)
        if assessment.model is None:
            print(f"{mode:<12} {len(train):>10}  no model: {assessment.reason}")
            continue
        f = score(assessment.model, test)
        ratio = f["brier_model"] / f["brier_prior"] if f["brier_prior"] > 0 else float("nan")
        print(f"{mode:<12} {len(train):>10} {'promoted' if assessment.promoted else 'refused':>9} "
              f"{len(test):>9} {f['brier_prior']:>10.4f} {f['brier_model']:>12.4f} {ratio:>6.2f}  "
              f"{f['mean_prior']:.3f} / {f['mean_model']:.3f} / {f['observed']:.3f}   "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
        print(f"{'':<12} gate on its training runs' latest quarter: {assessment.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

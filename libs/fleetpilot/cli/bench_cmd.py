"""``fleetpilot bench SUITE [ARGS...]``: run a benchmark suite with its own arguments.

``openb`` is the FGD-paper allocation benchmark (``fleetpilot.bench.openb``, see
``fleetpilot bench openb --help``); ``fleet`` is the fleet benchmark
(``fleetpilot.bench.fleet``) where this build has it, and ``fleet-sweep`` that benchmark over
many workloads (``fleetpilot.bench.fleet_sweep``); ``learner`` the outcome model on workloads it
never saw (``fleetpilot.bench.learner_eval``). Everything after the suite name is
handed to the suite's ``main(argv)`` untouched, so each suite documents its own flags.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUITES: dict[str, str] = {"openb": "fleetpilot.bench.openb", "fleet": "fleetpilot.bench.fleet",
                          "fleet-sweep": "fleetpilot.bench.fleet_sweep", "learner": "fleetpilot.bench.learner_eval"}


def add_arguments(parser) -> None:
    """The suite name, then the suite's own arguments."""
    parser.add_argument("suite", choices=sorted(SUITES), help="which benchmark")
    remainder = parser.add_argument(
        "suite_args", nargs=argparse.REMAINDER, help="arguments of the suite (see its --help)"
    )
    # argparse counts a REMAINDER as required, so a missing suite read "required: suite,
    # suite_args" although a suite runs with no arguments of its own.
    remainder.required = False


def main(args) -> int:
    """Import the suite and run its ``main`` with the remaining arguments."""
    module_name = SUITES[args.suite]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # the suite exists but something it needs is missing: show the real cause
        raise ValueError(
            f"the {args.suite} suite is not available in this build ({module_name} is missing)"
        ) from None
    try:
        return int(module.main(list(args.suite_args)) or 0)
    except SystemExit as refused:
        if not isinstance(refused.code, str):
            raise
        # A suite refuses bad input with its own one-line message; bad input exits 2.
        print(refused.code, file=sys.stderr)
        return 2

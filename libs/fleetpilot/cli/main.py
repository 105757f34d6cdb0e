"""``fleetpilot``: one command, one subcommand per job.

Bad arguments and bad input end with a one-line message and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("fleetpilot.cli.up", "run NATS and all services locally, show live decisions"),
    "submit": ("fleetpilot.cli.submit", "submit a task and print its decision"),
    "watch": ("fleetpilot.cli.watch", "follow decision.made (or other subjects)"),
    "token": ("fleetpilot.cli.token", "mint a bearer token with the local key"),
    "topology": ("fleetpilot.cli.topology_cmd", "parse saved `nvidia-smi topo -m` output, print the graph as JSON"),
    "probe": ("fleetpilot.cli.probe_cmd", "read this node's GPUs through NVML, as the collector would"),
    "fleet": ("fleetpilot.cli.fleet_cmd", "show the fleet from a spec, and live GPU readings when it runs"),
    "fingerprint": ("fleetpilot.cli.fingerprint_cmd", "fingerprint a task's memory series (CSV) as JSON"),
    "model": ("fleetpilot.cli.model_cmd", "show the learner's outcome models: what the policies use, and why"),
    "replay": ("fleetpilot.cli.replay_cmd", "replay recorded decision inputs through two policies, print the diff"),
    "bench": ("fleetpilot.cli.bench_cmd", "run a benchmark suite (openb, fleet, fleet-sweep, learner) with its own arguments"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not the usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = _Parser(prog="fleetpilot", description="Fleetpilot: decisions for a heterogeneous GPU fleet.")
    subs = parser.add_subparsers(dest="subcommand", required=True, parser_class=_Parser)
    for name, (module, help_text) in COMMANDS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse, run the subcommand, turn expected failures into one-line errors."""
    args = build_parser().parse_args(argv)
    module = importlib.import_module(COMMANDS[args.subcommand][0])
    try:
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, TimeoutError) as exc:
        # Any OSError, not only a missing file: a directory where a file belongs (or the
        # reverse) is as much the user's input. One of a file reads "[Errno 2] No such file
        # or directory: 'x'"; say it plainly. ConnectionError is one, with its own line.
        filename = getattr(exc, "filename", None)
        text = f"{exc.strerror.lower()}: {filename}" if filename is not None and exc.strerror else str(exc)
        print(f"fleetpilot {args.subcommand}: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

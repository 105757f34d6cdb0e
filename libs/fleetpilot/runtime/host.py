"""The service host: everything a service needs around its handlers.

A service module builds a ``ServiceHost``, registers plain async handlers with decorators
and calls ``host.main()``. The host serves ``/metrics`` and ``/healthz`` (bound first, not ok
until started), connects the bus, creates streams and buckets, binds durable consumers,
runs periodic jobs, and on SIGTERM stops taking work, lets in-flight handlers finish and
drains the connection.

Only the first connection must come at once (no server at all is an operator's mistake,
told in one line). If the server goes away after it, while the host sets itself up (a
restart, a failover), each set-up step is tried again once it is back, until the start-up
limit (``startup_timeout_s``).

    host = ServiceHost("sla", SlaSettings())

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def admit(task: TaskSubmitted, delivery: Delivery) -> TaskAdmitted: ...
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from functools import partial

from fleetpilot.contracts import CONSUMERS, ConsumerSpec, Event
from fleetpilot.contracts.codec import NonFiniteFloat

from . import logs, tracing
from .bus import Bus
from .config import STARTUP_TIMEOUT_VARIABLE, BadSettings, ServiceSettings
from .dispatch import Dispatcher, TypedHandler, as_events, reply_handler
from .http import OpsServer
from .metrics import HandlerMetrics

log = logging.getLogger("fleetpilot.host")

RESTART_BACKOFF_S = 0.5
"""The pause before a background job that ended is started again, doubled while it keeps failing..."""
RESTART_BACKOFF_MAX_S = 30.0
"""...up to this."""
STARTUP_RETRY_S = 0.25
"""The pause before a start-up step that found the server unreachable is tried again, doubled
while it keeps failing..."""
STARTUP_RETRY_MAX_S = 5.0
"""...up to this (and it waits, besides, until the connection is back)."""


class StartupTimedOut(TimeoutError):
    """A start-up step kept finding the server unreachable until the start-up limit. A
    ``TimeoutError``, so that ``main`` tells it in one line and exits 2."""


class StartupRefused(Exception):
    """The server refused a start-up step (``Bus.refused``): ``main`` tells it in one line
    and exits 2, as asking again would be refused again."""


class StartupAbandoned(Exception):
    """The service was told to stop (SIGTERM) while its start-up waited for the server."""


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@dataclass
class _Durable:
    consumer: ConsumerSpec
    event_types: tuple[type[Event], ...]
    handler: TypedHandler


@dataclass
class _Core:
    subject: str
    queue: str | None
    event_types: tuple[type[Event], ...]
    handler: TypedHandler


@dataclass
class _Endpoint:
    name: str
    subject: str
    event_types: tuple[type[Event], ...]
    handler: TypedHandler


CONSUMER_FAILING_LIMIT_S = 30.0
"""How long a durable consumer's fetches may fail in a row (a cluster without JetStream quorum,
a server back without JetStream) before ``/healthz`` says the service is not well: it is
connected, and takes no work."""

UNSENT_LIMIT = 10_000
"""The most events of one periodic job kept while the bus refuses them."""
PUBLISH_TURN = 256
"""Events of one periodic job published between two turns of the event loop."""


def next_tick(due: float, interval_s: float, now: float) -> float:
    """When a periodic job that was due at ``due`` is due next: one ``interval_s`` later,
    keeping its period whatever the run took; a run that overran its period is followed
    at once by the next, once (missed ticks are not made up in a burst)."""
    return max(due + interval_s, now)


@dataclass
class _Periodic:
    interval_s: float
    job: Callable[[], Awaitable[object]]


class ServiceHost:
    """Hosts one service's handlers on a bus."""

    def __init__(self, name: str, settings: ServiceSettings) -> None:
        self.name = name
        self.settings = settings
        self.metrics = HandlerMetrics(name)
        self.bus: Bus | None = None
        self._durables: list[_Durable] = []
        self._cores: list[_Core] = []
        self._endpoints: list[_Endpoint] = []
        self._periodic: list[_Periodic] = []
        self._startup: list[Callable[[Bus], Awaitable[None]]] = []
        self._shutdown: list[Callable[[], Awaitable[None]]] = []
        self._stopping_hooks: list[Callable[[], Awaitable[object]]] = []
        self._health_checks: list[Callable[[], dict | None]] = []
        self._tasks: list[asyncio.Task] = []
        self.restarts: dict[str, int] = {}
        """How many times each background job was started again (``/healthz`` shows it)."""
        self._ops: OpsServer | None = None
        self._stopped = asyncio.Event()
        self._started = False  # every consumer, subscription and endpoint set up
        self._stopping = False
        self._stop_requested = asyncio.Event()  # SIGTERM or SIGINT: ends a start-up that waits

    # -- registration -------------------------------------------------------------------
    def on(self, *event_types: type[Event], consumer: str, instance: str = "", instance_start_s_ago: float = 0.0,
           handler_limit_s: float | None = None) -> Callable[[TypedHandler], TypedHandler]:
        """Handle events from a catalogued durable consumer, shared by all replicas; with
        ``instance``, this replica's own copy of it (``ConsumerSpec.for_instance``), which
        gets every message and, when first made, starts ``instance_start_s_ago`` back (at
        every start, for a ``per_run`` consumer). ``handler_limit_s`` replaces the catalog's
        limit on one handling for a service whose settings make its handlers wait longer."""
        if consumer not in CONSUMERS:
            raise LookupError(f"consumer {consumer!r} is not declared in the catalog")
        spec = CONSUMERS[consumer]
        if spec.per_run and not instance:
            # Made afresh at each start and removed at each stop: shared, every replica's
            # start and stop would take the others' place away.
            raise ValueError(f"consumer {consumer!r} is per run: it needs an instance")
        if instance:
            spec = spec.for_instance(instance, instance_start_s_ago)
        if handler_limit_s is not None:
            spec = dataclasses.replace(spec, handler_limit_s=handler_limit_s)

        def register(handler: TypedHandler) -> TypedHandler:
            self._durables.append(_Durable(spec, event_types, handler))
            return handler
        return register

    def on_core(self, subject: str, *event_types: type[Event], queue: str | None = None
                ) -> Callable[[TypedHandler], TypedHandler]:
        """Handle events from a core subscription (telemetry); ``queue`` shares it among replicas."""
        def register(handler: TypedHandler) -> TypedHandler:
            self._cores.append(_Core(subject, queue, event_types, handler))
            return handler
        return register

    def endpoint(self, name: str, subject: str, *event_types: type[Event]) -> Callable[[TypedHandler], TypedHandler]:
        """Answer typed requests on ``subject`` (a ``nats.micro`` endpoint)."""
        def register(handler: TypedHandler) -> TypedHandler:
            self._endpoints.append(_Endpoint(name, subject, event_types, handler))
            return handler
        return register

    def every(self, interval_s: float) -> Callable[[Callable[[], Awaitable[object]]], Callable[[], Awaitable[object]]]:
        """Run a job periodically; the events it returns are published."""
        def register(job: Callable[[], Awaitable[object]]) -> Callable[[], Awaitable[object]]:
            self._periodic.append(_Periodic(interval_s, job))
            return job
        return register

    def on_startup(self, hook: Callable[[Bus], Awaitable[None]]) -> Callable[[Bus], Awaitable[None]]:
        """Run ``hook(bus)`` once the bus is ready, before any handler is bound.

        A hook that fails because the server went away (``Bus.unreachable``) is run again,
        whole, once it is back, after the background jobs it started were stopped: it must be
        safe to run again after a partial run (read its state again, write with
        compare-and-set or idempotency keys, open a store only if it is not open yet)."""
        self._startup.append(hook)
        return hook

    def on_stopping(self, hook: Callable[[], Awaitable[object]]) -> Callable[[], Awaitable[object]]:
        """Run ``hook()`` when the service stops, once its periodic jobs have stopped and its
        handlers have finished their last messages (no new one is taken), before the bus
        closes; the events it returns are published (its last word: what it gives up). It
        sees everything its handlers did: a sample or an end handled during the stop is not
        lost to a checkpoint written before it, nor a process started after it gave its tasks up."""
        self._stopping_hooks.append(hook)
        return hook

    def on_shutdown(self, hook: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """Run ``hook()`` after the bus is drained (close stores, stop child processes)."""
        self._shutdown.append(hook)
        return hook

    def health_check(self, check: Callable[[], dict | None]) -> Callable[[], dict | None]:
        """Add ``check()`` to ``/healthz``: it returns ``None`` while the service is well, else
        a dict naming what is wrong, merged into the document, which then says not ok (503).
        For a service's own trouble the host cannot see (a hardware call that hung); it runs
        on the event loop at every probe, so it must only look at state, never wait."""
        self._health_checks.append(check)
        return check

    def background(self, start: Callable[[], Awaitable[None]], name: str) -> None:
        """Keep a long-running job (a KV watcher, say) running until the service stops:
        ``start()`` is called again, after a pause, whenever the job ends or fails. A view
        whose watcher died would otherwise stay as it was for the rest of the process while
        the service went on deciding on it."""
        self._tasks.append(asyncio.create_task(self._keep_running(start, name), name=name))

    async def _keep_running(self, start: Callable[[], Awaitable[None]], name: str) -> None:
        failures = 0
        while not self._stopping:
            began = asyncio.get_running_loop().time()
            try:
                await start()
                log.warning("background task %s ended", name)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background task %s died", name)
            self.restarts[name] = self.restarts.get(name, 0) + 1
            # A job that ran a while before it failed is not failing in a loop: back off anew.
            failures = 1 if asyncio.get_running_loop().time() - began > RESTART_BACKOFF_MAX_S else failures + 1
            pause = min(RESTART_BACKOFF_S * 2 ** (failures - 1), RESTART_BACKOFF_MAX_S)
            log.info("background task %s starts again in %.1f s", name, pause)
            await asyncio.sleep(pause)

    # -- life cycle -----------------------------------------------------------------------
    async def start(self, bus: Bus | None = None) -> None:
        """Connect (unless a bus is given), set up the bus and begin serving."""
        tracing.configure(self.name, self.settings.otlp_endpoint)
        if self.settings.metrics_port >= 0:
            # Bound first: a port taken (two replicas on one host given the same one) is found
            # before any start-up hook has run or any message was taken, each cut when the
            # process exits; bound last, a crash loop cut a message's handling at every restart.
            # Until started, /healthz says so (``health``).
            self._ops = OpsServer(self.metrics.registry, self.health)
            try:
                port = await self._ops.start(self.settings.metrics_host, self.settings.metrics_port)
            except OSError as exc:
                # asyncio's own words name no setting ("Name or service not known"): say which.
                prefix = (self.settings.model_config.get("env_prefix") or "FLEETPILOT_").upper()
                raise OSError(f"/metrics and /healthz cannot listen on {self.settings.metrics_host}:"
                              f"{self.settings.metrics_port} ({prefix}METRICS_HOST, {prefix}METRICS_PORT): "
                              f"{exc.strerror or exc}") from exc
            log.info("%s: /metrics and /healthz on %s:%d", self.name, self.settings.metrics_host, port)
        if bus is None:
            from .nats_bus import NatsBus

            bus = await NatsBus.connect(self.settings.nats_url, f"{self.name}-{self.settings.replica}")
        self.bus = bus
        # From here the server may go away (a restart, a failover) and the client reconnects on
        # its own: each step that talks to the server is tried again once it is back
        # (``_until_done``), which each of them allows. ensure_topology creates what is missing
        # and updates the rest; consume makes its consumer or binds to the one there and starts
        # its loop only once bound; subscribe takes back a subscription the server may not have
        # got; serve makes the service and each endpoint once. Start-up hooks are run again
        # whole: they open views and stores step by step and are written to be run again (see
        # on_startup), while running one again from where it failed would need every hook cut in
        # steps. The collector's publishes its nodes' topology (a report again is harmless), the
        # executor's reclaims what its last run left behind (reading the ledger again, it
        # releases only what is still held), the policy's and the SLA's open their views again.
        deadline = asyncio.get_running_loop().time() + self.settings.startup_timeout_s
        await self._until_done("the streams and buckets", bus.ensure_topology, deadline)
        for hook in self._startup:
            await self._until_done(f"start-up hook {getattr(hook, '__name__', hook)}",
                                   partial(self._run_startup_hook, hook, bus), deadline)
        for durable in self._durables:
            spec = durable.consumer
            dispatcher = Dispatcher(bus, self.name, spec.durable, durable.event_types, durable.handler,
                                    self.metrics, max_deliver=spec.max_deliver, backoff_s=spec.backoff_s,
                                    ack_wait_s=spec.ack_wait_s, handler_limit_s=spec.handler_limit_s)
            await self._until_done(f"consumer {spec.durable}", partial(bus.consume, spec, dispatcher), deadline)
        for core in self._cores:
            dispatcher = Dispatcher(bus, self.name, core.subject, core.event_types, core.handler, self.metrics,
                                    redelivered=False)
            await self._until_done(f"subscription to {core.subject}",
                                   partial(bus.subscribe, core.subject, dispatcher, queue=core.queue), deadline)
        for ep in self._endpoints:
            await self._until_done(f"endpoint {ep.name}", partial(
                bus.serve, self.name, ep.name, ep.subject, reply_handler(ep.event_types, ep.handler, name=ep.name,
                                                                   metrics=self.metrics)), deadline)
        for periodic in self._periodic:
            self._tasks.append(asyncio.create_task(self._run_periodic(periodic), name=getattr(periodic.job, "__name__", "periodic")))
        self._started = True
        log.info("%s: started (replica %s)", self.name, self.settings.replica)

    async def _until_done(self, step: str, attempt: Callable[[], Awaitable[object]], deadline: float) -> None:
        """Run ``attempt``; while it fails because the server is unreachable, run it again after
        a pause (doubling) once the connection is back, until ``deadline``. Any other failure
        (the server refused a stream's config, a permission, a bug) is raised at once: asking
        again would be refused again. Raises ``StartupTimedOut`` at the deadline and
        ``StartupAbandoned`` when the service is told to stop meanwhile."""
        assert self.bus is not None
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            try:
                await attempt()
                return
            except Exception as exc:
                if self.bus.refused(exc):
                    raise StartupRefused(f"{step} refused by the NATS server: {_first_line(exc)}") from exc
                if not self.bus.unreachable(exc):
                    raise
                failures += 1
                if self._stop_requested.is_set() or self._stopping:
                    raise StartupAbandoned(f"{step} failed ({_first_line(exc)}) while stopping") from exc
                pause = min(STARTUP_RETRY_S * 2 ** (failures - 1), STARTUP_RETRY_MAX_S)
                log.warning("%s: %s failed (%s): the NATS server is away or not serving yet; trying again "
                            "in %.2g s once connected (start-up gives up in %.0f s)", self.name, step, _first_line(exc), pause,
                            max(0.0, deadline - loop.time()))
                if not await self._waited_to_retry(pause, deadline):
                    raise StartupTimedOut(
                        f"{step} still failed after {self.settings.startup_timeout_s:g} s, the start-up limit "
                        f"({STARTUP_TIMEOUT_VARIABLE}): {_first_line(exc)}") from None

    async def _waited_to_retry(self, pause_s: float, deadline: float) -> bool:
        """Wait ``pause_s``, then until the bus is connected; False when ``deadline`` comes
        first. Raises ``StartupAbandoned`` as soon as the service is told to stop."""
        assert self.bus is not None
        loop = asyncio.get_running_loop()
        resume = loop.time() + pause_s
        stop = asyncio.ensure_future(self._stop_requested.wait())
        try:
            while loop.time() < resume or not self.bus.connected:
                if loop.time() >= deadline:
                    return False
                # Polled: the bus tells no reconnection, and a few tens of ms are nothing here.
                await asyncio.wait({stop}, timeout=min(0.05, max(0.0, deadline - loop.time())))
                if stop.done() or self._stopping:
                    raise StartupAbandoned("told to stop while waiting for the NATS server")
            return True
        finally:
            stop.cancel()

    async def _run_startup_hook(self, hook: Callable[[Bus], Awaitable[None]], bus: Bus) -> None:
        """Run ``hook(bus)``; when it fails, stop the background jobs it started, so that running
        it again leaves one of each, not two following the same watch."""
        started = len(self._tasks)
        try:
            await hook(bus)
        except BaseException:
            abandoned = self._tasks[started:]
            del self._tasks[started:]
            await self._cancel(abandoned, 5.0, "after its start-up hook failed")
            raise

    async def _cancel(self, tasks: Iterable[asyncio.Task], timeout_s: float, when: str) -> None:
        """Cancel ``tasks`` and wait until they end, at most ``timeout_s``; log any that will not."""
        stuck = set(tasks)
        deadline = asyncio.get_running_loop().time() + timeout_s
        # Python 3.11's asyncio.wait_for (used throughout nats-py) can swallow a
        # cancellation that races with its result, so cancel again until the task ends.
        while stuck and asyncio.get_running_loop().time() < deadline:
            for task in stuck:
                task.cancel()
            _, stuck = await asyncio.wait(stuck, timeout=0.5)
        for task in stuck:
            log.error("%s: task %s ignored cancellation %s", self.name, task.get_name(), when)

    async def _run_periodic(self, periodic: _Periodic) -> None:
        """Run a job every ``interval_s`` and publish what it returns.

        The period is kept from one start to the next (``next_tick``): sleeping the whole
        interval after each run stretched a 1 s sampling job to 1.3 s when sampling took
        0.3 s. Events the bus refuses are kept and published first on the next tick, before
        the job runs again: given up at the first failed publish, the rest of a job's list
        was lost (the executor's ``evicted`` of a node's tasks whose holds it had released:
        those tasks were placed nowhere again). An event that can never be sent (it holds NaN
        or an infinity) is dropped and told instead (``_publish_sendable``)."""
        loop = asyncio.get_running_loop()
        name = getattr(periodic.job, "__name__", "?")
        unsent: list[Event] = []
        due = loop.time() + periodic.interval_s
        while not self._stopping:
            await asyncio.sleep(max(due - loop.time(), 0.0))
            due = next_tick(due, periodic.interval_s, loop.time())
            try:
                if unsent:
                    unsent = await self._publish_in_order(unsent, name)
                    if unsent:
                        continue  # still refused: what the job would return queues behind these
                unsent = await self._publish_in_order(as_events(await periodic.job()), name)  # type: ignore[arg-type]
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("periodic job %s failed", name)

    async def _publish_in_order(self, events: list[Event], job: str) -> list[Event]:
        """Publish ``events`` in order; those from the first the bus refuses on, kept (at
        most ``UNSENT_LIMIT``) to be published again."""
        for i, event in enumerate(events):
            if i and i % PUBLISH_TURN == 0:
                await asyncio.sleep(0)  # a job's thousands of events (the collector's) held the loop
            try:
                await self._publish_sendable(event, "periodic job", job)
            except Exception as exc:  # noqa: BLE001 - kept, published again next tick
                left = events[i:]
                if len(left) > UNSENT_LIMIT:
                    log.error("periodic job %s: %d events dropped, more than %d waited for the bus", job,
                              len(left) - UNSENT_LIMIT, UNSENT_LIMIT)
                    left = left[-UNSENT_LIMIT:]
                log.warning("periodic job %s: %d events not published (%s: %s); published again next tick",
                            job, len(left), type(exc).__name__, exc)
                return left
        return []

    async def _publish_sendable(self, event: Event, origin: str, name: str) -> None:
        """Publish ``event`` made by ``origin`` (``periodic job``, ``stopping hook``) ``name``.
        One that can never be sent (``NonFiniteFloat``: it holds NaN or an infinity) is
        dropped, logged and counted as ``name``'s error: kept to be published again, it was
        refused at every tick, for ever, and every event the job made after it queued behind it."""
        try:
            await self.bus.publish(event)  # type: ignore[union-attr]
        except NonFiniteFloat as exc:
            log.error("%s %s: an event dropped, it cannot be sent: %s", origin, name, exc)
            self.metrics.failed(name)

    def health(self) -> dict:
        """The ``/healthz`` document: ok once the service has started (until then it says
        ``starting``), while the bus is connected, no durable consumer has failed to fetch for
        ``CONSUMER_FAILING_LIMIT_S`` (those are named) and no ``health_check`` reports a
        problem (what it reports is merged in)."""
        connected = bool(self.bus and self.bus.connected)
        self.metrics.connected.labels(self.name).set(1 if connected else 0)
        # Connected alone said ok while JetStream served none of its consumers: the service
        # took no work for as long as that lasted, and nothing watching it knew.
        failing = sorted(durable for durable, seconds in (self.bus.consumers_failing() if self.bus else {}).items()
                         if seconds >= CONSUMER_FAILING_LIMIT_S)
        problems: dict = {}
        for check in self._health_checks:
            problems.update(check() or {})
        doc = {"ok": self._started and connected and not failing and not problems, "service": self.name,
               "replica": self.settings.replica, "background_restarts": dict(self.restarts)}
        if not self._started:
            doc["starting"] = True
        if failing:
            doc["consumers_failing"] = failing
        # A check names its own trouble; it cannot overwrite what the host says.
        doc.update((key, value) for key, value in problems.items() if key not in doc)
        return doc

    async def stop(self, step_timeout_s: float = 15.0) -> None:
        """Stop periodic jobs, stop consuming (in-flight handlers finish), run the stopping
        hooks, drain the bus (publish what is left, close), run shutdown hooks.

        Every step is bounded: a service that cannot stop is worse than one that stops
        with a step cut short, and the step that overran is logged.
        """
        self._stopping = True  # a start-up still waiting for the server gives up
        await self._cancel(self._tasks, step_timeout_s, "at shutdown")
        if self.bus is not None:
            await self._bounded(self.bus.stop_consuming(), "stop consuming", step_timeout_s)
        for hook in self._stopping_hooks:
            await self._bounded(self._publish_from(hook), f"stopping hook {getattr(hook, '__name__', hook)}",
                                step_timeout_s)
        if self.bus is not None:
            await self._bounded(self.bus.drain(), "bus drain", step_timeout_s)
        for hook in self._shutdown:
            await self._bounded(hook(), f"shutdown hook {getattr(hook, '__name__', hook)}", step_timeout_s)
        await self._bounded(asyncio.to_thread(tracing.flush, step_timeout_s), "span export", step_timeout_s)
        if self._ops is not None:
            await self._ops.stop()
        self._stopped.set()
        log.info("%s: stopped", self.name)

    async def _publish_from(self, hook: Callable[[], Awaitable[object]]) -> None:
        for event in as_events(await hook()):  # type: ignore[arg-type]
            if self.bus is not None:
                await self._publish_sendable(event, "stopping hook", getattr(hook, "__name__", "?"))

    async def _bounded(self, step: Awaitable[object], what: str, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(step, timeout_s)
        except TimeoutError:
            log.error("%s: %s did not finish in %.0fs", self.name, what, timeout_s)
        except Exception:
            log.exception("%s: %s failed", self.name, what)

    async def run_forever(self) -> None:
        """Start, then serve until SIGTERM or SIGINT, then stop gracefully."""
        # Handlers first: a SIGTERM that arrives while connecting still means "drain and exit 0",
        # and one while start-up waits for the server to come back ends the wait.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_requested.set)
        try:
            await self.start()
        except StartupAbandoned as reason:
            log.info("%s: stopping before it started: %s", self.name, reason)
        else:
            # What start-up built (catalog, views, a simulated fleet, models) lives as long as
            # the process: frozen, Python's full garbage collections no longer walk it (they
            # stopped the openb fleet's collector service 65-74 ms each, 21 ms since).
            gc.collect()
            gc.freeze()
            await self._stop_requested.wait()
            log.info("%s: signal received, draining", self.name)
        await self.stop()

    def main(self) -> None:
        """Process entry point: logging, run, and a one-line error instead of a traceback."""
        logs.configure(self.name, self.settings.log_level, self.settings.log_json)
        try:
            asyncio.run(self.run_forever())
        except (OSError, TimeoutError, StartupRefused) as exc:
            print(f"fleetpilot-{self.name}: cannot start: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        except KeyboardInterrupt:
            pass


def serve(name: str, build: Callable[[], ServiceHost], *start_errors: type[Exception]) -> None:
    """A service's console entry point: build it from the environment and run it until
    stopped. A bad setting (``BadSettings``), or one of ``start_errors`` raised while
    building (a missing GPU source, an unreadable fleet spec), is one line on standard
    error and exit code 2: an operator reads what to fix, not a traceback."""
    try:
        host = build()
    except (BadSettings, *start_errors) as exc:
        print(f"fleetpilot-{name}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    host.main()

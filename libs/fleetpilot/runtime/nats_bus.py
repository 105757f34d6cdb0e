"""The production bus: nats-py over a NATS server with JetStream.

Durable subjects are published with JetStream (``Nats-Msg-Id`` de-duplicates them within
the stream's window); telemetry goes over core NATS and is captured by a short-lived
stream for late joiners. Each durable consumer is a pull consumer bound by name, so every
replica of a service shares it. When the server restarts the client reconnects on its own;
the consume loop re-creates its stream and consumer if the server lost them and re-binds,
and a KV watch starts again from the bucket's current values.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from urllib.parse import urlparse

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api
from nats.micro.service import EndpointConfig, Service, ServiceConfig
from typing_extensions import override

from fleetpilot.contracts import (
    BUCKETS,
    STREAMS,
    ConsumerSpec,
    Event,
    encode,
    msg_id_for,
    route_for,
    subject_for,
)
from fleetpilot.contracts.catalog import RETIRED_CONSUMERS, stream_of
from fleetpilot.contracts.permissions import DEFAULT_INBOX_PREFIX, inbox_prefix

from .bus import Bus, CasConflict, Inbound, InboundHandler, KeyValue, KvEntry, RequestHandler, StoredMessage

log = logging.getLogger("fleetpilot.runtime.nats")

JETSTREAM_TEMPORARILY_UNAVAILABLE = 10008
"""The JetStream API's code for "JetStream system temporarily unavailable" (a cluster between
two meta leaders). Its other 503 answers (insufficient resources, JetStream not enabled for the
account) say the same however often they are asked."""

PING_INTERVAL_S = 10.0
"""How often the client pings the server. A server that stops answering without closing the
connection (frozen, or behind a partition that drops packets) is noticed only by its pings:
after ``MAX_OUTSTANDING_PINGS`` unanswered, the client takes the connection for lost, so
``connected`` (and ``/healthz``) says so and reconnecting begins. nats-py's default, 2 minutes,
kept a service reported well for 6 minutes while nothing reached it. Here it is 20 to 40 s:
short enough for a probe, long enough that an event loop held up a few seconds on a busy
machine is not taken for a lost server."""
MAX_OUTSTANDING_PINGS = 3
"""Unanswered pings after which the connection is taken for lost (see ``PING_INTERVAL_S``)."""

_UNREACHABLE = (TimeoutError, nats.errors.NoRespondersError, nats.errors.StaleConnectionError,
                nats.errors.OutboundBufferLimitError, nats.errors.ConnectionReconnectingError)
"""What nats-py raises while the server is away or not serving yet: no answer in time
(``nats.errors.TimeoutError`` and ``FlushTimeoutError`` are ``TimeoutError``s, and so is what
``request`` makes of them), nobody listening yet, the connection lost under the call, the
reconnect buffer full. ``ConnectionClosedError`` is not among them: with unlimited reconnects a
connection is closed only by ``drain`` or by the server refusing the credentials, and it never
comes back."""


class _NatsInbound(Inbound):
    def __init__(self, msg: Msg, durable: bool) -> None:
        self._msg, self._durable = msg, durable
        self.subject = msg.subject
        self.data = msg.data
        self.headers = dict(msg.headers or {})
        self.deliveries = msg.metadata.num_delivered if durable else 1
        if durable:
            # Per consumer: two services that both refuse one message each keep a letter.
            self.origin = f"{msg.metadata.stream}:{msg.metadata.consumer}:{msg.metadata.sequence.stream}"
            self.pending = msg.metadata.num_pending
            self.stream_seq = msg.metadata.sequence.stream
            # The ack subject's timestamp is the stored message's (nats-py's docstring calls
            # it the delivery's): the same at every delivery, as the stream's own get says.
            self.stored_at = msg.metadata.timestamp.timestamp()

    async def ack(self) -> None:
        if self._durable:
            await self._msg.ack()

    async def nak(self, delay_s: float) -> None:
        if self._durable:
            await self._msg.nak(delay=delay_s)

    async def term(self) -> None:
        if self._durable:
            await self._msg.term()

    async def in_progress(self) -> None:
        if self._durable:
            await self._msg.in_progress()


async def bucket_subject_keys(js, bucket: str) -> list[str]:
    """Every key a KV bucket has a subject for (deleted ones included), in one request.

    nats-py's ``keys()`` waits for an end-of-initial-values marker that a write racing with
    the listing can leave unsent, hanging the caller; the stream's per-subject state does
    not depend on that race.
    """
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    subjects = (info.state.subjects if info.state else None) or {}
    return sorted(subject[len(prefix):] for subject in subjects)


class Reconnections:
    """How many times a connection came back after losing its server. What lives in the
    server's state rather than in the client (a KV watch's ordered consumer) may be gone
    after one: a server that lost its store never delivers to it again."""

    def __init__(self) -> None:
        self.count = 0

    def happened(self) -> None:
        """The client reconnected."""
        self.count += 1


TURN = 256
"""Writes ``put_many`` sends between two turns of the event loop, so that requests waiting on
the loop are answered meanwhile."""


class NatsKeyValue(KeyValue):
    """A NATS KV bucket behind the ``KeyValue`` interface."""

    WATCH_POLL_S = 1.0
    """How often a quiet watch looks whether the connection came back since it started."""

    def __init__(self, kv, js, bucket: str, reconnections: Reconnections | None = None,
                 recreate: Callable[[], Awaitable[None]] | None = None, nc: Client | None = None) -> None:
        self._kv = kv
        self._js = js
        self._bucket = bucket
        self._nc = nc
        self._reconnections = reconnections or Reconnections()
        self._recreate = recreate

    @override
    async def get(self, key: str) -> KvEntry | None:
        try:
            entry = await self._kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return KvEntry(key, entry.value, entry.revision)

    @override
    async def put(self, key: str, value: bytes) -> int:
        return await self._kv.put(key, value)

    @override
    async def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        if self._nc is None or len(items) < 2:
            await super().put_many(items)
            return
        # All but the last as plain publishes to the bucket's subjects, which its stream
        # stores as it would a put, without an ack each: 6,212 acknowledged puts (the openb
        # fleet's GPUs, each second) took 0.6 s of the collector's CPU and over a second of
        # wall time, these 0.03 s. The last waits for its ack: the stream handles one
        # connection's messages in order, so a bucket gone or refusing is still told.
        # The loop is given back every ``TURN`` writes: thousands written at once held it.
        prefix = f"$KV.{self._bucket}."
        for i, (key, value) in enumerate(items[:-1], start=1):
            await self._nc.publish(prefix + key, value)
            if i % TURN == 0:
                await asyncio.sleep(0)
        await self.put(*items[-1])

    @override
    async def create(self, key: str, value: bytes) -> int:
        try:
            return await self._kv.create(key, value)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise CasConflict(f"key {key!r} exists") from exc

    @override
    async def update(self, key: str, value: bytes, revision: int) -> int:
        try:
            return await self._kv.update(key, value, last=revision)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise CasConflict(f"key {key!r} is not at revision {revision}") from exc

    @override
    async def delete(self, key: str, revision: int | None = None) -> None:
        if revision is None:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                await self._kv.delete(key)
            return
        try:
            await self._kv.delete(key, last=revision)
        except nats.js.errors.APIError as exc:
            # nats-py's update turns these codes into KeyWrongLastSequenceError; its delete
            # does not. 10071 and 10164: the key is no longer at that revision.
            if exc.err_code in (10071, 10164):
                raise CasConflict(f"key {key!r} is not at revision {revision}") from exc
            raise

    @override
    async def keys(self) -> list[str]:
        live = []
        for key in await bucket_subject_keys(self._js, self._bucket):
            if await self.get(key) is not None:  # a deleted key keeps its subject
                live.append(key)
        return live

    async def watch(self, pattern: str = ">") -> AsyncIterator[KvEntry]:
        """The current values, then every change, across server restarts: after a reconnect
        the watch starts again from the bucket's current values, and a key the caller holds
        that is gone from them (a server that lost its store) comes as deleted. nats-py's own
        watch stalls for good on a server that lost its store, and for about 20 s on one that
        kept it, while the mirrors built on it (the policy's ledger and fleet views, its
        configuration) looked current."""
        held: set[str] = set()  # keys whose last word to the caller was a value
        while True:
            since = self._reconnections.count
            watcher = await self._start_watch(pattern)
            current: set[str] | None = set()  # keys among the initial values; None once they are all in
            try:
                while self._reconnections.count == since:
                    try:
                        entry = await watcher.updates(timeout=self.WATCH_POLL_S)
                    except nats.errors.TimeoutError:
                        continue
                    if entry is None:  # the end of the initial values
                        if current is not None:
                            for key in sorted(held - current):
                                held.discard(key)
                                yield KvEntry(key, None, 0)
                        current = None
                        continue
                    deleted = entry.operation in ("DEL", "PURGE")
                    (held.discard if deleted else held.add)(entry.key)
                    if current is not None and not deleted:
                        current.add(entry.key)
                    yield KvEntry(entry.key, None if deleted else entry.value, entry.revision)
                log.info("kv %s: the connection came back; watching %s again from the current values",
                         self._bucket, pattern)
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()

    async def _start_watch(self, pattern: str):
        """nats-py's watcher, retried until the server serves the bucket again (it may have
        come back without JetStream ready, or without the bucket, which is made again)."""
        failures = 0
        while True:
            try:
                return await self._kv.watch(pattern)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - no responders, timeout, stream not found
                failures += 1
                log.warning("kv %s: cannot watch yet (%s); retrying", self._bucket, exc)
                await asyncio.sleep(min(0.25 * failures, 5.0))
                if self._recreate is not None:
                    with contextlib.suppress(Exception):
                        await self._recreate()


def without_credentials(url: str) -> str:
    """``url`` (or a comma-separated list of them) with any user, password or token it
    carries (``nats://user:pass@host``, ``nats://token@host``) masked, fit for a log line."""
    def one(part: str) -> str:
        scheme, sep, rest = part.partition("://")
        if not sep:
            scheme, rest = "", part
        userinfo, at, host = rest.rpartition("@")
        if not at:
            return part
        user, colon, _ = userinfo.partition(":")
        masked = f"{user}:***" if colon else "***"  # a lone userinfo is a token: all secret
        return f"{scheme}{sep}{masked}@{host}"
    return ",".join(one(part) for part in url.split(","))


def inbox_prefix_of(url: str) -> str:
    """The inbox prefix of a connection to ``url``: ``_INBOX_<user>`` when the URL names a
    user (``nats://user:pass@host``), the only inbox that user's permissions let it subscribe
    to (``contracts.permissions``), so no other user sees its answers; nats-py's ``_INBOX``
    when it names none (a local server, a token). ``ValueError`` in one line for a user that
    is not one subject token."""
    # Read as nats-py reads it (``Client._parse_server_uri``): a userinfo with a password is a
    # user, one without is a token. A URL urllib cannot parse is left to nats-py to refuse.
    try:
        uri = urlparse(url if "://" in url else f"nats://{url}")
        user, password = uri.username, uri.password
    except ValueError:
        return DEFAULT_INBOX_PREFIX
    return inbox_prefix(user) if user and password is not None else DEFAULT_INBOX_PREFIX


def cannot_connect(url: str, cause: BaseException) -> ConnectionError:
    """The one-line error for a first connection to ``url`` that never came, naming its
    cause (the first line of the error seen on the way, or its type when it says nothing).
    The URL's credentials are masked: this line goes to standard error and the logs."""
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return ConnectionError(f"cannot connect to NATS at {without_credentials(url)}: {first}")


class NatsBus(Bus):
    """A connection to NATS used by one service process."""

    def __init__(self, nc: Client, name: str) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._name = name
        self._stopping = asyncio.Event()
        self._loops: list[asyncio.Task] = []
        self._per_run: list[ConsumerSpec] = []  # this run's own consumers: removed when it stops
        self._micro: Service | None = None
        self._endpoints_served: set[tuple[str, str]] = set()
        self._core_subs: list = []  # drained, not cut, when the bus drains
        self._failing_since: dict[str, float] = {}  # durable → when its fetches began to fail
        self._kv_cache: dict[str, NatsKeyValue] = {}
        self._closing = asyncio.Event()
        self._reconnections = Reconnections()

    @classmethod
    async def connect(cls, url: str, name: str, *, connect_timeout_s: float = 5.0) -> NatsBus:
        """Connect with unlimited reconnects, so a restarted server is picked up again; the
        answers come on the inbox of the URL's user (``inbox_prefix_of``)."""

        closing = asyncio.Event()

        async def on_disconnect() -> None:
            if not closing.is_set():  # our own drain is not news
                log.warning("%s: disconnected from NATS", name)

        reconnections = Reconnections()

        async def on_reconnect() -> None:
            log.warning("%s: reconnected to NATS", name)
            reconnections.happened()

        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors[:] = [exc]  # the latest: what to tell if the first connection never comes
            log.debug("%s: NATS error: %s", name, exc)

        try:
            inbox = inbox_prefix_of(url)
        except ValueError as exc:
            raise cannot_connect(url, exc) from None
        # Unlimited reconnects once connected; the first connection must succeed in time,
        # or the caller learns at once that there is no server.
        try:
            nc = await asyncio.wait_for(nats.connect(
                servers=[url], name=name, inbox_prefix=inbox, connect_timeout=connect_timeout_s,
                max_reconnect_attempts=-1, reconnect_time_wait=0.25, allow_reconnect=True, ping_interval=PING_INTERVAL_S,
                max_outstanding_pings=MAX_OUTSTANDING_PINGS, disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect, error_cb=on_error), timeout=connect_timeout_s * 2)
        except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
            # A refused first connection is retried until the timeout, which alone says
            # nothing; the error seen on the way says why (refused, unknown host, TLS).
            raise cannot_connect(url, errors[-1] if errors else exc) from None
        except nats.errors.Error as exc:
            # A URL nats-py refuses before trying (a port that is no number or past 65535, no
            # host): no OSError, so a typo in FLEETPILOT_NATS_URL was a traceback.
            raise cannot_connect(url, exc) from None
        bus = cls(nc, name)
        bus._closing = closing
        bus._reconnections = reconnections
        return bus

    @property
    @override
    def connected(self) -> bool:
        return self._nc.is_connected

    @property
    @override
    def max_payload(self) -> int | None:
        return self._nc.max_payload

    @override
    def consumers_failing(self) -> dict[str, float]:
        now = time.monotonic()
        return {durable: now - since for durable, since in self._failing_since.items()}

    @override
    def unreachable(self, error: BaseException) -> bool:
        if isinstance(error, nats.js.errors.APIError):
            # A JetStream answer without a code is nats-py's rendering of "no responders": the
            # server is back but its JetStream does not serve yet. A coded answer is the server
            # judging the request (a stream config it refuses: 400), which asking again will not
            # change, except "temporarily unavailable".
            return (isinstance(error, nats.js.errors.ServiceUnavailableError)
                    and error.err_code in (None, JETSTREAM_TEMPORARILY_UNAVAILABLE))
        # A permission violation is told to error_cb only, and the request then times out: it
        # is taken for an outage, retried until the start-up limit, then reported.
        return isinstance(error, _UNREACHABLE)

    @override
    def refused(self, error: BaseException) -> bool:
        return isinstance(error, nats.errors.Error) and not self.unreachable(error)

    @override
    async def ensure_topology(self) -> None:
        for spec in STREAMS:
            config = api.StreamConfig(
                name=spec.name, subjects=list(spec.subjects), max_age=spec.max_age_s or None,
                duplicate_window=spec.duplicate_window_s, max_bytes=spec.max_bytes,
                storage=api.StorageType.MEMORY if spec.memory else api.StorageType.FILE)
            try:
                await self._js.add_stream(config)
            except nats.js.errors.BadRequestError as refused:
                # There with another config: updated to the catalog's, except its replica count
                # and placement, which the catalog does not declare and the operator sets on a
                # cluster (`nats stream edit --replicas 3`, deploy/README.md). Sent as the
                # default, they took every stream back to R1 at each service's start, and the
                # next node lost took its streams with it.
                try:
                    existing = (await self._js.stream_info(spec.name)).config
                except nats.js.errors.NotFoundError:
                    # Not there: refused for itself (another stream takes its subjects). Told as
                    # the missing stream the update looked for, the cause was hidden.
                    raise refused from None
                config.num_replicas, config.placement = existing.num_replicas, existing.placement
                try:
                    # The same stream as there, its replicas and placement included: a create
                    # that changes nothing succeeds, and needs no right to update a stream,
                    # which a service's NATS user may lack (the executor's, whose pod runs
                    # user code: contracts.permissions).
                    await self._js.add_stream(config)
                except nats.js.errors.BadRequestError:
                    await self._js.update_stream(config)
        for bucket in BUCKETS:
            with contextlib.suppress(nats.js.errors.BadRequestError):
                await self._js.create_key_value(bucket=bucket.name, history=bucket.history,
                                                ttl=bucket.ttl_s or None, description=bucket.description)
        for stream, durable in RETIRED_CONSUMERS:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self._js.delete_consumer(stream, durable)

    @override
    async def publish(self, event: Event, *, headers: dict[str, str] | None = None) -> None:
        hdrs = dict(headers or {})
        msg_id = msg_id_for(event)
        if msg_id:
            hdrs["Nats-Msg-Id"] = msg_id
        await self.publish_raw(subject_for(event), encode(event), headers=hdrs,
                               durable=route_for(type(event)).durable)

    @override
    async def publish_raw(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None,
                          durable: bool = True) -> None:
        if durable:
            await self._js.publish(subject, data, headers=headers or None)
        else:
            await self._nc.publish(subject, data, headers=headers or None)

    async def _bind(self, spec: ConsumerSpec):
        existing = await self._consumer_info(spec) if spec.start_s_ago is not None else None
        if existing is not None:
            # A replica's own consumer made before (the replica restarted, or re-binds after
            # a reconnect) goes on from where it is: its start time counts only when it is
            # first made, and the server refuses to change it ("start time can not be
            # updated", 10012), which a time computed now always would. What the catalog may
            # change is applied, though: kept as first made (for a week idle), an instance's
            # consumer held an ack wait the catalog had changed (a crashed node's decision
            # waited out the old one; the dispatcher's in-progress beats followed the new one)
            # and a filter it had widened (the new subjects never reached the instance).
            await self._update_editable(spec, existing.config)
            return await self._js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)
        if spec.start_s_ago is None:
            start: dict = {"deliver_policy": api.DeliverPolicy.ALL}
        else:
            start = {"deliver_policy": api.DeliverPolicy.BY_START_TIME,
                     "opt_start_time": datetime.fromtimestamp(time.time() - spec.start_s_ago, tz=UTC)}
        config = api.ConsumerConfig(
            durable_name=spec.durable, filter_subject=spec.filter_subject,
            ack_policy=api.AckPolicy.EXPLICIT, **start,
            ack_wait=spec.ack_wait_s, max_ack_pending=spec.max_ack_pending,
            inactive_threshold=spec.idle_limit_s,
            # Redelivery limits are enforced by the dispatcher so that the last failure
            # is dead-lettered rather than silently dropped by the server.
            max_deliver=-1)
        try:
            await self._js.add_consumer(spec.stream, config)
        except nats.js.errors.BadRequestError:
            log.debug("consumer %s exists with another config; binding to it", spec.durable)
        return await self._js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)

    async def _consumer_info(self, spec: ConsumerSpec) -> api.ConsumerInfo | None:
        try:
            return await self._js.consumer_info(spec.stream, spec.durable)
        except nats.js.errors.NotFoundError:
            return None

    async def _update_editable(self, spec: ConsumerSpec, config: api.ConsumerConfig) -> None:
        """Give an existing consumer the settings of ``spec`` that the server lets change,
        keeping where it starts."""
        wanted = {"ack_wait": float(spec.ack_wait_s), "max_ack_pending": spec.max_ack_pending,
                  "inactive_threshold": spec.idle_limit_s, "filter_subject": spec.filter_subject}
        if all(getattr(config, name) == value for name, value in wanted.items()):
            return
        log.info("consumer %s: applying the catalog's %s", spec.durable,
                 ", ".join(f"{name}={value}" for name, value in wanted.items() if getattr(config, name) != value))
        try:
            await self._js.add_consumer(spec.stream, dataclasses.replace(config, **wanted))
        except nats.js.errors.BadRequestError as exc:
            # Bound as it is rather than not at all; said where an operator reads it.
            log.warning("consumer %s keeps its settings, the server refused the catalog's: %s", spec.durable, exc)

    async def _remove_per_run(self) -> None:
        """Remove this run's own consumers (``ConsumerSpec.per_run``), its loops done: the
        next run makes its own, so one kept would be left for nobody. Best effort: a server
        out of reach now removes them itself after ``RUN_IDLE_LIMIT_S``."""
        for spec in self._per_run:
            try:
                await asyncio.wait_for(self._js.delete_consumer(spec.stream, spec.durable), timeout=2.0)
            except nats.js.errors.NotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - stopping goes on; the server's idle limit removes it
                log.info("consumer %s left to the server's idle limit (%gs): %s", spec.durable,
                         spec.idle_limit_s or 0, str(exc) or type(exc).__name__)
        self._per_run.clear()

    @override
    async def consume(self, spec: ConsumerSpec, handler: InboundHandler) -> None:
        if spec.per_run:
            # This run's first bind: a consumer of that name is the last run's (the same
            # replica id back after a restart or a crash), positioned past what that run read
            # and lost with its memory. Made afresh, it reads the recent past again. A re-bind
            # later in this run (``_consume_loop``) goes on from where this run is.
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self._js.delete_consumer(spec.stream, spec.durable)
        sub = await self._bind(spec)
        if spec.per_run:
            self._per_run.append(spec)
        self._loops.append(asyncio.create_task(self._consume_loop(spec, sub, handler),
                                               name=f"consume:{spec.durable}"))

    async def _consume_loop(self, spec: ConsumerSpec, sub, handler: InboundHandler) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                # One at a time: nats-py's fetch of a batch returns when the batch is full or
                # the timeout is over, so a quiet stream delayed each message by up to the
                # timeout (about 0.5 s per hop, 0.7 s from submission to decision in `up`).
                # Fetching one returns the moment it arrives; a round trip per message is
                # cheap next to what a handler does with it.
                msgs = await sub.fetch(1, timeout=1.0)
                failures = 0
                self._failing_since.pop(spec.durable, None)
            except (nats.errors.TimeoutError, TimeoutError):  # nats-py raises either when idle
                self._failing_since.pop(spec.durable, None)
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - connection loss, consumer lost on a fresh server
                failures += 1
                self._failing_since.setdefault(spec.durable, time.monotonic())
                log.warning("consumer %s: %s; re-binding", spec.durable, exc)
                await asyncio.sleep(min(0.25 * failures, 5.0))
                with contextlib.suppress(Exception):
                    if self._nc.is_connected:
                        await self.ensure_topology()
                        sub = await self._bind(spec)
                continue
            for i, msg in enumerate(msgs):
                if self._stopping.is_set():
                    # Hand what we fetched but did not start back to the other replicas now.
                    for rest in msgs[i:]:
                        with contextlib.suppress(Exception):
                            await rest.nak()
                    break
                try:
                    await handler(_NatsInbound(msg, durable=True))
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - the loop must outlive any one message
                    # A message the handler could not settle (its dead letter's publish timed
                    # out in a failover) comes again after the ack wait. Letting the error
                    # end this task stopped the replica consuming for good, unseen by /healthz.
                    log.exception("consumer %s: a message was left unsettled; it comes again after %gs",
                                  spec.durable, spec.ack_wait_s)

    @override
    async def subscribe(self, subject: str, handler: InboundHandler, *, queue: str | None = None) -> None:
        async def on_msg(msg: Msg) -> None:
            try:
                await handler(_NatsInbound(msg, durable=False))
            except Exception:  # noqa: BLE001 - nats-py would pass it to error_cb, logged at debug only
                # A core message is not delivered again: say at error level that it is lost.
                log.exception("subscription %s: a message on %s was lost", subject, msg.subject)

        sub = await self._nc.subscribe(subject, queue=queue or "", cb=on_msg)
        self._core_subs.append(sub)
        # Core messages are not kept: until the server has the subscription, what is published
        # is lost. A started service hears everything published after start().
        try:
            await self._subscriptions_known()
        except BaseException:
            # Not known to have reached the server (it went away meanwhile): taken back, so a
            # caller that subscribes again once it is back (start-up does) has one subscription,
            # not two each handling every message.
            self._core_subs.remove(sub)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            raise

    @staticmethod
    async def _drained(sub) -> None:
        """Drain one subscription; one that is gone already (the connection lost) is no error."""
        with contextlib.suppress(Exception):
            await sub.drain()

    @override
    async def serve(self, service: str, name: str, subject: str, handler: RequestHandler) -> None:
        # Safe to call again after it failed (start-up does, across an outage): the service and
        # each endpoint are made once, and only their reaching the server is waited for again.
        # nats-py's add_service, whose flush fails in an outage after it subscribed, made a
        # second service (another id answering pings) on each try, and a second add_endpoint a
        # second subscription.
        if self._micro is None:
            self._micro = Service(self._nc, ServiceConfig(name=f"fleetpilot-{service}", version="0.1.0"))
        await self._micro.start()  # subscribes once; returns at once when it has

        async def on_request(req) -> None:
            await req.respond(await handler(req.data, dict(req.headers or {})))

        if (name, subject) not in self._endpoints_served:
            await self._micro.add_endpoint(EndpointConfig(name=name, subject=subject, handler=on_request))
            self._endpoints_served.add((name, subject))
        # Known to the server before the caller advertises readiness: a request sent after
        # start() must not get "no responders".
        await self._subscriptions_known()

    async def _subscriptions_known(self) -> None:
        """Return once the server has every subscription this connection made so far.

        nats-py queues a SUB for its flusher task but writes ``flush()``'s PING straight to
        the socket, so the PONG can come back before the SUB has even been sent: a request
        from another connection then got "no responders" (8 in 300 in a loop here; the SLA
        service's test saw it under load). Writing the queue out first (the client's own
        flush of pending commands, waited for) puts the SUB ahead of the PING."""
        await self._nc._flush_pending(force_flush=True)  # nats-py has no public way to wait for its queue
        await self._nc.flush()

    @override
    async def request(self, subject: str, data: bytes, *, timeout_s: float = 2.0,
                      headers: dict[str, str] | None = None) -> bytes:
        try:
            msg = await self._nc.request(subject, data, timeout=timeout_s, headers=headers)
        except nats.errors.NoRespondersError as exc:
            raise TimeoutError(f"no responder on {subject}") from exc
        except nats.errors.TimeoutError as exc:
            raise TimeoutError(f"no reply on {subject} within {timeout_s:g} s") from exc
        # A handler that raised is answered by nats.micro with an empty body and these
        # headers: say so instead of handing the caller an empty reply to decode.
        error = (msg.headers or {}).get("Nats-Service-Error")
        if error is not None:
            code = (msg.headers or {}).get("Nats-Service-Error-Code", "?")
            raise RuntimeError(f"{subject} failed ({code}): {error}")
        return msg.data

    @override
    async def last_stored_at(self, subject: str) -> float | None:
        stream = stream_of(subject)
        if stream is None:
            return None
        try:
            msg = await self._js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            return None
        return msg.time.timestamp() if msg.time is not None else None

    @override
    async def first_stored_at(self, subject: str) -> float | None:
        stream = stream_of(subject)
        if stream is None:
            return None
        state = (await self._js.stream_info(stream)).state
        if not state.messages or not state.first_seq:
            return None
        try:
            msg = await self._js.get_msg(stream, seq=state.first_seq)
        except nats.js.errors.NotFoundError:
            return None  # discarded meanwhile: the next look sees the new first
        return msg.time.timestamp() if msg.time is not None else None

    @override
    async def stream_messages(self, stream: str, subject: str, *, since: float | None = None,
                              batch: int = 256) -> AsyncIterator[StoredMessage]:
        # Read through an ephemeral consumer that acknowledges nothing: no consumer of the
        # stream is moved.
        config = api.ConsumerConfig(
            filter_subject=subject, ack_policy=api.AckPolicy.NONE, inactive_threshold=30.0,
            deliver_policy=api.DeliverPolicy.BY_START_TIME if since is not None else api.DeliverPolicy.ALL,
            opt_start_time=datetime.fromtimestamp(since, UTC).isoformat() if since is not None else None)
        sub = await self._js.pull_subscribe(subject, durable=None, stream=stream, config=config)
        try:
            while True:
                try:
                    msgs = await sub.fetch(batch, timeout=1.0)
                except TimeoutError:  # nats-py's own or the builtin one, by where its wait ran out
                    return  # nothing (more) stored
                for msg in msgs:
                    meta = msg.metadata
                    yield StoredMessage(sequence=meta.sequence.stream, subject=msg.subject, data=msg.data,
                                        headers=dict(msg.headers or {}), at=meta.timestamp.timestamp())
                if msgs and msgs[-1].metadata.num_pending == 0:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def stored(self, stream: str, sequence: int) -> StoredMessage | None:
        """The message at ``sequence`` of ``stream`` (``None``: gone, removed by the stream's
        limits or by hand; or no such stream)."""
        try:
            msg = await self._js.get_msg(stream, seq=sequence)
        except nats.js.errors.NotFoundError:
            return None
        return StoredMessage(sequence=sequence, subject=msg.subject, data=msg.data or b"",
                             headers=dict(msg.headers or {}), at=msg.time.timestamp() if msg.time else 0.0)

    async def delete_stored(self, stream: str, sequence: int) -> None:
        """Remove one message from ``stream`` (a dead letter redriven); gone already is fine."""
        try:
            await self._js.delete_msg(stream, sequence)
        except nats.js.errors.NotFoundError:
            pass

    async def publish_stored(self, subject: str, data: bytes, headers: dict[str, str], msg_id: str) -> bool:
        """Publish ``data`` to the stream that takes ``subject``, de-duplicated by ``msg_id``;
        whether it is stored now (``False``: the stream had that id already). Raises
        ``LookupError`` when no stream takes the subject."""
        try:
            ack = await self._js.publish(subject, data, headers={**headers, "Nats-Msg-Id": msg_id})
        except nats.errors.NoRespondersError as exc:
            raise LookupError(f"no stream takes {subject}") from exc
        except nats.js.errors.NoStreamResponseError as exc:
            raise LookupError(f"no stream takes {subject}") from exc
        return not ack.duplicate

    @override
    async def kv(self, bucket: str) -> KeyValue:
        if bucket not in self._kv_cache:
            try:
                kv = await self._js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                await self.ensure_topology()
                kv = await self._js.key_value(bucket)
            self._kv_cache[bucket] = NatsKeyValue(kv, self._js, bucket, self._reconnections, self.ensure_topology,
                                                   nc=self._nc)
        return self._kv_cache[bucket]

    async def bucket_keys(self, bucket: str) -> list[str]:
        """Every key ``bucket`` has a subject for, deleted ones included, in one request
        (``KeyValue.keys`` reads each key)."""
        return await bucket_subject_keys(self._js, bucket)

    @override
    async def stop_consuming(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._loops:
            await asyncio.wait(self._loops, timeout=10)
        await self._remove_per_run()
        # Closing the connection, or nats.micro's stop (which unsubscribes its endpoints),
        # cancels a handler at work: a request in flight got no answer (its caller a timeout
        # in a rolling restart) and a core message being handled was lost. Each subscription
        # is drained instead: the server sends it nothing more, and what it took is handled.
        subs = list(self._core_subs)
        if self._micro is not None:
            subs += [ep._subscription for ep in getattr(self._micro, "_endpoints", ())
                     if getattr(ep, "_subscription", None) is not None]  # nats.micro keeps them private
        if subs:
            draining = [asyncio.create_task(self._drained(sub)) for sub in subs]
            _, overdue = await asyncio.wait(draining, timeout=10)
            for task in overdue:  # a handler past it is cut by the close, as before
                task.cancel()
        if self._micro is not None:
            with contextlib.suppress(Exception):  # its endpoints' subscriptions are drained already
                await self._micro.stop()

    @override
    async def drain(self) -> None:
        await self.stop_consuming()
        self._closing.set()
        # Every consumer loop has finished its messages by now. A NATS drain would wait on
        # the pull subscriptions' open requests; instead flush what we published and close.
        with contextlib.suppress(Exception):
            await self._nc.flush(timeout=2)
        if not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.close()

"""An in-process bus with JetStream-like semantics, for fast service tests.

Durable consumers see every stored message on their filter (even those published before
they started), are shared by all handlers bound to the same durable name, redeliver on
``nak`` with the asked delay and de-duplicate publishes by ``Nats-Msg-Id``. A stored message
has a sequence in its stream and the time it was stored (the bus's clock), handed to its
handler as JetStream's are (``Delivery.stream_seq``, ``Delivery.stored_at``). JetStream
behaviour that matters in production is tested against the real server, never here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from typing_extensions import override

from fleetpilot.contracts import (
    BUCKETS,
    ConsumerSpec,
    Event,
    encode,
    msg_id_for,
    route_for,
    subject_for,
)
from fleetpilot.contracts.catalog import stream_of

from .bus import (
    Bus,
    CasConflict,
    Inbound,
    InboundHandler,
    KeyValue,
    KvEntry,
    RequestHandler,
    StoredMessage,
    subject_matches,
)


@dataclass
class _Stored:
    subject: str
    data: bytes
    headers: dict[str, str]
    at: float = field(default_factory=time.time)
    sequence: int | None = None  # in its stream; None: no stream keeps it (a core message)


class _MemoryInbound(Inbound):
    def __init__(self, consumer: _MemoryConsumer, stored: _Stored, deliveries: int, durable: bool) -> None:
        self.subject, self.data, self.headers = stored.subject, stored.data, dict(stored.headers)
        self.deliveries = deliveries
        if durable:  # as JetStream's metadata: a core subscriber is told neither
            self.stream_seq, self.stored_at = stored.sequence, stored.at
        self._consumer, self._stored, self._durable = consumer, stored, durable
        self._settled = False

    async def ack(self) -> None:
        self._settle()

    async def term(self) -> None:
        self._settle()

    async def in_progress(self) -> None:
        """Nothing to restart: this bus redelivers on ``nak`` only, never by an ack wait."""

    async def nak(self, delay_s: float) -> None:
        if self._durable and not self._settled:
            self._settle()
            self._consumer.redeliver(self._stored, self.deliveries + 1, delay_s)

    def _settle(self) -> None:
        if not self._settled:
            self._settled = True
            self._consumer.settled()


@dataclass
class _MemoryConsumer:
    spec: ConsumerSpec
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    in_flight: int = 0
    workers: list[asyncio.Task] = field(default_factory=list)
    busy: set[asyncio.Task] = field(default_factory=set)  # workers with a handler at work

    def offer(self, stored: _Stored, deliveries: int = 1) -> None:
        self.in_flight += 1
        self.queue.put_nowait((stored, deliveries))

    def redeliver(self, stored: _Stored, deliveries: int, delay_s: float) -> None:
        self.in_flight += 1
        asyncio.get_running_loop().call_later(max(delay_s, 0.0), self.queue.put_nowait, (stored, deliveries))

    def settled(self) -> None:
        self.in_flight -= 1


class MemoryKeyValue(KeyValue):
    """A dict with revisions and watchers, shaped like a NATS KV bucket."""

    def __init__(self, bus: InMemoryBus) -> None:
        self._data: dict[str, KvEntry] = {}
        self._bus = bus
        self._watchers: list[tuple[str, asyncio.Queue]] = []

    @override
    async def get(self, key: str) -> KvEntry | None:
        entry = self._data.get(key)
        return entry if entry is not None and entry.value is not None else None

    def _write(self, key: str, value: bytes | None) -> int:
        revision = next(self._bus._revisions)
        entry = KvEntry(key, value, revision)
        self._data[key] = entry
        for pattern, queue in self._watchers:
            if subject_matches(pattern, key):
                queue.put_nowait(entry)
        return revision

    @override
    async def put(self, key: str, value: bytes) -> int:
        return self._write(key, value)

    @override
    async def create(self, key: str, value: bytes) -> int:
        if await self.get(key) is not None:
            raise CasConflict(f"key {key!r} exists")
        return self._write(key, value)

    @override
    async def update(self, key: str, value: bytes, revision: int) -> int:
        current = self._data.get(key)
        if current is None or current.revision != revision:
            raise CasConflict(f"key {key!r} is not at revision {revision}")
        return self._write(key, value)

    @override
    async def delete(self, key: str, revision: int | None = None) -> None:
        current = self._data.get(key)
        if revision is not None and (current is None or current.revision != revision):
            raise CasConflict(f"key {key!r} is not at revision {revision}")
        if current is not None:
            self._write(key, None)

    @override
    async def keys(self) -> list[str]:
        return [k for k, e in self._data.items() if e.value is not None]

    @override
    async def watch(self, pattern: str = ">") -> AsyncIterator[KvEntry]:
        queue: asyncio.Queue = asyncio.Queue()
        for entry in list(self._data.values()):
            if subject_matches(pattern, entry.key) and entry.value is not None:
                queue.put_nowait(entry)
        self._watchers.append((pattern, queue))
        try:
            while True:
                yield await queue.get()
        finally:
            self._watchers.remove((pattern, queue))


class InMemoryBus(Bus):
    """All services of a test in one event loop, talking through this object; ``clock``
    (epoch seconds) stamps what a stream stores, as the server's clock does (tests move it
    to store a message "earlier" than its handler runs)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._streams: dict[str, list[_Stored]] = defaultdict(list)
        self._consumers: dict[str, _MemoryConsumer] = {}
        self._core: list[tuple[str, str | None, InboundHandler]] = []
        self._queue_rr = itertools.count()
        self._seen_ids: set[str] = set()
        self._endpoints: dict[str, RequestHandler] = {}
        self._buckets: dict[str, MemoryKeyValue] = {}
        self._revisions = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._consuming = True
        self._closed = False

    @property
    @override
    def connected(self) -> bool:
        return not self._closed

    @property
    def consuming(self) -> bool:
        """Whether handlers are still handed new messages (until :meth:`stop_consuming`)."""
        return self._consuming

    @override
    async def ensure_topology(self) -> None:
        for bucket in BUCKETS:
            self._buckets.setdefault(bucket.name, MemoryKeyValue(self))

    @override
    async def publish(self, event: Event, *, headers: dict[str, str] | None = None) -> None:
        hdrs = dict(headers or {})
        msg_id = msg_id_for(event)
        if msg_id:
            hdrs["Nats-Msg-Id"] = msg_id
        await self.publish_raw(subject_for(event), encode(event), headers=hdrs, durable=route_for(type(event)).durable)

    @override
    async def publish_raw(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None,
                          durable: bool = True) -> None:
        hdrs = dict(headers or {})
        msg_id = hdrs.get("Nats-Msg-Id")
        stream = stream_of(subject)
        stored = _Stored(subject, data, hdrs, at=self._clock())
        if stream is not None and not (msg_id and msg_id in self._seen_ids):
            if msg_id:
                self._seen_ids.add(msg_id)
            # Numbered per stream from 1, as JetStream does; nothing is ever removed here.
            stored.sequence = len(self._streams[stream]) + 1
            self._streams[stream].append(stored)
            for consumer in self._consumers.values():
                if consumer.spec.stream == stream and subject_matches(consumer.spec.filter_subject, subject):
                    consumer.offer(stored)
        self._fan_out(stored)

    @override
    async def last_stored_at(self, subject: str) -> float | None:
        stream = stream_of(subject)
        for stored in reversed(self._streams.get(stream, []) if stream else []):
            if stored.subject == subject:
                return stored.at
        return None

    @override
    async def first_stored_at(self, subject: str) -> float | None:
        stream = stream_of(subject)
        kept = self._streams.get(stream, []) if stream else []
        return kept[0].at if kept else None

    @override
    async def stream_messages(self, stream: str, subject: str, *, since: float | None = None
                              ) -> AsyncIterator[StoredMessage]:
        for kept in list(self._streams.get(stream, [])):
            if subject_matches(subject, kept.subject) and (since is None or kept.at >= since):
                yield StoredMessage(sequence=kept.sequence or 0, subject=kept.subject, data=kept.data,
                                    headers=dict(kept.headers or {}), at=kept.at)

    def _fan_out(self, stored: _Stored) -> None:
        if not self._consuming:
            return  # as the real bus's drained subscriptions: nothing more is handed to them
        groups_done: set[str] = set()
        subs = [s for s in self._core if subject_matches(s[0], stored.subject)]
        turn = next(self._queue_rr)
        for pattern, queue, handler in subs:
            if queue is not None:
                if queue in groups_done:
                    continue
                members = [s for s in subs if s[1] == queue]
                pattern, queue, handler = members[turn % len(members)]
                groups_done.add(queue)
            inbound = _MemoryInbound(_MemoryConsumer(ConsumerSpec("core", "", pattern)), stored, 1, durable=False)
            self._spawn(handler(inbound))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @override
    async def consume(self, spec: ConsumerSpec, handler: InboundHandler) -> None:
        consumer = self._consumers.get(spec.durable)
        if consumer is None:
            consumer = self._consumers[spec.durable] = _MemoryConsumer(spec)
            # Stored messages keep no time here: ``start_s_ago`` starts at the first too.
            for stored in self._streams.get(spec.stream, []):
                if subject_matches(spec.filter_subject, stored.subject):
                    consumer.offer(stored)

        async def work() -> None:
            me = asyncio.current_task()
            while self._consuming:
                stored, deliveries = await consumer.queue.get()
                consumer.busy.add(me)  # type: ignore[arg-type]
                try:
                    await handler(_MemoryInbound(consumer, stored, deliveries, durable=True))
                finally:
                    consumer.busy.discard(me)  # type: ignore[arg-type]

        consumer.workers.append(asyncio.ensure_future(work()))

    @override
    async def subscribe(self, subject: str, handler: InboundHandler, *, queue: str | None = None) -> None:
        self._core.append((subject, queue, handler))

    @override
    async def serve(self, service: str, name: str, subject: str, handler: RequestHandler) -> None:
        self._endpoints[subject] = handler

    @override
    async def request(self, subject: str, data: bytes, *, timeout_s: float = 2.0,
                      headers: dict[str, str] | None = None) -> bytes:
        for pattern, handler in self._endpoints.items():
            if subject_matches(pattern, subject):
                try:
                    return await asyncio.wait_for(handler(data, dict(headers or {})), timeout_s)
                except TimeoutError:
                    raise TimeoutError(f"no reply on {subject} within {timeout_s:g} s") from None
                except Exception as exc:  # as nats.micro answers a handler that raised
                    raise RuntimeError(f"{subject} failed (500): {exc!r}") from exc
        raise TimeoutError(f"no responder on {subject}")

    @override
    async def kv(self, bucket: str) -> KeyValue:
        if bucket not in self._buckets:
            await self.ensure_topology()
        try:
            return self._buckets[bucket]
        except KeyError:
            raise LookupError(f"no bucket {bucket!r} declared in the catalog") from None

    def stored(self, stream: str) -> list[tuple[str, bytes]]:
        """What a stream holds, as (subject, data) pairs: lets tests look at the bus."""
        return [(s.subject, s.data) for s in self._streams.get(stream, [])]

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Wait until no consumer has a message in flight (tests call this, services never)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            busy = any(c.in_flight for c in self._consumers.values()) or any(not t.done() for t in self._tasks)
            if not busy:
                return
            await asyncio.sleep(0.01)
        raise TimeoutError("bus did not settle")

    @override
    async def stop_consuming(self, timeout_s: float = 10.0) -> None:
        if not self._consuming:
            return
        self._consuming = False
        # As the real bus drains: a worker waiting for a message is stopped, one at work and
        # each core message being handled finish first (cancelled, they cut the handler).
        workers = [worker for consumer in self._consumers.values() for worker in consumer.workers]
        for consumer in self._consumers.values():
            for worker in consumer.workers:
                if worker not in consumer.busy:
                    worker.cancel()
        pending = [*workers, *self._tasks]
        if pending:
            _, overdue = await asyncio.wait(pending, timeout=timeout_s)
            for task in overdue:  # a handler past it is cut, as the real bus's close cuts it
                task.cancel()
            if overdue:
                await asyncio.wait(overdue, timeout=1.0)

    @override
    async def drain(self, timeout_s: float = 10.0) -> None:
        await self.stop_consuming(timeout_s)
        self._closed = True

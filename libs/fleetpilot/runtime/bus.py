"""The bus seen by a service: publish typed events, consume them, ask and answer, keep state.

Two implementations share these types: ``NatsBus`` (nats-py, JetStream, KV, micro) and
``InMemoryBus`` (one process, for fast service tests). Handlers never see either: the
``Dispatcher`` turns an ``Inbound`` message into a typed call and back.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from fleetpilot.contracts import ConsumerSpec, Event, subject_matches


@dataclass(frozen=True)
class Delivery:
    """What a handler may know about the message it handles (never a NATS object)."""

    subject: str
    headers: dict[str, str] = field(default_factory=dict)
    deliveries: int = 1
    msg_id: str | None = None
    pending: int | None = None
    """How many messages the consumer had still to deliver after this one when it was
    delivered (0: it was the last one stored then); ``None`` when not known (a core message,
    the in-memory bus)."""
    stream_seq: int | None = None
    """The message's sequence in the stream that keeps it, the same at every delivery: of two
    messages on one subject, the one stored later has the higher. ``None`` for a core message
    (and a request), which no stream keeps for it. A stream made again (a server that lost
    its store) numbers from 1 again: compare it with ``stored_at`` too where that matters."""
    stored_at: float | None = None
    """When the stream stored the message (epoch seconds, the server's clock, not this
    process's), the same at every delivery: when it was sent, give or take the trip to the
    server, however long it waited for its handler. ``None`` where ``stream_seq`` is."""


class Retry(Exception):
    """Raised by a handler to have the message delivered again after ``delay_s``."""

    def __init__(self, reason: str, delay_s: float = 1.0) -> None:
        super().__init__(reason)
        self.delay_s = delay_s


class Reject(Exception):
    """Raised by a handler for a message that can never succeed: it is dead-lettered at once."""


class CasConflict(Exception):
    """A compare-and-set write lost: the key changed since the revision it was based on."""


@dataclass(frozen=True)
class KvEntry:
    """A key's value and revision; ``value is None`` marks a deletion in a watch."""

    key: str
    value: bytes | None
    revision: int


class KeyValue(abc.ABC):
    """A KV bucket with compare-and-set, the only way shared state is written."""

    @abc.abstractmethod
    async def get(self, key: str) -> KvEntry | None:
        """The current entry, or ``None`` when the key is absent or deleted."""

    @abc.abstractmethod
    async def put(self, key: str, value: bytes) -> int:
        """Write unconditionally; returns the new revision."""

    async def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Write each ``(key, value)`` unconditionally, in order, where no one write's revision
        is wanted (a cache of the latest samples). Raises as ``put`` does when the bucket does
        not take the last; one before it may be lost unseen (a cache's next round rewrites it)."""
        for key, value in items:
            await self.put(key, value)

    @abc.abstractmethod
    async def create(self, key: str, value: bytes) -> int:
        """Write only if the key does not exist; raises ``CasConflict`` otherwise."""

    @abc.abstractmethod
    async def update(self, key: str, value: bytes, revision: int) -> int:
        """Write only if the key is still at ``revision``; raises ``CasConflict`` otherwise."""

    @abc.abstractmethod
    async def delete(self, key: str, revision: int | None = None) -> None:
        """Remove a key (no error when absent); with ``revision``, only if the key is still
        at it, raising ``CasConflict`` otherwise."""

    @abc.abstractmethod
    async def keys(self) -> list[str]:
        """Every live key."""

    @abc.abstractmethod
    def watch(self, pattern: str = ">") -> AsyncIterator[KvEntry]:
        """The current values of matching keys, then every change, until cancelled."""


class Inbound(abc.ABC):
    """One received message with its acknowledgement verbs, as each bus implements them."""

    subject: str
    data: bytes
    headers: dict[str, str]
    deliveries: int
    pending: int | None = None
    """Messages the consumer had still to deliver after this one (``Delivery.pending``)."""
    stream_seq: int | None = None
    """The message's sequence in its stream (``Delivery.stream_seq``)."""
    stored_at: float | None = None
    """When its stream stored it, the server's clock (``Delivery.stored_at``)."""
    origin: str | None = None
    """Where a stream keeps the message and who reads it (``<stream>:<consumer>:<sequence>``),
    the same at every delivery; ``None`` for one nothing keeps. Its dead letter's idempotency
    key is made from it: one letter per message and consumer, however often it is refused
    (the fingerprinter and the SLA service each refuse a malformed submission, and each says why)."""

    @abc.abstractmethod
    async def ack(self) -> None:
        """Done: never deliver again."""

    @abc.abstractmethod
    async def nak(self, delay_s: float) -> None:
        """Failed for now: deliver again after ``delay_s``."""

    @abc.abstractmethod
    async def term(self) -> None:
        """Never deliver again, without success (it has been dead-lettered)."""

    @abc.abstractmethod
    async def in_progress(self) -> None:
        """Still at work on it: the server waits its ack wait again before redelivering."""


InboundHandler = Callable[[Inbound], Awaitable[None]]
RequestHandler = Callable[[bytes, dict[str, str]], Awaitable[bytes]]


@dataclass(frozen=True)
class StoredMessage:
    """One message a stream keeps: its sequence there, subject, bytes, headers, and when it
    was stored (epoch seconds, the server's clock)."""

    sequence: int
    subject: str
    data: bytes
    headers: dict[str, str]
    at: float


class Bus(abc.ABC):
    """Transport used by the service host; durable subjects go over JetStream."""

    @abc.abstractmethod
    async def publish(self, event: Event, *, headers: dict[str, str] | None = None) -> None:
        """Publish an event on its catalogued subject with its idempotency key."""

    @abc.abstractmethod
    async def publish_raw(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None,
                          durable: bool = True) -> None:
        """Publish bytes as they are (used for dead letters and by tests sending garbage)."""

    @abc.abstractmethod
    async def consume(self, spec: ConsumerSpec, handler: InboundHandler) -> None:
        """Start feeding a durable pull consumer, shared by replicas, to ``handler``."""

    @abc.abstractmethod
    async def subscribe(self, subject: str, handler: InboundHandler, *, queue: str | None = None) -> None:
        """Start a core subscription (no redelivery; ack verbs are no-ops)."""

    @abc.abstractmethod
    async def serve(self, service: str, name: str, subject: str, handler: RequestHandler) -> None:
        """Answer requests on ``subject`` (a micro endpoint on NATS)."""

    @abc.abstractmethod
    async def request(self, subject: str, data: bytes, *, timeout_s: float = 2.0,
                      headers: dict[str, str] | None = None) -> bytes:
        """Send a request and wait for one reply.

        Raises ``TimeoutError`` when nobody serves ``subject`` or no reply comes in time, and
        ``RuntimeError`` naming the error when the serving handler raised.
        """

    @abc.abstractmethod
    async def last_stored_at(self, subject: str) -> float | None:
        """When a stream stored its last message on ``subject`` (one literal subject), by
        the server's clock; ``None`` when no stream keeps one."""

    @abc.abstractmethod
    async def first_stored_at(self, subject: str) -> float | None:
        """When the stream that keeps ``subject`` stored the oldest message it still keeps
        (on any of its subjects): how far back ``last_stored_at`` can see. ``None`` when it
        keeps nothing, or no stream keeps ``subject``."""

    @abc.abstractmethod
    def stream_messages(self, stream: str, subject: str, *, since: float | None = None
                        ) -> AsyncIterator[StoredMessage]:
        """The messages ``stream`` keeps on ``subject`` (wildcards allowed), oldest first;
        only those stored at or after ``since`` (epoch seconds) when it is given. Reading
        them acknowledges nothing and moves no consumer."""

    @abc.abstractmethod
    async def kv(self, bucket: str) -> KeyValue:
        """A catalogued KV bucket."""

    @abc.abstractmethod
    async def ensure_topology(self) -> None:
        """Create the catalogued streams and buckets (idempotent)."""

    @abc.abstractmethod
    async def stop_consuming(self) -> None:
        """Stop taking new messages and let the handlers at work finish theirs; publishing,
        requests and the buckets still work until :meth:`drain`. Idempotent."""

    @abc.abstractmethod
    async def drain(self) -> None:
        """Stop consuming (:meth:`stop_consuming`, if not done yet), then close."""

    @property
    @abc.abstractmethod
    def connected(self) -> bool:
        """Whether the transport is currently usable (drives ``/healthz``)."""

    @property
    def max_payload(self) -> int | None:
        """The most bytes one message may hold on this bus (the server's limit); ``None``:
        no limit (a bus in one process)."""
        return None

    def consumers_failing(self) -> dict[str, float]:
        """Each durable consumer whose fetches fail now, with how many seconds they have failed
        in a row (the connection is up, but JetStream does not serve it). A bus in one process
        never fails to fetch."""
        return {}

    def unreachable(self, error: BaseException) -> bool:
        """Whether ``error`` says the server cannot be reached right now (it went away, or is
        back but not serving yet), so that the call that raised it may succeed once it is back.
        A bus in one process is never unreachable."""
        return False

    def refused(self, error: BaseException) -> bool:
        """Whether ``error`` is the server's answer refusing a request (a stream's config it
        will not take, a bucket that is not there): an operator's matter, told in one line
        at start-up. A bus in one process refuses nothing."""
        return False

__all__ = ["Bus", "CasConflict", "Delivery", "Inbound", "KeyValue", "KvEntry", "Reject", "Retry", "subject_matches"]

"""Turns a received message into one typed handler call and its outcome into ack verbs.

The one place where delivery semantics live, shared by both buses:

- undecodable bytes (broken JSON, wrong type, unknown tag) → dead letter at once, ``term``;
- ``Reject`` from the handler → dead letter at once, ``term``;
- an event the handling made that holds NaN or an infinity (``NonFiniteFloat``: JSON has
  neither) → dead letter at once (reason ``unencodable``, naming the field), ``term``, and
  none of its outputs published: no delivery again can change the value;
- ``Retry`` or any other exception → ``nak`` after the consumer's ``backoff_s`` (its step for
  that delivery, the last step once past them; ``Retry.delay_s`` when given), until the
  consumer's ``max_deliver`` is reached, then dead letter and ``term``; a core message (telemetry) is
  never delivered again, so its failure is dead-lettered at once (reason ``failed``);
- a message delivered more than ``max_deliver`` times (its handler never settled it: the
  process died or hung in it, or lost the server) → dead letter without running the handler
  again, ``term``: the server's own limit is off, so a message that kills its handler would
  otherwise crash every replica in turn, for ever;
- success → publish every returned event (idempotent ids), then ``ack``;
- a durable message still being handled after a third of its consumer's ack wait is told
  ``in_progress`` every third of it, so that the server does not hand it to another replica
  while this one is at work on it (an executor's eviction with a long grace, a migration);
- a handling that runs past its consumer's ``handler_limit_s`` (15 minutes unless a service
  sets more) is cancelled and counts as a failure (``HandlerOverran``): retried, then
  dead-lettered. The beats above would otherwise keep a hung handler's message from every
  replica for ever, and its own consumer would take nothing else;
- a ``CancelledError`` the handler raises while its handling is not being cancelled (it
  awaited a task something else cancelled) is a failure like any other (``HandlerCancelled``).

A dead letter keeps the original bytes and headers, so nothing is ever lost; one too large
for the server's max payload keeps their start, and names the stream and sequence where the
whole is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from fleetpilot.contracts import DeadLetter, Event, decoder_for, dlq_subject, encode, now, route_for
from fleetpilot.contracts.codec import NonFiniteFloat

from . import tracing
from .bus import Bus, Delivery, Inbound, Reject, Retry
from .metrics import HandlerMetrics

HandlerResult = Event | Iterable[Event] | None
TypedHandler = Callable[..., Awaitable[HandlerResult]]

log = logging.getLogger("fleetpilot.runtime")


def _wants_delivery(handler: TypedHandler) -> bool:
    params = [p for p in inspect.signature(handler).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(params) >= 2


def starts_traces(event_types: Iterable[type[Event]]) -> bool:
    """Whether handling messages of ``event_types`` starts a trace for one that carries none:
    unless every type is a sample stream's (``Route.traced``). A type without a route (a
    test's) is traced."""
    def traced(event_type: type[Event]) -> bool:
        try:
            return route_for(event_type).traced
        except LookupError:
            return True
    return any(traced(t) for t in event_types)


def as_events(result: HandlerResult) -> list[Event]:
    """Normalise a handler's return value to a list of events."""
    if result is None:
        return []
    if isinstance(result, Event):
        return [result]
    return list(result)


LETTER_HEADROOM = 1024
"""Bytes a dead letter leaves under the bus's ``max_payload`` for its NATS headers (the server
counts them in, and closes a connection that sends more than it takes)."""


class HandlerOverran(Exception):
    """A handler ran past its consumer's ``handler_limit_s`` and was cancelled: a failure
    like any other (delivered again on the back-off, then dead-lettered)."""


class HandlerCancelled(Exception):
    """A handler raised ``CancelledError`` while nobody cancelled its handling (it awaited a
    task that something else cancelled): a failure like any other, not a stop."""


async def _called(handler: TypedHandler, pass_delivery: bool, event: Event, delivery: Delivery,
                  name: str) -> HandlerResult:
    """``handler``'s result for ``event``; ``HandlerCancelled`` for a ``CancelledError`` it
    raises while this task is not being cancelled. Passed on, the handler's own stopped what
    called it for good: the consume loop, nats-py's subscription loop, nats.micro's endpoint."""
    try:
        return await (handler(event, delivery) if pass_delivery else handler(event))
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise  # this handling is being cancelled: its limit, or the service stopping
        raise HandlerCancelled(f"handler {name or '?'} raised CancelledError without being cancelled") from None


@dataclass
class Dispatcher:
    """Decodes, calls one handler, publishes its output and settles the message."""

    bus: Bus
    service: str
    name: str
    event_types: tuple[type[Event], ...]
    handler: TypedHandler
    metrics: HandlerMetrics
    max_deliver: int = 5
    backoff_s: tuple[float, ...] = (0.5, 2, 5, 10)
    """The delay before the n-th delivery again, the last one for any after it: the consumer's
    ``ConsumerSpec.backoff_s``, as the catalog declares and publishes it."""
    ack_wait_s: float | None = None
    """The consumer's ack wait (durable messages); ``None``: no redelivery by time to prevent."""
    handler_limit_s: float | None = None
    """How long one handling may take before it is cancelled and counted failed
    (``ConsumerSpec.handler_limit_s``); ``None``: no limit."""
    redelivered: bool = True
    """Whether a failed message comes again (a durable consumer's); ``False`` for core ones."""

    def __post_init__(self) -> None:
        self._decoder = decoder_for(*self.event_types)
        self._pass_delivery = _wants_delivery(self.handler)
        self._traced = starts_traces(self.event_types)

    async def __call__(self, msg: Inbound) -> None:
        """Handle one message end to end; never raises."""
        started = time.perf_counter()
        self.metrics.received(self.name, msg.deliveries)
        if self.redelivered and msg.deliveries > self.max_deliver:
            # Only a delivery that was never settled comes again past the limit: each failure
            # the handler raised was nak'ed below it, or dead-lettered at it.
            await self._dead_letter(msg, "max_deliver", f"delivered {msg.deliveries} times, more than "
                                    f"max_deliver {self.max_deliver}, and never settled: its handler died, "
                                    "hung or lost the server each time")
            return
        try:
            event = self._decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self._dead_letter(msg, "undecodable", str(exc))
            return
        delivery = Delivery(subject=msg.subject, headers=dict(msg.headers), deliveries=msg.deliveries,
                            msg_id=msg.headers.get("Nats-Msg-Id"), pending=msg.pending,
                            stream_seq=msg.stream_seq, stored_at=msg.stored_at)
        with self._span(msg) as span:
            try:
                # Kept in progress while at work only: a beat after the nak below would
                # stretch the nak's delay to a whole ack wait.
                async with self._kept_in_progress(msg):
                    result = await self._handled_in_time(event, delivery)
                    outputs = as_events(result)
                    if len(outputs) > 1:
                        # Each encoded before any goes out: a message dead-lettered for one
                        # output that cannot be sent has none of its outputs on the bus, so
                        # its redrive, once fixed, publishes them all once.
                        for out in outputs:
                            encode(out)
                    carrier = tracing.inject_headers() if outputs else {}
                    for out in outputs:
                        await self.bus.publish(out, headers=carrier)
            except Reject as exc:
                span.record_exception(exc)
                await self._dead_letter(msg, "rejected", str(exc))
                return
            except NonFiniteFloat as exc:
                # Made again at every delivery: retried, it was handled max_deliver times
                # (and, sent as null before, every consumer dead-lettered it as undecodable,
                # far from the handler that made the value).
                span.record_exception(exc)
                await self._dead_letter(msg, "unencodable", str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - any handler failure is retried, then dead-lettered
                span.record_exception(exc)
                self.metrics.failed(self.name)
                if not self.redelivered:
                    # A nak does nothing for a core message: without this, the sample
                    # was gone with a warning that promised a retry.
                    await self._dead_letter(msg, "failed", f"{type(exc).__name__}: {exc}")
                    return
                if msg.deliveries >= self.max_deliver:
                    await self._dead_letter(msg, "max_deliver", f"{type(exc).__name__}: {exc}")
                    return
                delay = exc.delay_s if isinstance(exc, Retry) else self._backoff(msg.deliveries)
                log.warning("handler %s failed (delivery %d), retry in %.1fs: %s",
                            self.name, msg.deliveries, delay, exc)
                await msg.nak(delay)
                return
        await msg.ack()
        self.metrics.handled(self.name, time.perf_counter() - started)

    def _span(self, msg: Inbound) -> contextlib.AbstractContextManager[tracing.Span]:
        """The consumer span ``msg`` is handled in; none (a span that records nothing) for a
        sample that carries no trace context."""
        if self._traced or tracing.TRACEPARENT in msg.headers:
            return tracing.span_from_headers(f"{self.service}.{self.name}", msg.headers, msg.subject)
        return contextlib.nullcontext(tracing.NO_SPAN)

    async def _handled_in_time(self, event: Event, delivery: Delivery) -> object:
        """The handler's result; ``HandlerOverran`` once it runs past ``handler_limit_s``."""
        limit = asyncio.timeout(self.handler_limit_s)
        try:
            async with limit:
                return await _called(self.handler, self._pass_delivery, event, delivery, self.name)
        except TimeoutError:
            if limit.expired():
                raise HandlerOverran(f"handler {self.name} ran past its limit of {self.handler_limit_s:g} s "
                                     "and was cancelled") from None
            raise

    def _backoff(self, deliveries: int) -> float:
        """The delay before delivering again a message that failed at its ``deliveries``-th."""
        steps = self.backoff_s or (0.5,)
        return float(steps[min(deliveries, len(steps)) - 1])

    @contextlib.asynccontextmanager
    async def _kept_in_progress(self, msg: Inbound) -> AsyncIterator[None]:
        """Tell the server every third of the ack wait that ``msg`` is still being handled."""
        if not self.ack_wait_s:
            yield
            return

        async def keep_alive() -> None:
            while True:
                await asyncio.sleep(self.ack_wait_s / 3)
                try:
                    await msg.in_progress()
                except Exception as exc:  # noqa: BLE001 - off the bus: redelivery is then right
                    log.warning("handler %s: could not tell the server a message is in progress: %s",
                                self.name, exc)

        beat = asyncio.create_task(keep_alive(), name=f"in-progress:{self.name}")
        try:
            yield
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat

    async def _dead_letter(self, msg: Inbound, reason: str, error: str) -> None:
        letter = DeadLetter(subject=msg.subject, reason=reason, error=error[:2000], service=self.service,
                            deliveries=msg.deliveries, headers=dict(msg.headers), data=msg.data, at=now())
        log.error("dead letter on %s (%s): %s", msg.subject, reason, error[:300])
        self.metrics.dead_lettered(self.name, reason)
        # The dead letter must be stored before the original is dropped. Its id is the
        # original's place in its stream: a dead letter stored whose publish still failed (the
        # ack lost in a failover) left the original unsettled, to be dead-lettered again, and
        # each copy was listed, and redriven, as a message of its own.
        headers = {"Nats-Msg-Id": f"dlq:{msg.origin}"} if msg.origin else None
        await self.bus.publish_raw(dlq_subject(msg.subject), self._fitted(letter, msg.origin), headers=headers)
        await msg.term()

    def _fitted(self, letter: DeadLetter, origin: str | None) -> bytes:
        """``letter`` encoded, within the bus's ``max_payload``. A message near that limit does
        not fit whole in its letter (base64 makes its bytes a third larger): its letter keeps
        the start of its bytes (and no headers, should even that not fit) and its error says
        so, and where the whole is kept. Refused by the server, the letter was never stored, and
        the message came back after every ack wait, for ever."""
        body = encode(letter)
        limit = self.bus.max_payload
        if limit is None or len(body) <= limit - LETTER_HEADROOM:
            return body
        where, original_at = "", ""
        if origin:  # <stream>:<consumer>:<sequence>; settled, it stays there until the stream's limits
            stream, sequence = origin.split(":")[0], origin.rsplit(":", 1)[1]
            where = f"; the whole stays in stream {stream} at sequence {sequence} until the stream's limits remove it"
            original_at = f"{stream}:{sequence}"
        note = f"[original of {len(letter.data)} bytes, too large for a whole dead letter: data holds its start{where}] "
        cut = msgspec.structs.replace(letter, error=(note + letter.error)[:2000], data=b"", truncated=True,
                                      original_at=original_at)
        if len(encode(cut)) > limit - LETTER_HEADROOM:
            cut = msgspec.structs.replace(cut, headers={}, error=(note + "[headers dropped] " + letter.error)[:2000])
        room = limit - LETTER_HEADROOM - len(encode(cut))
        return encode(msgspec.structs.replace(cut, data=letter.data[:max(room, 0) // 4 * 3]))


def reply_handler(event_types: tuple[type[Event], ...], handler: TypedHandler, *, name: str = "",
                  metrics: HandlerMetrics | None = None) -> Callable[[bytes, dict[str, str]], Awaitable[bytes]]:
    """Adapt a typed request handler (event in, event out) to a bytes request handler.

    A request that does not decode gets a JSON error body ``{"error": ...}`` instead of a
    reply, so an interactive client always learns what was wrong. A handler that fails is
    answered as a service error (the caller's ``RuntimeError``), logged and counted under
    ``name`` in ``metrics``, as a consumed message's failure is.
    """
    decoder = decoder_for(*event_types)
    pass_delivery = _wants_delivery(handler)

    async def handle(data: bytes, headers: dict[str, str]) -> bytes:
        started = time.perf_counter()
        if metrics is not None:
            metrics.received(name, 1)
        try:
            event = decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return msgspec.json.encode({"error": f"invalid request: {exc}"})
        delivery = Delivery(subject="", headers=headers)
        try:
            result: Any = await _called(handler, pass_delivery, event, delivery, name)
            # Encoded here, so that an answer that cannot be sent (``NonFiniteFloat``) is told
            # and counted as the handler's failure, not left to nats.micro's silent 500.
            reply = encode(result)
        except Reject as exc:
            return msgspec.json.encode({"error": str(exc)})
        except Exception as exc:
            # nats.micro answers it with a 500 and says nothing: the service's logs and
            # /metrics showed an endpoint failing every request as a healthy one.
            log.error("endpoint %s failed: %s: %s", name or "?", type(exc).__name__, exc)
            if metrics is not None:
                metrics.failed(name)
            raise
        if metrics is not None:
            metrics.handled(name, time.perf_counter() - started)
        return reply

    return handle

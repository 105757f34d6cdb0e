"""Bounds every NVML read of the collector: a call that hangs is told, and never piled on.

An NVML call can hang for good on real hardware (a GPU fallen off the bus, a driver stuck).
Awaited without a bound, it stopped the sampling job for the rest of the process, the node
went silent and nothing said why. ``NvmlWatchdog.call`` runs one read in a thread of its
own and waits ``timeout_s`` for it:

- a read that does not return in time raises ``NvmlHung`` to its caller, is logged once
  (which read, for how long), counted (``fleetpilot_collector_nvml_timeouts_total``) and
  makes ``health()`` report it, so that ``/healthz`` says not ok while it is hung;
- no other read is started while it runs: NVML serialises its calls on a global lock, so a
  second thread would only queue behind the first, and one more each tick would pile up.
  Those reads are skipped (``NvmlHung`` at once), counted
  (``fleetpilot_collector_nvml_skipped_total``) and logged at most once a minute;
- once it returns, reading goes on as before and ``health()`` is clear again.

The thread is a daemon: a read that never returns must not keep the process from exiting
when it is stopped (or restarted for it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("fleetpilot.collector")

T = TypeVar("T")

SKIP_LOG_EVERY_S = 60.0
"""At most one log line per this many seconds about reads skipped behind a hung one."""


class NvmlHung(RuntimeError):
    """An NVML read did not return within the timeout, or was not started because an
    earlier one has still not returned."""


@dataclass
class _Call:
    """One NVML read started in its thread."""

    what: str
    started: float
    future: asyncio.Future
    timed_out: bool = False
    abandoned: bool = False
    """Its caller was cancelled while it ran."""
    late: Callable[[Any], None] | None = None
    skipped: int = 0
    """Reads not started behind this one since it timed out."""
    skip_logged: float = field(default=-float("inf"))


class NvmlWatchdog:
    """Runs NVML reads one at a time, each in a daemon thread, bounded by ``timeout_s``.

    ``registry`` receives the timeout and skip counters and the hung-seconds gauge;
    ``clock`` is monotonic seconds (injected by tests).
    """

    def __init__(self, timeout_s: float, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._current: _Call | None = None
        # One caller at a time starts a read and waits for it; the others wait here, at most
        # the timeout of the one waiting, then find it hung and skip.
        self._lock = asyncio.Lock()
        registry = registry or CollectorRegistry()
        self._timeouts = Counter("fleetpilot_collector_nvml_timeouts_total",
                                 "NVML reads that did not return within FLEETPILOT_COLLECTOR_NVML_TIMEOUT_S",
                                 ["read"], registry=registry)
        self._skips = Counter("fleetpilot_collector_nvml_skipped_total",
                              "NVML reads not started because an earlier one had hung and not returned",
                              ["read"], registry=registry)
        hung = Gauge("fleetpilot_collector_nvml_hung_seconds",
                     "How long the NVML read in flight has run, once past its timeout; 0 when none is hung",
                     registry=registry)
        hung.set_function(lambda: (self.hung() or ("", 0.0))[1])

    def _running(self) -> _Call | None:
        current = self._current
        return current if current is not None and not current.future.done() else None

    def hung(self) -> tuple[str, float] | None:
        """``(read, seconds it has run)`` of the read in flight once it has outrun the
        timeout; ``None`` when none has."""
        current = self._running()
        if current is None:
            return None
        elapsed = self._clock() - current.started
        return (current.what, elapsed) if elapsed >= self.timeout_s else None

    def health(self) -> dict | None:
        """What ``/healthz`` adds while a read is hung (``nvml_hung``: which read, for how
        long, and why it matters); ``None`` otherwise."""
        found = self.hung()
        if found is None:
            return None
        what, elapsed = found
        return {"nvml_hung": {"read": what, "for_s": round(elapsed, 1), "timeout_s": self.timeout_s,
                              "reason": f"the NVML {what} read has not returned for {elapsed:.0f} s (a GPU fallen "
                                        "off the bus or a stuck driver?); no GPU is read until it returns"}}

    async def call(self, what: str, fn: Callable[..., T], *args: Any,
                   late: Callable[[T], None] | None = None) -> T:
        """``fn(*args)`` in a thread, its result once it returns within ``timeout_s``.

        Raises ``NvmlHung`` when it does not (it runs on; ``late``, if given, gets its result
        on the event loop when it returns at last), and at once, without starting ``fn``,
        while an earlier read is still hung. What ``fn`` raises is raised here."""
        async with self._lock:
            current = self._running()
            if current is not None:
                # Its caller stopped waiting (it timed out, or was cancelled at shutdown) and it
                # still runs: give it the rest of its time, then skip rather than queue on it.
                remaining = current.started + self.timeout_s - self._clock()
                if remaining > 0:
                    await asyncio.wait({current.future}, timeout=remaining)
                if not current.future.done():
                    if not current.timed_out:
                        self._timed_out(current)  # nobody was left waiting to tell it
                    self._skip(what, current)
                    raise NvmlHung(f"NVML {what} read skipped: the {current.what} read has not returned")
            call = self._start(what, fn, args)
            try:
                return await asyncio.wait_for(asyncio.shield(call.future), self.timeout_s)
            except TimeoutError:
                if call.future.done():  # it returned as the wait ran out: the result is good
                    return call.future.result()
                call.late = late
                self._timed_out(call)
                raise NvmlHung(f"NVML {what} read has not returned after {self.timeout_s:g} s") from None
            except asyncio.CancelledError:
                call.abandoned = True  # it runs on, and the next read waits for it (see above)
                raise

    def _timed_out(self, call: _Call) -> None:
        call.timed_out = True
        self._timeouts.labels(call.what).inc()
        log.error("NVML %s read has not returned after %g s (a GPU fallen off the bus or a stuck driver?): "
                  "no NVML read is started until it returns, and /healthz says not ok", call.what, self.timeout_s)

    def _start(self, what: str, fn: Callable[..., Any], args: tuple) -> _Call:
        loop = asyncio.get_running_loop()
        call = _Call(what, self._clock(), loop.create_future())

        def run() -> None:
            try:
                outcome: tuple[Any, BaseException | None] = (fn(*args), None)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller on the loop
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(self._returned, call, *outcome)
            except RuntimeError:
                pass  # the loop is closed: the service stopped while this read hung

        self._current = call
        threading.Thread(target=run, name=f"nvml-{what}", daemon=True).start()
        return call

    def _returned(self, call: _Call, result: Any, error: BaseException | None) -> None:
        """On the loop, when a read's thread is done: settle its future; for one that had
        timed out, say it is back and hand its result to ``late``."""
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(result)
        if call.timed_out or call.abandoned:
            call.future.exception()  # nobody awaits it any more: retrieved, so asyncio does not warn
        if not call.timed_out:
            return
        log.warning("NVML %s read returned after %.1f s, past its %g s timeout%s; %d reads were skipped "
                    "meanwhile; reading goes on", call.what, self._clock() - call.started, self.timeout_s,
                    f" (it failed: {error})" if error is not None else "", call.skipped)
        if error is None and call.late is not None:
            try:
                call.late(result)
            except Exception:  # noqa: BLE001 - a late result is a courtesy; it must not break the loop
                log.exception("NVML %s read: its late result could not be used", call.what)

    def _skip(self, what: str, hung: _Call) -> None:
        self._skips.labels(what).inc()
        hung.skipped += 1
        now = self._clock()
        if now - hung.skip_logged >= SKIP_LOG_EVERY_S:
            hung.skip_logged = now
            log.warning("NVML %s read skipped: the %s read has not returned for %.0f s (%d reads skipped so far)",
                        what, hung.what, now - hung.started, hung.skipped)

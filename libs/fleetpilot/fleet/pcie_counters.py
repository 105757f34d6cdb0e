"""PCIe byte counters that wrap, read often enough that no wrap is missed.

NVML's cumulative PCIe byte counters (``NVML_FI_DEV_PCIE_COUNT_TX_BYTES`` and ``_RX_BYTES``)
are, in NVML's words, values that can wrap. On an NVIDIA H200 with driver 580.159.04 they
are 32-bit (the field's ``valueType`` is ``NVML_VALUE_TYPE_UNSIGNED_INT``), and a pinned
host-to-GPU copy at 55 GB/s wraps them every 78 ms. Read once per telemetry period (half a
second), the difference of two readings is the true count modulo 2**32 and says nothing
about the rate: there, one reading in six of such a copy came out at 7.6 GB/s, not 58.

So a counter is read more often than its link can wrap it: its width over the link's top
rate (from the GPU's PCIe generation and lane count) is the longest gap two reads may
leave, and ``PcieCounterPoller`` reads narrow counters on a thread of its own at a quarter
of that. Each difference modulo the width is then the exact count. A gap too long for that
(the thread starved of the CPU), or a step faster than the link can carry (a counter reset
with its GPU), is noticed, and the period that holds it gets no counted rate: the reader
falls back to NVML's sampled rate for it. 64-bit counters need no thread: they are read
when a rate is asked for.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# NVML's ``nvmlValueType_t`` (nvidia-ml-py's ``NVML_VALUE_TYPE_*``) and the member of the
# value union each names.
VALUE_TYPE_DOUBLE = 0
VALUE_TYPE_UNSIGNED_INT = 1
VALUE_TYPE_UNSIGNED_LONG = 2
VALUE_TYPE_UNSIGNED_LONG_LONG = 3
VALUE_TYPE_SIGNED_LONG_LONG = 4
VALUE_TYPE_SIGNED_INT = 5
VALUE_TYPE_UNSIGNED_SHORT = 6
_UNION_MEMBER = {VALUE_TYPE_DOUBLE: "dVal", VALUE_TYPE_UNSIGNED_INT: "uiVal", VALUE_TYPE_UNSIGNED_LONG: "ulVal",
                 VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal", VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
                 VALUE_TYPE_SIGNED_INT: "siVal", VALUE_TYPE_UNSIGNED_SHORT: "usVal"}
# The range of each unsigned type, the counter's wrap. ``unsigned long`` is 64-bit on
# Linux, where NVML's collectors run.
_MODULUS = {VALUE_TYPE_UNSIGNED_INT: 1 << 32, VALUE_TYPE_UNSIGNED_LONG: 1 << 64,
            VALUE_TYPE_UNSIGNED_LONG_LONG: 1 << 64, VALUE_TYPE_UNSIGNED_SHORT: 1 << 16}

# Giga-transfers per second per lane, by PCIe generation: one bit per transfer, before
# line coding, so a bound on every byte a counter can count, headers included.
_GIGATRANSFERS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0, 7: 128.0}
# A generation or width NVML refuses is taken at its largest: the shortest wrap, the
# safest cadence.
UNKNOWN_GENERATION = 6
UNKNOWN_WIDTH = 16
# Reads come at this fraction of the wrap time, so that a read may come up to three
# periods late before a wrap can hide between two of them.
POLL_FRACTION = 0.25
# The longest gap counted: a margin under the wrap time for the time between a read and
# its stamp.
SAFE_FRACTION = 0.75
# A narrow counter is polled at least this often and at most this often (the fastest
# link there is, PCIe 7 x16, wraps a 32-bit counter in 17 ms).
POLL_MIN_S, POLL_MAX_S = 0.002, 1.0
# Counters that wrap sooner than this at their link's top rate are polled by a thread;
# wider ones (64-bit: centuries) are read only when a rate is asked for.
POLLED_WRAP_S = 3600.0
# A step larger than the link could carry over its gap, by this factor plus a slack for
# the time stamps, is not traffic: the counter went back (its GPU was reset).
OVERRUN_FACTOR, OVERRUN_SLACK_S = 1.5, 0.01


def field_number(field: Any) -> int | float:
    """An NVML field value (``c_nvmlFieldValue_t``) as a number, read from the member of its
    value union that its ``valueType`` names (``ullVal`` where the type is not given)."""
    member = _UNION_MEMBER.get(getattr(field, "valueType", VALUE_TYPE_UNSIGNED_LONG_LONG), "ullVal")
    return getattr(field.value, member)


def field_modulus(field: Any) -> int | None:
    """Where an unsigned field value wraps (2**32 for ``UNSIGNED_INT``); ``None`` for a type
    that is no counter (a double, a signed value). Without a ``valueType``: 64-bit."""
    return _MODULUS.get(getattr(field, "valueType", VALUE_TYPE_UNSIGNED_LONG_LONG))


def link_top_bytes_per_s(generation: int | None, width: int | None) -> float:
    """The most bytes per second a PCIe link of this generation and lane count carries in
    one direction, counting every bit on the wire; unknown values at their largest."""
    gigatransfers = _GIGATRANSFERS.get(generation or 0, _GIGATRANSFERS[UNKNOWN_GENERATION])
    lanes = width if width and width > 0 else UNKNOWN_WIDTH
    return gigatransfers * 1e9 * lanes / 8.0


class CounterPair:
    """One GPU's transmit and receive counters, unwrapped into totals (pure: the caller
    reads the counters and says when).

    ``observe`` adds each step since the last observation modulo the counters' width;
    ``take`` returns what was counted since the last take, or ``None`` where that period
    cannot be counted exactly."""

    def __init__(self, modulus: int, top_bytes_per_s: float) -> None:
        self.modulus = modulus
        self.top_bytes_per_s = top_bytes_per_s
        # How soon the link at its top rate wraps the counters; the longest gap between two
        # observations that a wrap cannot hide in is a margin under it.
        self.wrap_s = modulus / top_bytes_per_s
        self.safe_gap_s = SAFE_FRACTION * self.wrap_s
        self._last: tuple[float, int, int] | None = None
        self._totals = (0, 0)
        self._mark: tuple[float, int, int] | None = None
        self._lost = False

    def observe(self, at: float, tx: int, rx: int) -> None:
        """The counters read at monotonic time ``at``. An observation no later than the last
        one is dropped (another thread's, read before it)."""
        last = self._last
        if last is not None:
            gap = at - last[0]
            if gap <= 0:
                return
            d_tx, d_rx = (tx - last[1]) % self.modulus, (rx - last[2]) % self.modulus
            carried = self.top_bytes_per_s * (gap + OVERRUN_SLACK_S) * OVERRUN_FACTOR
            if gap > self.safe_gap_s or max(d_tx, d_rx) > carried:
                self._lost = True  # a wrap may hide in the gap, or the counters went back
            else:
                self._totals = (self._totals[0] + d_tx, self._totals[1] + d_rx)
        self._last = (at, tx, rx)

    def lose(self) -> None:
        """A read failed: the period that holds it cannot be counted."""
        self._lost = True
        self._last = None

    def take(self) -> tuple[int, int, float] | None:
        """``(tx bytes, rx bytes, seconds)`` since the last take, ending at the last
        observation; ``None`` for the first take, or when a step of the period was lost."""
        if self._last is None:
            self._mark = None
            return None
        mark, self._mark = self._mark, (self._last[0], *self._totals)
        lost, self._lost = self._lost, False
        if mark is None or lost or self._last[0] <= mark[0]:
            return None
        return self._totals[0] - mark[1], self._totals[1] - mark[2], self._last[0] - mark[0]


class PcieCounterPoller:
    """The PCIe byte counters of a node's GPUs, counted exactly (see the module's text).

    ``read(handle)`` returns a GPU's ``(tx, rx, modulus)`` (``None`` where NVML refuses),
    ``top_rate(handle)`` its link's top bytes per second. ``rate(index, handle)`` gives
    the bytes per second each way since its last call for that GPU. A GPU whose counters
    would wrap within an hour at its link's top rate is also read by a thread of this
    poller, every quarter of that wrap time (unless ``poll`` is false: then such a GPU's
    periods are lost and the reader samples instead); ``close`` stops it. NVML may be
    called from several threads at once."""

    def __init__(self, read: Callable[[Any], tuple[int, int, int] | None], top_rate: Callable[[Any], float],
                 monotonic: Callable[[], float], *, poll: bool = True) -> None:
        self._read = read
        self._poll_enabled = poll
        self._top_rate = top_rate
        self._monotonic = monotonic
        self._pairs: dict[int, tuple[Any, CounterPair]] = {}
        self._refused: set[int] = set()
        # Held across a read and its observation, so observations keep the reads' order.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.poll_s: float | None = None

    def _observe(self, handle: Any, pair: CounterPair) -> None:
        try:
            counts = self._read(handle)
        except Exception:  # noqa: BLE001 - a defect must not stop the polling thread for good
            log.exception("reading PCIe counters failed")
            counts = None
        if counts is None:
            pair.lose()
        else:
            pair.observe(self._monotonic(), counts[0], counts[1])

    def _register(self, index: int, handle: Any) -> None:
        counts = self._read(handle)
        if counts is None:
            self._refused.add(index)  # no counters: the sampled rate, and never asked again
            return
        pair = CounterPair(counts[2], self._top_rate(handle))
        pair.observe(self._monotonic(), counts[0], counts[1])
        pair.take()  # the first period starts here
        self._pairs[index] = (handle, pair)
        if self._poll_enabled and pair.wrap_s < POLLED_WRAP_S:
            poll_s = min(max(POLL_FRACTION * pair.wrap_s, POLL_MIN_S), POLL_MAX_S)
            self.poll_s = poll_s if self.poll_s is None else min(self.poll_s, poll_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._poll, name="pcie-counters", daemon=True)
                self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                for handle, pair in list(self._pairs.values()):
                    if pair.wrap_s < POLLED_WRAP_S:
                        self._observe(handle, pair)

    def rate(self, index: int, handle: Any) -> tuple[float, float] | None:
        """Bytes per second ``(tx, rx)`` of GPU ``index`` since the last call for it;
        ``None`` on the first call, for a period that could not be counted, or where the
        driver has no counters."""
        if index in self._refused:
            return None
        with self._lock:
            known = self._pairs.get(index)
            if known is None or known[0] is not handle:
                self._register(index, handle)
                return None
            pair = known[1]
            self._observe(handle, pair)
            taken = pair.take()
        if taken is None:
            return None
        return taken[0] / taken[2], taken[1] / taken[2]

    def close(self) -> None:
        """Stop the polling thread (the counters are no longer read)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

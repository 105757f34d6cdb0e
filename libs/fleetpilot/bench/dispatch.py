"""What a consumer pays per message before its handler runs, for a GPU sample.

Every message a service takes goes through ``fleetpilot.runtime.dispatch.Dispatcher``:
decoded, handled in a span, counted, settled. For most subjects that is little next to the
handler; for ``telemetry.gpu.<node>`` it is paid once per node per second by every executor
that covers the fleet (1,213 nodes on openb), and the handler itself is a few dict
operations per GPU. Until e31efd2 each sample was handled in a consumer span of its own,
started and ended through the OpenTelemetry SDK even with no exporter, and in a live
``fleetpilot up --fleet <openb>`` the executor spent more of its CPU there and in the
dispatcher than in its handlers (py-spy: 919 of 1,573 samples in dispatch, 278 of them in
the span). Sample streams now start no trace (``Route.traced``).

This times the dispatcher on one node's batch of 8 GPU samples with a handler that does
nothing: as published (no trace context: no span), and, the baseline in the same run, the
same batch carrying a ``traceparent`` (handled in a span, as every sample was). The decode
alone is printed as the floor.

Run: ``python -m fleetpilot.bench.dispatch [--messages N]``. Prints::

    dispatch: X µs per node sample untraced, Y µs traced (in a span, as every sample was): ratio X/Y; decode alone Z µs; ...
"""

from __future__ import annotations

import argparse
import asyncio
import time

from fleetpilot.contracts import NodeTelemetry, encode
from fleetpilot.maintenance.faults import gpu_reading
from fleetpilot.runtime import tracing
from fleetpilot.runtime.bus import Inbound
from fleetpilot.runtime.dispatch import Dispatcher
from fleetpilot.runtime.metrics import HandlerMetrics

GPUS_PER_NODE = 8
OPENB_NODES = 1213
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class _Received(Inbound):
    """A core message as the bus hands it over; settling it does nothing."""

    def __init__(self, data: bytes, headers: dict[str, str]) -> None:
        """A message of ``data`` on one node's telemetry subject, with ``headers``."""
        self.subject, self.data, self.headers, self.deliveries = "telemetry.gpu.node-0", data, headers, 1

    async def ack(self) -> None:
        """Nothing to settle."""

    async def nak(self, delay_s: float) -> None:
        """Nothing to settle."""

    async def term(self) -> None:
        """Nothing to settle."""

    async def in_progress(self) -> None:
        """Nothing to settle."""


async def _per_message(dispatcher: Dispatcher, data: bytes, headers: dict[str, str], messages: int) -> float:
    """Microseconds per message for ``messages`` messages of ``data`` with ``headers``."""
    began = time.perf_counter()
    for _ in range(messages):
        await dispatcher(_Received(data, headers))
    return (time.perf_counter() - began) / messages * 1e6


async def measure(messages: int = 20_000) -> dict[str, float]:
    """Microseconds per node sample untraced, traced (the baseline) and decoded alone; the ratio."""
    tracing.configure("bench", None)  # spans made as a service makes them, exported nowhere

    async def nothing(sample: NodeTelemetry) -> None:
        """The handler: nothing, so that only the dispatcher is timed."""

    dispatcher = Dispatcher(None, "executor", "telemetry.gpu.*", (NodeTelemetry,), nothing,  # type: ignore[arg-type]
                            HandlerMetrics("executor"), redelivered=False)
    data = encode(NodeTelemetry(node="node-0", at=1_000_000.0, source="sim",
                                gpus=[gpu_reading("node-0", gpu, 1_000_000.0) for gpu in range(GPUS_PER_NODE)]))
    out: dict[str, float] = {}
    for name, headers in (("untraced", {}), ("traced", {"traceparent": TRACEPARENT})):
        await _per_message(dispatcher, data, headers, messages // 10)  # warm
        out[f"{name}_us"] = min([await _per_message(dispatcher, data, headers, messages) for _ in range(3)])
    decoder = dispatcher._decoder
    began = time.perf_counter()
    for _ in range(messages):
        decoder.decode(data)
    out["decode_us"] = (time.perf_counter() - began) / messages * 1e6
    out["ratio"] = out["untraced_us"] / out["traced_us"]
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark and print the figures; returns the measurements."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000, help="messages per timing (default 20000)")
    args = parser.parse_args(argv)
    if args.messages < 10:
        parser.error("--messages must be at least 10")
    result = asyncio.run(measure(args.messages))
    print(f"dispatch: {result['untraced_us']:.1f} µs per node sample ({GPUS_PER_NODE} GPUs) untraced, "
          f"{result['traced_us']:.1f} µs traced (in a span, as every sample was): ratio {result['ratio']:.2f}; decode alone "
          f"{result['decode_us']:.1f} µs; the openb fleet's {OPENB_NODES} nodes a second: "
          f"{result['untraced_us'] * OPENB_NODES / 1e4:.1f}% of a core, {result['traced_us'] * OPENB_NODES / 1e4:.1f}% traced")
    return result


if __name__ == "__main__":
    main()

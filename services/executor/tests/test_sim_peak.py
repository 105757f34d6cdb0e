"""The peak the simulated fleet plays a task's program to: its ``sim.peak_mb`` label where it
carries a usable number, else what the task asks; and the command that places it says so."""

from __future__ import annotations

import pytest
from fleetpilot.contracts import Placement, SimAck, SimCommand, TaskSubmitted, decode, encode
from fleetpilot.workload import SIM_PEAK_LABEL
from fleetpilot_services.executor.backends import BusSimBackend, simulated_peak_mb


def task(**labels: str) -> TaskSubmitted:
    return TaskSubmitted(task_id="t1", kind="batch", gpus=1, gpu_memory_mb=20_000, labels=labels, submitted_at=0.0)


@pytest.mark.parametrize(("label", "peak"), [
    (None, 20_000.0), ("46000", 46_000.0), ("lots", 20_000.0), ("-5", 20_000.0), ("nan", 20_000.0), ("inf", 20_000.0),
])
def test_the_label_gives_the_peak_and_anything_else_what_the_task_asks(label, peak) -> None:
    assert simulated_peak_mb(task(**({SIM_PEAK_LABEL: label} if label is not None else {}))) == peak


class Bus:
    """Stands in for the bus: answers ``sim.control`` and keeps the commands."""

    def __init__(self) -> None:
        self.commands: list[SimCommand] = []

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        assert subject == "sim.control"
        self.commands.append(decode(data, SimCommand))
        return encode(SimAck(ok=True))


async def test_the_place_command_carries_the_described_peak() -> None:
    bus = Bus()
    backend = BusSimBackend(bus)  # type: ignore[arg-type]
    backend.describe("t1", simulated_peak_mb(task(**{SIM_PEAK_LABEL: "46000"})), "leak", 120.0)
    await backend.start("t1", [Placement(node="n0", gpu=0, milli=1000)], [], {})
    (cmd,) = bus.commands
    assert (cmd.verb, cmd.peak_memory_mb, cmd.pattern, cmd.duration_s) == ("place", 46_000.0, "leak", 120.0)

"""How long a node's executor waits for another node to hand a task over (``BusTakeOver``):
the source's checkpoint window, its stop's grace and a round trip, each try; for a task that
cannot resume, which the source only stops, no checkpoint window."""

from __future__ import annotations

import pytest
from fleetpilot.contracts import HandOver, decode
from fleetpilot.executor import BackendError
from fleetpilot_services.executor.backends import BusTakeOver


class SilentSource:
    """A bus on which the source never answers; it keeps what was asked and how long it waited."""

    def __init__(self) -> None:
        self.asked: list[tuple[HandOver, float]] = []

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        self.asked.append((decode(data, HandOver), timeout_s))
        raise TimeoutError("nats: timeout")


@pytest.mark.parametrize(("resumes", "waited_s"), [(True, 30.0 + 5.0 + 10.0), (False, 5.0 + 10.0)])
async def test_the_target_waits_for_the_checkpoint_only_of_a_task_that_resumes(resumes, waited_s):
    bus = SilentSource()
    with pytest.raises(BackendError, match="did not hand t1 over") as failed:
        await BusTakeOver(bus, checkpoint_s=30.0, attempts=2)("n1", "t1", 5.0, resumes)  # type: ignore[arg-type]
    assert failed.value.retryable
    assert [(h.task_id, h.node, h.resumable, timeout) for h, timeout in bus.asked] == [("t1", "n1", resumes, waited_s)] * 2

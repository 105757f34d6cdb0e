"""``encode`` refuses NaN and infinities: JSON has neither, and msgspec writes them as ``null``,
which every consumer then fails to decode (or, in an optional field, reads as "not set")."""

from __future__ import annotations

import math

import msgspec
import pytest
from fleetpilot.contracts import (
    Fingerprint,
    GpuSample,
    NodeTelemetry,
    ProcessMemory,
    Reading,
    SlaRequest,
    TaskFingerprinted,
    TaskSubmitted,
    TaskTelemetry,
    decode,
    encode,
)
from fleetpilot.contracts.codec import NonFiniteFloat


def gpu(index: int, **fields) -> GpuSample:
    values = dict(node="n1", gpu=index, uuid=f"GPU-{index}", model="H100", at=1.0, utilization_gpu_pct=50.0,
                  utilization_memory_pct=20.0, memory_total_mb=80_000.0, memory_used_mb=1000.0,
                  memory_free_mb=79_000.0, temperature_c=60.0, power_w=300.0, power_limit_w=700.0,
                  sm_clock_mhz=1980.0, pcie_tx_kbps=1.0, pcie_rx_kbps=2.0,
                  processes=[ProcessMemory(pid=7, used_mb=1000.0)])  # task_id None: a legitimate null
    return GpuSample(**{**values, **fields})


class Votes(msgspec.Struct, frozen=True):
    """A record with a float mapping, as the fingerprinter's signature statistics have."""

    votes: dict[str, float]


NAN, INF = math.nan, math.inf

CASES = [
    pytest.param(TaskTelemetry(task_id="t", node="n1", gpus=[0], at=1.0, memory_used_mb=NAN),
                 "$.memory_used_mb", "nan", id="top-level"),
    pytest.param(NodeTelemetry(node="n1", at=1.0, source="sim", gpus=[gpu(0), gpu(1, power_w=INF)]),
                 "$.gpus[1].power_w", "inf", id="in-a-list"),
    pytest.param(NodeTelemetry(node="n1", at=1.0, source="sim", gpus=[gpu(
        0, cuda_context_switches_per_sec=Reading(value=-INF, uncertainty_score=0.5))]),
                 "$.gpus[0].cuda_context_switches_per_sec.value", "-inf", id="nested-record"),
    # An optional bound: its null would read back as None, "no deadline", without any error.
    pytest.param(TaskSubmitted(task_id="t", sla=SlaRequest(deadline=INF)), "$.sla.deadline", "inf",
                 id="optional-reads-back-as-none"),
    pytest.param(TaskFingerprinted(task_id="t", source="observed", at=1.0, fingerprint=Fingerprint(
        signature="s", pattern="flat", pattern_confidence=1.0, growth_rate_mb_per_s=0.0, predicted_peak_mb=1.0,
        peak_low_mb=1.0, peak_high_mb=1.0, envelope_mb=(1.0, 2.0, NAN))),
                 "$.fingerprint.envelope_mb[2]", "nan", id="in-a-tuple"),
    pytest.param(Votes(votes={"flat": 1.0, "leak": NAN}), "$.votes['leak']", "nan", id="dict-value"),
]


@pytest.mark.parametrize(("value", "path", "shown"), CASES)
def test_a_non_finite_float_is_refused_naming_its_field(value, path, shown):
    with pytest.raises(ValueError, match="cannot be encoded") as refused:
        encode(value)
    assert isinstance(refused.value, NonFiniteFloat)
    message = str(refused.value)
    assert "\n" not in message
    assert f"{path} is {shown}" in message
    assert message.startswith(type(value).__name__)
    assert refused.value.path == path


@pytest.mark.parametrize("value", [
    # Every kind of legitimate null, and "null" inside a string: nothing to refuse.
    NodeTelemetry(node="null", at=1.0, source="sim", gpus=[gpu(0, labels={"note": "null, NaN, inf"})]),
    TaskSubmitted(task_id="t", sla=SlaRequest(), expected_duration_s=None),
    TaskSubmitted(task_id="t", sla=SlaRequest(deadline=1e308, max_queue_s=0.0), size_gb=-0.0),
    # MessagePack bytes that look like a NaN's (0xcb 0x7f 0xf0 inside an int): only the walk can tell.
    TaskSubmitted(task_id="t", memory_mb=0xCB7FF0),
    # An int that JSON takes and MessagePack does not.
    TaskSubmitted(task_id="t", memory_mb=2**70),
], ids=["none-and-null-in-text", "optional-none", "extreme-finite", "look-alike-bytes", "beyond-64-bits"])
def test_finite_values_and_none_encode_as_before(value):
    data = encode(value)
    assert data == msgspec.json.encode(value)
    assert decode(data, type(value)) == value

"""Seeded fault histories for GPUs, to evaluate the health model (pure).

Three kinds of GPU over a horizon (24 h by default, one sample every ``period_s``):

- ``healthy``: normal temperatures that follow the load, a rare corrected ECC error, a rare
  PCIe replay;
- ``noisy``: healthy hardware with a few one-off events that look alarming on their own:
  application XIDs (13, 31, 43), one corrected-ECC burst, one row remap (XID 63), a short
  temperature spike, a PCIe replay burst;
- ``degrading``: healthy until ``onset_at``, then a failure mode develops with rates that
  grow towards ``fails_at``, when the GPU falls off the bus (XID 79) and reporting stops.
  Modes: ``memory`` (corrected ECC rate, remaps, XID 63/92/94, then 48/95), ``bus``
  (PCIe replays, link width down-training), ``nvlink`` (XID 74 bursts, replays),
  ``thermal`` (temperature climbing to the ~97 °C shutdown point) and ``sudden`` (ten minutes of warning:
  the failures no model can see coming, kept so the evaluation stays honest).
"""

from __future__ import annotations

import random
from typing import Literal

import msgspec

from fleetpilot.contracts import GpuSample, ProcessMemory

ScenarioKind = Literal["healthy", "noisy", "degrading"]
FailureMode = Literal["memory", "bus", "nvlink", "thermal", "sudden"]
FAILURE_MODES: tuple[FailureMode, ...] = ("memory", "bus", "nvlink", "thermal", "sudden")


class FaultScenario(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU's generated history and the truth about it."""

    uuid: str
    node: str
    gpu: int
    kind: ScenarioKind
    mode: FailureMode | None = None
    onset_at: float | None = None
    fails_at: float | None = None
    samples: list[GpuSample]


class _Counters(msgspec.Struct, kw_only=True):
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    retired_pages: int = 0
    remapped_rows: int = 0
    pcie_replays: int = 0
    xid_last: int = 0
    xid_count: int = 0

    def xid(self, code: int) -> None:
        self.xid_count += 1
        self.xid_last = code


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth) for small means; enough for event counts per sample."""
    if mean <= 0:
        return 0
    if mean > 30:
        return max(int(rng.gauss(mean, mean**0.5)), 0)
    limit, k, p = pow(2.718281828459045, -mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def gpu_reading(node: str, gpu: int, at: float, *, temperature_c: float = 60.0, **fields) -> GpuSample:
    """A plausible reading of a busy, healthy A100 at ``at``; ``fields`` override any field
    (ECC, XID, remap counters, link width...). The fault histories are built from it, and
    tests of the health hooks use it for hand-made windows."""
    base = dict(
        uuid=f"GPU-{node}-{gpu}",
        model="A100",
        utilization_gpu_pct=80.0,
        utilization_memory_pct=50.0,
        memory_total_mb=81920.0,
        memory_used_mb=40960.0,
        memory_free_mb=40960.0,
        power_w=300.0,
        power_limit_w=400.0,
        sm_clock_mhz=1410.0,
        pcie_tx_kbps=0.0,
        pcie_rx_kbps=0.0,
        pcie_link_width_max=16,
    )
    return GpuSample(node=node, gpu=gpu, at=at, temperature_c=temperature_c, **{**base, **fields})


def _sample(
    node: str, gpu: int, uuid: str, at: float, temp: float, width: int, c: _Counters, tasks: list[str]
) -> GpuSample:
    return gpu_reading(
        node, gpu, at, temperature_c=temp, uuid=uuid,
        ecc_corrected=c.ecc_corrected,
        ecc_uncorrected=c.ecc_uncorrected,
        retired_pages=c.retired_pages,
        remapped_rows=c.remapped_rows,
        pcie_replays=c.pcie_replays,
        pcie_link_width=width,
        xid_last=c.xid_last,
        xid_count=c.xid_count,
        processes=[ProcessMemory(pid=1000 + i, used_mb=20480.0, task_id=t) for i, t in enumerate(tasks)],
    )


def generate(
    kind: ScenarioKind,
    index: int,
    *,
    seed: int = 0,
    horizon_s: float = 24 * 3600.0,
    period_s: float = 120.0,
    mode: FailureMode | None = None,
) -> FaultScenario:
    """One GPU's history; the same arguments always give the same history."""
    rng = random.Random(f"{seed}:{kind}:{index}")
    node, gpu = f"node-{index // 8:03d}", index % 8
    uuid = f"GPU-{kind}-{index:04d}"
    tasks = [f"task-{index}-{j}" for j in range(rng.randint(0, 3))]
    onset = fails = None
    if kind == "degrading":
        mode = mode or rng.choice(FAILURE_MODES)
        fails = rng.uniform(0.45, 0.95) * horizon_s
        lead = 600.0 if mode == "sudden" else rng.uniform(2.0, 8.0) * 3600.0
        onset = fails - lead
    noise_at = (
        {
            event: rng.uniform(0.05, 0.95) * horizon_s
            for event in ("xid_app", "ecc_burst", "remap", "spike", "replays")
        }
        if kind == "noisy"
        else {}
    )
    base_temp = rng.uniform(55.0, 72.0)
    c = _Counters()
    samples: list[GpuSample] = []
    width, t = 16, 0.0
    while t <= horizon_s and (fails is None or t <= fails):
        dt_h = period_s / 3600.0
        temp = base_temp + 6.0 * (0.5 - abs((t / 3600.0) % 6.0 / 6.0 - 0.5)) + rng.gauss(0.0, 1.0)
        c.ecc_corrected += _poisson(rng, 0.1 * dt_h)
        c.pcie_replays += _poisson(rng, 0.5 * dt_h)
        for event, at in noise_at.items():
            if at <= t < at + period_s:
                if event == "xid_app":
                    c.xid(rng.choice((13, 31, 43)))
                elif event == "ecc_burst":
                    c.ecc_corrected += rng.randint(5, 40)
                elif event == "remap":
                    c.remapped_rows += 1
                    c.xid(63)
                elif event == "replays":
                    c.pcie_replays += rng.randint(10, 100)
            if event == "spike" and at <= t < at + 240.0:
                temp = 86.0 + rng.uniform(0.0, 3.0)
        if onset is not None and fails is not None and t >= onset:
            progress = (t - onset) / max(fails - onset, 1.0)  # 0 at onset, 1 at failure
            if mode in ("memory", "sudden"):
                c.ecc_corrected += _poisson(rng, (20 + 800 * progress**2) * dt_h)
                if rng.random() < (0.3 + 2.5 * progress) * dt_h:
                    c.remapped_rows += 1
                    c.xid(rng.choice((63, 92, 94)))
                if rng.random() < 0.3 * progress**3 * dt_h:
                    c.ecc_uncorrected += 1
                    c.xid(48)
            elif mode == "bus":
                c.pcie_replays += _poisson(rng, (50 + 4000 * progress**2) * dt_h)
                if progress > 0.4 and width == 16 and rng.random() < 1.0 * dt_h:
                    width = rng.choice((8, 4))
            elif mode == "nvlink":
                if rng.random() < (0.5 + 3.0 * progress) * dt_h:
                    c.xid(74)
                c.pcie_replays += _poisson(rng, (20 + 500 * progress) * dt_h)
            elif mode == "thermal":
                # climbs towards the thermal shutdown point (~97 °C), reached at the failure
                temp += (97.0 - base_temp) * progress + rng.gauss(0.0, 0.5)
        if fails is not None and t + period_s > fails:
            c.xid(79)  # the last report before it disappears
        samples.append(_sample(node, gpu, uuid, t, temp, width, c, tasks))
        t += period_s
    return FaultScenario(
        uuid=uuid, node=node, gpu=gpu, kind=kind, mode=mode, onset_at=onset, fails_at=fails, samples=samples
    )


def generate_fleet(
    *,
    healthy: int = 40,
    noisy: int = 20,
    degrading: int = 20,
    seed: int = 0,
    horizon_s: float = 24 * 3600.0,
    period_s: float = 120.0,
) -> list[FaultScenario]:
    """A fleet of histories; degrading GPUs cycle through every failure mode in turn."""
    fleet = [
        generate("healthy", i, seed=seed, horizon_s=horizon_s, period_s=period_s) for i in range(healthy)
    ]
    fleet += [
        generate("noisy", healthy + i, seed=seed, horizon_s=horizon_s, period_s=period_s)
        for i in range(noisy)
    ]
    fleet += [
        generate(
            "degrading",
            healthy + noisy + i,
            seed=seed,
            horizon_s=horizon_s,
            period_s=period_s,
            mode=FAILURE_MODES[i % len(FAILURE_MODES)],
        )
        for i in range(degrading)
    ]
    return fleet

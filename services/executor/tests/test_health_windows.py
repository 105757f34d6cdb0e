"""The executor's GPU windows and its maintenance round, without a bus: what a window holds
when its GPU is replaced, when its node's clock steps back, or when the GPU goes silent for
good, and a maintenance round that one GPU's failure does not end for the others."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import msgspec
from fleetpilot.contracts import GpuInfo, NodeTopology, encode
from fleetpilot.executor import Cordon
from fleetpilot.maintenance.windows import HealthWindows
from fleetpilot.runtime import CasConflict
from fleetpilot_services.executor.health import GpuHealth
from fleetpilot_services.executor.service import ExecutorSettings

from .conftest import gpu_sample


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_replaced_gpu_starts_a_window_of_its_own() -> None:
    windows = HealthWindows(window_s=7200, every_s=30)
    for at in range(0, 3600, 60):  # the old board, decaying
        windows.add(gpu_sample("n1", 0, float(at), xid_count=at // 600, xid_last=79, uuid="GPU-old"))
    windows.add(gpu_sample("n1", 0, 3600.0, uuid="GPU-new"))
    windows.add(gpu_sample("n1", 0, 3660.0, uuid="GPU-new"))
    assert [s.uuid for s in windows.of("n1", 0)] == ["GPU-new", "GPU-new"]


def test_a_clock_stepped_back_does_not_blind_the_window() -> None:
    windows = HealthWindows(window_s=7200, every_s=30)
    for at in (100_000.0, 100_060.0):  # a clock an hour fast, then corrected
        windows.add(gpu_sample("n1", 0, at))
    for at in (96_500.0, 96_560.0, 96_620.0):
        windows.add(gpu_sample("n1", 0, at))
    assert [s.at for s in windows.of("n1", 0)] == [96_500.0, 96_560.0, 96_620.0]


class Labels:
    """The topology labels as the maintenance round uses them; writing ``failing`` fails."""

    def __init__(self, failing: str = "") -> None:
        self.failing = failing
        self.written: dict[tuple[str, int], dict[str, str]] = {}
        self.overridden: list[tuple[str, int, str, str]] = []  # nobody else writes here

    def labels_of(self, node: str, gpu: int, uuid: str = "") -> Mapping[str, str]:
        return self.written.get((node, gpu), {})

    async def apply_pending(self) -> None:
        """Nothing is kept to write again here: ``set`` either writes or raises."""

    async def set(self, node: str, gpu: int, labels: Mapping[str, str], uuid: str = "") -> bool:
        if node == self.failing:
            raise CasConflict(f"topology entry {node} kept changing under us")
        self.written.setdefault((node, gpu), {}).update(labels)
        return True


def health(tmp_path: Path, labels: Labels, clock: Clock | None = None) -> GpuHealth:
    replica = GpuHealth(ExecutorSettings(nats_url="nats://unused:4222", metrics_port=-1, replica="a",
                                         state_dir=str(tmp_path)))
    if clock is not None:
        replica.windows.clock = clock
    replica.labels = labels  # type: ignore[assignment]
    return replica


def decaying(node: str) -> list:
    quiet = gpu_sample(node, 0, 1_000_000.0)
    return [quiet, msgspec.structs.replace(quiet, at=1_000_060.0, ecc_uncorrected=2, xid_count=2, xid_last=48)]


async def test_one_gpu_s_failed_label_write_does_not_end_the_round_for_the_others(tmp_path: Path) -> None:
    labels = Labels(failing="n1")
    replica = health(tmp_path, labels)
    for node in ("n1", "n2"):  # n1 first: its write fails
        for sample in decaying(node):
            replica.windows.add(sample)
    await replica.assess_health()
    assert labels.written[("n2", 0)]["maintenance_pending"] == "true"


async def test_a_gpu_silent_for_longer_than_the_window_is_forgotten(tmp_path: Path) -> None:
    clock = Clock()
    labels = Labels()
    replica = health(tmp_path, labels, clock)
    for gpu in range(8):  # a node that left the fleet (scaled down, renamed)
        replica.windows.add(gpu_sample("gone", gpu, 1_000_000.0))
        replica.windows.add(gpu_sample("gone", gpu, 1_000_060.0))
    clock.now = 3600.0
    replica.windows.add(gpu_sample("here", 0, 1_003_600.0))
    await replica.assess_health()
    assert len(replica.windows.windows) == 9  # within the window: kept
    clock.now = 7200.0 + 61.0
    replica.windows.add(gpu_sample("here", 0, 1_007_261.0))
    await replica.assess_health()
    assert list(replica.windows.windows) == [("here", "GPU-here-0")]
    assert replica.windows.of("gone", 0) is None  # the index no longer names the board either
    # Its GPUs' failure probabilities leave /metrics with it; the one still heard stays.
    shown = [s.labels for family in replica.metrics.failure_probability.collect() for s in family.samples]
    assert shown == [{"node": "here", "gpu": "0"}]


async def test_a_board_swapped_after_it_fell_off_the_bus_starts_a_window_of_its_own(tmp_path: Path) -> None:
    # Board A reads quiet, falls off the bus (every NVML call fails: no uuid, fields labelled
    # unread) and is swapped for a refurbished spare with a year of counters behind it. Those
    # counters are not growth on A.
    labels = Labels()
    replica = health(tmp_path, labels)
    lost = "ecc,pcie_link_width,pcie_replays,remapped_rows,retired_pages,temperature,uuid"
    worn = dict(ecc_corrected=5000, retired_pages=20, pcie_replays=3000)
    t0 = 1_000_000.0
    for i in range(30):
        replica.windows.add(gpu_sample("n1", 0, t0 + i * 60.0, uuid="GPU-a"))
    for i in range(30, 35):
        replica.windows.add(gpu_sample("n1", 0, t0 + i * 60.0, 0.0, uuid="", pcie_link_width=0,
                                       labels={"nvml_unsupported": lost}))  # type: ignore[arg-type]
    for i in range(35, 60):
        replica.windows.add(gpu_sample("n1", 0, t0 + i * 60.0, uuid="GPU-spare", **worn))
    assert {s.uuid for s in replica.windows.of("n1", 0)} == {"GPU-spare"}
    await replica.assess_health()
    assert "maintenance_pending" not in labels.labels_of("n1", 0)


async def test_a_label_write_that_failed_is_written_again_on_the_next_round(tmp_path: Path) -> None:
    # The pre-decommission hook emits its cordon once. Its write failing (the entry kept
    # changing, the server away) raised out of the telemetry handler, and the GPU took new
    # work for the whole drain while the hook took it as cordoned.
    from fleetpilot.runtime.memory import InMemoryBus  # noqa: PLC0415
    from fleetpilot_services.executor.fleet_labels import FleetLabels  # noqa: PLC0415

    from .conftest import node_topology  # noqa: PLC0415

    class Contended:
        """The topology bucket, whose writes lose every race while ``busy``."""

        def __init__(self, kv) -> None:
            self.kv, self.busy = kv, True

        def __getattr__(self, name):
            return getattr(self.kv, name)

        async def update(self, key, value, revision):
            if self.busy:
                raise CasConflict(f"{key} changed")
            return await self.kv.update(key, value, revision)

    kv = await InMemoryBus().kv("topology")
    await kv.put("n1", encode(node_topology("n1")))
    contended = Contended(kv)
    replica = health(tmp_path, FleetLabels(contended))  # type: ignore[arg-type]
    replica.backend = object()  # type: ignore[assignment]  # a cordon stops no task
    await replica.decommission(Cordon(node="n1", gpu=1, reason="hot for 5 minutes"))  # says so; raises nothing
    contended.busy = False
    await replica.assess_health()
    stored = msgspec.json.decode((await kv.get("n1")).value, type=NodeTopology)
    assert stored.gpus[1].labels.get("cordoned") == "true"


async def test_a_renumbered_board_keeps_its_history_and_the_board_now_at_its_old_index_starts_fresh(
    tmp_path: Path,
) -> None:
    # The decaying board read quiet at 2, then (its neighbour fell off the bus) at 1, with an
    # uncorrected ECC error and XID 48; a new board reads at 2. By index, the new board's first
    # sample wiped the decaying board's history at 2, and at 1 it started over: one sample,
    # never assessed, never flagged.
    labels = Labels()
    replica = health(tmp_path, labels)
    quiet, failing = decaying("n1")
    replica.windows.add(msgspec.structs.replace(quiet, gpu=2, uuid="GPU-hot"))
    replica.windows.add(msgspec.structs.replace(failing, gpu=1, uuid="GPU-hot"))
    replica.windows.add(msgspec.structs.replace(quiet, gpu=2, uuid="GPU-new", at=failing.at))
    assert [(s.gpu, s.uuid) for s in replica.windows.of("n1", 1)] == [(2, "GPU-hot"), (1, "GPU-hot")]
    assert [(s.gpu, s.uuid) for s in replica.windows.of("n1", 2)] == [(2, "GPU-new")]
    await replica.assess_health()
    assert labels.written[("n1", 1)]["maintenance_pending"] == "true"
    assert labels.written[("n1", 1)]["maintenance_board"] == "GPU-hot"
    assert ("n1", 2) not in labels.written


def test_a_sample_without_a_uuid_goes_to_the_board_last_read_at_its_index() -> None:
    windows = HealthWindows(window_s=7200, every_s=30)
    windows.add(gpu_sample("n1", 2, 0.0, uuid="GPU-hot"))
    windows.add(gpu_sample("n1", 1, 60.0, uuid="GPU-hot"))  # renumbered
    windows.add(gpu_sample("n1", 2, 60.0, uuid="GPU-new"))
    windows.add(gpu_sample("n1", 1, 120.0, uuid=""))  # NVML could not read it
    windows.add(gpu_sample("n1", 2, 120.0, uuid=""))
    windows.add(gpu_sample("n1", 3, 120.0, uuid=""))  # no uuid ever read at 3: its index
    assert [(s.gpu, s.uuid) for s in windows.of("n1", 1)] == [(2, "GPU-hot"), (1, "GPU-hot"), (1, "")]
    assert [(s.gpu, s.uuid) for s in windows.of("n1", 2)] == [(2, "GPU-new"), (2, "")]
    assert [(s.gpu, s.uuid) for s in windows.of("n1", 3)] == [(3, "")]
    # Its uuid read at last: the same GPU, its window goes with it.
    windows.add(gpu_sample("n1", 3, 180.0, uuid="GPU-late"))
    assert [(s.gpu, s.uuid) for s in windows.of("n1", 3)] == [(3, ""), (3, "GPU-late")]
    assert sorted(windows.windows) == [("n1", "GPU-hot"), ("n1", "GPU-late"), ("n1", "GPU-new")]


async def test_an_operator_s_override_restarts_the_history_of_the_board_it_was_set_on(tmp_path: Path) -> None:
    # An operator's "false" on the topology entry's GPU 2, which is the board GPU-hot there.
    labels = Labels()
    replica = health(tmp_path, labels)
    replica.labels.nodes = {"n1": NodeTopology(node="n1", gpus=[  # type: ignore[attr-defined]
        GpuInfo(index=i, model="A100", uuid=u) for i, u in enumerate(("GPU-a", "GPU-b", "GPU-hot"))])}
    for sample in decaying("n1"):
        replica.windows.add(msgspec.structs.replace(sample, gpu=1, uuid="GPU-hot"))  # the samples ahead
        replica.windows.add(msgspec.structs.replace(sample, gpu=2, uuid="GPU-new"))
    labels.overridden = [("n1", 2, "maintenance_pending", "false")]
    replica.take_overrides()
    assert replica.windows.of("n1", 1) is None and len(replica.windows.of("n1", 2)) == 2


def test_a_gpu_no_uuid_was_ever_read_for_is_assessed_at_its_index() -> None:
    # Its window is keyed by its index; asking whether a board reads at that index raised
    # a TypeError once the index became a ``BoardIndex``, and every health round failed.
    windows = HealthWindows(window_s=7200, every_s=30)
    windows.add(gpu_sample("n1", 0, 60.0))
    for at in (60.0, 120.0):
        windows.add(gpu_sample("n1", 3, at, uuid=""))
    assert sorted((node, gpu, len(window)) for node, gpu, window in windows.current()) == [
        ("n1", 0, 1), ("n1", 3, 2)]


async def test_a_health_round_gives_the_loop_back_between_groups_of_gpus(tmp_path: Path, monkeypatch) -> None:
    # Assessed at once, the openb fleet's 6,212 full windows held the executor's loop 4 s a
    # round: no decision carried out, no sample read meanwhile.
    import math

    from fleetpilot.runtime.testing import LoopTurns
    from fleetpilot_services.executor import health as executor_health

    monkeypatch.setattr(executor_health, "GPUS_PER_TURN", 3)
    replica = health(tmp_path, Labels())
    for gpu in range(10):
        replica.windows.add(gpu_sample("n1", gpu, 1_000_000.0))
        replica.windows.add(gpu_sample("n1", gpu, 1_000_060.0))
    turns = LoopTurns()
    turn_of_each: list[int] = []
    assess = replica._label_if_at_risk

    async def assessed(node: str, gpu: int, window: list) -> float:
        turn_of_each.append(turns.count)
        return await assess(node, gpu, window)

    replica._label_if_at_risk = assessed  # type: ignore[method-assign]
    async with turns:
        await replica.assess_health()
    assert len(turn_of_each) == 10
    assert len(set(turn_of_each)) == math.ceil(10 / 3), turn_of_each  # three GPUs a turn

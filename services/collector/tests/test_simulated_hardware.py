"""``SimulatedHardware``: every task placed through ``sim.control`` ends exactly once, with the right kind."""

from __future__ import annotations

import msgspec
import pytest
from fleetpilot.contracts import SimCommand
from fleetpilot.fleet.inventory import load_fleet_spec
from fleetpilot.fleet.simulator import SimulatedFleet
from fleetpilot_services.collector.service import SimulatedHardware


@pytest.fixture(scope="module")
def three_site():
    return load_fleet_spec()


@pytest.fixture
def hw(three_site) -> SimulatedHardware:
    return SimulatedHardware(SimulatedFleet(three_site, seed=1, start_at=0.0))


def place(hw: SimulatedHardware, task_id: str = "t1", node: str = "a100-00", gpus=(0,), peak_mb: float = 4000.0,
          duration_s: float = 100.0, verb: str = "place"):
    return hw.command(SimCommand(verb=verb, task_id=task_id, node=node, gpus=list(gpus), peak_memory_mb=peak_mb,
                                 duration_s=duration_s))


def kinds(events, task_id: str | None = "t1") -> list[str]:
    return [e.kind for e in events if e.task_id == task_id]


def test_task_finishes_once_at_its_end(hw):
    assert place(hw).ok
    assert kinds(hw.advance(50.0)) == []
    ended = hw.advance(60.0)
    assert kinds(ended) == ["finished"]
    assert ended[0].node == "a100-00"
    assert kinds(hw.advance(200.0)) == []
    assert "t1" not in hw.fleet.running() and not hw.ends_at and not hw.node_of


@pytest.mark.parametrize(("xid", "task_kinds", "still_running"), [
    (79, ["task_failed"], False),   # fell off the bus: fatal, the task is lost
    (48, ["task_failed"], False),   # double-bit ECC: fatal
    (13, [], True),                 # graphics engine exception: reported, task survives
])
def test_xid_kills_only_on_fatal_codes(hw, xid, task_kinds, still_running):
    assert place(hw, gpus=(0, 1)).ok
    hw.advance(1.0)
    hw.fleet.inject_xid("a100-00", 1, xid)
    events = hw.advance(1.0)
    assert kinds(events) == task_kinds
    assert [e.kind for e in events if e.task_id is None] == ["xid"]
    assert ("t1" in hw.fleet.running()) is still_running
    if task_kinds:
        failed = next(e for e in events if e.task_id == "t1")
        assert failed.gpu == 1 and "Xid" in failed.detail
    # A task lost to a fatal XID must not also "finish" later.
    later = kinds(hw.advance(500.0))
    assert later == ([] if task_kinds else ["finished"])


def test_oom_kill_is_reported_once_and_never_finishes(hw):
    assert place(hw, peak_mb=60_000.0, duration_s=100.0).ok  # A100-40GB: cannot fit
    events = hw.advance(10.0)
    assert kinds(events) == ["oom_killed"]
    assert kinds(hw.advance(500.0)) == []


def test_move_keeps_the_end_time_and_reports_the_new_node(hw):
    assert place(hw, duration_s=100.0).ok
    hw.advance(60.0)
    assert place(hw, node="h100-00", gpus=(3,), duration_s=100.0, verb="move").ok
    assert hw.fleet.running() == ["t1"]
    ended = hw.advance(45.0)
    assert kinds(ended) == ["finished"] and ended[0].node == "h100-00"


def test_a_task_that_cannot_resume_starts_its_run_over_when_moved_or_placed_again(hw):
    def command(verb: str, node: str, gpu: int) -> bool:
        return hw.command(SimCommand(verb=verb, task_id="t1", node=node, gpus=[gpu], peak_memory_mb=4000.0,
                                     duration_s=100.0, resumable=False)).ok

    assert command("place", "a100-00", 0)
    hw.advance(60.0)
    assert command("move", "h100-00", 3)
    assert kinds(hw.advance(45.0)) == []  # 60 s done before the move count for nothing
    hw.advance(30.0)
    assert hw.command(SimCommand(verb="remove", task_id="t1")).ok
    assert command("place", "a100-00", 1)
    assert kinds(hw.advance(95.0)) == []  # nor the 75 s done before it was stopped
    ended = hw.advance(10.0)
    assert kinds(ended) == ["finished"] and ended[0].node == "a100-00"


@pytest.mark.parametrize(("node", "gpus"), [("a100-00", (8,)), ("nowhere", (0,)), ("a100-00", ()),
                                            ("a100-00", (1, 1))])
def test_move_to_a_bad_target_leaves_the_task_running(hw, node, gpus):
    assert place(hw).ok
    ack = place(hw, node=node, gpus=gpus, verb="move")
    assert not ack.ok and ack.detail
    assert hw.fleet.running() == ["t1"] and hw.node_of["t1"] == "a100-00"


def test_removed_task_reports_nothing(hw):
    assert place(hw, duration_s=10.0).ok
    assert hw.command(SimCommand(verb="remove", task_id="t1")).ok
    assert kinds(hw.advance(60.0)) == []
    assert hw.command(SimCommand(verb="remove", task_id="t1")).detail == "not running"


def test_place_is_idempotent(hw):
    assert place(hw).ok
    again = place(hw)
    assert again.ok and again.detail == "already running"
    assert hw.fleet.running() == ["t1"]


def memory_of(hw: SimulatedHardware, node: str, task_id: str = "t1") -> float:
    """What the task holds per GPU now, its CUDA context included."""
    sample = next(s for s in hw.fleet.task_samples(node) if s.task_id == task_id)
    return sample.memory_used_mb / len(sample.gpus)


def step_task_on_its_fourth_step(hw: SimulatedHardware) -> tuple[SimCommand, float]:
    """A 30 GB step task of 600 s placed on an A100 and run 360 s: its command, what it holds."""
    cmd = SimCommand(verb="place", task_id="t1", node="a100-00", gpus=[0], peak_memory_mb=30_000.0,
                     pattern="steps", duration_s=600.0)
    assert hw.command(cmd).ok
    hw.advance(360.0)
    return cmd, memory_of(hw, "a100-00")


def test_a_removed_step_task_placed_again_goes_on_from_its_checkpoint(hw):
    # 6 steps over 600 s (a third of its peak at the start): removed on its fourth step, it
    # comes back on that step and ends after the 240 s of its run that were left.
    cmd, held = step_task_on_its_fourth_step(hw)
    assert hw.command(SimCommand(verb="remove", task_id="t1")).ok
    hw.advance(100.0)
    assert hw.command(msgspec.structs.replace(cmd, node="h100-00", gpus=[2])).ok
    hw.advance(1.0)
    assert memory_of(hw, "h100-00") == pytest.approx(held, rel=0.02)
    assert kinds(hw.advance(230.0)) == []
    assert kinds(hw.advance(20.0)) == ["finished"]


def test_a_task_killed_by_the_simulator_starts_again_from_scratch(hw):
    cmd = SimCommand(verb="place", task_id="t1", node="a100-00", gpus=[0], peak_memory_mb=60_000.0,
                     pattern="steps", duration_s=600.0)
    assert hw.command(cmd).ok
    assert kinds(hw.advance(400.0)) == ["oom_killed"]  # 60 GB on a 40 GB A100, on some step
    assert hw.command(msgspec.structs.replace(cmd, node="h100-00", gpus=[2])).ok
    hw.advance(1.0)
    assert memory_of(hw, "h100-00") < 0.5 * 60_000.0  # back on its first step
    assert kinds(hw.advance(590.0)) == []
    assert kinds(hw.advance(20.0)) == ["finished"]


def test_a_moved_step_task_keeps_its_level_and_its_end(hw):
    cmd, held = step_task_on_its_fourth_step(hw)
    assert hw.command(msgspec.structs.replace(cmd, verb="move", node="h100-00", gpus=[2])).ok
    hw.advance(1.0)
    assert memory_of(hw, "h100-00") == pytest.approx(held, rel=0.02)
    assert kinds(hw.advance(230.0)) == []
    assert kinds(hw.advance(20.0)) == ["finished"]  # at 600 s, as if it had not moved


@pytest.mark.parametrize("fields", [
    {"utilization_pct": -40.0},          # read back as -40 % utilisation and power below idle
    {"peak_memory_mb": -1000.0},
    {"duration_s": -5.0},
    {"duration_s": 0.0},
])
def test_a_command_with_a_nonsense_figure_is_refused_with_the_reason_and_changes_nothing(hw, fields):
    """Before, a ``place`` with a negative utilisation was taken and the node's telemetry
    said -40 % utilisation and less than idle power (outside every physical range the
    consumers assume); a negative or zero duration or peak was quietly bent into something
    else. A refused command leaves the fleet as it was, and its ack says why."""
    assert place(hw, task_id="keep").ok
    (field, value), = fields.items()
    ack = hw.command(SimCommand(verb="place", task_id="t1", node="a100-00", gpus=[1], **{"peak_memory_mb": 4000.0,
                                                                                          "duration_s": 100.0,
                                                                                          **fields}))
    assert not ack.ok and field in ack.detail, ack.detail
    assert hw.fleet.running() == ["keep"] and "t1" not in hw.ends_at
    moved = hw.command(SimCommand(verb="move", task_id="keep", node="a100-00", gpus=[2], **{"peak_memory_mb": 4000.0,
                                                                                             "duration_s": 100.0,
                                                                                             **fields}))
    assert not moved.ok
    hw.advance(1.0)
    assert hw.fleet.running() == ["keep"]
    samples = hw.fleet.sample("a100-00")
    assert [p.task_id for p in samples[0].processes] == ["keep"]
    assert all(0.0 <= s.utilization_gpu_pct <= 100.0 for s in samples)

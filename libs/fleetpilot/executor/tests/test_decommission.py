"""Pre-decommission: the pure state machine and two executors competing for one lock."""

from __future__ import annotations

import asyncio

import pytest
from fleetpilot.contracts import DecisionMade, GpuSample, Placement, PolicyRef
from fleetpilot.executor import (
    Cordon,
    Decommission,
    DecommissionRules,
    GpuDecommission,
    InMemoryHookLock,
    PreDecommissionHook,
    StaticBusinessContext,
    check_before_assign,
    check_pre_decommission,
    step,
)
from fleetpilot.executor.decommission import lock_key
from fleetpilot.maintenance.faults import gpu_reading

RULES = DecommissionRules()


class FakeClock:
    """Time that only moves when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sample(at: float, temp: float, node: str = "n1", gpu: int = 0) -> GpuSample:
    return gpu_reading(node, gpu, at, temperature_c=temp)


@pytest.mark.parametrize(
    ("temps", "running", "stage"),
    [
        ([80, 90], 1, "hot"),
        ([90, 90, 90, 90, 90, 84], 1, "healthy"),  # a dip before 5 minutes resets
        ([90] * 6, 1, "cordoned"),  # 0..300 s above: cordon at 5 min
        ([90] * 6, 0, "decommissioned"),  # nothing to drain: straight through
        ([90] * 6 + [70] * 5, 1, "cordoned"),  # a cordon is sticky
        ([90] * 6 + [70] * 30, 1, "decommissioned"),  # drain time (30 min) over
        ([85] * 10, 1, "healthy"),  # "above" 85 is strict
    ],
)
def test_state_machine(temps: list[float], running: int, stage: str) -> None:
    state = GpuDecommission()
    for minute, temp in enumerate(temps):
        state = step(state, temp, running, minute * 60.0, RULES)
    assert state.stage == stage


async def feed(
    hooks: list[PreDecommissionHook], clock: FakeClock, minutes: range, temp: float, running: list[str]
) -> list[tuple[str, object]]:
    """Both executors observe each minute's sample, concurrently; returns who did what."""
    done: list[tuple[str, object]] = []
    for minute in minutes:
        clock.now = minute * 60.0
        results = await asyncio.gather(*(h.observe(sample(clock.now, temp), running) for h in hooks))
        done += [(h.owner, c) for h, cmds in zip(hooks, results, strict=True) for c in cmds]
    return done


async def test_two_executors_one_runs_it_with_drain() -> None:
    clock = FakeClock()
    lock = InMemoryHookLock(clock)
    a, b = PreDecommissionHook("exec-a", lock, clock=clock), PreDecommissionHook("exec-b", lock, clock=clock)
    done = await feed([a, b], clock, range(0, 5), 91, ["t1", "t2"])
    assert done == []  # hot, not yet 5 minutes
    done = await feed([a, b], clock, range(5, 6), 91, ["t1", "t2"])
    assert [type(c) for _, c in done] == [Cordon]
    owner = done[0][0]
    # both replicas now refuse new work on the GPU
    d = DecisionMade(
        decision_id="d",
        task_id="x",
        action="assign",
        placement=[Placement(node="n1", gpu=0, milli=1000)],
        confidence=1,
        policy=PolicyRef(name="p"),
        decided_at=0,
    )
    for hook in (a, b):
        verdict = await check_before_assign(StaticBusinessContext(hooks=[hook]), d)
        assert not verdict.allow and "cordoned" in verdict.reason
        # tasks are still draining: pulling the GPU is refused for now
        assert not (await check_pre_decommission(StaticBusinessContext(hooks=[hook]), "n1", 0, ["t1"])).allow
    # tasks keep running for 10 minutes, then finish: decommission then, by the same owner
    done = await feed([a, b], clock, range(6, 16), 91, ["t1", "t2"])
    assert done == []
    done = await feed([a, b], clock, range(16, 60), 91, [])
    assert [(o, type(c)) for o, c in done] == [(owner, Decommission)]
    assert done[0][1].evict == []
    # long after the lock's TTL, nobody does it again
    done = await feed([a, b], clock, range(100, 110), 91, [])
    assert done == []


async def test_drain_time_limit_evicts_the_rest() -> None:
    clock = FakeClock()
    lock = InMemoryHookLock(clock)
    hooks = [PreDecommissionHook(f"exec-{i}", lock, clock=clock) for i in range(2)]
    done = await feed(hooks, clock, range(0, 60), 95, ["t9", "t1"])
    kinds = [(type(c), round(clock.now)) for _, c in done]
    assert [k for k, _ in kinds] == [Cordon, Decommission]
    assert len({o for o, _ in done}) == 1
    decommission = done[1][1]
    assert isinstance(decommission, Decommission) and decommission.evict == ["t1", "t9"]
    assert hooks[0].state("n1", 0).decommissioned_at == 35 * 60.0  # cordon at 5 min + 30 min drain


async def test_other_executor_takes_over_when_owner_dies() -> None:
    clock = FakeClock()
    lock = InMemoryHookLock(clock)
    a, b = PreDecommissionHook("exec-a", lock, clock=clock), PreDecommissionHook("exec-b", lock, clock=clock)
    done = await feed([a, b], clock, range(0, 6), 91, ["t1"])
    owner, other = (a, b) if done[0][0] == "exec-a" else (b, a)
    # the owner crashes right after cordoning; the other keeps observing
    done = await feed([other], clock, range(6, 39), 91, ["t1"])
    assert done == []  # still locked: TTL 35 min from the cordon at minute 5 runs to minute 40
    done = await feed([other], clock, range(39, 45), 91, ["t1"])
    assert [(o, type(c)) for o, c in done] == [(other.owner, Cordon), (other.owner, Decommission)]
    assert other.state("n1", 0).stage == "decommissioned"


async def test_lock_ttl_and_ownership() -> None:
    clock = FakeClock()
    lock = InMemoryHookLock(clock)
    assert await lock.acquire("k", "a", 10)
    assert await lock.acquire("k", "a", 10)  # re-entrant for the owner
    assert not await lock.acquire("k", "b", 10)
    assert not await lock.release("k", "b")
    clock.now = 10.0
    assert await lock.holder("k") is None  # expired
    assert await lock.acquire("k", "b", 10)
    assert await lock.release("k", "b") and await lock.holder("k") is None


class ReadThenWaitLock(InMemoryHookLock):
    """A lock whose next read of a ``.done`` marker answers, then waits for ``go`` (a slow
    KV round trip, during which another replica finishes the procedure)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.hold_next_done_read = False
        self.read = asyncio.Event()
        self.go = asyncio.Event()

    async def holder(self, key: str) -> str | None:
        answer = await super().holder(key)
        if key.endswith(".done") and self.hold_next_done_read:
            self.hold_next_done_read = False
            self.read.set()
            await self.go.wait()
        return answer


async def test_a_replica_that_read_no_marker_just_before_the_owner_finished_does_not_repeat_it() -> None:
    """The owner decommissions, leaves its ``.done`` marker and lets the lock go between the
    other replica's read of the marker (none yet) and its try for the lock (free now): the
    other replica must not cordon and decommission the GPU a second time."""
    clock = FakeClock()
    lock = ReadThenWaitLock(clock)
    a, b = PreDecommissionHook("exec-a", lock, clock=clock), PreDecommissionHook("exec-b", lock, clock=clock)
    done = await feed([a, b], clock, range(0, 6), 91, ["t1"])
    owner, other = (a, b) if done[0][0] == "exec-a" else (b, a)
    assert await feed([a, b], clock, range(6, 35), 91, ["t1"]) == []
    clock.now = 35 * 60.0  # the drain is over, for both
    lock.hold_next_done_read = True
    late = asyncio.create_task(other.observe(sample(clock.now, 91), ["t1"]))
    await lock.read.wait()
    assert [type(c) for c in await owner.observe(sample(clock.now, 91), ["t1"])] == [Decommission]
    lock.go.set()
    assert await late == []
    assert await feed([a, b], clock, range(36, 200), 91, ["t1"]) == []


class FlakyMarkerLock(InMemoryHookLock):
    """A lock whose first write of a ``.done`` marker fails (the KV store timing out)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.failures = 1

    async def acquire(self, key: str, owner: str, ttl_s: float) -> bool:
        if key.endswith(".done") and self.failures:
            self.failures -= 1
            raise TimeoutError("kv request timed out")
        return await super().acquire(key, owner, ttl_s)


async def test_a_failed_done_marker_does_not_lose_the_decommission() -> None:
    """The lone executor reaches the end of the drain and its ``.done`` marker cannot be
    written: the decommission still goes out (its tasks evicted, the GPU pulled), and the
    marker's failure is no reason to do it twice."""
    clock = FakeClock()
    hook = PreDecommissionHook("exec-a", FlakyMarkerLock(clock), clock=clock)
    done: list[tuple[str, object]] = []
    for minute in range(0, 120):
        clock.now = minute * 60.0
        done += [(hook.owner, c) for c in await hook.observe(sample(clock.now, 91), ["t1"])]
    assert [type(c) for _, c in done] == [Cordon, Decommission]
    assert isinstance(done[1][1], Decommission) and done[1][1].evict == ["t1"]


# ---- renumbering: the procedure follows the board (NVML uuid), not its index -------------

HOT, HEALTHY, NEW = "GPU-hot-board", "GPU-healthy-board", "GPU-swapped-in"


def board(at: float, gpu: int, uuid: str, temp: float, node: str = "n1") -> GpuSample:
    """A sample of the board ``uuid`` read at index ``gpu``."""
    return gpu_reading(node, gpu, at, temperature_c=temp, uuid=uuid)


def assign(gpu: int, node: str = "n1") -> DecisionMade:
    """An assign of one task to ``node``/``gpu``."""
    return DecisionMade(decision_id=f"d-{node}-{gpu}", task_id="x", action="assign",
                        placement=[Placement(node=node, gpu=gpu, milli=500)], confidence=1,
                        policy=PolicyRef(name="p"), decided_at=0)


async def cordon_hot_board_at_index_2(hook: PreDecommissionHook, clock: FakeClock) -> list[object]:
    """The hot board at index 2 for 6 minutes, with a task draining: cordoned; index 1 healthy."""
    done: list[object] = []
    for minute in range(0, 6):
        clock.now = minute * 60.0
        done += await hook.observe(board(clock.now, 1, HEALTHY, 60.0), [])
        done += await hook.observe(board(clock.now, 2, HOT, 95.0), ["t-hot"])
    return done


async def test_a_cordoned_board_renumbered_from_index_2_to_1_stays_cordoned_and_index_2_takes_work() -> None:
    # The board at index 1 fell off the bus; at the next enumeration the hot board reads as 1
    # and a healthy board as 2. Keyed by index, the cordon stayed on 2 (the healthy board was
    # refused, then drained and pulled) while the hot board started over as healthy at 1.
    clock = FakeClock()
    hook = PreDecommissionHook("exec-a", InMemoryHookLock(clock), clock=clock)
    assert [type(c) for c in await cordon_hot_board_at_index_2(hook, clock)] == [Cordon]
    clock.now = 6 * 60.0
    assert await hook.observe(board(clock.now, 1, HOT, 95.0), ["t-hot"]) == []
    assert await hook.observe(board(clock.now, 2, NEW, 60.0), ["t-new"]) == []
    assert hook.state("n1", 1).stage == "cordoned"
    assert hook.state("n1", 2).stage == "healthy"
    refused = await check_before_assign(StaticBusinessContext(hooks=[hook]), assign(1))
    assert not refused.allow and "n1/1" in refused.reason and "cordoned" in refused.reason
    assert (await check_before_assign(StaticBusinessContext(hooks=[hook]), assign(2))).allow
    assert not (await check_pre_decommission(StaticBusinessContext(hooks=[hook]), "n1", 1, ["t-hot"])).allow
    assert (await check_pre_decommission(StaticBusinessContext(hooks=[hook]), "n1", 2, ["t-new"])).allow


async def test_after_a_renumbering_the_drain_ends_with_the_hot_board_pulled_at_its_new_index_only() -> None:
    clock = FakeClock()
    hook = PreDecommissionHook("exec-a", InMemoryHookLock(clock), clock=clock)
    await cordon_hot_board_at_index_2(hook, clock)
    done: list[object] = []
    for minute in range(6, 60):
        clock.now = minute * 60.0
        done += await hook.observe(board(clock.now, 1, HOT, 95.0), ["t-hot"])
        done += await hook.observe(board(clock.now, 2, NEW, 60.0), ["t-new"])
    # Once, for the hot board at the index it reads at now; no second cordon at its new index.
    assert done == [Decommission(node="n1", gpu=1, uuid=HOT, evict=["t-hot"], reason="drained or drain time over")]
    assert hook.state("n1", 2).stage == "healthy"


async def test_a_board_nvml_cannot_read_any_more_keeps_its_cordon() -> None:
    # A board falling off the bus reads no uuid (until it is swapped): it is still the board
    # last known at its index, not a new one to start over with.
    clock = FakeClock()
    hook = PreDecommissionHook("exec-a", InMemoryHookLock(clock), clock=clock)
    await cordon_hot_board_at_index_2(hook, clock)
    clock.now = 6 * 60.0
    assert await hook.observe(board(clock.now, 2, "", 0.0), ["t-hot"]) == []
    assert hook.state("n1", 2).stage == "cordoned"
    assert not (await check_before_assign(StaticBusinessContext(hooks=[hook]), assign(2))).allow


async def test_a_gpu_without_a_uuid_is_followed_by_its_index() -> None:
    # Collectors that cannot read uuids at all: the procedure runs by index, as it always did,
    # under the lock key earlier versions used.
    clock = FakeClock()
    lock = InMemoryHookLock(clock)
    hook = PreDecommissionHook("exec-a", lock, clock=clock)
    done: list[object] = []
    for minute in range(0, 6):
        clock.now = minute * 60.0
        done += await hook.observe(board(clock.now, 2, "", 95.0), ["t"])
    assert done == [Cordon(node="n1", gpu=2, reason="above threshold since 0.0")]
    assert hook.state("n1", 2).stage == "cordoned"
    assert await lock.holder("decommission.n1.2") == "exec-a"


async def test_the_lock_is_the_board_s_so_two_replicas_do_not_both_run_it_across_a_renumbering() -> None:
    clock = FakeClock()
    lock = InMemoryHookLock(clock)
    a = PreDecommissionHook("exec-a", lock, clock=clock)
    await cordon_hot_board_at_index_2(a, clock)
    assert await lock.holder(lock_key("n1", 2, HOT)) == "exec-a"
    assert await lock.holder(lock_key("n1", 1, HOT)) == "exec-a"  # the key names the board alone
    assert lock_key("n1", 2, HOT) != lock_key("n1", 2, NEW) != lock_key("n1", 2)
    # a replica started after the renumbering sees the hot board at index 1 only
    b = PreDecommissionHook("exec-b", lock, clock=clock)
    done: list[object] = []
    for minute in range(6, 30):
        clock.now = minute * 60.0
        done += await b.observe(board(clock.now, 1, HOT, 95.0), ["t-hot"])
    assert done == []  # a's lock on the board holds b off


async def test_lock_entries_an_earlier_version_left_by_index_are_still_honoured() -> None:
    clock = FakeClock()
    lock = InMemoryHookLock(clock)
    # An earlier version's replica runs the procedure of the GPU at index 2 (its lock is
    # keyed by the index): this one waits for it instead of running it a second time.
    assert await lock.acquire("decommission.n1.2", "old-replica", RULES.lock_ttl_s)
    hook = PreDecommissionHook("exec-a", lock, clock=clock)
    assert await cordon_hot_board_at_index_2(hook, clock) == []
    # It finished (its marker keyed by the index too) and let its lock go: not repeated.
    assert await lock.acquire("decommission.n1.2.done", "old-replica", RULES.done_ttl_s)
    assert await lock.release("decommission.n1.2", "old-replica")
    done: list[object] = []
    for minute in range(6, 60):
        clock.now = minute * 60.0
        done += await hook.observe(board(clock.now, 2, HOT, 95.0), [])
    assert done == []


async def test_a_placement_whose_hold_names_the_cordoned_board_is_refused_wherever_that_board_reads_now() -> None:
    # The policy reserved the hot board at 2, its topology behind the renumbering (or the
    # cordon): the hold names HOT. At 2 now reads NEW, which by index alone takes the task, and
    # the ledger then said it ran on HOT: HOT's drain counted it, and its pull evicted it.
    clock = FakeClock()
    hook = PreDecommissionHook("exec-a", InMemoryHookLock(clock), clock=clock)
    await cordon_hot_board_at_index_2(hook, clock)
    clock.now = 6 * 60.0
    await hook.observe(board(clock.now, 1, HOT, 95.0), ["t-hot"])
    await hook.observe(board(clock.now, 2, NEW, 60.0), [])
    assert not hook.accepts_board("n1", HOT) and hook.accepts_board("n1", NEW)
    assert hook.accepts_board("n1", "GPU-never-seen")
    refusal = hook.held_board_refusal("n1", 2, HOT)
    assert "n1/2" in refusal and HOT in refusal and "cordoned" in refusal
    assert hook.held_board_refusal("n1", 2, NEW) == ""
    assert hook.held_board_refusal("n1", 2, "") == ""  # a hold of an earlier version: by index
    # A hold naming another board than the one reading at its index now: placed by a topology
    # behind the samples; carried out, the ledger would name the wrong board for the task.
    stale = hook.held_board_refusal("n1", 2, HEALTHY)
    assert "n1/2" in stale and NEW in stale and HEALTHY in stale
    # No board known at the index (no sample read yet): nothing to say against the hold.
    assert hook.held_board_refusal("n1", 5, "GPU-other") == ""

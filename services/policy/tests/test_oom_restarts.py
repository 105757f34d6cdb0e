"""A task an OOM killed is started over, as its Job would restart it: queued again under its
next ``<task>.assign.<g>`` (killed alone on its GPU, asking more than that GPU has and than
it held; beside another task, what it asked before), once however often the kill is delivered; killed on a placement past
``oom_restarts``, it is given up with ``task.rejected``. Real nats-server, the policy and an
executor over a stand-in for the simulated fleet."""

from __future__ import annotations

import asyncio
import sys

import msgspec
from fleetpilot.contracts import (
    Allocation,
    NodeLedger,
    SimEvent,
    TaskLifecycle,
    TaskTelemetry,
    encode,
    now,
)
from fleetpilot.runtime.testing import eventually

from .conftest import admitted, node, wait_for
from .test_executor_evictions import loop_on_simulated_fleet, publish_lifecycle

A10_MB, H100_MB = 24_576, 81_920


async def held(observer, task_id: str) -> list[tuple[str, str, int]]:
    """(node, decision, GPU memory held) of each of ``task_id``'s holds in the ledger."""
    return [(n, a.decision_id, a.memory_mb) for n, ledger in (await observer.ledgers()).items()
            for a in ledger.allocations if a.task_id == task_id]


def told(events: list[TaskLifecycle]) -> list[tuple[str, str, str]]:
    """(state, decision, detail) of each lifecycle event seen: what a failed wait says."""
    return [(e.state, e.decision_id, e.detail) for e in events]


async def killed_by_oom(observer, events: list[TaskLifecycle], task_id: str, where: str, mb: float) -> TaskLifecycle:
    """``task_id`` is seen holding ``mb`` on ``where``'s GPU 0, then the simulated fleet kills
    it for running out of memory there; the executor's ``oom_killed`` event."""
    await observer.nc.publish(f"telemetry.task.{task_id}", encode(TaskTelemetry(
        task_id=task_id, node=where, gpus=[0], at=now(), memory_used_mb=mb)))
    await observer.nc.flush()
    await asyncio.sleep(0.3)  # the policy's samples are core NATS: taken before the kill
    ends = sum(e.state == "oom_killed" for e in events)
    await observer.nc.publish(f"sim.event.{where}", encode(SimEvent(
        kind="oom_killed", node=where, gpu=0, task_id=task_id, detail="CUDA out of memory", at=now())))
    await wait_for(lambda: sum(e.state == "oom_killed" for e in events) > ends, what=f"{task_id} killed")
    return [e for e in events if e.state == "oom_killed"][-1]


async def test_a_task_killed_by_an_oom_alone_on_its_gpu_starts_over_on_a_bigger_one_once(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0", gpus=1, model="A10", memory_mb=A10_MB),
                              node("n1", gpus=1, model="H100", memory_mb=H100_MB)])
    adm = admitted("t1", gpu_milli=1000, gpu_memory_mb=8_000, gpu_models=["A10", "H100"])
    await observer.kv_put("contracts", "contract.t1", encode(adm))

    async with loop_on_simulated_fleet(observer, nats_url, tmp_path, "t1") as events:
        await observer.admit(adm)
        await wait_for(lambda: any(e.state == "started" for e in events), what="t1 started")
        assert [(n, d) for n, d, _ in await held(observer, "t1")] == [("n0", "t1.assign")]  # best fit: the A10

        oom = await killed_by_oom(observer, events, "t1", "n0", 23_000.0)

        async def started_over() -> bool:
            return [(n, d) for n, d, _ in await held(observer, "t1")] == [("n1", "t1.assign.2")]

        await eventually(started_over, what="t1 placed again on the H100")
        await wait_for(lambda: [e.state for e in events] == ["started", "oom_killed", "started"],
                       what="t1 started again")
        (_, _, memory_mb), = await held(observer, "t1")
        # Alone on the A10 when it died: it needs more than the A10 has (with the headroom
        # a predicted peak gets), which only the H100 holds.
        assert memory_mb >= A10_MB * 1.05
        restart = next(d for d in observer.decisions if d.decision_id == "t1.assign.2")
        assert restart.action == "assign" and restart.placement[0].node == "n1"

        # The kill delivered again, while t1 runs again: nothing more is placed.
        await publish_lifecycle(observer, oom, 1)
        await asyncio.sleep(0.8)
        assert sorted(d.decision_id for d in observer.decisions) == ["t1.assign", "t1.assign.2"]
        assert await observer.live_keys("pending") == []


async def test_a_task_killed_by_an_oom_beside_another_asks_what_it_asked_before(observer, nats_url, tmp_path):
    """The other task may have taken the memory: no floor of its own (its fingerprint, told
    its signature's floor by the fingerprinter, asks for more where it knows more)."""
    await observer.put_fleet([node("n0", gpus=1, model="H100", memory_mb=H100_MB)])
    await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[
        Allocation(task_id="other", decision_id="other.assign", gpu=0, milli=500, memory_mb=40_000,
                   state="confirmed")])))
    adm = admitted("t4", gpu_milli=500, gpu_memory_mb=8_000)
    await observer.kv_put("contracts", "contract.t4", encode(adm))

    async with loop_on_simulated_fleet(observer, nats_url, tmp_path, "t4") as events:
        await observer.admit(adm)
        await wait_for(lambda: any(e.state == "started" for e in events), what="t4 started")
        first = await held(observer, "t4")
        await killed_by_oom(observer, events, "t4", "n0", 30_000.0)
        await wait_for(lambda: [e.state for e in events] == ["started", "oom_killed", "started"],
                       what="t4 started over")
        again = await held(observer, "t4")
    assert [(n, mb) for n, _, mb in again] == [(n, mb) for n, _, mb in first] == [("n0", 8_000)]
    assert [d for _, d, _ in again] == ["t4.assign.2"]


async def test_a_task_killed_by_an_oom_past_its_restarts_is_given_up(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0", gpus=2, model="H100", memory_mb=H100_MB)])
    adm = msgspec.structs.replace(admitted("t2", gpu_milli=500, gpu_memory_mb=8_000), tenant="acme")
    await observer.kv_put("contracts", "contract.t2", encode(adm))
    rejected = await observer.follow_rejections()
    async with loop_on_simulated_fleet(observer, nats_url, tmp_path, "t2", {"oom_restarts": 1}) as events:
        await observer.admit(adm)
        await wait_for(lambda: any(e.state == "started" for e in events), what="t2 started")
        await killed_by_oom(observer, events, "t2", "n0", 30_000.0)
        await wait_for(lambda: [e.state for e in events] == ["started", "oom_killed", "started"],
                       what="t2 started over")
        # Alone on an H100, the largest GPU there is: it asks a whole one.
        assert [(d, mb) for _, d, mb in await held(observer, "t2")] == [("t2.assign.2", H100_MB)]
        assert rejected == []

        last = await killed_by_oom(observer, events, "t2", "n0", 31_000.0)
        await wait_for(lambda: bool(rejected), what="t2 given up")
        await asyncio.sleep(0.8)  # nothing placed after it
        assert sorted(d.decision_id for d in observer.decisions) == ["t2.assign", "t2.assign.2"]
        assert await observer.live_keys("pending") == []
        assert await held(observer, "t2") == []
    (given_up,) = rejected
    assert given_up.task_id == "t2" and given_up.tenant == "acme" and given_up.code == "infeasible"
    assert given_up.rejected_at == last.at
    assert "placement 2" in given_up.reason and "oom_restarts" in given_up.reason


async def test_a_real_process_that_ran_out_of_gpu_memory_runs_again_and_finishes(observer, nats_url, tmp_path):
    """The whole loop with the process backend: the task's first run dies on a CUDA
    out-of-memory error (its stderr), the executor reports it ``oom_killed``, the policy
    places it again and the executor starts its command again, which finishes."""
    runs = tmp_path / "runs"
    code = ("import pathlib, sys\n"
            f"runs = pathlib.Path({str(runs)!r})\n"
            "n = len(runs.read_text().splitlines()) if runs.exists() else 0\n"
            "runs.write_text(runs.read_text() + 'run\\n' if runs.exists() else 'run\\n')\n"
            "if n == 0:\n"
            "    sys.exit('RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB')\n")
    await observer.put_fleet([node("n0", gpus=1)])
    adm = admitted("t3", gpu_milli=1000, gpu_memory_mb=8_000, command=[sys.executable, "-c", code])
    await observer.kv_put("contracts", "contract.t3", encode(adm))

    async with loop_on_simulated_fleet(observer, nats_url, tmp_path, "t3", backend="process", node="n0",
                                       process_log_dir=str(tmp_path / "logs")) as events:
        await observer.admit(adm)
        await wait_for(lambda: [e.state for e in events] == ["started", "oom_killed", "started", "finished"],
                       timeout_s=20, what=lambda: f"t3 killed, started over, finished (events: {told(events)})")
    assert runs.read_text().splitlines() == ["run", "run"]
    assert [(e.state, e.decision_id) for e in events] == [
        ("started", "t3.assign"), ("oom_killed", "t3.assign"), ("started", "t3.assign.2"), ("finished", "t3.assign.2")]
    assert "out of memory" in events[1].detail


async def test_a_task_moved_off_a_failing_node_has_all_its_oom_restarts_still(observer, nats_url, tmp_path):
    """oom_restarts counts the kills, not the placements: a task the executor evicted from a
    node gone silent (placed again through no fault of its own) and then killed by an OOM is
    started over; killed a second time, it is given up. Counted by placements, as it was,
    its first kill (on placement 2) gave it up."""
    await observer.put_fleet([node("n0", gpus=1, model="H100", memory_mb=H100_MB),
                              node("n1", gpus=1, model="H100", memory_mb=H100_MB)])
    adm = msgspec.structs.replace(admitted("t3", gpu_milli=1000, gpu_memory_mb=8_000), tenant="acme")
    await observer.kv_put("contracts", "contract.t3", encode(adm))
    rejected = await observer.follow_rejections()
    async with loop_on_simulated_fleet(observer, nats_url, tmp_path, "t3", {"oom_restarts": 1},
                                       silent_check_s=0.2) as events:
        await observer.admit(adm)
        await wait_for(lambda: any(e.state == "started" for e in events), what="t3 started")
        ((first, _, _),) = await held(observer, "t3")
        other = "n1" if first == "n0" else "n0"
        await observer.put_fleet([node(first, gpus=1, model="H100", memory_mb=H100_MB,
                                       labels={0: {"unreachable": "true"}})])
        await wait_for(lambda: [e.state for e in events] == ["started", "evicted", "started"],
                       what="t3 placed again off the silent node")

        await killed_by_oom(observer, events, "t3", other, 30_000.0)
        await wait_for(lambda: [e.state for e in events][-2:] == ["oom_killed", "started"],
                       what="t3 started over after its first kill")
        assert [d for _, d, _ in await held(observer, "t3")] == ["t3.assign.3"]
        assert rejected == []

        await killed_by_oom(observer, events, "t3", other, 31_000.0)
        await wait_for(lambda: bool(rejected), what="t3 given up at its second kill")
        await asyncio.sleep(0.8)  # nothing placed after it
        assert sorted(d.decision_id for d in observer.decisions) == ["t3.assign", "t3.assign.2", "t3.assign.3"]
        assert await held(observer, "t3") == []
    (given_up,) = rejected
    assert given_up.tenant == "acme" and "killed by an OOM 2 times" in given_up.reason
    assert "(placement 3)" in given_up.reason

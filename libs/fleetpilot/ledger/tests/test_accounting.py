"""The ledger arithmetic never books more than a GPU has, and every hold goes back: random
sequences of reservations, executions, failures, releases and redelivered executions on
one node, checked against a model of what each task holds."""

from __future__ import annotations

import random

import pytest
from fleetpilot.contracts import (
    Allocation,
    DecisionMade,
    GpuInfo,
    NodeLedger,
    NodeTopology,
    Placement,
    PolicyRef,
)
from fleetpilot.ledger.accounting import (
    confirmed,
    free_capacity,
    moved_here,
    resized,
    with_allocations,
    without_decision,
    without_task,
)

NODE = NodeTopology(node="n1", cpu_milli=64_000, memory_mb=512_000,
                    gpus=[GpuInfo(index=i, model="A100", memory_mb=40_000) for i in range(3)])


def hold(task: str, decision: str, gpu: int, milli: int, memory_mb: int) -> Allocation:
    return Allocation(task_id=task, decision_id=decision, gpu=gpu, milli=milli, memory_mb=memory_mb)


def test_a_placement_holding_one_gpu_twice_is_refused() -> None:
    # Each share fits GPU 0 alone; together they are 1600 of its 1000 milli.
    twice = [hold("t1", "t1.assign", 0, 800, 8000), hold("t1", "t1.assign", 0, 800, 8000)]
    with pytest.raises(ValueError, match="t1 would hold GPU 0 of n1 twice"):
        with_allocations(None, "n1", twice)
    # One hold per GPU, and CPU-only holds, are fine.
    fine = with_allocations(None, "n1", [hold("t1", "t1.assign", 0, 800, 8000), hold("t1", "t1.assign", 1, 800, 8000),
                                         hold("t2", "t2.assign", -1, 0, 0), hold("t3", "t3.assign", 0, 200, 0)])
    assert free_capacity(NODE, fine).gpu_milli == (0, 200, 1000)


def resize(task: str, decision: str, gpu: int, milli: int, memory_mb: int) -> DecisionMade:
    return DecisionMade(decision_id=decision, task_id=task, action="resize",
                        placement=[Placement(node="n1", gpu=gpu, milli=milli, memory_mb=memory_mb)],
                        confidence=0.5, policy=PolicyRef(name="test"), decided_at=0.0)


@pytest.mark.parametrize("seed", range(40))
def test_random_sequences_keep_the_ledger_equal_to_the_model(seed: int) -> None:
    rng = random.Random(seed)
    ledger = NodeLedger(node="n1")
    # task -> (decision, gpu, milli, memory) it runs under; in flight: task -> (kind, decision, gpu, memory)
    running: dict[str, tuple[str, int, int, int]] = {}
    in_flight: dict[str, tuple[str, str, int, int]] = {}
    done: list[tuple[str, str, str, int, int]] = []  # executed decisions, to be redelivered
    counter = 0

    def fits(gpu: int, milli: int, memory: int, cur: NodeLedger) -> bool:
        free = free_capacity(NODE, cur)
        return free.gpu_milli[gpu] >= milli and free.gpu_memory_mb[gpu] >= memory

    for _ in range(200):
        counter += 1
        op = rng.choice(["assign", "move", "resize", "execute", "fail", "release", "redeliver"])
        task = f"t{rng.randrange(6)}"
        gpu, milli, memory = rng.randrange(3), rng.choice([250, 500, 1000]), rng.choice([5000, 10_000, 20_000])
        if op == "assign" and task not in running and fits(gpu, milli, memory, ledger):
            d = f"{task}.assign.{counter}"
            ledger = with_allocations(ledger, "n1", [hold(task, d, gpu, milli, memory)])
            running[task] = (d, gpu, milli, memory)
            in_flight[task] = ("assign", d, gpu, memory)
        elif op == "move" and task in running and task not in in_flight:
            _, src, m, mem = running[task]
            if gpu != src and fits(gpu, m, mem, ledger):
                d = f"{task}.move.{counter}"
                ledger = NodeLedger(node="n1", allocations=[*ledger.allocations, hold(task, d, gpu, m, mem)])
                in_flight[task] = ("move", d, gpu, mem)
        elif op == "resize" and task in running and task not in in_flight:
            _, g, m, mem = running[task]
            if fits(g, 0, 5000, ledger):
                d = f"{task}.resize.{counter}"
                ledger = NodeLedger(node="n1", allocations=[*ledger.allocations, hold(task, d, g, 0, 5000)])
                in_flight[task] = ("resize", d, g, mem + 5000)
        elif op == "execute" and task in in_flight:
            kind, d, g, mem = in_flight.pop(task)
            if kind == "assign":
                ledger = confirmed(ledger, task, d)
            elif kind == "move":
                ledger = moved_here(ledger, task, d) or ledger
                running[task] = (d, g, running[task][2], mem)
            else:
                _, _, m, _ = running[task]
                ledger = resized(ledger, resize(task, d, g, m, mem)) or ledger
                running[task] = (running[task][0], g, m, mem)
            done.append((kind, task, d, g, mem))
        elif op == "fail" and task in in_flight and in_flight[task][0] != "assign":
            _, d, _, _ = in_flight.pop(task)
            ledger = without_decision(ledger, d) or ledger
        elif op == "release" and task in running and task not in in_flight:
            ledger = without_task(ledger, task)
            del running[task]
        elif op == "redeliver" and done:
            kind, t, d, g, mem = rng.choice(done)
            if kind == "assign":
                ledger = confirmed(ledger, t, d)
            elif kind == "move":
                ledger = moved_here(ledger, t, d) or ledger
            else:
                ledger = resized(ledger, resize(t, d, g, 0, mem)) or ledger

        # What each task holds is what the model says: its running hold, plus what its
        # decision in flight reserved; nothing of a released task; no GPU over its share.
        expected = set()
        for t, (d, g, m, mem) in running.items():
            expected.add((t, d, g, m, mem))
            if t in in_flight and in_flight[t][0] != "assign":
                kind, fd, fg, fmem = in_flight[t]
                expected.add((t, fd, fg, m if kind == "move" else 0, fmem if kind == "move" else 5000))
        got = sorted((a.task_id, a.decision_id, a.gpu, a.milli, a.memory_mb) for a in ledger.allocations)
        assert got == sorted(expected), (seed, op, task)
        free = free_capacity(NODE, ledger)
        assert min(free.gpu_milli) >= 0 and min(free.gpu_memory_mb) >= 0

"""FGD fragmentation and scores against hand-computed tiny clusters."""

from __future__ import annotations

import numpy as np
import pytest
from fleetpilot.policy import (
    ClusterState,
    FragTable,
    TaskRequest,
    TaskShape,
    build_policy,
    fgd_score,
    typical_tasks,
)


def cluster(rows: list[tuple[str, str, int, list[int]]]) -> ClusterState:
    """rows: (name, model, cpu_free, per-GPU free milli)."""
    state = ClusterState.build(names=[r[0] for r in rows], cpu_milli=[r[2] for r in rows],
                               memory_mb=[64000] * len(rows), gpus=[len(r[3]) for r in rows],
                               models=[r[1] for r in rows])
    for i, r in enumerate(rows):
        state.gpu_free[i, : len(r[3])] = r[3]
    return state


# Example 1. Typical tasks: t1 = 500 milli (w .5), t2 = one whole GPU (w .5), both 1000 CPU.
#   node A free [1000, 500]: t1 fits, no GPU < 500 -> 0; t2 fits, GPU1 (500) < 1000 -> 500.
#     frag(A) = .5*0 + .5*500 = 250.
#   node B free [1000, 1000]: both fit with nothing too small -> frag(B) = 0.
#   A sharing 500-milli task:
#     A/GPU1 -> [1000, 0]: t1 0, t2 0 (a 0 GPU adds 0) -> frag 0, delta +250 -> int(100*sig(.25)) = 56
#     A/GPU0 -> [500, 500]: t1 0, t2 cannot run -> L=1000 -> frag 500, delta -250 -> 43
#     B/GPU0 -> [500, 1000]: t1 0, t2 500 -> frag 250, delta -250 -> 43
EX1_SHAPES = [TaskShape(cpu_milli=1000, gpu_milli=500, gpus=1, weight=0.5),
              TaskShape(cpu_milli=1000, gpu_milli=1000, gpus=1, weight=0.5)]
# Example 2. Typical tasks: t3 CPU-only 4000 CPU (w .5) — it uses no GPU, so all free GPU
#   counts as fragment for it —, t4 one whole GPU of model Y only (w .5).
#   node X1 (model X) [1000, 1000]: t3 -> 2000, t4 wrong model -> 2000; frag = 2000.
#   node Y1 (model Y) [1000, 1000]: t3 -> 2000, t4 fits -> 0; frag = 1000.
#   A whole-GPU task with 4000 CPU: X1 -> [0, 1000]: t3 1000, t4 1000 -> frag 1000, delta 1000 -> 73
#                                   Y1 -> [0, 1000]: t3 1000, t4 0 -> frag 500, delta 500 -> 62
EX2_SHAPES = [TaskShape(cpu_milli=4000, gpu_milli=0, gpus=0, weight=0.5),
              TaskShape(cpu_milli=0, gpu_milli=1000, gpus=1, models=("Y",), weight=0.5)]


@pytest.mark.parametrize(
    ("shapes", "rows", "expected"),
    [
        (EX1_SHAPES, [("A", "X", 8000, [1000, 500]), ("B", "X", 8000, [1000, 1000])], [250.0, 0.0]),
        (EX2_SHAPES, [("X1", "X", 8000, [1000, 1000]), ("Y1", "Y", 8000, [1000, 1000])], [2000.0, 1000.0]),
        # Not enough CPU for t1/t2 (1000): every typical task sees all 1500 free milli.
        (EX1_SHAPES, [("C", "X", 500, [1000, 500])], [1500.0]),
        # Nothing free: nothing fragmented.
        (EX1_SHAPES, [("D", "X", 8000, [0, 0])], [0.0]),
    ],
)
def test_node_fragmentation_matches_hand_computation(shapes, rows, expected):
    state = cluster(rows)
    table = FragTable(shapes, state.models, state.max_gpus)
    assert table.node_frag(state).tolist() == pytest.approx(expected)


@pytest.mark.parametrize(("delta", "score"), [(250.0, 56), (-250.0, 43), (1000.0, 73), (500.0, 62), (0.0, 50)])
def test_fgd_score_is_integer_sigmoid(delta, score):
    assert fgd_score(np.asarray([delta]))[0] == score


def test_fgd_sharing_task_picks_least_fragmenting_gpu():
    state = cluster([("A", "X", 8000, [1000, 500]), ("B", "X", 8000, [1000, 1000])])
    table = FragTable(EX1_SHAPES, state.models, state.max_gpus)
    task = TaskRequest(task_id="s", gpus=1, gpu_milli=500, cpu_milli=1000)
    delta, _ = table.placement_deltas(state, task, np.arange(2))
    assert delta[0].tolist() == pytest.approx([-250.0, 250.0])
    assert delta[1].tolist() == pytest.approx([-250.0, -250.0])
    policy = build_policy("fgd", seed=1, typical=EX1_SHAPES)
    d = policy.decide(state, task)
    assert (d.placement[0].node, d.placement[0].gpu, d.placement[0].milli) == ("A", 1, 500)


def test_fgd_whole_gpu_task_prefers_model_nobody_needs():
    state = cluster([("X1", "X", 8000, [1000, 1000]), ("Y1", "Y", 8000, [1000, 1000])])
    task = TaskRequest(task_id="w", gpus=1, gpu_milli=1000, cpu_milli=4000)
    table = FragTable(EX2_SHAPES, state.models, state.max_gpus)
    delta, _ = table.placement_deltas(state, task, np.arange(2))
    assert fgd_score(delta).tolist() == [73, 62]
    assert build_policy("fgd", typical=EX2_SHAPES).decide(state, task).placement[0].node == "X1"


def test_typical_tasks_cover_95_percent_and_renormalise():
    tasks = ([TaskRequest(task_id=f"a{i}", gpus=1, gpu_milli=500) for i in range(60)]
             + [TaskRequest(task_id=f"b{i}", gpus=1, gpu_milli=1000) for i in range(36)]
             + [TaskRequest(task_id=f"c{i}", gpus=2, gpu_milli=1000) for i in range(3)]
             + [TaskRequest(task_id="d", gpus=0, gpu_milli=0, cpu_milli=100)])
    shapes = typical_tasks(tasks)
    assert [(s.gpu_milli, s.gpus) for s in shapes] == [(500, 1), (1000, 1)]  # 96% covered
    assert [round(s.weight, 4) for s in shapes] == [round(60 / 96, 4), round(36 / 96, 4)]

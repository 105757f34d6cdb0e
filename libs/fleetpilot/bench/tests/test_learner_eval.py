"""The learner benchmark's arguments and its scoring."""

from __future__ import annotations

import numpy as np
import pytest
from fleetpilot.bench.learner_eval import main, score, seeds
from fleetpilot.contracts import DecisionMade, Placement, PolicyRef, TaskSubmitted
from fleetpilot.learner import Example, OutcomeFeatures, train


@pytest.mark.parametrize("text, expected", [("1-3", [1, 2, 3]), ("4", [4]), ("1,5,9", [1, 5, 9]),
                                            ("1,11-13", [1, 11, 12, 13])])
def test_seeds(text: str, expected: list[int]) -> None:
    assert seeds(text) == expected


@pytest.mark.parametrize("argv, message", [
    (["--train", "1-3", "--test", "3-5"], "learner bench: --train and --test share a seed; the test must be unseen"),
    (["--train", "x"], "learner bench: argument --train: not a seed or a range of seeds: 'x' (e.g. 1-4 or 1,2,5)"),
    (["--train", "5-1"], "learner bench: argument --train: an empty range of seeds: '5-1' (e.g. 1-4 or 1,2,5)"),
    (["--fleet", "moon"], "learner bench: argument --fleet: invalid choice: 'moon' (choose from 'three-site', 'openb')"),
])
def test_bad_arguments_get_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert str(refused.value.code) == message


def test_a_model_that_learnt_nothing_scores_as_the_scheduler_did() -> None:
    examples = [Example(DecisionMade(decision_id=f"d{i}", task_id=f"t{i}", action="assign", confidence=c,
                                     placement=[Placement(node="n", gpu=0, milli=1000, memory_mb=8000)],
                                     policy=PolicyRef(name="k8s-default"), decided_at=float(i),
                                     task=TaskSubmitted(task_id=f"t{i}", gpu_memory_mb=8000)),
                        "T4", ok, 1.0, float(i))
                for i, (c, ok) in enumerate([(0.9, True), (0.9, False), (0.6, True), (0.99, True)])]
    layout = OutcomeFeatures.for_models({"T4"})
    x = layout.matrix([(e.decision, e.gpu_model) for e in examples])
    untrained = train(layout, x, np.ones(len(x)), np.ones(len(x)), epochs=0)
    figures = score(untrained, examples)
    expected = ((0.9 - 1) ** 2 + 0.9 ** 2 + 0.4 ** 2 + 0.01 ** 2) / 4
    assert figures["brier_model"] == pytest.approx(expected) and figures["brier_prior"] == pytest.approx(expected)
    assert figures["observed"] == 0.75 and figures["placements"] == 4

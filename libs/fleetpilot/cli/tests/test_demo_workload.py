"""The demo workload of ``fleetpilot up --demo``: the programs in their weights, and the one
program that outgrows what its users ask, which the simulated fleet plays to its real peak."""

from __future__ import annotations

from collections import Counter

from fleetpilot.cli.workload import demo_tasks
from fleetpilot.fingerprint import MODEL_LABEL
from fleetpilot.fleet.catalogue import gpu_model
from fleetpilot.workload import GROWTH_LABEL, GROWTH_PATTERNS, SIM_PEAK_LABEL


def test_the_demo_draws_its_programs_in_their_weights_and_the_same_for_a_seed() -> None:
    tasks = demo_tasks(4000)
    shares = Counter(t.labels[MODEL_LABEL] for t in tasks)
    assert abs(shares["resnet50-serve"] / len(tasks) - 0.30) < 0.03
    assert abs(shares["gpt-13b-train"] / len(tasks) - 0.05) < 0.015
    assert all(t.labels[GROWTH_LABEL] in GROWTH_PATTERNS for t in tasks)
    assert demo_tasks(50) == demo_tasks(50) != demo_tasks(50, seed=8)


def test_only_the_leaking_etl_job_outgrows_its_ask_and_a_40_gb_gpu() -> None:
    tasks = demo_tasks(300)
    outgrowing = {t.labels[MODEL_LABEL] for t in tasks if SIM_PEAK_LABEL in t.labels}
    assert outgrowing == {"feature-etl"}
    etl = next(t for t in tasks if t.labels[MODEL_LABEL] == "feature-etl")
    peak = float(etl.labels[SIM_PEAK_LABEL])
    assert peak > gpu_model("A100-40GB").memory_mb > etl.gpu_memory_mb
    assert peak < gpu_model("H100").memory_mb  # it fits a larger GPU: started over there, it finishes

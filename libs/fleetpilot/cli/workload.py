"""The demo workload of ``fleetpilot up --demo``: a seeded mix of training, fine-tuning,
inference and encoding tasks, shared and whole GPUs, with memory-growth patterns."""

from __future__ import annotations

import numpy as np

from fleetpilot.contracts import SlaRequest, TaskSubmitted
from fleetpilot.fingerprint import MODEL_LABEL
from fleetpilot.workload import GROWTH_LABEL, SIM_PEAK_LABEL

# (program, kind, gpus, gpu_milli, memory MB asked, growth pattern, duration s, weight, MB
# the program really peaks at: None for what it asks). Each shape is one program, named by
# its ``model`` label: tasks of one program share a signature, so the fingerprinter learns
# each program's memory, not a blend of programs of one kind. The ETL job leaks past what
# its users ask, and past a 40 GB A100: killed by an OOM there, it starts over asking more,
# and its program's fingerprint, learnt from the kills, sends its later runs to larger GPUs.
_SHAPES = [
    ("resnet50-serve", "infer", 1, 250, 9_000, "flat", 90, 0.30, None),
    ("llama2-7b-serve", "infer", 1, 500, 18_000, "flat", 120, 0.15, None),
    ("whisper-encode", "encode", 1, 500, 12_000, "sawtooth", 60, 0.15, None),
    ("llama2-7b-lora", "finetune", 1, 1000, 30_000, "steps", 150, 0.15, None),
    ("gpt-1b-train", "train", 2, 1000, 60_000, "linear", 240, 0.10, None),
    ("gpt-13b-train", "train", 8, 1000, 70_000, "linear", 300, 0.05, None),
    ("feature-etl", "batch", 1, 1000, 20_000, "leak", 120, 0.10, 46_000),
]


def demo_tasks(count: int, seed: int = 7, prefix: str = "demo") -> list[TaskSubmitted]:
    """``count`` tasks drawn from the shapes above with the seed."""
    rng = np.random.default_rng(seed)
    weights = np.array([s[7] for s in _SHAPES])
    picks = rng.choice(len(_SHAPES), size=count, p=weights / weights.sum())
    tasks = []
    for i, pick in enumerate(picks):
        program, kind, gpus, milli, mem, pattern, duration, _, peak = _SHAPES[int(pick)]
        tier = ("vip", "standard", "best_effort")[int(rng.integers(3))]
        # One inference task in ten asks for a warm-up no GPU can give while loading its
        # weights: the negotiator answers with a counter-offer.
        warmup_ms = 50.0 if kind == "infer" and i % 10 == 0 else None
        tasks.append(TaskSubmitted(
            task_id=f"{prefix}-{i:04d}", kind=kind, gpus=gpus, gpu_milli=milli, gpu_memory_mb=mem,
            cpu_milli=4000 * gpus, memory_mb=16_384 * gpus, size_gb=float(rng.uniform(1, 40)),
            sla=SlaRequest(tier=tier, warmup_ms=warmup_ms), expected_duration_s=float(duration),
            labels={GROWTH_LABEL: pattern, MODEL_LABEL: program} | ({SIM_PEAK_LABEL: str(peak)} if peak else {}),
            submitted_at=0.0))
    return tasks

"""How a task's GPU memory grows over its life: the ground truth the simulator plays out
and the fingerprinter learns to recognise.

Patterns (``t`` is seconds since the task started, ``T`` its duration):

- ``flat``: warm-up ramp to ``peak_mb`` within ``warmup_s``, then a plateau (an LLM server).
- ``linear``: from ``base_mb`` rising steadily to ``peak_mb`` at ``T``.
- ``steps``: ``n_steps`` equal jumps from ``base_mb`` to ``peak_mb`` (a CLIP fine-tune
  growing its batch or caches).
- ``sawtooth``: rises from ``base_mb`` to ``peak_mb`` and drops back every ``period_s``
  (periodic allocation and release).
- ``leak``: grows at a rate that itself increases (quadratic), reaching ``peak_mb`` at
  ``T`` — the leaking notebook that ends in an OOM if left alone.

Every function is vectorised over ``t`` with numpy and carries optional noise from a
seeded generator, so a series is reproducible.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

PatternName = Literal["flat", "linear", "steps", "sawtooth", "leak"]
GROWTH_PATTERNS: tuple[PatternName, ...] = ("flat", "linear", "steps", "sawtooth", "leak")

# Two task labels describe to the simulated fleet how a task's program behaves, as a real
# program would behave on a real GPU; only the executor's simulated backend reads them. The
# policy and the fingerprinter know a task by what it asks and what it is seen to do.
GROWTH_LABEL = "growth"
"""The pattern (``GROWTH_PATTERNS``) the simulated fleet plays the task's memory by."""
SIM_PEAK_LABEL = "sim.peak_mb"
"""The per-GPU peak, in MB, the task's program really reaches in the simulated fleet, where
it is not what the task asks (a user who asked for less than the program grows to: killed by
an OOM where its GPU is too small). Without it the program peaks at what it asks."""


class MemoryGrowth(msgspec.Struct, frozen=True, kw_only=True):
    """A memory-growth curve; ``memory_at(t)`` gives used MB at ``t`` seconds after start."""

    pattern: PatternName
    base_mb: float
    peak_mb: float
    duration_s: float
    warmup_s: float = 0.0
    n_steps: int = 4
    period_s: float = 60.0
    noise_mb: float = 0.0
    # ``steps``: how long the first level lasts, the others evenly spaced over the rest (a
    # schedule restored between two of its steps); 0: each lasts ``duration_s / n_steps``.
    first_step_s: float = 0.0

    def memory_at(self, t: np.ndarray | float, rng: np.random.Generator | None = None) -> np.ndarray:
        """Used memory (MB) at times ``t``; noise is added only when ``rng`` is given."""
        t = np.clip(np.asarray(t, dtype=np.float64), 0.0, self.duration_s)
        span = self.peak_mb - self.base_mb
        life = max(self.duration_s, 1e-9)
        if self.pattern == "flat":
            warm = max(self.warmup_s, 1e-9)
            mem = self.base_mb + span * np.minimum(t / warm, 1.0)
        elif self.pattern == "linear":
            mem = self.base_mb + span * (t / life)
        elif self.pattern == "steps":
            mem = self.base_mb + span * self._level(t) / max(self.n_steps, 1)
        elif self.pattern == "sawtooth":
            phase = np.mod(t, max(self.period_s, 1e-9)) / max(self.period_s, 1e-9)
            mem = self.base_mb + span * phase
        elif self.pattern == "leak":
            mem = self.base_mb + span * (t / life) ** 2
        else:  # pragma: no cover - Literal guards this
            raise ValueError(f"unknown pattern {self.pattern!r}")
        if rng is not None and self.noise_mb > 0:
            mem = mem + rng.normal(0.0, self.noise_mb, size=np.shape(mem))
        return np.maximum(mem, 0.0)

    def _stride(self) -> float:
        """How long each ``steps`` level after the first lasts."""
        steps = max(self.n_steps, 1)
        if self.first_step_s > 0 and steps > 1:
            return (self.duration_s - self.first_step_s) / (steps - 1)
        return self.duration_s / steps

    def _level(self, t: np.ndarray) -> np.ndarray:
        """The ``steps`` level (1 to ``n_steps``) the schedule stands on at ``t``."""
        steps = max(self.n_steps, 1)
        if self.first_step_s <= 0 or steps == 1:
            return np.minimum(np.floor(t / max(self.duration_s, 1e-9) * steps) + 1, steps)
        after = np.floor((t - self.first_step_s) / max(self._stride(), 1e-9)) + 2
        return np.where(t < self.first_step_s, 1.0, np.minimum(after, steps))

    def restored(self, progress_s: float, duration_s: float) -> MemoryGrowth:
        """The curve of this run restored from a checkpoint taken ``progress_s`` into it, played
        over ``duration_s`` (what is left of the run, plus the restore).

        ``steps`` follow the run's progress (a batch-size or resolution schedule): restored, the
        run comes back at the level it had reached, holds it through the restore and until its
        progress reaches the next step, and steps on at the same points of its progress to the
        same peak (when ``duration_s`` is shorter than the steps left, they are spread evenly
        over it). The other patterns follow the process (a warm-up, the caching allocator's
        growth, a period, a leak): a new process starts them over, to the same peak.
        """
        base, steps, first = self.base_mb, self.n_steps, 0.0
        if self.pattern == "steps":
            n = max(steps, 1)
            reached = int(self._level(np.asarray(float(progress_s))))
            steps = n - reached + 1
            level = float(self.memory_at(progress_s))
            base = self.peak_mb if steps == 1 else (steps * level - self.peak_mb) / (steps - 1)
            # The levels after this one last as long as they did; this one, the rest.
            first = duration_s - (steps - 1) * self._stride() if steps > 1 else 0.0
            first = max(first, 0.0)
        return msgspec.structs.replace(self, base_mb=base, n_steps=steps, duration_s=duration_s,
                                       warmup_s=min(self.warmup_s, duration_s), first_step_s=first)

    def highest_until(self, t: float) -> float:
        """The most the noiseless curve holds at any instant of its first ``t`` seconds: where
        it is at ``t`` for the patterns that never fall, the top a ``sawtooth`` comes up to once
        a period has passed. A process's peak as the driver keeps it (NVML's per-process
        accounting), which no sampling between two instants misses."""
        if self.pattern == "sawtooth" and t >= self.period_s:
            return float(self.peak_mb)
        return float(self.memory_at(t))

    @property
    def true_peak_mb(self) -> float:
        """The highest memory the noiseless curve reaches over the task's life."""
        return float(self.peak_mb)


def random_growth(rng: np.random.Generator, pattern: PatternName | None = None, *,
                  peak_mb: float | None = None, duration_s: float | None = None) -> MemoryGrowth:
    """A plausible random curve of ``pattern`` (random when ``None``) for tests and benchmarks."""
    pattern = pattern or GROWTH_PATTERNS[int(rng.integers(len(GROWTH_PATTERNS)))]
    peak = float(peak_mb if peak_mb is not None else rng.uniform(2_000, 70_000))
    duration = float(duration_s if duration_s is not None else rng.uniform(600, 7_200))
    base = peak * float(rng.uniform(0.15, 0.5))
    return MemoryGrowth(
        pattern=pattern,
        base_mb=base,
        peak_mb=peak,
        duration_s=duration,
        warmup_s=duration * float(rng.uniform(0.02, 0.1)),
        n_steps=int(rng.integers(3, 7)),
        period_s=duration / float(rng.uniform(4, 12)),
        noise_mb=peak * float(rng.uniform(0.002, 0.01)),
    )

"""Workload models shared by the simulator, the fingerprinter's evaluation and the benchmarks."""

from .growth import GROWTH_PATTERNS, MemoryGrowth, random_growth

__all__ = ["GROWTH_PATTERNS", "MemoryGrowth", "random_growth"]

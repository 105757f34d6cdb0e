"""Workload models shared by the simulator, the fingerprinter's evaluation and the benchmarks."""

from .growth import GROWTH_LABEL, GROWTH_PATTERNS, SIM_PEAK_LABEL, MemoryGrowth, random_growth

__all__ = ["GROWTH_LABEL", "GROWTH_PATTERNS", "SIM_PEAK_LABEL", "MemoryGrowth", "random_growth"]

"""Benchmarks that measure Fleetpilot libraries against ground truth and baselines."""

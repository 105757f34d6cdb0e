"""Collector: reads GPUs (NVML on real nodes, the simulated fleet elsewhere) and publishes telemetry."""

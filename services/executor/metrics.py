"""The executor's own Prometheus series: how its tasks end, and how healthy its GPUs look.

On Kubernetes each node's executor is scraped as a target of its own, so its series are the
node's; an executor that carries out the whole (simulated) fleet's decisions reports all of
its GPUs.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge


class ExecutorMetrics:
    """The service's own series, in the host's registry next to the handler metrics."""

    def __init__(self, registry) -> None:
        """Register the series in ``registry``."""
        self.task_ends = Counter(
            "fleetpilot_executor_task_ends_total",
            "Tasks that ended by themselves on the GPUs this executor runs, by how: finished, oom_killed, "
            "failed (a fatal XID, a non-zero exit)",
            ["state"], registry=registry,
        )
        self.failure_probability = Gauge(
            "fleetpilot_executor_gpu_failure_probability",
            "The health model's failure probability of each GPU at its latest assessment (maintenance_pending "
            "at or above FLEETPILOT_EXECUTOR_HEALTH_THRESHOLD)",
            ["node", "gpu"], registry=registry,
        )
        self._assessed: set[tuple[str, str]] = set()

    def ended(self, state: str) -> None:
        """Count a task's end the executor tells."""
        self.task_ends.labels(state).inc()

    def assessed(self, risks: dict[tuple[str, int], float]) -> None:
        """Show one health round's failure probabilities, by (node, GPU index); the GPUs
        the round no longer assesses (their node forgotten, their board silent) go."""
        shown = {(node, str(gpu)) for node, gpu in risks}
        for gone in self._assessed - shown:
            self.failure_probability.remove(*gone)
        for (node, gpu), risk in risks.items():
            self.failure_probability.labels(node, str(gpu)).set(risk)
        self._assessed = shown

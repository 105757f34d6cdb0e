"""GPU maintenance: a health model that flags GPUs about to fail, with its evaluation.

:class:`HealthModel` turns a window of telemetry into a failure risk and
``maintenance_pending`` above 0.85, with the tasks to migrate away; :mod:`.faults`
generates injected fault histories and ``fleetpilot.maintenance.eval`` (not imported here, so ``python -m`` runs it cleanly) measures detections, lead time and
false alarms on them.
"""

from .faults import FAILURE_MODES, FaultScenario, generate, generate_fleet
from .health import (
    MAINTENANCE_THRESHOLD,
    XID_SEVERITY,
    HealthAssessment,
    HealthFeatures,
    HealthModel,
    LogisticWeights,
    MigrationRequest,
    features_of,
    migration_plan,
    xid_severity,
)

__all__ = [
    "FAILURE_MODES",
    "MAINTENANCE_THRESHOLD",
    "XID_SEVERITY",
    "FaultScenario",
    "HealthAssessment",
    "HealthFeatures",
    "HealthModel",
    "LogisticWeights",
    "MigrationRequest",
    "features_of",
    "generate",
    "generate_fleet",
    "migration_plan",
    "xid_severity",
]

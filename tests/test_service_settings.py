"""Every service, started as its process with a misspelt and a malformed variable of its
own, stops at once with one line naming both: it never runs on settings it silently ignored."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SERVICES = ("collector", "topology", "fingerprinter", "sla", "policy", "executor", "feedback", "learner")


@pytest.mark.parametrize("service", SERVICES)
def test_a_wrong_variable_stops_the_service_with_one_line(service, tmp_path):
    prefix = f"FLEETPILOT_{service.upper()}_"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETPILOT_")}
    # Nothing listens there: a service that started anyway would fail on the bus, not on its settings.
    env.update({"FLEETPILOT_NATS_URL": "nats://127.0.0.1:1", "FLEETPILOT_STATE_DIR": str(tmp_path),
                f"{prefix}METRICS_PROT": "9300", f"{prefix}METRICS_PORT": "ninety"})
    proc = subprocess.run([sys.executable, "-m", f"fleetpilot_services.{service}"], env=env, capture_output=True,
                          text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"fleetpilot-{service}: {prefix}METRICS_PROT is not a setting "
                               f"(did you mean {prefix}METRICS_PORT?)"), lines[0]
    assert f"{prefix}METRICS_PORT='ninety': Input should be a valid integer" in lines[0]

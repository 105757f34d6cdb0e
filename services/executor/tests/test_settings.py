"""The executor's settings refuse nonsense at start, in one line per setting: a NaN grace
reached the hand-over request (``HandOver.grace_s``), which cannot be encoded; a negative
one stopped tasks at once; a NaN period ran a job back to back."""

from __future__ import annotations

import pytest
from fleetpilot_services.executor.settings import ExecutorSettings
from pydantic import ValidationError

REFUSED = [
    ("grace_s", "nan"), ("grace_s", -1.0),
    ("checkpoint_s", "nan"), ("checkpoint_s", -5.0),
    ("default_duration_s", 0.0), ("default_duration_s", "inf"),
    ("decommission_threshold_c", "nan"),
    ("decommission_hot_for_s", -1.0),
    ("health_interval_s", 0.0), ("health_interval_s", "nan"),
    ("health_window_s", 0.0),
    ("health_sample_every_s", -1.0),
    ("health_threshold", 1.5), ("health_threshold", "nan"),
    ("silent_check_s", 0.0), ("silent_check_s", "nan"),
    ("hand_over_taken_within_s", "nan"),
    ("process_log_max_mb", -1.0), ("process_log_max_mb", "inf"),
]


@pytest.mark.parametrize(("name", "value"), REFUSED)
def test_a_nonsense_value_is_refused_naming_the_setting(name, value):
    with pytest.raises(ValidationError) as refused:
        ExecutorSettings(**{name: value})
    assert name in str(refused.value)


def test_the_defaults_and_sensible_edges_are_accepted():
    ExecutorSettings()
    ExecutorSettings(grace_s=0.0, checkpoint_s=0.0, decommission_hot_for_s=0.0, health_threshold=1.0)


def test_carrying_out_a_decision_may_take_as_long_as_its_settings_make_it_wait():
    """A decision's handling is cut as hung past its consumer's limit (15 minutes); a move
    with a long checkpoint window and grace may wait longer (three hand-over tries), and
    must not be cut as hung while it waits as told."""
    from fleetpilot.contracts import CONSUMERS
    from fleetpilot_services.executor.backends import hand_over_wait_s

    default = ExecutorSettings(nats_url="nats://127.0.0.1:1", state_dir="/tmp")
    assert default.decision_limit_s == CONSUMERS["executor-decisions"].handler_limit_s
    slow = ExecutorSettings(nats_url="nats://127.0.0.1:1", state_dir="/tmp", checkpoint_s=600.0, grace_s=120.0,
                            hand_over_taken_within_s=3600.0)
    assert slow.decision_limit_s >= hand_over_wait_s(600.0, 120.0) + 720.0 > CONSUMERS["executor-decisions"].handler_limit_s

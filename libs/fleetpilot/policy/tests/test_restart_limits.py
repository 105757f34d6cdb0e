"""``PlacementFailures``: each kind counted apart, a placement once, and the value read back as written."""

import msgspec
import pytest
from fleetpilot.policy.restart_limits import PlacementFailures, decode_failures, encode_failures


def test_a_failure_is_added_once_and_only_to_its_kind() -> None:
    none = PlacementFailures()
    one = none.with_failure("oom_killed", "t.assign")
    assert one is not None and one.of("oom_killed") == ("t.assign",) and one.of("refused") == ()
    assert one.with_failure("oom_killed", "t.assign") is None  # told again
    both = one.with_failure("refused", "t.assign")
    assert both is not None and both.of("refused") == ("t.assign",) and both.of("oom_killed") == ("t.assign",)
    assert decode_failures(encode_failures(both)) == both


def test_a_value_that_is_not_a_record_of_failures_is_refused() -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_failures(b'{"oom_killed": "t.assign"}')

"""How each signature's runs come back from a checkpoint: where they were, or lower."""

from __future__ import annotations

import msgspec
from fleetpilot.contracts import Fingerprint
from fleetpilot.fingerprint import (
    SignatureMemory,
    SignatureStats,
    load_stats,
    merge,
    merge_restore,
    restore_tells,
    restores_start_over,
)
from fleetpilot.policy.rebalance import GROWTH_LOOKAHEAD_S
from fleetpilot.policy.restores import bridge_floor_mb


def test_an_unknown_signature_is_taken_to_come_back_where_it_was() -> None:
    assert not restores_start_over(None)
    assert not restores_start_over(SignatureStats(signature="sig-a"))
    assert bridge_floor_mb(None, 40_960, 3600.0, GROWTH_LOOKAHEAD_S) == 40_961


def test_a_signature_whose_restores_came_back_low_starts_over_and_carries_no_floor() -> None:
    memory = SignatureMemory()
    stats = memory.observe_restore("sig-leak", stopped_mb=38_000.0, restored_mb=15_000.0)
    assert (stats.restores_kept, stats.restores_reset) == (0, 1)
    assert restores_start_over(memory.stats("sig-leak"))
    assert bridge_floor_mb(memory.stats("sig-leak"), 40_960, 3600.0, GROWTH_LOOKAHEAD_S) == 0
    assert not restores_start_over(memory.stats("sig-other"))


def test_a_run_that_outgrew_its_room_sooner_than_a_lookahead_keeps_the_floor_though_it_starts_over() -> None:
    # Started over there, it would be stopped again as soon, and near its end outgrow the room
    # between two samples.
    memory = SignatureMemory()
    starts_over = memory.observe_restore("sig-leak", stopped_mb=38_000.0, restored_mb=15_000.0)
    assert restores_start_over(starts_over)
    assert bridge_floor_mb(starts_over, 32_768, 120.0, GROWTH_LOOKAHEAD_S) == 32_769
    assert bridge_floor_mb(starts_over, 32_768, GROWTH_LOOKAHEAD_S - 1.0, GROWTH_LOOKAHEAD_S) == 32_769
    assert bridge_floor_mb(starts_over, 32_768, GROWTH_LOOKAHEAD_S, GROWTH_LOOKAHEAD_S) == 0


def test_the_majority_of_restores_decides_and_a_tie_keeps_the_floor() -> None:
    stats = merge_restore(SignatureStats(signature="sig-steps"), stopped_mb=30_000.0, restored_mb=29_500.0)
    assert (stats.restores_kept, stats.restores_reset) == (1, 0)
    stats = merge_restore(stats, stopped_mb=30_000.0, restored_mb=10_000.0)
    assert not restores_start_over(stats)  # one each: not known to start over
    assert bridge_floor_mb(stats, 40_960, 3600.0, GROWTH_LOOKAHEAD_S) == 40_961
    stats = merge_restore(stats, stopped_mb=30_000.0, restored_mb=9_000.0)
    assert restores_start_over(stats)


def test_only_a_run_stopped_well_past_where_it_started_can_tell() -> None:
    # Stopped at 24 GB having started at 20: started over or not, it comes back near 20 GB.
    assert not restore_tells(started_mb=20_000.0, stopped_mb=24_000.0)
    assert restore_tells(started_mb=15_000.0, stopped_mb=38_000.0)


def test_a_finished_run_folded_in_keeps_the_restore_counts_and_they_survive_the_bucket() -> None:
    stats = merge_restore(SignatureStats(signature="sig-s"), stopped_mb=30_000.0, restored_mb=5_000.0)
    fp = Fingerprint(signature="sig-s", pattern="leak", pattern_confidence=0.9, growth_rate_mb_per_s=5.0,
                     predicted_peak_mb=38_000.0, peak_low_mb=37_000.0, peak_high_mb=39_000.0)
    stats = merge(stats, fp)
    assert (stats.count, stats.restores_kept, stats.restores_reset) == (1, 0, 1)
    again = load_stats(msgspec.json.encode(stats))
    assert again == stats
    # Statistics stored before restores were counted read as none known.
    old = {"memory": "per_gpu", "signature": "sig-s", "count": 1, "votes": {"leak": 0.9}}
    before = load_stats(msgspec.json.encode(old))
    assert before is not None and (before.restores_kept, before.restores_reset) == (0, 0)

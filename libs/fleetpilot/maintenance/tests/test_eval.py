"""The fault-history generator and the model's evaluation on injected faults."""

from __future__ import annotations

import pytest
from fleetpilot.maintenance import FAILURE_MODES, generate, generate_fleet
from fleetpilot.maintenance.eval import evaluate, format_report, main


def test_generator_is_deterministic_and_truthful() -> None:
    a, b = generate("degrading", 3, seed=7, mode="memory"), generate("degrading", 3, seed=7, mode="memory")
    assert a == b
    assert a.fails_at is not None and a.onset_at is not None and a.onset_at < a.fails_at
    assert a.samples[-1].at <= a.fails_at < a.samples[-1].at + 120.0  # reporting stops at the failure
    assert a.samples[-1].xid_last == 79
    assert a.samples[-1].ecc_corrected > 10 * max(a.samples[len(a.samples) // 4].ecc_corrected, 1)
    healthy = generate("healthy", 1, seed=7)
    assert healthy.fails_at is None and healthy.samples[-1].at == 24 * 3600.0
    assert healthy.samples[-1].xid_count == 0
    noisy = generate("noisy", 2, seed=7)
    assert noisy.samples[-1].xid_count >= 2 and noisy.fails_at is None


@pytest.fixture(scope="module")
def report():
    return evaluate(generate_fleet(healthy=20, noisy=15, degrading=15, seed=11))


def test_failures_seen_coming_without_false_alarms(report) -> None:  # type: ignore[no-untyped-def]
    assert report.failures == 15 and report.non_failing == 35
    visible = [r for r in report.results if r.fails_at is not None and r.mode != "sudden"]
    seen = [r for r in visible if r.lead_s is not None]
    assert len(seen) / len(visible) >= 0.75
    assert all(lead >= 600 for lead in report.lead_times_s)
    assert report.false_alarm_rate <= 0.05


def test_sudden_failures_are_reported_as_missed(report) -> None:  # type: ignore[no-untyped-def]
    sudden = [r for r in report.results if r.mode == "sudden"]
    assert sudden and all(r.lead_s is None for r in sudden)
    assert set(report.by_mode) == set(FAILURE_MODES)


def test_main_prints_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--healthy", "3", "--noisy", "2", "--degrading", "5"])
    out = capsys.readouterr().out
    for label in ("seen coming", "lead time", "false alarms", "mode thermal"):
        assert label in out
    assert "failures                  5" in format_report(
        evaluate(generate_fleet(healthy=1, noisy=0, degrading=5))
    )

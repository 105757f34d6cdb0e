"""The live log of ``fleetpilot up``: what a reader needs from a decision line."""

from __future__ import annotations

from fleetpilot.cli.up import _short_reason
from fleetpilot.contracts import DecisionMade
from fleetpilot.contracts.decision import PolicyRef


def decision(reason: str, *, fallback: bool) -> DecisionMade:
    """An assign decision with ``reason``."""
    return DecisionMade(decision_id="d1", task_id="t1", action="assign", confidence=0.5,
                        policy=PolicyRef(name="fallback" if fallback else "fleetpilot"), fallback=fallback,
                        reason=reason, decided_at=0.0)


def test_a_long_fallback_reason_keeps_why_the_primary_was_set_aside() -> None:
    reason = "fallback: node a100-00 score 51 of 11 feasible (priority 3, 2 ties) (primary: timeout)"
    line = _short_reason(decision(reason, fallback=True), width=30)
    assert line == "fallback: node a100-00 score 5… (primary: timeout)"


def test_short_reasons_are_whole_and_long_ones_are_cut() -> None:
    assert _short_reason(decision("fleetpilot: node a", fallback=False), width=30) == "fleetpilot: node a"
    cut = _short_reason(decision("fleetpilot: node a100-00 score 51 of 11 feasible (x)", fallback=False), width=30)
    assert cut == "fleetpilot: node a100-00 score…"

"""The Prometheus alerting rules in deploy/prometheus/ ask only for what the services serve:
every metric an expression names is registered by a service, with the labels it selects or
groups by, and every rule says how bad it is and what to do."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from fleetpilot.runtime.metrics import HandlerMetrics
from fleetpilot_services.fingerprinter.service import FingerprinterSettings
from fleetpilot_services.fingerprinter.service import build as build_fingerprinter
from fleetpilot_services.learner.service import LearnerSettings
from fleetpilot_services.learner.service import build as build_learner
from fleetpilot_services.policy.learned import LearnedConfidence
from fleetpilot_services.policy.metrics import PolicyMetrics
from fleetpilot_services.topology.service import TopologySettings
from fleetpilot_services.topology.service import build as build_topology
from prometheus_client import CollectorRegistry

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "alerts.yaml"
RULE_LIST = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def served() -> dict[str, set[str]]:
    """Every metric the services register, as a query names it (a counter with ``_total``),
    with its label names."""
    registries = [HandlerMetrics("any").registry, CollectorRegistry(),
                  build_topology(TopologySettings(metrics_port=-1, fleet_spec="none")).metrics.registry,
                  build_fingerprinter(FingerprinterSettings(metrics_port=-1)).metrics.registry,
                  build_learner(LearnerSettings(metrics_port=-1)).metrics.registry]
    PolicyMetrics(registries[1])
    LearnedConfidence(None, registries[1])
    out: dict[str, set[str]] = {}
    for registry in registries:
        # The collectors themselves: a labelled series shows no sample before its first use.
        for collector in set(registry._collector_to_names):  # noqa: SLF001 - no public listing
            for family in collector.describe():
                name = family.name + "_total" if family.type == "counter" else family.name
                out[name] = set(getattr(collector, "_labelnames", ()))
    return out


@pytest.mark.parametrize("rule", RULE_LIST, ids=lambda r: r["alert"])
def test_a_rule_asks_for_served_metrics_and_labels(rule):
    metrics = served()
    expr = rule["expr"]
    names = set(re.findall(r"\bfleetpilot_[a-z_]+", expr))
    assert names and names <= set(metrics), f"not served: {names - set(metrics)}"
    labels = set(metrics[next(iter(names))]) if len(names) == 1 else set().union(*(metrics[n] for n in names))
    used = set(re.findall(r"(\w+)\s*=~?\s*\"", expr))
    for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
        used |= {label.strip() for label in group.split(",") if label.strip()}
    assert used <= labels, f"labels {used - labels} are not on {names}"
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")


@pytest.mark.parametrize("rule", RULE_LIST, ids=lambda r: r["alert"])
def test_a_rule_says_how_bad_it_is_and_what_to_do(rule):
    assert rule["alert"].startswith("Fleetpilot")
    assert rule["labels"]["severity"] in {"warning", "critical"}
    assert rule["annotations"]["summary"] and rule["annotations"]["action"]
    assert "for" not in rule or re.fullmatch(r"\d+[smh]", rule["for"])


def test_alert_names_are_unique_and_cover_what_operators_watch():
    names = [rule["alert"] for rule in RULE_LIST]
    assert len(names) == len(set(names))
    watched = " ".join(rule["expr"] for rule in RULE_LIST)
    for metric in ("fleetpilot_topology_nodes", "fleetpilot_policy_breaker_open", "fleetpilot_dead_letters_total",
                   "fleetpilot_bus_connected", "fleetpilot_fingerprinter_partition",
                   "fleetpilot_policy_learned_confidence_total", "fleetpilot_learner_models_withdrawn_total",
                   "fleetpilot_policy_oldest_wait_seconds"):
        assert metric in watched


SERVICES = ("collector", "topology", "fingerprinter", "sla", "policy", "executor", "feedback", "learner")


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_with_no_replica_left_is_alerted_on(service):
    # FleetpilotBusDisconnected reads what a running replica says: with none running (a crash
    # loop, an image not pulled, pods not scheduled) there is no series, and nothing fired
    # while no task was admitted or placed. The label value is the host's name for the service.
    source = (RULES.parents[2] / "services" / service / "service.py").read_text()
    assert f'ServiceHost("{service}"' in source
    wanted = f'absent(fleetpilot_bus_connected{{service="{service}"}})'
    rules = [rule for rule in RULE_LIST if wanted in rule["expr"].replace(" ", "")]
    assert rules, f"no rule fires when no {service} replica serves its metrics"
    assert all(re.fullmatch(r"\d+m", rule.get("for", "")) for rule in rules)  # not for a rollout's restart

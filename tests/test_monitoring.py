"""The Prometheus alerting rules in deploy/prometheus/ and the Grafana dashboard in
deploy/grafana/ ask only for what the services serve: every metric an expression names is
registered by a service, with the labels it selects or groups by. Every rule says how bad it
is and what to do; every panel says what it shows, on the dashboard's templated data source."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest
import yaml
from fleetpilot.runtime.metrics import HandlerMetrics
from fleetpilot_services.collector.watchdog import NvmlWatchdog
from fleetpilot_services.executor.metrics import ExecutorMetrics
from fleetpilot_services.feedback.service import FeedbackSettings
from fleetpilot_services.feedback.service import build as build_feedback
from fleetpilot_services.fingerprinter.service import FingerprinterSettings
from fleetpilot_services.fingerprinter.service import build as build_fingerprinter
from fleetpilot_services.learner.service import LearnerSettings
from fleetpilot_services.learner.service import build as build_learner
from fleetpilot_services.policy.learned import LearnedConfidence
from fleetpilot_services.policy.metrics import PolicyMetrics
from fleetpilot_services.sla.metrics import SlaMetrics
from fleetpilot_services.topology.service import TopologySettings
from fleetpilot_services.topology.service import build as build_topology
from prometheus_client import CollectorRegistry

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yaml"
RULE_LIST = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
DASHBOARD = json.loads((DEPLOY / "grafana" / "fleetpilot.json").read_text())
PANELS = [panel for panel in DASHBOARD["panels"] if panel["type"] != "row"]
TARGETS = [(panel["title"], target) for panel in PANELS for target in panel["targets"]]


@cache
def served() -> dict[str, frozenset[str]]:
    """Every series the services register, as a query names it (a counter with ``_total``, a
    histogram's ``_bucket`` with its ``le``, ``_count`` and ``_sum``), with its label names."""
    registries = [HandlerMetrics("any").registry, CollectorRegistry(),
                  build_topology(TopologySettings(metrics_port=-1, fleet_spec="none")).metrics.registry,
                  build_fingerprinter(FingerprinterSettings(metrics_port=-1)).metrics.registry,
                  build_learner(LearnerSettings(metrics_port=-1)).metrics.registry,
                  build_feedback(FeedbackSettings(metrics_port=-1)).metrics.registry]
    PolicyMetrics(registries[1])
    LearnedConfidence(None, registries[1])
    NvmlWatchdog(1.0, registries[1])
    SlaMetrics(registries[1])
    ExecutorMetrics(registries[1])
    out: dict[str, frozenset[str]] = {}
    for registry in registries:
        # The collectors themselves: a labelled series shows no sample before its first use.
        for collector in set(registry._collector_to_names):  # noqa: SLF001 - no public listing
            for family in collector.describe():
                labels = frozenset(getattr(collector, "_labelnames", ()))
                if family.type == "counter":
                    out[family.name + "_total"] = labels
                elif family.type == "histogram":
                    out |= {family.name + "_bucket": labels | {"le"}, family.name + "_count": labels,
                            family.name + "_sum": labels}
                else:
                    out[family.name] = labels
    return out


def check_asks_for_served(expr: str) -> None:
    """Fail unless ``expr`` names only served series, and only their labels."""
    metrics = served()
    names = set(re.findall(r"\bfleetpilot_[a-z_]+", expr))
    assert names and names <= set(metrics), f"not served: {names - set(metrics)}"
    labels = set().union(*(metrics[n] for n in names))
    used = set(re.findall(r"(\w+)\s*=~?\s*\"", expr))
    for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
        used |= {label.strip() for label in group.split(",") if label.strip()}
    assert used <= labels, f"labels {used - labels} are not on {names}"
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")


@pytest.mark.parametrize("rule", RULE_LIST, ids=lambda r: r["alert"])
def test_a_rule_asks_for_served_metrics_and_labels(rule):
    check_asks_for_served(rule["expr"])


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
                   "fleetpilot_policy_oldest_wait_seconds", "fleetpilot_feedback_records_total",
                   "fleetpilot_feedback_expected_successes_total", "fleetpilot_executor_gpu_failure_probability",
                   "fleetpilot_sla_answers_total"):
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


@pytest.mark.parametrize(("panel", "target"), TARGETS, ids=[f"{title}-{t['refId']}" for title, t in TARGETS])
def test_a_dashboard_panel_asks_for_served_metrics_and_labels(panel, target):
    check_asks_for_served(target["expr"])
    assert target["legendFormat"]
    # A legend names only labels its query keeps.
    kept = set().union(*(g.split(",") for g in re.findall(r"\bby\s*\(([^)]*)\)", target["expr"])))
    assert set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"])) <= {k.strip() for k in kept}


def test_the_dashboard_reads_its_chosen_prometheus_and_tiles_its_panels():
    [variable] = [v for v in DASHBOARD["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in DASHBOARD["panels"]:
        box = panel["gridPos"]
        assert box["x"] >= 0 and box["x"] + box["w"] <= 24, panel["title"]
        covered = {(x, y) for x in range(box["x"], box["x"] + box["w"]) for y in range(box["y"], box["y"] + box["h"])}
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
    for panel in PANELS:
        assert panel["title"] and panel["description"] and panel["targets"]
        assert panel["datasource"]["uid"] == "${" + variable["name"] + "}"
        assert all(t["datasource"] == panel["datasource"] for t in panel["targets"])


def test_the_dashboard_shows_admission_the_loop_the_queue_and_the_services():
    shown = " ".join(target["expr"] for _, target in TARGETS)
    for metric in ("fleetpilot_policy_decisions_total", "fleetpilot_feedback_records_total",
                   "fleetpilot_feedback_expected_successes_total", "fleetpilot_feedback_action_latency_seconds",
                   "fleetpilot_policy_waiting_tasks", "fleetpilot_policy_oldest_wait_seconds",
                   "fleetpilot_topology_nodes", "fleetpilot_bus_connected", "fleetpilot_dead_letters_total",
                   "fleetpilot_sla_answers_total", "fleetpilot_sla_offers_closed_total",
                   "fleetpilot_executor_gpu_failure_probability", "fleetpilot_executor_task_ends_total"):
        assert metric in shown

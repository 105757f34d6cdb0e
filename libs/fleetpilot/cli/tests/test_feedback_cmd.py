"""``fleetpilot feedback`` over a real nats-server and the feedback service: what the store
holds, grouped as asked; a grouping the store does not know is refused before anything runs;
a bus without a feedback service is one line."""

from __future__ import annotations

import asyncio
import io
import json
from types import SimpleNamespace

import pytest
from fleetpilot.cli.feedback_cmd import DEFAULT_BY, main
from fleetpilot.cli.main import main as cli_main
from fleetpilot.contracts import ActionExecuted, ActionFailed, PolicyRef, TaskLifecycle, encode
from fleetpilot.runtime.testing import eventually
from fleetpilot_services.feedback.service import FeedbackSettings, build


def show(nats_url: str, by: tuple[str, ...] = DEFAULT_BY, *, as_json: bool = False) -> str:
    out = io.StringIO()
    assert main(SimpleNamespace(nats_url=nats_url, state_dir=None, by=by, timeout=5.0, json=as_json), out=out) == 0
    return out.getvalue()


def result(decision_id: str, action: str, *, failed: bool = False, kind: str = "train"):
    common = dict(action_id=f"act-{decision_id}", decision_id=decision_id, task_id=f"t-{decision_id}", action=action,
                  backend="sim", policy=PolicyRef(name="fleetpilot"), confidence=0.9, task_kind=kind,
                  gpu_model="H100", latency_ms=20.0)
    if failed:
        return ActionFailed(**common, error="backend down", failed_at=1.0)
    return ActionExecuted(**common, executed_at=1.0)


def finished(decision_id: str) -> TaskLifecycle:
    return TaskLifecycle(task_id=f"t-{decision_id}", state="finished", decision_id=decision_id, policy="fleetpilot",
                         policy_version="1", decision_action="assign", confidence=0.9, task_kind="train",
                         gpu_model="H100", node="n1", gpus=[0], at=2.0)


async def test_the_store_s_statistics_by_policy_and_action_and_by_any_grouping(nats_client, nats_url, tmp_path):
    host = build(FeedbackSettings(nats_url=nats_url, metrics_port=-1, state_dir=str(tmp_path)))
    await host.start()
    try:
        js = nats_client.jetstream()
        for d in ("d1", "d2"):
            await js.publish("action.executed", encode(result(d, "assign")))
        await js.publish("action.executed", encode(result("d3", "assign", kind="infer")))
        await js.publish("action.failed", encode(result("d4", "resize", failed=True)))
        for d in ("d1", "d2", "d3"):
            await js.publish(f"task.lifecycle.t-{d}", encode(finished(d)))
        text = ""

        async def all_judged() -> bool:
            nonlocal text
            text = await asyncio.to_thread(show, nats_url)
            return text.startswith("4 records")

        await eventually(all_judged, what="the four records stored")
        by_kind = json.loads(await asyncio.to_thread(show, nats_url, ("task_kind",), as_json=True))
        overall = await asyncio.to_thread(show, nats_url, ())
    finally:
        await host.stop()
    lines = text.splitlines()
    assert lines[0] == "4 records in the feedback store, by policy, action:"
    assert sorted(lines[1:]) == [
        "  fleetpilot@1 assign: 3 records, success 1.00 (weighted 1.00), p95 latency 20 ms over 3 measured, "
        "2.7 successes expected, 3 met, Brier 0.010",
        "  fleetpilot@1 resize: 1 record, success 0.00 (weighted 0.00), p95 latency 20 ms over 1 measured, "
        "0.9 successes expected, 0 met, Brier 0.810",
    ]
    assert by_kind["by"] == ["task_kind"]
    assert {g["key"]["task_kind"]: g["count"] for g in by_kind["groups"]} == {"train": 3, "infer": 1}
    assert overall.splitlines()[1].startswith("  every record: 4 records, success 0.75")


@pytest.mark.parametrize(("by", "fragment"), [("nonsense", "'nonsense'"), ("policy,policy", "('policy', 'policy')")])
def test_a_grouping_the_store_does_not_know_is_one_line(capsys, by, fragment):
    with pytest.raises(SystemExit) as ended:
        cli_main(["feedback", "--by", by, "--nats-url", "nats://127.0.0.1:1"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --by: group by a subset of" in err and fragment in err


async def test_a_bus_without_a_feedback_service_is_one_line(nats_url, capsys):
    rc = await asyncio.to_thread(cli_main, ["feedback", "--nats-url", nats_url])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"fleetpilot feedback: no feedback service answers feedback.stats on {nats_url}\n"

"""The live log of ``fleetpilot up``: what a reader needs from a decision line."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import msgspec
import pytest
from fleetpilot.cli.main import main as cli_main
from fleetpilot.cli.up import (
    POLICY_REBALANCE_S,
    SERVICES,
    Report,
    ServiceProcesses,
    _short_reason,
    _where,
    bus_store,
    earlier_run,
    store_stats,
)
from fleetpilot.contracts import (
    ActionExecuted,
    Allocation,
    DecisionMade,
    FeedbackRecorded,
    FeedbackStats,
    Fingerprint,
    HeldOutFigures,
    Measured,
    ModelPublished,
    NodeLedger,
    Placement,
    PolicyRef,
    StatsGroup,
    StatsQuery,
    TaskFingerprinted,
    TaskLifecycle,
    TaskSubmitted,
    decode,
    encode,
    now,
)
from fleetpilot.runtime import partition_of
from fleetpilot.runtime.nats_bus import NatsBus


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


async def test_the_closing_report_sets_confidence_against_outcome_per_policy_and_action() -> None:
    report = Report(quiet=True)

    async def recorded(policy: str, action: str, confidence: float, outcome: str) -> None:
        event = FeedbackRecorded(action_id=f"a{len(report.judged)}{confidence}{outcome}", outcome=outcome,
                                 latency_ms=Measured(value=1.0, uncertainty_score=0.0), unexpected_side_effect=[],
                                 policy=PolicyRef(name=policy), confidence=confidence, action=action,
                                 recorded_at=0.0)
        await report.on_message(SimpleNamespace(subject="feedback.recorded", data=encode(event)))

    await recorded("fleetpilot", "assign", 0.9, "success")
    await recorded("fleetpilot", "assign", 0.7, "oom")
    await recorded("fleetpilot", "migrate", 0.6, "success")
    assert report.calibration() == ("fleetpilot assign 0.80 predicted, 0.50 met (n=2); "
                                    "fleetpilot migrate 0.60 predicted, 1.00 met (n=1)")
    assert "confidence vs outcome: fleetpilot assign" in report.render(1.0)


async def test_the_closing_report_sets_the_learned_confidences_apart() -> None:
    report = Report(quiet=True)
    for i, (published, own, outcome) in enumerate([(0.99, 0.94, "success"), (0.95, 0.94, "oom"),
                                                   (0.94, None, "success")]):
        made = DecisionMade(decision_id=f"t{i}.assign", task_id=f"t{i}", action="assign", confidence=published,
                            prior_confidence=own, policy=PolicyRef(name="fleetpilot"), decided_at=0.0)
        await report.on_message(SimpleNamespace(subject="decision.made", data=encode(made)))
        event = FeedbackRecorded(action_id=f"a{i}", decision_id=made.decision_id, outcome=outcome,
                                 latency_ms=Measured(value=1.0, uncertainty_score=0.0), unexpected_side_effect=[],
                                 policy=PolicyRef(name="fleetpilot"), confidence=published, action="assign",
                                 recorded_at=0.0)
        await report.on_message(SimpleNamespace(subject="feedback.recorded", data=encode(event)))
    assert report.calibration() == ("fleetpilot assign 0.96 predicted, 0.67 met (n=3); those given the learned "
                                    "model's confidence: 0.97 predicted, 0.50 met (n=2)")


async def test_a_decision_or_action_published_again_is_counted_once() -> None:
    """A retried handler re-publishes the same decision, which the stream drops as a
    duplicate but the report, a core subscriber, hears again."""
    report = Report(quiet=True)
    evict = DecisionMade(decision_id="be1.evict.1", task_id="be1", action="evict", confidence=0.97,
                         policy=PolicyRef(name="preempt"), reason="preempted for vip task v1", decided_at=0.0)
    executed = ActionExecuted(action_id="act-be1.evict.1", decision_id="be1.evict.1", task_id="be1",
                              action="evict", backend="sim", latency_ms=1.0, policy=PolicyRef(name="preempt"),
                              executed_at=0.0)
    for _ in range(3):
        await report.on_message(SimpleNamespace(subject="decision.made", data=encode(evict)))
        await report.on_message(SimpleNamespace(subject="action.executed", data=encode(executed)))
    assert dict(report.decisions) == {"evict": 1} and dict(report.actions) == {"executed": 1}


async def test_any_submitters_task_counts_towards_submit_to_assign_at_once_or_after_a_queue() -> None:
    report = Report(quiet=True)
    assert "submit-to-assign, placed at once: no task" in report.render(1.0)

    async def decide(task_id: str, action: str, at: float) -> None:
        made = DecisionMade(decision_id=f"{task_id}.{action}", task_id=task_id, action=action, confidence=0.9,
                            policy=PolicyRef(name="fleetpilot"), decided_at=at)
        await report.on_message(SimpleNamespace(subject="decision.made", data=encode(made)))

    for i, (submitted, decided) in enumerate([(10.0, 10.2), (20.0, 20.1), (30.0, 33.0), (40.0, 100.0)]):
        task = TaskSubmitted(task_id=f"t{i}", tenant="acme", kind="train", gpus=1, gpu_milli=1000,
                             submitted_at=submitted)
        await report.on_message(SimpleNamespace(subject="task.submitted", data=encode(task)))
        if i == 3:  # queued first, placed a minute later
            await decide(f"t{i}", "queue", submitted + 0.1)
        await decide(f"t{i}", "assign", decided)
    await report.on_message(SimpleNamespace(subject="task.submitted", data=b"{not json"))
    rendered = report.render(1.0)
    assert "submit-to-assign, placed at once: mean 1100 ms, median 200 ms, p95 3000 ms over 3 tasks" in rendered
    assert "submit-to-assign, after a queue: mean 60.0 s, longest 60.0 s over 1 tasks (0 still queued)" in rendered


async def test_the_tasks_still_queued_at_the_end_are_named_longest_waiting_first_with_why() -> None:
    report = Report(quiet=True)
    for i in range(8):
        task = TaskSubmitted(task_id=f"q{i}", tenant="acme", kind="train", gpus=1, gpu_milli=1000,
                             submitted_at=100.0 - i)
        await report.on_message(SimpleNamespace(subject="task.submitted", data=encode(task)))
        made = DecisionMade(decision_id=f"q{i}.queue", task_id=f"q{i}", action="queue", confidence=0.95,
                            policy=PolicyRef(name="fleetpilot"), decided_at=100.0,
                            reason=f"no node has room now (0 of 4 nodes: {i % 4 + 1} lack free GPUs); queued")
        await report.on_message(SimpleNamespace(subject="decision.made", data=encode(made)))
    placed = DecisionMade(decision_id="q7.assign", task_id="q7", action="assign", confidence=0.9,
                          policy=PolicyRef(name="fleetpilot"), decided_at=130.0)
    await report.on_message(SimpleNamespace(subject="decision.made", data=encode(placed)))
    lines = report.render(1.0).splitlines()
    at = lines.index("still queued at the end, longest waiting first, with why they were queued: 7")
    assert lines[at + 1:at + 7] == [
        "  q6: no node has room now (0 of 4 nodes: 3 lack free GPUs); queued",
        "  q5: no node has room now (0 of 4 nodes: 2 lack free GPUs); queued",
        "  q4: no node has room now (0 of 4 nodes: 1 lack free GPUs); queued",
        "  q3: no node has room now (0 of 4 nodes: 4 lack free GPUs); queued",
        "  q2: no node has room now (0 of 4 nodes: 3 lack free GPUs); queued",
        "  and 2 more",
    ]
    assert not any(line.startswith("still queued") for line in Report(quiet=True).render(1.0).splitlines())


@pytest.mark.parametrize("argv, fragment", [
    (["--demo", "-5"], "argument --demo: must be 0 or more, got -5"),
    (["--rate", "0"], "argument --rate: must be more than 0, got 0"),
    (["--fingerprinter-partitions", "0"], "argument --fingerprinter-partitions: must be at least 1, got 0"),
    (["--duration", "nan"], "argument --duration: not a finite number"),
    (["--speed", "-1"], "argument --speed: must be more than 0"),
    (["--metrics-port-base", "70000"], "argument --metrics-port-base: must be 0 (free ports) or a port"),
    (["--fleet", "no-such-fleet.yaml"], "argument --fleet: no such file: 'no-such-fleet.yaml'"),
])
def test_bad_numbers_are_refused_in_one_line_before_anything_starts(argv, fragment, capsys) -> None:
    # Before, a negative --demo or a zero --rate started the whole fleet and reported nothing.
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["up", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err


def test_a_wide_placement_says_how_many_gpus_it_does_not_show() -> None:
    wide = msgspec.structs.replace(decision("x", fallback=False), placement=[
        Placement(node="h100-01", gpu=g, milli=1000, memory_mb=70_000) for g in range(8)])
    assert _where(wide) == ("h100-01/gpu0:1000m, h100-01/gpu1:1000m, h100-01/gpu2:1000m (+5 more)")
    narrow = msgspec.structs.replace(wide, placement=wide.placement[:2])
    assert _where(narrow) == "h100-01/gpu0:1000m, h100-01/gpu1:1000m"


@pytest.mark.parametrize(("set_env", "node"), [
    ({"FLEETPILOT_COLLECTOR_SOURCE": "nvml", "FLEETPILOT_EXECUTOR_BACKEND": "process"}, socket.gethostname()),
    ({"FLEETPILOT_COLLECTOR_SOURCE": "nvml", "FLEETPILOT_EXECUTOR_BACKEND": "process",
      "FLEETPILOT_COLLECTOR_NODE_NAME": "gpu-7"}, "gpu-7"),
    ({"FLEETPILOT_COLLECTOR_SOURCE": "nvml", "FLEETPILOT_EXECUTOR_BACKEND": "process",
      "FLEETPILOT_EXECUTOR_NODE": "mine"}, "mine"),
    ({"FLEETPILOT_EXECUTOR_BACKEND": "process"}, None),  # the simulated fleet: every node
    ({"FLEETPILOT_COLLECTOR_SOURCE": "nvml"}, None),  # the sim backend: no process runs here
])
def test_up_on_one_gpu_machine_gives_its_executor_the_node(monkeypatch, tmp_path, set_env, node) -> None:
    for name in ("FLEETPILOT_COLLECTOR_SOURCE", "FLEETPILOT_EXECUTOR_BACKEND", "FLEETPILOT_COLLECTOR_NODE_NAME",
                 "FLEETPILOT_EXECUTOR_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in set_env.items():
        monkeypatch.setenv(name, value)
    args = SimpleNamespace(metrics_port_base=0, speed=1.0, fleet=None)
    env = ServiceProcesses(tmp_path, "nats://127.0.0.1:4222", args).env_for("executor")
    assert env.get("FLEETPILOT_EXECUTOR_NODE") == node


def test_up_without_a_fleet_file_runs_the_shipped_fleet() -> None:
    from fleetpilot.cli.main import build_parser

    # argparse passes a string default through the flag's type: "" once failed the file check.
    assert build_parser().parse_args(["up"]).fleet is None


@pytest.mark.parametrize(("name", "setting"), [("openb_node_list_gpu_node.csv", "OPENB_NODES"),
                                                ("fleet.yaml", "FLEET_SPEC"), ("topology.json", "FLEET_SPEC")])
def test_up_gives_the_fleet_file_to_the_collector_and_topology_as_what_it_is(monkeypatch, tmp_path, name, setting):
    for var in ("FLEETPILOT_COLLECTOR_OPENB_NODES", "FLEETPILOT_TOPOLOGY_OPENB_NODES",
                "FLEETPILOT_COLLECTOR_FLEET_SPEC", "FLEETPILOT_TOPOLOGY_FLEET_SPEC"):
        monkeypatch.delenv(var, raising=False)
    path = str(tmp_path / name)
    processes = ServiceProcesses(tmp_path, "nats://127.0.0.1:4222",
                                 SimpleNamespace(metrics_port_base=0, speed=1.0, fleet=path))
    for service in ("collector", "topology"):
        env = processes.env_for(service)
        chosen = {k: v for k, v in env.items() if k.endswith(("_OPENB_NODES", "_FLEET_SPEC"))}
        assert chosen == {f"FLEETPILOT_COLLECTOR_{setting}": path, f"FLEETPILOT_TOPOLOGY_{setting}": path}


def test_a_demo_the_process_backend_cannot_run_is_refused_in_one_line(monkeypatch, capsys, tmp_path) -> None:
    # Before, every demo task was placed, refused by the executor three times ("has no
    # command") and rejected: 90 failed actions for 30 tasks, and a report of failures.
    monkeypatch.setenv("FLEETPILOT_EXECUTOR_BACKEND", "process")
    code = cli_main(["up", "--demo", "30", "--duration", "5", "--state-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--demo tasks carry no command" in err and not (tmp_path / "nats").exists()


def test_up_runs_the_fingerprinter_as_one_process_per_partition(tmp_path) -> None:
    args = SimpleNamespace(metrics_port_base=9101, speed=1.0, fleet=None)
    whole = ServiceProcesses(tmp_path, "nats://127.0.0.1:4222", args)
    assert whole.names() == list(SERVICES)
    assert "FLEETPILOT_FINGERPRINTER_PARTITION" not in whole.env_for("fingerprinter")

    split = ServiceProcesses(tmp_path, "nats://127.0.0.1:4222", args, fingerprinter_partitions=2)
    names = split.names()
    assert [n for n in names if n.startswith("fingerprinter")] == ["fingerprinter-0", "fingerprinter-1"]
    envs = {name: split.env_for(name) for name in names}
    assert [(envs[n]["FLEETPILOT_FINGERPRINTER_PARTITION"], envs[n]["FLEETPILOT_FINGERPRINTER_PARTITIONS"])
            for n in ("fingerprinter-0", "fingerprinter-1")] == [("0", "2"), ("1", "2")]
    # Every process serves /metrics on a port of its own: the first partition on the
    # fingerprinter's, the next after the eight services'.
    ports = [envs[n][f"FLEETPILOT_{n.partition('-')[0].upper()}_METRICS_PORT"] for n in names]
    assert len(set(ports)) == len(names) == 9
    assert envs["fingerprinter-0"]["FLEETPILOT_FINGERPRINTER_METRICS_PORT"] == "9103"
    assert envs["fingerprinter-1"]["FLEETPILOT_FINGERPRINTER_METRICS_PORT"] == "9109"
    assert envs["learner"]["FLEETPILOT_LEARNER_METRICS_PORT"] == "9108"


async def test_the_closing_report_says_what_the_learner_published_and_how_its_last_model_did() -> None:
    report = Report(quiet=True)
    assert "learner: no model published (too few judged placements yet)" in report.render(1.0)
    for version, promoted, brier in ((1, False, 0.05), (2, True, 0.01)):
        figures = HeldOutFigures(examples=60 * version, held_out=15 * version, brier_model=brier, brier_prior=0.04,
                                 mean_predicted=0.97, mean_prior=0.93, observed=0.99)
        model = ModelPublished(name="outcome" if promoted else "outcome-candidate", version=version, figures=figures,
                               promoted=promoted, reason="r", published_at=0.0)
        await report.on_message(SimpleNamespace(subject="model.published", data=encode(model)))
    gone = msgspec.structs.replace(model, version=1, withdrawn=True, reason="no better than the policy")
    await report.on_message(SimpleNamespace(subject="model.published", data=encode(gone)))
    assert report.render(1.0).splitlines()[-1] == (
        "learner: 2 models published, 1 promoted, 1 withdrawn; the last (outcome v2) from 120 outcomes: held-out "
        "Brier 0.0100 against the policy's 0.0400 over 30, mean 0.97 predicted by it, 0.93 by the policy, 0.99 met")


async def test_the_closing_report_counts_fingerprints_by_source_and_task() -> None:
    report = Report(quiet=True)
    assert "fingerprints: none" in report.render(1.0)
    fp = Fingerprint(signature="sig-1", pattern="linear", pattern_confidence=0.9, growth_rate_mb_per_s=1.0,
                     predicted_peak_mb=30_000.0, peak_low_mb=28_000.0, peak_high_mb=32_000.0)
    for task_id, source in [("t1", "observed"), ("t1", "observed"), ("t2", "observed"), ("t3", "signature")]:
        event = TaskFingerprinted(task_id=task_id, fingerprint=fp, source=source, at=0.0)
        await report.on_message(SimpleNamespace(subject="task.fingerprinted", data=encode(event)))
    assert "fingerprints: 3 observed for 2 tasks, 1 signature for 1 tasks\n" in report.render(1.0)

    # Partitioned, the report says how many tasks each partition's replica fitted.
    split = Report(quiet=True, fingerprinter_partitions=2)
    for task_id in ("t1", "t2", "t3", "t4", "t5"):
        event = TaskFingerprinted(task_id=task_id, fingerprint=fp, source="observed", at=0.0)
        await split.on_message(SimpleNamespace(subject="task.fingerprinted", data=encode(event)))
    shares = [sum(partition_of(t, 2) == p for t in ("t1", "t2", "t3", "t4", "t5")) for p in (0, 1)]
    assert f"observed by partition: 0: {shares[0]}, 1: {shares[1]}" in split.render(1.0)


async def test_a_report_whose_queued_tasks_were_all_still_waiting_says_so() -> None:
    report = Report(quiet=True)
    task = TaskSubmitted(task_id="q1", tenant="acme", kind="train", gpus=1, gpu_milli=1000, submitted_at=1.0)
    await report.on_message(SimpleNamespace(subject="task.submitted", data=encode(task)))
    queued = DecisionMade(decision_id="q1.queue", task_id="q1", action="queue", confidence=0.9,
                          policy=PolicyRef(name="fleetpilot"), decided_at=1.1)
    await report.on_message(SimpleNamespace(subject="decision.made", data=encode(queued)))
    assert "submit-to-assign, after a queue: none placed yet (1 still queued)" in report.render(1.0)


@pytest.mark.parametrize(("simulated", "kept"), [(True, False), (False, True)])
def test_up_starts_a_simulated_fleet_on_an_empty_bus_and_a_real_one_on_what_it_kept(tmp_path, simulated, kept):
    # The last run's reservations and queue describe a simulated fleet that is gone: a second
    # `make run` placed none of its queued tasks behind them.
    old = tmp_path / "nats" / "jetstream" / "$G" / "streams" / "KV_ledger"
    old.mkdir(parents=True)
    learnt = [tmp_path / "learner.db", tmp_path / "learner.db-wal"]
    for path in learnt:
        path.write_bytes(b"outcomes of the last run")
    store = bus_store(tmp_path, simulated=simulated)
    assert store == tmp_path / "nats" and old.exists() == kept
    assert [path.exists() for path in learnt] == [kept, kept]


async def test_up_on_a_nats_of_the_user_s_own_says_what_an_earlier_run_left_there(nats_url) -> None:
    bus = await NatsBus.connect(nats_url, "test")
    try:
        await bus.ensure_topology()
        assert await earlier_run(bus) == ""
        held = [Allocation(task_id=f"t{i}", decision_id=f"t{i}.assign", gpu=i, milli=1000, memory_mb=8_000,
                           state="confirmed", at=now()) for i in range(3)]
        await (await bus.kv("ledger")).put("node-a", encode(NodeLedger(node="node-a", allocations=held)))
        await (await bus.kv("ledger")).put("node-b", encode(NodeLedger(node="node-b", allocations=[])))
        await (await bus.kv("pending")).put("q1", b"{}")
        assert await earlier_run(bus) == "3 reservations, 1 tasks waiting"
    finally:
        await bus.drain()


async def test_the_report_passes_over_what_does_not_decode_and_counts_on(capsys) -> None:
    # Anyone may publish on these subjects: before, each such message was logged with a
    # traceback on up's console, and lost to the report.
    report = Report(quiet=False)
    for subject in ("decision.made", "action.executed", "feedback.recorded", "task.fingerprinted", "task.rejected",
                    "sla.offer.t1", "model.published"):
        await report.on_message(SimpleNamespace(subject=subject, data=b"{not json"))
    other = TaskSubmitted(task_id="t1", tenant="acme", kind="train", gpus=1, gpu_milli=1000, submitted_at=0.0)
    await report.on_message(SimpleNamespace(subject="decision.made", data=encode(other)))
    await report.on_message(SimpleNamespace(subject="decision.made", data=encode(decision("x", fallback=False))))
    assert dict(report.decisions) == {"assign": 1}
    out = capsys.readouterr().out
    assert out.count("that does not decode") == 8 and "ignored a message on sla.offer.t1" in out


async def test_the_closing_report_gives_the_feedback_store_s_own_figures(nats_client, nats_url) -> None:
    """Before the services stop, the report asks the feedback service's endpoint for what its
    store holds, by policy and action, and prints it; records judged without their result
    have no latency, which it says rather than printing 0 ms."""
    asked = []

    async def answer(msg) -> None:
        asked.append(decode(msg.data, StatsQuery).by)
        groups = [
            StatsGroup(key={"policy": "fleetpilot@1", "action": "assign"}, count=40, successes=38, success_rate=0.95,
                       weighted_success_rate=0.96, measured=40, p95_latency_ms=12.4, expected_successes=37.6,
                       brier_score=0.041, mean_resource_saving_mb=30_720.0),
            StatsGroup(key={"policy": "fleetpilot@1", "action": ""}, count=3, successes=1, success_rate=1 / 3,
                       measured=0, p95_latency_ms=None, expected_successes=2.7, brier_score=0.3),
        ]
        await msg.respond(encode(FeedbackStats(groups=groups, at=now())))

    await nats_client.subscribe("feedback.stats", cb=answer)
    await nats_client.flush()
    bus = await NatsBus.connect(nats_url, "up")
    try:
        report = Report(quiet=True)
        report.store_stats = await store_stats(bus)
        lines = report.render(1.0).splitlines()
        await nats_client.close()  # nobody answers any more
        silent = await store_stats(bus, timeout_s=0.2)
    finally:
        await bus.drain()
    assert asked == [["policy", "action"]]
    start = lines.index("feedback store, every run it holds (feedback.stats, by policy and action; `fleetpilot feedback`):")
    assert lines[start + 1:start + 3] == [
        "  fleetpilot@1 assign: 40 records, success 0.95 (weighted 0.96), p95 latency 12 ms over 40 measured, "
        "37.6 successes expected, 38 met, Brier 0.041, 30.0 GB of GPU memory left free per record against whole GPUs",
        "  fleetpilot@1 (judged without its result): 3 records, success 0.33, no latency measured, "
        "2.7 successes expected, 1 met, Brier 0.300",
    ]
    assert silent is None
    report.store_stats = silent
    assert "feedback store: no answer from feedback.stats" in report.render(1.0).splitlines()


async def test_the_closing_report_tells_the_oom_kills_by_program_and_what_became_of_the_killed_tasks() -> None:
    report = Report(quiet=True)
    assert "OOM kills: none" in report.render(1.0)

    async def heard(subject: str, event) -> None:
        await report.on_message(SimpleNamespace(subject=subject, data=encode(event)))

    for task_id, program in [("t1", "feature-etl"), ("t2", "feature-etl"), ("t3", "feature-etl"), ("t4", "resnet")]:
        await heard("task.submitted", TaskSubmitted(task_id=task_id, kind="batch", gpus=1, submitted_at=0.0,
                                                    labels={"model": program}))
    lives = [("t1", "started", 1.0), ("t1", "oom_killed", 2.0), ("t1", "started", 3.0), ("t1", "finished", 4.0),
             ("t2", "started", 1.0), ("t2", "oom_killed", 2.0), ("t2", "started", 3.0), ("t2", "oom_killed", 4.0),
             ("t3", "started", 1.0), ("t3", "finished", 5.0), ("t4", "started", 1.0), ("t4", "finished", 2.0)]
    for task_id, state, at in lives + lives[:2]:  # the first two heard again (a redelivery): counted once
        await heard(f"task.lifecycle.{task_id}", TaskLifecycle(task_id=task_id, state=state, node="n0", gpus=[0],
                                                               at=at))
    text = report.render(1.0)
    assert "lifecycle: finished 3, oom_killed 3, started 6\n" in text
    assert "OOM kills: 3 (feature-etl: 2 of its 3 tasks, 1 of them finished on a later placement)" in text


def test_up_scales_the_policy_s_rebalance_period_by_the_simulated_fleet_s_speed(monkeypatch, tmp_path) -> None:
    from fleetpilot_services.policy.settings import PolicySettings

    assert PolicySettings.model_fields["rebalance_s"].default == POLICY_REBALANCE_S
    for name in ("FLEETPILOT_COLLECTOR_SOURCE", "FLEETPILOT_POLICY_REBALANCE_S"):
        monkeypatch.delenv(name, raising=False)
    processes = ServiceProcesses(tmp_path, "nats://127.0.0.1:4222", SimpleNamespace(metrics_port_base=0, speed=10.0,
                                                                                    fleet=None))
    assert processes.env_for("policy")["FLEETPILOT_POLICY_REBALANCE_S"] == "3"
    assert "FLEETPILOT_POLICY_REBALANCE_S" not in processes.env_for("executor")
    monkeypatch.setenv("FLEETPILOT_POLICY_REBALANCE_S", "7")  # the user's own is kept
    assert processes.env_for("policy")["FLEETPILOT_POLICY_REBALANCE_S"] == "7"
    monkeypatch.delenv("FLEETPILOT_POLICY_REBALANCE_S")
    monkeypatch.setenv("FLEETPILOT_COLLECTOR_SOURCE", "nvml")  # real GPUs run in real time
    assert "FLEETPILOT_POLICY_REBALANCE_S" not in processes.env_for("policy")


async def test_the_demo_waits_until_the_topology_names_the_whole_fleet(nats_server):
    # The policy rebuilds its view of the fleet at each new node: on the openb fleet, whose
    # 1,213 nodes are written over 14 s, the demo's first tasks waited seconds for a decision.
    from fleetpilot.cli.up import fleet_known
    from fleetpilot.runtime.nats_bus import NatsBus

    bus = await NatsBus.connect(nats_server.url, "test")
    try:
        await bus.ensure_topology()
        topology = await bus.kv("topology")
        for node in ("n1", "n2"):
            await topology.put(node, b"{}")
        assert await fleet_known(bus, 3, timeout_s=0.6) == 2  # waited its time out, named 2
        await topology.put("n3", b"{}")
        assert await fleet_known(bus, 3, timeout_s=30.0) == 3
        assert await fleet_known(bus, 5, timeout_s=30.0, given_up=lambda: True) == 0  # not asked at all
    finally:
        await bus.drain()

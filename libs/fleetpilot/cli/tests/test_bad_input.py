"""Bad arguments and bad input files: one line on stderr, exit code 2, never a traceback, and
nothing published or left behind first."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess

import msgspec
import pytest
from fleetpilot.cli.local import NATS_URL_FILE
from fleetpilot.cli.main import main
from fleetpilot.fleet.inventory import fleet_to_json, load_fleet_spec
from fleetpilot.policy import ClusterState, TaskRequest, record
from fleetpilot.runtime.embedded import free_port, nats_server_binary

UNREACHABLE = "nats://127.0.0.1:1"


def one_line_error(argv: list[str], capsys) -> str:
    """Run ``fleetpilot ARGV`` in-process; assert exit 2 with one stderr line; return it."""
    try:
        rc = main(argv)
    except SystemExit as exit_:  # the parser's refusals
        rc = exit_.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def nats_without_jetstream(tmp_path):
    """A NATS server that answers but has no JetStream (a plain ``nats-server``)."""
    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import socket  # noqa: PLC0415 - only this fixture waits on a socket
    import time  # noqa: PLC0415

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"nats://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(5)


def test_a_state_dir_that_is_a_file_is_one_line(tmp_path, capsys) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    for argv in (["token"], ["submit", "--kind", "infer", "--nats-url", UNREACHABLE]):
        line = one_line_error([*argv, "--state-dir", str(not_a_dir)], capsys)
        assert f"state directory {not_a_dir} is not a directory" in line


def test_a_key_ring_that_is_a_directory_or_broken_is_one_line_naming_it(tmp_path, capsys) -> None:
    (tmp_path / "a" / "keyring.json").mkdir(parents=True)
    assert "is a directory" in one_line_error(["token", "--state-dir", str(tmp_path / "a")], capsys)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keyring.json").write_text("{}")
    line = one_line_error(["token", "--state-dir", str(tmp_path / "b")], capsys)
    assert f"{tmp_path / 'b' / 'keyring.json'}: not a key ring document" in line


@pytest.mark.parametrize("timeout", ["0", "-5", "nan"])
def test_submit_refuses_a_timeout_before_publishing(timeout, tmp_path, capsys) -> None:
    line = one_line_error(["submit", "--kind", "infer", "--timeout", timeout, "--nats-url", UNREACHABLE,
                           "--state-dir", str(tmp_path)], capsys)
    assert "argument --timeout" in line


@pytest.mark.parametrize("task_id", ["a b", "a.b", "a.*", "x>", "*"])
def test_submit_refuses_a_task_id_that_is_not_one_subject_token(task_id, tmp_path, capsys) -> None:
    line = one_line_error(["submit", "--kind", "infer", "--task-id", task_id, "--nats-url", UNREACHABLE,
                           "--state-dir", str(tmp_path)], capsys)
    assert f"invalid task: task_id {task_id!r}" in line and "one subject token" in line


def test_submit_refuses_an_empty_task_id_from_a_file(tmp_path, capsys) -> None:
    task = tmp_path / "task.yaml"
    task.write_text('task_id: ""\nkind: infer\n')
    line = one_line_error(["submit", "-f", str(task), "--nats-url", UNREACHABLE, "--state-dir", str(tmp_path)],
                          capsys)
    assert "task_id '' is empty" in line


def test_submit_refuses_accepting_and_declining_at_once(capsys) -> None:
    line = one_line_error(["submit", "--kind", "infer", "--accept-offer", "--decline-offer"], capsys)
    assert "not allowed with argument --accept-offer" in line


@pytest.mark.parametrize("subject", ["", "a b", "a..b", ".a", "a.", "a.>.b", "a*", "task.life>"])
def test_watch_refuses_a_malformed_subject(subject, capsys) -> None:
    line = one_line_error(["watch", subject, "--nats-url", UNREACHABLE], capsys)
    assert f"not a NATS subject: {subject!r}" in line


def test_subjects_and_task_ids_that_nats_takes_are_taken() -> None:
    from fleetpilot.contracts.catalog import subject_problem, task_id_problem  # noqa: PLC0415

    for subject in ("decision.made", "task.lifecycle.>", "sla.offer.*", ">", "*.made", "dlq.task.>"):
        assert subject_problem(subject) is None, subject
    assert subject_problem("sla.offer.*", wildcards=False) == "has a wildcard (* or >)"
    assert task_id_problem("cli-1_x") is None
    assert task_id_problem("a.b") == "has a dot"


def test_watch_refuses_a_negative_count(capsys) -> None:
    assert "argument --count: must be 0 or more" in one_line_error(["watch", "--count", "-3"], capsys)


def test_topology_names_a_directory_once(tmp_path, capsys) -> None:
    assert one_line_error(["topology", str(tmp_path)], capsys) == f"fleetpilot topology: {tmp_path}: is a directory"


def test_fingerprint_help_says_the_columns_and_their_units(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["fingerprint", "--help"])
    assert "timestamp_s,used_bytes" in " ".join(capsys.readouterr().out.split())


def test_fleet_refuses_a_file_that_holds_no_node(tmp_path, capsys) -> None:
    not_a_spec = tmp_path / "task.yaml"
    not_a_spec.write_text("kind: infer\n")
    assert "not a valid fleet: no nodes" in one_line_error(["fleet", "--spec", str(not_a_spec)], capsys)
    header_only = tmp_path / "nodes.csv"
    header_only.write_text("sn,cpu_milli,memory_mib,gpu,model\n")
    assert "not a valid fleet: no nodes" in one_line_error(["fleet", "--openb", str(header_only)], capsys)


def test_fleet_keeps_the_reason_whole(tmp_path, capsys) -> None:
    a_list = tmp_path / "list.yaml"
    a_list.write_text("- 1\n")
    line = one_line_error(["fleet", "--spec", str(a_list)], capsys)
    assert line.endswith("not a valid fleet: a fleet spec is a mapping (sites, links), got list")
    no_shape = tmp_path / "no-shape.yaml"
    no_shape.write_text("sites:\n  - name: x\n    groups:\n      - {prefix: n-, count: 1}\n")
    line = one_line_error(["fleet", "--spec", str(no_shape)], capsys)
    assert line.endswith("not a valid fleet: malformed fleet spec: missing 'shape'")  # its quotes unstripped


def test_up_refuses_a_fleet_the_collector_would_simulate_empty(tmp_path, capsys) -> None:
    # topology.json parses as YAML but is not a spec: the collector built a fleet of no GPU
    # from it while the topology service showed every node.
    saved = tmp_path / "topology.json"
    saved.write_bytes(fleet_to_json(load_fleet_spec()))
    line = one_line_error(["up", "--fleet", str(saved), "--state-dir", str(tmp_path / "state")], capsys)
    assert "argument --fleet" in line and "no nodes" in line
    assert not (tmp_path / "state").exists()  # refused before anything started


def test_up_on_an_unreachable_bus_leaves_no_pointer_to_it(tmp_path, capsys) -> None:
    line = one_line_error(["up", "--nats-url", UNREACHABLE, "--state-dir", str(tmp_path), "--duration", "1",
                           "--metrics-port-base", "0"], capsys)
    assert "cannot connect to NATS" in line
    assert not (tmp_path / NATS_URL_FILE).exists()  # `submit` from here would go to a dead bus


def test_a_nats_without_jetstream_is_one_line(nats_without_jetstream, tmp_path, capsys) -> None:
    said = f"the NATS server at {nats_without_jetstream} has no JetStream"
    assert said in one_line_error(["model", "--nats-url", nats_without_jetstream], capsys)
    # Was a traceback (ServiceUnavailableError) and exit code 1.
    assert said in one_line_error(["dead-letters", "--nats-url", nats_without_jetstream], capsys)
    assert said in one_line_error(["up", "--nats-url", nats_without_jetstream, "--state-dir", str(tmp_path),
                                   "--duration", "1", "--metrics-port-base", "0"], capsys)
    assert not (tmp_path / NATS_URL_FILE).exists()
    # `fleet` still shows the spec, and says why there is nothing live.
    assert main(["fleet", "--nats-url", nats_without_jetstream]) == 0
    captured = capsys.readouterr()
    assert said in captured.err and len(captured.err.strip().splitlines()) == 1
    assert captured.out.startswith("fleet three-site")


def _states(tmp_path):
    state = ClusterState.build(names=["n0", "n1"], cpu_milli=[64000] * 2, memory_mb=[256000] * 2, gpus=[4] * 2,
                               models=["A100"] * 2, gpu_memory_mb=[40960] * 2)
    path = tmp_path / "states.jsonl"
    path.write_bytes(msgspec.json.encode(record(state, TaskRequest(task_id="t0", gpus=1, gpu_milli=500,
                                                                   gpu_memory_mb=8000))) + b"\n")
    return path


@pytest.mark.parametrize("source,why", [
    ('PROFILES = {"x": 5}', "TypeError"),
    # The service's own export (vetting.exported_profiles): before, the replay's own read a
    # ValidationError here where the service refused the module with this TypeError.
    ("def profile():\n    return 7\n", "TypeError: a profile must be a ProfileConfig or a dict, not int"),
    ("def profile():\n    raise RuntimeError('boom')\n", "RuntimeError: boom"),
])
def test_replay_names_a_module_whose_profiles_do_not_load(source, why, tmp_path, capsys) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "mine.py").write_text(source)
    line = one_line_error(["replay", "--states", str(_states(tmp_path)), "--policy", "x", "--against", "fgd",
                           "--plugin-dir", str(plugins)], capsys)
    assert f"{plugins / 'mine.py'}: not a policy profile ({why}" in line


def test_replay_refuses_a_negative_seed_naming_the_flag(tmp_path, capsys) -> None:
    line = one_line_error(["replay", "--states", str(_states(tmp_path)), "--policy", "fgd", "--against", "fgd",
                           "--seed", "-1"], capsys)
    assert "argument --seed: must be 0 or more" in line


def test_bench_without_a_suite_asks_only_for_the_suite(capsys) -> None:
    assert one_line_error(["bench"], capsys).endswith("the following arguments are required: suite")


async def test_end_of_input_at_the_offer_prompt_declines(monkeypatch) -> None:
    import argparse  # noqa: PLC0415
    import io  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from fleetpilot.cli.submit import answer_offer  # noqa: PLC0415
    from fleetpilot.contracts import OfferOption, SlaOffer, SlaRequest  # noqa: PLC0415

    read_end, write_end = os.pipe()
    os.close(write_end)  # Ctrl-D: the input ends
    with os.fdopen(read_end) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        monkeypatch.setattr(stdin, "isatty", lambda: True)
        offer = SlaOffer(offer_id="o", task_id="t", tenant="local", asked=SlaRequest(), reason="too slow",
                         options=[OfferOption(option_id="o1", why="wait")], valid_until=0.0, at=0.0)
        reply = await answer_offer(offer, argparse.Namespace(decline_offer=False, accept_offer=False), io.StringIO())
    assert reply.accept is False


async def test_ctrl_c_at_the_offer_prompt_ends_submit(nats_client, nats_url, tmp_path) -> None:
    # Before, input() held the event loop: the first Ctrl-C did nothing until Enter, and a
    # second ended submit with nats-py's traceback.
    import signal  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415

    from fleetpilot.contracts import OfferOption, SlaOffer, SlaRequest, TaskSubmitted, decode, encode  # noqa: PLC0415

    async def offer(msg) -> None:
        task = decode(msg.data, TaskSubmitted)
        await nats_client.publish(f"sla.offer.{task.task_id}", encode(SlaOffer(
            offer_id="o1", task_id=task.task_id, tenant="local", asked=SlaRequest(), reason="too slow",
            options=[OfferOption(option_id="o1", why="wait")], valid_until=time.time() + 60, at=time.time())))

    await nats_client.subscribe("task.submitted", cb=offer)
    await nats_client.flush()
    terminal, user_side = os.openpty()
    submit = subprocess.Popen([sys.executable, "-m", "fleetpilot.cli.main", "submit", "--kind", "infer",
                               "--nats-url", nats_url, "--state-dir", str(tmp_path), "--timeout", "60"],
                              stdin=user_side, stdout=user_side, stderr=user_side)
    os.close(user_side)
    os.set_blocking(terminal, False)
    shown = b""
    try:
        deadline = time.monotonic() + 30
        while b"accept which option" not in shown and submit.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            with contextlib.suppress(BlockingIOError):
                shown += os.read(terminal, 4096)
        assert b"accept which option" in shown, shown
        submit.send_signal(signal.SIGINT)  # Ctrl-C, once
        deadline = time.monotonic() + 20
        while submit.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            with contextlib.suppress(BlockingIOError, OSError):
                shown += os.read(terminal, 4096)
    finally:
        if submit.poll() is None:
            submit.kill()
        submit.wait()
        os.close(terminal)
    assert submit.returncode == 130 and b"Traceback" not in shown, shown


@pytest.mark.parametrize(("content", "said"), [
    ("kind: infer\nsla: 5\n", "task.yaml: sla must be a mapping of SLA fields (cost_ceiling_per_hour, deadline, "
                              "max_queue_s, p95_latency_ms, tier, warmup_ms), got int"),
    ("kind: infer\nsla: [1, 2]\n", "got list"),
    ("kind: infer\nsla: gold\n", "got str"),
])
def test_submit_refuses_an_sla_that_is_no_mapping(content, said, tmp_path, capsys) -> None:
    # Before: `sla: 5` stopped submit with a TypeError traceback, `sla: gold` with "dictionary
    # update sequence element #0 has length 1; 2 is required".
    task = tmp_path / "task.yaml"
    task.write_text(content)
    line = one_line_error(["submit", "-f", str(task), "--nats-url", UNREACHABLE, "--state-dir", str(tmp_path)],
                          capsys)
    assert said in line


@pytest.mark.parametrize(("content", "said"), [
    ("kind: train\ngpu_memroy_mb: 40000\n", "unknown field 'gpu_memroy_mb' (did you mean 'gpu_memory_mb'?)"),
    ("kind: train\nsla: {tier: vip, max_queue: 60}\n", "unknown field 'sla.max_queue' (did you mean 'sla.max_queue_s'?)"),
    ("kind: train\nzzz: 1\n", "unknown field 'zzz'"),
])
def test_submit_refuses_a_field_the_task_has_not(content, said, tmp_path, capsys) -> None:
    # Before, a misspelt field was dropped without a word: the task went out asking for no GPU
    # memory, or with no bound on its queueing.
    task = tmp_path / "task.yaml"
    task.write_text(content)
    line = one_line_error(["submit", "-f", str(task), "--nats-url", UNREACHABLE, "--state-dir", str(tmp_path)],
                          capsys)
    assert line == f"fleetpilot submit: {task}: {said}"


def test_submit_takes_a_task_saved_from_the_bus(tmp_path) -> None:
    import argparse  # noqa: PLC0415

    from fleetpilot.cli.submit import build_task  # noqa: PLC0415
    from fleetpilot.contracts import SlaRequest, TaskSubmitted, encode  # noqa: PLC0415

    saved = tmp_path / "task.json"
    saved.write_bytes(encode(TaskSubmitted(task_id="t1", kind="train", gpu_memory_mb=40_000,
                                           sla=SlaRequest(tier="vip", max_queue_s=60.0))))
    flags = {name: None for name in ("kind", "gpus", "gpu_milli", "gpu_memory_mb", "cpu_milli", "memory_mb", "size_gb",
                                     "expected_duration_s", "command", "gpu_models", "tier", "max_queue_s",
                                     "warmup_ms", "p95_latency_ms", "task_id", "resumable")}
    task = build_task(argparse.Namespace(file=str(saved), **flags))
    assert (task.task_id, task.gpu_memory_mb, task.sla.tier, task.sla.max_queue_s) == ("t1", 40_000, "vip", 60.0)


@pytest.mark.parametrize(("content", "flags", "resumable"), [
    ("kind: train\n", [], True),
    ("kind: train\n", ["--not-resumable"], False),
    ("kind: train\nresumable: false\n", [], False),
])
def test_submit_says_whether_the_task_resumes(content, flags, resumable, tmp_path) -> None:
    """Left out, a task resumes (the contract's default); the flag or the file says it does not."""
    from fleetpilot.cli.main import build_parser  # noqa: PLC0415
    from fleetpilot.cli.submit import build_task  # noqa: PLC0415

    task_file = tmp_path / "task.yaml"
    task_file.write_text(content)
    assert build_task(build_parser().parse_args(["submit", "-f", str(task_file), *flags])).resumable is resumable


def test_submit_names_a_task_file_that_is_not_text(tmp_path, capsys) -> None:
    task = tmp_path / "task.yaml"
    task.write_bytes(b"\xff\xfe\x00kind")
    line = one_line_error(["submit", "-f", str(task), "--nats-url", UNREACHABLE, "--state-dir", str(tmp_path)],
                          capsys)
    assert line == f"fleetpilot submit: {task}: not a text file"  # was the codec's error, naming no file


async def test_submit_waits_on_past_an_answer_that_does_not_decode(nats_client, nats_url, tmp_path) -> None:
    # Anyone may publish on decision.made and task.rejected: before, the first message there that
    # did not decode as a decision ended submit with exit 2 while its task went on being decided.
    import argparse  # noqa: PLC0415
    import io  # noqa: PLC0415

    from fleetpilot.cli.submit import submit  # noqa: PLC0415
    from fleetpilot.contracts import DecisionMade, PolicyRef, TaskSubmitted, encode  # noqa: PLC0415

    async def decide(msg) -> None:
        await nats_client.publish("task.rejected", b"{not json")
        await nats_client.publish("decision.made", b'{"type": "decision.made.v9", "task_id": "t1"}')
        await nats_client.publish("decision.made", encode(DecisionMade(
            decision_id="t1.assign", task_id="t1", action="assign", confidence=0.9,
            policy=PolicyRef(name="fleetpilot"), decided_at=0.0)))

    await nats_client.subscribe("task.submitted", cb=decide)
    await nats_client.flush()
    args = argparse.Namespace(token="a-token", tenant="local", state_dir=str(tmp_path), nats_url=nats_url,
                              timeout=20.0, accept_offer=False, decline_offer=False)
    out = io.StringIO()
    assert await submit(TaskSubmitted(task_id="t1", kind="infer"), args, out) == 0
    assert '"action": "assign"' in out.getvalue()


def test_help_says_what_the_flags_really_do(capsys) -> None:
    # `up --quiet` said "only the report" and printed where NATS and the services ran; `submit
    # --token` said its default was the local key when $FLEETPILOT_TOKEN, if set, was.
    for argv in (["up", "--help"], ["submit", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
    shown = " ".join(capsys.readouterr().out.split())
    assert "only the report" not in shown
    assert "--quiet no live lines: only where NATS and the services run, their stop, and the report" in shown
    assert "(default: $FLEETPILOT_STATE_DIR, else .fleetpilot)" in shown
    assert "--token TOKEN bearer JWT (default: $FLEETPILOT_TOKEN, else one for --tenant from the local key)" in shown


@pytest.mark.parametrize("url", ["nats://127.0.0.1:99999", "nats://[::1"])
@pytest.mark.parametrize("argv", [["watch", "--count", "1"], ["dead-letters"], ["submit", "--kind", "infer"],
                                  ["up", "--duration", "1", "--metrics-port-base", "0"]])
def test_a_nats_url_that_does_not_parse_is_one_line(argv, url, tmp_path, capsys) -> None:
    # Was nats-py's traceback ("nats: invalid connect url option") and exit code 1: the URL is
    # parsed inside nats.connect, before any connection is tried.
    line = one_line_error([*argv, "--nats-url", url, "--state-dir", str(tmp_path)], capsys)
    assert f"cannot connect to NATS at {url}: nats: invalid connect url option" in line
    assert not (tmp_path / NATS_URL_FILE).exists()


@pytest.mark.parametrize(("name", "content"), [
    ("task.json", '{"labels": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("task.yaml", "labels: " + "[" * 100_000 + "]" * 100_000 + "\n"),
])
def test_submit_refuses_a_task_file_nested_too_deep(name, content, tmp_path, capsys) -> None:
    # Was a RecursionError traceback from the JSON or YAML parser.
    task = tmp_path / name
    task.write_text(content)
    line = one_line_error(["submit", "-f", str(task), "--nats-url", UNREACHABLE, "--state-dir", str(tmp_path)],
                          capsys)
    assert line.startswith(f"fleetpilot submit: {task}: not valid ") and "nested too deep" in line


@pytest.mark.parametrize("argv", [["watch", "--count", "1"], ["dead-letters"], ["model"], ["fleet", "forget", "n1"],
                                  ["submit", "--kind", "infer"]])
def test_a_nats_user_that_cannot_name_an_inbox_is_one_line(argv, tmp_path, capsys) -> None:
    # A connection that names a user takes its answers on `_INBOX_<user>`, the only inbox that
    # user may read: a user with a dot in it names no such inbox, said before any connection.
    url = "nats://ops.team:s3cret@127.0.0.1:1"
    line = one_line_error([*argv, "--nats-url", url, "--state-dir", str(tmp_path)], capsys)
    assert ("cannot connect to NATS at nats://ops.team:***@127.0.0.1:1: NATS user 'ops.team' cannot name "
            "an inbox: a user name must be one subject token") in line, line
    assert "s3cret" not in line

"""An empty argument (``-f "$TASK"`` with the variable unset) is refused in one line naming the
flag: it read as the flag left out, and the command went on with the default instead (the
shipped fleet, the default bus or state directory, a new task id, a task with no file)."""

from __future__ import annotations

import pytest

from .test_bad_input import UNREACHABLE, one_line_error


@pytest.fixture(autouse=True)
def no_default_bus_or_state(tmp_path, monkeypatch):
    """A flag taken for absent falls back to these, never to the machine's own bus (:4222) or
    the working directory's state."""
    monkeypatch.setenv("FLEETPILOT_NATS_URL", UNREACHABLE)
    monkeypatch.setenv("FLEETPILOT_STATE_DIR", str(tmp_path / "default-state"))
    monkeypatch.delenv("FLEETPILOT_TOKEN", raising=False)


@pytest.mark.parametrize("argv, flag", [
    (["submit", "--kind", "infer", "-f", ""], "--file/-f"),
    (["fleet", "--spec", ""], "--spec"),
    (["fleet", "--openb", ""], "--openb"),
    (["fingerprint", ""], "series"),
    (["topology", ""], "file"),
    (["replay", "--states", "", "--policy", "fgd", "--against", "fgd"], "--states"),
    (["replay", "--states", "x.jsonl", "--policy", "fgd", "--against", "fgd", "--plugin-dir", ""], "--plugin-dir"),
    (["token", "--state-dir", ""], "--state-dir"),
    (["submit", "--kind", "infer", "--state-dir", ""], "--state-dir"),
])
def test_an_empty_path_is_refused_naming_the_flag(argv, flag, capsys) -> None:
    line = one_line_error(argv, capsys)
    assert f"argument {flag}: an empty path" in line


@pytest.mark.parametrize("argv", [
    ["submit", "--kind", "infer"],
    ["watch", "--count", "1"],
    ["dead-letters"],
    ["model"],
    ["fleet"],
    ["fleet", "forget", "n1"],
])
def test_an_empty_nats_url_is_refused_not_taken_for_the_default_bus(argv, capsys) -> None:
    assert "argument --nats-url: an empty URL" in one_line_error([*argv, "--nats-url", ""], capsys)


def test_submit_refuses_an_empty_task_id_flag_as_it_does_one_in_a_file(tmp_path, capsys) -> None:
    line = one_line_error(["submit", "--kind", "infer", "--task-id", "", "--state-dir", str(tmp_path)], capsys)
    assert "task_id '' is empty" in line


@pytest.mark.parametrize("models", ["", ",,", " , "])
def test_submit_refuses_gpu_models_that_name_no_model(models, tmp_path, capsys) -> None:
    # ",," replaced the file's models with none (any GPU); "" kept the file's without a word.
    line = one_line_error(["submit", "--kind", "infer", "--gpu-models", models, "--state-dir", str(tmp_path)], capsys)
    assert "argument --gpu-models: names no GPU model" in line


def test_submit_gpu_models_flag_still_replaces_the_files(tmp_path) -> None:
    import argparse  # noqa: PLC0415

    from fleetpilot.cli.main import build_parser  # noqa: PLC0415
    from fleetpilot.cli.submit import build_task  # noqa: PLC0415

    task_file = tmp_path / "task.yaml"
    task_file.write_text("kind: infer\ngpu_models: [V100]\n")
    args = build_parser().parse_args(["submit", "-f", str(task_file), "--gpu-models", " A100, H100 ,"])
    assert isinstance(args, argparse.Namespace)
    assert build_task(args).gpu_models == ["A100", "H100"]


@pytest.mark.parametrize("flag, message", [
    ("--nats-url", "argument --nats-url: an empty URL"),
    ("--state-dir", "argument --state-dir: an empty path"),
])
def test_up_refuses_an_empty_bus_or_state_directory(flag, message, capsys) -> None:
    """Checked on the parser alone: taken for the flag left out, ``up`` went on to start a
    NATS server and the eight services of its own (or ran from the default state directory)."""
    from fleetpilot.cli.main import build_parser  # noqa: PLC0415

    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", flag, ""])
    assert message in capsys.readouterr().err


def test_up_reads_an_empty_environment_url_as_unset(monkeypatch) -> None:
    """``FLEETPILOT_NATS_URL=`` is no bus named, as every other command reads it: ``up``
    starts its own NATS rather than refusing a flag that was never given."""
    from fleetpilot.cli.main import build_parser  # noqa: PLC0415

    monkeypatch.setenv("FLEETPILOT_NATS_URL", "")
    assert build_parser().parse_args(["up"]).nats_url is None

"""``fleetpilot replay`` over a recorded file and ``fleetpilot bench`` forwarding."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest
from fleetpilot.cli.main import main
from fleetpilot.cli.replay_cmd import read_snapshots
from fleetpilot.policy import ClusterState, TaskRequest, record


def recorded(tmp_path, n: int = 12):
    """A JSONL record as the policy service writes it: a half-used fleet, small tasks."""
    state = ClusterState.build(
        names=[f"n{i}" for i in range(6)],
        cpu_milli=[64000] * 6,
        memory_mb=[256000] * 6,
        gpus=[4] * 6,
        models=["A100"] * 3 + ["H100"] * 3,
        gpu_memory_mb=[40960] * 6,
    )
    state.allocate(0, [0, 1], 1000)
    state.allocate(2, [3], 600)
    state.allocate(4, [1], 300)
    path = tmp_path / "states.jsonl"
    with path.open("wb") as fh:
        for i in range(n):
            task = TaskRequest(task_id=f"t{i}", gpus=1, gpu_milli=(250, 500, 1000)[i % 3], gpu_memory_mb=8000)
            fh.write(msgspec.json.encode(record(state, task)) + b"\n")
    return path


def test_replay_reports_differences_and_effects_as_json(tmp_path, capsys):
    path = recorded(tmp_path)
    assert (
        main(["replay", "--states", str(path), "--policy", "bestfit", "--against", "k8s-default", "--json"])
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["total"] == 12 and data["policy"] == "bestfit" and data["against"] == "k8s-default"
    # bestfit shares GPUs, the device plugin takes whole ones: every fractional task differs.
    assert data["differing"] >= 8 and sum(data["by_kind"].values()) == 12
    assert data["differing"] == len(data["differences"])
    assert data["mean_frag_delta"] != 0.0
    assert {"task_id", "kind", "a", "b", "frag_delta", "oom_delta"} <= set(data["differences"][0])


def test_replay_of_a_policy_against_itself_differs_nowhere(tmp_path, capsys):
    path = recorded(tmp_path, 6)
    assert main(["replay", "--states", str(path), "--policy", "fgd", "--against", "fgd"]) == 0
    out = capsys.readouterr().out
    assert "6 snapshot(s): 0 decision(s) differ" in out
    assert "+0.00 on average" in out


def test_replay_compares_two_versions_of_a_module_policy(tmp_path, capsys):
    path = recorded(tmp_path, 6)
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir()
    v2.mkdir()
    body = 'PROFILES = {{"mine": {{"filters": [{{"name": "node-resources"}}], "scores": [{{"name": "{s}"}}]}}}}\n'
    (v1 / "mine.py").write_text(body.format(s="packing"))
    (v2 / "mine.py").write_text(body.format(s="least-allocated"))
    assert (
        main(
            [
                "replay",
                "--states",
                str(path),
                "--policy",
                "mine",
                "--against",
                "mine",
                "--plugin-dir",
                str(v1),
                "--against-plugin-dir",
                str(v2),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "between mine (A) and mine (B's modules)" in out
    assert "0 decision(s) differ" not in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policy", "nope", "--against", "fgd"], "unknown policy 'nope'"),
        (["--policy", "fgd", "--against", "fgd", "--plugin-dir", "/no/such/dir"], "not a directory"),
    ],
)
def test_replay_errors_are_one_line(tmp_path, capsys, argv, message):
    path = recorded(tmp_path, 2)
    assert main(["replay", "--states", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_replay_names_a_bad_line(tmp_path, capsys):
    path = recorded(tmp_path, 2)
    with path.open("ab") as fh:
        fh.write(b'{"not": "a snapshot"}\n')
    assert main(["replay", "--states", str(path), "--policy", "fgd", "--against", "bestfit"]) == 2
    assert "states.jsonl:3: not a recorded snapshot" in capsys.readouterr().err


def rotate(path, *sizes):
    """Split a record as the policy service's rotation leaves it: the first ``sizes[0]`` lines
    in the oldest rotated file (``path.<len(sizes)>``), ..., the rest in ``path``."""
    lines = path.read_bytes().splitlines(keepends=True)
    start = 0
    for n, size in zip(range(len(sizes), 0, -1), sizes, strict=True):
        path.with_name(f"{path.name}.{n}").write_bytes(b"".join(lines[start:start + size]))
        start += size
    path.write_bytes(b"".join(lines[start:]))


def test_replay_reads_the_rotated_files_oldest_first(tmp_path, capsys):
    # The policy service rotates its record at FLEETPILOT_POLICY_RECORD_MAX_MB: FILE.1 holds
    # the lines before FILE's, FILE.2 those before. Before, only FILE was read: right after a
    # rotation, a replay saw a handful of snapshots.
    path = recorded(tmp_path, 12)
    rotate(path, 4, 4)
    (tmp_path / "states.jsonl.bak").write_bytes(b"not a rotation: never read\n")
    assert [s.task.task_id for s in read_snapshots(path)] == [f"t{i}" for i in range(12)]
    assert main(["replay", "--states", str(path), "--policy", "bestfit", "--against", "k8s-default", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total"] == 12
    assert data["files"] == [str(path) + ".2", str(path) + ".1", str(path)]
    assert main(["replay", "--states", str(path), "--policy", "fgd", "--against", "fgd"]) == 0
    assert "of 3 files, oldest first" in capsys.readouterr().out
    # --no-rotated: FILE alone, as before.
    assert main(["replay", "--states", str(path), "--policy", "fgd", "--against", "fgd", "--no-rotated", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["total"], data["files"]) == (4, [str(path)])


def test_replay_reads_past_a_gap_in_the_rotated_files(tmp_path):
    # A rotation cut short (the process killed between two renames) leaves .1 and .3: both
    # are still read, .3 first.
    path = recorded(tmp_path, 6)
    rotate(path, 2, 1, 1)
    path.with_name("states.jsonl.2").unlink()
    assert [s.task.task_id for s in read_snapshots(path)] == ["t0", "t1", "t3", "t4", "t5"]


def test_replay_names_a_bad_line_of_a_rotated_file(tmp_path, capsys):
    path = recorded(tmp_path, 6)
    rotate(path, 3)
    with path.with_name("states.jsonl.1").open("ab") as fh:
        fh.write(b'{"not": "a snapshot"}\n')
    assert main(["replay", "--states", str(path), "--policy", "fgd", "--against", "bestfit"]) == 2
    err = capsys.readouterr().err
    assert "states.jsonl.1:4: not a recorded snapshot" in err and err.count("\n") == 1


def _mutated(arrays=None, task=None, node_names=None):
    def change(doc):
        doc["state"]["arrays"].update(arrays or {})
        doc["task"].update(task or {})
        if node_names is not None:
            doc["state"]["node_names"] = node_names
            for name in doc["state"]["arrays"]:
                doc["state"]["arrays"][name] = []
    return change


@pytest.mark.parametrize(("change", "message"), [
    (_mutated(arrays={"node_model": [5] * 6}), "array 'node_model' points past its 2 models"),
    (_mutated(arrays={"gpu_rule": [[9] * 4] * 6}), "array 'gpu_rule' points past its 1 rule_sets"),
    (_mutated(task={"gpu_milli": 10**30}), "task gpu_milli 10000000000000000000000000000"),
    (_mutated(task={"gpus": -1}), "task gpus -1 is out of range"),
    (_mutated(node_names=[]), "its state has no nodes"),
    (_mutated(arrays={"cpu_total": [1]}), "array 'cpu_total' has shape (1,), expected (6,)"),
    (lambda doc: doc["state"]["arrays"].pop("gpu_free"), "lacks the array 'gpu_free'"),
])
def test_replay_refuses_a_snapshot_that_does_not_hold_together_in_one_line(tmp_path, capsys, change, message):
    # Valid JSON of the right shape, but an index past its list, a task count past int64 or
    # a missing array: each was a traceback from inside numpy (IndexError, OverflowError,
    # KeyError), or a decision on nonsense with exit 0 (a task of -1 GPUs).
    path = recorded(tmp_path, 2)
    lines = path.read_bytes().splitlines()
    doc = json.loads(lines[1])
    change(doc)
    path.write_bytes(lines[0] + b"\n" + json.dumps(doc).encode() + b"\n")
    assert main(["replay", "--states", str(path), "--policy", "fgd", "--against", "fleetpilot"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "states.jsonl:2: not a recorded snapshot" in err and message in err, err


def test_replay_takes_a_record_of_a_fleet_with_a_node_of_no_gpu_model(tmp_path, capsys):
    # A node with no GPU model (none of its GPUs names one: fallen off the bus, or it has
    # none) is recorded with model -1, which the policies take. Replay refused the record,
    # exit 2, as "not a recorded snapshot (its state's node_model indexes past its 1 entries)".
    state = ClusterState.build(names=["n0", "n1", "cpu-only"], cpu_milli=[64000] * 3, memory_mb=[256000] * 3,
                               gpus=[4, 4, 0], models=["A100", "A100", ""], gpu_memory_mb=[40960, 40960, 0])
    assert state.node_model.tolist() == [0, 0, -1]
    path = tmp_path / "states.jsonl"
    task = TaskRequest(task_id="t0", gpus=1, gpu_milli=500, gpu_memory_mb=8000)
    path.write_bytes(msgspec.json.encode(record(state, task)) + b"\n")
    assert main(["replay", "--states", str(path), "--policy", "fgd", "--against", "fleetpilot", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == 1


def test_bench_forwards_everything_after_the_suite(monkeypatch):
    seen = []

    class Suite:
        @staticmethod
        def main(argv):
            seen.append(argv)
            return 0

    monkeypatch.setitem(sys.modules, "fleetpilot.bench.openb", Suite)
    assert main(["bench", "openb", "--policy", "fgd", "--seeds", "42-43", "--json", "out.json"]) == 0
    assert seen == [["--policy", "fgd", "--seeds", "42-43", "--json", "out.json"]]


def test_bench_openb_reaches_the_real_suite(tmp_path, capsys):
    # The real module parses the forwarded flags: its own one-line error proves it got them.
    rc = main(["bench", "openb", "--nodes", str(tmp_path / "n.csv"), "--pods", str(tmp_path / "p.csv"),
               "--policy", "nope"])
    assert rc == 2 and "unknown policy 'nope'" in capsys.readouterr().err


def test_bench_fleet_without_the_module_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fleetpilot.bench.fleet", None)  # import fails as if absent
    rc = main(["bench", "fleet", "--anything"])
    err = capsys.readouterr().err
    if rc == 0:  # pragma: no cover - only if None in sys.modules stops being an import failure
        pytest.fail("bench fleet ran without its module")
    assert rc == 2 and "fleet suite is not available" in err and err.count("\n") == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "fleet", "--seed", "x"], "fleet bench: argument --seed: invalid int value: 'x'"),
    (["bench", "openb", "--seeds", "zz"], "openb: bad --seeds 'zz' (use e.g. 42-51 or 42,43)"),
])
def test_a_suite_refusing_its_arguments_exits_2_with_its_one_line(capsys, argv, message):
    # Before, the suite's SystemExit(message) left the command with code 1.
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err == message + "\n"


# --- policy modules vetted as the policy service vets them ----------------------------------

PROFILE = 'PROFILES = {"mine": {"filters": [{"name": "node-resources"}], "scores": [{"name": "packing"}]}}\n'


def _replay_with_modules(tmp_path, module: str, *extra: str, timeout_s: float = 60.0):
    """``fleetpilot replay`` in a process of its own over a directory holding ``module``
    (``mine.py``) and a good module: a module that ends its interpreter ends that process,
    not the test's. Old code that hangs is stopped at ``timeout_s`` (``TimeoutExpired``)."""
    path = recorded(tmp_path, 2)
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "good.py").write_text(PROFILE)
    (plugins / "mine.py").write_text(module)
    argv = [sys.executable, "-m", "fleetpilot.cli.main", "replay", "--states", str(path), "--policy", "mine",
            "--against", "fgd", "--plugin-dir", str(plugins), *extra]
    return plugins, subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.mark.timeout(120)
def test_replay_refuses_a_module_that_hangs_at_import_in_one_line(tmp_path):
    # Before: the replay imported it in its own process and never returned.
    plugins, done = _replay_with_modules(tmp_path, "while True:\n    pass\n", "--import-timeout", "3")
    assert done.returncode == 2, done
    assert done.stderr == (f"fleetpilot replay: {plugins / 'mine.py'}: cannot load "
                           "(did not finish importing within 3 s (stopped))\n"), done.stderr


@pytest.mark.timeout(120)
def test_replay_refuses_a_module_that_ends_its_interpreter_in_one_line(tmp_path):
    # Before: exit code 3 and not a word on stderr (the replay's own interpreter ended).
    plugins, done = _replay_with_modules(tmp_path, "import os\nos._exit(3)\n")
    assert done.returncode == 2, done
    assert done.stderr.startswith(f"fleetpilot replay: {plugins / 'mine.py'}: cannot load (its interpreter exited "
                                  "with status 3 before it finished importing")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_replay_loads_a_module_that_imports_its_sibling_as_the_service_names_it(tmp_path, capsys):
    # The policy service runs a directory's modules as fleetpilot_policy_plugin_<stem>: a module
    # may import another by that name. Before, the replay named them otherwise, and refused it.
    path = recorded(tmp_path, 4)
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "a_user.py").write_text(
        "import fleetpilot_policy_plugin_z_shared as shared\n"
        'PROFILES = {"mine": {"filters": [{"name": "node-resources"}], "scores": [{"name": shared.SCORE}]}}\n')
    (plugins / "z_shared.py").write_text('SCORE = "packing"\n')
    assert main(["replay", "--states", str(path), "--policy", "mine", "--against", "packing",
                 "--plugin-dir", str(plugins), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["differing"] == 0


# A module of each version registers a plugin of one name: v1 prefers the first node, v2 the last.
NAMED_PLUGIN = """
from fleetpilot.policy import register
from fleetpilot.policy.framework import ScorePlugin

@register
class Pick(ScorePlugin):
    name = "pick-by-row"
    def score(self, cycle):
        return cycle.rows * {sign}1.0

PROFILES = {{"mine": {{"filters": [{{"name": "node-resources"}}], "scores": [{{"name": "pick-by-row"}}],
                      "select": {{"name": "first"}}}}}}
"""


def test_replay_builds_each_version_of_a_plugin_from_its_own_directory(tmp_path, capsys):
    # Before: both directories' modules were loaded before either policy was built, so A was
    # built of B's plugin of the same name, and the two versions never differed.
    path = recorded(tmp_path, 6)
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir()
    v2.mkdir()
    (v1 / "mine.py").write_text(NAMED_PLUGIN.format(sign="-"))
    (v2 / "mine.py").write_text(NAMED_PLUGIN.format(sign="+"))
    assert main(["replay", "--states", str(path), "--policy", "mine", "--against", "mine", "--plugin-dir", str(v1),
                 "--against-plugin-dir", str(v2), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["differing"] == 6 and data["by_kind"].get("node") == 6, data

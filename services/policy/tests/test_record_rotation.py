"""The replay record (``state_dir/policy-states.jsonl``) is bounded: at
``FLEETPILOT_POLICY_RECORD_MAX_MB`` it is rotated to ``.1`` (``.1`` to ``.2``..., the oldest
past ``RECORD_KEEP`` dropped), under the lock every replica appends under. Before, it grew
until the disk was full. ``fleetpilot replay`` reads the rotated files, oldest first."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest
from fleetpilot.cli.replay_cmd import read_snapshots
from fleetpilot.policy import ClusterState, TaskRequest, record

from .conftest import policy_state

MIB = 1024 * 1024
RECORD = "policy-states.jsonl"


def fleet() -> ClusterState:
    """One small node: a record of a few hundred bytes."""
    return ClusterState.build(names=["n0"], cpu_milli=[64000], memory_mb=[256000], gpus=[2], models=["A100"],
                              gpu_memory_mb=[40960])


def request(task_id: str) -> TaskRequest:
    """A task to record; ids of one width give lines of one length."""
    return TaskRequest(task_id=task_id, gpus=1, gpu_milli=100)


def line_bytes(task_id: str) -> int:
    """The length of one recorded line (with its newline)."""
    return len(msgspec.json.encode(record(fleet(), request(task_id)))) + 1


def task_ids(path: Path) -> list[str]:
    """The task of every line of one file; a line that is not whole fails to decode."""
    return [json.loads(line)["task"]["task_id"] for line in path.read_bytes().splitlines()]


def rotated(state_dir: Path) -> list[str]:
    """The rotated files in ``state_dir``, by name."""
    return sorted(p.name for p in state_dir.iterdir() if p.name.startswith(RECORD + "."))


@pytest.mark.parametrize("keep", [0, 2])
def test_the_record_is_rotated_before_it_passes_its_bound_and_the_oldest_file_dropped(tmp_path, keep):
    """Room for four lines a file: 30 records leave the last two in the file, the four before
    in ``.1``, the four before those in ``.2``; nothing older (with ``keep`` 0, only the file)."""
    bound = 4.5 * line_bytes("r000")
    ps = policy_state(tmp_path, record_every=1, record_max_mb=bound / MIB, record_keep=keep)
    ids = [f"r{i:03d}" for i in range(30)]
    for task_id in ids:
        ps.record_input(fleet(), request(task_id))
    path = tmp_path / RECORD
    assert path.stat().st_size <= bound, f"{path.stat().st_size} bytes, bound {bound:.0f}"
    assert task_ids(path) == ["r028", "r029"]
    chunks = [ids[i:i + 4] for i in range(0, 28, 4)]  # the full files, oldest first
    assert rotated(tmp_path) == [f"{RECORD}.{n}" for n in range(1, keep + 1)]
    for n in range(1, keep + 1):
        assert task_ids(tmp_path / f"{RECORD}.{n}") == chunks[-n]
    # What `fleetpilot replay --states policy-states.jsonl` reads: every file kept, oldest first.
    kept = [task_id for chunk in chunks[len(chunks) - keep:] for task_id in chunk] + ["r028", "r029"]
    assert [s.task.task_id for s in read_snapshots(path)] == kept


def test_a_record_larger_than_the_bound_takes_a_file_of_its_own(tmp_path):
    """A bound below one record rotates at every record; none is split or refused."""
    ps = policy_state(tmp_path, record_every=1, record_max_mb=100 / MIB, record_keep=3)
    for i in range(5):
        ps.record_input(fleet(), request(f"r{i:03d}"))
    assert task_ids(tmp_path / RECORD) == ["r004"]
    assert [task_ids(tmp_path / f"{RECORD}.{n}") for n in (1, 2, 3)] == [["r003"], ["r002"], ["r001"]]
    assert rotated(tmp_path) == [f"{RECORD}.{n}" for n in (1, 2, 3)]


def test_a_file_left_past_a_smaller_keep_is_dropped_at_the_next_rotation(tmp_path):
    """``RECORD_KEEP`` lowered from 5 to 1: the next rotation leaves ``.1`` only, not ``.2``
    to ``.5`` of the earlier setting for ever."""
    for n in range(2, 6):
        (tmp_path / f"{RECORD}.{n}").write_bytes(msgspec.json.encode(record(fleet(), request(f"o{n:03d}"))) + b"\n")
    ps = policy_state(tmp_path, record_every=1, record_max_mb=1.5 * line_bytes("r000") / MIB, record_keep=1)
    for i in range(3):
        ps.record_input(fleet(), request(f"r{i:03d}"))
    assert rotated(tmp_path) == [f"{RECORD}.1"]
    assert (task_ids(tmp_path / f"{RECORD}.1"), task_ids(tmp_path / RECORD)) == (["r001"], ["r002"])


WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from fleetpilot.ledger.store import FleetView, LedgerStore
    from fleetpilot.policy import ClusterState, TaskRequest
    from fleetpilot_services.policy.metrics import PolicyMetrics
    from fleetpilot_services.policy.policy_set import ActivePolicies, PolicyConfig
    from fleetpilot_services.policy.service import PolicyState
    from fleetpilot_services.policy.settings import PolicySettings
    from prometheus_client import CollectorRegistry

    state_dir, writer, count, max_mb, keep = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    settings = PolicySettings(nats_url="nats://unused", metrics_port=-1, replica=writer, state_dir=str(state_dir),
                              record_every=1, record_max_mb=max_mb, record_keep=keep)
    ps = PolicyState(FleetView(None), LedgerStore(None), settings, ActivePolicies(PolicyConfig(profile="bestfit")),
                     PolicyMetrics(CollectorRegistry()))
    fleet = ClusterState.build(names=["n0"], cpu_milli=[64000], memory_mb=[256000], gpus=[2], models=["A100"],
                               gpu_memory_mb=[40960])
    (state_dir.parent / f"ready-{writer}").touch()
    while not (state_dir.parent / "go").exists():
        time.sleep(0.001)
    for i in range(count):
        ps.record_input(fleet, TaskRequest(task_id=f"{writer}-{i:03d}", gpus=1, gpu_milli=100))
    """
)


def test_writers_racing_around_rotations_lose_no_line_and_duplicate_none(tmp_path):
    """Three replica processes append 200 records each to one state directory, rotating every
    fourth line. Every line is kept whole in exactly one file, each rotated file is full (one
    rotation per full file: two writers never both rotate), none passes the bound, and each
    writer's lines read back in the order written."""
    writers, count = ("w0", "w1", "w2"), 200
    bound = 4.5 * line_bytes("w0-000")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(state_dir), w, str(count), repr(bound / MIB), "1000"])
        for w in writers
    ]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready-{w}").exists() for w in writers):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "writers did not start"
            time.sleep(0.01)
        (tmp_path / "go").touch()
        assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    files = rotated(state_dir)
    numbers = sorted(int(name.rsplit(".", 1)[1]) for name in files)
    assert numbers == list(range(1, len(numbers) + 1))
    oldest_first = [state_dir / f"{RECORD}.{n}" for n in reversed(numbers)] + [state_dir / RECORD]
    lines = [task_id for path in oldest_first for task_id in task_ids(path)]
    assert sorted(lines) == sorted(f"{w}-{i:03d}" for w in writers for i in range(count))  # none lost, none twice
    for path in oldest_first:
        assert path.stat().st_size <= bound, f"{path.name}: {path.stat().st_size} bytes, bound {bound:.0f}"
    assert [len(task_ids(p)) for p in oldest_first[:-1]] == [4] * len(numbers)
    for w in writers:
        assert [i for i in lines if i.startswith(w)] == [f"{w}-{i:03d}" for i in range(count)]
    assert [s.task.task_id for s in read_snapshots(state_dir / RECORD)] == lines


TORN = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    from fleetpilot.ledger.store import FleetView, LedgerStore
    from fleetpilot.policy import ClusterState, TaskRequest
    from fleetpilot_services.policy.metrics import PolicyMetrics
    from fleetpilot_services.policy.policy_set import ActivePolicies, PolicyConfig
    from fleetpilot_services.policy.service import PolicyState
    from fleetpilot_services.policy.settings import PolicySettings
    from prometheus_client import CollectorRegistry

    state_dir, limit = Path(sys.argv[1]), int(sys.argv[2])
    settings = PolicySettings(nats_url="nats://unused", metrics_port=-1, replica="a", state_dir=str(state_dir),
                              record_every=1)
    ps = PolicyState(FleetView(None), LedgerStore(None), settings, ActivePolicies(PolicyConfig(profile="bestfit")),
                     PolicyMetrics(CollectorRegistry()))
    fleet = ClusterState.build(names=["n0"], cpu_milli=[64000], memory_mb=[256000], gpus=[2], models=["A100"],
                               gpu_memory_mb=[40960])
    def put(task_id):
        ps.record_input(fleet, TaskRequest(task_id=task_id, gpus=1, gpu_milli=100))
    put("r000")
    put("r001")
    # The disk fills mid-record: the third line is cut where the file may grow no further.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    put("r002")
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    put("r003")
    """
)


def test_a_record_cut_short_by_a_full_disk_leaves_no_partial_line(tmp_path):
    """A write that fails part way (the disk full, here the file-size limit) is taken back.
    Before, the cut line stayed, the next record was glued to it, and `fleetpilot replay`
    refused the whole file at that line."""
    limit = int(2.5 * line_bytes("r000"))
    done = subprocess.run([sys.executable, "-c", TORN, str(tmp_path), str(limit)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "cannot record a state for replay" in done.stderr
    assert task_ids(tmp_path / RECORD) == ["r000", "r001", "r003"]

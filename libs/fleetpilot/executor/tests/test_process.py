"""ProcessBackend with real OS processes: start, finish, evict with grace, migrate, OOM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fleetpilot.contracts import Placement, TaskLifecycle
from fleetpilot.executor import BackendError, ProcessBackend, classify_exit
from fleetpilot.executor.process import child_env, oom_kill_counter

PY = sys.executable
GPU0 = [Placement(node="n1", gpu=0, milli=1000)]


def py(code: str) -> list[str]:
    return [PY, "-c", code]


async def wait_for_state(backend: ProcessBackend, task_id: str, timeout: float = 10.0) -> list[TaskLifecycle]:
    """Poll until the task leaves the backend; return all its events."""
    events: list[TaskLifecycle] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events += [e for e in await backend.poll() if e.task_id == task_id]
        if events and events[-1].state not in ("started", "migrated", "resized"):
            return events
        await asyncio.sleep(0.02)
    raise AssertionError(f"no end state for {task_id}: {events}")


async def wait_for_file(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text()
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} never written")


@pytest.mark.parametrize(
    ("code", "state", "exit_code"),
    [
        ("pass", "finished", 0),
        ("import sys; sys.exit(3)", "failed", 3),
        (
            "import sys; print('CUDA out of memory. Tried to allocate 2 GiB', file=sys.stderr); sys.exit(1)",
            "oom_killed",
            1,
        ),
    ],
)
async def test_exit_is_reported(code: str, state: str, exit_code: int) -> None:
    backend = ProcessBackend(node="n1")
    handle = await backend.start("t", GPU0, py(code), {})
    assert handle.pid and handle.gpus == [0]
    events = await wait_for_state(backend, "t")
    assert [e.state for e in events] == ["started", state]
    assert events[-1].exit_code == exit_code
    assert backend.running() == []


async def test_environment_gpus_and_samples(tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    backend = ProcessBackend(node="n1")
    placement = [Placement(node="n1", gpu=3, milli=500), Placement(node="n1", gpu=1, milli=500)]
    code = (
        "import os, time, pathlib; e = os.environ; "
        f"pathlib.Path({str(out)!r}).write_text(e['CUDA_VISIBLE_DEVICES'] + ' ' + e['FLEETPILOT_TASK_ID'] + ' '"
        " + e.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '-') + ' ' + e['MINE'] + '\\n'); time.sleep(30)"
    )
    await backend.start("t", placement, py(code), {"MINE": "x"})
    assert (await wait_for_file(out)).split() == ["1,3", "t", "50", "x"]
    [sample] = backend.samples()
    assert sample.task_id == "t" and sample.rss_mb > 1
    with pytest.raises(BackendError):
        await backend.start("t", placement, py("pass"), {})
    await backend.stop("t", grace_s=2)


async def test_evict_cooperative_process_is_quick() -> None:
    backend = ProcessBackend()
    await backend.start("t", GPU0, py("import time; time.sleep(60)"), {})
    # A process that exits at SIGTERM ends the stop then, not when a long grace is over. The
    # grace is far longer than the bound, so a loaded machine cannot make a right stop late.
    await asyncio.wait_for(backend.stop("t", grace_s=60), timeout=20)
    events = await wait_for_state(backend, "t")
    assert events[-1].state == "evicted" and events[-1].exit_code == -signal.SIGTERM


async def test_process_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    backend = ProcessBackend()
    code = (
        "import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(ready)!r}).write_text('ok\\n'); time.sleep(60)"
    )
    await backend.start("stubborn", GPU0, py(code), {})
    await wait_for_file(ready)
    began = time.monotonic()
    # The grace is waited out; then SIGKILL ends the stop, long before the 60 s sleep would.
    await asyncio.wait_for(backend.stop("stubborn", grace_s=0.5), timeout=20)
    assert time.monotonic() - began >= 0.5
    events = await wait_for_state(backend, "stubborn")
    assert events[-1].state == "evicted" and events[-1].exit_code == -signal.SIGKILL
    await backend.stop("stubborn", grace_s=1)  # stopping a stopped task is a no-op


async def test_migrate_checkpoints_and_restarts_on_target(tmp_path: Path) -> None:
    ready, checkpoint, restored = tmp_path / "ready", tmp_path / "ckpt", tmp_path / "restored"
    backend = ProcessBackend(checkpoint_s=5)
    first = await backend.start("m", GPU0, checkpointing(ready, checkpoint, restored), {})
    await wait_for_file(ready)
    target = [Placement(node="n1", gpu=5, milli=1000)]
    second = await backend.migrate("m", target)
    assert second.pid != first.pid and second.node == "n1" and second.gpus == [5]
    assert (await wait_for_file(restored)).strip() == "step=42 gpus=5"
    events = [e for e in await backend.poll() if e.task_id == "m"]
    assert [e.state for e in events] == ["started", "migrated"]  # the old exit is not a "finished"
    assert events[-1].node == "n1" and events[-1].gpus == [5]
    assert backend.running() == ["m"]
    await backend.stop("m", grace_s=2)
    assert (await wait_for_state(backend, "m"))[-1].state == "evicted"


async def test_memory_limit_makes_a_leak_an_oom() -> None:
    backend = ProcessBackend(limit_address_space=True, headroom_mb=256)
    grant = [Placement(node="n1", gpu=0, milli=1000, memory_mb=128)]
    await backend.start("leak", grant, py("b = bytearray(2 * 1024**3)"), {})
    events = await wait_for_state(backend, "leak")
    assert events[-1].state == "oom_killed" and "MemoryError" in events[-1].detail
    # the same task without a cap allocates fine (proves the cap caused the failure)
    free = ProcessBackend()
    await free.start("ok", grant, py("b = bytearray(64 * 1024**2)"), {})
    assert (await wait_for_state(free, "ok"))[-1].state == "finished"


async def test_resize_caps_memory_live(tmp_path: Path) -> None:
    go = tmp_path / "go"
    backend = ProcessBackend(limit_address_space=True, headroom_mb=256)
    code = (
        "import time, pathlib\n"
        f"go = pathlib.Path({str(go)!r})\n"
        "while not go.exists(): time.sleep(0.02)\n"
        "b = bytearray(1024**3)\n"
    )
    await backend.start("r", [Placement(node="n1", gpu=0, milli=1000, memory_mb=4096)], py(code), {})
    await backend.resize("r", milli=500, memory_mb=64)
    go.write_text("go")
    events = await wait_for_state(backend, "r")
    assert [e.state for e in events] == ["started", "resized", "oom_killed"]


@pytest.mark.parametrize(
    ("code", "stderr", "reason", "expected"),
    [
        (0, "", None, "finished"),
        (1, "Traceback...\nValueError: x", None, "failed"),
        (1, "torch.OutOfMemoryError: CUDA out of memory", None, "oom_killed"),
        (137, "", None, "oom_killed"),
        (-9, "", None, "oom_killed"),
        (-9, "", "evicted", "evicted"),
        (-15, "MemoryError", "evicted", "evicted"),
        (0, "", "migrated", "migrated"),
        # A task that caught an OOM, retried with a smaller batch and succeeded finished.
        (0, "CUDA out of memory, retrying with batch size 16", None, "finished"),
        # JAX / XLA, TensorFlow and the CUDA driver API word it their own way.
        (1, "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to "
            "allocate 17179869184 bytes.", None, "oom_killed"),
        (1, "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor "
            "with shape[8192,8192]", None, "oom_killed"),
        (1, "numba.cuda.cudadrv.driver.CudaAPIError: [2] Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY",
         None, "oom_killed"),
    ],
)
def test_classify_exit(code: int, stderr: str, reason: str | None, expected: str) -> None:
    assert classify_exit(code, stderr, reason)[0] == expected  # type: ignore[arg-type]


def fake_cgroup(root: Path, oom_kill: int) -> Path:
    """A cgroup tree under ``root`` whose OOM-kill counter (that of the cgroup this test, and
    so the tasks it starts, runs in: ``memory.events`` under v2, ``memory.oom_control`` under
    v1) counts ``oom_kill`` kills; the file, to move the count."""
    try:
        counter = oom_kill_counter(root, Path("/proc/self/cgroup").read_text())
    except ValueError as error:
        pytest.skip(f"this process has no cgroup to count its OOM kills: {error}")
    counter.parent.mkdir(parents=True, exist_ok=True)
    counter.write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}\n"
                       if counter.name == "memory.oom_control" else
                       f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {oom_kill}\noom_group_kill 0\n")
    return counter


@pytest.mark.parametrize(
    ("proc_cgroup", "counter"),
    [
        # cgroup v2 alone (a unified host, a container with a cgroup namespace).
        ("0::/system.slice/fleetpilot-executor.service\n",
         "system.slice/fleetpilot-executor.service/memory.events"),
        # cgroup v1: the memory controller has its own hierarchy.
        ("12:pids:/docker/abc\n4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n",
         "memory/docker/abc/memory.oom_control"),
        # hybrid: a v2 line without the memory controller, which v1 holds.
        ("4:memory:/process_api/x\n1:name=systemd:/\n0::/\n", "memory/process_api/x/memory.oom_control"),
    ],
)
def test_the_oom_kill_counter_is_read_where_the_memory_controller_is(proc_cgroup: str, counter: str) -> None:
    assert oom_kill_counter(Path("/cg"), proc_cgroup) == Path("/cg") / counter


@pytest.mark.parametrize("proc_cgroup", ["3:cpu:/a\n1:name=systemd:/a\n", "not a cgroup file", ""])
def test_a_process_without_a_memory_controller_has_no_oom_kill_counter(proc_cgroup: str) -> None:
    with pytest.raises(ValueError):
        oom_kill_counter(Path("/cg"), proc_cgroup)


async def killed_by_the_test(
    backend: ProcessBackend, then: Callable[[], None] = lambda: None
) -> TaskLifecycle:
    """Start a task that sleeps, run ``then``, SIGKILL the task from here (an operator's
    ``kill -9``, the OOM killer): its end."""
    handle = await backend.start("k", GPU0, py("import time; time.sleep(60)"), {})
    then()
    os.kill(handle.pid, signal.SIGKILL)
    events = await wait_for_state(backend, "k")
    assert [e.state for e in events][:1] == ["started"] and len(events) == 2
    assert events[-1].exit_code == -signal.SIGKILL
    return events[-1]


async def test_a_sigkill_that_is_not_the_oom_killer_s_is_a_failure_not_an_oom(tmp_path: Path) -> None:
    fake_cgroup(tmp_path, oom_kill=2)
    end = await killed_by_the_test(ProcessBackend(node="n1", cgroup_root=tmp_path))
    # A false OOM taught the task's signature an OOM floor above what it needs.
    assert end.state == "failed"
    assert "not an OOM" in end.detail and "oom_kill" in end.detail


async def test_a_sigkill_counted_by_the_cgroup_s_oom_kill_is_an_oom(tmp_path: Path) -> None:
    events = fake_cgroup(tmp_path, oom_kill=2)
    def oom_kill() -> None:
        events.write_text(events.read_text().replace("oom_kill 2", "oom_kill 3"))

    end = await killed_by_the_test(ProcessBackend(node="n1", cgroup_root=tmp_path), oom_kill)
    assert end.state == "oom_killed" and "oom_kill count moved" in end.detail


async def test_a_sigkill_whose_cgroup_cannot_be_read_is_taken_for_an_oom_and_says_so(tmp_path: Path) -> None:
    # cgroup v1, a container without the file, no permission: today's reading, told as a guess.
    end = await killed_by_the_test(ProcessBackend(node="n1", cgroup_root=tmp_path / "none"))
    assert end.state == "oom_killed" and "could not be told" in end.detail


@contextlib.contextmanager
def memory_limited_cgroup(limit_mb: int) -> Iterator[Callable[[], contextlib.AbstractContextManager[None]]]:
    """A real cgroup v1 memory cgroup below this process's own, limited to ``limit_mb``; what
    it gives, ``inside()``, puts this process in it for a ``with`` block, so that what starts
    there (a task) is born in it and stays when this process goes back. Skips where this
    process may not make one (not root, no v1 memory controller, a read-only tree)."""
    root = Path("/sys/fs/cgroup")
    try:
        counter = oom_kill_counter(root, Path("/proc/self/cgroup").read_text())
    except ValueError as error:
        pytest.skip(f"no memory cgroup: {error}")
    if counter.name != "memory.oom_control":
        pytest.skip("the memory controller is on cgroup v2 here")
    home = counter.parent
    cgroup = home / f"fleetpilot-test-{os.getpid()}"
    try:
        cgroup.mkdir()
        (cgroup / "memory.limit_in_bytes").write_text(str(limit_mb << 20))
    except OSError as error:
        with contextlib.suppress(OSError):
            cgroup.rmdir()
        pytest.skip(f"cannot make a memory cgroup here: {error}")

    @contextlib.contextmanager
    def inside() -> Iterator[None]:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield
        finally:
            (home / "cgroup.procs").write_text(str(os.getpid()))

    try:
        yield inside
    finally:
        for pid in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while True:
            try:
                cgroup.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


# Allocates until its cgroup's limit stops it, the first process the OOM killer picks.
MEMORY_HOG = ("open('/proc/self/oom_score_adj', 'w').write('1000')\n"
              "held = []\n"
              "while True:\n    held.append(b'x' * (8 << 20))")


async def test_the_kernel_s_oom_kill_and_an_operator_s_kill_9_are_told_apart_on_a_real_cgroup() -> None:
    backend = ProcessBackend(node="n1")
    with memory_limited_cgroup(128) as inside:
        with inside():
            await backend.start("hog", GPU0, py(MEMORY_HOG), {})
        hog = (await wait_for_state(backend, "hog"))[-1]
        assert hog.state == "oom_killed" and hog.exit_code == -signal.SIGKILL
        assert "OOM killer" in hog.detail and "oom_kill count moved" in hog.detail
        # In the same cgroup, killed by hand: the count moved before this task started, not since.
        with inside():
            sleeper = await backend.start("sleeper", GPU0, py("import time; time.sleep(60)"), {})
        os.kill(sleeper.pid, signal.SIGKILL)
        killed = (await wait_for_state(backend, "sleeper"))[-1]
        assert killed.state == "failed" and "not an OOM" in killed.detail


async def test_migration_whose_restart_fails_reports_the_task_lost(tmp_path: Path) -> None:
    script = tmp_path / "job"
    script.write_text(f"#!{PY}\nimport time\ntime.sleep(60)\n")
    script.chmod(0o755)
    backend = ProcessBackend(checkpoint_s=0.1)
    await backend.start("gone", GPU0, [str(script)], {})
    script.unlink()  # the binary disappears from the node: the restart cannot happen
    with pytest.raises(BackendError):
        await backend.migrate("gone", [Placement(node="n1", gpu=1, milli=1000)], grace_s=1)
    assert [e.state for e in await backend.poll()] == ["started", "failed"]
    assert backend.running() == []


async def test_a_move_to_another_node_is_refused_and_the_task_runs_on(tmp_path: Path) -> None:
    # The process restarts on this machine: to "move" it to n2 would run it here, on this
    # node's GPU 5, under the other node's name.
    backend = ProcessBackend(checkpoint_s=0.1)
    first = await backend.start("m", GPU0, py("import time; time.sleep(60)"), {})
    with pytest.raises(BackendError, match="within its node only, not to n2"):
        await backend.migrate("m", [Placement(node="n2", gpu=5, milli=1000)], grace_s=1)
    assert backend.running() == ["m"] and [e.state for e in await backend.poll()] == ["started"]
    assert [s.pid for s in backend.samples()] == [first.pid]
    await backend.stop("m", grace_s=1)


async def test_a_backend_of_one_node_refuses_a_task_placed_on_another() -> None:
    backend = ProcessBackend(node="n1")
    with pytest.raises(BackendError, match="placed on n2, and this backend runs on n1"):
        await backend.start("elsewhere", [Placement(node="n2", gpu=0, milli=1000)], py("pass"), {})
    assert backend.running() == []
    await backend.start("here", GPU0, py("pass"), {})
    assert [e.state for e in await wait_for_state(backend, "here")] == ["started", "finished"]


def checkpointing(ready: Path, checkpoint: Path, restored: Path) -> list[str]:
    """A task that saves ``step=42`` on SIGUSR1 and, restored, writes what it read and its GPUs."""
    return py(
        "import os, signal, sys, time, pathlib\n"
        f"ready, ckpt, restored = pathlib.Path({str(ready)!r}), pathlib.Path({str(checkpoint)!r}), pathlib.Path({str(restored)!r})\n"
        "if os.environ.get('FLEETPILOT_RESTORE') == '1':\n"
        "    restored.write_text(ckpt.read_text().strip() + ' gpus=' + os.environ['CUDA_VISIBLE_DEVICES'] + '\\n')\n"
        "def save(*_):\n"
        "    ckpt.write_text('step=42\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGUSR1, save)\n"
        "ready.write_text('ok\\n')\n"
        "time.sleep(60)\n"
    )


def two_nodes() -> dict[str, ProcessBackend]:
    """The backends of n1 and n2, each taking tasks over from the other directly (the
    executor service does it over the bus)."""
    backends: dict[str, ProcessBackend] = {}

    async def take_over(node: str, task_id: str, grace_s: float, resumes: bool) -> tuple[list[str], dict[str, str]]:
        return await backends[node].hand_over(task_id, grace_s, resumes=resumes)

    for node in ("n1", "n2"):
        backends[node] = ProcessBackend(node=node, checkpoint_s=5, take_over=take_over)
    return backends


async def test_a_task_moves_between_nodes_from_its_checkpoint(tmp_path: Path) -> None:
    ready, checkpoint, restored = tmp_path / "ready", tmp_path / "ckpt", tmp_path / "restored"
    nodes = two_nodes()
    first = await nodes["n1"].start("m", GPU0, checkpointing(ready, checkpoint, restored), {"STEP_EVERY": "9"})
    await wait_for_file(ready)
    target = [Placement(node="n2", gpu=1, milli=1000)]
    second = await nodes["n2"].migrate("m", target, source=GPU0, grace_s=2)
    assert second.pid != first.pid and (second.node, second.gpus) == ("n2", [1])
    assert (await wait_for_file(restored)).strip() == "step=42 gpus=1"
    # The source's process is gone and reports nothing more (no "finished", no "evicted").
    assert nodes["n1"].running() == [] and [e.state for e in await nodes["n1"].poll()] == ["started"]
    moved = await nodes["n2"].poll()
    assert [(e.state, e.node, e.gpus) for e in moved] == [("migrated", "n2", [1])]
    # A hand-over asked again (its answer lost on the way) gives the same command and env.
    command, env = await nodes["n1"].hand_over("m", grace_s=1)
    assert command == checkpointing(ready, checkpoint, restored) and env == {"STEP_EVERY": "9"}
    await nodes["n2"].stop("m", grace_s=2)
    assert (await wait_for_state(nodes["n2"], "m"))[-1].state == "evicted"


def noting_starts(log: Path) -> list[str]:
    """A task that notes in ``log`` each start (and whether it was told to restore) and the
    checkpoint signal, on which it exits."""
    return py(
        "import os, signal, sys, time, pathlib\n"
        f"log = pathlib.Path({str(log)!r})\n"
        "def note(line):\n"
        "    with log.open('a') as f: f.write(line + '\\n')\n"
        "def save(*_):\n"
        "    note('checkpoint'); sys.exit(0)\n"
        "signal.signal(signal.SIGUSR1, save)\n"
        "note('start restore=' + os.environ.get('FLEETPILOT_RESTORE', ''))\n"
        "time.sleep(60)\n"
    )


async def wait_for_lines(path: Path, count: int, timeout: float = 10.0) -> list[str]:
    """The lines of ``path`` once it has at least ``count``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return lines
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} never had {count} lines")


@pytest.mark.parametrize(("resumes", "to_node"), [(True, "n1"), (False, "n1"), (False, "n2")])
async def test_a_task_that_cannot_resume_moves_without_the_checkpoint_signal_and_starts_over(
    tmp_path: Path, resumes: bool, to_node: str
) -> None:
    log = tmp_path / "log"
    nodes = two_nodes()
    await nodes["n1"].start("m", GPU0, noting_starts(log), {})
    await wait_for_lines(log, 1)
    backend = nodes[to_node]
    await backend.migrate("m", [Placement(node=to_node, gpu=1, milli=1000)], source=GPU0, grace_s=2, resumes=resumes)
    lines = await wait_for_lines(log, 3 if resumes else 2)
    assert lines == (["start restore=", "checkpoint", "start restore=1"] if resumes
                     else ["start restore=", "start restore="])
    [moved] = [e for e in await backend.poll() if e.state == "migrated"]
    assert ("started over" in moved.detail) is not resumes
    await backend.stop("m", grace_s=2)
    assert (await wait_for_state(backend, "m"))[-1].state == "evicted"


async def test_a_take_over_of_a_task_not_running_at_its_source_starts_nothing() -> None:
    nodes = two_nodes()
    with pytest.raises(BackendError, match="not running on n1"):
        await nodes["n2"].migrate("ghost", [Placement(node="n2", gpu=0, milli=1000)], source=GPU0)
    assert nodes["n2"].running() == [] and await nodes["n2"].poll() == []


async def test_a_take_over_whose_restart_fails_reports_the_task_lost_at_its_source(tmp_path: Path) -> None:
    script = tmp_path / "job"
    script.write_text(f"#!{PY}\nimport time\ntime.sleep(60)\n")
    script.chmod(0o755)
    nodes = two_nodes()
    await nodes["n1"].start("gone", GPU0, [str(script)], {})
    script.unlink()  # not on the target's disk
    with pytest.raises(BackendError, match="cannot start gone"):
        await nodes["n2"].migrate("gone", [Placement(node="n2", gpu=0, milli=1000)], source=GPU0, grace_s=1)
    # Its end is reported where it held capacity, so that the source's hold is released.
    assert [(e.state, e.node) for e in await nodes["n2"].poll()] == [("failed", "n1")]
    assert nodes["n1"].running() == [] and nodes["n2"].running() == []


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie not reaped yet counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def until_gone(pid: int, within_s: float = 5.0) -> None:
    """Wait up to ``within_s`` for ``pid`` to exit (``gone``); the caller asserts it did."""
    deadline = time.monotonic() + within_s
    while not gone(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def test_a_backend_stops_what_a_dead_one_left_behind(tmp_path: Path) -> None:
    registry = tmp_path / "processes.json"
    first = ProcessBackend(node="n1", registry=registry)
    left = await first.start("left", GPU0, py("import time; time.sleep(60)"), {})
    await first.start("done", [Placement(node="n1", gpu=1, milli=1000)], py("pass"), {})
    await wait_for_state(first, "done")
    assert set(json.loads(registry.read_text())) == {"left"}  # a task that ended leaves the registry
    # The first backend dies without stopping its task; the next one on the node stops it.
    second = ProcessBackend(node="n1", registry=registry)
    assert await second.stop_left_behind(grace_s=1.0) == {"left": True}
    await until_gone(left.pid)
    assert gone(left.pid)
    assert json.loads(registry.read_text()) == {}
    # A pid the kernel has given to another process since (another start time) is left alone.
    registry.write_text(json.dumps({"ghost": [os.getpid(), 1]}))
    assert await second.stop_left_behind(grace_s=0.1) == {"ghost": False}
    assert not gone(os.getpid())


def spawning(pid_file: Path, *, own_session: bool = False, then: str = "pass") -> list[str]:
    """A task that starts a child sleeping 60 s (it inherits the task's stderr), writes the
    child's pid to ``pid_file``, then runs ``then``."""
    return py(
        "import pathlib, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        f" start_new_session={own_session})\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(f'{{child.pid}}\\n')\n"
        f"{then}\n"
    )


async def test_a_task_s_end_is_reported_when_its_process_ends_and_what_it_left_is_killed(tmp_path: Path) -> None:
    """A task whose process exits leaving a child running (holding its stderr) ends then: it
    is not reported running for as long as the child lives, and the child, which would hold
    the task's GPUs after they were given back, is killed with it."""
    backend = ProcessBackend(node="n1")
    await backend.start("t", GPU0, spawning(tmp_path / "child"), {})
    began = time.monotonic()
    events = await wait_for_state(backend, "t", timeout=10.0)
    assert [e.state for e in events] == ["started", "finished"] and time.monotonic() - began < 10.0
    child = int((await wait_for_file(tmp_path / "child")).strip())
    await until_gone(child)
    assert gone(child)
    assert backend.running() == []


async def test_an_eviction_is_not_held_up_by_a_process_that_left_the_task_s_session(tmp_path: Path) -> None:
    """A child that left the task's session (out of reach of the group's signals) and holds
    its stderr must not hold the eviction up: it returns once the task's process is gone."""
    backend = ProcessBackend(node="n1")
    await backend.start("t", GPU0, spawning(tmp_path / "child", own_session=True, then="time.sleep(60)"), {})
    child = int((await wait_for_file(tmp_path / "child")).strip())
    try:
        began = time.monotonic()
        await asyncio.wait_for(backend.stop("t", grace_s=0.5), timeout=15.0)
        assert time.monotonic() - began < 10.0
        assert [e.state for e in await backend.poll()] == ["started", "evicted"]
        assert backend.running() == []
    finally:
        with contextlib.suppress(ProcessLookupError):  # it ends with the task (its run's id)
            os.kill(child, signal.SIGKILL)
        await asyncio.sleep(0.3)  # the end of its stderr reaches the backend's reader


async def test_an_evicted_task_s_children_get_the_grace_then_are_killed(tmp_path: Path) -> None:
    """The task's process exits at SIGTERM while its child (stderr elsewhere) ignores it: the
    child is killed when the grace is over, not left running."""
    backend = ProcessBackend(node="n1")
    code = (
        "import pathlib, signal, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'], stderr=subprocess.DEVNULL)\n"
        f"pathlib.Path({str(tmp_path / 'child')!r}).write_text(f'{{child.pid}}\\n')\n"
        "signal.sigwait([signal.SIGTERM])\n"
    )
    await backend.start("t", GPU0, py("import signal; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])\n"
                                      + code), {})
    child = int((await wait_for_file(tmp_path / "child")).strip())
    await asyncio.sleep(0.3)  # the child has set SIGTERM aside
    await backend.stop("t", grace_s=1.0)
    await until_gone(child)
    assert gone(child)


async def test_a_child_that_does_not_hold_stderr_is_killed_when_the_task_ends(tmp_path: Path) -> None:
    """A task that starts a worker with its stderr elsewhere (``worker 2>log &``) and exits:
    the worker, which would hold the task's GPUs after they were given back, is killed with
    the task's end, as one that holds the task's stderr is."""
    backend = ProcessBackend(node="n1")
    code = (
        "import pathlib, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], stderr=subprocess.DEVNULL)\n"
        f"pathlib.Path({str(tmp_path / 'child')!r}).write_text(f'{{child.pid}}\\n')\n"
    )
    await backend.start("t", GPU0, py(code), {})
    assert [e.state for e in await wait_for_state(backend, "t")] == ["started", "finished"]
    child = int((await wait_for_file(tmp_path / "child")).strip())
    try:
        await until_gone(child)
        assert gone(child)
    finally:
        if not gone(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize(
    ("command", "env"),
    [
        (py("print('a\x00b')"), {}),
        (py("pass"), {"BAD=NAME": "x"}),
        (py("pass"), {"OK": "a\x00b"}),
    ],
)
async def test_a_command_or_environment_the_os_cannot_take_is_refused_for_good(
    command: list[str], env: dict[str, str]
) -> None:
    """A NUL byte in the command or environment, or an ``=`` in a variable's name, can never
    start: a non-retryable ``BackendError`` naming the task, not a ``ValueError`` that the
    dispatcher records as a retryable failure (re-placed again and again)."""
    backend = ProcessBackend(node="n1")
    with pytest.raises(BackendError, match="cannot start t") as raised:
        await backend.start("t", GPU0, command, env)
    assert not raised.value.retryable
    assert backend.running() == [] and await backend.poll() == []


async def test_a_task_id_with_a_slash_logs_inside_the_log_dir(tmp_path: Path) -> None:
    """Task ids are chosen by clients: ``team/job`` must neither fail the start (no such
    subfolder) nor ``../x`` write outside ``log_dir``."""
    logs = tmp_path / "logs"
    backend = ProcessBackend(node="n1", log_dir=logs)
    for task_id in ("team/job", "../escape"):
        await backend.start(task_id, GPU0, py("print('hello')"), {})
        assert [e.state for e in await wait_for_state(backend, task_id)] == ["started", "finished"]
    written = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert all(p.parent == logs for p in written) and len(written) == 2
    assert all(p.read_text() == "hello\n" for p in written)


async def test_a_stop_that_comes_after_the_task_exited_by_itself_reports_its_own_end() -> None:
    """The task exits 0 just before an eviction reaches it, its exit not yet seen by the event
    loop: it finished, and is not reported evicted (to be placed and run again)."""
    backend = ProcessBackend(node="n1")
    handle = await backend.start("t", GPU0, py("pass"), {})
    assert handle.pid is not None
    # Block the event loop until the process has exited: its exit is not processed yet.
    deadline = time.monotonic() + 10
    while not gone(handle.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gone(handle.pid)
    await backend.stop("t", grace_s=1.0)
    assert [(e.state, e.exit_code) for e in await backend.poll()] == [("started", None), ("finished", 0)]


async def exited_unseen(backend: ProcessBackend, task_id: str) -> None:
    """Start ``task_id`` as a process that exits at once, and wait until it has, blocking the
    event loop meanwhile: its exit is not yet processed (``poll`` has not seen it)."""
    handle = await backend.start(task_id, GPU0, py("pass"), {})
    assert handle.pid is not None
    deadline = time.monotonic() + 10
    while not gone(handle.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # blocks the event loop: the exit is not processed yet
    assert gone(handle.pid)


async def test_a_move_that_comes_after_the_task_exited_by_itself_does_not_run_it_again() -> None:
    """The task exits 0 just before its move reaches it: it finished, is told so, and is not
    started again on the target (a finished job run a second time from its checkpoint)."""
    backend = ProcessBackend(node="n1", checkpoint_s=0.2)
    await exited_unseen(backend, "t")
    with pytest.raises(BackendError, match="ended before its move") as raised:
        await backend.migrate("t", [Placement(node="n1", gpu=1, milli=1000)], grace_s=1.0)
    assert not raised.value.retryable
    assert [(e.state, e.exit_code) for e in await backend.poll()] == [("started", None), ("finished", 0)]
    assert backend.running() == []


async def test_a_registry_that_cannot_be_written_loses_no_task_and_no_end(tmp_path: Path) -> None:
    """The registry (the pids kept for a backend after a crash) is a safety net: its folder
    gone or its disk full must neither fail a start whose process runs (the task placed
    again, and run twice) nor swallow the end of a task (its GPUs held for ever)."""
    folder = tmp_path / "state"
    backend = ProcessBackend(node="n1", registry=folder / "processes.json")
    go = tmp_path / "go"
    await backend.start("t", GPU0, py(
        "import pathlib, time\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.02)\n"), {})
    # The state folder goes away (a volume unmounted, a file in its place).
    (folder / "processes.json").unlink()
    folder.rmdir()
    folder.write_text("not a folder")
    handle = await backend.start("u", [Placement(node="n1", gpu=1, milli=1000)], py("pass"), {})
    assert handle.pid is not None
    go.write_text("go")
    events: list[TaskLifecycle] = []
    deadline = time.monotonic() + 10
    while backend.running() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    events += await backend.poll()
    assert backend.running() == []
    assert sorted((e.task_id, e.state) for e in events) == [
        ("t", "finished"), ("t", "started"), ("u", "finished"), ("u", "started")]


def orphaned_group(tmp_path: Path, name: str, task_id: str) -> tuple[int, int, int]:
    """A task's process group whose main process has ended, its child running on, as a task
    leaves it when it ends while no executor watches: ``(leader pid, leader start time in
    clock ticks, child pid)``."""
    pid_file = tmp_path / f"{name}.pid"
    leader = subprocess.Popen(spawning(pid_file, then="sys.stdin.read()"), stdin=subprocess.PIPE,
                              start_new_session=True, env={**os.environ, "FLEETPILOT_TASK_ID": task_id})
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().endswith("\n"):
        assert time.monotonic() < deadline, "the task's child never started"
        time.sleep(0.02)
    started = int(Path(f"/proc/{leader.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    leader.communicate(b"")  # the main process ends (and is reaped); its child does not
    return leader.pid, started, int(pid_file.read_text())


async def test_a_task_whose_main_process_ended_while_no_executor_watched_has_its_children_stopped(
    tmp_path: Path,
) -> None:
    # Before, the leader's pid was the only proof that the group was the task's: with the
    # leader gone, its children ran on, holding the GPUs the task was placed again on.
    registry = tmp_path / "processes.json"
    ours = orphaned_group(tmp_path, "ours", "left")
    # A group whose processes carry another task's id in their environment is not this task's.
    other = orphaned_group(tmp_path, "other", "someone-else")
    try:
        registry.write_text(json.dumps({"left": list(ours[:2]), "stranger": list(other[:2])}))
        backend = ProcessBackend(node="n1", registry=registry)
        assert await backend.stop_left_behind(grace_s=1.0) == {"left": True, "stranger": False}
        await until_gone(ours[2])
        assert gone(ours[2]) and not gone(other[2])
    finally:
        for child in (ours[2], other[2]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


async def test_a_node_that_cannot_start_anything_fails_retryably_and_says_so_until_it_can(tmp_path: Path) -> None:
    """Its log directory gone bad (here a file stands where it should be; a full disk, no
    processes or file handles left are the same): every start failed as a refusal, as if the
    task's command were wrong, and after a few the policy told the submitter its task could
    never run. The node is at fault: the failure is retryable (placed again elsewhere), and
    after ``TROUBLE_AFTER_FAILURES`` in a row the backend says what is wrong with its node,
    until a trial start succeeds again."""
    from fleetpilot.executor.process import TROUBLE_AFTER_FAILURES

    logs = tmp_path / "logs"
    logs.write_text("not a directory")
    backend = ProcessBackend(node="n1", log_dir=logs)
    for i in range(TROUBLE_AFTER_FAILURES):
        assert backend.node_trouble == ""
        with pytest.raises(BackendError, match=f"cannot start t{i}") as raised:
            await backend.start(f"t{i}", GPU0, py("pass"), {})
        assert raised.value.retryable
    assert f"{TROUBLE_AFTER_FAILURES} starts in a row" in backend.node_trouble
    assert "logs" in backend.node_trouble  # what failed, for the operator
    assert await backend.recheck_node() == backend.node_trouble != ""  # still broken
    logs.unlink()
    assert await backend.recheck_node() == ""
    await backend.start("after", GPU0, py("pass"), {})
    assert [e.state for e in await wait_for_state(backend, "after")] == ["started", "finished"]


async def test_a_command_that_is_not_there_is_the_task_s_fault_not_the_node_s(tmp_path: Path) -> None:
    """A missing or non-executable command fails wherever it is placed: refused for good, and
    however many such tasks come, the node is not said to be in trouble; one start that
    works in between ends a run of node failures."""
    from fleetpilot.executor.process import TROUBLE_AFTER_FAILURES

    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    backend = ProcessBackend(node="n1")
    for i in range(TROUBLE_AFTER_FAILURES + 1):
        for command in ([str(tmp_path / "missing")], [str(script)]):
            with pytest.raises(BackendError) as raised:
                await backend.start(f"t{i}", GPU0, command, {})
            assert not raised.value.retryable
    assert backend.node_trouble == ""


async def test_a_start_that_works_ends_a_run_of_node_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS out of processes (``EAGAIN`` from fork) is the node's failure; a start that
    works between two such failures means the node is not stuck."""
    import errno

    from fleetpilot.executor.process import TROUBLE_AFTER_FAILURES

    real = asyncio.create_subprocess_exec
    failing = {"on": True}

    async def fork_fails(*args, **kwargs):  # type: ignore[no-untyped-def]
        if failing["on"]:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return await real(*args, **kwargs)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", fork_fails)
    backend = ProcessBackend(node="n1")

    async def fail_starts(count: int, prefix: str) -> None:
        for i in range(count):
            with pytest.raises(BackendError, match="Resource temporarily unavailable") as raised:
                await backend.start(f"{prefix}{i}", GPU0, py("pass"), {})
            assert raised.value.retryable

    await fail_starts(TROUBLE_AFTER_FAILURES - 1, "a")
    failing["on"] = False
    await backend.start("works", GPU0, py("pass"), {})
    assert [e.state for e in await wait_for_state(backend, "works")] == ["started", "finished"]
    failing["on"] = True
    await fail_starts(TROUBLE_AFTER_FAILURES - 1, "b")
    assert backend.node_trouble == ""
    await fail_starts(1, "c")
    assert backend.node_trouble != ""


async def test_a_task_id_too_long_for_a_file_name_is_not_the_node_s_fault(tmp_path: Path) -> None:
    """Task ids are chosen by clients and have no length limit: one longer than a file name
    may be (255 bytes) failed its log's ``open`` with ``ENAMETOOLONG``, counted as the node's
    fault, so a few such tasks took every node they were placed on out of service. The log
    gets a shortened name of its own, inside ``log_dir``, and the task runs."""
    from fleetpilot.executor.process import TROUBLE_AFTER_FAILURES

    logs = tmp_path / "logs"
    backend = ProcessBackend(node="n1", log_dir=logs)
    ids = [f"{'x' * 300}-{i}" for i in range(TROUBLE_AFTER_FAILURES)] + ["é" * 200]
    for task_id in ids:
        await backend.start(task_id, GPU0, py(f"print({task_id[-3:]!r})"), {})
        assert [e.state for e in await wait_for_state(backend, task_id)] == ["started", "finished"]
    assert backend.node_trouble == ""
    written = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert all(p.parent == logs for p in written)
    assert sorted(p.read_text() for p in written) == sorted(f"{task_id[-3:]}\n" for task_id in ids)


async def test_an_eviction_during_a_move_is_not_undone_by_the_move(tmp_path: Path) -> None:
    """A task is being moved (its checkpoint window open: it ignores the signal) when an
    eviction reaches it (its GPU decommissioned, a preemption, the executor stopping). The
    eviction is told and its holds given back, so the policy places it again; the move then
    restarted it on its target all the same, and it ran twice. The move fails instead."""
    ready, started = tmp_path / "ready", tmp_path / "started"
    backend = ProcessBackend(node="n1", checkpoint_s=1.0)
    code = (
        "import os, signal, time, pathlib\n"
        "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
        f"with open({str(started)!r}, 'a') as f: f.write(os.environ['CUDA_VISIBLE_DEVICES'] + '\\n')\n"
        f"pathlib.Path({str(ready)!r}).write_text('ok\\n')\n"
        "time.sleep(60)\n"
    )
    await backend.start("t", GPU0, py(code), {})
    await wait_for_file(ready)
    move = asyncio.create_task(backend.migrate("t", [Placement(node="n1", gpu=1, milli=1000)], grace_s=1.0))
    await asyncio.sleep(0.3)  # the checkpoint signal is sent; the task saves nothing
    await backend.stop("t", grace_s=1.0)
    with pytest.raises(BackendError, match="evicted") as raised:
        await move
    assert not raised.value.retryable
    assert backend.running() == []
    assert started.read_text() == "0\n"  # never started again, on GPU 1
    assert [e.state for e in await backend.poll()] == ["started", "evicted"]


async def test_an_eviction_while_a_move_restarts_the_task_stops_the_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eviction comes once the task saved and exited for its move, while its restart on
    the target is on its way: it is told evicted (its holds given back), so the restart is
    stopped and the move fails, rather than the task running on its target for nobody."""
    ready, checkpoint, restored = tmp_path / "ready", tmp_path / "ckpt", tmp_path / "restored"
    backend = ProcessBackend(node="n1", checkpoint_s=5)
    real = asyncio.create_subprocess_exec

    async def evicted_on_the_way(*args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs["env"].get("FLEETPILOT_RESTORE") == "1":
            await backend.stop("m", grace_s=1.0)
        return await real(*args, **kwargs)

    await backend.start("m", GPU0, checkpointing(ready, checkpoint, restored), {})
    await wait_for_file(ready)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", evicted_on_the_way)
    with pytest.raises(BackendError, match="evicted during its move") as raised:
        await backend.migrate("m", [Placement(node="n1", gpu=5, milli=1000)], grace_s=1.0)
    assert not raised.value.retryable
    assert backend.running() == []
    assert [e.state for e in await backend.poll()] == ["started", "evicted"]


@pytest.mark.parametrize("launched", [True, False], ids=["after-launch", "right-after-start"])
async def test_resize_grows_the_memory_cap_live(tmp_path: Path, launched: bool) -> None:
    """A task that grows is given more memory. Once its cap was set, the launcher had made
    it the hard limit too, which only a process with ``CAP_SYS_RESOURCE`` may raise: every
    resize up failed (retryably, again and again) for an executor without it (the image
    runs as uid 10001). A resize right after the start, before the launcher set the cap, was
    reported done and then undone by the launcher (the smaller of the two won). Either way
    the task ran out of memory at its old cap."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    backend = ProcessBackend(limit_address_space=True, headroom_mb=256)
    code = (
        "import time, pathlib\n"
        f"pathlib.Path({str(ready)!r}).write_text('ok\\n')\n"
        f"go = pathlib.Path({str(go)!r})\n"
        "while not go.exists(): time.sleep(0.02)\n"
        "b = bytearray(1024**3)\n"
    )
    await backend.start("g", [Placement(node="n1", gpu=0, milli=1000, memory_mb=64)], py(code), {})
    if launched:
        await wait_for_file(ready)  # the launcher has set the cap and exec'd the task
    await backend.resize("g", milli=1000, memory_mb=4096)
    go.write_text("go")
    events = await wait_for_state(backend, "g")
    assert [e.state for e in events] == ["started", "resized", "finished"]


async def test_a_task_does_not_get_the_executor_s_own_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task is user code: the executor's settings (the NATS URL with its credentials, which
    let it write the ledger and publish decisions) are not in its environment; what it asked
    for, the variables it is given and the rest of the node's environment are."""
    monkeypatch.setenv("FLEETPILOT_NATS_URL", "nats://executor:s3cret@nats:4222")
    monkeypatch.setenv("FLEETPILOT_EXECUTOR_NODE", "n1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer s3cret")
    monkeypatch.setenv("LANG_OF_THE_NODE", "kept")
    out = tmp_path / "env.json"
    backend = ProcessBackend(node="n1")
    code = f"import json, os, pathlib; pathlib.Path({str(out)!r}).write_text(json.dumps(dict(os.environ)) + '\\n')"
    await backend.start("t", GPU0, py(code), {"FLEETPILOT_DECISION_ID": "d1", "MINE": "x"})
    seen = json.loads(await wait_for_file(out))
    assert "FLEETPILOT_NATS_URL" not in seen and "FLEETPILOT_EXECUTOR_NODE" not in seen
    assert "OTEL_EXPORTER_OTLP_HEADERS" not in seen
    assert seen["LANG_OF_THE_NODE"] == "kept" and seen["PATH"] == os.environ["PATH"]
    assert (seen["FLEETPILOT_DECISION_ID"], seen["FLEETPILOT_TASK_ID"], seen["MINE"]) == ("d1", "t", "x")
    await wait_for_state(backend, "t")


@pytest.mark.parametrize("end", ["evicted", "finished"])
async def test_a_process_that_left_the_task_s_session_ends_with_the_task(tmp_path: Path, end: str) -> None:
    """A daemon the task started in a session of its own (``setsid``, ``ray start``, a double
    fork) is out of reach of the group's signals: before, it ran on after the task was evicted
    or ended, holding the GPUs the task's share was given back from. It carries the task's id
    in its environment and ends with the task."""
    backend = ProcessBackend(node="n1")
    then = "time.sleep(60)" if end == "evicted" else "pass"
    await backend.start("t", GPU0, spawning(tmp_path / "child", own_session=True, then=then), {})
    child = int((await wait_for_file(tmp_path / "child")).strip())
    try:
        if end == "evicted":
            await asyncio.wait_for(backend.stop("t", grace_s=0.5), timeout=15.0)
        assert (await wait_for_state(backend, "t"))[-1].state == end
        await until_gone(child)
        assert gone(child)
    finally:
        if not gone(child):
            os.kill(child, signal.SIGKILL)


async def test_a_process_that_left_the_session_of_a_task_left_behind_is_stopped(tmp_path: Path) -> None:
    """The next executor of the node stops what a dead one left running, a daemon the task
    started in a session of its own included (known by its run's id); a process of another
    run of a task of the same id (another executor's) is not touched."""
    registry = tmp_path / "processes.json"
    first = ProcessBackend(node="n1", registry=registry)
    await first.start("t", GPU0, spawning(tmp_path / "child", own_session=True, then="time.sleep(60)"), {})
    other = ProcessBackend(node="n2")
    await other.start("t", [Placement(node="n2", gpu=0, milli=1000)], py("import time; time.sleep(60)"), {})
    child = int((await wait_for_file(tmp_path / "child")).strip())
    try:
        second = ProcessBackend(node="n1", registry=registry)
        assert await second.stop_left_behind(grace_s=0.5) == {"t": True}
        await until_gone(child)
        assert gone(child)
        assert other.running() == ["t"] and [e.state for e in await other.poll()] == ["started"]
    finally:
        await other.stop("t", grace_s=0.5)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


async def test_a_chatty_task_s_log_is_kept_within_its_cap(tmp_path: Path) -> None:
    """A task that prints for days filled the node's disk through its log (every start on the
    node failing then, taken for the node's fault): a log past ``log_max_bytes`` is cut, its
    latest part kept beside it (``.out.1``), so a task's logs take about twice the cap."""
    logs, cap = tmp_path / "logs", 64 * 1024
    backend = ProcessBackend(node="n1", log_dir=logs, log_max_bytes=cap)
    code = (  # 200 KB in bursts of 20 KB
        "import sys, time\n"
        "for i in range(200):\n"
        "    sys.stdout.write(f'line {i} ' + 'x' * 1000 + '\\n'); sys.stdout.flush()\n"
        "    if i % 20 == 19: time.sleep(0.2)\n"
        "sys.stdout.write('last\\n'); sys.stdout.flush(); time.sleep(60)\n"
    )
    await backend.start("chatty", GPU0, py(code), {})
    log, kept = logs / "chatty.out", logs / "chatty.out.1"

    def both() -> bytes:
        return (kept.read_bytes() if kept.exists() else b"") + (log.read_bytes() if log.exists() else b"")

    try:
        deadline = time.monotonic() + 20
        while b"last\n" not in both() and time.monotonic() < deadline:
            await backend.poll()  # the executor polls its backend every second
            await asyncio.sleep(0.05)
        await backend.poll()
        assert b"last\n" in both() and b"line 199 " in both()
        assert log.stat().st_size <= cap
        assert kept.stat().st_size <= cap + 32 * 1024  # what came in while it was cut
        assert b"line 0 " not in both()
    finally:
        await backend.stop("chatty", grace_s=0.5)


async def test_a_resize_that_comes_after_the_task_exited_by_itself_fails_and_tells_no_resize() -> None:
    """The task exits 0 just before its resize reaches it, its exit not yet seen by the event
    loop: the resize is refused for good (the task ended), and no ``resized`` is told beside
    its ``finished`` (it was, and the resize counted as executed on a task that ran no more)."""
    backend = ProcessBackend(node="n1")
    await exited_unseen(backend, "t")
    with pytest.raises(BackendError, match="ended before its resize") as raised:
        await backend.resize("t", milli=500, memory_mb=1024)
    assert not raised.value.retryable
    events = await wait_for_state(backend, "t")
    assert [(e.state, e.exit_code) for e in events] == [("started", None), ("finished", 0)]


async def test_a_command_that_is_not_there_is_refused_at_its_start_under_a_memory_cap(tmp_path: Path) -> None:
    """With ``limit_address_space`` the task runs behind a launcher, which always starts: a
    command that is not there was told ``started``, then ``failed`` (exit 127), where without
    the cap its start is refused for good. Refused the same now, with nothing told."""
    backend = ProcessBackend(node="n1", limit_address_space=True)
    placement = [Placement(node="n1", gpu=0, milli=1000, memory_mb=1024)]
    with pytest.raises(BackendError, match="no executable") as raised:
        await backend.start("t", placement, [str(tmp_path / "no-such-binary"), "--x"], {})
    assert not raised.value.retryable
    assert await backend.poll() == [] and backend.running() == []
    # A command found on the task's own PATH (not the executor's) starts behind the launcher.
    tool = tmp_path / "bin" / "mytool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    await backend.start("u", placement, ["mytool"], {"PATH": f"{tool.parent}:{os.environ['PATH']}"})
    assert [e.state for e in await wait_for_state(backend, "u")] == ["started", "finished"]


async def test_a_task_handed_over_whose_take_back_cannot_start_is_told_lost(tmp_path: Path) -> None:
    """A task handed over for a move that never took it is restarted where it was; a restart
    that fails there too left it stopped everywhere, told nothing (its hold kept in the ledger
    for ever, the policy taking it as running). It is told ``failed``, on its placement, so
    the executor gives its holds back, as for a move whose restart failed."""
    script = tmp_path / "task.sh"
    script.write_text("#!/bin/sh\nexec sleep 30\n")
    script.chmod(0o755)
    backend = ProcessBackend(node="n1", checkpoint_s=0.2)
    placement = [Placement(node="n1", gpu=2, milli=1000)]
    await backend.start("h", placement, [str(script)], {})
    assert await backend.hand_over("h", grace_s=0.5) == ([str(script)], {})
    script.unlink()  # the command went meanwhile (a shared volume unmounted, a redeploy)
    with pytest.raises(BackendError):
        await backend.take_back("h")
    events = [e for e in await backend.poll() if e.state != "started"]
    assert [(e.state, e.node, e.gpus) for e in events] == [("failed", "n1", [2])]
    assert "never took it" in events[0].detail
    assert backend.running() == []


CHATTY = (  # 200 KB in bursts of 20 KB, then quiet
    "import sys, time\n"
    "for i in range(200):\n"
    "    sys.stdout.write(f'line {i} ' + 'x' * 1000 + '\\n'); sys.stdout.flush()\n"
    "    if i % 20 == 19: time.sleep(0.2)\n"
    "sys.stdout.write('last\\n'); sys.stdout.flush(); time.sleep(60)\n"
)


async def test_a_log_is_kept_within_its_cap_when_its_kept_part_cannot_be_written(tmp_path: Path) -> None:
    """The kept part of a log (``.out.1``) cannot be written (a full disk, a quota, a path
    that is not a file): the copy failed, and the log was never cut, growing for ever. It is
    cut all the same, its content lost rather than the node's disk."""
    logs, cap = tmp_path / "logs", 64 * 1024
    logs.mkdir()
    (logs / "chatty.out.1").mkdir()  # not a file: no copy can be written there
    backend = ProcessBackend(node="n1", log_dir=logs, log_max_bytes=cap)
    handle = await backend.start("chatty", GPU0, py(CHATTY), {})
    log = logs / "chatty.out"
    try:
        deadline = time.monotonic() + 20
        while b"last\n" not in log.read_bytes() and time.monotonic() < deadline:
            await backend.poll()  # the executor polls its backend every second
            await asyncio.sleep(0.05)
        await backend.poll()
        assert b"last\n" in log.read_bytes()
        assert log.stat().st_size <= cap
        assert handle.pid is not None and backend.running() == ["chatty"]
    finally:
        await backend.stop("chatty", grace_s=0.5)


async def test_a_log_removed_while_its_task_runs_is_still_kept_within_its_cap(tmp_path: Path) -> None:
    """An operator removes a running task's log (``rm *.out`` on a full disk): the task goes
    on writing to the file no name reaches, which the cap no longer cut (it looked the log up
    by its name, and warned every second that it was not there) and whose room the disk never
    got back. The cap follows the file the task writes to."""
    logs, cap = tmp_path / "logs", 64 * 1024
    go = tmp_path / "go"
    code = f"import pathlib, time\nwhile not pathlib.Path({str(go)!r}).exists(): time.sleep(0.02)\n" + CHATTY
    backend = ProcessBackend(node="n1", log_dir=logs, log_max_bytes=cap)
    handle = await backend.start("chatty", GPU0, py(code), {})
    assert handle.pid is not None
    (logs / "chatty.out").unlink()
    go.write_text("go")
    kept = logs / "chatty.out.1"
    stdout = Path(f"/proc/{handle.pid}/fd/1")
    try:
        deadline = time.monotonic() + 20
        while not (kept.exists() and b"last\n" in kept.read_bytes() + stdout.read_bytes()) \
                and time.monotonic() < deadline:
            await backend.poll()
            await asyncio.sleep(0.05)
        await backend.poll()
        assert os.stat(stdout).st_size <= cap  # the file the task writes to
        assert b"last\n" in kept.read_bytes() + stdout.read_bytes()
    finally:
        await backend.stop("chatty", grace_s=0.5)


async def test_a_task_moved_away_and_back_is_stopped_when_it_moves_away_again(tmp_path: Path) -> None:
    """A task moves n1 → n2 → n1 → n2 within minutes (a rebalancer). n1 kept its first
    hand-over to answer a repeat: the third move was answered from it, the task not stopped
    on n1 and started on n2 as well (run twice), and n1 took it as stranded and started it
    a second time there. A task started on a node settles what that node handed over of it."""
    ready, checkpoint, restored = tmp_path / "ready", tmp_path / "ckpt", tmp_path / "restored"
    nodes = two_nodes()
    n1, n2 = GPU0, [Placement(node="n2", gpu=1, milli=1000)]
    await nodes["n1"].start("m", n1, checkpointing(ready, checkpoint, restored), {})
    await wait_for_file(ready)
    for source, target, here, there in ((n1, n2, "n2", "n1"), (n2, n1, "n1", "n2"), (n1, n2, "n2", "n1")):
        ready.unlink()
        await nodes[here].migrate("m", target, source=source, grace_s=1)
        await wait_for_file(ready)
        assert (nodes[here].running(), nodes[there].running()) == (["m"], [])
        # Nothing handed over from where it runs waits to be taken back there.
        assert nodes[here].handed_over_before(time.time() + 1) == []
    await nodes["n2"].stop("m", grace_s=1)


def test_a_task_numbers_its_gpus_as_nvml_does_whatever_its_own_environment_says() -> None:
    """``CUDA_VISIBLE_DEVICES`` holds NVML's indices (the collector's, the ledger's); CUDA
    numbers devices fastest first unless told the PCI bus order NVML uses, so on a node of
    mixed boards a task given GPU 1 ran on another board. A task's own ``FASTEST_FIRST``
    would do the same."""
    placement = [Placement(node="n1", gpu=1, milli=1000)]
    for given in ({}, {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}):
        env = child_env({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, given, "t", placement, restore=False)
        assert (env["CUDA_DEVICE_ORDER"], env["CUDA_VISIBLE_DEVICES"]) == ("PCI_BUS_ID", "1")

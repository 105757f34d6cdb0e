"""``ProcessBackend``: runs each task's ``command`` as a real OS process on this node.

- **GPUs**: the child sees only its GPUs (``CUDA_VISIBLE_DEVICES``); a fractional share
  (``milli < 1000``) is passed as ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` for MPS to enforce.
- **Environment**: the node's, without the executor's own settings (``FLEETPILOT_*``,
  ``OTEL_*``), then
  ``FLEETPILOT_TASK_ID``, ``FLEETPILOT_RUN_ID`` (this run's) and what the decision gives.
- **Evict** (``stop``): SIGTERM to the task's process group, SIGKILL after ``grace_s`` (to
  what is left of the group even when the task's own process exited within the grace); the
  run's processes that left the group (``setsid``) are found by ``FLEETPILOT_RUN_ID`` in
  their environment and signalled with it.
- **End**: a task ends when its process exits; what it left running in its process group
  is killed then (it would hold the GPUs given back), whether or not it holds the task's
  stderr, and a child that keeps its stderr open does not keep it "running". A stop or a
  move that comes after the exit (not yet seen by the event loop) reports the task's own end.
- **Migrate**: the checkpoint signal (SIGUSR1) first, ``checkpoint_s`` for the task to save
  its state (it may exit by itself), then stop with grace and start again on the target
  with ``FLEETPILOT_RESTORE=1``. A task that does not handle SIGUSR1 is terminated by it
  (the signal's default action) and simply restarts from scratch. A task that cannot resume
  (``resumes`` false) gets neither the signal nor the window: it is stopped with grace and
  started over, without ``FLEETPILOT_RESTORE``. An eviction that comes
  during the move wins: the move fails, and the task is not started on the target. Between nodes, the
  target's backend asks the source's (``take_over``, over the bus in the executor service)
  to do the first half (``hand_over``) and starts the task itself; its checkpoint must be
  where the target can read it (shared storage).
- **Resize**: the new share is recorded and used at the next start; with
  ``limit_address_space`` the memory cap (the soft limit, so it can be raised without
  ``CAP_SYS_RESOURCE``) is changed live with ``prlimit``.
- **OOM**: reported as ``oom_killed`` when the process exits non-zero with an out-of-memory
  marker on stderr (``CUDA out of memory``, ``OutOfMemoryError``, ``MemoryError``,
  ``std::bad_alloc``, ``RESOURCE_EXHAUSTED: Out of memory``...), or dies by a SIGKILL that we
  did not send (exit 137 / -9) while the ``oom_kill`` count of its cgroup (under
  ``cgroup_root``: v2's ``memory.events``, v1's ``memory/.../memory.oom_control``) moved since
  its start: the kernel's OOM killer. A SIGKILL that count did not see (an operator's
  ``kill -9``, a node's watchdog) is ``failed``. Where the count cannot be read (no memory
  controller, the root cgroup of v2, a v1 kernel before 4.13, no permission)
  such a SIGKILL is taken for an OOM, and its detail says it could not be told. The count is
  the cgroup's, not the task's: tasks that share a cgroup (an executor's pod) see each other's
  OOM kills, so a ``kill -9`` that comes as another task of the cgroup is OOM-killed is taken
  for an OOM too.
  With ``limit_address_space=True`` a task given ``memory_mb`` also gets
  a soft ``RLIMIT_AS = memory_mb + headroom_mb`` (set by a launcher that then ``exec``s it): without a GPU-level memory limit on this machine
  the host address space stands in for it, so a leaking task fails as an OOM would. It is
  off by default because CUDA reserves far more virtual address space than it uses.
- **Samples**: :meth:`ProcessBackend.samples` reads each task's RSS from ``/proc``.
- **Logs**: stdout to ``log_dir/<task>.out``, cut past ``log_max_bytes`` (``cap_logs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import resource
import secrets
import shutil
import signal
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from fleetpilot.contracts import LifecycleState, Placement, TaskLifecycle

from .backend import STARTED_OVER, BackendError, ProcessSample, TaskHandle, gpus_of, node_of
from .locks import Clock

log = logging.getLogger("fleetpilot.executor")

OOM_MARKERS: tuple[str, ...] = (
    "CUDA out of memory",
    "OutOfMemoryError",
    "MemoryError",
    "std::bad_alloc",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
    "CUDA_ERROR_OUT_OF_MEMORY",  # the driver API (numba, JAX's allocator)
    "RESOURCE_EXHAUSTED: Out of memory",  # JAX / XLA
    "OOM when allocating tensor",  # TensorFlow's ResourceExhaustedError
)
STDERR_TAIL_BYTES = 16_384
# How often a watcher looks whether a task's process exited while its stderr stays open
# (held by a process the task started).
EXIT_POLL_S = 0.2
# How long the rest of stderr is read once the task's process is gone: a process that left
# the task's session may hold it open for ever.
STDERR_DRAIN_S = 2.0
# How long a backend answers a repeated hand-over of a task with what it handed over.
HANDED_OVER_KEPT_S = 900.0

TakeOver = Callable[[str, str, float, bool], Awaitable[tuple[list[str], dict[str, str]]]]
"""``take_over(source_node, task_id, grace_s, resumes)``: have the task stopped on its node,
after its checkpoint signal when it ``resumes``, and return its command and environment;
raises ``BackendError``."""
# Why the OS may refuse to start a process on this node whatever the command: out of memory,
# processes or file handles, its disk full or read-only, an I/O error. Trying elsewhere may
# work; the task is not at fault. (A command missing or not executable fails anywhere.)
NODE_FAULT_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC,
                               errno.EDQUOT, errno.EIO, errno.EROFS})
# After this many starts in a row failed for the node's fault, the backend says the node is in
# trouble (``node_trouble``), and the executor takes it out of service until a trial start
# works again: each decision sent there would fail the same way.
TROUBLE_AFTER_FAILURES = 3
# The executor's own settings, kept from a task's environment (``child_env``): its own
# (``FLEETPILOT_*``) and its tracing exporter's (``OTEL_*``: its service name, and headers
# that may carry the collector's credentials).
EXECUTOR_ENV_PREFIXES = ("FLEETPILOT_", "OTEL_")
# The longest file name most file systems take (NAME_MAX), in bytes.
LOG_NAME_MAX_BYTES = 255
# A task's log past this many bytes is cut (``cap_logs``), its latest part kept beside it.
LOG_MAX_BYTES = 256 * 1024 * 1024
# The name of that part: the log's with this after it (a log's name leaves room for it).
LOG_KEPT_SUFFIX = ".1"

# The cap is the soft limit; the hard one is left as it was, for ``resize`` to raise the cap
# (raising a hard limit takes ``CAP_SYS_RESOURCE``, which an executor run as a user lacks).
# ``argv[2]`` is the soft limit the launcher was started with: another one now is a resize
# that came before the launcher set the cap, and it wins.
_RLIMIT_LAUNCHER = (
    "import os, resource, sys\n"
    "limit, inherited = int(sys.argv[1]), int(sys.argv[2])\n"
    "soft, hard = resource.getrlimit(resource.RLIMIT_AS)\n"
    "if soft != inherited:\n"
    "    limit = soft  # a resize that came first (prlimit) wins\n"
    "if hard != resource.RLIM_INFINITY:\n"
    "    limit = min(limit, hard)\n"
    "resource.setrlimit(resource.RLIMIT_AS, (limit, hard))\n"
    "try:\n"
    "    os.execvp(sys.argv[3], sys.argv[3:])\n"
    "except OSError as error:\n"
    "    print(f'cannot exec {sys.argv[3]}: {error}', file=sys.stderr)\n"
    "    os._exit(127)\n"
)

StopReason = LifecycleState | None
# The exits of a process killed by SIGKILL: its own (-9), or a shell's whose child it was (137).
SIGKILLED = (128 + signal.SIGKILL, -signal.SIGKILL)
# Where cgroups are mounted: v2 at the top, each v1 controller below it (``memory``); in a
# container with a cgroup namespace, its own part of the tree.
CGROUP_ROOT = Path("/sys/fs/cgroup")


def classify_exit(
    returncode: int, stderr_tail: str, stop_reason: StopReason, oom_kill_moved: bool | None = None
) -> tuple[LifecycleState, str]:
    """What a process exit means for its task: the lifecycle state and a short detail.

    ``stop_reason`` is the state we asked for when *we* stopped the process (``evicted`` or
    ``migrated``); an exit we caused is never mistaken for an OOM or a failure.
    ``oom_kill_moved`` says whether the ``oom_kill`` count of the task's cgroup moved during
    its run (``None``: it could not be read), which tells the OOM killer's SIGKILL from
    another's.
    """
    if stop_reason is not None:
        return stop_reason, f"stopped by executor (exit {returncode})"
    if returncode == 0:
        # Its own word: a task that caught an out-of-memory error and went on with less
        # (a smaller batch) finished, whatever its stderr says.
        return "finished", "exit 0"
    marker = next((m for m in OOM_MARKERS if m in stderr_tail), None)
    if marker:
        return "oom_killed", f"out of memory: {marker!r} on stderr (exit {returncode})"
    if returncode in SIGKILLED:
        if oom_kill_moved is None:
            return "oom_killed", (f"killed by SIGKILL not sent by the executor (exit {returncode}), taken "
                                  f"for the OOM killer: whether it was could not be told (its cgroup's "
                                  f"oom_kill count cannot be read)")
        if oom_kill_moved:
            return "oom_killed", (f"killed by the OOM killer (exit {returncode}: the cgroup's oom_kill count "
                                  f"moved)")
        return "failed", (f"killed by SIGKILL (exit {returncode}; not an OOM: the cgroup's oom_kill count "
                          f"did not move)")
    tail = stderr_tail.strip().splitlines()[-1:] or [""]
    return "failed", f"exit {returncode}: {tail[0][:200]}"


def child_env(
    base: Mapping[str, str],
    env: Mapping[str, str],
    task_id: str,
    placement: Sequence[Placement],
    *,
    restore: bool,
    run: str = "",
) -> dict[str, str]:
    """The environment a task's process gets (pure, so it can be tested without processes):
    the node's (``base``) without the executor's own settings, then what the task was given."""
    # A task is user code: the executor's settings (``FLEETPILOT_*``) include the NATS URL with
    # its credentials, which let a task write the ledger or publish decisions. The variables
    # the executor means a task to have are set below or come with ``env``.
    full = {k: v for k, v in base.items() if not k.startswith(EXECUTOR_ENV_PREFIXES)}
    full.update(env)
    gpus = gpus_of(placement)
    full["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    # Those are NVML's indices (the collector's, the ledger's), which follow the PCI bus;
    # CUDA numbers devices fastest first unless told otherwise, so on a node of mixed boards
    # the task ran on others than it was given. Set over the task's own, as its GPUs are.
    full["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    full["FLEETPILOT_TASK_ID"] = task_id
    shares = [p.milli for p in placement if p.gpu >= 0]
    if shares and max(shares) < 1000:
        full["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, max(shares) // 10))
    if restore:
        full["FLEETPILOT_RESTORE"] = "1"
    if run:
        full["FLEETPILOT_RUN_ID"] = run
    return full


def _started_over(resumes: bool) -> str:
    """What a move's event adds for a task that cannot resume."""
    return "" if resumes else f": {STARTED_OVER}"


class _Task:
    """One running process and what we know about it."""

    def __init__(
        self, task_id: str, placement: list[Placement], command: list[str], env: dict[str, str]
    ) -> None:
        self.task_id = task_id
        self.placement = placement
        self.command = command
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.stop_reason: StopReason = None
        self.stderr = bytearray()
        self.watcher: asyncio.Task[None] | None = None
        # An eviction reached it: a move under way must not start it again.
        self.evicted = False
        # This run's id (``FLEETPILOT_RUN_ID``, each start, restart or move its own) and when
        # its process was started (clock ticks since boot, taken just before): a process that
        # carries the id in its environment and started since is the run's (``_signal_task``).
        self.run = ""
        self.since = 0
        # The file that counts the OOM kills of the cgroup its process runs in and that count
        # at the start, or why they cannot be read (``_oom_kills``).
        self.oom_kills: tuple[Path, int] | str = ""
        # This run's log as the executor opened it for the task's stdout, kept open while the
        # run lasts: the log is cut through it (``cap_logs``), whatever its name says now (an
        # operator's ``rm`` or a rename left the task writing, uncapped, to a file no path named).
        self.log: BinaryIO | None = None

    @property
    def marker(self) -> bytes:
        """What the environment of each of this run's processes holds."""
        return _marker(self.task_id, self.run)


class ProcessBackend:
    """An :class:`~fleetpilot.executor.backend.ExecutorBackend` running OS processes."""

    name = "process"

    def __init__(
        self,
        *,
        node: str = "",
        limit_address_space: bool = False,
        headroom_mb: int = 512,
        checkpoint_signal: signal.Signals = signal.SIGUSR1,
        checkpoint_s: float = 1.0,
        inherit_env: bool = True,
        log_dir: Path | None = None,
        clock: Clock = time.time,
        take_over: TakeOver | None = None,
        registry: Path | None = None,
        log_max_bytes: int = LOG_MAX_BYTES,
        cgroup_root: Path = CGROUP_ROOT,
    ) -> None:
        """Configure the backend; see the module docstring for what each knob does."""
        self.node = node
        self._take_over_from = take_over
        # Where the pids of the running tasks are kept, for a backend started after this one
        # died without stopping them (``stop_left_behind``).
        self._registry = registry
        self._closed = False
        # Tasks handed over to another node: (when, command, env, placement here, whether it
        # resumes), to answer a repeat, and to take one back that no move took (``take_back``).
        self._handed: OrderedDict[str, tuple[float, list[str], dict[str, str], list[Placement], bool]] = OrderedDict()
        self._limit_as = limit_address_space
        self._headroom_mb = headroom_mb
        self._checkpoint_signal = checkpoint_signal
        self._checkpoint_s = checkpoint_s
        self._inherit_env = inherit_env
        self._log_dir = log_dir
        self._log_max_bytes = log_max_bytes
        self._cgroup_root = cgroup_root
        self._clock = clock
        self._tasks: dict[str, _Task] = {}
        self._events: deque[TaskLifecycle] = deque()
        # Readers of the stderr of tasks that ended while something outside their session
        # held it open (see ``_watch``).
        self._readers: set[asyncio.Task[None]] = set()
        # Starts failed in a row for the node's fault, and the last such failure.
        self._node_failures = 0
        self._node_failure = ""

    def _emit(
        self, task: _Task, state: LifecycleState, *, exit_code: int | None = None, detail: str = ""
    ) -> None:
        self._events.append(
            TaskLifecycle(
                task_id=task.task_id,
                state=state,
                node=node_of(task.placement) or self.node,
                gpus=gpus_of(task.placement),
                exit_code=exit_code,
                detail=detail,
                at=self._clock(),
            )
        )

    def _memory_limit_mb(self, placement: Sequence[Placement]) -> int | None:
        memory = sum(p.memory_mb for p in placement)
        return memory + self._headroom_mb if self._limit_as and memory > 0 else None

    def _argv(self, task: _Task, env: Mapping[str, str]) -> list[str]:
        """The command line to exec, behind the address-space launcher when a cap applies.

        The cap is set by a tiny Python launcher that calls ``setrlimit`` and then ``exec``s
        the task (same pid), rather than by ``preexec_fn``, which is unsafe in a process
        that runs threads (the SQLite store and ``asyncio.to_thread`` do).
        """
        limit_mb = self._memory_limit_mb(task.placement)
        if limit_mb is None:
            return task.command
        # Looked up as the launcher's ``execvp`` will (the task's ``PATH``): the launcher itself
        # always starts, so a command that is not there was told ``started``, then ``failed``
        # with exit 127, where without the cap its start is refused for good.
        if shutil.which(task.command[0], path=env.get("PATH", os.defpath)) is None:
            raise BackendError(f"cannot start {task.task_id}: no executable {task.command[0]!r} "
                               f"(not found, or not executable, on the task's PATH)")
        inherited = resource.getrlimit(resource.RLIMIT_AS)[0]
        return [sys.executable, "-c", _RLIMIT_LAUNCHER, str(limit_mb * 1024 * 1024), str(inherited), *task.command]

    async def _spawn(self, task: _Task, *, restore: bool) -> TaskHandle:
        began = time.perf_counter()
        base = os.environ if self._inherit_env else {"PATH": os.environ.get("PATH", "")}
        stdout: int | object = asyncio.subprocess.DEVNULL
        spawned = False
        try:
            try:
                stdout = self._open_log(task.task_id)
            except OSError as error:
                # The log directory is the node's: whatever the task, it is at fault.
                raise self._node_fault(f"cannot start {task.task_id}: its log: {error}") from error
            task.run, task.since = secrets.token_hex(8), _ticks_now()
            env = child_env(base, task.env, task.task_id, task.placement, restore=restore, run=task.run)
            task.proc = await asyncio.create_subprocess_exec(
                *self._argv(task, env),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=stdout,  # type: ignore[arg-type]
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # its own process group, so eviction reaches its children
            )
            spawned = True
        except OSError as error:
            if error.errno in NODE_FAULT_ERRNOS:
                raise self._node_fault(f"cannot start {task.task_id}: {error}") from error
            raise BackendError(f"cannot start {task.task_id}: {error}") from error
        except ValueError as error:
            # A NUL byte in the command or environment, an ``=`` in a variable's name: this
            # command can never start, wherever it is placed.
            raise BackendError(f"cannot start {task.task_id}: bad command or environment: {error}") from error
        finally:
            if not spawned and not isinstance(stdout, int):
                stdout.close()  # type: ignore[attr-defined]
        # The run's watcher closes it when the run's process ends.
        task.log = None if isinstance(stdout, int) else stdout  # type: ignore[assignment]
        self._node_failures, self._node_failure = 0, ""
        # It runs here now (moved back, placed here again, taken back): a hand-over of it
        # before is settled. Kept, the next hand-over was answered from it without stopping
        # the task (run on two nodes), and ``take_back`` started it a second time here.
        self._handed.pop(task.task_id, None)
        task.stop_reason = None
        task.stderr = bytearray()
        # Read at once: a count that moves before it is read hides this task's own OOM.
        task.oom_kills = _oom_kills(self._cgroup_root, task.proc.pid)
        task.watcher = asyncio.create_task(self._watch(task, task.proc, task.log))
        self._tasks[task.task_id] = task
        self._save_registry()
        return TaskHandle(
            task_id=task.task_id,
            backend=self.name,
            node=node_of(task.placement) or self.node,
            gpus=gpus_of(task.placement),
            pid=task.proc.pid,
            started_at=self._clock(),
            latency_ms=(time.perf_counter() - began) * 1000.0,
        )

    def _open_log(self, task_id: str) -> int | object:
        """The file the task's stdout goes to (``DEVNULL`` without a log directory)."""
        if self._log_dir is None:
            return asyncio.subprocess.DEVNULL
        self._log_dir.mkdir(parents=True, exist_ok=True)
        # Read as well as appended to: a log cut (``cap_logs``) keeps what it held.
        return open(self._log_dir / log_name(task_id), "a+b")  # noqa: SIM115 - the run owns it

    def _node_fault(self, message: str) -> BackendError:
        """The retryable error of a start that failed for the node's fault, counted."""
        self._node_failures += 1
        self._node_failure = message
        return BackendError(message, retryable=True)

    @property
    def node_trouble(self) -> str:
        """What is wrong with this node, after ``TROUBLE_AFTER_FAILURES`` starts in a row
        failed for its fault (empty when nothing is known to be)."""
        if self._node_failures < TROUBLE_AFTER_FAILURES:
            return ""
        return f"{self._node_failures} starts in a row failed on {self.node or 'this node'}, the last: {self._node_failure}"

    async def recheck_node(self) -> str:
        """Try a start of nothing (``python -c pass``, logged as a task's would be) on a
        node in trouble, and end the trouble when it works; ``node_trouble`` after it. A
        node taken out of service gets no more tasks whose start could tell it is well."""
        if not self.node_trouble:
            return ""
        stdout: int | object = asyncio.subprocess.DEVNULL
        try:
            stdout = self._open_log("fleetpilot-node-check")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", "pass", stdin=asyncio.subprocess.DEVNULL,
                stdout=stdout,  # type: ignore[arg-type]
                stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
            await proc.wait()
        except OSError as error:
            self._node_failure = f"the trial start: {error}"
            return self.node_trouble
        finally:
            if not isinstance(stdout, int):
                stdout.close()  # type: ignore[attr-defined]
        log.warning("%s starts processes again (a trial start worked): back in service", self.node or "this node")
        self._node_failures, self._node_failure = 0, ""
        return ""

    @staticmethod
    async def _read_stderr(task: _Task, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        while chunk := await proc.stderr.read(4096):
            task.stderr.extend(chunk)
            del task.stderr[:-STDERR_TAIL_BYTES]  # keep only the tail: markers come last

    async def _watch(self, task: _Task, proc: asyncio.subprocess.Process, log_file: BinaryIO | None) -> None:
        """Report the task's end when its process exits, then close the run's log.

        The end is the task's process's exit, not the close of its stderr: a child it left
        running keeps stderr open (and ``proc.wait()`` waits for that too), which kept a
        finished task "running" and its eviction waiting for as long as the child lived.
        """
        try:
            await self._watch_run(task, proc)
        finally:
            if log_file is not None:
                log_file.close()

    async def _watch_run(self, task: _Task, proc: asyncio.subprocess.Process) -> None:
        reader = asyncio.create_task(self._read_stderr(task, proc))
        while proc.returncode is None and not reader.done():
            await asyncio.wait({reader}, timeout=EXIT_POLL_S)
        if reader.done():
            returncode = await proc.wait()
            if task.stop_reason is None:
                # What it left running without its stderr (``worker 2>log &``) is killed too.
                _signal_task(proc.pid, task.marker, task.since, signal.SIGKILL)
        else:
            if task.stop_reason is None:
                # It ended by itself: what it left in its process group would hold its GPUs
                # once they are given back (as a container's processes die with its main
                # one). A task being stopped has its group killed when the grace is over.
                _signal_task(proc.pid, task.marker, task.since, signal.SIGKILL)
            try:
                await asyncio.wait_for(asyncio.shield(reader), timeout=STDERR_DRAIN_S)
            except TimeoutError:
                # Held by a process that left the session: the tail so far does. The reader
                # goes on (kept here) until that process closes it, so the pipe is not left
                # unread and its transport closes then.
                self._readers.add(reader)
                reader.add_done_callback(self._readers.discard)
            assert proc.returncode is not None
            returncode = proc.returncode
        if self._tasks.get(task.task_id) is task and task.proc is proc:
            if task.stop_reason != "migrated":  # the migration reports its own event
                del self._tasks[task.task_id]
                self._save_registry()
            state, detail = classify_exit(returncode, task.stderr.decode(errors="replace"), task.stop_reason,
                                          self._oom_kill_moved(task)
                                          if returncode in SIGKILLED and task.stop_reason is None else None)
            if task.stop_reason != "migrated":
                self._emit(task, state, exit_code=returncode, detail=detail)

    @staticmethod
    def _oom_kill_moved(task: _Task) -> bool | None:
        """Whether the ``oom_kill`` count of the task's cgroup moved since its start (``None``:
        it cannot be read)."""
        if isinstance(task.oom_kills, str):
            log.info("cannot tell whether %s was OOM-killed: %s", task.task_id, task.oom_kills)
            return None
        events, at_start = task.oom_kills
        try:
            return _read_oom_kill(events) != at_start
        except (OSError, ValueError) as error:
            log.info("cannot tell whether %s was OOM-killed: %s", task.task_id, error)
            return None

    async def start(
        self, task_id: str, placement: Sequence[Placement], command: Sequence[str], env: Mapping[str, str]
    ) -> TaskHandle:
        """Start ``command`` as a process of its own session; raises if the task runs."""
        self._refuse_when_closed(task_id)
        if task_id in self._tasks:
            raise BackendError(f"task {task_id} is already running")
        if not command:
            raise BackendError(f"task {task_id} has no command")
        where = node_of(placement)
        if self.node and where and where != self.node:
            # A decision for another node reached this one: running it here would put the
            # task on this machine's GPUs of the same numbers.
            raise BackendError(f"task {task_id} is placed on {where}, and this backend runs on {self.node}")
        task = _Task(task_id, list(placement), list(command), dict(env))
        handle = await self._spawn(task, restore=False)
        self._emit(task, "started", detail=f"pid {handle.pid}")
        return handle

    async def _terminate(self, task: _Task, grace_s: float, reason: LifecycleState) -> None:
        proc, watcher = task.proc, task.watcher
        if proc is None or watcher is None:
            return
        if proc.returncode is None and not _exited(proc.pid) and task.stop_reason != "evicted":
            # Only an exit we cause is ours: one that came first (its watcher still reading
            # the last of stderr, or its exit not yet seen by the event loop) is the task's
            # own end, finished or failed. An eviction that came during a move stays one.
            task.stop_reason = reason
        deadline = time.monotonic() + max(grace_s, 0.0)
        _signal_task(proc.pid, task.marker, task.since, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(watcher), timeout=max(grace_s, 0.0))
        except TimeoutError:
            pass
        # The task's process may be gone within the grace while others of its group (its
        # children) still run: they get the rest of the grace, then SIGKILL, as it would.
        while time.monotonic() < deadline and _group_alive(proc.pid):
            await asyncio.sleep(0.05)
        # Unconditionally: a group whose leader is a zombie for a moment reads as gone.
        _signal_task(proc.pid, task.marker, task.since, signal.SIGKILL)
        await watcher

    async def stop(self, task_id: str, grace_s: float) -> None:
        """Evict: SIGTERM to the process group, SIGKILL after ``grace_s``; no-op if not running."""
        task = self._tasks.get(task_id)
        if task is not None:
            task.evicted = True
            await self._terminate(task, grace_s, "evicted")

    async def migrate(
        self,
        task_id: str,
        target: Sequence[Placement],
        *,
        source: Sequence[Placement] = (),
        grace_s: float = 5.0,
        resumes: bool = True,
    ) -> TaskHandle:
        """Checkpoint signal, stop, restart on ``target`` with ``FLEETPILOT_RESTORE=1``; for a
        task that cannot resume (``resumes`` false), a stop and a start over.

        The new process starts on this machine. A task running here moves within the node
        only: a target on another node is refused with the task left running (a restart
        here under the other node's GPU numbers would run it on the wrong GPUs). A task
        that runs on another node (``source``) is taken over from there, when this backend
        was given ``take_over``: the source's backend checkpoints and stops it
        (``hand_over``), and it restarts here from that checkpoint (over, when it cannot
        resume)."""
        task = self._tasks.get(task_id)
        if task is None or task.proc is None or task.watcher is None:
            return await self._take_over(task_id, target, source, grace_s, resumes)
        origin = list(task.placement)
        if node_of(target) != node_of(origin):
            raise BackendError(f"task {task_id} runs on {node_of(origin)}: the process backend moves a task "
                               f"within its node only, not to {node_of(target)}")
        await self._checkpoint_and_stop(task, grace_s, resumes=resumes)
        task.placement = list(target)
        try:
            handle = await self._spawn(task, restore=resumes)
        except BackendError as error:
            # The old process is gone and the new one did not start: the task is lost.
            del self._tasks[task_id]
            self._save_registry()
            self._emit(task, "failed", detail=f"migration restart failed: {error}")
            raise
        if task.evicted:
            # Evicted while it restarted (told evicted, its holds given back): not run here.
            await self._terminate(task, grace_s, "evicted")
            raise BackendError(f"task {task_id} was evicted during its move")
        self._emit(task, "migrated", detail=f"from {_describe(origin)} to {_describe(target)}, pid {handle.pid}"
                                            f"{_started_over(resumes)}")
        return handle

    async def _checkpoint_and_stop(self, task: _Task, grace_s: float, *, resumes: bool) -> None:
        """The checkpoint signal, ``checkpoint_s`` to save (the task may exit by itself),
        then a stop with grace; only the stop for a task that cannot resume. The exit is the
        move's, not the end of the task."""
        assert task.proc is not None and task.watcher is not None
        if task.proc.returncode is not None or _exited(task.proc.pid):
            # It ended by itself before its move reached it (its exit perhaps not yet seen
            # by the event loop): that end is told as such, and it is not run again.
            await task.watcher
            raise BackendError(f"task {task.task_id} ended before its move")
        task.stop_reason = "migrated"
        if resumes:
            try:
                os.kill(task.proc.pid, self._checkpoint_signal)
                await asyncio.wait_for(asyncio.shield(task.watcher), timeout=self._checkpoint_s)
            except (ProcessLookupError, TimeoutError):
                pass  # gone already, or still saving: the stop below finishes it
        await self._terminate(task, grace_s, "migrated")
        if task.evicted:
            # An eviction reached it during its move (its GPU decommissioned, a preemption,
            # the executor stopping): it was told evicted and its holds were given back, to
            # be placed again. Started on the target all the same, it ran twice.
            if self._tasks.get(task.task_id) is task:
                # Its exit was taken for the move's (it saved and exited before the
                # eviction came): told now as the eviction it is.
                del self._tasks[task.task_id]
                self._save_registry()
                self._emit(task, "evicted", exit_code=task.proc.returncode, detail="evicted during its move")
            raise BackendError(f"task {task.task_id} was evicted during its move")

    async def _take_over(
        self, task_id: str, target: Sequence[Placement], source: Sequence[Placement], grace_s: float, resumes: bool
    ) -> TaskHandle:
        """Restart here a task that ran on ``source``'s node, stopped there by its backend."""
        self._refuse_when_closed(task_id)
        origin, where = node_of(source), node_of(target)
        if self._take_over_from is None or not origin or origin == where:
            raise BackendError(f"task {task_id} is not running here (the process backend moves a task "
                               f"within its node only)")
        if self.node and where != self.node:
            raise BackendError(f"task {task_id} moves to {where}, and this backend runs on {self.node}")
        command, env = await self._take_over_from(origin, task_id, grace_s, resumes)
        task = _Task(task_id, list(target), list(command), dict(env))
        try:
            handle = await self._spawn(task, restore=resumes)
        except BackendError as error:
            # Stopped at the source and not started here: the task is lost, and what it
            # held at the source goes with it (the event names the source).
            self._tasks.pop(task_id, None)
            self._save_registry()
            self._emit(_Task(task_id, list(source), task.command, task.env), "failed",
                       detail=f"migration restart on {where} failed: {error}")
            raise
        self._emit(task, "migrated", detail=f"from {_describe(source)} to {_describe(target)}, pid {handle.pid}"
                                            f"{_started_over(resumes)}")
        return handle

    async def hand_over(self, task_id: str, grace_s: float, *, resumes: bool = True) -> tuple[list[str], dict[str, str]]:
        """Checkpoint and stop a task that moves to another node (only stop one that cannot
        resume, ``resumes`` false), and give what restarts it there: its command and
        environment. Its life goes on there, so nothing is reported here. Asked again (an
        answer lost on the way), it gives the same."""
        handed = self._handed.get(task_id)
        if handed is not None and self._clock() - handed[0] <= HANDED_OVER_KEPT_S:
            return list(handed[1]), dict(handed[2])
        task = self._tasks.get(task_id)
        if task is None or task.proc is None or task.watcher is None:
            raise BackendError(f"task {task_id} is not running on {self.node or 'this node'}")
        await self._checkpoint_and_stop(task, grace_s, resumes=resumes)
        self._tasks.pop(task_id, None)
        self._save_registry()
        self._handed[task_id] = (self._clock(), list(task.command), dict(task.env), list(task.placement), resumes)
        while len(self._handed) > 10_000:
            self._handed.popitem(last=False)
        return list(task.command), dict(task.env)

    def handed_over_before(self, at: float) -> list[str]:
        """The tasks handed over at or before ``at`` (this backend's clock), not yet settled
        (``settle_hand_over``) or taken back."""
        return [task_id for task_id, (handed_at, *_) in self._handed.items() if handed_at <= at]

    def settle_hand_over(self, task_id: str) -> None:
        """Forget a hand-over whose move is known to have taken the task."""
        self._handed.pop(task_id, None)

    async def take_back(self, task_id: str) -> TaskHandle:
        """Restart here, on the placement it had, a task handed over for a move that never
        took it (every answer lost, or the target gave up after the task was stopped): from
        the checkpoint it saved, with ``FLEETPILOT_RESTORE=1`` (over, for a task that cannot
        resume), told ``started``."""
        self._refuse_when_closed(task_id)
        handed = self._handed.pop(task_id, None)
        if handed is None:
            raise BackendError(f"task {task_id} was not handed over from {self.node or 'this node'}")
        _, command, env, placement, resumes = handed
        task = _Task(task_id, placement, command, env)
        try:
            handle = await self._spawn(task, restore=resumes)
        except BackendError as error:
            # Stopped for its move and not started again here: told as lost (its holds here
            # go back then), as a move whose restart failed is. Untold, its hold stayed in the
            # ledger for ever and the policy took it as running.
            self._emit(task, "failed", detail=f"restart after a move that never took it failed: {error}")
            raise
        how = "from its checkpoint" if resumes else "and started over"
        self._emit(task, "started", detail=f"pid {handle.pid}: taken back {how}, its move never took it")
        return handle

    async def resize(self, task_id: str, milli: int, memory_mb: int) -> None:
        """Record the new share (used at the next start); cap memory live when enabled."""
        task = self._tasks.get(task_id)
        if task is None:
            raise BackendError(f"task {task_id} is not running here")
        if task.proc is not None and (task.proc.returncode is not None or _exited(task.proc.pid)):
            # It ended by itself (its exit not yet told by ``poll``): resized and executed, the
            # resize was told after (or before) the task's own end, as if it ran on.
            raise BackendError(f"task {task_id} ended before its resize")
        task.placement = [
            Placement(node=p.node, gpu=p.gpu, milli=milli, memory_mb=memory_mb) if p.gpu >= 0 else p
            for p in task.placement
        ]
        limit_mb = self._memory_limit_mb(task.placement)
        if limit_mb is not None and task.proc is not None:
            limit = limit_mb * 1024 * 1024
            try:
                # The soft limit only (see ``_RLIMIT_LAUNCHER``), within the hard one.
                _, hard = resource.prlimit(task.proc.pid, resource.RLIMIT_AS)
                if hard != resource.RLIM_INFINITY:
                    limit = min(limit, hard)
                resource.prlimit(task.proc.pid, resource.RLIMIT_AS, (limit, hard))
            except (ProcessLookupError, PermissionError, ValueError) as error:
                raise BackendError(f"cannot cap memory of {task_id}: {error}", retryable=True) from error
        self._emit(task, "resized", detail=f"milli={milli} memory_mb={memory_mb}")

    async def poll(self) -> list[TaskLifecycle]:
        """Lifecycle changes since the last poll, oldest first (and the logs kept within
        their cap, ``cap_logs``: the executor polls every second)."""
        await self.cap_logs()
        events = list(self._events)
        self._events.clear()
        return events

    async def cap_logs(self) -> None:
        """Cut each running task's log that grew past ``log_max_bytes``: its content goes to
        ``<log>.1`` (replacing the part kept before), and the log starts again empty. A task
        that prints for days filled the node's disk, and then every start on the node failed
        (its checkpoints with them). The task writes on: its log was opened to append, so it
        writes at the new end (lines written while the copy is made are lost, as with
        logrotate's ``copytruncate``)."""
        if self._log_dir is None or self._log_max_bytes <= 0:
            return
        for task in list(self._tasks.values()):
            log_file = task.log
            if log_file is None or log_file.closed:
                continue
            path = self._log_dir / log_name(task.task_id)
            try:
                # The file the task writes to, by its descriptor: the path may name another
                # file now (removed or renamed by an operator, or logrotate) or none.
                if os.fstat(log_file.fileno()).st_size <= self._log_max_bytes:
                    continue
                # A descriptor of its own for the thread: the run's watcher may close the
                # log meanwhile, and its number be given to another file.
                fd = os.dup(log_file.fileno())
            except (OSError, ValueError) as error:
                log.warning("cannot cut the log %s of %s: %s", path, task.task_id, error)
                continue
            try:
                await asyncio.to_thread(_cut_log, fd, path)
            except OSError as error:
                log.warning("cannot cut the log %s of %s: %s", path, task.task_id, error)
            finally:
                os.close(fd)

    def running(self) -> list[str]:
        """Ids of the tasks with a live process."""
        return sorted(self._tasks)

    def ended_untold(self, task_id: str) -> bool:
        """Whether the task's process ended by itself and ``poll`` has not told it yet (an
        eviction that comes now finds nothing to stop, and its end is still to be told)."""
        return task_id not in self._tasks and any(
            e.task_id == task_id and e.state in ("finished", "failed", "oom_killed") for e in self._events
        )

    def samples(self) -> list[ProcessSample]:
        """Resident memory of each running task's main process, from ``/proc``."""
        out = []
        for task in self._tasks.values():
            if task.proc is None or task.proc.returncode is not None:
                continue
            rss = _rss_mb(task.proc.pid)
            if rss is not None:
                out.append(
                    ProcessSample(task_id=task.task_id, pid=task.proc.pid, rss_mb=rss, at=self._clock())
                )
        return out

    def _save_registry(self) -> None:
        if self._registry is None:
            return
        # With each pid its start time: a pid the kernel has given to another process since
        # is not that task's.
        pids = {t.task_id: [t.proc.pid, _started_at(t.proc.pid), t.run] for t in self._tasks.values()
                if t.proc is not None}
        try:
            self._registry.parent.mkdir(parents=True, exist_ok=True)
            partial = self._registry.with_suffix(".partial")
            partial.write_text(json.dumps(pids, sort_keys=True))
            partial.replace(self._registry)  # a crash never leaves half a file
        except OSError as error:
            # A safety net for after a crash, no more: raised, it failed a start whose
            # process ran on (the task placed again, run twice) or swallowed a task's end
            # (its GPUs held for ever). The next change writes the whole table again.
            log.warning("cannot write the process registry %s: %s", self._registry, error)

    async def stop_left_behind(self, grace_s: float) -> dict[str, bool]:
        """Stop the processes a backend before this one left running (it died without
        stopping them: children lead their own sessions and outlive it), from the
        ``registry``. Per task it had: whether its process was still there to stop."""
        if self._registry is None or not self._registry.exists():
            return {}
        try:
            # A run id is missing from the file of an executor before runs had them.
            left = {str(k): (int(v[0]), v[1], str(v[2]) if len(v) > 2 else "")
                    for k, v in json.loads(self._registry.read_text()).items()}
        except (OSError, ValueError, AttributeError, TypeError, IndexError, KeyError):
            left = {}
        found: dict[str, bool] = {}
        for task_id, (pid, started, run) in left.items():
            if task_id in self._tasks:
                continue
            marker = _marker(task_id, run)
            found[task_id] = _still_the_task(marker, pid, started)
            if found[task_id]:
                _signal_task(pid, marker, started, signal.SIGTERM)
                deadline = time.monotonic() + max(grace_s, 0.0)
                while _group_alive(pid) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                _signal_task(pid, marker, started, signal.SIGKILL)
        self._save_registry()
        return found

    def close(self) -> None:
        """Take no new task from now on (the executor is stopping): a start or a take-over
        fails as retryable, for the task to be placed elsewhere."""
        self._closed = True

    def _refuse_when_closed(self, task_id: str) -> None:
        if self._closed:
            raise BackendError(f"task {task_id} not started: the executor of {self.node or 'this node'} is "
                               f"stopping", retryable=True)

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Close, and evict every running task (the executor itself stops)."""
        self.close()
        await asyncio.gather(*(self.stop(task_id, grace_s) for task_id in list(self._tasks)))


def log_name(task_id: str) -> str:
    """The file name of a task's stdout in ``log_dir``: task ids are chosen by clients, so a
    ``/`` (or a ``..``) must not reach another folder, and an id longer than a file name may
    be is cut, with a digest of the whole id so that two long ids keep logs of their own."""
    name = task_id.replace("%", "%25").replace("/", "%2F")
    # Room is left for the name of its kept part (``cap_logs``).
    if len(name.encode()) + len(".out" + LOG_KEPT_SUFFIX) <= LOG_NAME_MAX_BYTES:
        return name + ".out"
    # Its open failed with ENAMETOOLONG, taken for the node's fault: a few such tasks took
    # every node they were placed on out of service.
    digest = hashlib.sha256(task_id.encode()).hexdigest()[:16]
    head = name.encode()[: LOG_NAME_MAX_BYTES - len(digest) - len("~.out" + LOG_KEPT_SUFFIX)].decode(errors="ignore")
    return f"{head}~{digest}.out"


def _cut_log(fd: int, path: Path) -> None:
    """Copy the log open as ``fd`` (named ``path``) to its kept part, then empty it
    (``ProcessBackend.cap_logs``). The log is emptied even when its kept part cannot be
    written (a full disk, a kept part that is not a file): the cap is what keeps the node's
    disk, and a copy that failed left the log growing for ever."""
    kept = path.with_name(path.name + LOG_KEPT_SUFFIX)
    size = os.fstat(fd).st_size  # no more: a task that writes faster than this copies is not followed
    try:
        with open(kept, "wb") as out:
            offset = 0
            while offset < size and (chunk := os.pread(fd, min(1 << 20, size - offset), offset)):
                out.write(chunk)
                offset += len(chunk)
    except OSError as error:
        log.warning("the log %s is cut without keeping its content in %s: %s", path, kept, error)
        with contextlib.suppress(OSError):
            kept.unlink()  # part of a copy: the room it takes is what a full disk lacks
    os.ftruncate(fd, 0)


def oom_kill_counter(cgroup_root: Path, proc_cgroup: str) -> Path:
    """The file that counts the OOM kills of a process's cgroup, under ``cgroup_root``, given
    its ``/proc/<pid>/cgroup`` (``proc_cgroup``); ``ValueError`` where it has none.

    The memory controller is bound to one hierarchy. Under cgroup v1 (or a hybrid tree, whose
    v2 part then has no memory controller) that is the line naming ``memory``, counted in
    ``<root>/memory/<path>/memory.oom_control`` (kernel 4.13 and later); under v2 alone, the
    ``0::`` line, counted in ``<root>/<path>/memory.events``."""
    lines = [line.split(":", 2) for line in proc_cgroup.splitlines() if line.strip()]
    if any(len(parts) != 3 for parts in lines):
        raise ValueError(f"not a /proc/<pid>/cgroup: {proc_cgroup[:200]!r}")
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):
            return cgroup_root / "memory" / path.lstrip("/") / "memory.oom_control"
    for hierarchy, controllers, path in lines:
        if hierarchy == "0" and not controllers:
            return cgroup_root / path.lstrip("/") / "memory.events"
    raise ValueError("in no cgroup with a memory controller")


def _oom_kills(cgroup_root: Path, pid: int) -> tuple[Path, int] | str:
    """The file that counts the OOM kills of the cgroup process ``pid`` runs in
    (``oom_kill_counter``) and its ``oom_kill`` count now; or why they cannot be read."""
    try:
        counter = oom_kill_counter(cgroup_root, Path(f"/proc/{pid}/cgroup").read_text())
        return counter, _read_oom_kill(counter)
    except (OSError, ValueError) as error:
        return f"process {pid}: {error}"


def _read_oom_kill(events: Path) -> int:
    """The ``oom_kill`` count of a cgroup's ``memory.events`` (v2) or ``memory.oom_control``
    (v1), both lines of ``key value``: the processes of the cgroup (and, v2, of those below
    it) killed by an OOM killer."""
    for line in events.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    raise ValueError(f"no oom_kill in {events}")


def _exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited, though the event loop may not know yet (a
    zombie, or reaped by the child watcher's thread), without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True  # reaped already


def _group_alive(pid: int) -> bool:
    """Whether the process group ``pid`` leads still has a member (a zombie counts as
    gone)."""
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # not the leader any more, but a member lives on


def _marker(task_id: str, run: str) -> bytes:
    """The variable each process of a task's run has in its environment: its run id (unique,
    so that another executor's run of a task of the same id is not taken for it), or, for a
    run started before runs had ids, its task id."""
    return f"FLEETPILOT_RUN_ID={run}".encode() if run else f"FLEETPILOT_TASK_ID={task_id}".encode()


def _still_the_task(marker: bytes, pid: int, started: int | None) -> bool:
    """Whether the process group that ``pid`` led is still the task's, its leader started at
    ``started`` (clock ticks since boot): the leader itself, the same pid started at the same
    time; or, the leader gone (the task's main process ended while no executor watched it,
    and its children ran on), a process that started no earlier and carries the run's
    ``marker`` in the environment it was started with (``_carrying``), in the group or not."""
    if started is None:
        return False
    if _started_at(pid) == started:
        return _group_alive(pid)
    return bool(_carrying(marker, started))


def _carrying(marker: bytes, since: int) -> list[int]:
    """The live (not zombie) processes started at or after ``since`` (clock ticks since boot)
    whose environment, as they were started with it, holds ``marker`` (``_marker``): a run's
    processes, those that left its process group (``setsid``, a daemon) too."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z" or int(fields[19]) < since:
                continue
            environ = Path(f"/proc/{entry.name}/environ").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # ended while we looked, or not ours to read
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _signal_task(pid: int, marker: bytes, since: int | None, sig: signal.Signals) -> None:
    """Signal a task's process group (``pid`` leads it) and the run's processes that left the
    group (``_carrying`` ``marker`` since ``since``). A daemon the task started in a session of its
    own (``setsid``, ``ray start``, a double fork) is out of reach of the group's signals:
    it ran on after the task ended or was evicted, holding the GPUs given back."""
    _signal_group(pid, sig)
    if since is None:
        return
    for stray in _carrying(marker, since):
        try:
            os.kill(stray, sig)
        except (ProcessLookupError, PermissionError):
            pass  # gone meanwhile


def _ticks_now() -> int:
    """Now, in the clock ticks since boot that ``/proc/<pid>/stat`` gives start times in, one
    tick early: a process started after this reads as started at or after it."""
    return max(0, int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK")) - 1)


def _started_at(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own session, so its pgid is its pid
    except (ProcessLookupError, PermissionError):
        pass  # gone, or a process group that is not ours


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        return None
    return None


def _describe(placement: Sequence[Placement]) -> str:
    return ",".join(f"{p.node}/{p.gpu}" for p in placement) or "-"

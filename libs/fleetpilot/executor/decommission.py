"""Pre-decommission of overheating GPUs: cordon, drain, then pull — once, fleet-wide.

A GPU above ``threshold_c`` (85 °C) for ``hot_for_s`` (5 minutes) is not pulled at once:

1. **cordon**: no new work goes to it (``before_assign`` refuses it);
2. **drain**: running tasks may finish, for up to ``drain_s`` (30 minutes);
3. **decommission**: when it is empty or the drain time is over (remaining tasks are
   evicted).

:func:`step` is the pure state machine (time is an argument, so tests fast-forward).
:class:`PreDecommissionHook` runs it in an executor: every replica observes the same
samples and keeps the same state, but only the one holding the GPU's :class:`HookLock`
(TTL ``lock_ttl_s`` = 35 minutes, longer than the drain) emits commands. When it is done it
leaves a ``.done`` marker so no one repeats the work after the lock expires; if it dies
mid-drain, the lock expires and another replica takes over where the state says it is.
The marker lives as long as the lock store keeps it: ``done_ttl_s`` asks a week, and the
executor's ``hook_locks`` bucket caps every key at its 35-minute TTL. Past that, the
executor service skips a GPU whose topology labels say ``decommissioned`` (what the
procedure's last command writes), so no replica starts it again.
Cordon and decommission commands are idempotent for whoever carries them out.

The procedure follows the *board*, by its NVML ``uuid``, not its index: indices renumber
when a GPU falls off the bus or a board is swapped, and by index a hot board's cordon went
to the healthy board that took its number while the hot board started over as healthy.
A sample without a uuid (NVML could not read it: a board falling off the bus) belongs to
the board last seen at its index; a GPU no uuid was ever read for is followed by its index.
Each command names the board's uuid and the index it reads at *now*, and its lock is the
board's (:func:`lock_key`). Lock entries an earlier version left, keyed by index, are still
honoured for the board at that index (see :meth:`PreDecommissionHook.observe`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from typing import Literal

import msgspec

from fleetpilot.contracts import DecisionMade, GpuSample, TaskLifecycle
from fleetpilot.fleet.boards import BoardIndex

from .business import ALLOW, HookVerdict
from .locks import Clock, HookLock

log = logging.getLogger("fleetpilot.executor")

Stage = Literal["healthy", "hot", "cordoned", "decommissioned"]
_RANK: dict[Stage, int] = {"healthy": 0, "hot": 1, "cordoned": 2, "decommissioned": 3}


class DecommissionRules(msgspec.Struct, frozen=True, kw_only=True):
    """The thresholds of the pre-decommission procedure."""

    threshold_c: float = 85.0
    hot_for_s: float = 300.0
    drain_s: float = 1800.0
    lock_ttl_s: float = 2100.0
    done_ttl_s: float = 7 * 24 * 3600.0
    """How long the ``.done`` marker is asked to last (a lock store may keep it less)."""


class GpuDecommission(msgspec.Struct, frozen=True, kw_only=True):
    """Where one GPU is in the procedure."""

    stage: Stage = "healthy"
    hot_since: float | None = None
    cordoned_at: float | None = None
    decommissioned_at: float | None = None


class Cordon(msgspec.Struct, frozen=True, kw_only=True, tag="cordon"):
    """Stop placing new work on the GPU: the board ``uuid`` (``""``: not known), which reads
    at index ``gpu`` now."""

    node: str
    gpu: int
    reason: str
    uuid: str = ""


class Decommission(msgspec.Struct, frozen=True, kw_only=True, tag="decommission"):
    """Pull the GPU (the board ``uuid``, at index ``gpu`` now) from service, evicting
    ``evict`` first."""

    node: str
    gpu: int
    evict: list[str]
    reason: str
    uuid: str = ""


Command = Cordon | Decommission


def step(
    state: GpuDecommission, temperature_c: float, running_tasks: int, now: float, rules: DecommissionRules
) -> GpuDecommission:
    """The next state after one observation (pure). A cordon is sticky: cooling down after
    it does not put the GPU back in service; an operator does that."""
    if state.stage in ("healthy", "hot"):
        if temperature_c <= rules.threshold_c:
            return GpuDecommission()
        hot_since = state.hot_since if state.hot_since is not None else now
        if now - hot_since < rules.hot_for_s:
            return GpuDecommission(stage="hot", hot_since=hot_since)
        state = GpuDecommission(stage="cordoned", hot_since=hot_since, cordoned_at=now)
    if state.stage == "cordoned":
        assert state.cordoned_at is not None
        if running_tasks == 0 or now - state.cordoned_at >= rules.drain_s:
            return msgspec.structs.replace(state, stage="decommissioned", decommissioned_at=now)
    return state


def commands_for(
    applied: Stage, target: GpuDecommission, node: str, gpu: int, running_tasks: Sequence[str], uuid: str = ""
) -> list[Command]:
    """The commands that take a GPU (the board ``uuid`` at index ``gpu``) from stage
    ``applied`` to ``target.stage`` (pure)."""
    out: list[Command] = []
    if _RANK[applied] < _RANK["cordoned"] <= _RANK[target.stage]:
        out.append(Cordon(node=node, gpu=gpu, uuid=uuid, reason=f"above threshold since {target.hot_since}"))
    if _RANK[applied] < _RANK["decommissioned"] == _RANK[target.stage]:
        out.append(Decommission(node=node, gpu=gpu, uuid=uuid, evict=sorted(running_tasks),
                                reason="drained or drain time over"))
    return out


def _kv_safe(text: str) -> str:
    """``text`` with the characters a NATS KV key refuses written ``_``."""
    return re.sub(r"[^A-Za-z0-9_=-]", "_", text)


def lock_key(node: str, gpu: int, uuid: str = "") -> str:
    """The lock key of one GPU's procedure (characters a NATS KV key accepts): the board's,
    ``decommission.<node>.uuid=<uuid>``, whatever index it reads at; by index
    (``decommission.<node>.<gpu>``, the key of earlier versions) only for a GPU whose uuid
    is not known. The ``uuid=`` keeps a board's key from ever reading as an index's."""
    board = f"uuid={_kv_safe(uuid)}" if uuid else str(gpu)
    return f"decommission.{_kv_safe(node)}.{board}"


GpuKey = tuple[str, str]
"""(node, board): the board is its uuid, or ``#<index>`` for a GPU with no uuid known."""


def _by_index(gpu: int) -> str:
    return f"#{gpu}"


class PreDecommissionHook:
    """The shipped pre-decommission hook for one executor replica (``owner``).

    Its state is kept per board (:data:`GpuKey`); ``(node, index)`` arguments name the board
    that reads at that index now, as the latest samples said (``boards``)."""

    def __init__(
        self, owner: str, lock: HookLock, *, rules: DecommissionRules | None = None, clock: Clock = time.time
    ) -> None:
        """Create the hook; ``lock`` is shared by every replica."""
        self.owner = owner
        self.rules = rules or DecommissionRules()
        self._lock = lock
        self._clock = clock
        self._states: dict[GpuKey, GpuDecommission] = {}
        self._applied: dict[GpuKey, Stage] = {}
        # The board last read at each index: what a placement's index names, and whose a
        # sample NVML could not read the uuid of is.
        self.boards = BoardIndex()

    def board_at(self, node: str, gpu: int) -> GpuKey:
        """The board that reads at ``node``/``gpu`` now, or the index itself when no uuid was
        read there."""
        return node, self.boards.get(node, gpu) or _by_index(gpu)

    def _seen(self, sample: GpuSample) -> GpuKey:
        """Note where ``sample``'s board reads now; returns its key."""
        node, gpu, uuid = sample.node, sample.gpu, sample.uuid
        if not uuid:
            return self.board_at(node, gpu)
        self.boards.seen(node, gpu, uuid)
        key, by_index = (node, uuid), (node, _by_index(gpu))
        if key not in self._states and by_index in self._states:
            # The uuid read for the first time at an index followed so far by its number (a
            # collector that could not read it before): the same board, its state goes with it.
            self._states[key] = self._states.pop(by_index)
            if by_index in self._applied:
                self._applied[key] = self._applied.pop(by_index)
        return key

    def state(self, node: str, gpu: int) -> GpuDecommission:
        """This replica's view of the board at ``node``/``gpu`` now."""
        return self._states.get(self.board_at(node, gpu), GpuDecommission())

    def board_state(self, node: str, uuid: str) -> GpuDecommission:
        """This replica's view of the board ``uuid`` of ``node``, wherever it reads."""
        return self._states.get((node, uuid), GpuDecommission())

    async def observe(self, sample: GpuSample, running_tasks: Sequence[str]) -> list[Command]:
        """Feed one sample; returns the commands this replica must carry out now (often none).

        Lock entries that an earlier version left for the GPU at this index (keyed by the
        index) are honoured for the board reading there: a live lock of another replica holds
        this one off, a ``.done`` marker says it was done. They name the GPU at that index
        when they were written, which the board there now is unless the node renumbered
        since (within the bucket's 35 minutes at most)."""
        key = self._seen(sample)
        node, board = key
        uuid = board if not board.startswith("#") else ""
        state = step(self._states.get(key, GpuDecommission()), sample.temperature_c, len(running_tasks),
                     sample.at, self.rules)
        self._states[key] = state
        applied = self._applied.get(key, "healthy")
        if _RANK[state.stage] < _RANK["cordoned"] or _RANK[state.stage] <= _RANK[applied]:
            return []
        name = lock_key(node, sample.gpu, uuid)
        legacy = lock_key(node, sample.gpu) if uuid else ""
        if await self._done(name, legacy):
            self._applied[key] = "decommissioned"  # another replica finished the procedure
            return []
        if legacy and (await self._lock.holder(legacy)) not in (None, self.owner):
            # An earlier version's replica runs it, under the index's key. Only read, not
            # taken: that replica may still take it after this read (during a rolling
            # upgrade), and then both carry the commands out, which are idempotent.
            return []
        if not await self._lock.acquire(name, self.owner, self.rules.lock_ttl_s):
            return []  # another replica runs it
        if await self._done(name, legacy):
            # The owner finished between our read of the marker above and our try for the
            # lock (it leaves the marker, then lets the lock go): done, not ours to repeat.
            await self._lock.release(name, self.owner)
            self._applied[key] = "decommissioned"
            return []
        commands = commands_for(applied, state, node, sample.gpu, running_tasks, uuid)
        self._applied[key] = state.stage
        if state.stage == "decommissioned":
            try:
                await self._lock.acquire(name + ".done", self.owner, self.rules.done_ttl_s)
                await self._lock.release(name, self.owner)
            except Exception as error:  # noqa: BLE001 - the lock store failing must not lose the commands
                # Raised, the commands were lost for good: this replica counts them applied,
                # so a lone executor never pulled the GPU. Without the marker, the lock (kept
                # until its TTL) holds the other replicas off, and a repeat after it is
                # harmless (the commands are idempotent).
                log.warning("decommission of %s/%d (%s): cannot leave the done marker: %s",
                            node, sample.gpu, uuid or "no uuid", error)
        return commands

    async def _done(self, name: str, legacy: str) -> bool:
        """Whether the procedure's ``.done`` marker is there, under the board's key or the
        index's key of an earlier version."""
        if await self._lock.holder(name + ".done") is not None:
            return True
        return bool(legacy) and await self._lock.holder(legacy + ".done") is not None

    def forget_node(self, node: str) -> None:
        """Drop what this replica made of ``node``'s GPUs: the node left the fleet (its
        topology key was deleted), and one back under its name is a new node. Kept, a GPU
        that was cordoned refused every assign, and the next sample of an empty one pulled
        it again."""
        for key in [k for k in self._states.keys() | self._applied.keys() if k[0] == node]:
            self._states.pop(key, None)
            self._applied.pop(key, None)
        self.boards.forget_node(node)

    def accepts_work(self, node: str, gpu: int) -> bool:
        """Whether new work may go to the board at this index now (not cordoned, not
        decommissioned)."""
        return _RANK[self.state(node, gpu).stage] < _RANK["cordoned"]

    def accepts_board(self, node: str, uuid: str) -> bool:
        """Whether new work may go to the board ``uuid`` of ``node``, wherever it reads now
        (not cordoned, not decommissioned; a board never seen hot is)."""
        return _RANK[self.board_state(node, uuid).stage] < _RANK["cordoned"]

    def held_board_refusal(self, node: str, gpu: int, uuid: str) -> str:
        """Why a placement at ``node``/``gpu`` whose ledger hold names the board ``uuid`` (the
        one the policy's topology had at that index) must not go ahead; ``""``: nothing
        against it. The placement's index alone names the board that reads there now
        (:meth:`before_assign`); the hold names the board the policy placed on, which after
        a renumbering the policy's topology had not caught up with may be another one:

        - that board is cordoned or decommissioned, wherever it reads now: the policy placed
          on it before it knew, or by a topology behind a renumbering;
        - another board reads at the index now (as the latest samples say): carried out, the
          task runs on that board while its hold names the other, whose drain then counts
          it and whose pull evicts it, and the board it runs on is pulled without evicting it.

        A hold that names no board (an earlier version's) and an index no board was read at
        say nothing here."""
        if not uuid:
            return ""
        if not self.accepts_board(node, uuid):
            return f"{node}/{gpu}: the board its hold names, {uuid}, is {self.board_state(node, uuid).stage}"
        there = self.boards.get(node, gpu)
        if there and there != uuid:
            return (f"{node}/{gpu} reads board {there} now, not {uuid}, which its hold names (placed by a "
                    "topology behind a renumbering)")
        return ""

    async def before_assign(self, decision: DecisionMade) -> HookVerdict:
        """Refuse placements on cordoned or decommissioned GPUs: a placement's index names
        the board that reads there now."""
        for p in decision.placement:
            if p.gpu >= 0 and not self.accepts_work(p.node, p.gpu):
                _, board = self.board_at(p.node, p.gpu)
                named = "" if board.startswith("#") else f" (board {board})"
                return HookVerdict(
                    allow=False, reason=f"{p.node}/{p.gpu}{named} is {self.state(p.node, p.gpu).stage}"
                )
        return ALLOW

    async def after_finish(self, event: TaskLifecycle) -> None:
        """Nothing to do: the running-task count comes with each observation."""

    async def pre_decommission(self, node: str, gpu: int, running_tasks: Sequence[str]) -> HookVerdict:
        """Allow pulling a GPU (the board at that index now) only once it is drained or its
        drain time is over."""
        state = self.state(node, gpu)
        if state.stage != "cordoned":
            return ALLOW  # not in this procedure's drain: nothing for this hook to hold back
        assert state.cordoned_at is not None
        left = self.rules.drain_s - (self._clock() - state.cordoned_at)
        if running_tasks and left > 0:
            return HookVerdict(allow=False, reason=f"{len(running_tasks)} tasks draining, {left:.0f}s left")
        return ALLOW

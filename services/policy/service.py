"""The policy service.

For each ``task.admitted`` (a durable consumer shared by every replica) it decides a
placement with the policy engine over the live fleet and ledger, reserves it in the ledger
with compare-and-set and only then publishes ``decision.made``, so a published ``assign`` is
final even with several replicas. A task that fits nowhere gets a ``queue`` decision and
waits in the ``pending`` bucket; it is retried whenever capacity may have freed.

This module wires the handlers. What a replica does is ``PolicyState``, in three parts:
``replica`` (its live view and the placement of a task), ``moves`` (the rebalance round) and
``evictions`` (preemption, and queueing again); the queue's retry round is ``retry_round``.

Around that core (see ``README.md``):

* the policies come from the ``config`` bucket (``policies.<hostname>``, else
  ``policies.default``, else the settings), watched and swapped live (``policy_set``);
* policy modules in ``FLEETPILOT_POLICY_PLUGIN_DIR`` are hot-reloaded (``plugin_dir``);
* the confidence of a published placement is the learner's promoted outcome model's, read
  from the ``models`` bucket, with the policy's own kept as ``prior_confidence``; without a
  model, or when it fails, the policy's own is published (``learned``);
* every policy sits behind a circuit breaker with a fallback scheduler rebuilt from the
  feedback service's success rates per (task kind, GPU model);
* GPU labels in the topology keep new work off cordoned, decommissioned and
  maintenance-pending GPUs, and a periodic rebalancer grows the hold of a task whose
  fingerprint predicts a peak above it when its GPU has room (``resize``), else migrates
  tasks off GPUs that are going away or where their fingerprint predicts an OOM
  (``rebalance``);
* the queue is ordered by tier, then by expected completion, with backfill around a
  reservation for the longest-blocked wide task (``backfill``); no placement or migration
  that would delay it uses the reserved GPUs, and when moving the tenants of a node costs
  less than its wait, the rebalancer migrates them away (``clear_for_reservation``);
* a ``vip`` task waiting in ``pending`` preempts the cheapest set of ``best_effort`` tasks on
  one node that makes it fit (``evict``); the evicted tasks wait in ``pending`` for a new
  placement (``preempt``); a task the executor evicts on its own (a decommissioned GPU) is
  queued the same way, once, under its next ``<task>.assign.<g>`` (``requeue_evicted``);
* a task with a fingerprint waits for GPUs that hold its predicted peak (plus 5%, as the
  ledger then holds); one whose fingerprint predicts smooth growth (``linear``, ``leak``)
  past every GPU free now may instead start on GPUs that hold its ask (a *bridge*), and the
  rebalancer moves it up to a GPU that holds its peak once one has room; a task that should
  move but has nowhere to go, and whose measured growth (``telemetry.task``) or, for a run
  from its start, whose program's envelope would overflow its GPU soon
  (``rebalance.bridge_overflow``), is checkpointed (``evict``) and queued again rather than
  left to the OOM kill;
* a blocked task of one whole GPU gets room from a tenant of a GPU it could take, moved down
  to a GPU model the waiter cannot take where its program's envelope says it fits a while
  (``Moves.move_down``), and moved up again by that envelope; failing that, a run alone on
  such a GPU with at least three times the waiter's run (and its pause) left, that the queue's
  order puts after the waiter, is checkpointed and queued again with its progress
  (``Moves.make_way``, ``backfill.makes_way``);
* a blocked task of a share of one GPU gets room the same way from a running task of one GPU
  whose going leaves it room on that GPU and node (``backfill.leaves_room``);
* every Nth decision input is recorded for ``fleetpilot replay``.

Decision ids are derived from the task (``<task>.assign``, ``<task>.migrate.<n>``,
``<task>.resize.<mb>``, ``<task>.evict.<g>``, ``<task>.assign.<g>``), and a
redelivered task that already holds capacity gets the same decision again: a policy killed
between reserving and acknowledging loses nothing and doubles nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path

import msgspec
from fleetpilot.contracts import (
    ActionFailed,
    DecisionMade,
    FeedbackStats,
    PolicyRef,
    StatsQuery,
    TaskAdmitted,
    TaskFingerprinted,
    TaskLifecycle,
    TaskRejected,
    TaskSubmitted,
    TaskTelemetry,
    decode,
    encode,
    now,
)
from fleetpilot.fingerprint import keep_signature_knowledge
from fleetpilot.ledger import FleetView, LedgerStore
from fleetpilot.ledger.store import node_key
from fleetpilot.policy.preempt import NoRoom, claim_of, decode_pending, encode_pending, with_no_room
from fleetpilot.runtime import Bus, CasConflict, Delivery, KeyValue, Retry, ServiceHost, serve

from .admissions import Admissions
from .evictions import Evictions
from .learned import LearnedConfidence
from .metrics import PolicyMetrics
from .moves import Moves
from .plugin_dir import PluginDirectory
from .policy_set import (
    CONFIG_PREFIX,
    DEFAULT_CONFIG_KEY,
    ActivePolicies,
    PolicyConfig,
    config_key,
    parse_config,
    success_table,
)
from .replica import QUEUE_CONFIDENCE, calibration_key, decision_id_for
from .retry_round import PendingQueue, RetryRound
from .settings import PolicySettings
from .untaken import UntakenReservations

log = logging.getLogger("fleetpilot.policy")


def totals_by_policy_action(groups: list) -> dict[str, tuple[float, float, float]]:
    """Feedback groups keyed by ``policy`` (``name@version``) and ``action``, summed per
    policy name and action (``calibration_key``): the sum of published confidences, the
    successes and the records (what ``ConfidenceCalibration`` learns from; a profile rebuilt
    under a new version is still the same policy). Records of unknown action are left out."""
    out: dict[str, tuple[float, float, float]] = {}
    for g in groups:
        name = g.key.get("policy", "").rsplit("@", 1)[0]
        action = g.key.get("action", "")
        if not name or name == "fallback" or not action:
            continue
        key = calibration_key(name, action)
        expected, met, count = out.get(key, (0.0, 0.0, 0.0))
        out[key] = (expected + g.expected_successes, met + g.successes, count + g.count)
    return out


class PolicyState(Moves, Evictions):
    """Everything a replica holds and does: its view and placements (``ReplicaState``), its
    moves of running tasks (``Moves``), its evictions and re-queueing (``Evictions``), and
    the queue its retry rounds read (``queue``, set when the state opens)."""

    queue: PendingQueue


FINGERPRINT_REPLAY_S = 2 * 24 * 3600.0
"""How far back a replica's fingerprint consumer starts: the fingerprints of the tasks that
may still run (a task's fingerprint is published again when it changes materially)."""


def build(settings: PolicySettings | None = None) -> ServiceHost:
    """Wire the policy service."""
    settings = settings or PolicySettings.from_environment()
    host = ServiceHost("policy", settings)
    metrics = PolicyMetrics(host.metrics.registry)
    learned = LearnedConfidence(None, host.metrics.registry)

    def outgoing(decision: DecisionMade) -> DecisionMade:
        """A decision on its way out: the learned model's confidence where it has one, counted."""
        return metrics.decided(learned.apply(decision))
    holder: dict[str, object] = {}
    host_key = config_key(settings.hostname)
    plugins = PluginDirectory(Path(settings.plugin_dir),
                              on_failure=lambda name: metrics.module_errors.labels(module=name).inc(),
                              import_timeout_s=settings.plugin_import_timeout_s,
                              ) if settings.plugin_dir else None

    def state() -> PolicyState:
        return holder["state"]  # type: ignore[return-value]

    def effective(docs: dict[str, bytes]) -> tuple[PolicyConfig, str]:
        for key in (host_key, DEFAULT_CONFIG_KEY):
            if key in docs:
                return parse_config(docs[key]), key
        return settings.policy_config(), "settings"

    async def open_state(bus: Bus) -> None:
        fleet = await FleetView.open(bus)
        ledger = await LedgerStore.open(bus)
        config_kv = await bus.kv("config")
        docs = {}
        for key in (host_key, DEFAULT_CONFIG_KEY):
            entry = await config_kv.get(key)
            if entry and entry.value:
                docs[key] = entry.value
        try:
            config, source = effective(docs)
        except ValueError as exc:
            metrics.config_errors.inc()
            log.error("%s; starting from the settings", exc)
            config, source = settings.policy_config(), "settings"
        if plugins is not None:
            # Vetted in child processes first: a module that hangs at import delays the start
            # by at most plugin_import_timeout_s and is refused, rather than stop it for good.
            await plugins.poll()
        profiles = plugins.profiles() if plugins else {}
        try:
            active = ActivePolicies(config, source, profiles)
        except Exception as exc:  # noqa: BLE001 - as ``ActivePolicies`` refuses any bad input live
            if source == "settings":
                raise  # the replica's own settings are wrong: nothing to fall back on
            # Parsed, but it does not compile (an unknown policy, a module not loaded, a bad
            # rule): running replicas refuse it and keep serving, so one starting now serves
            # the settings rather than not start at all (a rolling restart would stop them all).
            metrics.config_errors.inc()
            log.error("policy config %s not applied (%s); starting from the settings", source, exc)
            active = ActivePolicies(settings.policy_config(), "settings", profiles)
        active.on_swap = lambda kind, s: metrics.swapped(kind, s, active.current.generation)
        active.on_breaker = metrics.breaker_changed
        metrics.generation.set(active.current.generation)
        holder["state"] = ps = PolicyState(fleet, ledger, settings, active, metrics)
        ps.admissions = admissions = await Admissions.open(bus)
        ps.executions = await bus.kv("executions")
        holder["untaken"] = UntakenReservations(bus, ledger, ps.executions, settings.untaken_expiry_s)
        ps.signatures = await bus.kv("fingerprints")
        ps.queue = queue = await PendingQueue.open(bus)
        # No fingerprint stored within the replay window: nothing to read back first.
        last_fingerprint = await bus.last_stored_at("task.fingerprinted")
        ps.fingerprints_read = last_fingerprint is None or last_fingerprint < now() - FINGERPRINT_REPLAY_S
        ps.pending = queue.kv
        host.background(fleet.follow, "fleet-watch")
        host.background(ledger.follow, "ledger-watch")
        host.background(admissions.follow, "contracts-watch")
        host.background(queue.follow, "pending-watch")
        host.background(lambda: watch_config(bus, docs), "config-watch")
        learned.fleet = fleet
        host.background(lambda: learned.follow(bus), "models-watch")
        if plugins is not None:
            host.background(watch_plugins, "plugin-watch")
        await refresh_stats(bus)

    async def watch_config(bus: Bus, docs: dict[str, bytes]) -> None:
        kv = await bus.kv("config")
        async for entry in kv.watch(CONFIG_PREFIX + ">"):
            if entry.key not in (host_key, DEFAULT_CONFIG_KEY):
                continue
            if entry.value is None:
                if docs.pop(entry.key, None) is None:
                    continue
            elif docs.get(entry.key) == entry.value:
                continue  # the watch replays what we read at start-up
            else:
                docs[entry.key] = entry.value
            try:
                config, source = effective(docs)
            except ValueError as exc:
                metrics.config_errors.inc()
                log.error("%s (key %s); the previous policies keep serving", exc, entry.key)
                continue
            if not state().active.apply_config(
                config, f"{source} rev {entry.revision}" if source != "settings" else source
            ):
                metrics.config_errors.inc()

    async def watch_plugins() -> None:
        assert plugins is not None
        while True:
            await asyncio.sleep(settings.plugin_poll_s)
            # A changed module is first vetted in a child process (the loop decides on
            # meanwhile): one that hangs at import is refused there, not here.
            changes = await plugins.vet()
            # Import and compile of what passed run on the event loop between two decisions:
            # the swap is atomic without a lock (the registry is never touched from another
            # thread), and a decision is delayed by at most one reload. The vetting is not
            # part of the reload time.
            started = time.perf_counter()
            if plugins.apply(changes):
                state().active.apply_plugins(plugins.profiles(), started)

    async def refresh_stats(bus: Bus) -> None:
        try:
            by_kind, by_policy = [
                decode(
                    await bus.request("feedback.stats", encode(StatsQuery(by=by)), timeout_s=settings.stats_timeout_s),
                    FeedbackStats,
                )
                for by in (["task_kind", "gpu_model"], ["policy", "action"])
            ]
        # RuntimeError: the endpoint's handler failed (the feedback store down). Let through,
        # it failed the start-up hook, and no replica started until the store was back.
        except (TimeoutError, RuntimeError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.info("feedback statistics unavailable (%s); the fallback and confidences keep their last state", exc)
            return
        state().active.apply_stats(success_table(by_kind.groups))
        for key, (expected, met, count) in totals_by_policy_action(by_policy.groups).items():
            factor = state().calibration.update(key, expected, met, count)
            log.debug("confidence of %s corrected by %.3f (feedback: %.1f expected, %.0f met)", key, factor, expected, met)

    host.on_startup(open_state)

    # Each replica decides by every task's fingerprint: its own consumer (a shared one handed
    # each replica only some), per run (``ConsumerSpec.per_run``): made afresh at each start,
    # so the recent past is read again into the memory a restart emptied, even under the id
    # the last run had, and removed at a clean stop (after ``RUN_IDLE_LIMIT_S`` idle when not).
    @host.on(TaskFingerprinted, consumer="policy-fingerprints", instance=settings.replica,
             instance_start_s_ago=FINGERPRINT_REPLAY_S)
    async def on_fingerprint(event: TaskFingerprinted, delivery: Delivery) -> None:
        ps = state()
        if delivery.pending is None or delivery.pending == 0:
            ps.fingerprints_read = True  # the last one stored when it came: read back
        if ps.fingerprinted_at.get(event.task_id, float("-inf")) > event.at:
            return  # a redelivered older fingerprint: the newer one stands
        # An observed fingerprint does not tell when the program grows nor how far its runs
        # spread: what its signature predicted of both stays (``keep_signature_knowledge``).
        kept = keep_signature_knowledge(event.fingerprint, ps.fingerprints.get(event.task_id))
        ps.remember(ps.fingerprints, event.task_id, ps.with_shared_spread(kept))
        ps.remember(ps.fingerprinted_at, event.task_id, event.at)

    seen: deque[TaskSubmitted] = deque(maxlen=settings.workload_window)

    @host.every(settings.workload_refresh_s)
    async def refresh_workload() -> None:
        if "state" in holder and seen:
            state().active.apply_workload(state().workload(seen))

    @host.on(TaskAdmitted, consumer="policy-admitted")
    async def on_admitted(adm: TaskAdmitted) -> DecisionMade | None:
        ps = state()
        seen.append(adm.task)
        again = ps.existing(adm)
        if again is not None:
            # Out like any decision (the learned confidence, the count), as it went the first time.
            return outgoing(again)
        first = decision_id_for(adm.task.task_id, "assign")
        if await ps.journaled(first):
            # Delivered again after the executor took its assign (it runs, ran, or failed and
            # gave the hold back): what became of the task is the action's business. A new
            # reservation under the same id would go out as a duplicate the stream drops,
            # held by nobody, and would keep the failure from placing the task again.
            log.info("%s: admitted again after the executor took %s; nothing to decide", adm.task.task_id, first)
            return None
        # A fleet whose nodes have not reported yet (a fresh deploy's first seconds) has no
        # room: the task is queued, and the retry round places it once they report. (A Retry
        # here sent it to the dead letters after max_deliver, about five seconds, unplaced.)
        unknown_fleet = not ps.fleet.nodes
        # A replica that started reads the recent fingerprints back first: the task's own may
        # be at the end of that backlog. Queued, it is placed by a retry round once read (this
        # replica's, or one of the others' at once).
        reading = ps.reading_fingerprints()
        if reading:
            decision, (name, shard_id) = None, ps.active.current.route(adm.task)
        else:
            decision, name, shard_id = await ps.place(adm)
        if decision is not None:
            return outgoing(decision)
        # What kept it off every node, as the policy counted it, for whoever asks why it waits:
        # its decision now, its queue entry until it is placed (``fleetpilot queue``).
        refusal = "" if unknown_fleet or reading else ps.refusals.get(adm.task.task_id, "")
        shortfall = f" ({refusal})" if refusal else ""
        pending = await host.bus.kv("pending")  # type: ignore[union-attr]
        try:
            await pending.create(node_key(adm.task.task_id),
                                 with_no_room(encode_pending(adm), NoRoom(shortfall=refusal, at=now())))
        except CasConflict:
            # Queued already, by an earlier delivery of this admission: the entry may have
            # moved on since (claimed by a round, queued again with a note), and is left to
            # whoever holds it. Writing the bare admission over it would lose both.
            log.info("%s: admitted again while queued; the queue entry stays as it is", adm.task.task_id)
        return outgoing(
            DecisionMade(
                decision_id=decision_id_for(adm.task.task_id, "queue"),
                task_id=adm.task.task_id,
                action="queue",
                # What a queue is judged on is its acknowledgement, as the policies' own
                # queue decisions (0.95: the filters are exact on a fresh view); corrected by
                # the record of the policy's queue decisions.
                confidence=ps.calibration.apply(calibration_key(name, "queue"), QUEUE_CONFIDENCE),
                policy=PolicyRef(name=name, version=ps.active.current.versions.get(name, "1")),
                shard_id=shard_id,
                reason=("no fleet topology known yet; queued until the nodes report" if unknown_fleet
                        else f"this replica started {now() - ps.started_at:.0f} s ago and reads back the recent "
                        "fingerprints; queued until it has" if reading
                        else f"no node has room now{shortfall}; queued until capacity frees"),
                decided_at=now(),
                task=adm.task,
                contract=adm.contract,
            )
        )

    # The rounds' decisions have their holds reserved (and their ``pending`` entries gone):
    # returned, the runtime publishes them, and keeps what the bus refuses for the next tick.
    @host.every(settings.pending_retry_s)
    async def retry_pending() -> list[DecisionMade]:
        if "state" not in holder or state().reading_fingerprints():
            return []  # placed once the recent fingerprints are read back (``on_admitted``)
        ps = state()
        round_ = RetryRound(ps, ps.queue, settings, outgoing)
        await round_.collect()
        metrics.waiting(round_.tiers, round_.waiting_since, now())
        try:
            await round_.place()
        except Exception:  # noqa: BLE001 - the bus lost mid-round
            # What the round decided still goes out (its holds are reserved, its entries
            # gone); an entry claimed when the round broke off is taken over after
            # ``claim_timeout_s``.
            log.exception("retry round cut short after %d decisions", len(round_.out))
        # Only the whole round says who the reservation's owner is, so this round (and the
        # arrivals decided while it awaits, which must not find the reserved GPUs unguarded)
        # ran against the last round's reservation, at most ``pending_retry_s`` old.
        ps.reservation, ps.reservations_apart = ps.reservations_for(round_.reservation_owners())
        ps.blocked = round_.blocked
        ps.blocked_progress = round_.progress
        ps.leaving = round_.leaving
        return round_.out

    def opened() -> Bus:
        """The bus, once the replica's state is open (a retry until then)."""
        if "state" not in holder or host.bus is None:
            raise Retry("policy state not open yet", 1.0)
        return host.bus

    @host.on(ActionFailed, consumer="policy-failed")
    async def on_action_failed(failed: ActionFailed) -> TaskRejected | None:
        bus = opened()
        given_up = await state().given_up(failed, await bus.kv("placement_failures"))
        if given_up is not None:
            log.warning("%s will not run: %s", failed.task_id, given_up.reason)
            return given_up
        await state().requeue_failed(failed, await bus.kv("pending"), await bus.kv("ledger"))
        return None

    @host.on_core("telemetry.task.*", TaskTelemetry)
    async def on_task_sample(sample: TaskTelemetry) -> None:
        # Every replica sees every sample (no queue group): each may be the one to act.
        if "state" in holder:
            state().observe(sample)

    @host.on(TaskLifecycle, consumer="policy-lifecycle")
    async def on_lifecycle(life: TaskLifecycle) -> TaskRejected | None:
        bus = opened()
        pending = await bus.kv("pending")
        failures = await bus.kv("placement_failures")
        given_up = await state().oom_given_up(life, failures)
        restarted = life.state == "oom_killed" and given_up is None
        if life.state == "evicted":
            # Evicted without a decision of ours (a decommissioned GPU): queue it again (its
            # note's floor from its last sample, so before its samples go). Our own evictions
            # already wait in ``pending`` with their requeue note.
            await state().requeue_evicted(life, pending, await bus.kv("ledger"))
        elif restarted:
            # Started over, as its Job would; killed alone, asking more than its GPUs have and
            # than it held (so before its samples go).
            await state().restart_after_oom(life, pending, await bus.kv("ledger"))
        if life.state in ("finished", "oom_killed", "failed", "evicted", "migrated"):
            state().forget_run(life.task_id)
        if restarted or life.state not in ("finished", "oom_killed", "failed"):
            return None
        await drop_ended(life, pending)
        if life.state == "finished" and await failures.get(node_key(life.task_id)) is not None:
            await failures.delete(node_key(life.task_id))  # its restart limits are behind it
        if given_up is not None:
            log.warning("%s will not run again: %s", life.task_id, given_up.reason)
        return given_up

    async def drop_ended(life: TaskLifecycle, pending: KeyValue) -> None:
        """An evicted task waits in ``pending`` for its re-placement; if it ended on its own
        instead (the eviction failed or never went out), it must not be started again (an
        OOM-killed one is started again by that entry, unless it was given up)."""
        entry = await pending.get(node_key(life.task_id))
        if entry is None or not entry.value:
            return
        value = entry.value
        claim = claim_of(value)
        if claim is not None:
            at, value = claim
            if now() - at < settings.claim_timeout_s:
                # A round is placing it right now and will put it back if it finds no room:
                # taken now, the event would be lost and the ended task started again later.
                # Four waits of a quarter of the claim timeout: the last delivery comes when
                # a claim still held is its dead replica's, and is judged as it stands.
                raise Retry(f"{life.task_id} ended while its pending entry is claimed; judged once released",
                            settings.claim_timeout_s / 4)
            # Claimed by a replica that died: nobody puts it back; judged as it stands.
        try:
            _, requeue = decode_pending(value) if value else (None, None)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("pending %s is unreadable (%s); left as it is", entry.key, exc)
            return
        if requeue is None:
            return
        try:
            # Only the entry judged: one claimed or written again since is judged again.
            await pending.delete(entry.key, revision=entry.revision)
        except CasConflict as exc:
            raise Retry(f"pending {entry.key} changed while {life.task_id} ended; judged again", 0.2) from exc

    @host.every(settings.stats_refresh_s)
    async def refresh_fallback() -> None:
        if "state" in holder:
            await refresh_stats(host.bus)  # type: ignore[arg-type]

    @host.every(settings.rebalance_s)
    async def rebalance() -> list[DecisionMade]:
        if "state" not in holder:
            return []
        await state().release_settled_reservations()
        await holder["untaken"].expire()  # type: ignore[attr-defined]
        return [outgoing(d) for d in await state().rebalance_round()]

    return host


def main() -> None:
    """Console entry point ``fleetpilot-policy``."""
    serve("policy", build)

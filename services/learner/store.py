"""The learner's own store: placements and their outcomes, in one SQLite file.

Decisions (of the learned actions only) are kept by ``decision_id`` as their encoded event;
outcomes by ``action_id`` with what the model needs of them. Either may come first: a
decision waits for its outcome, an outcome for its decision, and the training set is their
join. Every write is one committed transaction, made before the handler returns (so before
the message is acked), and ``INSERT OR IGNORE`` on the key makes a redelivery a no-op; an
outcome pruned already (recorded at or before ``PRUNED_THROUGH``) delivered again is not
stored at all.

``joined`` counts every outcome that found its decision, whichever came second, and never
goes down (pruning does not undo it): the service retrains when it has grown by
``retrain_every`` since the last round (``trained``, kept here too, so a restart neither
forgets a round nor repeats one).

The writer is one connection on the event loop's thread (each write is a few small
statements); a round of training reads on a connection of its own, in its worker thread
(``read_examples``); WAL mode lets the two run side by side.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
from fleetpilot.contracts import DecisionMade, FeedbackRecorded, decoder_for, encode
from fleetpilot.learner import LEARNED_ACTIONS, Example

SCHEMA = """
CREATE TABLE IF NOT EXISTS decisions (
    decision_id TEXT PRIMARY KEY,
    decided_at REAL NOT NULL,
    event BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS outcomes (
    action_id TEXT PRIMARY KEY,
    decision_id TEXT NOT NULL,
    success INTEGER NOT NULL,
    weight REAL NOT NULL,
    gpu_model TEXT NOT NULL,
    recorded_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS outcomes_by_decision ON outcomes (decision_id);
CREATE INDEX IF NOT EXISTS outcomes_by_time ON outcomes (recorded_at);
CREATE INDEX IF NOT EXISTS decisions_by_time ON decisions (decided_at);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS marks (
    name TEXT PRIMARY KEY,
    value REAL NOT NULL
);
"""

_NO_OUTCOME = "NOT EXISTS (SELECT 1 FROM outcomes o WHERE o.decision_id = decisions.decision_id)"
_NO_DECISION = "NOT EXISTS (SELECT 1 FROM decisions d WHERE d.decision_id = outcomes.decision_id)"

JOINED = "joined"
TRAINED = "trained"
PRUNED_THROUGH = "pruned_through"
"""The mark of the latest ``recorded_at`` among the joined outcomes pruned to keep the store
within its bound: an outcome recorded then or before is older than every one kept."""

log = logging.getLogger("fleetpilot.learner")


OUTCOME_WEIGHT = 1.0
"""What one recorded outcome weighs among the model's examples: each counts once.

The model learns whether a placement met its goal, and every record observes that, whether
it was judged with the action's result or from the task's end alone. The uncertainty a
record carries is its *latency's* (how well the action was timed, what the feedback store
weighs its latency figures by), and says nothing of the outcome. Weighed by it, a record
judged from the task's end alone (latency unknown: weight 0) taught nothing, and those are
the placements that failed before their result was handled (a task OOM-killed as it
started): the model learnt from a sample leaning to success. Examples keep a weight of their
own (``outcomes.weight``) for rows stored so by earlier versions."""


def learns_from(feedback: FeedbackRecorded) -> bool:
    """Whether an outcome may belong to a learned placement: its action is one of them, or
    unknown (a record judged without the action's result; the join decides)."""
    return not feedback.action or feedback.action in LEARNED_ACTIONS


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=30.0, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    # A committed write survives the process (a crash, a restart); only a power cut can
    # take the last ones back, as in the feedback store.
    db.execute("PRAGMA synchronous=NORMAL")
    return db


class ExampleStore:
    """Decisions and outcomes kept until they teach the model, in ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = _connect(self.path)
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        """Close the writer's connection."""
        self._db.close()

    # -- writes (each one transaction) ------------------------------------------------------
    def add_decision(self, decision: DecisionMade) -> bool:
        """Keep a placement decision; ``False`` when it was kept already or is no placement."""
        if decision.action not in LEARNED_ACTIONS:
            return False
        with _transaction(self._db):
            added = self._db.execute(
                "INSERT OR IGNORE INTO decisions (decision_id, decided_at, event) VALUES (?, ?, ?)",
                (decision.decision_id, float(decision.decided_at), encode(decision))).rowcount == 1
            if added:
                (waiting,) = self._db.execute("SELECT COUNT(*) FROM outcomes WHERE decision_id = ?",
                                              (decision.decision_id,)).fetchone()
                self._bump(JOINED, waiting)
        return added

    def add_outcome(self, feedback: FeedbackRecorded) -> bool:
        """Keep an action's outcome (weighing ``OUTCOME_WEIGHT``); ``False`` when it was kept
        already, cannot teach (no placement's), or is older than every joined outcome the
        store keeps (pruned already, or it would be)."""
        if not feedback.decision_id or not learns_from(feedback):
            return False
        # A pruned outcome delivered again (a replica's consumers made anew replay 7 days;
        # the feedback service announces a stored record again under a new message id) found
        # no row to ignore: it was stored, joined its decision delivered again, and counted a
        # second time, starting rounds on outcomes already learnt from.
        if float(feedback.recorded_at) <= self._mark(PRUNED_THROUGH):
            return False
        with _transaction(self._db):
            added = self._db.execute(
                "INSERT OR IGNORE INTO outcomes (action_id, decision_id, success, weight, gpu_model, recorded_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (feedback.action_id, feedback.decision_id, 1 if feedback.outcome == "success" else 0,
                 OUTCOME_WEIGHT, feedback.gpu_model, float(feedback.recorded_at))).rowcount == 1
            if added and self._db.execute("SELECT 1 FROM decisions WHERE decision_id = ?",
                                          (feedback.decision_id,)).fetchone():
                self._bump(JOINED, 1)
        return added

    def mark_trained(self, joined: int) -> None:
        """Remember that a round learnt from the first ``joined`` outcomes joined."""
        with _transaction(self._db):
            self._db.execute("INSERT INTO counters (name, value) VALUES (?, ?) "
                             "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (TRAINED, joined))

    def prune(self, *, max_examples: int, unjoined_before: float, sizes: dict[str, int] | None = None) -> int:
        """Keep the latest ``max_examples`` joined outcomes (by ``recorded_at``) with their
        decisions, and at most ``max_examples`` of each kind still waiting for the other,
        none of them from before ``unjoined_before``; returns how many rows went. Cheap when
        nothing is over its bound (it runs on the event loop's thread at every check);
        ``sizes``, when the caller has just counted them, spares counting again."""
        sizes = sizes if sizes is not None else self.sizes()
        gone = 0
        with _transaction(self._db):
            if sizes["joined"] > max_examples:
                old = self._db.execute(
                    "SELECT o.action_id, o.decision_id, o.recorded_at FROM outcomes o JOIN decisions d "
                    "USING (decision_id) ORDER BY o.recorded_at DESC, o.action_id DESC LIMIT -1 OFFSET ?",
                    (max_examples,)).fetchall()
                if old:
                    self._db.execute(
                        "INSERT INTO marks (name, value) VALUES (?, ?) ON CONFLICT (name) "
                        "DO UPDATE SET value = max(value, excluded.value)",
                        (PRUNED_THROUGH, max(float(at) for _, _, at in old)))
                gone += self._db.executemany("DELETE FROM outcomes WHERE action_id = ?",
                                             [(a,) for a, _, _ in old]).rowcount
                gone += self._db.executemany("DELETE FROM decisions WHERE decision_id = ?",
                                             sorted({(d,) for _, d, _ in old})).rowcount
            gone += self._db.execute(f"DELETE FROM decisions WHERE decided_at < ? AND {_NO_OUTCOME}",
                                     (unjoined_before,)).rowcount
            gone += self._db.execute(f"DELETE FROM outcomes WHERE recorded_at < ? AND {_NO_DECISION}",
                                     (unjoined_before,)).rowcount
            if sizes["decisions_waiting"] > max_examples:
                gone += self._db.execute(
                    f"DELETE FROM decisions WHERE {_NO_OUTCOME} AND decision_id NOT IN (SELECT decision_id "
                    f"FROM decisions WHERE {_NO_OUTCOME} ORDER BY decided_at DESC, decision_id DESC LIMIT ?)",
                    (max_examples,)).rowcount
            if sizes["outcomes_waiting"] > max_examples:
                gone += self._db.execute(
                    f"DELETE FROM outcomes WHERE {_NO_DECISION} AND action_id NOT IN (SELECT action_id "
                    f"FROM outcomes WHERE {_NO_DECISION} ORDER BY recorded_at DESC, action_id DESC LIMIT ?)",
                    (max_examples,)).rowcount
        return gone

    # -- reads -----------------------------------------------------------------------------
    def counter(self, name: str) -> int:
        """A counter's value (``JOINED`` or ``TRAINED``), 0 before its first write."""
        row = self._db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return int(row[0]) if row else 0

    def _mark(self, name: str) -> float:
        """A mark's value (``PRUNED_THROUGH``), minus infinity before its first write."""
        row = self._db.execute("SELECT value FROM marks WHERE name = ?", (name,)).fetchone()
        return float(row[0]) if row else float("-inf")

    def sizes(self) -> dict[str, int]:
        """How many rows are kept: ``joined`` (examples), ``decisions_waiting`` (no outcome
        yet), ``outcomes_waiting`` (no decision yet)."""
        (joined,) = self._db.execute(
            "SELECT COUNT(*) FROM outcomes o JOIN decisions d USING (decision_id)").fetchone()
        (decisions,) = self._db.execute("SELECT COUNT(*) FROM decisions").fetchone()
        (outcomes,) = self._db.execute("SELECT COUNT(*) FROM outcomes").fetchone()
        return {"joined": joined, "decisions_waiting": decisions - _joined_decisions(self._db),
                "outcomes_waiting": outcomes - joined}

    def _bump(self, name: str, by: int) -> None:
        if by:
            self._db.execute("INSERT INTO counters (name, value) VALUES (?, ?) "
                             "ON CONFLICT (name) DO UPDATE SET value = value + excluded.value", (name, by))


def read_examples(path: str | Path, limit: int) -> list[Example]:
    """The latest ``limit`` joined outcomes kept in ``path`` as the learner's examples, read
    on a connection of the caller's own (a training round's worker thread)."""
    db = _connect(Path(path))
    try:
        rows = db.execute(
            "SELECT d.event, o.gpu_model, o.success, o.weight, o.recorded_at "
            "FROM outcomes o JOIN decisions d USING (decision_id) "
            "ORDER BY o.recorded_at DESC, o.action_id DESC LIMIT ?", (limit,)).fetchall()
    finally:
        db.close()
    decoder = decoder_for(DecisionMade)
    examples, unreadable = [], 0
    for event, gpu_model, success, weight, recorded_at in rows:
        # A decision stored by an earlier version of the learner that this one no longer
        # decodes (a contract that changed) is left out, not allowed to fail the round: it
        # failed every round for as long as it stayed among the latest outcomes kept.
        try:
            decision = decoder.decode(event)
        except (msgspec.DecodeError, msgspec.ValidationError):
            unreadable += 1
            continue
        examples.append(Example(decision=decision, gpu_model=gpu_model, success=bool(success),
                                weight=float(weight), recorded_at=float(recorded_at)))
    if unreadable:
        log.warning("learner: %d of the %d latest stored decisions no longer decode; learning without them",
                    unreadable, len(rows))
    return examples


def _joined_decisions(db: sqlite3.Connection) -> int:
    (count,) = db.execute("SELECT COUNT(DISTINCT decision_id) FROM outcomes o "
                          "WHERE EXISTS (SELECT 1 FROM decisions d WHERE d.decision_id = o.decision_id)").fetchone()
    return count


@contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` (``ROLLBACK`` on error) on an autocommit connection."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")

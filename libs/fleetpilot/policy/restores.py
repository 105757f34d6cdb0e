"""How the runs of each signature come back from a checkpoint: where they were, or lower.

A run checkpointed because it was about to outgrow its GPU is, by default, bridged again
only onto more room than it outgrew (``Requeue.bridge_floor_mb``): a step schedule (batch
size, resolution) is restored at the level it had reached and would die of OOM at its next
step on the same room. A run whose memory follows its process (a leak, the caching
allocator, a cache) comes back low and may start again on the same room, which would
otherwise stay idle while it waits for a larger GPU. Which of the two a program is shows
in the first sample after a restore; ``RestoreMemory`` keeps that per signature.
"""

from __future__ import annotations

from collections import Counter

KEPT_SHARE = 0.75
"""A restored run that holds at least this share of what it held when stopped came back
where it was; one below it started over."""


def restore_tells(started_mb: float, stopped_mb: float) -> bool:
    """Whether the restore of a run that held ``started_mb`` per GPU in its first sample and
    ``stopped_mb`` when stopped can tell a run that starts over from one that comes back where
    it was: not when it was stopped before it had grown well past where it started."""
    return KEPT_SHARE * stopped_mb > started_mb


class RestoreMemory:
    """Per signature, how many restored runs came back where they were and how many lower."""

    def __init__(self) -> None:
        """Nothing known: every signature is treated as coming back where it was."""
        self.kept: Counter[str] = Counter()
        self.reset: Counter[str] = Counter()

    def observe(self, signature: str, stopped_mb: float, restored_mb: float) -> bool:
        """Count one restore of ``signature`` (one that ``restore_tells``): the run held
        ``stopped_mb`` per GPU when stopped and ``restored_mb`` in its first sample since.
        Whether it came back where it was."""
        kept = restored_mb >= KEPT_SHARE * stopped_mb
        (self.kept if kept else self.reset)[signature] += 1
        return kept

    def bridge_floor_mb(self, signature: str, outgrown_mb: float) -> int:
        """What a bridge of a run of ``signature`` checkpointed for outgrowing ``outgrown_mb``
        per GPU must ask: more than that, unless its restores come back low (then nothing)."""
        return 0 if self.starts_over(signature) else int(outgrown_mb) + 1

    def starts_over(self, signature: str) -> bool:
        """Whether the restored runs of ``signature`` have mostly come back lower: such a run
        may be bridged again onto the room it outgrew. Unknown signatures do not."""
        return self.reset[signature] > self.kept[signature]

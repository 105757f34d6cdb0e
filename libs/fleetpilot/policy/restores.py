"""How far a checkpointed run is bridged again: onto more room than it outgrew, or the same.

A run checkpointed because it was about to outgrow its GPU is, by default, bridged again
only onto more room than it outgrew (``Requeue.bridge_floor_mb``): a step schedule (batch
size, resolution) is restored at the level it had reached and would die of OOM at its next
step on the same room. A run whose memory follows its process (a leak, the caching
allocator, a cache) comes back low and may start again on the same room, which would
otherwise stay idle while it waits for a larger GPU. Which of the two a program is, its
signature's statistics say (``fingerprint.restores_start_over``): the fingerprinter counts,
per signature, the restores that came back where they were and those that started over.
"""

from __future__ import annotations

from fleetpilot.fingerprint import SignatureStats, restores_start_over


def bridge_floor_mb(stats: SignatureStats | None, outgrown_mb: float) -> int:
    """What a bridge of a run checkpointed for outgrowing ``outgrown_mb`` per GPU must ask,
    given its signature's statistics (``None``: none known): more than that, unless its
    restores have mostly started over (then nothing)."""
    return 0 if restores_start_over(stats) else int(outgrown_mb) + 1

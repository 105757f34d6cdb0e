"""How far a checkpointed run is bridged again: onto more room than it outgrew, or the same.

A run checkpointed because it was about to outgrow its GPU is, by default, bridged again
only onto more room than it outgrew (``Requeue.bridge_floor_mb``): a step schedule (batch
size, resolution) is restored at the level it had reached and would die of OOM at its next
step on the same room. A run whose memory follows its process (a leak, the caching
allocator, a cache) comes back low and may start again on the same room, which would
otherwise stay idle while it waits for a larger GPU. Which of the two a program is, its
signature's statistics say (``fingerprint.restores_start_over``): the fingerprinter counts,
per signature, the restores that came back where they were and those that started over.

Starting over buys a run about as long on that room as it stayed there before, and no more:
restored, it grows to the same peak over what is left of its run. A run that outgrew its room
sooner than one growth lookahead after it was placed there (the time the watch needs to move or
checkpoint it before it overflows) would, started over there, be stopped again as soon, a
checkpoint pause for every short stay, until near its end it outgrows the room between two
samples and dies of OOM; its Job then starts it over onto the same room. So it keeps the
floor whatever its signature's restores did. On the fleet benchmark an 8-GPU run of a linear
program peaking at 38.5 GB was stopped on the same 32 GB GPUs every two minutes, and killed
that way seven times over.
"""

from __future__ import annotations

from fleetpilot.fingerprint import SignatureStats, restores_start_over


def bridge_floor_mb(stats: SignatureStats | None, outgrown_mb: float, stayed_s: float, lookahead_s: float) -> int:
    """What a bridge of a run checkpointed for outgrowing ``outgrown_mb`` per GPU, after
    ``stayed_s`` on that room, must ask, given its signature's statistics (``None``: none
    known) and the watch's growth lookahead: more than that, unless its restores have mostly
    started over and it stayed there at least ``lookahead_s`` (then nothing)."""
    if restores_start_over(stats) and stayed_s >= lookahead_s:
        return 0
    return int(outgrown_mb) + 1

"""What the limits on placing a task again count.

Two limits give a task up: ``oom_restarts`` (placements an OOM killed, as Kubernetes'
``backoffLimit`` counts a Job's failed pods) and ``refused_replacements`` (assigns the executor
refused). A task's placement number counts every re-placement, most of them through no
fault of the task: preempted for a vip, moved off a decommissioned GPU, an assign failed for
a passing reason. Counted by placements, a best-effort task preempted six times was given up
at its first OOM. So each limit counts its own failures, kept per task in the
``placement_failures`` bucket (``PlacementFailures``, written with compare-and-set by the
policy service). Each failure is named by the placement it ended (its decision id), so a
redelivered event counts once.
"""

from __future__ import annotations

from typing import Literal

import msgspec

FailureKind = Literal["oom_killed", "refused"]


class PlacementFailures(msgspec.Struct, frozen=True, kw_only=True):
    """The placements of one task that ended in a failure its limits count, by kind: the
    decision ids an OOM killed, and the assigns the executor refused."""

    oom_killed: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()

    def of(self, kind: FailureKind) -> tuple[str, ...]:
        """The placements that ended in ``kind``."""
        return self.oom_killed if kind == "oom_killed" else self.refused

    def with_failure(self, kind: FailureKind, placement: str) -> PlacementFailures | None:
        """These failures with ``placement`` ended by ``kind`` added; ``None`` when it is
        counted already (the same event delivered again)."""
        seen = self.of(kind)
        if placement in seen:
            return None
        return msgspec.structs.replace(self, **{kind: (*seen, placement)})


_DECODER = msgspec.json.Decoder(PlacementFailures)


def decode_failures(raw: bytes) -> PlacementFailures:
    """A ``placement_failures`` value; raises ``msgspec.DecodeError`` on one that is not."""
    return _DECODER.decode(raw)


def encode_failures(failures: PlacementFailures) -> bytes:
    """The ``placement_failures`` value of ``failures``."""
    return msgspec.json.encode(failures)

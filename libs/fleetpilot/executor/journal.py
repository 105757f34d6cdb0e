"""Execution journal: which decisions were already carried out, so a redelivered
``decision.made`` is executed once.

A decision is first *claimed* (create-only, so two replicas cannot both start it) and then
*recorded* with its result; a later delivery finds the result and republishes it instead of
acting again. The service backs this with the ``executions`` NATS KV bucket; the in-memory
implementation serves tests and single-process runs.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, runtime_checkable

import msgspec

from fleetpilot.contracts import ActionExecuted, ActionFailed

ActionResult = ActionExecuted | ActionFailed

_RESULT = msgspec.json.Decoder(ActionResult)


def recorded_result(value: bytes | None) -> ActionResult | None:
    """The result a journal entry of the ``executions`` bucket records, ``None`` for no entry
    or a claim (the decision is being carried out). Raises ``msgspec.DecodeError`` for bytes
    that are neither."""
    if not value or value.startswith(b'{"claim"'):
        return None
    return _RESULT.decode(value)


@runtime_checkable
class ExecutionJournal(Protocol):
    """Has this ``decision_id`` been executed? Record it."""

    async def claim(self, decision_id: str, owner: str) -> bool:
        """Reserve the decision for ``owner``; ``False`` if anyone claimed it before."""
        ...

    async def result(self, decision_id: str) -> ActionResult | None:
        """The recorded result of an executed decision, or ``None``."""
        ...

    async def record(self, decision_id: str, result: ActionResult) -> None:
        """Store the result of an executed decision (overwrites a claim)."""
        ...


class InMemoryExecutionJournal:
    """An :class:`ExecutionJournal` held in a dict."""

    def __init__(self) -> None:
        """Start empty."""
        self._claims: dict[str, str] = {}
        self._results: dict[str, ActionResult] = {}
        self._mutex = asyncio.Lock()

    async def claim(self, decision_id: str, owner: str) -> bool:
        """Create-only reservation of ``decision_id``."""
        async with self._mutex:
            if decision_id in self._claims:
                return False
            self._claims[decision_id] = owner
            return True

    async def result(self, decision_id: str) -> ActionResult | None:
        """The stored result, if the decision was executed."""
        return self._results.get(decision_id)

    async def record(self, decision_id: str, result: ActionResult) -> None:
        """Store ``result`` for ``decision_id``."""
        async with self._mutex:
            self._claims.setdefault(decision_id, "")
            self._results[decision_id] = result

"""Test support for code built on the runtime: waiting for asynchronous effects.

Service tests observe a bus, and what they wait for arrives when it arrives; this is the
one polling loop they share, so a slow CI machine changes only one timeout.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any


async def eventually(predicate: Callable[[], Any] | Callable[[], Awaitable[Any]], timeout_s: float = 20.0, *,
                     interval_s: float = 0.05, what: str = "condition") -> Any:
    """Poll ``predicate`` (plain or async) until it returns something truthy and return that;
    fail the test with ``AssertionError`` naming ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(interval_s)


class LoopTurns:
    """Counts the turns of the event loop while entered (``async with LoopTurns() as turns``,
    then ``turns.count``): a test records it where work happens, to see that long work gives
    the loop back between its parts."""

    def __init__(self) -> None:
        """No turn counted yet."""
        self.count = 0
        self._counting: asyncio.Task | None = None

    async def _count(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.count += 1

    async def __aenter__(self) -> LoopTurns:
        """Start counting, from the next turn."""
        self._counting = asyncio.create_task(self._count())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Stop counting."""
        assert self._counting is not None
        self._counting.cancel()

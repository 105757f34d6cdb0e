"""The event loop a command runs on: one that Ctrl-C stops at once, even while the command
still looks up its bus's host name.

asyncio looks a host name up on its default thread pool. A lookup cannot be cancelled, and
that pool is joined when the loop closes (and by Python at exit): Ctrl-C while ``watch``,
``submit`` or ``up`` looked for a bus whose name server did not answer waited out the
resolver's timeouts before the command stopped. Here a lookup runs on a thread of its own that
nothing waits for once its answer is no longer wanted.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class CommandLoop(asyncio.SelectorEventLoop):
    """An event loop whose name lookups are left behind, not waited for, when it closes."""

    async def getaddrinfo(self, host, port, *, family=0, type=0, proto=0, flags=0):  # noqa: A002 - asyncio's names
        """``socket.getaddrinfo`` on a daemon thread; what it answers after the loop has
        closed goes nowhere."""
        answer = self.create_future()

        def settle(outcome: Any, failed: bool) -> None:
            if not answer.done():  # the wait was given up (Ctrl-C): nobody reads it
                (answer.set_exception if failed else answer.set_result)(outcome)

        def look_up() -> None:
            try:
                outcome, failed = socket.getaddrinfo(host, port, family, type, proto, flags), False
            except Exception as exc:  # noqa: BLE001 - handed to the waiting coroutine, as asyncio does
                outcome, failed = exc, True
            with contextlib.suppress(RuntimeError):  # the loop has closed: the command is over
                self.call_soon_threadsafe(settle, outcome, failed)

        threading.Thread(target=look_up, name=f"getaddrinfo {host}", daemon=True).start()
        return await answer


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a :class:`CommandLoop`: Ctrl-C cancels ``main`` and raises
    ``KeyboardInterrupt`` as ``asyncio.run`` does, without waiting for a lookup under way."""
    with asyncio.Runner(loop_factory=CommandLoop) as runner:
        return runner.run(main)

"""Each GPU's recent samples, as the health model assesses them (``HealthModel``): kept per
board, thinned, bounded in time, and forgotten when the board goes silent.

Pure: no I/O. The executor feeds every sample of the nodes it covers through ``add`` and
assesses ``current`` every health round.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from fleetpilot.contracts import GpuSample
from fleetpilot.fleet.boards import BoardIndex

BoardKey = tuple[str, str]
"""(node, board): the board is its uuid, or ``#<index>`` for a GPU no uuid was read for."""


class HealthWindows:
    """The recent samples of every GPU, thinned to one per ``every_s`` and at most
    ``window_s`` old, so a large fleet's windows stay small (240 samples per GPU by default).

    A window is a *board*'s (its NVML uuid), not an index's: indices renumber when a GPU falls
    off the bus or a board is swapped, and by index a renumbered board started its history
    over while the board that took its number went on with the old one's. A sample without a
    uuid (NVML could not read it: a board falling off the bus) goes to the window of the board
    last read at its index; a GPU no uuid was ever read for is followed by its index until
    one is, and its window then goes with the uuid (the same GPU, read at last). So a board
    swapped in at an index starts a window of its own. A sample from before the window's
    newest one (its node's clock stepped back) starts it again. A board nothing was heard from
    for ``window_s`` (by ``clock``, this process's monotonic clock: collectors' clocks may be
    wrong) is forgotten by :meth:`forget_silent`, so boards and nodes that leave the fleet do
    not stay in memory, and in every assessment, for good. Only the boards reading at an
    index now are assessed (:meth:`current`): one swapped out, or not read anywhere since its
    index went to another board, keeps its window until it reads again or goes silent.
    """

    def __init__(self, window_s: float, every_s: float) -> None:
        """Keep ``window_s`` of history, one sample per ``every_s``."""
        self._window_s = window_s
        self._every_s = every_s
        self.windows: dict[BoardKey, deque[GpuSample]] = {}
        # The board last read at each (node, index): whose a sample without a uuid is, and
        # which window an index names now.
        self.boards = BoardIndex()
        self.clock: Callable[[], float] = time.monotonic
        self._heard_at: dict[BoardKey, float] = {}

    def key_at(self, node: str, gpu: int) -> BoardKey:
        """The key of the board that reads at ``node``/``gpu`` now (the index itself when no
        uuid was read there)."""
        return node, self.boards.get(node, gpu) or f"#{gpu}"

    def _seen(self, sample: GpuSample) -> BoardKey:
        """Note where ``sample``'s board reads now; returns its key."""
        node, gpu, uuid = sample.node, sample.gpu, sample.uuid
        if not uuid:
            return self.key_at(node, gpu)
        self.boards.seen(node, gpu, uuid)
        key, by_index = (node, uuid), (node, f"#{gpu}")
        if key not in self.windows and by_index in self.windows:
            # The uuid read for the first time at an index followed so far by its number (a
            # collector that could not read it before): the same GPU, its history goes with it.
            self.windows[key] = self.windows.pop(by_index)
            self._heard_at.pop(by_index, None)
        return key

    def add(self, sample: GpuSample) -> None:
        """Keep ``sample`` in its board's window if enough time passed since the last one kept."""
        key = self._seen(sample)
        self._heard_at[key] = self.clock()
        window = self.windows.setdefault(key, deque())
        if window and sample.at < window[-1].at:
            # Samples older than the newest kept would all be thinned away until the clock
            # caught up with it.
            window.clear()
        if window and sample.at - window[-1].at < self._every_s:
            return
        window.append(sample)
        while window and window[0].at < sample.at - self._window_s:
            window.popleft()

    def of(self, node: str, gpu: int) -> deque[GpuSample] | None:
        """The window of the board that reads at ``node``/``gpu`` now (``None``: none kept)."""
        return self.windows.get(self.key_at(node, gpu))

    def current(self) -> list[tuple[str, int, deque[GpuSample]]]:
        """(node, index, window) of each board that reads at an index now, at that index."""
        out = [(node, gpu, self.windows[(node, uuid)]) for (node, gpu), uuid in self.boards.items()
               if (node, uuid) in self.windows]
        for (node, board), window in self.windows.items():
            if board.startswith("#") and (node, int(board[1:])) not in self.boards:
                out.append((node, int(board[1:]), window))
        return out

    def drop(self, node: str, gpu: int, uuid: str = "") -> None:
        """Start the history of the board ``uuid`` afresh (``""``: of the board that reads at
        ``node``/``gpu`` now)."""
        self.windows.pop((node, uuid) if uuid else self.key_at(node, gpu), None)

    @staticmethod
    def board(window: deque[GpuSample] | list[GpuSample]) -> str:
        """The uuid of the board a window holds ("" while none is known). Samples NVML could
        not read carry no uuid (a GPU fallen off the bus reads so until it is swapped), so the
        newest sample alone may not say which board it is."""
        for kept in reversed(window):
            if kept.uuid:
                return kept.uuid
        return ""

    def forget_node(self, node: str) -> None:
        """Drop the windows of ``node``'s GPUs (the node left the fleet)."""
        for key in [k for k in self.windows.keys() | self._heard_at.keys() if k[0] == node]:
            self.windows.pop(key, None)
            self._heard_at.pop(key, None)
        self.boards.forget_node(node)

    def forget_silent(self) -> None:
        """Drop the window of every board not heard from for ``window_s``, and the index it
        was last read at with it."""
        silent_since = self.clock() - self._window_s
        silent = {k for k, heard in self._heard_at.items() if heard < silent_since}
        for key in silent:
            del self._heard_at[key]
            self.windows.pop(key, None)
        self.boards.forget_boards(silent)

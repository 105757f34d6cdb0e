"""Which board reads at each GPU index of a node, as the latest samples said.

A GPU's index renumbers when a board falls off the bus or is swapped, so what the executor
keeps of a GPU (its health window, its decommission state) is keyed by the board's NVML
uuid, and the index a sample or a placement names is looked up here. A board read at a new
index has left its old one. Both directions are kept, so that a sample costs a few dict
operations whatever the fleet's size: found by scanning every index, each sample of a
6,212-GPU fleet cost 6,212 steps, and an executor covering the whole openb fleet spent its
core on that and fell behind its telemetry.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable

IndexKey = tuple[str, int]
"""(node, GPU index)."""
BoardKey = tuple[str, str]
"""(node, board uuid)."""


class BoardIndex:
    """(node, index) → the board (uuid) read there now, and back."""

    def __init__(self) -> None:
        """Empty: no board read anywhere yet."""
        self._board_at: dict[IndexKey, str] = {}
        self._index_of: dict[BoardKey, int] = {}

    def get(self, node: str, gpu: int) -> str | None:
        """The board read at ``node``/``gpu`` now, ``None`` when none was."""
        return self._board_at.get((node, gpu))

    def seen(self, node: str, gpu: int, uuid: str) -> None:
        """``uuid`` reads at ``node``/``gpu`` now: at the index it read at before, if another,
        it reads no more, and the board that read here before is at no index now."""
        before = self._index_of.get((node, uuid))
        if before is not None and before != gpu and self._board_at.get((node, before)) == uuid:
            del self._board_at[node, before]  # renumbered: the board left that index
        replaced = self._board_at.get((node, gpu))
        if replaced is not None and replaced != uuid and self._index_of.get((node, replaced)) == gpu:
            del self._index_of[node, replaced]
        self._board_at[node, gpu] = uuid
        self._index_of[node, uuid] = gpu

    def items(self) -> ItemsView[IndexKey, str]:
        """Every ((node, index), board) read now."""
        return self._board_at.items()

    def forget_node(self, node: str) -> None:
        """Drop every board of ``node`` (the node left the fleet)."""
        self.forget_boards([key for key in self._index_of if key[0] == node])

    def forget_boards(self, boards: Iterable[BoardKey]) -> None:
        """Drop these (node, uuid) boards and the indices they read at."""
        for node, uuid in boards:
            at = self._index_of.pop((node, uuid), None)
            if at is not None and self._board_at.get((node, at)) == uuid:
                del self._board_at[node, at]

    def __contains__(self, key: IndexKey) -> bool:
        """Whether a board was read at ``key``, (node, index)."""
        return key in self._board_at

    def __len__(self) -> int:
        """How many indices have a board read at them."""
        return len(self._board_at)

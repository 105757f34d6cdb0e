"""Which board reads at each GPU index: a board read at a new index leaves its old one, an
index read by a new board forgets the old board, and forgetting a node or a board leaves
the rest as it was."""

from __future__ import annotations

import asyncio

from fleetpilot.fleet.boards import BoardIndex


def test_a_board_read_at_a_new_index_leaves_its_old_one():
    boards = BoardIndex()
    boards.seen("n1", 0, "GPU-a")
    boards.seen("n1", 1, "GPU-b")
    boards.seen("n1", 1, "GPU-a")  # renumbered: GPU-b fell off the bus, GPU-a took index 1
    assert boards.get("n1", 0) is None and boards.get("n1", 1) == "GPU-a"
    assert sorted(boards.items()) == [(("n1", 1), "GPU-a")]
    boards.seen("n1", 0, "GPU-b")  # GPU-b back at index 0: GPU-a stays where it reads
    assert sorted(boards.items()) == [(("n1", 0), "GPU-b"), (("n1", 1), "GPU-a")]


def test_the_same_uuid_on_two_nodes_is_two_boards():
    boards = BoardIndex()
    boards.seen("n1", 0, "GPU-x")
    boards.seen("n2", 3, "GPU-x")
    assert boards.get("n1", 0) == "GPU-x" and boards.get("n2", 3) == "GPU-x"


def test_a_board_swapped_in_forgets_the_one_it_replaced():
    boards = BoardIndex()
    boards.seen("n1", 0, "GPU-old")
    boards.seen("n1", 0, "GPU-new")
    boards.forget_boards([("n1", "GPU-old")])  # gone silent: nothing of it is read anywhere
    assert boards.get("n1", 0) == "GPU-new"
    boards.seen("n1", 2, "GPU-old")  # read again elsewhere: GPU-new is not moved by it
    assert sorted(boards.items()) == [(("n1", 0), "GPU-new"), (("n1", 2), "GPU-old")]


def test_forgetting_a_node_or_a_board_leaves_the_others():
    boards = BoardIndex()
    for node in ("n1", "n2"):
        for gpu in range(2):
            boards.seen(node, gpu, f"GPU-{node}-{gpu}")
    boards.forget_node("n1")
    boards.forget_boards([("n2", "GPU-n2-0"), ("n2", "#1")])  # an index-only key names no board
    assert sorted(boards.items()) == [(("n2", 1), "GPU-n2-1")]
    assert len(boards) == 1


class Unscannable(dict):
    """A dict that may be read and written key by key, never walked."""

    def __iter__(self):
        raise AssertionError("walked every entry")

    def items(self):
        raise AssertionError("walked every entry")

    keys = values = items


def test_a_sample_reads_only_its_own_entries_however_large_the_fleet():
    # Each sample's board was found by walking every index known: on the openb fleet's 6,212
    # GPUs an executor covering the fleet spent 4.2 s of CPU per second of telemetry.
    from fleetpilot.executor import PreDecommissionHook
    from fleetpilot.executor.locks import InMemoryHookLock
    from fleetpilot.maintenance.faults import gpu_reading
    from fleetpilot.maintenance.windows import HealthWindows

    windows = HealthWindows(window_s=7200, every_s=30)
    hook = PreDecommissionHook("a", InMemoryHookLock())

    async def feed(samples) -> None:
        for sample in samples:
            windows.add(sample)
            await hook.observe(sample, ())

    asyncio.run(feed(gpu_reading(f"n{node}", gpu, 1_000.0) for node in range(50) for gpu in range(8)))
    for index in (windows.boards, hook.boards):
        index._board_at = Unscannable(index._board_at)  # noqa: SLF001 - what a sample may touch
        index._index_of = Unscannable(index._index_of)  # noqa: SLF001
    # The second sample: board 5 renumbered to index 3.
    asyncio.run(feed([gpu_reading("n7", 3, 1_060.0), gpu_reading("n7", 3, 1_090.0, uuid="GPU-n7-5")]))
    for index in (windows.boards, hook.boards):
        assert index.get("n7", 3) == "GPU-n7-5" and index.get("n7", 5) is None

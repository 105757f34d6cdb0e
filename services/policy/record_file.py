"""The replay record's file (``state_dir/policy-states.jsonl``), bounded by rotation.

Every replica that shares the state directory appends to the one file under an exclusive
``flock``. Before a line would take the file past its bound, the writer holding the lock
renames it to ``<file>.1`` (``.1`` to ``.2``, ..., the oldest past ``keep`` dropped), the way
logrotate names files, so ``fleetpilot replay`` finds them. The lock lives on the file itself
(no lock file beside it), so a writer re-checks after taking it that its file is still the
one at the path: one that waited while another rotated holds the lock of a renamed file and
opens the new one instead. Thus one writer rotates a full file, none appends to a rotated one,
and no line is lost, cut or written twice.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import BinaryIO


def rotated_path(path: Path, number: int) -> Path:
    """The ``number``-th rotated file of ``path`` (1 is the newest): ``<path>.<number>``."""
    return path.with_name(f"{path.name}.{number}")


def rotated_numbers(path: Path) -> list[int]:
    """The numbers of the rotated files of ``path`` on disk, ascending (newest first); gaps
    (a rotation cut short between two renames) are kept as they are."""
    prefix = path.name + "."
    suffixes = [s.name[len(prefix):] for s in path.parent.iterdir() if s.name.startswith(prefix)]
    return sorted(int(x) for x in suffixes if x.isascii() and x.isdigit() and int(x) > 0)


class RecordFile:
    """Appends whole lines to ``path`` under ``flock``, rotating it before a line would take it
    past ``max_bytes``; keeps ``keep`` rotated files (0: the full file is dropped)."""

    def __init__(self, path: Path, max_bytes: int, keep: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep

    def append(self, line: bytes) -> None:
        """Append ``line`` (ending in a newline) whole, rotating the file first if it would pass
        the bound (a line larger than the bound alone takes a file of its own). An ``OSError``
        (the disk full) leaves the file as it was, with no part of the line in it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            with self.path.open("ab", buffering=0) as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file is closed
                if not self._is_current(fh):
                    continue  # another writer rotated the file while this one waited: reopen
                size = os.fstat(fh.fileno()).st_size
                if size > 0 and size + len(line) > self.max_bytes:
                    self._rotate()
                    continue  # the lock held is now a rotated file's: take the new file's
                self._write_whole(fh, line, size)
                return

    def _is_current(self, fh: BinaryIO) -> bool:
        """Whether the open (locked) file is still the one at ``path``."""
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:  # rotated away (or dropped with keep 0), not yet recreated
            return False
        mine = os.fstat(fh.fileno())
        return (mine.st_dev, mine.st_ino) == (at_path.st_dev, at_path.st_ino)

    @staticmethod
    def _write_whole(fh: BinaryIO, line: bytes, size: int) -> None:
        """Write all of ``line`` or none: a write cut short (the disk full) is taken back, since
        a partial line glued to the next record made ``fleetpilot replay`` refuse the file."""
        view = memoryview(line)
        try:
            while view:
                written = os.write(fh.fileno(), view)
                view = view[written:]
        except OSError:
            os.ftruncate(fh.fileno(), size)
            raise

    def _rotate(self) -> None:
        """Shift the rotated files up by one and the current file to ``.1``; called holding the
        lock of the file at ``path``. Files numbered ``keep`` or above go first: the oldest,
        and any left by an earlier, larger ``keep``. Renamed oldest first, so a crash between
        two renames leaves a gap, never a file overwritten."""
        for number in rotated_numbers(self.path):
            if number >= max(self.keep, 1):
                rotated_path(self.path, number).unlink(missing_ok=True)
        if self.keep == 0:
            self.path.unlink()
            return
        for number in range(self.keep - 1, 0, -1):
            try:
                os.replace(rotated_path(self.path, number), rotated_path(self.path, number + 1))
            except FileNotFoundError:
                pass  # fewer rotations so far, or a gap
        os.replace(self.path, rotated_path(self.path, 1))

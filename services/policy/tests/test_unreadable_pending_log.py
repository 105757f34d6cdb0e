"""An unreadable ``pending`` entry is reported once per revision, not by every round."""

from __future__ import annotations

import logging
from pathlib import Path

from fleetpilot.runtime.bus import KvEntry
from fleetpilot_services.policy.retry_round import PendingQueue, RetryRound

from .conftest import policy_state


async def test_an_unreadable_entry_is_logged_once_until_it_is_written_again(tmp_path: Path, caplog) -> None:
    ps = policy_state(tmp_path)
    queue = PendingQueue(None)  # type: ignore[arg-type]
    queue.entries["garbled"] = KvEntry("garbled", b"{not an admission", 7)
    caplog.set_level(logging.ERROR, logger="fleetpilot.policy")

    async def rounds(n: int) -> int:
        caplog.clear()
        for _ in range(n):
            await RetryRound(ps, queue, ps.settings, lambda d: d).collect()
        return sum("garbled is unreadable" in r.getMessage() for r in caplog.records)

    # Before, every round (every pending_retry_s, 1 s by default) logged it again: 86,400
    # error lines a day for one bad entry, burying everything else.
    assert await rounds(5) == 1
    queue.entries["garbled"] = KvEntry("garbled", b"{still not one", 8)  # written again
    assert await rounds(3) == 1

"""Children that end with the process that started them (``ended_with_this_process``)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fleetpilot.runtime.children import ended_with_this_process

PARENT = """
import subprocess, sys, time
from fleetpilot.runtime.children import ended_with_this_process
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                         preexec_fn=ended_with_this_process() if sys.argv[1] == "tied" else None)
print(child.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, or a reaped process, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_child_ends_when_its_parent_is_killed_and_an_untied_one_runs_on(tied) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "tied" if tied else "free"],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())  # type: ignore[union-attr]
    try:
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline and tied:
            time.sleep(0.05)
        assert alive(child) is not tied
    finally:
        if alive(child):
            subprocess.run(["kill", "-9", str(child)], check=False)


def test_it_refuses_a_child_started_from_another_thread() -> None:
    # The kernel ties the signal to the starting thread: a worker thread that ended would
    # take the child with it while this process still ran.
    errors: list[BaseException] = []

    def start() -> None:
        try:
            ended_with_this_process()
        except RuntimeError as exc:
            errors.append(exc)

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    assert [str(e) for e in errors] == ["a child that ends with its parent must be started from the main thread"]

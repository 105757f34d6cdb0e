"""Child processes that do not outlive the process that started them.

``fleetpilot up`` starts the nats-server and the services each in a session of its own, so
that a Ctrl-C in its terminal reaches ``up`` alone, which then stops them in order. A ``up``
killed outright (SIGKILL, the OOM killer) could stop nothing: they ran on, the executor's
tasks with them, holding the GPUs and the ports, with nobody to stop them. On Linux the
kernel can send a child a signal when its parent dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def ended_with_this_process(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` after which the child is sent ``sig`` when
    this process dies, however it dies; ``None`` where the kernel offers no such thing
    (not Linux), and the child then outlives a killed parent as before.

    The kernel ties it to the thread that starts the child, not to the process: a child
    started from a thread that ends would be sent ``sig`` then. So this is only for children
    started from the main thread, and says so by raising ``RuntimeError`` anywhere else.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("a child that ends with its parent must be started from the main thread")
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    parent = os.getpid()

    def in_the_child() -> None:
        """Runs in the child between fork and exec (the setting survives the exec)."""
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the setting took
            os.kill(os.getpid(), sig)

    return in_the_child

"""Executor family: a node's executor saying it is there to carry decisions out.

A node's collector keeps reporting while its executor is down (a crash loop, an image that
does not start), and a node that reports is in service: decisions kept going to it and
nobody carried them out. With one executor per node (``FLEETPILOT_EXECUTOR_NODE``), the
executor rewrites its node's key in the ``executors`` bucket every few seconds; the topology
service labels the node ``not_ready`` once the key stops changing, and lifts the label when
it changes again. A node whose executor never wrote the key (one executor serving the
simulated fleet) is not judged by it.

An executor that is there but cannot start anything on its node (its disk full, out of
processes or file handles: its starts fail for the node's fault, not the task's) says so in
``trouble``, and the topology service takes the node out of service at once, until the
executor writes the key again without it.
"""

from __future__ import annotations

from .base import Record


class ExecutorPresence(Record, frozen=True, kw_only=True):
    """The value of a node's key in the ``executors`` bucket: which replica wrote it and when
    (its clock; the topology service judges silence by the key's revisions, on its own), and
    ``trouble``: why no task can start on the node now (empty: nothing known)."""

    node: str
    replica: str
    at: float
    trouble: str = ""

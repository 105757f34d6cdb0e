"""``fleetpilot fleet``: what the fleet is made of and, when it runs, what every GPU is doing.

Without a reachable NATS server it prints the fleet of a spec (``--spec`` YAML, ``--openb``
node list, or the shipped three-site fleet): sites, nodes, GPUs per model, inter-site links
and the bandwidth estimates of ``fleet.bandwidth.SiteNetwork``.

With a running fleet (``--nats-url`` or ``FLEETPILOT_NATS_URL``) it also reads the
``topology`` bucket (the nodes the collectors reported), the latest ``topology.updated``
(the topology service's bandwidth estimates) and the ``gpu_state`` bucket (the latest
sample of every GPU), and prints one line per GPU with its state in service, then every GPU
out of service (cordoned, decommissioned, pending maintenance, or on an unreachable node,
which sends no samples), and the nodes whose decisions have waited over five minutes for
their executor. It only reads: no bucket or stream is created by looking.

``fleetpilot fleet forget NODE`` removes a node gone for good (decommissioned, renamed) from
the running fleet: without it, its key stays in the ``topology`` bucket for ever, marked
``unreachable``, and every service goes on seeing it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from fleetpilot.contracts import (
    GPU_LABEL_CORDONED,
    GPU_LABEL_DECOMMISSIONED,
    GPU_LABEL_MAINTENANCE_PENDING,
    GPU_LABEL_MAINTENANCE_RISK,
    GPU_LABEL_MIG,
    GPU_LABEL_NOT_READY,
    GPU_LABEL_UNREACHABLE,
    BandwidthEstimate,
    ExecutorPresence,
    GpuSample,
    NodeLedger,
    NodeTopology,
    TopologyUpdated,
    decode,
    marked_condition,
    unreachable_since,
)
from fleetpilot.fleet.bandwidth import SiteNetwork
from fleetpilot.fleet.inventory import Fleet, Site, load_fleet_spec, load_openb_fleet

from . import event_loop
from .arguments import nats_url, path_text
from .local import announced_nats_url, connect_once, local_nats_url, no_jetstream

READ_TIMEOUT_S = 10.0


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot fleet``."""
    parser.add_argument("--nats-url", type=nats_url, default=None,
                        help="a running fleet's NATS (default: $FLEETPILOT_NATS_URL, else the one `fleetpilot up` "
                             "runs from --state-dir; none: the spec only)")
    parser.add_argument("--state-dir", type=path_text, default=None, help="where a running `fleetpilot up` keeps its state")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--spec", type=path_text, help="fleet spec YAML (default: the shipped three-site fleet)")
    source.add_argument("--openb", type=path_text, metavar="NODES.csv", help="openb node list CSV")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    actions = parser.add_subparsers(dest="fleet_action", metavar="forget")
    forget = actions.add_parser(
        "forget", help="remove a node gone for good from the running fleet",
        description="Remove a node gone for good (decommissioned, renamed) from the running fleet: its entry in "
                    "the topology bucket, its labels with it, and its executor's key. Only a node the topology "
                    "service has given up (unreachable) whose tasks the ledger no longer holds, unless --force.")
    forget.add_argument("node", help="the node's name, as `fleetpilot fleet` shows it")
    forget.add_argument("--force", action="store_true",
                        help="forget a node still reporting (its next report brings it back, without its labels) "
                             "or whose tasks the ledger still holds (they stay held)")
    # SUPPRESS: given before `forget`, the flag keeps its value (a default here replaced it).
    forget.add_argument("--nats-url", type=nats_url, default=argparse.SUPPRESS,
                        help="the running fleet's NATS (default: $FLEETPILOT_NATS_URL, else the one `fleetpilot up` "
                             "runs from --state-dir)")
    forget.add_argument("--state-dir", type=path_text, default=argparse.SUPPRESS, help="where a running `fleetpilot up` keeps its state")


@dataclass
class LiveFleet:
    """What a running fleet's buckets and streams hold."""

    url: str
    nodes: list[NodeTopology] = field(default_factory=list)
    samples: list[GpuSample] = field(default_factory=list)
    bandwidth: list[BandwidthEstimate] | None = None
    ledgers: list[NodeLedger] = field(default_factory=list)
    executors: list[ExecutorPresence] = field(default_factory=list)


def load_fleet_file(path: str, *, openb: bool | None = None) -> Fleet:
    """The fleet in ``path`` as the simulator reads it: the openb node list (``openb``, by
    default a ``.csv``), else a spec YAML. A file that does not load, or holds no node, is a
    ``ValueError`` in one line naming it: an empty fleet is the wrong file, not a fleet."""
    is_openb = path.lower().endswith(".csv") if openb is None else openb
    try:
        if Path(path).is_dir():
            raise ValueError("is a directory")
        fleet = load_openb_fleet(path) if is_openb else load_fleet_spec(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except KeyError as exc:  # a missing column or key: its str() is the quoted name
        raise ValueError(f"{path}: not a valid fleet: missing {exc}") from None
    except (TypeError, AttributeError, UnicodeDecodeError, LookupError, ValueError,
            msgspec.ValidationError) as exc:
        # A malformed spec surfaces as any of these from the YAML/CSV builders.
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path}: not a valid fleet: {text}") from None
    except Exception as exc:  # yaml.YAMLError and friends: still one line, never a traceback
        raise ValueError(f"{path}: not a valid fleet: {str(exc).splitlines()[0]}") from None
    if not fleet.nodes:
        what = "an openb node list (sn,cpu_milli,memory_mib,gpu,model)" if is_openb else "a fleet spec YAML"
        raise ValueError(f"{path}: not a valid fleet: no nodes (expected {what})")
    return fleet


def load_spec(args) -> tuple[Fleet, str]:
    """The fleet named by the flags and a word on where it came from."""
    if args.openb is not None:
        return load_fleet_file(args.openb, openb=True), f"openb node list {args.openb}"
    if args.spec is not None:
        return load_fleet_file(args.spec, openb=False), f"spec {args.spec}"
    return load_fleet_spec(), "shipped three-site spec"


async def _read_bucket(js, bucket: str, kind: type) -> list:
    """Every live value of a bucket decoded as ``kind``; a missing bucket is empty.

    Keys come from the stream's per-subject state (``bucket_subject_keys``), not from a
    watch: nats-py's initial-values marker can go missing when a write races the listing.
    """
    import nats.js.errors

    from fleetpilot.runtime.nats_bus import bucket_subject_keys

    try:
        kv = await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        return []
    out = []
    for key in await asyncio.wait_for(bucket_subject_keys(js, bucket), READ_TIMEOUT_S):
        try:
            entry = await asyncio.wait_for(kv.get(key), READ_TIMEOUT_S)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            continue  # deleted since the listing
        if entry.value:
            try:
                out.append(msgspec.json.decode(entry.value, type=kind))
            except msgspec.DecodeError:
                continue  # a foreign or older value: not ours to show
    return out


async def _last_bandwidth(js) -> list[BandwidthEstimate] | None:
    import nats.js.errors

    try:
        msg = await js.get_last_msg("TOPOLOGY", "topology.updated")
    except nats.js.errors.NotFoundError:
        return None
    try:
        return list(decode(msg.data, TopologyUpdated).bandwidth)
    except msgspec.DecodeError:
        return None


async def read_live(url: str) -> LiveFleet:
    """Read the running fleet's state; ``ConnectionError`` when no server answers."""
    import nats.js.errors

    nc = await connect_once(url, "fleetpilot-fleet")
    try:
        js = nc.jetstream()
        live = LiveFleet(url=url)
        live.nodes = await _read_bucket(js, "topology", NodeTopology)
        live.samples = await _read_bucket(js, "gpu_state", GpuSample)
        live.bandwidth = await _last_bandwidth(js)
        live.ledgers = await _read_bucket(js, "ledger", NodeLedger)
        live.executors = await _read_bucket(js, "executors", ExecutorPresence)
        return live
    except nats.js.errors.ServiceUnavailableError:
        raise no_jetstream(url) from None  # no fleet can run there: the spec is shown alone
    finally:
        await nc.close()


def summarise(fleet: Fleet, source: str, live: LiveFleet | None) -> dict[str, Any]:
    """The fleet as plain data: sites, nodes, GPUs per model, links, bandwidth estimates.

    With live data, the reported nodes replace the spec's and the topology service's
    estimates replace the ones computed from the spec's links.
    """
    nodes = fleet.nodes
    name, sites, links = fleet.name, list(fleet.sites), list(fleet.links)
    if live is not None and live.nodes:
        nodes = sorted(live.nodes, key=lambda n: n.node)
        source = f"topology bucket at {live.url}"
        # The running fleet is what its collectors reported, not the spec: a fleet `up` ran
        # from another spec (the openb node list) was shown under the spec's name, with the
        # spec's sites at 0 nodes and links between them that do not exist there.
        present = {n.site for n in nodes}
        known = {s.name for s in fleet.sites}
        sites = [s for s in fleet.sites if s.name in present] + [Site(name=s) for s in sorted(present - known)]
        links = [link for link in fleet.links if link.a in present and link.b in present]
        if not present <= known:
            name = "running"
    bandwidth = SiteNetwork(links).estimates() if links else []
    bandwidth_source = "computed from the spec's links"
    if live is not None and live.bandwidth is not None:
        bandwidth, bandwidth_source = live.bandwidth, "latest topology.updated"
    return {
        "fleet": name,
        "source": source,
        "sites": [
            {"name": s.name, "kind": s.kind, "region": s.region,
             "nodes": sum(1 for n in nodes if n.site == s.name),
             "gpus": sum(len(n.gpus) for n in nodes if n.site == s.name),
             "gpu_models": dict(sorted(Counter(g.model for n in nodes if n.site == s.name for g in n.gpus).items()))}
            for s in sites
        ],
        "nodes": [{"node": n.node, "site": n.site, "gpus": len(n.gpus),
                   "gpu_models": sorted({g.model for g in n.gpus})} for n in nodes],
        "gpu_models": dict(sorted(Counter(g.model for n in nodes for g in n.gpus).items())),
        "links": [msgspec.to_builtins(link) for link in links],
        "bandwidth_source": bandwidth_source,
        "bandwidth": [msgspec.to_builtins(b) for b in bandwidth],
    }


def service_state(labels: dict[str, str]) -> str:
    """A GPU's state in service, from the labels operations put on it: ``unreachable`` (its
    node's collector went silent: its tasks are given up), ``not_ready`` (silent a shorter
    while: no new work), ``decommissioned``, ``cordoned``, ``mig`` (cut into MIG slices, which
    placement does not model), ``maintenance (risk R)``, else
    ``ok``. The first that holds wins, in that order."""
    def on(label: str) -> bool:
        return labels.get(label, "").lower() == "true"

    for label in (GPU_LABEL_UNREACHABLE, GPU_LABEL_NOT_READY, GPU_LABEL_DECOMMISSIONED, GPU_LABEL_CORDONED,
                  GPU_LABEL_MIG):
        if on(label):
            return label
    if on(GPU_LABEL_MAINTENANCE_PENDING):
        risk = labels.get(GPU_LABEL_MAINTENANCE_RISK)
        return f"maintenance (risk {risk})" if risk else "maintenance"
    return "ok"


def out_of_service(nodes: list[NodeTopology]) -> list[dict[str, Any]]:
    """Every GPU not in service, sampled or not (an unreachable node's GPUs send nothing)."""
    return [{"node": n.node, "gpu": g.index, "model": g.model, "state": service_state(g.labels)}
            for n in sorted(nodes, key=lambda n: n.node) for g in n.gpus if service_state(g.labels) != "ok"]


STALE_RESERVATION_S = 300.0
"""A reservation older than this has waited too long for its executor (a decision is
carried out in well under a second)."""


def not_carried_out(ledgers: list[NodeLedger], now: float, older_than_s: float = STALE_RESERVATION_S
                    ) -> list[dict[str, Any]]:
    """Per node, the decisions reserved in the ledger longer than ``older_than_s`` ago and
    still not confirmed by an executor: the node's executor is down, or never started."""
    out = []
    for ledger in sorted(ledgers, key=lambda ledger: ledger.node):
        waiting: dict[str, float] = {}
        for a in ledger.allocations:
            if a.state == "reserved" and a.at > 0 and now - a.at > older_than_s:
                waiting[a.decision_id] = min(waiting.get(a.decision_id, a.at), a.at)
        if waiting:
            out.append({"node": ledger.node, "decisions": sorted(waiting),
                        "oldest_s": round(now - min(waiting.values()), 1)})
    return out


EXECUTOR_SILENT_S = 60.0
"""An executor that has not rewritten its node's key for this long is shown as silent (the
topology service's ``EXECUTOR_SILENT_AFTER_S``: its node then takes no new work)."""


def silent_executors(executors: list[ExecutorPresence], now: float, older_than_s: float = EXECUTOR_SILENT_S
                     ) -> list[dict[str, Any]]:
    """The nodes whose executor last said it was there more than ``older_than_s`` ago (by
    its clock, read against this one's): the executor is down, and the node takes no new work."""
    return [{"node": e.node, "replica": e.replica, "silent_s": round(now - e.at, 1)}
            for e in sorted(executors, key=lambda e: e.node) if now - e.at > older_than_s]


def troubled_executors(executors: list[ExecutorPresence]) -> list[dict[str, Any]]:
    """The nodes whose executor says no task can start there (``trouble``: its starts kept
    failing for the node's fault, a full disk, no processes left): they take no new work."""
    return [{"node": e.node, "replica": e.replica, "trouble": e.trouble}
            for e in sorted(executors, key=lambda e: e.node) if e.trouble]


def gpu_rows(samples: list[GpuSample], nodes: list[NodeTopology] | None = None) -> list[dict[str, Any]]:
    """One compact record per GPU, ordered by node and index, with its state in service."""
    labels = {(n.node, g.index): g.labels for n in nodes or [] for g in n.gpus}
    return [
        {"node": s.node, "gpu": s.gpu, "model": s.model, "util_pct": s.utilization_gpu_pct,
         "mem_used_mb": s.memory_used_mb, "mem_total_mb": s.memory_total_mb, "temp_c": s.temperature_c,
         "power_w": s.power_w, "ctx_switches_per_s": s.cuda_context_switches_per_sec.value, "at": s.at,
         "state": service_state(labels.get((s.node, s.gpu), {}))}
        for s in sorted(samples, key=lambda s: (s.node, s.gpu))
    ]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _node_range(names: list[str]) -> str:
    if not names:
        return "no nodes"
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def render_text(summary: dict[str, Any], rows: list[dict[str, Any]] | None, out,
                idle: list[dict[str, Any]] | None = None, stale: list[dict[str, Any]] | None = None,
                quiet: list[dict[str, Any]] | None = None, troubled: list[dict[str, Any]] | None = None) -> None:
    """Tables for people: the fleet, then (when live) one line per GPU, the GPUs out of
    service (``idle``), the nodes whose decisions wait for their executor (``stale``), those
    whose executor has gone silent (``quiet``) or cannot start tasks there (``troubled``)."""
    total_nodes = sum(s["nodes"] for s in summary["sites"])
    total_gpus = sum(s["gpus"] for s in summary["sites"])
    print(f"fleet {summary['fleet']} ({summary['source']}): {_count(len(summary['sites']), 'site')}, "
          f"{_count(total_nodes, 'node')}, {_count(total_gpus, 'GPU')}", file=out)
    for s in summary["sites"]:
        models = ", ".join(f"{count}x {model}" for model, count in s["gpu_models"].items()) or "no GPUs"
        where = ", ".join(x for x in (s["kind"], s["region"]) if x)
        names = [n["node"] for n in summary["nodes"] if n["site"] == s["name"]]
        print(f"  {s['name']} ({where}): {_count(s['nodes'], 'node')} [{_node_range(names)}], "
              f"{_count(s['gpus'], 'GPU')}: {models}",
              file=out)
    if summary["links"]:
        print("inter-site links:", file=out)
        for link in summary["links"]:
            name = f" {link['name']}" if link["name"] else ""
            print(f"  {link['a']} <-> {link['b']}{name}: {link['rate_gbps']:g} Gbit/s, {link['rtt_ms']:g} ms RTT",
                  file=out)
    if summary["bandwidth"]:
        print(f"bandwidth estimates, Gbit/s ({summary['bandwidth_source']}):", file=out)
        pairs: dict[tuple[str, str], dict[str, dict]] = {}
        for b in summary["bandwidth"]:
            pairs.setdefault((b["a_site"], b["b_site"]), {})[b["strategy"]] = b
        for (a, b), by in pairs.items():
            cells = "  ".join(f"{k} {v['effective_gbps']:8.1f} (uncertainty {v['uncertainty_score']:.1f})"
                              for k, v in sorted(by.items()))
            print(f"  {a} <-> {b}: {cells}", file=out)
    if rows is None:
        return
    if not rows:
        print("live: no GPU samples in the gpu_state bucket (is the collector running?)", file=out)
    else:
        print(f"live: {len(rows)} GPUs", file=out)
        width = max(len("NODE"), *(len(r["node"]) for r in rows))
        model_w = max(len("MODEL"), *(len(r["model"]) for r in rows))
        print(f"{'NODE':<{width}} {'GPU':>3} {'MODEL':<{model_w}} {'UTIL%':>6} {'MEM USED/TOTAL MiB':>19} "
              f"{'TEMP C':>6} {'POWER W':>7} {'CTXSW/S':>8} STATE", file=out)
        for r in rows:
            mem = f"{r['mem_used_mb']:.0f}/{r['mem_total_mb']:.0f}"
            print(f"{r['node']:<{width}} {r['gpu']:>3} {r['model']:<{model_w}} {r['util_pct']:>6.1f} {mem:>19} "
                  f"{r['temp_c']:>6.1f} {r['power_w']:>7.1f} {r['ctx_switches_per_s']:>8.1f} {r['state']}", file=out)
    if idle:
        print(f"out of service: {_count(len(idle), 'GPU')}", file=out)
        for g in idle:
            print(f"  {g['node']}/{g['gpu']} ({g['model']}): {g['state']}", file=out)
    if stale:
        print(f"not carried out (reserved over {STALE_RESERVATION_S:.0f} s ago; is the node's executor running?):",
              file=out)
        for n in stale:
            shown = ", ".join(n["decisions"][:3]) + (f" (+{len(n['decisions']) - 3} more)" if len(n["decisions"]) > 3 else "")
            print(f"  {n['node']}: {_count(len(n['decisions']), 'decision')}, oldest {n['oldest_s'] / 60:.0f} min: "
                  f"{shown}", file=out)
    if troubled:
        print(f"executors that cannot start tasks (their nodes take no new work): {_count(len(troubled), 'node')}",
              file=out)
        for e in troubled:
            print(f"  {e['node']}: {e['replica']}: {e['trouble']}", file=out)
    if quiet:
        print(f"executors silent (their nodes take no new work): {_count(len(quiet), 'node')}; "
              "last word from each, by its clock:", file=out)
        for e in quiet:
            ago = f"{e['silent_s'] / 60:.0f} min" if e["silent_s"] >= 120 else f"{e['silent_s']:.0f} s"
            print(f"  {e['node']}: {e['replica']}, {ago} ago", file=out)


async def forget_node(url: str, name: str, force: bool = False) -> list[str]:
    """Remove node ``name`` from the fleet at ``url``: its ``topology`` entry (compare-and-set
    at the revision judged) and its ``executors`` key; what was removed, one line each. A node
    not given up (``unreachable``), or whose tasks the ``ledger`` still holds, is refused
    with a one-line ``ValueError`` and nothing removed, unless ``force``.

    The ledger is not written here (the policy and executor own it): the executor gives an
    unreachable node's tasks up, but only while the node is in the bucket."""
    import nats.js.errors

    from fleetpilot.ledger.store import node_key
    from fleetpilot.runtime import CasConflict
    from fleetpilot.runtime.nats_bus import NatsKeyValue

    nc = await connect_once(url, "fleetpilot-fleet-forget")
    try:
        js = nc.jetstream()

        async def bucket(name: str) -> NatsKeyValue | None:
            try:
                return NatsKeyValue(await asyncio.wait_for(js.key_value(name), READ_TIMEOUT_S), js, name)
            except nats.js.errors.BucketNotFoundError:
                return None
            except nats.js.errors.ServiceUnavailableError:
                raise no_jetstream(url) from None

        key = node_key(name)
        topology = await bucket("topology")
        entry = await asyncio.wait_for(topology.get(key), READ_TIMEOUT_S) if topology is not None else None
        if topology is None or entry is None or not entry.value:
            raise ValueError(f"no node {name!r} in the fleet at {url}: nothing to forget")
        try:
            node: NodeTopology | None = msgspec.json.decode(entry.value, type=NodeTopology)
        except (msgspec.DecodeError, msgspec.ValidationError):
            node = None
        condition = "unreadable" if node is None else marked_condition(node) or "ready"
        if condition != GPU_LABEL_UNREACHABLE and not force:
            why = {"ready": "its collector reports", GPU_LABEL_NOT_READY: "silent a while, not given up yet",
                   "unreadable": "its entry is not a node topology"}[condition]
            raise ValueError(f"{name} is {condition} ({why}), not unreachable: not forgotten (the topology service "
                             "gives a silent node up after FLEETPILOT_TOPOLOGY_SILENT_AFTER_S; --force forgets it anyway)")
        back = await reported_since_given_up(js, node) if condition == GPU_LABEL_UNREACHABLE else None
        if back is not None and not force:
            raise ValueError(f"{name} has reported again since it was given up ({back:.0f} s ago): the topology "
                             "service lifts its mark at its next check; not forgotten (--force forgets it anyway, "
                             "and its next report brings it back without its labels)")
        if back is not None:
            condition = f"{condition}, but reported again"
        ledger = await bucket("ledger")
        held_entry = await asyncio.wait_for(ledger.get(key), READ_TIMEOUT_S) if ledger is not None else None
        held: list[str] = []
        if held_entry is not None and held_entry.value:
            try:
                held = sorted({a.task_id for a in msgspec.json.decode(held_entry.value, type=NodeLedger).allocations})
            except (msgspec.DecodeError, msgspec.ValidationError):
                held = []
        tasks = f"{_count(len(held), 'task')} ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''})"
        if held and not force:
            raise ValueError(f"the ledger still holds {tasks} on {name}: not forgotten (the executor gives an "
                             "unreachable node's tasks up, but only while it is in the fleet: is one running? "
                             "--force forgets it and leaves them held)")
        try:
            await asyncio.wait_for(topology.delete(key, revision=entry.revision), READ_TIMEOUT_S)
        except CasConflict:
            raise ValueError(f"{name} changed while being forgotten (a report, a label): nothing removed; "
                             "look again") from None
        forced = "" if condition == GPU_LABEL_UNREACHABLE and not held else ", forced"
        lines = [f"forgot {name} ({condition}{forced}): removed its topology entry"
                 + (f" ({node.site}, {_count(len(node.gpus), 'GPU')}), with its labels: {kept_labels(node)}"
                    if node is not None else "")]
        executors = await bucket("executors")
        if executors is not None and await asyncio.wait_for(executors.get(key), READ_TIMEOUT_S) is not None:
            await asyncio.wait_for(executors.delete(key), READ_TIMEOUT_S)
            lines.append("removed its executor's key (an executor still running there writes it again)")
        if held:
            lines.append(f"left held in the ledger: {tasks}: not placed again until released")
        if forced:
            lines.append(f"its next report, if it still reports, brings {name} back as a new node, without these "
                         "labels")
        return lines
    finally:
        await nc.close()


async def reported_since_given_up(js, node: NodeTopology) -> float | None:
    """How long ago the node's last report was stored, when that was after the topology
    service gave it up (``NODE_LABEL_UNREACHABLE_SINCE``); ``None`` otherwise, or when it cannot be
    told (no such label: a mark by an earlier version; no report kept).

    An unchanged report of a node given up writes nothing: its key says ``unreachable`` until
    the service's next check lifts the mark, and only the stream tells that it is back."""
    import nats.js.errors

    since = unreachable_since(node)
    if since is None:
        return None
    try:
        msg = await asyncio.wait_for(js.get_last_msg("TOPOLOGY", f"topology.report.{node.node}"), READ_TIMEOUT_S)
    except nats.js.errors.NotFoundError:
        return None
    stored = msg.time.timestamp() if msg.time is not None else None
    return time.time() - stored if stored is not None and stored > since else None


def kept_labels(node: NodeTopology) -> str:
    """Operations' labels on the node's GPUs, as ``label=value on GPUs i, j`` (``label``
    alone for ``"true"``), what forgetting the node removes; ``none`` without any."""
    from fleetpilot.contracts import OPERATIONAL_GPU_LABELS

    on: dict[str, list[int]] = {}
    for gpu in node.gpus:
        for label, value in sorted(gpu.labels.items()):
            if label in OPERATIONAL_GPU_LABELS and label not in (GPU_LABEL_NOT_READY, GPU_LABEL_UNREACHABLE):
                on.setdefault(label if value == "true" else f"{label}={value}", []).append(gpu.index)
    return "; ".join(f"{label} on {'GPU' if len(gpus) == 1 else 'GPUs'} {', '.join(map(str, gpus))}"
                     for label, gpus in on.items()) or "none"


def main(args, out=None) -> int:
    """Print the fleet; live readings too when a fleet answers at the NATS URL. ``forget``
    removes a node from the running fleet instead."""
    out = out or sys.stdout
    if getattr(args, "fleet_action", None) == "forget":
        for line in event_loop.run(forget_node(args.nats_url or local_nats_url(args.state_dir), args.node, args.force)):
            print(line, file=out)
        return 0
    fleet, source = load_spec(args)
    live: LiveFleet | None = None
    url = args.nats_url or announced_nats_url(args.state_dir)
    if url:
        try:
            live = event_loop.run(read_live(url))
        except ConnectionError as exc:
            # No fleet running is the normal case on a laptop: the spec is still worth showing.
            print(f"fleetpilot fleet: {exc}; showing the spec only", file=sys.stderr)
    summary = summarise(fleet, source, live)
    rows = gpu_rows(live.samples, live.nodes) if live is not None else None
    idle = out_of_service(live.nodes) if live is not None else None
    stale = not_carried_out(live.ledgers, time.time()) if live is not None else None
    quiet = silent_executors(live.executors, time.time()) if live is not None else None
    troubled = troubled_executors(live.executors) if live is not None else None
    if args.json:
        doc: dict[str, Any] = {"fleet": summary}
        if live is not None:
            doc["live"] = {"nats_url": live.url, "gpus": rows, "out_of_service": idle, "not_carried_out": stale,
                           "silent_executors": quiet, "troubled_executors": troubled}
        print(json.dumps(doc, indent=2), file=out)
    else:
        render_text(summary, rows, out, idle, stale, quiet, troubled)
    return 0

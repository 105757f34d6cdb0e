"""The fleet: sites, their nodes (``contracts.topology.NodeTopology``) and the links
between sites; built from a YAML spec or the openb node list, saved as ``topology.json``.

Spec format (see ``specs/three_site.yaml``)::

    driver_version: "550.90.07"          # default for every node
    sites:
      - name: site-a
        kind: datacenter                 # or edge
        region: eu-west
        groups:                          # nodes of one shape
          - prefix: a100-               # node names: a100-00, a100-01, ...
            count: 8
            roles: [train]               # optional: business_role per GPU, cycled
            shape: {gpu_model: A100-40GB, gpus: 8, nvlink: nvswitch, ...}   # NodeShape fields
    links:
      - {a: site-a, b: site-b, rate_gbps: 100, rtt_ms: 8, name: a-b-primary}

Only ``load_fleet_spec``, ``load_openb_fleet`` and ``read_fleet_json`` touch files; the
builders take plain data.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from fleetpilot.contracts.topology import NodeTopology

from .node_shapes import NicSpec, NodeShape, build_node

SiteKind = Literal["datacenter", "edge"]

SPECS_DIR = Path(__file__).with_name("specs")
THREE_SITE_SPEC = SPECS_DIR / "three_site.yaml"


class Site(msgspec.Struct, frozen=True, kw_only=True):
    """A data centre or edge location."""

    name: str
    kind: SiteKind = "datacenter"
    region: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)


class SiteLink(msgspec.Struct, frozen=True, kw_only=True):
    """One wide-area path between two sites; several may join the same pair (multipath)."""

    a: str
    b: str
    rate_gbps: float
    rtt_ms: float
    name: str = ""

    def joins(self, x: str, y: str) -> bool:
        """True when this link connects sites ``x`` and ``y`` (either direction)."""
        return {self.a, self.b} == {x, y}


class Fleet(msgspec.Struct, frozen=True, kw_only=True):
    """Every site, node and inter-site link: the content of ``topology.json``."""

    sites: list[Site] = msgspec.field(default_factory=list)
    nodes: list[NodeTopology] = msgspec.field(default_factory=list)
    links: list[SiteLink] = msgspec.field(default_factory=list)
    name: str = "fleet"

    @property
    def gpu_count(self) -> int:
        """Total GPUs over all nodes."""
        return sum(len(n.gpus) for n in self.nodes)

    def node(self, name: str) -> NodeTopology:
        """The node called ``name``; ``KeyError`` when absent."""
        for n in self.nodes:
            if n.node == name:
                return n
        raise KeyError(f"no node {name!r} in fleet {self.name!r}")

    def nodes_at(self, site: str) -> list[NodeTopology]:
        """The nodes of one site."""
        return [n for n in self.nodes if n.site == site]

    def links_between(self, a: str, b: str) -> list[SiteLink]:
        """The inter-site links joining ``a`` and ``b``."""
        return [link for link in self.links if link.joins(a, b)]


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Fleet)


def fleet_to_json(fleet: Fleet) -> bytes:
    """Serialise a fleet (the ``topology.json`` format)."""
    return _ENCODER.encode(fleet)


def fleet_from_json(data: bytes | str) -> Fleet:
    """Parse ``topology.json`` content back into a ``Fleet``."""
    return _DECODER.decode(data)


def read_fleet_json(path: str | Path) -> Fleet:
    """Read a ``topology.json`` file."""
    return fleet_from_json(Path(path).read_bytes())


MOST_GPUS_PER_NODE = 256
"""More GPUs than any one machine holds (the largest hold 16, an NVLink rack's trays 4
each): a count above it is a typo, and building it held the command for ever."""
MOST_NODES_PER_GROUP = 100_000


def _counted(what: str, value: Any, most: int) -> int:
    """``value`` as a whole count in 0..``most``; ``ValueError`` naming ``what`` otherwise."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a whole number, got {value!r}") from None
    if not 0 <= number <= most:
        raise ValueError(f"{what} must be within 0..{most}, got {number}")
    return number


def build_fleet(spec: dict[str, Any]) -> Fleet:
    """Build a fleet from a parsed spec (the YAML structure in the module doc).

    Raises ``UnknownGpuModel`` for an unknown GPU model and ``ValueError`` (one line) for
    anything else wrong: a link naming an unknown site, a spec that is no mapping, a key
    missing or a value of the wrong shape (``sites: 3``, a group without ``shape``).
    """
    if not isinstance(spec, dict):
        raise ValueError(f"a fleet spec is a mapping (sites, links), got {type(spec).__name__}")
    try:
        return _build_fleet(spec)
    except KeyError as exc:
        # UnknownGpuModel is a LookupError, not a KeyError: it keeps its own type.
        raise ValueError(f"malformed fleet spec: missing {exc}") from None
    except (TypeError, AttributeError) as exc:
        # A list where a mapping belongs (or the reverse) surfaces as one of these; the
        # services turn a ValueError into their one-line exit, these were a traceback.
        raise ValueError(f"malformed fleet spec: {exc}") from None


def _build_fleet(spec: dict[str, Any]) -> Fleet:
    driver = str(spec.get("driver_version", "550.90.07"))
    sites: list[Site] = []
    nodes: list[NodeTopology] = []
    for site_spec in spec.get("sites", []):
        site = Site(name=site_spec["name"], kind=site_spec.get("kind", "datacenter"),
                    region=site_spec.get("region", ""), labels={k: str(v) for k, v in site_spec.get("labels", {}).items()})
        sites.append(site)
        for group in site_spec.get("groups", []):
            shape_data = {"driver_version": driver, **group["shape"]}
            shape = msgspec.convert(shape_data, NodeShape)
            _counted(f"group {group.get('prefix')!r}: gpus", shape.gpus, MOST_GPUS_PER_NODE)
            count = _counted(f"group {group.get('prefix')!r}: count", group.get("count", 1), MOST_NODES_PER_GROUP)
            width = max(len(str(count - 1)), 2)
            roles = list(group.get("roles") or [])
            for i in range(count):
                # Rotate the role list node by node so single-GPU nodes alternate roles too.
                shift = (i * shape.gpus) % len(roles) if roles else 0
                nodes.append(build_node(f"{group['prefix']}{i:0{width}d}", shape, site=site.name,
                                        roles=roles[shift:] + roles[:shift] or None))
    names = {s.name for s in sites}
    links: list[SiteLink] = []
    for link_spec in spec.get("links", []):
        link = msgspec.convert(link_spec, SiteLink)
        if link.a not in names or link.b not in names:
            raise ValueError(f"link {link.name or (link.a, link.b)!r} names an unknown site; sites: {sorted(names)}")
        links.append(link)
    return Fleet(name=str(spec.get("name", "fleet")), sites=sites, nodes=nodes, links=links)


def load_fleet_spec(path: str | Path = THREE_SITE_SPEC) -> Fleet:
    """Read a YAML fleet spec and build it (default: the shipped three-site fleet).

    A file that is not YAML, or not a spec, is a one-line ``ValueError`` (see ``build_fleet``).
    """
    try:
        spec = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"fleet spec is not YAML: {' '.join(str(exc).split())}") from None
    return build_fleet(spec)


# openb does not disclose the interconnect nor the role of its machines; the role follows
# the GPU class (inference cards infer, training cards train) so policies see a mix.
_OPENB_ROLE = {"T4": "infer", "A10": "infer", "P100": "encode", "G1": "encode"}
# The trace names no NICs either: assume one 25 GbE RoCE port per node, typical of the era.
_OPENB_NIC = NicSpec(count=1, rate_gbps=25.0, link_layer="Ethernet", prefix="eth")


def openb_node(sn: str, cpu_milli: int, memory_mib: int, gpus: int, model: str, *, site: str = "openb") -> NodeTopology:
    """One openb CSV row as a node: PCIe only, two sockets from 32 cores up."""
    sockets = 2 if cpu_milli >= 32_000 and gpus > 1 else 1
    shape = NodeShape(gpu_model=model, gpus=gpus, sockets=sockets, gpus_per_switch=2 if gpus > 1 else 1,
                      cpu_milli=cpu_milli, memory_mb=memory_mib, business_role=_OPENB_ROLE.get(model, "train"),
                      nics=[_OPENB_NIC], labels={"openb_model": model})
    return build_node(sn, shape, site=site)


def load_openb_fleet(path: str | Path) -> Fleet:
    """Read the openb node list CSV (``sn,cpu_milli,memory_mib,gpu,model``) into a fleet.

    Rows with zero GPUs are kept as CPU-only nodes. The fleet has one site, ``openb``. A row
    that is short, lacks a column or holds no number where one belongs is a one-line
    ``ValueError`` naming its line; an unknown model stays ``UnknownGpuModel``.
    """
    nodes: list[NodeTopology] = []
    with Path(path).open(newline="") as handle:
        rows = csv.DictReader(handle)
        for row in rows:
            try:
                nodes.append(_openb_row(row))
            except KeyError as exc:
                raise ValueError(f"line {rows.line_num}: no column {exc}") from None
            except (TypeError, ValueError) as exc:
                # A short row reads None for its missing cells (a TypeError in int()).
                what = "a cell is missing" if None in row.values() else str(exc)
                raise ValueError(f"line {rows.line_num}: {what}") from None
    return Fleet(name="openb", sites=[Site(name="openb", region="alibaba")], nodes=nodes)


def _openb_row(row: dict[str, Any]) -> NodeTopology:
    gpus = _counted(f"node {row.get('sn')!r}: gpu", row.get("gpu"), MOST_GPUS_PER_NODE)
    if gpus == 0:
        return NodeTopology(node=row["sn"], site="openb", cpu_milli=int(row["cpu_milli"]),
                            memory_mb=int(row["memory_mib"]))
    return openb_node(row["sn"], int(row["cpu_milli"]), int(row["memory_mib"]), gpus, row["model"])

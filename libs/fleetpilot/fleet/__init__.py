"""The fleet: GPU catalogue, node and fleet model, topology, network bandwidth, and the
two GPU readers (NVML on real nodes, the vectorised simulator elsewhere) behind one
``GpuReader`` interface. See ``README.md`` for the resource schema."""

from .bandwidth import SiteNetwork, port_rates
from .catalogue import CATALOGUE, GpuModel, UnknownGpuModel, gpu_model
from .inventory import (
    Fleet,
    Site,
    SiteLink,
    build_fleet,
    fleet_from_json,
    fleet_to_json,
    load_fleet_spec,
    load_openb_fleet,
)
from .reader import FleetEvent, GpuReader
from .simulator import SimulatedFleet
from .topo_parser import TopoParseError, parse_topo_matrix
from .topology import (
    colocation_domains,
    gpu_cost_matrix,
    render_nvidia_smi,
    render_topology,
    topology_from_matrix,
)

__all__ = [
    "CATALOGUE", "Fleet", "FleetEvent", "GpuModel", "GpuReader", "SimulatedFleet", "Site", "SiteLink", "SiteNetwork",
    "TopoParseError", "UnknownGpuModel", "build_fleet", "colocation_domains", "fleet_from_json", "fleet_to_json",
    "gpu_cost_matrix", "gpu_model", "load_fleet_spec", "load_openb_fleet", "parse_topo_matrix", "port_rates",
    "render_nvidia_smi", "render_topology", "topology_from_matrix",
]

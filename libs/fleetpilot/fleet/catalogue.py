"""The GPU catalogue: what each GPU model offers, costs and is worth in VGU.

Value in VGU (virtual GPU units). One VGU is 1/8 of an A100-40GB in compute *and*
memory. A model's value combines its compute ratio ``c = fp16_tflops / 312`` and its
memory ratio ``m = memory_mb / 40960`` (both relative to the A100-40GB) with a geometric
mean::

    vgu = 8 * sqrt(c * m)

The geometric mean is used (not the arithmetic one) because a slice of a GPU is only
useful when it has both compute and memory: a device rich in one and poor in the other
(a Jetson with 64 GB of shared memory but 1/7 of the compute) must not be valued as if
the surplus could be spent. It is scale-free and gives the A100-40GB exactly 8 VGU.

Figures are dense FP16 tensor-core TFLOPs from the vendors' data sheets (no sparsity),
board TDP, and public on-demand cloud prices per GPU-hour (late 2025, rounded). The openb
models ``G1``..``G3`` are undisclosed by Alibaba; their figures are plausible guesses
(marked ``disclosed=False``).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Literal

import msgspec

FormFactor = Literal["sxm", "pcie", "soc"]

# The reference device of the VGU: A100-SXM4-40GB.
REFERENCE_FP16_TFLOPS = 312.0
REFERENCE_MEMORY_MB = 40_960.0
VGU_PER_REFERENCE = 8.0

# Per-link, per-direction NVLink data rate in GB/s by generation (gen 1: P100; 2: V100;
# 3: A100; 4: H100/H200). Used as the peak for NVLink utilisation ratios.
NVLINK_GBPS_PER_LINK: dict[int, float] = {0: 0.0, 1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}

# Usable PCIe x16 bandwidth per direction in GB/s by generation.
PCIE_X16_GBPS: dict[int, float] = {3: 15.75, 4: 31.5, 5: 63.0}


class UnknownGpuModel(LookupError):
    """Raised when a name matches no catalogue entry nor alias; lists the known names."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown GPU model {name!r}; known models: {', '.join(sorted(known))}")
        self.name = name


class GpuModel(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU model: memory, compute, interconnect, power and price."""

    name: str
    memory_mb: int
    fp16_tflops: float
    nvlink_gen: int = 0
    nvlink_links: int = 0
    pcie_gen: int = 4
    tdp_w: float = 300.0
    idle_w: float = 50.0
    price_usd_per_hour: float = 1.0
    max_sm_clock_mhz: float = 1_410.0
    slowdown_temp_c: float = 87.0
    form: FormFactor = "pcie"
    aliases: tuple[str, ...] = ()
    disclosed: bool = True
    notes: str = ""

    @property
    def compute_ratio(self) -> float:
        """FP16 compute relative to an A100-40GB."""
        return self.fp16_tflops / REFERENCE_FP16_TFLOPS

    @property
    def memory_ratio(self) -> float:
        """Memory relative to an A100-40GB."""
        return self.memory_mb / REFERENCE_MEMORY_MB

    @property
    def vgu(self) -> float:
        """Value in VGU: ``8 * sqrt(compute_ratio * memory_ratio)`` (see the module doc)."""
        return VGU_PER_REFERENCE * math.sqrt(self.compute_ratio * self.memory_ratio)

    @property
    def nvlink_peak_gbps(self) -> float:
        """Aggregate NVLink peak per direction in GB/s (0 without NVLink)."""
        return NVLINK_GBPS_PER_LINK.get(self.nvlink_gen, 0.0) * self.nvlink_links

    @property
    def pcie_peak_gbps(self) -> float:
        """PCIe x16 peak per direction in GB/s."""
        return PCIE_X16_GBPS.get(self.pcie_gen, 15.75)

    @property
    def usd_per_vgu_hour(self) -> float:
        """Price of one VGU-hour on this model: the price-performance figure."""
        return self.price_usd_per_hour / max(self.vgu, 1e-9)


CATALOGUE: tuple[GpuModel, ...] = (
    GpuModel(name="A100-40GB", memory_mb=40_960, fp16_tflops=312, nvlink_gen=3, nvlink_links=12,
             pcie_gen=4, tdp_w=400, idle_w=55, price_usd_per_hour=3.67, max_sm_clock_mhz=1_410,
             form="sxm", aliases=("A100", "A100-SXM4-40GB", "A100 40GB", "A100-PCIE-40GB")),
    GpuModel(name="A100-80GB", memory_mb=81_920, fp16_tflops=312, nvlink_gen=3, nvlink_links=12,
             pcie_gen=4, tdp_w=400, idle_w=60, price_usd_per_hour=5.12, max_sm_clock_mhz=1_410,
             form="sxm", aliases=("A100-SXM4-80GB", "A100 80GB", "A100-SXM-80GB", "A100 80GB PCIe")),
    GpuModel(name="H100", memory_mb=81_559, fp16_tflops=989, nvlink_gen=4, nvlink_links=18,
             pcie_gen=5, tdp_w=700, idle_w=70, price_usd_per_hour=6.88, max_sm_clock_mhz=1_980,
             form="sxm", aliases=("H100-SXM", "H100 80GB HBM3", "H100-SXM5-80GB", "H100 SXM")),
    GpuModel(name="H200", memory_mb=143_771, fp16_tflops=989, nvlink_gen=4, nvlink_links=18,
             pcie_gen=5, tdp_w=700, idle_w=75, price_usd_per_hour=10.60, max_sm_clock_mhz=1_980,
             form="sxm", aliases=("H200-SXM", "H200 141GB HBM3e", "H200 SXM")),
    GpuModel(name="V100-16GB", memory_mb=16_160, fp16_tflops=125, nvlink_gen=2, nvlink_links=6,
             pcie_gen=3, tdp_w=300, idle_w=40, price_usd_per_hour=3.06, max_sm_clock_mhz=1_530,
             slowdown_temp_c=85, form="sxm",
             aliases=("V100", "V100M16", "V100-SXM2-16GB", "Tesla V100-SXM2-16GB", "V100-PCIE-16GB")),
    GpuModel(name="V100-32GB", memory_mb=32_510, fp16_tflops=125, nvlink_gen=2, nvlink_links=6,
             pcie_gen=3, tdp_w=300, idle_w=40, price_usd_per_hour=3.90, max_sm_clock_mhz=1_530,
             slowdown_temp_c=85, form="sxm",
             aliases=("V100M32", "V100-SXM2-32GB", "Tesla V100-SXM2-32GB", "V100S")),
    GpuModel(name="T4", memory_mb=15_360, fp16_tflops=65, pcie_gen=3, tdp_w=70, idle_w=10,
             price_usd_per_hour=0.35, max_sm_clock_mhz=1_590, slowdown_temp_c=85,
             aliases=("Tesla T4",)),
    GpuModel(name="A10G", memory_mb=23_028, fp16_tflops=70, pcie_gen=4, tdp_w=300, idle_w=25,
             price_usd_per_hour=1.01, max_sm_clock_mhz=1_710, aliases=("NVIDIA A10G",)),
    GpuModel(name="A10", memory_mb=23_028, fp16_tflops=125, pcie_gen=4, tdp_w=150, idle_w=20,
             price_usd_per_hour=0.90, max_sm_clock_mhz=1_695, aliases=("NVIDIA A10",)),
    GpuModel(name="L4", memory_mb=23_034, fp16_tflops=121, pcie_gen=4, tdp_w=72, idle_w=12,
             price_usd_per_hour=0.71, max_sm_clock_mhz=2_040, aliases=("NVIDIA L4",)),
    GpuModel(name="RTX4090", memory_mb=24_564, fp16_tflops=165, pcie_gen=4, tdp_w=450, idle_w=20,
             price_usd_per_hour=0.40, max_sm_clock_mhz=2_520, slowdown_temp_c=88,
             aliases=("RTX 4090", "GeForce RTX 4090", "4090")),
    GpuModel(name="Jetson-Orin", memory_mb=65_536, fp16_tflops=42.5, pcie_gen=4, tdp_w=60, idle_w=8,
             price_usd_per_hour=0.10, max_sm_clock_mhz=1_300, slowdown_temp_c=95, form="soc",
             aliases=("Orin", "Jetson AGX Orin", "AGX Orin", "Jetson-AGX-Orin-64GB"),
             notes="64 GB unified memory shared with the CPU; price is amortised hardware, not rental"),
    GpuModel(name="P100", memory_mb=16_280, fp16_tflops=18.7, pcie_gen=3, tdp_w=250, idle_w=30,
             price_usd_per_hour=1.46, max_sm_clock_mhz=1_329, slowdown_temp_c=85,
             aliases=("Tesla P100", "P100-PCIE-16GB", "Tesla P100-PCIE-16GB"),
             notes="no tensor cores: FP16 figure is the plain FP16 rate"),
    GpuModel(name="G1", memory_mb=16_384, fp16_tflops=65, pcie_gen=3, tdp_w=75, idle_w=10,
             price_usd_per_hour=0.40, disclosed=False, notes="openb undisclosed model; guessed T4-class"),
    GpuModel(name="G2", memory_mb=32_768, fp16_tflops=125, pcie_gen=4, tdp_w=250, idle_w=30,
             price_usd_per_hour=2.00, disclosed=False, notes="openb undisclosed model; guessed V100/A10-class"),
    GpuModel(name="G3", memory_mb=81_920, fp16_tflops=312, nvlink_gen=3, nvlink_links=12, pcie_gen=4,
             tdp_w=400, idle_w=55, price_usd_per_hour=4.50, form="sxm", disclosed=False,
             notes="openb undisclosed model; guessed A100-80GB-class"),
)


def _normalise(name: str) -> str:
    # Vendors and tools spell the same model many ways ("NVIDIA A100-SXM4-40GB",
    # "Tesla T4", "a100 40gb"): drop the brand words and the separators before comparing.
    key = name.upper()
    key = re.sub(r"\b(NVIDIA|TESLA|GEFORCE)\b", "", key)
    return re.sub(r"[\s_\-]+", "", key)


_INDEX: dict[str, GpuModel] = {}
for _model in CATALOGUE:
    for _alias in (_model.name, *_model.aliases):
        _INDEX.setdefault(_normalise(_alias), _model)


@functools.lru_cache(maxsize=1024)
def gpu_model(name: str) -> GpuModel:
    """The catalogue entry for ``name`` or one of its aliases (case and separators ignored).

    Raises ``UnknownGpuModel`` (a ``LookupError``) naming the known models otherwise.
    Cached: services look a model up per GPU on every fleet snapshot, and the entries are
    immutable (an unknown name is not cached: it raises).
    """
    found = _INDEX.get(_normalise(name))
    if found is None:
        raise UnknownGpuModel(name, [m.name for m in CATALOGUE])
    return found


def known_models() -> list[str]:
    """The canonical names of every catalogue entry."""
    return [m.name for m in CATALOGUE]

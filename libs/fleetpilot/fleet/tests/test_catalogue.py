"""The GPU catalogue: lookups, aliases, VGU formula and plausibility of the figures."""

from __future__ import annotations

import math

import pytest
from fleetpilot.fleet.catalogue import CATALOGUE, UnknownGpuModel, gpu_model, known_models

REQUIRED = ["A100-40GB", "A100-80GB", "H100", "H200", "V100-16GB", "V100-32GB", "T4", "A10G", "L4", "RTX4090",
            "Jetson-Orin", "P100", "A10", "G1", "G2", "G3"]


@pytest.mark.parametrize("name", REQUIRED)
def test_required_models_exist(name: str) -> None:
    assert gpu_model(name).name == name


@pytest.mark.parametrize(("alias", "canonical"), [
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("a100 80gb", "A100-80GB"),
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("Tesla V100-SXM2-16GB", "V100-16GB"),
    ("V100M16", "V100-16GB"),
    ("V100M32", "V100-32GB"),
    ("Tesla T4", "T4"),
    ("NVIDIA GeForce RTX 4090", "RTX4090"),
    ("Jetson AGX Orin", "Jetson-Orin"),
    ("Tesla P100-PCIE-16GB", "P100"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA A10G", "A10G"),
])
def test_aliases_resolve(alias: str, canonical: str) -> None:
    assert gpu_model(alias).name == canonical


def test_unknown_model_is_a_lookup_error_naming_known_models() -> None:
    with pytest.raises(LookupError) as info:
        gpu_model("B200-MAX")
    assert isinstance(info.value, UnknownGpuModel)
    assert "B200-MAX" in str(info.value) and "A100-40GB" in str(info.value)


def test_reference_gpu_is_eight_vgu_and_formula_is_geometric_mean() -> None:
    assert gpu_model("A100-40GB").vgu == pytest.approx(8.0)
    for m in CATALOGUE:
        assert m.vgu == pytest.approx(8 * math.sqrt(m.compute_ratio * m.memory_ratio))


@pytest.mark.parametrize(("better", "worse"), [
    ("H100", "A100-80GB"), ("A100-80GB", "A100-40GB"), ("H200", "H100"), ("V100-32GB", "V100-16GB"),
    ("A100-40GB", "T4"), ("L4", "T4"), ("V100-16GB", "P100"),
])
def test_vgu_orders_models_sensibly(better: str, worse: str) -> None:
    assert gpu_model(better).vgu > gpu_model(worse).vgu


def test_every_entry_is_plausible() -> None:
    assert len(set(known_models())) == len(CATALOGUE)
    for m in CATALOGUE:
        assert 4_000 <= m.memory_mb <= 200_000, m.name
        assert 0 < m.fp16_tflops < 2_000, m.name
        assert 0 < m.idle_w < m.tdp_w <= 1_000, m.name
        assert 0 < m.price_usd_per_hour < 20, m.name
        assert (m.nvlink_links > 0) == (m.nvlink_gen > 0), m.name
        assert m.pcie_gen in (3, 4, 5), m.name
    assert not any(gpu_model(g).disclosed for g in ("G1", "G2", "G3"))
    assert gpu_model("H100").nvlink_peak_gbps == pytest.approx(450.0)

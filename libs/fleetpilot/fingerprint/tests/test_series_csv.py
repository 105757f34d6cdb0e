"""CSV parsing (header optional, clear errors naming the line) and the CLI's fingerprint."""

from __future__ import annotations

import numpy as np
import pytest
from fleetpilot.fingerprint import fingerprint_csv, parse_series_csv
from fleetpilot.workload.growth import MemoryGrowth

MB = 1024 * 1024


@pytest.mark.parametrize("text,times,mbs", [
    ("0,1048576\n10,2097152\n", [0, 10], [1, 2]),
    ("timestamp,used_bytes\n100,1048576\n110,3145728\n", [0, 10], [1, 3]),
    ("# comment\n\n5, 0\n6 , 1048576\n", [0, 1], [0, 1]),
])
def test_parse_ok(text, times, mbs):
    t, y = parse_series_csv(text)
    assert t.tolist() == times and y.tolist() == mbs


@pytest.mark.parametrize("text,message", [
    ("0,1\n10,abc\n", "line 2:"),
    ("0,1\n10\n", "line 2:"),
    ("0,1,2\n", "line 1:"),
    ("ts,bytes\n0,1\nfoo,bar\n", "line 3:"),
    ("0,1\n10,-5\n", "line 2:"),
    ("0,1\n10,nan\n", "line 2:"),
    ("10,1\n5,1\n", "line 2: timestamp 5"),
    ("", "no samples"),
    ("ts,bytes\n", "no samples"),
])
def test_parse_errors_name_the_line(text, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_series_csv(text)
    assert "\n" not in str(err.value)


def test_fingerprint_csv_from_text_and_path(tmp_path):
    g = MemoryGrowth(pattern="linear", base_mb=2000.0, peak_mb=10000.0, duration_s=2000.0, noise_mb=20.0)
    t = np.arange(0.0, 2000.0 + 1e-9, 5.0)
    y = g.memory_at(t, np.random.default_rng(1))
    text = "timestamp,used_bytes\n" + "\n".join(f"{a:.1f},{int(b * MB)}" for a, b in zip(t, y, strict=True))
    out = fingerprint_csv(text, at=0.25)
    assert out["pattern"] == "linear"
    assert out["samples_used"] == 101 and out["life_s"] == 2000.0
    assert abs(out["predicted_peak_mb"] - 10000.0) < 200.0
    assert abs(out["error_mb"]) < abs(out["baseline_error_mb"]) / 10
    path = tmp_path / "series.csv"
    path.write_text(text)
    assert fingerprint_csv(str(path), at=0.25)["predicted_peak_mb"] == out["predicted_peak_mb"]


@pytest.mark.parametrize("at", [0.0, -0.1, 1.5])
def test_fingerprint_csv_rejects_bad_fraction(at):
    with pytest.raises(ValueError, match="--at"):
        fingerprint_csv("0,1\n1,2\n", at=at)


@pytest.mark.parametrize("text", [
    "".join(f"{i * 10_000},1.7e308\n" for i in range(30)),  # memory near float's limit: sums overflow
    "".join(f"{i * 1e290:g},{(1000 + i) * MB}\n" for i in range(30)),  # times near float's limit
])
def test_fingerprint_csv_of_values_too_large_to_fit_is_one_clear_error(text):
    with pytest.raises(ValueError, match="too large") as err:
        fingerprint_csv(text, at=1.0)
    assert "\n" not in str(err.value)


def test_parse_skips_a_byte_order_mark():
    # A spreadsheet's "CSV UTF-8" starts with one; without a header it sat on the first number.
    t, y = parse_series_csv("\ufeff0,1048576\n10,2097152\n")
    assert t.tolist() == [0, 10] and y.tolist() == [1, 2]

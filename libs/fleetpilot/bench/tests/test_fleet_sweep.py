"""The fleet benchmark over many workloads: seeds, the table it prints, real runs in processes
of their own, and one-line refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fleetpilot.bench import fleet_sweep
from fleetpilot.bench.fleet_sweep import (
    HELD_OUT_SEEDS,
    TABLE_ROWS,
    TABLE_SEEDS,
    SweepRun,
    code_line,
    cut_percent,
    geometric_mean,
    main,
    markdown_table,
    parse_seeds,
    read_all,
    summary,
)
from fleetpilot.bench.outputs import code_digest, describe_environment, run_environment


def figures(folder: Path, fleet: str, seed: int, *, queue: float, oom: float = 0.05, events: float = 3.0,
            code: str = "c0de", cpu: str = "EPYC", known_queue: float | None = None,
            by_work: dict[str, float] | None = None) -> None:
    """A run's ``--json`` as the fleet benchmark writes it, with the ratios given."""
    ratio = {"utilisation": 1.1, "useful_utilisation": 1.3, "mean_queue_s": queue, "p95_queue_s": 0.5,
             "oom_events": oom}
    met = {"utilisation": False, "mean_queue_s": queue <= 0.2, "oom_events": oom <= 0.1}
    doc = {"fleet": fleet, "seed": seed, "ratio": ratio, "targets": {"met": met},
           "fleetpilot": {"oom_events": events}, "largest_gpu_load": {"load": 1.5}, "code_digest": code,
           "environment": {"cpu": cpu, "cpu_flags": "f1a9", "python": "3.11.7", "numpy": "2.4.6"}}
    if by_work is not None:
        doc["queue_by_work"] = by_work
    if known_queue is not None:
        doc["peaks_known"] = {"ratio": {**ratio, "mean_queue_s": known_queue}}
    (folder / f"{fleet}-{seed}.json").write_text(json.dumps(doc))


def test_seeds_are_lists_and_ranges() -> None:
    assert parse_seeds("7,11,201-203") == (7, 11, 201, 202, 203)
    for bad in ("x", "3-", "5-2", ""):
        with pytest.raises(ValueError):
            parse_seeds(bad)
    assert len(TABLE_SEEDS["three-site"]) + len(TABLE_SEEDS["openb"]) == 46


def test_the_table_counts_targets_met_and_averages_ratios_geometrically(tmp_path: Path) -> None:
    figures(tmp_path, "openb", 1, queue=0.1)
    figures(tmp_path, "openb", 2, queue=0.4, oom=0.2, events=9.0)
    (tmp_path / "notes.json").write_text("[]")  # not a run: left out
    runs = read_all(tmp_path)
    assert sorted(runs) == [("openb", 1), ("openb", 2)]
    text = summary(runs)
    assert "mean_queue_s 1/2" in text and "oom_events 1/2" in text and "utilisation 0/2" in text
    assert f"geometric mean {math.sqrt(0.1 * 0.4):.4f}" in text and "OOM events 12" in text
    row = next(line for line in text.splitlines() if line.startswith("openb") and " 2 " in line)
    assert "-60.0%*" in row and "-80.0%*" in row  # the queue and OOM targets missed, marked
    assert geometric_mean([]) != geometric_mean([])  # nan: nothing to average


def test_the_queue_split_by_work_is_summed_up_per_fleet_and_left_out_where_no_run_kept_it(tmp_path: Path) -> None:
    figures(tmp_path, "openb", 1, queue=0.5, by_work={"only_largest": 2.0, "rest": 0.1})
    figures(tmp_path, "openb", 2, queue=0.3, by_work={"only_largest": 0.5, "rest": 0.4})
    figures(tmp_path, "three-site", 1, queue=0.05)  # written before the split was kept
    text = summary(read_all(tmp_path))
    assert ("openb, mean queue by work: runs other than those only the largest GPUs can hold 1/2 within the target, "
            f"geometric mean {math.sqrt(0.1 * 0.4):.4f}; the runs only they can hold, geometric mean 1.0000") in text
    assert "three-site, mean queue by work" not in text


def test_a_change_is_cut_toward_zero_never_rounded_up_to_a_target() -> None:
    assert cut_percent(0.2004) == "−79"  # -79.96%: not -80, which would meet the target
    assert cut_percent(0.2) == "−80" and cut_percent(0.995) == "−0" and cut_percent(1.0) == "0"
    assert cut_percent(1.149) == "+14" and cut_percent(math.inf) == "inf"


def test_the_readme_table_is_written_from_the_runs(tmp_path: Path) -> None:
    figures(tmp_path, "openb", 7, queue=0.1, oom=0.03)
    figures(tmp_path, "openb", 11, queue=0.2004, oom=0.11)  # both targets missed: in bold
    figures(tmp_path, "openb", 42, queue=0.2)
    figures(tmp_path, "openb", 999, queue=0.15)  # a seed outside the table: a row of its own
    figures(tmp_path, "three-site", 1, queue=0.05)
    lines = markdown_table(read_all(tmp_path)).splitlines()
    assert lines[0].startswith("| fleet | seed |") and len(lines) == 5
    three_site, openb, other = lines[2:]
    assert three_site.startswith("| three-site | 1 / 2 / 3 / 5 | 1.10 / n/a / n/a / n/a (1.30 / n/a / n/a / n/a) |")
    assert openb == ("| openb | 7 / 11 / 42 / 123 | 1.10 / 1.10 / 1.10 / n/a (1.30 / 1.30 / 1.30 / n/a) | "
                     "−90 / **−79** / −80 / n/a% | −50 / −50 / −50 / n/a% | −97 / **−89** / −95 / n/a% |")
    assert other.startswith("| openb | 999 | ")
    assert TABLE_SEEDS["openb"] == tuple(s for row in TABLE_ROWS["openb"] for s in row)


def test_a_sweep_of_mixed_code_says_so(tmp_path: Path) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    figures(mine, "openb", 1, queue=0.1, code="aaaa")
    figures(mine, "openb", 2, queue=0.1, code="bbbb")
    figures(mine, "openb", 3, queue=0.1, code="aaaa", cpu="Xeon")
    figures(other, "openb", 1, queue=0.1, code="cccc")
    text = summary(read_all(mine), read_all(other))
    assert ("\ncode MIXED: aaaa (2 runs), bbbb (1 runs); machine MIXED: EPYC [f1a9], python 3.11.7, numpy 2.4.6 "
            "(2 runs), Xeon [f1a9], python 3.11.7, numpy 2.4.6 (1 runs)") in text
    assert "\nagainst: code cccc; machine EPYC [f1a9], python 3.11.7, numpy 2.4.6" in text
    old = SweepRun(fleet="openb", seed=1, ratio={}, met={}, oom_events=0.0, largest_load=None)  # kept no digest
    assert code_line([old]) == "code unknown; machine unknown"


def test_a_sweep_is_printed_beside_another(tmp_path: Path) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    figures(mine, "three-site", 7, queue=0.1)
    figures(other, "three-site", 7, queue=0.3)
    figures(other, "three-site", 8, queue=0.3)
    text = summary(read_all(mine), read_all(other))
    row7 = next(line for line in text.splitlines() if line.startswith("three-site") and " 7 " in line)
    assert row7.index("-90.0%") < row7.index("against") < row7.index("-70.0%*")
    assert any("(not run)" in line for line in text.splitlines() if " 8 " in line)
    assert "against three-site: met utilisation 0/2, mean_queue_s 0/2" in text


def test_a_sweep_runs_the_benchmark_in_processes_and_prints_the_table(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    assert main(["--out", str(out), "--fleet", "three-site", "--seeds", "3-4", "--tasks", "150", "--hours", "0.5",
                 "--arrivals", "generated", "--jobs", "2", "--estimate-spread", "0.5",
                 "--peak-spread", "0.2", "--baseline", "kai-share"]) == 0
    assert sorted(p.name for p in out.glob("*.json")) == ["three-site-3.json", "three-site-4.json"]
    # The runs were given the sweep's settings.
    written = json.loads((out / "three-site-3.json").read_text())
    described = written["workload"]
    assert "sigma 0.5" in described and "within 20%" in described
    assert written["baseline"]["policy"] == "kai-share"
    text = capsys.readouterr().out
    assert "(ratios Fleetpilot / kai-share," in text
    assert sum(line.startswith("three-site ") for line in text.splitlines()) == 2
    assert "three-site: met utilisation" in text
    # Read again without running: the same table.
    assert main(["--out", str(out), "--no-run"]) == 0
    again = capsys.readouterr().out
    assert again.startswith("fleet ") and text.endswith(again)


@pytest.mark.parametrize("argv, says", [
    (["--out", "x", "--seeds", "a"], "--seeds: not a seed"),
    (["--out", "x", "--jobs", "0"], "must be positive"),
    (["--out", "x", "--queue-aging", "-1"], "--queue-aging must be above 0"),
    (["--out", "x", "--queue-aging", "nan"], "--queue-aging must be above 0"),
    (["--out", "x", "--estimate-spread", "0"], "--estimate-spread must be above 0"),
    (["--out", "x", "--estimate-spread", "nan"], "--estimate-spread must be above 0"),
    (["--out", "x", "--peak-spread", "1.5"], "--peak-spread must be above 0 and below 1"),
    (["--out", "x", "--hours", "nan"], "must be positive"),
    (["--out", "x", "--hours", "inf"], "must be positive"),
    (["--out", "/nonexistent/folder", "--no-run"], "no such folder"),
    (["--fleet", "moon"], "invalid choice"),
    (["--out", "x", "--held-out", "--seeds", "7"], "--held-out names its own seeds"),
])
def test_bad_arguments_get_one_line(argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert isinstance(refused.value.code, str) and says in refused.value.code and "\n" not in refused.value.code


def test_a_failed_run_is_named_in_one_line(tmp_path: Path) -> None:
    # Three tasks cannot make the fleet's load: the benchmark refuses, and the sweep says which run.
    with pytest.raises(SystemExit) as refused:
        main(["--out", str(tmp_path), "--fleet", "three-site", "--seeds", "5", "--tasks", "3",
              "--arrivals", "generated"])
    message = str(refused.value.code)
    assert message.startswith("fleet sweep: three-site seed 5 failed (exit 1): fleet bench:") and "\n" not in message


def test_the_code_digest_follows_the_code_not_its_docs_or_tests(tmp_path: Path) -> None:
    package = tmp_path / "fleetpilot"
    (package / "policy" / "tests").mkdir(parents=True)
    (package / "policy" / "rules.py").write_text("LIMIT = 3\n")
    (package / "fleet.yaml").write_text("gpus: 8\n")
    first = code_digest(package)
    (package / "README.md").write_text("# notes\n")
    (package / "policy" / "tests" / "test_rules.py").write_text("def test(): ...\n")
    assert code_digest(package) == first
    (package / "policy" / "rules.py").write_text("LIMIT = 4\n")
    changed = code_digest(package)
    (package / "policy" / "rules.py").write_text("LIMIT = 3\n")
    (package / "fleet.yaml").write_text("gpus: 4\n")
    assert len({first, changed, code_digest(package)}) == 3


def test_a_run_names_the_machine_it_ran_on() -> None:
    env = run_environment()
    assert env["python"].startswith("3.") and env["numpy"] and env["machine"] and env["cpu"]
    assert describe_environment(env).startswith(env["cpu"]) and describe_environment({}) == ""


def test_a_sweep_told_the_true_peaks_prints_that_bound_beside_each_run(tmp_path: Path) -> None:
    figures(tmp_path, "openb", 1, queue=0.3, known_queue=0.15)
    figures(tmp_path, "openb", 2, queue=0.3, known_queue=0.35)
    text = summary(read_all(tmp_path))
    row = next(line for line in text.splitlines() if line.startswith("openb") and " 1 " in line)
    assert row.endswith("| peaks known: -85.0%")
    assert f"openb, told each run's true peak: mean_queue_s 1/2; mean-queue ratio geometric mean {math.sqrt(0.15 * 0.35):.4f}" in text
    figures(tmp_path, "openb", 3, queue=0.3)  # a run without the bound: no column, no total for it
    assert "mean_queue_s 1/2;" in summary(read_all(tmp_path))


def test_held_out_runs_the_held_out_seeds_of_each_fleet_asked_and_none_of_the_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    played: list[tuple[str, int]] = []

    def play(runs, out, jobs, extra):
        played.extend(runs)
        for fleet, seed in runs:
            figures(out, fleet, seed, queue=0.15)

    monkeypatch.setattr(fleet_sweep, "run_all", play)
    assert main(["--out", str(tmp_path), "--held-out"]) == 0
    assert played == [(f, s) for f in ("three-site", "openb") for s in HELD_OUT_SEEDS]
    assert not set(HELD_OUT_SEEDS) & {s for seeds in TABLE_SEEDS.values() for s in seeds}
    played.clear()
    assert main(["--out", str(tmp_path / "openb"), "--held-out", "--fleet", "openb"]) == 0
    assert played == [("openb", s) for s in HELD_OUT_SEEDS]

"""The fleet benchmark over many workloads: the runs behind the README's table, each in its
own process, summed up the way the table reads.

``python -m fleetpilot.bench.fleet_sweep --out DIR`` (or ``fleetpilot bench fleet-sweep``)
runs ``fleetpilot.bench.fleet`` once per fleet and seed, ``--jobs`` at a time, each writing
``DIR/<fleet>-<seed>.json``; then it prints one row per run (the ratios Fleetpilot /
baseline, a missed target marked ``*``) and, per fleet, how many runs meet each target, the
geometric mean of the mean-queue ratio and Fleetpilot's OOM events in all. ``--against
OTHER`` puts a sweep of other code beside it, row by row, for "measured against X on the
same workloads"; ``--no-run`` only reads what ``DIR`` holds. The default seeds are the 46
runs of the README's table (``TABLE_SEEDS``); a full sweep takes 10 to 25 minutes on two
cores. ``--held-out`` runs the held-out seeds of both fleets instead (``HELD_OUT_SEEDS``:
reported with every change, never used to choose one), in 8 to 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from .fleet_job import BASELINES
from .fleet_report import TARGETS
from .outputs import check_writable, describe_environment

FLEETS = ("three-site", "openb")
_EARLIER = ((7, 11, 42, 123), (1, 2, 3, 5), (13, 17, 19, 23), (31, 57, 77, 99, 101))
TABLE_ROWS: dict[str, tuple[tuple[int, ...], ...]] = {
    "three-site": _EARLIER,
    "openb": (*_EARLIER, (201, 202, 203, 204, 205, 206), (301, 302, 303, 304, 305, 306)),
}
"""The workloads of the README's table, by fleet, in the groups of seeds its rows show."""
TABLE_SEEDS: dict[str, tuple[int, ...]] = {f: tuple(s for row in rows for s in row) for f, rows in TABLE_ROWS.items()}
"""The same workloads, by fleet, one seed after another."""
HELD_OUT_SEEDS: tuple[int, ...] = (401, 402, 403, 501, 502, 503)
"""Seeds of both fleets reported with every change and never used to choose one (``--held-out``).
Three-site 402 has been looked into (91b3103), which is why 501-503 joined them."""


class SweepError(RuntimeError):
    """A run of the fleet benchmark failed; the message says which and why."""


@dataclass(frozen=True)
class SweepRun:
    """What one run's ``--json`` says, as the table reads it."""

    fleet: str
    seed: int
    ratio: dict[str, float]  # Fleetpilot / baseline per figure
    met: dict[str, bool]  # per target
    oom_events: float  # Fleetpilot's
    largest_load: float | None  # the largest GPUs' load (``fleet_workload.largest_gpu_load``)
    code: str = ""  # the digest of the code that ran it (``outputs.code_digest``; empty before it was kept)
    machine: str = ""  # where it ran (``outputs.describe_environment``; empty before it was kept)
    known: dict[str, float] | None = None  # the ratios of the run told each run's true peak (``--peaks-known``)
    # The mean queue's ratio over the runs only the largest GPUs can hold and over the rest
    # (``Comparison.queue_by_work``; empty before it was kept).
    by_work: dict[str, float] = field(default_factory=dict)
    baseline: str = "k8s-default"  # what Fleetpilot was measured against (the fleet benchmark's ``--baseline``)

    @classmethod
    def read(cls, path: Path) -> SweepRun:
        """The run ``path`` (a ``--json`` of the fleet benchmark) holds."""
        doc = json.loads(path.read_text())
        largest = doc.get("largest_gpu_load") or {}
        return cls(fleet=doc["fleet"], seed=int(doc["seed"]), ratio=doc["ratio"], met=doc["targets"]["met"],
                   oom_events=float(doc["fleetpilot"]["oom_events"]), largest_load=largest.get("load"),
                   code=str(doc.get("code_digest") or ""),
                   machine=describe_environment(doc.get("environment") or {}),
                   known=(doc.get("peaks_known") or {}).get("ratio"), by_work=doc.get("queue_by_work") or {},
                   baseline=str(doc.get("baseline", {}).get("policy") or "k8s-default"))


def run_path(out: Path, fleet: str, seed: int) -> Path:
    """Where the run of ``fleet`` and ``seed`` writes its figures."""
    return out / f"{fleet}-{seed}.json"


def run_one(fleet: str, seed: int, out: Path, extra: Sequence[str] = ()) -> Path:
    """Run the fleet benchmark for ``fleet`` and ``seed`` in a process of its own (a run holds
    a fleet and a workload in memory for a few minutes; a process gives it all back)."""
    path = run_path(out, fleet, seed)
    cmd = [sys.executable, "-m", "fleetpilot.bench.fleet", "--fleet", fleet, "--seed", str(seed),
           "--json", str(path), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise SweepError(f"{fleet} seed {seed} failed (exit {done.returncode}): {last}")
    return path


def run_all(runs: Sequence[tuple[str, int]], out: Path, jobs: int, extra: Sequence[str] = ()) -> list[Path]:
    """Every run, ``jobs`` at a time; each one's progress is printed as it ends. A failed run
    does not stop the others: they all finish, then the first failure is raised."""
    failures: list[SweepError] = []

    def one(run: tuple[str, int]) -> Path | None:
        try:
            path = run_one(*run, out, extra)
        except SweepError as exc:
            failures.append(exc)
            print(f"  {exc}", flush=True)
            return None
        print(f"  {run[0]} seed {run[1]}: {path}", flush=True)
        return path

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        paths = list(pool.map(one, runs))
    if failures:
        raise failures[0]
    return [p for p in paths if p is not None]


def read_all(folder: Path) -> dict[tuple[str, int], SweepRun]:
    """The runs a folder holds, by (fleet, seed); files that are not a run's figures are left out."""
    found = {}
    for path in sorted(folder.glob("*.json")):
        try:
            run = SweepRun.read(path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        found[run.fleet, run.seed] = run
    return found


def _change(ratio: float) -> str:
    return f"{(ratio - 1.0) * 100:+.1f}%"


def _cells(run: SweepRun | None) -> str:
    if run is None:
        return f"{'(not run)':>46}"
    r, met = run.ratio, run.met
    mark = {name: "" if met.get(name, True) else "*" for name in TARGETS}
    util = f"{r['utilisation']:.2f} ({r['useful_utilisation']:.2f}){mark['utilisation']}"
    return (f"{util:>13} {_change(r['mean_queue_s']) + mark['mean_queue_s']:>9} {_change(r['p95_queue_s']):>8} "
            f"{_change(r['oom_events']) + mark['oom_events']:>9} {run.oom_events:>5.0f}")


def geometric_mean(values: Sequence[float]) -> float:
    """The geometric mean of positive ``values`` (how ratios average), ``nan`` when there are none."""
    kept = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in kept) / len(kept)) if kept else math.nan


def fleet_totals(runs: Sequence[SweepRun]) -> str:
    """One fleet's runs in one line: targets met, mean-queue geometric mean, OOM events."""
    met = ", ".join(f"{name} {sum(r.met.get(name, False) for r in runs)}/{len(runs)}" for name in TARGETS)
    queue = geometric_mean([r.ratio["mean_queue_s"] for r in runs])
    return f"met {met}; mean-queue ratio geometric mean {queue:.4f}; Fleetpilot OOM events {sum(r.oom_events for r in runs):.0f}"


def by_work_line(split: Sequence[dict[str, float]]) -> str:
    """The mean queue's ratio split by work (``SweepRun.by_work``) in one line: how often the
    runs other than those only the largest GPUs can hold meet the mean-queue target, and
    both groups' geometric means. A breakdown, not a target: the table's verdict is the
    whole run's."""
    rest = [s["rest"] for s in split]
    met = sum(r <= TARGETS["mean_queue_s"] for r in rest)
    return (f"mean queue by work: runs other than those only the largest GPUs can hold {met}/{len(rest)} within "
            f"the target, geometric mean {geometric_mean(rest):.4f}; the runs only they can hold, geometric mean "
            f"{geometric_mean([s['only_largest'] for s in split if 'only_largest' in s]):.4f}")


def code_line(runs: Sequence[SweepRun]) -> str:
    """Which code the runs measured, and on what machine: one of each, or a warning naming each
    and how many runs it made (a sweep of mixed code, or of several machines, cannot stand for
    one commit: before cbb6d6e the same code measured differently on two machines, and some
    other library could make it do so again)."""
    lines = []
    for what, of in (("code", lambda r: r.code), ("machine", lambda r: r.machine)):
        counts = Counter(of(r) or "unknown" for r in runs)
        if len(counts) == 1:
            lines.append(f"{what} {next(iter(counts))}")
        else:
            mix = ", ".join(f"{name} ({n} runs)" for name, n in counts.most_common())
            lines.append(f"{what} MIXED: {mix}")
    return "; ".join(lines)


def summary(runs: dict[tuple[str, int], SweepRun], against: dict[tuple[str, int], SweepRun] | None = None) -> str:
    """The table: a row per run (``against`` beside it when given), then each fleet's totals."""
    keys = sorted(set(runs) | set(against or {}), key=lambda k: (FLEETS.index(k[0]) if k[0] in FLEETS else 9, k[1]))
    head = f"{'utilisation':>13} {'mean q':>9} {'p95 q':>8} {'OOM':>9} {'OOMs':>5}"
    lines = [f"{'fleet':<11} {'seed':>5} {'largest':>7}  {head}" + (f"  | against: {head}" if against is not None else "")]
    for key in keys:
        run = runs.get(key)
        other = (against or {}).get(key)
        load = (run or other).largest_load if (run or other) else None
        row = f"{key[0]:<11} {key[1]:>5} {'' if load is None else f'x{load:.2f}':>7}  {_cells(run)}"
        if against is not None:
            row += f"  | against: {_cells(other)}"
        if run is not None and run.known is not None:
            row += f"  | peaks known: {_change(run.known['mean_queue_s'])}"
        lines.append(row)
    baselines = " or ".join(sorted({r.baseline for r in (*runs.values(), *(against or {}).values())}))
    lines.append(f"(ratios Fleetpilot / {baselines}, as changes, and Fleetpilot's OOM events; * a missed target; "
                 "largest: the load of the largest GPUs by the runs only they hold)")
    for fleet in sorted({k[0] for k in keys}, key=lambda f: FLEETS.index(f) if f in FLEETS else 9):
        for name, source in (("", runs), ("against ", against)):
            if source is None:
                continue
            mine = [r for k, r in sorted(source.items()) if k[0] == fleet]
            if mine:
                lines.append(f"{name}{fleet}: {fleet_totals(mine)}")
            split = [r.by_work for r in mine if "rest" in r.by_work]
            if split:
                lines.append(f"{name}{fleet}, {by_work_line(split)}")
            told = [r.known for r in mine if r.known is not None]
            if told:
                met = sum(k["mean_queue_s"] <= TARGETS["mean_queue_s"] for k in told)
                lines.append(f"{name}{fleet}, told each run's true peak: mean_queue_s {met}/{len(told)}; mean-queue "
                             f"ratio geometric mean {geometric_mean([k['mean_queue_s'] for k in told]):.4f}")
    for name, source in (("", runs), ("against: ", against)):
        if source:
            lines.append(f"{name}{code_line(list(source.values()))}")
    return "\n".join(lines)


def cut_percent(ratio: float) -> str:
    """A ratio as the README writes a change, in percent without the sign ``%``: whole, cut
    toward zero so that a figure is never rounded up to a target (0.2004 is ``−79``, not
    ``−80``), with a true minus sign."""
    change = (ratio - 1.0) * 100.0
    if not math.isfinite(change):
        return "inf"
    return f"{'−' if change < 0 else '+' if change > 0 else ''}{math.trunc(abs(change))}"


_MARKDOWN_HEAD = ("| fleet | seed | utilisation (useful) | mean queue | p95 queue | OOM events |\n"
                  "|---|---|---|---|---|---|")


def markdown_table(runs: dict[tuple[str, int], SweepRun]) -> str:
    """The README's table from a sweep: a row per group of seeds (``TABLE_ROWS``, then any other
    seeds swept, each fleet's in one row), each cell its seeds' figures joined by ``/``.
    Utilisation is a ratio, the rest changes cut to the whole percent (``cut_percent``); a
    missed mean-queue or OOM target is in bold (utilisation's is stated below the table, as
    no run meets it). A seed of a row that was not swept reads ``n/a``."""

    def cells(seeds: tuple[int, ...], fleet: str) -> list[str]:
        got = [runs.get((fleet, s)) for s in seeds]

        def column(show, unit: str = "") -> str:
            return " / ".join("n/a" if r is None else show(r) for r in got) + unit

        def change(name: str):
            return lambda r: (f"**{cut_percent(r.ratio[name])}**" if not r.met.get(name, True)
                              else cut_percent(r.ratio[name]))

        util = column(lambda r: f"{r.ratio['utilisation']:.2f}") + " (" + column(
            lambda r: f"{r.ratio['useful_utilisation']:.2f}") + ")"
        return [util, column(change("mean_queue_s"), "%"), column(lambda r: cut_percent(r.ratio["p95_queue_s"]), "%"),
                column(change("oom_events"), "%")]

    lines = [_MARKDOWN_HEAD]
    fleets = sorted({f for f, _ in runs}, key=lambda f: FLEETS.index(f) if f in FLEETS else 9)
    for fleet in fleets:
        rows = [row for row in TABLE_ROWS.get(fleet, ()) if any((fleet, s) in runs for s in row)]
        listed = {s for row in TABLE_ROWS.get(fleet, ()) for s in row}
        others = tuple(sorted(s for f, s in runs if f == fleet and s not in listed))
        for seeds in [*rows, *([others] if others else [])]:
            lines.append(f"| {fleet} | {' / '.join(map(str, seeds))} | " + " | ".join(cells(seeds, fleet)) + " |")
    return "\n".join(lines)


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"7,11,201-206"`` -> the seeds, in order; ``ValueError`` on anything else."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"not a seed or a range of seeds: {part.strip()!r}")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"an empty range of seeds: {part.strip()!r}")
        seeds.extend(range(first, last + 1))
    return tuple(seeds)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise SystemExit(f"fleet sweep: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m fleetpilot.bench.fleet_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder of the runs' figures (<fleet>-<seed>.json)")
    p.add_argument("--fleet", choices=FLEETS, action="append", help="a fleet to run (default: both)")
    p.add_argument("--seeds", default=None, help="seeds, e.g. 7,11,201-206 (default: the README table's, per fleet)")
    p.add_argument("--held-out", action="store_true",
                   help=f"the held-out seeds instead of the table's ({', '.join(map(str, HELD_OUT_SEEDS))})")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    p.add_argument("--tasks", type=int, default=None, help="tasks per workload (default: the fleet benchmark's)")
    p.add_argument("--hours", type=float, default=None, help="arrival window in virtual hours (default: its)")
    p.add_argument("--arrivals", choices=("trace", "generated"), default=None,
                   help="arrivals from the openb trace or a seeded process (default: the fleet benchmark's)")
    p.add_argument("--against", type=Path, default=None, help="a sweep of other code to print beside this one")
    p.add_argument("--queue-aging", type=float, default=None,
                   help="Fleetpilot's queue aging in every run (the fleet benchmark's --queue-aging; default its 1)")
    p.add_argument("--peaks-known", action="store_true",
                   help="also run Fleetpilot told each run's true peak (a bound on better memory prediction)")
    p.add_argument("--estimate-spread", type=float, default=None,
                   help="the fleet benchmark's --estimate-spread in every run (declared durations log-normal)")
    p.add_argument("--peak-spread", type=float, default=None,
                   help="the fleet benchmark's --peak-spread in every run (runs' peaks farther from their program's)")
    p.add_argument("--resumable-share", type=float, default=None,
                   help="the fleet benchmark's --resumable-share in every run (only that share of programs resume)")
    p.add_argument("--baseline", choices=BASELINES, default=None,
                   help="the fleet benchmark's --baseline in every run (default: k8s-default)")
    p.add_argument("--baseline-never-preempts", action="store_true",
                   help="the fleet benchmark's --baseline-never-preempts in every run (non-preempting PriorityClasses)")
    p.add_argument("--vip-evicts-standard", action="store_true",
                   help="the fleet benchmark's --vip-evicts-standard in every run (vips may evict standard work)")
    p.add_argument("--no-run", action="store_true", help="only read what --out holds")
    p.add_argument("--markdown", action="store_true",
                   help="also print the README's table of these runs (changes cut to the whole percent)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep and print its table; bad arguments raise ``SystemExit`` with one line."""
    args = _parser().parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds) if args.seeds is not None else None
    except ValueError as exc:
        raise SystemExit(f"fleet sweep: --seeds: {exc}") from None
    if args.held_out:
        if seeds is not None:
            raise SystemExit("fleet sweep: --held-out names its own seeds: give it or --seeds, not both")
        seeds = HELD_OUT_SEEDS
    # Written so that NaN fails each test (every comparison with it is false).
    if (args.jobs < 1 or (args.tasks is not None and args.tasks < 1)
            or (args.hours is not None and not 0 < args.hours < math.inf)):
        raise SystemExit("fleet sweep: --jobs, --tasks and --hours must be positive (and --hours finite)")
    if args.queue_aging is not None and not 0 < args.queue_aging < math.inf:
        raise SystemExit(f"fleet sweep: --queue-aging must be above 0 and finite, got {args.queue_aging:g}")
    if args.estimate_spread is not None and not 0 < args.estimate_spread < math.inf:
        raise SystemExit(f"fleet sweep: --estimate-spread must be above 0 and finite, got {args.estimate_spread:g}")
    if args.peak_spread is not None and not 0 < args.peak_spread < 1:
        raise SystemExit(f"fleet sweep: --peak-spread must be above 0 and below 1, got {args.peak_spread:g}")
    if args.resumable_share is not None and not 0 <= args.resumable_share <= 1:
        raise SystemExit(f"fleet sweep: --resumable-share must be within [0, 1], got {args.resumable_share:g}")
    if args.against is not None and not args.against.is_dir():
        raise SystemExit(f"fleet sweep: no such folder {args.against}")
    if args.no_run and not args.out.is_dir():
        raise SystemExit(f"fleet sweep: no such folder {args.out}")
    if not args.no_run:
        check_writable("fleet sweep", dirs=(args.out,))
        fleets = args.fleet or list(FLEETS)
        runs = [(f, s) for f in fleets for s in (seeds if seeds is not None else TABLE_SEEDS[f])]
        extra = [*(["--tasks", str(args.tasks)] if args.tasks is not None else []),
                 *(["--hours", str(args.hours)] if args.hours is not None else []),
                 *(["--arrivals", args.arrivals] if args.arrivals is not None else []),
                 *(["--queue-aging", repr(args.queue_aging)] if args.queue_aging is not None else []),
                 *(["--peaks-known"] if args.peaks_known else []),
                 *(["--baseline", args.baseline] if args.baseline is not None else []),
                 *(["--baseline-never-preempts"] if args.baseline_never_preempts else []),
                 *(["--vip-evicts-standard"] if args.vip_evicts_standard else []),
                 *(["--estimate-spread", repr(args.estimate_spread)] if args.estimate_spread is not None else []),
                 *(["--peak-spread", repr(args.peak_spread)] if args.peak_spread is not None else []),
                 *(["--resumable-share", repr(args.resumable_share)] if args.resumable_share is not None else [])]
        print(f"fleet sweep: {len(runs)} runs, {args.jobs} at a time, into {args.out}", flush=True)
        try:
            run_all(runs, args.out, args.jobs, extra)
        except SweepError as exc:
            raise SystemExit(f"fleet sweep: {exc}") from None
    found = read_all(args.out)
    if not found:
        raise SystemExit(f"fleet sweep: no run's figures in {args.out}")
    print(summary(found, read_all(args.against) if args.against is not None else None))
    if args.markdown:
        print(markdown_table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())

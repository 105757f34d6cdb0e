"""``fleetpilot replay --states FILE --policy A --against B``: judge a policy change offline.

``FILE`` is the JSONL the policy service records (``FLEETPILOT_POLICY_RECORD_EVERY``: one
``fleetpilot.policy.Snapshot`` — the fleet state and the task — per line). The service rotates
it at ``FLEETPILOT_POLICY_RECORD_MAX_MB`` to ``FILE.1`` (the newest), ``FILE.2``...: those
beside ``FILE`` are read too, the highest number first and ``FILE`` last, so the snapshots come
in the order recorded (``--no-rotated``: ``FILE`` alone). Every snapshot is
decided by A and by B; the report says how many decisions differ and how (another action,
another node, other GPUs on the same node) and what the differences do to fragmentation
(FGD's measure over the typical tasks of the file, in milli-GPU; lower is better) and to the
predicted OOM risk of the chosen GPUs. ``--json`` prints the same as one JSON document.

A and B are built-in policies or profiles exported by the policy modules of
``--plugin-dir`` (the service's hot-reload directory); ``--against-plugin-dir`` loads B's
modules from another directory, to compare two versions of one policy.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from fleetpilot.policy import (
    BUILTIN_POLICIES,
    ClusterState,
    DiffReport,
    Policy,
    ProfileConfig,
    Snapshot,
    build_policy,
    builtin_profile,
    replay,
    typical_tasks,
)
from fleetpilot.policy.fragmentation import TaskShape

from .arguments import non_negative_int, path_text


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot replay``."""
    parser.add_argument(
        "--states", required=True, type=path_text, help="JSONL of recorded snapshots (the policy service's record)"
    )
    parser.add_argument(
        "--no-rotated", action="store_true",
        help="read FILE alone, not the files the service rotated it to (FILE.1, FILE.2, ...)",
    )
    parser.add_argument("--policy", required=True, help="policy A: a built-in or a --plugin-dir profile")
    parser.add_argument("--against", required=True, help="policy B, compared with A")
    parser.add_argument("--plugin-dir", type=path_text, help="directory of policy modules (PROFILES / profile())")
    parser.add_argument("--against-plugin-dir", type=path_text, help="B's modules, when comparing two versions of one policy")
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="tie-breaking seed of the built-in policies (default 0)"
    )
    parser.add_argument("--show", type=non_negative_int, default=10, help="differing decisions to list in the text report")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def record_files(path: Path, rotated: bool = True) -> list[Path]:
    """``path`` and, with ``rotated``, the files the policy service rotated it to, oldest first:
    ``path.<n>`` by number from the highest (the policy service's ``.1`` is the newest), then
    ``path``. A gap in the numbers (a rotation cut short) is read past; a name with another
    suffix (``path.bak``) is not a rotation and is left alone."""
    if path.is_dir():
        raise ValueError(f"{path}: is a directory")
    if not rotated:
        return [path]
    prefix = path.name + "."
    # Listed, not globbed: a name may hold the glob's own characters ("states[1].jsonl").
    suffixes = [s.name[len(prefix):] for s in path.parent.iterdir() if s.name.startswith(prefix)]
    numbers = sorted((int(x) for x in suffixes if x.isascii() and x.isdigit() and int(x) > 0), reverse=True)
    return [path.with_name(f"{prefix}{n}") for n in numbers] + [path]


def read_snapshots(path: Path, rotated: bool = True) -> list[Snapshot]:
    """Every snapshot of a JSONL record, with ``rotated`` its rotated files' first, oldest
    first (``record_files``); a bad line is a ``ValueError`` naming its file and line."""
    return read_record(record_files(path, rotated))


def read_record(files: list[Path]) -> list[Snapshot]:
    """Every snapshot of ``files`` (oldest first, the current file last), in order. All are
    opened before any is read, so that a rotation by the service meanwhile cannot rename one
    under the reader; a rotated file dropped since it was listed is passed over."""
    out = []
    decoder = msgspec.json.Decoder(Snapshot)
    with ExitStack() as stack:
        opened = []
        for file in files:
            try:
                opened.append((file, stack.enter_context(file.open("rb"))))
            except FileNotFoundError:
                if file == files[-1]:
                    raise
        for file, fh in opened:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    snapshot = decoder.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise ValueError(f"{file}:{number}: not a recorded snapshot ({exc})") from None
                problem = snapshot_problem(snapshot)
                if problem is not None:
                    raise ValueError(f"{file}:{number}: not a recorded snapshot ({problem})")
                out.append(snapshot)
    if not out:
        raise ValueError(f"{files[-1]}: no snapshots")
    return out


_INT32_MAX = 2**31 - 1
_TASK_COUNTS = ("gpus", "gpu_milli", "gpu_memory_mb", "cpu_milli", "memory_mb")


def snapshot_problem(snapshot: Snapshot) -> str | None:
    """Why a decoded snapshot's state does not hold together, in a few words; ``None`` when
    it does. A record whose JSON decodes can still name a model, site, role or rule set that
    is not in its lists, hold arrays of another number of nodes or GPUs than its names, or
    a task count no policy's arithmetic takes: the policies then failed deep inside numpy
    with a traceback (``IndexError``, ``OverflowError``), or decided on nonsense."""
    task = snapshot.task
    for name in _TASK_COUNTS:
        value = getattr(task, name)
        if not 0 <= value <= _INT32_MAX:
            return f"task {name} {value} is out of range 0..{_INT32_MAX}"
    for name in ("predicted_peak_mb", "peak_sigma_mb"):
        if not 0.0 <= getattr(task, name) < float("inf"):
            return f"task {name} {getattr(task, name)} is not a finite number of at least 0"
    record = snapshot.state
    if not record.node_names:
        return "its state has no nodes"
    try:
        state = ClusterState.from_record(record)
    except KeyError as exc:
        return f"its state has no array {exc}"
    except (ValueError, TypeError, OverflowError) as exc:
        return f"its state's arrays do not read: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    # Each array's shape, and each index into the names, ``from_record`` checks above, as the
    # policy library reads them: a node with no GPU model or site (-1) is one it records. Checked
    # here again, from 0, a record of a fleet with such a node was refused as not a snapshot.
    for name in ("gpu_temp_c", "gpu_nvlink_util"):
        if not np.isfinite(getattr(state, name)).all():
            return f"its state's {name} is not finite"
    return None


def module_profiles(directory: Path) -> dict[str, ProfileConfig]:
    """Profiles exported by the ``*.py`` modules of a directory (the service's format)."""
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory")
    out: dict[str, ProfileConfig] = {}
    for file in sorted(directory.glob("*.py")):
        name = f"fleetpilot_replay_plugin_{abs(hash(str(file.resolve())))}_{file.stem}"
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - report which module is broken, in one line
            raise ValueError(f"{file}: cannot load ({type(exc).__name__}: {exc})") from None
        try:
            exported: list[Any] = [
                {**(v if isinstance(v, dict) else msgspec.to_builtins(v)), "name": k}
                for k, v in dict(getattr(module, "PROFILES", {}) or {}).items()
            ]
            if callable(getattr(module, "profile", None)):
                made = module.profile()
                exported += list(made) if isinstance(made, list | tuple) else [made]
            for prof in exported:
                config = prof if isinstance(prof, ProfileConfig) else msgspec.convert(prof, ProfileConfig)
                out[config.name] = config
        except Exception as exc:  # noqa: BLE001 - operator code: name the module, in one line
            text = str(exc).splitlines()[0] if str(exc) else ""
            raise ValueError(f"{file}: not a policy profile ({type(exc).__name__}: {text})") from None
    return out


def resolve(name: str, plugins: dict[str, ProfileConfig], seed: int, typical: list[TaskShape]) -> Policy:
    """A policy by name: a module profile first (it may shadow a built-in), then a built-in."""
    if name in plugins:
        return build_policy(plugins[name])
    if name in BUILTIN_POLICIES:
        return build_policy(builtin_profile(name, seed=seed, typical=typical))
    known = ", ".join(sorted({*BUILTIN_POLICIES, *plugins}))
    raise ValueError(f"unknown policy {name!r} (known: {known})")


def _where(d) -> str:
    if d.action != "assign":
        return d.action
    gpus = [p.gpu for p in d.placement if p.gpu >= 0]
    return f"{d.placement[0].node} GPUs {gpus}" if gpus else f"{d.placement[0].node} (CPU only)"


def summary(report: DiffReport, a: str, b: str, files: list[Path] | None = None) -> dict[str, Any]:
    """The report as plain data (what ``--json`` prints); ``files``: the record's files read,
    oldest first."""
    actions_a = Counter(i.a.action for i in report.items)
    actions_b = Counter(i.b.action for i in report.items)
    return {
        "policy": a,
        "against": b,
        "files": [str(f) for f in files or []],
        "total": report.total,
        "differing": report.differing,
        "by_kind": report.by_kind,
        "actions": {a: dict(actions_a), b: dict(actions_b)} if a != b else {a: dict(actions_a)},
        "mean_frag_delta": report.mean_frag_delta,
        "mean_oom_delta": report.mean_oom_delta,
        "differences": [
            {
                "task_id": i.task_id,
                "kind": i.kind,
                "a": _where(i.a),
                "b": _where(i.b),
                "frag_delta": i.frag_b - i.frag_a,
                "oom_delta": i.oom_b - i.oom_a,
            }
            for i in report.items
            if i.kind != "same"
        ],
    }


def format_report(data: dict[str, Any], show: int) -> str:
    """The human-readable report."""
    total, diff = data["total"], data["differing"]
    kinds = data["by_kind"]
    files = data.get("files", [])
    source = f" of {len(files)} files, oldest first ({', '.join(files)})" if len(files) > 1 else ""
    lines = [
        f"replayed {total} snapshot(s){source}: {diff} decision(s) differ ({100.0 * diff / total:.1f}%) "
        f"between {data['policy']} (A) and {data['against']} (B)",
        f"  how: {kinds.get('action', 0)} another action, {kinds.get('node', 0)} another node, "
        f"{kinds.get('gpus', 0)} other GPUs on the same node, {kinds.get('same', 0)} the same",
        f"  fragmentation after the decision, B - A: {data['mean_frag_delta']:+.2f} on average "
        "(milli-GPU; negative = B fragments less)",
        f"  predicted OOM risk of the chosen GPUs, B - A: {data['mean_oom_delta']:+.4f} on average",
        "  actions: "
        + "; ".join(
            f"{p}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) for p, c in data["actions"].items()
        ),
    ]
    for d in data["differences"][: max(show, 0)]:
        lines.append(
            f"  {d['task_id']}: A {d['a']} | B {d['b']} ({d['kind']}; frag {d['frag_delta']:+.1f}, "
            f"OOM {d['oom_delta']:+.3f})"
        )
    if len(data["differences"]) > show > 0:
        lines.append(f"  ... {len(data['differences']) - show} more (--show N, or --json)")
    return "\n".join(lines)


def main(args, out=None) -> int:
    """Replay the file through both policies and print the diff."""
    out = out or sys.stdout
    files = record_files(Path(args.states), rotated=not args.no_rotated)
    snapshots = read_record(files)
    typical = typical_tasks([s.task for s in snapshots])
    plugins_a = module_profiles(Path(args.plugin_dir)) if args.plugin_dir is not None else {}
    plugins_b = module_profiles(Path(args.against_plugin_dir)) if args.against_plugin_dir is not None else plugins_a
    policy_a = resolve(args.policy, plugins_a, args.seed, typical)
    policy_b = resolve(args.against, plugins_b, args.seed, typical)
    report = replay(snapshots, policy_a.decide, policy_b.decide, typical=typical)
    label_b = (
        args.against
        if (args.against != args.policy or plugins_b is plugins_a)
        else f"{args.against} (B's modules)"
    )
    data = summary(report, args.policy, label_b, files)
    if args.json:
        print(json.dumps(data, indent=2), file=out)
    else:
        print(format_report(data, args.show), file=out)
    return 0

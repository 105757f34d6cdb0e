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
modules from another directory, to compare two versions of one policy. Each module is vetted
as the service vets it (run first in a child interpreter, within ``--import-timeout``): one
that hangs, ends its interpreter or fails is a one-line error naming it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from fleetpilot.policy import (
    BUILTIN_POLICIES,
    REGISTRY,
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
from fleetpilot.policy.vetting import (
    DEFAULT_IMPORT_TIMEOUT_S,
    MODULE_PREFIX,
    VETTING_AT_ONCE,
    Sibling,
    Verdict,
    digest_of,
    execute,
    in_order,
    module_name,
    vet,
)

from .arguments import non_negative_int, path_text, positive_float


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
        "--import-timeout", type=positive_float, default=DEFAULT_IMPORT_TIMEOUT_S, metavar="SECONDS",
        help="a module not imported within this (vetted in a child interpreter, as the policy service "
        f"does) is refused (default {DEFAULT_IMPORT_TIMEOUT_S:g})",
    )
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


def module_profiles(directory: Path, import_timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S) -> dict[str, ProfileConfig]:
    """Profiles exported by the ``*.py`` modules of a directory (the service's format), each
    module vetted first as the policy service vets it (``fleetpilot.policy.vetting``): run in
    a child interpreter within ``import_timeout_s``, the directory's other modules importable
    under the names the service gives them. A module that hangs, ends its interpreter or
    fails is a ``ValueError`` naming it, in one line; before, one that hung hung the command
    and one that called ``os._exit`` ended it with no word."""
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory")
    return asyncio.run(_load_directory(directory, import_timeout_s))


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


async def _load_directory(directory: Path, import_timeout_s: float) -> dict[str, ProfileConfig]:
    """Vet the modules, then run those that passed here, siblings first, in rounds: one
    vetted against a sibling that has run since is vetted again (``vetting.in_order``)."""
    files = sorted(directory.glob("*.py"))
    pending = {module_name(file): (file, file.read_bytes()) for file in files}
    siblings: dict[str, Sibling] = {}
    out: dict[str, ProfileConfig] = {}
    gate = asyncio.Semaphore(VETTING_AT_ONCE)

    async def vet_one(file: Path, source: bytes) -> Verdict:
        async with gate:
            return await vet(file, source, siblings, import_timeout_s)

    for _ in range(len(files)):
        if not pending:
            break
        verdicts = await asyncio.gather(*(vet_one(file, source) for file, source in pending.values()))
        again: dict[str, tuple[Path, bytes]] = {}
        for verdict, now in in_order(verdicts, lambda: siblings):
            file, source = pending[verdict.module]
            if not now:
                again[verdict.module] = (file, source)
                continue
            if verdict.refused is not None:
                what = "not a policy profile" if verdict.stage == "profiles" else "cannot load"
                raise ValueError(f"{file}: {what} ({_first_line(verdict.refused)})")
            stage = ["import"]
            try:
                executed = execute(file, source, verdict.module, ran=functools.partial(stage.append, "profiles"))
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - operator code: name the module, in one line
                what = "not a policy profile" if stage[-1] == "profiles" else "cannot load"
                raise ValueError(f"{file}: {what} ({type(exc).__name__}: {_first_line(str(exc))})") from None
            siblings[verdict.module] = Sibling(file, source, digest_of(source), executed.plugins)
            out.update((prof.name, prof) for prof in executed.profiles)
        pending = again
    if pending:  # each round settles one module at least: not reached, but never dropped silently
        raise ValueError(f"{next(iter(pending.values()))[0]}: cannot load (its siblings did not settle)")
    return out


@contextmanager
def _own_modules() -> Iterator[None]:
    """Around one directory's modules and the policies built of them: the plugin registry and
    the modules' ``sys.modules`` names are put back afterwards, so that ``--against-plugin-dir``
    starts as a fresh service would. Before, B's modules replaced A's plugins of the same
    name in the registry before A's policy was built: A was built of B's plugins."""
    registry = {point: dict(plugins) for point, plugins in REGISTRY.items()}
    modules = {name: module for name, module in sys.modules.items() if name.startswith(MODULE_PREFIX)}
    try:
        yield
    finally:
        for point, plugins in registry.items():
            REGISTRY[point].clear()
            REGISTRY[point].update(plugins)
        for name in [n for n in sys.modules if n.startswith(MODULE_PREFIX)]:
            del sys.modules[name]
        sys.modules.update(modules)


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
    # Each directory's policies are built while its modules are the registry's (``_own_modules``).
    with _own_modules():
        plugins_a = module_profiles(Path(args.plugin_dir), args.import_timeout) if args.plugin_dir is not None else {}
        policy_a = resolve(args.policy, plugins_a, args.seed, typical)
        if args.against_plugin_dir is None:
            plugins_b = plugins_a
            policy_b = resolve(args.against, plugins_b, args.seed, typical)
    if args.against_plugin_dir is not None:
        with _own_modules():
            plugins_b = module_profiles(Path(args.against_plugin_dir), args.import_timeout)
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

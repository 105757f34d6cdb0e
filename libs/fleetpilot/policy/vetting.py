"""Policy modules (an operator's ``*.py`` files) vetted in a child interpreter before they run.

A policy module is operator code: it may hang while it is imported (``while True: pass``, a
``sleep``, a blocking call at top level), end its interpreter (``os._exit``, a crash in C
code), or build a plugin whose constructor never returns. Run in a long-lived process (the
policy service, ``fleetpilot replay``), any of these stopped that process. ``vet`` first runs
the module's bytes in a fresh interpreter (``sys.executable``, a child process in a session
of its own), executing them and compiling the profiles they export exactly as ``execute``
does, within a time limit; only a module that passed is then run in-process by ``execute``.
A hang costs a child process and at most the limit: the child and anything it started are
killed, and the module is refused with one line saying why.

**Siblings.** The modules of one directory run in one process under the names
``MODULE_PREFIX + <stem>``, so one may ``import fleetpilot_policy_plugin_<stem>`` another,
and a profile may name a plugin another module registered. The child is given the same
environment: the ``Sibling`` modules the process has run (their bytes as run, never the
file again, whose bytes may be a newer version not vetted yet) are importable there under
the same names, and a plugin a profile names that a sibling registered is the real one (the
sibling is imported to register it), built with the profile's arguments. The ``Verdict``
records what the child asked of its environment (``view``): a sibling that changed between
the vetting and the in-process run makes the verdict stale (``Verdict.stale``), and the
module is vetted again rather than run against a sibling it was not vetted with
(``in_order`` applies a directory's verdicts, siblings first).

The vetting is a trial run, not a proof: a module whose import is not deterministic (it
waits on a server that answered the child but not the process, reads a clock or a random
number) can pass it and still hang in-process. A plugin nobody the process ran registered
stands in, in the child, taking any arguments; the in-process compile refuses it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.abc
import importlib.util
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from .builtin import build_policy
from .framework import REGISTRY, Plugin, ProfileConfig

MODULE_PREFIX = "fleetpilot_policy_plugin_"
"""The ``sys.modules`` name of a policy module is this prefix and its file's stem."""

DEFAULT_IMPORT_TIMEOUT_S = 10.0
"""How long a module's vetting (a fresh interpreter executing it and compiling its profiles;
~0.2 s for a small module) may take before the module is refused as hanging."""

VETTING_AT_ONCE = max(1, min(4, os.cpu_count() or 1))
"""Children vetting at once at most: a directory of many modules is not serialised behind one
that hangs, and a directory of hanging modules does not take every core for the limit."""

# The child's start: it takes the parent's import path before importing anything of ours,
# so it finds the same packages (and the same ``fleetpilot.policy``) as the parent.
_CHILD = (
    "import json, sys\n"
    "job = json.loads(sys.stdin.buffer.readline())\n"
    "sys.path[:], sys.argv[:] = job['path'], job['argv']\n"
    f"from {__name__} import run_child\n"
    "run_child(job, sys.stdin.buffer.read())\n"
)

PluginKey = tuple[str, str]  # (extension point, plugin name)


def module_name(file: Path) -> str:
    """The ``sys.modules`` name a policy module runs under: ``MODULE_PREFIX + stem``."""
    return MODULE_PREFIX + file.stem


def digest_of(source: bytes) -> str:
    """A module version's short content digest (part of its profiles' versions)."""
    return hashlib.sha256(source).hexdigest()[:10]


@dataclass(frozen=True)
class Sibling:
    """A module this process has run, as a vetting child imports it: the bytes that ran (not
    the file again) and the plugins it registered."""

    file: Path
    source: bytes
    digest: str
    plugins: frozenset[PluginKey] = frozenset()


def _view(asked: frozenset[str], stand_ins: frozenset[PluginKey],
          siblings: Mapping[str, Sibling]) -> tuple[Any, ...]:
    """What a vetting found of ``siblings``: the digest of each sibling it asked for (``None``:
    none), and the module that registers each plugin it stood in for (``None``: nobody)."""
    owners = {key: (name, s.digest) for name, s in siblings.items() for key in s.plugins}
    return (tuple((name, siblings[name].digest if name in siblings else None) for name in sorted(asked)),
            tuple((key, owners.get(key)) for key in sorted(stand_ins)))


@dataclass(frozen=True)
class Verdict:
    """A vetting's outcome: ``refused`` says why (``None``: passed), ``asked`` the sibling
    names the module imported (found or not), ``stand_ins`` the plugins nobody there
    registered, ``view`` what the siblings were then (``stale`` compares it with now), and
    ``stage`` how far it got: ``import`` (running the module), or ``profiles`` (its code ran;
    exporting or compiling its profiles failed)."""

    module: str
    refused: str | None
    asked: frozenset[str] = frozenset()
    stand_ins: frozenset[PluginKey] = frozenset()
    view: tuple[Any, ...] = ((), ())
    stage: str = "import"

    def stale(self, siblings: Mapping[str, Sibling]) -> bool:
        """Whether a sibling the module used (or missed) is another now than when vetted: then
        the verdict says nothing of the module as it would run, and it is vetted again."""
        return _view(self.asked, self.stand_ins, siblings) != self.view


def in_order(verdicts: Sequence[Verdict], siblings: Callable[[], Mapping[str, Sibling]]) -> Iterator[tuple[Verdict, bool]]:
    """The verdicts of one round in the order to apply them, each with whether to apply it
    now (``False``: stale, vet it again). The caller applies each (running it, which changes
    ``siblings()``) before taking the next: a module comes after the siblings of the round it
    imported, and after the round's modules that use no stand-in when it used one (they may
    register the plugin); it is stale when one of those changed since its vetting or was
    itself found stale. Modules that wait on each other (a cycle) go in their given order."""
    pending = list(verdicts)
    deferred: set[str] = set()
    while pending:
        names = {v.module for v in pending}
        plain = {v.module for v in pending if not v.stand_ins}

        verdict = next((v for v in pending if not _waits(v, names, plain)), pending[0])
        pending.remove(verdict)
        stale = bool(verdict.asked & deferred) or verdict.stale(siblings())
        if stale:
            deferred.add(verdict.module)
        yield verdict, not stale


def _waits(verdict: Verdict, names: set[str], plain: set[str]) -> bool:
    """Whether a verdict waits on another of the round: a sibling it imported, or (when it
    stood in for a plugin) any module of the round that used no stand-in."""
    others = {verdict.module}
    return bool(verdict.asked & (names - others)) or (bool(verdict.stand_ins) and bool(plain - others))


async def vet(file: Path, source: bytes, siblings: Mapping[str, Sibling],
              timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S, name: str | None = None) -> Verdict:
    """Run ``source`` (the bytes of ``file``) as ``execute`` would, in a fresh interpreter with
    ``siblings`` importable, within ``timeout_s``. The child and its session are killed
    whatever happens (a timeout, the caller cancelled), so none is left behind."""
    name = name or module_name(file)
    others = {n: s for n, s in siblings.items() if n != name}  # its own old version is no sibling
    job = {
        "path": [str(entry) for entry in sys.path],
        "argv": [str(arg) for arg in sys.argv],  # a module may read the command line
        "file": str(file),
        "module": name,
        "limit_s": timeout_s,
        "siblings": {n: {"file": str(s.file), "source": base64.b64encode(s.source).decode(),
                         "plugins": sorted(s.plugins)} for n, s in others.items()},
    }

    def verdict(refused: str | None, asked: Sequence[str] = (), stand_ins: Sequence[Sequence[str]] = (),
                stage: str = "import") -> Verdict:
        a, s = frozenset(asked), frozenset((str(p), str(n)) for p, n in stand_ins)
        return Verdict(name, refused, a, s, _view(a, s, others), stage)

    try:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CHILD,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            # A session of its own: the whole group (anything the module started) is killed
            # with it, and a terminal's Ctrl-C aimed at the parent misses it.
            start_new_session=True,
        )
    except OSError as exc:
        return verdict(f"could not start an interpreter to vet it ({exc})")
    try:
        out, err = await asyncio.wait_for(child.communicate(json.dumps(job).encode() + b"\n" + source), timeout_s)
    except TimeoutError:
        return verdict(f"did not finish importing within {timeout_s:g} s (stopped)")
    except OSError as exc:  # the pipes to it failed: no verdict to go by
        return verdict(f"could not be vetted ({type(exc).__name__}: {exc})")
    finally:
        _kill_session(child.pid)
        if child.returncode is None:
            await child.wait()  # reaped: no zombie either
    try:
        said = json.loads(out)
    except ValueError:
        said = None
    if isinstance(said, dict) and "ok" in said:
        refused = None if said["ok"] is True else str(said.get("error", "refused"))
        return verdict(refused, said.get("asked", ()), said.get("stand_ins", ()), str(said.get("stage", "import")))
    code = child.returncode
    if code is not None and code < 0:
        if -code == signal.SIGALRM:  # the child's own backstop fired before our limit
            return verdict(f"did not finish importing within {timeout_s:g} s (stopped)")
        try:
            killed_by = signal.Signals(-code).name
        except ValueError:  # a signal without a name (a real-time one)
            killed_by = f"signal {-code}"
        return verdict(f"its interpreter was killed by {killed_by} while importing it")
    lines = err.decode(errors="replace").strip().splitlines()
    return verdict(f"its interpreter exited with status {code} before it finished importing"
                   + (f" ({lines[-1]})" if lines else ""))


@dataclass(frozen=True)
class Executed:
    """A module run in-process: the profiles it exports (each compiled once) and the plugins
    it registered (new or replaced)."""

    profiles: list[ProfileConfig]
    plugins: frozenset[PluginKey]


def execute(file: Path, source: bytes, name: str | None = None, ran: Callable[[], None] | None = None) -> Executed:
    """Run ``source`` (the bytes of ``file``, already vetted) in this process as a fresh module
    object under ``name`` (``module_name(file)``) and compile its profiles (``ran`` is called
    between the two, so that a caller can tell which failed). On any failure
    (``SystemExit`` included) the plugin registry and ``sys.modules`` are put back as they
    were and the exception is raised; the previous module object stays to the policies that
    use its classes."""
    name = name or module_name(file)
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {file}")
    module = importlib.util.module_from_spec(spec)
    registry_before = {point: dict(plugins) for point, plugins in REGISTRY.items()}
    # msgspec and dataclasses resolve annotations through sys.modules: the fresh module must
    # be findable under its name while (and after) it executes.
    previous = sys.modules.get(name)
    sys.modules[name] = module
    try:
        exec(compile(source, str(file), "exec"), module.__dict__)  # noqa: S102 - operator-supplied code
        if ran is not None:
            ran()
        profiles = exported_profiles(module)
        for prof in profiles:
            build_policy(prof)  # compiles: unknown plugins and bad arguments fail here
    except BaseException:
        for point, plugins in registry_before.items():
            REGISTRY[point].clear()
            REGISTRY[point].update(plugins)
        if previous is not None:
            sys.modules[name] = previous
        else:
            sys.modules.pop(name, None)
        raise
    registered = frozenset((point, plugin) for point, plugins in REGISTRY.items()
                           for plugin, cls in plugins.items() if registry_before[point].get(plugin) is not cls)
    return Executed(profiles, registered)


def exported_profiles(module: Any) -> list[ProfileConfig]:
    """The profiles a module exports: ``PROFILES`` (name to ``ProfileConfig`` or its dict
    form) and ``profile()`` (one profile or a list)."""
    out = [_as_profile(v, k) for k, v in dict(getattr(module, "PROFILES", {}) or {}).items()]
    factory = getattr(module, "profile", None)
    if callable(factory):
        made = factory()
        out.extend(_as_profile(p) for p in (made if isinstance(made, list | tuple) else [made]))
    return out


def _as_profile(value: Any, name: str | None = None) -> ProfileConfig:
    if isinstance(value, ProfileConfig):
        return value if name is None or value.name == name else msgspec.structs.replace(value, name=name)
    if isinstance(value, dict):
        data = dict(value)
        if name is not None:
            data["name"] = name
        return msgspec.convert(data, ProfileConfig)
    raise TypeError(f"a profile must be a ProfileConfig or a dict, not {type(value).__name__}")


def _kill_session(pgid: int) -> None:
    """SIGKILL every process left in a vetting child's session (the child, what it started)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # all gone already
        pass


# --- the child's side ---------------------------------------------------------------------

class _AnyArgs(msgspec.Struct, frozen=True):
    """A stand-in plugin's arguments: any (unknown fields are ignored, not refused)."""


class _Environment(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The child's siblings: importable under their names from the bytes the parent ran, and
    what the module asked of them (``asked``, ``stand_ins``) for the verdict."""

    def __init__(self, siblings: dict[str, dict[str, Any]]) -> None:
        self.siblings = siblings
        self.owners = {(p, n): name for name, s in siblings.items() for p, n in s["plugins"]}
        self.asked: set[str] = set()
        self.stand_ins: set[PluginKey] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        """A sibling's spec (from its bytes); ``None`` for any other name (another finder's)."""
        if fullname.startswith(MODULE_PREFIX):
            self.asked.add(fullname)  # a missing one too: the parent may have it by the run
        if fullname not in self.siblings:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=self.siblings[fullname]["file"])

    def create_module(self, spec: Any) -> None:
        """The default module object."""
        return None

    def exec_module(self, module: Any) -> None:
        """Run the sibling's bytes as the parent ran them (under its file name)."""
        sibling = self.siblings[module.__name__]
        module.__file__ = sibling["file"]
        exec(compile(base64.b64decode(sibling["source"]), sibling["file"], "exec"), module.__dict__)  # noqa: S102

    def plugin(self, point: str, name: str, found: dict[str, Any]) -> Any:
        """The plugin ``name``: registered here, else by importing the sibling that registered
        it in the parent, else a stand-in that takes any arguments."""
        if name not in found and (point, name) in self.owners:
            importlib.import_module(self.owners[(point, name)])
        cls = dict.get(found, name)
        if cls is None:
            self.stand_ins.add((point, name))
            cls = type(f"StandIn_{point}_{name}", (Plugin,), {"name": name, "point": point, "Args": _AnyArgs})
        return cls


class _WithStandIns(dict):
    """One extension point's plugins in the vetting child, looked up through the
    environment (``_Environment.plugin``)."""

    def __init__(self, point: str, plugins: dict[str, Any], environment: _Environment) -> None:
        super().__init__(plugins)
        self.point, self.environment = point, environment

    def get(self, name: str, default: Any = None) -> Any:
        """The registered plugin, a sibling's, else a stand-in for it."""
        return self.environment.plugin(self.point, name, self)


def run_child(job: dict[str, Any], source: bytes) -> None:
    """The vetting child's work (started by ``vet``): execute ``source`` and compile its
    profiles as ``execute`` does, with the siblings importable, write the verdict as JSON to
    the original stdout, and leave with ``os._exit`` (no atexit handler or thread of the
    module's may hold the exit up)."""
    # A backstop for an orphan (the parent killed mid-vetting): SIGALRM's default action ends
    # the process whatever Python is doing. The parent kills it before this fires.
    signal.alarm(min(int(math.ceil(float(job["limit_s"]))) + 2, 2**31 - 1))
    verdict_fd = os.dup(1)  # not inherited by what the module may start
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the module's prints go nowhere: no pipe for it to fill
        os.dup2(devnull, fd)
    environment = _Environment(job["siblings"])
    sys.meta_path.insert(0, environment)
    for point in list(REGISTRY):  # what ``register`` adds lands in these too
        REGISTRY[point] = _WithStandIns(point, REGISTRY[point], environment)
    stage = {"stage": "import"}
    try:
        execute(Path(job["file"]), source, job["module"], ran=lambda: stage.update(stage="profiles"))
        verdict: dict[str, Any] = {"ok": True}
    except BaseException as exc:  # noqa: BLE001 - every way out is a verdict
        try:
            said = f"{type(exc).__name__}: {exc}"
        except BaseException:  # noqa: BLE001 - an exception whose str() fails
            said = type(exc).__name__
        verdict = {"ok": False, "error": said[:4000]}
    verdict.update(stage, asked=sorted(environment.asked), stand_ins=sorted(environment.stand_ins))
    os.write(verdict_fd, json.dumps(verdict).encode())
    os._exit(0)

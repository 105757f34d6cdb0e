"""Hot reload of policy modules from a watched directory.

Every ``*.py`` file in the directory is a policy module. It may register plugins with the
library's ``@register`` (at any extension point) and exports profiles as ``PROFILES``
(a dict of name to ``ProfileConfig`` or its dict form) and/or ``profile()`` (returning one
profile or a list of them). Example::

    from fleetpilot.policy import ProfileConfig, PluginSpec, register
    from fleetpilot.policy.framework import ScorePlugin

    @register
    class Coolest(ScorePlugin):
        name = "coolest"
        def score(self, cycle):
            return -cycle.state.gpu_temp_c[cycle.rows].min(axis=1)

    PROFILES = {"cool": ProfileConfig(name="cool", filters=[PluginSpec(name="node-resources")],
                                      scores=[PluginSpec(name="coolest")])}

``poll()`` compares each file's ``(mtime_ns, size)`` with the last poll (a ``stat`` per file:
cheap, no watcher dependency); a changed file is read, and if its bytes changed it is
*vetted* first: a fresh interpreter (``sys.executable``, a child process in a session of its
own) executes those bytes and compiles the profiles they export exactly as the service
would, within ``import_timeout_s``. The event loop only waits for the child (asyncio), so a
module that hangs while it is imported (``while True: pass``, a ``sleep``, a blocking
network call at top level) costs a child process and at most ``import_timeout_s``, not the
service: such a module is refused ("did not finish importing within N s"), its child and
anything the child started are killed, and its previous version keeps serving. A module
that kills its interpreter (``os._exit``, a crash in C code) is refused the same way.

Only a module that passed the vetting is executed in-process, as a fresh module object
(``importlib``; the previous module object is left to the compiled policies that still use
its classes), on the event loop between two decisions (``apply``): the plugin registry that
decisions read is never touched from another thread. Its profiles are compiled once more as
a check. A module that fails to import or whose profiles do not compile is logged, the plugin
registry is restored to what it was before the import, and the module's previous version
keeps serving. A deleted file withdraws its profiles.

The vetting is a trial run, not a proof: a module whose import is not deterministic (it
waits on a server that answered the child but not the service, reads a clock or a random
number) can pass it and still hang in-process. In the child, a plugin a profile names that
nobody there registered (another module's: the child runs this module alone) is a stand-in
that takes any arguments, so the child's verdict is about hanging and dying, and the
service's own compile still refuses an unknown plugin or bad arguments; a module that
imports another policy module by its ``sys.modules`` name finds none there and is refused.

Write modules atomically (write a temporary file, then rename it over the old one): a
half-written file fails to import and simply waits for the next change.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from fleetpilot.policy import REGISTRY, ProfileConfig, build_policy
from fleetpilot.policy.framework import Plugin

from .policy_set import PluginProfile

log = logging.getLogger("fleetpilot.policy.plugins")

MODULE_PREFIX = "fleetpilot_policy_plugin_"

DEFAULT_IMPORT_TIMEOUT_S = 10.0
"""How long a changed module's vetting (a fresh interpreter executing it and compiling its
profiles; ~0.2 s for a small module) may take before the module is refused as hanging."""

# Vetted at once at most: a start-up with many modules is not serialised behind one that
# hangs, and a directory of hanging modules does not take every core for the limit.
_VETTING_AT_ONCE = max(1, min(4, os.cpu_count() or 1))

# The child's start: it takes the service's import path before importing anything of ours,
# so it finds the same packages (and the same ``fleetpilot.policy``) as the service.
_CHILD = (
    "import json, sys\n"
    "job = json.loads(sys.stdin.buffer.readline())\n"
    "sys.path[:], sys.argv[:] = job['path'], job['argv']\n"
    f"from {__name__} import _vet_in_child\n"
    "_vet_in_child(job, sys.stdin.buffer.read())\n"
)


@dataclass
class _Loaded:
    stat: tuple[int, int]
    digest: str
    profiles: dict[str, PluginProfile]


@dataclass(frozen=True)
class _Vetted:
    """A changed file's bytes as read, and why its vetting refused them (``None``: passed)."""

    name: str
    stat: tuple[int, int]
    source: bytes
    digest: str
    refused: str | None


@dataclass(frozen=True)
class PendingChanges:
    """What ``vet`` found, for ``apply``: the files present and each changed, vetted file."""

    seen: dict[str, tuple[int, int]]
    vetted: list[_Vetted]


@dataclass
class PluginDirectory:
    """The modules of one directory, their profiles, and what changed since the last poll."""

    path: Path
    loaded: dict[str, _Loaded] = field(default_factory=dict)
    failed: dict[str, tuple[tuple[int, int], str]] = field(default_factory=dict)
    # The stat at which each unreadable file was last reported: it is read again at every
    # poll (a permission fixed changes no mtime), but said once. Before, a WARNING every poll.
    unreadable: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Told the file name of each module that fails to load or cannot be read, once per
    # version of the file (the service counts them: a log line alone is missed).
    on_failure: Callable[[str], None] | None = None
    # A module whose vetting takes longer is refused as hanging (the child is killed).
    import_timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S

    async def poll(self) -> bool:
        """Reload what changed on disk (``vet``, then ``apply``); ``True`` when the set of
        profiles changed."""
        return self.apply(await self.vet())

    async def vet(self) -> PendingChanges:
        """Find the files whose bytes changed and vet each in a child process, concurrently;
        the event loop runs on meanwhile. Changes nothing a decision reads: ``apply`` does."""
        seen: dict[str, tuple[int, int]] = {}
        if self.path.is_dir():
            for file in sorted(self.path.glob("*.py")):
                try:
                    st = file.stat()
                except FileNotFoundError:  # renamed away between glob and stat
                    continue
                seen[file.name] = (st.st_mtime_ns, st.st_size)
        for name in [n for n in self.unreadable if n not in seen]:
            del self.unreadable[name]
        changed: list[tuple[str, tuple[int, int], bytes, str]] = []
        for name, stat in seen.items():
            old = self.loaded.get(name)
            if (old is not None and old.stat == stat) or self.failed.get(name, (None,))[0] == stat:
                continue
            read = self._read(name, stat)
            if read is not None:
                changed.append((name, stat, *read))
        gate = asyncio.Semaphore(_VETTING_AT_ONCE)

        async def vet_one(name: str, stat: tuple[int, int], source: bytes, digest: str) -> _Vetted:
            async with gate:
                refused = await self._vet(name, source, digest)
            return _Vetted(name, stat, source, digest, refused)

        vetted = await asyncio.gather(*(vet_one(*c) for c in changed))
        return PendingChanges(seen, list(vetted))

    def apply(self, changes: PendingChanges) -> bool:
        """Withdraw the removed modules and execute the vetted ones in-process (synchronous:
        on the event loop, between two decisions); ``True`` when the set of profiles changed."""
        changed = False
        for name in [n for n in self.loaded if n not in changes.seen]:
            log.info("policy module %s removed; its profiles are withdrawn", name)
            del self.loaded[name]
            changed = True
        for vetted in changes.vetted:
            changed |= self._load(vetted)
        return changed

    def profiles(self) -> dict[str, PluginProfile]:
        """Every profile the loaded modules export (a later file wins a name clash)."""
        out: dict[str, PluginProfile] = {}
        for loaded in self.loaded.values():
            out.update(loaded.profiles)
        return out

    def _failed(self, name: str) -> None:
        if self.on_failure is not None:
            self.on_failure(name)

    def _read(self, name: str, stat: tuple[int, int]) -> tuple[bytes, str] | None:
        """The file's bytes and digest when they changed; ``None`` when unreadable or the same."""
        try:
            source = (self.path / name).read_bytes()
        except OSError as exc:
            if self.unreadable.get(name) != stat:
                self.unreadable[name] = stat
                self._failed(name)
                log.warning("policy module %s unreadable (%s); %s", name, exc,
                            "the previous version keeps serving" if name in self.loaded else "it serves nothing")
            return None
        self.unreadable.pop(name, None)
        digest = hashlib.sha256(source).hexdigest()[:10]
        old = self.loaded.get(name)
        if old is not None and old.digest == digest:
            old.stat = stat  # touched, not changed
            return None
        return source, digest

    async def _vet(self, name: str, source: bytes, digest: str) -> str | None:
        """Run ``source`` as the service would, in a fresh interpreter, within the limit:
        ``None`` when it passed, else why it is refused. The child and its session are
        killed whatever happens (a timeout, the service stopping), so none is left behind."""
        file = self.path / name
        job = {
            "path": [str(entry) for entry in sys.path],
            "argv": [str(arg) for arg in sys.argv],  # a module may read the command line
            "file": str(file),
            "module": MODULE_PREFIX + file.stem,
            "digest": digest,
            "limit_s": self.import_timeout_s,
        }
        try:
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _CHILD,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                # A session of its own: the whole group (anything the module started) is
                # killed with it, and a terminal's Ctrl-C aimed at the service misses it.
                start_new_session=True,
            )
        except OSError as exc:
            return f"could not start an interpreter to vet it ({exc})"
        try:
            out, err = await asyncio.wait_for(
                child.communicate(json.dumps(job).encode() + b"\n" + source), self.import_timeout_s
            )
        except TimeoutError:
            return f"did not finish importing within {self.import_timeout_s:g} s (stopped)"
        except OSError as exc:  # the pipes to it failed: no verdict to go by
            return f"could not be vetted ({type(exc).__name__}: {exc})"
        finally:
            _kill_session(child.pid)
            if child.returncode is None:
                await child.wait()  # reaped: no zombie either
        try:
            verdict = json.loads(out)
        except ValueError:
            verdict = None
        if isinstance(verdict, dict) and "ok" in verdict:
            return None if verdict["ok"] is True else str(verdict.get("error", "refused"))
        code = child.returncode
        if code is not None and code < 0:
            if -code == signal.SIGALRM:  # the child's own backstop fired before our limit
                return f"did not finish importing within {self.import_timeout_s:g} s (stopped)"
            try:
                killed_by = signal.Signals(-code).name
            except ValueError:  # a signal without a name (a real-time one)
                killed_by = f"signal {-code}"
            return f"its interpreter was killed by {killed_by} while importing it"
        said = err.decode(errors="replace").strip().splitlines()
        return f"its interpreter exited with status {code} before it finished importing" + (
            f" ({said[-1]})" if said else ""
        )

    def _load(self, vetted: _Vetted) -> bool:
        name, stat, digest = vetted.name, vetted.stat, vetted.digest
        old = self.loaded.get(name)
        if vetted.refused is not None:
            self.failed[name] = (stat, digest)
            self._failed(name)
            log.error("policy module %s (%s) failed to load: %s; %s", name, digest, vetted.refused,
                      "the previous version keeps serving" if old else "it serves nothing")
            return False
        file = self.path / name
        registry_before = {point: dict(plugins) for point, plugins in REGISTRY.items()}
        module_name = MODULE_PREFIX + file.stem
        try:
            # The bytes the child vetted, not the file again: it may have changed since.
            profiles = self._execute(file, module_name, vetted.source, digest)
        # SystemExit too: a module that calls sys.exit (or argparse on the service's own
        # arguments) at import otherwise went up through the watcher and out of the event
        # loop, stopping the replica. KeyboardInterrupt still stops it.
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a broken module must never stop the service
            for point, plugins in registry_before.items():
                REGISTRY[point].clear()
                REGISTRY[point].update(plugins)
            self.failed[name] = (stat, digest)
            self._failed(name)
            log.error(
                "policy module %s (%s) failed to load: %s: %s; %s",
                name,
                digest,
                type(exc).__name__,
                exc,
                "the previous version keeps serving" if old else "it serves nothing",
            )
            return False
        self.failed.pop(name, None)
        self.loaded[name] = _Loaded(stat, digest, profiles)
        log.info("policy module %s (%s) loaded: profiles %s", name, digest, sorted(profiles) or "none")
        return True

    @staticmethod
    def _execute(file: Path, module_name: str, source: bytes, digest: str) -> dict[str, PluginProfile]:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {file}")
        module = importlib.util.module_from_spec(spec)
        # msgspec and dataclasses resolve annotations through sys.modules: the fresh module
        # must be findable under its name while (and after) it executes.
        previous = sys.modules.get(module_name)
        sys.modules[module_name] = module
        try:
            exec(compile(source, str(file), "exec"), module.__dict__)  # noqa: S102 - operator-supplied code
            profiles = _exported_profiles(module)
            for prof in profiles:
                build_policy(prof)  # compiles: unknown plugins and bad arguments fail here
        except BaseException:
            if previous is not None:
                sys.modules[module_name] = previous
            else:
                sys.modules.pop(module_name, None)
            raise
        return {
            p.name: PluginProfile(profile=p, version=f"{p.version}+{digest}", module=file.name)
            for p in profiles
        }


def _kill_session(pgid: int) -> None:
    """SIGKILL every process left in a vetting child's session (the child, what it started)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # all gone already
        pass


class _AnyArgs(msgspec.Struct, frozen=True):
    """A stand-in plugin's arguments: any (unknown fields are ignored, not refused)."""


class _WithStandIns(dict):
    """One extension point's plugins in the vetting child, where a name nobody registered
    gets a stand-in that takes any arguments: the plugin may come from another module (the
    service has it; a module vetted in the same poll registers it), so the child cannot tell
    an unknown plugin from one it does not see. The service's own compile says."""

    def __init__(self, point: str, plugins: dict[str, Any]) -> None:
        super().__init__(plugins)
        self.point = point

    def get(self, name: str, default: Any = None) -> Any:
        """The registered plugin, else a stand-in for it."""
        found = super().get(name)
        if found is None:
            found = type(f"StandIn_{self.point}_{name}", (Plugin,),
                         {"name": name, "point": self.point, "Args": _AnyArgs})
        return found


def _vet_in_child(job: dict[str, Any], source: bytes) -> None:
    """The vetting child's work: execute ``source`` and compile its profiles as ``_execute``
    does in the service, write the verdict as JSON to the original stdout, and leave with
    ``os._exit`` (no atexit handler or thread of the module's may hold the exit up)."""
    # A backstop for an orphan (the service killed mid-vetting): SIGALRM's default action
    # ends the process whatever Python is doing. The service kills it before this fires.
    signal.alarm(min(int(math.ceil(float(job["limit_s"]))) + 2, 2**31 - 1))
    verdict_fd = os.dup(1)  # not inherited by what the module may start
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the module's prints go nowhere: no pipe for it to fill
        os.dup2(devnull, fd)
    for point in list(REGISTRY):  # what ``register`` adds lands in these too
        REGISTRY[point] = _WithStandIns(point, REGISTRY[point])
    try:
        PluginDirectory._execute(Path(job["file"]), job["module"], source, job["digest"])
        verdict: dict[str, Any] = {"ok": True}
    except BaseException as exc:  # noqa: BLE001 - every way out is a verdict
        try:
            said = f"{type(exc).__name__}: {exc}"
        except BaseException:  # noqa: BLE001 - an exception whose str() fails
            said = type(exc).__name__
        verdict = {"ok": False, "error": said[:4000]}
    os.write(verdict_fd, json.dumps(verdict).encode())
    os._exit(0)


def _as_profile(value: Any, name: str | None = None) -> ProfileConfig:
    if isinstance(value, ProfileConfig):
        return value if name is None or value.name == name else msgspec.structs.replace(value, name=name)
    if isinstance(value, dict):
        data = dict(value)
        if name is not None:
            data["name"] = name
        return msgspec.convert(data, ProfileConfig)
    raise TypeError(f"a profile must be a ProfileConfig or a dict, not {type(value).__name__}")


def _exported_profiles(module: Any) -> list[ProfileConfig]:
    out = [_as_profile(v, k) for k, v in dict(getattr(module, "PROFILES", {}) or {}).items()]
    factory = getattr(module, "profile", None)
    if callable(factory):
        made = factory()
        out.extend(_as_profile(p) for p in (made if isinstance(made, list | tuple) else [made]))
    return out

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
executed as a fresh module object (``importlib``; the previous module object is left to the
compiled policies that still use its classes). Its profiles are compiled once as a check.
A module that fails to import or whose profiles do not compile is logged, the plugin
registry is restored to what it was before the import, and the module's previous version
keeps serving. A deleted file withdraws its profiles.

Write modules atomically (write a temporary file, then rename it over the old one): a
half-written file fails to import and simply waits for the next change.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from fleetpilot.policy import REGISTRY, ProfileConfig, build_policy

from .policy_set import PluginProfile

log = logging.getLogger("fleetpilot.policy.plugins")

MODULE_PREFIX = "fleetpilot_policy_plugin_"


@dataclass
class _Loaded:
    stat: tuple[int, int]
    digest: str
    profiles: dict[str, PluginProfile]


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

    def poll(self) -> bool:
        """Reload what changed on disk; ``True`` when the set of profiles changed."""
        seen: dict[str, tuple[int, int]] = {}
        if self.path.is_dir():
            for file in sorted(self.path.glob("*.py")):
                try:
                    st = file.stat()
                except FileNotFoundError:  # renamed away between glob and stat
                    continue
                seen[file.name] = (st.st_mtime_ns, st.st_size)
        changed = False
        for name in [n for n in self.unreadable if n not in seen]:
            del self.unreadable[name]
        for name in [n for n in self.loaded if n not in seen]:
            log.info("policy module %s removed; its profiles are withdrawn", name)
            del self.loaded[name]
            changed = True
        for name, stat in seen.items():
            old = self.loaded.get(name)
            if (old is not None and old.stat == stat) or self.failed.get(name, (None,))[0] == stat:
                continue
            changed |= self._load(name, stat)
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

    def _load(self, name: str, stat: tuple[int, int]) -> bool:
        file = self.path / name
        try:
            source = file.read_bytes()
        except OSError as exc:
            if self.unreadable.get(name) != stat:
                self.unreadable[name] = stat
                self._failed(name)
                log.warning("policy module %s unreadable (%s); %s", name, exc,
                            "the previous version keeps serving" if name in self.loaded else "it serves nothing")
            return False
        self.unreadable.pop(name, None)
        digest = hashlib.sha256(source).hexdigest()[:10]
        old = self.loaded.get(name)
        if old is not None and old.digest == digest:
            old.stat = stat  # touched, not changed
            return False
        registry_before = {point: dict(plugins) for point, plugins in REGISTRY.items()}
        module_name = MODULE_PREFIX + file.stem
        try:
            profiles = self._execute(file, module_name, source, digest)
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

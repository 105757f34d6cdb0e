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
*vetted* first (``fleetpilot.policy.vetting``): a fresh interpreter executes those bytes and
compiles the profiles they export as the service would, within ``import_timeout_s``, with the
modules the service runs importable there under the names they have here (``Sibling``: the
bytes that ran, not the files, which may hold a version not vetted yet). The event loop only
waits for the child (asyncio), so a module that hangs while it is imported costs a child
process and at most ``import_timeout_s``, not the service: it is refused ("did not finish
importing within N s"), its child and anything the child started are killed, and its
previous version keeps serving. A module that kills its interpreter (``os._exit``, a crash in
C code) is refused the same way, and so is one whose profile builds a plugin (its own or
another module's) whose constructor hangs.

Only a module that passed is executed in-process, as a fresh module object (the previous
module object is left to the compiled policies that still use its classes), on the event
loop between two decisions (``apply``): the plugin registry that decisions read is never
touched from another thread. Its profiles are compiled once more as a check. A module that
fails to import or whose profiles do not compile is logged, the plugin registry is restored
to what it was before the import, and the module's previous version keeps serving. A deleted
file withdraws its profiles (its module object and plugins stay, as they were, for the
modules that use them). Modules changed in one poll run siblings first; one whose vetting
used (or missed) a sibling that has changed since is vetted again at the next poll rather
than run against a sibling it was not vetted with, and a refused one is tried again when such
a sibling changes.

Write modules atomically (write a temporary file, then rename it over the old one): a
half-written file fails to import and simply waits for the next change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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

from .policy_set import PluginProfile

__all__ = ["DEFAULT_IMPORT_TIMEOUT_S", "MODULE_PREFIX", "PendingChanges", "PluginDirectory"]

log = logging.getLogger("fleetpilot.policy.plugins")


@dataclass
class _Loaded:
    stat: tuple[int, int]
    digest: str
    profiles: dict[str, PluginProfile]


@dataclass(frozen=True)
class _Failed:
    """A version of a file that was refused, and the vetting's view of its siblings then."""

    stat: tuple[int, int]
    digest: str
    verdict: Verdict


@dataclass(frozen=True)
class _Vetted:
    """A changed file's bytes as read, and its vetting's verdict."""

    name: str
    stat: tuple[int, int]
    source: bytes
    digest: str
    verdict: Verdict


@dataclass(frozen=True)
class PendingChanges:
    """What ``vet`` found, for ``apply``: the files present and each changed, vetted file."""

    seen: dict[str, tuple[int, int]]
    vetted: list[_Vetted]
    # Filled by ``apply``: the files whose verdict a sibling's change made stale.
    deferred: list[str] = field(default_factory=list)


@dataclass
class PluginDirectory:
    """The modules of one directory, their profiles, and what changed since the last poll."""

    path: Path
    loaded: dict[str, _Loaded] = field(default_factory=dict)
    failed: dict[str, _Failed] = field(default_factory=dict)
    # The stat at which each unreadable file was last reported: it is read again at every
    # poll (a permission fixed changes no mtime), but said once. Before, a WARNING every poll.
    unreadable: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Told the file name of each module that fails to load or cannot be read, once per
    # version of the file (the service counts them: a log line alone is missed).
    on_failure: Callable[[str], None] | None = None
    # A module whose vetting takes longer is refused as hanging (the child is killed).
    import_timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S
    # Every module run here, by its sys.modules name, as the last version that ran: what a
    # vetting child can import. Kept when its file goes, as sys.modules and the registry keep it.
    siblings: dict[str, Sibling] = field(default_factory=dict)

    async def poll(self) -> bool:
        """Reload what changed on disk (``vet``, then ``apply``, again while a module was left
        to be vetted again: a start-up serves every module that imports another); ``True``
        when the set of profiles changed."""
        changed = False
        for _ in range(max(1, len(list(self.path.glob("*.py"))) if self.path.is_dir() else 1)):
            changes = await self.vet()
            changed |= self.apply(changes)
            if not changes.deferred:
                break
        return changed

    async def vet(self) -> PendingChanges:
        """Find the files whose bytes changed (or whose refusal a sibling's change may have
        lifted) and vet each in a child process, concurrently; the event loop runs on
        meanwhile. Changes nothing a decision reads: ``apply`` does."""
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
            old, failed = self.loaded.get(name), self.failed.get(name)
            if old is not None and old.stat == stat:
                continue
            if failed is not None and failed.stat == stat and not failed.verdict.stale(self.siblings):
                continue
            read = self._read(name, stat)
            if read is not None:
                changed.append((name, stat, *read))
        gate = asyncio.Semaphore(VETTING_AT_ONCE)

        async def vet_one(name: str, stat: tuple[int, int], source: bytes, digest: str) -> _Vetted:
            async with gate:
                verdict = await vet(self.path / name, source, self.siblings, self.import_timeout_s)
            return _Vetted(name, stat, source, digest, verdict)

        vetted = await asyncio.gather(*(vet_one(*c) for c in changed))
        return PendingChanges(seen, list(vetted))

    def apply(self, changes: PendingChanges) -> bool:
        """Withdraw the removed modules and execute the vetted ones in-process, siblings first
        (synchronous: on the event loop, between two decisions); ``True`` when the set of
        profiles changed. One whose verdict a sibling's change made stale is left to the next
        poll, which vets it again."""
        changed = False
        for name in [n for n in self.loaded if n not in changes.seen]:
            log.info("policy module %s removed; its profiles are withdrawn", name)
            del self.loaded[name]
            changed = True
        by_module = {v.verdict.module: v for v in changes.vetted}
        for verdict, now in in_order([v.verdict for v in changes.vetted], lambda: self.siblings):
            vetted = by_module[verdict.module]
            if now:
                changed |= self._load(vetted)
            else:
                changes.deferred.append(vetted.name)
                log.info("policy module %s (%s): a module it uses changed since it was vetted; "
                         "vetted again", vetted.name, vetted.digest)
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
        digest = digest_of(source)
        old = self.loaded.get(name)
        if old is not None and old.digest == digest:
            old.stat = stat  # touched, not changed
            return None
        return source, digest

    def _load(self, vetted: _Vetted) -> bool:
        name, stat, digest, verdict = vetted.name, vetted.stat, vetted.digest, vetted.verdict
        old = self.loaded.get(name)
        if verdict.refused is not None:
            self.failed[name] = _Failed(stat, digest, verdict)
            self._failed(name)
            log.error("policy module %s (%s) failed to load: %s; %s", name, digest, verdict.refused,
                      "the previous version keeps serving" if old else "it serves nothing")
            return False
        file = self.path / name
        try:
            # The bytes the child vetted, not the file again: it may have changed since.
            executed = execute(file, vetted.source, module_name(file))
        # SystemExit too: a module that calls sys.exit (or argparse on the service's own
        # arguments) at import otherwise went up through the watcher and out of the event
        # loop, stopping the replica. KeyboardInterrupt still stops it.
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a broken module must never stop the service
            self.failed[name] = _Failed(stat, digest, verdict)
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
        self.siblings[module_name(file)] = Sibling(file, vetted.source, digest, executed.plugins)
        profiles = {
            p.name: PluginProfile(profile=p, version=f"{p.version}+{digest}", module=file.name)
            for p in executed.profiles
        }
        self.loaded[name] = _Loaded(stat, digest, profiles)
        log.info("policy module %s (%s) loaded: profiles %s", name, digest, sorted(profiles) or "none")
        return True

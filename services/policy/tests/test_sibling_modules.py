"""Policy modules of one directory that use each other, vetted as they run in the service.

Before, the vetting child executed a changed module alone: one that imported another policy
module by its ``sys.modules`` name (``fleetpilot_policy_plugin_<stem>``), which the service
has, found none there and was refused; and a plugin another module registered stood in for
itself there, so its constructor never ran in the child: one that hangs on the arguments a
profile gives it passed the vetting and then hung the service. Each test carries a timeout,
so the old code fails them rather than hanging the run."""

from __future__ import annotations

from pathlib import Path

import pytest
from fleetpilot.policy import REGISTRY
from fleetpilot_services.policy.plugin_dir import PluginDirectory

from .conftest import write_module

LIMIT_S = 5.0

SHARED = """
FACTOR = {factor}
def setup():
    {setup}
    return FACTOR
"""
# Imports its sibling by the name the service gives it, and reads it at import.
USER = """
import fleetpilot_policy_plugin_{shared} as shared
from fleetpilot.policy import ProfileConfig, PluginSpec
{at_import}
PROFILES = {{"user": ProfileConfig(name="user", version="{version}" + str(shared.FACTOR),
                                   filters=[PluginSpec(name="node-resources")])}}
"""


def shared(factor: float = 2.0, setup: str = "pass") -> str:
    """A module other modules import: ``FACTOR``, and ``setup()`` (which may hang)."""
    return SHARED.format(factor=factor, setup=setup)


def user(version: str, shared_stem: str = "a_shared", at_import: str = "") -> str:
    """A module that imports ``shared_stem`` by its service name and exports profile ``user``."""
    return USER.format(shared=shared_stem, version=version, at_import=at_import)


@pytest.mark.timeout(60)
async def test_a_module_may_import_a_sibling_by_its_module_name(tmp_path: Path) -> None:
    write_module(tmp_path, "a_shared.py", shared(factor=2.0))
    failures: list[str] = []
    plugins = PluginDirectory(tmp_path, on_failure=failures.append, import_timeout_s=LIMIT_S)
    await plugins.poll()
    assert plugins.profiles() == {}
    write_module(tmp_path, "b_user.py", user("1."))
    # Before: refused in the child ("No module named 'fleetpilot_policy_plugin_a_shared'").
    assert await plugins.poll()
    assert plugins.profiles()["user"].version.startswith("1.2.0+") and failures == []


@pytest.mark.timeout(60)
async def test_a_module_importing_a_sibling_that_sorts_after_it_loads_at_start(tmp_path: Path) -> None:
    # All new in one poll, the importer first by name: it waits for its sibling rather than
    # being refused for good (before: refused, and not tried again until it changed).
    write_module(tmp_path, "a_user.py", user("1.", shared_stem="z_shared"))
    write_module(tmp_path, "z_shared.py", shared(factor=3.0))
    failures: list[str] = []
    plugins = PluginDirectory(tmp_path, on_failure=failures.append, import_timeout_s=LIMIT_S)
    assert await plugins.poll()
    assert plugins.profiles()["user"].version.startswith("1.3.0+") and failures == []


@pytest.mark.timeout(60)
async def test_a_sibling_is_vetted_with_the_bytes_the_service_runs_not_the_file(tmp_path: Path, caplog) -> None:
    write_module(tmp_path, "a_shared.py", shared(factor=2.0))
    write_module(tmp_path, "b_user.py", user("1."))
    failures: list[str] = []
    plugins = PluginDirectory(tmp_path, on_failure=failures.append, import_timeout_s=LIMIT_S)
    assert await plugins.poll() and failures == []
    # In one poll: the sibling's file becomes a version that ends its interpreter (refused:
    # the service keeps its previous version), and the importer changes. The importer is
    # vetted against the sibling the service runs, so it loads; read from the disk, the
    # sibling had killed the importer's child too.
    write_module(tmp_path, "a_shared.py", "import os\nos._exit(0)\n")
    write_module(tmp_path, "b_user.py", user("2."))
    with caplog.at_level("ERROR", logger="fleetpilot.policy.plugins"):
        assert await plugins.poll()
    assert plugins.profiles()["user"].version.startswith("2.2.0+")
    assert failures == ["a_shared.py"]


@pytest.mark.timeout(60)
async def test_a_siblings_new_version_is_not_run_by_an_importer_vetted_against_the_old(tmp_path: Path) -> None:
    write_module(tmp_path, "a_shared.py", shared(factor=2.0))
    write_module(tmp_path, "b_user.py", user("1."))
    failures: list[str] = []
    plugins = PluginDirectory(tmp_path, on_failure=failures.append, import_timeout_s=LIMIT_S)
    assert await plugins.poll() and failures == []
    # In one poll: the sibling's new setup() hangs (its import alone does not: it passes), and
    # the importer now calls setup() at import. Vetted against the old sibling it passed;
    # run in the service after the new sibling, it hung the replica. It is vetted again.
    write_module(tmp_path, "a_shared.py", shared(factor=5.0, setup="while True:\n        pass"))
    write_module(tmp_path, "b_user.py", user("2.", at_import="shared.setup()"))
    await plugins.poll()
    assert failures == ["b_user.py"]
    assert plugins.profiles()["user"].version.startswith("1.2.0+")  # the previous version serves


# A module registers a plugin whose constructor hangs on some arguments; another's profile
# gives it those arguments.
SLOW_PLUGIN = """
import time
import msgspec
from fleetpilot.policy import register
from fleetpilot.policy.framework import ScorePlugin

class Args(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    hang: bool = False

@register
class SlowToBuild(ScorePlugin):
    name = "slow-to-build"
    Args = Args
    def __init__(self, args=None):
        super().__init__(args)
        while self.args.hang:
            time.sleep(0.01)
    def score(self, cycle):
        return cycle.rows * 0.0
"""
USES_SLOW = """
PROFILES = {{"slow": {{"filters": [{{"name": "node-resources"}}], "version": "{version}",
                      "scores": [{{"name": "slow-to-build", "args": {{"hang": {hang}}}}}]}}}}
"""


@pytest.mark.timeout(60)
async def test_a_profile_that_builds_another_modules_plugin_into_a_hang_is_refused(tmp_path: Path) -> None:
    write_module(tmp_path, "a_slow.py", SLOW_PLUGIN)
    write_module(tmp_path, "b_uses.py", USES_SLOW.format(version="1", hang="False"))
    failures: list[str] = []
    plugins = PluginDirectory(tmp_path, on_failure=failures.append, import_timeout_s=LIMIT_S)
    assert await plugins.poll() and failures == []
    # Before: the child built a stand-in for slow-to-build (another module's plugin), passed,
    # and the service's own build never returned.
    write_module(tmp_path, "b_uses.py", USES_SLOW.format(version="2", hang="True"))
    assert await plugins.poll() is False
    assert failures == ["b_uses.py"] and plugins.profiles()["slow"].version.startswith("1+")
    assert "slow-to-build" in REGISTRY["score"]

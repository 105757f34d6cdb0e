"""A policy module that exits while it is imported must not take the service with it."""

from __future__ import annotations

from pathlib import Path

from fleetpilot.policy import REGISTRY
from fleetpilot_services.policy.plugin_dir import PluginDirectory

GOOD = """
from fleetpilot.policy import ProfileConfig, PluginSpec
PROFILES = {"mine": ProfileConfig(name="mine", filters=[PluginSpec(name="node-resources")])}
"""

# An operator's module that parses its own command line at import (argparse exits on the
# service's arguments), or calls sys.exit: SystemExit is no Exception, and before it went up
# through ``poll`` into the plugin watcher and out of the event loop, stopping the replica.
EXITS = """
from fleetpilot.policy import register
from fleetpilot.policy.framework import ScorePlugin

@register
class HalfLoaded(ScorePlugin):
    name = "half-loaded-by-an-exiting-module"
    def score(self, cycle):
        return 0.0

import sys
sys.exit(2)
"""


async def test_a_module_that_exits_on_import_is_refused_and_the_previous_version_serves(tmp_path: Path) -> None:
    module = tmp_path / "mine.py"
    module.write_text(GOOD)
    failures: list[str] = []
    plugins = PluginDirectory(tmp_path, on_failure=failures.append)
    assert await plugins.poll()
    before = plugins.profiles()["mine"].version

    module.write_text(EXITS + "\n# changed\n")
    assert await plugins.poll() is False  # refused, logged; no SystemExit escapes
    assert plugins.profiles()["mine"].version == before
    # What the half-run module registered is not in the service's registry (it exits in the
    # vetting child, so it is not run here; were it run, it would be taken back).
    assert not any("half-loaded-by-an-exiting-module" in names for names in REGISTRY.values())
    assert await plugins.poll() is False  # not tried again until the file changes
    assert failures == ["mine.py"]  # counted once (fleetpilot_policy_module_errors_total), not only logged


async def test_an_unreadable_module_is_reported_once_and_read_again_when_it_can_be(tmp_path: Path, caplog) -> None:
    (tmp_path / "mine.py").mkdir()  # a module path that cannot be read (as a permission denied)
    failures: list[str] = []
    plugins = PluginDirectory(tmp_path, on_failure=failures.append)
    with caplog.at_level("WARNING", logger="fleetpilot.policy.plugins"):
        for _ in range(5):
            assert await plugins.poll() is False
    # Before: one WARNING every poll (twice a second, for as long as it stayed), saying "keeping
    # the previous version" of a module that had none.
    unreadable = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(unreadable) == 1 and "it serves nothing" in unreadable[0], unreadable
    assert failures == ["mine.py"]
    (tmp_path / "mine.py").rmdir()
    (tmp_path / "mine.py").write_text(GOOD)
    assert await plugins.poll() and "mine" in plugins.profiles()

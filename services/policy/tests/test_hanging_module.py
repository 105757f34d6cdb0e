"""A policy module that hangs while it is imported must not stop the policy service.

Before, ``PluginDirectory.poll`` executed a changed module in-process, on the event loop: a
module with ``while True: pass`` (a ``sleep``, a blocking call) at top level stopped the
replica's every decision and heartbeat for ever, at start-up as on a hot reload. Each test
carries a timeout, so the old code fails them rather than hanging the run."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from fleetpilot_services.policy.plugin_dir import PluginDirectory
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for, write_module

LIMIT_S = 1.5
# The replica's limit: room for a decision while a module is vetted, on a busy machine.
SERVICE_LIMIT_S = 4.0

GOOD = """
from fleetpilot.policy import ProfileConfig, PluginSpec
PROFILES = {{"{name}": ProfileConfig(name="{name}", version="{version}", filters=[PluginSpec(name="node-resources")])}}
"""

# Says where the interpreter that imports it runs (and what it started), then never returns.
HANGS = """
import os, subprocess, sys, time
from pathlib import Path
{start_grandchild}
Path({pid_file!r}).write_text(str(os.getpid()))
{hang}
"""
GRANDCHILD = """
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
Path({pid_file!r} + ".grandchild").write_text(str(helper.pid))
"""


def hanging(pid_file: Path, hang: str = "while True:\n    pass", grandchild: bool = False) -> str:
    """A module that records its interpreter's pid (and its helper's) in ``pid_file``, then hangs."""
    return HANGS.format(pid_file=str(pid_file), hang=hang,
                        start_grandchild=GRANDCHILD.format(pid_file=str(pid_file)) if grandchild else "")


def gone(pid: int) -> bool:
    """The process no longer runs (exited, or a zombie waiting for its parent to reap it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return fields[0] in ("Z", "X")


@pytest.mark.timeout(60)
async def test_a_module_that_hangs_on_import_is_refused_and_the_loop_runs_on(tmp_path: Path, caplog) -> None:
    write_module(tmp_path, "a.py", GOOD.format(name="mine", version="1"))
    write_module(tmp_path, "b.py", GOOD.format(name="other", version="1"))
    failures: list[str] = []
    plugins = PluginDirectory(tmp_path, on_failure=failures.append, import_timeout_s=LIMIT_S)
    assert await plugins.poll()
    other_before = plugins.profiles()["other"].version

    # One module is fixed while the other starts to hang, in one poll.
    write_module(tmp_path, "a.py", GOOD.format(name="mine", version="2"))
    write_module(tmp_path, "b.py", hanging(tmp_path / "b.pid"))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    beat = asyncio.create_task(ticker())
    started = time.monotonic()
    with caplog.at_level("ERROR", logger="fleetpilot.policy.plugins"):
        changed = await plugins.poll()
    took = time.monotonic() - started
    beat.cancel()

    assert changed
    assert LIMIT_S <= took < LIMIT_S + 5, took
    # The event loop ran all along (before: not one tick, ever).
    assert ticks >= LIMIT_S / 0.05 / 3, ticks
    profiles = plugins.profiles()
    assert profiles["mine"].version.startswith("2+")  # the other module's change went through
    assert profiles["other"].version == other_before  # the hanging one's previous version serves
    assert failures == ["b.py"]
    said = [r.getMessage() for r in caplog.records if "b.py" in r.getMessage()]
    assert len(said) == 1 and f"did not finish importing within {LIMIT_S:g} s" in said[0], said
    assert "the previous version keeps serving" in said[0]
    # The interpreter that hung was killed, and reaped.
    await wait_for(lambda: gone(int((tmp_path / "b.pid").read_text())), 5.0, "the hanging child gone")

    # Not tried again (nor counted, nor logged) until the file changes.
    started = time.monotonic()
    with caplog.at_level("ERROR", logger="fleetpilot.policy.plugins"):
        assert await plugins.poll() is False
    assert time.monotonic() - started < LIMIT_S
    assert failures == ["b.py"]
    assert len([r for r in caplog.records if "b.py" in r.getMessage()]) == 1

    # Fixed, it loads.
    write_module(tmp_path, "b.py", GOOD.format(name="other", version="3"))
    assert await plugins.poll()
    assert plugins.profiles()["other"].version.startswith("3+")


@pytest.mark.timeout(60)
async def test_a_hanging_module_leaves_no_process_behind(tmp_path: Path) -> None:
    # It sleeps rather than spins, and starts a helper process first: both are killed.
    write_module(tmp_path, "stuck.py", hanging(tmp_path / "stuck.pid", hang="time.sleep(3600)", grandchild=True))
    failures: list[str] = []
    plugins = PluginDirectory(tmp_path, on_failure=failures.append, import_timeout_s=LIMIT_S)
    assert await asyncio.wait_for(plugins.poll(), LIMIT_S + 10) is False
    assert failures == ["stuck.py"] and plugins.profiles() == {}
    pids = [int((tmp_path / name).read_text()) for name in ("stuck.pid", "stuck.pid.grandchild")]
    await wait_for(lambda: all(gone(pid) for pid in pids), 5.0, "no process left behind")


# A shared module registers a plugin; another module's profile names it.
SHARED = """
from fleetpilot.policy import register
from fleetpilot.policy.framework import ScorePlugin
import msgspec

class Args(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    factor: float = 1.0

@register
class Shared(ScorePlugin):
    name = "shared-score"
    Args = Args
    def score(self, cycle):
        return cycle.rows * self.args.factor
"""
USES_SHARED = """
PROFILES = {{"user": {{"filters": [{{"name": "node-resources"}}],
                      "scores": [{{"name": "shared-score", "args": {{"factor": 2.0}}}}], "version": "{version}"}}}}
"""


@pytest.mark.timeout(60)
async def test_a_module_may_still_use_a_plugin_another_module_registered(tmp_path: Path) -> None:
    write_module(tmp_path, "a_shared.py", SHARED)
    write_module(tmp_path, "b_user.py", USES_SHARED.format(version="1"))
    failures: list[str] = []
    plugins = PluginDirectory(tmp_path, on_failure=failures.append, import_timeout_s=10.0)
    assert await plugins.poll() and set(plugins.profiles()) == {"user"}
    # The vetting child runs b_user.py alone: the service's other plugins stand in there.
    write_module(tmp_path, "b_user.py", USES_SHARED.format(version="2"))
    assert await plugins.poll()
    assert plugins.profiles()["user"].version.startswith("2+") and failures == []
    # In the service the real plugin checks the arguments, as before.
    write_module(tmp_path, "b_user.py", USES_SHARED.format(version="3").replace('"factor"', '"facter"'))
    assert await plugins.poll() is False
    assert plugins.profiles()["user"].version.startswith("2+") and failures == ["b_user.py"]


@pytest.mark.timeout(60)
async def test_a_module_that_ends_its_interpreter_on_import_is_refused(tmp_path: Path, caplog) -> None:
    write_module(tmp_path, "mine.py", GOOD.format(name="mine", version="1"))
    failures: list[str] = []
    plugins = PluginDirectory(tmp_path, on_failure=failures.append, import_timeout_s=10.0)
    assert await plugins.poll()
    # Before: executed in the service, it ended the service (no exception to catch).
    write_module(tmp_path, "mine.py", "import os\nos._exit(0)\n")
    with caplog.at_level("ERROR", logger="fleetpilot.policy.plugins"):
        assert await plugins.poll() is False
    assert plugins.profiles()["mine"].version.startswith("1+") and failures == ["mine.py"]
    assert any("exited with status 0 before it finished importing" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(60)
async def test_a_replica_starts_and_decides_while_a_module_hangs(observer, nats_url, tmp_path):
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    write_module(plugin_dir, "mine.py", GOOD.format(name="mine", version="1"))
    write_module(plugin_dir, "stuck.py", hanging(tmp_path / "stuck.pid"))  # present at start
    await observer.put_fleet([node("n0", gpus=2)])
    host = build(settings(nats_url, tmp_path, profile="mine", plugin_dir=str(plugin_dir),
                          plugin_import_timeout_s=SERVICE_LIMIT_S))
    # Before: the start-up's load never returned (nor did anything else on the loop).
    await asyncio.wait_for(host.start(), SERVICE_LIMIT_S + 30)
    try:
        await observer.admit(admitted("t1"))
        await wait_for(lambda: len(observer.decisions) >= 1, what="the first decision")

        # A hot reload into a version that hangs: decisions go on meanwhile, on version 1.
        write_module(plugin_dir, "mine.py", hanging(tmp_path / "mine.pid"))
        await wait_for(lambda: (tmp_path / "mine.pid").exists(), 10.0, "the new version being vetted")
        await observer.admit(admitted("t2"))
        await wait_for(lambda: len(observer.decisions) >= 2, SERVICE_LIMIT_S + 10, "a decision")
        errors = {name: host.metrics.registry.get_sample_value("fleetpilot_policy_module_errors_total",
                                                               {"module": name})
                  for name in ("stuck.py", "mine.py")}
        await wait_for(lambda: host.metrics.registry.get_sample_value(
            "fleetpilot_policy_module_errors_total", {"module": "mine.py"}) == 1.0, SERVICE_LIMIT_S + 10,
            "the refusal")
        await observer.admit(admitted("t3"))
        await wait_for(lambda: len(observer.decisions) >= 3, what="a decision after the refusal")
        await asyncio.sleep(3 * 0.1)  # a few more polls: the refused version is not tried again
        mine_errors = host.metrics.registry.get_sample_value("fleetpilot_policy_module_errors_total",
                                                             {"module": "mine.py"})
    finally:
        await host.stop()
    # t2 was decided while the new version was being vetted (not refused yet).
    assert errors == {"stuck.py": 1.0, "mine.py": None}
    assert mine_errors == 1.0
    decided = {d.task_id: d for d in observer.decisions}
    assert {t: (d.action, d.policy.name, d.fallback) for t, d in decided.items()} == {
        t: ("assign", "mine", False) for t in ("t1", "t2", "t3")}
    assert len({d.policy.version for d in decided.values()}) == 1
    assert decided["t3"].policy.version.startswith("1+")
    for pid_file in ("stuck.pid", "mine.pid"):
        await wait_for(lambda f=pid_file: gone(int((tmp_path / f).read_text())), 5.0, f"{pid_file} gone")

"""The policy service over a real nats-server: a broken primary hands over to the
stats-fed fallback and gets its traffic back after the breaker's cooldown once fixed; a KV
config change and a hot-reloaded module take effect without losing a decision."""

from __future__ import annotations

import asyncio

import msgspec
from fleetpilot.contracts import FeedbackStats, StatsGroup, StatsQuery, decode, encode, now
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for, write_module

FLAKY = """
import numpy as np
from fleetpilot.policy import register
from fleetpilot.policy.framework import ScorePlugin

BROKEN = {broken}

@register
class Flaky(ScorePlugin):
    name = "flaky-score"

    def score(self, cycle):
        if BROKEN:
            raise RuntimeError("the flaky plugin is broken")
        return np.zeros(cycle.rows.size)

PROFILES = {{"flaky": {{"filters": [{{"name": "node-resources"}}, {{"name": "gpu-model"}}],
                       "scores": [{{"name": "flaky-score"}}], "version": "{version}"}}}}
"""


def sample(host, name: str, **labels) -> float | None:
    return host.metrics.registry.get_sample_value(name, labels or None)


async def test_broken_primary_falls_back_on_history_and_returns_after_cooldown(observer, nats_url, tmp_path):
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    write_module(plugin_dir, "flaky.py", FLAKY.format(broken=True, version="1"))
    await observer.put_fleet(
        [
            node("a100-0", model="A100-40GB", memory_mb=40960),
            node("a100-1", model="A100-40GB"),
            node("h100-0"),
            node("h100-1"),
        ]
    )
    queries = []

    async def stats(msg) -> None:  # the feedback service's endpoint: train jobs fail on A100s
        queries.append(decode(msg.data, StatsQuery))
        groups = [
            StatsGroup(
                key={"task_kind": "train", "gpu_model": "A100-40GB"},
                count=100,
                successes=5,
                success_rate=0.05,
            ),
            StatsGroup(
                key={"task_kind": "train", "gpu_model": "H100"}, count=100, successes=95, success_rate=0.95
            ),
        ]
        await msg.respond(encode(FeedbackStats(groups=groups, at=now())))

    await observer.nc.subscribe("feedback.stats", cb=stats)
    breaker = {"failure_threshold": 2, "cooldown_s": 3.0, "time_budget_s": 2.0}
    host = build(settings(nats_url, tmp_path, profile="flaky", breaker=breaker, plugin_dir=str(plugin_dir)))
    await host.start()
    try:
        broken = [admitted(f"b{i}", gpu_milli=100) for i in range(8)]
        for adm in broken:
            await observer.admit(adm)
        await wait_for(lambda: len(observer.decisions) >= len(broken), what="decisions while broken")
        open_while_broken = sample(host, "fleetpilot_policy_breaker_open", policy="flaky")
        generation = sample(host, "fleetpilot_policy_generation")
        write_module(plugin_dir, "flaky.py", FLAKY.format(broken=False, version="2"))
        await wait_for(
            lambda: sample(host, "fleetpilot_policy_generation") != generation, what="module reloaded"
        )
        # Fixed, but the breaker is still open: the next tasks still go to the fallback.
        early = [admitted(f"e{i}", gpu_milli=100) for i in range(3)]
        for adm in early:
            await observer.admit(adm)
        await wait_for(
            lambda: len(observer.decisions) >= len(broken) + len(early), what="decisions before cooldown"
        )
        await asyncio.sleep(3.0)  # past the cooldown: the half-open probe reaches the fixed primary
        late = [admitted(f"l{i}", gpu_milli=100) for i in range(4)]
        for adm in late:
            await observer.admit(adm)
        total = len(broken) + len(early) + len(late)
        await wait_for(lambda: len(observer.decisions) >= total, what="decisions after cooldown")
        reload_s = sample(host, "fleetpilot_policy_last_reload_seconds", kind="module")
        open_once_fixed = sample(host, "fleetpilot_policy_breaker_open", policy="flaky")
        trips = sample(host, "fleetpilot_policy_breaker_trips_total", policy="flaky", outcome="exception")
    finally:
        await host.stop()
    decided = observer.by_task()
    assert all(len(ds) == 1 and ds[0].action == "assign" for ds in decided.values())
    for adm in broken + early:
        d = decided[adm.task.task_id][0]
        assert d.fallback and d.policy.name == "fallback"
        # Built from the feedback statistics: train jobs go where they succeed.
        assert d.placement[0].node.startswith("h100"), d
    for adm in late:
        d = decided[adm.task.task_id][0]
        assert not d.fallback and d.policy.name == "flaky" and d.policy.version.startswith("2+")
    assert queries and set(queries[0].by) == {"task_kind", "gpu_model"}
    assert reload_s is not None and 0 < reload_s < 0.5
    # Operators see the breaker: open while the primary raised (by the exceptions), closed again.
    assert (open_while_broken, open_once_fixed) == (1.0, 0.0) and trips is not None and trips >= 1


async def test_config_change_and_module_reload_lose_no_decision(observer, nats_url, tmp_path):
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    custom = 'PROFILES = {{"custom": {{"filters": [{{"name": "node-resources"}}], "scores": [{{"name": "packing"}}], "version": "{v}"}}}}\n'
    write_module(plugin_dir, "custom.py", custom.format(v="1"))
    await observer.put_fleet([node(f"n{i}", gpus=4) for i in range(8)])
    host = build(settings(nats_url, tmp_path, profile="bestfit", plugin_dir=str(plugin_dir)))
    await host.start()
    tasks = [admitted(f"t{i:03d}", gpu_milli=100) for i in range(240)]

    async def feed() -> None:
        for adm in tasks:
            await observer.admit(adm)
            await asyncio.sleep(0.01)

    async def change(after: int, act) -> None:
        await wait_for(lambda: len(observer.decisions) >= after, what=f"{after} decisions")
        await act()

    async def set_default() -> None:
        await observer.kv_put("config", "policies.default", b'{"profile": "packing"}')

    async def set_host() -> None:
        await observer.kv_put("config", "policies.test-host", b'{"profile": "custom"}')

    async def bad_then_new_module() -> None:
        write_module(plugin_dir, "custom.py", "this is not python\n")  # keeps v1 serving
        await asyncio.sleep(0.3)
        write_module(plugin_dir, "custom.py", custom.format(v="2"))

    async def bad_config() -> None:  # refused; the previous policies keep serving
        await observer.kv_put("config", "policies.test-host", b'{"profile": "no-such-policy"}')

    try:
        await asyncio.gather(
            feed(),
            change(40, set_default),
            change(90, set_host),
            change(130, bad_then_new_module),
            change(190, bad_config),
        )
        await wait_for(lambda: len(observer.decisions) >= len(tasks), 20.0, "every task decided")
        await asyncio.sleep(0.3)
        errors = sample(host, "fleetpilot_policy_config_errors_total")
    finally:
        await host.stop()
    decided = observer.by_task()
    assert set(decided) == {a.task.task_id for a in tasks}
    assert all(len(ds) == 1 and ds[0].action == "assign" for ds in decided.values())
    # Decisions in the order the tasks arrived: the policies change in the order applied.
    seen = [
        (decided[a.task.task_id][0].policy.name, decided[a.task.task_id][0].policy.version.split("+")[0])
        for a in tasks
    ]
    order = [seen[0]]
    for s in seen[1:]:
        if s != order[-1]:
            order.append(s)
    assert order == [("bestfit", "1"), ("packing", "1"), ("custom", "1"), ("custom", "2")], order
    assert seen[-1] == ("custom", "2")  # the bad config at 190 changed nothing
    assert errors == 1


def test_bad_config_documents_are_refused_with_a_reason():
    from fleetpilot_services.policy.policy_set import ActivePolicies, config_key, parse_config

    active = ActivePolicies(parse_config(b'{"profile": "bestfit"}'))
    for doc, needle in [(b'{"profile": 1}', "profile"), (b'{"profil": "x"}', "profil"), (b"{", "invalid")]:
        try:
            parse_config(doc)
        except ValueError as exc:
            assert needle in str(exc)
        else:
            raise AssertionError(f"{doc!r} accepted")
    bad_rule = parse_config(b'{"shaping": [{"condition": "task.kind ==", "policy": "fgd"}]}')
    assert not active.apply_config(bad_rule, "x")
    assert active.current.default == "bestfit" and active.current.generation == 1
    assert active.apply_config(msgspec.convert({"profile": "fgd"}, type(bad_rule)), "y")
    assert active.current.default == "fgd"
    assert config_key("gpu-7.dc1.example") == "policies.gpu-7.dc1.example"
    assert config_key("weird/host name") == "policies.weird_host_name"


async def test_a_stored_config_that_does_not_compile_does_not_stop_a_replica_from_starting(
    observer, nats_url, tmp_path
):
    """A config document naming a policy nobody knows (a typo, a module not mounted) is
    refused while replicas run; a replica started afterwards refused to start at all, so a
    rolling restart took every replica down. It starts from the settings and counts the error."""
    await observer.put_fleet([node("n0")])
    await observer.kv_put("config", "policies.default", b'{"profile": "no-such-policy"}')
    host = build(settings(nats_url, tmp_path, profile="bestfit"))
    await host.start()
    try:
        await observer.admit(admitted("t"))
        await wait_for(lambda: len(observer.decisions) >= 1, what="t decided")
        errors = sample(host, "fleetpilot_policy_config_errors_total")
    finally:
        await host.stop()
    assert [(d.action, d.policy.name) for d in observer.decisions] == [("assign", "bestfit")]
    assert errors == 1


def test_a_breaker_left_open_by_a_config_change_is_reported_closed():
    """An operator whose policy's breaker opened (it timed out on a big fleet) raises its
    time budget: the new breaker config gets a new, closed breaker and the primary decides
    again. Before, the open breaker was only left behind, and the ``breaker_open`` gauge it
    set stayed at 1 for good; so it did when a shaping rule's open policy was removed."""
    from fleetpilot_services.policy.metrics import PolicyMetrics
    from fleetpilot_services.policy.policy_set import ActivePolicies, parse_config
    from prometheus_client import CollectorRegistry

    metrics = PolicyMetrics(CollectorRegistry())
    active = ActivePolicies(parse_config(
        b'{"profile": "bestfit", "shaping": [{"condition": "true", "weight": 0.1, "policy": "fgd"}]}'))
    active.on_breaker = metrics.breaker_changed

    def gauge(name: str) -> float | None:
        return metrics.breaker_open.labels(name)._value.get()

    for name in ("bestfit", "fgd"):
        for _ in range(3):
            active.current.guarded[name].breaker.record("timeout")
    assert (gauge("bestfit"), gauge("fgd")) == (1.0, 1.0)
    assert active.apply_config(parse_config(b'{"profile": "bestfit", "breaker": {"time_budget_s": 1.0}}'), "kv")
    assert active.current.guarded["bestfit"].breaker.state == "closed"
    assert (gauge("bestfit"), gauge("fgd")) == (0.0, 0.0)
    # A swap that keeps the breaker (a module, the statistics) leaves the gauge alone.
    active.current.guarded["bestfit"].breaker.record("timeout")
    for _ in range(2):
        active.current.guarded["bestfit"].breaker.record("timeout")
    assert active.apply_stats([]) and gauge("bestfit") == 1.0


def test_a_config_refused_for_a_module_not_loaded_yet_is_applied_when_the_module_comes():
    """The operator writes ``policies.default`` naming a profile whose module is rolled out a
    moment later: refused then, it is applied with the module, as a replica started after the
    module applies it. Before, the running replica kept its old policies until the key was
    written again."""
    from fleetpilot.policy import PluginSpec, ProfileConfig
    from fleetpilot_services.policy.policy_set import ActivePolicies, PluginProfile, parse_config

    active = ActivePolicies(parse_config(b'{"profile": "bestfit"}'))
    assert not active.apply_config(parse_config(b'{"profile": "mine"}'), "kv rev 2")
    assert active.current.default == "bestfit"
    mine = PluginProfile(profile=ProfileConfig(name="mine", filters=[PluginSpec(name="node-resources")]),
                         version="1+abc", module="mine.py")
    assert active.apply_plugins({"mine": mine})
    assert (active.current.default, active.current.source) == ("mine", "kv rev 2")
    # Applied once: a later module change keeps it, and a config accepted since is not undone.
    assert active.apply_config(parse_config(b'{"profile": "fgd"}'), "kv rev 3")
    assert active.apply_plugins({"mine": mine, "other": PluginProfile(profile=ProfileConfig(name="other"),
                                                                      version="1", module="o.py")})
    assert active.current.default == "fgd"

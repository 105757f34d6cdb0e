"""The terms of a contract, over a real nats-server: where a term depends on the site (a
warm-up bound, a deadline) the task runs at one of the contract's sites (an accepted
offer's, an admission's; an old contract's one ``site`` for an accepted offer); the site and
start of the estimate a task was admitted on do not bind otherwise, nor does an option's
expected start (``not_before``)."""

from __future__ import annotations

import msgspec
from fleetpilot.contracts import Allocation, Contract, NodeLedger, encode, now
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


def bound(task_id: str, **terms) -> object:
    """A one-GPU task admitted under a contract with ``terms``, from an accepted offer."""
    return msgspec.structs.replace(admitted(task_id, gpu_milli=1000), contract=Contract(offer_id="o-1", **terms))


def as_asked(task_id: str, **terms) -> object:
    """A one-GPU task admitted as it asked, under the estimate's ``terms``."""
    return msgspec.structs.replace(admitted(task_id, gpu_milli=1000), contract=Contract(**terms))


async def take_first_gpu(observer, node_name: str) -> None:
    """Hold GPU 0 of ``node_name`` in the ledger for another, confirmed task."""
    taken = Allocation(task_id="old", decision_id="old.assign", gpu=0, milli=1000, memory_mb=1000, state="confirmed")
    await observer.kv_put("ledger", node_name, encode(NodeLedger(node=node_name, allocations=[taken])))


async def test_a_contract_that_names_a_site_is_placed_there(observer, nats_url, tmp_path):
    # bestfit prefers the fuller node: a-0 (one of its four GPUs taken) over b-0 (four free).
    await observer.put_fleet([node("a-0", gpus=4, site="site-a"), node("b-0", gpus=4, site="site-b")])
    await take_first_gpu(observer, "a-0")
    policy = build(settings(nats_url, tmp_path, profile="bestfit"))
    await policy.start()
    try:
        await observer.admit(bound("free"))  # no site: where bestfit likes it
        await wait_for(lambda: len(observer.decisions) == 1, what="the free task placed")
        await observer.admit(bound("bound", site="site-b", warmup_ms=500.0))
        await wait_for(lambda: len(observer.decisions) == 2, what="the bound task placed")
        # An option's site that no term depends on binds nothing: any site keeps the contract.
        await observer.admit(bound("unbound", site="site-b"))
        await wait_for(lambda: len(observer.decisions) == 3, what="the unbound task placed")
        # Admitted as asked: the site of its estimate is no term.
        await observer.admit(as_asked("estimated", site="site-b"))
        await wait_for(lambda: len(observer.decisions) == 4, what="the estimated task placed")
    finally:
        await policy.stop()
    where = {d.task_id: (d.action, d.placement[0].node) for d in observer.decisions}
    assert where == {"free": ("assign", "a-0"), "bound": ("assign", "b-0"), "unbound": ("assign", "a-0"),
                     "estimated": ("assign", "a-0")}


async def test_a_contract_that_names_a_site_without_room_waits_for_it(observer, nats_url, tmp_path):
    await observer.put_fleet([node("a-0", site="site-a"), node("b-0", gpus=1, site="site-b")])
    await take_first_gpu(observer, "b-0")
    policy = build(settings(nats_url, tmp_path, profile="bestfit"))
    await policy.start()
    try:
        await observer.admit(bound("bound", site="site-b", deadline=now() + 86_400))
        await wait_for(lambda: len(observer.decisions) == 1, what="a decision")
    finally:
        await policy.stop()
    assert [d.action for d in observer.decisions] == ["queue"]  # a-0 is free, but on site-a


async def test_an_admission_whose_warmup_depends_on_the_site_is_held_to_the_sites_keeping_it(
        observer, nats_url, tmp_path):
    """Admitted as asked under a warm-up bound that only "site-b" and "site-c" keep (its data's
    trip to "site-a" is too long): the site was no term of an admission, and bestfit put it on
    a-0, the fuller node, where its warm-up broke its contract."""
    await observer.put_fleet([node("a-0", gpus=4, site="site-a"), node("b-0", gpus=4, site="site-b")])
    await take_first_gpu(observer, "a-0")
    policy = build(settings(nats_url, tmp_path, profile="bestfit"))
    await policy.start()
    try:
        await observer.admit(as_asked("near", site="site-c", sites=["site-c", "site-b"], warmup_ms=500.0))
        await wait_for(lambda: len(observer.decisions) == 1, what="the admission placed")
        # Listed sites with no term that depends on them bind nothing: bestfit's a-0.
        await observer.admit(bound("loose", site="site-b", sites=["site-b"], max_queue_s=60.0))
        await wait_for(lambda: len(observer.decisions) == 2, what="the loose task placed")
    finally:
        await policy.stop()
    where = {d.task_id: (d.action, d.placement[0].node) for d in observer.decisions}
    assert where == {"near": ("assign", "b-0"), "loose": ("assign", "a-0")}


async def test_an_accepted_offer_runs_at_another_site_that_keeps_its_terms(observer, nats_url, tmp_path):
    """Offered at "site-b", whose one GPU is taken, under a warm-up "site-c" keeps too: bound
    to the option's site alone, the task waited there while c-0 stood free. Never on a-0:
    "site-a" keeps none of its terms, though bestfit likes its fuller node best."""
    await observer.put_fleet([node("a-0", gpus=4, site="site-a"), node("b-0", gpus=1, site="site-b"),
                              node("c-0", gpus=4, site="site-c")])
    for name in ("a-0", "b-0"):
        taken = Allocation(task_id=f"old-{name}", decision_id=f"old-{name}.assign", gpu=0, milli=1000,
                           memory_mb=1000, state="confirmed")
        await observer.kv_put("ledger", name, encode(NodeLedger(node=name, allocations=[taken])))
    policy = build(settings(nats_url, tmp_path, profile="bestfit"))
    await policy.start()
    try:
        await observer.admit(bound("offered", site="site-b", sites=["site-b", "site-c"], warmup_ms=500.0))
        await wait_for(lambda: len(observer.decisions) == 1, what="the accepted offer decided")
    finally:
        await policy.stop()
    assert [(d.action, d.placement[0].node if d.placement else "") for d in observer.decisions] == [("assign", "c-0")]


async def test_an_expected_start_does_not_hold_a_task_back(observer, nats_url, tmp_path):
    # ``not_before`` is when the estimate expected the task to start (its queue ahead), not a
    # start the client asked for: with room now, the task starts now.
    await observer.put_fleet([node("n0")])
    policy = build(settings(nats_url, tmp_path, profile="bestfit"))
    await policy.start()
    try:
        await observer.admit(bound("offered", not_before=now() + 600))
        await observer.admit(as_asked("asked", not_before=now() + 600))
        await wait_for(lambda: len(observer.decisions) == 2, what="both decided")
    finally:
        await policy.stop()
    assert sorted((d.task_id, d.action) for d in observer.decisions) == [("asked", "assign"), ("offered", "assign")]

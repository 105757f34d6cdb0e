"""The negotiator over a table of fleet states and requests: admit, counter-offers, rejects, tiers."""

from __future__ import annotations

import msgspec
import pytest
from fleetpilot.contracts import Fingerprint, SlaOffer, SlaRequest, TaskSubmitted, encode
from fleetpilot.sla import (
    Admit,
    CounterOffer,
    FleetView,
    GpuPool,
    NegotiationPolicy,
    Reject,
    bound_sites,
    contract_for,
    negotiate,
)

NOW = 10_000.0

A100 = GpuPool(site="eu-1", gpu_model="A100", memory_mb_per_gpu=81_920, price_per_gpu_hour=2.0, free_gpus=2,
               reserved_gpus=1, preemptible_gpus=2, completions=((600.0, 2),))
H100 = GpuPool(site="us-1", gpu_model="H100", memory_mb_per_gpu=81_920, price_per_gpu_hour=4.0, free_gpus=0,
               completions=((240.0, 1), (900.0, 1)), relative_compute=2.0)
V100 = GpuPool(site="eu-1", gpu_model="V100", memory_mb_per_gpu=16_384, price_per_gpu_hour=0.8, free_gpus=4,
               relative_compute=0.5)
SHARED = GpuPool(site="eu-2", gpu_model="L4", memory_mb_per_gpu=24_576, price_per_gpu_hour=1.0, free_gpus=0,
                 free_milli=600)
FLEET = FleetView(pools=(A100, H100, V100), bandwidth_gbps={("us-1", "eu-1"): 0.2}, local_bandwidth_gbps=10.0)


def task(**kw) -> TaskSubmitted:
    sla = SlaRequest(**kw.pop("sla", {}))
    return TaskSubmitted(task_id="t1", tenant="acme", sla=sla, **kw)


def kinds(decision: CounterOffer) -> set[str]:
    """Which terms each option relaxes, read back from its explanation."""
    found = set()
    for o in decision.options:
        for word, kind in [("slower warm-up", "warmup"), ("longer wait", "queue"), ("another GPU model", "model"),
                           ("higher cost", "cost"), ("higher p95", "latency")]:
            if word in o.why:
                found.add(kind)
    return found


# (name, task, expected outcome, (model, site) of the admission or expected counter-offer kinds / reject code)
CASES = [
    ("cheapest free GPU", task(kind="train"), Admit, ("V100", "eu-1")),
    ("memory rules out V100", task(kind="train", gpu_memory_mb=40_000), Admit, ("A100", "eu-1")),
    ("fractional on a shared GPU", task(kind="infer", gpu_milli=500, gpu_models=["L4"]), Admit, ("L4", "eu-2")),
    ("waits when no queue bound", task(kind="train", gpu_models=["H100"]), Admit, ("H100", "us-1")),
    ("no GPU big enough", task(gpu_memory_mb=100_000), Reject, "infeasible"),
    ("deadline cannot be met", task(expected_duration_s=3_600, sla={"deadline": NOW + 100}), Reject, "infeasible"),
    ("bad milli", task(gpu_milli=0), Reject, "invalid"),
    ("shared multi-GPU", task(gpus=2, gpu_milli=500), Reject, "invalid"),
    ("negative CPU", task(cpu_milli=-1), Reject, "invalid"),
    ("negative host memory", task(memory_mb=-1), Reject, "invalid"),
    ("endless duration", task(expected_duration_s=float("inf")), Reject, "invalid"),
    ("zero duration", task(expected_duration_s=0.0), Reject, "invalid"),
    ("negative queue bound", task(sla={"max_queue_s": -5}), Reject, "invalid"),
    ("NaN latency bound", task(sla={"p95_latency_ms": float("nan")}), Reject, "invalid"),
    ("negative cost ceiling", task(sla={"cost_ceiling_per_hour": -1.0}), Reject, "invalid"),
    ("endless deadline", task(sla={"deadline": float("inf")}), Reject, "invalid"),
    # Date.now() of a JavaScript client: milliseconds, read as seconds some 50,000 years away,
    # met by every pool, so it was silently no deadline at all.
    ("deadline in milliseconds", task(sla={"deadline": 1_796_000_000_000.0}), Reject, "invalid"),
    # Past 53 bits an integer is read inexactly, or not at all, by a consumer outside Python.
    ("more GPUs than any reader holds", task(gpus=99_999_999_999_999_999_999), Reject, "invalid"),
    ("host memory past 2**53", task(memory_mb=2**70), Reject, "invalid"),
    # The p95 reference label is read as a number: words crashed the negotiator (the service
    # retried the submission five times, then dead-lettered it; a quote got no answer), and
    # "nan" passed every latency bound, so the task was admitted whatever it asked.
    ("p95 reference in words", task(kind="infer", labels={"p95_ref_ms": "fast"}), Reject, "invalid"),
    ("NaN p95 reference", task(kind="infer", labels={"p95_ref_ms": "nan"}, sla={"p95_latency_ms": 10}),
     Reject, "invalid"),
    ("endless p95 reference", task(kind="infer", labels={"p95_ref_ms": "inf"}), Reject, "invalid"),
    ("negative p95 reference", task(kind="infer", labels={"p95_ref_ms": "-5"}), Reject, "invalid"),
    ("never enough GPUs", task(gpus=16), Reject, "infeasible"),
    ("relax warm-up or wait",
     task(kind="infer", size_gb=2.0, labels={"data_site": "us-1"}, gpu_models=["A100", "H100"],
          sla={"warmup_ms": 250, "max_queue_s": 30}),
     CounterOffer, {"warmup", "queue"}),
    ("wait longer or other model", task(kind="train", gpu_models=["H100"], sla={"max_queue_s": 60}),
     CounterOffer, {"queue", "model"}),
    ("higher cost", task(kind="train", gpu_memory_mb=40_000, sla={"cost_ceiling_per_hour": 1.0}),
     CounterOffer, {"cost"}),
    ("latency needs the H100 later", task(kind="infer", sla={"p95_latency_ms": 30, "max_queue_s": 30}),
     CounterOffer, {"latency", "queue"}),
    ("vip preempts best_effort", task(gpus=4, gpu_models=["A100"], sla={"tier": "vip", "max_queue_s": 60}),
     Admit, ("A100", "eu-1")),
    ("standard cannot preempt", task(gpus=4, gpu_models=["A100"], sla={"tier": "standard", "max_queue_s": 60}),
     CounterOffer, {"queue"}),
    ("standard uses reserved capacity", task(gpus=2, gpu_models=["A100"], sla={"max_queue_s": 60}),
     Admit, ("A100", "eu-1")),
    ("best_effort never sees reserved", task(gpus=2, gpu_models=["A100"], sla={"tier": "best_effort",
                                                                                "max_queue_s": 60}),
     CounterOffer, {"queue"}),
    ("cpu only", task(gpus=0), Admit, (None, None)),
    ("p95 reference label is used", task(kind="infer", labels={"p95_ref_ms": "120"}, gpu_models=["V100"],
                                          sla={"p95_latency_ms": 200}),
     CounterOffer, {"latency"}),
]


@pytest.mark.parametrize("name,submitted,outcome,expected", CASES, ids=[c[0] for c in CASES])
def test_negotiate_table(name, submitted, outcome, expected):
    fleet = FleetView(pools=(*FLEET.pools, SHARED), bandwidth_gbps=FLEET.bandwidth_gbps, local_bandwidth_gbps=10.0)
    decision = negotiate(submitted, fleet, now=NOW)
    assert isinstance(decision, outcome), decision
    if isinstance(decision, Admit):
        models = decision.contract.gpu_models or [None]
        assert (models[0], decision.contract.site) == expected
        assert decision.contract.tier == submitted.sla.tier
    elif isinstance(decision, Reject):
        assert decision.code == expected and decision.task_id == "t1" and decision.reason
    else:
        assert expected <= kinds(decision), decision.reason
        assert decision.valid_until == NOW + NegotiationPolicy().offer_ttl_s
        assert len({o.option_id for o in decision.options}) == len(decision.options) <= 4


def test_counter_offer_options_are_concrete_and_meetable():
    submitted = task(kind="infer", size_gb=2.0, labels={"data_site": "us-1"}, gpu_models=["A100", "H100"],
                     sla={"warmup_ms": 250, "max_queue_s": 30})
    decision = negotiate(submitted, FLEET, now=NOW)
    assert isinstance(decision, CounterOffer)
    assert "warm-up within 250 ms is not possible on a free GPU now" in decision.reason
    # The options travel as a list; a reason that listed them too was shown twice by
    # ``fleetpilot submit`` (the reason, then each option).
    assert not any(o.why in decision.reason for o in decision.options) and "options" not in decision.reason
    by_model = {o.gpu_model: o for o in decision.options}
    # A100 now, but the data crosses a 0.2 GB/s link: 2 GB -> 10 s of warm-up.
    assert by_model["A100"].expected_queue_s == 0 and by_model["A100"].warmup_ms == pytest.approx(10_000)
    # H100 sits with the data (10 GB/s -> 200 ms) but frees up in 4 minutes.
    assert by_model["H100"].warmup_ms == pytest.approx(200) and by_model["H100"].expected_queue_s == 240
    assert by_model["H100"].not_before == NOW + 240 and by_model["H100"].p95_latency_ms == pytest.approx(25)
    assert "about 4 minutes" in by_model["H100"].why


def test_vip_admission_is_marked_preemptive():
    decision = negotiate(task(gpus=4, gpu_models=["A100"], sla={"tier": "vip", "max_queue_s": 60}), FLEET, now=NOW)
    assert isinstance(decision, Admit) and decision.may_preempt
    assert "may_preempt" in decision.contract.notes
    plain = negotiate(task(gpus=1, gpu_models=["A100"], sla={"tier": "vip"}), FLEET, now=NOW)
    assert isinstance(plain, Admit) and not plain.may_preempt


def test_best_effort_options_avoid_reserved_capacity():
    decision = negotiate(task(gpus=2, gpu_models=["A100"], sla={"tier": "best_effort", "max_queue_s": 60}),
                         FLEET, now=NOW)
    assert isinstance(decision, CounterOffer)
    a100 = [o for o in decision.options if o.gpu_model == "A100"]
    assert a100 and all(o.expected_queue_s >= 600 for o in a100)


@pytest.mark.parametrize(("completions", "queue_s"), [((), 0.0), (((600.0, 1), (1800.0, 1)), 1800.0)])
def test_the_headroom_delays_a_best_effort_task_the_pool_can_hold_but_never_refuses_it(completions, queue_s):
    # Four A100s, one free and kept as headroom for guaranteed tiers. A best_effort task of
    # every GPU the pool will have is not refused: it may take the headroom once the pool's
    # known work has ended (at once where nothing runs, as on an idle one-GPU pool).
    gpus = 1 + sum(n for _, n in completions)
    pool = GpuPool(site="eu-1", gpu_model="A100", memory_mb_per_gpu=81_920, price_per_gpu_hour=2.0, free_gpus=1,
                   reserved_gpus=1, completions=completions)
    request = task(gpus=gpus, gpu_models=["A100"], expected_duration_s=600.0, sla={"tier": "best_effort"})
    decision = negotiate(request, FleetView(pools=(pool,)), now=NOW)
    assert isinstance(decision, Admit), decision
    assert (decision.contract.not_before or NOW) - NOW == queue_s
    # One GPU more than the pool will ever have is still refused.
    wider = negotiate(msgspec.structs.replace(request, gpus=gpus + 1), FleetView(pools=(pool,)), now=NOW)
    assert isinstance(wider, Reject) and wider.code == "infeasible"


def test_fingerprint_peak_and_warmup_count():
    fp = Fingerprint(signature="s", pattern="leak", pattern_confidence=0.9, growth_rate_mb_per_s=1.0,
                     predicted_peak_mb=30_000, peak_low_mb=25_000, peak_high_mb=35_000, warmup_s=1.5)
    decision = negotiate(task(kind="train"), FLEET, now=NOW, fingerprint=fp)
    # Estimated on A100 (free now), not on the V100, too small for the peak; the V100 holds
    # the ask, so it stays among the models: which holds the growth is the policy's to judge.
    assert isinstance(decision, Admit) and decision.contract.gpu_models == ["A100", "H100", "V100"]
    assert "A100" in decision.contract.notes
    assert "warm-up 1500 ms" in decision.contract.notes


def test_an_admission_may_run_on_every_model_that_keeps_its_terms_the_estimated_one_first():
    """Pinned to the one model it was estimated on, an admitted task waited for that model
    while others it asked for stood free. It keeps every model whose own terms (acceptable,
    its latency, its price) the ask allows; a model too dear for its cost ceiling is not one."""
    asked = task(gpus=1, gpu_models=["A100", "H100", "V100"], sla={"max_queue_s": 600})
    admitted = negotiate(asked, FLEET, now=NOW)
    assert isinstance(admitted, Admit)
    assert admitted.contract.gpu_models[0] == admitted.contract.notes.split()[2]  # "estimated on <model> at"
    assert sorted(admitted.contract.gpu_models) == ["A100", "H100", "V100"]
    prices = {p.gpu_model: p.price_per_gpu_hour for p in FLEET.pools}
    ceiling = sorted(set(prices.values()))[-2]  # the dearest model breaks it
    capped = negotiate(task(gpus=1, gpu_models=["A100", "H100", "V100"],
                            sla={"max_queue_s": 600, "cost_ceiling_per_hour": ceiling}), FLEET, now=NOW)
    assert isinstance(capped, Admit)
    dearest = max(prices, key=prices.get)
    assert dearest not in capped.contract.gpu_models and len(capped.contract.gpu_models) == 2


def test_an_offer_under_a_deadline_closes_before_accepting_it_would_miss_the_deadline():
    # The H100 frees too late for the deadline; the A100 now leaves 60 s to spare. Accepted
    # at the end of a 300 s validity it would start 240 s after the deadline allowed, under a
    # contract that promises the deadline: the offer must close when that slack runs out.
    submitted = task(kind="train", gpu_models=["H100"], expected_duration_s=600,
                     sla={"max_queue_s": 30, "deadline": NOW + 660})
    decision = negotiate(submitted, FLEET, now=NOW, policy=NegotiationPolicy(offer_ttl_s=300))
    assert isinstance(decision, CounterOffer)
    assert {o.gpu_model for o in decision.options} >= {"A100"}
    latest = min(submitted.sla.deadline - o.warmup_ms / 1000 - 600 for o in decision.options)
    assert decision.valid_until == pytest.approx(latest) and NOW < decision.valid_until <= NOW + 60
    roomy = negotiate(task(kind="train", gpu_models=["H100"], expected_duration_s=600,
                           sla={"max_queue_s": 30, "deadline": NOW + 100_000}), FLEET, now=NOW,
                      policy=NegotiationPolicy(offer_ttl_s=300))
    assert isinstance(roomy, CounterOffer) and roomy.valid_until == NOW + 300


@pytest.mark.parametrize("task_id", ["", "team.a", "a b", "t*", "t>", "t\n1"])
def test_a_task_id_that_is_no_single_subject_token_is_invalid(task_id):
    """Answers go out on ``sla.offer.<task>`` and replies come on ``sla.reply.<task>``, which
    the SLA stream takes one token deep: an offer to ``team.a`` was never stored (the
    submission retried, then dead-lettered) and the client could never answer it."""
    decision = negotiate(TaskSubmitted(task_id=task_id, tenant="acme", gpus=1), FLEET, now=NOW)
    assert isinstance(decision, Reject) and decision.code == "invalid" and "task_id" in decision.reason


@pytest.mark.parametrize("sla", [{"deadline": NOW - 60}, {"deadline": NOW + 100}])
def test_a_cpu_only_task_that_cannot_meet_its_deadline_is_infeasible(sla):
    """The deadline is hard for every task: a CPU-only one whose deadline had passed at
    submission (or that runs past it) was admitted under a contract promising it."""
    decision = negotiate(task(gpus=0, expected_duration_s=600, sla=sla), FLEET, now=NOW)
    assert isinstance(decision, Reject) and decision.code == "infeasible" and "deadline" in decision.reason
    roomy = negotiate(task(gpus=0, expected_duration_s=600, sla={"deadline": NOW + 600}), FLEET, now=NOW)
    assert isinstance(roomy, Admit) and roomy.contract.deadline == NOW + 600


@pytest.mark.parametrize(("submitted", "pools"), [
    # 1e308 GB at 10 GB/s is 1e310 ms: infinity, on every pool.
    (task(kind="train", size_gb=1e308, sla={"warmup_ms": 250}), FLEET.pools),
    (task(kind="train", size_gb=1e308), FLEET.pools),  # no bound: nothing to admit it on either
    # A p95 reference of 1e308 ms over a V100's 0.5 compute: infinity.
    (task(kind="infer", labels={"p95_ref_ms": "1e308"}, sla={"p95_latency_ms": 10}), (V100,)),
])
def test_an_estimate_that_overflows_to_infinity_is_infeasible_not_offered(submitted, pools):
    """Finite but huge inputs made an infinite warm-up or p95: the offer holding it cannot be
    encoded, so the service dead-lettered the submission and never answered it."""
    decision = negotiate(submitted, FleetView(pools=pools, local_bandwidth_gbps=10.0), now=NOW)
    assert isinstance(decision, Reject) and decision.code == "infeasible", decision
    assert "finite" in decision.reason


def test_a_pool_whose_estimate_overflows_is_left_out_of_the_offer():
    """The other pools' finite estimates are still offered, and the offer can be sent."""
    submitted = task(kind="infer", labels={"p95_ref_ms": "1e308"}, sla={"p95_latency_ms": 10})
    decision = negotiate(submitted, FLEET, now=NOW)
    assert isinstance(decision, CounterOffer) and decision.options
    assert "V100" not in {o.gpu_model for o in decision.options}
    encode(SlaOffer(offer_id="t1/x", task_id="t1", tenant="acme", asked=submitted.sla,
                    options=decision.options, reason=decision.reason, valid_until=decision.valid_until, at=NOW))


FULL = GpuPool(site="eu-1", gpu_model="A100", memory_mb_per_gpu=81_920, price_per_gpu_hour=2.0, free_gpus=0)


@pytest.mark.parametrize(("pools", "sla", "says", "not_says"), [
    # Every GPU busy with work of unknown duration: the deadline a day away was blamed.
    ((FULL,), {"deadline": NOW + 86_400}, "free enough GPUs", "deadline"),
    # No GPU in the fleet at all (only CPU nodes reported): "no GPU model has 0 MB per GPU".
    ((), {}, "no GPUs", "0 MB"),
    ((), {"deadline": NOW + 86_400}, "no GPUs", "0 MB"),
])
def test_an_infeasible_task_is_told_the_reason_that_applies(pools, sla, says, not_says):
    decision = negotiate(task(kind="train", sla=sla), FleetView(pools=pools), now=NOW)
    assert isinstance(decision, Reject) and decision.code == "infeasible"
    assert says in decision.reason and not_says not in decision.reason, decision.reason


def test_an_option_runs_on_every_model_its_terms_hold_on_its_own_first():
    """Accepted, an option is the ask relaxed to its terms: the models the task asked for that
    keep them run it too, the option's own first. Held to the option's model alone, an
    accepted offer of another model now never took the model it asked for, freeing later."""
    asked = task(kind="train", gpu_models=["H100"], gpu_memory_mb=20_000, sla={"max_queue_s": 60})
    offer = negotiate(asked, FLEET, now=NOW)
    assert isinstance(offer, CounterOffer)
    by_model = {o.gpu_model: o for o in offer.options}
    assert by_model["A100"].gpu_models == ["A100", "H100"]  # another model now, or the H100 asked
    assert by_model["H100"].gpu_models == ["H100"]  # the wait: the V100 is too small, the A100 not asked
    # Under a cost ceiling the H100 breaks, the A100 option keeps it: the H100 is not one of its models.
    capped = negotiate(task(kind="train", gpu_models=["H100"], gpu_memory_mb=20_000,
                            sla={"max_queue_s": 60, "cost_ceiling_per_hour": 3.0}), FLEET, now=NOW)
    assert isinstance(capped, CounterOffer)
    assert {o.gpu_model: o.gpu_models for o in capped.options}["A100"] == ["A100"]


# Three A100 pools whose data lies at "near": local (200 ms for 2 GB), over a fast link to
# "mid" (400 ms) and a slow one to "far" (4 s). "near" is busy for a minute.
SITES = FleetView(pools=(
    GpuPool(site="near", gpu_model="A100", memory_mb_per_gpu=81_920, price_per_gpu_hour=2.0, completions=((60.0, 1),)),
    GpuPool(site="mid", gpu_model="A100", memory_mb_per_gpu=81_920, price_per_gpu_hour=2.0, free_gpus=1),
    GpuPool(site="far", gpu_model="A100", memory_mb_per_gpu=81_920, price_per_gpu_hour=2.0, free_gpus=2),
), bandwidth_gbps={("near", "mid"): 5.0, ("near", "far"): 0.5}, local_bandwidth_gbps=10.0)


def near_data(**sla) -> TaskSubmitted:
    """A 2 GB task whose data lies at "near", asking ``sla``."""
    return task(kind="train", size_gb=2.0, labels={"data_site": "near"}, expected_duration_s=600.0, sla=sla)


def test_an_admission_whose_warmup_differs_by_site_is_held_to_the_sites_that_keep_it():
    """The site was no term of an admission: estimated at "mid", a task bound to a 500 ms
    warm-up could be placed at "far", 4 s from its data. Its contract lists the sites whose
    warm-up keeps the bound, the estimated one first, then the closest."""
    admitted = negotiate(near_data(warmup_ms=500.0), SITES, now=NOW)
    assert isinstance(admitted, Admit)
    assert admitted.contract.site == "mid"  # free now; "near" frees in a minute
    assert admitted.contract.sites == ["mid", "near"]
    assert bound_sites(admitted.contract) == ["mid", "near"]


def test_an_admission_under_a_deadline_is_held_to_the_sites_whose_warmup_it_allows():
    """A deadline counts the warm-up: started when the estimate starts it, the 4 s trip to
    "far" ends the run after a deadline 2 s past the run at "mid"."""
    admitted = negotiate(near_data(deadline=NOW + 602.0), SITES, now=NOW)
    assert isinstance(admitted, Admit)
    assert admitted.contract.sites == ["mid", "near"]


def test_a_contract_without_site_dependent_terms_binds_no_site():
    """A wait, a price: no term the site decides. Any site keeps the contract: it lists none,
    admitted or offered."""
    admitted = negotiate(near_data(max_queue_s=600.0, cost_ceiling_per_hour=3.0), SITES, now=NOW)
    assert isinstance(admitted, Admit) and admitted.contract.site == "mid"
    assert admitted.contract.sites == [] and bound_sites(admitted.contract) == []
    offer = negotiate(task(kind="train", gpu_models=["H100"], sla={"max_queue_s": 60}), FLEET, now=NOW)
    assert isinstance(offer, CounterOffer) and all(o.sites == [] for o in offer.options)


def test_an_option_lists_every_site_that_keeps_its_relaxed_warmup():
    """Accepted, an option binds its task to the sites that keep its warm-up (the asked bound
    relaxed to the option's), its own first: offered "mid" at 400 ms, the task may run at
    "near" (200 ms) as well, never at "far" (4 s)."""
    offer = negotiate(near_data(warmup_ms=300.0, max_queue_s=10.0), SITES, now=NOW)
    assert isinstance(offer, CounterOffer)
    by_site = {o.site: o for o in offer.options}
    assert by_site["mid"].sites == ["mid", "near"]
    assert by_site["near"].sites == ["near"]  # the wait: its 300 ms asked holds nowhere else
    accepted = contract_for(near_data(warmup_ms=300.0, max_queue_s=10.0), by_site["mid"], "o")
    assert accepted.sites == ["mid", "near"] and bound_sites(accepted) == ["mid", "near"]


def test_a_short_task_is_admitted_into_the_gap_a_waiting_wide_task_leaves():
    """Four A100s idle until an 8-GPU task waiting for them starts in an hour: a 1-GPU run of
    20 minutes ends before then, so the policy backfills it now and its deadline in 40
    minutes is met. Without the gaps its only start was after the wide task, two hours away:
    it was rejected, and a deadline missed the fleet could keep."""
    waiting_wide = GpuPool(site="eu-1", gpu_model="A100", memory_mb_per_gpu=81_920, price_per_gpu_hour=2.0,
                           completions=((10_800.0, 8),), gaps=((0.0, 3_600.0),) * 4)
    fleet = FleetView(pools=(waiting_wide,))
    short = task(kind="train", expected_duration_s=1_200, sla={"deadline": NOW + 2_400})
    decision = negotiate(short, fleet, now=NOW)
    assert isinstance(decision, Admit) and decision.contract.not_before is None
    # A run that would outlast the gap waits for the wide task's end, and misses the deadline.
    longer = task(kind="train", expected_duration_s=3_900, sla={"deadline": NOW + 5_000})
    assert isinstance(negotiate(longer, fleet, now=NOW), Reject)
    # Wider than the gaps there are: the same.
    wide = task(kind="train", gpus=5, expected_duration_s=1_200, sla={"deadline": NOW + 2_400})
    assert isinstance(negotiate(wide, fleet, now=NOW), Reject)
    # A run of unknown length is never promised a gap.
    unknown = task(kind="train", sla={"max_queue_s": 60})
    assert not isinstance(negotiate(unknown, fleet, now=NOW), Admit)

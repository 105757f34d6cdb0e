"""The SLA negotiator: admit a submission as asked, counter-offer what can be met, or reject.

For every pool that can hold the task (enough GPU memory per GPU for the asked memory or
the fingerprint's predicted peak), the negotiator estimates what the task would get there:
queue time (from free GPUs visible to its tier, then running tasks' expected completions, or
GPUs idle until a waiting wide task starts, where its run ends by then),
warm-up (data size over the link bandwidth from the data's site, plus the fingerprint's
warm-up), p95 latency for inference (reference latency over relative compute) and cost.
Each estimate is compared with the asked bounds:

- nothing violated on an acceptable GPU model -> :class:`Admit` (fastest, then cheapest),
  on every model whose own terms it meets, at every site whose own terms it meets where a
  term depends on the site (``admit_contract``, ``sites_keeping``);
- a vip request that only fits by preempting best_effort work -> :class:`Admit` with
  ``may_preempt`` (and a note in the contract);
- otherwise every estimate that breaks some bounds (but never the deadline) is a concrete
  :class:`~fleetpilot.contracts.OfferOption` — relax warm-up, wait longer, another GPU
  model or site, a higher cost, or a mix — and the best few, one of each kind first, make a
  :class:`CounterOffer`;
- nothing can hold the task at all, or nothing meets the deadline -> :class:`Reject`.

Tiers: vip and standard see every free GPU; best_effort sees only free GPUs not reserved
for guaranteed tiers, so it is never offered someone else's guaranteed capacity.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from fleetpilot.contracts import Contract, Fingerprint, OfferOption, RejectCode, TaskSubmitted
from fleetpilot.contracts.catalog import TASK_ID_MAX_BYTES, task_id_problem

from .fleet import FleetView, GpuPool, earliest_in_windows

# Labels a submission may carry to inform the estimates.
DATA_SITE_LABEL = "data_site"
P95_REFERENCE_LABEL = "p95_ref_ms"

Term = str  # one of TERMS
TERMS = ("gpu_model", "queue", "warmup", "latency", "cost")


@dataclass(frozen=True)
class Admit:
    """Run the task under ``contract``; ``may_preempt`` lets a vip task displace best_effort work."""

    contract: Contract
    may_preempt: bool = False


@dataclass(frozen=True)
class CounterOffer:
    """The ask cannot be met as is; each option is met as stated. Open until ``valid_until``:
    the policy's ttl, or sooner when a deadline leaves an option less slack than that."""

    options: list[OfferOption]
    reason: str
    valid_until: float


@dataclass(frozen=True)
class Reject:
    """The task will not run: ``code`` for machines, ``reason`` for people."""

    code: RejectCode
    reason: str
    task_id: str = ""


Decision = Admit | CounterOffer | Reject


@dataclass(frozen=True)
class NegotiationPolicy:
    """Knobs: how long offers stay open and how many options one offer carries."""

    offer_ttl_s: float = 300.0
    max_options: int = 4


@dataclass(frozen=True)
class Estimate:
    """What the task would get on one pool, and which asked bounds that breaks."""

    pool: GpuPool
    queue_s: float
    warmup_ms: float
    p95_ms: float | None
    cost_per_hour: float
    violations: tuple[Term, ...]
    preempts: bool = False


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"about {seconds / 60:.0f} minutes"
    return f"about {seconds / 3600:.1f} hours"


def _visible_free(pool: GpuPool, tier: str) -> int:
    if tier == "best_effort":
        return max(pool.free_gpus - pool.reserved_gpus, 0)
    return pool.free_gpus


def _queue_s(pool: GpuPool, task: TaskSubmitted, tier: str, hold_s: float | None = None) -> float:
    """Seconds until enough GPUs free up for the task; ``inf`` if running work never frees them.

    With ``hold_s`` (how long the task holds its GPUs: its warm-up and expected run), it may
    also start sooner in the pool's ``gaps``, GPUs idle until a waiting task takes them, if
    the run ends within them: the policy backfills there."""
    if task.gpus == 1 and task.gpu_milli < 1000 and pool.free_milli >= task.gpu_milli:
        return 0.0
    free = _visible_free(pool, tier)
    if free >= task.gpus:
        return 0.0
    have, queue = free, math.inf
    for in_s, gpus in sorted(pool.completions):
        have += gpus
        if have >= task.gpus:
            queue = max(float(in_s), 0.0)
            break
    if math.isinf(queue) and free < pool.free_gpus and pool.free_gpus + (have - free) >= task.gpus:
        # The headroom kept for guaranteed tiers delays a best_effort task; it never refuses
        # one the pool can hold: such a task may take the headroom once the pool's known work
        # has ended (at once on an idle pool, whose every GPU was headroom: a best_effort
        # task on an idle one-GPU pool was refused as if no GPU would ever free).
        queue = max((max(float(in_s), 0.0) for in_s, _ in pool.completions), default=0.0)
    if hold_s is None or not pool.gaps:
        return queue
    for_good = [(0.0, math.inf)] * free + [(max(float(in_s), 0.0), math.inf) for in_s, gpus in pool.completions
                                           if in_s < queue for _ in range(gpus)]
    early = earliest_in_windows([*pool.gaps, *for_good], task.gpus, hold_s, queue)
    return queue if early is None else early[0]


def estimate(task: TaskSubmitted, pool: GpuPool, fleet: FleetView, fingerprint: Fingerprint | None,
             now: float, preempt: bool) -> Estimate | None:
    """What ``task`` would get on ``pool`` at ``now`` and which asked bounds that breaks;
    ``None`` where the pool can never hold it, or not before its deadline. With ``preempt``,
    as if a vip request displaced the pool's best_effort work."""
    sla = task.sla
    if preempt:
        # Summed over the pool, two half-free nodes read as room for a task as wide as a
        # node that no preemption could clear.
        room = pool.free_gpus + pool.preemptible_gpus
        if pool.most_clearable_on_a_node is not None:
            room = min(room, pool.most_clearable_on_a_node)
        if room < task.gpus:
            return None
        queue = 0.0
    warmup = warmup_ms_at(task, pool.site, fleet, fingerprint)
    if not preempt:
        hold = None if task.expected_duration_s is None else warmup / 1000.0 + task.expected_duration_s
        queue = _queue_s(pool, task, sla.tier, hold)
    if math.isinf(queue):
        return None
    p95 = None
    if task.kind == "infer":
        reference = float(task.labels.get(P95_REFERENCE_LABEL, fleet.reference_p95_ms))
        p95 = reference / max(pool.relative_compute, 1e-9)
    if not math.isfinite(warmup) or (p95 is not None and not math.isfinite(p95)):
        # Finite but huge inputs (a size, a p95 reference) overflow here: nothing can be
        # promised on the pool, and an offer or contract holding infinity cannot be sent.
        return None
    share = task.gpus if task.gpu_milli >= 1000 or task.gpus != 1 else task.gpu_milli / 1000.0
    cost = pool.price_per_gpu_hour * share
    if sla.deadline is not None:
        finish = now + queue + warmup / 1000.0 + (task.expected_duration_s or 0.0)
        if finish > sla.deadline:
            return None  # a deadline is hard: nothing that misses it is offered
    violations: list[Term] = []
    if task.gpu_models and pool.gpu_model not in task.gpu_models:
        violations.append("gpu_model")
    if sla.max_queue_s is not None and queue > sla.max_queue_s:
        violations.append("queue")
    if sla.warmup_ms is not None and warmup > sla.warmup_ms:
        violations.append("warmup")
    if sla.p95_latency_ms is not None and p95 is not None and p95 > sla.p95_latency_ms:
        violations.append("latency")
    if sla.cost_ceiling_per_hour is not None and cost > sla.cost_ceiling_per_hour:
        violations.append("cost")
    return Estimate(pool=pool, queue_s=queue, warmup_ms=warmup, p95_ms=p95, cost_per_hour=cost,
                    violations=tuple(violations), preempts=preempt)


def warmup_ms_at(task: TaskSubmitted, site: str, fleet: FleetView, fingerprint: Fingerprint | None) -> float:
    """The warm-up ``task`` would have at ``site``, in ms: its data's trip there (its size over
    the link from ``DATA_SITE_LABEL``'s site) plus the fingerprint's warm-up. The site alone
    decides it, whatever the model."""
    bandwidth = fleet.bandwidth(task.labels.get(DATA_SITE_LABEL), site)
    warmup = (task.size_gb / bandwidth * 1000.0 if task.size_gb > 0 else 0.0)
    return warmup + (fingerprint.warmup_s * 1000.0 if fingerprint is not None else 0.0)


def sites_keeping(task: TaskSubmitted, first: str, models: Iterable[str], fleet: FleetView | None,
                  fingerprint: Fingerprint | None, *, start: float, warmup_ms: float | None,
                  deadline: float | None) -> list[str]:
    """``first``, then every other site with a pool of one of ``models`` that holds the ask
    and keeps the terms a site decides: its warm-up (``warmup_ms_at``) within ``warmup_ms``,
    and, started at ``start`` (the latest start the terms were judged on), the run over by
    ``deadline`` (``None``: no bound); the closest first. Empty when neither term binds
    (``offers.site_bound``): any site keeps the contract then.

    The wait is not judged here, as in ``models_keeping``: it depends on when, and a site
    that frees sooner than the estimate's only makes the task wait less. Held to the one site
    estimated on, a task waited there while another site that met its terms stood free;
    held to none, it could be placed where its data's trip broke its warm-up or deadline."""
    if warmup_ms is None and deadline is None:
        return []
    if fleet is None:
        return [first]
    wanted = set(models)
    duration = task.expected_duration_s or 0.0
    kept: dict[str, float] = {}
    for pool in fleet.pools:
        if (pool.site == first or pool.site in kept or pool.gpu_model not in wanted
                or pool.memory_mb_per_gpu < task.gpu_memory_mb
                or not pool.holds(task.gpus, task.cpu_milli, task.memory_mb)):
            continue
        warmup = warmup_ms_at(task, pool.site, fleet, fingerprint)
        if not math.isfinite(warmup) or (warmup_ms is not None and warmup > warmup_ms):
            continue
        if deadline is not None and start + warmup / 1000.0 + duration > deadline:
            continue
        kept[pool.site] = warmup
    return [first, *sorted(kept, key=lambda site: (kept[site], site))]


def _where(e: Estimate) -> str:
    when = "now" if e.queue_s <= 0 else f"in {_duration(e.queue_s)}"
    return f"{e.pool.gpu_model} at {e.pool.site} {when}"


def _terms(e: Estimate) -> str:
    parts = [f"warm-up {e.warmup_ms:.0f} ms"]
    if e.p95_ms is not None:
        parts.append(f"p95 {e.p95_ms:.0f} ms")
    parts.append(f"{e.cost_per_hour:.2f}/h")
    return ", ".join(parts)


def _why(e: Estimate, task: TaskSubmitted) -> str:
    sla = task.sla
    changes = []
    for term in e.violations:
        if term == "gpu_model":
            changes.append(f"another GPU model ({e.pool.gpu_model}, not {'/'.join(task.gpu_models)})")
        elif term == "queue":
            changes.append(f"a longer wait ({_duration(e.queue_s)}, not within {_duration(sla.max_queue_s or 0)})")
        elif term == "warmup":
            changes.append(f"a slower warm-up ({e.warmup_ms:.0f} ms, not {sla.warmup_ms:.0f} ms)")
        elif term == "latency":
            changes.append(f"a higher p95 ({e.p95_ms:.0f} ms, not {sla.p95_latency_ms:.0f} ms)")
        elif term == "cost":
            changes.append(f"a higher cost ({e.cost_per_hour:.2f}/h, above {sla.cost_ceiling_per_hour:.2f}/h)")
    return f"{_where(e)}: {_terms(e)}; accepts " + " and ".join(changes)


def _shortfall(task: TaskSubmitted, acceptable_now: list[Estimate]) -> str:
    """Why the ask fails now, bound by bound, against the best acceptable pool for that bound."""
    sla = task.sla
    if not acceptable_now:
        models = "/".join(task.gpu_models) if task.gpu_models else "any GPU"
        return f"no {models} can start within the asked wait"
    lines = []
    best = min(acceptable_now, key=lambda e: e.warmup_ms)
    if sla.warmup_ms is not None and best.warmup_ms > sla.warmup_ms:
        lines.append(f"warm-up within {sla.warmup_ms:.0f} ms is not possible on a free GPU now "
                     f"(best {best.warmup_ms:.0f} ms on {best.pool.gpu_model} at {best.pool.site})")
    p95s = [e for e in acceptable_now if e.p95_ms is not None]
    if sla.p95_latency_ms is not None and p95s:
        fastest = min(p95s, key=lambda e: e.p95_ms or 0.0)
        if (fastest.p95_ms or 0.0) > sla.p95_latency_ms:
            lines.append(f"p95 within {sla.p95_latency_ms:.0f} ms is not possible now "
                         f"(best {fastest.p95_ms:.0f} ms on {fastest.pool.gpu_model})")
    cheapest = min(acceptable_now, key=lambda e: e.cost_per_hour)
    if sla.cost_ceiling_per_hour is not None and cheapest.cost_per_hour > sla.cost_ceiling_per_hour:
        lines.append(f"nothing free now costs under {sla.cost_ceiling_per_hour:.2f}/h "
                     f"(cheapest {cheapest.cost_per_hour:.2f}/h)")
    return "; ".join(lines) or "the asked terms cannot all be met together now"


def _option(e: Estimate, task: TaskSubmitted, now: float, option_id: str,
            others: Iterable[Estimate] = (), *, fleet: FleetView | None = None,
            fingerprint: Fingerprint | None = None, closes: float | None = None) -> OfferOption:
    p95 = None if e.p95_ms is None else round(e.p95_ms, 1)
    cost = round(e.cost_per_hour, 4)
    warmup = round(e.warmup_ms, 1)
    # Accepted, the option's terms are the ask relaxed to its own (``offers.contract_for``):
    # every other model that keeps those runs it as well, as for an admission, and every
    # other site that keeps the terms a site decides. Accepted as late as the offer stays
    # open (``closes``), it starts no sooner than then.
    sla = task.sla
    models = models_keeping(task, e.pool.gpu_model, others,
                            p95_ms=None if sla.p95_latency_ms is None else max(sla.p95_latency_ms, p95 or 0.0),
                            cost_per_hour=None if sla.cost_ceiling_per_hour is None
                            else max(sla.cost_ceiling_per_hour, cost))
    sites = sites_keeping(task, e.pool.site, models, fleet, fingerprint,
                          start=max(now + e.queue_s, closes if closes is not None else now),
                          warmup_ms=None if sla.warmup_ms is None else max(sla.warmup_ms, warmup),
                          deadline=sla.deadline)
    return OfferOption(option_id=option_id, gpu_model=e.pool.gpu_model, site=e.pool.site,
                       warmup_ms=warmup, expected_queue_s=round(e.queue_s, 1),
                       p95_latency_ms=p95, cost_per_hour=cost,
                       not_before=now + e.queue_s if e.queue_s > 0 else None, why=_why(e, task),
                       gpu_models=models, sites=sites)


def models_keeping(task: TaskSubmitted, first: str, others: Iterable[Estimate], *,
                   p95_ms: float | None, cost_per_hour: float | None) -> list[str]:
    """``first``, then every other model among the ``others`` estimates that keeps the terms a
    model alone decides (its name, its compute, its price) under the given bounds: one
    ``task`` accepts (or ``first`` itself, a model an accepted option adds), its p95 within
    ``p95_ms``, its price within ``cost_per_hour`` (``None``: no bound). Warm-up and the wait
    depend on where and when, not on the model: a model that keeps these keeps the contract
    wherever the policy finds it room."""
    models = [first]
    for other in sorted(others, key=lambda o: o.pool.gpu_model):
        model = other.pool.gpu_model
        if model in models or (task.gpu_models and model not in task.gpu_models):
            continue
        if p95_ms is not None and other.p95_ms is not None and other.p95_ms > p95_ms:
            continue
        if cost_per_hour is not None and other.cost_per_hour > cost_per_hour:
            continue
        models.append(model)
    return models


def _notes(e: Estimate) -> str:
    text = f"estimated on {_where(e)}: {_terms(e)}"
    if e.preempts:
        text += "; may_preempt: best_effort work may be preempted to start now"
    return text


def admit_contract(task: TaskSubmitted, e: Estimate, now: float, others: Iterable[Estimate] = (), *,
                   fleet: FleetView | None = None, fingerprint: Fingerprint | None = None) -> Contract:
    """The contract for running ``task`` as estimated in ``e``: the asked bounds, placed.

    ``gpu_models`` is the model estimated on first, then every other model among ``others``
    (the estimates on the pools that hold the ask) that keeps the terms the model alone
    decides (``models_keeping``): the policy may place the task on any of them and keep the
    contract, and on one that frees sooner than the estimate's it only waits less; which of
    them holds the task's growth is the policy's to judge, as for a task with no contract.
    Pinned to the one model estimated on, a task waited for that model while others it had
    asked for stood free (on the openb fleet, admitted tasks waited four times longer than
    under the default scheduler). ``site`` stays the estimate's (the queue the negotiator
    counts the task in). Where a term depends on the site (a warm-up bound, a deadline),
    ``sites`` is that site first, then every other site of ``fleet`` that keeps those terms,
    started when the estimate starts it (``sites_keeping``): placed at a site its data's
    trip to broke its warm-up, the task broke its contract, since the site was no term."""
    sla = task.sla
    models = models_keeping(task, e.pool.gpu_model, others, p95_ms=sla.p95_latency_ms,
                            cost_per_hour=sla.cost_ceiling_per_hour)
    sites = sites_keeping(task, e.pool.site, models, fleet, fingerprint, start=now + e.queue_s,
                          warmup_ms=sla.warmup_ms, deadline=sla.deadline)
    return Contract(tier=sla.tier, max_queue_s=sla.max_queue_s, warmup_ms=sla.warmup_ms,
                    p95_latency_ms=sla.p95_latency_ms, deadline=sla.deadline,
                    cost_ceiling_per_hour=sla.cost_ceiling_per_hour, gpu_models=models,
                    site=e.pool.site, not_before=now + e.queue_s if e.queue_s > 0 else None, notes=_notes(e),
                    sites=sites)


MAX_EXACT_INT = 2**53 - 1
"""The largest integer every JSON reader holds exactly (a JavaScript number, a double)."""
DEADLINE_READS_AS_MS = 1e11
"""A deadline at or past this (seconds since 1970: year 5138) is a time in milliseconds."""


def task_problem(task: TaskSubmitted) -> str | None:
    """What makes ``task`` impossible to negotiate as submitted, in one line; ``None`` when
    nothing does. The CLI asks the same before it publishes."""
    if (why := task_id_problem(task.task_id)) is not None:
        # The answer goes out on ``sla.offer.<task>`` and the client's on ``sla.reply.<task>``,
        # which the SLA stream takes one token deep: an offer to ``team.a`` is stored by nobody.
        # Quoted cut short: an id refused for its length would fill the rejection with itself.
        shown = task.task_id if len(task.task_id) <= 80 else task.task_id[:80] + "..."
        return (f"task_id {shown!r} {why}: it must be one subject token (no dots, spaces, * or >) "
                f"of at most {TASK_ID_MAX_BYTES} bytes")
    for name in ("gpus", "gpu_milli", "gpu_memory_mb", "cpu_milli", "memory_mb"):
        if abs(getattr(task, name)) > MAX_EXACT_INT:
            # JSON carries any integer, but a consumer in Go, Java or JavaScript reads at most 64
            # bits (53 exactly): past that, the admission and decision it is copied into are
            # events it cannot read at all.
            return f"{name} must be at most {MAX_EXACT_INT} (2**53 - 1)"
    if task.gpus < 0:
        return "gpus must be >= 0"
    if not 1 <= task.gpu_milli <= 1000:
        return "gpu_milli must be in 1..1000"
    if task.gpus != 1 and task.gpu_milli < 1000:
        return "only a single-GPU task may share a GPU (gpu_milli < 1000)"
    if task.gpu_memory_mb < 0 or task.size_gb < 0 or task.cpu_milli < 0 or task.memory_mb < 0:
        return "sizes must be >= 0"
    if not math.isfinite(task.size_gb):
        return "size_gb must be a finite number"
    if task.expected_duration_s is not None and not (math.isfinite(task.expected_duration_s)
                                                     and task.expected_duration_s > 0):
        return f"expected_duration_s must be a finite number above 0, got {task.expected_duration_s}"
    sla = task.sla
    for name in ("max_queue_s", "warmup_ms", "p95_latency_ms", "cost_ceiling_per_hour"):
        bound = getattr(sla, name)
        if bound is not None and not (math.isfinite(bound) and bound >= 0):
            return f"sla.{name} must be a finite number >= 0, got {bound}"
    if sla.deadline is not None and not math.isfinite(sla.deadline):
        return f"sla.deadline must be a finite time, got {sla.deadline}"
    if sla.deadline is not None and sla.deadline >= DEADLINE_READS_AS_MS:
        # A JavaScript client's Date.now() is in milliseconds: read as seconds, it is a deadline
        # some 50,000 years away, which every pool meets, so it was silently no deadline.
        return (f"sla.deadline {sla.deadline:.0f} reads as milliseconds since 1970; it is in seconds "
                f"(a deadline in year 5138 or later is taken for a mistake)")
    if task.kind == "infer" and P95_REFERENCE_LABEL in task.labels:
        # The estimate divides this label by the pool's compute: words would raise out of
        # ``negotiate`` and NaN would pass every latency bound.
        text = task.labels[P95_REFERENCE_LABEL]
        try:
            reference = float(text)
        except ValueError:
            reference = math.nan
        if not (math.isfinite(reference) and reference > 0):
            return f"label {P95_REFERENCE_LABEL} must be a finite number of ms above 0, got {text!r}"
    return None


def negotiate(task: TaskSubmitted, fleet: FleetView, *, now: float, fingerprint: Fingerprint | None = None,
              policy: NegotiationPolicy | None = None) -> Decision:
    """Decide on ``task`` against ``fleet`` at time ``now``; see the module docstring."""
    policy = policy or NegotiationPolicy()
    problem = task_problem(task)
    if problem is not None:
        return Reject("invalid", problem, task.task_id)
    sla = task.sla
    if task.gpus == 0:
        # The deadline is hard here too: no queue or warm-up is estimated, the run still counts.
        if sla.deadline is not None and now + (task.expected_duration_s or 0.0) > sla.deadline:
            return Reject("infeasible", "the deadline cannot be met: it has passed, or passes before the run "
                          "could end", task.task_id)
        return Admit(Contract(tier=sla.tier, max_queue_s=sla.max_queue_s, deadline=sla.deadline,
                              cost_ceiling_per_hour=sla.cost_ceiling_per_hour, notes="cpu-only task"))
    need_mb = max(task.gpu_memory_mb, fingerprint.predicted_peak_mb if fingerprint is not None else 0.0)
    pools = [p for p in fleet.pools if p.memory_mb_per_gpu >= need_mb]
    if not pools:
        # A fleet of CPU nodes only has no pool at all: "no GPU model has 0 MB" said nothing.
        why = f"no GPU model has {need_mb:.0f} MB per GPU" if fleet.pools else "the fleet has no GPUs"
        return Reject("infeasible", why, task.task_id)
    # A task's GPUs are all on one node, with its CPU and host memory: admitted where no node
    # has that many, or that much besides, it would be queued for ever, every pool's free
    # GPUs summed across nodes looking like room.
    if not any(p.holds(task.gpus) for p in pools):
        return Reject("infeasible", f"no node has {task.gpus} GPUs of {need_mb:.0f} MB or more", task.task_id)
    pools = [p for p in pools if p.holds(task.gpus, task.cpu_milli, task.memory_mb)]
    if not pools:
        return Reject("infeasible", f"no node with {task.gpus} GPUs of {need_mb:.0f} MB or more also has "
                      f"{task.cpu_milli} CPU milli and {task.memory_mb} MB of memory", task.task_id)
    # Every model that holds the ask may run it under a contract its terms allow (``asked``):
    # which holds the task's growth is the policy's to judge (it starts a known leak on a
    # smaller GPU and moves it up before the peak). Estimated on, only those that hold it.
    asked = [e for p in fleet.pools if p.memory_mb_per_gpu >= task.gpu_memory_mb
             and p.holds(task.gpus, task.cpu_milli, task.memory_mb)
             and (e := estimate(task, p, fleet, fingerprint, now, preempt=False))]
    estimates = [e for e in asked if e.pool.memory_mb_per_gpu >= need_mb]
    meeting = [e for e in estimates if not e.violations]
    if meeting:
        best = min(meeting, key=lambda e: (e.queue_s, e.cost_per_hour, e.warmup_ms))
        return Admit(admit_contract(task, best, now, asked, fleet=fleet, fingerprint=fingerprint))
    if sla.tier == "vip":
        preempting = [e for p in pools if (e := estimate(task, p, fleet, fingerprint, now, preempt=True))]
        preempting = [e for e in preempting if not e.violations]
        if preempting:
            best = min(preempting, key=lambda e: (e.cost_per_hour, e.warmup_ms))
            return Admit(admit_contract(task, best, now, fleet=fleet, fingerprint=fingerprint), may_preempt=True)
    if not estimates:
        # The deadline is named only when it is what ruled every pool out: a fleet that never
        # frees a GPU was reported as a deadline missed, however far the deadline was.
        undated = msgspec.structs.replace(task, sla=msgspec.structs.replace(sla, deadline=None))
        if not any(_queue_s(p, task, sla.tier) < math.inf for p in pools):
            why = "no pool will free enough GPUs for this task"
        elif sla.deadline is not None and any(estimate(undated, p, fleet, fingerprint, now, preempt=False)
                                              for p in pools):
            why = "the deadline cannot be met on any pool"
        else:
            why = ("no pool gives a finite warm-up or p95 estimate for this task "
                   "(its size or p95_ref_ms is too large)")
        return Reject("infeasible", why, task.task_id)
    chosen = _pick_options(estimates, policy.max_options)
    valid_until = now + policy.offer_ttl_s
    if sla.deadline is not None:
        # An option starts at its not_before or at its acceptance, whichever is later, so it
        # meets the (hard) deadline only if accepted by deadline - warm-up - duration: the
        # offer closes when the first option's slack runs out, not after the ttl regardless.
        duration = task.expected_duration_s or 0.0
        valid_until = min([valid_until, *(sla.deadline - e.warmup_ms / 1000.0 - duration for e in chosen)])
    options = [_option(e, task, now, f"o{i + 1}", asked, fleet=fleet, fingerprint=fingerprint, closes=valid_until)
               for i, e in enumerate(chosen)]
    acceptable_now = [e for e in estimates if "gpu_model" not in e.violations and "queue" not in e.violations]
    # The options travel as their own list: a reason listing them too was read twice.
    reason = _shortfall(task, acceptable_now)
    return CounterOffer(options=options, reason=reason, valid_until=valid_until)


def _severity(e: Estimate) -> tuple[int, float, float, float]:
    return (len(e.violations), e.queue_s, e.cost_per_hour, e.warmup_ms)


def _pick_options(estimates: list[Estimate], limit: int) -> list[Estimate]:
    """The best estimate of each kind of relaxation first (fewest relaxed terms), then the rest."""
    ranked = sorted(estimates, key=_severity)
    chosen: list[Estimate] = []
    kinds: set[tuple[Term, ...]] = set()
    for e in ranked:
        if e.violations not in kinds:
            kinds.add(e.violations)
            chosen.append(e)
    for e in ranked:
        if e not in chosen:
            chosen.append(e)
    return sorted(chosen[:limit], key=_severity)

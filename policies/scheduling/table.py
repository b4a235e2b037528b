"""Estimate: the cost table the fleet scheduler solves over.

For each deployment, candidate engine instances are count vectors over the fleet's node
groups (:func:`policies.deployment.node_groups`), each solved once with the deployment's
own model, workload and engine through :func:`policies.solve.solve` (the ``greedy`` policy
by default: a screen, like :func:`policies.advice.cost.min_cost`'s), so every figure comes from
the one cost model and the engine group rules (one all-to-all backend per group, equal GPUs
per node where the engine needs it; :func:`policies.estimate.engines.resolve_runtime`) reject what
the engine cannot run. Which vectors:

* every vector when there are at most ``full_enumeration`` of them;
* else every single-group vector (``1..n_t`` nodes of group ``t``), and mixed groups made of
  whole node groups taken in order of their per-GPU throughput (the fastest group, then the
  two fastest, ...), the last one being every node the deployment may use;
* none with more GPUs than the deployment's ``maxGpus`` (it could not be given one).

A deployment with ``memoryFraction`` f < 1 is estimated on GPUs with f of their memory and
gets f of their throughput (time-shared compute; an assumption, not a measurement).

:class:`EstimateCache` keeps the estimates between schedules (keyed by the deployment's
planning inputs and the nodes' make-up), so re-scheduling after a node loss or a new
deployment solves only what is new.

Units: tokens per second, microseconds, USD per hour. Pure: no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace

from policies.advice.cost import fleet_usd_per_hour
from policies.deployment import describe_nodes, node_groups, sub_fleet, try_solve
from policies.errors import InfeasibleError, InputError
from policies.hardware.fleet import Fleet, Gpu
from policies.scheduling.types import Candidate, Demand, NodeGroup, ScheduleRequest
from policies.spec.build import DeploymentSpec, SolverPolicy, price_table, resolve_model, to_request


@dataclass
class EstimateCache:
    """Candidate estimates kept between schedules: key -> :class:`Candidate` (mutable; the
    caller owns it)."""

    entries: dict[tuple[object, ...], Candidate] = field(default_factory=dict)
    solves: int = 0


@dataclass(frozen=True)
class TableSettings:
    """How the cost table is built.

    Attributes:
        estimate_policy: policy of the estimate solves (``greedy``: fast; ``ilp``: exact).
        full_enumeration: enumerate every count vector up to this many per deployment.
        max_instances: engine instances (replica groups) a deployment may be split into.
        engine_exact: solve every estimate as the chosen instance is solved. Off, each
            estimate is a screen (``SolverOptions.screen``): SGLang's ``static`` replica
            choice as its expectation (each rank's nearest replica, else an even spread)
            instead of replayed draw by draw
            (:func:`policies.estimate.replica_choice.sglang_static_map`, whose cost grows with the
            square of the instance's GPUs), and no locality search after the placement.
    """

    estimate_policy: str = "greedy"
    full_enumeration: int = 24
    max_instances: int = 1
    engine_exact: bool = False


def demand_of(spec: DeploymentSpec, eligible: Collection[str], max_instances: int = 1) -> Demand:
    """The scheduler's view of a deployment spec."""
    return Demand(
        name=spec.name,
        eligible=frozenset(eligible),
        namespace=spec.namespace,
        priority=spec.priority,
        min_gpus=spec.min_gpus,
        max_gpus=spec.max_gpus,
        objective=spec.objective,
        slo_step_time_us=spec.slo_step_time_ms * 1000.0,
        memory_fraction=spec.memory_fraction,
        max_instances=max_instances,
    )


def fleet_groups(fleet: Fleet, spec: DeploymentSpec | None = None) -> tuple[NodeGroup, ...]:
    """The fleet's node groups, priced at ``spec``'s prices (the defaults without one)."""
    prices = price_table(spec) if spec is not None else price_table(DeploymentSpec("x"))
    out: list[NodeGroup] = []
    for names in node_groups(fleet):
        node = fleet.node(names[0])
        try:
            usd = fleet_usd_per_hour(sub_fleet(fleet, names[:1]), prices)
        except InputError:
            usd = 0.0
        out.append(
            NodeGroup(describe_nodes(fleet, names[:1])[3:].strip("()"), names, len(node.gpus), usd)
        )
    return tuple(out)


def count_vectors(
    groups: Sequence[NodeGroup],
    eligible: Collection[str],
    settings: TableSettings,
    per_gpu_order: Sequence[int] | None = None,
    max_gpus: int = 0,
) -> list[tuple[int, ...]]:
    """The candidate count vectors of a deployment (see the module docstring), smallest
    first; ``per_gpu_order`` is the group order of the mixed vectors (fastest first). None
    has more than ``max_gpus`` GPUs (0: no limit): the scheduler could not give it one."""
    vecs = _vectors(groups, eligible, settings, per_gpu_order)
    if max_gpus:
        vecs = [
            v
            for v in vecs
            if sum(k * g.gpus_per_node for k, g in zip(v, groups, strict=True)) <= max_gpus
        ]
    return vecs


def _vectors(
    groups: Sequence[NodeGroup],
    eligible: Collection[str],
    settings: TableSettings,
    per_gpu_order: Sequence[int] | None,
) -> list[tuple[int, ...]]:
    caps = [sum(1 for n in g.nodes if n in eligible) for g in groups]
    total = 1
    for c in caps:
        total *= c + 1
    if total <= settings.full_enumeration + 1:
        vecs = [v for v in itertools.product(*(range(c + 1) for c in caps)) if any(v)]
    else:
        vecs = []
        for t, c in enumerate(caps):
            for k in range(1, c + 1):
                vecs.append(tuple(k if i == t else 0 for i in range(len(caps))))
        order = [t for t in (per_gpu_order or range(len(caps))) if caps[t]]
        for j in range(2, len(order) + 1):
            keep = set(order[:j])
            vecs.append(tuple(caps[i] if i in keep else 0 for i in range(len(caps))))
    return sorted(set(vecs), key=lambda v: (sum(v), v))


def build_table(
    fleet: Fleet,
    specs: Sequence[tuple[DeploymentSpec, Collection[str]]],
    *,
    settings: TableSettings = TableSettings(),
    cache: EstimateCache | None = None,
    previous: Mapping[str, frozenset[str]] | None = None,
    quotas_gpus: Mapping[str, int] | None = None,
    move_weight: float = 0.25,
    pool: Executor | None = None,
) -> ScheduleRequest:
    """The schedule request of ``specs`` (each with the nodes it may use) on ``fleet``.

    ``pool``: an executor (the caller's; e.g. a process pool) that runs the estimate solves
    not in ``cache``; the answer is the same with or without it (each candidate is solved
    alone, deterministically), only the wall-clock time differs. Without it they run here,
    one after another.

    Raises:
        InputError: an invalid spec (the field is named).
    """
    cache = cache if cache is not None else EstimateCache()
    groups = fleet_groups(fleet)
    demands: list[tuple[DeploymentSpec, Demand]] = []
    for spec, eligible in specs:
        resolve_model(spec)
        d = demand_of(spec, set(eligible) & {n.name for n in fleet.nodes}, settings.max_instances)
        demands.append((spec, d))
    # Single groups first, every deployment at once: their per-GPU throughput orders the
    # mixed vectors (only single-group vectors: a mixed one in another order is not wanted).
    one_group = replace(settings, full_enumeration=0)
    jobs = [
        (s, d, v)
        for s, d in demands
        for v in count_vectors(groups, d.eligible, one_group, max_gpus=d.max_gpus)
        if sum(1 for k in v if k) == 1
    ]
    done = _estimate_all(fleet, groups, jobs, settings, cache, pool)
    vectors: dict[str, list[tuple[int, ...]]] = {}
    for _, d in demands:
        per_gpu: dict[int, float] = {}
        for (name, v), c in done.items():
            if name == d.name:
                t = next(i for i, k in enumerate(v) if k)
                per_gpu[t] = max(per_gpu.get(t, 0.0), c.tokens_per_s / max(1, c.gpus))
        order = sorted(per_gpu, key=lambda t: -per_gpu[t])
        vectors[d.name] = count_vectors(groups, d.eligible, settings, order, d.max_gpus)
    jobs = [(s, d, v) for s, d in demands for v in vectors[d.name] if (d.name, v) not in done]
    done.update(_estimate_all(fleet, groups, jobs, settings, cache, pool))
    return ScheduleRequest(
        groups=groups,
        demands=tuple(d for _, d in demands),
        candidates={d.name: tuple(done[d.name, v] for v in vectors[d.name]) for _, d in demands},
        previous=dict(previous or {}),
        quotas_gpus=dict(quotas_gpus or {}),
        move_weight=move_weight,
    )


Job = tuple[DeploymentSpec, Demand, tuple[int, ...]]


def _estimate_all(
    fleet: Fleet,
    groups: Sequence[NodeGroup],
    jobs: Sequence[Job],
    settings: TableSettings,
    cache: EstimateCache,
    pool: Executor | None,
) -> dict[tuple[str, tuple[int, ...]], Candidate]:
    """Every job's candidate, ``(deployment, counts) -> Candidate``: from the cache, else
    solved once per distinct make-up (on ``pool`` when given)."""
    keyed: list[tuple[str, tuple[int, ...], tuple[object, ...], int, float]] = []
    todo: dict[tuple[object, ...], tuple[Fleet, DeploymentSpec, tuple[int, ...], int, float]] = {}
    for spec, d, counts in jobs:
        names = [
            n
            for g, k in zip(groups, counts, strict=True)
            for n in [x for x in g.nodes if x in d.eligible][:k]
        ]
        part = sub_fleet(fleet, names, name=f"{fleet.name}-{spec.name}")
        key: tuple[object, ...] = (
            _spec_key(spec),
            settings.estimate_policy,
            settings.engine_exact,
            tuple(
                sorted((repr(n.gpus[0].spec) if n.gpus else "", len(n.gpus)) for n in part.nodes)
            ),
        )
        try:
            usd = fleet_usd_per_hour(part, price_table(spec))
        except InputError:
            usd = 0.0
        keyed.append((d.name, counts, key, len(part.gpus), usd))
        if key not in cache.entries and key not in todo:
            todo[key] = (part, spec, counts, len(part.gpus), usd)
    parts = [t[0] for t in todo.values()]
    specs = [t[1] for t in todo.values()]
    policies = [settings.estimate_policy] * len(todo)
    exact = [settings.engine_exact] * len(todo)
    mapper = pool.map if pool is not None and len(todo) > 1 else map
    answers = list(mapper(_solve_one, parts, specs, policies, exact))
    for (key, (_, _, counts, gpus, usd)), (tps, step_us, why) in zip(
        todo.items(), answers, strict=True
    ):
        cache.solves += 1
        cache.entries[key] = Candidate(counts, gpus, tps, step_us, usd, why)
    return {
        (name, counts): replace(cache.entries[key], counts=counts)
        for name, counts, key, _, _ in keyed
    }


def _solve_one(
    part: Fleet, spec: DeploymentSpec, policy: str, engine_exact: bool = False
) -> tuple[float, float, str]:
    """One candidate's estimate: ``(tokens/s, step time us, "")`` or ``(0, 0, why not)``
    (a module-level function, so a process pool can run it); a screen unless
    ``engine_exact`` (:class:`TableSettings`)."""
    f = spec.memory_fraction
    if f < 1.0:
        part = _memory_share(part, f)
    est = replace(spec, policy=policy)
    try:
        req = to_request(est, SolverPolicy(workers=1), part)
        out = try_solve(replace(req, options=replace(req.options, screen=not engine_exact)))
    except (InputError, InfeasibleError) as exc:
        return 0.0, 0.0, str(exc) or type(exc).__name__
    if out.result is None or not out.ok:
        return 0.0, 0.0, out.reason or "no plan"
    summary = out.result.plan.summary
    return summary.tokens_per_s * f, summary.step_time_us, ""


def _spec_key(spec: DeploymentSpec) -> tuple[object, ...]:
    """What of a spec changes its estimates (not its name, priority or bounds)."""
    return (
        spec.model,
        repr(spec.model_config),
        spec.workload,
        spec.form,
        spec.redundant_experts,
        spec.allow_cross_vendor,
        spec.engine,
        spec.memory_fraction,
        tuple(sorted(spec.gpu_hour_prices.items())),
    )


def _memory_share(fleet: Fleet, fraction: float) -> Fleet:
    """The fleet with ``fraction`` of every GPU's memory."""
    nodes = tuple(
        replace(
            n,
            gpus=tuple(
                Gpu(
                    g.id,
                    g.node,
                    g.index,
                    replace(g.spec, memory_gib=g.spec.memory_gib * fraction),
                    g.uuid,
                )
                for g in n.gpus
            ),
        )
        for n in fleet.nodes
    )
    return Fleet(fleet.name, nodes, fleet.fabric_links)

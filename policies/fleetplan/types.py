"""The fleet planner's request and reply.

A :class:`PlanRequest` names the fleet, each deployment's demand and SLOs
(:class:`FleetDeployment`) and optionally the previous plan (changes against it are
penalised). A :class:`FleetPlan` says, per deployment, which instances serve it
(:class:`DeploymentPlan` of :class:`PlannedPool`: aggregated instances, or prefill and
decode instances with the KV path between them, each a :class:`Variant` x count on named
nodes), what they are predicted to give (TTFT, TPOT, goodput, cost), and which deployments
are short of what (:class:`Shortfall`). A pool maps one to one onto a
:class:`policies.serving.plan.Pool`, so a plan runs through the serving simulator as it is
(:func:`policies.fleetplan.report.serving_plan`), and onto the engine instances a controller would
start.

Units: requests per second, tokens per second, milliseconds (``_ms``), microseconds
(``_us``), GB/s (1e9 bytes per second), USD per hour. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from policies.defaults import INSTANCE_ROLES
from policies.fleetplan.curves import CurveGrid
from policies.fleetplan.sizing import UTILISATION, Sizing
from policies.hardware.fleet import Fleet
from policies.serving.curves import StepCurve
from policies.serving.plan import DEFAULT_CHUNK_TOKENS
from policies.serving.traffic import Slo, Traffic
from policies.spec.build import DeploymentSpec
from policies.spec.types import DISAGGREGATION as SPEC_DISAGGREGATION

ROLES = INSTANCE_ROLES
"""What an instance does: both phases with chunked prefill, or one of them
(:data:`policies.defaults.INSTANCE_ROLES`)."""

DISAGGREGATION = SPEC_DISAGGREGATION
"""Whether a deployment may (``auto``), may not (``off``) or must (``on``) split prefill and
decode onto different instances (the spec's values)."""


@dataclass(frozen=True)
class FleetDeployment:
    """One deployment as the planner sees it: its spec (which carries the demand, SLOs,
    priority, disaggregation and budget: :class:`policies.spec.build.DeploymentSpec`) and the
    nodes it may use.

    Attributes:
        spec: the deployment; ``spec.traffic`` and ``spec.slo`` must be set.
        eligible: node names it may use besides its node selector (None = every node).
    """

    spec: DeploymentSpec
    eligible: frozenset[str] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def traffic(self) -> Traffic:
        """Its demand (:func:`policies.fleetplan.planner.check_request` ensures one)."""
        assert self.spec.traffic is not None
        return self.spec.traffic

    @property
    def slo(self) -> Slo:
        """Its latency targets (a request without ``slo`` is refused)."""
        assert self.spec.slo is not None
        return self.spec.slo

    @property
    def priority(self) -> int:
        return self.spec.priority

    @property
    def disaggregation(self) -> str:
        return self.spec.disaggregation

    def batch_cap(self, gpus: int) -> int | None:
        """The most sequences an aggregated or decode instance of ``gpus`` GPUs may run: a
        stated ``tokensPerGpu`` of the decode phase (one token per sequence and step) x
        ``gpus``, the deployment's explicit override; None when the SLO alone sizes it."""
        w = self.spec.workload
        if not w.tokens_per_gpu_set or w.phase != "decode":
            return None
        return max(1, int(w.tokens_per_gpu * gpus))

    @property
    def budget_usd_per_hour(self) -> float:
        return self.spec.budget.usd_per_hour

    @property
    def budget_gpus(self) -> int:
        return self.spec.budget.gpus


@dataclass(frozen=True)
class PlannerSettings:
    """How the planner enumerates and solves.

    Attributes:
        grid: where curves are sampled (:class:`~policies.fleetplan.curves.CurveGrid`).
        instance_nodes: the ladder of node counts of one-group instances, smallest first.
        sizes_per_group: sizes of the ladder kept per group: the smallest that hold the
            model (the ladder is climbed until this many do, or it ends).
        mixed_max_groups: two-group instances (one node of each of two groups, when one node
            of either cannot hold the model alone) are candidates when the fleet has at most
            this many node groups (0 = never).
        utilisation: share of an instance's capacity that is planned (of its rate at its
            batch limit, or with ``queueing`` of what its slots hold within the TTFT
            target).
        queueing: size aggregated and decode capacity by the wait for a slot (Erlang C,
            :mod:`policies.fleetplan.queueing`): few slots queue sooner than many at the
            same utilisation. False: ``utilisation`` of the rate at the batch limit alone.
        chunk_tokens: chunked-prefill budget of an aggregated step, tokens.
        pairs_per_decode: prefill variants kept per decode variant (cheapest per request).
        decode_variants: decode variants kept per deployment (cheapest per request).
        move_weight: cost of changing one instance against the previous plan, in units of
            its price (USD per hour).
        max_solver_nodes: branch-and-bound nodes of each integer program (the work limit:
            the same inputs give the same plan on an idle and a busy machine).
        mip_gap: relative gap at which a served-demand solve stops.
        cost_gap: relative gap at which the cost solve stops (0.02: a plan proven within 2%
            of the cheapest).
    """

    grid: CurveGrid = field(default_factory=CurveGrid)
    instance_nodes: tuple[int, ...] = (1, 2, 4, 8)
    sizes_per_group: int = 2
    mixed_max_groups: int = 4
    utilisation: float = UTILISATION
    queueing: bool = True
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    pairs_per_decode: int = 3
    decode_variants: int = 3
    move_weight: float = 0.1
    max_solver_nodes: int = 500
    mip_gap: float = 1e-6
    cost_gap: float = 0.02


@dataclass(frozen=True)
class Variant:
    """One kind of engine instance of one deployment.

    Attributes:
        key: ``<make-up>/<role>`` (unique per deployment, stable across runs).
        deployment: the deployment it serves.
        role: ``aggregated`` | ``prefill`` | ``decode``.
        counts: nodes per node group (the request's group order).
        make_up: its nodes in words (``2x (8x H200-SXM-141GB)``).
        gpus: GPUs of one instance.
        attention_tp: largest attention tensor-parallel size (1 = data-parallel attention).
        expert_parallel: expert-parallel size (its GPUs).
        curve_key: the cache key of its curve.
        curve: its step curve.
        sizing: batch limit, capacity and latencies (a prefill variant's is for its best
            decode partner; the pair's own is in :class:`PlannedPool`).
        usd_per_hour: price of one instance, USD per hour.
        nic_gbytes_per_s: RDMA bandwidth of one instance's NICs in all, GB/s per direction.
    """

    key: str
    deployment: str
    role: str
    counts: tuple[int, ...]
    make_up: str
    gpus: int
    attention_tp: int
    expert_parallel: int
    curve_key: str
    curve: StepCurve
    sizing: Sizing
    usd_per_hour: float
    nic_gbytes_per_s: float = 0.0

    @property
    def nodes(self) -> int:
        """Nodes of one instance."""
        return sum(self.counts)


@dataclass(frozen=True)
class PlannedGroup:
    """``count`` instances of one variant.

    Attributes:
        variant: what each instance is.
        count: instances.
        nodes: per instance its node names.
        batch_limit: most sequences one instance runs (prefill: its prompt-token budget per
            forward), tokens or sequences.
    """

    variant: Variant
    count: int
    nodes: tuple[tuple[str, ...], ...]
    batch_limit: int

    @property
    def usd_per_hour(self) -> float:
        return self.count * self.variant.usd_per_hour

    @property
    def gpus(self) -> int:
        return self.count * self.variant.gpus


@dataclass(frozen=True)
class PlannedPool:
    """One pool of a deployment: aggregated instances, or prefill and decode instances.

    Attributes:
        name: pool name (unique in the deployment).
        requests_per_s: traffic the router sends it, requests per second.
        instances: the aggregated instances (None for a disaggregated pool).
        prefill: prefill instances of a disaggregated pool.
        decode: decode instances of a disaggregated pool.
        kv_gbytes_per_s: bandwidth one KV transfer gets from prefill to decode, GB/s.
        kv_latency_us: fixed cost of one transfer, us.
        kv_path: the path in words (``RDMA ib0, 4x 400 Gb/s per node``).
        ttft_ms: predicted TTFT at the SLO's percentile at its load, ms.
        tpot_ms: predicted TPOT at its load, ms.
        capacity_requests_per_s: what its instances serve within the SLO, requests/s.
    """

    name: str
    requests_per_s: float
    instances: PlannedGroup | None = None
    prefill: PlannedGroup | None = None
    decode: PlannedGroup | None = None
    kv_gbytes_per_s: float = 0.0
    kv_latency_us: float = 0.0
    kv_path: str = ""
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    capacity_requests_per_s: float = 0.0

    def groups(self) -> tuple[PlannedGroup, ...]:
        """Its instance groups (one aggregated, or prefill then decode)."""
        return tuple(g for g in (self.instances, self.prefill, self.decode) if g is not None)

    @property
    def usd_per_hour(self) -> float:
        return sum(g.usd_per_hour for g in self.groups())

    @property
    def gpus(self) -> int:
        return sum(g.gpus for g in self.groups())


@dataclass(frozen=True)
class DeploymentPlan:
    """What serves one deployment.

    Attributes:
        deployment: its name.
        priority: its priority.
        traffic: its demand.
        slo: its targets.
        pools: the pools that serve it (empty when nothing does).
        served_requests_per_s: requests per second it is predicted to serve within the SLO
            (its goodput; at most the demand).
    """

    deployment: str
    priority: int
    traffic: Traffic
    slo: Slo
    pools: tuple[PlannedPool, ...]
    served_requests_per_s: float

    @property
    def demand_requests_per_s(self) -> float:
        return self.traffic.requests_per_s

    @property
    def goodput_output_tokens_per_s(self) -> float:
        """Output tokens per second of the requests served within the SLO."""
        return self.served_requests_per_s * self.traffic.output_len.mean

    @property
    def usd_per_hour(self) -> float:
        return sum(p.usd_per_hour for p in self.pools)

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pools)

    @property
    def usd_per_million_tokens(self) -> float:
        """Price of a million output tokens served within the SLO, USD (inf when none)."""
        tps = self.goodput_output_tokens_per_s
        return self.usd_per_hour / (tps * 3600.0) * 1e6 if tps > 0 else float("inf")

    @property
    def ttft_ms(self) -> float:
        """Worst predicted TTFT of its pools, ms."""
        return max((p.ttft_ms for p in self.pools if p.requests_per_s > 0), default=0.0)

    @property
    def tpot_ms(self) -> float:
        """Worst predicted TPOT of its pools, ms."""
        return max((p.tpot_ms for p in self.pools if p.requests_per_s > 0), default=0.0)


@dataclass(frozen=True)
class Shortfall:
    """A deployment the plan serves only in part.

    Attributes:
        deployment: its name.
        resource: what is missing: ``gpus`` (the fleet, or nodes held by higher
            priorities), ``budget`` (its own), ``slo`` (no variant meets it) or ``nodes``
            (none eligible).
        missing_requests_per_s: demand not served within the SLO, requests per second.
        missing_output_tokens_per_s: the same in output tokens per second.
        fix: what would serve it, in words (``3 more nodes of 8x H200-SXM-141GB``).
        message: the reason in words, with what to do.
    """

    deployment: str
    resource: str
    missing_requests_per_s: float
    missing_output_tokens_per_s: float
    fix: str
    message: str


@dataclass(frozen=True)
class PlanRequest:
    """One fleet planning problem.

    Attributes:
        fleet: the usable nodes (healthy GPUs only).
        deployments: the deployments, any order (names unique).
        previous: the plan running now (changes against it are penalised), or None.
        settings: how the planner enumerates and solves.
    """

    fleet: Fleet
    deployments: tuple[FleetDeployment, ...]
    previous: FleetPlan | None = None
    settings: PlannerSettings = field(default_factory=PlannerSettings)


@dataclass(frozen=True)
class FleetPlan:
    """The planner's answer.

    Attributes:
        deployments: per deployment (by name) what serves it.
        shortfalls: deployments served only in part, by name.
        free_nodes: nodes no instance uses.
        solver: ``HiGHS optimal`` | ``HiGHS work_limit`` per the last solve.
        variants: candidate variants per deployment (for ``explain``).
        curves_computed: curves computed in this run (not found in the cache).
        curves_cached: curves read from the cache.
        solve_s: wall-clock time of the integer programs, s (reported, never a limit).
    """

    deployments: Mapping[str, DeploymentPlan]
    shortfalls: Mapping[str, Shortfall]
    free_nodes: tuple[str, ...]
    solver: str
    variants: Mapping[str, tuple[Variant, ...]] = field(default_factory=dict)
    curves_computed: int = 0
    curves_cached: int = 0
    solve_s: float = 0.0

    @property
    def usd_per_hour(self) -> float:
        return sum(d.usd_per_hour for d in self.deployments.values())

    @property
    def goodput_output_tokens_per_s(self) -> float:
        return sum(d.goodput_output_tokens_per_s for d in self.deployments.values())

"""A deployment to size: fleet, model and placement settings, everything but the batch.

The strategy modules (:mod:`policies.advice.advise`, :mod:`policies.advice.tiers`, :mod:`policies.advice.cost`)
ask the same question many times with one thing changed - the batch, the context, the
nodes, the policy - and always through :func:`policies.solve.solve`, so every answer
comes from the one cost model. :class:`Deployment` holds what stays fixed and builds each
:class:`~policies.request.PlacementRequest`; :func:`try_solve` turns "does not fit" into a
reason instead of an exception; :func:`sub_fleet` and :func:`engine_redundancy` adapt the
request to a subset of the nodes.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.errors import InputError
from policies.estimate.costmodel import CostSettings
from policies.estimate.engines import EngineSpec
from policies.estimate.workload import KV_DTYPES, PHASES, Workload, make_workload
from policies.hardware.fleet import Fleet, Node
from policies.model.architecture import ModelSpec
from policies.plan import FORMS
from policies.request import (
    POLICIES,
    PlacementRequest,
    PlacementResult,
    SolverOptions,
)
from policies.solve import solve


def engine_redundancy(num_experts: int, num_gpus: int, at_least: int = 0) -> int:
    """Smallest count of redundant expert slots ``R >= at_least`` that engine form accepts
    on ``num_gpus`` GPUs: ``num_experts + R`` divisible by the GPU count and at most
    ``num_experts`` slots per GPU. 0 for dense models.

    Raises:
        InputError: no such count (only when ``at_least`` asks for more than
            ``num_experts`` slots per GPU).
    """
    if num_experts <= 0:
        return 0
    if num_gpus <= 0:
        raise InputError("a deployment needs at least one GPU", field="fleet")
    total = max(num_experts + at_least, num_experts)
    total = -(-total // num_gpus) * num_gpus
    if total // num_gpus > num_experts:
        raise InputError(
            f"{at_least} redundant experts on {num_gpus} GPUs give more than {num_experts} "
            "slots per GPU. To fix: ask for fewer redundant experts",
            field="redundant_experts",
        )
    return total - num_experts


def sub_fleet(fleet: Fleet, nodes: Iterable[str], name: str | None = None) -> Fleet:
    """The fleet restricted to ``nodes`` (fleet order kept), with the fabric links whose
    two fabrics the kept nodes still use.

    Raises:
        InputError: an unknown node name, or no node at all.
    """
    keep = set(nodes)
    unknown = keep - {n.name for n in fleet.nodes}
    if unknown:
        raise InputError(f"unknown nodes {sorted(unknown)}", field="nodes")
    kept = tuple(n for n in fleet.nodes if n.name in keep)
    if not kept:
        raise InputError("a sub-fleet needs at least one node", field="nodes")
    fabrics = {f for n in kept for f in n.fabrics}
    links = tuple(x for x in fleet.fabric_links if x.a in fabrics and x.b in fabrics)
    return Fleet(name or fleet.name, kept, links)


@dataclass(frozen=True)
class Deployment:
    """Everything about a placement except the batch size.

    Attributes:
        fleet: the GPUs.
        model: the model.
        phase: ``decode`` (step time = time per output token, TPOT) or ``prefill`` (step
            time = time to first token of the batch, TTFT).
        context_len: KV length per sequence, tokens.
        kv_cache_dtype: ``bf16`` or ``fp8``.
        load: ``[moe_layer][expert]`` load weights, or None for uniform load.
        load_source: where the load came from (for plan reports).
        policy: ``uniform`` | ``eplb`` | ``greedy`` | ``ilp``.
        form: ``engine`` or ``native``.
        redundant_experts: the fewest redundant expert slots wanted; in engine form raised
            to the next count the GPU count divides (:func:`engine_redundancy`), so the same
            deployment works on any subset of nodes.
        options: MILP solver options (used by ``ilp``).
        settings: cost-model settings.
        allow_cross_vendor: let one deployment's expert-parallel all-to-all span GPU
            vendors (passed on to the request once it has that field; see
            :mod:`policies.hardware.vendors`).
        engine: the engine that will run the plans (:mod:`policies.estimate.engines`).
    """

    fleet: Fleet
    model: ModelSpec
    phase: str = "decode"
    context_len: int = 4096
    kv_cache_dtype: str = "bf16"
    load: tuple[tuple[float, ...], ...] | None = None
    load_source: str = "uniform"
    policy: str = "greedy"
    form: str = "engine"
    redundant_experts: int = 0
    options: SolverOptions = field(default_factory=SolverOptions)
    settings: CostSettings = field(default_factory=CostSettings)
    allow_cross_vendor: bool = False
    engine: EngineSpec = field(default_factory=EngineSpec)

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise InputError(f"must be one of {PHASES}, got {self.phase!r}", field="phase")
        if self.policy not in POLICIES:
            raise InputError(f"must be one of {POLICIES}, got {self.policy!r}", field="policy")
        if self.form not in FORMS:
            raise InputError(f"must be one of {FORMS}, got {self.form!r}", field="form")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise InputError(
                f"must be one of {KV_DTYPES}, got {self.kv_cache_dtype!r}", field="kv_cache_dtype"
            )
        if self.redundant_experts < 0:
            raise InputError("must be >= 0", field="redundant_experts")

    def workload(self, tokens_per_gpu: int, context_len: int | None = None) -> Workload:
        """The workload at a batch of ``tokens_per_gpu`` tokens per GPU per step.

        Raises:
            InputError: non-positive sizes or a load of the wrong shape.
        """
        return make_workload(
            self.model,
            phase=self.phase,
            tokens_per_gpu=tokens_per_gpu,
            context_len=self.context_len if context_len is None else context_len,
            load=self.load,
            kv_cache_dtype=self.kv_cache_dtype,
            load_source=self.load_source,
        )

    def redundancy_for(self, num_gpus: int) -> int:
        """Redundant slots used on ``num_gpus`` GPUs (engine form: made divisible)."""
        if not self.model.is_moe:
            return 0
        if self.form == "native":
            return self.redundant_experts
        return engine_redundancy(self.model.num_experts, num_gpus, self.redundant_experts)

    def request(
        self,
        tokens_per_gpu: int,
        *,
        context_len: int | None = None,
        fleet: Fleet | None = None,
        policy: str | None = None,
    ) -> PlacementRequest:
        """The placement request for one batch size (optionally another context, subset of
        the fleet or policy)."""
        f = self.fleet if fleet is None else fleet
        req = PlacementRequest(
            fleet=f,
            model=self.model,
            workload=self.workload(tokens_per_gpu, context_len),
            policy=self.policy if policy is None else policy,
            form=self.form,
            redundant_experts=self.redundancy_for(len(f.gpus)),
            options=self.options,
            settings=self.settings,
            engine=self.engine,
        )
        if (
            self.allow_cross_vendor
            and "allow_cross_vendor" in PlacementRequest.__dataclass_fields__
        ):
            extra: dict[str, Any] = {"allow_cross_vendor": True}
            req = replace(req, **extra)
        return req


@dataclass(frozen=True)
class Outcome:
    """A solve that may not have produced a usable plan.

    Attributes:
        result: the solve's result, or None when the solver proved nothing fits.
        reason: why the plan cannot be used (first memory or coverage problem); empty when
            it can.
    """

    result: PlacementResult | None
    reason: str = ""

    @property
    def ok(self) -> bool:
        """A plan exists and violates nothing."""
        return self.result is not None and not self.reason


def try_solve(req: PlacementRequest) -> Outcome:
    """Solve, turning infeasibility into a reason (bad input still raises).

    Raises:
        InputError: the request itself is invalid.
    """
    result = solve(req)
    if not result.placed:
        return Outcome(None, result.infeasible[0])
    if result.infeasible:
        return Outcome(result, result.infeasible[0])
    return Outcome(result)


def node_groups(fleet: Fleet) -> list[tuple[str, ...]]:
    """Nodes grouped by make-up (GPU models and counts, NVLink bandwidth, NICs and fabrics):
    nodes of a group are interchangeable for placement. Groups in fleet order of their first
    node, node names in fleet order."""
    groups: dict[tuple[object, ...], list[str]] = {}
    for n in fleet.nodes:
        groups.setdefault(node_make_up(n), []).append(n.name)
    return [tuple(v) for v in groups.values()]


def node_make_up(node: Node) -> tuple[object, ...]:
    """What makes two nodes interchangeable: GPU specs, NVLink bandwidth, NICs and fabrics
    (the name and the NVLink domain's name do not count)."""
    return (
        tuple(sorted(repr(g.spec) for g in node.gpus)),
        node.nvlink.per_gpu_bidir_gbytes_per_s if node.nvlink else None,
        tuple(
            sorted(
                (x.count, x.per_direction_gbits_per_s, x.fabric, x.link_layer) for x in node.nics
            )
        ),
    )


def describe_nodes(fleet: Fleet, names: Sequence[str]) -> str:
    """``2x (8x H100-SXM5-80GB) + 1x (8x H200-SXM-141GB)`` for a set of node names."""
    if not names:
        return "none"
    counts: dict[str, int] = {}
    wanted = set(names)
    for n in fleet.nodes:
        if n.name not in wanted:
            continue
        models: dict[str, int] = {}
        for g in n.gpus:
            models[g.spec.model] = models.get(g.spec.model, 0) + 1
        label = " + ".join(f"{c}x {m}" for m, c in models.items())
        counts[label] = counts.get(label, 0) + 1
    return " + ".join(f"{c}x ({label})" for label, c in counts.items())

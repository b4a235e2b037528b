"""Deployment-strategy questions asked of a running controller (PlanService.AdviseTiers,
AdviseBatch, AdviseContext, EstimateCost, MinCost).

The planners are the ones ``mixfleetctl advise ...`` / ``plan cost|min-cost`` call
(:mod:`policies.advice.tiers`, :mod:`policies.advice.advise`, :mod:`policies.advice.cost`); what differs is
where the inputs come from. Here:

* the fleet is the controller's live view - registered nodes that are alive, not draining,
  with healthy GPUs, matching ``spec.node_selector`` - built exactly as
  :meth:`controlplane.server.controller.Controller.dry_run` builds it (:meth:`StrategyService.fleet`);
* the model, workload, policy, form, slot budget and whether expert-parallel traffic may
  span GPU vendors come from a :class:`~policies.spec.build.DeploymentSpec`
  (:func:`deployment_for`), with the measured load of a deployment of the same name when
  engines reported one (as Solve);
* prices are the built-in assumed list prices, replaced by the spec's ``gpu_hour_prices``
  (:func:`policies.spec.build.price_table`), replaced by the request's overrides
  (:class:`PriceOverrides`).

A question (``*Question``, already validated by :mod:`controlplane.wire.strategies`) goes in,
an answer (``*Answer``: the planner's result plus the fleet it ran on) comes out. Every
planner call runs in a worker thread (``asyncio.to_thread``) so the event loop keeps
serving heartbeats and other calls while it solves. Infeasibility is part of the answer;
only bad input (:class:`~policies.errors.InputError`) and a missing fleet or plan
(:class:`~controlplane.errors.PreconditionError`, :class:`~controlplane.errors.NotFoundError`)
raise.

Units: ms for latency targets, tokens/s, requests/s, price per GPU-hour in ``currency``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from controlplane.errors import PreconditionError
from controlplane.server import reconcile as rc
from controlplane.server.controller import Controller
from controlplane.server.controller.nodes import reachable_or_precondition
from policies.advice.advise import BatchAdvice, ContextAdvice, advise_batch, advise_context
from policies.advice.cost import (
    MinCostResult,
    PlanCost,
    PriceTable,
    min_cost,
    plan_cost,
    price_table_from_dict,
)
from policies.advice.tier_planner import plan_tiers
from policies.advice.tiers import BatchTier, InteractiveTier, TierPlan, TierRequest
from policies.assignment import aggregate_load
from policies.deployment import Deployment
from policies.errors import InfeasibleError, InputError
from policies.hardware.catalog import AmbiguousGpuNameError, lookup
from policies.hardware.fleet import Fleet
from policies.plan import Plan
from policies.request import SolverOptions
from policies.spec.build import DeploymentSpec, price_table, resolve_model, workload_for

#: Measured load windows younger than this feed the advice (as in Solve), s.
MEASURED_LOAD_WINDOW_S = 3600.0


# ------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class PriceOverrides:
    """Prices a request sets on top of the built-in assumed list prices.

    Attributes:
        per_gpu_hour: GPU model (catalog name, alias, or the model name of a GPU in the
            fleet) -> price of one GPU-hour in ``currency``.
        currency: unit label of every price and cost.
        field: request field the overrides came from (for error messages).
    """

    per_gpu_hour: Mapping[str, float] = field(default_factory=dict)
    currency: str = "USD"
    field: str = "prices"

    def table(self, gpu_models: Iterable[str], *, base: PriceTable | None = None) -> PriceTable:
        """The price table for GPUs of ``gpu_models`` (the fleet's or a plan's): ``base``
        (default: the built-in assumed prices), the overrides on top, every one of those
        models priced.

        Raises:
            InputError: a price that is not a finite number >= 0, a GPU model that is
                neither in the catalog nor among ``gpu_models``, or one of ``gpu_models``
                without a price (a custom GPU) - naming ``prices["MODEL"]``.
        """
        known = set(gpu_models)
        for name, value in self.per_gpu_hour.items():
            path = f'{self.field}["{name}"]'
            if isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise InputError(f"must be a finite price >= 0, got {value!r}", field=path)
            if name in known:
                continue
            try:
                lookup(name, field_path=path)
            except AmbiguousGpuNameError:
                raise
            except InputError as exc:
                raise InputError(
                    f"unknown GPU model {name!r}: not in the catalog and no GPU here has that "
                    f"model ({', '.join(sorted(known)) or 'none'}). To fix: use a catalog name "
                    "or alias (H100-SXM5-80GB, NVIDIA H200, MI300X, ...) or a model the nodes report",
                    field=path,
                ) from exc
        doc = {"currency": self.currency, "prices": dict(self.per_gpu_hour)}
        source = base.source if base is not None else "defaults (assumed list prices)"
        if self.per_gpu_hour:
            source += f", {len(self.per_gpu_hour)} price(s) from the request"
        table = price_table_from_dict(
            doc, source=source, base=base.usd_per_gpu_hour if base is not None else None
        )
        for model in sorted(known):
            if model not in table.usd_per_gpu_hour:
                raise InputError(
                    f"no price for GPU model {model!r}. To fix: add "
                    f'{self.field}["{model}"] (price per GPU-hour in {self.currency})',
                    field=self.field,
                )
        return table


def deployment_for(
    spec: DeploymentSpec,
    fleet: Fleet,
    *,
    measured: Sequence[Sequence[float]] | None = None,
) -> Deployment:
    """The planning core's :class:`~policies.deployment.Deployment` of a spec on a fleet:
    the same model, workload and slot budget :func:`policies.spec.build.build_request`
    gives a Solve of that spec.

    Args:
        spec: a validated spec.
        fleet: the GPUs.
        measured: aggregated measured load ``[moe_layers][experts]`` (or None).

    Raises:
        InputError: an invalid spec (naming ``spec.*``).
    """
    model = resolve_model(spec)
    workload = workload_for(spec, model, measured=measured)
    load = workload.expert_load if workload.load_source != "uniform" else None
    return Deployment(
        fleet=fleet,
        model=model,
        phase=workload.phase,
        context_len=workload.context_len,
        kv_cache_dtype=workload.kv_cache_dtype,
        load=load,
        load_source=workload.load_source,
        policy=spec.policy,
        form=spec.form,
        redundant_experts=spec.redundant_experts or 0,
        options=SolverOptions(time_limit_s=spec.solver_time_limit_s),
        allow_cross_vendor=spec.allow_cross_vendor,
        engine=spec.engine,
    )


# --------------------------------------------------------------------------- questions


@dataclass(frozen=True)
class TiersQuestion:
    """AdviseTiers: split the fleet between an interactive and a batch tier.

    Attributes:
        spec: model, batch-tier workload (phase, tokens per GPU, context), final policy,
            node selector, prices, whether the batch tier's all-to-all may span vendors.
        interactive: the latency tier's SLO and traffic.
        preference: ``fastest`` or ``max-batch``.
        batch_min_tokens_per_s: the batch tier's throughput target (reported only); None.
        additions: catalog GPUs to size when the SLO is unmet; None = every
            FlashAttention-class GPU.
        prices: price overrides (additions are ranked cheapest first).
    """

    spec: DeploymentSpec
    interactive: InteractiveTier
    preference: str = "fastest"
    batch_min_tokens_per_s: float | None = None
    additions: tuple[str, ...] | None = None
    prices: PriceOverrides = field(default_factory=PriceOverrides)


@dataclass(frozen=True)
class BatchQuestion:
    """AdviseBatch: the largest batch per GPU meeting memory and a step-time target.

    Attributes:
        spec: the deployment (its phase says whether the target is TPOT or TTFT).
        target_ms: step-time target, ms; None = largest batch that fits memory.
        max_tokens_per_gpu: largest batch tried; None = the planner's default.
    """

    spec: DeploymentSpec
    target_ms: float | None = None
    max_tokens_per_gpu: int | None = None


@dataclass(frozen=True)
class ContextQuestion:
    """AdviseContext: the longest context each policy's plan holds at a batch.

    Attributes:
        spec: the deployment; ``workload.tokens_per_gpu`` is the batch.
        contexts: contexts to solve, tokens.
        policies: placement policies to compare.
        granularity: bisection step between contexts, tokens.
    """

    spec: DeploymentSpec
    contexts: tuple[int, ...]
    policies: tuple[str, ...]
    granularity: int = 1024


@dataclass(frozen=True)
class CostQuestion:
    """EstimateCost: price a deployment's committed plan or a dry-run solve of a spec.

    Attributes:
        deployment: name of the deployment whose committed plan to price ("" with spec).
        spec: the spec to solve and price (None with deployment).
        prices: price overrides.
    """

    deployment: str = ""
    spec: DeploymentSpec | None = None
    prices: PriceOverrides = field(default_factory=PriceOverrides)


@dataclass(frozen=True)
class MinCostQuestion:
    """MinCost: the cheapest subset of whole nodes reaching a throughput.

    Attributes:
        spec: the deployment; ``workload.tokens_per_gpu`` is the batch throughput is judged
            at, ``policy`` solves the finalists, ``allow_cross_vendor`` lets a group span
            vendors.
        target_tokens_per_s: throughput to reach, tokens/s.
        layout: ``best``, ``group`` or ``replicas``.
        finalists: stop screening after this many subsets meet the target.
        prices: price overrides.
    """

    spec: DeploymentSpec
    target_tokens_per_s: float
    layout: str = "best"
    finalists: int = 3
    prices: PriceOverrides = field(default_factory=PriceOverrides)


# ----------------------------------------------------------------------------- answers


@dataclass(frozen=True)
class TiersAnswer:
    """The tier split (``plan``) on ``fleet``, additions priced in ``currency``."""

    fleet: Fleet
    plan: TierPlan
    currency: str


@dataclass(frozen=True)
class BatchAnswer:
    """The batch-size advice on ``fleet``."""

    fleet: Fleet
    advice: BatchAdvice


@dataclass(frozen=True)
class ContextAnswer:
    """The long-context report on ``fleet``; ``infeasible`` says why when no policy holds
    even the shortest context."""

    fleet: Fleet
    advice: ContextAdvice
    infeasible: tuple[str, ...] = ()


@dataclass(frozen=True)
class CostAnswer:
    """What a plan costs (a dry run's plan may come with ``infeasible`` reasons, as in Solve).

    Attributes:
        plan: the plan priced; None when a dry run proved that nothing fits.
        version: its version when it is a deployment's committed plan; 0 for a dry run.
        deployment: the deployment ("" for a dry run).
        cost: the plan's cost; None without a plan.
        prices_used: price per GPU-hour of each GPU model of the plan.
        currency: unit of the prices.
        infeasible: why a dry run has no valid plan (a plan that violates memory is still
            priced, at 0 tokens/s).
    """

    plan: Plan | None
    version: int
    deployment: str
    cost: PlanCost | None
    prices_used: Mapping[str, float]
    currency: str
    infeasible: tuple[str, ...] = ()


@dataclass(frozen=True)
class MinCostAnswer:
    """The cheapest subset (``result``), or why there is none (``infeasible``)."""

    fleet: Fleet
    target_tokens_per_s: float
    currency: str
    result: MinCostResult | None
    infeasible: tuple[str, ...] = ()


def _infeasible_lines(exc: InfeasibleError) -> tuple[str, ...]:
    """An infeasibility as reply lines: the headline, then each reason."""
    return (str(exc).split("\n")[0], *exc.reasons)


# ----------------------------------------------------------------------------- service


class StrategyService:
    """Answers strategy questions on a controller's live fleet (see the module docstring).

    Args:
        controller: the controller whose nodes, deployments and load windows are used.
    """

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    def fleet(self, spec: DeploymentSpec) -> Fleet:
        """The usable fleet for ``spec``: healthy GPUs of live, non-draining nodes matching
        its node selector, in node-name order (as the controller plans deployments).

        Raises:
            PreconditionError: no usable node matches.
        """
        obs = self.c.observe()
        nodes, _ = rc.usable_gpus(spec, obs.nodes, obs.now_s, self.c.settings.reconcile_settings())
        fleet = self.c.fleet_for(spec.name, nodes)
        if not fleet.gpus:
            raise PreconditionError(
                "no usable node matches the node selector. To fix: start agents on matching "
                "nodes, wait for them to register, or change spec.node_selector",
                field="spec.node_selector",
            )
        reachable_or_precondition(fleet)
        return fleet

    def measured_load(self, spec: DeploymentSpec) -> list[list[float]] | None:
        """Aggregated load windows of a deployment named ``spec.name`` (last hour), or None."""
        since = self.c.clock() - MEASURED_LOAD_WINDOW_S
        windows = self.c.store.load_windows(spec.name, since_s=since)
        if not windows:
            return None
        return aggregate_load([w.counts for w in windows], resolve_model(spec))

    def deployment(self, spec: DeploymentSpec) -> Deployment:
        """The spec on the live fleet (:meth:`fleet`, :func:`deployment_for`).

        Raises:
            PreconditionError: no usable node. InputError: invalid spec.
        """
        fleet = self.fleet(spec)
        return deployment_for(spec, fleet, measured=self.measured_load(spec))

    async def tiers(self, q: TiersQuestion) -> TiersAnswer:
        """Split the live fleet between the tiers (:func:`policies.advice.tier_planner.plan_tiers`).

        Raises:
            InputError, PreconditionError: see :meth:`deployment`, bad tiers.
        """
        dep = self.deployment(q.spec)
        prices = q.prices.table((g.spec.model for g in dep.fleet.gpus), base=price_table(q.spec))
        w = q.spec.workload
        req = TierRequest(
            deployment=dep,
            interactive=q.interactive,
            batch=BatchTier(
                phase=w.phase,
                tokens_per_gpu=w.tokens_per_gpu,
                context_len=w.context_len,
                min_tokens_per_s=q.batch_min_tokens_per_s,
            ),
            preference=q.preference,
            allow_cross_vendor=q.spec.allow_cross_vendor,
            additions=q.additions,
            prices=prices,
        )
        plan = await asyncio.to_thread(plan_tiers, req)
        return TiersAnswer(dep.fleet, plan, prices.currency)

    async def batch(self, q: BatchQuestion) -> BatchAnswer:
        """Batch-size search on the live fleet (:func:`policies.advice.advise.advise_batch`).

        Raises:
            InputError, PreconditionError: see :meth:`deployment`.
        """
        dep = self.deployment(q.spec)
        advice = await asyncio.to_thread(
            advise_batch, dep, q.target_ms, max_tokens_per_gpu=q.max_tokens_per_gpu
        )
        return BatchAnswer(dep.fleet, advice)

    async def context(self, q: ContextQuestion) -> ContextAnswer:
        """Long-context report on the live fleet (:func:`policies.advice.advise.advise_context`).

        Raises:
            InputError, PreconditionError: see :meth:`deployment`.
        """
        dep = self.deployment(q.spec)
        tokens = q.spec.workload.tokens_per_gpu

        def run() -> ContextAdvice:
            return advise_context(
                dep,
                tokens,
                contexts=q.contexts,
                policies=q.policies,
                granularity=q.granularity,
            )

        advice = await asyncio.to_thread(run)
        infeasible: tuple[str, ...] = ()
        if all(rep.longest_context is None for rep in advice.policies):
            infeasible = (
                f"no policy holds even {min(q.contexts):,} tokens of context at {tokens} "
                "tokens per GPU. To fix: lower spec.workload.tokens_per_gpu, use "
                "spec.workload.kv_cache_dtype fp8, try shorter contexts, or add GPUs with "
                "more memory",
            )
        return ContextAnswer(dep.fleet, advice, infeasible)

    async def cost(self, q: CostQuestion) -> CostAnswer:
        """Price a deployment's committed plan, or a dry-run solve of ``q.spec``.

        Raises:
            NotFoundError: unknown deployment. PreconditionError: nothing committed yet, or
            no usable node for the spec. InputError: bad spec or prices.
        """
        if q.spec is None:
            stored = self.c.routing_plan(q.deployment)
            assert stored.plan is not None  # the committed plan is stored with its document
            plan, version, name = stored.plan, stored.version, q.deployment
            spec = self.c.get_deployment(q.deployment).spec
            prices = q.prices.table((g.model for g in plan.gpus), base=price_table(spec))
            infeasible: tuple[str, ...] = ()
        else:
            fleet = self.fleet(q.spec)
            models = (g.spec.model for g in fleet.gpus)
            prices = q.prices.table(models, base=price_table(q.spec))  # before solving
            try:
                result = await self.c.dry_run(q.spec, fleet)
            except InfeasibleError as exc:
                return CostAnswer(None, 0, "", None, {}, prices.currency, _infeasible_lines(exc))
            plan, version, name = result.plan, 0, ""
            infeasible = tuple(result.infeasible)
        used = {g.model: prices.price(g.model) for g in plan.gpus}
        cost = plan_cost(plan, prices)
        return CostAnswer(plan, version, name, cost, used, prices.currency, infeasible)

    async def min_cost(self, q: MinCostQuestion) -> MinCostAnswer:
        """The cheapest subset of the live fleet (:func:`policies.advice.cost.min_cost`).

        Raises:
            InputError, PreconditionError: see :meth:`deployment`, bad options or prices.
        """
        dep = self.deployment(q.spec)
        prices = q.prices.table((g.spec.model for g in dep.fleet.gpus), base=price_table(q.spec))

        def run() -> MinCostResult:
            return min_cost(
                dep,
                q.target_tokens_per_s,
                prices,
                tokens_per_gpu=q.spec.workload.tokens_per_gpu,
                final_policy=q.spec.policy,
                layout=q.layout,
                finalists=q.finalists,
                allow_cross_vendor=q.spec.allow_cross_vendor,
            )

        try:
            result = await asyncio.to_thread(run)
        except InfeasibleError as exc:
            return MinCostAnswer(
                dep.fleet, q.target_tokens_per_s, prices.currency, None, _infeasible_lines(exc)
            )
        return MinCostAnswer(dep.fleet, q.target_tokens_per_s, prices.currency, result)

"""``mixfleet.v1`` messages of the deployment-strategy RPCs <-> the questions and answers of
:mod:`controlplane.server.strategies`.

``*_question`` functions read a request and validate every field, raising
:class:`~policies.errors.InputError` with the proto field path (``interactive.tpot_ms``,
``prices["XYZ"]``, ``contexts[2]``) and how to fix it; zero values mean the documented
defaults. ``*_to_proto`` functions copy an answer into the reply; they add no logic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from mixfleet.v1 import plan_pb2

from apis.wire.deployment import spec_from_proto
from controlplane.server.strategies import (
    BatchAnswer,
    BatchQuestion,
    ContextAnswer,
    ContextQuestion,
    CostAnswer,
    CostQuestion,
    MinCostAnswer,
    MinCostQuestion,
    PriceOverrides,
    TiersAnswer,
    TiersQuestion,
)
from controlplane.wire.plans import unstored_plan_to_proto
from policies.advice.advise import DEFAULT_CONTEXTS, BatchPoint, ContextPoint, ModelShare
from policies.advice.cost import LAYOUTS, CostCandidate
from policies.advice.tiers import PREFERENCES, InteractiveTier, UnitCapacity
from policies.errors import InputError
from policies.hardware.catalog import lookup
from policies.hardware.fleet import Fleet
from policies.request import POLICIES
from policies.spec.build import DeploymentSpec

#: Name given to a request's spec when it has none (names only pick up measured load).
DEFAULT_SPEC_NAME = "advice"
#: Policies of AdviseContext when the request names none (as ``mixfleetctl advise context``).
DEFAULT_CONTEXT_POLICIES = ("uniform", "greedy", "ilp")
_INTERACTIVE_DEFAULTS = InteractiveTier()

# ============================================================================ requests


def strategy_spec(msg: plan_pb2.DeploymentSpec, *, present: bool) -> DeploymentSpec:
    """The request's deployment spec, validated; an empty name becomes ``advice``.

    Args:
        msg: the ``spec`` field.
        present: whether the request set it.

    Raises:
        InputError: a missing spec, or a bad field (``spec.workload.phase`` ...).
    """
    if not present:
        raise InputError(
            "missing. To fix: give at least spec.model (a preset) or spec.model_config_json",
            field="spec",
        )
    if not msg.name:
        named = plan_pb2.DeploymentSpec()
        named.CopyFrom(msg)
        named.name = DEFAULT_SPEC_NAME
        msg = named
    return spec_from_proto(msg)


def _positive(value: float, path: str, unit: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"must be a finite number of {unit} > 0, got {value!r}", field=path)
    return value


def _count(value: int, path: str, default: int, *, what: str = "tokens") -> int:
    """A count where 0 means ``default``."""
    if value < 0:
        raise InputError(f"must be >= 1 {what} (0 = {default}), got {value}", field=path)
    return value or default


def price_overrides(prices: Mapping[str, float], currency: str) -> PriceOverrides:
    """The request's ``prices`` / ``currency`` (checked against the fleet later).

    Raises:
        InputError: a price that is not a finite number >= 0, naming ``prices["MODEL"]``.
    """
    for name, value in prices.items():
        if not math.isfinite(value) or value < 0:
            raise InputError(
                f"must be a finite price per GPU-hour >= 0, got {value!r}",
                field=f'prices["{name}"]',
            )
    return PriceOverrides(dict(prices), currency.strip() or "USD")


def tiers_question(msg: plan_pb2.AdviseTiersRequest) -> TiersQuestion:
    """Read an AdviseTiers request.

    Raises:
        InputError: naming the field (``interactive.tpot_ms``, ``preference`` ...).
    """
    spec = strategy_spec(msg.spec, present=msg.HasField("spec"))
    if not msg.HasField("interactive"):
        raise InputError(
            "missing. To fix: give interactive.tpot_ms and/or interactive.ttft_ms and "
            "interactive.requests_per_s",
            field="interactive",
        )
    it = msg.interactive
    tpot = _positive(it.tpot_ms, "interactive.tpot_ms", "ms") if it.HasField("tpot_ms") else None
    ttft = _positive(it.ttft_ms, "interactive.ttft_ms", "ms") if it.HasField("ttft_ms") else None
    if tpot is None and ttft is None:
        raise InputError(
            "an interactive tier needs a latency target. To fix: set interactive.tpot_ms "
            "and/or interactive.ttft_ms",
            field="interactive",
        )
    if not math.isfinite(it.requests_per_s) or it.requests_per_s < 0:
        raise InputError(
            f"must be a finite rate >= 0 requests/s, got {it.requests_per_s!r}",
            field="interactive.requests_per_s",
        )
    util = it.max_utilisation or _INTERACTIVE_DEFAULTS.max_utilisation
    if not 0 < util <= 1:
        raise InputError(
            f"must be in (0, 1] (0 = {_INTERACTIVE_DEFAULTS.max_utilisation}), got {util!r}",
            field="interactive.max_utilisation",
        )
    interactive = InteractiveTier(
        tpot_ms=tpot,
        ttft_ms=ttft,
        requests_per_s=it.requests_per_s,
        prompt_tokens=_count(
            it.prompt_tokens, "interactive.prompt_tokens", _INTERACTIVE_DEFAULTS.prompt_tokens
        ),
        output_tokens=_count(
            it.output_tokens, "interactive.output_tokens", _INTERACTIVE_DEFAULTS.output_tokens
        ),
        max_utilisation=util,
    )
    interactive.check()
    preference = msg.preference or PREFERENCES[0]
    if preference not in PREFERENCES:
        raise InputError(
            f"must be one of {', '.join(PREFERENCES)}, got {preference!r}", field="preference"
        )
    target = None
    if msg.HasField("batch_min_tokens_per_s"):
        target = msg.batch_min_tokens_per_s
        if not math.isfinite(target) or target < 0:
            raise InputError(
                f"must be a finite throughput >= 0 tokens/s, got {target!r}",
                field="batch_min_tokens_per_s",
            )
    additions = None
    if msg.additions:
        additions = tuple(
            lookup(name, field_path=f"additions[{i}]").model for i, name in enumerate(msg.additions)
        )
    return TiersQuestion(
        spec=spec,
        interactive=interactive,
        preference=preference,
        batch_min_tokens_per_s=target,
        additions=additions,
        prices=price_overrides(msg.prices, msg.currency),
    )


def batch_question(msg: plan_pb2.AdviseBatchRequest) -> BatchQuestion:
    """Read an AdviseBatch request; the target must belong to the spec's phase.

    Raises:
        InputError: naming the field (``tpot_ms``, ``max_tokens_per_gpu`` ...).
    """
    spec = strategy_spec(msg.spec, present=msg.HasField("spec"))
    phase = spec.workload.phase
    if msg.HasField("tpot_ms") and msg.HasField("ttft_ms"):
        raise InputError(
            "give one target: tpot_ms for spec.workload.phase decode, ttft_ms for prefill",
            field="ttft_ms",
        )
    target: float | None = None
    if msg.HasField("tpot_ms"):
        target = _positive(msg.tpot_ms, "tpot_ms", "ms")
        if phase != "decode":
            raise InputError(
                "TPOT is a decode target. To fix: set spec.workload.phase to decode, or give "
                "ttft_ms for prefill",
                field="tpot_ms",
            )
    if msg.HasField("ttft_ms"):
        target = _positive(msg.ttft_ms, "ttft_ms", "ms")
        if phase != "prefill":
            raise InputError(
                "TTFT is a prefill target. To fix: set spec.workload.phase to prefill, or "
                "give tpot_ms for decode",
                field="ttft_ms",
            )
    if msg.max_tokens_per_gpu < 0:
        raise InputError(
            f"must be >= 1 token per GPU (0 = the default cap), got {msg.max_tokens_per_gpu}",
            field="max_tokens_per_gpu",
        )
    return BatchQuestion(spec, target, msg.max_tokens_per_gpu or None)


def context_question(msg: plan_pb2.AdviseContextRequest) -> ContextQuestion:
    """Read an AdviseContext request.

    Raises:
        InputError: naming the field (``contexts[1]``, ``policies[0]`` ...).
    """
    spec = strategy_spec(msg.spec, present=msg.HasField("spec"))
    for i, ctx in enumerate(msg.contexts):
        if ctx <= 0:
            raise InputError(
                f"must be a positive number of tokens, got {ctx}. To fix: e.g. 32768, 65536",
                field=f"contexts[{i}]",
            )
    for i, policy in enumerate(msg.policies):
        if policy not in POLICIES:
            raise InputError(
                f"must be one of {', '.join(POLICIES)}, got {policy!r}", field=f"policies[{i}]"
            )
    if msg.granularity < 0:
        raise InputError(
            f"must be >= 1 token (0 = 1024), got {msg.granularity}", field="granularity"
        )
    return ContextQuestion(
        spec,
        tuple(msg.contexts) or DEFAULT_CONTEXTS,
        tuple(dict.fromkeys(msg.policies)) or DEFAULT_CONTEXT_POLICIES,
        msg.granularity or 1024,
    )


def cost_question(msg: plan_pb2.EstimateCostRequest) -> CostQuestion:
    """Read an EstimateCost request (a deployment name or a spec).

    Raises:
        InputError: neither given, a bad spec or a bad price.
    """
    prices = price_overrides(msg.prices, msg.currency)
    which = msg.WhichOneof("plan")
    if which == "deployment":
        if not msg.deployment:
            raise InputError("empty. To fix: name a deployment, or give spec", field="deployment")
        return CostQuestion(deployment=msg.deployment, prices=prices)
    if which == "spec":
        return CostQuestion(spec=strategy_spec(msg.spec, present=True), prices=prices)
    raise InputError(
        "missing. To fix: give deployment (price its committed plan) or spec (price a dry run)",
        field="plan",
    )


def min_cost_question(msg: plan_pb2.MinCostRequest) -> MinCostQuestion:
    """Read a MinCost request.

    Raises:
        InputError: naming the field (``target_tokens_per_s``, ``layout`` ...).
    """
    spec = strategy_spec(msg.spec, present=msg.HasField("spec"))
    target = _positive(msg.target_tokens_per_s, "target_tokens_per_s", "tokens/s")
    layout = msg.layout or LAYOUTS[0]
    if layout not in LAYOUTS:
        raise InputError(f"must be one of {', '.join(LAYOUTS)}, got {layout!r}", field="layout")
    return MinCostQuestion(
        spec=spec,
        target_tokens_per_s=target,
        layout=layout,
        finalists=_count(msg.finalists, "finalists", 3, what="subset"),
        prices=price_overrides(msg.prices, msg.currency),
    )


# ============================================================================= replies


def _nodes(fleet: Fleet) -> list[str]:
    return [n.name for n in fleet.nodes]


def batch_point_to_proto(p: BatchPoint) -> plan_pb2.BatchPoint:
    msg = plan_pb2.BatchPoint(
        tokens_per_gpu=p.tokens_per_gpu,
        tokens_per_s=p.tokens_per_s,
        max_gpu_tokens=p.max_gpu_tokens,
        fits_memory=p.fits_memory,
        meets_target=p.meets_target,
        reason=p.reason,
        plan_id=p.plan_id,
    )
    if p.step_time_us is not None:
        msg.step_time_us = p.step_time_us
    return msg


def _unit_to_proto(u: UnitCapacity) -> plan_pb2.TierUnit:
    msg = plan_pb2.TierUnit(
        nodes=list(u.nodes),
        description=u.description,
        gpu_model=u.gpu_model,
        gpus=u.gpus,
        requests_per_s=u.requests_per_s,
        reason=u.reason,
    )
    if u.decode is not None:
        msg.decode.CopyFrom(batch_point_to_proto(u.decode))
    if u.prefill is not None:
        msg.prefill.CopyFrom(batch_point_to_proto(u.prefill))
    return msg


def tiers_to_proto(a: TiersAnswer) -> plan_pb2.AdviseTiersResponse:
    tp = a.plan
    i, b = tp.interactive, tp.batch
    interactive = plan_pb2.InteractiveTierReport(
        nodes=list(i.nodes),
        replicas=[
            plan_pb2.TierReplica(
                nodes=list(r.nodes),
                gpu_model=r.gpu_model,
                plan=unstored_plan_to_proto(r.result.plan, with_doc=False),
                tpot_ms=r.tpot_ms,
                ttft_ms=r.ttft_ms,
                decode_tokens_per_gpu=r.decode_tokens_per_gpu,
                prefill_tokens_per_gpu=r.prefill_tokens_per_gpu,
                requests_per_s=r.requests_per_s,
            )
            for r in i.replicas
        ],
        capacity_requests_per_s=i.capacity_requests_per_s,
        demand_requests_per_s=i.demand_requests_per_s,
        slo_met=i.slo_met,
        additions=[
            plan_pb2.TierAddition(
                gpu_model=x.gpu_model,
                nodes=x.nodes,
                gpus_per_node=x.gpus_per_node,
                gpus=x.gpus,
                requests_per_s_per_node=x.requests_per_s_per_node,
                cost_per_hour=x.usd_per_hour,
            )
            for x in i.additions
        ],
        reasons=list(i.reasons),
    )
    if math.isfinite(i.utilisation):
        interactive.utilisation = i.utilisation
    if i.tpot_ms is not None:
        interactive.tpot_ms = i.tpot_ms
    if i.ttft_ms is not None:
        interactive.ttft_ms = i.ttft_ms
    batch = plan_pb2.BatchTierReport(
        nodes=list(b.nodes),
        plans=[unstored_plan_to_proto(r.plan, with_doc=False) for r in b.results],
        tokens_per_s=b.tokens_per_s,
        reason=b.reason,
    )
    if b.step_time_ms is not None:
        batch.step_time_ms = b.step_time_ms
    if b.meets_target is not None:
        batch.meets_target = b.meets_target
    return plan_pb2.AdviseTiersResponse(
        fleet_nodes=_nodes(a.fleet),
        preference=tp.preference,
        assignments_screened=tp.assignments_screened,
        unit_types=[_unit_to_proto(u) for u in tp.unit_types],
        interactive=interactive,
        batch=batch,
        notes=list(tp.notes),
        currency=a.currency,
    )


def batch_to_proto(a: BatchAnswer) -> plan_pb2.AdviseBatchResponse:
    adv = a.advice
    msg = plan_pb2.AdviseBatchResponse(
        fleet_nodes=_nodes(a.fleet),
        phase=adv.phase,
        policy=adv.policy,
        target=adv.target_name,
        start_tokens_per_gpu=adv.start_tokens_per_gpu,
        start_gpu=adv.start_gpu,
        limit=adv.limit,
        points=[batch_point_to_proto(p) for p in adv.points],
        infeasible=list(adv.infeasible),
    )
    if adv.target_ms is not None:
        msg.target_ms = adv.target_ms
    if adv.largest_tokens_per_gpu is not None:
        msg.largest_tokens_per_gpu = adv.largest_tokens_per_gpu
    if adv.best is not None:
        msg.best.CopyFrom(batch_point_to_proto(adv.best))
    return msg


def _share_to_proto(s: ModelShare) -> plan_pb2.GpuModelShare:
    msg = plan_pb2.GpuModelShare(
        gpu_model=s.gpu_model,
        gpus=s.gpus,
        attention_share_each=s.attention_share_each,
        kv_gib_each=s.kv_gib_each,
        free_gib_each=s.free_gib_each,
    )
    if s.max_context is not None:
        msg.max_context = s.max_context
    return msg


def _context_point_to_proto(p: ContextPoint) -> plan_pb2.ContextPoint:
    msg = plan_pb2.ContextPoint(
        context_len=p.context_len,
        fits=p.ok,
        reason=p.reason,
        tokens_per_s=p.tokens_per_s,
        shares=[_share_to_proto(s) for s in p.shares],
        binding_gpu=p.binding_gpu,
    )
    if p.step_time_us is not None:
        msg.step_time_us = p.step_time_us
    if p.max_context_at_shares is not None:
        msg.max_context_at_shares = p.max_context_at_shares
    return msg


def context_to_proto(a: ContextAnswer) -> plan_pb2.AdviseContextResponse:
    policies = []
    for rep in a.advice.policies:
        msg = plan_pb2.PolicyContext(
            policy=rep.policy,
            binding_gpu=rep.binding_gpu,
            points=[_context_point_to_proto(p) for p in rep.points],
        )
        if rep.longest_context is not None:
            msg.longest_context = rep.longest_context
        policies.append(msg)
    return plan_pb2.AdviseContextResponse(
        fleet_nodes=_nodes(a.fleet),
        tokens_per_gpu=a.advice.tokens_per_gpu,
        contexts=list(a.advice.contexts),
        policies=policies,
        infeasible=list(a.infeasible),
    )


def cost_to_proto(a: CostAnswer) -> plan_pb2.EstimateCostResponse:
    msg = plan_pb2.EstimateCostResponse(currency=a.currency, infeasible=list(a.infeasible))
    if a.plan is not None:
        msg.plan.CopyFrom(unstored_plan_to_proto(a.plan, with_doc=False))
        msg.plan.deployment = a.deployment
        msg.plan.version = a.version
    if a.cost is not None:
        msg.cost_per_hour = a.cost.usd_per_hour
        msg.tokens_per_s = a.cost.tokens_per_s
        msg.cost_per_million_tokens = a.cost.usd_per_million_tokens
        msg.gpus_by_model.update(a.cost.gpus_by_model)
    msg.prices_used.update(a.prices_used)
    return msg


def _candidate_to_proto(c: CostCandidate) -> plan_pb2.CostCandidate:
    msg = plan_pb2.CostCandidate(
        nodes=list(c.nodes),
        gpus=c.gpus,
        cost_per_hour=c.usd_per_hour,
        layout=c.layout,
        screened_tokens_per_s=c.screened_tokens_per_s,
        reason=c.reason,
    )
    if c.final_tokens_per_s is not None:
        msg.final_tokens_per_s = c.final_tokens_per_s
    return msg


def min_cost_to_proto(a: MinCostAnswer, *, with_docs: bool) -> plan_pb2.MinCostResponse:
    msg = plan_pb2.MinCostResponse(
        fleet_nodes=_nodes(a.fleet),
        target_tokens_per_s=a.target_tokens_per_s,
        currency=a.currency,
        infeasible=list(a.infeasible),
    )
    r = a.result
    if r is None:
        return msg
    msg.chosen.CopyFrom(_candidate_to_proto(r.best))
    msg.description = r.description
    msg.plans.extend(unstored_plan_to_proto(x.plan, with_doc=with_docs) for x in r.results)
    msg.tokens_per_s = r.cost.tokens_per_s
    msg.cost_per_hour = r.cost.usd_per_hour
    msg.cost_per_million_tokens = r.cost.usd_per_million_tokens
    msg.screened.extend(_candidate_to_proto(c) for c in r.screened)
    msg.finalists.extend(_candidate_to_proto(c) for c in r.finalists)
    msg.notes.extend(r.notes)
    return msg

"""Tier planner: split a fleet's nodes between an interactive tier with a latency SLO and a
batch tier that maximises throughput with the rest.

Owns :func:`plan_tiers` and its rules; the request and report types it reads and returns
live in :mod:`policies.advice.tiers`.

Rules (what a tier may use):

* **Interactive replicas stay inside one NVLink domain.** A replica is one *unit*: the
  nodes of one NVLink (or Infinity Fabric) domain - one node behind an NVSwitch, several
  nodes of a multi-node NVLink domain (NVL72) - or one PCIe-only node. Its attention is
  data-parallel over the unit's GPUs and its expert all-to-all never leaves the unit, so no
  interactive token crosses the RDMA network. Units are independent copies of the model;
  the tier is a set of units. A unit is eligible when its GPUs have FlashAttention-class
  kernels (Ampere, Ada, Hopper, Blackwell, CDNA3; not Volta), the model fits it and one
  replica meets the latency target at some batch.
* **Batch is one expert-parallel deployment over every node left** (older GPUs
  included), split per vendor for MoE models unless cross-vendor all-to-all is allowed
  (:mod:`policies.hardware.vendors`).

What a replica serves (all predicted by :func:`policies.solve.solve`):

* decode: the largest batch per GPU whose step time meets the TPOT target
  (:func:`policies.advice.advise.advise_batch`), giving ``D`` output tokens/s; the decode context
  is ``prompt_tokens + output_tokens`` (the longest a sequence gets);
* prefill: the largest prompt batch whose step time meets the TTFT target, giving ``P``
  prompt tokens/s (without a TTFT target: the largest that fits, at most 8192 tokens per
  GPU, so prompts still cost their compute);
* prefill and decode steps share the GPUs, so at ``lambda`` requests/s a replica is busy
  ``lambda * (output_tokens / D + prompt_tokens / P)`` of the time; it may be busy at most
  ``max_utilisation`` (queueing headroom), hence its capacity
  ``c = max_utilisation / (output_tokens / D + prompt_tokens / P)`` requests/s. TPOT as
  modelled leaves out the stall a prefill step causes to running decodes (chunked prefill
  keeps it small); ``max_utilisation`` is the margin for it.

Assignment. Units of identical make-up form a type with capacity ``c_t`` and ``n_t`` units;
an assignment takes ``k_t`` units of each type (``0 <= k_t <= n_t``) and meets the demand
when ``sum_t k_t c_t >= lambda``. Two preferences:

* ``fastest`` (default): the interactive tier takes units fastest first - most requests/s
  per GPU at the SLO, which in practice is the newest generation - and stops as soon as the
  demand is met; the batch tier gets the rest.
* ``max-batch``: every minimal assignment (no unit can be dropped) is enumerated; the
  batch tier of each is screened with a fast policy (``greedy``), the best ``finalists``
  are solved with the deployment's policy and the one with the highest batch throughput
  wins (ties go to newer interactive GPUs).

When even every eligible unit cannot carry the demand the SLO is reported unmet, the
interactive tier keeps every eligible unit, and :attr:`InteractiveReport.additions` says
how many more nodes of each catalog GPU would close the gap: for each candidate model a
hypothetical node (``addition_node_gpus`` GPUs, NVLink when the model has it) is sized the
same way and the shortfall divided by its capacity.

Units: ms for targets, requests/s, tokens/s, USD per hour. Pure: no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

from policies.advice.advise import advise_batch
from policies.advice.tiers import (
    PREFERENCES,
    Addition,
    BatchReport,
    BatchTier,
    InteractiveReport,
    InteractiveTier,
    Replica,
    TierPlan,
    TierRequest,
    UnitCapacity,
)
from policies.deployment import (
    Deployment,
    Outcome,
    describe_nodes,
    node_make_up,
    sub_fleet,
    try_solve,
)
from policies.errors import InputError
from policies.hardware.catalog import CATALOG, GpuSpec, lookup
from policies.hardware.fleet import Fleet, Gpu, GpuId, NicGroup, Node, NvLinkDomain
from policies.hardware.vendors import split_by_vendor, vendors_of
from policies.request import POLICIES

#: Generation order used to rank GPUs as "newer" (CDNA3 is MI300X, Hopper's peer).
GENERATION = {"volta": 0, "ampere": 1, "ada": 2, "hopper": 3, "cdna3": 3, "blackwell": 4}
#: Architectures with FlashAttention-class attention kernels (FA2 on Ampere and Ada, FA3 on
#: Hopper, cuDNN / FA-class kernels on Blackwell, Composable Kernel FA on CDNA3).
FLASH_ATTENTION_ARCHS = frozenset({"ampere", "ada", "hopper", "blackwell", "cdna3"})
#: Largest prefill batch tried when the interactive tier has no TTFT target, tokens/GPU.
PREFILL_CAP_WITHOUT_TARGET = 8192


# ------------------------------------------------------------------------------ units


def interactive_units(fleet: Fleet) -> list[tuple[str, ...]]:
    """Nodes grouped into NVLink domains (fleet order); a PCIe-only node is its own unit."""
    units: dict[str, list[str]] = {}
    for n in fleet.nodes:
        key = f"nvl:{n.nvlink.domain}" if n.nvlink is not None else f"node:{n.name}"
        units.setdefault(key, []).append(n.name)
    return [tuple(v) for v in units.values()]


def _unit_key(fleet: Fleet, unit: Sequence[str]) -> tuple[object, ...]:
    return tuple(sorted(repr(node_make_up(fleet.node(n))) for n in unit))


def _newness(fleet: Fleet, nodes: Sequence[str]) -> float:
    """Mean generation rank of the GPUs on ``nodes`` (higher is newer)."""
    ranks = [GENERATION.get(g.spec.architecture, 0) for n in nodes for g in fleet.node(n).gpus]
    return sum(ranks) / len(ranks) if ranks else 0.0


def unit_capacity(
    dep: Deployment, tier: InteractiveTier, unit: Fleet, screen_policy: str
) -> UnitCapacity:
    """Size one interactive replica on ``unit`` (see the module docstring).

    Raises:
        InputError: invalid tier or deployment.
    """
    gpus = unit.gpus
    first = gpus[0].spec.model
    names = tuple(n.name for n in unit.nodes)
    desc = describe_nodes(unit, names)
    old = sorted({g.spec.model for g in gpus if g.spec.architecture not in FLASH_ATTENTION_ARCHS})
    if old:
        return UnitCapacity(
            names,
            desc,
            first,
            len(gpus),
            None,
            None,
            0.0,
            f"{', '.join(old)}: no FlashAttention-class kernels",
        )
    if dep.model.is_moe and len(vendors_of(unit)) > 1:
        return UnitCapacity(names, desc, first, len(gpus), None, None, 0.0, "mixes vendors")
    base = replace(dep, fleet=unit, policy=screen_policy)
    dec = advise_batch(
        replace(base, phase="decode", context_len=tier.prompt_tokens + tier.output_tokens),
        tier.tpot_ms,
    )
    pre = advise_batch(
        replace(base, phase="prefill", context_len=tier.prompt_tokens),
        tier.ttft_ms,
        max_tokens_per_gpu=None if tier.ttft_ms is not None else PREFILL_CAP_WITHOUT_TARGET,
    )
    if dec.best is None or pre.best is None:
        why = (dec.infeasible or pre.infeasible or ("no batch fits",))[0]
        return UnitCapacity(names, desc, first, len(gpus), dec.best, pre.best, 0.0, why)
    busy = tier.output_tokens / dec.best.tokens_per_s + tier.prompt_tokens / pre.best.tokens_per_s
    return UnitCapacity(
        names, desc, first, len(gpus), dec.best, pre.best, tier.max_utilisation / busy
    )


# ------------------------------------------------------------------------------- batch


def batch_tier(
    dep: Deployment,
    tier: BatchTier,
    fleet: Fleet,
    nodes: Sequence[str],
    policy: str,
    *,
    allow_cross_vendor: bool,
) -> BatchReport:
    """Solve the batch tier on ``nodes`` (one plan per vendor unless allowed to mix).

    Raises:
        InputError: invalid tier or deployment.
    """
    names = tuple(nodes)
    if not names:
        return BatchReport((), (), 0.0, None, _met(tier, 0.0), "no nodes left for the batch tier")
    part = sub_fleet(fleet, names, name=f"{fleet.name}-batch")
    parts = [part]
    if dep.model.is_moe and not allow_cross_vendor:
        parts = split_by_vendor(part)
    dep_b = replace(
        dep,
        phase=tier.phase,
        context_len=tier.context_len,
        policy=policy,
        allow_cross_vendor=allow_cross_vendor,
    )
    outcomes: list[Outcome] = [
        try_solve(dep_b.request(tier.tokens_per_gpu, fleet=p)) for p in parts
    ]
    results = tuple(o.result for o in outcomes if o.ok and o.result is not None)
    reasons = [o.reason for o in outcomes if not o.ok]
    tps = sum(r.plan.summary.tokens_per_s for r in results)
    step = max((r.plan.summary.step_time_us / 1e3 for r in results), default=None)
    return BatchReport(names, results, tps, step, _met(tier, tps), "; ".join(reasons))


def _met(tier: BatchTier, tps: float) -> bool | None:
    return None if tier.min_tokens_per_s is None else tps >= tier.min_tokens_per_s


# ------------------------------------------------------------------------------ search


def _check(req: TierRequest) -> None:
    req.interactive.check()
    if req.preference not in PREFERENCES:
        raise InputError(
            f"must be one of {PREFERENCES}, got {req.preference!r}", field="preference"
        )
    if req.screen_policy not in POLICIES:
        raise InputError(f"must be one of {POLICIES}", field="screen_policy")
    if req.addition_node_gpus < 1 or req.finalists < 1 or req.max_assignments < 1:
        raise InputError(
            "addition_node_gpus, finalists and max_assignments must be >= 1", field="tiers"
        )
    if req.batch.tokens_per_gpu < 1 or req.batch.context_len < 1:
        raise InputError("batch tokens and context must be >= 1", field="batch")


def plan_tiers(req: TierRequest) -> TierPlan:
    """Split the fleet between the interactive and the batch tier (module docstring).

    Raises:
        InputError: invalid tiers, preference or deployment.
    """
    _check(req)
    dep = req.deployment
    fleet = dep.fleet
    tier = req.interactive
    caps = _unit_types(req)
    reasons = tuple(
        f"{c.description}: {c.reason}" for c, _ in caps if c.requests_per_s <= 0 and c.reason
    )
    eligible = [(c, m) for c, m in caps if c.requests_per_s > 0]
    demand = tier.requests_per_s
    total = sum(c.requests_per_s * len(m) for c, m in eligible)
    notes: list[str] = []
    screened = 0
    if total < demand or not eligible:
        chosen = [list(m) for _, m in eligible]
        batch_nodes = _rest(fleet, chosen)
        batch = batch_tier(
            dep,
            req.batch,
            fleet,
            batch_nodes,
            dep.policy,
            allow_cross_vendor=req.allow_cross_vendor,
        )
        screened = 1
    elif req.preference == "fastest":
        chosen = _fastest(eligible, demand)
        batch = batch_tier(
            dep,
            req.batch,
            fleet,
            _rest(fleet, chosen),
            dep.policy,
            allow_cross_vendor=req.allow_cross_vendor,
        )
        screened = 1
    else:
        chosen, batch, screened, more = _max_batch(req, eligible, demand)
        notes.extend(more)
    replicas = _replicas(req, chosen, caps)
    return TierPlan(
        _interactive_report(req, chosen, replicas, reasons),
        batch,
        tuple(c for c, _ in caps),
        req.preference,
        screened,
        tuple(notes),
    )


def _unit_types(req: TierRequest) -> list[tuple[UnitCapacity, list[tuple[str, ...]]]]:
    """Interactive units grouped by identical make-up, each type sized on its first unit;
    fastest type (most requests/s per GPU, then newest) first."""
    dep = req.deployment
    fleet = dep.fleet
    by_type: dict[tuple[object, ...], list[tuple[str, ...]]] = {}
    for u in interactive_units(fleet):
        by_type.setdefault(_unit_key(fleet, u), []).append(u)
    caps: list[tuple[UnitCapacity, list[tuple[str, ...]]]] = []
    for members in by_type.values():
        sample = sub_fleet(fleet, members[0], name=f"{fleet.name}-unit")
        caps.append((unit_capacity(dep, req.interactive, sample, req.screen_policy), members))
    caps.sort(key=lambda c: (-c[0].per_gpu, -_newness(fleet, c[1][0])))
    return caps


def _interactive_report(
    req: TierRequest,
    chosen: Sequence[Sequence[tuple[str, ...]]],
    replicas: tuple[Replica, ...],
    reasons: tuple[str, ...],
) -> InteractiveReport:
    """The interactive tier of the chosen units: capacity against the demand, worst step
    times, and additions when the SLO is not met."""
    tier = req.interactive
    demand = tier.requests_per_s
    capacity = sum(r.requests_per_s for r in replicas)
    met = capacity >= demand and (demand == 0 or bool(replicas))
    additions: tuple[Addition, ...] = ()
    if not met:
        additions = _additions(req, demand - capacity)
    inter_nodes = tuple(n for unit in (u for units_ in chosen for u in units_) for n in unit)
    return InteractiveReport(
        nodes=inter_nodes,
        replicas=replicas,
        capacity_requests_per_s=capacity,
        demand_requests_per_s=demand,
        utilisation=(demand / capacity * tier.max_utilisation) if capacity > 0 else math.inf,
        slo_met=met,
        tpot_ms=max((r.tpot_ms for r in replicas), default=None),
        ttft_ms=max((r.ttft_ms for r in replicas), default=None),
        additions=additions,
        reasons=reasons
        + (
            ()
            if met
            else (
                f"the eligible units serve {capacity:.2f} requests/s within the SLO, "
                f"{demand:.2f} asked. To fix: add one of the listed node sets, lower the "
                "rate or relax the targets",
            )
        ),
    )


def _rest(fleet: Fleet, chosen: Sequence[Sequence[tuple[str, ...]]]) -> list[str]:
    taken = {n for units in chosen for unit in units for n in unit}
    return [n.name for n in fleet.nodes if n.name not in taken]


def _fastest(
    eligible: Sequence[tuple[UnitCapacity, list[tuple[str, ...]]]], demand: float
) -> list[list[tuple[str, ...]]]:
    """Units fastest type first until the demand is met."""
    chosen: list[list[tuple[str, ...]]] = []
    have = 0.0
    for cap, members in eligible:
        take: list[tuple[str, ...]] = []
        for unit in members:
            if have >= demand:
                break
            take.append(unit)
            have += cap.requests_per_s
        chosen.append(take)
    return chosen


def _max_batch(
    req: TierRequest,
    eligible: Sequence[tuple[UnitCapacity, list[tuple[str, ...]]]],
    demand: float,
) -> tuple[list[list[tuple[str, ...]]], BatchReport, int, list[str]]:
    """Minimal assignments; the batch tier of each screened, the best solved finally."""
    dep = req.deployment
    fleet = dep.fleet
    c = [cap.requests_per_s for cap, _ in eligible]
    ranges = [
        range(min(len(m), math.ceil(demand / ci) if ci > 0 else 0) + 1)
        for ci, (_, m) in zip(c, eligible, strict=True)
    ]
    minimal: list[tuple[int, ...]] = []
    for k in itertools.product(*ranges):
        have = sum(ki * ci for ki, ci in zip(k, c, strict=True))
        if have < demand:
            continue
        if demand > 0 and any(ki > 0 and have - ci >= demand for ki, ci in zip(k, c, strict=True)):
            continue
        minimal.append(k)
    notes: list[str] = []
    if len(minimal) > req.max_assignments:
        notes.append(
            f"{len(minimal)} minimal assignments, the {req.max_assignments} with the fewest "
            "GPUs screened (max_assignments)"
        )
        minimal.sort(
            key=lambda k: sum(ki * cap.gpus for ki, (cap, _) in zip(k, eligible, strict=True))
        )
        minimal = minimal[: req.max_assignments]
    scored: list[tuple[float, float, list[list[tuple[str, ...]]]]] = []
    for k in minimal:
        chosen = [list(m[:ki]) for ki, (_, m) in zip(k, eligible, strict=True)]
        rest = _rest(fleet, chosen)
        rep = batch_tier(
            dep,
            req.batch,
            fleet,
            rest,
            req.screen_policy,
            allow_cross_vendor=req.allow_cross_vendor,
        )
        inter = [n for units in chosen for unit in units for n in unit]
        scored.append((rep.tokens_per_s, _newness(fleet, inter), chosen))
    scored.sort(key=lambda s: (-s[0], -s[1]))
    best: tuple[float, float, list[list[tuple[str, ...]]], BatchReport] | None = None
    for tps_screen, newness, chosen in scored[: req.finalists]:
        rep = batch_tier(
            dep,
            req.batch,
            fleet,
            _rest(fleet, chosen),
            dep.policy,
            allow_cross_vendor=req.allow_cross_vendor,
        )
        key = max(rep.tokens_per_s, tps_screen)
        if best is None or key > best[0] * 1.005 or (key >= best[0] * 0.995 and newness > best[1]):
            best = (key, newness, chosen, rep)
    assert best is not None  # demand <= total capacity, so one assignment is feasible
    return best[2], best[3], len(scored), notes


def _replicas(
    req: TierRequest,
    chosen: Sequence[Sequence[tuple[str, ...]]],
    caps: Sequence[tuple[UnitCapacity, list[tuple[str, ...]]]],
) -> tuple[Replica, ...]:
    """Final plans of the chosen units at their type's batches (final policy, falling back
    to the screening plan when that is faster)."""
    dep = req.deployment
    tier = req.interactive
    fleet = dep.fleet
    cap_of = {unit: cap for cap, members in caps for unit in members}
    out: list[Replica] = []
    for unit in (u for units in chosen for u in units):
        cap = cap_of[unit]
        if cap.decode is None or cap.prefill is None:
            continue
        part = sub_fleet(fleet, unit, name=f"{fleet.name}-{unit[0]}")
        dec = replace(dep, phase="decode", context_len=tier.prompt_tokens + tier.output_tokens)
        final = try_solve(dec.request(cap.decode.tokens_per_gpu, fleet=part))
        screen = try_solve(
            dec.request(cap.decode.tokens_per_gpu, fleet=part, policy=req.screen_policy)
        )
        best = final
        if not final.ok or (
            screen.ok
            and screen.result is not None
            and final.result is not None
            and screen.result.plan.summary.step_time_us < final.result.plan.summary.step_time_us
        ):
            best = screen
        if best.result is None:
            continue
        out.append(
            Replica(
                unit,
                cap.gpu_model,
                best.result,
                best.result.plan.summary.step_time_us / 1e3,
                (cap.prefill.step_time_us or 0.0) / 1e3,
                cap.decode.tokens_per_gpu,
                cap.prefill.tokens_per_gpu,
                cap.requests_per_s,
            )
        )
    return tuple(out)


def _additions(req: TierRequest, shortfall: float) -> tuple[Addition, ...]:
    """Nodes of each candidate catalog GPU that would cover ``shortfall`` requests/s."""
    names = req.additions
    if names is None:
        names = tuple(m for m, s in CATALOG.items() if s.architecture in FLASH_ATTENTION_ARCHS)
    out: list[Addition] = []
    for name in names:
        spec = lookup(name, field_path="additions")
        node = _hypothetical_node(spec, req.addition_node_gpus)
        unit = Fleet("addition", (node,))
        cap = unit_capacity(req.deployment, req.interactive, unit, req.screen_policy)
        if cap.requests_per_s <= 0:
            continue
        count = max(1, math.ceil(shortfall / cap.requests_per_s - 1e-9))
        price = None
        if req.prices is not None:
            price = count * req.addition_node_gpus * req.prices.price(spec.model)
        out.append(Addition(spec.model, count, req.addition_node_gpus, cap.requests_per_s, price))
    out.sort(key=lambda a: (a.usd_per_hour if a.usd_per_hour is not None else 0.0, a.gpus))
    return tuple(out)


def _hypothetical_node(spec: GpuSpec, count: int) -> Node:
    """A node of ``count`` GPUs of ``spec``: NVLink (or Infinity Fabric) when the part has
    it, one 400 Gb/s NIC."""
    name = "add-" + "".join(ch if ch.isalnum() else "-" for ch in spec.model.lower())
    gpus = tuple(Gpu(GpuId(f"{name}/gpu{i}"), name, i, spec) for i in range(count))
    nvlink = (
        NvLinkDomain(name, spec.nvlink_bidir_gbytes_per_s)
        if spec.nvlink_bidir_gbytes_per_s > 0
        else None
    )
    return Node(name, gpus, nvlink, (NicGroup(1, 400.0, "ib0"),))

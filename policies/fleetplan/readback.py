"""The fleet planner's reply: instance counts become pools with named nodes (previous nodes
kept where the count allows), predicted latencies at each pool's load, and shortfalls with
what would fix them.

Units: requests per second, milliseconds, GB/s, USD per hour. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from policies.fleetplan.candidates import Candidates, eligible_nodes
from policies.fleetplan.program import Counts
from policies.fleetplan.sizing import Lengths, aggregated_step_us, aggregated_ttft_us
from policies.fleetplan.types import (
    DeploymentPlan,
    FleetDeployment,
    FleetPlan,
    PlannedGroup,
    PlannedPool,
    PlanRequest,
    Shortfall,
    Variant,
)


def _deal(
    req: PlanRequest, c: Candidates, counts: Counts
) -> tuple[dict[tuple[str, str, str], tuple[tuple[str, ...], ...]], tuple[str, ...]]:
    """Node names per instance: an instance keeps the nodes it had in the previous plan
    where it still exists, the rest come from the free nodes in fleet order (deployments
    with the fewest eligible nodes first)."""
    free: list[list[str]] = [list(g.nodes) for g in c.groups]
    out: dict[tuple[str, str, str], list[tuple[str, ...]]] = {}
    elig = {d.name: eligible_nodes(req.fleet, d) for d in req.deployments}
    vec_of: dict[tuple[str, str, str], tuple[int, ...]] = {}
    for d in req.deployments:
        for v in c.aggregated[d.name]:
            vec_of[d.name, "agg", v.key] = v.counts
        for k in c.pairs[d.name]:
            vec_of[d.name, "pre", k.key] = k.prefill.counts
            vec_of[d.name, "dec", k.key] = k.decode.counts
    prev_nodes: dict[tuple[str, str, str], list[tuple[str, ...]]] = {}
    if req.previous is not None:
        for name, dp in req.previous.deployments.items():
            for p in dp.pools:
                if p.instances is not None:
                    prev_nodes[name, "agg", p.instances.variant.key] = list(p.instances.nodes)
                elif p.prefill is not None and p.decode is not None:
                    key = f"{p.prefill.variant.key}+{p.decode.variant.key}"
                    prev_nodes[name, "pre", key] = list(p.prefill.nodes)
                    prev_nodes[name, "dec", key] = list(p.decode.nodes)
    taken: set[str] = set()
    # Kept instances first.
    for ident, n in sorted(counts.items()):
        if n <= 0:
            continue
        kept = [
            inst
            for inst in prev_nodes.get(ident, [])
            if all(x not in taken for x in inst) and all(x in elig[ident[0]] for x in inst)
        ][:n]
        for inst in kept:
            taken.update(inst)
        out[ident] = kept
    order = sorted((i for i, n in counts.items() if n > 0), key=lambda i: (len(elig[i[0]]), i))
    for ident in order:
        vec = vec_of[ident]
        while len(out[ident]) < counts[ident]:
            picked: list[str] = []
            for t, cnt in enumerate(vec):
                pool = [x for x in free[t] if x not in taken and x in elig[ident[0]]]
                picked.extend(pool[:cnt])
            if len(picked) < sum(vec):  # pragma: no cover - the program's (3), (4) prevent it
                break
            taken.update(picked)
            out[ident].append(tuple(picked))
    left = tuple(n.name for n in req.fleet.nodes if n.name not in taken)
    return {k: tuple(v) for k, v in out.items()}, left


def _agg_load(
    v: Variant, d: FleetDeployment, per_instance: float, chunk: int
) -> tuple[float, float]:
    """Predicted ``(TTFT ms, TPOT ms)`` of an aggregated instance at ``per_instance``
    requests/s: the steady batch ``B`` with ``B / (OSL t(B)) = rate``."""
    n = Lengths.of(d.traffic, d.slo)
    lo, hi = 0.0, float(v.sizing.batch_limit)
    for _ in range(40):
        mid = (lo + hi) / 2
        t = aggregated_step_us(v.curve, n, max(mid, 1e-9), chunk)
        if mid / (n.osl * t * 1e-6) < per_instance:
            lo = mid
        else:
            hi = mid
    b = max(hi, 1.0)
    return aggregated_ttft_us(v.curve, n, b, chunk) / 1e3, aggregated_step_us(
        v.curve, n, b, chunk
    ) / 1e3


def _decode_load(v: Variant, d: FleetDeployment, per_instance: float) -> float:
    """Predicted TPOT of a decode instance at ``per_instance`` requests/s, ms."""
    n = Lengths.of(d.traffic, d.slo)
    lo, hi = 0.0, float(v.sizing.batch_limit)
    for _ in range(40):
        mid = (lo + hi) / 2
        t = v.curve.decode_us(max(mid, 1e-9), n.context)
        if mid / (n.osl * t * 1e-6) < per_instance:
            lo = mid
        else:
            hi = mid
    return v.curve.decode_us(max(hi, 1.0), n.context) / 1e3


def _prefill_ttft_ms(
    p: PlannedPool, d: FleetDeployment, per_instance: float, step_ms: float
) -> float:
    """Predicted TTFT of a P/D pool at ``per_instance`` requests/s per prefill instance, ms:
    the running forward and the request's own, each of the tokens that arrive during one
    forward (a fixed point; at least the percentile prompt, at most the budget), then the KV
    transfer and a decode step."""
    assert p.prefill is not None
    v = p.prefill.variant
    n = Lengths.of(d.traffic, d.slo)
    tokens = n.isl_q
    for _ in range(50):
        nxt = min(
            float(p.prefill.batch_limit),
            max(n.isl_q, per_instance * n.isl * v.curve.prefill_time_us(tokens) * 1e-6),
        )
        if abs(nxt - tokens) < 1.0:
            break
        tokens = nxt
    forward = v.curve.prefill_time_us(tokens)
    kv_us = p.kv_latency_us + v.curve.kv_bytes_per_token * n.isl_q / (p.kv_gbytes_per_s * 1e3)
    return (2.0 * forward + kv_us) / 1e3 + step_ms


def read_back(
    req: PlanRequest, c: Candidates, counts: Counts, solver: str, solve_s: float
) -> FleetPlan:
    """The plan from the instance counts: pools, their loads and latencies, shortfalls."""
    nodes, free = _deal(req, c, counts)
    chunk = req.settings.chunk_tokens
    plans: dict[str, DeploymentPlan] = {}
    shortfalls: dict[str, Shortfall] = {}
    for d in req.deployments:
        pools: list[PlannedPool] = []
        for v in c.aggregated[d.name]:
            k = counts.get((d.name, "agg", v.key), 0)
            if k <= 0:
                continue
            pools.append(
                PlannedPool(
                    name=v.key,
                    requests_per_s=0.0,
                    instances=PlannedGroup(v, k, nodes[d.name, "agg", v.key], v.sizing.batch_limit),
                    capacity_requests_per_s=k * v.sizing.requests_per_s,
                )
            )
        for pr in c.pairs[d.name]:
            yk = counts.get((d.name, "pre", pr.key), 0)
            zk = counts.get((d.name, "dec", pr.key), 0)
            if yk <= 0 or zk <= 0:
                continue
            pools.append(
                PlannedPool(
                    name=pr.key,
                    requests_per_s=0.0,
                    prefill=PlannedGroup(
                        pr.prefill, yk, nodes[d.name, "pre", pr.key], pr.prefill.sizing.batch_limit
                    ),
                    decode=PlannedGroup(
                        pr.decode, zk, nodes[d.name, "dec", pr.key], pr.decode.sizing.batch_limit
                    ),
                    kv_gbytes_per_s=pr.kv_gbytes_per_s,
                    kv_latency_us=pr.kv_latency_us,
                    kv_path=pr.kv_path,
                    capacity_requests_per_s=min(
                        yk * pr.prefill.sizing.requests_per_s, zk * pr.decode.sizing.requests_per_s
                    ),
                )
            )
        capacity = sum(p.capacity_requests_per_s for p in pools)
        demand = d.traffic.requests_per_s
        served = min(demand, capacity)
        loaded: list[PlannedPool] = []
        for p in pools:
            rate = served * p.capacity_requests_per_s / capacity if capacity > 0 else 0.0
            if p.instances is not None:
                ttft, tpot = _agg_load(p.instances.variant, d, rate / p.instances.count, chunk)
            else:
                assert p.prefill is not None and p.decode is not None
                tpot = _decode_load(p.decode.variant, d, rate / p.decode.count)
                ttft = _prefill_ttft_ms(p, d, rate / p.prefill.count, tpot)
            loaded.append(replace(p, requests_per_s=rate, ttft_ms=ttft, tpot_ms=tpot))
        plans[d.name] = DeploymentPlan(d.name, d.priority, d.traffic, d.slo, tuple(loaded), served)
        short = demand - served
        if short > demand * 1e-6:
            shortfalls[d.name] = _capped_note(c, d, _shortfall(req, c, d, plans, short))
    return FleetPlan(
        deployments=plans,
        shortfalls=shortfalls,
        free_nodes=free,
        solver=solver,
        variants={d.name: _variants_seen(c, d) for d in req.deployments},
        curves_computed=c.computed,
        curves_cached=c.cached,
        solve_s=solve_s,
    )


def _variants_seen(c: Candidates, d: FleetDeployment) -> tuple[Variant, ...]:
    """``d``'s variants for the report: aggregated, decode, and each prefill variant once (as
    sized in its pair of the highest rate)."""
    best_prefill: dict[str, Variant] = {}
    for pr in c.pairs[d.name]:
        seen = best_prefill.get(pr.prefill.key)
        if seen is None or pr.prefill.sizing.requests_per_s > seen.sizing.requests_per_s:
            best_prefill[pr.prefill.key] = pr.prefill
    return (*c.aggregated[d.name], *c.decode[d.name], *best_prefill.values())


_Option = tuple[float, str, float, float, int, tuple[int, ...]]
"""A way to serve more: ``(USD/h per request/s, key, requests/s of one instance (pair), its
USD/h, GPUs, nodes per group)``."""


def _shortfall(
    req: PlanRequest,
    c: Candidates,
    d: FleetDeployment,
    plans: Mapping[str, DeploymentPlan],
    short: float,
) -> Shortfall:
    """Why ``d`` is short by ``short`` requests/s and what would serve the rest."""
    tokens = short * d.traffic.output_len.mean
    amount = (
        f"{short:.3g} requests/s ({tokens:,.0f} output tokens/s) of {d.traffic.requests_per_s:.3g}"
    )
    if not any(c.eligible[d.name]):
        return Shortfall(
            d.name,
            "nodes",
            short,
            tokens,
            "nodes matching its node selector",
            f"no node is eligible for {d.name} (node selector {dict(d.spec.node_selector)}). "
            "To fix: label nodes or change the node selector",
        )
    options = _options(c, d)
    if not options:
        seen = "; ".join(c.reasons[d.name][:3])
        return Shortfall(
            d.name,
            "slo",
            short,
            tokens,
            "a looser SLO or faster GPUs",
            f"{d.name} misses {amount}: no instance on this fleet meets TTFT "
            f"{d.slo.ttft_ms:g} ms and TPOT {d.slo.tpot_ms:g} ms at p{d.slo.percentile:g} "
            f"({seen}). To fix: relax the SLO, shorten the prompts or add faster GPUs",
        )
    options.sort()
    _, key, rate, usd, gpus, vec = options[0]
    need = math.ceil(short / rate - 1e-9)
    over = _over_budget(d, plans[d.name], (short, tokens, amount), need, usd, gpus)
    if over is not None:
        return over
    parts = [
        f"{need * k} more node{'s' if need * k != 1 else ''} of {g.label}"
        for g, k in zip(c.groups, vec, strict=True)
        if k
    ]
    fix = " and ".join(parts) + f" (as {need} more {key})"
    holders = _holders(req, d, plans)
    held = f"; the nodes it may use are held by {', '.join(holders)}" if holders else ""
    return Shortfall(
        d.name,
        "gpus",
        short,
        tokens,
        fix,
        f"{d.name} misses {amount}{held}. To fix: add {fix}, lower its demand or raise its "
        "priority",
    )


def _capped_note(c: Candidates, d: FleetDeployment, sf: Shortfall) -> Shortfall:
    """``sf``, saying so when ``d``'s stated batch (``tokensPerGpu``) is what holds its
    instances back: some candidate runs at exactly that batch."""
    per_gpu = d.batch_cap(1)
    sides = [*c.aggregated[d.name], *(p.decode for p in c.pairs[d.name])]
    if per_gpu is None or not any(v.sizing.batch_limit == d.batch_cap(v.gpus) for v in sides):
        return sf
    note = (
        f". Its stated batch (workload.tokensPerGpu {per_gpu}) caps its instances at that "
        "batch: without it the SLO sizes them"
    )
    return replace(sf, message=sf.message + note)


def _options(c: Candidates, d: FleetDeployment) -> list[_Option]:
    """Every instance (pair) that would serve more of ``d``, unsorted."""
    options: list[_Option] = []
    for v in c.aggregated[d.name]:
        rate = v.sizing.requests_per_s
        options.append((v.usd_per_hour / rate, v.key, rate, v.usd_per_hour, v.gpus, v.counts))
    for p in c.pairs[d.name]:
        rate = min(p.prefill.sizing.requests_per_s, p.decode.sizing.requests_per_s)
        usd = p.prefill.usd_per_hour + p.decode.usd_per_hour
        vec = tuple(a + b for a, b in zip(p.prefill.counts, p.decode.counts, strict=True))
        options.append((usd / rate, p.key, rate, usd, p.prefill.gpus + p.decode.gpus, vec))
    return options


def _over_budget(
    d: FleetDeployment,
    mine: DeploymentPlan,
    missing: tuple[float, float, str],
    need: int,
    usd: float,
    gpus: int,
) -> Shortfall | None:
    """The shortfall when one more instance of the cheapest option (``usd`` USD/h, ``gpus``
    GPUs; ``need`` of them serve the rest) would break ``d``'s budget, else None.
    ``missing``: requests/s, output tokens/s and both in words."""
    short, tokens, amount = missing
    budget = d.budget_usd_per_hour
    if budget > 0 and mine.usd_per_hour + usd > budget + 1e-9:
        return Shortfall(
            d.name,
            "budget",
            short,
            tokens,
            f"a budget of {mine.usd_per_hour + need * usd:.1f} USD/h",
            f"{d.name} misses {amount}: its budget of {budget:g} USD/h is spent "
            f"({mine.usd_per_hour:.1f} USD/h). To fix: raise the budget to "
            f"{mine.usd_per_hour + need * usd:.1f} USD/h or relax the SLO",
        )
    if d.budget_gpus > 0 and mine.gpus + gpus > d.budget_gpus:
        return Shortfall(
            d.name,
            "budget",
            short,
            tokens,
            f"a budget of {mine.gpus + need * gpus} GPUs",
            f"{d.name} misses {amount}: its budget of {d.budget_gpus} GPUs is used "
            f"({mine.gpus}). To fix: raise the budget to {mine.gpus + need * gpus} GPUs",
        )
    return None


def _holders(
    req: PlanRequest, d: FleetDeployment, plans: Mapping[str, DeploymentPlan]
) -> list[str]:
    """Deployments of ``d``'s priority or higher that hold nodes ``d`` may use, by name."""
    return sorted(
        {
            o.deployment
            for o in plans.values()
            if o.deployment != d.name
            and req_priority(req, o.deployment) >= d.priority
            and any(
                x in eligible_nodes(req.fleet, d)
                for p in o.pools
                for g in p.groups()
                for inst in g.nodes
                for x in inst
            )
        }
    )


def req_priority(req: PlanRequest, name: str) -> int:
    """The priority of deployment ``name``."""
    return next(d.priority for d in req.deployments if d.name == name)

"""The fleet planner: variants and instance counts for every deployment, serving each
deployment's demand within its SLOs at least cost, by priority when the fleet is short.

Estimate, then build, then solve:

1. **Variants** (:mod:`policies.fleetplan.candidates`, :mod:`policies.fleetplan.pairs`).
   Nodes of one make-up form a node group
   (:func:`policies.scheduling.table.fleet_groups`). A deployment's candidate instances are
   ``k`` nodes of one group (``k`` in ``settings.instance_nodes``) and, on fleets of at most
   ``settings.mixed_max_groups`` groups, one node each of two groups. Each make-up's step
   curve is computed once (:mod:`policies.fleetplan.curves`, cached by key) and sized per
   role (:mod:`policies.fleetplan.sizing`): an **aggregated** variant, a **decode** variant,
   and **prefill** variants paired with decode variants over the KV path between their
   nodes (:func:`~policies.fleetplan.pairs.kv_path`; a pair without an RDMA or NVLink
   path is not a candidate). A variant's capacity ``cap_v`` is its capacity at the SLO:
   the rate its ``B`` slots hold while at most the SLO's miss share of requests waits for a
   slot longer than the TTFT target leaves (Erlang C, :mod:`policies.fleetplan.queueing`),
   times ``settings.utilisation``. Not a flat share of ``B / (OSL x step)``: few slots
   queue sooner than many at the same utilisation, and the integer program trades
   variants (and the router splits traffic) by these capacities, so a flat share would
   favour small-batch variants and overload their pools first.
2. **Integer program** (:mod:`policies.fleetplan.program`; HiGHS through
   :class:`policies.solvers.milp.Model`: one thread, fixed seed, a node limit - the same
   inputs give the same plan on a busy machine). Variables:
   ``x_v`` in Z>=0 instances of aggregated variant ``v``; for a prefill/decode pair ``k =
   (p, q)``: ``y_k``, ``z_k`` in Z>=0 prefill and decode instances of its pool; served rates
   ``r_v, f_k >= 0`` and ``s_d`` per deployment. Constraints::

       (1) r_v <= cap_v x_v;   f_k <= capP_k y_k;   f_k <= capD_q z_k
       (2) s_d = sum_{v of d} r_v + sum_{k of d} f_k <= demand_d
       (3) sum over instances of nodes of group g <= |g|            (every group g)
       (4) the same over d's instances <= nodes of g eligible for d  (every d, g)
       (5) sum usd x <= budget_usd_d;  sum gpus x <= budget_gpus_d   (where given)

   Solved lexicographically by priority: for each priority level, highest first, maximise
   ``sum_{d at level} s_d / demand_d`` and keep what it reaches (less 1e-6) as a constraint
   for the levels below; then minimise ``sum usd x + move_weight * sum usd |x - x_prev|``
   (the price of the GPUs, plus a penalty for every instance changed against the previous
   plan) with every level's served share kept. So a higher priority's demand is served
   first, each deployment up to its demand, and at least cost (within
   ``settings.cost_gap``: the cost stage stops at a plan proven within that fraction of
   the cheapest). The cost stage also gets, per deployment, a floor on what its instances
   cost (the proven bound of its program alone: a valid row) and a start built deployment
   by deployment; with them the LP bound is close to the optimum on many deployments
   (:func:`policies.fleetplan.program.solve`).
3. **Read back** (:mod:`policies.fleetplan.readback`). Counts become pools with named
   nodes (previous nodes kept where the count allows), predicted latencies at each pool's
   load, and shortfalls with what would fix them.

Units: requests per second, milliseconds, GB/s, USD per hour. Pure: no I/O.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor

from policies.errors import InputError
from policies.fleetplan.candidates import Candidates, candidates
from policies.fleetplan.curves import CurveCache, MemoryCurveCache
from policies.fleetplan.pairs import Pair, kv_path
from policies.fleetplan.program import Counts, solve
from policies.fleetplan.readback import read_back, req_priority
from policies.fleetplan.types import FleetPlan, PlanRequest
from policies.spec.build import check_spec

__all__ = [
    "Candidates",
    "Counts",
    "Pair",
    "candidates",
    "check_request",
    "kv_path",
    "plan_fleet",
    "req_priority",
]


def plan_fleet(
    req: PlanRequest,
    *,
    cache: CurveCache | None = None,
    pool: Executor | None = None,
) -> FleetPlan:
    """Plan the fleet (see the module docstring).

    Args:
        req: fleet, deployments with traffic and SLOs, previous plan, settings.
        cache: curves kept between calls (a disk-backed one across runs); in memory when
            None.
        pool: the caller's executor for curves not in the cache (a process pool computes
            them in parallel; the plan is the same without it).

    Raises:
        InputError: an invalid deployment (the field is named).
    """
    check_request(req)
    cands = candidates(req, cache if cache is not None else MemoryCurveCache(), pool)
    t0 = time.perf_counter()
    counts, solver = solve(req, cands)
    elapsed = time.perf_counter() - t0
    return read_back(req, cands, counts, solver, elapsed)


def check_request(req: PlanRequest) -> None:
    """Validate the deployments: their specs (traffic, SLOs, disaggregation and budget
    included), that each states traffic and SLOs, and unique names.

    Raises:
        InputError: naming the deployment and the field.
    """
    seen: set[str] = set()
    for d in req.deployments:
        at = f"deployments.{d.name or '?'}"
        check_spec(d.spec, path=at)
        if d.name in seen:
            raise InputError(f"deployment {d.name!r} appears twice", field=f"{at}.name")
        seen.add(d.name)
        if d.spec.traffic is None or d.spec.slo is None:
            missing = "traffic" if d.spec.traffic is None else "slo"
            raise InputError(
                "the fleet planner needs the demand and the SLOs. To fix: give spec.traffic "
                "and spec.slo, or schedule it by its batch (tokensPerGpu)",
                field=f"{at}.{missing}",
            )

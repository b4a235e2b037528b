"""Stage 1 of the ``ilp`` policy: attention shares and expert-slot reservations by LP.

Notation as in :mod:`policies.solvers.ilp`; the constraint labels (1a)-(1f) below are the
ones the code of :func:`attention_lp` points back to.

Stage 1 - attention LP (exact for the attention phase)::

    min   L_dense * tau_Ad + L_moe * (tau_Am + tau_S) - eps * sum_i m_i
    s.t.  sum_i a_i = 1,  a_i >= 0                                           (1a)
          tau_Ak >= g_i,k * T a_i + q_i * T a_i + o_i     for k in {dense, moe}  (1b)
          tau_Ak >= R_i,k + q_i * T a_i + o_i                                (1c)
          W_i + L_moe * B * m_i + K_i * a_i + K0_i <= U_i    (memory)        (1d)
          engine: m_i = S;  native: sum_i m_i >= E + R,  0 <= m_i <= E      (1e)
          tau_S >= alpha_i + V / bw_i,ch * max(a_i * sum_{j~ch} s_j,
                                               s_i * sum_{j~ch} a_j)   (comm, 1f)

``s_j`` is the fraction of pairs GPU j serves in the speed-aware greedy placement (an
estimate: the MILP of stage 2 decides the real one), ``j~ch`` the GPUs i reaches over
channel ch. ``g`` GEMM us per token, ``R`` weight-read us, ``q`` attention-core us per token, ``W``
shared weights, ``B`` bytes per expert replica, ``K`` KV-cache and activation bytes per
unit share, ``rho_i`` fraction of GPUs outside i's NVLink domain. Identical GPUs of a class
are then given their class average (feasible and no worse, the constraints being symmetric
and convex). Native form rounds shares to whole query heads per node (largest remainder).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pulp

from policies.estimate.costmodel import CostTable
from policies.estimate.evaluation import LayerPlacement, evaluate, served_fractions
from policies.hardware.topology import Channel
from policies.request import Infeasible, PlacementRequest
from policies.solvers import greedy
from policies.solvers.common import replicate_capped, slots_per_gpu
from policies.solvers.milp import solve_milp

_EPS_SLOTS = 1e-4  # weight of "keep memory for experts" in stage 1, us per slot

AttentionAnswer = tuple[list[float], list[float], float]
"""(shares per GPU, expert-slot reservations per GPU, attention-phase time over layers in us)."""


def class_of(table: CostTable, req: PlacementRequest) -> list[list[int]]:
    """Groups of interchangeable GPUs, fleet order: same spec on nodes of the same make-up
    (GPU models, NVLink, NICs, fabrics). Swapping two GPUs of a group, or two such nodes
    wholesale, changes no cost, so the MILP counts replicas per group instead of per GPU:
    the symmetry is broken and big fleets shrink to a handful of groups (nodes first, then
    GPUs)."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, gpu in enumerate(req.fleet.gpus):
        node = req.fleet.node(gpu.node)
        make_up = (
            tuple(sorted(g.spec.model for g in node.gpus)),
            node.nvlink.per_gpu_bidir_gbytes_per_s if node.nvlink else None,
            tuple(sorted((n.count, n.per_direction_gbits_per_s, n.fabric) for n in node.nics)),
        )
        groups.setdefault((gpu.spec, make_up), []).append(i)
    return list(groups.values())


def class_frac(
    table: CostTable, classes: Sequence[Sequence[int]]
) -> tuple[tuple[tuple[float, ...], ...], ...]:
    """``frac[c][d][ch]``: fraction of group d's GPUs that a GPU of group c reaches over
    channel ch (LOCAL for itself). Groups are symmetric, so one representative suffices."""
    out = []
    for cls in classes:
        row = table.topology.channel[cls[0]]
        per = []
        for other in classes:
            counts = [0.0] * len(Channel)
            for j in other:
                counts[row[j]] += 1.0
            per.append(tuple(x / len(other) for x in counts))
        out.append(tuple(per))
    return tuple(out)


def attention_lp(
    req: PlacementRequest,
    table: CostTable,
    classes: Sequence[Sequence[int]],
    served: Sequence[float] | None,
) -> AttentionAnswer | Infeasible:
    """Stage 1: attention shares and per-GPU expert slot reservations.

    ``served`` estimates the fraction of each layer's token-expert pairs each GPU will serve
    (from the speed-aware greedy placement); with it the dispatch/combine volumes are linear
    in the attention shares and enter the LP per channel, exactly as in the cost model.

    Returns:
        (shares, slot reservations per GPU, attention-phase time summed over layers in us),
        or an :class:`Infeasible` when no share vector fits memory.
    """
    n = table.num_gpus
    L_moe, L_dense = table.num_moe_layers, table.num_dense_layers
    kinds = ["moe"] if L_moe else []
    if L_dense:
        kinds.append("dense")
    # Identical GPUs of a group get the same share (the LP is symmetric and convex, so
    # averaging any optimum over a group stays optimal): one variable per group.
    C = len(classes)
    size = [len(cls) for cls in classes]
    served_c = (
        None if served is None else [sum(served[i] for i in cls) / len(cls) for cls in classes]
    )
    prob = pulp.LpProblem("attention", pulp.LpMinimize)
    # With the engine's own DP balancing every rank gets 1/n of the tokens: fixed shares.
    fixed = 1.0 / n if req.engine.equal_dp else None
    a = [pulp.LpVariable(f"a{c}", fixed or 0, fixed or 1) for c in range(C)]
    tau = {k: pulp.LpVariable(f"tauA_{k}", 0) for k in kinds}
    tau_s = pulp.LpVariable("tauS", 0)
    engine = req.form == "engine"
    m = [pulp.LpVariable(f"m{c}", 0, table.num_experts) for c in range(C)]
    weights = {"moe": L_moe, "dense": L_dense}
    obj = pulp.lpSum(weights[k] * tau[k] for k in kinds) + L_moe * tau_s
    if not engine and L_moe:
        obj -= _EPS_SLOTS * pulp.lpSum(size[c] * m[c] for c in range(C))
    prob += obj
    prob += pulp.lpSum(size[c] * a[c] for c in range(C)) == 1  # (1a)
    rows = _ClassRows(req, table, classes, served_c, prob, a, m, tau, tau_s)
    for ci in range(C):
        rows.add(ci)
    if L_moe and not engine:
        prob += (
            pulp.lpSum(size[c] * m[c] for c in range(C))
            >= table.num_experts + req.redundant_experts
        )  # (1e)
    outcome = solve_milp(
        prob,
        solver=req.options.solver,
        time_limit_s=max(1.0, req.options.time_limit_s / 4),
        mip_gap=0,
        warm=False,
    )
    if outcome.status != "optimal":
        return _no_split(req, n, fixed is not None)
    share = [0.0] * n
    slots = [0.0] * n
    for ci, cls in enumerate(classes):
        for i in cls:
            share[i] = max(0.0, float(a[ci].varValue or 0.0))
            slots[i] = max(0.0, float(m[ci].varValue or 0.0))
    total = sum(share)
    share = [x / total for x in share]
    attn_us = sum(weights[k] * float(tau[k].varValue or 0.0) for k in kinds)
    return share, slots, attn_us


def _no_split(req: PlacementRequest, n: int, equal: bool) -> Infeasible:
    """Why stage 1 found no attention split (``equal``: the engine fixes every share). The
    fixes are :func:`policies.solve.verified_fixes`' (each checked by re-solving)."""
    if equal:
        return Infeasible(
            f"with {req.engine.name}'s own DP balancing every rank takes 1/{n} of the tokens, "
            "and that does not fit every GPU's memory",
            (
                "the smallest GPU's KV cache, shared weights and expert slots overflow at an "
                "equal share",
            ),
        )
    return Infeasible(
        "no attention split fits GPU memory",
        ("KV cache, shared weights and expert slots exceed the fleet's memory",),
    )


class _ClassRows:
    """Adds one class's rows (1b)-(1f) to the stage-1 LP (variables built by attention_lp)."""

    def __init__(
        self,
        req: PlacementRequest,
        table: CostTable,
        classes: Sequence[Sequence[int]],
        served_c: Sequence[float] | None,
        prob: pulp.LpProblem,
        a: Sequence[pulp.LpVariable],
        m: Sequence[pulp.LpVariable],
        tau: dict[str, pulp.LpVariable],
        tau_s: pulp.LpVariable,
    ) -> None:
        self.req, self.table, self.classes, self.served_c = req, table, classes, served_c
        self.prob, self.a, self.m, self.tau, self.tau_s = prob, a, m, tau, tau_s
        self.size = [len(cls) for cls in classes]
        self.frac = class_frac(table, classes)
        n = table.num_gpus
        self.slots = (
            slots_per_gpu(table.num_experts, req.redundant_experts, n)
            if table.num_moe_layers
            else 0
        )

    def add(self, ci: int) -> None:
        """Rows of class ``ci``: attention time (1b, 1c), memory (1d), slots (1e), comm (1f)."""
        table, prob, a, m, tau = self.table, self.prob, self.a, self.m, self.tau
        T = table.total_tokens
        L_moe = table.num_moe_layers
        c = table.gpus[self.classes[ci][0]]
        for k in tau:  # (1b), (1c)
            prob += (
                tau[k]
                >= (c.attn_gemm_us_per_token[k] + c.attn_core_us_per_token) * T * a[ci]
                + c.attn_overhead_us
            )
            prob += (
                tau[k]
                >= c.attn_weight_read_us[k]
                + c.attn_core_us_per_token * T * a[ci]
                + c.attn_overhead_us
            )
        per_share = T * table.act_bytes_per_token + (
            T * table.context_len * table.kv_bytes_per_token
            if table.decode
            else T * table.kv_bytes_per_token
        )
        const = 0.0 if table.decode else table.context_len * table.kv_bytes_per_token
        expert_mem = L_moe * table.expert_bytes
        prob += (
            c.fixed_bytes + expert_mem * m[ci] + per_share * a[ci] + const <= c.usable_bytes
        )  # (1d)
        if not L_moe:
            prob += m[ci] == 0
            return
        if self.req.form == "engine":
            prob += m[ci] == self.slots  # (1e)
        if self.served_c is not None:
            self._comm(ci)

    def _comm(self, ci: int) -> None:
        """(1f): send and receive time per channel of class ``ci`` (none with an all-gather
        backend: every GPU receives every token whatever the shares)."""
        assert self.served_c is not None
        if self.table.exchange == "allgather":
            return
        table, a, served_c, size, frac = self.table, self.a, self.served_c, self.size, self.frac
        C = len(self.classes)
        V = table.total_tokens * table.top_k * table.bytes_per_copy
        c = table.gpus[self.classes[ci][0]]
        for ch in range(1, len(Channel) - 1):  # (1f) send and receive per channel
            bw = c.comm_bw_bytes_per_us[ch]
            reach = [size[d] * frac[ci][d][ch] for d in range(C)]
            if not any(reach) or bw <= 0:
                continue
            out_frac = sum(reach[d] * served_c[d] for d in range(C))
            if out_frac > 0:
                self.prob += self.tau_s >= c.comm_alpha_us + V / bw * out_frac * a[ci]
            if served_c[ci] > 0:
                self.prob += self.tau_s >= c.comm_alpha_us + V / bw * served_c[ci] * pulp.lpSum(
                    reach[d] * a[d] for d in range(C) if reach[d]
                )


def choose_attention(
    req: PlacementRequest, table: CostTable, groups: Sequence[Sequence[int]]
) -> AttentionAnswer | Infeasible:
    """Stage 1 under three estimates of where pairs will be served (the greedy placement's,
    evenly, and none - attention alone); keep the shares whose greedy placement scores best
    under the full cost model."""
    n = table.num_gpus
    if table.num_moe_layers == 0:
        return attention_lp(req, table, groups, None)
    base = greedy.greedy_attention(req, table)
    greedy_served = _greedy_served(req, table, base)
    if isinstance(greedy_served, Infeasible):
        return greedy_served
    estimates: list[Sequence[float] | None] = [greedy_served, [1.0 / n] * n, None]
    best: tuple[float, AttentionAnswer] | None = None
    for served in estimates:
        cand = attention_lp(req, table, groups, served)
        if isinstance(cand, Infeasible):
            return cand
        share, reserve, _ = cand
        caps = [slots_per_gpu(table.num_experts, req.redundant_experts, n)] * n
        if req.form != "engine":
            caps = [max(1, math.floor(r + 1e-6)) for r in reserve]
        step = evaluate(table, share, greedy_layers(req, table, caps)).step_time_us
        if best is None or step < best[0] - 1e-9:
            best = (step, cand)
    assert best is not None
    return best[1]


def greedy_layers(
    req: PlacementRequest, table: CostTable, caps: Sequence[int]
) -> list[LayerPlacement]:
    """Greedy replication and speed-weighted LPT packing of every MoE layer."""

    budget = min(table.num_experts + req.redundant_experts, sum(caps))
    out = []
    for li in range(table.num_moe_layers):
        weight = [table.pairs(li, e) for e in range(table.num_experts)]
        phy = replicate_capped(weight, budget, table.num_gpus)
        out.append(greedy.pack_layer(table, li, phy, list(caps)))
    return out


def _greedy_served(
    req: PlacementRequest, table: CostTable, share: Sequence[float]
) -> list[float] | Infeasible:
    """Fraction of pairs each GPU serves, averaged over MoE layers, in the greedy plan."""
    n = table.num_gpus
    caps = greedy.capacities(req, table, list(share))
    if isinstance(caps, Infeasible):
        return caps
    total = [0.0] * n
    for li, layer in enumerate(greedy_layers(req, table, caps)):
        for i, x in enumerate(served_fractions(table, li, layer)):
            total[i] += x
    return [x / table.num_moe_layers for x in total]


def heads_rounding(req: PlacementRequest, share: Sequence[float]) -> tuple[list[float], list[int]]:
    """Native form: whole query heads per GPU inside each node's tensor-parallel attention
    (largest remainder), shares recomputed from the heads."""
    heads = req.model.num_q_heads
    out_share = list(share)
    out_heads = [0] * len(share)
    index = {g.id: i for i, g in enumerate(req.fleet.gpus)}
    for node in req.fleet.nodes:
        idx = [index[g.id] for g in node.gpus]
        node_share = sum(share[i] for i in idx)
        if node_share <= 0:
            continue
        exact = [share[i] / node_share * heads for i in idx]
        floor = [math.floor(x) for x in exact]
        left = heads - sum(floor)
        order = sorted(range(len(idx)), key=lambda k: exact[k] - floor[k], reverse=True)
        for k in order[:left]:
            floor[k] += 1
        for k, i in enumerate(idx):
            out_heads[i] = floor[k]
            out_share[i] = node_share * floor[k] / heads
    return out_share, out_heads

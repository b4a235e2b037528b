"""``ilp``: heterogeneity-aware placement by mixed-integer programming (PuLP + HiGHS).

The step time is ``L_dense * A_dense + sum over MoE layers l of (A_moe + C_l + E_l)`` where
A, C and E are the attention, dispatch/combine and expert phases, each costing its slowest
GPU (see :mod:`policies.costmodel`). Attention shares are global and every MoE layer's
experts are independent given them, so the problem is solved in three stages.

Notation: GPUs i; classes c of interchangeable GPUs (same node, same spec; ``n_c`` GPUs);
experts e with token-expert pairs ``p_e`` per step in the layer and load fraction
``w_e = p_e / sum p``; channels ch (NVLink, PCIe, RDMA, cross-fabric RDMA); ``T`` tokens per
step; coefficients ``f_i`` (us per pair), ``r_i`` (us per replica read), ``b_i`` (us per
pair of activation traffic), ``o_i`` (fixed us), ``V`` (bytes of all pairs),
``bw_i,ch`` (bytes/us).

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

Stage 2 - per MoE layer, class-level MILP (layers solved in parallel processes). Identical
GPUs are interchangeable, so variables count replicas per *class* instead of per GPU - this
breaks the symmetry and shrinks the model by the class size. Native form::

    y_e,c in {0..n_c}   replicas of e in class c          t_e,c in [0,1]  share of e's pairs
    k_c   integer       most replicas on one GPU of c      mv_e,c >= 0     moves (re-planning)

    min   tau_C + tau_E + lambda * sum mv_e,c
    s.t.  sum_c t_e,c = 1                                   coverage            (2a)
          t_e,c <= u_e,c * y_e,c                            replica size        (2b)
          sum_e,c y_e,c <= E + R,  sum_e y_e,c <= n_c cap_c  slot budget, memory (2c)
          n_c k_c >= sum_e y_e,c                                                (2d)
          tau_E >= f_c * P_c / n_c + o_c,    P_c = sum_e p_e t_e,c                (2e)
          tau_E >= r_c * k_c + b_c * P_c / n_c + o_c                            (2f)
          tau_C >= alpha_c + V * recv_c,ch / bw_c,ch,  recv_c,ch = s_c / n_c * src_c,ch   (2g)
          tau_C >= alpha_c + V * send_c,ch / bw_c,ch,  send_c,ch = a_c * dst_c,ch(s)      (2h)
          mv_e,c >= y_e,c - y0_e,c                          only with a previous plan (2i)
          tau_C >= alpha_L + V / (2 bw_L) * (A_a S_b + A_b S_a)  per fabric link L
                      joining segments a, b (A: attention share, S: served)  (2k)
          h_c >= p_e t_e,c - p_e (y_e,c - 1),  tau_E >= f_c h_c + o_c,
          tau_C >= alpha_c + rho_c h_c                      heaviest lone replica (2j)
                                    (engine form: h_c + (S - 1) * lightest replica)

``s_c = sum_e w_e t_e,c`` is the class's served fraction, ``src_c,ch`` the attention share
of the GPUs reaching c over ch, ``dst_c,ch(s)`` the served fraction reachable from c over
ch, ``rho_c`` the receive time per pair of a GPU of c. ``u_e,c = min(1, Pmax_c / p_e)`` caps a replica at the pairs a GPU of c can process
within the greedy plan's layer time, a bound any solution better than the warm start obeys.
Engine form replaces ``t`` by a replica count per expert: binaries ``z_e,r`` choose
``r_e = r`` and integers ``y_e,c,r`` place them, each replica serving ``p_e / r`` pairs::

    sum_r z_e,r = 1,  sum_c y_e,c,r = r z_e,r,  y_e,c,r <= min(n_c, r) z_e,r
    sum_e,r y_e,c,r = S n_c  (equal slots),     P_c = sum_e,r (p_e / r) y_e,c,r

with ``r`` ranging over 1..``r_max`` only for the experts heavy enough to need it.

Stage 3 - per class, GPUs: replicas go heaviest first to the least-loaded GPU of the
class with a free slot that does not hold that expert (preferring the GPU that held it
before, when re-planning), then pairwise swaps reduce the most-loaded GPU. Native form
finally re-splits each expert's class share over its replicas with an LP that minimises
the class's most-loaded GPU.

The plan's lower bound is the stage-1 LP optimum for the attention phases plus, per layer,
HiGHS's proven bound of the stage-2 MILP; it bounds the step time for the stage-1
attention shares (stage 2 relaxes GPUs of a class to their average, so it bounds the
GPU-level problem). Warm start: the greedy plan's class counts.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

import pulp

from policies.costmodel import (
    CostTable,
    LayerPlacement,
    comm_times_us,
    evaluate,
    link_time_us,
    served_fractions,
)
from policies.errors import InfeasibleError
from policies.request import PlacementRequest, RawPlacement, count_moves, migration_weight_us
from policies.solvers import greedy
from policies.solvers.common import make_room, replicate_capped, slots_per_gpu
from policies.solvers.milp import solve_milp
from policies.topology import Channel

_EPS_SLOTS = 1e-4  # weight of "keep memory for experts" in stage 1, us per slot


# ------------------------------------------------------------------------ stage 1


def _class_of(table: CostTable, req: PlacementRequest) -> list[list[int]]:
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
            node.nvlink.per_gpu_gbps if node.nvlink else None,
            tuple(sorted((n.count, n.gbps, n.fabric) for n in node.nics)),
        )
        groups.setdefault((gpu.spec, make_up), []).append(i)
    return list(groups.values())


def _class_frac(
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
) -> tuple[list[float], list[float], float]:
    """Stage 1: attention shares and per-GPU expert slot reservations.

    ``served`` estimates the fraction of each layer's token-expert pairs each GPU will serve
    (from the speed-aware greedy placement); with it the dispatch/combine volumes are linear
    in the attention shares and enter the LP per channel, exactly as in the cost model.

    Returns:
        (shares, slot reservations per GPU, attention-phase time summed over layers in us).

    Raises:
        InfeasibleError: no share vector fits memory.
    """
    n = table.num_gpus
    T = table.total_tokens
    L_moe, L_dense = table.num_moe_layers, table.num_dense_layers
    kinds = ["moe"] if L_moe else []
    if L_dense:
        kinds.append("dense")
    # Identical GPUs of a group get the same share (the LP is symmetric and convex, so
    # averaging any optimum over a group stays optimal): one variable per group.
    C = len(classes)
    size = [len(cls) for cls in classes]
    frac = _class_frac(table, classes)
    served_c = (
        None if served is None else [sum(served[i] for i in cls) / len(cls) for cls in classes]
    )
    prob = pulp.LpProblem("attention", pulp.LpMinimize)
    a = [pulp.LpVariable(f"a{c}", 0, 1) for c in range(C)]
    tau = {k: pulp.LpVariable(f"tauA_{k}", 0) for k in kinds}
    tau_s = pulp.LpVariable("tauS", 0)
    engine = req.form == "engine"
    S = slots_per_gpu(table.num_experts, req.redundant_experts, n) if L_moe else 0
    m = [pulp.LpVariable(f"m{c}", 0, table.num_experts) for c in range(C)]
    weights = {"moe": L_moe, "dense": L_dense}
    obj = pulp.lpSum(weights[k] * tau[k] for k in kinds) + L_moe * tau_s
    if not engine and L_moe:
        obj -= _EPS_SLOTS * pulp.lpSum(size[c] * m[c] for c in range(C))
    prob += obj
    prob += pulp.lpSum(size[c] * a[c] for c in range(C)) == 1  # (1a)
    V = T * table.top_k * table.bytes_per_copy
    for ci, cls in enumerate(classes):
        c = table.gpus[cls[0]]
        for k in kinds:  # (1b), (1c)
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
        if L_moe:
            if engine:
                prob += m[ci] == S  # (1e)
            if served_c is None:
                continue
            for ch in range(1, len(Channel) - 1):  # (1f) send and receive per channel
                bw = c.comm_bw_bytes_per_us[ch]
                reach = [size[d] * frac[ci][d][ch] for d in range(C)]
                if not any(reach) or bw <= 0:
                    continue
                out_frac = sum(reach[d] * served_c[d] for d in range(C))
                if out_frac > 0:
                    prob += tau_s >= c.comm_alpha_us + V / bw * out_frac * a[ci]
                if served_c[ci] > 0:
                    prob += tau_s >= c.comm_alpha_us + V / bw * served_c[ci] * pulp.lpSum(
                        reach[d] * a[d] for d in range(C) if reach[d]
                    )
        else:
            prob += m[ci] == 0
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
        raise InfeasibleError(
            "no attention split fits GPU memory",
            (
                "KV cache, shared weights and expert slots exceed the fleet's memory. To fix: "
                "lower --tokens or --context, use --kv-cache-dtype fp8, fewer "
                "--redundant-experts, or add GPUs",
            ),
        )
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


def _choose_attention(
    req: PlacementRequest, table: CostTable, groups: Sequence[Sequence[int]]
) -> tuple[list[float], list[float], float]:
    """Stage 1 under three estimates of where pairs will be served (the greedy placement's,
    evenly, and none - attention alone); keep the shares whose greedy placement scores best
    under the full cost model."""
    n = table.num_gpus
    if table.num_moe_layers == 0:
        return attention_lp(req, table, groups, None)
    base = greedy.greedy_attention(req, table)
    estimates: list[Sequence[float] | None] = [
        _greedy_served(req, table, base),
        [1.0 / n] * n,
        None,
    ]
    best: tuple[float, tuple[list[float], list[float], float]] | None = None
    for served in estimates:
        cand = attention_lp(req, table, groups, served)
        share, reserve, _ = cand
        caps = [slots_per_gpu(table.num_experts, req.redundant_experts, n)] * n
        if req.form != "engine":
            caps = [max(1, math.floor(r + 1e-6)) for r in reserve]
        step = evaluate(table, share, _greedy_layers(req, table, caps)).step_time_us
        if best is None or step < best[0] - 1e-9:
            best = (step, cand)
    assert best is not None
    return best[1]


def _greedy_layers(
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


def _greedy_served(req: PlacementRequest, table: CostTable, share: Sequence[float]) -> list[float]:
    """Fraction of pairs each GPU serves, averaged over MoE layers, in the greedy plan."""
    n = table.num_gpus
    caps = greedy.capacities(req, table, list(share))
    total = [0.0] * n
    for li, layer in enumerate(_greedy_layers(req, table, caps)):
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


# ------------------------------------------------------------------------ stage 2


@dataclass(frozen=True)
class ClassCost:
    """Coefficients of one class of identical GPUs (see module docstring)."""

    members: tuple[int, ...]
    share_each: float
    cap: int
    flop: float
    read: float
    act: float
    overhead: float
    alpha: float
    bw: tuple[float, ...]
    recv_us_per_pair: float = 0.0


@dataclass(frozen=True)
class LayerProblem:
    """Stage-2 input for one MoE layer; plain data so it pickles cheaply to a worker."""

    layer: int
    engine: bool
    pairs: tuple[float, ...]
    classes: tuple[ClassCost, ...]
    frac: tuple[tuple[tuple[float, ...], ...], ...]  # [c][d][channel], see _class_frac
    class_segment: tuple[int, ...]  # fabric segment of each class
    segment_share: tuple[tuple[int, float], ...]  # (segment, attention share of its GPUs)
    segment_links: tuple[tuple[int, int, float, float], ...]  # see CostTable.segment_links
    volume_bytes: float
    budget: int
    slots: int
    pair_cap: tuple[float, ...]
    prev: tuple[tuple[int, ...], ...] | None
    warm: tuple[tuple[int, ...], ...]
    warm_k: tuple[int, ...]
    migration_weight_us: float
    time_limit_s: float
    mip_gap: float
    solver: str


@dataclass(frozen=True)
class LayerSolution:
    """Stage-2 output: replicas and pair shares per class and expert."""

    layer: int
    replicas: tuple[tuple[int, ...], ...]  # [class][expert]
    share: tuple[tuple[float, ...], ...]  # [class][expert], fraction of the expert's pairs
    bound_us: float
    objective_us: float
    status: str
    solver: str


def _solve_layer(p: LayerProblem) -> LayerSolution:
    """Stage 2 for one layer (runs in a worker process); ``p.time_limit_s`` covers building
    the model too."""
    started = time.perf_counter()
    E = len(p.pairs)
    C = len(p.classes)
    total_pairs = sum(p.pairs) or 1.0
    w = [x / total_pairs for x in p.pairs]
    prob = pulp.LpProblem(f"layer{p.layer}", pulp.LpMinimize)
    tau_e = pulp.LpVariable("tauE", 0)
    tau_c = pulp.LpVariable("tauC", 0)
    k = [
        pulp.LpVariable(f"k{c}", 0, cls.cap if not p.engine else p.slots, cat="Integer")
        for c, cls in enumerate(p.classes)
    ]
    # replicas[c][e] and pairs[c][e] as linear expressions
    rep: list[list[pulp.LpAffineExpression]] = [
        [pulp.LpAffineExpression() for _ in range(E)] for _ in range(C)
    ]
    pairs_on: list[list[pulp.LpAffineExpression]] = [
        [pulp.LpAffineExpression() for _ in range(E)] for _ in range(C)
    ]
    served: list[pulp.LpAffineExpression] = [pulp.LpAffineExpression() for _ in range(C)]
    warm_vars: list[tuple[pulp.LpVariable, float]] = []
    # h_c: pairs of the heaviest single replica in class c (2j): the GPU holding it receives
    # and computes at least that much, which the class average alone would hide.
    h = [pulp.LpVariable(f"h{c}", 0) for c in range(C)]
    if not p.engine:
        for e in range(E):
            ts = []
            for c, cls in enumerate(p.classes):
                ub = min(len(cls.members), cls.cap)
                u = min(1.0, p.pair_cap[c] / p.pairs[e]) if p.pairs[e] > 0 else 1.0
                y = pulp.LpVariable(f"y{e}_{c}", 0, ub, cat="Integer")
                t = pulp.LpVariable(f"t{e}_{c}", 0, 1)
                prob += t <= u * y  # (2b)
                if p.pairs[e] > 0:
                    prob += h[c] >= p.pairs[e] * t - p.pairs[e] * (y - 1)  # (2j), binds when y = 1
                ts.append(t)
                rep[c][e] += y
                pairs_on[c][e] += p.pairs[e] * t
                served[c] += w[e] * t
                warm_vars.append((y, float(p.warm[c][e])))
            prob += pulp.lpSum(ts) == 1  # (2a)
        prob += pulp.lpSum(rep[c][e] for c in range(C) for e in range(E)) <= p.budget  # (2c)
        for c, cls in enumerate(p.classes):
            prob += pulp.lpSum(rep[c]) <= len(cls.members) * cls.cap  # (2c)
    else:
        n_total = sum(len(cls.members) for cls in p.classes)
        extra = p.budget - E
        max_cap = max(p.pair_cap)
        avg_slot = sum(p.pairs) / p.budget
        order = sorted(range(E), key=lambda e: -p.pairs[e])
        heavy = set(order[: min(E, 2 * extra + 8)]) if extra > 0 else set()
        warm_count = [sum(p.warm[c][e] for c in range(C)) for e in range(E)]
        r_max = [1] * E
        for e in range(E):
            r_min = max(1, math.ceil(p.pairs[e] / max_cap - 1e-9)) if p.pairs[e] > 0 else 1
            if e in heavy:
                r_hi = max(r_min, math.ceil(p.pairs[e] / max(avg_slot, 1e-9)) + 2, warm_count[e])
                options = list(range(r_min, min(n_total, extra + 1, r_hi) + 1)) or [
                    min(r_min, n_total)
                ]
            else:
                options = [max(1, min(r_min, n_total))]
                if warm_count[e] not in options and warm_count[e] >= 1:
                    options.append(warm_count[e])
            r_max[e] = max(options)
            zs = []
            for r in options:
                z = pulp.LpVariable(f"z{e}_{r}", 0, 1, cat="Binary")
                zs.append(z)
                warm_vars.append((z, 1.0 if warm_count[e] == r else 0.0))
                ys = []
                for c, cls in enumerate(p.classes):
                    fits = p.pairs[e] / r <= p.pair_cap[c] + 1e-9
                    ub = min(len(cls.members), r) if fits else 0
                    if ub == 0:
                        continue
                    y = pulp.LpVariable(f"y{e}_{c}_{r}", 0, ub, cat="Integer")
                    prob += y <= ub * z
                    if ub == 1:
                        prob += h[c] >= (p.pairs[e] / r) * y  # (2j)
                    ys.append(y)
                    rep[c][e] += y
                    pairs_on[c][e] += (p.pairs[e] / r) * y
                    served[c] += (w[e] / r) * y
                    warm_vars.append((y, float(p.warm[c][e]) if warm_count[e] == r else 0.0))
                prob += pulp.lpSum(ys) == r * z
            prob += pulp.lpSum(zs) == 1
        for c, cls in enumerate(p.classes):
            prob += pulp.lpSum(rep[c]) == p.slots * len(cls.members)  # equal slots
        lightest = min(p.pairs[e] / max(r_max[e], 1) for e in range(E))
    if not p.engine:
        lightest = 0.0
    moves = []
    for c, cls in enumerate(p.classes):
        n_c = len(cls.members)
        P_c = pulp.lpSum(pairs_on[c])
        prob += n_c * k[c] >= pulp.lpSum(rep[c])  # (2d)
        prob += tau_e >= cls.flop / n_c * P_c + cls.overhead  # (2e)
        prob += tau_e >= cls.read * k[c] + cls.act / n_c * P_c + cls.overhead  # (2f)
        # (2j) the GPU holding the heaviest lone replica; in engine form it also holds S - 1
        # other replicas of at least the lightest possible load.
        rest = (p.slots - 1) * lightest if p.engine else 0.0
        prob += tau_e >= cls.flop * (h[c] + rest) + cls.overhead
        prob += tau_c >= cls.alpha + cls.recv_us_per_pair * (h[c] + rest)
        # (2g), (2h): per channel, receive and send volumes of one GPU of class c
        for ch in range(1, len(Channel) - 1):
            src = 0.0
            dst = pulp.LpAffineExpression()
            for c2, cls2 in enumerate(p.classes):
                f = p.frac[c][c2][ch]
                if f <= 0:
                    continue
                src += cls2.share_each * len(cls2.members) * f
                dst += served[c2] * f
            bw = cls.bw[ch]
            if bw <= 0:
                continue
            if src > 0:
                prob += tau_c >= cls.alpha + p.volume_bytes / bw * src / n_c * served[c]
            if cls.share_each > 0 and dst.keys():
                prob += tau_c >= cls.alpha + p.volume_bytes / bw * cls.share_each * dst
        if p.prev is not None:
            for e in range(E):
                mv = pulp.LpVariable(f"mv{e}_{c}", 0)
                prob += mv >= rep[c][e] - p.prev[c][e]  # (2i)
                moves.append(mv)
    # (2k) links between fabric segments carry every pair that crosses them, shared
    share_of = dict(p.segment_share)
    for sa, sb, bw, alpha in p.segment_links:
        served_a = pulp.lpSum(served[c] for c in range(C) if p.class_segment[c] == sa)
        served_b = pulp.lpSum(served[c] for c in range(C) if p.class_segment[c] == sb)
        cross = share_of.get(sa, 0.0) * served_b + share_of.get(sb, 0.0) * served_a
        prob += tau_c >= alpha + p.volume_bytes / (2 * bw) * cross
    prob += tau_e + tau_c + p.migration_weight_us * pulp.lpSum(moves)
    for c in range(len(p.classes)):  # warm k_c: most replicas on one GPU of c
        warm_vars.append((k[c], float(p.warm_k[c])))
    for var, value in warm_vars:
        var.setInitialValue(value)
    # HiGHS needs a moment for presolve and the root LP; below that it proves nothing.
    limit = max(0.25, p.time_limit_s - (time.perf_counter() - started))
    out = solve_milp(prob, solver=p.solver, time_limit_s=limit, mip_gap=p.mip_gap, warm=True)
    if not math.isfinite(out.objective):
        raise InfeasibleError(
            f"MoE layer {p.layer}: {out.solver} found no placement ({out.status})"
        )
    replicas = tuple(tuple(round(pulp.value(rep[c][e]) or 0.0) for e in range(E)) for c in range(C))
    share = []
    for c in range(C):
        row = []
        for e in range(E):
            pe = p.pairs[e]
            val = float(pulp.value(pairs_on[c][e]) or 0.0)
            row.append(
                val / pe
                if pe > 0
                else (1.0 if replicas[c][e] and c == _first(replicas, e) else 0.0)
            )
        share.append(tuple(row))
    bound = out.bound
    if not math.isfinite(bound):
        # Stopped before the root LP: the LP relaxation is still a valid (weaker) bound.
        # Solving it overwrites the variables, so the answer was read out above.
        relaxed = solve_milp(
            prob, solver=p.solver, time_limit_s=5.0, mip_gap=0, warm=False, relax=True
        )
        bound = relaxed.bound if relaxed.status == "optimal" else -math.inf
    return LayerSolution(
        p.layer, replicas, tuple(share), bound, out.objective, out.status, out.solver
    )


def _first(replicas: Sequence[Sequence[int]], e: int) -> int:
    for c, row in enumerate(replicas):
        if row[e] > 0:
            return c
    return -1


def _rank_mapped(
    reference: LayerSolution, ref_pairs: Sequence[float], p: LayerProblem
) -> LayerProblem:
    """``p`` warm-started from a solved layer: the expert of load rank k in ``p`` gets the
    replicas per class that the expert of load rank k got in the reference layer. Loads of
    different layers usually have similar sorted profiles, so this start is close to optimal
    and HiGHS often only has to confirm it."""
    ref_order = sorted(range(len(ref_pairs)), key=lambda e: -ref_pairs[e])
    order = sorted(range(len(p.pairs)), key=lambda e: -p.pairs[e])
    warm = [[0] * len(p.pairs) for _ in p.classes]
    for rank, e in enumerate(order):
        e_ref = ref_order[rank]
        for c in range(len(p.classes)):
            warm[c][e] = reference.replicas[c][e_ref]
    warm_k = tuple(
        p.slots if p.engine else -(-sum(warm[c]) // len(cls.members))
        for c, cls in enumerate(p.classes)
    )
    return replace(p, warm=tuple(tuple(r) for r in warm), warm_k=warm_k)


def _solve_layers(
    problems: Sequence[LayerProblem], workers: int, first_weight: float = 1.0
) -> list[LayerSolution]:
    """Solve one layer (with ``first_weight`` times the per-layer time, since every other
    layer starts from its answer), warm-start the others from it by load rank, and solve
    them in parallel."""
    if not problems:
        return []
    first = _solve_layer(replace(problems[0], time_limit_s=problems[0].time_limit_s * first_weight))
    rest = list(problems[1:])
    if math.isfinite(first.objective_us) and problems[0].prev is None:
        rest = [_rank_mapped(first, problems[0].pairs, p) for p in rest]
    if workers > 1 and len(rest) > 1:
        # fork is cheap and safe while this process runs no other thread; a threaded host
        # (the gRPC controller) gets spawn, which needs its main module import-guarded.
        method = "fork" if threading.active_count() == 1 and os.name == "posix" else "spawn"
        ctx = multiprocessing.get_context(method)
        with ProcessPoolExecutor(max_workers=min(workers, len(rest)), mp_context=ctx) as pool:
            others = list(pool.map(_solve_layer, rest, chunksize=1))
    else:
        others = [_solve_layer(p) for p in rest]
    return [first, *others]


# ------------------------------------------------------------------------ stage 3


def _assign_class(
    members: Sequence[int],
    items: list[tuple[float, int]],
    slots: Sequence[int],
    prev_held: Sequence[set[int]],
    penalty: float,
    merge: bool,
) -> list[list[tuple[int, float]]]:
    """Place replicas (pairs, expert) on a class's GPUs: heaviest first onto the GPU with the
    lowest load plus re-planning penalty, then pairwise swaps to lower the maximum.

    When re-planning (``penalty > 0``), replicas first stay on GPUs that held their expert
    before, as far as the class keeps that many replicas, and no swap moves them: the moves
    are then exactly the new replicas the MILP priced.

    Returns per member GPU a list of (expert, pairs)."""
    n = len(members)
    load = [0.0] * n
    held: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    has: list[set[int]] = [set() for _ in range(n)]
    pinned: set[tuple[int, int]] = set()
    todo = sorted(items, key=lambda x: (-x[0], x[1]))
    if penalty > 0:
        rest = []
        for pairs, e in todo:
            keep = [
                g
                for g in range(n)
                if e in prev_held[g] and e not in has[g] and len(held[g]) < slots[g]
            ]
            if keep:
                g = min(keep, key=lambda x: load[x])
                held[g].append((e, pairs))
                has[g].add(e)
                load[g] += pairs
                pinned.add((g, e))
            else:
                rest.append((pairs, e))
        todo = rest
    for pairs, e in todo:
        best, best_cost = -1, math.inf
        for g in range(n):
            if len(held[g]) >= slots[g] or e in has[g]:
                continue
            cost = load[g] + pairs + (0.0 if e in prev_held[g] else penalty)
            if cost < best_cost - 1e-12:
                best, best_cost = g, cost
        if best < 0:  # every GPU with room already holds e
            holders = [g for g in range(n) if e in has[g]]
            if merge and holders:  # native form: one replica per GPU takes the extra pairs
                g = min(holders, key=lambda x: load[x])
                held[g] = [(ee, pp + pairs if ee == e else pp) for ee, pp in held[g]]
                load[g] += pairs
                continue
            best = make_room(held, has, load, slots, e)
            if best < 0:  # cannot happen with a feasible class solution; keep it visible
                best = max(range(n), key=lambda g: slots[g] - len(held[g]))
        held[best].append((e, pairs))
        has[best].add(e)
        load[best] += pairs
    # Pairwise swaps between the most-loaded GPU and the others.
    for _ in range(4 * n * max(1, max(slots, default=1))):
        g_max = max(range(n), key=lambda g: load[g])
        improved = False
        for g in sorted(range(n), key=lambda g: load[g]):
            if g == g_max:
                continue
            gap = load[g_max] - load[g]
            best_swap: tuple[float, int, int] | None = None
            for a_idx, (ea, pa) in enumerate(held[g_max]):
                if ea in has[g]:
                    continue
                for b_idx, (eb, pb) in enumerate(held[g]):
                    delta = pa - pb
                    if not 0 < delta < gap or eb in has[g_max]:
                        continue
                    # pairs off the busiest GPU, less the re-planning price of the replicas
                    # this swap takes away from GPUs that held them before
                    away = int(ea not in prev_held[g]) + int(eb not in prev_held[g_max])
                    home = int(ea not in prev_held[g_max]) + int(eb not in prev_held[g])
                    value = min(delta, gap - delta) - penalty * (away - home)
                    if value > 1e-9 and (best_swap is None or value > best_swap[0]):
                        best_swap = (value, a_idx, b_idx)
            if best_swap is not None:
                _, a_idx, b_idx = best_swap
                ea, pa = held[g_max][a_idx]
                eb, pb = held[g][b_idx]
                held[g_max][a_idx], held[g][b_idx] = (eb, pb), (ea, pa)
                has[g_max].discard(ea)
                has[g_max].add(eb)
                has[g].discard(eb)
                has[g].add(ea)
                load[g_max] += pb - pa
                load[g] += pa - pb
                improved = True
                break
        if not improved:
            break
    return held


def _rebalance_native(
    table: CostTable,
    members: Sequence[int],
    held: list[list[tuple[int, float]]],
    comm_us_per_pair: float,
    solver: str,
) -> list[list[tuple[int, float]]]:
    """LP: re-split each expert's class pairs over its replicas in the class to minimise
    the most-loaded GPU's expert time plus its receive time (``comm_us_per_pair`` per pair
    served), so a class whose expert time sits on its weight-read floor still spreads
    traffic evenly."""
    by_expert: dict[int, list[int]] = {}
    for g, slots in enumerate(held):
        for e, _ in slots:
            by_expert.setdefault(e, []).append(g)
    if all(len(gs) == 1 for gs in by_expert.values()):
        return held
    prob = pulp.LpProblem("split", pulp.LpMinimize)
    tau = pulp.LpVariable("tau", 0)
    most = pulp.LpVariable("most_pairs", 0)
    x: dict[tuple[int, int], pulp.LpVariable] = {}
    class_pairs = {
        e: sum(pp for g2 in gs for ee, pp in held[g2] if ee == e) for e, gs in by_expert.items()
    }
    for e, gs in by_expert.items():
        for g in gs:
            x[e, g] = pulp.LpVariable(f"x{e}_{g}", 0)
        prob += pulp.lpSum(x[e, g] for g in gs) == class_pairs[e]
    for g, slots in enumerate(held):
        c = table.gpus[members[g]]
        P = pulp.lpSum(x[e, g] for e, _ in slots)
        prob += tau >= c.expert_flop_us_per_pair * P
        prob += tau >= c.expert_read_us_per_replica * len(slots) + c.expert_act_us_per_pair * P
        prob += most >= P
    prob += tau + comm_us_per_pair * most
    out = solve_milp(prob, solver=solver, time_limit_s=2, mip_gap=0, warm=False)
    if out.status != "optimal":
        return held
    return [[(e, float(x[e, g].varValue or 0.0)) for e, _ in slots] for g, slots in enumerate(held)]


# ------------------------------------------------------------------------ driver


def _recv_us_per_pair(table: CostTable, cls: ClassCost, share: Sequence[float]) -> float:
    """Receive time per token-expert pair served by a GPU of ``cls``, us (slowest channel)."""
    i = cls.members[0]
    by_channel = [0.0] * len(Channel)
    for j, ch in enumerate(table.topology.channel[i]):
        if ch != Channel.LOCAL:
            by_channel[ch] += share[j]
    return max(
        (
            table.bytes_per_copy * by_channel[ch] / cls.bw[ch]
            for ch in range(1, len(Channel))
            if cls.bw[ch] > 0
        ),
        default=0.0,
    )


def _previous_layers(req: PlacementRequest, table: CostTable) -> list[LayerPlacement] | None:
    """The previous plan's placement on this fleet, or None when its GPUs differ."""
    prev = req.previous
    if prev is None or [g.gpu for g in prev.gpus] != list(table.gpu_ids):
        return None
    if any(len(g.experts) != table.num_moe_layers for g in prev.gpus):
        return None
    return [
        LayerPlacement(tuple(tuple((s.expert, s.share) for s in g.experts[li]) for g in prev.gpus))
        for li in range(table.num_moe_layers)
    ]


def _previous_start(
    req: PlacementRequest,
    table: CostTable,
    classes: Sequence[ClassCost],
    prev_counts: Sequence[tuple[tuple[int, ...], ...] | None],
    caps: Sequence[int],
    engine: bool,
) -> tuple[list[tuple[int, ...]], list[bool]]:
    """Per layer: most replicas on one GPU of each class in the previous plan, and whether
    that plan is a valid start here (every expert still covered, slots within the caps)."""
    ks: list[tuple[int, ...]] = []
    fits: list[bool] = []
    held = {}
    if req.previous is not None:
        held = {g.gpu: g.experts for g in req.previous.gpus}
    for li, counts in enumerate(prev_counts):
        if counts is None:
            ks.append(())
            fits.append(False)
            continue
        per_gpu = [len(held[gid][li]) if gid in held else 0 for gid in table.gpu_ids]
        k = tuple(max(per_gpu[i] for i in c.members) for c in classes)
        covered = all(
            sum(counts[c][e] for c in range(len(classes))) >= 1 for e in range(table.num_experts)
        )
        within = all(per_gpu[i] <= caps[i] for i in range(table.num_gpus))
        if engine:
            within = within and all(per_gpu[i] == caps[i] for i in range(table.num_gpus))
        ks.append(k)
        fits.append(covered and within)
    return ks, fits


def _warm_counts(
    classes: Sequence[ClassCost], placement: LayerPlacement, num_experts: int
) -> tuple[tuple[int, ...], ...]:
    out = []
    for cls in classes:
        row = [0] * num_experts
        for i in cls.members:
            for e, _ in placement.per_gpu[i]:
                row[e] += 1
        out.append(tuple(row))
    return tuple(out)


def _prev_counts(
    req: PlacementRequest, table: CostTable, classes: Sequence[ClassCost], layer: int
) -> tuple[tuple[int, ...], ...] | None:
    if req.previous is None:
        return None
    held = {
        g.gpu: {s.expert for s in g.experts[layer]}
        for g in req.previous.gpus
        if layer < len(g.experts)
    }
    out = []
    for cls in classes:
        row = [0] * table.num_experts
        for i in cls.members:
            for e in held.get(table.gpu_ids[i], set()):
                row[e] += 1
        out.append(tuple(row))
    return tuple(out)


def place(req: PlacementRequest, table: CostTable) -> RawPlacement:
    """Solve the three stages (see module docstring)."""
    started = time.perf_counter()
    n = table.num_gpus
    groups = _class_of(table, req)
    share, reserve, attn_us = _choose_attention(req, table, groups)
    heads: list[int] | None = None
    if req.form == "native":
        share, heads = heads_rounding(req, share)
    notes = [f"{len(groups)} classes of identical GPUs; attention by LP, experts per layer by MILP"]
    if table.num_moe_layers == 0:
        evaluate(table, share, ())
        return RawPlacement(
            tuple(share),
            (),
            tuple(heads) if heads else None,
            attn_us,
            "HiGHS optimal (LP)",
            tuple(notes),
        )
    engine = req.form == "engine"
    S = slots_per_gpu(table.num_experts, req.redundant_experts, n)
    # Warm start and upper bound: the greedy plan with these attention shares.
    caps = [S] * n if engine else [max(1, math.floor(r + 1e-6)) for r in reserve]
    budget = min(table.num_experts + req.redundant_experts, sum(caps))
    warm_layers = []

    for li in range(table.num_moe_layers):
        weight = [table.pairs(li, e) for e in range(table.num_experts)]
        phy = replicate_capped(weight, budget, table.num_gpus)
        warm_layers.append(greedy.pack_layer(table, li, phy, caps))
    warm_eval = evaluate(table, share, warm_layers)
    classes = tuple(
        ClassCost(
            members=tuple(m),
            share_each=share[m[0]],
            cap=caps[m[0]],
            flop=table.gpus[m[0]].expert_flop_us_per_pair,
            read=table.gpus[m[0]].expert_read_us_per_replica,
            act=table.gpus[m[0]].expert_act_us_per_pair,
            overhead=table.gpus[m[0]].expert_overhead_us,
            alpha=table.gpus[m[0]].comm_alpha_us,
            bw=tuple(min(x, 1e12) for x in table.gpus[m[0]].comm_bw_bytes_per_us),
        )
        for m in groups
    )
    classes = tuple(
        replace(c, recv_us_per_pair=_recv_us_per_pair(table, c, share)) for c in classes
    )
    frac = _class_frac(table, groups)
    seg_share: dict[int, float] = {}
    for i, seg in enumerate(table.segment):
        seg_share[seg] = seg_share.get(seg, 0.0) + share[i]
    volume = table.total_tokens * table.top_k * table.bytes_per_copy
    workers = req.options.workers or (os.cpu_count() or 1)
    # The time limit is a wall-clock budget for the whole solve: what is left after stage 1
    # and the warm start is shared by the layers, ``workers`` at a time.
    left = max(0.0, req.options.time_limit_s - (time.perf_counter() - started))
    rest_waves = math.ceil((table.num_moe_layers - 1) / workers)
    first_weight = 4.0 if rest_waves >= 8 else 1.0  # the first layer runs alone, longer
    waves = first_weight + rest_waves
    # keep some of each wave for building the model and realising its answer
    per_layer_limit = max(0.05, 0.85 * left / max(waves, 1))
    prev_counts = [_prev_counts(req, table, classes, li) for li in range(table.num_moe_layers)]
    prev_k, prev_fits = _previous_start(req, table, classes, prev_counts, caps, engine)
    problems = []
    for li in range(table.num_moe_layers):
        lt = warm_eval.moe_layers[li]
        ub = max(lt.expert_us) + max(lt.comm_us) - min(c.alpha for c in classes)
        pair_cap = tuple(
            max(0.0, min((ub - c.overhead) / c.flop, (ub - c.overhead - c.read) / c.act))
            for c in classes
        )
        problems.append(
            LayerProblem(
                layer=li,
                engine=engine,
                pairs=tuple(table.pairs(li, e) for e in range(table.num_experts)),
                classes=classes,
                frac=frac,
                class_segment=tuple(table.segment[c.members[0]] for c in classes),
                segment_share=tuple(seg_share.items()),
                segment_links=table.segment_links,
                volume_bytes=volume,
                budget=budget,
                slots=S,
                pair_cap=pair_cap,
                prev=prev_counts[li],
                # re-planning starts from the previous placement (zero moves) when it still
                # fits the slots; otherwise from the greedy plan
                warm=prev_counts[li]  # type: ignore[arg-type]  # prev_fits implies not None
                if prev_fits[li]
                else _warm_counts(classes, warm_layers[li], table.num_experts),
                warm_k=prev_k[li]
                if prev_fits[li]
                else tuple(
                    max(len(warm_layers[li].per_gpu[i]) for i in c.members) for c in classes
                ),
                migration_weight_us=migration_weight_us(req),
                time_limit_s=per_layer_limit,
                mip_gap=req.options.mip_gap,
                solver=req.options.solver,
            )
        )
    solutions = _solve_layers(problems, workers, first_weight)
    layers = []
    bound = attn_us
    statuses: dict[str, int] = {}
    prev_sets = None
    if req.previous is not None:
        prev_sets = {
            g.gpu: [{s.expert for s in layer} for layer in g.experts] for g in req.previous.gpus
        }
    for sol in solutions:
        statuses[sol.status] = statuses.get(sol.status, 0) + 1
        bound += sol.bound_us
        per_gpu: list[tuple[tuple[int, float], ...]] = [() for _ in range(n)]
        for c, cls in enumerate(classes):
            items = []
            for e in range(table.num_experts):
                cnt = sol.replicas[c][e]
                if cnt <= 0:
                    continue
                pe = table.pairs(sol.layer, e) * sol.share[c][e]
                items.extend([(pe / cnt, e)] * cnt)
            members = cls.members
            prev_held = [
                (
                    prev_sets.get(table.gpu_ids[i], [set()] * (sol.layer + 1))[sol.layer]
                    if prev_sets
                    else set()
                )
                for i in members
            ]
            slots = [S if engine else cls.cap for _ in members]
            if not engine:
                total = len(items)
                base, extra = divmod(total, len(members))
                slots = [min(cls.cap, base + (1 if g < extra else 0)) for g in range(len(members))]
                if sum(slots) < total:
                    slots = [cls.cap] * len(members)
            penalty = migration_weight_us(req) / cls.flop if req.previous is not None else 0.0
            held = _assign_class(members, items, slots, prev_held, penalty, merge=not engine)
            if not engine:
                held = _rebalance_native(
                    table, members, held, cls.recv_us_per_pair, req.options.solver
                )
            for g, i in enumerate(members):
                per_gpu[i] = tuple((e, pp) for e, pp in held[g])
        # Convert pairs to shares of each expert's pairs.
        out_gpu = []
        replicas_of: dict[int, int] = {}
        for slots_i in per_gpu:
            for e, _ in slots_i:
                replicas_of[e] = replicas_of.get(e, 0) + 1
        for slots_i in per_gpu:
            row = []
            for e, pp in slots_i:
                pe = table.pairs(sol.layer, e)
                s = (1.0 / replicas_of[e]) if engine or pe <= 0 else pp / pe
                row.append((e, s))
            out_gpu.append(tuple(row))
        if not engine:  # a replica the share LP left idle only costs memory: drop it
            out_gpu = [tuple((e, x) for e, x in row if x > 1e-9) for row in out_gpu]
        layers.append(LayerPlacement(_normalise(tuple(out_gpu), table.num_experts)))
    # Safety net: per layer keep the better of the MILP's realisation and the greedy warm
    # start under the same attention shares (moves priced in when re-planning).
    fallback = 0
    for li in range(len(layers)):
        mine = _layer_cost(req, table, share, li, layers[li])
        theirs = _layer_cost(req, table, share, li, warm_layers[li])
        if theirs < mine - 1e-9:
            layers[li] = warm_layers[li]
            fallback += 1
    if fallback:
        notes.append(f"{fallback} layer(s) kept the greedy warm start, which realised better")
    if req.previous is not None:
        notes.append("re-planning: objective includes expert moves, so the bound is not reported")
        kept = _previous_layers(req, table)
        if kept is not None:
            # Keeping the previous plan as it is (no moves) is always a candidate.
            old_share = [g.attention_share for g in req.previous.gpus]
            lam = migration_weight_us(req)
            new_cost = evaluate(table, share, layers).step_time_us + lam * (
                count_moves(req.previous, table.gpu_ids, layers) or 0
            )
            old_eval = evaluate(table, old_share, kept)
            if old_eval.feasible and old_eval.step_time_us <= new_cost:
                return RawPlacement(
                    tuple(old_share),
                    tuple(kept),
                    tuple(g.attention_heads or 0 for g in req.previous.gpus) if heads else None,
                    None,
                    "previous plan kept",
                    (*notes, "no re-placement paid for its moves; the previous placement stands"),
                )
    status = ", ".join(f"{k} x{v}" for k, v in sorted(statuses.items()))
    solver_name = solutions[0].solver if solutions else "HiGHS"
    if req.previous is None:
        # Whole-plan safety net: the greedy plan with its own attention shares.
        ours = evaluate(table, share, layers)
        fallback_raw = greedy.place(req, table)
        alt = evaluate(table, fallback_raw.attention_share, fallback_raw.layers)
        if alt.feasible and (alt.step_time_us < ours.step_time_us - 1e-9 or not ours.feasible):
            return replace_raw(
                fallback_raw,
                solver=f"{solver_name} ({status}); greedy plan kept",
                notes=(
                    *notes,
                    "the greedy plan realised better than the MILP's; no bound reported",
                ),
            )
    return RawPlacement(
        tuple(share),
        tuple(layers),
        tuple(heads) if heads else None,
        None if req.previous is not None else bound,
        f"{solver_name} ({status})",
        tuple(notes),
    )


def replace_raw(raw: RawPlacement, *, solver: str, notes: tuple[str, ...]) -> RawPlacement:
    """``raw`` with another solver label and notes."""
    return RawPlacement(raw.attention_share, raw.layers, raw.attention_heads, None, solver, notes)


def _layer_cost(
    req: PlacementRequest, table: CostTable, share: Sequence[float], li: int, layer: LayerPlacement
) -> float:
    """Comm + expert phase time of one layer, plus the move penalty when re-planning, us."""
    served = served_fractions(table, li, layer)
    comm = comm_times_us(table, share, served)
    exp = [
        table.expert_us(i, served[i] * table.total_tokens * table.top_k, len(slots))
        for i, slots in enumerate(layer.per_gpu)
    ]
    cost = max(max(comm), link_time_us(table, share, served)) + max(exp)
    if req.previous is not None:
        empty = LayerPlacement(tuple(() for _ in table.gpu_ids))
        moves = count_moves(req.previous, table.gpu_ids, [empty] * li + [layer]) or 0
        cost += migration_weight_us(req) * moves
    return cost


def _normalise(
    per_gpu: tuple[tuple[tuple[int, float], ...], ...], num_experts: int
) -> tuple[tuple[tuple[int, float], ...], ...]:
    """Make each expert's shares sum to exactly 1 (solver round-off) and drop empty slots
    in native form."""
    total = [0.0] * num_experts
    for slots in per_gpu:
        for e, s in slots:
            total[e] += s
    return tuple(
        tuple((e, s / total[e] if total[e] > 0 else s) for e, s in slots) for slots in per_gpu
    )

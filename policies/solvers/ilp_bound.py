"""Proven lower bounds on the step time, for the ``ilp`` policy's plans.

Two bounds, each a valid bound of the problem its name gives:

* :func:`global_bound` - no placement of the request beats it: any attention shares that fit
  memory (or the equal shares of an engine that balances DP ranks itself), any replicas per
  GPU within memory and the slot rules of the form, any split of an expert's tokens over its
  replicas - so it holds whatever replica choice the engine makes.
* :func:`conditional_bound` - no placement with the given attention shares beats it: it says
  how far the experts' side of a plan is from the best its shares allow.

Both are optima of the relaxation of :mod:`policies.solvers.ilp_relax`, written over classes of
GPUs that are interchangeable in the cost model (:func:`equitable_classes`). With the shares
given, every MoE layer is a block of its own and the dispatch volumes are exact. With free
shares a dispatch volume is a product of two class totals (attention share and served
fraction); a branch and bound over boxes of the attention shares narrows their McCormick
envelopes, and the bound is the least of the open boxes' optima (best box first, at most
``MAX_BOXES`` boxes: a work limit, so the bound is the same on any machine). The layers are
then one block whose constants are the layers' averages (valid for their sum).

The expert-phase floor of a layer (:func:`expert_floor_us`) covers what class totals cannot
see: an expert's pairs are served only by the GPUs holding its replicas. HiGHS's proven dual
bound is reported, less a relative 1e-6 for its tolerances.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from policies.estimate.costmodel import CostTable
from policies.estimate.engines import Runtime
from policies.estimate.execution import runtime_of
from policies.hardware.topology import Channel
from policies.request import PlacementRequest
from policies.solvers.common import slots_per_gpu
from policies.solvers.ilp_relax import ClassData, Profile, Relaxation, reach_counts
from policies.solvers.milp import Limits

MAX_BOXES = 160
"""Work limit of the branch and bound over attention shares (relaxations solved)."""

_MAX_NODES = 10_000  # per relaxation; it has at most one binary per class
_TANGENTS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Bound:
    """A proven lower bound on the step time.

    Attributes:
        value_us: the bound, us.
        status: ``optimal`` when the relaxation was solved to the end; ``work_limit`` when
            the branch and bound stopped at ``MAX_BOXES`` (the bound holds, weaker); or the
            solver's status.
        classes: classes of interchangeable GPUs the relaxation was written over.
        boxes: relaxations solved.
        share: per GPU, the attention shares (every GPU of a class the same) at which the
            relaxation's value was the least found (global bound with free shares): a
            candidate for the plan; None otherwise.
    """

    value_us: float
    status: str
    classes: int
    boxes: int
    share: tuple[float, ...] | None = None


def equitable_classes(table: CostTable, key: Sequence[Hashable] | None = None) -> list[list[int]]:
    """GPUs grouped so that GPUs of one group have the same cost coefficients (and ``key``),
    and every GPU of a group reaches the same number of GPUs of every group over every
    channel; fleet order. Refined from the coefficients until stable."""
    n = table.num_gpus
    channel = np.asarray(table.topology.channel)
    if n and not np.array_equal(channel, channel.T):  # asymmetric links: one GPU per group
        return [[i] for i in range(n)]
    labels = [
        (repr(table.gpus[i]), table.kv_split(i), None if key is None else key[i]) for i in range(n)
    ]
    ids = _relabel(labels)
    while True:
        count = max(ids, default=-1) + 1
        onehot = np.zeros((n, count))
        onehot[np.arange(n), ids] = 1.0
        profile = [
            (
                ids[i],
                tuple(int(x) for ch in range(len(Channel)) for x in (channel[i] == ch) @ onehot),
            )
            for i in range(n)
        ]
        new = _relabel(profile)
        if max(new, default=-1) + 1 == count:
            break
        ids = new
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    return list(groups.values())


def _relabel(labels: Sequence[Hashable]) -> list[int]:
    """Dense ids in order of first appearance."""
    seen: dict[Hashable, int] = {}
    return [seen.setdefault(x, len(seen)) for x in labels]


def global_bound(
    req: PlacementRequest, table: CostTable, wall_s: float, max_boxes: int = MAX_BOXES
) -> Bound | None:
    """The least step time of any placement of the request (module docstring), with at
    most ``max_boxes`` relaxations; None when no share vector fits memory or the
    relaxation cannot be solved (it proves nothing)."""
    if req.engine.equal_dp:  # the engine's balancer fixes every share at 1/n
        return conditional_bound(req, table, [1.0 / table.num_gpus] * table.num_gpus, wall_s)
    setup = _Setup(req, table, None)
    root = [(0.0, min(1.0, c.size * c.a_cap)) for c in setup.classes]
    if sum(hi for _, hi in root) < 1 - 1e-9:
        return None
    return _branch_and_bound(setup, root, wall_s, max_boxes)


def conditional_bound(
    req: PlacementRequest, table: CostTable, share: Sequence[float], wall_s: float
) -> Bound | None:
    """The least step time of any placement with attention shares ``share`` (per GPU)."""
    setup = _Setup(req, table, [round(x, 12) for x in share])
    box = [(sum(share[i] for i in c.members),) * 2 for c in setup.classes]
    rx = setup.relaxation(box, setup.layers)
    out = rx.solve(req.options.solver, Limits(max_nodes=_MAX_NODES, wall_s=wall_s))
    if not math.isfinite(out.bound):
        return None
    return Bound(_margin(out.bound), out.status, len(setup.classes), 1)


def exchange_rule(runtime: Runtime) -> str:
    """How the relaxation models dispatch+combine under ``runtime``: ``allgather`` (every GPU
    gets every token), ``proportional`` (every rank spreads an expert's tokens over its
    replicas in the same proportions: ``planned`` and ``even``) or ``any`` (replicas picked
    by locality, SGLang ``static``/``dynamic``: any routing of tokens to replicas)."""
    if runtime.exchange_in(decode=True) == "allgather":  # the same in both phases
        return "allgather"
    return "any" if runtime.dispatch in ("static", "dynamic") else "proportional"


def _margin(value: float) -> float:
    return max(0.0, value - _TOLERANCE * abs(value) - _TOLERANCE)


def _branch_and_bound(
    setup: _Setup, root: list[tuple[float, float]], wall_s: float, max_boxes: int
) -> Bound | None:
    """Best-first branch and bound over boxes of the class attention totals: split the
    lowest box's widest side in two until ``max_boxes`` relaxations are solved or the lowest
    box is within the tolerance of the relaxation's value at its own optimum's shares.
    Returns the least box optimum, with those shares. The wall clock ``wall_s`` is a safety
    net of each relaxation only."""
    limits = Limits(max_nodes=_MAX_NODES, wall_s=wall_s)
    heap: list[tuple[float, int, list[tuple[float, float]], list[float]]] = []
    solved = 0
    best_point = math.inf  # the relaxation's value at fixed shares: >= its minimum
    best_totals: list[float] = []  # ... and those shares

    def push(box: list[tuple[float, float]]) -> None:
        nonlocal solved
        rx = setup.relaxation(box, setup.merged_blocks)
        out = rx.solve(setup.solver, limits)
        solved += 1
        totals = rx.shares(out)
        if out.status == "infeasible":
            return  # no share vector in this box fits: nothing to cover
        heapq.heappush(heap, (out.bound, solved, box, totals or []))

    push(root)
    while heap and solved < max_boxes:
        low, _, box, totals = heap[0]
        if not math.isfinite(low) or low >= best_point * (1 - 1e-4):
            break
        if totals:  # the relaxation at this box's optimal shares
            value = _point_value(setup, totals, limits)
            solved += 1
            if value < best_point:
                best_point, best_totals = value, totals
        side = max(range(len(box)), key=lambda c: (box[c][1] - box[c][0], -c))
        lo, hi = box[side]
        if hi - lo <= 1e-7 or low >= best_point * (1 - 1e-4):
            break
        heapq.heappop(heap)
        mid = 0.5 * (lo + hi)
        for part in ((lo, mid), (mid, hi)):
            push([part if c == side else b for c, b in enumerate(box)])
    if not heap:
        return None
    low = heap[0][0]
    status = "optimal" if low >= best_point * (1 - 1e-4) else "work_limit"
    share = None
    totals = best_totals
    if totals:
        share = [0.0] * setup.table.num_gpus
        for c, cls in enumerate(setup.classes):
            for i in cls.members:
                share[i] = max(0.0, totals[c]) / cls.size
        total = sum(share)
        share = [x / total for x in share] if total > 0 else None
    value = _margin(min(low, best_point))
    return Bound(value, status, len(setup.classes), solved, None if share is None else tuple(share))


def _point_value(setup: _Setup, totals: Sequence[float], limits: Limits) -> float:
    """The relaxation's value at the class attention totals ``totals`` (every GPU of a
    class the same share), or inf."""
    point = [max(0.0, x) for x in totals]
    total = sum(point)
    if total <= 0:
        return math.inf
    point = [x / total for x in point]
    out = setup.relaxation([(x, x) for x in point], setup.merged_blocks).solve(setup.solver, limits)
    return out.bound if math.isfinite(out.bound) else math.inf


class _Setup:
    """Classes, per-layer profiles and their merged block for one request."""

    def __init__(
        self, req: PlacementRequest, table: CostTable, key: Sequence[Hashable] | None
    ) -> None:
        runtime = runtime_of(req)
        # The exchange the engine runs in this phase, whatever the caller's table says.
        table = replace(table, exchange=runtime.exchange_in(table.decode))
        self.table, self.solver = table, req.options.solver
        self.engine = req.form == "engine"
        self.rule = exchange_rule(runtime)
        E = table.num_experts
        self.slots = slots_per_gpu(E, req.redundant_experts, table.num_gpus) if E else 0
        self.budget = E + req.redundant_experts
        groups = equitable_classes(table, key)
        reserve = self.slots * table.num_moe_layers * table.expert_bytes if self.engine else 0.0
        reach = reach_counts(table, groups)
        self.classes = [
            ClassData(tuple(g), _share_cap(table, g[0], reserve), reach[c])
            for c, g in enumerate(groups)
        ]
        self.tops: list[list[float]] = []
        self.layers = [self._profile(li) for li in range(table.num_moe_layers)]
        self.merged = _merge(self.layers, self.tops)
        self.merged_blocks = [self.merged] if self.layers else []

    def relaxation(
        self, box: Sequence[tuple[float, float]], blocks: Sequence[Profile]
    ) -> Relaxation:
        rx = Relaxation(
            self.table, self.classes, self.engine, self.slots, self.budget, box, self.rule
        )
        rx.attention()
        for p in blocks:
            rx.block(p)
        return rx

    def _profile(self, li: int) -> Profile:
        t = self.table
        E = t.num_experts
        load = sorted(t.load[li], reverse=True)
        total = sum(load) or 1.0
        prefix = [0.0, *np.cumsum([x / total for x in load]).tolist()]
        caps = []
        for c in self.classes:
            if self.engine:
                most = self.slots
            else:
                g = t.gpus[c.members[0]]
                free = max(0.0, g.usable_bytes - g.fixed_bytes)
                most = int(free // t.expert_bytes) if t.expert_bytes > 0 else E
            caps.append(min(1.0, prefix[min(E, most)]))
        class_cap = tuple(min(1.0, prefix[min(E, self.slots * c.size)]) for c in self.classes)
        self.tops.append(prefix)
        tangents = tangent_lines(prefix)
        floor = expert_floor_us(t, li, self.engine, self.slots, self.budget)
        pairs = t.total_tokens * t.top_k * sum(t.load[li])
        return Profile(
            1.0, pairs, tuple(caps), tuple(caps), class_cap, floor, tangents, tuple(prefix)
        )


def _merge(layers: Sequence[Profile], top: Sequence[Sequence[float]]) -> Profile:
    """One block for all layers (``top``: each layer's loads of its k heaviest experts):
    averages of constants that stand alone in a row, worst cases of those that multiply a
    variable, tangents of the concave hull of the pointwise largest ``top``."""
    if not layers:
        return Profile(0.0, 0.0, (), (), (), 0.0, ())
    n = len(layers)
    C = len(layers[0].cap)

    def mean(xs: Sequence[float]) -> float:
        return sum(xs) / n

    cap = tuple(mean([p.cap[c] for p in layers]) for c in range(C))
    worst = tuple(max(p.cap_worst[c] for p in layers) for c in range(C))
    class_cap = tuple(mean([p.class_cap[c] for p in layers]) for c in range(C))
    largest = [max(col) for col in zip(*top, strict=True)]
    return Profile(
        float(n),
        mean([p.pairs for p in layers]),
        cap,
        worst,
        class_cap,
        mean([p.floor_us for p in layers]),
        tangent_lines(largest),
        tuple(largest),
    )


def tangent_lines(values: Sequence[float]) -> tuple[tuple[float, float], ...]:
    """``(intercept, slope)`` lines, each at or above the whole concave hull of the points
    ``(k, values[k])`` (so above the piecewise-linear ``values`` everywhere): the hull's
    segments over ``[j, j + 1]`` for j in a fixed ladder."""
    hull: list[int] = []  # indices of the upper concave hull, left to right
    for k in range(len(values)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when it lies on or below the line from a to k
            if (values[b] - values[a]) * (k - a) <= (values[k] - values[a]) * (b - a):
                hull.pop()
            else:
                break
        hull.append(k)
    lines: dict[tuple[float, float], None] = {}
    seg = 0
    for j in _TANGENTS:
        if j + 1 >= len(values):
            break
        while seg + 1 < len(hull) - 1 and hull[seg + 1] <= j:
            seg += 1
        a, b = hull[seg], hull[seg + 1]
        slope = (values[b] - values[a]) / (b - a)
        lines[(values[a] - slope * a, slope)] = None
    return tuple(lines)


def _share_cap(table: CostTable, i: int, reserve_bytes: float) -> float:
    """Largest attention share GPU i's memory allows next to ``reserve_bytes`` of experts
    (KV and activations are at least linear in the share: ``mem(a) >= a * mem(1)``)."""
    c = table.gpus[i]
    room = c.usable_bytes - c.fixed_bytes - reserve_bytes
    if room <= 0 or table.kv_cache_bytes(i, 1e-9) > room:
        return 0.0
    per_share = table.kv_cache_bytes(i, table.total_tokens) + (
        table.total_tokens * table.act_bytes_per_token
    )
    return min(1.0, room / per_share) if per_share > 0 else 1.0


def expert_floor_us(table: CostTable, li: int, engine: bool, slots: int, budget: int) -> float:
    """(b7): a time below which no placement's expert phase of layer ``li`` can end, us.

    At time t a GPU serves at most ``cap(t) = min((t - o) / f, (t - o - r k) / b)`` pairs
    (k = ``slots`` in engine form, at least 1 in native form) and at most its ``k`` heaviest
    experts' pairs. Feasibility needs: the caps cover all pairs; for every j, the j heaviest
    experts (on at most ``j + budget - E`` GPUs) fit the largest that many caps; in native
    form the replicas fit (``sum (t - o - b P_i) / r >= E`` with the pairs on the GPUs that
    read weights cheapest per pair); in engine form every GPU's ``r S + o`` passes. Every
    condition only loosens as t grows, so bisection finds the first t meeting them all and
    returns a t that fails (a proven lower bound)."""
    t = table
    E = t.num_experts
    pairs = sorted((t.pairs(li, e) for e in range(E)), reverse=True)
    total = sum(pairs)
    if total <= 0 or not t.num_gpus:
        return 0.0
    cum = np.cumsum(pairs)
    extra = max(0, budget - E)
    n = t.num_gpus
    m_j = np.minimum(n, np.arange(1, E + 1) + extra)
    k_each = slots if engine else 1
    top_k_pairs = float(cum[min(E, max(k_each, 1)) - 1]) if engine else total
    g = t.gpus
    o = np.array([x.expert_overhead_us for x in g])
    f = np.array([x.expert_flop_us_per_pair for x in g])
    r = np.array([x.expert_read_us_per_replica for x in g])
    b = np.array([x.expert_act_us_per_pair for x in g])

    def ok(time_us: float) -> bool:
        if engine and np.any(time_us < o + r * slots):
            return False
        with np.errstate(divide="ignore", invalid="ignore"):
            cap = np.minimum((time_us - o) / f, (time_us - o - r * k_each) / np.maximum(b, 1e-30))
        cap = np.clip(np.nan_to_num(cap, nan=0.0, posinf=total), 0.0, top_k_pairs)
        if cap.sum() < total * (1 - 1e-12):
            return False
        best = np.concatenate(([0.0], np.cumsum(np.sort(cap)[::-1])))
        if np.any(best[m_j] < cum * (1 - 1e-12)):
            return False
        return engine or _replicas_fit(time_us, o, r, b, cap, total, E)

    hi = float(np.max(o + r * k_each)) + 1.0
    while not ok(hi):
        hi *= 2.0
        if hi > 1e15:
            return 0.0
    lo = 0.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return lo


def _replicas_fit(
    time_us: float,
    o: np.ndarray,
    r: np.ndarray,
    b: np.ndarray,
    cap: np.ndarray,
    total: float,
    experts: int,
) -> bool:
    """Native form: can the GPUs hold ``experts`` replicas and serve ``total`` pairs by
    ``time_us``? Each GPU reads ``(t - o - b P) / r`` replicas at most; pairs go first to the
    GPUs whose pairs cost the fewest replicas (``b / r``)."""
    usable = time_us >= o + r
    if not np.any(usable):
        return False
    room = np.where(usable, (time_us - o) / np.where(r > 0, r, 1e-30), 0.0)
    cost = np.where(r > 0, b / np.where(r > 0, r, 1.0), 0.0)
    left = total
    used = 0.0
    for i in np.argsort(cost, kind="stable"):
        if not usable[i] or left <= 0:
            continue
        take = min(left, float(cap[i]))
        used += cost[i] * take
        left -= take
    return float(room.sum()) - used >= experts * (1 - 1e-12)

"""Budgets and bounds of the ``ilp`` policy: how much work each part of a solve may do, and
the proven bounds a plan carries (the module docstring of :mod:`policies.solvers.ilp` says
why).

Every limit here is derived from the request alone (time limit, layer count, model size),
never from the clock or the worker count, so the same request gives the same plan on any
machine; the wall-clock deadlines are safety nets whose use the plan's notes report.
Under :func:`policies.solvers.milp.work_only` there are no wall-clock safety nets at all:
the work limits alone end the solve, however slow or busy the machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from policies.estimate.costmodel import CostTable
from policies.estimate.engines import EngineSpec
from policies.estimate.execution import runtime_of
from policies.request import PlacementRequest, RawPlacement
from policies.solvers.common import slot_cap, slots_per_gpu
from policies.solvers.ilp_bound import (
    MAX_BOXES,
    Bound,
    conditional_bound,
    exchange_rule,
    global_bound,
)
from policies.solvers.ilp_layers import LayerSolution
from policies.solvers.milp import work_only

LAYER_FRACTION = 0.8
"""Share of ``time_limit_s`` after which no stage-2 layer starts (wall clock, from the start
of :func:`place`): the rest is left for realising the layers, the safety nets and
assembling the plan."""

MILP_FRACTION = 0.3
"""Share of ``time_limit_s`` the stage-2 layer solves are planned to take on one idle CPU of
the reference machine; how many layers get a MILP of their own and each one's node limit are
derived from it (:func:`work_budget`), so a machine half as fast still finishes them before
``LAYER_FRACTION``."""

FIRST_WEIGHT = 4.0
"""The first layer gets this many times a layer's work: every other layer starts from it."""

BOXES_PER_S = 8.0
"""Branch-and-bound boxes of the global bound per second of ``time_limit_s`` (a work limit,
at most :data:`policies.solvers.ilp_bound.MAX_BOXES`)."""


@dataclass(frozen=True)
class WorkBudget:
    """Deterministic limits of the stage-2 solves, from the request alone, and the wall-clock
    safety nets.

    Attributes:
        layer_work_s: planned work of one layer's solve, reference seconds (its node limit
            follows from it and the model's size: the work limit).
        milp_s: planned stage-2 work, reference seconds (:func:`solve_layers` solves as
            many layers as it pays for, the others take the first layer's answer).
        bound_boxes: boxes of the global bound's branch and bound (its work limit).
        layer_wall_s: wall-clock safety net of one layer's solve, seconds.
        deadline: ``time.monotonic()`` after which no layer starts.
        end: ``time.monotonic()`` by which :func:`place` should have returned.
    """

    layer_work_s: float
    bound_boxes: int
    layer_wall_s: float
    deadline: float
    end: float
    milp_s: float


def work_budget(req: PlacementRequest, table: CostTable, started: float) -> WorkBudget:
    """The stage-2 budget: ``MILP_FRACTION`` of the time limit spread over the layers (the
    first counted ``FIRST_WEIGHT`` times), in reference seconds. It depends on neither the
    worker count nor the machine, so neither changes the plan; the wall-clock limits are
    safety nets that only a machine about twice slower than planned reaches (none at all
    under :func:`work_only`)."""
    limit = req.options.time_limit_s
    per_layer_s = limit * MILP_FRACTION / max(1.0, table.num_moe_layers - 1 + FIRST_WEIGHT)
    boxes = max(8, min(MAX_BOXES, round(BOXES_PER_S * limit)))
    if work_only():
        return WorkBudget(per_layer_s, boxes, math.inf, math.inf, math.inf, limit * MILP_FRACTION)
    return WorkBudget(
        per_layer_s,
        boxes,
        max(2.0, 10 * per_layer_s),
        started + LAYER_FRACTION * limit,
        started + limit,
        limit * MILP_FRACTION,
    )


SWITCH_MARGIN = 0.02
"""The relaxation's optimal attention shares replace stage 1's when their conditional bound
is lower by more than this fraction (the bound is a proxy for what the shares allow)."""


class Bounds:
    """The plan's proven bounds (:mod:`policies.solvers.ilp_bound`), computed before the
    layers: the global one, valid for every placement of the request, and the one
    conditional on given attention shares (kept per share vector). A bound the clock cut
    short is still proven, only weaker."""

    def __init__(self, req: PlacementRequest, table: CostTable, budget: WorkBudget) -> None:
        self.req, self.table, self.budget = req, table, budget
        self.glob = global_bound(req, table, self._left(), budget.bound_boxes)
        self._cond: dict[tuple[float, ...], Bound | None] = {}

    def conditional(self, share: Sequence[float]) -> Bound | None:
        """The bound conditional on the attention shares ``share``."""
        key = tuple(share)
        if key not in self._cond:
            self._cond[key] = conditional_bound(self.req, self.table, share, self._left())
        return self._cond[key]

    def _left(self) -> float:
        return max(0.5, self.budget.end - time.monotonic())

    def better_shares(self, share: Sequence[float]) -> list[float] | None:
        """The shares at the global relaxation's optimum when their conditional bound beats
        that of ``share`` (stage 1's) by more than ``SWITCH_MARGIN`` and their slots fit;
        else None. The stage-1 LP sees dispatch volumes through an estimate of where pairs
        will be served; the relaxation prices them with the serving itself.

        Under a locality rule (SGLang static/dynamic) the request's own relaxation may route
        every token to a replica on its own GPU and prices dispatch far below what the engine
        sends, so the shares are chosen with the proportional relaxation (the idealised
        engine's), which is then only a proxy: the plan is scored under the real rule."""
        if self.req.engine.equal_dp or not self.table.num_moe_layers:
            return None
        req, glob = self.req, self.glob
        proxy = exchange_rule(runtime_of(self.req)) == "any"
        if proxy:
            req = replace(self.req, engine=EngineSpec())
            glob = global_bound(req, self.table, self._left(), self.budget.bound_boxes)

        def conditional(x: Sequence[float]) -> Bound | None:
            if not proxy:
                return self.conditional(x)
            return conditional_bound(req, self.table, x, self._left())

        if glob is None or glob.share is None:
            return None
        t, n = self.table, self.table.num_gpus
        if req.form == "engine":
            slots = slots_per_gpu(t.num_experts, req.redundant_experts, n)
            if any(slot_cap(t, i, glob.share[i]) < slots for i in range(n)):
                return None
        mine, theirs = conditional(share), conditional(glob.share)
        if mine is None or theirs is None:
            return None
        if theirs.value_us < mine.value_us * (1 - SWITCH_MARGIN):
            return list(glob.share)
        return None

    def attach(self, raw: RawPlacement) -> RawPlacement:
        """``raw`` with the bounds that hold for it."""
        cond = self.conditional(raw.attention_share)
        notes = list(raw.notes)
        if self.glob is None:
            notes.append("no global lower bound: its relaxation could not be solved")
        return replace(
            raw,
            lower_bound_us=None if self.glob is None else self.glob.value_us,
            conditional_bound_us=None if cond is None else cond.value_us,
            bound_scope=bound_scope(self.req, self.table),
            notes=tuple(notes),
        )


def slot_reservations(table: CostTable, share: Sequence[float]) -> list[float]:
    """Per GPU the expert slots per layer its memory holds next to attention share ``share``."""
    return [float(slot_cap(table, i, share[i])) for i in range(table.num_gpus)]


def limit_notes(solutions: Sequence[LayerSolution]) -> list[str]:
    """Notes for layers the clock, not the work limit, stopped (their answer depends on the
    machine's speed) and for layers the deadline skipped."""
    out = []
    wall = sum(1 for s in solutions if s.status == "wall_clock")
    skipped = sum(1 for s in solutions if s.status == "skipped")
    if wall:
        out.append(
            f"wall-clock safety net: {wall} layer solve(s) stopped by the clock before their "
            "work limit (their answer depends on the machine's speed)"
        )
    mapped = sum(1 for s in solutions if s.status == "mapped")
    if mapped:
        out.append(
            f"work limit: {mapped} layer(s) took the first layer's answer mapped by load rank "
            "instead of a MILP of their own (raise --time-limit to solve them)"
        )
    if skipped:
        out.append(
            f"time limit: {skipped} layer(s) not solved before the deadline kept the greedy "
            "warm start (the answer depends on the machine's speed)"
        )
    return out


def bound_scope(req: PlacementRequest, table: CostTable) -> str:
    """What the global bound covers, in words."""
    shares = (
        f"equal DP shares ({req.engine.name} balances its DP ranks)"
        if req.engine.equal_dp
        else "any attention shares that fit memory"
    )
    tp = "" if all(k == 1 for k in table.attention_tp) else ", the plan's attention TP sizes"
    return (
        f"every {req.form}-form placement on this fleet: {shares}{tp}, any replicas within "
        "memory and any split of an expert's tokens over its replicas (so any engine's "
        "replica choice)"
    )

"""The planning core's request and reply types: what every policy is asked and answers.

A :class:`PlacementRequest` (fleet, model, workload, slot budget, cost settings) goes in;
a :class:`PlacementResult` comes out, carrying the plan and, when no valid plan exists, the
reasons (which GPU ran out of memory and by how much) - infeasibility is part of the
reply, never an exception. Between the two, a policy answers a :class:`RawPlacement` or an
:class:`Infeasible`. The policy names are registered here once (:data:`PolicyName`,
:data:`POLICIES`).

This module imports no solver: the solvers import it, and :mod:`policies.solve` (the front
door, ``solve(request) -> PlacementResult``) imports both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from policies import defaults
from policies.defaults import POLICIES as POLICIES  # one default per concept
from policies.defaults import PolicyName as PolicyName
from policies.errors import InfeasibleError, InputError
from policies.estimate.costmodel import CostSettings, CostTable
from policies.estimate.engines import EngineSpec
from policies.estimate.evaluation import Evaluation, LayerPlacement
from policies.estimate.workload import Workload
from policies.hardware.fleet import Fleet, check_reachable
from policies.hardware.vendors import check_vendors
from policies.model.architecture import ModelSpec
from policies.plan import FORMS, Plan


@dataclass(frozen=True)
class SolverOptions:
    """Knobs of the MILP solver.

    Attributes:
        time_limit_s: wall-clock limit for the whole solve, seconds.
        mip_gap: relative MIP gap at which a layer's solve stops (0.01 = 1%).
        solver: ``highs`` (default) or ``cbc`` (fallback, also used when HiGHS is missing).
        workers: processes solving layers in parallel; 0 = one per CPU.
        migration_weight_us: objective cost of moving one expert replica, us per move
            (used only with a previous plan); None = 30% of the previous plan's mean time
            per MoE layer divided by its slots per layer: a move must buy back a third of
            what one slot's share of the layer costs.
        screen: a screening estimate (the fleet scheduler's candidates; the solve of the
            chosen instance is not one): SGLang's seeded ``static`` replica choice is taken
            as its expectation, the ``dynamic`` rule
            (:func:`policies.estimate.execution.runtime_of`), instead of replayed draw by draw, whose
            cost grows with the square of the GPUs; and the stages after the policy's own
            placement are skipped (``ilp``: the EPLB plan and a mix with it; ``greedy`` and
            ``ilp`` under a nearest-replica engine: the locality search of
            :func:`policies.solvers.locality.refine`).
    """

    time_limit_s: float = defaults.DEFAULT_SOLVER_TIME_LIMIT_S
    mip_gap: float = defaults.DEFAULT_MIP_GAP
    solver: str = defaults.DEFAULT_MILP_SOLVER
    workers: int = defaults.DEFAULT_WORKERS
    migration_weight_us: float | None = None
    screen: bool = False


@dataclass(frozen=True)
class PlacementRequest:
    """Everything a policy needs.

    Attributes:
        fleet: GPUs and links.
        model: model architecture.
        workload: phase, batch, context and expert load.
        policy: one of :data:`POLICIES` (checked by :func:`check_request`).
        form: ``engine`` (equal slots, equal replica shares) or ``native``.
        redundant_experts: extra expert slots per MoE layer beyond one per expert
            (engine form: ``num_experts + redundant_experts`` must divide by the GPU count).
        options: solver options.
        previous: plan to stay close to (re-planning); None for a fresh plan.
        settings: cost-model settings (efficiencies, measured figures, headroom).
        allow_cross_vendor: let one expert-parallel group span GPU vendors (NVIDIA and AMD
            all-to-all in one group); off by default.
        engine: the engine that will run the plan (:mod:`policies.estimate.engines`); its replica
            choice and DP balancing are what the plan is scored and optimised under.
    """

    fleet: Fleet
    model: ModelSpec
    workload: Workload
    policy: str = "ilp"
    form: str = "engine"
    redundant_experts: int = 32
    options: SolverOptions = field(default_factory=SolverOptions)
    previous: Plan | None = None
    settings: CostSettings = field(default_factory=CostSettings)
    allow_cross_vendor: bool = False
    engine: EngineSpec = field(default_factory=EngineSpec)


@dataclass(frozen=True)
class RawPlacement:
    """What a policy decides, before scoring.

    Attributes:
        attention_share: per GPU, fraction of the step's tokens (sums to 1).
        layers: per MoE layer the placement (per GPU ``(expert, share)`` lists).
        attention_heads: native form: query heads per GPU, or None.
        lower_bound_us: proven lower bound on the step time of every placement of the
            request (``bound_scope`` says which placements), or None.
        solver: solver name and status.
        notes: remarks for the plan.
        conditional_bound_us: proven lower bound on the step time of every placement with
            these attention shares, or None.
        bound_scope: the placements ``lower_bound_us`` covers, in words.
    """

    attention_share: tuple[float, ...]
    layers: tuple[LayerPlacement, ...]
    attention_heads: tuple[int, ...] | None = None
    lower_bound_us: float | None = None
    solver: str = "heuristic"
    notes: tuple[str, ...] = ()
    conditional_bound_us: float | None = None
    bound_scope: str = ""


@dataclass(frozen=True)
class Infeasible:
    """A policy's answer when it cannot place the request at all.

    Attributes:
        message: one line saying what does not fit, ending with what to do ("To fix: ...").
        reasons: one line per culprit (GPU and amounts, or the constraint that failed).
    """

    message: str
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlacementResult:
    """A solve's reply: the plan, and the reasons when no valid plan exists.

    Attributes:
        plan: the plan (also when it violates a constraint; see ``plan.violations``). When
            no policy placement exists (``placed`` False) it is the uniform layout, kept so
            its memory violations show which GPU overflows and by how much.
        evaluation: its cost-model evaluation.
        infeasible: reasons no valid plan exists (empty when ``plan.violations`` is empty).
        placed: False when the policy found no placement at all (``message`` says why).
        message: one-line summary when ``placed`` is False, else empty.
    """

    plan: Plan
    evaluation: Evaluation
    infeasible: tuple[str, ...] = ()
    placed: bool = True
    message: str = ""

    def require_placed(self) -> PlacementResult:
        """This result, for callers at the edge that report "no placement" as an error.

        Raises:
            InfeasibleError: the policy found no placement (``message`` with its reasons).
        """
        if not self.placed:
            raise InfeasibleError(
                self.message, tuple(r for r in self.infeasible if r != self.message)
            )
        return self


PolicyFn = Callable[[PlacementRequest, CostTable], RawPlacement | Infeasible]
"""A policy: the request and its cost table in, a placement or the reasons for none out."""


def check_request(req: PlacementRequest) -> None:
    """Validate the request's options.

    Raises:
        InputError: unknown policy or form, bad slot budget, bad solver options.
    """
    if req.policy not in POLICIES:
        raise InputError(f"unknown policy {req.policy!r}; choose one of {POLICIES}", field="policy")
    if req.form not in FORMS:
        raise InputError(f"unknown form {req.form!r}; choose one of {FORMS}", field="form")
    r = req.redundant_experts
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise InputError(f"must be an integer >= 0, got {r!r}", field="redundant_experts")
    o = req.options
    if not (o.time_limit_s > 0 and math.isfinite(o.time_limit_s)):
        raise InputError(f"must be > 0 seconds, got {o.time_limit_s!r}", field="time_limit")
    if not 0 <= o.mip_gap < 1:
        raise InputError(f"must be in [0, 1), got {o.mip_gap!r}", field="mip_gap")
    if o.solver not in ("highs", "cbc"):
        raise InputError(f"must be 'highs' or 'cbc', got {o.solver!r}", field="solver")
    if o.workers < 0:
        raise InputError(f"must be >= 0, got {o.workers}", field="workers")
    if o.migration_weight_us is not None and not o.migration_weight_us >= 0:
        raise InputError("must be >= 0", field="migration_weight_us")
    g = len(req.fleet.gpus)
    e = req.model.num_experts
    if req.model.is_moe and req.form == "engine" and (e + r) % g != 0:
        lo = (e + r) // g * g - e
        hi = lo + g
        options = [x for x in (lo, hi) if x >= 0]
        raise InputError(
            f"engine form needs num_experts + redundant_experts ({e} + {r}) divisible by the "
            f"{g} GPUs (every rank holds the same number of slots). To fix: use "
            f"--redundant-experts {' or '.join(map(str, options))}, or --form native",
            field="redundant_experts",
        )
    if req.model.is_moe and req.form == "engine" and (e + r) // g > e:
        raise InputError(
            f"engine form would give every GPU {(e + r) // g} slots but {req.model.name} has only "
            f"{e} experts per layer. To fix: use fewer --redundant-experts (at most "
            f"{e * g - e}) or more GPUs",
            field="redundant_experts",
        )
    check_vendors(req.fleet, req.model, allow_cross_vendor=req.allow_cross_vendor)
    check_reachable(req.fleet)
    if req.previous is not None and len(req.previous.moe_layers) != req.model.num_moe_layers:
        raise InputError(
            "previous plan is for a different model (MoE layer count differs)", field="previous"
        )


def migration_weight_us(req: PlacementRequest) -> float:
    """Price of one expert move in the re-planning objective, us (see SolverOptions)."""
    if req.options.migration_weight_us is not None:
        return req.options.migration_weight_us
    if req.previous is None or not req.previous.moe_layers:
        return 0.0
    prev = req.previous
    slots = sum(len(g.experts[0]) for g in prev.gpus) or 1
    return 0.3 * prev.summary.step_time_us / len(prev.moe_layers) / slots


def count_moves(
    previous: Plan | None, gpu_ids: Sequence[str], layers: Sequence[LayerPlacement]
) -> int | None:
    """Replicas placed on a GPU that did not hold that expert in ``previous`` (same layer)."""
    if previous is None:
        return None
    before: dict[str, list[set[int]]] = {
        g.gpu: [{s.expert for s in layer} for layer in g.experts] for g in previous.gpus
    }
    moves = 0
    for li, placement in enumerate(layers):
        for gid, slots in zip(gpu_ids, placement.per_gpu, strict=True):
            held = before.get(gid)
            had = held[li] if held is not None and li < len(held) else set()
            moves += sum(1 for e, _ in slots if e not in had)
    return moves

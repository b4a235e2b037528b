"""MILP front end: HiGHS (highspy) by default, CBC (through PuLP) as fallback.

Two ways in:

* :class:`Model` - a light builder (columns, rows as ``(column, coefficient)`` lists, an
  objective, a partial start) handed to HiGHS as arrays in one call. The stage-2 layer
  problems and the bound relaxations use it: building thousands of rows through PuLP's
  expression objects cost more than solving them.
* :func:`solve_milp` - a PuLP problem (the small stage-1 and stage-3 LPs).

Deterministic settings (:class:`Limits`): every HiGHS solve runs on one thread with a fixed
random seed, and stops on a node limit (a work limit: the same inputs give the same answer on
an idle and on a loaded machine) or at the relative gap. The wall-clock limit is only an outer
safety net; an outcome says when it was hit (``wall_clock``), because then the answer depends
on how fast the machine was.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulp

from policies.errors import SolverError

SEED = 20240611
"""HiGHS ``random_seed`` of every solve (any fixed value; fixed so runs repeat)."""

_NO_LIMIT = 2**31 - 1

WORK_ONLY_ENV = "MIXFLEET_SOLVER_WORK_ONLY"
"""Environment variable: ``1`` drops every wall-clock safety net of the solvers (each
solve's clock limit here; the ``ilp`` policy's layer deadlines,
:func:`policies.solvers.ilp_budget.work_budget`), so that a plan depends on its request
alone even on a machine many times slower than the reference one: the solve takes as long
as its work takes. The test suite sets it (tests assert behaviour, never the clock)."""


def work_only() -> bool:
    """Whether :data:`WORK_ONLY_ENV` asks for work limits alone (no wall-clock limit)."""
    return os.environ.get(WORK_ONLY_ENV, "") == "1"


@dataclass(frozen=True)
class Limits:
    """What stops one solve.

    Attributes:
        max_nodes: branch-and-bound nodes (HiGHS ``mip_max_nodes``): the work limit.
        mip_gap: relative gap at which the solve stops (0.01 = 1%).
        wall_s: wall-clock safety net, seconds (HiGHS ``time_limit``); inf = none.
    """

    max_nodes: int = _NO_LIMIT
    mip_gap: float = 0.0
    wall_s: float = math.inf


@dataclass(frozen=True)
class MilpOutcome:
    """Result of one solve.

    Attributes:
        status: ``optimal`` | ``work_limit`` (node limit) | ``wall_clock`` (safety net) |
            ``infeasible`` | other solver status text.
        objective: objective of the incumbent, or inf when none.
        bound: proven lower bound on the objective (a minimisation), -inf when none.
        solver: ``HiGHS`` or ``CBC``.
        values: :class:`Model` solves: the incumbent's column values (empty when none).
        nodes: branch-and-bound nodes explored (-1 when unknown).
    """

    status: str
    objective: float
    bound: float
    solver: str
    values: tuple[float, ...] = field(default=(), repr=False)
    nodes: int = -1

    @property
    def wall_clock(self) -> bool:
        """True when the wall-clock safety net stopped the solve."""
        return self.status == "wall_clock"


_BANNER_SILENCED = [False]


def _silence_highs_banner() -> None:
    """HiGHS prints a banner to the C-level stdout the first time a solver object is made
    in a process, which would corrupt ``-o json`` output; make that first object with
    file descriptor 1 pointed at /dev/null."""
    if _BANNER_SILENCED[0]:
        return
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        highspy.Highs()  # type: ignore[no-untyped-call]
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
    _BANNER_SILENCED[0] = True


def _highs_options(limits: Limits) -> dict[str, Any]:
    """The deterministic HiGHS options of one solve."""
    opts: dict[str, Any] = {
        "output_flag": False,
        "threads": 1,
        "random_seed": SEED,
        "mip_rel_gap": float(limits.mip_gap),
        "mip_max_nodes": int(min(limits.max_nodes, _NO_LIMIT)),
    }
    if math.isfinite(limits.wall_s) and not work_only():
        opts["time_limit"] = max(0.01, float(limits.wall_s))
    return opts


def _status(text: str) -> str:
    """HiGHS's model status text as an outcome status."""
    s = text.lower()
    if s == "optimal":
        return "optimal"
    if "time" in s:
        return "wall_clock"
    if "node" in s or "leaves" in s or "iteration" in s or "solution limit" in s:
        return "work_limit"
    return s


def highs_available() -> bool:
    """Whether highspy is importable."""
    try:
        import highspy  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the install
        return False
    return True


class Model:
    """A MILP being built: columns by index, rows as sparse lists, a minimisation.

    Rows are ``lo <= sum(coef * x[col]) <= hi``; repeated columns in a row are summed.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.cost: list[float] = []
        self.row_lo: list[float] = []
        self.row_hi: list[float] = []
        self.starts: list[int] = [0]
        self.index: list[int] = []
        self.value: list[float] = []
        self.start: dict[int, float] = {}
        self.offset = 0.0

    @property
    def num_cols(self) -> int:
        return len(self.lower)

    def var(self, lo: float = 0.0, hi: float = math.inf, *, integer: bool = False) -> int:
        """A new column with bounds ``[lo, hi]``; returns its index."""
        self.lower.append(float(lo))
        self.upper.append(float(hi))
        self.integer.append(integer)
        self.cost.append(0.0)
        return len(self.lower) - 1

    def row(self, terms: Iterable[tuple[int, float]], lo: float, hi: float) -> None:
        """Add ``lo <= sum(coef * x[col]) <= hi``."""
        merged: dict[int, float] = {}
        for col, coef in terms:
            merged[col] = merged.get(col, 0.0) + coef
        for col, coef in merged.items():
            if coef != 0.0:
                self.index.append(col)
                self.value.append(coef)
        self.starts.append(len(self.index))
        self.row_lo.append(float(lo))
        self.row_hi.append(float(hi))

    def ge(self, terms: Iterable[tuple[int, float]], rhs: float) -> None:
        """``sum(coef * x) >= rhs``."""
        self.row(terms, rhs, math.inf)

    def le(self, terms: Iterable[tuple[int, float]], rhs: float) -> None:
        """``sum(coef * x) <= rhs``."""
        self.row(terms, -math.inf, rhs)

    def eq(self, terms: Iterable[tuple[int, float]], rhs: float) -> None:
        """``sum(coef * x) == rhs``."""
        self.row(terms, rhs, rhs)

    def minimise(self, terms: Iterable[tuple[int, float]], offset: float = 0.0) -> None:
        """Set the objective ``offset + sum(coef * x)`` (to be minimised)."""
        self.cost = [0.0] * self.num_cols
        for col, coef in terms:
            self.cost[col] += coef
        self.offset = offset

    def set_start(self, col: int, value: float) -> None:
        """Starting value of an integer column (a partial MIP start)."""
        self.start[col] = float(value)

    def within_bounds(self, col: int, value: float) -> bool:
        """Whether ``value`` lies within column ``col``'s bounds."""
        return self.lower[col] - 1e-9 <= value <= self.upper[col] + 1e-9

    def solve(self, *, solver: str, limits: Limits, relax: bool = False) -> MilpOutcome:
        """Solve (its LP relaxation with ``relax``) and report the outcome.

        Raises:
            SolverError: the solver could not run.
        """
        if solver == "highs" and highs_available():
            return self._solve_highs(limits, relax)
        return self._solve_cbc(limits, relax)

    def _solve_highs(self, limits: Limits, relax: bool, *, use_start: bool = True) -> MilpOutcome:
        import highspy
        import numpy as np

        _silence_highs_banner()
        h = highspy.Highs()  # type: ignore[no-untyped-call]
        for key, val in _highs_options(limits).items():
            h.setOptionValue(key, val)
        lp = highspy.HighsLp()
        n = self.num_cols
        lp.num_col_, lp.num_row_ = n, len(self.row_lo)
        inf = highspy.kHighsInf
        lp.col_cost_ = np.array(self.cost, dtype=np.float64)
        lp.col_lower_ = np.array([max(-inf, x) for x in self.lower], dtype=np.float64)
        lp.col_upper_ = np.array([min(inf, x) for x in self.upper], dtype=np.float64)
        lp.row_lower_ = np.array([max(-inf, x) for x in self.row_lo], dtype=np.float64)
        lp.row_upper_ = np.array([min(inf, x) for x in self.row_hi], dtype=np.float64)
        lp.offset_ = self.offset
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.array(self.starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(self.index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(self.value, dtype=np.float64)
        mip = not relax and any(self.integer)
        if mip:
            kind = [highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous]
            lp.integrality_ = [kind[0] if x else kind[1] for x in self.integer]
        h.passModel(lp)
        started = mip and bool(self.start) and use_start
        if started:
            idx = np.array(list(self.start), dtype=np.int32)
            h.setSolution(len(idx), idx, np.array(list(self.start.values()), dtype=np.float64))
        h.run()
        status = _status(h.modelStatusToString(h.getModelStatus()))
        info = h.getInfo()
        has_solution = int(info.primal_solution_status) >= 2  # kSolutionStatusFeasible
        values = tuple(h.getSolution().col_value) if has_solution else ()
        objective = float(info.objective_function_value) if has_solution else math.inf
        if mip:
            bound = float(info.mip_dual_bound)
            nodes = int(info.mip_node_count)
        else:  # an LP solved to optimality proves its objective
            bound, nodes = (objective if status == "optimal" else -math.inf), 0
        if status == "optimal" and not math.isfinite(bound):
            bound = objective
        if started and values and not self._objective_matches(values, objective):
            # HiGHS 1.16 can report the optimum's objective with the MIP start as its column
            # values (seen on the fleet planner's cost program: objective 77.6, values of the
            # 101.52 start). Values that do not give the reported objective are not trusted:
            # solve again without the start.
            return self._solve_highs(limits, relax, use_start=False)
        return MilpOutcome(status, objective, bound, "HiGHS", values, nodes)

    def _objective_matches(self, values: Sequence[float], objective: float) -> bool:
        """Whether ``values`` give ``objective`` (relative 1e-6)."""
        got = self.offset + sum(c * v for c, v in zip(self.cost, values, strict=True))
        return abs(got - objective) <= 1e-6 * max(1.0, abs(objective))

    def _solve_cbc(self, limits: Limits, relax: bool) -> MilpOutcome:
        prob = pulp.LpProblem(self.name, pulp.LpMinimize)
        xs = [
            pulp.LpVariable(
                f"x{j}",
                None if math.isinf(lo) else lo,
                None if math.isinf(hi) else hi,
                cat="Integer" if integer and not relax else "Continuous",
            )
            for j, (lo, hi, integer) in enumerate(
                zip(self.lower, self.upper, self.integer, strict=True)
            )
        ]
        prob += pulp.lpSum(c * xs[j] for j, c in enumerate(self.cost) if c) + self.offset
        for r, (lo, hi) in enumerate(zip(self.row_lo, self.row_hi, strict=True)):
            s, e = self.starts[r], self.starts[r + 1]
            expr = pulp.lpSum(self.value[k] * xs[self.index[k]] for k in range(s, e))
            if lo == hi:
                prob += expr == lo
                continue
            if math.isfinite(lo):
                prob += expr >= lo
            if math.isfinite(hi):
                prob += expr <= hi
        for col, val in self.start.items():
            xs[col].setInitialValue(val)
        out = _cbc(prob, limits, relax, warm=bool(self.start))
        values = tuple(float(x.varValue or 0.0) for x in xs) if math.isfinite(out.objective) else ()
        return MilpOutcome(out.status, out.objective, out.bound, "CBC", values)


def _cbc(prob: pulp.LpProblem, limits: Limits, relax: bool, warm: bool) -> MilpOutcome:
    """Solve a PuLP problem with CBC (one thread, fixed seed, its node limit)."""
    options = [f"randomSeed {SEED % 2**31}", f"randomCbcSeed {SEED % 2**31}"]
    if limits.max_nodes < _NO_LIMIT:
        options.append(f"maxNodes {limits.max_nodes}")
    try:
        cbc = pulp.PULP_CBC_CMD(
            mip=not relax,
            msg=False,
            timeLimit=None if math.isinf(limits.wall_s) or work_only() else max(1.0, limits.wall_s),
            gapRel=limits.mip_gap,
            warmStart=warm,
            threads=1,
            options=options,
        )
        prob.solve(cbc)
    except pulp.PulpSolverError as exc:  # pragma: no cover - depends on the install
        raise SolverError(f"CBC failed: {exc}") from exc
    status = pulp.LpStatus[prob.status].lower()
    obj = pulp.value(prob.objective)
    objective = float(obj) if obj is not None else math.inf
    # CBC through PuLP does not report its bound; only an optimal status proves one.
    bound = objective if status == "optimal" else -math.inf
    return MilpOutcome(status, objective, bound, "CBC")


class _WarmHiGHS(pulp.HiGHS):  # type: ignore[misc]
    """PuLP's HiGHS adapter with a warm start, the proven bound read back and the deterministic
    options of :func:`_highs_options`."""

    def __init__(self, limits: Limits, **kwargs: Any) -> None:
        super().__init__(msg=False, **kwargs, **_highs_options(limits))
        self.dual_bound = -math.inf
        self.model_status = ""

    def callSolver(self, lp: Any) -> None:  # noqa: N802 - PuLP's name
        model = lp.solverModel
        given = [
            (i, float(v.varValue)) for i, v in enumerate(lp.variables()) if v.varValue is not None
        ]
        if given:
            import numpy as np

            idx = np.array([i for i, _ in given], dtype=np.int32)
            val = np.array([x for _, x in given], dtype=np.float64)
            model.setSolution(len(given), idx, val)
        model.run()
        info = model.getInfo()
        self.model_status = model.modelStatusToString(model.getModelStatus())
        self.dual_bound = float(info.mip_dual_bound)


def solve_milp(
    prob: pulp.LpProblem,
    *,
    solver: str,
    limits: Limits | None = None,
    time_limit_s: float = math.inf,
    mip_gap: float = 0.0,
    warm: bool = False,
    relax: bool = False,
) -> MilpOutcome:
    """Solve the PuLP problem ``prob`` (a minimisation) and report status, objective and
    bound; with ``relax`` its LP relaxation (integrality dropped), whose optimum bounds the
    MILP. The variables hold the answer afterwards. Without ``limits``, ``time_limit_s`` (the
    wall-clock safety net) and ``mip_gap`` make them.

    Raises:
        SolverError: the solver could not run.
    """
    if limits is None:
        limits = Limits(mip_gap=mip_gap, wall_s=time_limit_s)
    if not (solver == "highs" and highs_available()):
        return _cbc(prob, limits, relax, warm)
    _silence_highs_banner()
    s = _WarmHiGHS(limits, mip=not relax)
    prob.solve(s)
    status = _status(s.model_status)
    obj = pulp.value(prob.objective)
    objective = float(obj) if obj is not None else math.inf
    bound = s.dual_bound
    if status == "optimal" and not math.isfinite(bound):
        bound = objective
    if not math.isfinite(bound):  # pure LP: the dual bound is the objective
        bound = objective if status == "optimal" else -math.inf
    return MilpOutcome(status, objective, bound, "HiGHS")
